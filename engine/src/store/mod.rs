//! The tensor-object store: format and open a store over 1 to 64 devices, then put, get, delete,
//! stat and list objects. The data path reads top to bottom: this API -> the stripe map
//! ([`crate::layout::stripe`]) -> the dispatcher ([`dispatch`]) -> per-device queues
//! ([`crate::queue`]) -> a backend ([`crate::backend`]).

mod commit;
mod dispatch;
mod identity;
mod object;
pub mod ticket;

use crate::backend::fault::FaultyBackend;
use crate::backend::powercut::PowerCutBackend;
use crate::backend::{self, BackendChoice, BackendKind};
use crate::buffer::{AlignedBuf, BouncePool};
use crate::config::{FormatConfig, OpenConfig, MAX_DEVICES, MIB};
use crate::device::{self, Access, Device};
use crate::error::{Error, Result};
use crate::gpu::runtime::StoreGpu;
use crate::layout::alloc::{DeviceAllocator, Extent};
use crate::layout::codec::{round_down, round_up};
use crate::layout::metadata::encode_checkpoint;
use crate::layout::stripe::{position_bytes, unit_count, StripeMap};
use crate::layout::superblock::{flags, Superblock, FORMAT_VERSION};
use crate::layout::table::{ObjectRecord, MAX_EXTENTS_PER_DEVICE};
use crate::layout::SUPERBLOCK_BYTES;
use crate::queue::{DeviceQueue, Priority};
use crate::stats::{IoCounters, OpCounters, StatsSnapshot};
use commit::CommitMsg;
use dispatch::{DispatchState, Op, OpKind, OpObject};
use object::{Allocators, Geometry, Object};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::{sync_channel, Sender};
use std::sync::{Arc, Condvar, Mutex, RwLock};
use std::thread::JoinHandle;
use ticket::{IoBuf, IoBufMut, Ticket};

/// What `stat` and `list` tell about an object.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ObjectInfo {
    pub id: u64,
    pub len_bytes: u64,
    pub meta: Vec<u8>,
    /// Devices the object is striped over, in stripe order.
    pub devices: Vec<u16>,
    pub extent_count: usize,
}

/// One device as `info` reports it.
#[derive(Debug, Clone)]
pub struct DeviceInfo {
    pub index: u16,
    pub path: PathBuf,
    pub size_bytes: u64,
    pub data_bytes: u64,
    pub free_bytes: u64,
    pub largest_free_bytes: u64,
    pub free_runs: usize,
    pub is_block_device: bool,
}

/// The store as `info` reports it.
#[derive(Debug, Clone)]
pub struct StoreInfo {
    pub uuid: String,
    pub format_version: u32,
    pub block_size: u64,
    pub stripe_unit_bytes: u64,
    pub checksums: bool,
    pub devices: Vec<DeviceInfo>,
    pub object_count: usize,
    pub object_bytes: u64,
    pub backend: String,
    pub backend_reason: String,
    pub checkpoint_slot_bytes: u64,
    pub journal_bytes: u64,
}

/// What `fsck` found.
#[derive(Debug, Clone, Default)]
pub struct FsckReport {
    pub objects_checked: u64,
    pub bytes_checked: u64,
    pub units_checked: u64,
    /// One line per problem (still there after any repair); empty when the store is sound.
    pub problems: Vec<String>,
    /// Harmless findings, one line each: the remains of interrupted writes that recovery ignores.
    pub notes: Vec<String>,
    /// What `fsck_paths` with `repair` fixed, one line each.
    pub repairs: Vec<String>,
}

/// The problems of a check that `fsck_paths` with `repair` can fix.
#[derive(Debug, Default)]
struct Fixable {
    /// Damaged or disagreeing superblock copies (a writer's open rewrites both copies).
    superblock_copies: Vec<String>,
    /// A damaged newest checkpoint, recovered from without loss (a new checkpoint replaces it).
    checkpoint: bool,
}

impl Fixable {
    fn is_empty(&self) -> bool {
        self.superblock_copies.is_empty() && !self.checkpoint
    }
}

impl FsckReport {
    pub fn is_clean(&self) -> bool {
        self.problems.is_empty()
    }
}

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
    pub devices: Vec<Device>,
    pub pool: BouncePool,
    pub table: RwLock<HashMap<u64, Arc<Object>>>,
    pub allocators: Allocators,
    pub dispatch: Mutex<DispatchState>,
    pub dispatch_cv: Condvar,
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
}

impl Shared {
    fn op_started(&self) -> Result<()> {
        let mut n = self.ops_outstanding.lock().expect("ops");
        if self.closed.load(Ordering::Acquire) {
            return Err(Error::Closed);
        }
        *n += 1;
        Ok(())
    }

    pub(crate) fn op_finished(&self) {
        let mut n = self.ops_outstanding.lock().expect("ops");
        *n -= 1;
        // Only `close` waits for this (it sets `closed` under the same lock first).
        if *n == 0 && self.closed.load(Ordering::Acquire) {
            self.ops_idle.notify_all();
        }
    }
}

/// A striped tensor-object store. Cheap to share between threads (`&Store` is enough for every op).
pub struct Store {
    shared: Arc<Shared>,
    dispatcher: Option<JoinHandle<()>>,
    committer: Option<JoinHandle<()>>,
}

