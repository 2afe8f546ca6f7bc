//! The on-disk layout: superblocks, the object table and its journal, the extent allocator and the
//! stripe map. `docs/format.md` is the written specification of every byte here.

pub mod alloc;
pub mod codec;
pub mod metadata;
pub mod stripe;
pub mod superblock;
pub mod table;

/// Bytes of the superblock area at the start (and the backup at the end) of every device.
pub const SUPERBLOCK_BYTES: u64 = 4096;
