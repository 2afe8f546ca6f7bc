//! Where a new object goes: its extents on the devices, or the `NoSpace` error that says how much
//! would fit.

use super::object::{Geometry, Object};
use super::Store;
use crate::error::{Error, Result};
use crate::layout::alloc::{DeviceAllocator, Extent};
use crate::layout::codec::round_up;
use crate::layout::stripe::{position_bytes, unit_count};
use crate::layout::table::{ObjectRecord, MAX_EXTENTS_PER_DEVICE};
use std::sync::atomic::Ordering;

impl Store {
    /// Allocates a new object's extents. The device with the most free space takes the first
    /// stripe unit (device 0 also holds the metadata, so a plain rotation would fill it first;
    /// equal devices take turns), and every other first device is tried before giving up:
    /// `NoSpace` means no placement exists. Nothing is taken when it fails.
    pub(super) fn allocate(&self, id: u64, len_bytes: u64, meta: &[u8]) -> Result<Object> {
        let g = &self.shared.geometry;
        let padded = round_up(len_bytes, g.block_size);
        let units = unit_count(padded, g.stripe_unit);
        let spread = units.max(1).min(g.device_count as u64) as u16;
        let needs = position_bytes(padded, g.stripe_unit, spread);
        let count = g.device_count as usize;
        let rotation = self.shared.next_first_device.fetch_add(1, Ordering::Relaxed);
        let mut allocators = self.shared.allocators.lock().expect("allocators");
        let mut order: Vec<u16> = (0..count).map(|i| ((rotation + i) % count) as u16).collect();
        // A stable sort: ties keep the rotation.
        order.sort_by_key(|&d| std::cmp::Reverse(allocators[d as usize].free_blocks()));
        for first_device in order {
            if let Some(extents) = place(&mut allocators, g, first_device, &needs) {
                drop(allocators);
                let record = ObjectRecord {
                    id,
                    len_bytes,
                    meta: meta.to_vec(),
                    first_device,
                    spread,
                    extents,
                    unit_crcs: Vec::new(),
                };
                return Ok(Object::new(record, self.shared.allocators.clone()));
            }
        }
        Err(no_space(&allocators, g, padded))
    }
}

/// Takes the extents of an object whose stripe unit 0 goes to `first_device` and position p to
/// the p-th device after it, `needs[p]` bytes each; None (nothing taken) if a device lacks room.
fn place(allocators: &mut [DeviceAllocator], g: &Geometry, first_device: u16, needs: &[u64]) -> Option<Vec<Extent>> {
    let mut extents = Vec::new();
    for (position, need) in needs.iter().enumerate() {
        if *need == 0 {
            continue;
        }
        let device = (first_device + position as u16) % g.device_count;
        match allocators[device as usize].allocate(need / g.block_size, MAX_EXTENTS_PER_DEVICE) {
            Some(mut e) => extents.append(&mut e),
            None => {
                for x in extents {
                    allocators[x.device as usize].free(x);
                }
                return None;
            }
        }
    }
    Some(extents)
}

/// The error of a failed placement of `needed` bytes: the store's free space, and the largest
/// object some placement could take now (each device can give at most its
/// `MAX_EXTENTS_PER_DEVICE` largest free runs to one object).
pub(crate) fn no_space(allocators: &[DeviceAllocator], g: &Geometry, needed: u64) -> Error {
    let count = g.device_count as usize;
    let free_blocks: u64 = allocators.iter().map(DeviceAllocator::free_blocks).sum();
    let capacity: Vec<u64> = allocators.iter().map(|a| a.placeable_blocks(MAX_EXTENTS_PER_DEVICE)).collect();
    let fits = |blocks: u64| {
        let padded = blocks * g.block_size;
        let spread = unit_count(padded, g.stripe_unit).max(1).min(count as u64) as u16;
        let needs = position_bytes(padded, g.stripe_unit, spread);
        (0..count)
            .any(|first| needs.iter().enumerate().all(|(p, need)| need / g.block_size <= capacity[(first + p) % count]))
    };
    // Each position's need grows with the object's size, so whether it fits is monotone.
    let (mut low, mut high) = (0, free_blocks);
    while low < high {
        let mid = low + (high - low).div_ceil(2);
        if fits(mid) {
            low = mid;
        } else {
            high = mid - 1;
        }
    }
    Error::NoSpace {
        needed_bytes: needed,
        free_bytes: free_blocks * g.block_size,
        largest_placeable_bytes: low * g.block_size,
    }
}
