//! Checking a verified get against its record's stripe-unit checksums, and where a unit lies on
//! disk for the error that names it.

use super::crcs::unit_crcs_from_pieces;
use super::object::Geometry;
use super::op::{Op, OpObject};
use super::Shared;
use crate::error::{Error, Result};
use crate::layout::stripe::StripeMap;
use crate::layout::table::ObjectRecord;
use std::sync::Mutex;

impl Shared {
    /// A verified get: the checksum of every stripe unit in its checked range (see
    /// `Store::get_span`), combined from the crcs its pieces took as they arrived, against the
    /// record's.
    pub(super) fn verify_get(&self, op: &Op, crcs: &Mutex<Vec<(u64, u64, u32)>>) -> Result<()> {
        let OpObject::Get(object) = &op.object else { unreachable!("verify on a get") };
        let r = &object.record;
        let su = self.geometry.stripe_unit;
        let pieces = std::mem::take(&mut *crcs.lock().expect("piece crcs"));
        let (start, end) = op.checked;
        let units = unit_crcs_from_pieces(pieces, su, r.len_bytes, start, end);
        assert_eq!(units.len() as u64, end.div_ceil(su) - start / su, "every checked unit was read whole");
        for (unit, crc) in units {
            if r.unit_crcs[unit as usize] != crc {
                let (device, device_offset) = unit_location(&self.geometry, r, unit);
                return Err(Error::ChecksumMismatch { id: op.id, unit, device, device_offset });
            }
        }
        Ok(())
    }
}

/// Where stripe unit `unit` of an object starts on disk: (device, byte offset).
pub(super) fn unit_location(g: &Geometry, r: &ObjectRecord, unit: u64) -> (u16, u64) {
    let (su, block) = (g.stripe_unit, g.block_size);
    let mut at = None;
    StripeMap::new(r, su, block, g.device_count).for_each_piece(unit * su..unit * su + block, block, |p| {
        at.get_or_insert((p.device, p.device_offset));
    });
    at.expect("a unit has a first block")
}
