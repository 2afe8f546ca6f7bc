//! The planner's command-line faces: clap argument structs and `run_*` functions for
//! `teraio plan`, `teraio sim` and `teraio trace`, with their tables and SVG plots. The planning
//! itself is the planner crate's (`plan_and_predict`, `compare`, `generate`); `teraio plan
//! --json` prints the `PlanAndPrediction` that Python's `teraio.plan` returns too.

mod plot;
#[cfg(test)]
mod tests;

use std::path::{Path, PathBuf};
use std::str::FromStr;

use clap::builder::{PossibleValuesParser, TypedValueParser};
use clap::Args;
use serde::Serialize;

use teraio_planner::greedy::{PlannerConfig, TierPreference};
use teraio_planner::hardware::{gpu_preset, Hardware};
use teraio_planner::plan::{ActionKind, Plan, Tier};
use teraio_planner::predict::{plan_and_predict, PlanAndPrediction, PlanOptions};
use teraio_planner::report::{compare, Comparison, PolicyName, PolicyRow, ALL_POLICIES};
use teraio_planner::sim::{simulate, Outcome, Policy, SimConfig};
use teraio_planner::synth::{generate, model_preset, Dtype};
use teraio_planner::trace::Trace;
use teraio_units::ReadWriteBandwidth;

use crate::error::{CliError, CliResult};
use crate::units::{bandwidth_arg, format_duration_us, format_gib, memory_size_arg, ssd_arg};
use plot::{plot_memory, unplanned_series, PlotFormat, Series};

