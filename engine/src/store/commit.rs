//! The commit thread and recovery. Puts whose data is on disk and deletes are gathered into one
//! journal batch (group commit): written devices are flushed, the batch is written and flushed,
//! and only then are the changes applied to the in-memory table and the callers told. When the
//! journal ring is full, the table is checkpointed first. Recovery reverses this on open.

use super::dispatch::{Op, OpObject};
use super::object::{Allocators, Geometry, Object};
use super::Shared;
use crate::backend::IoKind;
use crate::buffer::AlignedBuf;
use crate::device::Device;
use crate::error::{Error, Result};
use crate::layout::metadata::{
    decode_batch_header, decode_batch_payload, decode_checkpoint_header, decode_checkpoint_payload, encode_batch,
    encode_checkpoint, HEADER_BYTES,
};
use crate::layout::superblock::Superblock;
use crate::layout::table::{ObjectRecord, TableChange};
use crate::queue::{Priority, Request};
use std::collections::HashMap;
use std::sync::mpsc::{Receiver, SyncSender};
use std::sync::Arc;

/// Messages to the commit thread.
pub(crate) enum CommitMsg {
    Put(Arc<Op>),
    Delete { id: u64, reply: SyncSender<Result<bool>> },
    Checkpoint { reply: SyncSender<Result<()>> },
}

/// Where the metadata lives on device 0 and where the journal stands.
#[derive(Debug, Clone)]
pub(crate) struct JournalState {
    pub metadata_start: u64,
    pub slot_bytes: u64,
    pub journal_bytes: u64,
    pub block_size: u64,
    pub generation: u64,
    pub sequence: u64,
    pub position: u64,
}

impl JournalState {
    fn slot_offset(&self, generation: u64) -> u64 {
        self.metadata_start + (generation % 2) * self.slot_bytes
    }
    fn journal_offset(&self) -> u64 {
        self.metadata_start + 2 * self.slot_bytes
    }
}

impl Shared {
    pub(crate) fn send_to_commit(&self, op: Arc<Op>) {
        let sent = self.commit_tx.lock().expect("commit sender").as_ref().map(|tx| tx.send(CommitMsg::Put(op.clone())));
        if !matches!(sent, Some(Ok(()))) {
            self.finish_op(&op, Err(Error::Closed));
        }
    }

    /// Runs device requests synchronously on the urgent lane (metadata I/O), splitting large
    /// buffers into requests of at most `max_io_bytes`.
    pub(crate) fn sync_io(&self, device: u16, kind: IoKind, offset: u64, buf: *mut u8, len: u64) -> Result<()> {
        let (tx, rx) = std::sync::mpsc::channel();
        let step = self.config.max_io_bytes;
        let mut requests = Vec::new();
        let mut at = 0;
        loop {
            let n = (len - at).min(step);
            let tx = tx.clone();
            requests.push(Request {
                kind,
                offset: offset + at,
                // SAFETY: at < len or len == 0 (flush).
                buf: unsafe { buf.add(at as usize) },
                len: n as u32,
                fixed_index: None,
                priority: Priority::Urgent,
                on_complete: Box::new(move |r| {
                    let _ = tx.send(r);
                }),
            });
            at += n;
            if at >= len {
                break;
            }
        }
        let count = requests.len();
        self.queues[device as usize].submit(requests);
        let mut first_error = None;
        for _ in 0..count {
            if let Err(source) = rx.recv().expect("queue answers every request") {
                first_error.get_or_insert(Error::DeviceIo {
                    device,
                    path: self.devices[device as usize].path.clone(),
                    op: kind.name(),
                    offset,
                    source,
                });
            }
        }
        first_error.map_or(Ok(()), Err)
    }

    fn flush_devices(&self, mask: u64) -> Result<()> {
        for device in 0..self.geometry.device_count {
            if mask & (1u64 << device) != 0 {
                self.sync_io(device, IoKind::Flush, 0, std::ptr::null_mut(), 0)?;
            }
        }
        Ok(())
    }

