//! A piece of a GPU op through a pinned bounce chunk, each step a plain function that hands the
//! piece to the next: a put zero-fills the chunk's padding, queues the device->host copy
//! (`start_put`), and once it is done submits the disk write to the device's queue
//! (`after_put_copy`); a get's disk read (`get_request`) completes into `after_get_read`, which
//! has the piece checked and its host->device copy queued (`copy_to_gpu`, on a verify thread when
//! the piece is checked), whose completion (`after_get_copy`) finishes the piece. Copies
//! run on the engine's streams and complete on the copy engine's waiter thread (`cuda::copy`).

use super::PieceIo;
use crate::buffer::BounceChunk;
use crate::cuda::copy::CopyDirection;
use crate::error::Result;
use crate::layout::stripe::Piece;
use crate::queue::Request;
use crate::store::op::Op;
use crate::store::Shared;
use std::io;
use std::sync::Arc;

/// Starts a put's piece: the caller's bytes are copied into `chunk`, then written.
pub(in crate::store::dispatch) fn start_put(shared: &Arc<Shared>, op: &Arc<Op>, piece: Piece, chunk: BounceChunk) {
    let mut io = PieceIo::new(shared, op, piece, Some(chunk));
    let chunk_ptr = io.buf();
    let Some(o) = io.overlap() else {
        // SAFETY: the chunk is ours and at least piece.len long.
        unsafe { std::ptr::write_bytes(chunk_ptr, 0, piece.len as usize) };
        return after_put_copy(io, Ok(()));
    };
    // SAFETY: the chunk is ours and at least piece.len long; the copy fills the overlap.
    unsafe {
        std::ptr::write_bytes(chunk_ptr, 0, o.in_piece);
        std::ptr::write_bytes(chunk_ptr.add(o.in_piece + o.len), 0, piece.len as usize - o.in_piece - o.len);
    }
    let copy = &op.gpu.as_ref().expect("a GPU op").device.copy;
    let queued = io.queue_copy();
    // SAFETY: the chunk is pinned (the slab) and held by `io` until the continuation runs; the
    // device range lies in the caller's buffer, which the ticket keeps alive.
    unsafe {
        copy.copy(
            CopyDirection::DeviceToHost,
            chunk_ptr.add(o.in_piece),
            o.user_address as u64,
            o.len,
            Box::new(move |copied| after_put_copy(io, copied)),
        )
    };
    drop(queued);
}

/// The chunk holds the piece: its checksum is taken and the disk write goes to the device's queue.
/// NOTE: the write goes straight to the device queue (`DeviceQueue::submit`, the dispatcher's
/// own way in), not back through the dispatcher: the dispatcher may be waiting for a bounce chunk
/// that only this write's completion gives back.
fn after_put_copy(io: PieceIo, copied: Result<()>) {
    if let Err(e) = copied {
        return io.fail(e);
    }
    // SAFETY: the copy filled the piece's bytes (a put covers the whole object).
    unsafe { io.op.take_piece_crc(io.piece, io.buf()) };
    let (shared, device) = (io.shared.clone(), io.piece.device as usize);
    shared.queues[device].submit(std::iter::once(io.into_request(PieceIo::finish)));
}

/// The disk read of a get's piece into `chunk`.
pub(in crate::store::dispatch) fn get_request(
    shared: &Arc<Shared>,
    op: &Arc<Op>,
    piece: Piece,
    chunk: BounceChunk,
) -> Request {
    PieceIo::new(shared, op, piece, Some(chunk)).into_request(after_get_read)
}

/// The chunk holds the piece: it goes on to `copy_to_gpu` (on a verify thread when it is
/// checked, see `PieceIo::continue_get`, so the device worker returns to its queue at once and
/// the pieces' checksums run in parallel with the reads and the copies).
fn after_get_read(io: PieceIo, result: io::Result<()>) {
    if result.is_err() {
        return io.finish(result);
    }
    io.continue_get(copy_to_gpu);
}

/// Takes the piece's checksum, then queues the copy of the caller's part to the GPU. The bytes
/// reach the caller's memory before the get is checked as a whole, but the get succeeds only if
/// every checked unit matches (`Shared::verify_get`, once every piece is done).
fn copy_to_gpu(mut io: PieceIo) {
    // SAFETY: the read filled the chunk.
    unsafe { io.op.take_piece_crc(io.piece, io.buf()) };
    let Some(o) = io.overlap() else {
        // Read only to verify its stripe unit (outside the caller's range).
        return io.finish(Ok(()));
    };
    let source = io.buf().wrapping_add(o.in_piece);
    let device = io.op.gpu.as_ref().expect("a GPU op").device.clone();
    let queued = io.queue_copy();
    // SAFETY: the chunk is pinned and held by `io` until the continuation runs; the destination
    // lies in the caller's buffer, which the ticket keeps alive.
    unsafe {
        device.copy.copy(
            CopyDirection::HostToDevice,
            source,
            o.user_address as u64,
            o.len,
            Box::new(move |copied| after_get_copy(io, copied)),
        )
    };
    // Queued (its event is with the copy waiter): a stream wait for the op may now be enqueued.
    drop(queued);
}

/// The piece is in the caller's GPU memory.
fn after_get_copy(io: PieceIo, copied: Result<()>) {
    match copied {
        Ok(()) => io.finish(Ok(())),
        Err(e) => io.fail(e),
    }
}
