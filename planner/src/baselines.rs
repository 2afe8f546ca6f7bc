//! Baseline policies to compare the planner with, all replayed by the same simulator:
//! ideal (unlimited GPU memory), a ZeRO-Infinity-like policy (parameters, gradients and optimizer
//! state at layer granularity, prefetched one layer ahead, bandwidth-unaware, host memory first
//! then SSD), a FlashNeuron-like policy (activations only, to SSD, largest first until the
//! estimate fits) and LRU swapping (on demand, in the simulator).

use crate::hardware::Hardware;
use crate::lifetime::{base_pressure_bytes, copy_still_valid, inactive_periods, InactivePeriod};
use crate::plan::{Migration, Plan, Tier};
use crate::trace::{Phase, TensorKind, Trace};

/// Hardware with GPU memory large enough for anything (the ideal baseline).
pub fn unlimited(hardware: &Hardware) -> Hardware {
    Hardware { gpu_capacity_bytes: u64::MAX / 4, ..*hardware }
}

/// For each op, the first op of the (layer, phase) group before its own group, cyclically:
/// where a layer-granular prefetcher issues the fetch for this op.
fn previous_group_start(trace: &Trace) -> Vec<u32> {
    let n = trace.ops.len();
    let key = |op: usize| -> (Option<u32>, Phase) { (trace.ops[op].layer, trace.ops[op].phase) };
    let mut starts = vec![0u32];
    for op in 1..n {
        if key(op) != key(op - 1) {
            starts.push(op as u32);
        }
    }
    let mut previous = vec![0u32; n];
    let mut group = 0usize;
    for (op, slot) in previous.iter_mut().enumerate() {
        while group + 1 < starts.len() && starts[group + 1] as usize <= op {
            group += 1;
        }
        *slot = if group == 0 { starts[starts.len() - 1] } else { starts[group - 1] };
    }
    previous
}

/// Turns chosen periods into migrations with instant-transfer timing: absent from the slot after
/// the offload is issued (or at once for a clean drop) until the prefetch issue slot.
fn migrations_from(trace: &Trace, chosen: &[(InactivePeriod, u32, Tier)]) -> Vec<Migration> {
    let n = trace.ops.len() as u32;
    chosen
        .iter()
        .map(|&(period, prefetch_slot, tier)| {
            let tensor = &trace.tensors[period.tensor as usize];
            let clean = tier == Tier::Ssd
                && copy_still_valid(tensor, period.after_use, |after_use| {
                    chosen
                        .iter()
                        .any(|(p, _, t)| p.tensor == period.tensor && p.after_use == after_use && *t == Tier::Ssd)
                });
            let absent_from_slot = if clean { period.start_slot } else { period.start_slot + 1 };
            Migration {
                tensor_id: tensor.id,
                tensor_index: period.tensor,
                tier,
                offload_op: period.start_slot % n,
                writes: !clean,
                prefetch_op: prefetch_slot % n,
                next_use_op: period.end_slot % n,
                absent_from_slot,
                absent_to_slot: prefetch_slot.max(absent_from_slot),
                wraps: period.end_slot > n,
                offloaded_at_start: period.end_slot > n && prefetch_slot >= n,
                offload_urgent: false,
                prefetch_urgent: false,
                offload_stalls: false,
                prefetch_stalls: false,
            }
        })
        .collect()
}

/// Peak of the memory estimate under migrations with instant transfers.
fn estimated_peak(trace: &Trace, migrations: &[Migration]) -> u64 {
    let mut pressure = base_pressure_bytes(trace);
    apply_absences(trace, &mut pressure, migrations);
    pressure.into_iter().max().unwrap_or(0)
}

fn apply_absences(trace: &Trace, pressure: &mut [u64], migrations: &[Migration]) {
    let n = pressure.len() as u32;
    for m in migrations {
        let size = trace.tensors[m.tensor_index as usize].size_bytes;
        for slot in m.absent_from_slot..m.absent_to_slot {
            pressure[(slot % n) as usize] -= size;
        }
    }
}

