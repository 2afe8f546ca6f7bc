//! The host data API: put, get, delete, checkpoint, stat and list, and the one raw op path that
//! every put and get (host or GPU memory) goes through.

use super::commit::CommitMsg;
use super::object::Object;
use super::op::{Op, OpKind, OpObject, OpSpec, Target};
use super::ticket::{Completion, IoBuf, IoBufMut, Ticket};
use super::Store;
use crate::buffer::AlignedBuf;
use crate::cuda::handoff::Handoff;
use crate::cuda::{DeviceSlice, RawEvent};
use crate::error::{Error, Result};
use crate::layout::codec::{round_down, round_up};
use crate::layout::table::ObjectRecord;
use crate::queue::Priority;
use std::sync::atomic::Ordering;
use std::sync::mpsc::sync_channel;
use std::sync::{Arc, Mutex};

/// What `stat` and `list` tell about an object.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ObjectInfo {
    pub id: u64,
    pub len_bytes: u64,
    pub meta: Vec<u8>,
    /// Devices the object is striped over, in stripe order.
    pub devices: Vec<u16>,
    pub extent_count: usize,
}

impl Store {
    pub(super) fn check_writable(&self) -> Result<()> {
        if self.shared.read_only {
            return Err(Error::InvalidConfig(
                "the store is open read-only (for inspection): puts, deletes and checkpoints are refused; open it for writing to change it".into(),
            ));
        }
        Ok(())
    }

    pub(super) fn check_meta(&self, meta: &[u8]) -> Result<()> {
        let max = self.shared.superblocks[0].max_meta_bytes as usize;
        if meta.len() > max {
            return Err(Error::MetadataTooLarge { len: meta.len(), max });
        }
        Ok(())
    }

    /// Starts writing `data` as object `id` (replacing any object of that id once durable).
    /// The ticket hands `data` back when the put is acknowledged: durable and visible to gets.
    pub fn put<B: IoBuf>(&self, id: u64, data: B, meta: &[u8], priority: Priority) -> Result<Ticket<B>> {
        let memory = Memory::Host { ptr: data.io_ptr() as usize, len: data.io_len() };
        // SAFETY: the ticket owns `data`, so the memory outlives the op.
        let started = unsafe { self.start_put(PutSpec { id, meta, priority }, memory)? };
        Ok(Ticket { completion: started.completion, buffer: Some(data) })
    }

    /// `put` from raw memory (for the C ABI and Python).
    ///
    /// # Safety
    /// `ptr` must be valid for reads of `len` bytes, unchanged, until the returned ticket is done.
    pub unsafe fn put_raw_ticket(
        &self,
        id: u64,
        ptr: *const u8,
        len: usize,
        meta: &[u8],
        priority: Priority,
    ) -> Result<Ticket<()>> {
        // SAFETY: forwarded contract.
        let started =
            unsafe { self.start_put(PutSpec { id, meta, priority }, Memory::Host { ptr: ptr as usize, len })? };
        Ok(Ticket { completion: started.completion, buffer: Some(()) })
    }

    /// Starts reading the whole of object `id` into `buf`, which may be longer than the object
    /// (the rest is left untouched) but not shorter.
    pub fn get<B: IoBufMut>(&self, id: u64, mut buf: B, priority: Priority) -> Result<Ticket<B>> {
        let memory = Memory::Host { ptr: buf.io_mut_ptr() as usize, len: buf.io_len() };
        // SAFETY: the ticket owns `buf`.
        let started = unsafe { self.start_get(GetSpec { id, offset: 0, whole: true, priority }, memory)? };
        Ok(Ticket { completion: started.completion, buffer: Some(buf) })
    }

    /// Starts reading `buf.len()` bytes of object `id` from byte `offset` into `buf`.
    pub fn get_range<B: IoBufMut>(&self, id: u64, offset: u64, mut buf: B, priority: Priority) -> Result<Ticket<B>> {
        let memory = Memory::Host { ptr: buf.io_mut_ptr() as usize, len: buf.io_len() };
        // SAFETY: the ticket owns `buf`.
        let started = unsafe { self.start_get(GetSpec { id, offset, whole: false, priority }, memory)? };
        Ok(Ticket { completion: started.completion, buffer: Some(buf) })
    }