impl Store {
    /// Formats `paths` as one new store. Regular files are created with
    /// `config.create_file_bytes` if missing. Devices that hold a store are refused unless
    /// `config.force`; so are mounted block devices.
    pub fn format(paths: &[impl AsRef<Path>], config: &FormatConfig) -> Result<StoreInfoAtFormat> {
        config.validate()?;
        let paths: Vec<PathBuf> = paths.iter().map(|p| p.as_ref().to_path_buf()).collect();
        check_device_list(&paths)?;
        let mut devices = Vec::with_capacity(paths.len());
        for path in &paths {
            if !path.exists() {
                match config.create_file_bytes {
                    Some(size) => device::create_file(path, size)?,
                    None => {
                        return Err(Error::DeviceOpen {
                            path: path.clone(),
                            source: std::io::Error::new(
                                std::io::ErrorKind::NotFound,
                                "no such file (give a size to create it)",
                            ),
                        })
                    }
                }
            }
            let d = Device::open_for(path, config.direct_io, Access::Exclusive)?;
            if d.is_block_device && !config.force {
                if let Some(m) = device::mounted_at(path) {
                    return Err(Error::InvalidConfig(format!(
                        "{} is mounted ({m}); unmount it, or pass force to overwrite it",
                        path.display()
                    )));
                }
            }
            if !config.force {
                let mut block = AlignedBuf::new(SUPERBLOCK_BYTES as usize, 4096)?;
                if d.size_bytes >= SUPERBLOCK_BYTES && d.read_exact_at(&mut block, 0).is_ok() {
                    match Superblock::decode(&block, path) {
                        Ok(sb) => {
                            return Err(Error::InvalidConfig(format!(
                                "{} already holds teraio store {}; pass force to overwrite it",
                                path.display(),
                                sb.uuid_string()
                            )))
                        }
                        Err(Error::UnsupportedVersion { found, .. }) => {
                            return Err(Error::InvalidConfig(format!(
                                "{} already holds a teraio store of format version {found}; pass force to overwrite it",
                                path.display()
                            )))
                        }
                        Err(_) => {}
                    }
                }
            }
            devices.push(d);
        }

        let block = config.block_size;
        let su = config.stripe_unit_bytes;
        let data_align = block.max(su.min(MIB));
        let dev0_bytes = round_down(devices[0].size_bytes, SUPERBLOCK_BYTES);
        let default_meta = round_up((dev0_bytes / 128).clamp(MIB, 256 * MIB), block);
        let slot_bytes = config.checkpoint_slot_bytes.unwrap_or(default_meta);
        let journal_bytes = config.journal_bytes.unwrap_or(slot_bytes);
        let uuid = *uuid::Uuid::new_v4().as_bytes();
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
        let mut superblocks = Vec::new();
        for (index, d) in devices.iter().enumerate() {
            let device_bytes = round_down(d.size_bytes, SUPERBLOCK_BYTES);
            let (metadata_start, slot, journal) =
                if index == 0 { (SUPERBLOCK_BYTES, slot_bytes, journal_bytes) } else { (0, 0, 0) };
            let metadata_end = SUPERBLOCK_BYTES + 2 * slot + journal;
            let data_start = round_up(metadata_end, data_align);
            let data_end = round_down(device_bytes.saturating_sub(SUPERBLOCK_BYTES), block);
            let min_bytes = data_start + su + SUPERBLOCK_BYTES;
            if device_bytes < min_bytes || data_end < data_start + su {
                return Err(Error::DeviceTooSmall { path: d.path.clone(), size_bytes: d.size_bytes, min_bytes });
            }
            superblocks.push(Superblock {
                format_version: FORMAT_VERSION,
                flags: if config.checksums { flags::CHECKSUMS } else { 0 },
                store_uuid: uuid,
                device_index: index as u16,
                device_count: devices.len() as u16,
                block_size: block as u32,
                stripe_unit_bytes: su as u32,
                device_bytes,
                data_start,
                data_end,
                metadata_start,
                checkpoint_slot_bytes: slot,
                journal_bytes: journal,
                created_unix_secs: now,
                max_meta_bytes: config.max_meta_bytes,
                epoch: 1,
            });
        }
        // Metadata first: an empty checkpoint of generation 1 in slot 1, slot 0 and the journal
        // head wiped so nothing of an earlier store can be replayed. Superblocks last.
        let sb0 = &superblocks[0];
        let zero = AlignedBuf::new(block as usize, block as usize)?;
        devices[0].write_all_at(&zero, sb0.metadata_start)?;
        devices[0].write_all_at(&zero, sb0.metadata_start + 2 * slot_bytes)?;
        let empty = encode_checkpoint(&uuid, 1, 1, std::iter::empty(), block);
        let mut buf = AlignedBuf::new(empty.len(), block as usize)?;
        buf.copy_from_slice(&empty);
        devices[0].write_all_at(&buf, sb0.metadata_start + slot_bytes)?;
        for (d, sb) in devices.iter().zip(&superblocks) {
            identity::write_superblock_copies(d, sb)?;
        }
        tracing::info!(uuid = %sb0.uuid_string(), devices = devices.len(), "formatted teraio store");
        Ok(StoreInfoAtFormat { uuid: sb0.uuid_string(), superblocks })
    }

    /// Formats and opens in one step.
    pub fn create(paths: &[impl AsRef<Path>], format: &FormatConfig, open: OpenConfig) -> Result<Store> {
        Store::format(paths, format)?;
        Store::open(paths, open)
    }

    /// Opens the store on `paths` (every device of it, in any order) as its one writer. Nothing is
    /// written before the devices, the checkpoints and the journal are checked; then every
    /// device moves to a new store epoch (rewriting a damaged superblock copy from the good one).
    pub fn open(paths: &[impl AsRef<Path>], config: OpenConfig) -> Result<Store> {
        Store::open_with(paths, config, Access::Writer)
    }

    /// Opens the store read-only, beside a writer that may hold it (for `info` and `fsck`): the
    /// devices are opened O_RDONLY under a shared lock, nothing is repaired or written, and puts,
    /// deletes and checkpoints are refused. Of a store a writer is changing, it sees the state of
    /// one moment during the open.
    pub fn open_read_only(paths: &[impl AsRef<Path>], config: OpenConfig) -> Result<Store> {
        let mut attempts = 0;
        loop {
            match Store::open_with(paths, config.clone(), Access::Reader) {
                // A writer may be between the writes of a superblock or a journal batch: look again.
                Err(Error::CorruptMetadata { .. } | Error::CorruptSuperblock { .. }) if attempts < 3 => {
                    attempts += 1;
                    std::thread::sleep(std::time::Duration::from_millis(50));
                }
                other => return other,
            }
        }
    }

    fn open_with(paths: &[impl AsRef<Path>], config: OpenConfig, access: Access) -> Result<Store> {
        let paths: Vec<PathBuf> = paths.iter().map(|p| p.as_ref().to_path_buf()).collect();
        check_device_list(&paths)?;
        let lock_wait = std::time::Duration::from_millis(config.lock_wait_ms);
        let mut found = Vec::with_capacity(paths.len());
        for path in &paths {
            let d = Device::open_locked(path, config.direct_io, access, lock_wait)?;
            let copies = identity::read_copies(&d);
            found.push((d, copies));
        }
        let members = identity::assemble(found)?;
        let expected = members.superblocks[0].clone();
        let count = expected.device_count;
        let block = expected.block_size as u64;
        config.validate(block)?;
        let geometry = Geometry {
            block_size: block,
            stripe_unit: expected.stripe_unit_bytes as u64,
            device_count: count,
            checksums: expected.has_checksums(),
            data_areas: members.superblocks.iter().map(|s| (s.data_start, s.data_end)).collect(),
        };

        let mut recovery = commit::Findings::default();
        let (records, mut journal) =
            commit::recover(&members.devices[0], &members.superblocks[0], &geometry, &mut recovery)?;
        identity::check_recorded_epoch(&members, journal.epoch)?;
        let identity::Members { devices, mut superblocks } = members;
        let allocators: Allocators = Arc::new(Mutex::new(
            superblocks
                .iter()
                .map(|s| DeviceAllocator::new(s.device_index, s.data_start / block, s.data_end / block))
                .collect(),
        ));
        let table = commit::claim(records, &allocators)
            .map_err(|e| commit::with_advice(e, &devices[0].path.display().to_string()))?;
        if access == Access::Writer {
            // Everything checked: from here on this writer's changes carry a new epoch.
            let epoch = identity::next_epoch(&superblocks, journal.epoch);
            identity::write_epoch_at_open(&devices, &mut superblocks, epoch)?;
            journal.epoch = epoch;
        }

        let choice = backend::choose(config.backend, &config.uring)?;
        tracing::info!(backend = ?choice.kind, reason = %choice.reason, "teraio backend");
        let chunk_bytes = geometry.stripe_unit.min(config.max_io_bytes);
        let chunk_count = (config.bounce_pool_bytes / chunk_bytes).clamp(2, u16::MAX as u64) as usize;
        let pool = BouncePool::new(chunk_bytes as usize, chunk_count, block as usize)?;
        let mut queues = Vec::with_capacity(devices.len());
        for (i, d) in devices.iter().enumerate() {
            let mut b = backend::build(choice.kind, d, config.queue_depth, &config.uring, &pool)?;
            if let Some(injector) = &config.fault_injector {
                b = Box::new(FaultyBackend::new(b, i as u16, injector.clone()));
            }
            if let Some(dir) = config.power_cut_log_dir.as_ref().filter(|_| access == Access::Writer) {
                b = Box::new(PowerCutBackend::new(b, i as u16, &d.file, dir, block as usize)?);
            }
            if let Some(model) = config.emulate {
                b = Box::new(crate::backend::throttle::ThrottledBackend::new(b, model));
            }
            queues.push(
                DeviceQueue::start(i as u16, b, config.queue_depth)
                    .map_err(|e| Error::io("starting a device queue thread", e))?,
            );
        }

        let (commit_tx, commit_rx) = std::sync::mpsc::channel();
        let shared = Arc::new(Shared {
            geometry,
            config,
            superblocks,
            gpu: std::sync::OnceLock::new(),
            queues,
            devices,
            pool,
            table: RwLock::new(table),
            allocators,
            dispatch: Mutex::new(DispatchState::default()),
            dispatch_cv: Condvar::new(),
            commit_tx: Mutex::new(Some(commit_tx)),
            ops_outstanding: Mutex::new(0),
            ops_idle: Condvar::new(),
            op_counters: Mutex::new(OpCounters::default()),
            backend_choice: choice,
            next_first_device: AtomicUsize::new(0),
            closed: AtomicBool::new(false),
            read_only: access == Access::Reader,
            recovery,
        });
        let s = shared.clone();
        let dispatcher = std::thread::Builder::new()
            .name("teraio-dispatch".into())
            .spawn(move || dispatch::run_dispatcher(s))
            .map_err(|e| Error::io("starting the dispatcher thread", e))?;
        let s = shared.clone();
        let committer = std::thread::Builder::new()
            .name("teraio-commit".into())
            .spawn(move || commit::run_commit(s, commit_rx, journal))
            .map_err(|e| Error::io("starting the commit thread", e))?;
        Ok(Store { shared, dispatcher: Some(dispatcher), committer: Some(committer) })
    }

