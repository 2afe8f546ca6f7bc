//! A bench workload and the loop that drives it through a [`Store`].
//!
//! How fio's vocabulary maps onto teraio's object API:
//! - The data set is `object_count` objects of `object_bytes` (ids `0..object_count`), striped
//!   over all devices, written before the timed phase.
//! - Sequential read: whole-object `get`s, each worker cycling through its own objects, with
//!   enough gets in flight to keep `queue_depth` requests of `request_bytes` on every device.
//!   The engine cuts each get into requests of `request_bytes` (its `max_io_bytes`).
//! - Sequential write: whole-object `put`s replacing the same objects.
//! - Random read: `get_range` of `request_bytes` at a random aligned offset of a random object,
//!   `queue_depth` x devices of them in flight.
//! - Random write: teraio has no in-place partial writes, so a random write is a `put` of a
//!   small object of `request_bytes` with a random id out of a separate set of
//!   [`RANDOM_WRITE_IDS`] (each put replaces the earlier object of that id).
//! - Mixed: each op is a read with probability `read_percent`, else a write, as above.
//! - A random write that finds the store full (a put needs room for the new version before
//!   the old one is freed) deletes other objects of the random-write set, in turn, until it
//!   fits, so a time-based run keeps going; the report counts those deletes.

use super::buffer::{BufferKind, HostBuf, OpBuf, OpTicket};
use super::pattern::{self, Rng};
use crate::error::{CliError, CliResult};
use crate::units::format_bytes;
use serde::Serialize;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};
use teraio_engine::{Priority, Store, Ticket};

/// Object ids of the random-write set start here (far above the data set's ids).
pub const RANDOM_WRITE_ID_BASE: u64 = 1 << 40;
/// Most small objects random writes cycle through (keeps the object table small).
pub const RANDOM_WRITE_IDS: u64 = 16_384;

/// Sequential or random access.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Pattern {
    Sequential,
    Random,
}

/// One workload, fully resolved.
#[derive(Debug, Clone, Serialize)]
pub struct Workload {
    pub pattern: Pattern,
    /// 100: reads only, 0: writes only.
    pub read_percent: u8,
    pub request_bytes: u64,
    pub object_bytes: u64,
    pub object_count: u64,
    /// Requests in flight per device (the engine's queue depth).
    pub queue_depth: usize,
    /// Submitting threads.
    pub threads: usize,
    pub stripe_unit_bytes: u64,
    pub devices: usize,
    /// With verify: every byte read is checked against the pattern it was written with.
    pub verify: bool,
    /// The engine checks stripe-unit checksums on every get.
    pub verify_checksums: bool,
    pub buffer: BufferKind,
    /// CUDA device of GPU buffers.
    pub gpu_ordinal: u32,
}

