//! One put or get in flight, and its life on the `Shared` side: counted in at the API
//! (`op_started`), counted down once per finished request (`request_done`), then finalized: a put
//! goes to the commit thread, a get is verified and finished (`finish_op`).

use super::crcs::unit_crcs_from_pieces;
use super::object::Object;
use super::ticket::Completion;
use super::Shared;
use crate::cuda::gate::GateMark;
use crate::cuda::handoff::{HandoffSlot, IssueHold, Unissued};
use crate::error::{Error, Result};
use crate::layout::stripe::Piece;
use crate::queue::Priority;
use crate::store::gpu::runtime::GpuDevice;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum OpKind {
    Put,
    Get,
}

/// The object an op works on: a put owns its new object until commit; a get shares a committed
/// one. A get's share pins that version: its extents go back to the allocator only when the last
/// holder lets go (`Object`'s drop), so an overwrite or delete that lands meanwhile never has its
/// blocks reused under the read.
pub(crate) enum OpObject {
    Put(Mutex<Option<Object>>),
    Get(Arc<Object>),
}

/// Where the caller's bytes of an op are.
pub(crate) enum Target {
    /// Host memory at this address.
    Host(usize),
    /// CUDA device memory at this device address.
    Gpu { ptr: u64, gpu: GpuOp },
}

impl Target {
    fn address(&self) -> usize {
        match self {
            Target::Host(ptr) => *ptr,
            Target::Gpu { ptr, .. } => *ptr as usize,
        }
    }
}

/// What an op is, besides its object and the caller's memory.
pub(crate) struct OpSpec {
    pub kind: OpKind,
    pub id: u64,
    pub priority: Priority,
    /// The caller's memory holds object bytes `user_start..user_end`.
    pub user_start: u64,
    pub user_end: u64,
    /// Take the crc32c of every piece as it passes through host memory (`Op::piece_crcs`).
    pub take_crcs: bool,
    /// A verified get: the object bytes whose stripe units it checks (see `Store::get_span`).
    pub checked: (u64, u64),
}

/// One put or get in flight.
pub(crate) struct Op {
    pub kind: OpKind,
    pub id: u64,
    pub priority: Priority,
    pub object: OpObject,
    /// Caller memory: `user_ptr` holds object bytes `user_start..user_end`.
    pub user_ptr: usize,
    pub user_start: u64,
    pub user_end: u64,
    /// Requests not yet finished, plus one while the op is still being dispatched.
    pub(super) remaining: AtomicUsize,
    error: Mutex<Option<Error>>,
    pub completion: Arc<Completion>,
    /// Bit i set: device i was written (for the flush before commit).
    pub devices_written: AtomicU64,
    pub started: Instant,
    /// (object offset, bytes, crc32c) of each piece's true object bytes, taken as the piece passes
    /// through host memory: a verified get's check and a GPU put's stripe-unit checksums are
    /// built from these. None: no checksums are taken.
    pub piece_crcs: Option<Mutex<Vec<(u64, u64, u32)>>>,
    /// A verified get: the object bytes whose stripe units it checks (see `Store::get_span`).
    pub checked: (u64, u64),
    /// Set for ops on CUDA device memory (`user_ptr` is then a device address).
    pub gpu: Option<GpuOp>,
}

/// What a GPU op carries besides a host op's state.
pub(crate) struct GpuOp {
    pub device: Arc<GpuDevice>,
    /// Whole blocks go through cuFile (else every piece bounces).
    pub use_cufile: bool,
    pub handoff: Option<HandoffSlot>,
    pub handoff_signalled: AtomicBool,
    /// The op's GPU work not queued yet, which a stream wait for the op waits for first.
    pub unissued: Arc<Unissued>,
    /// The dispatch's hold on `unissued`, dropped once the op is cut into requests (`dispatched`).
    pub dispatching: Mutex<Option<IssueHold>>,
    /// The caller's event the op starts after, captured on the device's gate; taken when the op
    /// is queued (`Store::start`).
    pub after: Option<GateMark>,
}

impl GpuOp {
    /// The op is cut into requests (or finished without them): each piece holds its own work.
    pub fn dispatched(&self) {
        drop(self.dispatching.lock().expect("dispatch hold").take());
    }

    /// Sets the op's hand-off flag and frees its slot, once.
    pub fn signal_handoff(&self) {
        if let Some(slot) = self.handoff {
            if !self.handoff_signalled.swap(true, Ordering::AcqRel) {
                self.device.handoff.signal(slot);
            }
        }
    }
}

impl Drop for GpuOp {
    /// An op refused before it was queued (bad metadata, no space, store closed) still gives its
    /// hand-off slot back.
    fn drop(&mut self) {
        self.signal_handoff();
    }
}

impl Op {
    pub fn new(spec: OpSpec, object: OpObject, target: Target) -> Self {
        assert!(spec.user_start <= spec.user_end, "an op's range runs forwards");
        assert!(spec.checked.0 <= spec.checked.1, "an op's checked range runs forwards");
        let user_ptr = target.address();
        let version_len = match &object {
            OpObject::Get(o) => Some(o.record.len_bytes),
            OpObject::Put(_) => None,
        };
        let gpu = match target {
            Target::Host(_) => None,
            Target::Gpu { gpu, .. } => Some(gpu),
        };
        Op {
            kind: spec.kind,
            id: spec.id,
            priority: spec.priority,
            object,
            user_ptr,
            user_start: spec.user_start,
            user_end: spec.user_end,
            remaining: AtomicUsize::new(1),
            error: Mutex::new(None),
            completion: Arc::new(Completion::new(version_len)),
            devices_written: AtomicU64::new(0),
            started: Instant::now(),
            piece_crcs: spec.take_crcs.then(|| Mutex::new(Vec::new())),
            checked: spec.checked,
            gpu,
        }
    }

