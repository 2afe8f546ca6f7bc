//! Cutting one slice of an op into device requests: the pieces of the stripe map, each held to
//! the budget, given a bounce chunk where it cannot go straight from/to the caller's memory, and
//! built by [`super::request`]; the slice's requests go to the queues together.

use super::request::{bounce, cufile, host};
use super::PendingOp;
use crate::buffer::BounceChunk;
use crate::layout::stripe::{Piece, StripeMap};
use crate::queue::Request;
use crate::store::op::{Op, OpKind, OpObject};
use crate::store::Shared;
use std::sync::Arc;

/// Bytes of an op cut into requests in one go before the urgent lane is looked at again.
const DISPATCH_SLICE_BYTES: u64 = 64 << 20;

/// The requests of one slice, per queue, until they are submitted together.
struct Batch<'a> {
    shared: &'a Shared,
    /// Per store device: its host-memory queue.
    host: Vec<Vec<Request>>,
    /// Per store device: its cuFile queue (GPU ops on the cuFile path only; else empty).
    cufile: Vec<Vec<Request>>,
}

impl Batch<'_> {
    /// An empty batch; with `cufile`, room for requests to the cuFile queues too.
    fn new(shared: &Shared, cufile: bool) -> Batch<'_> {
        let count = shared.geometry.device_count as usize;
        let cufile_count = if cufile { count } else { 0 };
        Batch {
            shared,
            host: (0..count).map(|_| Vec::new()).collect(),
            cufile: (0..cufile_count).map(|_| Vec::new()).collect(),
        }
    }

    /// Hands everything built so far to the queues.
    fn submit(&mut self) {
        for (device, requests) in self.host.iter_mut().enumerate() {
            if !requests.is_empty() {
                self.shared.queues[device].submit(requests.drain(..));
            }
        }
        for (device, requests) in self.cufile.iter_mut().enumerate() {
            if !requests.is_empty() {
                let gpu = self.shared.gpu.get().and_then(|r| r.as_ref().ok());
                gpu.expect("cuFile requests only with GPU state").cufile_queues[device].submit(requests.drain(..));
            }
        }
    }
}

/// Cuts up to one slice of `pending` into requests; true when the op is fully dispatched.
/// Without `may_block` it stops (returning false) where it would have to wait for budget or a
/// bounce chunk, so the caller's thread never blocks; the dispatcher thread goes on from there.
pub(super) fn dispatch_slice(shared: &Arc<Shared>, pending: &mut PendingOp, may_block: bool) -> bool {
    let op = pending.op.clone();
    let g = &shared.geometry;
    let slice_end = pending.end.min(pending.cursor + DISPATCH_SLICE_BYTES);
    let pieces = slice_pieces(shared, &op, pending.cursor, slice_end);
    let mut batch = Batch::new(shared, op.gpu.as_ref().is_some_and(|g| g.use_cufile));
    for piece in pieces {
        if !shared.try_acquire_budget(piece.len, op.priority) {
            // Submit what was built before waiting: it holds budget and bounce chunks.
            batch.submit();
            if !may_block || !shared.acquire_budget(piece.len, op.priority) {
                pending.cursor = piece.object_offset;
                return false;
            }
        }
        let chunk = if needs_bounce(shared, &op, piece) {
            match take_chunk(shared, &mut batch, may_block) {
                Some(c) => Some(c),
                None => {
                    shared.release_budget(piece.len);
                    batch.submit();
                    pending.cursor = piece.object_offset;
                    return false;
                }
            }
        } else {
            None
        };
        let device = piece.device as usize;
        match (&op.gpu, chunk) {
            (None, chunk) => {
                if op.kind == OpKind::Put && g.checksums && piece.object_offset % g.stripe_unit == 0 {
                    pending.unit_crcs.push(unit_crc(&op, piece.unit, g.stripe_unit));
                }
                batch.host[device].push(host::request(shared, &op, piece, chunk));
            }
            (Some(_), None) => batch.cufile[device].push(cufile::request(shared, &op, piece)),
            (Some(_), Some(chunk)) => match op.kind {
                OpKind::Get => batch.host[device].push(bounce::get_request(shared, &op, piece, chunk)),
                // The disk write is submitted once the copy into the chunk is done.
                OpKind::Put => bounce::start_put(shared, &op, piece, chunk),
            },
        }
        pending.cursor = piece.object_offset + piece.len;
    }
    batch.submit();
    pending.cursor = slice_end;
    slice_end == pending.end
}