impl Workload {
    /// fio's name for it: read, write, rw, randread, randwrite, randrw.
    pub fn fio_rw(&self) -> &'static str {
        match (self.pattern, self.read_percent) {
            (Pattern::Sequential, 100) => "read",
            (Pattern::Sequential, 0) => "write",
            (Pattern::Sequential, _) => "rw",
            (Pattern::Random, 100) => "randread",
            (Pattern::Random, 0) => "randwrite",
            (Pattern::Random, _) => "randrw",
        }
    }

    pub fn data_bytes(&self) -> u64 {
        self.object_bytes * self.object_count
    }

    pub fn reads(&self) -> bool {
        self.read_percent > 0
    }

    pub fn writes(&self) -> bool {
        self.read_percent < 100
    }

    /// Bytes of one op's buffer: a whole object for sequential ops, a request for random ones.
    pub fn op_bytes(&self) -> u64 {
        match self.pattern {
            Pattern::Sequential => self.object_bytes,
            Pattern::Random => self.request_bytes,
        }
    }

    /// Ops each worker keeps in flight: enough to keep `queue_depth` requests on every device,
    /// plus one sequential op so that the next object is already queued when one finishes.
    pub fn ops_in_flight_per_worker(&self) -> usize {
        let requests_total = (self.queue_depth * self.devices) as u64;
        let total = match self.pattern {
            Pattern::Sequential => (requests_total * self.request_bytes).div_ceil(self.object_bytes) + 1,
            Pattern::Random => requests_total,
        };
        let per_worker = total.div_ceil(self.threads as u64).max(1) as usize;
        match self.pattern {
            // Never two ops on one object at once: cap at the worker's share of objects.
            Pattern::Sequential => per_worker.min(self.objects_of_worker(0).len().max(1)),
            Pattern::Random => per_worker,
        }
    }

    /// Ids of the data-set objects worker `worker` cycles through in sequential workloads.
    pub fn objects_of_worker(&self, worker: usize) -> Vec<u64> {
        (worker as u64..self.object_count).step_by(self.threads).collect()
    }

    /// Bytes of host memory the bench's buffers take.
    pub fn buffer_bytes(&self) -> u64 {
        self.op_bytes() * (self.ops_in_flight_per_worker() * self.threads) as u64
    }

    /// Small objects the random-write set holds.
    pub fn random_write_ids(&self) -> u64 {
        (self.data_bytes() / self.request_bytes).clamp(1, RANDOM_WRITE_IDS)
    }

    /// One line for reports: `randread 4 KiB, qd 128/device, 1 thread, ...`.
    pub fn describe(&self) -> String {
        let mix = if self.reads() && self.writes() { format!(" {}% reads", self.read_percent) } else { String::new() };
        format!(
            "{}{mix}, {} requests, qd {}/device, {} thread(s), {} device(s), {} in {} object(s) of {}, stripe unit {}, {} buffers, checksums {}{}",
            self.fio_rw(),
            format_bytes(self.request_bytes),
            self.queue_depth,
            self.threads,
            self.devices,
            format_bytes(self.data_bytes()),
            self.object_count,
            format_bytes(self.object_bytes),
            format_bytes(self.stripe_unit_bytes),
            match self.buffer {
                BufferKind::Host => "host",
                BufferKind::Pinned => "pinned",
                BufferKind::Gpu => "GPU",
            },
            match (self.verify_checksums, self.pattern) {
                (false, _) => "not checked",
                // The engine checks a partial stripe unit only when that at most doubles the I/O.
                (true, Pattern::Random) if 2 * self.request_bytes < self.stripe_unit_bytes => {
                    "checked for whole stripe units only (requests are under half a unit)"
                }
                (true, _) => "checked",
            },
            if self.verify { ", verifying every byte" } else { "" }
        )
    }
}

/// When a phase stops.
#[derive(Debug, Clone, Copy)]
pub enum Limit {
    Runtime(Duration),
    /// Bytes moved (reads plus writes) over all workers.
    Bytes(u64),
    /// The default timed phase: until the running mean rate is steady ([`is_steady`]), at most
    /// [`STEADY_MAX`].
    Steady,
}

/// How often the steady rule samples the running mean rate.
pub const STEADY_SAMPLE: Duration = Duration::from_millis(250);
/// Samples the running mean must hold over: 2 s.
pub const STEADY_WINDOW: usize = 8;
/// How far apart (max - min, as a share of the latest) the window's means may be.
pub const STEADY_TOLERANCE: f64 = 0.02;
/// The longest default timed phase.
pub const STEADY_MAX: Duration = Duration::from_secs(10);

/// Whether a phase has settled: `means` are its running mean rates (bytes moved since the phase
/// began over the time since, one per sample, oldest first); the last `window` of them lie within
/// `tolerance` of the latest (max - min <= tolerance x latest). A rate of 0 never settles.
pub fn is_steady(means: &[f64], window: usize, tolerance: f64) -> bool {
    assert!(window >= 2 && tolerance >= 0.0);
    if means.len() < window {
        return false;
    }
    let last = &means[means.len() - window..];
    let latest = last[window - 1];
    let (low, high) = last.iter().fold((f64::INFINITY, 0.0f64), |(lo, hi), &m| (lo.min(m), hi.max(m)));
    latest > 0.0 && high - low <= tolerance * latest
}

