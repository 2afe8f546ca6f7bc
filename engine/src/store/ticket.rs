//! Tickets: the caller's handle on an asynchronous put or get. A ticket owns the caller's buffer
//! until the I/O is done, so the buffer can never be freed or reused under the device.

use crate::error::{Error, Result};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

/// Memory the engine may read from (for put) while the op runs. The address of the bytes must not
/// change when the value is moved (heap memory: `Vec<u8>`, `Box<[u8]>`, [`crate::AlignedBuf`]).
///
/// # Safety
/// `io_ptr` must point to `io_len` bytes that stay valid, at the same address, for the value's life.
pub unsafe trait IoBuf: Send + 'static {
    fn io_ptr(&self) -> *const u8;
    fn io_len(&self) -> usize;
}

/// Memory the engine may write into (for get). Same contract as [`IoBuf`].
///
/// # Safety
/// As [`IoBuf`], and the bytes must be writable.
pub unsafe trait IoBufMut: IoBuf {
    fn io_mut_ptr(&mut self) -> *mut u8;
}

// SAFETY: heap storage of a Vec does not move when the Vec does.
unsafe impl IoBuf for Vec<u8> {
    fn io_ptr(&self) -> *const u8 {
        self.as_ptr()
    }
    fn io_len(&self) -> usize {
        self.len()
    }
}

// SAFETY: as its IoBuf impl; the bytes are writable through `&mut self`.
unsafe impl IoBufMut for Vec<u8> {
    fn io_mut_ptr(&mut self) -> *mut u8 {
        self.as_mut_ptr()
    }
}
// SAFETY: as for Vec.
unsafe impl IoBuf for Box<[u8]> {
    fn io_ptr(&self) -> *const u8 {
        self.as_ptr()
    }
    fn io_len(&self) -> usize {
        self.len()
    }
}

// SAFETY: as its IoBuf impl; the bytes are writable through `&mut self`.
unsafe impl IoBufMut for Box<[u8]> {
    fn io_mut_ptr(&mut self) -> *mut u8 {
        self.as_mut_ptr()
    }
}
// SAFETY: AlignedBuf owns a fixed heap allocation.
unsafe impl IoBuf for crate::buffer::AlignedBuf {
    fn io_ptr(&self) -> *const u8 {
        self.as_ptr()
    }
    fn io_len(&self) -> usize {
        self.len()
    }
}

// SAFETY: as its IoBuf impl; the bytes are writable through `&mut self`.
unsafe impl IoBufMut for crate::buffer::AlignedBuf {
    fn io_mut_ptr(&mut self) -> *mut u8 {
        self.as_mut_ptr()
    }
}
// SAFETY: static memory never moves.
unsafe impl IoBuf for &'static [u8] {
    fn io_ptr(&self) -> *const u8 {
        self.as_ptr()
    }
    fn io_len(&self) -> usize {
        self.len()
    }
}

/// Completion state shared by a ticket and the engine.
#[derive(Default)]
pub(crate) struct Completion {
    state: Mutex<CompletionState>,
    done: Condvar,
    /// A get: the length of the object version it reads, fixed when it starts (the bytes come
    /// from that same version). None for a put.
    object_len_bytes: Option<u64>,
}

#[derive(Default)]
struct CompletionState {
    result: Option<Result<()>>,
    /// Threads blocked in `wait`: finishing wakes the condvar only when there are some, since a
    /// wake is a system call and most ops finish before anyone waits (or are polled).
    waiters: usize,
    /// Told when the op finishes (`Ticket::signal_when_done`).
    signal: Option<Arc<DoneSignal>>,
}

/// Lets one thread wait until any of many tickets finishes, instead of on one of them: each
/// ticket registered with [`Ticket::signal_when_done`] bumps the count when its op finishes.
/// A caller that keeps ops of different latencies in flight (gets and puts) then refills a
/// finished slot at once rather than when its oldest op is done.
#[derive(Default)]
pub struct DoneSignal {
    finished: Mutex<u64>,
    changed: Condvar,
}

impl DoneSignal {
    /// Ops finished so far among the registered tickets.
    pub fn finished(&self) -> u64 {
        *self.finished.lock().expect("done signal")
    }

    /// Waits until more than `seen` registered ops have finished; returns how many have.
    pub fn wait_past(&self, seen: u64) -> u64 {
        let guard = self.finished.lock().expect("done signal");
        *self.changed.wait_while(guard, |n| *n <= seen).expect("done signal")
    }

    fn bump(&self) {
        *self.finished.lock().expect("done signal") += 1;
        self.changed.notify_all();
    }
}

impl Completion {
    /// The completion of a get of a version `object_len_bytes` long, or of a put (None).
    pub(crate) fn new(object_len_bytes: Option<u64>) -> Completion {
        Completion { object_len_bytes, ..Completion::default() }
    }

