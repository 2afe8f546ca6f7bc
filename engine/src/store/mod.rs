//! The tensor-object store: format and open a store over 1 to 64 devices, then put, get, delete,
//! stat and list objects. The data path reads top to bottom: the API ([`api`], [`gpu_api`]) ->
//! the stripe map ([`crate::layout::stripe`]) -> the dispatcher ([`dispatch`]) -> per-device
//! queues ([`crate::queue`]) -> a backend ([`crate::backend`]) -> the verify threads ([`verifiers`],
//! gets) or the commit thread ([`commit`], puts).
//! docs/internals.md tells the whole story: threads, queues, an op's life and the lock order.

mod api;
mod commit;
mod crcs;
mod dispatch;
mod fsck;
pub mod gpu;
mod gpu_api;
mod identity;
mod info;
mod object;
mod op;
mod open;
pub(crate) mod place;
pub mod ticket;
mod verifiers;
mod verify;

pub use api::ObjectInfo;
pub use fsck::FsckReport;
pub use info::{DeviceInfo, StoreInfo};
pub use open::StoreInfoAtFormat;

use crate::backend::stack::DeviceWrappers;
use crate::backend::{BackendChoice, BackendKind};
use crate::buffer::BouncePool;
use crate::config::OpenConfig;
use crate::device::Device;
use crate::error::Result;
use crate::layout::superblock::Superblock;
use crate::queue::DeviceQueue;
use crate::stats::OpCounters;
use crate::store::gpu::runtime::StoreGpu;
use commit::CommitMsg;
use dispatch::DispatchState;
use object::{Allocators, Geometry, Object};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize};
use std::sync::mpsc::Sender;
use std::sync::{Arc, Condvar, Mutex, RwLock};
use std::thread::JoinHandle;

/// Everything the engine's threads share.
pub(crate) struct Shared {
    pub geometry: Geometry,
    pub config: OpenConfig,
    pub superblocks: Vec<Superblock>,
    /// GPU state, set up by the first GPU op. Before `queues`, `devices` and `pool`: its cuFile
    /// queues stop and the slab is unpinned before the device files close and the slab is freed.
    pub gpu: std::sync::OnceLock<Result<StoreGpu>>,
    /// Before `devices`: the queues' workers stop before the device files close.
    pub queues: Vec<DeviceQueue>,
    /// Per device: what every backend of it is wrapped in (its host queue's, its cuFile queue's).
    pub wrappers: Vec<DeviceWrappers>,
    pub devices: Vec<Device>,
    pub pool: BouncePool,
    pub table: RwLock<HashMap<u64, Arc<Object>>>,
    pub allocators: Allocators,
    pub dispatch: Mutex<DispatchState>,
    pub dispatch_cv: Condvar,
    /// Where verified gets' pieces are finished, off the device workers (`verifiers`).
    pub verifiers: verifiers::Verifiers,
    pub commit_tx: Mutex<Option<Sender<CommitMsg>>>,
    pub ops_outstanding: Mutex<u64>,
    pub ops_idle: Condvar,
    pub op_counters: Mutex<OpCounters>,
    pub backend_choice: BackendChoice,
    pub next_first_device: AtomicUsize,
    pub closed: AtomicBool,
    /// Opened with `open_read_only`: nothing may be written.
    pub read_only: bool,
    /// What recovery at open found besides the table (reported by `fsck`).
    pub recovery: commit::Findings,
    /// Bytes the table's records take in a checkpoint; kept by the commit thread, which holds
    /// it to what a checkpoint slot fits.
    pub table_bytes: AtomicU64,
    /// What a writer's open repaired (damaged superblock copies, a damaged newest checkpoint).
    pub repairs_at_open: Mutex<Vec<String>>,
}

/// A striped tensor-object store. Cheap to share between threads (`&Store` is enough for every op).
pub struct Store {
    shared: Arc<Shared>,
    dispatcher: Option<JoinHandle<()>>,
    committer: Option<JoinHandle<()>>,
}

impl Drop for Store {
    fn drop(&mut self) {
        let _ = self.shutdown();
    }
}

/// Parses a backend name (re-exported for the CLI and bindings).
pub fn parse_backend(name: &str) -> Result<BackendKind> {
    name.parse()
}