/// Why a timed phase ended, for the report.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum StopReason {
    /// The runtime (--runtime), or a phase run for a set time.
    #[default]
    Runtime,
    /// The byte count (--size).
    Bytes,
    /// The running mean held within [`STEADY_TOLERANCE`] over [`STEADY_WINDOW`] samples.
    Steady,
    /// [`STEADY_MAX`] passed before the running mean settled.
    SteadyCap,
}

impl StopReason {
    /// How the report says it.
    pub fn describe(self) -> String {
        match self {
            StopReason::Runtime => "the runtime".into(),
            StopReason::Bytes => "the byte count".into(),
            StopReason::Steady => format!(
                "stopped when the running mean held within {:.0}% for {:.0} s",
                STEADY_TOLERANCE * 100.0,
                STEADY_SAMPLE.as_secs_f64() * STEADY_WINDOW as f64
            ),
            StopReason::SteadyCap => format!(
                "stopped at the {} s cap: the running mean had not settled within {:.0}%",
                STEADY_MAX.as_secs(),
                STEADY_TOLERANCE * 100.0
            ),
        }
    }
}

/// Live counters the progress bar reads.
#[derive(Debug, Default)]
pub struct Progress {
    pub bytes_done: AtomicU64,
}

/// What the bench itself counted in a phase (the engine's own counters come from `Store::stats`).
#[derive(Debug, Clone, Default, Serialize)]
pub struct PhaseTotals {
    pub elapsed_s: f64,
    pub read_ops: u64,
    pub read_bytes: u64,
    pub write_ops: u64,
    pub write_bytes: u64,
    /// Bytes compared against the written pattern (with verify).
    pub verified_bytes: u64,
    /// Objects of the random-write set deleted to make room for random writes.
    pub room_deletes: u64,
    /// What ended the phase.
    pub stopped_by: StopReason,
}

impl PhaseTotals {
    fn add(&mut self, o: &PhaseTotals) {
        self.read_ops += o.read_ops;
        self.read_bytes += o.read_bytes;
        self.write_ops += o.write_ops;
        self.write_bytes += o.write_bytes;
        self.verified_bytes += o.verified_bytes;
        self.room_deletes += o.room_deletes;
    }
}

/// Set by SIGINT or SIGTERM during a bench: workers stop issuing, drain what is in flight, and
/// the run ends with an error, so that the temporary store is still removed.
static INTERRUPTED: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(_: libc::c_int) {
    INTERRUPTED.store(true, Ordering::Relaxed);
}

/// Routes SIGINT and SIGTERM to [`interrupted`] instead of killing the process.
pub fn catch_interrupts() {
    // SAFETY: the handler only stores to an atomic, which is async-signal-safe.
    unsafe {
        let mut action: libc::sigaction = std::mem::zeroed();
        action.sa_sigaction = on_signal as *const () as libc::sighandler_t;
        libc::sigemptyset(&mut action.sa_mask);
        libc::sigaction(libc::SIGINT, &action, std::ptr::null_mut());
        libc::sigaction(libc::SIGTERM, &action, std::ptr::null_mut());
    }
}

/// Whether the user asked the bench to stop.
pub fn interrupted() -> bool {
    INTERRUPTED.load(Ordering::Relaxed)
}

