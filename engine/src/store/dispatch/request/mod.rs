//! One device request per piece of an op, by where the caller's bytes are: host memory
//! ([`host`]: straight, or through a bounce chunk copied on the CPU), GPU memory through a pinned
//! bounce chunk and the GPU's copy engine ([`bounce`]), or GPU memory straight through cuFile
//! ([`cufile`]). [`PieceIo`] is what every one of them carries to its completion.

pub(super) mod bounce;
pub(super) mod cufile;
pub(super) mod host;

use crate::backend::IoKind;
use crate::buffer::BounceChunk;
use crate::cuda::handoff::IssueHold;
use crate::error::Error;
use crate::layout::stripe::Piece;
use crate::queue::Request;
use crate::store::op::{Op, OpKind};
use crate::store::verifiers::VERIFY_ON_WORKER_MAX_BYTES;
use crate::store::Shared;
use std::io;
use std::sync::atomic::Ordering;
use std::sync::Arc;

/// A piece of an op on its way to and from the device: counted in the op's `remaining` from
/// [`PieceIo::new`] until [`PieceIo::finish`], holding its budget and its bounce chunk (if any)
/// until then (a chunk goes back to the pool when dropped).
pub(super) struct PieceIo {
    shared: Arc<Shared>,
    op: Arc<Op>,
    piece: Piece,
    chunk: Option<BounceChunk>,
    /// A GPU op's piece: its hold on the op's unqueued GPU work, until its copy is queued
    /// (`queue_copy`) or, on the cuFile path, until it is done.
    issue: Option<IssueHold>,
}

/// The part of a piece that lies in the caller's range.
#[derive(Debug, Clone, Copy)]
struct Overlap {
    /// Where it starts in the piece (and so in a bounce chunk).
    in_piece: usize,
    /// Where it starts in the caller's memory (a host or a device address).
    user_address: usize,
    len: usize,
}

impl PieceIo {
    /// Counts the piece into its op (and a put's device into those to flush before commit).
    /// The piece's budget is already taken.
    fn new(shared: &Arc<Shared>, op: &Arc<Op>, piece: Piece, chunk: Option<BounceChunk>) -> PieceIo {
        assert!(piece.len > 0 && piece.len <= shared.pool.chunk_bytes() as u64, "a piece fits a bounce chunk");
        if op.kind == OpKind::Put {
            op.devices_written.fetch_or(1u64 << piece.device, Ordering::Relaxed);
        }
        op.remaining.fetch_add(1, Ordering::AcqRel);
        let issue = op.gpu.as_ref().map(|g| g.unissued.hold());
        PieceIo { shared: shared.clone(), op: op.clone(), piece, chunk, issue }
    }

    fn kind(&self) -> IoKind {
        match self.op.kind {
            OpKind::Put => IoKind::Write,
            OpKind::Get => IoKind::Read,
        }
    }

    /// Where the caller's copy of object byte `object_offset` is.
    fn user_address(&self, object_offset: u64) -> usize {
        self.op.user_ptr + (object_offset - self.op.user_start) as usize
    }

    fn overlap(&self) -> Option<Overlap> {
        let (piece_start, piece_end) = (self.piece.object_offset, self.piece.object_offset + self.piece.len);
        let (start, end) = (piece_start.max(self.op.user_start), piece_end.min(self.op.user_end));
        (start < end).then(|| Overlap {
            in_piece: (start - piece_start) as usize,
            user_address: self.user_address(start),
            len: (end - start) as usize,
        })
    }

    /// The device request's buffer: the bounce chunk, else the caller's memory.
    fn buf(&self) -> *mut u8 {
        match &self.chunk {
            Some(c) => c.ptr,
            None => self.user_address(self.piece.object_offset) as *mut u8,
        }
    }

    /// The piece's device request from/to `buf()`; `after` runs on its completion (in the
    /// device's worker thread) and must end in `finish` or `fail`.
    fn into_request(self, after: fn(PieceIo, io::Result<()>)) -> Request {
        Request {
            kind: self.kind(),
            offset: self.piece.device_offset,
            buf: self.buf(),
            len: self.piece.len as u32,
            fixed_index: None,
            priority: self.op.priority,
            on_complete: Box::new(move |result| after(self, result)),
        }
    }

    /// The piece is done: gives back its bounce chunk and budget, records a device error, and
    /// counts the request done.
    fn finish(self, result: io::Result<()>) {
        let kind = self.kind();
        let PieceIo { shared, op, piece, chunk, issue } = self;
        drop((chunk, issue));
        shared.release_budget(piece.len);
        if let Err(source) = result {
            op.set_error(Error::DeviceIo {
                device: piece.device,
                path: shared.devices[piece.device as usize].path.clone(),
                op: kind.name(),
                offset: piece.device_offset,
                source,
            });
        }
        shared.request_done(&op);
    }

    /// Goes on with a get's piece whose read is in: `then` takes its checksum and hands the
    /// bytes on. A piece whose checksum is taken and is longer than
    /// `VERIFY_ON_WORKER_MAX_BYTES` goes to a verify thread (`store::verifiers`), so the device
    /// worker that read it returns to its queue at once; a short or unchecked one goes on here.
    fn continue_get(self, then: fn(PieceIo)) {
        assert_eq!(self.op.kind, OpKind::Get, "only a get's read goes on to a check");
        if self.op.piece_crcs.is_some() && self.piece.len > VERIFY_ON_WORKER_MAX_BYTES {
            let shared = self.shared.clone();
            shared.verifiers.run(move || then(self));
        } else {
            then(self);
        }
    }

    /// The piece's hold on its op's unqueued GPU work, taken out before its copy is queued and
    /// dropped by the caller once `copy` has returned (the copy's continuation may finish the
    /// piece before that).
    fn queue_copy(&mut self) -> Option<IssueHold> {
        self.issue.take()
    }

    /// The piece failed outside the device (a GPU copy): the op fails with `e`.
    fn fail(self, e: Error) {
        self.op.set_error(e);
        self.finish(Ok(()));
    }
}