    fn check_writable(&self) -> Result<()> {
        if self.shared.read_only {
            return Err(Error::InvalidConfig(
                "the store is open read-only (for inspection); open it with Store::open to change it".into(),
            ));
        }
        Ok(())
    }

    fn check_meta(&self, meta: &[u8]) -> Result<()> {
        let max = self.shared.superblocks[0].max_meta_bytes as usize;
        if meta.len() > max {
            return Err(Error::MetadataTooLarge { len: meta.len(), max });
        }
        Ok(())
    }

    /// Allocates a new object's extents. The device with the most free space takes the first
    /// stripe unit (device 0 also holds the metadata, so a plain rotation would fill it first;
    /// equal devices take turns), and every other first device is tried before giving up:
    /// `NoSpace` means no placement exists. Nothing is taken when it fails.
    fn allocate(&self, id: u64, len_bytes: u64, meta: &[u8]) -> Result<Object> {
        let g = &self.shared.geometry;
        let padded = round_up(len_bytes, g.block_size);
        let units = unit_count(padded, g.stripe_unit);
        let spread = units.max(1).min(g.device_count as u64) as u16;
        let needs = position_bytes(padded, g.stripe_unit, spread);
        let count = g.device_count as usize;
        let rotation = self.shared.next_first_device.fetch_add(1, Ordering::Relaxed);
        let mut allocators = self.shared.allocators.lock().expect("allocators");
        let mut order: Vec<u16> = (0..count).map(|i| ((rotation + i) % count) as u16).collect();
        // A stable sort: ties keep the rotation.
        order.sort_by_key(|&d| std::cmp::Reverse(allocators[d as usize].free_blocks()));
        for first_device in order {
            if let Some(extents) = place(&mut allocators, g, first_device, &needs) {
                drop(allocators);
                let record = ObjectRecord {
                    id,
                    len_bytes,
                    meta: meta.to_vec(),
                    first_device,
                    spread,
                    extents,
                    unit_crcs: Vec::new(),
                };
                return Ok(Object::new(record, self.shared.allocators.clone()));
            }
        }
        Err(no_space(&allocators, g, padded))
    }

    /// Starts writing `data` as object `id` (replacing any object of that id once durable).
    /// The ticket hands `data` back when the put is acknowledged: durable and visible to gets.
    pub fn put<B: IoBuf>(&self, id: u64, data: B, meta: &[u8], priority: Priority) -> Result<Ticket<B>> {
        // SAFETY: the ticket owns `data`, so the memory outlives the op.
        let completion = unsafe { self.put_raw(id, data.io_ptr(), data.io_len(), meta, priority)? };
        Ok(Ticket { completion, buffer: Some(data) })
    }

    /// `put` from raw memory (for the C ABI and Python).
    ///
    /// # Safety
    /// `ptr` must be valid for reads of `len` bytes, unchanged, until the returned ticket is done.
    pub unsafe fn put_raw_ticket(
        &self,
        id: u64,
        ptr: *const u8,
        len: usize,
        meta: &[u8],
        priority: Priority,
    ) -> Result<Ticket<()>> {
        // SAFETY: forwarded contract.
        let completion = unsafe { self.put_raw(id, ptr, len, meta, priority)? };
        Ok(Ticket { completion, buffer: Some(()) })
    }

    unsafe fn put_raw(
        &self,
        id: u64,
        ptr: *const u8,
        len: usize,
        meta: &[u8],
        priority: Priority,
    ) -> Result<Arc<ticket::Completion>> {
        self.check_writable()?;
        self.check_meta(meta)?;
        self.shared.op_started()?;
        let object = match self.allocate(id, len as u64, meta) {
            Ok(o) => o,
            Err(e) => {
                self.shared.op_finished();
                return Err(e);
            }
        };
        let padded = round_up(len as u64, self.shared.geometry.block_size);
        let op = Arc::new(Op::new(
            OpKind::Put,
            id,
            priority,
            OpObject::Put(Mutex::new(Some(object))),
            ptr as usize,
            0,
            len as u64,
            false,
        ));
        let completion = op.completion.clone();
        self.shared.enqueue(op, 0, padded);
        Ok(completion)
    }

    /// Starts reading the whole of object `id` into `buf`, which may be longer than the object
    /// (the rest is left untouched) but not shorter.
    pub fn get<B: IoBufMut>(&self, id: u64, mut buf: B, priority: Priority) -> Result<Ticket<B>> {
        // SAFETY: the ticket owns `buf`.
        let completion = unsafe { self.get_raw(id, 0, buf.io_mut_ptr(), buf.io_len(), true, priority)? };
        Ok(Ticket { completion, buffer: Some(buf) })
    }

    /// Starts reading `buf.len()` bytes of object `id` from byte `offset` into `buf`.
    pub fn get_range<B: IoBufMut>(&self, id: u64, offset: u64, mut buf: B, priority: Priority) -> Result<Ticket<B>> {
        // SAFETY: the ticket owns `buf`.
        let completion = unsafe { self.get_raw(id, offset, buf.io_mut_ptr(), buf.io_len(), false, priority)? };
        Ok(Ticket { completion, buffer: Some(buf) })
    }

