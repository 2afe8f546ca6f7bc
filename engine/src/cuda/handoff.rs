//! The stream hand-off: a caller's CUDA stream waits for a GPU op without blocking the CPU.
//!
//! Each GPU op takes a slot in a small array of 32-bit flags in pinned, device-mapped host memory
//! and a target value one above the slot's current value. When the op has finished (for a get:
//! after its last host->device copy has completed, or the last cuFile read has returned) the engine
//! stores the target into the slot. [`HandoffFlags::enqueue_wait`] puts
//! `cuStreamWaitValue32(flag >= target)` on the caller's stream, so work queued after it on that
//! stream starts only once the data is in place.
//!
//! Contract: the flag is set whether the op succeeded or failed (so a stream never hangs); the
//! caller learns the outcome from the ticket, and must not trust the data if it reports an error.
//! Values only grow, so a slot reused by a later op never releases a waiter early, and a waiter
//! enqueued after the op finished passes at once.
//!
//! The wait is enqueued only once the op's own GPU work is queued ([`Unissued`]): the caller's
//! thread waits on the host until then. CUDA does not see the order a `cuStreamWaitValue32`
//! sets up, and its documentation warns that work ordered by it may be serialized behind the
//! wait, a deadlock (e.g. a copy CUDA orders after the caller's stream, as synchronous copies are
//! after the legacy default stream). Waiting for work queued earlier only, the caller's stream
//! never holds up the copies that would release it.

use super::driver::{self as cuda, Context, DevicePtr, PinnedRegistration};
use crate::buffer::AlignedBuf;
use crate::error::{Error, Result};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Condvar, Mutex};

/// Flag slots per store and GPU: an op started while this many are in flight gets no slot, and
/// its `enqueue_stream_wait` returns an error saying so (never a silent no-op).
pub const HANDOFF_SLOTS: usize = 4096;

pub struct HandoffFlags {
    ctx: &'static Context,
    // Declared before `memory`: unregistered before the memory is freed.
    registration: PinnedRegistration,
    memory: AlignedBuf,
    device_base: DevicePtr,
    free: Mutex<Vec<u32>>,
}

/// One op's claim on a flag slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HandoffSlot {
    pub index: u32,
    pub target: u32,
}

impl HandoffFlags {
    pub fn new(ctx: &'static Context) -> Result<HandoffFlags> {
        let mut memory = AlignedBuf::new(HANDOFF_SLOTS * 4, 4096)?;
        // SAFETY: `memory` lives in the same struct and is dropped after the registration.
        let registration = unsafe { PinnedRegistration::new(ctx, memory.as_mut_ptr(), memory.len())? };
        let device_base = registration.device_address(ctx, memory.as_mut_ptr())?;
        Ok(HandoffFlags {
            ctx,
            registration,
            memory,
            device_base,
            free: Mutex::new((0..HANDOFF_SLOTS as u32).rev().collect()),
        })
    }

    fn word(&self, index: u32) -> &AtomicU32 {
        assert!((index as usize) < HANDOFF_SLOTS);
        // SAFETY: 4-byte aligned words inside our allocation, only accessed atomically.
        unsafe { &*(self.memory.as_ptr().add(index as usize * 4) as *const AtomicU32) }
    }

    /// A slot for a new op, or None when all are taken (that op then has no hand-off).
    pub fn claim(&self) -> Option<HandoffSlot> {
        let index = self.free.lock().expect("handoff").pop()?;
        let target = self.word(index).load(Ordering::Acquire).wrapping_add(1).max(1);
        Some(HandoffSlot { index, target })
    }

    /// Marks the op done: releases stream waiters, then frees the slot.
    pub fn signal(&self, slot: HandoffSlot) {
        self.word(slot.index).store(slot.target, Ordering::Release);
        self.free.lock().expect("handoff").push(slot.index);
    }

