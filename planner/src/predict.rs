//! The planner's one entry point: a trace, the hardware and the options in; the plan and its
//! prediction (the plan replayed in the simulator) out, as one serde type. `teraio plan`,
//! Python's `teraio.plan` and C's `teraio_plan_json` all call [`plan_and_predict`] and print or
//! return [`PlanAndPrediction`], so every interface reports the same keys.

use std::collections::HashSet;
use std::time::Instant;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::greedy::{plan_teraio, PlannerConfig};
use crate::hardware::Hardware;
use crate::plan::{Plan, Tier};
use crate::sim::{simulate, Policy, SimConfig, SimReport};
use crate::trace::{Access, Tensor, TensorKind, TensorUse, Trace};

/// What to plan besides the trace and the hardware. Every field has a default, so a JSON request
/// (`{}` included) names only what it changes.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PlanOptions {
    /// The planner's settings (default `PlannerConfig::default()`).
    pub planner: PlannerConfig,
    /// Only tensors of these kinds may move; the others are pinned (they keep their GPU memory
    /// over their whole live range). Default None: every kind may move. A runtime passes the
    /// kinds it can execute moves of.
    pub movable_kinds: Option<Vec<TensorKind>>,
}

/// A plan request as JSON clients (the C API) send it beside the trace:
/// `{"hardware": {...}, "options": {...}}`, with `Hardware`'s and `PlanOptions`' field names.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PlanRequest {
    /// The machine to plan for.
    pub hardware: Hardware,
    /// Default: `PlanOptions::default()`.
    #[serde(default)]
    pub options: PlanOptions,
}

/// [`plan_and_predict`] on JSON text: a trace (docs/trace.md) and a [`PlanRequest`] in, the
/// [`PlanAndPrediction`] out. A request or trace that does not decode is `Error::Config` or
/// `Error::InvalidTrace`, naming what is wrong.
pub fn plan_and_predict_json(trace_json: &str, request_json: &str) -> Result<String> {
    let trace: Trace = serde_json::from_str(trace_json)
        .map_err(|e| Error::InvalidTrace(format!("the trace is not valid trace JSON: {e}")))?;
    let request: PlanRequest = serde_json::from_str(request_json).map_err(|e| {
        Error::Config(format!("the plan request is not {{\"hardware\": {{...}}, \"options\": {{...}}}} JSON: {e}"))
    })?;
    let result = plan_and_predict(&trace, &request.hardware, &request.options)?;
    serde_json::to_string(&result).map_err(|e| Error::Config(format!("cannot write the prediction as JSON: {e}")))
}

/// A plan and what the simulator predicts for it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PlanAndPrediction {
    /// Numbers about the plan and its simulated replay.
    pub prediction: Prediction,
    /// The plan file (docs/planner.md).
    pub plan: Plan,
}

/// The planner's and the simulator's view of one plan.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Prediction {
    /// The trace's description.
    pub trace: String,
    /// The hardware planned for.
    pub hardware: Hardware,
    /// Wall time the planner took.
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
    /// Peak GPU memory with nothing moved.
    pub unplanned_peak_bytes: u64,
    /// Peak GPU memory the planner expects (stall-free timing; the plan's `predicted_peak_bytes`).
    pub planned_peak_bytes: u64,
    /// The planner expects every op to fit.
    pub fits: bool,
    /// Iteration time with unlimited GPU memory.
    pub ideal_time_us: f64,
    /// Simulated throughput relative to ideal, percent (0 when the replay runs out of memory).
    pub percent_of_ideal: f64,
    /// The simulated replay of the plan: iteration and stall time, peaks, bytes per tier and
    /// the outcome, at the top level of the prediction.
    #[serde(flatten)]
    pub simulated: SimReport,
}

