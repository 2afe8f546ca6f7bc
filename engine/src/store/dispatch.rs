//! From ops to device requests: the dispatcher thread takes queued puts and gets (urgent lane
//! first, even in the middle of a large normal op), cuts them along the stripe map into device
//! requests, holds them to the in-flight byte budget, bounces what O_DIRECT cannot take straight
//! from the caller's memory, and hands the requests to the per-device queues.

use super::object::Object;
use super::ticket::Completion;
use super::Shared;
use crate::backend::IoKind;
use crate::buffer::BounceChunk;
use crate::error::{Error, Result};
use crate::layout::stripe::{Piece, StripeMap};
use crate::queue::{Priority, Request};
use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// Bytes of an op cut into requests in one go before the urgent lane is looked at again.
const DISPATCH_SLICE_BYTES: u64 = 64 << 20;
/// Ops up to this size are cut into requests on the caller's thread when nothing is queued
/// ahead of them, saving a thread hop per small op (4 KiB random reads live on this path).
const INLINE_DISPATCH_MAX_BYTES: u64 = 1 << 20;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum OpKind {
    Put,
    Get,
}

/// The object an op works on: a put owns its new object until commit; a get shares a committed one.
pub(crate) enum OpObject {
    Put(Mutex<Option<Object>>),
    Get(Arc<Object>),
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
    remaining: AtomicUsize,
    error: Mutex<Option<Error>>,
    pub completion: Arc<Completion>,
    /// Bit i set: device i was written (for the flush before commit).
    pub devices_written: AtomicU64,
    pub started: Instant,
    pub verify: bool,
}

