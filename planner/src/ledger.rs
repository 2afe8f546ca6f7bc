//! Per-slot bandwidth and host-memory bookkeeping for the planner: how many bytes each migration
//! channel (SSD write, SSD read, host write, host read) has already committed in each op slot, and
//! how much host memory is held. A transfer is split over as many slots as it needs; it never
//! takes more than a slot's remaining budget, so no slot is ever over-committed.

use crate::hardware::Hardware;
use crate::lifetime::Timeline;
use crate::plan::Tier;
use crate::pressure::PressureTree;

/// Direction of a transfer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    /// GPU to tier.
    Write,
    /// Tier to GPU.
    Read,
}

/// Channel index for (tier, direction).
pub fn channel_index(tier: Tier, direction: Direction) -> usize {
    tier.index() * 2
        + match direction {
            Direction::Write => 0,
            Direction::Read => 1,
        }
}

/// Names of the four channels, by index.
pub const CHANNEL_NAMES: [&str; 4] = ["ssd_write", "ssd_read", "host_write", "host_read"];

/// Committed bytes and budgets per channel and slot.
#[derive(Debug, Clone)]
pub struct Ledger {
    slot_count: usize,
    /// Budget of each channel in each slot: bandwidth times the op's duration.
    pub budget_bytes: [Vec<f64>; 4],
    /// Bytes already committed by bandwidth-feasible migrations (never above the budget).
    pub committed_bytes: [Vec<f64>; 4],
    /// Bytes of stall-accepting transfers (second phase), put whole at the edge of their window:
    /// the GPU waits for them. Kept apart so that `committed_bytes` never exceeds the budget.
    pub overflow_bytes: [Vec<f64>; 4],
    /// Fixed per-transfer cost expressed in bytes of each channel (latency times bandwidth).
    latency_bytes: [f64; 4],
    /// Host memory held in each slot, as excess over the host capacity (a segment tree, so
    /// that the check over a long period is O(log n)).
    host_held: PressureTree,
    /// Host memory the plan may hold at any time.
    pub host_capacity_bytes: u64,
    /// SSD reads and writes share each slot's device time (`Hardware::ssd_shared`).
    ssd_shared: bool,
    /// SSD bytes also take host-link bytes in the same direction (`Hardware::ssd_via_host_link`).
    ssd_via_host_link: bool,
}

/// A transfer's span: it runs from `first_slot` to `last_slot` (virtual slots, inclusive).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Span {
    /// First slot used.
    pub first_slot: u32,
    /// Last slot used (the transfer completes inside it).
    pub last_slot: u32,
}

/// Budget below which a slot counts as full (avoids walking over crumbs).
const CRUMB_BYTES: f64 = 1.0;

impl Ledger {
    /// An empty ledger for the timeline and hardware.
    pub fn new(timeline: &Timeline, hardware: &Hardware) -> Self {
        let rates = [
            hardware.ssd_write_bytes_per_s,
            hardware.ssd_read_bytes_per_s,
            hardware.host_link_bytes_per_s,
            hardware.host_link_bytes_per_s,
        ];
        let latency_us =
            [hardware.ssd_latency_us, hardware.ssd_latency_us, hardware.host_latency_us, hardware.host_latency_us];
        let slot_count = timeline.slot_count();
        let budget = |rate: f64| -> Vec<f64> { timeline.duration_us.iter().map(|d| d * 1e-6 * rate).collect() };
        Ledger {
            slot_count,
            budget_bytes: rates.map(budget),
            committed_bytes: std::array::from_fn(|_| vec![0.0; slot_count]),
            overflow_bytes: std::array::from_fn(|_| vec![0.0; slot_count]),
            latency_bytes: std::array::from_fn(|i| latency_us[i] * 1e-6 * rates[i]),
            host_held: PressureTree::new(&vec![0; slot_count], hardware.host_capacity_bytes, &timeline.duration_us),
            host_capacity_bytes: hardware.host_capacity_bytes,
            ssd_shared: hardware.ssd_shared,
            ssd_via_host_link: hardware.ssd_via_host_link,
        }
    }

    /// The host-link channel an SSD channel's bytes also cross, if they do.
    fn link_of(&self, channel: usize) -> Option<usize> {
        (self.ssd_via_host_link && channel < 2).then_some(channel + 2)
    }

    fn free_bytes(&self, channel: usize, virtual_slot: usize) -> f64 {
        let device_free = self.device_free_bytes(channel, virtual_slot);
        match self.link_of(channel) {
            Some(link) => device_free.min(self.device_free_bytes(link, virtual_slot)),
            None => device_free,
        }
    }