    /// `get_range` into raw memory (for the C ABI and Python). With `whole`, `len` may exceed the
    /// object and only the object's bytes are read.
    ///
    /// # Safety
    /// `ptr` must be valid for writes of `len` bytes, and not otherwise accessed, until the
    /// returned ticket is done.
    pub unsafe fn get_raw_ticket(
        &self,
        id: u64,
        offset: u64,
        ptr: *mut u8,
        len: usize,
        whole: bool,
        priority: Priority,
    ) -> Result<Ticket<()>> {
        let memory = Memory::Host { ptr: ptr as usize, len };
        // SAFETY: forwarded contract.
        let started = unsafe { self.start_get(GetSpec { id, offset, whole, priority }, memory)? };
        Ok(Ticket { completion: started.completion, buffer: Some(()) })
    }

    /// The one way a put starts, from host or GPU memory: checks it, allocates its object and
    /// queues it.
    ///
    /// # Safety
    /// `memory` must be valid for reads, unchanged, until the op is done (GPU memory with an event:
    /// from the event's completion on), and its event, if any, live for this call.
    pub(super) unsafe fn start_put(&self, spec: PutSpec, memory: Memory) -> Result<Started> {
        self.check_writable()?;
        // SAFETY: forwarded contract (`memory` includes its event).
        let target = unsafe { self.target(memory)? };
        self.check_meta(spec.meta)?;
        self.shared.op_started()?;
        let len = memory.len() as u64;
        let object = self.allocate(spec.id, len, spec.meta).inspect_err(|_| self.shared.op_finished())?;
        // A GPU put's bytes are on the host only inside bounce chunks: its checksums come from
        // there, and objects put through cuFile keep none (docs/gpu.md). A host put's come from
        // the caller's buffer as it is dispatched.
        let take_crcs = matches!(&target, Target::Gpu { gpu, .. } if !gpu.use_cufile) && self.shared.geometry.checksums;
        let op = OpSpec {
            kind: OpKind::Put,
            id: spec.id,
            priority: spec.priority,
            user_start: 0,
            user_end: len,
            take_crcs,
            checked: (0, 0),
        };
        let padded = round_up(len, self.shared.geometry.block_size);
        Ok(self.start(Op::new(op, OpObject::Put(Mutex::new(Some(object))), target), 0, padded))
    }

    /// The one way a get starts, into host or GPU memory: finds the object, checks the range and
    /// queues the op.
    ///
    /// # Safety
    /// `memory` must be valid for writes, and not otherwise accessed, until the op is done (GPU
    /// memory with an event: from the event's completion on), and its event, if any, live for
    /// this call.
    pub(super) unsafe fn start_get(&self, spec: GetSpec, memory: Memory) -> Result<Started> {
        let object = self.current_version(spec.id)?;
        // SAFETY: forwarded contract.
        unsafe { self.start_get_of(object, spec, memory) }
    }

    /// The version of object `id` that is current now, held: while the `Arc` lives its extents
    /// are not reused (see `Object`), so a get of it reads that version alone, whatever puts
    /// and deletes of the id land meanwhile.
    fn current_version(&self, id: u64) -> Result<Arc<Object>> {
        self.shared.table.read().expect("table").get(&id).cloned().ok_or(Error::NotFound { id })
    }

    /// `start_get` of a version already looked up: its length, the range check and the bytes
    /// read all come from `object`.
    ///
    /// # Safety
    /// As `start_get`.
    unsafe fn start_get_of(&self, object: Arc<Object>, spec: GetSpec, memory: Memory) -> Result<Started> {
        let GetSpec { id, offset, whole, priority } = spec;
        assert_eq!(object.record.id, id, "a get reads a version of its own id");
        let (object_len, len) = (object.record.len_bytes, memory.len() as u64);
        let end = if whole && offset == 0 {
            if len < object_len {
                return Err(Error::BufferTooSmall { needed_bytes: object_len, given_bytes: len });
            }
            object_len
        } else {
            let end = offset.saturating_add(len);
            if end > object_len {
                return Err(Error::RangeOutOfBounds { id, offset, len, object_len });
            }
            end
        };
        // SAFETY: forwarded contract (`memory` includes its event).
        let target = unsafe { self.target(memory)? };
        self.shared.op_started()?;
        // On the cuFile path the bytes never pass through host memory: nothing to check them
        // in (the GPU report and docs/gpu.md say so).
        let via_host = !matches!(&target, Target::Gpu { gpu, .. } if gpu.use_cufile);
        let span = self.get_span(&object, offset, end, via_host);
        let op = OpSpec {
            kind: OpKind::Get,
            id,
            priority,
            user_start: offset,
            user_end: end,
            take_crcs: span.verify,
            checked: span.checked,
        };
        Ok(self.start(Op::new(op, OpObject::Get(object), target), span.read.0, span.read.1))
    }