impl Op {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        kind: OpKind,
        id: u64,
        priority: Priority,
        object: OpObject,
        user_ptr: usize,
        user_start: u64,
        user_end: u64,
        verify: bool,
    ) -> Self {
        Op {
            kind,
            id,
            priority,
            object,
            user_ptr,
            user_start,
            user_end,
            remaining: AtomicUsize::new(1),
            error: Mutex::new(None),
            completion: Arc::new(Completion::default()),
            devices_written: AtomicU64::new(0),
            started: Instant::now(),
            verify,
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
}

/// An op waiting in a lane, with how far it has been cut into requests.
pub(crate) struct PendingOp {
    pub op: Arc<Op>,
    /// Next block-aligned object offset to dispatch, and where to stop.
    pub cursor: u64,
    pub end: u64,
    /// Put only: checksums of the stripe units dispatched so far.
    pub unit_crcs: Vec<u32>,
}

/// Lanes and the in-flight byte budget, under one lock so that a completion can both free budget
/// and wake the dispatcher.
#[derive(Default)]
pub(crate) struct DispatchState {
    pub urgent: VecDeque<PendingOp>,
    pub normal: VecDeque<PendingOp>,
    pub inflight_bytes: u64,
    pub shutdown: bool,
}

impl Shared {
    fn budget_limit(&self, priority: Priority) -> u64 {
        match priority {
            Priority::Urgent => self.config.max_inflight_bytes,
            Priority::Normal => self.config.max_inflight_bytes / 8 * 7,
        }
    }

    /// Queues an op for the dispatcher, or dispatches a small one right here when no other op
    /// waits (it then cannot overtake anything, so priorities hold).
    pub(crate) fn enqueue(self: &Arc<Self>, op: Arc<Op>, start: u64, end: u64) {
        let mut pending = PendingOp { op, cursor: start, end, unit_crcs: Vec::new() };
        if end - start <= INLINE_DISPATCH_MAX_BYTES {
            let idle = {
                let st = self.dispatch.lock().expect("dispatch");
                st.urgent.is_empty() && st.normal.is_empty()
            };
            if idle && dispatch_slice(self, &mut pending, false) {
                finish_dispatch(self, &mut pending);
                return;
            }
        }
        let mut st = self.dispatch.lock().expect("dispatch");
        match pending.op.priority {
            Priority::Urgent => st.urgent.push_back(pending),
            Priority::Normal => st.normal.push_back(pending),
        }
        drop(st);
        self.dispatch_cv.notify_all();
    }

    fn release_budget(&self, bytes: u64) {
        let mut st = self.dispatch.lock().expect("dispatch");
        st.inflight_bytes -= bytes;
        drop(st);
        self.dispatch_cv.notify_all();
    }

    /// Takes `bytes` of budget for an op of `priority` if it is free now.
    fn try_acquire_budget(&self, bytes: u64, priority: Priority) -> bool {
        let mut st = self.dispatch.lock().expect("dispatch");
        if st.inflight_bytes + bytes <= self.budget_limit(priority) || st.inflight_bytes == 0 {
            st.inflight_bytes += bytes;
            return true;
        }
        false
    }

    /// Takes `bytes` of budget for an op of `priority`, waiting for completions to free it.
    /// Returns false (taking nothing) if a normal op must yield because urgent work arrived.
    /// NOTE: the caller must have handed every request it built to the queues first, or the
    /// budget it waits for may be held by its own unsubmitted requests.
    fn acquire_budget(&self, bytes: u64, priority: Priority) -> bool {
        let limit = self.budget_limit(priority);
        let mut st = self.dispatch.lock().expect("dispatch");
        loop {
            if st.inflight_bytes + bytes <= limit || st.inflight_bytes == 0 {
                st.inflight_bytes += bytes;
                return true;
            }
            if priority == Priority::Normal && !st.urgent.is_empty() {
                return false;
            }
            st = self.dispatch_cv.wait(st).expect("dispatch");
        }
    }

    /// Called once per finished request (and once when dispatch of the op ends).
    pub(crate) fn request_done(self: &Arc<Self>, op: &Arc<Op>) {
        if op.remaining.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.finalize(op);
        }
    }

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
            OpKind::Put => self.send_to_commit(op.clone()),
            OpKind::Get => {
                let result = if op.verify { self.verify_get(op) } else { Ok(()) };
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
        self.op_finished();
    }

    /// Checks the checksum of every stripe unit the get covered completely.
    fn verify_get(&self, op: &Op) -> Result<()> {
        let OpObject::Get(object) = &op.object else { unreachable!("verify on a get") };
        let r = &object.record;
        if r.unit_crcs.is_empty() {
            return Ok(());
        }
        let su = self.geometry.stripe_unit;
        let first_unit = op.user_start.div_ceil(su);
        for unit in first_unit..r.unit_crcs.len() as u64 {
            let (start, end) = (unit * su, ((unit + 1) * su).min(r.len_bytes));
            if end > op.user_end {
                break;
            }
            // SAFETY: [start, end) lies inside the caller's buffer, which the ticket keeps alive.
            let bytes = unsafe {
                std::slice::from_raw_parts(
                    (op.user_ptr + (start - op.user_start) as usize) as *const u8,
                    (end - start) as usize,
                )
            };
            if crc32c::crc32c(bytes) != r.unit_crcs[unit as usize] {
                let map = StripeMap::new(r, su, self.geometry.block_size, self.geometry.device_count);
                let mut at = None;
                map.for_each_piece(start..start + self.geometry.block_size, self.geometry.block_size, |p| {
                    at.get_or_insert((p.device, p.device_offset));
                });
                let (device, device_offset) = at.expect("a unit has a first block");
                return Err(Error::ChecksumMismatch { id: op.id, unit, device, device_offset });
            }
        }
        Ok(())
    }
}

/// The dispatcher thread's loop.
pub(crate) fn run_dispatcher(shared: Arc<Shared>) {
    loop {
        let mut pending = {
            let mut st = shared.dispatch.lock().expect("dispatch");
            loop {
                if let Some(p) = st.urgent.pop_front().or_else(|| st.normal.pop_front()) {
                    break p;
                }
                if st.shutdown {
                    return;
                }
                st = shared.dispatch_cv.wait(st).expect("dispatch");
            }
        };
        if dispatch_slice(&shared, &mut pending, true) {
            finish_dispatch(&shared, &mut pending);
        } else {
            let mut st = shared.dispatch.lock().expect("dispatch");
            match pending.op.priority {
                Priority::Urgent => st.urgent.push_front(pending),
                Priority::Normal => st.normal.push_front(pending),
            }
        }
    }
}