    /// `get_range` into raw memory (for the C ABI and Python). With `whole`, `len` may exceed the
    /// object and only the object's bytes are read.
    ///
    /// # Safety
    /// `ptr` must be valid for writes of `len` bytes, and not otherwise accessed, until the
    /// returned ticket is done.
    pub unsafe fn get_raw_ticket(
        &self,
        id: u64,
        offset: u64,
        ptr: *mut u8,
        len: usize,
        whole: bool,
        priority: Priority,
    ) -> Result<Ticket<()>> {
        // SAFETY: forwarded contract.
        let completion = unsafe { self.get_raw(id, offset, ptr, len, whole, priority)? };
        Ok(Ticket { completion, buffer: Some(()) })
    }

    unsafe fn get_raw(
        &self,
        id: u64,
        offset: u64,
        ptr: *mut u8,
        len: usize,
        whole: bool,
        priority: Priority,
    ) -> Result<Arc<ticket::Completion>> {
        let object = self.shared.table.read().expect("table").get(&id).cloned().ok_or(Error::NotFound { id })?;
        let object_len = object.record.len_bytes;
        let end = if whole && offset == 0 {
            if (len as u64) < object_len {
                return Err(Error::BufferTooSmall { needed_bytes: object_len, given_bytes: len as u64 });
            }
            object_len
        } else {
            let end = offset.saturating_add(len as u64);
            if end > object_len {
                return Err(Error::RangeOutOfBounds { id, offset, len: len as u64, object_len });
            }
            end
        };
        self.shared.op_started()?;
        let span = self.get_span(&object, offset, end, true);
        let mut op = Op::new(OpKind::Get, id, priority, OpObject::Get(object), ptr as usize, offset, end, span.verify);
        op.checked = span.checked;
        let op = Arc::new(op);
        let completion = op.completion.clone();
        self.shared.enqueue(op, span.read.0, span.read.1);
        Ok(completion)
    }

    /// What a get of object bytes `offset..end` reads and checks. Checks need a store that keeps
    /// checksums, `verify_checksums`, and bytes that pass through host memory. A checksum covers
    /// a whole stripe unit, so every unit the range covers whole is checked; a unit it covers
    /// only in part (at either end) is read whole (the rest into bounce memory) and checked too
    /// when that at most doubles the bytes the get reads, and returned unchecked otherwise
    /// (e.g. 4 KiB out of a 1 MiB unit: 256 times the I/O).
    fn get_span(&self, object: &Object, offset: u64, end: u64, via_host: bool) -> GetSpan {
        let (su, block) = (self.shared.geometry.stripe_unit, self.shared.geometry.block_size);
        let len = object.record.len_bytes;
        let blocks = (round_down(offset, block), round_up(end, block));
        let unchecked = GetSpan { verify: false, read: blocks, checked: (offset, offset) };
        if !(self.shared.config.verify_checksums && via_host && !object.record.unit_crcs.is_empty()) {
            return unchecked;
        }
        let units = (round_down(offset, su), round_up(end, su).min(len));
        let whole = (units.0, round_up(units.1, block));
        if (whole.1 - whole.0) - (blocks.1 - blocks.0) <= end - offset {
            return GetSpan { verify: end > offset, read: whole, checked: units };
        }
        let inner = (round_up(offset, su), if end == len { len } else { round_down(end, su) });
        if inner.0 >= inner.1 {
            return unchecked;
        }
        GetSpan { verify: true, read: blocks, checked: inner }
    }

    /// Puts `data` and waits until it is durable.
    pub fn put_blocking(&self, id: u64, data: &[u8], meta: &[u8]) -> Result<()> {
        // SAFETY: we wait for the ticket before `data`'s borrow ends.
        unsafe { self.put_raw_ticket(id, data.as_ptr(), data.len(), meta, Priority::Normal)? }.wait()
    }

    /// Reads the whole object into a new vector.
    pub fn get_to_vec(&self, id: u64) -> Result<Vec<u8>> {
        let len = self.stat(id).ok_or(Error::NotFound { id })?.len_bytes as usize;
        let buf = AlignedBuf::new(len, self.shared.geometry.block_size as usize)?;
        let buf = self.get(id, buf, Priority::Normal)?.wait()?;
        Ok(buf[..len].to_vec())
    }

    /// Deletes object `id` durably; returns whether it existed.
    pub fn delete(&self, id: u64) -> Result<bool> {
        self.check_writable()?;
        if self.shared.closed.load(Ordering::Acquire) {
            return Err(Error::Closed);
        }
        let (tx, rx) = sync_channel(1);
        let sent =
            self.shared.commit_tx.lock().expect("commit").as_ref().map(|c| c.send(CommitMsg::Delete { id, reply: tx }));
        if !matches!(sent, Some(Ok(()))) {
            return Err(Error::Closed);
        }
        let existed = rx.recv().map_err(|_| Error::Closed)??;
        if existed {
            self.shared.op_counters.lock().expect("op counters").deletes += 1;
        }
        Ok(existed)
    }

    /// Writes a checkpoint of the table now (it also happens when the journal fills and at close).
    pub fn checkpoint(&self) -> Result<()> {
        self.check_writable()?;
        let (tx, rx) = sync_channel(1);
        let sent =
            self.shared.commit_tx.lock().expect("commit").as_ref().map(|c| c.send(CommitMsg::Checkpoint { reply: tx }));
        if !matches!(sent, Some(Ok(()))) {
            return Err(Error::Closed);
        }
        rx.recv().map_err(|_| Error::Closed)?
    }

    pub fn stat(&self, id: u64) -> Option<ObjectInfo> {
        self.shared.table.read().expect("table").get(&id).map(|o| self.object_info(&o.record))
    }

    /// Every object, by id.
    pub fn list(&self) -> Vec<ObjectInfo> {
        let table = self.shared.table.read().expect("table");
        let mut v: Vec<ObjectInfo> = table.values().map(|o| self.object_info(&o.record)).collect();
        v.sort_by_key(|o| o.id);
        v
    }

    fn object_info(&self, r: &ObjectRecord) -> ObjectInfo {
        let count = self.shared.geometry.device_count;
        ObjectInfo {
            id: r.id,
            len_bytes: r.len_bytes,
            meta: r.meta.clone(),
            devices: (0..r.spread).map(|p| (r.first_device + p) % count).collect(),
            extent_count: r.extents.len(),
        }
    }

    pub fn info(&self) -> StoreInfo {
        let sb0 = &self.shared.superblocks[0];
        let g = &self.shared.geometry;
        let allocators = self.shared.allocators.lock().expect("allocators");
        let devices = self
            .shared
            .devices
            .iter()
            .zip(&self.shared.superblocks)
            .zip(allocators.iter())
            .map(|((d, sb), a)| DeviceInfo {
                index: sb.device_index,
                path: d.path.clone(),
                size_bytes: d.size_bytes,
                data_bytes: sb.data_end - sb.data_start,
                free_bytes: a.free_blocks() * g.block_size,
                largest_free_bytes: a.largest_free_blocks() * g.block_size,
                free_runs: a.free_runs(),
                is_block_device: d.is_block_device,
            })
            .collect();
        drop(allocators);
        let table = self.shared.table.read().expect("table");
        StoreInfo {
            uuid: sb0.uuid_string(),
            format_version: sb0.format_version,
            block_size: g.block_size,
            stripe_unit_bytes: g.stripe_unit,
            checksums: g.checksums,
            devices,
            object_count: table.len(),
            object_bytes: table.values().map(|o| o.record.len_bytes).sum(),
            backend: self.shared.queues[0].backend_name.to_string(),
            backend_reason: self.shared.backend_choice.reason.clone(),
            checkpoint_slot_bytes: sb0.checkpoint_slot_bytes,
            journal_bytes: sb0.journal_bytes,
        }
    }

