//! A runtime's own schedule replayed in the simulator. Whole-model offload does not execute the
//! planner's plan: it runs its own schedule (a unit's parameters read ahead along the recorded
//! order, gradients out as backward leaves a unit, the step's windows). To predict that schedule
//! at other bandwidths (more SSDs, another link) the runtime records one iteration as it ran: its
//! ops (GPU time of each stretch between two waits, measured), the tensors they used, and the
//! transfers it issued before each op. [`plan_from_schedule`] turns the transfers into a plan
//! (each departure paired with the read that brings the tensor back, wrapping into the next
//! iteration where the tensor starts the iteration on its tier) and [`replay`] runs it through
//! [`crate::sim::simulate`]: the same channel, latency and link model as every other prediction,
//! with the runtime's rule for a tensor needed again while its write runs: the read waits for
//! the write (`SimConfig::reads_wait_for_writes`), where the planner's executor would keep it.
//!
//! With the optimizer step on the CPU the record also holds the CPU step's jobs (a unit's
//! update, its measured time on the runtime's one worker thread, the gradients it reads and the
//! parameters it writes) and the gradients' writes to host memory, which are never read back (a
//! departure of a tensor that does not outlive the iteration, with no read after it: a lone
//! departure). The replay runs the jobs on a CPU worker of the simulator (`sim::SideWork`): one
//! at a time in issue order, each after its gradients' writes, each parameter's next read after
//! the job that writes it.

use std::collections::HashMap;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::hardware::Hardware;
use crate::plan::{ActionKind, Migration, Plan, Tier};
use crate::sim::{simulate_with, LoneDeparture, Policy, SideWork, SimConfig, SimReport, WorkerJob};
use crate::trace::Trace;

/// The policy name replayed plans carry.
pub const REPLAY_POLICY: &str = "replayed schedule";

/// Iterations a replay runs back to back (the last is reported): where a tier cannot keep up,
/// its backlog grows over the first iterations, and the last must show the steady state (a
/// record whose store writes outlast the iteration's GPU work settles within three).
pub const REPLAY_ITERATIONS: u32 = 4;

/// One transfer the runtime issued: before op `op` (the op count: after the last op, which is
/// before the next iteration's first), `kind` of tensor `tensor_id` to or from `tier` (offload:
/// written, then its GPU memory freed; drop: freed, the tier's copy is current; prefetch: read
/// back). Within one op the simulator issues departures before reads, as plans order them.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Issued {
    /// The op before which it was issued.
    pub op: u32,
    /// The trace's tensor id.
    pub tensor_id: u64,
    /// What was done.
    pub kind: ActionKind,
    /// Source or destination tier.
    pub tier: Tier,
}

/// Most CPU jobs a schedule may hold (a job per unit of a model: far fewer).
pub const MAX_CPU_JOBS: usize = 1 << 16;

/// One job the runtime queued on its CPU worker (the CPU step's update of one unit), before op
/// `op` (the op count: after the last op; a job queued at `optimizer.step()` after backward is
/// there). The worker runs jobs one at a time in issue order; this one starts once the
/// departures of `waits_for` issued before it (lone, or followed by a read) are done, and the
/// reads of `produces` issued before its end wait for it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CpuJob {
    /// The op before which it was queued.
    pub op: u32,
    /// Its time on the worker, measured (not counting its waits for `waits_for`).
    pub duration_us: f64,
    /// The trace's ids of the tensors whose departures it reads (a unit's gradients).
    pub waits_for: Vec<u64>,
    /// The trace's ids of the tensors it writes on their tier (a unit's parameters).
    pub produces: Vec<u64>,
}

/// A recorded schedule as JSON clients send it: `{"transfers": [...], "cpu_jobs": [...]}`, each
/// in issue order (`cpu_jobs` may be left out: none).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Schedule {
    /// Every transfer of one iteration, in the order the runtime issued them.
    pub transfers: Vec<Issued>,
    /// The CPU step's jobs of that iteration, in the order the runtime queued them.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub cpu_jobs: Vec<CpuJob>,
}

