//! The superblock: the first 4 KiB of every device (with a backup copy in the last 4 KiB), naming
//! the store, the device's place in it, the layout parameters and the store epoch the device last
//! took part in. See `docs/format.md`.

use super::codec::{Decoder, Encoder};
use super::SUPERBLOCK_BYTES;
use crate::error::{Error, Result};
use std::path::Path;

/// "TERAIOSB": the first eight bytes of every teraio device.
pub const MAGIC: [u8; 8] = *b"TERAIOSB";
/// The on-disk format version this build writes.
pub const FORMAT_VERSION: u32 = 3;
/// The oldest version this build opens: version 2 has the same superblock and records, and one
/// journal region for every generation (docs/format.md, Journal).
pub const OLDEST_OPENED_VERSION: u32 = 2;
/// Bytes of the encoded fields (the rest of the 4 KiB block is zero).
const ENCODED_BYTES: usize = 8 + 4 + 4 + 16 + 2 + 2 + 4 + 4 + 8 * 9 + 4;
/// Bytes of the encoded fields of a version 1 superblock (no epoch), to recognise old stores.
const V1_ENCODED_BYTES: usize = ENCODED_BYTES - 8;

/// Store-wide flags kept in the superblock.
pub mod flags {
    /// Every stripe unit of every object carries a crc32c in the object table.
    pub const CHECKSUMS: u32 = 1;
}

/// One device's superblock.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Superblock {
    pub format_version: u32,
    pub flags: u32,
    pub store_uuid: [u8; 16],
    pub device_index: u16,
    pub device_count: u16,
    pub block_size: u32,
    pub stripe_unit_bytes: u32,
    /// The device size used by the layout, a multiple of 4096 (the backup superblock is its last 4 KiB).
    pub device_bytes: u64,
    /// First byte of the data area on this device.
    pub data_start: u64,
    /// One past the last byte of the data area on this device.
    pub data_end: u64,
    /// Where the metadata area starts on this device (0 where the device holds none).
    pub metadata_start: u64,
    /// Bytes of each of the two checkpoint slots (0 where the device holds no metadata).
    pub checkpoint_slot_bytes: u64,
    /// Bytes of the journal ring (0 where the device holds no metadata).
    pub journal_bytes: u64,
    /// Seconds since the Unix epoch at format time.
    pub created_unix_secs: u64,
    /// Largest caller metadata blob per object.
    pub max_meta_bytes: u64,
    /// The store epoch this device last took part in: advanced on every device at each writer
    /// open and each checkpoint, and recorded in every checkpoint and journal batch, so that a
    /// device put back from an older copy is found (see `store::identity`).
    pub epoch: u64,
}

impl Superblock {
    /// Encodes into a full zero-padded 4 KiB block with a trailing crc32c over the fields.
    pub fn encode(&self) -> Vec<u8> {
        let mut e = Encoder::with_capacity(SUPERBLOCK_BYTES as usize);
        e.raw(&MAGIC);
        e.u32(self.format_version);
        e.u32(self.flags);
        e.raw(&self.store_uuid);
        e.u16(self.device_index);
        e.u16(self.device_count);
        e.u32(self.block_size);
        e.u32(self.stripe_unit_bytes);
        e.u64(self.device_bytes);
        e.u64(self.data_start);
        e.u64(self.data_end);
        e.u64(self.metadata_start);
        e.u64(self.checkpoint_slot_bytes);
        e.u64(self.journal_bytes);
        e.u64(self.created_unix_secs);
        e.u64(self.max_meta_bytes);
        e.u64(self.epoch);
        let crc = crc32c::crc32c(&e.bytes);
        e.u32(crc);
        debug_assert_eq!(e.bytes.len(), ENCODED_BYTES);
        e.bytes.resize(SUPERBLOCK_BYTES as usize, 0);
        e.bytes
    }

    /// Decodes a 4 KiB block; `path` only names the device in errors.
    pub fn decode(block: &[u8], path: &Path) -> Result<Superblock> {
        if block.len() < ENCODED_BYTES || block[..8] != MAGIC {
            return Err(Error::NotATeraioDevice { path: path.to_path_buf() });
        }
        let crc_matches = |encoded: usize| {
            let stored = u32::from_le_bytes(block[encoded - 4..encoded].try_into().expect("4 bytes"));
            (crc32c::crc32c(&block[..encoded - 4]) == stored, stored)
        };
        let format_version = u32::from_le_bytes(block[8..12].try_into().expect("4 bytes"));
        // A whole superblock of another version (its own checksum holds) is that version's, not damage.
        if format_version == 1 && crc_matches(V1_ENCODED_BYTES).0 {
            return Err(Error::UnsupportedVersion { path: path.to_path_buf(), found: 1, supported: FORMAT_VERSION });
        }
        let (matches, stored_crc) = crc_matches(ENCODED_BYTES);
        if !matches {
            let crc = crc32c::crc32c(&block[..ENCODED_BYTES - 4]);
            return Err(Error::CorruptSuperblock {
                path: path.to_path_buf(),
                detail: format!("superblock checksum {crc:#010x} does not match the stored {stored_crc:#010x}"),
            });
        }
        let mut d = Decoder::new(&block[12..], "superblock");
        if !(OLDEST_OPENED_VERSION..=FORMAT_VERSION).contains(&format_version) {
            return Err(Error::UnsupportedVersion {
                path: path.to_path_buf(),
                found: format_version,
                supported: FORMAT_VERSION,
            });
        }
        let sb = Superblock {
            format_version,
            flags: d.u32()?,
            store_uuid: d.raw(16)?.try_into().expect("16 bytes"),
            device_index: d.u16()?,
            device_count: d.u16()?,
            block_size: d.u32()?,
            stripe_unit_bytes: d.u32()?,
            device_bytes: d.u64()?,
            data_start: d.u64()?,
            data_end: d.u64()?,
            metadata_start: d.u64()?,
            checkpoint_slot_bytes: d.u64()?,
            journal_bytes: d.u64()?,
            created_unix_secs: d.u64()?,
            max_meta_bytes: d.u64()?,
            epoch: d.u64()?,
        };
        sb.validate(path)?;
        Ok(sb)
    }

