//! Command-line faces of the planner: clap argument structs and `run_*` functions for
//! `teraio plan`, `teraio sim` and `teraio trace`. The `teraio` binary (the cli crate) flattens
//! these structs into its sub-commands; each `run_*` prints a table, or JSON with `--json`.

use std::path::PathBuf;
use std::time::Instant;

use clap::Args;
use serde::Serialize;

use crate::error::{Error, Result};
use crate::greedy::{plan_teraio, PlannerConfig, TierPreference};
use crate::hardware::{gpu_preset, Hardware};
use crate::plan::{ActionKind, Plan, Tier};
use crate::plot::plot_memory;
use crate::report::{compare, format_table, unplanned_series, Comparison, PolicyName, ALL_POLICIES};
use crate::sim::{simulate, Policy, SimConfig, SimReport};
use crate::synth::{generate, model_preset, Dtype};
use crate::trace::Trace;
use crate::units::{
    format_duration_us, format_gib, parse_bandwidth_bytes_per_s, parse_size_bytes, parse_ssd_bandwidth,
    ReadWriteBandwidth,
};

fn size_arg(text: &str) -> std::result::Result<u64, String> {
    parse_size_bytes(text).map_err(|e| e.to_string())
}

fn bandwidth_arg(text: &str) -> std::result::Result<f64, String> {
    parse_bandwidth_bytes_per_s(text).map_err(|e| e.to_string())
}

fn ssd_arg(text: &str) -> std::result::Result<ReadWriteBandwidth, String> {
    parse_ssd_bandwidth(text).map_err(|e| e.to_string())
}

