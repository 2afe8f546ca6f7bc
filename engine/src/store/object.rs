//! A live object: its record plus ownership of its extents. Dropping the last reference returns
//! the extents to the allocator, so blocks are reused only after the table no longer names them
//! and no get is still reading them.

use crate::error::{Error, Result};
use crate::layout::alloc::DeviceAllocator;
use crate::layout::codec::round_up;
use crate::layout::stripe::{position_bytes, unit_count};
use crate::layout::table::ObjectRecord;
use std::sync::{Arc, Mutex};

pub(crate) type Allocators = Arc<Mutex<Vec<DeviceAllocator>>>;

pub(crate) struct Object {
    pub record: ObjectRecord,
    allocators: Allocators,
}

impl Object {
    pub fn new(record: ObjectRecord, allocators: Allocators) -> Self {
        Object { record, allocators }
    }
}

impl Drop for Object {
    fn drop(&mut self) {
        let mut allocators = self.allocators.lock().expect("allocators");
        for x in &self.record.extents {
            allocators[x.device as usize].free(*x);
        }
    }
}

/// Store geometry needed to check and map records.
#[derive(Debug, Clone)]
pub(crate) struct Geometry {
    pub block_size: u64,
    pub stripe_unit: u64,
    pub device_count: u16,
    pub checksums: bool,
    /// (data_start, data_end) in bytes per device.
    pub data_areas: Vec<(u64, u64)>,
}

impl Geometry {
    /// Checks that a record read from disk describes a well-formed object of this store, so that
    /// mapping it can never go out of its extents.
    pub fn validate(&self, r: &ObjectRecord) -> Result<()> {
        let bad = |detail: String| Err(Error::CorruptMetadata { detail: format!("object {}: {detail}", r.id) });
        let padded = round_up(r.len_bytes, self.block_size);
        let units = unit_count(padded, self.stripe_unit);
        let expected_spread = (units.max(1)).min(self.device_count as u64) as u16;
        if r.spread != expected_spread {
            return bad(format!("spread {} where {} was expected", r.spread, expected_spread));
        }
        if !(r.unit_crcs.is_empty() || r.unit_crcs.len() as u64 == units) {
            return bad(format!("{} checksums for {} stripe units", r.unit_crcs.len(), units));
        }
        let needs = position_bytes(padded, self.stripe_unit, r.spread);
        for (position, need) in needs.iter().enumerate() {
            let device = (r.first_device + position as u16) % self.device_count;
            let have: u64 =
                r.extents.iter().filter(|x| x.device == device).map(|x| x.len_blocks * self.block_size).sum();
            if have != *need {
                return bad(format!("device {device} holds {have} bytes of it, {need} expected"));
            }
        }
        let in_spread = |d: u16| (d + self.device_count - r.first_device) % self.device_count < r.spread;
        for x in &r.extents {
            let (start, end) = self.data_areas[x.device as usize];
            if !in_spread(x.device)
                || x.start_block * self.block_size < start
                || x.end_block().saturating_mul(self.block_size) > end
            {
                return bad(format!("extent {x:?} lies outside its device's data area"));
            }
        }
        Ok(())
    }
}