    fn write_metadata(&self, offset: u64, bytes: &[u8]) -> Result<()> {
        let mut buf = AlignedBuf::new(bytes.len(), self.geometry.block_size as usize)?;
        buf.copy_from_slice(bytes);
        self.sync_io(0, IoKind::Write, offset, buf.as_mut_ptr(), bytes.len() as u64)
    }

    /// Writes the whole table as the next checkpoint generation and restarts the journal.
    /// The header block goes last, after the rest is durable, so a valid header means a whole
    /// checkpoint.
    pub(crate) fn checkpoint(&self, journal: &mut JournalState) -> Result<()> {
        let bytes = {
            let table = self.table.read().expect("table");
            let mut objects: Vec<&Arc<Object>> = table.values().collect();
            objects.sort_by_key(|o| o.record.id);
            encode_checkpoint(journal.generation + 1, objects.iter().map(|o| &o.record), journal.block_size)
        };
        if bytes.len() as u64 > journal.slot_bytes {
            return Err(Error::TableFull {
                detail: format!("a checkpoint needs {} bytes, a slot holds {}", bytes.len(), journal.slot_bytes),
            });
        }
        let offset = journal.slot_offset(journal.generation + 1);
        let block = journal.block_size as usize;
        if bytes.len() > block {
            self.write_metadata(offset + block as u64, &bytes[block..])?;
            self.flush_devices(1)?;
        }
        self.write_metadata(offset, &bytes[..block])?;
        self.flush_devices(1)?;
        journal.generation += 1;
        journal.sequence = 0;
        journal.position = 0;
        Ok(())
    }
}

/// The commit thread: group commit until the channel closes, then a final checkpoint.
pub(crate) fn run_commit(shared: Arc<Shared>, rx: Receiver<CommitMsg>, mut journal: JournalState) {
    let batch_limit = (journal.journal_bytes / 2).max(journal.block_size) as usize;
    while let Ok(first) = rx.recv() {
        let mut messages = vec![first];
        while messages.len() < 4096 {
            match rx.try_recv() {
                Ok(m) => messages.push(m),
                Err(_) => break,
            }
        }
        commit_batch(&shared, &mut journal, messages, batch_limit);
    }
    if journal.position > 0 {
        if let Err(e) = shared.checkpoint(&mut journal) {
            tracing::error!(error = %e, "final checkpoint at close failed; the journal will be replayed at open");
        }
    }
}

