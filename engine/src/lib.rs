//! teraio's storage engine: a striped tensor-object store over many SSDs with its own block
//! layout, per-device queues and pluggable I/O backends (io_uring, psync).
//!
//! The data path, top to bottom: [`Store`] (put/get/delete, tickets, priorities) ->
//! [`layout::stripe`] (which device bytes hold which object bytes) -> the dispatcher and the
//! in-flight budget -> [`queue`] (one worker per device, urgent lane first) -> [`backend`]
//! (io_uring or psync, or a fault-injecting wrapper). The on-disk format is in `docs/format.md`.
//! GPU memory (put/get from CUDA device pointers, the pinned bounce and cuFile paths) is the
//! store's [`store::gpu`], over [`cuda`] (the driver, libcufile, copies), which sits below the
//! backends.
//! docs/internals.md describes the threads, an op's life and the lock order.
//!
//! Beside the store, [`adamw`] is the CPU Adam/AdamW step the offload runtime runs over
//! host-resident optimizer state.

pub mod adamw;
pub mod backend;
pub mod buffer;
pub mod config;
pub mod cuda;
pub mod device;
pub mod error;
pub mod layout;
pub mod options;
pub mod queue;
pub mod stats;
pub mod store;

pub use backend::fault::{Fault, FaultInjector, FaultRule};
pub use backend::{BackendKind, IoKind, UringOptions};
pub use buffer::AlignedBuf;
pub use config::{parse_size, FormatConfig, GpuOptions, GpuPath, OpenConfig, GIB, KIB, MIB};
pub use error::{Error, Result};
pub use queue::Priority;
pub use stats::{IoCounters, LatencySummary, OpCounters, StatsSnapshot};
pub use store::gpu::{GpuPathReport, GpuTicket};
pub use store::ticket::{wait_all, wait_all_ok, DoneSignal, IoBuf, IoBufMut, Ticket};
pub use store::{DeviceInfo, FsckReport, ObjectInfo, Store, StoreInfo, StoreInfoAtFormat};
