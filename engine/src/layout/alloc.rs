//! The extent allocator: one per device, in blocks. Free space is a set of runs kept two ways, by
//! start (to merge neighbours on free) and by length (best fit), so churn does not shred space.
//!
//! Nothing about free space is persisted: on open it is derived from the object table, so there is
//! no allocator state to get wrong after a crash.

use crate::error::{Error, Result};
use std::collections::{BTreeMap, BTreeSet};

/// A run of blocks on one device.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Extent {
    pub device: u16,
    /// First block, counted from the start of the device (not of the data area).
    pub start_block: u64,
    pub len_blocks: u64,
}

impl Extent {
    pub fn end_block(&self) -> u64 {
        self.start_block + self.len_blocks
    }
}

/// Free space of one device.
#[derive(Debug, Clone)]
pub struct DeviceAllocator {
    device: u16,
    /// start -> length of every free run; runs never touch (they are merged).
    by_start: BTreeMap<u64, u64>,
    /// (length, start) of every free run, for best fit.
    by_len: BTreeSet<(u64, u64)>,
    free_blocks: u64,
    total_blocks: u64,
}

impl DeviceAllocator {
    /// All of `[first_block, end_block)` free.
    pub fn new(device: u16, first_block: u64, end_block: u64) -> Self {
        assert!(first_block <= end_block);
        let mut a = DeviceAllocator {
            device,
            by_start: BTreeMap::new(),
            by_len: BTreeSet::new(),
            free_blocks: 0,
            total_blocks: end_block - first_block,
        };
        if end_block > first_block {
            a.insert_run(first_block, end_block - first_block);
        }
        a
    }

    pub fn free_blocks(&self) -> u64 {
        self.free_blocks
    }
    pub fn total_blocks(&self) -> u64 {
        self.total_blocks
    }
    pub fn largest_free_blocks(&self) -> u64 {
        self.by_len.iter().next_back().map_or(0, |&(len, _)| len)
    }
    pub fn free_runs(&self) -> usize {
        self.by_start.len()
    }

    fn insert_run(&mut self, start: u64, len: u64) {
        self.by_start.insert(start, len);
        self.by_len.insert((len, start));
        self.free_blocks += len;
    }

    fn remove_run(&mut self, start: u64, len: u64) {
        self.by_start.remove(&start);
        self.by_len.remove(&(len, start));
        self.free_blocks -= len;
    }

    /// Most blocks one `allocate` with `max_extents` pieces could take now: the sum of the
    /// largest `max_extents` free runs.
    pub fn placeable_blocks(&self, max_extents: usize) -> u64 {
        self.by_len.iter().rev().take(max_extents).map(|&(len, _)| len).sum()
    }

    /// Takes `len_blocks`: one contiguous run if any fits (the smallest that does), else the largest
    /// runs first, in at most `max_extents` pieces. None (nothing taken) when it does not fit;
    /// the store then tries other devices and builds the error from the whole store's free space.
    pub fn allocate(&mut self, len_blocks: u64, max_extents: usize) -> Option<Vec<Extent>> {
        assert!(len_blocks > 0 && max_extents > 0);
        if len_blocks > self.free_blocks {
            return None;
        }
        if let Some(&(len, start)) = self.by_len.range((len_blocks, 0)..).next() {
            self.remove_run(start, len);
            if len > len_blocks {
                self.insert_run(start + len_blocks, len - len_blocks);
            }
            return Some(vec![Extent { device: self.device, start_block: start, len_blocks }]);
        }
        // No single run is large enough: gather the largest runs.
        let mut pieces = Vec::new();
        let mut still = len_blocks;
        for &(len, start) in self.by_len.iter().rev() {
            if still == 0 || pieces.len() == max_extents {
                break;
            }
            let take = len.min(still);
            pieces.push((start, len, take));
            still -= take;
        }
        if still > 0 {
            return None;
        }
        let mut extents = Vec::with_capacity(pieces.len());
        for (start, len, take) in pieces {
            self.remove_run(start, len);
            if len > take {
                self.insert_run(start + take, len - take);
            }
            extents.push(Extent { device: self.device, start_block: start, len_blocks: take });
        }
        // Keep device order within the object: ascending addresses read better on spinning
        // media and make the stripe map easy to read.
        extents.sort_by_key(|e| e.start_block);
        Some(extents)
    }

    /// Marks an extent as used (rebuilding from the table on open). Fails if any of it is not free,
    /// which means two objects claim the same blocks.
    pub fn reserve(&mut self, extent: Extent) -> Result<()> {
        let corrupt = || Error::CorruptMetadata {
            detail: format!(
                "extent {}+{} on device {} is claimed twice or lies outside the data area",
                extent.start_block, extent.len_blocks, extent.device
            ),
        };
        let (&start, &len) = self.by_start.range(..=extent.start_block).next_back().ok_or_else(corrupt)?;
        if extent.end_block() > start + len {
            return Err(corrupt());
        }
        self.remove_run(start, len);
        if extent.start_block > start {
            self.insert_run(start, extent.start_block - start);
        }
        if start + len > extent.end_block() {
            self.insert_run(extent.end_block(), start + len - extent.end_block());
        }
        Ok(())
    }