/// Called once an op is fully cut into requests: a put's checksums join its record, and the
/// dispatch's own hold on the op is released.
fn finish_dispatch(shared: &Arc<Shared>, pending: &mut PendingOp) {
    if let OpObject::Put(object) = &pending.op.object {
        if let Some(o) = object.lock().expect("put object").as_mut() {
            o.record.unit_crcs = std::mem::take(&mut pending.unit_crcs);
        }
    }
    shared.request_done(&pending.op);
}

/// Cuts up to one slice of `pending` into requests; true when the op is fully dispatched.
/// Without `may_block` it stops (returning false) where it would have to wait for budget or a
/// bounce chunk, so the caller's thread never blocks; the dispatcher thread goes on from there.
fn dispatch_slice(shared: &Arc<Shared>, pending: &mut PendingOp, may_block: bool) -> bool {
    let op = pending.op.clone();
    let g = &shared.geometry;
    let slice_end = pending.end.min(pending.cursor + DISPATCH_SLICE_BYTES);
    let mut pieces: Vec<Piece> = Vec::new();
    let max_piece = shared.pool.chunk_bytes() as u64;
    {
        let put_guard;
        let record = match &op.object {
            OpObject::Get(o) => &o.record,
            OpObject::Put(o) => {
                put_guard = o.lock().expect("put object");
                &put_guard.as_ref().expect("put object present while dispatching").record
            }
        };
        if pending.cursor < slice_end {
            StripeMap::new(record, g.stripe_unit, g.block_size, g.device_count).for_each_piece(
                pending.cursor..slice_end,
                max_piece,
                |p| pieces.push(p),
            );
        }
    }
    let mut per_device: Vec<Vec<Request>> = (0..g.device_count).map(|_| Vec::new()).collect();
    let flush = |per_device: &mut Vec<Vec<Request>>| {
        for (device, requests) in per_device.iter_mut().enumerate() {
            if !requests.is_empty() {
                shared.queues[device].submit(requests.drain(..));
            }
        }
    };
    for piece in pieces {
        if !shared.try_acquire_budget(piece.len, op.priority) {
            // Submit what was built before waiting: it holds budget and bounce chunks.
            flush(&mut per_device);
            if !may_block || !shared.acquire_budget(piece.len, op.priority) {
                pending.cursor = piece.object_offset;
                return false;
            }
        }
        let needs_bounce = !is_direct(shared, &op, piece);
        let chunk = if needs_bounce {
            match shared.pool.try_take() {
                Some(c) => Some(c),
                None if may_block => {
                    // Chunks come back as submitted requests finish: submit ours before waiting.
                    flush(&mut per_device);
                    Some(shared.pool.take())
                }
                None => {
                    shared.release_budget(piece.len);
                    flush(&mut per_device);
                    pending.cursor = piece.object_offset;
                    return false;
                }
            }
        } else {
            None
        };
        if op.kind == OpKind::Put && g.checksums && piece.object_offset % g.stripe_unit == 0 {
            pending.unit_crcs.push(unit_crc(&op, piece.unit, g.stripe_unit));
        }
        let request = build_request(shared, &op, piece, chunk);
        per_device[piece.device as usize].push(request);
        pending.cursor = piece.object_offset + piece.len;
    }
    flush(&mut per_device);
    pending.cursor = slice_end;
    slice_end == pending.end
}

/// crc32c of a stripe unit's true bytes, read from the caller's buffer of a put.
fn unit_crc(op: &Op, unit: u64, stripe_unit: u64) -> u32 {
    let start = unit * stripe_unit;
    let end = ((unit + 1) * stripe_unit).min(op.user_end);
    // SAFETY: a put's user range is the whole object, and the ticket keeps the buffer alive.
    let bytes =
        unsafe { std::slice::from_raw_parts((op.user_ptr + start as usize) as *const u8, (end - start) as usize) };
    crc32c::crc32c(bytes)
}

