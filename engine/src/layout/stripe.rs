//! The stripe map: where each byte of an object lives. An object is cut into stripe units; unit k
//! goes to position `k % spread`, i.e. device `(first_device + k % spread) % device_count`, at byte
//! `(k / spread) * stripe_unit` of that device's share, and a share is the concatenation of the
//! object's extents on that device.

use super::alloc::Extent;
use super::codec::round_up;
use super::table::ObjectRecord;
use std::ops::Range;

/// A run of object bytes that is contiguous on one device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Piece {
    pub object_offset: u64,
    pub device: u16,
    pub device_offset: u64,
    pub len: u64,
    /// Stripe unit the piece belongs to.
    pub unit: u64,
}

/// How many stripe units an object of `padded_len` bytes has.
pub fn unit_count(padded_len: u64, stripe_unit: u64) -> u64 {
    padded_len.div_ceil(stripe_unit)
}

/// Bytes each position (0..spread) must hold for an object of `padded_len` bytes.
pub fn position_bytes(padded_len: u64, stripe_unit: u64, spread: u16) -> Vec<u64> {
    let spread = spread as u64;
    let units = unit_count(padded_len, stripe_unit);
    let mut bytes = vec![0u64; spread as usize];
    for (position, slot) in bytes.iter_mut().enumerate() {
        let position = position as u64;
        if position < units {
            *slot = (units - position).div_ceil(spread) * stripe_unit;
        }
    }
    if units > 0 {
        let last_len = padded_len - (units - 1) * stripe_unit;
        bytes[((units - 1) % spread) as usize] -= stripe_unit - last_len;
    }
    bytes
}

/// The resolved stripe map of one object.
pub struct StripeMap<'a> {
    record: &'a ObjectRecord,
    stripe_unit: u64,
    block_size: u64,
    /// Per position: (first share byte, extent) for each of its extents.
    shares: Vec<Vec<(u64, Extent)>>,
}

impl<'a> StripeMap<'a> {
    pub fn new(record: &'a ObjectRecord, stripe_unit: u64, block_size: u64, device_count: u16) -> Self {
        let mut shares: Vec<Vec<(u64, Extent)>> = vec![Vec::new(); record.spread as usize];
        for (position, share) in shares.iter_mut().enumerate() {
            let device = (record.first_device + position as u16) % device_count;
            let mut at = 0;
            for x in record.extents.iter().filter(|x| x.device == device) {
                share.push((at, *x));
                at += x.len_blocks * block_size;
            }
        }
        StripeMap { record, stripe_unit, block_size, shares }
    }

    /// The padded length of the object on disk.
    pub fn padded_len(&self) -> u64 {
        round_up(self.record.len_bytes, self.block_size)
    }

    /// Calls `visit` for each piece covering `range` (block-aligned, inside the padded length), in
    /// object order, no piece longer than `max_piece` bytes nor crossing a stripe unit or extent.
    pub fn for_each_piece(&self, range: Range<u64>, max_piece: u64, mut visit: impl FnMut(Piece)) {
        debug_assert!(range.start.is_multiple_of(self.block_size) && range.end.is_multiple_of(self.block_size));
        debug_assert!(range.end <= self.padded_len());
        let spread = self.record.spread as u64;
        let mut at = range.start;
        while at < range.end {
            let unit = at / self.stripe_unit;
            let in_unit = at % self.stripe_unit;
            let unit_end = ((unit + 1) * self.stripe_unit).min(range.end);
            let position = (unit % spread) as usize;
            let mut share_offset = (unit / spread) * self.stripe_unit + in_unit;
            let mut left = unit_end - at;
            let share = &self.shares[position];
            // Shares have few extents (usually one); a linear scan from the right one is cheapest.
            let mut index = share.partition_point(|(start, _)| *start <= share_offset) - 1;
            while left > 0 {
                let (share_start, extent) = share[index];
                let extent_bytes = extent.len_blocks * self.block_size;
                let within = share_offset - share_start;
                let len = left.min(extent_bytes - within).min(max_piece);
                visit(Piece {
                    object_offset: at,
                    device: extent.device,
                    device_offset: extent.start_block * self.block_size + within,
                    len,
                    unit,
                });
                at += len;
                share_offset += len;
                left -= len;
                if share_offset - share_start == extent_bytes {
                    index += 1;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn position_bytes_add_up() {
        assert_eq!(position_bytes(10 * 4096, 4096, 4), vec![3 * 4096, 3 * 4096, 2 * 4096, 2 * 4096]);
        assert_eq!(position_bytes(4096, 1 << 20, 4), vec![4096, 0, 0, 0]);
        assert_eq!(position_bytes((1 << 20) + 8192, 1 << 20, 2), vec![1 << 20, 8192]);
    }

    proptest! {
        /// Every object byte maps to exactly one device byte, inside the object's extents, and no
        /// two object bytes share a device byte.
        #[test]
        fn map_is_a_bijection_into_the_extents(
            blocks in 1u64..200, unit_blocks in 1u64..8, spread in 1u16..4, first in 0u16..4,
            split in 1u64..5, max_piece_blocks in 1u64..10,
        ) {
            let bs = 512u64;
            let devices = 4u16;
            let su = unit_blocks * bs;
            let padded = blocks * bs;
            let needs = position_bytes(padded, su, spread);
            let mut extents = Vec::new();
            for (p, need) in needs.iter().enumerate() {
                let device = (first + p as u16) % devices;
                let nb = need / bs;
                // Split each share into up to `split` extents at scattered addresses.
                let mut left = nb;
                let mut base = 1000 * (p as u64 + 1);
                while left > 0 {
                    let take = (nb / split).max(1).min(left);
                    extents.push(Extent { device, start_block: base, len_blocks: take });
                    base += take + 3;
                    left -= take;
                }
            }
            let record = ObjectRecord { id: 1, len_bytes: padded, meta: vec![], first_device: first, spread, extents: extents.clone(), unit_crcs: vec![] };
            let map = StripeMap::new(&record, su, bs, devices);
            let mut seen = std::collections::HashSet::new();
            let mut expect = 0;
            map.for_each_piece(0..padded, max_piece_blocks * bs, |p| {
                assert_eq!(p.object_offset, expect);
                assert!(p.len > 0 && p.len <= max_piece_blocks * bs);
                assert_eq!(p.unit, p.object_offset / su);
                assert_eq!((p.object_offset + p.len - 1) / su, p.unit);
                let ok = extents.iter().any(|x| x.device == p.device
                    && p.device_offset >= x.start_block * bs
                    && p.device_offset + p.len <= x.end_block() * bs);
                assert!(ok, "piece {p:?} outside extents");
                for b in (p.device_offset..p.device_offset + p.len).step_by(bs as usize) {
                    assert!(seen.insert((p.device, b)));
                }
                expect += p.len;
            });
            prop_assert_eq!(expect, padded);
        }
    }
}