    /// Returns an extent, merging it with free neighbours.
    pub fn free(&mut self, extent: Extent) {
        assert_eq!(extent.device, self.device);
        let mut start = extent.start_block;
        let mut len = extent.len_blocks;
        if let Some((&prev_start, &prev_len)) = self.by_start.range(..start).next_back() {
            assert!(prev_start + prev_len <= start, "double free of blocks at {start} on device {}", self.device);
            if prev_start + prev_len == start {
                self.remove_run(prev_start, prev_len);
                start = prev_start;
                len += prev_len;
            }
        }
        if let Some((&next_start, &next_len)) = self.by_start.range(start..).next() {
            assert!(next_start >= start + len, "double free of blocks at {start} on device {}", self.device);
            if next_start == start + len {
                self.remove_run(next_start, next_len);
                len += next_len;
            }
        }
        self.insert_run(start, len);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn best_fit_then_merge_back() {
        let mut a = DeviceAllocator::new(0, 10, 110);
        let x = a.allocate(30, 4).unwrap();
        let y = a.allocate(30, 4).unwrap();
        assert_eq!(x, vec![Extent { device: 0, start_block: 10, len_blocks: 30 }]);
        a.free(x[0]);
        // A 20-block request takes the 30-block hole (best fit), not the 40-block tail.
        let z = a.allocate(20, 4).unwrap();
        assert_eq!(z[0].start_block, 10);
        a.free(z[0]);
        a.free(y[0]);
        assert_eq!(a.free_runs(), 1);
        assert_eq!(a.free_blocks(), 100);
    }

    #[test]
    fn fragmented_space_is_gathered_and_failure_takes_nothing() {
        let mut a = DeviceAllocator::new(3, 0, 100);
        let parts: Vec<_> = (0..10).map(|_| a.allocate(10, 1).unwrap()[0]).collect();
        for p in parts.iter().step_by(2) {
            a.free(*p);
        }
        assert_eq!(a.largest_free_blocks(), 10);
        assert_eq!(a.placeable_blocks(2), 20);
        let e = a.allocate(30, 8).unwrap();
        assert_eq!(e.iter().map(|x| x.len_blocks).sum::<u64>(), 30);
        assert_eq!(e.len(), 3);
        let before = a.free_blocks();
        assert!(a.allocate(30, 8).is_none());
        assert_eq!(a.free_blocks(), before);
        // Too many pieces needed: refused, nothing taken.
        assert!(a.allocate(20, 1).is_none());
        assert_eq!(a.free_blocks(), before);
    }

    #[test]
    fn reserve_detects_double_claims() {
        let mut a = DeviceAllocator::new(0, 0, 100);
        a.reserve(Extent { device: 0, start_block: 20, len_blocks: 10 }).unwrap();
        assert!(a.reserve(Extent { device: 0, start_block: 25, len_blocks: 10 }).is_err());
        assert!(a.reserve(Extent { device: 0, start_block: 95, len_blocks: 10 }).is_err());
        assert_eq!(a.free_blocks(), 90);
    }

    proptest! {
        /// Random allocate/free sequences keep the free count exact, never hand out a block twice,
        /// and end fully merged once everything is returned.
        #[test]
        fn churn_keeps_invariants(ops in proptest::collection::vec((1u64..40, any::<bool>()), 1..200)) {
            let mut a = DeviceAllocator::new(1, 5, 1005);
            let mut live: Vec<Vec<Extent>> = Vec::new();
            let mut owned = std::collections::BTreeSet::new();
            for (len, do_free) in ops {
                if do_free && !live.is_empty() {
                    for e in live.swap_remove(len as usize % live.len()) {
                        for b in e.start_block..e.end_block() { owned.remove(&b); }
                        a.free(e);
                    }
                } else if let Some(es) = a.allocate(len, 4) {
                    prop_assert_eq!(es.iter().map(|e| e.len_blocks).sum::<u64>(), len);
                    for e in &es {
                        prop_assert!(e.start_block >= 5 && e.end_block() <= 1005);
                        for b in e.start_block..e.end_block() { prop_assert!(owned.insert(b)); }
                    }
                    live.push(es);
                }
                prop_assert_eq!(a.free_blocks() + owned.len() as u64, 1000);
            }
            for es in live { for e in es { a.free(e); } }
            prop_assert_eq!(a.free_runs(), 1);
        }
    }
}