/// Writes the whole data set (and the random-write set when the workload writes randomly), so
/// reads find data and writes replace objects as a steady-state device would.
pub fn prefill(store: &Store, w: &Workload, progress: &Progress) -> CliResult<()> {
    let depth = w.ops_in_flight_per_worker().max(2) * w.threads;
    let mut jobs: Vec<(u64, u64)> = (0..w.object_count).map(|id| (id, w.object_bytes)).collect();
    if w.pattern == Pattern::Random && w.writes() {
        jobs.extend((0..w.random_write_ids()).map(|i| (RANDOM_WRITE_ID_BASE + i, w.request_bytes)));
    }
    let mut free: Vec<HostBuf> = Vec::new();
    let mut inflight: VecDeque<(Ticket<HostBuf>, u64)> = VecDeque::new();
    for (id, bytes) in jobs {
        if interrupted() {
            break;
        }
        if inflight.len() >= depth {
            let (ticket, len) = inflight.pop_front().expect("non-empty");
            free.push(ticket.wait()?);
            progress.bytes_done.fetch_add(len, Ordering::Relaxed);
        }
        let mut buf = match free.iter().position(|b| b.len() as u64 == bytes) {
            Some(i) => free.swap_remove(i),
            None => HostBuf::new(bytes as usize, w.buffer)?,
        };
        pattern::fill(&mut buf, id, 0);
        inflight.push_back((store.put(id, buf, &[], Priority::Normal)?, bytes));
    }
    for (ticket, len) in inflight {
        ticket.wait()?;
        progress.bytes_done.fetch_add(len, Ordering::Relaxed);
    }
    Ok(())
}

/// What one in-flight op is.
struct Issued {
    ticket: OpTicket,
    read: bool,
    id: u64,
    offset: u64,
    bytes: u64,
}

/// Runs the workload until `limit`; returns what the workers counted.
pub fn run_phase(store: &Store, w: &Workload, limit: Limit, progress: &Progress) -> CliResult<PhaseTotals> {
    let started = Instant::now();
    let deadline = match limit {
        Limit::Runtime(d) => Some(started + d),
        Limit::Steady => Some(started + STEADY_MAX),
        Limit::Bytes(_) => None,
    };
    let byte_budget = match limit {
        Limit::Bytes(b) => Some(b),
        Limit::Runtime(_) | Limit::Steady => None,
    };
    let issued_bytes = AtomicU64::new(0);
    let stop = AtomicBool::new(false);
    let settled = AtomicBool::new(false);
    let workers_done = AtomicBool::new(false);
    let results: Vec<CliResult<PhaseTotals>> = std::thread::scope(|scope| {
        if matches!(limit, Limit::Steady) {
            // Samples the running mean and stops the workers once it has settled.
            let (stop, settled, workers_done) = (&stop, &settled, &workers_done);
            scope.spawn(move || {
                let mut means = Vec::with_capacity((STEADY_MAX.as_millis() / STEADY_SAMPLE.as_millis()) as usize + 1);
                while !workers_done.load(Ordering::Relaxed) && !stop.load(Ordering::Relaxed) {
                    std::thread::sleep(STEADY_SAMPLE);
                    let elapsed_s = started.elapsed().as_secs_f64();
                    means.push(progress.bytes_done.load(Ordering::Relaxed) as f64 / elapsed_s.max(1e-9));
                    if is_steady(&means, STEADY_WINDOW, STEADY_TOLERANCE) {
                        settled.store(true, Ordering::Relaxed);
                        stop.store(true, Ordering::Relaxed);
                    }
                }
            });
        }
        let handles: Vec<_> = (0..w.threads)
            .map(|worker| {
                let (issued_bytes, stop) = (&issued_bytes, &stop);
                scope.spawn(move || {
                    let result = worker_loop(store, w, worker, deadline, byte_budget, issued_bytes, stop, progress);
                    if result.is_err() {
                        stop.store(true, Ordering::Relaxed);
                    }
                    result
                })
            })
            .collect();
        let results = handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|_| Err(CliError::failed("a bench worker panicked"))))
            .collect();
        workers_done.store(true, Ordering::Relaxed);
        results
    });
    let mut totals = PhaseTotals::default();
    for r in results {
        totals.add(&r?);
    }
    totals.elapsed_s = started.elapsed().as_secs_f64();
    totals.stopped_by = match limit {
        Limit::Runtime(_) => StopReason::Runtime,
        Limit::Bytes(_) => StopReason::Bytes,
        Limit::Steady if settled.load(Ordering::Relaxed) => StopReason::Steady,
        Limit::Steady => StopReason::SteadyCap,
    };
    Ok(totals)
}