fn commit_batch(shared: &Arc<Shared>, journal: &mut JournalState, messages: Vec<CommitMsg>, batch_limit: usize) {
    let mut changes: Vec<TableChange> = Vec::new();
    let mut puts: Vec<Arc<Op>> = Vec::new();
    let mut deletes: Vec<(u64, SyncSender<Result<bool>>)> = Vec::new();
    let mut checkpoints = Vec::new();
    let mut flush_mask = 0u64;
    let mut size = HEADER_BYTES;
    let mut leftover = Vec::new();
    for m in messages {
        if size > batch_limit {
            leftover.push(m);
            continue;
        }
        match m {
            CommitMsg::Put(op) => {
                let OpObject::Put(object) = &op.object else { unreachable!("commit of a get") };
                let change =
                    TableChange::Put(object.lock().expect("put object").as_ref().expect("uncommitted").record.clone());
                let mut e = crate::layout::codec::Encoder::default();
                change.encode(&mut e);
                if HEADER_BYTES + e.bytes.len() > batch_limit {
                    object.lock().expect("put object").take();
                    shared.finish_op(
                        &op,
                        Err(Error::TableFull {
                            detail: format!("one object record needs {} journal bytes", e.bytes.len()),
                        }),
                    );
                    continue;
                }
                size += e.bytes.len();
                if shared.config.durable {
                    flush_mask |= op.devices_written.load(std::sync::atomic::Ordering::Relaxed);
                }
                changes.push(change);
                puts.push(op);
            }
            CommitMsg::Delete { id, reply } => {
                let in_batch = changes.iter().any(|c| matches!(c, TableChange::Put(r) if r.id == id));
                if in_batch || shared.table.read().expect("table").contains_key(&id) {
                    size += 9;
                    changes.push(TableChange::Delete { id });
                }
                deletes.push((id, reply));
            }
            CommitMsg::Checkpoint { reply } => checkpoints.push(reply),
        }
    }

    let result = write_batch(shared, journal, &changes, flush_mask);
    match result {
        Ok(()) => {
            // Apply in order; replaced and deleted objects free their extents when the last
            // reader lets go.
            let mut existed: HashMap<u64, bool> = HashMap::new();
            let mut replaced = Vec::new();
            {
                let mut table = shared.table.write().expect("table");
                let mut put_iter = puts.iter();
                for change in &changes {
                    match change {
                        TableChange::Put(r) => {
                            let op = put_iter.next().expect("one op per put change");
                            let OpObject::Put(object) = &op.object else { unreachable!() };
                            let object = object.lock().expect("put object").take().expect("uncommitted");
                            debug_assert_eq!(object.record.id, r.id);
                            replaced.extend(table.insert(r.id, Arc::new(object)));
                        }
                        TableChange::Delete { id } => {
                            let old = table.remove(id);
                            existed.insert(*id, old.is_some());
                            replaced.extend(old);
                        }
                    }
                }
            }
            drop(replaced);
            for op in &puts {
                shared.finish_op(op, Ok(()));
            }
            for (id, reply) in deletes {
                let _ = reply.send(Ok(existed.get(&id).copied().unwrap_or(false)));
            }
            if !checkpoints.is_empty() {
                let r = shared.checkpoint(journal);
                for reply in checkpoints {
                    let _ = reply.send(r.clone());
                }
            }
        }
        Err(e) => {
            tracing::error!(error = %e, "journal commit failed; the ops in the batch fail and the store stays as it was");
            for op in &puts {
                let OpObject::Put(object) = &op.object else { unreachable!() };
                object.lock().expect("put object").take();
                shared.finish_op(op, Err(e.clone()));
            }
            for (_, reply) in deletes {
                let _ = reply.send(Err(e.clone()));
            }
            for reply in checkpoints {
                let _ = reply.send(Err(e.clone()));
            }
        }
    }
    if !leftover.is_empty() {
        commit_batch(shared, journal, leftover, batch_limit);
    }
}

fn write_batch(shared: &Shared, journal: &mut JournalState, changes: &[TableChange], flush_mask: u64) -> Result<()> {
    if changes.is_empty() {
        return Ok(());
    }
    shared.flush_devices(flush_mask)?;
    let bytes = encode_batch(journal.generation + 1, journal.sequence, changes, journal.block_size);
    if journal.position + bytes.len() as u64 > journal.journal_bytes {
        shared.checkpoint(journal)?;
        // The checkpoint advanced the generation: re-encode for it.
        return write_batch(shared, journal, changes, 0);
    }
    shared.write_metadata(journal.journal_offset() + journal.position, &bytes)?;
    if shared.config.durable {
        shared.flush_devices(1)?;
    }
    journal.position += bytes.len() as u64;
    journal.sequence += 1;
    Ok(())
}

