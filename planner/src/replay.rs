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

use std::collections::HashMap;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::hardware::Hardware;
use crate::plan::{ActionKind, Migration, Plan, Tier};
use crate::sim::{simulate, Policy, SimConfig, SimReport};
use crate::trace::Trace;

/// The policy name replayed plans carry.
pub const REPLAY_POLICY: &str = "replayed schedule";

/// Iterations a replay runs back to back (the last is reported): where a tier cannot keep up,
/// its backlog grows over the first iterations, and the last must show the steady state. On
/// the H100 a record whose store writes took longer than the iteration's GPU work settled at
/// the third.
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

/// A recorded schedule as JSON clients send it: `{"transfers": [...]}`, in issue order.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Schedule {
    /// Every transfer of one iteration, in the order the runtime issued them.
    pub transfers: Vec<Issued>,
}

/// The plan that executes `transfers` (issue order) on `trace`. Per tensor the transfers must
/// alternate between a departure (offload or drop) and a prefetch from the same tier; where the
/// first is a prefetch, the tensor starts the iteration on its tier and the last departure's
/// period wraps. Anything else is `Error::InvalidPlan`, naming the tensor.
pub fn plan_from_schedule(trace: &Trace, transfers: &[Issued], gpu_capacity_bytes: u64) -> Result<Plan> {
    let op_count = trace.ops.len() as u32;
    let index_of: HashMap<u64, u32> = trace.tensors.iter().enumerate().map(|(i, t)| (t.id, i as u32)).collect();
    let mut per_tensor: HashMap<u32, Vec<Issued>> = HashMap::new();
    for issued in transfers {
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
    Ok(Plan::new(REPLAY_POLICY, trace, gpu_capacity_bytes, 0, migrations))
}

/// Replays `transfers` on `trace` (see the module docs) and returns the simulator's report.
pub fn replay(trace: &Trace, transfers: &[Issued], hardware: &Hardware) -> Result<SimReport> {
    trace.validate()?;
    hardware.validate()?;
    let plan = plan_from_schedule(trace, transfers, hardware.gpu_capacity_bytes)?;
    let config = SimConfig { iterations: REPLAY_ITERATIONS, reads_wait_for_writes: true };
    simulate(trace, hardware, Policy::Planned(&plan), config)
}

#[cfg(test)]
mod tests {
    use super::*;
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
        let plan = plan_from_schedule(&trace(), &transfers, 1 << 40).unwrap();
        assert_eq!(plan.migrations.len(), 2);
        assert!(plan.migrations.iter().any(|m| m.offloaded_at_start && m.offload_op == 2 && m.writes));
        // 1 MB at 1 GB/s: 1000 us per read, one write; nothing hides the reads.
        let report = replay(&trace(), &transfers, &hardware(1e9)).unwrap();
        assert_eq!(report.downgraded_drops, 0, "the host copy was current: the drop must not write");
        assert_eq!(report.host_read_bytes, 2_000_000);
        assert_eq!(report.host_written_bytes, 1_000_000);
        assert!((report.iteration_time_us - 7200.0).abs() < 1.0, "{}", report.iteration_time_us);
        // Far faster link: the ops alone.
        let fast = replay(&trace(), &transfers, &hardware(1e15)).unwrap();
        assert!((fast.iteration_time_us - 5200.0).abs() < 1.0, "{}", fast.iteration_time_us);
        // Written back after the last op: the same as before the next iteration's first.
        let after_last = [transfers[0], transfers[1], transfers[2], issued(3, ActionKind::Offload)];
        let plan = plan_from_schedule(&trace(), &after_last, 1 << 40).unwrap();
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
        let one_way = replay(&trace, &transfers, &hardware(1e9)).unwrap();
        assert!((one_way.iteration_time_us - 7020.0).abs() < 1.0, "{}", one_way.iteration_time_us);
        // Both directions at once at 0.5 GB/s each: w's read takes 2000 us; g's read alone
        // before op 0 still goes at the one-way rate.
        let duplex = Hardware { host_link_duplex_bytes_per_s: Some(0.5e9), ..hardware(1e9) };
        let shared = replay(&trace, &transfers, &duplex).unwrap();
        assert!((shared.iteration_time_us - 8020.0).abs() < 1.0, "{}", shared.iteration_time_us);
        // A duplex rate equal to the one-way rate changes nothing.
        let as_fast = Hardware { host_link_duplex_bytes_per_s: Some(1e9), ..hardware(1e9) };
        let same = replay(&trace, &transfers, &as_fast).unwrap();
        assert!((same.iteration_time_us - one_way.iteration_time_us).abs() < 1e-6);
    }

    #[test]
    fn a_transfer_alone_goes_back_to_the_one_way_rate_when_the_other_direction_ends() {
        // w's 1 MB read while g's 0.5 MB write runs: both at 0.5 GB/s until the write ends
        // (1000 us, 0.5 MB read), then the read's other 0.5 MB at 1 GB/s (500 us).
        let (trace, transfers) = read_during_write(500_000, 20000.0);
        let duplex = Hardware { host_link_duplex_bytes_per_s: Some(0.5e9), ..hardware(1e9) };
        let report = replay(&trace, &transfers, &duplex).unwrap();
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
        let report = replay(&trace, &transfers, &hardware(1e9)).unwrap();
        assert_eq!(report.host_read_bytes, 1_000_000, "the tensor must be read back, not kept");
        assert_eq!(report.host_written_bytes, 1_000_000);
        // Each iteration: op 2 (100 us, the write's first 100 us), the write's other 900 us, the
        // read (1000 us), ops 0 and 1.
        assert!((report.iteration_time_us - 2200.0).abs() < 1.0, "{}", report.iteration_time_us);
        // The planner's executor keeps it instead: no read, no wait.
        let plan = plan_from_schedule(&trace, &transfers, 1 << 40).unwrap();
        let kept = simulate(&trace, &hardware(1e9), Policy::Planned(&plan), SimConfig::default()).unwrap();
        assert_eq!(kept.host_read_bytes, 0);
        assert!(kept.iteration_time_us < 1000.0, "{}", kept.iteration_time_us);
    }

    #[test]
    fn transfers_that_do_not_pair_up_are_refused() {
        let twice = [issued(0, ActionKind::Prefetch), issued(1, ActionKind::Prefetch)];
        assert!(matches!(plan_from_schedule(&trace(), &twice, 1 << 40), Err(Error::InvalidPlan(_))));
        let other_tier =
            [Issued { tier: Tier::Ssd, ..issued(0, ActionKind::Prefetch) }, issued(1, ActionKind::Offload)];
        assert!(matches!(plan_from_schedule(&trace(), &other_tier, 1 << 40), Err(Error::InvalidPlan(_))));
        let unknown = [Issued { tensor_id: 8, ..issued(0, ActionKind::Prefetch) }];
        assert!(matches!(plan_from_schedule(&trace(), &unknown, 1 << 40), Err(Error::InvalidPlan(_))));
        let late = [issued(4, ActionKind::Prefetch), issued(1, ActionKind::Offload)];
        assert!(matches!(plan_from_schedule(&trace(), &late, 1 << 40), Err(Error::InvalidPlan(_))));
    }
}