#[allow(clippy::too_many_arguments)]
fn worker_loop(
    store: &Store,
    w: &Workload,
    worker: usize,
    deadline: Option<Instant>,
    byte_budget: Option<u64>,
    issued_bytes: &AtomicU64,
    stop: &AtomicBool,
    progress: &Progress,
) -> CliResult<PhaseTotals> {
    let depth = w.ops_in_flight_per_worker();
    let op_bytes = w.op_bytes();
    let mut free = Vec::with_capacity(depth);
    for _ in 0..depth {
        free.push(OpBuf::new(op_bytes as usize, w.buffer, w.gpu_ordinal)?);
    }
    let my_objects = w.objects_of_worker(worker);
    if w.pattern == Pattern::Sequential && my_objects.is_empty() {
        return Ok(PhaseTotals::default());
    }
    let mut next_object = 0usize;
    let mut rng = Rng::new(0x5EED ^ worker as u64);
    let requests_per_object = w.object_bytes / w.request_bytes;
    let mut inflight: VecDeque<Issued> = VecDeque::with_capacity(depth);
    let mut totals = PhaseTotals::default();
    let done = std::sync::Arc::new(teraio_engine::DoneSignal::default());
    let mut seen = 0u64;
    // Where this worker's next delete to make room starts in the random-write set.
    let mut room_cursor = worker as u64 * w.random_write_ids() / w.threads as u64;
    loop {
        while inflight.len() < depth && !stop.load(Ordering::Relaxed) && !interrupted() {
            if deadline.is_some_and(|d| Instant::now() >= d) {
                break;
            }
            let read = w.read_percent == 100 || (w.read_percent > 0 && rng.below(100) < w.read_percent as u64);
            if let Some(budget) = byte_budget {
                if issued_bytes.fetch_add(op_bytes, Ordering::Relaxed) >= budget {
                    break;
                }
            }
            let mut buf = free.pop().expect("a free buffer per slot");
            let (id, offset) = match w.pattern {
                Pattern::Sequential => {
                    let id = my_objects[next_object];
                    next_object = (next_object + 1) % my_objects.len();
                    (id, 0)
                }
                Pattern::Random if read => {
                    let id = rng.below(w.object_count);
                    (id, rng.below(requests_per_object) * w.request_bytes)
                }
                Pattern::Random => (RANDOM_WRITE_ID_BASE + rng.below(w.random_write_ids()), 0),
            };
            let ticket = if read {
                match w.pattern {
                    Pattern::Sequential => buf.get(store, id)?,
                    Pattern::Random => buf.get_range(store, id, offset)?,
                }
            } else {
                if w.verify {
                    // Only with verify: writes must carry the bytes later reads expect.
                    let mut bytes = vec![0u8; op_bytes as usize];
                    pattern::fill(&mut bytes, id, 0);
                    buf.write_from(&bytes)?;
                }
                match buf.put(store, id) {
                    Ok(ticket) => ticket,
                    Err(teraio_engine::Error::NoSpace { .. }) if w.pattern == Pattern::Random => {
                        put_making_room(store, w, id, &mut room_cursor, &mut totals)?
                    }
                    Err(e) => return Err(e.into()),
                }
            };
            ticket.signal_when_done(&done);
            inflight.push_back(Issued { ticket, read, id, offset, bytes: op_bytes });
        }
        if inflight.is_empty() {
            break;
        }
        // Wait for any op to finish (not the oldest: a put that waits for its commit must not
        // hold the slots of gets that finished meanwhile idle), then take every finished one.
        seen = done.wait_past(seen);
        let (finished, still_running): (VecDeque<Issued>, VecDeque<Issued>) =
            inflight.drain(..).partition(|op| op.ticket.is_done());
        inflight = still_running;
        for Issued { ticket, read, id, offset, bytes } in finished {
            let buf = ticket.wait()?;
            if read && w.verify {
                let mismatch = buf.inspect(bytes as usize, |data| pattern::check(data, id, offset))?;
                if let Some(at) = mismatch {
                    stop.store(true, Ordering::Relaxed);
                    return Err(CliError::failed(format!(
                        "verify failed: object {id} byte {at} differs from what was written; the data path is corrupting data (run `teraio fsck` on the targets)"
                    )));
                }
                totals.verified_bytes += bytes;
            }
            account(read, bytes, &mut totals);
            progress.bytes_done.fetch_add(bytes, Ordering::Relaxed);
            free.push(buf);
        }
    }
    Ok(totals)
}

