//! From ops to device requests: the dispatcher thread takes queued puts and gets (urgent lane
//! first, even in the middle of a large normal op), cuts them along the stripe map into device
//! requests, holds them to the in-flight byte budget, bounces what O_DIRECT cannot take straight
//! from the caller's memory, and hands the requests to the per-device queues.
//!
//! GPU ops (caller memory on a CUDA device) take one of two ways per piece: through a pinned
//! bounce chunk with the host<->device copy on the GPU's copy engine (put: copy, then disk write;
//! get: disk read, then copy), or, on the cuFile path, straight to the cuFile queue of the device
//! with the GPU address as the buffer. Partial blocks (object tail, unaligned range ends) always
//! bounce: cuFile must never touch GPU bytes outside the caller's range.

use super::object::Object;
use super::ticket::Completion;
use super::Shared;
use crate::backend::IoKind;
use crate::buffer::BounceChunk;
use crate::error::{Error, Result};
use crate::gpu::copy::CopyDirection;
use crate::gpu::handoff::HandoffSlot;
use crate::gpu::runtime::GpuDevice;
use crate::layout::stripe::{Piece, StripeMap};
use crate::layout::table::ObjectRecord;
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
    pub handoff_signalled: std::sync::atomic::AtomicBool,
}

impl GpuOp {
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
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        kind: OpKind,
        id: u64,
        priority: Priority,
        object: OpObject,
        user_ptr: usize,
        user_start: u64,
        user_end: u64,
        take_crcs: bool,
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
            piece_crcs: take_crcs.then(|| Mutex::new(Vec::new())),
            checked: (user_start, user_end),
            gpu: None,
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
    unsafe fn take_piece_crc(&self, piece: Piece, bytes: *const u8) {
        if let Some(crcs) = &self.piece_crcs {
            let len = (piece.object_offset + piece.len).min(self.object_len()).saturating_sub(piece.object_offset);
            // SAFETY: forwarded contract.
            let crc = crc32c::crc32c(unsafe { std::slice::from_raw_parts(bytes, len as usize) });
            crcs.lock().expect("piece crcs").push((piece.object_offset, len, crc));
        }
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
    /// Threads asleep on `dispatch_cv`: completions and new ops wake it only when this is
    /// non-zero, since a wake is a system call on every request otherwise.
    pub sleepers: usize,
}

impl DispatchState {
    /// Sleeps on `cv`, counted in `sleepers`.
    fn sleep<'a>(
        mut guard: std::sync::MutexGuard<'a, DispatchState>,
        cv: &std::sync::Condvar,
    ) -> std::sync::MutexGuard<'a, DispatchState> {
        guard.sleepers += 1;
        let mut guard = cv.wait(guard).expect("dispatch");
        guard.sleepers -= 1;
        guard
    }
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
        let wake = st.sleepers > 0;
        drop(st);
        if wake {
            self.dispatch_cv.notify_all();
        }
    }

    fn release_budget(&self, bytes: u64) {
        let mut st = self.dispatch.lock().expect("dispatch");
        st.inflight_bytes -= bytes;
        let wake = st.sleepers > 0;
        drop(st);
        if wake {
            self.dispatch_cv.notify_all();
        }
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
            st = DispatchState::sleep(st, &self.dispatch_cv);
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

    /// A verified get: the checksum of every stripe unit in its checked range (see
    /// `Store::get_span`), combined from the crcs its pieces took as they arrived, against the
    /// record's.
    fn verify_get(&self, op: &Op, crcs: &Mutex<Vec<(u64, u64, u32)>>) -> Result<()> {
        let OpObject::Get(object) = &op.object else { unreachable!("verify on a get") };
        let r = &object.record;
        let su = self.geometry.stripe_unit;
        let pieces = std::mem::take(&mut *crcs.lock().expect("piece crcs"));
        let (start, end) = op.checked;
        let units = unit_crcs_from_pieces(pieces, su, r.len_bytes, start, end);
        debug_assert_eq!(units.len() as u64, end.div_ceil(su) - start / su, "every checked unit was read whole");
        for (unit, crc) in units {
            if r.unit_crcs[unit as usize] != crc {
                let (device, device_offset) = self.unit_location(r, unit);
                return Err(Error::ChecksumMismatch { id: op.id, unit, device, device_offset });
            }
        }
        Ok(())
    }

    /// Where stripe unit `unit` of an object starts on disk: (device, byte offset).
    fn unit_location(&self, r: &ObjectRecord, unit: u64) -> (u16, u64) {
        let (su, block) = (self.geometry.stripe_unit, self.geometry.block_size);
        let mut at = None;
        StripeMap::new(r, su, block, self.geometry.device_count).for_each_piece(
            unit * su..unit * su + block,
            block,
            |p| {
                at.get_or_insert((p.device, p.device_offset));
            },
        );
        at.expect("a unit has a first block")
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
            // After the ticket is done, so a stream that passed the hand-off finds `is_done`.
            gpu.signal_handoff();
        }
        self.op_finished();
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
                st = DispatchState::sleep(st, &shared.dispatch_cv);
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
    // Requests for the devices' host-memory queues, and (GPU ops on the cuFile path) for their
    // cuFile queues: index device_count + d.
    let queue_count = g.device_count as usize * if op.gpu.is_some() { 2 } else { 1 };
    let mut per_device: Vec<Vec<Request>> = (0..queue_count).map(|_| Vec::new()).collect();
    let gpu_state = shared.gpu.get().and_then(|r| r.as_ref().ok());
    let flush = |per_device: &mut Vec<Vec<Request>>| {
        for (queue, requests) in per_device.iter_mut().enumerate() {
            if requests.is_empty() {
                continue;
            }
            match queue.checked_sub(g.device_count as usize) {
                None => shared.queues[queue].submit(requests.drain(..)),
                Some(device) => gpu_state.expect("cuFile requests only with GPU state").cufile_queues[device]
                    .submit(requests.drain(..)),
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
        let needs_bounce = match &op.gpu {
            None => !is_direct(shared, &op, piece),
            Some(gpu) => !(gpu.use_cufile && covers(&op, piece)),
        };
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
        match (&op.gpu, chunk) {
            (None, chunk) => {
                if op.kind == OpKind::Put && g.checksums && piece.object_offset % g.stripe_unit == 0 {
                    pending.unit_crcs.push(unit_crc(&op, piece.unit, g.stripe_unit));
                }
                let request = build_request(shared, &op, piece, chunk);
                per_device[piece.device as usize].push(request);
            }
            (Some(_), None) => {
                let request = build_cufile_request(shared, &op, piece);
                per_device[g.device_count as usize + piece.device as usize].push(request);
            }
            (Some(gpu), Some(chunk)) => {
                if let Some(request) = build_gpu_bounce(shared, &op, gpu, piece, chunk) {
                    per_device[piece.device as usize].push(request);
                }
            }
        }
        pending.cursor = piece.object_offset + piece.len;
    }
    flush(&mut per_device);
    pending.cursor = slice_end;
    slice_end == pending.end
}

/// Whether the caller's range covers the whole piece.
fn covers(op: &Op, piece: Piece) -> bool {
    piece.object_offset >= op.user_start && piece.object_offset + piece.len <= op.user_end
}

/// Per stripe unit lying wholly in `[start, end)` (a unit ends at the next unit or at
/// `object_len`), the crc32c of its bytes, combined from the crcs of the pieces that tile it.
pub(crate) fn unit_crcs_from_pieces(
    mut pieces: Vec<(u64, u64, u32)>,
    stripe_unit: u64,
    object_len: u64,
    start: u64,
    end: u64,
) -> Vec<(u64, u32)> {
    pieces.sort_unstable_by_key(|p| p.0);
    let mut out = Vec::new();
    let mut current: Option<(u64, u64, u32)> = None; // (unit, bytes covered so far from the unit start, crc)
    for (offset, len, crc) in pieces {
        let unit = offset / stripe_unit;
        let unit_start = unit * stripe_unit;
        let unit_end = (unit_start + stripe_unit).min(object_len);
        if unit_start < start || unit_end > end {
            continue;
        }
        current = match current {
            Some((u, covered, c)) if u == unit && unit_start + covered == offset => {
                Some((u, covered + len, crc32c::crc32c_combine(c, crc, len as usize)))
            }
            _ if offset == unit_start => Some((unit, len, crc)),
            _ => None,
        };
        if let Some((u, covered, c)) = current {
            if unit_start + covered == unit_end {
                out.push((u, c));
                current = None;
            }
        }
    }
    out
}

/// What to do when a device request of an op finishes: give back its bounce chunk and budget,
/// record an error, count the request done.
#[allow(clippy::too_many_arguments)]
fn finish_device_request(
    shared: &Arc<Shared>,
    op: &Arc<Op>,
    chunk: Option<BounceChunk>,
    kind: IoKind,
    device: u16,
    device_offset: u64,
    len: u64,
    result: std::io::Result<()>,
) {
    if let Some(chunk) = chunk {
        shared.pool.put(chunk);
    }
    shared.release_budget(len);
    if let Err(source) = result {
        op.set_error(Error::DeviceIo {
            device,
            path: shared.devices[device as usize].path.clone(),
            op: kind.name(),
            offset: device_offset,
            source,
        });
    }
    shared.request_done(op);
}

/// A piece of a GPU op on the cuFile path: the device request's buffer is the GPU address.
fn build_cufile_request(shared: &Arc<Shared>, op: &Arc<Op>, piece: Piece) -> Request {
    let kind = if op.kind == OpKind::Put { IoKind::Write } else { IoKind::Read };
    if kind == IoKind::Write {
        op.devices_written.fetch_or(1u64 << piece.device, Ordering::Relaxed);
    }
    op.remaining.fetch_add(1, Ordering::AcqRel);
    let device_address = op.user_ptr as u64 + (piece.object_offset - op.user_start);
    let (s, o) = (shared.clone(), op.clone());
    let (device, device_offset, len) = (piece.device, piece.device_offset, piece.len);
    Request {
        kind,
        offset: piece.device_offset,
        buf: device_address as usize as *mut u8,
        len: piece.len as u32,
        fixed_index: None,
        priority: op.priority,
        on_complete: Box::new(move |result| {
            finish_device_request(&s, &o, None, kind, device, device_offset, len, result)
        }),
    }
}

/// A piece of a GPU op through a pinned bounce chunk. A get returns its disk read, whose
/// completion queues the host->device copy. A put zero-fills the chunk's padding and queues the
/// device->host copy now; the copy's completion submits the disk write, so it returns None.
fn build_gpu_bounce(
    shared: &Arc<Shared>,
    op: &Arc<Op>,
    gpu: &GpuOp,
    piece: Piece,
    chunk: BounceChunk,
) -> Option<Request> {
    let (piece_start, piece_end) = (piece.object_offset, piece.object_offset + piece.len);
    let (overlap_start, overlap_end) = (piece_start.max(op.user_start), piece_end.min(op.user_end));
    let overlap_len = overlap_end.saturating_sub(overlap_start) as usize;
    let in_chunk = overlap_start.saturating_sub(piece_start) as usize;
    let device_address = op.user_ptr as u64 + (overlap_start.max(op.user_start) - op.user_start);
    let (device, device_offset, len) = (piece.device, piece.device_offset, piece.len);
    let priority = op.priority;
    op.remaining.fetch_add(1, Ordering::AcqRel);
    let copy_engine = gpu.device.clone();
    let chunk_ptr = SendPtr(chunk.ptr);
    let chunk_host = chunk.ptr;
    match op.kind {
        OpKind::Put => {
            op.devices_written.fetch_or(1u64 << piece.device, Ordering::Relaxed);
            // SAFETY: the chunk is ours and at least piece.len long.
            unsafe {
                std::ptr::write_bytes(chunk.ptr, 0, in_chunk);
                std::ptr::write_bytes(
                    chunk.ptr.add(in_chunk + overlap_len),
                    0,
                    piece.len as usize - in_chunk - overlap_len,
                );
            }
            let (s, o) = (shared.clone(), op.clone());
            let then: crate::gpu::copy::AfterCopy = Box::new(move |copied: Result<()>| {
                let chunk_ptr = chunk_ptr;
                if let Err(e) = copied {
                    o.set_error(e);
                    s.pool.put(chunk);
                    s.release_budget(len);
                    s.request_done(&o);
                    return;
                }
                // SAFETY: the copy filled the piece's bytes (a put covers the whole object).
                unsafe { o.take_piece_crc(piece, chunk_ptr.0) };
                let (s2, o2) = (s.clone(), o.clone());
                let request = Request {
                    kind: IoKind::Write,
                    offset: device_offset,
                    buf: chunk_ptr.0,
                    len: len as u32,
                    fixed_index: None,
                    priority,
                    on_complete: Box::new(move |result| {
                        finish_device_request(&s2, &o2, Some(chunk), IoKind::Write, device, device_offset, len, result)
                    }),
                };
                s.queues[device as usize].submit(std::iter::once(request));
            });
            if overlap_len == 0 {
                then(Ok(()));
            } else {
                // SAFETY: the chunk is pinned (the slab) and held until `then` runs; the device
                // range lies in the caller's buffer, which the ticket keeps alive.
                unsafe {
                    copy_engine.copy.copy(
                        CopyDirection::DeviceToHost,
                        chunk_host.add(in_chunk),
                        device_address,
                        overlap_len,
                        then,
                    )
                };
            }
            None
        }
        OpKind::Get => {
            let (s, o) = (shared.clone(), op.clone());
            let buf = chunk.ptr;
            Some(Request {
                kind: IoKind::Read,
                offset: device_offset,
                buf,
                len: len as u32,
                fixed_index: None,
                priority,
                on_complete: Box::new(move |result| {
                    let chunk_ptr = chunk_ptr;
                    if result.is_err() {
                        finish_device_request(&s, &o, Some(chunk), IoKind::Read, device, device_offset, len, result);
                        return;
                    }
                    // SAFETY: the read filled the chunk, while it is still hot in cache.
                    unsafe { o.take_piece_crc(piece, chunk_ptr.0) };
                    let (s2, o2) = (s.clone(), o.clone());
                    let then: crate::gpu::copy::AfterCopy = Box::new(move |copied: Result<()>| {
                        if let Err(e) = copied {
                            o2.set_error(e);
                        }
                        finish_device_request(&s2, &o2, Some(chunk), IoKind::Read, device, device_offset, len, Ok(()));
                    });
                    if overlap_len == 0 {
                        // Read only to verify its stripe unit (outside the caller's range).
                        then(Ok(()));
                        return;
                    }
                    // SAFETY: the chunk is pinned and held until `then` runs; the destination lies
                    // in the caller's buffer, which the ticket keeps alive.
                    unsafe {
                        copy_engine.copy.copy(
                            CopyDirection::HostToDevice,
                            chunk_ptr.0.add(in_chunk),
                            device_address,
                            overlap_len,
                            then,
                        )
                    };
                }),
            })
        }
    }
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
            // Nothing to copy for a piece read only to verify its stripe unit.
            OpKind::Get if overlap_len > 0 => {
                copy_out = Some((SendPtr(user_at(overlap_start) as *mut u8), in_chunk, overlap_len))
            }
            OpKind::Get => {}
        }
        let ptr = chunk.ptr;
        bounce = Some(chunk);
        ptr
    } else {
        user_at(piece_start) as *mut u8
    };

    let shared_done = shared.clone();
    let op_done = op.clone();
    let buf_at = SendPtr(buf);
    let (device, device_offset, len) = (piece.device, piece.device_offset, piece.len);
    Request {
        kind,
        offset: piece.device_offset,
        buf,
        len: piece.len as u32,
        fixed_index: None,
        priority: op.priority,
        on_complete: Box::new(move |result| {
            let buf_at = buf_at;
            if result.is_ok() && op_done.kind == OpKind::Get {
                // SAFETY: the read filled `buf` with the piece, which is still hot in cache.
                unsafe { op_done.take_piece_crc(piece, buf_at.0) };
            }
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

#[cfg(test)]
mod tests {
    use super::unit_crcs_from_pieces;

    #[test]
    fn unit_crcs_combine_pieces_and_skip_partial_units() {
        let data: Vec<u8> = (0..10_000u32).map(|i| (i * 7 + 3) as u8).collect();
        let crc = |a: usize, b: usize| crc32c::crc32c(&data[a..b]);
        // Stripe unit 4096, object of 10_000 bytes cut into pieces of at most 1024 (shuffled).
        let mut pieces: Vec<(u64, u64, u32)> = (0..10_000usize)
            .step_by(1024)
            .map(|a| (a as u64, (10_000 - a).min(1024) as u64, crc(a, (a + 1024).min(10_000))))
            .collect();
        pieces.reverse();
        let all = unit_crcs_from_pieces(pieces.clone(), 4096, 10_000, 0, 10_000);
        assert_eq!(all, vec![(0, crc(0, 4096)), (1, crc(4096, 8192)), (2, crc(8192, 10_000))]);
        // A range that ends inside unit 2 and starts inside unit 0 checks unit 1 only.
        let inner: Vec<_> = pieces.into_iter().filter(|p| p.0 >= 1024 && p.0 + p.1 <= 9216).collect();
        assert_eq!(unit_crcs_from_pieces(inner, 4096, 10_000, 1024, 9216), vec![(1, crc(4096, 8192))]);
    }
}