/// The plan that executes the schedule's transfers (issue order) on `trace`, and the side work
/// the plan does not hold: lone departures and CPU jobs. Per tensor the transfers must
/// alternate between a departure (offload or drop) and a prefetch from the same tier; where the
/// first is a prefetch, the tensor starts the iteration on its tier and the last departure's
/// period wraps; for a tensor that does not outlive the iteration, an offload no read follows
/// before it leaves again or the iteration ends is a lone departure. Anything else is
/// `Error::InvalidPlan`, naming the tensor.
pub fn plan_from_schedule(trace: &Trace, schedule: &Schedule, gpu_capacity_bytes: u64) -> Result<(Plan, SideWork)> {
    let op_count = trace.ops.len() as u32;
    let index_of: HashMap<u64, u32> = trace.tensors.iter().enumerate().map(|(i, t)| (t.id, i as u32)).collect();
    let mut per_tensor: HashMap<u32, Vec<Issued>> = HashMap::new();
    let mut lone_departures = Vec::new();
    for issued in &schedule.transfers {
        let Some(&index) = index_of.get(&issued.tensor_id) else {
            return Err(Error::InvalidPlan(format!(
                "a transfer names tensor {}, which the trace lacks",
                issued.tensor_id
            )));
        };
        if issued.op > op_count {
            return Err(Error::InvalidPlan(format!(
                "a transfer of tensor {} is issued before op {}; the trace has {op_count} ops",
                issued.tensor_id, issued.op
            )));
        }
        per_tensor.entry(index).or_default().push(*issued);
    }
    let mut migrations = Vec::new();
    let mut tensors: Vec<u32> = per_tensor.keys().copied().collect();
    tensors.sort_unstable();
    for index in tensors {
        let mut events = per_tensor.remove(&index).unwrap_or_default();
        events.sort_by_key(|e| e.op); // stable: issue order within an op
                                      // After the last op is before the next iteration's first.
        let at = |e: &Issued| if e.op == op_count { 0 } else { e.op };
        let tensor = &trace.tensors[index as usize];
        let leaves = |e: &Issued| e.kind != ActionKind::Prefetch;
        let invalid = |why: &str| Error::InvalidPlan(format!("tensor {} ({:?}): {why}", tensor.id, tensor.name));
        if !tensor.is_persistent() {
            // It does not outlive the iteration: a write no read follows before it leaves again
            // (or the iteration ends) is gone for good, a lone departure.
            let mut paired = Vec::with_capacity(events.len());
            for (position, event) in events.iter().enumerate() {
                if !leaves(event) || events.get(position + 1).is_some_and(|next| !leaves(next)) {
                    paired.push(*event);
                } else if event.kind == ActionKind::Offload {
                    lone_departures.push(LoneDeparture { op: event.op, tensor_index: index, tier: event.tier });
                } else {
                    return Err(invalid("it is dropped and never read back"));
                }
            }
            if paired.is_empty() {
                continue;
            }
            events = paired;
        }
        let departures = events.iter().filter(|e| leaves(e)).count();
        if departures * 2 != events.len() {
            return Err(invalid("its departures and prefetches do not pair up"));
        }
        // Start at the first departure: the events then alternate departure, prefetch, ...
        let first = events.iter().position(leaves).ok_or_else(|| invalid("it is read but never leaves"))?;
        let wrapped = first == 1;
        if first > 1 {
            return Err(invalid("it is read twice without leaving between"));
        }
        if wrapped && !tensor.is_persistent() {
            return Err(invalid("it is read back before it left, but it does not outlive the iteration"));
        }
        for pair in 0..departures {
            let out = events[(first + 2 * pair) % events.len()];
            let back = events[(first + 2 * pair + 1) % events.len()];
            if !leaves(&out) || leaves(&back) {
                return Err(invalid("it leaves twice without coming back, or comes back twice"));
            }
            if out.tier != back.tier {
                return Err(invalid("it is read back from another tier than the one it left to"));
            }
            let wraps = wrapped && pair + 1 == departures;
            let next_use_op = tensor
                .uses
                .iter()
                .map(|u| u.op)
                .find(|&op| op >= at(&back))
                .or_else(|| tensor.uses.first().map(|u| u.op))
                .unwrap_or(at(&back));
            migrations.push(Migration {
                tensor_id: tensor.id,
                tensor_index: index,
                tier: out.tier,
                offload_op: at(&out),
                writes: out.kind == ActionKind::Offload,
                prefetch_op: at(&back),
                next_use_op,
                // Op indices: a replayed schedule has no planner slots.
                absent_from_slot: at(&out),
                absent_to_slot: at(&back),
                wraps,
                offloaded_at_start: wraps,
                offload_urgent: false,
                prefetch_urgent: next_use_op == at(&back),
                offload_stalls: false,
                prefetch_stalls: false,
            });
        }
    }
    // The simulator issues them op by op, in this order within an op.
    lone_departures.sort_by_key(|d: &LoneDeparture| d.op);
    let written: Vec<(u32, u32)> =
        migrations.iter().filter(|m| m.writes).map(|m| (m.tensor_index, m.offload_op)).collect();
    let jobs = worker_jobs(trace, &schedule.cpu_jobs, &index_of, &lone_departures, &written)?;
    let plan = Plan::new(REPLAY_POLICY, trace, gpu_capacity_bytes, 0, migrations);
    Ok((plan, SideWork { lone_departures, jobs }))
}