/// Plans migrations for `trace` on `hardware` and replays the plan in the simulator.
pub fn plan_and_predict(trace: &Trace, hardware: &Hardware, options: &PlanOptions) -> Result<PlanAndPrediction> {
    trace.validate()?;
    hardware.validate()?;
    let slack = options.planner.prefetch_slack;
    if !(slack.is_finite() && slack >= 0.0) {
        return Err(Error::Config(format!("prefetch_slack must be a finite number >= 0, not {slack}")));
    }
    let pinned;
    let trace = match &options.movable_kinds {
        Some(kinds) => {
            pinned = pin_unmovable(trace, kinds);
            &pinned
        }
        None => trace,
    };
    let started = Instant::now();
    let outcome = plan_teraio(trace, hardware, options.planner)?;
    let planning_time_ms = started.elapsed().as_secs_f64() * 1e3;
    let plan = outcome.plan;
    let simulated = simulate(trace, hardware, Policy::Planned(&plan), SimConfig::default())?;
    let ideal_time_us = trace.compute_time_us();
    let count_migrations = |tier: Tier| plan.migrations.iter().filter(|m| m.tier == tier).count();
    let prediction = Prediction {
        trace: trace.description.clone(),
        hardware: *hardware,
        planning_time_ms,
        candidates: outcome.candidate_count,
        evaluations: outcome.evaluation_count,
        migrations: plan.migrations.len(),
        ssd_migrations: count_migrations(Tier::Ssd),
        host_migrations: count_migrations(Tier::Host),
        clean_drops: plan.migrations.iter().filter(|m| !m.writes).count(),
        urgent_actions: plan.actions.iter().filter(|a| a.urgent).count(),
        stall_repairs: outcome.repair_count,
        expected_stall_us: outcome.expected_stall_us,
        unplanned_peak_bytes: outcome.base_pressure_bytes.iter().copied().max().unwrap_or(0),
        planned_peak_bytes: plan.predicted_peak_bytes,
        fits: plan.fits,
        ideal_time_us,
        percent_of_ideal: simulated.percent_of(ideal_time_us),
        simulated,
    };
    Ok(PlanAndPrediction { prediction, plan })
}

/// A copy of `trace` in which every tensor of a kind not in `movable` has a use at every op of
/// its live range: it has no inactive period, so the planner leaves it where it is.
fn pin_unmovable(trace: &Trace, movable: &[TensorKind]) -> Trace {
    let mut pinned = trace.clone();
    let op_count = pinned.ops.len() as u32;
    for tensor in pinned.tensors.iter_mut().filter(|t| !movable.contains(&t.kind)) {
        pin_tensor(tensor, op_count);
    }
    pinned
}

