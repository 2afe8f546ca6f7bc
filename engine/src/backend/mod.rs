//! How bytes move: one small trait that every I/O backend implements, one file per kind.
//!
//! A backend serves one device. The per-device queue ([`crate::queue`]) pushes requests into it and
//! reaps completions from it; the backend never decides order or priority, so a new backend
//! (cuFile, NVMe passthrough, an emulated device) plugs in without touching the queue code.

pub mod cufile;
pub mod fault;
pub mod powercut;
pub mod psync;
pub(crate) mod stack;
pub mod throttle;
pub mod uring;

use crate::buffer::BouncePool;
use crate::device::Device;
use crate::error::{Error, Result};
use std::io;
use std::sync::Arc;

/// What a request does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum IoKind {
    Read,
    Write,
    /// Make completed writes durable (fdatasync).
    Flush,
}

impl IoKind {
    pub fn name(self) -> &'static str {
        match self {
            IoKind::Read => "read",
            IoKind::Write => "write",
            IoKind::Flush => "flush",
        }
    }
}

/// One device request. `buf` must stay valid and untouched until its completion is reaped.
#[derive(Debug, Clone, Copy)]
pub struct BackendRequest {
    pub token: u64,
    pub kind: IoKind,
    pub offset: u64,
    pub buf: *mut u8,
    pub len: u32,
    /// Index of the registered (fixed) buffer that contains `buf`, where there is one.
    pub fixed_index: Option<u16>,
}

// SAFETY: the pointer is only dereferenced by the kernel or a backend thread while the owner of the
// memory keeps it alive (the queue holds it until completion).
unsafe impl Send for BackendRequest {}

/// A finished request: `result` is the byte count, or a negative errno.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BackendCompletion {
    pub token: u64,
    pub result: i32,
}

/// Wakes a queue worker that waits inside [`Backend::submit_and_reap`].
pub type Waker = Arc<dyn Fn() + Send + Sync>;

/// An I/O backend for one device.
pub trait Backend: Send {
    /// A short name for reports ("io_uring", "psync").
    fn name(&self) -> &'static str;

    /// Queues one request; it reaches the device at the next `submit_and_reap`.
    ///
    /// # Safety
    /// `request.buf` must be valid for `request.len` bytes until its completion is returned, and the
    /// caller must never have more requests outstanding than the depth the backend was built with.
    unsafe fn push(&mut self, request: BackendRequest);

    /// Submits what was pushed, then moves finished requests into `out`. With `wait`, blocks until
    /// at least one completion arrives or the waker is called.
    fn submit_and_reap(&mut self, wait: bool, out: &mut Vec<BackendCompletion>) -> io::Result<()>;

    /// A handle that makes a blocked `submit_and_reap` return.
    fn waker(&self) -> Waker;
}

/// Which backend to use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum BackendKind {
    /// io_uring where the kernel allows it, else psync; the choice is logged and shown in stats.
    #[default]
    Auto,
    IoUring,
    Psync,
    /// A backend from another crate, built by its factory (teraio-nvme's NVMe passthrough and
    /// userspace driver: `teraio_nvme::PASSTHRU`, ...).
    External(BackendFactory),
}

/// Builds one device's backend of another crate: (device, depth, bounce pool).
pub type BuildBackend = fn(&Device, usize, &BouncePool) -> Result<Box<dyn Backend>>;

/// A backend of another crate, as an open config names it: its name (for reports and errors) and
/// how to build it for one device.
#[derive(Clone, Copy)]
pub struct BackendFactory {
    pub name: &'static str,
    pub build: BuildBackend,
}

impl std::fmt::Debug for BackendFactory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "BackendFactory({:?})", self.name)
    }
}

/// Factories are told apart by name (comparing function pointers is not reliable).
impl PartialEq for BackendFactory {
    fn eq(&self, other: &Self) -> bool {
        self.name == other.name
    }
}

impl Eq for BackendFactory {}

/// The backend names users give (`backend="auto"` in Python, `--backend` in the CLI); external
/// backends are not named by strings but passed as [`BackendKind::External`] factories.
impl std::str::FromStr for BackendKind {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "auto" => Ok(BackendKind::Auto),
            "io_uring" | "uring" | "io-uring" => Ok(BackendKind::IoUring),
            "psync" => Ok(BackendKind::Psync),
            other => Err(Error::InvalidConfig(format!("unknown backend {other:?}; use auto, io_uring or psync"))),
        }
    }
}

/// Options for building backends. Defaults: io_uring without SQPOLL or IOPOLL.
#[derive(Debug, Clone, Copy, Default)]
pub struct UringOptions {
    /// Kernel submission polling thread with this idle time in ms (None: off).
    pub sqpoll_idle_ms: Option<u32>,
    /// Polled completions (needs O_DIRECT on a device with poll queues).
    pub iopoll: bool,
}

/// What was chosen for a store, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BackendChoice {
    pub kind: BackendKind,
    pub reason: String,
}

/// Decides the backend for `requested`: `Auto` probes io_uring once and says why it was or was not
/// taken; an explicit choice that cannot be had is an error, never a silent fallback.
pub fn choose(requested: BackendKind, uring: &UringOptions) -> Result<BackendChoice> {
    match requested {
        BackendKind::Psync => Ok(BackendChoice { kind: BackendKind::Psync, reason: "psync requested".into() }),
        BackendKind::External(factory) => {
            Ok(BackendChoice { kind: requested, reason: format!("{} requested", factory.name) })
        }
        BackendKind::IoUring => match uring::probe(uring) {
            Ok(()) => Ok(BackendChoice { kind: BackendKind::IoUring, reason: "io_uring requested".into() }),
            Err(e) => Err(Error::BackendUnavailable { backend: "io_uring", reason: e.to_string() }),
        },
        BackendKind::Auto => match uring::probe(uring) {
            Ok(()) => Ok(BackendChoice { kind: BackendKind::IoUring, reason: "auto: io_uring is available".into() }),
            Err(e) => {
                let reason = format!("auto: io_uring unavailable ({e}); using psync");
                tracing::warn!("{reason}");
                Ok(BackendChoice { kind: BackendKind::Psync, reason })
            }
        },
    }
}

/// Builds the chosen backend for one device with room for `depth` requests in flight.
pub fn build(
    kind: BackendKind,
    device: &Device,
    depth: usize,
    uring_options: &UringOptions,
    pool: &BouncePool,
) -> Result<Box<dyn Backend>> {
    if device.external.is_some() && !matches!(kind, BackendKind::External(_)) {
        let reason = format!("{} is driven from userspace; open it with its own backend", device.path.display());
        return Err(Error::BackendUnavailable { backend: "io_uring/psync", reason });
    }
    match kind {
        BackendKind::IoUring => Ok(Box::new(uring::UringBackend::new(device, depth, uring_options, pool)?)),
        BackendKind::Psync => Ok(Box::new(psync::PsyncBackend::new(device, depth)?)),
        BackendKind::External(factory) => (factory.build)(device, depth, pool),
        BackendKind::Auto => unreachable!("resolve Auto with choose() first"),
    }
}
