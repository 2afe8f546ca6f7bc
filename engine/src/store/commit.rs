//! The commit thread and recovery. Puts whose data is on disk and deletes are gathered into one
//! journal batch (group commit): written devices are flushed, the batch is written and flushed,
//! and only then are the changes applied to the in-memory table and the callers told. When the
//! journal ring is full, the table is checkpointed first. Recovery reverses this on open.

use super::object::{Allocators, Geometry, Object};
use super::op::{Op, OpObject};
use super::Shared;
use crate::backend::IoKind;
use crate::buffer::AlignedBuf;
use crate::device::Device;
use crate::error::{Error, Result};
use crate::layout::metadata::{
    decode_batch_header, decode_batch_payload, decode_checkpoint_header, decode_checkpoint_payload, encode_batch,
    encode_checkpoint, is_damaged_batch_header, HEADER_BYTES,
};
use crate::layout::superblock::Superblock;
use crate::layout::table::{ObjectRecord, TableChange};
use crate::queue::{Priority, Request};
use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::mpsc::{Receiver, SyncSender};
use std::sync::Arc;

/// Messages to the commit thread.
pub(crate) enum CommitMsg {
    Put(Arc<Op>),
    Delete {
        id: u64,
        reply: SyncSender<Result<bool>>,
    },
    /// Deletes committed in one batch (`Store::delete_many`): whether each existed.
    DeleteMany {
        ids: Vec<u64>,
        reply: SyncSender<Result<Vec<bool>>>,
    },
    Checkpoint {
        reply: SyncSender<Result<()>>,
    },
}

/// Where the outcome of a delete request goes.
enum DeleteReply {
    One(SyncSender<Result<bool>>),
    Many(SyncSender<Result<Vec<bool>>>),
}

impl DeleteReply {
    /// Sends whether each id existed (`existed`), or the batch's error.
    fn send(self, ids: &[u64], existed: Result<&HashMap<u64, bool>>) {
        let of = |existed: &HashMap<u64, bool>, id: &u64| existed.get(id).copied().unwrap_or(false);
        match self {
            DeleteReply::One(reply) => {
                let _ = reply.send(existed.map(|e| of(e, &ids[0])));
            }
            DeleteReply::Many(reply) => {
                let _ = reply.send(existed.map(|e| ids.iter().map(|id| of(e, id)).collect()));
            }
        }
    }
}

/// The most ids one `delete_many` may name: one batch of them must fit a journal region (each
/// delete takes 9 bytes), for a journal of `journal_bytes` with blocks of `block_size`.
pub(crate) fn delete_many_limit(journal_bytes: u64, block_size: u64) -> usize {
    let region = crate::layout::codec::round_down(journal_bytes / 2, block_size);
    (region.saturating_sub(HEADER_BYTES as u64) / 9) as usize
}

impl super::Store {
    /// Deletes the objects `ids` durably, in one journal batch; returns whether each existed.
    /// A store whose table outgrew a checkpoint slot under an earlier release (format version 2)
    /// commits deletes only as a batch that brings the table under the slot: this is how to make
    /// one. At most `delete_many_limit` ids (half the journal / 9 bytes) in one call.
    pub fn delete_many(&self, ids: &[u64]) -> Result<Vec<bool>> {
        if self.shared.read_only {
            return Err(Error::InvalidConfig(
                "the store is open read-only (for inspection); open it with Store::open to change it".into(),
            ));
        }
        let sb0 = &self.shared.superblocks[0];
        let limit = delete_many_limit(sb0.journal_bytes, sb0.block_size as u64);
        if ids.len() > limit {
            return Err(Error::InvalidConfig(format!(
                "delete_many takes at most {limit} ids (one journal batch of this store), not {}; split the call",
                ids.len()
            )));
        }
        if ids.is_empty() {
            return Ok(Vec::new());
        }
        if self.shared.closed.load(Ordering::Acquire) {
            return Err(Error::Closed);
        }
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        let message = CommitMsg::DeleteMany { ids: ids.to_vec(), reply: tx };
        let sent = self.shared.commit_tx.lock().expect("commit").as_ref().map(|c| c.send(message));
        if !matches!(sent, Some(Ok(()))) {
            return Err(Error::Closed);
        }
        let existed = rx.recv().map_err(|_| Error::Closed)??;
        self.shared.op_counters.lock().expect("op counters").deletes += existed.iter().filter(|&&e| e).count() as u64;
        Ok(existed)
    }
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
    /// The store epoch batches and checkpoints are written in (after recovery: the newest one
    /// they record).
    pub epoch: u64,
    /// The store uuid, which every header's crc covers.
    pub store: [u8; 16],
    /// Format version 3 and later: the batches of each generation go in their own half of the
    /// ring (`region`), so the batches after the older checkpoint outlive the newer one's
    /// writing. Version 2: one region, the whole ring, for every generation.
    pub split: bool,
}