/// A random write that found the store full: deletes objects of the random-write set other
/// than `id`, from `cursor` on, until a put of `id` fits. The failed put took its buffer with
/// it, so this one gets a new one.
fn put_making_room(
    store: &Store,
    w: &Workload,
    id: u64,
    cursor: &mut u64,
    totals: &mut PhaseTotals,
) -> CliResult<OpTicket> {
    let ids = w.random_write_ids();
    for _ in 0..ids {
        let victim = RANDOM_WRITE_ID_BASE + *cursor % ids;
        *cursor += 1;
        if victim == id || !store.delete(victim)? {
            continue;
        }
        totals.room_deletes += 1;
        let mut buf = OpBuf::new(w.request_bytes as usize, w.buffer, w.gpu_ordinal)?;
        if w.verify {
            let mut bytes = vec![0u8; w.request_bytes as usize];
            pattern::fill(&mut bytes, id, 0);
            buf.write_from(&bytes)?;
        }
        match buf.put(store, id) {
            Ok(ticket) => return Ok(ticket),
            Err(teraio_engine::Error::NoSpace { .. }) => continue,
            Err(e) => return Err(e.into()),
        }
    }
    Err(CliError::failed(format!(
        "a random write of {} finds the store full even with every other object of the random-write set deleted; give a smaller --data-size or larger targets",
        format_bytes(w.request_bytes)
    )))
}

