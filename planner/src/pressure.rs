//! Critical memory pressure over the iteration, as a segment tree: per slot the GPU memory in use
//! minus the capacity (negative when it fits), with range updates (a tensor leaves for a range of
//! slots) and the planner's benefit query, Σ clamp(excess, 0, size) × duration over a range, in
//! O(log n) where the range is uniformly far above or below capacity.

/// Segment tree over slots.
#[derive(Debug, Clone)]
pub struct PressureTree {
    slot_count: usize,
    min_excess: Vec<i64>,
    max_excess: Vec<i64>,
    /// Σ excess × duration over the node.
    excess_duration: Vec<f64>,
    duration_us: Vec<f64>,
    pending: Vec<i64>,
}

impl PressureTree {
    /// Builds the tree from per-slot pressure and the capacity.
    pub fn new(pressure_bytes: &[u64], capacity_bytes: u64, duration_us: &[f64]) -> Self {
        let slot_count = pressure_bytes.len();
        assert!(slot_count > 0 && slot_count == duration_us.len());
        let size = 4 * slot_count;
        let mut tree = PressureTree {
            slot_count,
            min_excess: vec![0; size],
            max_excess: vec![0; size],
            excess_duration: vec![0.0; size],
            duration_us: vec![0.0; size],
            pending: vec![0; size],
        };
        let excess: Vec<i64> =
            pressure_bytes.iter().map(|&p| p as i64 - capacity_bytes.min(i64::MAX as u64) as i64).collect();
        tree.build(1, 0, slot_count, &excess, duration_us);
        tree
    }

    fn build(&mut self, node: usize, lo: usize, hi: usize, excess: &[i64], duration_us: &[f64]) {
        if hi - lo == 1 {
            self.min_excess[node] = excess[lo];
            self.max_excess[node] = excess[lo];
            self.duration_us[node] = duration_us[lo];
            self.excess_duration[node] = excess[lo] as f64 * duration_us[lo];
            return;
        }
        let mid = (lo + hi) / 2;
        self.build(2 * node, lo, mid, excess, duration_us);
        self.build(2 * node + 1, mid, hi, excess, duration_us);
        self.pull(node);
    }

    fn pull(&mut self, node: usize) {
        let (left, right) = (2 * node, 2 * node + 1);
        self.min_excess[node] = self.min_excess[left].min(self.min_excess[right]);
        self.max_excess[node] = self.max_excess[left].max(self.max_excess[right]);
        self.excess_duration[node] = self.excess_duration[left] + self.excess_duration[right];
        self.duration_us[node] = self.duration_us[left] + self.duration_us[right];
    }

    fn apply(&mut self, node: usize, delta: i64) {
        self.min_excess[node] += delta;
        self.max_excess[node] += delta;
        self.excess_duration[node] += delta as f64 * self.duration_us[node];
        self.pending[node] += delta;
    }

    fn push(&mut self, node: usize) {
        let delta = self.pending[node];
        if delta != 0 {
            self.apply(2 * node, delta);
            self.apply(2 * node + 1, delta);
            self.pending[node] = 0;
        }
    }

    /// Adds `delta_bytes` to slots `from..to` (plain slots, `to <= slot_count`).
    fn add_plain(&mut self, from: usize, to: usize, delta_bytes: i64) {
        if from < to {
            self.add_node(1, 0, self.slot_count, from, to, delta_bytes);
        }
    }

    fn add_node(&mut self, node: usize, lo: usize, hi: usize, from: usize, to: usize, delta: i64) {
        if to <= lo || hi <= from {
            return;
        }
        if from <= lo && hi <= to {
            self.apply(node, delta);
            return;
        }
        self.push(node);
        let mid = (lo + hi) / 2;
        self.add_node(2 * node, lo, mid, from, to, delta);
        self.add_node(2 * node + 1, mid, hi, from, to, delta);
        self.pull(node);
    }

    /// Splits virtual slots `from..to` (in `0..2n`, at most n long) into plain ranges.
    fn split(&self, from: u32, to: u32) -> [(usize, usize); 2] {
        let n = self.slot_count;
        let (from, to) = (from as usize, to as usize);
        debug_assert!(to >= from && to - from <= n);
        if to <= n {
            [(from, to), (0, 0)]
        } else if from >= n {
            [(from - n, to - n), (0, 0)]
        } else {
            [(from, n), (0, to - n)]
        }
    }

    /// Adds `delta_bytes` to the pressure of virtual slots `from..to`.
    pub fn add(&mut self, from_slot: u32, to_slot: u32, delta_bytes: i64) {
        for (from, to) in self.split(from_slot, to_slot) {
            self.add_plain(from, to, delta_bytes);
        }
    }

    /// Σ clamp(excess, 0, size) × duration over virtual slots `from..to`: the critical pressure a
    /// tensor of `size_bytes` removes when it is absent there (byte-microseconds).
    pub fn benefit(&mut self, from_slot: u32, to_slot: u32, size_bytes: u64) -> f64 {
        let size = size_bytes.min(i64::MAX as u64) as i64;
        let mut total = 0.0;
        for (from, to) in self.split(from_slot, to_slot) {
            if from < to {
                total += self.benefit_node(1, 0, self.slot_count, from, to, size);
            }
        }
        total
    }

