//! Configuration of a store: what is fixed at format time and what can change at each open.
//! Every field has a documented default.

use crate::backend::fault::FaultInjector;
use crate::backend::{BackendKind, UringOptions};
use crate::error::{Error, Result};

pub const KIB: u64 = 1024;
pub const MIB: u64 = 1024 * KIB;
pub const GIB: u64 = 1024 * MIB;

/// The most devices one store spans.
pub const MAX_DEVICES: usize = 64;

/// Fixed when a store is formatted.
#[derive(Debug, Clone)]
pub struct FormatConfig {
    /// Bytes of each stripe unit; a multiple of the block size. Default 1 MiB.
    pub stripe_unit_bytes: u64,
    /// Allocation and I/O alignment unit; a power of two in 512..=65536. Default 4096.
    /// NOTE: must be a multiple of every device's logical block size for O_DIRECT.
    pub block_size: u64,
    /// Keep a crc32c per stripe unit and check it on `fsck` and verified gets. Default true.
    pub checksums: bool,
    /// Largest caller metadata blob per object. Default 4096 (at most 65535).
    pub max_meta_bytes: u64,
    /// Bytes of each checkpoint slot: a checkpoint of the whole table must fit one, so this
    /// bounds the object count and caller metadata (puts past it fail with `TableFull`).
    /// Default: room for one object with `max_meta_bytes` of metadata per stripe unit of all
    /// devices' space, at least the journal's default size and at most 256 MiB and device 0's
    /// size / 8.
    pub checkpoint_slot_bytes: Option<u64>,
    /// Bytes of the journal ring. Default: device 0's size / 128, clamped to 1 MiB..=256 MiB.
    pub journal_bytes: Option<u64>,
    /// Create missing device files with this size (regular files only). Default: None (they must exist).
    pub create_file_bytes: Option<u64>,
    /// Overwrite devices that already hold a teraio store. Default false.
    pub force: bool,
    /// Open the devices with O_DIRECT while formatting. Default true; false for file systems
    /// without O_DIRECT (tmpfs), which must then be opened with `OpenConfig::direct_io` false too.
    pub direct_io: bool,
}

impl Default for FormatConfig {
    fn default() -> Self {
        FormatConfig {
            stripe_unit_bytes: MIB,
            block_size: 4096,
            checksums: true,
            max_meta_bytes: 4096,
            checkpoint_slot_bytes: None,
            journal_bytes: None,
            create_file_bytes: None,
            force: false,
            direct_io: true,
        }
    }
}

impl FormatConfig {
    pub fn validate(&self) -> Result<()> {
        let bs = self.block_size;
        if !bs.is_power_of_two() || !(512..=65536).contains(&bs) {
            return Err(Error::InvalidConfig(format!("block size {bs} must be a power of two in 512..=65536")));
        }
        let su = self.stripe_unit_bytes;
        if su == 0 || !su.is_multiple_of(bs) || su > u32::MAX as u64 / 2 {
            return Err(Error::InvalidConfig(format!(
                "stripe unit {su} must be a non-zero multiple of the block size {bs} and below 2 GiB"
            )));
        }
        if self.max_meta_bytes > u16::MAX as u64 {
            return Err(Error::InvalidConfig("max_meta_bytes must be at most 65535".into()));
        }
        for (name, v) in [("checkpoint_slot_bytes", self.checkpoint_slot_bytes), ("journal_bytes", self.journal_bytes)]
        {
            if let Some(v) = v {
                if v < 4 * bs || v % bs != 0 {
                    return Err(Error::InvalidConfig(format!(
                        "{name} {v} must be a multiple of {bs} and at least {}",
                        4 * bs
                    )));
                }
            }
        }
        Ok(())
    }
}