/// Counts a finished op.
fn account(read: bool, bytes: u64, totals: &mut PhaseTotals) {
    if read {
        totals.read_ops += 1;
        totals.read_bytes += bytes;
    } else {
        totals.write_ops += 1;
        totals.write_bytes += bytes;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn workload(pattern: Pattern, read_percent: u8) -> Workload {
        Workload {
            pattern,
            read_percent,
            request_bytes: 4 << 20,
            object_bytes: 256 << 20,
            object_count: 16,
            queue_depth: 32,
            threads: 1,
            stripe_unit_bytes: 4 << 20,
            devices: 1,
            verify: false,
            verify_checksums: true,
            buffer: BufferKind::Host,
            gpu_ordinal: 0,
        }
    }

    #[test]
    fn in_flight_covers_the_queue_depth() {
        // 32 x 4 MiB = 128 MiB on one device: half an object, plus one queued: 2 gets.
        assert_eq!(workload(Pattern::Sequential, 100).ops_in_flight_per_worker(), 2);
        let mut w = workload(Pattern::Random, 100);
        w.request_bytes = 4096;
        w.queue_depth = 128;
        w.devices = 4;
        w.threads = 2;
        assert_eq!(w.ops_in_flight_per_worker(), 256);
        assert_eq!(w.fio_rw(), "randread");
        assert_eq!(workload(Pattern::Sequential, 70).fio_rw(), "rw");
    }

    #[test]
    fn the_default_phase_stops_once_the_running_mean_holds_within_two_percent() {
        // Fed running means (bytes/s), not a clock: a ramp, then a plateau within 1%.
        let ramp = [1.0e9, 1.4e9, 1.6e9, 1.7e9];
        let plateau = [1.75e9, 1.76e9, 1.755e9, 1.76e9, 1.765e9, 1.76e9, 1.758e9, 1.762e9];
        let mut means: Vec<f64> = ramp.to_vec();
        for (index, &mean) in plateau.iter().enumerate() {
            means.push(mean);
            let want = index + 1 >= STEADY_WINDOW; // the whole window on the plateau
            assert_eq!(is_steady(&means, STEADY_WINDOW, STEADY_TOLERANCE), want, "after {} samples", means.len());
        }
        // A window that spans 3% never settles; nor does a phase that moved nothing.
        let drifting: Vec<f64> = (0..20).map(|i| 1e9 * (1.0 + 0.03 * (i % 2) as f64)).collect();
        assert!(!is_steady(&drifting, STEADY_WINDOW, STEADY_TOLERANCE));
        assert!(!is_steady(&[0.0; 20], STEADY_WINDOW, STEADY_TOLERANCE));
        assert!(!is_steady(&plateau[..STEADY_WINDOW - 1], STEADY_WINDOW, STEADY_TOLERANCE), "too few samples");
        // Exactly 2% apart is steady.
        let edge = [0.98e9, 1.0e9, 1.0e9, 1.0e9, 1.0e9, 1.0e9, 1.0e9, 1.0e9];
        assert!(is_steady(&edge, STEADY_WINDOW, STEADY_TOLERANCE));
        assert_eq!(STEADY_MAX, Duration::from_secs(10));
    }

    #[test]
    fn random_writes_into_a_full_store_delete_older_ones_and_keep_running() {
        use teraio_engine::{FormatConfig, OpenConfig, MIB};
        let dir = tempfile::Builder::new()
            .tempdir_in(std::env::var_os("TERAIO_TEST_DIR").map_or_else(std::env::temp_dir, Into::into))
            .unwrap();
        let paths = [dir.path().join("d0")];
        let format = FormatConfig {
            stripe_unit_bytes: MIB,
            checkpoint_slot_bytes: Some(MIB),
            journal_bytes: Some(MIB),
            create_file_bytes: Some(16 * MIB),
            ..FormatConfig::default()
        };
        let open = OpenConfig { durable: false, queue_depth: 4, ..OpenConfig::default() };
        let store = Store::create(&paths, &format, open).unwrap();
        let mut w = workload(Pattern::Random, 0);
        (w.request_bytes, w.object_bytes, w.object_count, w.queue_depth, w.verify) = (256 << 10, MIB, 2, 4, true);
        prefill(&store, &w, &Progress::default()).unwrap();
        // Fill what is left with objects outside the workload's ids: every put now needs room.
        let filler = vec![0u8; 256 << 10];
        let mut id = 1 << 50;
        while store.put_blocking(id, &filler, b"").is_ok() {
            id += 1;
        }
        let totals = run_phase(&store, &w, Limit::Runtime(Duration::from_millis(300)), &Progress::default()).unwrap();
        assert!(totals.write_ops > 0);
        assert!(totals.room_deletes > 0, "the store was full, so writes had to make room");
        // Reads of what the random writes left behind are whole and checked.
        w.read_percent = 50;
        let totals = run_phase(&store, &w, Limit::Runtime(Duration::from_millis(200)), &Progress::default()).unwrap();
        assert!(totals.read_ops > 0);
    }

    #[test]
    fn workers_split_the_objects() {
        let mut w = workload(Pattern::Sequential, 100);
        w.threads = 3;
        let all: usize = (0..3).map(|t| w.objects_of_worker(t).len()).sum();
        assert_eq!(all, 16);
        assert_eq!(w.objects_of_worker(1), vec![1, 4, 7, 10, 13]);
    }
}
