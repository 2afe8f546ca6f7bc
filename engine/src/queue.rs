//! Per-device queues: one worker thread per device owns that device's backend, admits requests
//! from two lanes (urgent first, with part of the depth held back for it), keeps up to the queue
//! depth in flight, finishes short transfers and records statistics.

use crate::backend::{Backend, BackendCompletion, BackendRequest, IoKind, Waker};
use crate::stats::IoCounters;
use slab::Slab;
use std::collections::VecDeque;
use std::io;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::Instant;

/// How many times one request is resubmitted after EAGAIN/EINTR before it fails.
const MAX_RETRIES: u32 = 16;

/// Lane of a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Priority {
    /// Background work.
    #[default]
    Normal,
    /// Overtakes queued background work (what the next kernel needs).
    Urgent,
}

/// What to run when a request finishes (in the device's worker thread).
pub type OnComplete = Box<dyn FnOnce(io::Result<()>) + Send>;

/// One device request as the store hands it over.
pub struct Request {
    pub kind: IoKind,
    pub offset: u64,
    pub buf: *mut u8,
    pub len: u32,
    pub fixed_index: Option<u16>,
    pub priority: Priority,
    pub on_complete: OnComplete,
}

// SAFETY: see BackendRequest; the memory is owned by the op that `on_complete` belongs to.
unsafe impl Send for Request {}

struct Lanes {
    urgent: VecDeque<Request>,
    normal: VecDeque<Request>,
    shutdown: bool,
    /// The worker sleeps on `work_ready` (nothing in flight): only then does a submit wake it,
    /// since a wake is a system call.
    worker_idle: bool,
}

struct Shared {
    lanes: Mutex<Lanes>,
    work_ready: Condvar,
    waker: Waker,
    waiting_in_backend: AtomicBool,
    counters: Mutex<IoCounters>,
}

/// The queue of one device.
pub struct DeviceQueue {
    shared: Arc<Shared>,
    worker: Option<JoinHandle<()>>,
    pub backend_name: &'static str,
}

struct InFlight {
    request: Request,
    done_bytes: u32,
    retries: u32,
    started: Instant,
}

impl DeviceQueue {
    /// Starts the worker for `backend` with `depth` requests in flight at most.
    pub fn start(device_index: u16, backend: Box<dyn Backend>, depth: usize) -> io::Result<DeviceQueue> {
        assert!(depth > 0);
        let backend_name = backend.name();
        let shared = Arc::new(Shared {
            lanes: Mutex::new(Lanes {
                urgent: VecDeque::new(),
                normal: VecDeque::new(),
                shutdown: false,
                worker_idle: false,
            }),
            work_ready: Condvar::new(),
            waker: backend.waker(),
            waiting_in_backend: AtomicBool::new(false),
            counters: Mutex::new(IoCounters::default()),
        });
        let worker_shared = shared.clone();
        let worker = std::thread::Builder::new()
            .name(format!("teraio-dev{device_index}"))
            .spawn(move || Worker::new(backend, depth, worker_shared).run())?;
        Ok(DeviceQueue { shared, worker: Some(worker), backend_name })
    }

    /// Hands requests to the worker.
    pub fn submit(&self, requests: impl IntoIterator<Item = Request>) {
        let mut lanes = self.shared.lanes.lock().expect("lanes");
        for r in requests {
            match r.priority {
                Priority::Urgent => lanes.urgent.push_back(r),
                Priority::Normal => lanes.normal.push_back(r),
            }
        }
        let wake = self.shared.waiting_in_backend.load(Ordering::Acquire);
        let idle = lanes.worker_idle;
        drop(lanes);
        if idle {
            self.shared.work_ready.notify_one();
        }
        if wake {
            (self.shared.waker)();
        }
    }

    pub fn counters(&self) -> IoCounters {
        self.shared.counters.lock().expect("counters").clone()
    }

    pub fn reset_counters(&self) {
        *self.shared.counters.lock().expect("counters") = IoCounters::default();
    }
}

impl Drop for DeviceQueue {
    fn drop(&mut self) {
        self.shared.lanes.lock().expect("lanes").shutdown = true;
        self.shared.work_ready.notify_one();
        (self.shared.waker)();
        if let Some(w) = self.worker.take() {
            // Never join from the worker itself (its last completion may drop the store).
            if w.thread().id() != std::thread::current().id() {
                let _ = w.join();
            }
        }
    }
}

struct Worker {
    backend: Box<dyn Backend>,
    depth: usize,
    /// Slots normal requests may use; the rest wait for urgent ones.
    normal_depth: usize,
    shared: Arc<Shared>,
    in_flight: Slab<InFlight>,
    completions: Vec<BackendCompletion>,
}

impl Worker {
    fn new(backend: Box<dyn Backend>, depth: usize, shared: Arc<Shared>) -> Self {
        let reserve = if depth > 1 { (depth / 8).max(1) } else { 0 };
        // Normal requests always get a slot; with a depth above 1 urgent ones keep some.
        assert!(depth - reserve >= 1 && (depth == 1 || reserve >= 1));
        Worker {
            backend,
            depth,
            normal_depth: depth - reserve,
            shared,
            in_flight: Slab::with_capacity(depth),
            completions: Vec::with_capacity(depth),
        }
    }