/// The schedule's CPU jobs with the trace's tensor indices, checked: in issue order, at most
/// [`MAX_CPU_JOBS`], a finite time, known tensors, each tensor waited for with a departure
/// issued before the job (a lone one, or a write of the plan's, `written`: (tensor, op)), each
/// tensor produced outliving the iteration.
fn worker_jobs(
    trace: &Trace,
    cpu_jobs: &[CpuJob],
    index_of: &HashMap<u64, u32>,
    lone_departures: &[LoneDeparture],
    written: &[(u32, u32)],
) -> Result<Vec<WorkerJob>> {
    let op_count = trace.ops.len() as u32;
    if cpu_jobs.len() > MAX_CPU_JOBS {
        return Err(Error::InvalidPlan(format!(
            "{} CPU jobs; a schedule may hold at most {MAX_CPU_JOBS}",
            cpu_jobs.len()
        )));
    }
    let mut jobs = Vec::with_capacity(cpu_jobs.len());
    let mut previous_op = 0;
    for (position, job) in cpu_jobs.iter().enumerate() {
        let invalid = |why: String| Error::InvalidPlan(format!("CPU job {position}: {why}"));
        if job.op > op_count {
            return Err(invalid(format!("queued before op {}; the trace has {op_count} ops", job.op)));
        }
        if job.op < previous_op {
            return Err(invalid(format!("queued before op {}, after a job queued before op {previous_op}", job.op)));
        }
        previous_op = job.op;
        if !job.duration_us.is_finite() || job.duration_us < 0.0 {
            return Err(invalid(format!("duration_us {} is not a time", job.duration_us)));
        }
        let index = |id: &u64| {
            index_of.get(id).copied().ok_or_else(|| invalid(format!("it names tensor {id}, which the trace lacks")))
        };
        let waits_for = job.waits_for.iter().map(index).collect::<Result<Vec<u32>>>()?;
        let produces = job.produces.iter().map(index).collect::<Result<Vec<u32>>>()?;
        for (&id, &tensor) in job.waits_for.iter().zip(&waits_for) {
            let lone = lone_departures.iter().any(|d| d.tensor_index == tensor && d.op <= job.op);
            if !lone && !written.iter().any(|&(t, op)| t == tensor && op <= job.op) {
                return Err(invalid(format!("it waits for tensor {id}, which has no departure before it")));
            }
        }
        for (&id, &tensor) in job.produces.iter().zip(&produces) {
            if !trace.tensors[tensor as usize].is_persistent() {
                return Err(invalid(format!("it produces tensor {id}, which does not outlive the iteration")));
            }
        }
        jobs.push(WorkerJob { op: job.op, duration_us: job.duration_us, waits_for, produces });
    }
    Ok(jobs)
}