    /// What is left of the channel's own budget in the slot (the SSD's time when shared; a
    /// host channel's budget is the link, which SSD transfers may also have taken).
    fn device_free_bytes(&self, channel: usize, virtual_slot: usize) -> f64 {
        let slot = virtual_slot % self.slot_count;
        if self.ssd_shared && channel < 2 {
            // One device time for both directions: what is left of the slot, at this direction's rate.
            let used: f64 = (0..2)
                .filter(|&c| self.budget_bytes[c][slot] > 0.0)
                .map(|c| self.committed_bytes[c][slot] / self.budget_bytes[c][slot])
                .sum();
            return ((1.0 - used) * self.budget_bytes[channel][slot]).max(0.0);
        }
        (self.budget_bytes[channel][slot] - self.committed_bytes[channel][slot]).max(0.0)
    }

    /// Bytes a transfer of `size_bytes` costs on a channel, latency included.
    pub fn transfer_bytes(&self, channel: usize, size_bytes: u64) -> f64 {
        size_bytes as f64 + self.latency_bytes[channel]
    }

    /// Earliest span of a transfer that starts at `from_slot` and goes forward, finishing before
    /// `limit_slot` (exclusive); `None` if the free budget before the limit is too small.
    pub fn fit_forward(&self, channel: usize, size_bytes: u64, from_slot: u32, limit_slot: u32) -> Option<Span> {
        let mut remaining = self.transfer_bytes(channel, size_bytes);
        let mut first = None;
        for slot in from_slot..limit_slot {
            let free = self.free_bytes(channel, slot as usize);
            if free <= CRUMB_BYTES {
                continue;
            }
            first.get_or_insert(slot);
            remaining -= free;
            if remaining <= 0.0 {
                return Some(Span { first_slot: first.unwrap_or(slot), last_slot: slot });
            }
        }
        None
    }

    /// Latest span of a transfer that must finish by the end of slot `end_slot - 1`, going
    /// backwards but not before `floor_slot` (inclusive); the span's `first_slot` is where it
    /// must be issued.
    pub fn fit_backward(&self, channel: usize, size_bytes: u64, end_slot: u32, floor_slot: u32) -> Option<Span> {
        let mut remaining = self.transfer_bytes(channel, size_bytes);
        let mut last = None;
        let mut slot = end_slot;
        while slot > floor_slot {
            slot -= 1;
            let free = self.free_bytes(channel, slot as usize);
            if free <= CRUMB_BYTES {
                continue;
            }
            last.get_or_insert(slot);
            remaining -= free;
            if remaining <= 0.0 {
                return Some(Span { first_slot: slot, last_slot: last.unwrap_or(slot) });
            }
        }
        None
    }

    /// Commits a transfer over `span` in the given direction of fill (forward spans fill from
    /// the first slot, backward spans from the last), exactly as the matching `fit_*` found it.
    /// Returns the (slot, bytes) taken so that the commitment can be undone.
    pub fn commit(&mut self, channel: usize, size_bytes: u64, span: Span, forward: bool) -> Vec<(u32, f64)> {
        let mut remaining = self.transfer_bytes(channel, size_bytes);
        let mut taken = Vec::new();
        let slots: Box<dyn Iterator<Item = u32>> = if forward {
            Box::new(span.first_slot..=span.last_slot)
        } else {
            Box::new((span.first_slot..=span.last_slot).rev())
        };
        for slot in slots {
            if remaining <= 0.0 {
                break;
            }
            let free = self.free_bytes(channel, slot as usize);
            if free <= CRUMB_BYTES {
                continue;
            }
            let take = free.min(remaining);
            let slot = slot % self.slot_count as u32;
            self.committed_bytes[channel][slot as usize] += take;
            if let Some(link) = self.link_of(channel) {
                self.committed_bytes[link][slot as usize] += take;
            }
            taken.push((slot, take));
            remaining -= take;
        }
        debug_assert!(remaining <= 1e-3 * self.transfer_bytes(channel, size_bytes) + 1.0);
        taken
    }

    /// Gives back what [`Ledger::commit`] took.
    pub fn uncommit(&mut self, channel: usize, taken: &[(u32, f64)]) {
        let link = self.link_of(channel);
        for &(slot, bytes) in taken {
            for c in std::iter::once(channel).chain(link) {
                let committed = &mut self.committed_bytes[c][slot as usize];
                *committed = (*committed - bytes).max(0.0);
            }
        }
    }