    /// Checks the internal consistency of the fields (a valid checksum over nonsense is still nonsense).
    fn validate(&self, path: &Path) -> Result<()> {
        let bad = |detail: String| {
            Err(Error::CorruptSuperblock { path: path.to_path_buf(), detail: format!("superblock fields: {detail}") })
        };
        let bs = self.block_size as u64;
        if !bs.is_power_of_two() || !(512..=65536).contains(&bs) {
            return bad(format!("block size {bs} is not a power of two in 512..=65536"));
        }
        let su = self.stripe_unit_bytes as u64;
        if su == 0 || !su.is_multiple_of(bs) {
            return bad(format!("stripe unit {su} is not a multiple of the block size {bs}"));
        }
        if self.device_count == 0 || self.device_index >= self.device_count {
            return bad(format!("device index {} of {}", self.device_index, self.device_count));
        }
        let aligned = |v: u64| v.is_multiple_of(bs);
        if !(aligned(self.data_start) && aligned(self.data_end) && self.device_bytes.is_multiple_of(SUPERBLOCK_BYTES))
            || self.data_start > self.data_end
            || self.data_end + SUPERBLOCK_BYTES > self.device_bytes
        {
            return bad(format!(
                "data area {}..{} does not fit a device of {} bytes",
                self.data_start, self.data_end, self.device_bytes
            ));
        }
        if self.metadata_start != 0
            && self.metadata_start + 2 * self.checkpoint_slot_bytes + self.journal_bytes > self.data_start
        {
            return bad("metadata area overlaps the data area".into());
        }
        Ok(())
    }

    /// Whether `other` describes the same device of the same store, whatever its epoch.
    pub fn same_identity(&self, other: &Superblock) -> bool {
        Superblock { epoch: other.epoch, ..self.clone() } == *other
    }

    /// Offset of the backup superblock on this device.
    pub fn backup_offset(&self) -> u64 {
        self.device_bytes - SUPERBLOCK_BYTES
    }

    pub fn has_checksums(&self) -> bool {
        self.flags & flags::CHECKSUMS != 0
    }

    /// The store UUID as the usual hyphenated text.
    pub fn uuid_string(&self) -> String {
        uuid::Uuid::from_bytes(self.store_uuid).hyphenated().to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Superblock {
        Superblock {
            format_version: FORMAT_VERSION,
            flags: flags::CHECKSUMS,
            store_uuid: [7; 16],
            device_index: 1,
            device_count: 4,
            block_size: 4096,
            stripe_unit_bytes: 1 << 20,
            device_bytes: 1 << 30,
            data_start: 1 << 20,
            data_end: (1 << 30) - (1 << 20),
            metadata_start: 0,
            checkpoint_slot_bytes: 0,
            journal_bytes: 0,
            created_unix_secs: 1,
            max_meta_bytes: 1024,
            epoch: 9,
        }
    }

    #[test]
    fn round_trip() {
        let sb = sample();
        let block = sb.encode();
        assert_eq!(block.len(), 4096);
        assert_eq!(Superblock::decode(&block, Path::new("x")).unwrap(), sb);
    }

    #[test]
    fn every_single_bit_flip_is_detected() {
        let block = sample().encode();
        for byte in 0..ENCODED_BYTES {
            for bit in 0..8 {
                let mut b = block.clone();
                b[byte] ^= 1 << bit;
                assert!(Superblock::decode(&b, Path::new("x")).is_err(), "flip at {byte}.{bit} not detected");
            }
        }
    }

    #[test]
    fn a_version_1_superblock_is_an_old_store_not_damage() {
        let mut block = sample().encode();
        block[8..12].copy_from_slice(&1u32.to_le_bytes());
        // Version 1 had no epoch: its checksum sat where the epoch is now.
        let crc = crc32c::crc32c(&block[..V1_ENCODED_BYTES - 4]);
        block[V1_ENCODED_BYTES - 4..V1_ENCODED_BYTES].copy_from_slice(&crc.to_le_bytes());
        let err = Superblock::decode(&block, Path::new("x")).unwrap_err();
        assert!(matches!(err, Error::UnsupportedVersion { found: 1, supported: FORMAT_VERSION, .. }), "{err}");
    }

    #[test]
    fn foreign_bytes_are_not_a_teraio_device() {
        assert!(matches!(Superblock::decode(&[0u8; 4096], Path::new("x")), Err(Error::NotATeraioDevice { .. })));
    }

    #[test]
    fn consistent_checksum_over_bad_fields_is_rejected() {
        let mut sb = sample();
        sb.stripe_unit_bytes = 1000;
        assert!(matches!(Superblock::decode(&sb.encode(), Path::new("x")), Err(Error::CorruptSuperblock { .. })));
        let mut sb = sample();
        sb.format_version = 99;
        assert!(matches!(Superblock::decode(&sb.encode(), Path::new("x")), Err(Error::UnsupportedVersion { .. })));
    }

    #[test]
    fn version_2_still_opens() {
        let sb = Superblock { format_version: 2, ..sample() };
        assert_eq!(Superblock::decode(&sb.encode(), Path::new("x")).unwrap().format_version, 2);
    }

    proptest::proptest! {
        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(proptest::num::u8::ANY, 0..4200)) {
            let _ = Superblock::decode(&bytes, Path::new("x"));
        }
    }
}