struct SendPtr(*mut u8);
// SAFETY: the pointee is owned by the op or the bounce pool for the request's lifetime.
unsafe impl Send for SendPtr {}

/// Whether a piece can go straight from/to the caller's memory: it covers the piece and is
/// aligned for O_DIRECT.
fn is_direct(shared: &Shared, op: &Op, piece: Piece) -> bool {
    let block = shared.geometry.block_size as usize;
    piece.object_offset >= op.user_start
        && piece.object_offset + piece.len <= op.user_end
        && (op.user_ptr + (piece.object_offset - op.user_start) as usize).is_multiple_of(block)
}

/// Builds the device request for one piece: straight from/to the caller's memory where
/// `is_direct`, else through `chunk`.
fn build_request(shared: &Arc<Shared>, op: &Arc<Op>, piece: Piece, chunk: Option<BounceChunk>) -> Request {
    let (piece_start, piece_end) = (piece.object_offset, piece.object_offset + piece.len);
    let (overlap_start, overlap_end) = (piece_start.max(op.user_start), piece_end.min(op.user_end));
    let user_at = |object_offset: u64| op.user_ptr + (object_offset - op.user_start) as usize;
    let kind = match op.kind {
        OpKind::Put => IoKind::Write,
        OpKind::Get => IoKind::Read,
    };
    if kind == IoKind::Write {
        op.devices_written.fetch_or(1u64 << piece.device, Ordering::Relaxed);
    }
    op.remaining.fetch_add(1, Ordering::AcqRel);

    let mut bounce: Option<BounceChunk> = None;
    let mut copy_out: Option<(SendPtr, usize, usize)> = None; // (destination, chunk offset, length)
    let buf = if let Some(chunk) = chunk {
        let overlap_len = overlap_end.saturating_sub(overlap_start) as usize;
        let in_chunk = overlap_start.saturating_sub(piece_start) as usize;
        match op.kind {
            OpKind::Put => {
                // SAFETY: the chunk is ours and at least piece.len long; the source lies in the
                // caller's buffer (a put covers the whole object).
                unsafe {
                    std::ptr::write_bytes(chunk.ptr, 0, piece.len as usize);
                    if overlap_len > 0 {
                        std::ptr::copy_nonoverlapping(
                            user_at(overlap_start) as *const u8,
                            chunk.ptr.add(in_chunk),
                            overlap_len,
                        );
                    }
                }
            }
            OpKind::Get => copy_out = Some((SendPtr(user_at(overlap_start) as *mut u8), in_chunk, overlap_len)),
        }
        let ptr = chunk.ptr;
        bounce = Some(chunk);
        ptr
    } else {
        user_at(piece_start) as *mut u8
    };

    let shared_done = shared.clone();
    let op_done = op.clone();
    let (device, device_offset, len) = (piece.device, piece.device_offset, piece.len);
    Request {
        kind,
        offset: piece.device_offset,
        buf,
        len: piece.len as u32,
        fixed_index: None,
        priority: op.priority,
        on_complete: Box::new(move |result| {
            if let (Ok(()), Some((dst, at, n)), Some(chunk)) = (&result, &copy_out, &bounce) {
                // SAFETY: the read filled the chunk; dst lies inside the caller's buffer.
                unsafe { std::ptr::copy_nonoverlapping(chunk.ptr.add(*at), dst.0, *n) };
            }
            if let Some(chunk) = bounce {
                shared_done.pool.put(chunk);
            }
            shared_done.release_budget(len);
            if let Err(source) = result {
                op_done.set_error(Error::DeviceIo {
                    device,
                    path: shared_done.devices[device as usize].path.clone(),
                    op: kind.name(),
                    offset: device_offset,
                    source,
                });
            }
            shared_done.request_done(&op_done);
        }),
    }
}