/// The pieces of object bytes `start..end` of `op`, each at most a bounce chunk long.
fn slice_pieces(shared: &Shared, op: &Op, start: u64, end: u64) -> Vec<Piece> {
    let g = &shared.geometry;
    let mut pieces = Vec::new();
    if start >= end {
        return pieces;
    }
    let put_guard;
    let record = match &op.object {
        OpObject::Get(o) => &o.record,
        OpObject::Put(o) => {
            put_guard = o.lock().expect("put object");
            &put_guard.as_ref().expect("put object present while dispatching").record
        }
    };
    StripeMap::new(record, g.stripe_unit, g.block_size, g.device_count).for_each_piece(
        start..end,
        shared.pool.chunk_bytes() as u64,
        |p| pieces.push(p),
    );
    pieces
}

/// Takes a bounce chunk: now if one is free; else, with `may_block`, after submitting the batch
/// (chunks come back as submitted requests finish); else None.
fn take_chunk(shared: &Shared, batch: &mut Batch, may_block: bool) -> Option<BounceChunk> {
    if let Some(c) = shared.pool.try_take() {
        return Some(c);
    }
    if !may_block {
        return None;
    }
    batch.submit();
    Some(shared.pool.take())
}

/// Whether a piece goes through a bounce chunk. Host memory: unless the caller's range covers
/// the piece, aligned for O_DIRECT. GPU memory: unless it is on the cuFile path and covers the
/// piece (partial blocks always bounce: cuFile must never touch GPU bytes outside the range).
fn needs_bounce(shared: &Shared, op: &Op, piece: Piece) -> bool {
    let covers = piece.object_offset >= op.user_start && piece.object_offset + piece.len <= op.user_end;
    match &op.gpu {
        None => {
            let block = shared.geometry.block_size as usize;
            let aligned =
                (op.user_ptr + (piece.object_offset.max(op.user_start) - op.user_start) as usize).is_multiple_of(block);
            !(covers && aligned)
        }
        Some(gpu) => !(gpu.use_cufile && covers),
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

#[cfg(test)]
mod tests {
    use crate::config::{FormatConfig, OpenConfig, MIB};
    use crate::queue::Priority;
    use crate::store::Store;

    /// Every bounce chunk and every byte of budget is back once the ops' tickets are done, on
    /// the paths that bounce (unaligned memory, partial blocks, ranged gets).
    #[test]
    fn finished_ops_hold_no_chunk_and_no_budget() {
        let dir = tempfile::tempdir().unwrap();
        let paths: Vec<_> = (0..2).map(|i| dir.path().join(format!("d{i}"))).collect();
        let format = FormatConfig {
            create_file_bytes: Some(64 * MIB),
            direct_io: false,
            stripe_unit_bytes: 64 << 10,
            ..Default::default()
        };
        let open = OpenConfig { direct_io: false, durable: false, ..Default::default() };
        let store = Store::create(&paths, &format, open).unwrap();
        let data: Vec<u8> = (0..(1 << 20) + 4099).map(|i| (i * 31 % 251) as u8).collect();
        for (id, len) in [(1u64, 1usize), (2, 4097), (3, 300_001), (4, (1 << 20) + 4097)] {
            // One byte into the vector: never block-aligned, so every piece bounces.
            // SAFETY: we wait for the ticket before `data` goes away.
            unsafe { store.put_raw_ticket(id, data.as_ptr().add(1), len, b"", Priority::Normal) }
                .unwrap()
                .wait()
                .unwrap();
            let mut back = vec![0u8; len + 1];
            // SAFETY: as above, for `back`.
            unsafe { store.get_raw_ticket(id, 0, back.as_mut_ptr().add(1), len, true, Priority::Urgent) }
                .unwrap()
                .wait()
                .unwrap();
            assert_eq!(&back[1..], &data[1..len + 1]);
            if len > 10 {
                let part = store.get_range(id, 3, vec![0u8; len - 7], Priority::Normal).unwrap().wait().unwrap();
                assert_eq!(part, &data[4..len - 3]);
            }
        }
        let shared = &store.shared;
        assert_eq!(shared.pool.free_chunks(), shared.pool.chunk_count(), "every chunk went back to the pool");
        assert_eq!(shared.dispatch.lock().unwrap().budget.in_flight(), 0, "every request gave its budget back");
        store.close().unwrap();
    }
}