/// Chosen at each open.
#[derive(Debug, Clone)]
pub struct OpenConfig {
    /// Default `Auto`: io_uring where the kernel allows it, else psync (logged, and in stats).
    pub backend: BackendKind,
    /// Requests in flight per device. Default 32.
    pub queue_depth: usize,
    /// io_uring SQPOLL/IOPOLL. Default: both off.
    pub uring: UringOptions,
    /// O_DIRECT. Default true.
    pub direct_io: bool,
    /// Largest single device request. Default 4 MiB (requests never cross a stripe unit either).
    pub max_io_bytes: u64,
    /// Bytes of device requests in flight over the whole store; submission waits past this.
    /// Normal-priority work may use 7/8 of it, the rest is kept for urgent work. Default 1 GiB.
    pub max_inflight_bytes: u64,
    /// Bytes of bounce memory for unaligned buffers and partial last blocks, allocated at open
    /// and registered with io_uring. Default 64 MiB.
    pub bounce_pool_bytes: u64,
    /// Check the crc32c of every stripe unit a get returns bytes of, failing the get with
    /// `ChecksumMismatch` instead of returning damaged data. A checksum covers a whole stripe
    /// unit: a ranged get checks the units it covers whole, and a unit it covers in part when
    /// reading the rest of it at most doubles the get's I/O (else those bytes are returned
    /// unchecked). Needs a store formatted with
    /// checksums; GPU gets on the cuFile path cannot be checked (their bytes never pass through
    /// host memory; the GPU report says so). Default true.
    pub verify_checksums: bool,
    /// Flush written devices and the journal before a put or delete is acknowledged, so it
    /// survives power loss, not only a process crash. Default true.
    pub durable: bool,
    /// Faults to inject into every device's backend (tests, reliability runs). Default None.
    pub fault_injector: Option<FaultInjector>,
    /// Keep a power-cut undo log of unflushed writes in this directory (reliability runs; slow).
    /// Default None.
    pub power_cut_log_dir: Option<std::path::PathBuf>,
    /// Make every device behave like an SSD of this bandwidth and latency (an emulated array:
    /// see `backend::throttle`). Default None (the devices as they are).
    pub emulate: Option<crate::backend::throttle::DeviceModel>,
    /// How long to wait for a device lock held by another writer before failing with `Locked`.
    /// A crashed writer's lock is released only once the kernel has finished its last requests.
    /// Default 2 s.
    pub lock_wait_ms: u64,
    /// GPU data paths (used from the first GPU put/get on). Default: `GpuOptions::default()`.
    pub gpu: GpuOptions,
}

impl Default for OpenConfig {
    fn default() -> Self {
        OpenConfig {
            backend: BackendKind::Auto,
            queue_depth: 32,
            uring: UringOptions::default(),
            direct_io: true,
            max_io_bytes: 4 * MIB,
            max_inflight_bytes: GIB,
            bounce_pool_bytes: 64 * MIB,
            verify_checksums: true,
            durable: true,
            fault_injector: None,
            lock_wait_ms: 2000,
            power_cut_log_dir: None,
            emulate: None,
            gpu: GpuOptions::default(),
        }
    }
}

impl OpenConfig {
    pub fn validate(&self, block_size: u64) -> Result<()> {
        if self.queue_depth == 0 || self.queue_depth > 4096 {
            return Err(Error::InvalidConfig(format!("queue depth {} must be in 1..=4096", self.queue_depth)));
        }
        if self.max_io_bytes < block_size || !self.max_io_bytes.is_multiple_of(block_size) || self.max_io_bytes > GIB {
            return Err(Error::InvalidConfig(format!(
                "max_io_bytes {} must be a multiple of the block size {block_size}, at most 1 GiB",
                self.max_io_bytes
            )));
        }
        if self.max_inflight_bytes < 2 * self.max_io_bytes {
            return Err(Error::InvalidConfig(format!(
                "max_inflight_bytes {} must be at least twice max_io_bytes {}",
                self.max_inflight_bytes, self.max_io_bytes
            )));
        }
        Ok(())
    }
}

