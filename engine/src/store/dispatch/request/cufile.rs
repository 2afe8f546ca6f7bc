//! A piece of a GPU op on the cuFile path: the device request's buffer is the GPU address, and it
//! goes to the device's cuFile queue. Only pieces the caller's range covers whole come here.

use super::PieceIo;
use crate::layout::stripe::Piece;
use crate::queue::Request;
use crate::store::op::Op;
use crate::store::Shared;
use std::sync::Arc;

/// The cuFile request of `piece`.
pub(in crate::store::dispatch) fn request(shared: &Arc<Shared>, op: &Arc<Op>, piece: Piece) -> Request {
    PieceIo::new(shared, op, piece, None).into_request(PieceIo::finish)
}