    /// Where `memory` is, as an op sees it (for GPU memory: the device's state and path).
    ///
    /// # Safety
    /// A GPU memory's `after` event, if any, must be live for this call's length.
    unsafe fn target(&self, memory: Memory) -> Result<Target> {
        match memory {
            Memory::Host { ptr, .. } => Ok(Target::Host(ptr)),
            Memory::Gpu { slice, after } => {
                // SAFETY: forwarded contract.
                let gpu = unsafe { self.gpu_op(slice, after)? };
                Ok(Target::Gpu { ptr: slice.ptr, gpu })
            }
        }
    }

    /// Queues `op` for object bytes `start..end` (block-aligned); a GPU op with an event to start
    /// after is queued by the device's gate once the event has completed.
    fn start(&self, mut op: Op, start: u64, end: u64) -> Started {
        let handoff = op.gpu.as_ref().and_then(|g| {
            g.handoff.map(|slot| Handoff { flags: g.device.handoff.clone(), slot, unissued: g.unissued.clone() })
        });
        let gated = op.gpu.as_mut().and_then(|g| g.after.take().map(|mark| (g.device.clone(), mark)));
        let op = Arc::new(op);
        let started = Started { completion: op.completion.clone(), handoff };
        match gated {
            None => self.shared.enqueue(op, start, end),
            Some((device, mark)) => {
                let shared = self.shared.clone();
                device.gate.pass(
                    mark,
                    Box::new(move |passed| match passed {
                        Ok(()) => shared.enqueue(op, start, end),
                        Err(e) => {
                            // Nothing was queued: the op's own hold is its last request.
                            op.set_error(e);
                            shared.request_done(&op);
                        }
                    }),
                );
            }
        }
        started
    }

    /// What a get of object bytes `offset..end` reads and checks. Checks need a store that keeps
    /// checksums, `verify_checksums`, and bytes that pass through host memory. A checksum covers
    /// a whole stripe unit, so every unit the range covers whole is checked; a unit it covers
    /// only in part (at either end) is read whole (the rest into bounce memory) and checked too
    /// when that at most doubles the bytes the get reads, and returned unchecked otherwise
    /// (e.g. 4 KiB out of a 1 MiB unit: 256 times the I/O).
    fn get_span(&self, object: &Object, offset: u64, end: u64, via_host: bool) -> GetSpan {
        let (su, block) = (self.shared.geometry.stripe_unit, self.shared.geometry.block_size);
        let len = object.record.len_bytes;
        let blocks = (round_down(offset, block), round_up(end, block));
        let unchecked = GetSpan { verify: false, read: blocks, checked: (offset, offset) };
        if !(self.shared.config.verify_checksums && via_host && !object.record.unit_crcs.is_empty()) {
            return unchecked;
        }
        let units = (round_down(offset, su), round_up(end, su).min(len));
        let whole = (units.0, round_up(units.1, block));
        if (whole.1 - whole.0) - (blocks.1 - blocks.0) <= end - offset {
            return GetSpan { verify: end > offset, read: whole, checked: units };
        }
        let inner = (round_up(offset, su), if end == len { len } else { round_down(end, su) });
        if inner.0 >= inner.1 {
            return unchecked;
        }
        GetSpan { verify: true, read: blocks, checked: inner }
    }

    /// Puts `data` and waits until it is durable.
    pub fn put_blocking(&self, id: u64, data: &[u8], meta: &[u8]) -> Result<()> {
        // SAFETY: we wait for the ticket before `data`'s borrow ends.
        unsafe { self.put_raw_ticket(id, data.as_ptr(), data.len(), meta, Priority::Normal)? }.wait()
    }

