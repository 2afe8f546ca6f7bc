//! Host<->device copies of bounce chunks, overlapped with disk I/O: the thread that has a chunk
//! ready (the dispatcher for a put, a device worker for a get) only enqueues the copy on one of the
//! engine's own streams and records an event; a small waiter thread sleeps on the events in order
//! and runs each copy's continuation (submit the disk write, or finish the request). No engine
//! thread ever waits for PCIe, so disk and copies run side by side and the slower one sets the pace.

use super::cuda::{self, Context, DevicePtr, Event, Stream};
use crate::error::{Error, Result};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{channel, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

/// Direction of a copy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CopyDirection {
    HostToDevice,
    DeviceToHost,
}

/// What runs once a copy has finished (or failed), on the waiter thread. It must not call CUDA
/// in ways that wait for the engine's own streams.
pub type AfterCopy = Box<dyn FnOnce(Result<()>) + Send>;

struct Pending {
    event: Event,
    then: AfterCopy,
}

/// The copy streams and waiter thread of one CUDA device.
pub struct CopyEngine {
    ctx: &'static Context,
    streams: Vec<Stream>,
    next_stream: AtomicUsize,
    /// Events ready for reuse (the waiter gives them back once their copy is done).
    spare_events: Arc<Mutex<Vec<Event>>>,
    to_waiter: Mutex<Option<Sender<Pending>>>,
    waiter: Option<JoinHandle<()>>,
}

impl CopyEngine {
    /// `stream_count` streams (at least one) on device `ordinal`.
    pub fn new(ordinal: u32, stream_count: usize) -> Result<CopyEngine> {
        let ctx = cuda::context(ordinal)?;
        let streams = (0..stream_count.max(1)).map(|_| Stream::new(ctx)).collect::<Result<Vec<_>>>()?;
        let (tx, rx) = channel::<Pending>();
        let spare_events = Arc::new(Mutex::new(Vec::new()));
        let returned = spare_events.clone();
        let waiter = std::thread::Builder::new()
            .name(format!("teraio-gpu{ordinal}-copy"))
            .spawn(move || {
                let current = ctx.make_current();
                for p in rx {
                    let result = match &current {
                        Ok(()) => p.event.synchronize(),
                        Err(e) => Err(e.clone()),
                    };
                    // The event is free again before the continuation may queue the next copy.
                    returned.lock().expect("events").push(p.event);
                    (p.then)(result);
                }
            })
            .map_err(|e| Error::io("starting the GPU copy thread", e))?;
        Ok(CopyEngine {
            ctx,
            streams,
            next_stream: AtomicUsize::new(0),
            spare_events,
            to_waiter: Mutex::new(Some(tx)),
            waiter: Some(waiter),
        })
    }

    pub fn ordinal(&self) -> u32 {
        self.ctx.ordinal
    }

    fn take_event(&self) -> Result<Event> {
        let spare = self.spare_events.lock().expect("events").pop();
        match spare {
            Some(e) => Ok(e),
            None => Event::new(self.ctx),
        }
    }

    /// Enqueues a copy of `len` bytes between pinned `host` and `device`; `then` runs on the
    /// waiter thread once it has finished (or at once, here, if it could not be enqueued).
    ///
    /// # Safety
    /// `host` must be pinned memory (the bounce slab) and both ranges must stay valid until
    /// `then` runs.
    pub unsafe fn copy(&self, direction: CopyDirection, host: *mut u8, device: DevicePtr, len: usize, then: AfterCopy) {
        let enqueued = (|| -> Result<Event> {
            self.ctx.make_current()?;
            let stream = &self.streams[self.next_stream.fetch_add(1, Ordering::Relaxed) % self.streams.len()];
            // SAFETY: forwarded contract.
            unsafe {
                match direction {
                    CopyDirection::HostToDevice => cuda::copy_to_device_async(device, host, len, stream)?,
                    CopyDirection::DeviceToHost => cuda::copy_to_host_async(host, device, len, stream)?,
                }
            }
            let event = self.take_event()?;
            event.record(stream)?;
            Ok(event)
        })();
        match enqueued {
            Ok(event) => {
                let tx = self.to_waiter.lock().expect("copy sender");
                match tx.as_ref() {
                    Some(tx) => {
                        if let Err(std::sync::mpsc::SendError(p)) = tx.send(Pending { event, then }) {
                            (p.then)(Err(Error::Closed));
                        }
                    }
                    None => {
                        drop(tx);
                        then(Err(Error::Closed))
                    }
                }
            }
            Err(e) => then(Err(e)),
        }
    }
}

impl Drop for CopyEngine {
    fn drop(&mut self) {
        // Closing the channel ends the waiter after the copies already queued.
        self.to_waiter.lock().expect("copy sender").take();
        if let Some(w) = self.waiter.take() {
            if w.thread().id() != std::thread::current().id() {
                let _ = w.join();
            }
        }
    }
}