impl JournalState {
    fn slot_offset(&self, generation: u64) -> u64 {
        self.metadata_start + (generation % 2) * self.slot_bytes
    }
    fn journal_offset(&self) -> u64 {
        self.metadata_start + 2 * self.slot_bytes
    }

    /// Where the batches of `batch_generation` go: (offset in the ring, bytes).
    pub(crate) fn region(&self, batch_generation: u64) -> (u64, u64) {
        if self.split {
            let half = crate::layout::codec::round_down(self.journal_bytes / 2, self.block_size);
            ((batch_generation % 2) * half, half)
        } else {
            (0, self.journal_bytes)
        }
    }

    /// The most bytes one batch may take before padding: it must fit its region (or, for
    /// format version 2, half the ring).
    fn batch_limit(&self) -> usize {
        if self.split {
            self.region(0).1 as usize
        } else {
            (self.journal_bytes / 2).max(self.block_size) as usize
        }
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
    /// checkpoint. First every device's superblocks move to the next store epoch, which the
    /// checkpoint records: a device put back from a copy older than this is then found at open.
    pub(crate) fn checkpoint(&self, journal: &mut JournalState) -> Result<()> {
        self.checkpoint_with(journal, &[])
    }

    /// `checkpoint` of the table with `changes` applied on top (not yet applied in memory): once
    /// its header is durable, the checkpoint commits them.
    fn checkpoint_with(&self, journal: &mut JournalState, changes: &[TableChange]) -> Result<()> {
        let epoch = journal.epoch + 1;
        let bytes = {
            let table = self.table.read().expect("table");
            let mut records: std::collections::BTreeMap<u64, &ObjectRecord> =
                table.values().map(|o| (o.record.id, &o.record)).collect();
            for change in changes {
                match change {
                    TableChange::Put(r) => records.insert(r.id, r),
                    TableChange::Delete { id } => records.remove(id),
                };
            }
            let payload_bytes: u64 = records.values().map(|r| r.encoded_bytes()).sum();
            let needed = checkpoint_bytes(payload_bytes, journal.block_size);
            if needed > journal.slot_bytes {
                return Err(Error::TableFull { detail: table_full_detail(needed, journal.slot_bytes, records.len()) });
            }
            encode_checkpoint(&journal.store, journal.generation + 1, epoch, records.into_values(), journal.block_size)
        };
        debug_assert!(bytes.len() as u64 <= journal.slot_bytes);
        super::identity::write_epoch(self, epoch)?;
        journal.epoch = epoch;
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

/// Bytes of a checkpoint whose records take `payload_bytes`: header and payload, padded.
pub(crate) fn checkpoint_bytes(payload_bytes: u64, block_size: u64) -> u64 {
    crate::layout::codec::round_up(HEADER_BYTES as u64 + payload_bytes, block_size)
}

/// What a `TableFull` error says when the table would outgrow a checkpoint slot: the limit, and
/// what frees room in it.
fn table_full_detail(needed_bytes: u64, slot_bytes: u64, objects: usize) -> String {
    format!(
        "a checkpoint of the table would need {needed_bytes} bytes with {objects} object(s), and a checkpoint slot \
         holds {slot_bytes}. The limit is the table (object count and caller metadata), not data space: delete \
         objects or put them again with less caller metadata (deletes and overwrites that shrink the table always \
         succeed), or copy the objects into a store formatted with larger checkpoint slots \
         (`teraio format --checkpoint-slot-bytes`, FormatConfig::checkpoint_slot_bytes)"
    )
}

/// The commit thread: group commit until the channel closes, then a final checkpoint.
pub(crate) fn run_commit(shared: Arc<Shared>, rx: Receiver<CommitMsg>, mut journal: JournalState) {
    let batch_limit = journal.batch_limit();
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
    if journal.position > 0 && !shared.read_only {
        if let Err(e) = shared.checkpoint(&mut journal) {
            tracing::error!(error = %e, "final checkpoint at close failed; the journal will be replayed at open");
        }
    }
}

fn commit_batch(shared: &Arc<Shared>, journal: &mut JournalState, messages: Vec<CommitMsg>, batch_limit: usize) {
    let mut changes: Vec<TableChange> = Vec::new();
    let mut puts: Vec<Arc<Op>> = Vec::new();
    let mut deletes: Vec<(Vec<u64>, DeleteReply)> = Vec::new();
    let mut checkpoints = Vec::new();
    let mut flush_mask = 0u64;
    let mut size = HEADER_BYTES;
    let mut leftover = Vec::new();
    // The table's record bytes as this batch leaves it: a put that would grow it past what a
    // checkpoint slot holds fails, so every checkpoint fits and deletes can always commit.
    let mut table_bytes = shared.table_bytes.load(Ordering::Relaxed);
    let mut batch_records: HashMap<u64, u64> = HashMap::new();
    let record_bytes_now = |batch_records: &HashMap<u64, u64>, id: u64| -> u64 {
        batch_records
            .get(&id)
            .copied()
            .unwrap_or_else(|| shared.table.read().expect("table").get(&id).map_or(0, |o| o.record.encoded_bytes()))
    };
    for m in messages {
        let delete_bytes = match &m {
            CommitMsg::DeleteMany { ids, .. } => 9 * ids.len(),
            _ => 0,
        };
        // A batch of many deletes starts a batch of its own when it would not fit this one.
        if size > batch_limit || (size > HEADER_BYTES && size + delete_bytes > batch_limit) {
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
                            detail: format!(
                                "this object's record needs {} journal bytes and one journal batch holds at most {} \
                                 (half the journal); put it with less caller metadata, or copy the objects into a \
                                 store formatted with a larger journal (FormatConfig::journal_bytes)",
                                e.bytes.len(),
                                batch_limit - HEADER_BYTES
                            ),
                        }),
                    );
                    continue;
                }
                let TableChange::Put(record) = &change else { unreachable!("a put's change") };
                let (before, after) = (record_bytes_now(&batch_records, record.id), record.encoded_bytes());
                let grown = table_bytes - before + after;
                let needed = checkpoint_bytes(grown, journal.block_size);
                if after > before && needed > journal.slot_bytes {
                    object.lock().expect("put object").take();
                    let objects = shared.table.read().expect("table").len() + usize::from(before == 0);
                    let detail = table_full_detail(needed, journal.slot_bytes, objects);
                    shared.finish_op(&op, Err(Error::TableFull { detail }));
                    continue;
                }
                table_bytes = grown;
                batch_records.insert(record.id, after);
                size += e.bytes.len();
                if shared.config.durable {
                    flush_mask |= op.devices_written.load(std::sync::atomic::Ordering::Relaxed);
                }
                changes.push(change);
                puts.push(op);
            }
            CommitMsg::Delete { .. } | CommitMsg::DeleteMany { .. } => {
                let (ids, reply) = match m {
                    CommitMsg::Delete { id, reply } => (vec![id], DeleteReply::One(reply)),
                    CommitMsg::DeleteMany { ids, reply } => (ids, DeleteReply::Many(reply)),
                    _ => unreachable!("a delete"),
                };
                for &id in &ids {
                    let in_batch = changes.iter().any(|c| matches!(c, TableChange::Put(r) if r.id == id));
                    if in_batch || shared.table.read().expect("table").contains_key(&id) {
                        size += 9;
                        table_bytes -= record_bytes_now(&batch_records, id);
                        batch_records.insert(id, 0);
                        changes.push(TableChange::Delete { id });
                    }
                }
                deletes.push((ids, reply));
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
            shared.table_bytes.store(table_bytes, Ordering::Relaxed);
            for op in &puts {
                shared.finish_op(op, Ok(()));
            }
            for (ids, reply) in deletes {
                reply.send(&ids, Ok(&existed));
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
            for (ids, reply) in deletes {
                reply.send(&ids, Err(e.clone()));
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
    let bytes = encode_batch(
        &journal.store,
        journal.generation + 1,
        journal.sequence,
        journal.epoch,
        changes,
        journal.block_size,
    );
    let (base, region_bytes) = journal.region(journal.generation + 1);
    if journal.position + bytes.len() as u64 > region_bytes {
        // No room in the region: checkpoint the table as it is (it fits: puts are held to the
        // slot), then journal the batch after the new checkpoint. Every change is journaled, so
        // recovery from the older checkpoint finds it too, or (format version 2, whose one region
        // the newer batches overwrite) refuses rather than lose it.
        match shared.checkpoint(journal) {
            Ok(()) => return write_batch(shared, journal, changes, 0),
            Err(Error::TableFull { .. }) if !journal.split => {
                // A version 2 store whose table outgrew a slot under a release that did not hold
                // it to one: the checkpoint of the table with this batch applied commits it, so
                // that deletes that bring the table under the slot commit. The batch is then
                // journaled too (replaying it over that checkpoint changes nothing), so that a
                // fallback to the older checkpoint sees the newer generation and refuses.
                shared.checkpoint_with(journal, changes).map_err(|e| match e {
                    Error::TableFull { detail } => Error::TableFull {
                        detail: format!(
                            "{detail}. This store's table already exceeds a slot (filled by an earlier release) and its \
                             journal is full: deletes commit only as a batch that brings the table under the slot, so \
                             delete enough objects in one call (Store::delete_many)"
                        ),
                    },
                    other => other,
                })?;
                if let Err(e) = write_batch(shared, journal, changes, 0) {
                    tracing::warn!(error = %e, "journaling a batch its checkpoint already holds failed");
                }
                return Ok(());
            }
            Err(e) => return Err(e),
        }
    }
    shared.write_metadata(journal.journal_offset() + base + journal.position, &bytes)?;
    if shared.config.durable {
        shared.flush_devices(1)?;
    }
    journal.position += bytes.len() as u64;
    journal.sequence += 1;
    Ok(())
}

/// What to do about damaged metadata on device 0, said after every such error (with `FSCK_HINT`).
pub(crate) const RESTORE_DEVICE0: &str =
    "restore device 0 from a copy taken together with the other devices, or re-create the store from its sources";
/// Where to see the rest: open stops at the first damage, fsck lists all (fsck's own report drops it).
pub(crate) const FSCK_HINT: &str = "; `teraio fsck` lists every damaged part and writes nothing";

/// Why replay stopped where it did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stop {
    /// Zeros or an older generation's bytes: the end of the log.
    End,
    /// A batch that was started there but does not check out: torn, or damaged.
    Unreadable,
    /// The expected batch's header, damaged (its identity intact, its checksum failing).
    DamagedHeader,
}

/// What recovery saw besides the table: damage it recovered from without loss (problems for
/// fsck) and the harmless remains of interrupted writes (notes).
#[derive(Debug, Clone, Default)]
pub(crate) struct Findings {
    pub problems: Vec<String>,
    pub notes: Vec<String>,
    /// The newest checkpoint is damaged (recovered from the older one): a new checkpoint fixes it.
    pub checkpoint_damaged: bool,
}

/// Rebuilds the table from device 0: the newest valid checkpoint plus its journal batches, and
/// the newest store epoch they record (in `JournalState::epoch`). Reads only. Journal batches carry
/// the generation of the checkpoint they follow plus one.
///
/// A batch that does not check out ends the log only when no valid batch of its generation lies
/// after it: batches are written one after the other, each after the previous one is durable, so
/// an interrupted write is always the last one. A damaged batch with valid ones after it is
/// damage, and dropping it would lose acknowledged changes: that is an error, never skipped.
pub(crate) fn recover(
    device0: &Device,
    sb0: &Superblock,
    geometry: &Geometry,
    findings: &mut Findings,
) -> Result<(Vec<ObjectRecord>, JournalState)> {
    let block = sb0.block_size as u64;
    let path = device0.path.display().to_string();
    let mut journal = JournalState {
        metadata_start: sb0.metadata_start,
        slot_bytes: sb0.checkpoint_slot_bytes,
        journal_bytes: sb0.journal_bytes,
        block_size: block,
        generation: 0,
        sequence: 0,
        position: 0,
        epoch: 0,
        store: sb0.store_uuid,
        split: sb0.format_version >= 3,
    };
    let read = |offset: u64, len: u64| -> Result<AlignedBuf> {
        let mut buf = AlignedBuf::new(len as usize, block as usize)?;
        device0.read_exact_at(&mut buf, offset)?;
        Ok(buf)
    };
    // Newest checkpoint whose header and payload both check out.
    let mut candidates = Vec::new();
    let mut unreadable_slots = Vec::new();
    let mut slot_headers = Vec::with_capacity(2);
    for slot in 0..2u64 {
        let offset = sb0.metadata_start + slot * sb0.checkpoint_slot_bytes;
        let header_block = read(offset, block)?;
        slot_headers.push(header_block[..HEADER_BYTES].to_vec());
        match decode_checkpoint_header(&header_block, &sb0.store_uuid) {
            Some(h)
                if h.generation % 2 == slot && HEADER_BYTES as u64 + h.payload_bytes <= sb0.checkpoint_slot_bytes =>
            {
                candidates.push((h, slot, offset));
            }
            Some(h) => findings.problems.push(format!(
                "{path}: checkpoint slot {slot} (offset {offset}) holds a header of generation {} with {} payload \
                 bytes, which cannot belong there",
                h.generation, h.payload_bytes
            )),
            None if header_block.iter().all(|&b| b == 0) => {}
            // Said once the chosen checkpoint tells whether this was the newer one.
            None => unreadable_slots.push((slot, offset)),
        }
    }
    candidates.sort_by_key(|(h, _, _)| std::cmp::Reverse(h.generation));
    let mut chosen = None;
    let mut failures = Vec::new();
    for (i, (h, slot, offset)) in candidates.iter().enumerate() {
        let total = crate::layout::codec::round_up(HEADER_BYTES as u64 + h.payload_bytes, block);
        let bytes = read(*offset, total)?;
        let payload = &bytes[HEADER_BYTES..HEADER_BYTES + h.payload_bytes as usize];
        match decode_checkpoint_payload(h, payload, sb0.device_count) {
            Ok(records) => {
                chosen = Some((*h, records));
                break;
            }
            Err(e) => {
                let e = match e {
                    Error::CorruptMetadata { detail } => detail,
                    other => other.to_string(),
                };
                let what = format!("checkpoint generation {} in slot {slot} (offset {offset})", h.generation);
                failures.push(format!("{what}: {e}"));
                if i == 0 {
                    // Its header is written last, after the rest is durable: a valid header over a
                    // bad payload is damage, not an interrupted write.
                    findings.checkpoint_damaged = true;
                    findings.problems.push(format!("{path}: the newest {what} is damaged: {e}"));
                } else {
                    findings.notes.push(format!(
                        "{path}: the older {what} does not check out (a newer checkpoint was being written over it)"
                    ));
                }
            }
        }
    }
    let Some((header, records)) = chosen else {
        let seen =
            if failures.is_empty() { "neither slot holds a valid header".to_string() } else { failures.join("; ") };
        return Err(Error::CorruptMetadata {
            detail: format!(
                "device 0 ({path}) has no readable checkpoint ({seen}), so the object table cannot be rebuilt; \
                 {RESTORE_DEVICE0}{FSCK_HINT}"
            ),
        });
    };
    let generation = header.generation;
    journal.generation = generation;
    journal.epoch = header.epoch;
    let mut table: HashMap<u64, ObjectRecord> = records.into_iter().map(|r| (r.id, r)).collect();
    let slot_damage = newest_slot_damage(&read, sb0, generation, &path)?;
    for (slot, offset) in unreadable_slots {
        if slot != (generation + 1) % 2 || slot_damage.is_none() {
            findings.notes.push(format!(
                "{path}: checkpoint slot {slot} (offset {offset}) holds no valid header (an interrupted \
                 checkpoint write, or damage to a checkpoint no longer needed)"
            ));
        }
    }

    // Replay the batches that follow the chosen checkpoint, in sequence, up to the first that
    // does not check out.
    let mut replay = Replay { device0, sb0, path: &path, table: &mut table, journal: &mut journal };
    let mut stop = replay.generation(generation + 1)?;
    // With a journal region per generation, the batches after a newer checkpoint that cannot be
    // read are still there: replay them too (that checkpoint held exactly the table replayed so
    // far, since it was written once every batch before it was durable).
    let lost_newer = journal.split
        && find_later_batch(device0, sb0, journal.region(generation + 2), 0, generation + 2, u64::MAX)?.is_some();
    let mut replay = Replay { device0, sb0, path: &path, table: &mut table, journal: &mut journal };
    if lost_newer {
        if let Some((reason, kind, at)) = &stop {
            if *kind != Stop::End {
                return Err(Error::CorruptMetadata {
                    detail: format!(
                        "device 0 ({path}): journal batch {} of generation {} at offset {at} is damaged ({reason}), \
                         and batches of generation {} follow it: skipping it would silently lose acknowledged puts \
                         and deletes, so the store was not opened and nothing was written; {RESTORE_DEVICE0}{FSCK_HINT}",
                        replay.journal.sequence,
                        generation + 1,
                        generation + 2
                    ),
                });
            }
        }
        stop = replay.generation(generation + 2)?;
    }
    // A reader beside a writer may have read the slots just before the writer's next
    // checkpoint, and then a journal region the writer went on to fill: if a slot header changed
    // meanwhile, the store moved on while it was read, which is no damage (`open_read_only`
    // looks again). A writer's open holds the store alone: its slots never change here.
    for (slot, before) in slot_headers.iter().enumerate() {
        let offset = sb0.metadata_start + slot as u64 * sb0.checkpoint_slot_bytes;
        if read(offset, block)?[..HEADER_BYTES] != before[..] {
            return Err(Error::CorruptMetadata {
                detail: format!(
                    "device 0 ({path}): checkpoint slot {slot} changed while the metadata was read (a writer \
                     holds the store and wrote a checkpoint); read it again"
                ),
            });
        }
    }
    if lost_newer || slot_damage.is_some() || findings.checkpoint_damaged {
        let what = if findings.checkpoint_damaged {
            // Its payload: said by the choice of checkpoint above.
            findings.problems.pop().expect("the damaged newest checkpoint's problem")
        } else if let Some(damage) = slot_damage {
            damage
        } else {
            format!("{path}: the newest checkpoint, generation {}, is unreadable", generation + 1)
        };
        let replayed = if lost_newer {
            format!("the journal after it and the journal after generation {}", generation + 1)
        } else {
            "the journal after it".into()
        };
        findings.problems.push(format!(
            "{what}; recovered without loss from generation {generation} and {replayed} (a writer's open, or fsck \
             --repair, writes a new checkpoint over it)"
        ));
        findings.checkpoint_damaged = true;
        if lost_newer {
            // The next checkpoint goes over the damaged slot, with a generation of its own, before
            // any batch: a batch now would land in the region of the batches just replayed.
            journal.generation = generation + 2;
            journal.sequence = 0;
            journal.position = journal.region(generation + 3).1;
        }
    }
    if let Some((reason, kind, at)) = stop {
        match kind {
            Stop::End => {}
            // A header sector is written whole: one whose identity survived is damage.
            Stop::DamagedHeader => findings.problems.push(format!(
                "{path}: the last journal batch {} at offset {at} is damaged ({reason}): it was written whole, so it \
                 may have held acknowledged puts and deletes, and they are not in the store; {RESTORE_DEVICE0} if \
                 they matter (a writer's next batch overwrites it)",
                journal.sequence
            )),
            Stop::Unreadable => findings.notes.push(format!(
                "{path}: the journal ends in batch {} at offset {at}, which does not check out ({reason}): a write \
                 interrupted by a crash (then not yet acknowledged), or damage to the last batch (then it may have held \
                 acknowledged puts and deletes); the two cannot be told apart, and its changes are not in the store",
                journal.sequence
            )),
        }
    }
    let mut records: Vec<ObjectRecord> = table.into_values().collect();
    records.sort_by_key(|r| r.id);
    for r in &records {
        geometry.validate(r).map_err(|e| with_advice(e, &path))?;
    }
    Ok((records, journal))
}

/// The checkpoint slot that would hold generation `chosen + 1`, when it holds a damaged header
/// that is that newer checkpoint's (its generation field says so; a header is written whole, so
/// this is damage, not an interrupted write): the problem line. A header left by the checkpoint
/// before `chosen`, or zeros, is none.
fn newest_slot_damage(
    read: &dyn Fn(u64, u64) -> Result<AlignedBuf>,
    sb0: &Superblock,
    chosen: u64,
    path: &str,
) -> Result<Option<String>> {
    let slot = (chosen + 1) % 2;
    let offset = sb0.metadata_start + slot * sb0.checkpoint_slot_bytes;
    let header = read(offset, sb0.block_size as u64)?;
    if decode_checkpoint_header(&header, &sb0.store_uuid).is_some() {
        return Ok(None);
    }
    let generation_field = u64::from_le_bytes(header[8..16].try_into().expect("8 bytes"));
    let magic_ok = header[..8] == crate::layout::metadata::CHECKPOINT_MAGIC;
    Ok((generation_field == chosen + 1 || (magic_ok && generation_field != chosen.wrapping_sub(1))).then(|| {
        format!(
            "{path}: the newest checkpoint's header in slot {slot} (offset {offset}) is damaged (its checksum \
             fails; it names generation {generation_field})"
        )
    }))
}

/// Replays one generation's journal batches into a table.
struct Replay<'a> {
    device0: &'a Device,
    sb0: &'a Superblock,
    path: &'a str,
    table: &'a mut HashMap<u64, ObjectRecord>,
    journal: &'a mut JournalState,
}

impl Replay<'_> {
    /// Replays the batches of `batch_generation` from the start of its journal region, in
    /// sequence, until one does not check out; `journal` ends after the last one replayed. A
    /// damaged batch with a valid one of this generation (or a newer one) after it in the region
    /// is an error; otherwise returns why replay stopped (`None`: at the region's end).
    fn generation(&mut self, batch_generation: u64) -> Result<Option<(String, Stop, u64)>> {
        let (sb0, path) = (self.sb0, self.path);
        let block = sb0.block_size as u64;
        let journal_start = sb0.metadata_start + 2 * sb0.checkpoint_slot_bytes;
        let (base, region_bytes) = self.journal.region(batch_generation);
        self.journal.position = 0;
        self.journal.sequence = 0;
        let read = |offset: u64, len: u64| -> Result<AlignedBuf> {
            let mut buf = AlignedBuf::new(len as usize, block as usize)?;
            self.device0.read_exact_at(&mut buf, offset)?;
            Ok(buf)
        };
        let stop: Option<(String, Stop)> = loop {
            let position = self.journal.position;
            if position + block > region_bytes {
                break None;
            }
            let head = read(journal_start + base + position, block)?;
            let Some(h) = decode_batch_header(&head, &sb0.store_uuid) else {
                if is_damaged_batch_header(&head, batch_generation, self.journal.sequence) {
                    break Some((
                        "its header is damaged: its magic, generation and sequence are there but its checksum fails"
                            .into(),
                        Stop::DamagedHeader,
                    ));
                }
                // Zeros, or the middle of an older batch: the end of the log.
                break Some(("no valid batch header".into(), Stop::End));
            };
            if h.generation > batch_generation && position == 0 {
                return Err(Error::CorruptMetadata {
                    detail: format!(
                        "device 0 ({path}): the journal follows checkpoint generation {} but only generation {} is \
                         readable, so the newest checkpoint is lost{}; {RESTORE_DEVICE0}{FSCK_HINT}",
                        h.generation - 1,
                        batch_generation - 1,
                        if self.journal.split {
                            ""
                        } else {
                            " (a store of format version 2 keeps one journal region for every generation; version 3 \
                             keeps the journal after the older checkpoint too, and recovers from this)"
                        }
                    ),
                });
            }
            if h.generation != batch_generation {
                // A batch of an older generation: what the region held before.
                break Some(("the ring holds an older generation's batch there".into(), Stop::End));
            }
            if h.sequence != self.journal.sequence {
                break Some((format!("a batch header with sequence {} stands there", h.sequence), Stop::Unreadable));
            }
            let total = h.padded_bytes(block);
            if position + total > region_bytes {
                break Some((format!("the batch claims {total} bytes, past the end of its region"), Stop::Unreadable));
            }
            let bytes = if total == block { head } else { read(journal_start + base + position, total)? };
            let payload = &bytes[HEADER_BYTES..HEADER_BYTES + h.payload_bytes as usize];
            let Some(changes) = decode_batch_payload(&h, payload, sb0.device_count) else {
                break Some(("its payload does not check out".into(), Stop::Unreadable));
            };
            for change in changes {
                match change {
                    TableChange::Put(r) => {
                        self.table.insert(r.id, r);
                    }
                    TableChange::Delete { id } => {
                        self.table.remove(&id);
                    }
                }
            }
            self.journal.epoch = self.journal.epoch.max(h.epoch);
            self.journal.position += total;
            self.journal.sequence += 1;
        };
        let Some((reason, kind)) = stop else { return Ok(None) };
        let at = journal_start + base + self.journal.position;
        let later = find_later_batch(
            self.device0,
            sb0,
            (base, region_bytes),
            self.journal.position,
            batch_generation,
            self.journal.sequence,
        )?;
        if let Some((later_offset, later)) = later {
            // `later` at the stop itself is a batch of this generation out of sequence.
            return Err(Error::CorruptMetadata {
                detail: format!(
                    "device 0 ({path}): journal batch {} of generation {batch_generation} at offset {at} is damaged \
                     ({reason}), yet the valid batch {} of generation {} follows at offset {}: skipping the damaged \
                     batch would silently lose acknowledged puts and deletes, so the store was not opened and \
                     nothing was written; {RESTORE_DEVICE0}{FSCK_HINT}",
                    self.journal.sequence,
                    later.sequence,
                    later.generation,
                    journal_start + base + later_offset
                ),
            });
        }
        Ok(Some((reason, kind, at)))
    }
}

