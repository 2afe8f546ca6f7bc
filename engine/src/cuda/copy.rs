//! Host<->device copies of bounce chunks, overlapped with disk I/O: the thread that has a chunk
//! ready (the dispatcher for a put, a device worker for a get) only enqueues the copy on one of the
//! engine's own streams and records an event; a small waiter thread sleeps on the events in order
//! and runs each copy's continuation (submit the disk write, or finish the request). No engine
//! thread ever waits for PCIe, so disk and copies run side by side and the slower one sets the pace.

use super::driver::{self as cuda, Context, DevicePtr, Event, Stream};
use super::waiter::EventWaiter;
use crate::error::Result;
use std::sync::atomic::{AtomicUsize, Ordering};

/// Direction of a copy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CopyDirection {
    HostToDevice,
    DeviceToHost,
}

/// What runs once a copy has finished (or failed), on the waiter thread. It must not call CUDA
/// in ways that wait for the engine's own streams.
pub type AfterCopy = super::waiter::AfterEvent;

/// The copy streams and waiter thread of one CUDA device.
pub struct CopyEngine {
    /// Declared first, so dropped first: its thread finishes the copies already queued before
    /// the streams go.
    waiter: EventWaiter,
    ctx: &'static Context,
    streams: Vec<Stream>,
    next_stream: AtomicUsize,
}

impl CopyEngine {
    /// `stream_count` streams (at least one) on device `ordinal`.
    pub fn new(ordinal: u32, stream_count: usize) -> Result<CopyEngine> {
        let ctx = cuda::context(ordinal)?;
        let streams = (0..stream_count.max(1)).map(|_| Stream::new(ctx)).collect::<Result<Vec<_>>>()?;
        let waiter = EventWaiter::new(ctx, format!("teraio-gpu{ordinal}-copy"))?;
        Ok(CopyEngine { waiter, ctx, streams, next_stream: AtomicUsize::new(0) })
    }

    pub fn ordinal(&self) -> u32 {
        self.ctx.ordinal
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
            let event = self.waiter.take_event()?;
            event.record(stream)?;
            Ok(event)
        })();
        match enqueued {
            Ok(event) => self.waiter.after(event, then),
            Err(e) => then(Err(e)),
        }
    }
}