/// A clap parser for one of the planner's named values (`names`), listed in `--help`.
fn named<T>(names: impl IntoIterator<Item = &'static str>) -> impl TypedValueParser<Value = T>
where
    T: FromStr<Err = teraio_planner::Error> + Clone + Send + Sync + 'static,
{
    PossibleValuesParser::new(names).try_map(|name| name.parse::<T>())
}

/// Migration hardware of one GPU.
#[derive(Args, Debug, Clone)]
pub struct HardwareArgs {
    /// GPU memory capacity, e.g. 40GiB or 94GB [default: the trace's].
    #[arg(long, value_parser = memory_size_arg)]
    pub gpu_mem: Option<u64>,
    /// SSD array: NxBW (same read and write) or NxREAD/WRITE, e.g. 4x6.5GB/s or 4x6.7/6.5GB/s.
    #[arg(long, value_parser = ssd_arg, default_value = "4x6.5GB/s")]
    pub ssd: ReadWriteBandwidth,
    /// Host memory the plan may use (0 = SSD only).
    #[arg(long, value_parser = memory_size_arg, default_value = "0")]
    pub host_mem: u64,
    /// Host link bandwidth per direction left for offloading.
    #[arg(long, value_parser = bandwidth_arg, default_value = "25GB/s")]
    pub host_link: f64,
    /// Fixed cost of one SSD transfer, microseconds.
    #[arg(long, default_value_t = 20.0)]
    pub ssd_latency_us: f64,
    /// Fixed cost of one host transfer, microseconds.
    #[arg(long, default_value_t = 10.0)]
    pub host_latency_us: f64,
    /// SSD reads and writes share the drives' time (e.g. one disk); `--ssd` then gives each
    /// direction's bandwidth when it runs alone.
    #[arg(long)]
    pub ssd_shared: bool,
    /// SSD transfers also cross the host link (staged in pinned host memory, or GPUDirect
    /// Storage on the GPU's one PCIe link): SSD bytes take host-link bytes too.
    #[arg(long)]
    pub ssd_via_host_link: bool,
}

impl HardwareArgs {
    /// The hardware, with the trace's GPU capacity unless overridden.
    pub fn hardware(&self, trace: &Trace) -> CliResult<Hardware> {
        let mut hardware = Hardware::new(self.gpu_mem.unwrap_or(trace.gpu_capacity_bytes), self.ssd, self.host_mem);
        hardware.host_link_bytes_per_s = self.host_link;
        hardware.ssd_latency_us = self.ssd_latency_us;
        hardware.host_latency_us = self.host_latency_us;
        hardware.ssd_shared = self.ssd_shared;
        hardware.ssd_via_host_link = self.ssd_via_host_link;
        hardware.validate()?;
        Ok(hardware)
    }
}

/// Planner knobs.
#[derive(Args, Debug, Clone)]
pub struct PlannerArgs {
    /// Run the paper's algorithm as published (write every offload, latest-feasible prefetch).
    #[arg(long)]
    pub paper: bool,
    /// Issue prefetches earlier by up to this multiple of their transfer time where memory has
    /// room (ignored with --paper).
    #[arg(long, default_value_t = 1.0)]
    pub prefetch_slack: f64,
    /// Do not repair with stalling transfers when bandwidth-feasible migrations cannot make the
    /// iteration fit (the plan then may not fit).
    #[arg(long)]
    pub no_stall_repair: bool,
    /// GPU memory to keep free (allocator slack), e.g. 2GiB.
    #[arg(long, value_parser = memory_size_arg, default_value = "0")]
    pub reserve: u64,
    /// The tier a period goes to when both can take it: ssd (the paper), host, or auto (plan
    /// both ways, keep the faster by the simulator).
    #[arg(long, value_parser = named::<TierPreference>(TierPreference::NAMES), default_value = "ssd")]
    pub tier_preference: TierPreference,
}

impl PlannerArgs {
    /// The planner configuration.
    pub fn config(&self) -> PlannerConfig {
        let config = PlannerConfig {
            reserve_bytes: self.reserve,
            prefetch_slack: self.prefetch_slack,
            allow_stalls: !self.no_stall_repair,
            tier_preference: self.tier_preference,
            ..PlannerConfig::default()
        };
        if self.paper {
            config.paper()
        } else {
            config
        }
    }
}

/// `teraio plan TRACE`: plan migrations for a trace and predict the iteration.
#[derive(Args, Debug, Clone)]
pub struct PlanArgs {
    /// Trace file (JSON, docs/trace.md).
    pub trace: PathBuf,
    #[command(flatten)]
    pub hardware: HardwareArgs,
    #[command(flatten)]
    pub planner: PlannerArgs,
    /// Write the plan (JSON) here.
    #[arg(short, long)]
    pub output: Option<PathBuf>,
    /// Write an SVG of GPU memory over time, before and after the plan.
    #[arg(long)]
    pub svg: Option<PathBuf>,
    /// Write the same plot as a PNG (1000x560 pixels).
    #[arg(long)]
    pub png: Option<PathBuf>,
    /// Let the plot's y axis reach the peak without offload too (SVG and PNG) [default: the plan
    /// and the GPU capacity].
    #[arg(long)]
    pub svg_full_y: bool,
    /// Actions to list in the table.
    #[arg(long, default_value_t = 20)]
    pub show_actions: usize,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// `teraio sim TRACE`: replay a trace under each policy and compare.
#[derive(Args, Debug, Clone)]
pub struct SimArgs {
    /// Trace file (JSON, docs/trace.md).
    pub trace: PathBuf,
    #[command(flatten)]
    pub hardware: HardwareArgs,
    #[command(flatten)]
    pub planner: PlannerArgs,
    /// Policies to run, comma-separated [default: all].
    #[arg(long, value_parser = named::<PolicyName>(ALL_POLICIES.map(PolicyName::label)), value_delimiter = ',')]
    pub policies: Vec<PolicyName>,
    /// Also replay this saved plan (from `teraio plan -o`).
    #[arg(long)]
    pub plan: Option<PathBuf>,
    /// Write an SVG of GPU memory over time for every policy.
    #[arg(long)]
    pub svg: Option<PathBuf>,
    /// Write the same plot as a PNG (1000x560 pixels).
    #[arg(long)]
    pub png: Option<PathBuf>,
    /// Let the plot's y axis reach the peak without offload too (SVG and PNG) [default: the
    /// policies' lines and the GPU capacity].
    #[arg(long)]
    pub svg_full_y: bool,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// `teraio trace`: generate a synthetic Llama-shaped training trace.
#[derive(Args, Debug, Clone)]
pub struct TraceArgs {
    /// Model preset: llama3-8b, llama3-70b or tiny.
    #[arg(long, default_value = "tiny")]
    pub model: String,
    /// GPU preset for op times and capacity: h100, h100-nvl, h100-pcie, a100.
    #[arg(long, default_value = "h100")]
    pub gpu: String,
    /// Override: transformer layers.
    #[arg(long)]
    pub layers: Option<u32>,
    /// Override: hidden size.
    #[arg(long)]
    pub hidden: Option<u64>,
    /// Override: attention heads.
    #[arg(long)]
    pub heads: Option<u64>,
    /// Override: key/value heads.
    #[arg(long)]
    pub kv_heads: Option<u64>,
    /// Override: feed-forward size.
    #[arg(long)]
    pub ffn: Option<u64>,
    /// Override: vocabulary size.
    #[arg(long)]
    pub vocab: Option<u64>,
    /// Override: sequence length.
    #[arg(long)]
    pub seq: Option<u64>,
    /// Override: sequences per iteration.
    #[arg(long)]
    pub batch: Option<u64>,
    /// Override: numeric format.
    #[arg(long, value_parser = named::<Dtype>(Dtype::NAMES))]
    pub dtype: Option<Dtype>,
    /// Pipeline stages (the trace is the last stage's).
    #[arg(long)]
    pub stages: Option<u32>,
    /// Let fp32 matmuls use TF32 tensor cores.
    #[arg(long)]
    pub tf32: bool,
    /// Override: GPU memory capacity recorded in the trace.
    #[arg(long, value_parser = memory_size_arg)]
    pub gpu_mem: Option<u64>,
    /// Output file.
    #[arg(short, long)]
    pub output: PathBuf,
    /// Print the summary as JSON.
    #[arg(long)]
    pub json: bool,
}

fn to_json<T: Serialize>(value: &T) -> CliResult<String> {
    serde_json::to_string_pretty(value).map_err(|e| CliError::failed(format!("cannot write JSON: {e}")))
}

/// Summary of a generated trace.
#[derive(Debug, Serialize)]
pub struct TraceSummary {
    /// Where it was written.
    pub path: PathBuf,
    /// Description.
    pub description: String,
    /// Ops.
    pub ops: usize,
    /// Tensors.
    pub tensors: usize,
    /// Iteration time with unlimited memory.
    pub compute_time_us: f64,
    /// Peak memory with nothing offloaded.
    pub peak_bytes_without_offload: u64,
    /// GPU capacity recorded.
    pub gpu_capacity_bytes: u64,
}

/// Generates a trace and returns the text to print.
pub fn trace_command(args: &TraceArgs) -> CliResult<String> {
    let mut model = model_preset(&args.model)?;
    let gpu = gpu_preset(&args.gpu)?;
    model.layers = args.layers.unwrap_or(model.layers);
    model.hidden = args.hidden.unwrap_or(model.hidden);
    model.heads = args.heads.unwrap_or(model.heads);
    model.kv_heads = args.kv_heads.unwrap_or(model.kv_heads);
    model.ffn_hidden = args.ffn.unwrap_or(model.ffn_hidden);
    model.vocab = args.vocab.unwrap_or(model.vocab);
    model.sequence = args.seq.unwrap_or(model.sequence);
    model.batch = args.batch.unwrap_or(model.batch);
    model.dtype = args.dtype.unwrap_or(model.dtype);
    model.pipeline_stages = args.stages.unwrap_or(model.pipeline_stages);
    model.allow_tf32 = args.tf32;
    let mut trace = generate(&model, &gpu)?;
    if let Some(capacity) = args.gpu_mem {
        trace.gpu_capacity_bytes = capacity;
    }
    trace.save(&args.output)?;
    let summary = TraceSummary {
        path: args.output.clone(),
        description: trace.description.clone(),
        ops: trace.ops.len(),
        tensors: trace.tensors.len(),
        compute_time_us: trace.compute_time_us(),
        peak_bytes_without_offload: teraio_planner::lifetime::base_pressure_bytes(&trace)
            .into_iter()
            .max()
            .unwrap_or(0),
        gpu_capacity_bytes: trace.gpu_capacity_bytes,
    };
    if args.json {
        return to_json(&summary);
    }
    Ok(format!(
        "wrote {}\n{}\nops: {}  tensors: {}\nideal iteration: {}\npeak memory without offload: {} (GPU {})\n",
        summary.path.display(),
        summary.description,
        summary.ops,
        summary.tensors,
        format_duration_us(summary.compute_time_us),
        format_gib(summary.peak_bytes_without_offload as f64),
        format_gib(summary.gpu_capacity_bytes as f64),
    ))
}

/// The plot files a command was asked for (`--svg`, `--png`, `--svg-full-y`).
struct Plots<'a> {
    svg: Option<&'a Path>,
    png: Option<&'a Path>,
    full_y: bool,
}

impl Plots<'_> {
    /// Draws the same chart, memory with nothing moved and then `lines`, into each file asked for.
    fn write(&self, trace: &Trace, capacity_bytes: u64, lines: &[Series]) -> CliResult<()> {
        let unplanned = unplanned_series(trace);
        for (path, format) in [(self.svg, PlotFormat::Svg), (self.png, PlotFormat::Png)] {
            if let Some(path) = path {
                plot_memory(path, format, &trace.description, capacity_bytes, &unplanned, lines, self.full_y)?;
            }
        }
        Ok(())
    }
}

/// `teraio trace`.
pub fn run_trace(args: &TraceArgs) -> CliResult<()> {
    print!("{}", trace_command(args)?);
    Ok(())
}

/// Plans and predicts (`plan_and_predict`), writes the requested files, and returns the text
/// to print: the `PlanAndPrediction` JSON with `--json`, else a table.
pub fn plan_command(args: &PlanArgs) -> CliResult<String> {
    let trace = Trace::load(&args.trace)?;
    let hardware = args.hardware.hardware(&trace)?;
    let options = PlanOptions { planner: args.planner.config(), movable_kinds: None };
    let result = plan_and_predict(&trace, &hardware, &options)?;
    if let Some(path) = &args.output {
        result.plan.save(path)?;
    }
    if args.svg.is_some() || args.png.is_some() {
        let after =
            (format!("{} (simulated)", result.plan.policy), result.prediction.simulated.memory_timeline.clone());
        let plots = Plots { svg: args.svg.as_deref(), png: args.png.as_deref(), full_y: args.svg_full_y };
        plots.write(&trace, hardware.gpu_capacity_bytes, &[after])?;
    }
    if args.json {
        return to_json(&result);
    }
    Ok(format_plan(&result, &trace, args.show_actions))
}

fn format_plan(result: &PlanAndPrediction, trace: &Trace, show_actions: usize) -> String {
    let (plan, p) = (&result.plan, &result.prediction);
    let simulated = &p.simulated;
    let traffic = plan.bytes_moved(trace);
    let mut out = format!(
        "trace: {}\n\
         planning: {:.1} ms, {} candidates, {} evaluations\n\
         migrations: {} (SSD {}, host {}, clean drops {}, urgent actions {}, stall repairs {})\n\
         traffic per iteration: SSD write {:.1} GB, read {:.1} GB; host write {:.1} GB, read {:.1} GB\n\
         memory: {} without offload, {} planned peak, GPU {}: {}\n\
         predicted iteration: {} (ideal {}, {:.1}% of ideal), stalls {} in {} ops, peak {}, outcome {}\n",
        p.trace,
        p.planning_time_ms,
        p.candidates,
        p.evaluations,
        p.migrations,
        p.ssd_migrations,
        p.host_migrations,
        p.clean_drops,
        p.urgent_actions,
        p.stall_repairs,
        traffic.written_bytes[0] as f64 / 1e9,
        traffic.read_bytes[0] as f64 / 1e9,
        traffic.written_bytes[1] as f64 / 1e9,
        traffic.read_bytes[1] as f64 / 1e9,
        format_gib(p.unplanned_peak_bytes as f64),
        format_gib(p.planned_peak_bytes as f64),
        format_gib(p.hardware.gpu_capacity_bytes as f64),
        if p.fits { "fits" } else { "does not fit" },
        format_duration_us(simulated.iteration_time_us),
        format_duration_us(p.ideal_time_us),
        p.percent_of_ideal,
        format_duration_us(simulated.stall_time_us),
        simulated.stalled_ops,
        format_gib(simulated.peak_gpu_bytes as f64),
        outcome_text(&simulated.outcome),
    );
    if show_actions > 0 && !plan.actions.is_empty() {
        out.push_str(&format!(
            "\n{:>7}  {:<8} {:<5} {:>10}  {:<6} {}\n",
            "op", "action", "tier", "size MB", "urgent", "tensor"
        ));
        for action in plan.actions.iter().take(show_actions) {
            let tensor = trace.tensors.iter().find(|t| t.id == action.tensor_id);
            let (name, size) = tensor.map_or(("?", 0), |t| (t.name.as_str(), t.size_bytes));
            let kind = match action.kind {
                ActionKind::Offload => "offload",
                ActionKind::Drop => "drop",
                ActionKind::Prefetch => "prefetch",
            };
            let tier = match action.tier {
                Tier::Ssd => "ssd",
                Tier::Host => "host",
            };
            out.push_str(&format!(
                "{:>7}  {:<8} {:<5} {:>10.1}  {:<6} {} (id {})\n",
                action.op,
                kind,
                tier,
                size as f64 / 1e6,
                if action.urgent { "yes" } else { "" },
                name,
                action.tensor_id
            ));
        }
        if plan.actions.len() > show_actions {
            out.push_str(&format!("... {} more (use -o to save the whole plan)\n", plan.actions.len() - show_actions));
        }
    }
    out
}

/// `teraio plan`.
pub fn run_plan(args: &PlanArgs) -> CliResult<()> {
    print!("{}", plan_command(args)?);
    Ok(())
}

/// Runs the comparison and returns it with the text to print.
pub fn sim_command(args: &SimArgs) -> CliResult<(Comparison, String)> {
    let trace = Trace::load(&args.trace)?;
    let hardware = args.hardware.hardware(&trace)?;
    let policies: Vec<PolicyName> =
        if args.policies.is_empty() { ALL_POLICIES.to_vec() } else { args.policies.clone() };
    let mut comparison = compare(&trace, &hardware, args.planner.config(), &policies)?;
    if let Some(path) = &args.plan {
        let plan = Plan::load(path)?;
        let mut sim = simulate(&trace, &hardware, Policy::Planned(&plan), SimConfig::default())?;
        sim.policy = format!("plan:{}", plan.policy);
        comparison.rows.push(PolicyRow {
            policy: sim.policy.clone(),
            planning_time_ms: 0.0,
            migrations: plan.migrations.len(),
            plan_fits: plan.fits,
            percent_of_ideal: sim.percent_of(comparison.ideal_time_us),
            sim,
        });
    }
    if args.svg.is_some() || args.png.is_some() {
        let mut series = Vec::new();
        for row in &comparison.rows {
            if row.policy != "ideal" && !row.sim.memory_timeline.is_empty() {
                series.push((row.policy.clone(), row.sim.memory_timeline.clone()));
            }
        }
        let plots = Plots { svg: args.svg.as_deref(), png: args.png.as_deref(), full_y: args.svg_full_y };
        plots.write(&trace, hardware.gpu_capacity_bytes, &series)?;
    }
    let text = if args.json { to_json(&comparison)? } else { format_table(&comparison) };
    Ok((comparison, text))
}

/// `teraio sim`.
pub fn run_sim(args: &SimArgs) -> CliResult<()> {
    print!("{}", sim_command(args)?.1);
    Ok(())
}

fn outcome_text(outcome: &Outcome) -> String {
    match outcome {
        Outcome::Completed => "ok".into(),
        Outcome::OutOfMemory { op, needed_bytes } => {
            format!("OOM at op {op} ({})", format_gib(*needed_bytes as f64))
        }
    }
}

/// Readable table of a comparison.
fn format_table(comparison: &Comparison) -> String {
    let mut out = String::new();
    out.push_str(&format!("trace: {}\n", comparison.trace));
    let hw = &comparison.hardware;
    out.push_str(&format!(
        "hardware: GPU {}, SSD read {:.1} GB/s write {:.1} GB/s, host {} at {:.1} GB/s\n",
        format_gib(hw.gpu_capacity_bytes as f64),
        hw.ssd_read_bytes_per_s / 1e9,
        hw.ssd_write_bytes_per_s / 1e9,
        format_gib(hw.host_capacity_bytes as f64),
        hw.host_link_bytes_per_s / 1e9,
    ));
    out.push_str(&format!("ideal iteration: {}\n\n", format_duration_us(comparison.ideal_time_us)));
    out.push_str(&format!(
        "{:<14} {:>8} {:>10} {:>10} {:>10} {:>10} {:>8} {:>8} {:>8} {:>8} {:>8}  {}\n",
        "policy",
        "% ideal",
        "iteration",
        "stalls",
        "peak GPU",
        "peak host",
        "SSD w",
        "SSD r",
        "host w",
        "host r",
        "plan ms",
        "outcome"
    ));
    for row in &comparison.rows {
        let sim = &row.sim;
        out.push_str(&format!(
            "{:<14} {:>7.1}% {:>10} {:>10} {:>10} {:>10} {:>8.1} {:>8.1} {:>8.1} {:>8.1} {:>8.1}  {}\n",
            row.policy,
            row.percent_of_ideal,
            format_duration_us(sim.iteration_time_us),
            format_duration_us(sim.stall_time_us),
            format_gib(sim.peak_gpu_bytes as f64),
            format_gib(sim.peak_host_bytes as f64),
            sim.ssd_written_bytes as f64 / 1e9,
            sim.ssd_read_bytes as f64 / 1e9,
            sim.host_written_bytes as f64 / 1e9,
            sim.host_read_bytes as f64 / 1e9,
            row.planning_time_ms,
            outcome_text(&sim.outcome),
        ));
    }
    out
}