/// Rebuilds the table from device 0: the newest valid checkpoint plus its journal batches.
/// Journal batches carry the generation of the checkpoint they follow plus one.
pub(crate) fn recover(
    device0: &Device,
    sb0: &Superblock,
    geometry: &Geometry,
) -> Result<(Vec<ObjectRecord>, JournalState)> {
    let block = sb0.block_size as u64;
    let mut journal = JournalState {
        metadata_start: sb0.metadata_start,
        slot_bytes: sb0.checkpoint_slot_bytes,
        journal_bytes: sb0.journal_bytes,
        block_size: block,
        generation: 0,
        sequence: 0,
        position: 0,
    };
    let read = |offset: u64, len: u64| -> Result<AlignedBuf> {
        let mut buf = AlignedBuf::new(len as usize, block as usize)?;
        device0.read_exact_at(&mut buf, offset)?;
        Ok(buf)
    };
    // Newest checkpoint whose header and payload both check out.
    let mut candidates = Vec::new();
    for slot in 0..2u64 {
        let offset = sb0.metadata_start + slot * sb0.checkpoint_slot_bytes;
        let header_block = read(offset, block)?;
        if let Some(h) = decode_checkpoint_header(&header_block) {
            if h.generation % 2 == slot && HEADER_BYTES as u64 + h.payload_bytes <= sb0.checkpoint_slot_bytes {
                candidates.push((h, offset));
            }
        }
    }
    candidates.sort_by_key(|(h, _)| std::cmp::Reverse(h.generation));
    let mut chosen = None;
    let mut first_error = None;
    for (h, offset) in candidates {
        let total = crate::layout::codec::round_up(HEADER_BYTES as u64 + h.payload_bytes, block);
        let bytes = read(offset, total)?;
        let payload = &bytes[HEADER_BYTES..HEADER_BYTES + h.payload_bytes as usize];
        match decode_checkpoint_payload(&h, payload, sb0.device_count) {
            Ok(records) => {
                chosen = Some((h.generation, records));
                break;
            }
            Err(e) => {
                tracing::warn!(generation = h.generation, error = %e, "checkpoint unreadable; trying the older one");
                first_error.get_or_insert(e);
            }
        }
    }
    let Some((generation, records)) = chosen else {
        return Err(first_error.unwrap_or(Error::CorruptMetadata { detail: "no valid checkpoint on device 0".into() }));
    };
    journal.generation = generation;
    let mut table: HashMap<u64, ObjectRecord> = records.into_iter().map(|r| (r.id, r)).collect();

    // Replay this generation's batches in sequence; the first that does not check out ends it.
    let journal_start = sb0.metadata_start + 2 * sb0.checkpoint_slot_bytes;
    loop {
        if journal.position + block > journal.journal_bytes {
            break;
        }
        let head = read(journal_start + journal.position, block)?;
        let Some(h) = decode_batch_header(&head) else { break };
        if h.generation != generation + 1 || h.sequence != journal.sequence {
            if journal.position == 0 && h.generation > generation + 1 {
                return Err(Error::CorruptMetadata {
                    detail: format!(
                        "the journal follows checkpoint generation {} but only generation {} is readable",
                        h.generation - 1,
                        generation
                    ),
                });
            }
            break;
        }
        let total = h.padded_bytes(block);
        if journal.position + total > journal.journal_bytes {
            break;
        }
        let bytes = if total == block { head } else { read(journal_start + journal.position, total)? };
        let Some(changes) =
            decode_batch_payload(&h, &bytes[HEADER_BYTES..HEADER_BYTES + h.payload_bytes as usize], sb0.device_count)
        else {
            break;
        };
        for change in changes {
            match change {
                TableChange::Put(r) => {
                    table.insert(r.id, r);
                }
                TableChange::Delete { id } => {
                    table.remove(&id);
                }
            }
        }
        journal.position += total;
        journal.sequence += 1;
    }
    let mut records: Vec<ObjectRecord> = table.into_values().collect();
    records.sort_by_key(|r| r.id);
    for r in &records {
        geometry.validate(r)?;
    }
    Ok((records, journal))
}

/// Builds live objects from recovered records, claiming their extents (a block claimed twice is
/// corruption, reported, never silently shared).
pub(crate) fn claim(records: Vec<ObjectRecord>, allocators: &Allocators) -> Result<HashMap<u64, Arc<Object>>> {
    let mut table = HashMap::with_capacity(records.len());
    for r in records {
        {
            let mut a = allocators.lock().expect("allocators");
            for x in &r.extents {
                a[x.device as usize].reserve(*x)?;
            }
        }
        table.insert(r.id, Arc::new(Object::new(r, allocators.clone())));
    }
    Ok(table)
}