/// Prefetch slot one layer group ahead of the period's end; `None` if that is not after the
/// period's start.
fn layer_ahead_prefetch(period: &InactivePeriod, previous_start: &[u32]) -> Option<u32> {
    let n = previous_start.len() as u32;
    let next_use_op = period.end_slot % n;
    let gap = (next_use_op + n - previous_start[next_use_op as usize]) % n;
    let gap = if gap == 0 { 1 } else { gap };
    let prefetch_slot = period.end_slot.checked_sub(gap)?;
    (prefetch_slot > period.start_slot + 1).then_some(prefetch_slot)
}

/// ZeRO-Infinity-like: every inactive period of parameters, gradients and optimizer states is
/// offloaded right after use and fetched one layer ahead, whether memory needs it or not and
/// whatever bandwidth is in use. Host memory holds whole tensors up to its capacity (in order of
/// first use), the rest go to the SSD. Activations stay on the GPU.
pub fn zero_infinity_like(trace: &Trace, hardware: &Hardware) -> Plan {
    let previous_start = previous_group_start(trace);
    let mut host_left = hardware.host_capacity_bytes;
    let mut tier_of = vec![Tier::Ssd; trace.tensors.len()];
    let mut order: Vec<usize> = (0..trace.tensors.len()).collect();
    order.sort_by_key(|&t| (trace.tensors[t].uses[0].op, t));
    for t in order {
        let size = trace.tensors[t].size_bytes;
        if size <= host_left {
            host_left -= size;
            tier_of[t] = Tier::Host;
        }
    }
    let chosen: Vec<(InactivePeriod, u32, Tier)> = inactive_periods(trace)
        .into_iter()
        .filter(|p| {
            matches!(
                trace.tensors[p.tensor as usize].kind,
                TensorKind::Weight | TensorKind::Gradient | TensorKind::OptimizerState
            )
        })
        .filter_map(|p| layer_ahead_prefetch(&p, &previous_start).map(|slot| (p, slot, tier_of[p.tensor as usize])))
        .collect();
    let migrations = migrations_from(trace, &chosen);
    let peak = estimated_peak(trace, &migrations);
    Plan::new("zero-infinity", trace, hardware.gpu_capacity_bytes, peak, migrations)
}

/// FlashNeuron-like: activations only, to the SSD, largest first, until the memory estimate
/// (instant transfers) fits; each is fetched one layer ahead of its backward use.
pub fn flashneuron_like(trace: &Trace, hardware: &Hardware) -> Plan {
    let previous_start = previous_group_start(trace);
    let mut candidates: Vec<(InactivePeriod, u32)> = inactive_periods(trace)
        .into_iter()
        .filter(|p| trace.tensors[p.tensor as usize].kind == TensorKind::Activation)
        .filter_map(|p| layer_ahead_prefetch(&p, &previous_start).map(|slot| (p, slot)))
        .collect();
    candidates
        .sort_by_key(|(p, _)| (std::cmp::Reverse(trace.tensors[p.tensor as usize].size_bytes), p.tensor, p.start_slot));
    let mut pressure = base_pressure_bytes(trace);
    let capacity = hardware.gpu_capacity_bytes;
    let mut chosen = Vec::new();
    for (period, prefetch_slot) in candidates {
        if pressure.iter().all(|&p| p <= capacity) {
            break;
        }
        let migration = migrations_from(trace, &[(period, prefetch_slot, Tier::Ssd)]);
        apply_absences(trace, &mut pressure, &migration);
        chosen.push((period, prefetch_slot, Tier::Ssd));
    }
    let migrations = migrations_from(trace, &chosen);
    let peak = estimated_peak(trace, &migrations);
    Plan::new("flashneuron", trace, capacity, peak, migrations)
}