    /// Makes `stream` (a `CUstream` of this device's primary context, or null for the legacy
    /// default stream) wait until the op of `slot` has finished.
    ///
    /// # Safety
    /// `stream` must be a live stream of this device's primary context.
    pub unsafe fn enqueue_wait(&self, slot: HandoffSlot, stream: cudarc::driver::sys::CUstream) -> Result<()> {
        let _ = &self.registration;
        self.ctx.make_current()?;
        let addr = self.device_base + slot.index as u64 * 4;
        // SAFETY: forwarded contract; the flags stay mapped for the store's life.
        unsafe { cuda::stream_wait_value_geq(stream, addr, slot.target) }
    }

    /// Whether the op of `slot` has finished, as the flag says.
    pub fn is_set(&self, slot: HandoffSlot) -> bool {
        self.word(slot.index).load(Ordering::Acquire).wrapping_sub(slot.target) < u32::MAX / 2
    }
}

impl std::fmt::Debug for HandoffFlags {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "HandoffFlags(device {})", self.ctx.ordinal)
    }
}

/// The error for a hand-off that cannot be had.
pub(crate) fn no_handoff(why: &str) -> Error {
    Error::InvalidConfig(format!("no stream hand-off for this op: {why}"))
}

/// The GPU work of one op that is not queued yet: the op's dispatch, and each piece whose copy
/// (bounce path) or cuFile call (cuFile path) is still to come. A stream wait for the op is
/// enqueued only once nothing is left ([`Unissued::wait`]).
#[derive(Debug)]
pub(crate) struct Unissued {
    left: Mutex<usize>,
    none_left: Condvar,
}

/// One claim on an op's [`Unissued`] work, given back when dropped.
#[derive(Debug)]
pub(crate) struct IssueHold(Arc<Unissued>);

impl Unissued {
    /// The work of a new op, and the hold of its dispatch (dropped once the op is cut into
    /// requests, or finished without them).
    pub fn new() -> (Arc<Unissued>, IssueHold) {
        let unissued = Arc::new(Unissued { left: Mutex::new(1), none_left: Condvar::new() });
        (unissued.clone(), IssueHold(unissued))
    }

    /// A claim for more work of the op, held until that work is queued.
    pub fn hold(self: &Arc<Self>) -> IssueHold {
        let mut left = self.left.lock().expect("unissued");
        assert!(*left > 0, "work is added only while the op's dispatch or a piece holds it");
        *left += 1;
        IssueHold(self.clone())
    }

    /// Waits until all of the op's GPU work is queued.
    pub fn wait(&self) {
        let left = self.left.lock().expect("unissued");
        drop(self.none_left.wait_while(left, |n| *n > 0).expect("unissued"));
    }

    /// Whether all of the op's GPU work is queued; never blocks.
    pub fn is_issued(&self) -> bool {
        *self.left.lock().expect("unissued") == 0
    }
}

impl Drop for IssueHold {
    fn drop(&mut self) {
        let mut left = self.0.left.lock().expect("unissued");
        assert!(*left > 0, "each hold is given back once");
        *left -= 1;
        if *left == 0 {
            self.0.none_left.notify_all();
        }
    }
}

/// What a ticket keeps of its op's hand-off: the flag slot and the work to wait for first.
#[derive(Debug, Clone)]
pub(crate) struct Handoff {
    pub flags: Arc<HandoffFlags>,
    pub slot: HandoffSlot,
    pub unissued: Arc<Unissued>,
}

#[cfg(test)]
mod tests {
    use super::Unissued;

    /// A stream wait goes ahead only once the dispatch and every piece have let go, whichever
    /// order they do it in (no CUDA needed: the count is host state).
    #[test]
    fn unissued_work_is_waited_for_until_every_hold_is_dropped() {
        let (unissued, dispatching) = Unissued::new();
        let piece = unissued.hold();
        let other = unissued.hold();
        drop(dispatching);
        assert!(!unissued.is_issued(), "two pieces still hold work back");
        let waiter = {
            let unissued = unissued.clone();
            std::thread::spawn(move || {
                unissued.wait();
                unissued.is_issued()
            })
        };
        drop(other);
        assert!(!unissued.is_issued(), "one piece still holds work back");
        drop(piece);
        assert!(waiter.join().unwrap(), "the wait returned before every hold was dropped");
        assert!(unissued.is_issued());
        unissued.wait(); // nothing left: returns at once
    }
}