/// How GPU memory moves to and from the SSDs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum GpuPath {
    /// cuFile if libcufile works here and a short measurement finds it faster than the pinned
    /// bounce path, else the bounce path; the report says what was measured and chosen.
    #[default]
    Auto,
    /// Through the store's pinned bounce chunks, with overlapped host<->device copies.
    Bounce,
    /// Through libcufile, in true GDS or compatibility mode (the report says which, and why).
    Cufile,
    /// Through libcufile in true GDS mode only: an error (naming the reasons) where only
    /// compatibility mode is possible.
    Gds,
}

impl GpuPath {
    pub fn name(self) -> &'static str {
        match self {
            GpuPath::Auto => "auto",
            GpuPath::Bounce => "bounce",
            GpuPath::Cufile => "cufile",
            GpuPath::Gds => "gds",
        }
    }
}

impl std::str::FromStr for GpuPath {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "auto" => Ok(GpuPath::Auto),
            "bounce" | "pinned" | "compat" => Ok(GpuPath::Bounce),
            "cufile" => Ok(GpuPath::Cufile),
            "gds" => Ok(GpuPath::Gds),
            other => Err(Error::InvalidConfig(format!("unknown GPU path {other:?}; use auto, bounce, cufile or gds"))),
        }
    }
}

/// GPU data path settings, read when a store's first GPU op sets its GPU state up.
/// NOTE: the pinned host memory the bounce path uses is the store's bounce slab, so
/// `OpenConfig::bounce_pool_bytes` bounds it (pinned memory can never exhaust RAM).
#[derive(Debug, Clone)]
pub struct GpuOptions {
    /// Default `Auto`.
    pub path: GpuPath,
    /// CUDA streams per GPU for bounce copies. Default 4.
    pub copy_streams: usize,
    /// Threads per store device issuing cuFile calls (they block). Default 8.
    pub cufile_threads_per_device: usize,
    /// Bytes `Auto` reads through each path to compare them. Default 64 MiB.
    pub auto_probe_bytes: u64,
}

impl Default for GpuOptions {
    fn default() -> Self {
        GpuOptions { path: GpuPath::Auto, copy_streams: 4, cufile_threads_per_device: 8, auto_probe_bytes: 64 * MIB }
    }
}

/// Parses sizes like `4096`, `4k`, `1MiB`, `64M`, `2G`, `1.5GiB` (powers of 1024) or `94GB`
/// (powers of 1000): teraio-units, the one parser every interface shares.
pub fn parse_size(text: &str) -> Result<u64> {
    teraio_units::parse_size_bytes(text).map_err(|e| Error::InvalidConfig(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse() {
        assert_eq!(parse_size("4096").unwrap(), 4096);
        assert_eq!(parse_size("4k").unwrap(), 4096);
        assert_eq!(parse_size("1MiB").unwrap(), MIB);
        assert_eq!(parse_size("1.5G").unwrap(), 3 * GIB / 2);
        assert!(parse_size("abc").is_err());
        assert!(parse_size("4q").is_err());
        assert_eq!(parse_size("1.5").unwrap(), 1, "fractions round down to whole bytes (teraio-units)");
        assert_eq!(parse_size("1GB").unwrap(), 1_000_000_000, "GB is decimal, as the planner reads it");
    }

    #[test]
    fn configs_validate() {
        assert!(FormatConfig::default().validate().is_ok());
        assert!(FormatConfig { stripe_unit_bytes: 1000, ..Default::default() }.validate().is_err());
        assert!(FormatConfig { block_size: 3000, ..Default::default() }.validate().is_err());
        assert!(OpenConfig::default().validate(4096).is_ok());
        assert!(OpenConfig { queue_depth: 0, ..Default::default() }.validate(4096).is_err());
        assert!(OpenConfig { max_io_bytes: 5000, ..Default::default() }.validate(4096).is_err());
    }
}