    pub fn set_error(&self, e: Error) {
        self.error.lock().expect("op error").get_or_insert(e);
    }

    pub fn take_error(&self) -> Option<Error> {
        self.error.lock().expect("op error").take()
    }

    pub fn bytes(&self) -> u64 {
        self.user_end - self.user_start
    }

    /// The object's length: a put's is its caller range, a get's is in its record.
    fn object_len(&self) -> u64 {
        match &self.object {
            OpObject::Get(o) => o.record.len_bytes,
            OpObject::Put(_) => self.user_end,
        }
    }

    /// Takes the checksum of a piece's true object bytes (those below the object's end) at
    /// `bytes`, where they now are in host memory, if this op takes checksums.
    ///
    /// # Safety
    /// `bytes` must be valid for reads of the piece's true bytes.
    pub(super) unsafe fn take_piece_crc(&self, piece: Piece, bytes: *const u8) {
        if let Some(crcs) = &self.piece_crcs {
            let len = (piece.object_offset + piece.len).min(self.object_len()).saturating_sub(piece.object_offset);
            // SAFETY: forwarded contract.
            let crc = crc32c::crc32c(unsafe { std::slice::from_raw_parts(bytes, len as usize) });
            crcs.lock().expect("piece crcs").push((piece.object_offset, len, crc));
        }
    }
}

impl Shared {
    /// Counts a new op in, unless the store is closing.
    pub(super) fn op_started(&self) -> Result<()> {
        let mut n = self.ops_outstanding.lock().expect("ops");
        if self.closed.load(Ordering::Acquire) {
            return Err(Error::Closed);
        }
        *n += 1;
        Ok(())
    }

    /// Counts an op out (finished, or refused after `op_started`).
    pub(crate) fn op_finished(&self) {
        let mut n = self.ops_outstanding.lock().expect("ops");
        assert!(*n > 0, "an op finishes once, after it started");
        *n -= 1;
        // Only `close` waits for this (it sets `closed` under the same lock first).
        if *n == 0 && self.closed.load(Ordering::Acquire) {
            self.ops_idle.notify_all();
        }
    }

    /// Called once per finished request (and once when dispatch of the op ends).
    pub(crate) fn request_done(self: &Arc<Self>, op: &Arc<Op>) {
        let before = op.remaining.fetch_sub(1, Ordering::AcqRel);
        assert!(before > 0, "op {}: more requests finished than were counted", op.id);
        if before == 1 {
            self.finalize(op);
        }
    }

    /// Every request of `op` is done: a failed op is finished (a put's new extents go back), a
    /// put goes on to the commit thread, a get is checked against its checksums.
    fn finalize(self: &Arc<Self>, op: &Arc<Op>) {
        if let Some(e) = op.take_error() {
            if let OpObject::Put(object) = &op.object {
                // Never committed: dropping it returns its extents.
                object.lock().expect("put object").take();
            }
            self.finish_op(op, Err(e));
            return;
        }
        match op.kind {
            OpKind::Put => {
                if let (Some(crcs), OpObject::Put(object)) = (&op.piece_crcs, &op.object) {
                    // A GPU put's bytes were on the host only in its bounce chunks.
                    let pieces = std::mem::take(&mut *crcs.lock().expect("piece crcs"));
                    let su = self.geometry.stripe_unit;
                    let units = unit_crcs_from_pieces(pieces, su, op.user_end, 0, op.user_end);
                    if let Some(o) = object.lock().expect("put object").as_mut() {
                        o.record.unit_crcs = units.into_iter().map(|(_, crc)| crc).collect();
                    }
                }
                self.send_to_commit(op.clone())
            }
            OpKind::Get => {
                let result = match &op.piece_crcs {
                    Some(crcs) => self.verify_get(op, crcs),
                    None => Ok(()),
                };
                self.finish_op(op, result);
            }
        }
    }

    /// Completes an op: wakes its ticket and updates the counters.
    pub(crate) fn finish_op(&self, op: &Op, result: Result<()>) {
        {
            let mut c = self.op_counters.lock().expect("op counters");
            match (&result, op.kind) {
                (Err(_), _) => c.failed += 1,
                (Ok(()), OpKind::Put) => {
                    c.puts += 1;
                    c.put_bytes += op.bytes();
                    c.put_latency.record(op.started.elapsed());
                }
                (Ok(()), OpKind::Get) => {
                    c.gets += 1;
                    c.get_bytes += op.bytes();
                    c.get_latency.record(op.started.elapsed());
                }
            }
        }
        op.completion.finish(result);
        if let Some(gpu) = &op.gpu {
            // An op refused before its dispatch ended holds no work back.
            gpu.dispatched();
            // After the ticket is done, so a stream that passed the hand-off finds `is_done`.
            gpu.signal_handoff();
        }
        self.op_finished();
    }
}