    pub fn stats(&self) -> StatsSnapshot {
        let devices: Vec<IoCounters> = self.shared.queues.iter().map(DeviceQueue::counters).collect();
        let mut total = IoCounters::default();
        for d in &devices {
            total.merge(d);
        }
        StatsSnapshot {
            backend: self.shared.queues[0].backend_name.to_string(),
            backend_reason: self.shared.backend_choice.reason.clone(),
            devices,
            total,
            ops: self.shared.op_counters.lock().expect("op counters").clone(),
        }
    }

    /// Zeroes all counters (e.g. after a warm-up).
    pub fn reset_stats(&self) {
        for q in &self.shared.queues {
            q.reset_counters();
        }
        *self.shared.op_counters.lock().expect("op counters") = OpCounters::default();
    }

    /// The store's block size: O_DIRECT-friendly buffers are aligned to it.
    pub fn block_size(&self) -> u64 {
        self.shared.geometry.block_size
    }

    pub fn device_count(&self) -> u16 {
        self.shared.geometry.device_count
    }

    /// Checks the store and writes nothing: both superblock copies of every device (each bad
    /// copy reported on its own), what recovery found in the checkpoints and the journal at open
    /// (a damaged newest checkpoint; the remains of interrupted writes as notes), that no two
    /// objects share a block (already enforced at open), and every stripe unit's checksum,
    /// reading all data. A writer's open has already rewritten damaged superblock copies; for
    /// the store as it lies on disk, use [`Store::fsck_paths`].
    pub fn fsck(&self) -> Result<FsckReport> {
        self.check().map(|(report, _)| report)
    }

    /// `fsck`, and which of its problems a writer's open and a checkpoint would fix.
    fn check(&self) -> Result<(FsckReport, Fixable)> {
        let mut report = FsckReport::default();
        for (d, sb) in self.shared.devices.iter().zip(&self.shared.superblocks) {
            let copies = identity::read_copies(d);
            if copies.chosen().is_some_and(|c| !c.same_identity(sb)) {
                report.problems.push(format!(
                    "{}: device {}: the superblock on disk differs from the one read at open",
                    d.path.display(),
                    sb.device_index
                ));
            }
        }
        let fixable = Fixable {
            superblock_copies: identity::copy_problems(&self.shared.devices),
            checkpoint: self.shared.recovery.checkpoint_damaged,
        };
        report.problems.extend(fixable.superblock_copies.iter().cloned());
        report.problems.extend(self.shared.recovery.problems.iter().cloned());
        report.notes.extend(self.shared.recovery.notes.iter().cloned());
        let objects: Vec<Arc<Object>> = self.shared.table.read().expect("table").values().cloned().collect();
        let g = &self.shared.geometry;
        for o in objects {
            let r = &o.record;
            report.objects_checked += 1;
            if let Err(e) = g.validate(r) {
                report.problems.push(e.to_string());
                continue;
            }
            let padded = round_up(r.len_bytes, g.block_size);
            let mut buf = AlignedBuf::new(padded as usize, g.block_size as usize)?;
            // SAFETY: we wait before `buf` goes away.
            let got =
                unsafe { self.get_raw_ticket(r.id, 0, buf.as_mut_ptr(), padded as usize, true, Priority::Normal) }
                    .and_then(Ticket::wait);
            if let Err(e) = got {
                if !matches!(e, Error::NotFound { .. }) {
                    report.problems.push(format!("object {}: {e}", r.id));
                }
                continue;
            }
            report.bytes_checked += r.len_bytes;
            for (unit, crc) in r.unit_crcs.iter().enumerate() {
                let start = unit as u64 * g.stripe_unit;
                let end = (start + g.stripe_unit).min(r.len_bytes);
                report.units_checked += 1;
                if crc32c::crc32c(&buf[start as usize..end as usize]) != *crc {
                    let map = StripeMap::new(r, g.stripe_unit, g.block_size, g.device_count);
                    let mut at = None;
                    map.for_each_piece(start..start + g.block_size, g.block_size, |p| {
                        at.get_or_insert((p.device, p.device_offset));
                    });
                    let (device, device_offset) = at.expect("unit has a block");
                    report.problems.push(
                        Error::ChecksumMismatch { id: r.id, unit: unit as u64, device, device_offset }.to_string(),
                    );
                }
            }
        }
        Ok((report, fixable))
    }

    /// Checks the store on `paths` as it lies on disk, beside a writer if one holds it: opens it
    /// read-only and runs [`Store::fsck`]. A store too damaged to open is one problem (the open
    /// error, which names what and where), after each damaged superblock copy.
    ///
    /// With `repair`, and when no writer holds the store, then fixes what can be fixed without
    /// losing anything, lists it in `repairs`, and checks again (`problems` is what is left): a
    /// damaged superblock copy is rewritten from the good one, a damaged newest checkpoint is
    /// replaced by a new one. Damaged object data, journal batches and devices cannot be rebuilt
    /// (teraio keeps no second copy): they stay problems.
    pub fn fsck_paths(paths: &[impl AsRef<Path>], config: OpenConfig, repair: bool) -> Result<FsckReport> {
        let found = match Store::open_read_only(paths, config.clone()) {
            Ok(store) => {
                let found = store.check();
                store.close()?;
                found?
            }
            Err(e @ (Error::CorruptMetadata { .. } | Error::CorruptSuperblock { .. })) => {
                let mut report = FsckReport::default();
                let mut devices = Vec::new();
                for p in paths {
                    let lock_wait = std::time::Duration::from_millis(config.lock_wait_ms);
                    devices.push(Device::open_locked(p.as_ref(), config.direct_io, Access::Reader, lock_wait)?);
                }
                report.problems.extend(identity::copy_problems(&devices));
                report
                    .problems
                    .push(format!("the store cannot be opened: {}", e.to_string().replace(commit::FSCK_HINT, "")));
                return Ok(report);
            }
            Err(e) => return Err(e),
        };
        let (report, fixable) = found;
        if !repair || fixable.is_empty() {
            return Ok(report);
        }
        let mut repairs: Vec<String> = fixable.superblock_copies.iter().map(|p| format!("rewrote {p}")).collect();
        {
            // A writer's open rewrites both superblock copies of every device from the good one.
            let store = Store::open(paths, config.clone())?;
            if fixable.checkpoint {
                store.checkpoint()?;
                repairs.push("wrote a new checkpoint in place of the damaged newest one".into());
            }
            store.close()?;
        }
        let mut after = Store::open_read_only(paths, config)?.check()?.0;
        after.repairs = repairs;
        Ok(after)
    }

    /// Waits for every op, writes a final checkpoint and stops the engine's threads. Dropping the
    /// store does the same; `close` reports the outcome.
    pub fn close(mut self) -> Result<()> {
        self.shutdown()
    }