    pub(crate) fn finish(&self, result: Result<()>) {
        let mut state = self.state.lock().expect("completion");
        debug_assert!(state.result.is_none(), "op finished twice");
        state.result = Some(result);
        let wake = state.waiters > 0;
        let signal = state.signal.take();
        drop(state);
        if wake {
            self.done.notify_all();
        }
        if let Some(signal) = signal {
            signal.bump();
        }
    }
    pub(crate) fn is_done(&self) -> bool {
        self.state.lock().expect("completion").result.is_some()
    }
    pub(crate) fn wait(&self) -> Result<()> {
        let mut state = self.state.lock().expect("completion");
        state.waiters += 1;
        let result = loop {
            if let Some(r) = state.result.as_ref() {
                break r.clone();
            }
            state = self.done.wait(state).expect("completion");
        };
        state.waiters -= 1;
        result
    }
    pub(crate) fn wait_timeout(&self, timeout: Duration) -> Option<Result<()>> {
        let mut state = self.state.lock().expect("completion");
        state.waiters += 1;
        let (mut state, _) = self.done.wait_timeout_while(state, timeout, |s| s.result.is_none()).expect("completion");
        state.waiters -= 1;
        state.result.clone()
    }
}

/// The handle of an asynchronous put or get. It holds the buffer until the op is done; dropping
/// an unfinished ticket waits for the op (the buffer must outlive the I/O).
#[must_use = "a ticket must be waited on to learn whether the op succeeded"]
pub struct Ticket<B = ()> {
    pub(crate) completion: Arc<Completion>,
    pub(crate) buffer: Option<B>,
}

impl<B> Ticket<B> {
    /// Waits for the op; returns the buffer (filled, for a get) or the op's error.
    pub fn wait(mut self) -> Result<B> {
        let result = self.completion.wait();
        let buffer = self.buffer.take().expect("ticket buffer taken once");
        result.map(|()| buffer)
    }

    /// Like [`Ticket::wait`], but hands the buffer back whatever the outcome.
    pub fn wait_with_buffer(mut self) -> (Result<()>, B) {
        let result = self.completion.wait();
        (result, self.buffer.take().expect("ticket buffer taken once"))
    }

    /// Whether the op has finished (successfully or not); never blocks.
    pub fn is_done(&self) -> bool {
        self.completion.is_done()
    }

    /// A get: the length of the object version it reads. The get pins that version when it
    /// starts (its extents are not reused until the get is done), so the bytes it returns are
    /// all of that version even if the object is replaced or deleted meanwhile; a whole-object
    /// get into a longer buffer filled this many bytes. None for a put.
    pub fn object_len_bytes(&self) -> Option<u64> {
        self.completion.object_len_bytes
    }

    /// Bumps `signal` when the op finishes (at once if it already has).
    pub fn signal_when_done(&self, signal: &Arc<DoneSignal>) {
        let mut state = self.completion.state.lock().expect("completion");
        if state.result.is_some() {
            drop(state);
            signal.bump();
        } else {
            state.signal = Some(signal.clone());
        }
    }

    /// Waits at most `timeout`; `None` if the op is still running.
    pub fn wait_timeout(&self, timeout: Duration) -> Option<Result<()>> {
        self.completion.wait_timeout(timeout)
    }
}

impl<B> Drop for Ticket<B> {
    fn drop(&mut self) {
        if self.buffer.is_some() {
            let _ = self.completion.wait();
        }
    }
}

/// Waits for every ticket; returns each op's outcome in order.
pub fn wait_all<B>(tickets: impl IntoIterator<Item = Ticket<B>>) -> Vec<Result<B>> {
    tickets.into_iter().map(Ticket::wait).collect()
}

/// Waits for every ticket and returns the first error, if any.
pub fn wait_all_ok<B>(tickets: impl IntoIterator<Item = Ticket<B>>) -> Result<Vec<B>> {
    let mut first_error: Option<Error> = None;
    let mut out = Vec::new();
    for r in wait_all(tickets) {
        match r {
            Ok(b) => out.push(b),
            Err(e) => {
                first_error.get_or_insert(e);
            }
        }
    }
    match first_error {
        Some(e) => Err(e),
        None => Ok(out),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ticket() -> Ticket<()> {
        Ticket { completion: Arc::new(Completion::default()), buffer: Some(()) }
    }

    #[test]
    fn a_done_signal_wakes_on_any_registered_ticket() {
        let signal = Arc::new(DoneSignal::default());
        let (slow, fast) = (ticket(), ticket());
        slow.signal_when_done(&signal);
        fast.signal_when_done(&signal);
        let fast_completion = fast.completion.clone();
        let waiter = std::thread::spawn({
            let signal = signal.clone();
            move || signal.wait_past(0)
        });
        // The younger op finishes first: the waiter wakes although the older one still runs.
        fast_completion.finish(Ok(()));
        assert_eq!(waiter.join().unwrap(), 1);
        assert!(fast.is_done() && !slow.is_done());
        slow.completion.finish(Err(Error::Closed));
        assert_eq!(signal.finished(), 2);
        // Registering an op that already finished counts it at once.
        let done = ticket();
        done.completion.finish(Ok(()));
        done.signal_when_done(&signal);
        assert_eq!(signal.wait_past(2), 3);
        drop((slow, fast, done));
    }
}
