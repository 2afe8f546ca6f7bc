//! A thread that sleeps on CUDA events in the order they are handed to it and runs each one's
//! continuation once its event has completed, with a pool of spare events for the next ones.
//! The copy engine ([`super::copy`]) and the gate ([`super::gate`]) each own one: the gate's
//! events may wait for work whose completion the copy engine's waiter reports, so they must not
//! share a thread.

use super::driver::{Context, Event};
use crate::error::{Error, Result};
use std::sync::mpsc::{channel, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

/// What runs on the waiter's thread once an event has completed (or could not be waited for).
pub type AfterEvent = Box<dyn FnOnce(Result<()>) + Send>;

struct Pending {
    event: Event,
    then: AfterEvent,
}

/// One waiter thread and its spare events, for one CUDA device.
pub struct EventWaiter {
    ctx: &'static Context,
    /// Events ready for reuse (the thread gives each back once it has completed).
    spare_events: Arc<Mutex<Vec<Event>>>,
    to_thread: Mutex<Option<Sender<Pending>>>,
    thread: Option<JoinHandle<()>>,
}

impl EventWaiter {
    /// Starts the thread, named `name`, with `ctx` current on it.
    pub fn new(ctx: &'static Context, name: String) -> Result<EventWaiter> {
        let (tx, rx) = channel::<Pending>();
        let spare_events = Arc::new(Mutex::new(Vec::new()));
        let returned = spare_events.clone();
        let thread = std::thread::Builder::new()
            .name(name)
            .spawn(move || {
                let current = ctx.make_current();
                for p in rx {
                    let result = match &current {
                        Ok(()) => p.event.synchronize(),
                        Err(e) => Err(e.clone()),
                    };
                    // The event is free again before the continuation may need the next one.
                    returned.lock().expect("waiter events").push(p.event);
                    (p.then)(result);
                }
            })
            .map_err(|e| Error::io("starting a GPU event waiter thread", e))?;
        Ok(EventWaiter { ctx, spare_events, to_thread: Mutex::new(Some(tx)), thread: Some(thread) })
    }

    /// A spare event, or a new one (blocking sync: the thread sleeps on it without spinning).
    pub fn take_event(&self) -> Result<Event> {
        let spare = self.spare_events.lock().expect("waiter events").pop();
        match spare {
            Some(e) => Ok(e),
            None => Event::new(self.ctx),
        }
    }

    /// Runs `then` on the thread once `event` (recorded, from [`EventWaiter::take_event`]) has
    /// completed, after the events handed over before it; with `Error::Closed` at once, here,
    /// if the waiter has stopped.
    pub fn after(&self, event: Event, then: AfterEvent) {
        let tx = self.to_thread.lock().expect("waiter sender");
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
}

impl Drop for EventWaiter {
    fn drop(&mut self) {
        // Closing the channel ends the thread after the events already handed to it.
        self.to_thread.lock().expect("waiter sender").take();
        if let Some(t) = self.thread.take() {
            if t.thread().id() != std::thread::current().id() {
                let _ = t.join();
            }
        }
    }
}