    fn shutdown(&mut self) -> Result<()> {
        if self.committer.is_none() {
            return Ok(());
        }
        {
            let mut n = self.shared.ops_outstanding.lock().expect("ops");
            self.shared.closed.store(true, Ordering::Release);
            while *n > 0 {
                n = self.shared.ops_idle.wait(n).expect("ops");
            }
        }
        self.shared.dispatch.lock().expect("dispatch").shutdown = true;
        self.shared.dispatch_cv.notify_all();
        if let Some(d) = self.dispatcher.take() {
            let _ = d.join();
        }
        self.shared.commit_tx.lock().expect("commit").take();
        if let Some(c) = self.committer.take() {
            c.join().map_err(|_| Error::Closed)?;
        }
        // A request's completion closure may still hold the shared state for a moment after its
        // op finished; wait for it so that the devices (and their locks) are closed when we return.
        while Arc::strong_count(&self.shared) > 1 {
            std::thread::yield_now();
        }
        Ok(())
    }
}

impl Drop for Store {
    fn drop(&mut self) {
        let _ = self.shutdown();
    }
}

/// GPU memory: put and get from CUDA device pointers, on the store's GPU path.
impl Store {
    /// Sets up GPU I/O for CUDA device `ordinal` now (else the first GPU op does it): pins the
    /// bounce slab, chooses the path per `OpenConfig::gpu` (measuring both where `auto` may pick
    /// either) and returns what was chosen and why. Later calls return the first outcome.
    pub fn gpu_setup(&self, ordinal: u32) -> Result<crate::gpu::GpuPathReport> {
        self.gpu_state(ordinal).map(|g| g.report.clone())
    }

    /// The GPU path report, if GPU I/O has been set up.
    pub fn gpu_report(&self) -> Option<crate::gpu::GpuPathReport> {
        self.shared.gpu.get().and_then(|r| r.as_ref().ok()).map(|g| g.report.clone())
    }

    fn gpu_state(&self, ordinal: u32) -> Result<&StoreGpu> {
        self.shared.gpu.get_or_init(|| init_gpu(&self.shared, ordinal)).as_ref().map_err(Clone::clone)
    }

    /// Starts writing device memory `data` as object `id`; the ticket hands `data` back when the
    /// put is durable. The caller's writes to `data` must be complete (e.g. its stream
    /// synchronized) before this call.
    pub fn put_gpu<B: crate::gpu::DeviceIoBuf>(
        &self,
        id: u64,
        data: B,
        meta: &[u8],
        priority: Priority,
    ) -> Result<crate::gpu::GpuTicket<B>> {
        let slice =
            crate::gpu::DeviceSlice { ptr: data.device_ptr(), len: data.device_len(), device: data.device_ordinal() };
        // SAFETY: the ticket owns `data`.
        let t = unsafe { self.put_gpu_raw(id, slice, meta, priority)? };
        Ok(t.holding(data))
    }

    /// Starts reading the whole of object `id` into device memory `buf` (at least as long as the
    /// object; the rest is left untouched).
    pub fn get_gpu<B: crate::gpu::DeviceIoBuf>(
        &self,
        id: u64,
        buf: B,
        priority: Priority,
    ) -> Result<crate::gpu::GpuTicket<B>> {
        let slice =
            crate::gpu::DeviceSlice { ptr: buf.device_ptr(), len: buf.device_len(), device: buf.device_ordinal() };
        // SAFETY: the ticket owns `buf`.
        let t = unsafe { self.get_gpu_raw(id, 0, slice, true, priority)? };
        Ok(t.holding(buf))
    }

    /// Starts reading `buf.device_len()` bytes of object `id` from byte `offset` into device memory.
    pub fn get_gpu_range<B: crate::gpu::DeviceIoBuf>(
        &self,
        id: u64,
        offset: u64,
        buf: B,
        priority: Priority,
    ) -> Result<crate::gpu::GpuTicket<B>> {
        let slice =
            crate::gpu::DeviceSlice { ptr: buf.device_ptr(), len: buf.device_len(), device: buf.device_ordinal() };
        // SAFETY: the ticket owns `buf`.
        let t = unsafe { self.get_gpu_raw(id, offset, slice, false, priority)? };
        Ok(t.holding(buf))
    }

    /// `put_gpu` from a raw device range (for the C ABI, Python and framework tensors).
    ///
    /// # Safety
    /// `src` must be device memory of `src.device`, unchanged and allocated until the ticket is done.
    pub unsafe fn put_gpu_raw(
        &self,
        id: u64,
        src: crate::gpu::DeviceSlice,
        meta: &[u8],
        priority: Priority,
    ) -> Result<crate::gpu::GpuTicket<()>> {
        self.check_writable()?;
        let gpu = self.gpu_op(src)?;
        self.check_meta(meta)?;
        self.shared.op_started()?;
        let object = match self.allocate(id, src.len as u64, meta) {
            Ok(o) => o,
            Err(e) => {
                self.shared.op_finished();
                return Err(e);
            }
        };
        let padded = round_up(src.len as u64, self.shared.geometry.block_size);
        let mut op = Op::new(
            OpKind::Put,
            id,
            priority,
            OpObject::Put(Mutex::new(Some(object))),
            src.ptr as usize,
            0,
            src.len as u64,
            // The caller's bytes are on the host only inside bounce chunks: checksums come
            // from there, and objects put through cuFile keep none (docs/gpu.md).
            self.shared.geometry.checksums && !gpu.use_cufile,
        );
        let handoff = gpu.handoff.map(|slot| (gpu.device.handoff.clone(), slot));
        op.gpu = Some(gpu);
        let op = Arc::new(op);
        let completion = op.completion.clone();
        self.shared.enqueue(op, 0, padded);
        Ok(crate::gpu::GpuTicket { ticket: Ticket { completion, buffer: Some(()) }, handoff })
    }

    /// `get_gpu_range` into a raw device range; with `whole`, `dst.len` may exceed the object.
    ///
    /// # Safety
    /// `dst` must be device memory of `dst.device`, allocated and not otherwise accessed until the
    /// ticket is done.
    pub unsafe fn get_gpu_raw(
        &self,
        id: u64,
        offset: u64,
        dst: crate::gpu::DeviceSlice,
        whole: bool,
        priority: Priority,
    ) -> Result<crate::gpu::GpuTicket<()>> {
        let object = self.shared.table.read().expect("table").get(&id).cloned().ok_or(Error::NotFound { id })?;
        let object_len = object.record.len_bytes;
        let end = if whole && offset == 0 {
            if (dst.len as u64) < object_len {
                return Err(Error::BufferTooSmall { needed_bytes: object_len, given_bytes: dst.len as u64 });
            }
            object_len
        } else {
            let end = offset.saturating_add(dst.len as u64);
            if end > object_len {
                return Err(Error::RangeOutOfBounds { id, offset, len: dst.len as u64, object_len });
            }
            end
        };
        let gpu = self.gpu_op(dst)?;
        self.shared.op_started()?;
        // On the cuFile path the bytes never pass through host memory: nothing to check them
        // in (the GPU report and docs/gpu.md say so).
        let span = self.get_span(&object, offset, end, !gpu.use_cufile);
        let mut op =
            Op::new(OpKind::Get, id, priority, OpObject::Get(object), dst.ptr as usize, offset, end, span.verify);
        op.checked = span.checked;
        let handoff = gpu.handoff.map(|slot| (gpu.device.handoff.clone(), slot));
        op.gpu = Some(gpu);
        let op = Arc::new(op);
        let completion = op.completion.clone();
        self.shared.enqueue(op, span.read.0, span.read.1);
        Ok(crate::gpu::GpuTicket { ticket: Ticket { completion, buffer: Some(()) }, handoff })
    }

