//! Starting a GPU op after a caller's CUDA event, so that the caller need not wait for its own
//! stream (or poll the event) before it hands the engine a buffer that queued work still writes
//! (a put's source) or still reads (a get's target).
//!
//! [`Gate::mark`] runs on the caller's thread: it makes the gate's own stream wait for the
//! caller's event (`cuStreamWaitEvent`, which takes the event as last recorded at that moment, so
//! the caller may record or destroy it right after) and records one of the gate's events, made
//! with blocking sync, behind that wait. [`Gate::pass`] hands the mark and the op's start to the
//! gate's thread, which sleeps on the marks in order and starts each op once its mark has
//! passed. Nothing in the engine reads or writes the buffer before then, on either GPU path (the
//! bounce copies and cuFile both come after the op is queued).
//!
//! The gate has its own thread, not the copy engine's waiter: a caller's event may depend on a
//! stream hand-off of an earlier op ([`super::handoff`]), whose copies complete on that waiter.
//! Marks are passed in the order they were made, and a mark can only depend on work queued
//! before it, so the gate never waits for an op behind it.

use super::driver::{self as cuda, Context, Event, Stream};
use super::waiter::EventWaiter;
use crate::error::{Error, Result};

/// A caller's CUDA event (`CUevent`) that an op starts after.
pub type RawEvent = cudarc::driver::sys::CUevent;

/// What runs on the gate's thread once a mark has passed (or could not be waited for).
pub type AfterGate = super::waiter::AfterEvent;

/// A caller's event as captured on the gate's stream by [`Gate::mark`].
pub struct GateMark {
    event: Event,
}

/// The gate of one CUDA device: its stream, and the thread that starts ops once their marks pass.
pub struct Gate {
    /// Declared first, so dropped first: its thread passes the marks already handed to it before
    /// the stream goes.
    waiter: EventWaiter,
    ctx: &'static Context,
    stream: Stream,
}

impl Gate {
    pub fn new(ordinal: u32) -> Result<Gate> {
        let ctx = cuda::context(ordinal)?;
        let stream = Stream::new(ctx)?;
        let waiter = EventWaiter::new(ctx, format!("teraio-gpu{ordinal}-gate"))?;
        Ok(Gate { waiter, ctx, stream })
    }

    /// Captures `after` as it is now: the mark passes once the work recorded in it has finished.
    ///
    /// # Safety
    /// `after` must be a live CUDA event (of any device's primary context) for this call's length.
    pub unsafe fn mark(&self, after: RawEvent) -> Result<GateMark> {
        if after.is_null() {
            return Err(Error::InvalidConfig("the event to start after is a null CUevent".into()));
        }
        self.ctx.make_current()?;
        // SAFETY: forwarded contract; the gate's stream lives as long as the gate.
        cuda::check(unsafe { cudarc::driver::sys::cuStreamWaitEvent(self.stream.raw, after, 0) }, "cuStreamWaitEvent")?;
        let event = self.waiter.take_event()?;
        event.record(&self.stream)?;
        Ok(GateMark { event })
    }

    /// Runs `then` on the gate's thread once `mark` has passed (with the error, if waiting for it
    /// failed or the gate has stopped).
    pub fn pass(&self, mark: GateMark, then: AfterGate) {
        self.waiter.after(mark.event, then)
    }
}