    fn benefit_node(&mut self, node: usize, lo: usize, hi: usize, from: usize, to: usize, size: i64) -> f64 {
        if to <= lo || hi <= from || self.max_excess[node] <= 0 {
            return 0.0;
        }
        if from <= lo && hi <= to {
            if self.min_excess[node] >= size {
                return size as f64 * self.duration_us[node];
            }
            if self.min_excess[node] >= 0 && self.max_excess[node] <= size {
                return self.excess_duration[node];
            }
        }
        self.push(node);
        let mid = (lo + hi) / 2;
        self.benefit_node(2 * node, lo, mid, from, to, size) + self.benefit_node(2 * node + 1, mid, hi, from, to, size)
    }

    /// Largest excess over virtual slots `from..to` (`i64::MIN` for an empty range).
    pub fn max_excess_in(&mut self, from_slot: u32, to_slot: u32) -> i64 {
        let mut best = i64::MIN;
        for (from, to) in self.split(from_slot, to_slot) {
            if from < to {
                best = best.max(self.max_node(1, 0, self.slot_count, from, to));
            }
        }
        best
    }

    fn max_node(&mut self, node: usize, lo: usize, hi: usize, from: usize, to: usize) -> i64 {
        if to <= lo || hi <= from {
            return i64::MIN;
        }
        if from <= lo && hi <= to {
            return self.max_excess[node];
        }
        self.push(node);
        let mid = (lo + hi) / 2;
        self.max_node(2 * node, lo, mid, from, to).max(self.max_node(2 * node + 1, mid, hi, from, to))
    }

    /// Largest excess over any slot (> 0 means some slot is over capacity).
    pub fn max_excess_bytes(&self) -> i64 {
        self.max_excess[1]
    }

    /// The slot with the largest excess (the first one on ties).
    pub fn argmax_excess(&mut self) -> usize {
        let (mut node, mut lo, mut hi) = (1, 0, self.slot_count);
        while hi - lo > 1 {
            self.push(node);
            let mid = (lo + hi) / 2;
            if self.max_excess[2 * node] >= self.max_excess[2 * node + 1] {
                node *= 2;
                hi = mid;
            } else {
                node = 2 * node + 1;
                lo = mid;
            }
        }
        lo
    }

    /// Current excess of every slot.
    pub fn excess_per_slot(&mut self) -> Vec<i64> {
        let mut out = vec![0; self.slot_count];
        self.collect(1, 0, self.slot_count, &mut out);
        out
    }

    fn collect(&mut self, node: usize, lo: usize, hi: usize, out: &mut [i64]) {
        if hi - lo == 1 {
            out[lo] = self.min_excess[node];
            return;
        }
        self.push(node);
        let mid = (lo + hi) / 2;
        self.collect(2 * node, lo, mid, out);
        self.collect(2 * node + 1, mid, hi, out);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn brute_benefit(excess: &[i64], duration: &[f64], from: u32, to: u32, size: i64) -> f64 {
        let n = excess.len() as u32;
        (from..to)
            .map(|v| {
                let s = (v % n) as usize;
                excess[s].clamp(0, size) as f64 * duration[s]
            })
            .sum()
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]
        #[test]
        fn tree_matches_brute_force(
            pressure in proptest::collection::vec(0u64..100, 1..40),
            updates in proptest::collection::vec((0u32..80, 0u32..40, -30i64..30), 0..20),
            query in (0u32..80, 0u32..40, 1i64..60),
        ) {
            let n = pressure.len() as u32;
            let duration: Vec<f64> = (0..n).map(|i| 1.0 + (i % 3) as f64).collect();
            let capacity = 50;
            let mut tree = PressureTree::new(&pressure, capacity, &duration);
            let mut excess: Vec<i64> = pressure.iter().map(|&p| p as i64 - 50).collect();
            for (from, length, delta) in updates {
                let from = from % (2 * n);
                let to = (from + length % (n + 1)).min(2 * n);
                tree.add(from, to, delta);
                for v in from..to { excess[(v % n) as usize] += delta; }
            }
            let (from, length, size) = query;
            let from = from % (2 * n);
            let to = (from + length % (n + 1)).min(2 * n);
            let expected = brute_benefit(&excess, &duration, from, to, size);
            let got = tree.benefit(from, to, size as u64);
            prop_assert!((expected - got).abs() < 1e-6, "expected {expected}, got {got}");
            prop_assert_eq!(tree.excess_per_slot(), excess.clone());
            prop_assert_eq!(tree.max_excess_bytes(), *excess.iter().max().unwrap());
            let (from, to) = (0, n);
            prop_assert_eq!(tree.max_excess_in(from, to), *excess.iter().max().unwrap());
            let argmax = tree.argmax_excess();
            prop_assert_eq!(excess[argmax], *excess.iter().max().unwrap());
        }
    }
}
