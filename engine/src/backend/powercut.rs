//! Power-loss simulation for reliability runs: a wrapper that keeps an undo log of every write
//! not yet covered by a completed flush (the bytes it overwrote), in a file beside the device.
//! After the process is killed, [`apply_power_cut`] reverts a random subset of those writes, block
//! by block, as a power cut may: whatever the device had not been told to make durable can be lost.

use super::{Backend, BackendCompletion, BackendRequest, IoKind, Waker};
use crate::buffer::AlignedBuf;
use crate::error::{Error, Result};
use std::collections::{HashMap, HashSet};
use std::fs::{File, OpenOptions};
use std::io::{self, Read, Write};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};

/// The undo log of device `device` in `dir`.
pub fn log_path(dir: &Path, device: u16) -> PathBuf {
    dir.join(format!("undo-{device}.log"))
}

struct Entry {
    offset: u64,
    old: Vec<u8>,
}

/// A write or flush in one of the device's stacks: (stack, the request's token).
type Key = (u32, u64);

/// The undo log of one device, shared by every backend stack of that device (its host queue and
/// its cuFile queue): a completed flush through either covers every write completed before it,
/// as an fdatasync does.
pub struct PowerCutLog {
    state: Mutex<LogState>,
    next_stack: AtomicU32,
}

struct LogState {
    device_file: File,
    log_path: PathBuf,
    /// Unflushed writes, in submission order.
    entries: Vec<(Key, Entry)>,
    in_flight_writes: HashSet<Key>,
    /// For each flush in flight: the writes that had completed when it was submitted.
    flushes: HashMap<Key, Vec<Key>>,
    completed_unflushed: Vec<Key>,
    block_size: usize,
}

impl PowerCutLog {
    /// Starts the (empty) undo log of device `device` in `dir`.
    pub fn new(device: u16, device_file: &File, dir: &Path, block_size: usize) -> Result<Arc<PowerCutLog>> {
        let log_path = log_path(dir, device);
        File::create(&log_path).map_err(|e| Error::io(format!("creating {}", log_path.display()), e))?;
        let state = LogState {
            device_file: device_file.try_clone().map_err(|e| Error::io("duplicating a device file", e))?,
            log_path,
            entries: Vec::new(),
            in_flight_writes: HashSet::new(),
            flushes: HashMap::new(),
            completed_unflushed: Vec::new(),
            block_size,
        };
        Ok(Arc::new(PowerCutLog { state: Mutex::new(state), next_stack: AtomicU32::new(0) }))
    }
}

impl LogState {
    /// Rewrites the log file with the entries still unflushed (small: tests only).
    fn save(&self) {
        let mut bytes = Vec::new();
        for (_, e) in &self.entries {
            bytes.extend_from_slice(&e.offset.to_le_bytes());
            bytes.extend_from_slice(&(e.old.len() as u64).to_le_bytes());
            bytes.extend_from_slice(&e.old);
        }
        let tmp = self.log_path.with_extension("tmp");
        if std::fs::write(&tmp, &bytes).and_then(|()| std::fs::rename(&tmp, &self.log_path)).is_err() {
            tracing::error!(path = %self.log_path.display(), "cannot save the power-cut undo log");
        }
    }
}

/// One stack's view of its device's [`PowerCutLog`].
pub struct PowerCutBackend {
    inner: Box<dyn Backend>,
    stack: u32,
    log: Arc<PowerCutLog>,
}

impl PowerCutBackend {
    /// Wraps `inner`, logging into `log` (the device's, shared with its other stacks).
    pub fn new(inner: Box<dyn Backend>, log: &Arc<PowerCutLog>) -> Self {
        PowerCutBackend { inner, stack: log.next_stack.fetch_add(1, Ordering::Relaxed), log: log.clone() }
    }
}

impl Backend for PowerCutBackend {
    fn name(&self) -> &'static str {
        self.inner.name()
    }

    unsafe fn push(&mut self, request: BackendRequest) {
        let key = (self.stack, request.token);
        {
            let mut log = self.log.state.lock().expect("power-cut log");
            match request.kind {
                IoKind::Write => {
                    let mut old = AlignedBuf::new(request.len as usize, log.block_size).expect("undo buffer");
                    let n = log.device_file.read_at(&mut old, request.offset).unwrap_or(0);
                    old[n..].fill(0);
                    log.entries.push((key, Entry { offset: request.offset, old: old.to_vec() }));
                    log.in_flight_writes.insert(key);
                    log.save();
                }
                IoKind::Flush => {
                    let covered = std::mem::take(&mut log.completed_unflushed);
                    log.flushes.insert(key, covered);
                }
                IoKind::Read => {}
            }
        }
        // SAFETY: forwarded under the caller's contract.
        unsafe { self.inner.push(request) }
    }

    fn submit_and_reap(&mut self, wait: bool, out: &mut Vec<BackendCompletion>) -> io::Result<()> {
        let start = out.len();
        self.inner.submit_and_reap(wait, out)?;
        let mut log = self.log.state.lock().expect("power-cut log");
        let mut changed = false;
        for c in &out[start..] {
            let key = (self.stack, c.token);
            if log.in_flight_writes.remove(&key) {
                if c.result < 0 {
                    // A failed write changed nothing we promise to keep either way.
                } else {
                    log.completed_unflushed.push(key);
                }
            } else if let Some(covered) = log.flushes.remove(&key) {
                if c.result >= 0 {
                    let covered: HashSet<Key> = covered.into_iter().collect();
                    log.entries.retain(|(key, _)| !covered.contains(key));
                    changed = true;
                } else {
                    log.completed_unflushed.extend(covered);
                }
            }
        }
        if changed {
            log.save();
        }
        Ok(())
    }

    fn waker(&self) -> Waker {
        self.inner.waker()
    }
}