    /// True when `size_bytes` more host memory fits in every slot of `from..to` (virtual).
    pub fn host_fits(&mut self, size_bytes: u64, from_slot: u32, to_slot: u32) -> bool {
        self.host_held.max_excess_in(from_slot, to_slot) + size_bytes as i64 <= 0
    }

    /// Holds host memory over `from..to` (virtual slots).
    pub fn hold_host(&mut self, size_bytes: u64, from_slot: u32, to_slot: u32) {
        self.host_held.add(from_slot, to_slot, size_bytes as i64);
    }

    /// Host memory held in each slot.
    pub fn host_held_bytes(&mut self) -> Vec<u64> {
        let capacity = self.host_capacity_bytes as i64;
        self.host_held.excess_per_slot().into_iter().map(|excess| (excess + capacity).max(0) as u64).collect()
    }

    /// Records a stall-accepting transfer in `virtual_slot`.
    pub fn record_stall(&mut self, channel: usize, virtual_slot: u32, size_bytes: u64) {
        let bytes = self.transfer_bytes(channel, size_bytes);
        for c in std::iter::once(channel).chain(self.link_of(channel)) {
            self.overflow_bytes[c][virtual_slot as usize % self.slot_count] += bytes;
        }
    }

    /// Bytes committed beyond the feasible budget (second phase), over all channels.
    pub fn overflow_total_bytes(&self) -> f64 {
        self.overflow_bytes.iter().flatten().sum()
    }

    /// The largest over-commitment of any channel in any slot (0 when the budget is kept).
    pub fn worst_overcommit_bytes(&self) -> f64 {
        let mut worst: f64 = 0.0;
        for channel in 0..4 {
            for slot in 0..self.slot_count {
                worst = worst.max(self.committed_bytes[channel][slot] - self.budget_bytes[channel][slot]);
            }
        }
        worst
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lifetime::Timeline;
    use crate::trace::{Access, Op, Phase, Tensor, TensorKind, TensorUse, Trace, FORMAT_VERSION};
    use teraio_units::ReadWriteBandwidth;

    fn ledger() -> Ledger {
        let trace = Trace {
            format_version: FORMAT_VERSION,
            description: String::new(),
            gpu_capacity_bytes: 1,
            ops: (0..4)
                .map(|i| Op { name: format!("op{i}"), duration_us: 1000.0, layer: None, phase: Phase::Other })
                .collect(),
            tensors: vec![Tensor {
                id: 0,
                name: String::new(),
                size_bytes: 1,
                kind: TensorKind::Weight,
                alloc_op: None,
                free_op: None,
                uses: vec![TensorUse { op: 0, access: Access::Read }],
            }],
        };
        // 1 GB/s and no latency: 1 MB per 1 ms slot.
        let ssd = ReadWriteBandwidth { read_bytes_per_s: 1e9, write_bytes_per_s: 1e9 };
        let mut hardware = Hardware::new(1, ssd, 0);
        hardware.ssd_latency_us = 0.0;
        Ledger::new(&Timeline::new(&trace), &hardware)
    }

    #[test]
    fn transfers_split_over_slots_and_never_overcommit() {
        let mut ledger = ledger();
        let channel = channel_index(Tier::Ssd, Direction::Write);
        let span = ledger.fit_forward(channel, 1_500_000, 0, 4).unwrap();
        assert_eq!(span, Span { first_slot: 0, last_slot: 1 });
        ledger.commit(channel, 1_500_000, span, true);
        // Half of slot 1 is left: the next 1 MB takes it and half of slot 2.
        let span = ledger.fit_forward(channel, 1_000_000, 0, 4).unwrap();
        assert_eq!(span, Span { first_slot: 1, last_slot: 2 });
        let taken = ledger.commit(channel, 1_000_000, span, true);
        assert_eq!(ledger.worst_overcommit_bytes(), 0.0);
        assert!(ledger.fit_forward(channel, 2_000_000, 0, 4).is_none());
        ledger.uncommit(channel, &taken);
        assert!(ledger.fit_forward(channel, 2_000_000, 0, 4).is_some());
        // Wrapping virtual slots: backward from slot 5 (= op 1 of the next iteration).
        let read = channel_index(Tier::Ssd, Direction::Read);
        let span = ledger.fit_backward(read, 1_500_000, 6, 2).unwrap();
        assert_eq!(span, Span { first_slot: 4, last_slot: 5 });
    }
}
