//! Format, open and close: lays a new store out over its devices, assembles an existing one from
//! its superblocks (`identity`), recovers its table (`commit::recover`), moves it to a new epoch,
//! starts the device queues, the dispatcher and the commit thread, and stops them again.

use super::dispatch::budget::Budget;
use super::dispatch::DispatchState;
use super::object::{Allocators, Geometry};
use super::{commit, dispatch, identity, Shared, Store};
use crate::backend;
use crate::backend::stack::DeviceWrappers;
use crate::buffer::{AlignedBuf, BouncePool};
use crate::config::{FormatConfig, OpenConfig, MAX_DEVICES, MIB};
use crate::device::{self, Access, Device};
use crate::error::{Error, Result};
use crate::layout::alloc::DeviceAllocator;
use crate::layout::codec::{round_down, round_up};
use crate::layout::metadata::encode_checkpoint;
use crate::layout::superblock::{flags, Superblock, FORMAT_VERSION};
use crate::layout::SUPERBLOCK_BYTES;
use crate::queue::DeviceQueue;
use crate::stats::OpCounters;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, RwLock};

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
        let default_journal = round_up((dev0_bytes / 128).clamp(MIB, 256 * MIB), block);
        let total_bytes: u64 = devices.iter().map(|d| d.size_bytes).sum();
        let slot_bytes = config.checkpoint_slot_bytes.unwrap_or_else(|| {
            default_slot_bytes(default_journal, total_bytes, su, config.max_meta_bytes, block, dev0_bytes)
        });
        let journal_bytes = config.journal_bytes.unwrap_or(default_journal);
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
        // Both halves of the journal ring (one per generation parity, docs/format.md).
        devices[0].write_all_at(&zero, sb0.metadata_start + 2 * slot_bytes)?;
        devices[0].write_all_at(&zero, sb0.metadata_start + 2 * slot_bytes + round_down(journal_bytes / 2, block))?;
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
                Err(Error::CorruptMetadata { .. } | Error::CorruptSuperblock { .. })
                    if attempts < READ_ONLY_OPEN_ATTEMPTS =>
                {
                    attempts += 1;
                    std::thread::sleep(std::time::Duration::from_millis(50));
                }
                other => return other,
            }
        }
    }

    pub(super) fn open_with(paths: &[impl AsRef<Path>], config: OpenConfig, access: Access) -> Result<Store> {
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
        let table_bytes: u64 = records.iter().map(|r| r.encoded_bytes()).sum();
        let allocators: Allocators = Arc::new(Mutex::new(
            superblocks
                .iter()
                .map(|s| DeviceAllocator::new(s.device_index, s.data_start / block, s.data_end / block))
                .collect(),
        ));
        let table = commit::claim(records, &allocators)
            .map_err(|e| commit::with_advice(e, &devices[0].path.display().to_string()))?;
        let mut repairs = Vec::new();
        if access == Access::Writer {
            // Everything checked: from here on this writer's changes carry a new epoch. Writing it
            // rewrites both superblock copies of every device, a damaged one from the good one.
            let damaged_copies = identity::copy_problems(&devices);
            let epoch = identity::next_epoch(&superblocks, journal.epoch);
            identity::write_epoch_at_open(&devices, &mut superblocks, epoch)?;
            journal.epoch = epoch;
            repairs.extend(damaged_copies.iter().map(|p| format!("rewrote {p}")));
        }

        let choice = backend::choose(config.backend, &config.uring)?;
        tracing::info!(backend = ?choice.kind, reason = %choice.reason, "teraio backend");
        let chunk_bytes = geometry.stripe_unit.min(config.max_io_bytes);
        let chunk_count = (config.bounce_pool_bytes / chunk_bytes).clamp(2, u16::MAX as u64) as usize;
        let pool = BouncePool::new(chunk_bytes as usize, chunk_count, block as usize)?;
        let mut wrappers = Vec::with_capacity(devices.len());
        let mut queues = Vec::with_capacity(devices.len());
        for (i, d) in devices.iter().enumerate() {
            let w = DeviceWrappers::new(i as u16, d, &config, access == Access::Writer, block)?;
            let b = w.wrap(backend::build(choice.kind, d, config.queue_depth, &config.uring, &pool)?);
            queues.push(
                DeviceQueue::start(i as u16, b, config.queue_depth)
                    .map_err(|e| Error::io("starting a device queue thread", e))?,
            );
            wrappers.push(w);
        }

        let budget = Budget::new(config.max_inflight_bytes, chunk_bytes);
        let (commit_tx, commit_rx) = std::sync::mpsc::channel();
        let shared = Arc::new(Shared {
            geometry,
            config,
            superblocks,
            gpu: std::sync::OnceLock::new(),
            queues,
            wrappers,
            devices,
            pool,
            table: RwLock::new(table),
            allocators,
            dispatch: Mutex::new(DispatchState::new(budget)),
            dispatch_cv: Condvar::new(),
            verifiers: super::verifiers::Verifiers::start()?,
            commit_tx: Mutex::new(Some(commit_tx)),
            ops_outstanding: Mutex::new(0),
            ops_idle: Condvar::new(),
            op_counters: Mutex::new(OpCounters::default()),
            backend_choice: choice,
            next_first_device: AtomicUsize::new(0),
            closed: AtomicBool::new(false),
            read_only: access == Access::Reader,
            recovery,
            table_bytes: AtomicU64::new(table_bytes),
            repairs_at_open: Mutex::new(Vec::new()),
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
        let store = Store { shared, dispatcher: Some(dispatcher), committer: Some(committer) };
        if access == Access::Writer && store.shared.recovery.checkpoint_damaged {
            // Recovered from the older checkpoint: a new one, over the damaged one, before any
            // batch, so that two good checkpoints stand again.
            store.checkpoint()?;
            repairs.push("wrote a new checkpoint in place of the damaged newest one".into());
        }
        for repair in &repairs {
            tracing::warn!(repair = %repair, "repaired at open");
        }
        for problem in &store.shared.recovery.problems {
            tracing::warn!(problem = %problem, "found at open");
        }
        for note in &store.shared.recovery.notes {
            tracing::info!(note = %note, "found at open");
        }
        *store.shared.repairs_at_open.lock().expect("repairs") = repairs;
        Ok(store)
    }

    /// Waits for every op, writes a final checkpoint and stops the engine's threads. Dropping the
    /// store does the same; `close` reports the outcome.
    pub fn close(mut self) -> Result<()> {
        self.shutdown()
    }

    pub(super) fn shutdown(&mut self) -> Result<()> {
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

/// How many times a read-only open looks again when the metadata it read did not fit together:
/// beside a busy writer, a checkpoint or journal write may land while it reads.
const READ_ONLY_OPEN_ATTEMPTS: u32 = 10;

/// What `format` reports.
#[derive(Debug, Clone)]
pub struct StoreInfoAtFormat {
    pub uuid: String,
    pub superblocks: Vec<Superblock>,
}

/// The default checkpoint slot: room for one object with `max_meta_bytes` of caller metadata per
/// stripe unit of the devices' space, so that objects of a stripe unit or more fill the data area
/// before the table; at least `journal_bytes` (device 0's size / 128, at least 1 MiB), at most
/// 256 MiB and an eighth of device 0.
fn default_slot_bytes(
    journal_bytes: u64,
    total_bytes: u64,
    stripe_unit: u64,
    max_meta_bytes: u64,
    block: u64,
    dev0_bytes: u64,
) -> u64 {
    let objects = total_bytes / stripe_unit;
    let table =
        commit::checkpoint_bytes(objects * crate::layout::table::ObjectRecord::one_unit_bytes(max_meta_bytes), block);
    let most = round_down((dev0_bytes / 8).min(256 * MIB), block).max(journal_bytes);
    round_up(table, block).clamp(journal_bytes, most)
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