    /// Reads the whole object into a new vector: one version, whole (the version current when
    /// the call looks the id up; its length sizes the buffer and its bytes fill it).
    pub fn get_to_vec(&self, id: u64) -> Result<Vec<u8>> {
        let object = self.current_version(id)?;
        let len = object.record.len_bytes as usize;
        let mut buf = AlignedBuf::new(len, self.shared.geometry.block_size as usize)?;
        let memory = Memory::Host { ptr: buf.as_mut_ptr() as usize, len };
        let spec = GetSpec { id, offset: 0, whole: true, priority: Priority::Normal };
        // SAFETY: the ticket owns `buf`.
        let started = unsafe { self.start_get_of(object, spec, memory)? };
        let ticket = Ticket { completion: started.completion, buffer: Some(buf) };
        assert_eq!(ticket.object_len_bytes(), Some(len as u64), "the buffer was sized from the version read");
        let buf = ticket.wait()?;
        Ok(buf[..len].to_vec())
    }

    /// Deletes object `id` durably; returns whether it existed.
    pub fn delete(&self, id: u64) -> Result<bool> {
        self.check_writable()?;
        if self.shared.closed.load(Ordering::Acquire) {
            return Err(Error::Closed);
        }
        let (tx, rx) = sync_channel(1);
        let sent =
            self.shared.commit_tx.lock().expect("commit").as_ref().map(|c| c.send(CommitMsg::Delete { id, reply: tx }));
        if !matches!(sent, Some(Ok(()))) {
            return Err(Error::Closed);
        }
        let existed = rx.recv().map_err(|_| Error::Closed)??;
        if existed {
            self.shared.op_counters.lock().expect("op counters").deletes += 1;
        }
        Ok(existed)
    }

    /// Writes a checkpoint of the table now (it also happens when the journal fills and at close).
    pub fn checkpoint(&self) -> Result<()> {
        self.check_writable()?;
        let (tx, rx) = sync_channel(1);
        let sent =
            self.shared.commit_tx.lock().expect("commit").as_ref().map(|c| c.send(CommitMsg::Checkpoint { reply: tx }));
        if !matches!(sent, Some(Ok(()))) {
            return Err(Error::Closed);
        }
        rx.recv().map_err(|_| Error::Closed)?
    }

    pub fn stat(&self, id: u64) -> Option<ObjectInfo> {
        self.shared.table.read().expect("table").get(&id).map(|o| self.object_info(&o.record))
    }

    /// Every object, by id.
    pub fn list(&self) -> Vec<ObjectInfo> {
        let table = self.shared.table.read().expect("table");
        let mut v: Vec<ObjectInfo> = table.values().map(|o| self.object_info(&o.record)).collect();
        v.sort_by_key(|o| o.id);
        v
    }

    pub(super) fn object_info(&self, r: &ObjectRecord) -> ObjectInfo {
        let count = self.shared.geometry.device_count;
        ObjectInfo {
            id: r.id,
            len_bytes: r.len_bytes,
            meta: r.meta.clone(),
            devices: (0..r.spread).map(|p| (r.first_device + p) % count).collect(),
            extent_count: r.extents.len(),
        }
    }
}

/// The caller's memory of a new op, before it is checked.
#[derive(Clone, Copy)]
pub(super) enum Memory {
    Host {
        ptr: usize,
        len: usize,
    },
    /// Device memory; with `after`, the op starts once that CUDA event has completed.
    Gpu {
        slice: DeviceSlice,
        after: Option<RawEvent>,
    },
}

impl Memory {
    fn len(&self) -> usize {
        match self {
            Memory::Host { len, .. } => *len,
            Memory::Gpu { slice, .. } => slice.len,
        }
    }
}

/// A put, besides the caller's memory.
pub(super) struct PutSpec<'a> {
    pub id: u64,
    pub meta: &'a [u8],
    pub priority: Priority,
}

/// A get, besides the caller's memory: object bytes from `offset`, as many as the memory holds;
/// with `whole` (and `offset` 0) the memory may be longer than the object, which is read whole.
pub(super) struct GetSpec {
    pub id: u64,
    pub offset: u64,
    pub whole: bool,
    pub priority: Priority,
}

/// A queued op as its ticket needs it.
pub(super) struct Started {
    pub completion: Arc<Completion>,
    /// The GPU stream hand-off slot of a GPU op, if it has one.
    pub handoff: Option<Handoff>,
}

/// What a get reads and checks (`Store::get_span`).
struct GetSpan {
    verify: bool,
    /// Object bytes read, block-aligned.
    read: (u64, u64),
    /// Object bytes whose stripe units are checked (whole units, or up to the object's end).
    checked: (u64, u64),
}
