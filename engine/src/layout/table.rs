//! Object records: what the object table keeps per object (length, caller metadata, where its
//! stripe units live, their checksums) and how a record is encoded in checkpoints and the journal.

use super::alloc::Extent;
use super::codec::{Decoder, Encoder};
use crate::error::{Error, Result};

/// Most extents one object may own on one device; beyond this the space is too fragmented and the
/// put fails with `NoSpace` rather than making the record unbounded.
pub const MAX_EXTENTS_PER_DEVICE: usize = 64;

/// One object in the table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ObjectRecord {
    pub id: u64,
    /// True length in bytes (the last block on disk is zero-padded past it).
    pub len_bytes: u64,
    /// Opaque caller metadata (dtype, shape, ...).
    pub meta: Vec<u8>,
    /// Device that holds stripe unit 0.
    pub first_device: u16,
    /// How many devices the object is striped over (unit k sits on device (first + k % spread) % count).
    pub spread: u16,
    /// Extents grouped by device in stripe order (all of position 0's device, then position 1's, ...),
    /// each device's extents in the order they are filled.
    pub extents: Vec<Extent>,
    /// crc32c of each stripe unit's true bytes, or empty when the store keeps no checksums.
    pub unit_crcs: Vec<u32>,
}

/// Bytes of a record's fixed fields (id, length, meta length, first device, spread, extent and
/// crc counts), without its metadata, extents and crcs.
const RECORD_FIXED_BYTES: u64 = 8 + 8 + 2 + 2 + 2 + 4 + 4;
/// Bytes one extent takes in a record.
const EXTENT_BYTES: u64 = 2 + 8 + 8;

impl ObjectRecord {
    /// Bytes `encode` writes for this record: what it adds to a checkpoint.
    pub fn encoded_bytes(&self) -> u64 {
        RECORD_FIXED_BYTES
            + self.meta.len() as u64
            + EXTENT_BYTES * self.extents.len() as u64
            + 4 * self.unit_crcs.len() as u64
    }

    /// Bytes of the record of a one-extent, one-unit object with `meta_bytes` of caller metadata:
    /// the smallest record of an object that holds data (what format sizes the table by).
    pub fn one_unit_bytes(meta_bytes: u64) -> u64 {
        RECORD_FIXED_BYTES + meta_bytes + EXTENT_BYTES + 4
    }

    pub fn encode(&self, e: &mut Encoder) {
        e.u64(self.id);
        e.u64(self.len_bytes);
        e.u16(self.meta.len() as u16);
        e.raw(&self.meta);
        e.u16(self.first_device);
        e.u16(self.spread);
        e.u32(self.extents.len() as u32);
        for x in &self.extents {
            e.u16(x.device);
            e.u64(x.start_block);
            e.u64(x.len_blocks);
        }
        e.u32(self.unit_crcs.len() as u32);
        for c in &self.unit_crcs {
            e.u32(*c);
        }
    }

    /// Decodes one record; `device_count` bounds the device numbers it may name.
    pub fn decode(d: &mut Decoder<'_>, device_count: u16) -> Result<ObjectRecord> {
        let id = d.u64()?;
        let len_bytes = d.u64()?;
        let meta_len = d.u16()? as usize;
        let meta = d.raw(meta_len)?.to_vec();
        let first_device = d.u16()?;
        let spread = d.u16()?;
        let extent_count = d.u32()? as usize;
        let corrupt = |detail: String| Err(Error::CorruptMetadata { detail: format!("object {id}: {detail}") });
        if first_device >= device_count || spread == 0 || spread > device_count {
            return corrupt(format!("first device {first_device}, spread {spread} with {device_count} devices"));
        }
        if extent_count > MAX_EXTENTS_PER_DEVICE * spread as usize || extent_count * 18 > d.remaining() {
            return corrupt(format!("{extent_count} extents"));
        }
        let mut extents = Vec::with_capacity(extent_count);
        for _ in 0..extent_count {
            let x = Extent { device: d.u16()?, start_block: d.u64()?, len_blocks: d.u64()? };
            if x.device >= device_count || x.len_blocks == 0 || x.start_block.checked_add(x.len_blocks).is_none() {
                return corrupt(format!("bad extent {x:?}"));
            }
            extents.push(x);
        }
        let crc_count = d.u32()? as usize;
        if crc_count * 4 > d.remaining() {
            return corrupt(format!("{crc_count} checksums"));
        }
        let unit_crcs = (0..crc_count).map(|_| d.u32()).collect::<Result<Vec<_>>>()?;
        Ok(ObjectRecord { id, len_bytes, meta, first_device, spread, extents, unit_crcs })
    }
}

/// One change to the table, as the journal records it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TableChange {
    Put(ObjectRecord),
    Delete { id: u64 },
}

const TAG_PUT: u8 = 1;
const TAG_DELETE: u8 = 2;

impl TableChange {
    pub fn encode(&self, e: &mut Encoder) {
        match self {
            TableChange::Put(r) => {
                e.u8(TAG_PUT);
                r.encode(e);
            }
            TableChange::Delete { id } => {
                e.u8(TAG_DELETE);
                e.u64(*id);
            }
        }
    }

    pub fn decode(d: &mut Decoder<'_>, device_count: u16) -> Result<TableChange> {
        match d.u8()? {
            TAG_PUT => Ok(TableChange::Put(ObjectRecord::decode(d, device_count)?)),
            TAG_DELETE => Ok(TableChange::Delete { id: d.u64()? }),
            tag => Err(Error::CorruptMetadata { detail: format!("unknown journal record tag {tag}") }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    pub fn sample(id: u64) -> ObjectRecord {
        ObjectRecord {
            id,
            len_bytes: 12345,
            meta: b"f32[3,4]".to_vec(),
            first_device: 1,
            spread: 2,
            extents: vec![
                Extent { device: 1, start_block: 100, len_blocks: 2 },
                Extent { device: 2, start_block: 7, len_blocks: 2 },
            ],
            unit_crcs: vec![1, 2, 3, 4],
        }
    }

    #[test]
    fn record_round_trip() {
        let changes = vec![TableChange::Put(sample(9)), TableChange::Delete { id: 9 }];
        let mut e = Encoder::default();
        for c in &changes {
            c.encode(&mut e);
        }
        let mut d = Decoder::new(&e.bytes, "journal");
        for c in &changes {
            assert_eq!(&TableChange::decode(&mut d, 4).unwrap(), c);
        }
        assert_eq!(d.remaining(), 0);
    }

    #[test]
    fn encoded_bytes_is_what_encode_writes() {
        for r in [sample(3), ObjectRecord { meta: vec![7; 4096], extents: vec![], unit_crcs: vec![], ..sample(4) }] {
            let mut e = Encoder::default();
            r.encode(&mut e);
            assert_eq!(e.bytes.len() as u64, r.encoded_bytes());
        }
        let one = ObjectRecord { extents: sample(1).extents[..1].to_vec(), unit_crcs: vec![9], ..sample(1) };
        assert_eq!(one.encoded_bytes(), ObjectRecord::one_unit_bytes(one.meta.len() as u64));
    }

    #[test]
    fn device_numbers_are_bounded() {
        let mut e = Encoder::default();
        TableChange::Put(sample(1)).encode(&mut e);
        assert!(TableChange::decode(&mut Decoder::new(&e.bytes, "j"), 2).is_err());
    }

    proptest::proptest! {
        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(proptest::num::u8::ANY, 0..512)) {
            let mut d = Decoder::new(&bytes, "journal");
            while d.remaining() > 0 {
                if TableChange::decode(&mut d, 8).is_err() { break; }
            }
        }
    }
}