/// The first valid batch header at or after `from` in the journal region `(base, bytes)` that
/// belongs to `generation` or a newer one, skipping a header of `generation` at `from` itself
/// only when it carries the expected `sequence` (then it is the batch that failed). Offsets are
/// within the region. Reads it in large pieces.
fn find_later_batch(
    device0: &Device,
    sb0: &Superblock,
    (base, region_bytes): (u64, u64),
    from: u64,
    generation: u64,
    sequence: u64,
) -> Result<Option<(u64, crate::layout::metadata::BatchHeader)>> {
    const PIECE: u64 = 4 << 20;
    let block = sb0.block_size as u64;
    let region_start = sb0.metadata_start + 2 * sb0.checkpoint_slot_bytes + base;
    let piece = crate::layout::codec::round_down(PIECE, block).max(block);
    let mut at = from;
    while at + block <= region_bytes {
        let len = piece.min(crate::layout::codec::round_down(region_bytes - at, block));
        let mut buf = AlignedBuf::new(len as usize, block as usize)?;
        device0.read_exact_at(&mut buf, region_start + at)?;
        for (i, b) in buf.chunks_exact(block as usize).enumerate() {
            let offset = at + i as u64 * block;
            let Some(h) = decode_batch_header(b, &sb0.store_uuid) else { continue };
            if offset == from && h.generation == generation && h.sequence == sequence {
                continue;
            }
            if h.generation >= generation {
                return Ok(Some((offset, h)));
            }
        }
        at += len;
    }
    Ok(None)
}

/// Adds the restore advice to a record-level metadata error found during recovery.
pub(crate) fn with_advice(e: Error, device0: &str) -> Error {
    match e {
        Error::CorruptMetadata { detail } => {
            Error::CorruptMetadata { detail: format!("device 0 ({device0}): {detail}; {RESTORE_DEVICE0}{FSCK_HINT}") }
        }
        other => other,
    }
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