    /// The GPU part of a new op on `mem`: checks the pointer, finds the device's state and path.
    fn gpu_op(&self, mem: crate::gpu::DeviceSlice) -> Result<dispatch::GpuOp> {
        let state = self.gpu_state(mem.device)?;
        if mem.len > 0 {
            crate::gpu::cuda::check_device_pointer(mem.ptr, mem.len, mem.device)?;
        }
        let device = state.device(mem.device)?;
        let use_cufile = state.uses_cufile(mem.device);
        let handoff = device.handoff.claim();
        Ok(dispatch::GpuOp { device, use_cufile, handoff, handoff_signalled: AtomicBool::new(false) })
    }
}

/// Builds a store's GPU state on its first GPU op (see `GpuOptions` and docs/gpu.md).
fn init_gpu(shared: &Arc<Shared>, ordinal: u32) -> Result<StoreGpu> {
    use crate::config::GpuPath;
    use crate::gpu::{cuda, cufile, probe, GpuPathReport};
    let options = shared.config.gpu.clone();
    let ctx = cuda::context(ordinal)?;
    let (slab, slab_bytes) = shared.pool.slab();
    // SAFETY: the slab lives in `shared.pool`, which is dropped after `shared.gpu`.
    let pinned = unsafe { cuda::PinnedRegistration::new(ctx, slab, slab_bytes)? };
    let mut report = GpuPathReport {
        path: GpuPath::Bounce,
        device: ordinal,
        cufile_mode: Vec::new(),
        reason: String::new(),
        measured_gbps: None,
        pinned_bytes: slab_bytes as u64,
        store_checksums: shared.geometry.checksums,
        verify_checksums: shared.config.verify_checksums,
    };
    let mut gpu = StoreGpu {
        cufile_queues: Vec::new(),
        devices: Mutex::new(HashMap::new()),
        report: report.clone(),
        copy_streams: options.copy_streams,
        _pinned: pinned,
    };
    if options.path == GpuPath::Bounce {
        gpu.report.reason = "bounce requested: pinned bounce chunks with overlapped copies".into();
        tracing::info!(report = %gpu.report, "teraio GPU path");
        return Ok(gpu);
    }
    // cuFile: what mode each device would run in, then its queues.
    let mut compat_reasons = Vec::new();
    for d in &shared.devices {
        let why = probe::gds_obstacles(&d.path);
        if why.is_empty() {
            report.cufile_mode.push(format!("{}: true GDS", d.path.display()));
        } else {
            report.cufile_mode.push(format!("{}: compatibility mode ({})", d.path.display(), why.join(", ")));
            compat_reasons.push(format!("{}: {}", d.path.display(), why.join(", ")));
        }
    }
    if options.path == GpuPath::Gds && !compat_reasons.is_empty() {
        return Err(Error::BackendUnavailable {
            backend: "gds",
            reason: format!(
                "true GDS is not possible, cuFile would run in compatibility mode: {}",
                compat_reasons.join("; ")
            ),
        });
    }
    let queues = cufile::cufile().and_then(|_| {
        shared
            .devices
            .iter()
            .enumerate()
            .map(|(i, d)| {
                let b = crate::backend::cufile::CufileBackend::new(d, options.cufile_threads_per_device, ordinal)?;
                DeviceQueue::start(i as u16, Box::new(b), shared.config.queue_depth)
                    .map_err(|e| Error::io("starting a cuFile queue thread", e))
            })
            .collect::<Result<Vec<_>>>()
    });
    let queues = match (queues, options.path) {
        (Ok(q), _) => q,
        (Err(e), GpuPath::Auto) => {
            report.reason = format!("auto: cuFile unavailable ({e}); using the pinned bounce path");
            report.cufile_mode.clear();
            tracing::warn!("{}", report.reason);
            gpu.report = report;
            return Ok(gpu);
        }
        (Err(e), _) => return Err(e),
    };
    gpu.cufile_queues = queues;
    let mode = if compat_reasons.is_empty() { "true GDS".to_string() } else { "compatibility mode".to_string() };
    if options.path != GpuPath::Auto {
        report.path = options.path;
        report.reason = format!("{} requested: cuFile in {mode}", options.path.name());
        gpu.report = report;
        tracing::info!(report = %gpu.report, "teraio GPU path");
        return Ok(gpu);
    }
    let (bounce, direct) = match measure_gpu_paths(shared, &gpu, ordinal, options.auto_probe_bytes) {
        Ok((b, c)) => (Ok(b), Ok(c)),
        Err(e) => (Err(e.clone()), Err(e)),
    };
    match (bounce, direct) {
        (Ok(b), Ok(c)) => {
            report.measured_gbps = Some((b, c));
            if c > b {
                report.path = GpuPath::Cufile;
                report.reason = format!("auto: cuFile ({mode}) measured faster than the pinned bounce path");
            } else {
                report.path = GpuPath::Bounce;
                report.reason = format!("auto: the pinned bounce path measured faster than cuFile ({mode})");
                gpu.cufile_queues.clear();
            }
        }
        (_, Err(e)) | (Err(e), _) => {
            report.path = GpuPath::Bounce;
            report.reason = format!("auto: could not measure the two paths ({e}); using the pinned bounce path");
            tracing::warn!("{}", report.reason);
            gpu.cufile_queues.clear();
        }
    }
    gpu.report = report;
    tracing::info!(report = %gpu.report, "teraio GPU path");
    Ok(gpu)
}

/// The short measurement of `auto`: takes a free run of device 0 (no object lives there), writes
/// `bytes` to it so that the reads below hit the disk rather than a hole of a sparse file, then
/// reads it into GPU memory through each path twice, alternating, and keeps each path's best GB/s.
/// The run is given back to the allocator before returning.
fn measure_gpu_paths(shared: &Arc<Shared>, gpu: &StoreGpu, ordinal: u32, bytes: u64) -> Result<(f64, f64)> {
    if shared.read_only {
        return Err(Error::InvalidConfig("a read-only store writes no measurement run".into()));
    }
    let g = &shared.geometry;
    let chunk = shared.pool.chunk_bytes() as u64;
    let bytes = round_up(bytes.max(chunk), chunk);
    let extent = {
        let mut allocators = shared.allocators.lock().expect("allocators");
        let run = allocators[0].allocate(bytes / g.block_size, 1);
        run.ok_or_else(|| no_space(&allocators, g, bytes))?.pop().expect("one extent")
    };
    let start = extent.start_block * g.block_size;
    let result = (|| {
        write_measurement_run(shared, start, bytes)?;
        let (mut bounce, mut direct) = (0f64, 0f64);
        for _ in 0..2 {
            bounce = bounce.max(measure_gpu_read(shared, gpu, ordinal, false, start, bytes)?);
            direct = direct.max(measure_gpu_read(shared, gpu, ordinal, true, start, bytes)?);
        }
        Ok((bounce, direct))
    })();
    shared.allocators.lock().expect("allocators")[0].free(extent);
    result
}