/// Migration hardware of one GPU.
#[derive(Args, Debug, Clone)]
pub struct HardwareArgs {
    /// GPU memory capacity, e.g. 40GiB or 94GB [default: the trace's].
    #[arg(long, value_parser = size_arg)]
    pub gpu_mem: Option<u64>,
    /// SSD array: NxBW (same read and write) or NxREAD/WRITE, e.g. 4x6.5GB/s or 4x6.7/6.5GB/s.
    #[arg(long, value_parser = ssd_arg, default_value = "4x6.5GB/s")]
    pub ssd: ReadWriteBandwidth,
    /// Host memory the plan may use (0 = SSD only).
    #[arg(long, value_parser = size_arg, default_value = "0")]
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
    pub fn hardware(&self, trace: &Trace) -> Result<Hardware> {
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
    #[arg(long, value_parser = size_arg, default_value = "0")]
    pub reserve: u64,
    /// The tier a period goes to when both can take it: ssd (the paper), host, or auto (plan
    /// both ways, keep the faster by the simulator).
    #[arg(long, value_enum, default_value_t = TierPreference::Ssd)]
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
    #[arg(long, value_enum, value_delimiter = ',')]
    pub policies: Vec<PolicyName>,
    /// Also replay this saved plan (from `teraio plan -o`).
    #[arg(long)]
    pub plan: Option<PathBuf>,
    /// Write an SVG of GPU memory over time for every policy.
    #[arg(long)]
    pub svg: Option<PathBuf>,
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
    #[arg(long, value_enum)]
    pub dtype: Option<Dtype>,
    /// Pipeline stages (the trace is the last stage's).
    #[arg(long)]
    pub stages: Option<u32>,
    /// Let fp32 matmuls use TF32 tensor cores.
    #[arg(long)]
    pub tf32: bool,
    /// Override: GPU memory capacity recorded in the trace.
    #[arg(long, value_parser = size_arg)]
    pub gpu_mem: Option<u64>,
    /// Output file.
    #[arg(short, long)]
    pub output: PathBuf,
    /// Print the summary as JSON.
    #[arg(long)]
    pub json: bool,
}

fn to_json<T: Serialize>(value: &T) -> Result<String> {
    serde_json::to_string_pretty(value).map_err(|source| Error::Json { path: PathBuf::from("<stdout>"), source })
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
pub fn trace_command(args: &TraceArgs) -> Result<String> {
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
        peak_bytes_without_offload: crate::lifetime::base_pressure_bytes(&trace).into_iter().max().unwrap_or(0),
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

/// `teraio trace`.
pub fn run_trace(args: &TraceArgs) -> Result<()> {
    print!("{}", trace_command(args)?);
    Ok(())
}

/// What `plan` reports.
#[derive(Debug, Serialize)]
pub struct PlanSummary {
    /// Trace description.
    pub trace: String,
    /// Hardware planned for.
    pub hardware: Hardware,
    /// Planning time.
    pub planning_time_ms: f64,
    /// Candidate (tensor, period) pairs.
    pub candidates: usize,
    /// Candidate evaluations (lazy greedy).
    pub evaluations: usize,
    /// Migrations planned.
    pub migrations: usize,
    /// Migrations to the SSD.
    pub ssd_migrations: usize,
    /// Migrations to host memory.
    pub host_migrations: usize,
    /// Offloads that drop a clean SSD copy instead of writing.
    pub clean_drops: usize,
    /// Urgent actions.
    pub urgent_actions: usize,
    /// Changes made by the stall repair (0 when bandwidth-feasible migrations were enough).
    pub stall_repairs: usize,
    /// GPU waiting time the planner expects from stalling transfers.
    pub expected_stall_us: f64,
    /// Peak memory with nothing moved.
    pub unplanned_peak_bytes: u64,
    /// Peak memory the planner predicts (stall-free timing).
    pub predicted_peak_bytes: u64,
    /// The planner predicts every op fits.
    pub fits: bool,
    /// Iteration time with unlimited memory.
    pub ideal_time_us: f64,
    /// Simulated replay of the plan.
    pub predicted: SimReport,
    /// Predicted throughput relative to ideal, percent.
    pub percent_of_ideal: f64,
}

/// Plans, simulates the plan, writes the requested files, and returns the text to print.
pub fn plan_command(args: &PlanArgs) -> Result<String> {
    let trace = Trace::load(&args.trace)?;
    let hardware = args.hardware.hardware(&trace)?;
    let started = Instant::now();
    let outcome = plan_teraio(&trace, &hardware, args.planner.config())?;
    let planning_time_ms = started.elapsed().as_secs_f64() * 1e3;
    let plan = &outcome.plan;
    let predicted = simulate(&trace, &hardware, Policy::Planned(plan), SimConfig::default())?;
    let ideal_time_us = trace.compute_time_us();
    if let Some(path) = &args.output {
        plan.save(path)?;
    }
    if let Some(path) = &args.svg {
        let after = (format!("{} (simulated)", plan.policy), predicted.memory_timeline.clone());
        plot_memory(
            path,
            &format!("GPU memory: {}", trace.description),
            hardware.gpu_capacity_bytes,
            &[unplanned_series(&trace), after],
        )?;
    }
    let summary = PlanSummary {
        trace: trace.description.clone(),
        hardware,
        planning_time_ms,
        candidates: outcome.candidate_count,
        evaluations: outcome.evaluation_count,
        migrations: plan.migrations.len(),
        ssd_migrations: plan.migrations.iter().filter(|m| m.tier == Tier::Ssd).count(),
        host_migrations: plan.migrations.iter().filter(|m| m.tier == Tier::Host).count(),
        clean_drops: plan.migrations.iter().filter(|m| !m.writes).count(),
        urgent_actions: plan.actions.iter().filter(|a| a.urgent).count(),
        stall_repairs: outcome.repair_count,
        expected_stall_us: outcome.expected_stall_us,
        unplanned_peak_bytes: outcome.base_pressure_bytes.iter().copied().max().unwrap_or(0),
        predicted_peak_bytes: plan.predicted_peak_bytes,
        fits: plan.fits,
        ideal_time_us,
        percent_of_ideal: predicted.percent_of(ideal_time_us),
        predicted,
    };
    if args.json {
        return to_json(&summary);
    }
    Ok(format_plan(&summary, plan, &trace, args.show_actions))
}

fn format_plan(summary: &PlanSummary, plan: &Plan, trace: &Trace, show_actions: usize) -> String {
    let traffic = plan.bytes_moved(trace);
    let p = &summary.predicted;
    let mut out = format!(
        "trace: {}\n\
         planning: {:.1} ms, {} candidates, {} evaluations\n\
         migrations: {} (SSD {}, host {}, clean drops {}, urgent actions {}, stall repairs {})\n\
         traffic per iteration: SSD write {:.1} GB, read {:.1} GB; host write {:.1} GB, read {:.1} GB\n\
         memory: {} without offload, {} planned peak, GPU {}: {}\n\
         predicted iteration: {} (ideal {}, {:.1}% of ideal), stalls {} in {} ops, peak {}, outcome {:?}\n",
        summary.trace,
        summary.planning_time_ms,
        summary.candidates,
        summary.evaluations,
        summary.migrations,
        summary.ssd_migrations,
        summary.host_migrations,
        summary.clean_drops,
        summary.urgent_actions,
        summary.stall_repairs,
        traffic.written_bytes[0] as f64 / 1e9,
        traffic.read_bytes[0] as f64 / 1e9,
        traffic.written_bytes[1] as f64 / 1e9,
        traffic.read_bytes[1] as f64 / 1e9,
        format_gib(summary.unplanned_peak_bytes as f64),
        format_gib(summary.predicted_peak_bytes as f64),
        format_gib(summary.hardware.gpu_capacity_bytes as f64),
        if summary.fits { "fits" } else { "does not fit" },
        format_duration_us(p.iteration_time_us),
        format_duration_us(summary.ideal_time_us),
        summary.percent_of_ideal,
        format_duration_us(p.stall_time_us),
        p.stalled_ops,
        format_gib(p.peak_gpu_bytes as f64),
        p.outcome,
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
pub fn run_plan(args: &PlanArgs) -> Result<()> {
    print!("{}", plan_command(args)?);
    Ok(())
}

/// Runs the comparison and returns it with the text to print.
pub fn sim_command(args: &SimArgs) -> Result<(Comparison, String)> {
    let trace = Trace::load(&args.trace)?;
    let hardware = args.hardware.hardware(&trace)?;
    let policies: Vec<PolicyName> =
        if args.policies.is_empty() { ALL_POLICIES.to_vec() } else { args.policies.clone() };
    let mut comparison = compare(&trace, &hardware, args.planner.config(), &policies)?;
    if let Some(path) = &args.plan {
        let plan = Plan::load(path)?;
        let mut sim = simulate(&trace, &hardware, Policy::Planned(&plan), SimConfig::default())?;
        sim.policy = format!("plan:{}", plan.policy);
        comparison.rows.push(crate::report::PolicyRow {
            policy: sim.policy.clone(),
            planning_time_ms: 0.0,
            migrations: plan.migrations.len(),
            plan_fits: plan.fits,
            percent_of_ideal: sim.percent_of(comparison.ideal_time_us),
            sim,
        });
    }
    if let Some(path) = &args.svg {
        let mut series = vec![unplanned_series(&trace)];
        for row in &comparison.rows {
            if row.policy != "ideal" && !row.sim.memory_timeline.is_empty() {
                series.push((row.policy.clone(), row.sim.memory_timeline.clone()));
            }
        }
        plot_memory(path, &format!("GPU memory: {}", trace.description), hardware.gpu_capacity_bytes, &series)?;
    }
    let text = if args.json { to_json(&comparison)? } else { format_table(&comparison) };
    Ok((comparison, text))
}

/// `teraio sim`.
pub fn run_sim(args: &SimArgs) -> Result<()> {
    print!("{}", sim_command(args)?.1);
    Ok(())
}
