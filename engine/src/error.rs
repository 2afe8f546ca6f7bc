//! The engine's error type: one enum whose messages say what went wrong and what to do about it.
//!
//! Operating errors (EIO, ENOSPC, a missing device, a corrupt superblock) are values of this enum;
//! programmer errors (a broken invariant) are assertions.

use std::io;
use std::path::PathBuf;

/// Result alias used across the engine.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Every way a teraio call can fail.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("cannot open device {path}: {source} (check that it exists and that you may read and write it)")]
    DeviceOpen { path: PathBuf, source: io::Error },

    #[error("{path} does not support O_DIRECT ({source}); put the store on a file system that does (ext4, xfs) or open with direct_io = false")]
    DirectIoUnsupported { path: PathBuf, source: io::Error },

    #[error("device {path} is {size_bytes} bytes; a teraio device needs at least {min_bytes} bytes")]
    DeviceTooSmall { path: PathBuf, size_bytes: u64, min_bytes: u64 },

    #[error("{path} is not a teraio device (no teraio superblock found); format it with `teraio format`")]
    NotATeraioDevice { path: PathBuf },

    /// A device whose identity cannot be trusted: both superblock copies damaged, stale, shorter
    /// than recorded, or not matching the other devices. `detail` says which and what to do.
    #[error("{path}: {detail}")]
    CorruptSuperblock { path: PathBuf, detail: String },

    #[error("{path} was formatted with teraio format version {found}; this build reads version {supported}: read its objects with the teraio release that wrote it and put them into a store formatted by this one")]
    UnsupportedVersion { path: PathBuf, found: u32, supported: u32 },

    #[error("{path} belongs to store {found}, not to store {expected}; give only the devices of one store")]
    WrongStore { path: PathBuf, expected: String, found: String },

    #[error("device {index} of {count} is missing; give all {count} devices of the store (in any order)")]
    MissingDevice { index: u16, count: u16 },

    #[error("devices {first} and {second} both claim to be device {index} of the store; give each device once")]
    DuplicateDevice { index: u16, first: PathBuf, second: PathBuf },

    #[error("{given} devices given but the store has {count}; give exactly the store's devices")]
    DeviceCountMismatch { given: usize, count: u16 },

    #[error("store device {path} is already open by another writer (lock held); close the other process first")]
    Locked { path: PathBuf },

    /// Damaged checkpoints or journal: `detail` names the device, offset and what to do.
    #[error("store metadata is corrupt: {detail}")]
    CorruptMetadata { detail: String },

    /// Raised only when no placement of the object exists on any device.
    #[error("{}", no_space_message(*needed_bytes, *free_bytes, *largest_placeable_bytes))]
    NoSpace { needed_bytes: u64, free_bytes: u64, largest_placeable_bytes: u64 },

    /// The object table (not data space) has no room for a put: `detail` says which limit and
    /// what frees room.
    #[error("the object table is full: {detail}")]
    TableFull { detail: String },

    #[error("object {id} not found")]
    NotFound { id: u64 },

    #[error("buffer of {given_bytes} bytes is too small for {needed_bytes} bytes")]
    BufferTooSmall { needed_bytes: u64, given_bytes: u64 },

    #[error("range {offset}+{len} is outside object {id} of {object_len} bytes")]
    RangeOutOfBounds { id: u64, offset: u64, len: u64, object_len: u64 },

    #[error("caller metadata of {len} bytes is larger than the limit of {max} bytes")]
    MetadataTooLarge { len: usize, max: usize },

    #[error("invalid configuration: {0}")]
    InvalidConfig(String),

    #[error("I/O error on device {device} ({path}) during {op} at offset {offset}: {source}")]
    DeviceIo { device: u16, path: PathBuf, op: &'static str, offset: u64, source: io::Error },

    #[error("checksum mismatch in object {id}, stripe unit {unit} (device {device}, offset {device_offset}): the data on disk is damaged; it was not returned")]
    ChecksumMismatch { id: u64, unit: u64, device: u16, device_offset: u64 },

    #[error("backend {backend} is not available: {reason}")]
    BackendUnavailable { backend: &'static str, reason: String },

    #[error("I/O error: {context}: {source}")]
    Io { context: String, source: io::Error },

    #[error("the store is closed")]
    Closed,

    #[error("CUDA call {call} failed: {detail}")]
    Gpu { call: &'static str, detail: String },
}

/// The advice depends on why nothing fits: too little space in all, or space too scattered
/// (over devices or into runs) for an object this large.
fn no_space_message(needed: u64, free: u64, largest: u64) -> String {
    if needed > free {
        format!(
            "not enough free space for an object of {needed} bytes: the store has {free} bytes free in all, and the largest object it can place now is {largest} bytes; delete objects or add devices"
        )
    } else {
        format!(
            "no placement for an object of {needed} bytes although the store has {free} bytes free: that space is split over devices and free runs so that the largest object it can place now is {largest} bytes; store it as smaller objects, or delete objects to make room"
        )
    }
}

impl Error {
    /// Wraps an `io::Error` with a sentence about what was being done.
    pub fn io(context: impl Into<String>, source: io::Error) -> Self {
        Error::Io { context: context.into(), source }
    }

    /// The errno behind this error, where there is one (for the C ABI and Python).
    pub fn raw_os_error(&self) -> Option<i32> {
        match self {
            Error::DeviceOpen { source, .. }
            | Error::DirectIoUnsupported { source, .. }
            | Error::DeviceIo { source, .. }
            | Error::Io { source, .. } => source.raw_os_error(),
            Error::NoSpace { .. } | Error::TableFull { .. } => Some(libc::ENOSPC),
            Error::NotFound { .. } => Some(libc::ENOENT),
            Error::Locked { .. } => Some(libc::EBUSY),
            _ => None,
        }
    }
}

/// Manual `Clone`: `io::Error` is not `Clone`, but an op's error is handed to every waiter.
impl Clone for Error {
    fn clone(&self) -> Self {
        fn c(e: &io::Error) -> io::Error {
            match e.raw_os_error() {
                Some(code) => io::Error::from_raw_os_error(code),
                None => io::Error::new(e.kind(), e.to_string()),
            }
        }
        match self {
            Error::DeviceOpen { path, source } => Error::DeviceOpen { path: path.clone(), source: c(source) },
            Error::DirectIoUnsupported { path, source } => {
                Error::DirectIoUnsupported { path: path.clone(), source: c(source) }
            }
            Error::DeviceTooSmall { path, size_bytes, min_bytes } => {
                Error::DeviceTooSmall { path: path.clone(), size_bytes: *size_bytes, min_bytes: *min_bytes }
            }
            Error::NotATeraioDevice { path } => Error::NotATeraioDevice { path: path.clone() },
            Error::CorruptSuperblock { path, detail } => {
                Error::CorruptSuperblock { path: path.clone(), detail: detail.clone() }
            }
            Error::UnsupportedVersion { path, found, supported } => {
                Error::UnsupportedVersion { path: path.clone(), found: *found, supported: *supported }
            }
            Error::WrongStore { path, expected, found } => {
                Error::WrongStore { path: path.clone(), expected: expected.clone(), found: found.clone() }
            }
            Error::MissingDevice { index, count } => Error::MissingDevice { index: *index, count: *count },
            Error::DuplicateDevice { index, first, second } => {
                Error::DuplicateDevice { index: *index, first: first.clone(), second: second.clone() }
            }
            Error::DeviceCountMismatch { given, count } => Error::DeviceCountMismatch { given: *given, count: *count },
            Error::Locked { path } => Error::Locked { path: path.clone() },
            Error::CorruptMetadata { detail } => Error::CorruptMetadata { detail: detail.clone() },
            Error::NoSpace { needed_bytes, free_bytes, largest_placeable_bytes } => Error::NoSpace {
                needed_bytes: *needed_bytes,
                free_bytes: *free_bytes,
                largest_placeable_bytes: *largest_placeable_bytes,
            },
            Error::TableFull { detail } => Error::TableFull { detail: detail.clone() },
            Error::NotFound { id } => Error::NotFound { id: *id },
            Error::BufferTooSmall { needed_bytes, given_bytes } => {
                Error::BufferTooSmall { needed_bytes: *needed_bytes, given_bytes: *given_bytes }
            }
            Error::RangeOutOfBounds { id, offset, len, object_len } => {
                Error::RangeOutOfBounds { id: *id, offset: *offset, len: *len, object_len: *object_len }
            }
            Error::MetadataTooLarge { len, max } => Error::MetadataTooLarge { len: *len, max: *max },
            Error::InvalidConfig(s) => Error::InvalidConfig(s.clone()),
            Error::DeviceIo { device, path, op, offset, source } => {
                Error::DeviceIo { device: *device, path: path.clone(), op, offset: *offset, source: c(source) }
            }
            Error::ChecksumMismatch { id, unit, device, device_offset } => {
                Error::ChecksumMismatch { id: *id, unit: *unit, device: *device, device_offset: *device_offset }
            }
            Error::BackendUnavailable { backend, reason } => {
                Error::BackendUnavailable { backend, reason: reason.clone() }
            }
            Error::Io { context, source } => Error::Io { context: context.clone(), source: c(source) },
            Error::Closed => Error::Closed,
            Error::Gpu { call, detail } => Error::Gpu { call, detail: detail.clone() },
        }
    }
}