/// Writes `bytes` at `start` of device 0 from bounce chunks (whatever they hold), waiting.
fn write_measurement_run(shared: &Arc<Shared>, start: u64, bytes: u64) -> Result<()> {
    use crate::backend::IoKind;
    use crate::queue::Request;
    let chunk = shared.pool.chunk_bytes() as u64;
    let (tx, rx) = std::sync::mpsc::channel::<Result<()>>();
    let pieces = bytes / chunk;
    for i in 0..pieces {
        let c = shared.pool.take();
        let (s, tx) = (shared.clone(), tx.clone());
        let request = Request {
            kind: IoKind::Write,
            offset: start + i * chunk,
            buf: c.ptr,
            len: chunk as u32,
            fixed_index: None,
            priority: Priority::Normal,
            on_complete: Box::new(move |r| {
                s.pool.put(c);
                let _ = tx.send(r.map_err(|e| Error::io("writing the GPU path measurement run", e)));
            }),
        };
        shared.queues[0].submit(std::iter::once(request));
    }
    drop(tx);
    for _ in 0..pieces {
        rx.recv().map_err(|_| Error::Closed)??;
    }
    Ok(())
}

/// Reads `bytes` at `start` of device 0 into GPU memory through one path; returns GB/s.
/// Bounce: disk -> pinned chunk -> copy engine; cuFile: the cuFile queue straight into GPU memory.
fn measure_gpu_read(
    shared: &Arc<Shared>,
    gpu: &StoreGpu,
    ordinal: u32,
    via_cufile: bool,
    start: u64,
    bytes: u64,
) -> Result<f64> {
    use crate::backend::IoKind;
    use crate::queue::Request;
    let chunk = shared.pool.chunk_bytes() as u64;
    let scratch = crate::gpu::DeviceBuffer::new(ordinal, bytes as usize)?;
    let device = gpu.device(ordinal)?;
    let (tx, rx) = std::sync::mpsc::channel::<Result<()>>();
    let pieces = bytes / chunk;
    let begin = std::time::Instant::now();
    for i in 0..pieces {
        let tx = tx.clone();
        let dst = scratch.ptr() + i * chunk;
        let request = if via_cufile {
            Request {
                kind: IoKind::Read,
                offset: start + i * chunk,
                buf: dst as usize as *mut u8,
                len: chunk as u32,
                fixed_index: None,
                priority: Priority::Normal,
                on_complete: Box::new(move |r| {
                    let _ = tx.send(r.map_err(|e| Error::io("cuFile read while measuring", e)));
                }),
            }
        } else {
            let c = shared.pool.take();
            let (s, d, ptr) = (shared.clone(), device.clone(), c.ptr as usize);
            Request {
                kind: IoKind::Read,
                offset: start + i * chunk,
                buf: c.ptr,
                len: chunk as u32,
                fixed_index: None,
                priority: Priority::Normal,
                on_complete: Box::new(move |r| {
                    if let Err(e) = r {
                        s.pool.put(c);
                        let _ = tx.send(Err(Error::io("read while measuring", e)));
                        return;
                    }
                    let s2 = s.clone();
                    // SAFETY: the chunk is pinned and held until the continuation; dst is ours.
                    unsafe {
                        d.copy.copy(
                            crate::gpu::copy::CopyDirection::HostToDevice,
                            ptr as *mut u8,
                            dst,
                            chunk as usize,
                            Box::new(move |r| {
                                s2.pool.put(c);
                                let _ = tx.send(r);
                            }),
                        )
                    };
                }),
            }
        };
        if via_cufile {
            gpu.cufile_queues[0].submit(std::iter::once(request));
        } else {
            shared.queues[0].submit(std::iter::once(request));
        }
    }
    drop(tx);
    for _ in 0..pieces {
        rx.recv().map_err(|_| Error::Closed)??;
    }
    let seconds = begin.elapsed().as_secs_f64();
    Ok(bytes as f64 / seconds / 1e9)
}

/// Takes the extents of an object whose stripe unit 0 goes to `first_device` and position p to
/// the p-th device after it, `needs[p]` bytes each; None (nothing taken) if a device lacks room.
fn place(allocators: &mut [DeviceAllocator], g: &Geometry, first_device: u16, needs: &[u64]) -> Option<Vec<Extent>> {
    let mut extents = Vec::new();
    for (position, need) in needs.iter().enumerate() {
        if *need == 0 {
            continue;
        }
        let device = (first_device + position as u16) % g.device_count;
        match allocators[device as usize].allocate(need / g.block_size, MAX_EXTENTS_PER_DEVICE) {
            Some(mut e) => extents.append(&mut e),
            None => {
                for x in extents {
                    allocators[x.device as usize].free(x);
                }
                return None;
            }
        }
    }
    Some(extents)
}

/// The error of a failed placement of `needed` bytes: the store's free space, and the largest
/// object some placement could take now (each device can give at most its
/// `MAX_EXTENTS_PER_DEVICE` largest free runs to one object).
fn no_space(allocators: &[DeviceAllocator], g: &Geometry, needed: u64) -> Error {
    let count = g.device_count as usize;
    let free_blocks: u64 = allocators.iter().map(DeviceAllocator::free_blocks).sum();
    let capacity: Vec<u64> = allocators.iter().map(|a| a.placeable_blocks(MAX_EXTENTS_PER_DEVICE)).collect();
    let fits = |blocks: u64| {
        let padded = blocks * g.block_size;
        let spread = unit_count(padded, g.stripe_unit).max(1).min(count as u64) as u16;
        let needs = position_bytes(padded, g.stripe_unit, spread);
        (0..count)
            .any(|first| needs.iter().enumerate().all(|(p, need)| need / g.block_size <= capacity[(first + p) % count]))
    };
    // Each position's need grows with the object's size, so whether it fits is monotone.
    let (mut low, mut high) = (0, free_blocks);
    while low < high {
        let mid = low + (high - low).div_ceil(2);
        if fits(mid) {
            low = mid;
        } else {
            high = mid - 1;
        }
    }
    Error::NoSpace {
        needed_bytes: needed,
        free_bytes: free_blocks * g.block_size,
        largest_placeable_bytes: low * g.block_size,
    }
}

/// What a get reads and checks (`Store::get_span`).
struct GetSpan {
    verify: bool,
    /// Object bytes read, block-aligned.
    read: (u64, u64),
    /// Object bytes whose stripe units are checked (whole units, or up to the object's end).
    checked: (u64, u64),
}

/// What `format` reports.
#[derive(Debug, Clone)]
pub struct StoreInfoAtFormat {
    pub uuid: String,
    pub superblocks: Vec<Superblock>,
}

fn check_device_list(paths: &[PathBuf]) -> Result<()> {
    if paths.is_empty() || paths.len() > MAX_DEVICES {
        return Err(Error::InvalidConfig(format!("a store has 1 to {MAX_DEVICES} devices, not {}", paths.len())));
    }
    let mut seen = std::collections::HashSet::new();
    for p in paths {
        let key = std::fs::canonicalize(p).unwrap_or_else(|_| p.clone());
        if !seen.insert(key) {
            return Err(Error::InvalidConfig(format!("device {} is given twice", p.display())));
        }
    }
    Ok(())
}

/// Parses a backend name (re-exported for the CLI and bindings).
pub fn parse_backend(name: &str) -> Result<BackendKind> {
    name.parse()
}