/// Replays `schedule` on `trace` (see the module docs) and returns the simulator's report.
pub fn replay(trace: &Trace, schedule: &Schedule, hardware: &Hardware) -> Result<SimReport> {
    trace.validate()?;
    hardware.validate()?;
    let (plan, side) = plan_from_schedule(trace, schedule, hardware.gpu_capacity_bytes)?;
    let config = SimConfig { iterations: REPLAY_ITERATIONS, reads_wait_for_writes: true };
    simulate_with(trace, hardware, Policy::Planned(&plan), config, &side)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sim::simulate;
    use crate::trace::{Access, Op, Phase, Tensor, TensorKind, TensorUse, FORMAT_VERSION};
    use teraio_units::ReadWriteBandwidth;

    /// Ops of 100, 100 and 5000 us, one persistent 1 MB weight read by the first and written by
    /// the second (the third is long enough for its write to end within the iteration).
    fn trace() -> Trace {
        let op = |name: &str, duration_us: f64| Op { name: name.into(), duration_us, layer: None, phase: Phase::Other };
        let uses = vec![TensorUse { op: 0, access: Access::Read }, TensorUse { op: 1, access: Access::Write }];
        Trace {
            format_version: FORMAT_VERSION,
            description: "replay test".into(),
            gpu_capacity_bytes: 1 << 40,
            ops: vec![op("forward", 100.0), op("step", 100.0), op("other", 5000.0)],
            tensors: vec![Tensor {
                id: 7,
                name: "w".into(),
                size_bytes: 1_000_000,
                kind: TensorKind::Weight,
                alloc_op: None,
                free_op: None,
                uses,
            }],
        }
    }

    fn hardware(host_bytes_per_s: f64) -> Hardware {
        let ssd = ReadWriteBandwidth { read_bytes_per_s: 1e9, write_bytes_per_s: 1e9 };
        let mut hardware = Hardware::new(1 << 40, ssd, 1 << 40);
        hardware.host_link_bytes_per_s = host_bytes_per_s;
        hardware.host_latency_us = 0.0;
        hardware
    }

    /// A schedule of transfers alone.
    fn only(transfers: &[Issued]) -> Schedule {
        Schedule { transfers: transfers.to_vec(), cpu_jobs: Vec::new() }
    }

    fn issued(op: u32, kind: ActionKind) -> Issued {
        Issued { op, tensor_id: 7, kind, tier: Tier::Host }
    }

    #[test]
    fn a_wrapping_read_starts_on_the_tier_and_a_clean_host_drop_writes_nothing() {
        // Read before op 0, dropped before op 1 (unchanged), read before op 1, written back after.
        let transfers = [
            issued(0, ActionKind::Prefetch),
            issued(1, ActionKind::Drop),
            issued(1, ActionKind::Prefetch),
            issued(2, ActionKind::Offload),
        ];
        let (plan, _) = plan_from_schedule(&trace(), &only(&transfers), 1 << 40).unwrap();
        assert_eq!(plan.migrations.len(), 2);
        assert!(plan.migrations.iter().any(|m| m.offloaded_at_start && m.offload_op == 2 && m.writes));
        // 1 MB at 1 GB/s: 1000 us per read, one write; nothing hides the reads.
        let report = replay(&trace(), &only(&transfers), &hardware(1e9)).unwrap();
        assert_eq!(report.downgraded_drops, 0, "the host copy was current: the drop must not write");
        assert_eq!(report.host_read_bytes, 2_000_000);
        assert_eq!(report.host_written_bytes, 1_000_000);
        assert!((report.iteration_time_us - 7200.0).abs() < 1.0, "{}", report.iteration_time_us);
        // Far faster link: the ops alone.
        let fast = replay(&trace(), &only(&transfers), &hardware(1e15)).unwrap();
        assert!((fast.iteration_time_us - 5200.0).abs() < 1.0, "{}", fast.iteration_time_us);
        // Written back after the last op: the same as before the next iteration's first.
        let after_last = [transfers[0], transfers[1], transfers[2], issued(3, ActionKind::Offload)];
        let (plan, _) = plan_from_schedule(&trace(), &only(&after_last), 1 << 40).unwrap();
        assert!(plan.migrations.iter().any(|m| m.offloaded_at_start && m.offload_op == 0 && m.prefetch_op == 0));
    }

    /// Weights g (`write_bytes`) and w (1 MB): g written before op 1 while w is read for it
    /// (both at once), w dropped again, g read back for the next iteration's op 0 (alone); ops
    /// of 10, 10 and `last_op_us` us.
    fn read_during_write(write_bytes: u64, last_op_us: f64) -> (Trace, [Issued; 4]) {
        let op = |name: &str, duration_us: f64| Op { name: name.into(), duration_us, layer: None, phase: Phase::Other };
        let weight = |id: u64, size_bytes: u64, op: u32, access: Access| Tensor {
            id,
            name: format!("t{id}"),
            size_bytes,
            kind: TensorKind::Weight,
            alloc_op: None,
            free_op: None,
            uses: vec![TensorUse { op, access }],
        };
        let trace = Trace {
            format_version: FORMAT_VERSION,
            description: "a read during a write".into(),
            gpu_capacity_bytes: 1 << 40,
            ops: vec![op("a", 10.0), op("b", 10.0), op("c", last_op_us)],
            tensors: vec![weight(7, 1_000_000, 1, Access::Read), weight(8, write_bytes, 0, Access::Write)],
        };
        let transfers = [
            Issued { op: 1, tensor_id: 8, kind: ActionKind::Offload, tier: Tier::Host },
            issued(1, ActionKind::Prefetch),
            issued(2, ActionKind::Drop),
            Issued { op: 3, tensor_id: 8, kind: ActionKind::Prefetch, tier: Tier::Host },
        ];
        (trace, transfers)
    }

    #[test]
    fn a_read_and_a_write_at_once_share_the_link_at_its_duplex_rate() {
        let (trace, transfers) = read_during_write(1_000_000, 5000.0);
        // At 1 GB/s each way: g's read before op 0 (1000 us), op 0, w's read for op 1 (1000 us),
        // ops 1 and 2.
        let one_way = replay(&trace, &only(&transfers), &hardware(1e9)).unwrap();
        assert!((one_way.iteration_time_us - 7020.0).abs() < 1.0, "{}", one_way.iteration_time_us);
        // Both directions at once at 0.5 GB/s each: w's read takes 2000 us; g's read alone
        // before op 0 still goes at the one-way rate.
        let duplex = Hardware { host_link_duplex_bytes_per_s: Some(0.5e9), ..hardware(1e9) };
        let shared = replay(&trace, &only(&transfers), &duplex).unwrap();
        assert!((shared.iteration_time_us - 8020.0).abs() < 1.0, "{}", shared.iteration_time_us);
        // A duplex rate equal to the one-way rate changes nothing.
        let as_fast = Hardware { host_link_duplex_bytes_per_s: Some(1e9), ..hardware(1e9) };
        let same = replay(&trace, &only(&transfers), &as_fast).unwrap();
        assert!((same.iteration_time_us - one_way.iteration_time_us).abs() < 1e-6);
    }

    #[test]
    fn a_transfer_alone_goes_back_to_the_one_way_rate_when_the_other_direction_ends() {
        // w's 1 MB read while g's 0.5 MB write runs: both at 0.5 GB/s until the write ends
        // (1000 us, 0.5 MB read), then the read's other 0.5 MB at 1 GB/s (500 us).
        let (trace, transfers) = read_during_write(500_000, 20000.0);
        let duplex = Hardware { host_link_duplex_bytes_per_s: Some(0.5e9), ..hardware(1e9) };
        let report = replay(&trace, &only(&transfers), &duplex).unwrap();
        // 500 (g's read alone) + 10 + 1500 (w's read) + 10 + 20000.
        assert!((report.iteration_time_us - 22020.0).abs() < 1.0, "{}", report.iteration_time_us);
    }

    #[test]
    fn a_read_of_a_tensor_whose_write_runs_waits_for_the_write() {
        // w is written back before op 2 (1000 us at 1 GB/s) and read again before op 0 of the
        // next iteration, 100 us later: the read waits for the write, then takes its 1000 us.
        let transfers = [issued(0, ActionKind::Prefetch), issued(2, ActionKind::Offload)];
        let trace = Trace {
            ops: vec![
                Op { name: "forward".into(), duration_us: 100.0, layer: None, phase: Phase::Other },
                Op { name: "step".into(), duration_us: 100.0, layer: None, phase: Phase::Other },
                Op { name: "other".into(), duration_us: 100.0, layer: None, phase: Phase::Other },
            ],
            ..trace()
        };
        let report = replay(&trace, &only(&transfers), &hardware(1e9)).unwrap();
        assert_eq!(report.host_read_bytes, 1_000_000, "the tensor must be read back, not kept");
        assert_eq!(report.host_written_bytes, 1_000_000);
        // Each iteration: op 2 (100 us, the write's first 100 us), the write's other 900 us, the
        // read (1000 us), ops 0 and 1.
        assert!((report.iteration_time_us - 2200.0).abs() < 1.0, "{}", report.iteration_time_us);
        // The planner's executor keeps it instead: no read, no wait.
        let (plan, _) = plan_from_schedule(&trace, &only(&transfers), 1 << 40).unwrap();
        let kept = simulate(&trace, &hardware(1e9), Policy::Planned(&plan), SimConfig::default()).unwrap();
        assert_eq!(kept.host_read_bytes, 0);
        assert!(kept.iteration_time_us < 1000.0, "{}", kept.iteration_time_us);
    }

    #[test]
    fn transfers_that_do_not_pair_up_are_refused() {
        let twice = [issued(0, ActionKind::Prefetch), issued(1, ActionKind::Prefetch)];
        assert!(matches!(plan_from_schedule(&trace(), &only(&twice), 1 << 40), Err(Error::InvalidPlan(_))));
        let other_tier =
            [Issued { tier: Tier::Ssd, ..issued(0, ActionKind::Prefetch) }, issued(1, ActionKind::Offload)];
        assert!(matches!(plan_from_schedule(&trace(), &only(&other_tier), 1 << 40), Err(Error::InvalidPlan(_))));
        let unknown = [Issued { tensor_id: 8, ..issued(0, ActionKind::Prefetch) }];
        assert!(matches!(plan_from_schedule(&trace(), &only(&unknown), 1 << 40), Err(Error::InvalidPlan(_))));
        let late = [issued(4, ActionKind::Prefetch), issued(1, ActionKind::Offload)];
        assert!(matches!(plan_from_schedule(&trace(), &only(&late), 1 << 40), Err(Error::InvalidPlan(_))));
    }

    /// A unit's parameter (1 MB, persistent) read by ops 0 (forward) and 1 (backward).
    fn unit_weight(id: u64, name: &str) -> Tensor {
        Tensor {
            id,
            name: name.into(),
            size_bytes: 1_000_000,
            kind: TensorKind::Weight,
            alloc_op: None,
            free_op: None,
            uses: vec![TensorUse { op: 0, access: Access::Read }, TensorUse { op: 1, access: Access::Read }],
        }
    }

    /// Its gradient, written by op 1 and gone after it.
    fn unit_gradient(id: u64, name: &str, size_bytes: u64) -> Tensor {
        Tensor {
            id,
            name: name.into(),
            size_bytes,
            kind: TensorKind::Gradient,
            alloc_op: Some(1),
            free_op: Some(1),
            uses: vec![TensorUse { op: 1, access: Access::Write }],
        }
    }

    /// The CPU step's schedule: a unit with parameter w (id 1, 1 MB, persistent) read by ops 0
    /// (forward) and 1 (backward), and its gradient g (id 2, `gradient_bytes`, written by op 1,
    /// gone after it); ops of 1000, 1000 and 20000 us. w is read before op 0 and dropped (its
    /// host copy current) before op 2; g leaves for good before op `job_op`, where the CPU job
    /// that reads g and writes w (`job_us`) is queued.
    fn cpu_step(job_op: u32, job_us: f64) -> (Trace, Schedule) {
        let op = |name: &str, duration_us: f64| Op { name: name.into(), duration_us, layer: None, phase: Phase::Other };
        let weight = unit_weight(1, "w");
        let gradient = unit_gradient(2, "w.grad", 1_000_000);
        let trace = Trace {
            format_version: FORMAT_VERSION,
            description: "the CPU step".into(),
            gpu_capacity_bytes: 1 << 40,
            ops: vec![op("forward", 1000.0), op("backward", 1000.0), op("other", 20000.0)],
            tensors: vec![weight, gradient],
        };
        let transfer = |op: u32, tensor_id: u64, kind: ActionKind| Issued { op, tensor_id, kind, tier: Tier::Host };
        let schedule = Schedule {
            transfers: vec![
                transfer(0, 1, ActionKind::Prefetch),
                transfer(2, 1, ActionKind::Drop),
                transfer(job_op, 2, ActionKind::Offload),
            ],
            cpu_jobs: vec![CpuJob { op: job_op, duration_us: job_us, waits_for: vec![2], produces: vec![1] }],
        };
        (trace, schedule)
    }

    #[test]
    fn a_gradient_that_leaves_for_good_is_a_lone_departure() {
        let (trace, schedule) = cpu_step(2, 5000.0);
        let (plan, side) = plan_from_schedule(&trace, &schedule, 1 << 40).unwrap();
        assert_eq!(side.lone_departures, vec![LoneDeparture { op: 2, tensor_index: 1, tier: Tier::Host }]);
        assert_eq!(plan.migrations.len(), 1, "w's drop and read; g has no read to pair with");
        assert_eq!(side.jobs, vec![WorkerJob { op: 2, duration_us: 5000.0, waits_for: vec![1], produces: vec![0] }]);
        // Written twice without a read between (gradients accumulated in host memory): both
        // writes are lone, and a job waits for both.
        let mut twice = schedule.clone();
        twice.transfers.insert(0, Issued { op: 1, tensor_id: 2, kind: ActionKind::Offload, tier: Tier::Host });
        let (_, side) = plan_from_schedule(&trace, &twice, 1 << 40).unwrap();
        assert_eq!(side.lone_departures.iter().map(|d| d.op).collect::<Vec<_>>(), vec![1, 2]);
        // It moves its bytes: w read once, g written once.
        let report = replay(&trace, &schedule, &hardware(1e9)).unwrap();
        assert_eq!((report.host_read_bytes, report.host_written_bytes), (1_000_000, 1_000_000));
        // A tensor that outlives the iteration and leaves without a read after it has its read
        // wrap into the next iteration; with none at all it is refused, not a lone departure.
        let mut persistent = schedule.clone();
        persistent.transfers.remove(0);
        assert!(matches!(plan_from_schedule(&trace, &persistent, 1 << 40), Err(Error::InvalidPlan(_))));
    }

    #[test]
    fn a_job_may_wait_for_a_departure_a_read_follows() {
        // An earlier micro-batch's gradient: written before op 1, read back before op 2 (its
        // sum added on the GPU), and gone for good after op 2. A job queued at op 1 (the host's
        // fold of it) waits for the first write, which a read follows (not lone).
        let (mut trace, _) = cpu_step(3, 5000.0);
        trace.tensors[1].alloc_op = Some(0);
        trace.tensors[1].uses =
            vec![TensorUse { op: 0, access: Access::Write }, TensorUse { op: 1, access: Access::Write }];
        let transfer = |op: u32, kind: ActionKind| Issued { op, tensor_id: 2, kind, tier: Tier::Host };
        let fold = CpuJob { op: 1, duration_us: 1000.0, waits_for: vec![2], produces: Vec::new() };
        let schedule = Schedule {
            transfers: vec![
                transfer(1, ActionKind::Offload),
                transfer(1, ActionKind::Prefetch),
                transfer(2, ActionKind::Offload),
            ],
            cpu_jobs: vec![fold.clone()],
        };
        let (plan, side) = plan_from_schedule(&trace, &schedule, 1 << 40).unwrap();
        assert_eq!(plan.migrations.len(), 1);
        assert_eq!(side.lone_departures, vec![LoneDeparture { op: 2, tensor_index: 1, tier: Tier::Host }]);
        assert_eq!(side.jobs[0].waits_for, vec![1]);
        let report = replay(&trace, &schedule, &hardware(1e9)).unwrap();
        assert_eq!(report.host_written_bytes, 2_000_000);
        // Queued before any departure of it: refused.
        let mut early = schedule.clone();
        early.cpu_jobs[0].op = 0;
        assert!(matches!(plan_from_schedule(&trace, &early, 1 << 40), Err(Error::InvalidPlan(_))));
    }

    #[test]
    fn a_cpu_job_hidden_under_compute_costs_nothing() {
        // Step in backward: g leaves and the job is queued as backward leaves the unit (before
        // op 2). g's write (1000 us) and the job (5000 us) end within op 2 (20000 us): the
        // iteration is w's read (1000 us) and the ops (22000 us).
        let (trace, schedule) = cpu_step(2, 5000.0);
        let report = replay(&trace, &schedule, &hardware(1e9)).unwrap();
        assert!((report.iteration_time_us - 23000.0).abs() < 1.0, "{}", report.iteration_time_us);
        assert_eq!(report.demand_fetches, 0);
        // Without the job: the same.
        let none = Schedule { cpu_jobs: Vec::new(), ..schedule };
        let without = replay(&trace, &none, &hardware(1e9)).unwrap();
        assert!((without.iteration_time_us - report.iteration_time_us).abs() < 1e-6);
    }

    #[test]
    fn a_cpu_job_longer_than_the_compute_after_it_bounds_the_iteration() {
        // Step in backward, a 30000 us job: from op 2's start, g's write (1000 us), the job
        // (30000 us), w's read for the next forward (1000 us), ops 0 and 1 (2000 us) are one
        // chain, longer than op 2 (20000 us).
        let (trace, schedule) = cpu_step(2, 30000.0);
        let report = replay(&trace, &schedule, &hardware(1e9)).unwrap();
        assert!((report.iteration_time_us - 34000.0).abs() < 1.0, "{}", report.iteration_time_us);
        // Step after backward (at `optimizer.step()`, after the last op): nothing hides the
        // chain; g's write (1000 us), the job (5000 us), w's read (1000 us) and the ops.
        let (trace, schedule) = cpu_step(3, 5000.0);
        let report = replay(&trace, &schedule, &hardware(1e9)).unwrap();
        assert!((report.iteration_time_us - 29000.0).abs() < 1.0, "{}", report.iteration_time_us);
        // A faster link shortens the chain by the write and the read only.
        let fast = replay(&trace, &schedule, &hardware(1e15)).unwrap();
        assert!((fast.iteration_time_us - 27000.0).abs() < 1.0, "{}", fast.iteration_time_us);
    }

    /// Two units' jobs, both queued after the last op: A reads g1 (10 MB, written after the
    /// last op) and writes w1, B reads g2 (1 MB, written before op 1) and writes w2; 1000 us
    /// each; w1 and w2 (1 MB each) are read before op 0. `b_first`: B is queued before A.
    fn two_jobs(b_first: bool) -> (Trace, Schedule) {
        let op = |name: &str| Op { name: name.into(), duration_us: 1000.0, layer: None, phase: Phase::Other };
        let weight = |id: u64| unit_weight(id, &format!("w{id}"));
        let gradient = |id: u64, size_bytes: u64| unit_gradient(id, &format!("g{id}"), size_bytes);
        let trace = Trace {
            format_version: FORMAT_VERSION,
            description: "two CPU jobs".into(),
            gpu_capacity_bytes: 1 << 40,
            ops: vec![op("forward"), op("backward")],
            tensors: vec![weight(1), weight(2), gradient(11, 10_000_000), gradient(12, 1_000_000)],
        };
        let transfer = |op: u32, tensor_id: u64, kind: ActionKind| Issued { op, tensor_id, kind, tier: Tier::Host };
        let job = |waits: u64, produces: u64| CpuJob {
            op: 2,
            duration_us: 1000.0,
            waits_for: vec![waits],
            produces: vec![produces],
        };
        let mut cpu_jobs = vec![job(11, 1), job(12, 2)];
        if b_first {
            cpu_jobs.reverse();
        }
        let schedule = Schedule {
            transfers: vec![
                transfer(0, 1, ActionKind::Prefetch),
                transfer(0, 2, ActionKind::Prefetch),
                transfer(1, 12, ActionKind::Offload),
                transfer(2, 1, ActionKind::Drop),
                transfer(2, 2, ActionKind::Drop),
                transfer(2, 11, ActionKind::Offload),
            ],
            cpu_jobs,
        };
        (trace, schedule)
    }

    #[test]
    fn cpu_jobs_run_one_at_a_time_in_the_order_they_were_queued() {
        // A first: A waits for g1's write (10000 us), runs (1000 us); B, ready long before,
        // runs after it (1000 us); w1's read overlaps B, w2's read follows B (1000 us); then
        // ops 0 and 1.
        let (trace, schedule) = two_jobs(false);
        let report = replay(&trace, &schedule, &hardware(1e9)).unwrap();
        assert!((report.iteration_time_us - 15000.0).abs() < 1.0, "{}", report.iteration_time_us);
        // B first: B runs at once and w2 is read meanwhile; A and w1's read follow g1's write.
        let (trace, schedule) = two_jobs(true);
        let report = replay(&trace, &schedule, &hardware(1e9)).unwrap();
        assert!((report.iteration_time_us - 14000.0).abs() < 1.0, "{}", report.iteration_time_us);
    }

    #[test]
    fn cpu_jobs_the_replay_cannot_run_are_refused_naming_what_is_wrong() {
        let (trace, schedule) = cpu_step(2, 5000.0);
        let refused = |change: &dyn Fn(&mut CpuJob)| {
            let mut broken = schedule.clone();
            change(&mut broken.cpu_jobs[0]);
            match plan_from_schedule(&trace, &broken, 1 << 40) {
                Err(Error::InvalidPlan(why)) => why,
                other => panic!("accepted: {other:?}"),
            }
        };
        assert!(refused(&|job| job.waits_for = vec![9]).contains("tensor 9, which the trace lacks"));
        assert!(refused(&|job| job.produces = vec![9]).contains("tensor 9, which the trace lacks"));
        assert!(refused(&|job| job.op = 1).contains("waits for tensor 2, which has no departure before it"));
        assert!(refused(&|job| job.produces = vec![2]).contains("does not outlive the iteration"));
        assert!(refused(&|job| job.duration_us = -1.0).contains("not a time"));
        assert!(refused(&|job| job.duration_us = f64::NAN).contains("not a time"));
        assert!(refused(&|job| job.op = 4).contains("the trace has 3 ops"));
        let mut unordered = schedule.clone();
        unordered.cpu_jobs.insert(0, CpuJob { op: 3, duration_us: 1.0, waits_for: Vec::new(), produces: Vec::new() });
        assert!(matches!(plan_from_schedule(&trace, &unordered, 1 << 40), Err(Error::InvalidPlan(_))));
        let mut dropped = schedule.clone();
        dropped.transfers[2].kind = ActionKind::Drop;
        assert!(matches!(plan_from_schedule(&trace, &dropped, 1 << 40), Err(Error::InvalidPlan(_))));
    }

    #[test]
    fn a_schedule_without_cpu_jobs_parses_as_before_and_unknown_fields_are_refused() {
        let old: Schedule =
            serde_json::from_str(r#"{"transfers": [{"op": 0, "tensor_id": 7, "kind": "prefetch", "tier": "host"}]}"#)
                .unwrap();
        assert_eq!(old, only(&[issued(0, ActionKind::Prefetch)]));
        assert_eq!(
            serde_json::to_string(&old).unwrap(),
            r#"{"transfers":[{"op":0,"tensor_id":7,"kind":"prefetch","tier":"host"}]}"#
        );
        let (_, schedule) = cpu_step(3, 5000.0);
        let text = serde_json::to_string(&schedule).unwrap();
        assert!(
            text.contains(r#""cpu_jobs":[{"op":3,"duration_us":5000.0,"waits_for":[2],"produces":[1]}]"#),
            "{text}"
        );
        assert_eq!(serde_json::from_str::<Schedule>(&text).unwrap(), schedule);
        assert!(serde_json::from_str::<Schedule>(r#"{"transfers": [], "cpu_job": []}"#).is_err());
    }
}
