//! Lifetime analysis: the time axis of the iteration (op start times), the memory pressure at
//! every op when nothing is moved, and every tensor's inactive periods (gaps between uses;
//! persistent tensors get one more that wraps into the next iteration).
//!
//! Slots are ops. A period is given in *virtual* slots `0..2n` so that a wrapping period is one
//! contiguous range; slot `k` of the iteration is virtual slot `k` or `k + n`.

use crate::trace::{Access, Trace};

/// Op start times and durations.
#[derive(Debug, Clone)]
pub struct Timeline {
    /// Duration of each op.
    pub duration_us: Vec<f64>,
    /// Start of each op when nothing stalls.
    pub start_us: Vec<f64>,
    /// Sum of durations.
    pub total_us: f64,
}

impl Timeline {
    /// Builds the stall-free time axis of a trace.
    pub fn new(trace: &Trace) -> Self {
        let duration_us: Vec<f64> = trace.ops.iter().map(|op| op.duration_us).collect();
        let mut start_us = Vec::with_capacity(duration_us.len());
        let mut now = 0.0;
        for d in &duration_us {
            start_us.push(now);
            now += d;
        }
        Timeline { duration_us, start_us, total_us: now }
    }

    /// Number of slots (ops).
    pub fn slot_count(&self) -> usize {
        self.duration_us.len()
    }

    /// Duration of a virtual slot.
    pub fn virtual_duration_us(&self, virtual_slot: usize) -> f64 {
        self.duration_us[virtual_slot % self.duration_us.len()]
    }
}

/// GPU memory in use at each op when no tensor is moved.
pub fn base_pressure_bytes(trace: &Trace) -> Vec<u64> {
    let n = trace.ops.len();
    let mut delta = vec![0i128; n + 1];
    for tensor in &trace.tensors {
        let from = tensor.live_from_op() as usize;
        let to = tensor.live_to_op(n as u32) as usize;
        delta[from] += i128::from(tensor.size_bytes);
        delta[to + 1] -= i128::from(tensor.size_bytes);
    }
    let mut pressure = Vec::with_capacity(n);
    let mut running = 0i128;
    for d in delta.iter().take(n) {
        running += d;
        pressure.push(running as u64);
    }
    pressure
}

/// One gap between two uses of a tensor: the tensor is not needed in virtual slots
/// `start_slot..end_slot`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InactivePeriod {
    /// Index into `Trace::tensors`.
    pub tensor: u32,
    /// Index of the use that opens the period (the period follows it).
    pub after_use: u32,
    /// First slot without a use (the op after the last use).
    pub start_slot: u32,
    /// The slot of the next use (exclusive end); `>= n` when the period wraps.
    pub end_slot: u32,
    /// Access of the use that closes the period.
    pub closing_access: Access,
}

impl InactivePeriod {
    /// Slots in the period.
    pub fn length_slots(&self) -> u32 {
        self.end_slot - self.start_slot
    }

    /// True when the period crosses the iteration boundary.
    pub fn wraps(&self, slot_count: usize) -> bool {
        self.end_slot as usize > slot_count
    }
}

/// Shortest period worth considering: one slot to offload in and one to be absent in.
pub const PERIOD_SLOTS_MIN: u32 = 2;

/// All inactive periods of all tensors, in tensor order then time order.
pub fn inactive_periods(trace: &Trace) -> Vec<InactivePeriod> {
    let n = trace.ops.len() as u32;
    let mut periods = Vec::new();
    for (index, tensor) in trace.tensors.iter().enumerate() {
        let uses = &tensor.uses;
        for (use_index, pair) in uses.windows(2).enumerate() {
            let period = InactivePeriod {
                tensor: index as u32,
                after_use: use_index as u32,
                start_slot: pair[0].op + 1,
                end_slot: pair[1].op,
                closing_access: pair[1].access,
            };
            if period.length_slots() >= PERIOD_SLOTS_MIN {
                periods.push(period);
            }
        }
        if tensor.is_persistent() {
            let last = uses[uses.len() - 1];
            let period = InactivePeriod {
                tensor: index as u32,
                after_use: (uses.len() - 1) as u32,
                start_slot: last.op + 1,
                end_slot: uses[0].op + n,
                closing_access: uses[0].access,
            };
            if period.length_slots() >= PERIOD_SLOTS_MIN {
                periods.push(period);
            }
        }
    }
    periods
}

/// True when a copy written out during an earlier offloaded period of `tensor` is still up to
/// date when the period after use `after_use` starts: walking back from that use, only reads
/// happen before reaching a period for which `offloaded_after(period_after_use)` holds.
/// Persistent tensors walk back across the iteration boundary.
pub fn copy_still_valid(tensor: &crate::trace::Tensor, after_use: u32, offloaded_after: impl Fn(u32) -> bool) -> bool {
    let use_count = tensor.uses.len() as u32;
    let mut use_index = after_use;
    for _ in 0..use_count {
        if tensor.uses[use_index as usize].access == Access::Write {
            return false;
        }
        let previous_period = if use_index == 0 {
            if !tensor.is_persistent() {
                return false;
            }
            use_count - 1
        } else {
            use_index - 1
        };
        if offloaded_after(previous_period) {
            return true;
        }
        use_index = previous_period;
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trace::{Op, Phase, Tensor, TensorKind, TensorUse, FORMAT_VERSION};

    fn trace() -> Trace {
        let read = |op| TensorUse { op, access: Access::Read };
        Trace {
            format_version: FORMAT_VERSION,
            description: String::new(),
            gpu_capacity_bytes: 100,
            ops: (0..10)
                .map(|i| Op { name: format!("op{i}"), duration_us: 1.0 + i as f64, layer: None, phase: Phase::Other })
                .collect(),
            tensors: vec![
                Tensor {
                    id: 1,
                    name: "w".into(),
                    size_bytes: 10,
                    kind: TensorKind::Weight,
                    alloc_op: None,
                    free_op: None,
                    uses: vec![read(2), read(3), read(7)],
                },
                Tensor {
                    id: 2,
                    name: "a".into(),
                    size_bytes: 5,
                    kind: TensorKind::Activation,
                    alloc_op: Some(1),
                    free_op: Some(8),
                    uses: vec![read(1), read(8)],
                },
            ],
        }
    }

    #[test]
    fn periods_skip_short_gaps_and_wrap_for_persistent_tensors() {
        let periods = inactive_periods(&trace());
        let spans: Vec<(u32, u32, u32)> = periods.iter().map(|p| (p.tensor, p.start_slot, p.end_slot)).collect();
        // 2->3 is too short; 3->7 is a period; 7->2 wraps (8..12); activation 1->8.
        assert_eq!(spans, vec![(0, 4, 7), (0, 8, 12), (1, 2, 8)]);
        assert!(periods[1].wraps(10));
    }

    #[test]
    fn pressure_counts_live_tensors() {
        let pressure = base_pressure_bytes(&trace());
        assert_eq!(pressure[0], 10);
        assert_eq!(pressure[1], 15);
        assert_eq!(pressure[8], 15);
        assert_eq!(pressure[9], 10);
        let timeline = Timeline::new(&trace());
        assert_eq!(timeline.start_us[2], 3.0);
        assert_eq!(timeline.total_us, 55.0);
    }
}
