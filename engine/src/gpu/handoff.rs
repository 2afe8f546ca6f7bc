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

use super::cuda::{self, Context, DevicePtr, PinnedRegistration};
use crate::buffer::AlignedBuf;
use crate::error::{Error, Result};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Mutex;

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
