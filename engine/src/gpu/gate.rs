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

use super::cuda::{self, Context, Event, Stream};
use crate::error::{Error, Result};
use std::sync::mpsc::{channel, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

/// A caller's CUDA event (`CUevent`) that an op starts after.
pub type RawEvent = cudarc::driver::sys::CUevent;

/// What runs on the gate's thread once a mark has passed (or could not be waited for).
pub type AfterGate = Box<dyn FnOnce(Result<()>) + Send>;

/// A caller's event as captured on the gate's stream by [`Gate::mark`].
pub struct GateMark {
    event: Event,
}

struct Pending {
    event: Event,
    then: AfterGate,
}

/// The gate of one CUDA device: its stream, and the thread that starts ops once their marks pass.
pub struct Gate {
    ctx: &'static Context,
    stream: Stream,
    /// Events ready for reuse (the thread gives them back once their mark has passed).
    spare_events: Arc<Mutex<Vec<Event>>>,
    to_thread: Mutex<Option<Sender<Pending>>>,
    thread: Option<JoinHandle<()>>,
}

impl Gate {
    pub fn new(ordinal: u32) -> Result<Gate> {
        let ctx = cuda::context(ordinal)?;
        let stream = Stream::new(ctx)?;
        let (tx, rx) = channel::<Pending>();
        let spare_events = Arc::new(Mutex::new(Vec::new()));
        let returned = spare_events.clone();
        let thread = std::thread::Builder::new()
            .name(format!("teraio-gpu{ordinal}-gate"))
            .spawn(move || {
                let current = ctx.make_current();
                for p in rx {
                    let result = match &current {
                        Ok(()) => p.event.synchronize(),
                        Err(e) => Err(e.clone()),
                    };
                    returned.lock().expect("gate events").push(p.event);
                    (p.then)(result);
                }
            })
            .map_err(|e| Error::io("starting the GPU gate thread", e))?;
        Ok(Gate { ctx, stream, spare_events, to_thread: Mutex::new(Some(tx)), thread: Some(thread) })
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
        let spare = self.spare_events.lock().expect("gate events").pop();
        let event = match spare {
            Some(e) => e,
            None => Event::new(self.ctx)?,
        };
        event.record(&self.stream)?;
        Ok(GateMark { event })
    }

    /// Runs `then` on the gate's thread once `mark` has passed (with the error, if waiting for it
    /// failed or the gate has stopped).
    pub fn pass(&self, mark: GateMark, then: AfterGate) {
        let tx = self.to_thread.lock().expect("gate sender");
        match tx.as_ref() {
            Some(tx) => {
                if let Err(std::sync::mpsc::SendError(p)) = tx.send(Pending { event: mark.event, then }) {
                    (p.then)(Err(Error::Closed));
                }
            }
            None => {
                drop(tx);
                then(Err(Error::Closed))
            }
        }
    }
}

impl Drop for Gate {
    fn drop(&mut self) {
        // Closing the channel ends the thread after the marks already passed to it.
        self.to_thread.lock().expect("gate sender").take();
        if let Some(t) = self.thread.take() {
            if t.thread().id() != std::thread::current().id() {
                let _ = t.join();
            }
        }
    }
}