/// Simulates a power cut on `device_path` from its undo log: each logged block is reverted with
/// probability one half (decided by `coin`), newest write first. Returns (blocks reverted, blocks
/// logged). Run only while no process has the store open.
pub fn apply_power_cut(
    log: &Path,
    device_path: &Path,
    block_size: usize,
    mut coin: impl FnMut() -> bool,
) -> Result<(u64, u64)> {
    let mut bytes = Vec::new();
    match File::open(log) {
        Ok(mut f) => f.read_to_end(&mut bytes).map_err(|e| Error::io(format!("reading {}", log.display()), e))?,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok((0, 0)),
        Err(e) => return Err(Error::io(format!("opening {}", log.display()), e)),
    };
    let mut entries = Vec::new();
    let mut at = 0;
    while at + 16 <= bytes.len() {
        let offset = u64::from_le_bytes(bytes[at..at + 8].try_into().expect("8"));
        let len = u64::from_le_bytes(bytes[at + 8..at + 16].try_into().expect("8")) as usize;
        if at + 16 + len > bytes.len() {
            break;
        }
        entries.push((offset, &bytes[at + 16..at + 16 + len]));
        at += 16 + len;
    }
    let device = OpenOptions::new()
        .write(true)
        .open(device_path)
        .map_err(|source| Error::DeviceOpen { path: device_path.to_path_buf(), source })?;
    let (mut reverted, mut logged) = (0, 0);
    for (offset, old) in entries.iter().rev() {
        for (i, block) in old.chunks(block_size).enumerate() {
            logged += 1;
            if coin() {
                reverted += 1;
                device
                    .write_all_at(block, offset + (i * block_size) as u64)
                    .map_err(|e| Error::io(format!("reverting a block of {}", device_path.display()), e))?;
            }
        }
    }
    device.sync_all().map_err(|e| Error::io("flushing after a power cut", e))?;
    let _ = std::fs::OpenOptions::new().write(true).truncate(true).open(log).and_then(|mut f| f.flush());
    Ok((reverted, logged))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::psync::PsyncBackend;
    use crate::device::Device;

    /// Runs one request through `b` and waits for it.
    fn run(b: &mut PowerCutBackend, token: u64, kind: IoKind, buf: &mut AlignedBuf) {
        let len = if kind == IoKind::Flush { 0 } else { buf.len() as u32 };
        // SAFETY: `buf` outlives the request, which is waited for below; one in flight.
        unsafe { b.push(BackendRequest { token, kind, offset: 0, buf: buf.as_mut_ptr(), len, fixed_index: None }) };
        let mut out = Vec::new();
        while out.is_empty() {
            b.submit_and_reap(true, &mut out).unwrap();
        }
        assert_eq!(out[0].token, token);
        assert!(out[0].result >= 0);
    }

    #[test]
    fn a_flush_through_one_stack_covers_the_writes_of_another() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("d");
        crate::device::create_file(&path, 1 << 20).unwrap();
        let device = Device::open(&path, false).unwrap();
        let log = PowerCutLog::new(0, &device.file, dir.path(), 4096).unwrap();
        let mut host = PowerCutBackend::new(Box::new(PsyncBackend::new(&device, 1).unwrap()), &log);
        let mut other = PowerCutBackend::new(Box::new(PsyncBackend::new(&device, 1).unwrap()), &log);
        let mut buf = AlignedBuf::new(4096, 4096).unwrap();
        buf.fill(7);
        // The same token in both stacks: they must not be confused.
        run(&mut other, 0, IoKind::Write, &mut buf);
        let logged = std::fs::metadata(log_path(dir.path(), 0)).unwrap().len();
        assert_eq!(logged, 16 + 4096, "the other stack's write is in the device's one log");
        run(&mut host, 0, IoKind::Flush, &mut buf);
        assert_eq!(std::fs::metadata(log_path(dir.path(), 0)).unwrap().len(), 0, "the host stack's flush covers it");
    }
}