fn pin_tensor(tensor: &mut Tensor, op_count: u32) {
    let from = tensor.live_from_op();
    let to = tensor.live_to_op(op_count);
    let writes: HashSet<u32> = tensor.uses.iter().filter(|u| u.access == Access::Write).map(|u| u.op).collect();
    tensor.uses = (from..=to)
        .map(|op| TensorUse { op, access: if writes.contains(&op) { Access::Write } else { Access::Read } })
        .collect();
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::greedy::TierPreference;
    use crate::hardware::gpu_preset;
    use crate::synth::{generate, model_preset};
    use teraio_units::ReadWriteBandwidth;

    fn tiny_trace() -> Trace {
        let mut model = model_preset("tiny").unwrap();
        model.batch = 8;
        model.sequence = 512;
        generate(&model, &gpu_preset("h100").unwrap()).unwrap()
    }

    fn hardware_at_three_quarters(trace: &Trace) -> Hardware {
        let peak = crate::lifetime::base_pressure_bytes(trace).into_iter().max().unwrap();
        let ssd = ReadWriteBandwidth { read_bytes_per_s: 2e9, write_bytes_per_s: 2e9 };
        Hardware::new(peak * 3 / 4, ssd, 0)
    }

    #[test]
    fn the_prediction_is_the_plan_replayed() {
        let trace = tiny_trace();
        let hardware = hardware_at_three_quarters(&trace);
        let result = plan_and_predict(&trace, &hardware, &PlanOptions::default()).unwrap();
        let prediction = &result.prediction;
        assert!(result.plan.fits && prediction.fits);
        assert!(prediction.migrations > 0);
        assert_eq!(prediction.migrations, prediction.ssd_migrations + prediction.host_migrations);
        assert_eq!(prediction.planned_peak_bytes, result.plan.predicted_peak_bytes);
        assert!(prediction.unplanned_peak_bytes > hardware.gpu_capacity_bytes);
        let replay = simulate(&trace, &hardware, Policy::Planned(&result.plan), SimConfig::default()).unwrap();
        assert_eq!(prediction.simulated.iteration_time_us, replay.iteration_time_us);
        assert!(prediction.simulated.peak_gpu_bytes <= hardware.gpu_capacity_bytes);
        assert!(prediction.percent_of_ideal > 0.0 && prediction.percent_of_ideal <= 100.0 + 1e-9);
    }

    #[test]
    fn the_json_has_one_flat_prediction_and_the_plan_file() {
        let trace = tiny_trace();
        let hardware = hardware_at_three_quarters(&trace);
        let result = plan_and_predict(&trace, &hardware, &PlanOptions::default()).unwrap();
        let value = serde_json::to_value(&result).unwrap();
        // The keys the Python runtime reads: the simulated replay sits beside the planner's numbers.
        for key in
            ["iteration_time_us", "peak_gpu_bytes", "unplanned_peak_bytes", "outcome", "fits", "planning_time_ms"]
        {
            assert!(value["prediction"].get(key).is_some(), "prediction lacks {key}: {value}");
        }
        assert_eq!(value["plan"]["format_version"], crate::plan::PLAN_FORMAT_VERSION);
        let back: PlanAndPrediction = serde_json::from_value(value).unwrap();
        assert_eq!(back.plan, result.plan);
        assert_eq!(back.prediction.simulated.iteration_time_us, result.prediction.simulated.iteration_time_us);
    }

    #[test]
    fn movable_kinds_pin_every_other_kind() {
        let trace = tiny_trace();
        let hardware = hardware_at_three_quarters(&trace);
        let options = PlanOptions { movable_kinds: Some(vec![TensorKind::Activation]), ..PlanOptions::default() };
        let result = plan_and_predict(&trace, &hardware, &options).unwrap();
        assert!(!result.plan.migrations.is_empty());
        for migration in &result.plan.migrations {
            let tensor = trace.tensors.iter().find(|t| t.id == migration.tensor_id).unwrap();
            assert_eq!(tensor.kind, TensorKind::Activation, "{} moved", tensor.name);
        }
        let nothing = PlanOptions { movable_kinds: Some(vec![]), ..PlanOptions::default() };
        let result = plan_and_predict(&trace, &hardware, &nothing).unwrap();
        assert!(result.plan.migrations.is_empty() && !result.prediction.fits);
    }

    #[test]
    fn the_json_entry_takes_a_request_and_returns_the_same_document() {
        let trace = tiny_trace();
        let hardware = hardware_at_three_quarters(&trace);
        let request = PlanRequest { hardware, options: PlanOptions::default() };
        let trace_json = serde_json::to_string(&trace).unwrap();
        let text = plan_and_predict_json(&trace_json, &serde_json::to_string(&request).unwrap()).unwrap();
        let from_json: PlanAndPrediction = serde_json::from_str(&text).unwrap();
        let direct = plan_and_predict(&trace, &hardware, &request.options).unwrap();
        assert_eq!(from_json.plan, direct.plan);
        assert_eq!(from_json.prediction.simulated.iteration_time_us, direct.prediction.simulated.iteration_time_us);
        // Options may be left out; a misspelt field or a bad trace is named.
        let bare = format!(r#"{{"hardware": {}}}"#, serde_json::to_string(&hardware).unwrap());
        assert!(plan_and_predict_json(&trace_json, &bare).is_ok());
        let message = plan_and_predict_json(&trace_json, r#"{"hardwre": {}}"#).unwrap_err().to_string();
        assert!(message.contains("hardwre"), "{message}");
        let message = plan_and_predict_json("{", &bare).unwrap_err().to_string();
        assert!(message.contains("trace"), "{message}");
    }

    #[test]
    fn bad_options_are_refused_with_their_name() {
        let trace = tiny_trace();
        let hardware = hardware_at_three_quarters(&trace);
        let mut options = PlanOptions::default();
        options.planner.prefetch_slack = f64::NAN;
        let message = plan_and_predict(&trace, &hardware, &options).unwrap_err().to_string();
        assert!(message.contains("prefetch_slack"), "{message}");
        let message = "fastest".parse::<TierPreference>().unwrap_err().to_string();
        assert!(message.contains("tier_preference"), "{message}");
        for name in TierPreference::NAMES {
            assert_eq!(serde_json::to_value(name.parse::<TierPreference>().unwrap()).unwrap(), name);
        }
        let request: std::result::Result<PlanOptions, _> = serde_json::from_str(r#"{"planer": {}}"#);
        assert!(request.unwrap_err().to_string().contains("planer"));
        let partial: PlanOptions = serde_json::from_str(r#"{"planner": {"reserve_bytes": 4096}}"#).unwrap();
        assert_eq!(partial.planner, PlannerConfig { reserve_bytes: 4096, ..PlannerConfig::default() });
    }
}