    fn push(&mut self, slot: usize) {
        let f = &self.in_flight[slot];
        let r = &f.request;
        let done = f.done_bytes;
        assert!(r.kind == IoKind::Flush || done < r.len, "a slot goes to the device with bytes left");
        assert!(self.in_flight.len() <= self.depth, "no more slots in flight than the depth");
        let request = BackendRequest {
            token: slot as u64,
            kind: r.kind,
            offset: r.offset + done as u64,
            // done_bytes < len, so this stays inside the request's buffer (which may be a GPU
            // address for the cuFile backend: wrapping arithmetic, never dereferenced here).
            buf: r.buf.wrapping_add(done as usize),
            len: r.len - done,
            fixed_index: r.fixed_index,
        };
        // SAFETY: the request's buffer lives until on_complete runs; at most `depth` in flight.
        unsafe { self.backend.push(request) };
    }

    fn run(mut self) {
        loop {
            let wait_in_backend;
            {
                let shared = self.shared.clone();
                let mut lanes = shared.lanes.lock().expect("lanes");
                loop {
                    let next = if self.in_flight.len() < self.depth && !lanes.urgent.is_empty() {
                        lanes.urgent.pop_front()
                    } else if self.in_flight.len() < self.normal_depth {
                        lanes.normal.pop_front()
                    } else {
                        None
                    };
                    let Some(request) = next else { break };
                    assert!(
                        request.priority == Priority::Urgent || self.in_flight.len() < self.normal_depth,
                        "normal requests leave the reserved slots to urgent ones"
                    );
                    let slot =
                        self.in_flight.insert(InFlight { request, done_bytes: 0, retries: 0, started: Instant::now() });
                    self.push(slot);
                }
                if self.in_flight.is_empty() {
                    if lanes.shutdown && lanes.urgent.is_empty() && lanes.normal.is_empty() {
                        return;
                    }
                    lanes.worker_idle = true;
                    let mut lanes = shared.work_ready.wait(lanes).expect("lanes");
                    lanes.worker_idle = false;
                    continue;
                }
                let can_admit = (!lanes.urgent.is_empty() && self.in_flight.len() < self.depth)
                    || (!lanes.normal.is_empty() && self.in_flight.len() < self.normal_depth);
                wait_in_backend = !can_admit;
                self.shared.waiting_in_backend.store(wait_in_backend, Ordering::Release);
            }
            let result = self.backend.submit_and_reap(wait_in_backend, &mut self.completions);
            self.shared.waiting_in_backend.store(false, Ordering::Release);
            if let Err(e) = result {
                // The ring itself failed: fail everything in flight rather than hang.
                tracing::error!(error = %e, "device backend failed");
                let slots: Vec<usize> = self.in_flight.iter().map(|(k, _)| k).collect();
                for slot in slots {
                    let f = self.in_flight.remove(slot);
                    self.shared.counters.lock().expect("counters").errors += 1;
                    (f.request.on_complete)(Err(io::Error::new(e.kind(), e.to_string())));
                }
                continue;
            }
            let completions = std::mem::take(&mut self.completions);
            for c in &completions {
                self.complete(*c);
            }
            self.completions = completions;
            self.completions.clear();
        }
    }

    fn complete(&mut self, c: BackendCompletion) {
        let slot = c.token as usize;
        let f = &mut self.in_flight[slot];
        let kind = f.request.kind;
        let outcome: Option<io::Result<()>> = if c.result < 0 {
            let errno = -c.result;
            if (errno == libc::EAGAIN || errno == libc::EINTR) && f.retries < MAX_RETRIES {
                f.retries += 1;
                None
            } else {
                Some(Err(io::Error::from_raw_os_error(errno)))
            }
        } else if kind == IoKind::Flush {
            Some(Ok(()))
        } else if c.result == 0 && f.request.len > f.done_bytes {
            Some(Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                format!("device returned 0 bytes with {} of {} left", f.request.len - f.done_bytes, f.request.len),
            )))
        } else {
            f.done_bytes += c.result as u32;
            assert!(f.done_bytes <= f.request.len, "the device moved more bytes than asked");
            if f.done_bytes < f.request.len {
                f.retries += 1;
                None
            } else {
                Some(Ok(()))
            }
        };
        let Some(outcome) = outcome else {
            self.shared.counters.lock().expect("counters").retries += 1;
            self.push(slot);
            return;
        };
        let f = self.in_flight.remove(slot);
        {
            let mut s = self.shared.counters.lock().expect("counters");
            if f.request.priority == Priority::Urgent {
                s.urgent_ops += 1;
            }
            match (&outcome, kind) {
                (Err(_), _) => s.errors += 1,
                (Ok(()), IoKind::Read) => {
                    s.read_ops += 1;
                    s.read_bytes += f.request.len as u64;
                    s.read_latency.record(f.started.elapsed());
                }
                (Ok(()), IoKind::Write) => {
                    s.write_ops += 1;
                    s.write_bytes += f.request.len as u64;
                    s.write_latency.record(f.started.elapsed());
                }
                (Ok(()), IoKind::Flush) => s.flush_ops += 1,
            }
        }
        (f.request.on_complete)(outcome);
    }
}
