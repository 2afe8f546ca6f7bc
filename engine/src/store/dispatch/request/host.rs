//! A piece of an op on host memory: the device request goes straight from/to the caller's memory,
//! or through a bounce chunk (unaligned memory, a partial block) copied on the CPU: a put fills
//! the chunk now, a get empties it on completion.

use super::PieceIo;
use crate::buffer::BounceChunk;
use crate::layout::stripe::Piece;
use crate::queue::Request;
use crate::store::op::{Op, OpKind};
use crate::store::Shared;
use std::io;
use std::sync::Arc;

/// The device request of `piece`, through `chunk` if one is given.
pub(in crate::store::dispatch) fn request(
    shared: &Arc<Shared>,
    op: &Arc<Op>,
    piece: Piece,
    chunk: Option<BounceChunk>,
) -> Request {
    let io = PieceIo::new(shared, op, piece, chunk);
    if let (Some(chunk), OpKind::Put) = (&io.chunk, op.kind) {
        // SAFETY: the chunk is ours and at least piece.len long; the source lies in the caller's
        // buffer (a put covers the whole object), which the ticket keeps alive.
        unsafe {
            std::ptr::write_bytes(chunk.ptr, 0, piece.len as usize);
            if let Some(o) = io.overlap() {
                std::ptr::copy_nonoverlapping(o.user_address as *const u8, chunk.ptr.add(o.in_piece), o.len);
            }
        }
    }
    io.into_request(done)
}

/// The device is done with the piece: a put's is finished, a get's goes on to `get_read`
/// (on a verify thread when it is checked, see `PieceIo::continue_get`).
fn done(io: PieceIo, result: io::Result<()>) {
    if result.is_ok() && io.op.kind == OpKind::Get {
        return io.continue_get(get_read);
    }
    io.finish(result);
}

/// A get's bytes are in: their checksum is taken and a bounce chunk's part of the caller's range
/// copied out (nothing, for a piece read only to verify its stripe unit).
fn get_read(io: PieceIo) {
    // SAFETY: the read filled the buffer with the piece.
    unsafe { io.op.take_piece_crc(io.piece, io.buf()) };
    if let (Some(chunk), Some(o)) = (&io.chunk, io.overlap()) {
        // SAFETY: the read filled the chunk; the destination lies inside the caller's buffer,
        // which the ticket keeps alive.
        unsafe { std::ptr::copy_nonoverlapping(chunk.ptr.add(o.in_piece), o.user_address as *mut u8, o.len) };
    }
    io.finish(Ok(()));
}
