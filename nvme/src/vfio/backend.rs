//! The engine backend over one userspace I/O queue pair: push builds NVMe commands (PRP lists in
//! a page per command slot), submit rings the doorbell once per batch, reap polls the completion
//! queue. No system call on the data path.

use super::dma::{DmaMemory, PAGE_BYTES};
use super::queue::QueuePair;
use super::{Controller, DmaRegion, IommuMode};
use crate::error::{NvmeError, Result};
use crate::spec::{self, Command, Completion};
use std::collections::VecDeque;
use std::io;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use teraio_engine::backend::{Backend, BackendCompletion, BackendRequest, IoKind, Waker};

/// The most requests one backend takes in flight.
pub const MAX_DEPTH: usize = 4096;
/// PRP entries in one list page.
const PRP_ENTRIES_PER_PAGE: usize = PAGE_BYTES / 8;
/// Bounce slots (one transfer limit each) for caller memory that is not registered DMA memory
/// or not dword-aligned: such commands are copied through them, at most this many at a time.
const BOUNCE_SLOTS: usize = 16;

/// A command whose data goes through a bounce slot.
#[derive(Debug, Clone, Copy)]
struct Bounced {
    slot: usize,
    caller_buf: usize,
    len: usize,
    read: bool,
}

#[derive(Debug, Clone, Copy)]
struct Parent {
    token: u64,
    pieces_left: u32,
    bytes: u32,
    error: i32,
}

#[derive(Debug, Clone, Copy)]
struct Piece {
    parent: usize,
    opcode: u8,
    offset: u64,
    buf: usize,
    len: u32,
}

/// One I/O queue pair of a [`Controller`], as an engine backend.
pub struct VfioBackend {
    controller: Arc<Controller>,
    queue: Option<QueuePair>,
    /// SQ, CQ and one PRP list page per command slot.
    memory: DmaMemory,
    memory_region: Arc<DmaRegion>,
    prp_pages: usize,
    regions: Vec<Arc<DmaRegion>>,
    parent_of_command: Vec<usize>,
    parents: Vec<Option<Parent>>,
    free_parents: Vec<usize>,
    waiting: VecDeque<Piece>,
    ready: Vec<BackendCompletion>,
    /// Bounce memory: BOUNCE_SLOTS slots of max_transfer_bytes each, allocated on first use.
    bounce: Option<(DmaMemory, Arc<DmaRegion>)>,
    free_bounce_slots: Vec<usize>,
    bounced: Vec<Option<Bounced>>,
    completions: Vec<Completion>,
    lba_shift: u32,
    woken: Arc<AtomicBool>,
}

impl VfioBackend {
    /// Creates an I/O queue pair on `controller` for `depth` requests in flight.
    pub fn new(controller: Arc<Controller>, depth: usize) -> Result<VfioBackend> {
        if depth == 0 || depth > MAX_DEPTH {
            return Err(NvmeError::Config(format!("queue depth {depth} must be in 1..={MAX_DEPTH}")));
        }
        let mut entries = controller.queue_entries;
        let sq_bytes = |e: u16| e as usize * 64;
        // Layout: SQ | CQ | PRP pages, each queue in its own pages.
        let size_for = |e: u16| {
            sq_bytes(e).div_ceil(PAGE_BYTES) * PAGE_BYTES
                + (e as usize * 16).div_ceil(PAGE_BYTES) * PAGE_BYTES
                + e as usize * PAGE_BYTES
        };
        let memory = DmaMemory::allocate(size_for(entries))?;
        if controller.mode == IommuMode::NoIommu && !memory.hugepages {
            // Without an IOMMU every queue must be physically contiguous: one 4 KiB page each.
            entries = entries.min(64);
        }
        let base = memory.base as usize;
        let cq = base + sq_bytes(entries).div_ceil(PAGE_BYTES) * PAGE_BYTES;
        let prp_pages = cq + (entries as usize * 16).div_ceil(PAGE_BYTES) * PAGE_BYTES;
        let memory_region = controller.register(memory.base, memory.len)?;
        let queue = controller.create_queue(entries, &memory_region, base, cq)?;
        let regions = vec![memory_region.clone()];
        Ok(VfioBackend {
            lba_shift: controller.namespace.lba_bytes.trailing_zeros(),
            controller,
            parent_of_command: vec![usize::MAX; entries as usize],
            queue: Some(queue),
            memory,
            memory_region,
            prp_pages,
            regions,
            parents: vec![None; depth],
            free_parents: (0..depth).rev().collect(),
            waiting: VecDeque::new(),
            ready: Vec::new(),
            bounce: None,
            free_bounce_slots: (0..BOUNCE_SLOTS).rev().collect(),
            bounced: vec![None; entries as usize],
            completions: Vec::with_capacity(entries as usize),
            woken: Arc::new(AtomicBool::new(false)),
        })
    }

    /// Completions the device posted for command ids not in flight (ignored).
    pub fn spurious_completions(&self) -> u64 {
        self.queue.as_ref().map_or(0, |q| q.spurious_completions)
    }

    pub fn controller(&self) -> &Arc<Controller> {
        &self.controller
    }

    fn region_of(&mut self, addr: usize, len: usize) -> Option<Arc<DmaRegion>> {
        if let Some(r) = self.regions.iter().find(|r| r.contains(addr, len)) {
            return Some(r.clone());
        }
        let r = self.controller.region_of(addr, len)?;
        self.regions.push(r.clone());
        Some(r)
    }

    /// Whether [addr, addr+len) can be handed to the device as it is.
    fn direct(&mut self, addr: usize, len: usize) -> bool {
        addr.is_multiple_of(4) && self.region_of(addr, len).is_some()
    }

    /// Submits waiting pieces while the SQ (and, for bounced ones, a bounce slot) has room.
    fn issue(&mut self) {
        while let Some(mut piece) = self.waiting.front().copied() {
            let queue = self.queue.as_mut().expect("queue");
            let Some(id) = queue.next_id() else { break };
            let mut bounced = None;
            if piece.opcode != spec::IO_FLUSH && !self.direct(piece.buf, piece.len as usize) {
                let Some(slot) = self.free_bounce_slots.pop() else { break };
                if self.bounce.is_none() {
                    let bytes = BOUNCE_SLOTS * self.controller.max_transfer_bytes as usize;
                    match DmaMemory::allocate(bytes).and_then(|m| Ok((self.controller.register(m.base, m.len)?, m))) {
                        Ok((region, memory)) => self.bounce = Some((memory, region)),
                        Err(e) => {
                            tracing::error!(error = %e, "nvme-vfio: no bounce memory");
                            self.free_bounce_slots.push(slot);
                            self.waiting.pop_front();
                            self.fail_piece(piece.parent, -libc::ENOMEM);
                            continue;
                        }
                    }
                }
                let base = self.bounce.as_ref().unwrap().0.base as usize;
                let slot_buf = base + slot * self.controller.max_transfer_bytes as usize;
                let read = piece.opcode == spec::IO_READ;
                if !read {
                    // SAFETY: the caller's buffer is valid for len bytes (push's contract) and the
                    // slot is ours and as long as the transfer limit.
                    unsafe {
                        std::ptr::copy_nonoverlapping(piece.buf as *const u8, slot_buf as *mut u8, piece.len as usize)
                    };
                }
                bounced = Some(Bounced { slot, caller_buf: piece.buf, len: piece.len as usize, read });
                piece.buf = slot_buf;
            }
            self.waiting.pop_front();
            let mut cmd = if piece.opcode == spec::IO_FLUSH {
                Command { opcode: spec::IO_FLUSH, nsid: self.controller.nsid, ..Default::default() }
            } else {
                let blocks = piece.len >> self.lba_shift;
                Command::read_write(piece.opcode, self.controller.nsid, piece.offset >> self.lba_shift, blocks)
            };
            if piece.opcode != spec::IO_FLUSH {
                let region = self.region_of(piece.buf, piece.len as usize).expect("direct or bounced");
                let first = (PAGE_BYTES - piece.buf % PAGE_BYTES).min(piece.len as usize);
                cmd.prp1 = region.iova_of(piece.buf);
                let rest = piece.len as usize - first;
                if rest > 0 && rest <= PAGE_BYTES {
                    cmd.prp2 = region.iova_of(piece.buf + first);
                } else if rest > 0 {
                    let list = self.prp_pages + id as usize * PAGE_BYTES;
                    let count = rest.div_ceil(PAGE_BYTES);
                    assert!(count <= PRP_ENTRIES_PER_PAGE, "transfer over the PRP list limit");
                    for k in 0..count {
                        // SAFETY: the list page of slot `id` lies in our DMA memory; k < 512.
                        unsafe { *(list as *mut u64).add(k) = region.iova_of(piece.buf + first + k * PAGE_BYTES) };
                    }
                    cmd.prp2 = self.memory_region.iova_of(list);
                }
            }
            self.bounced[id as usize] = bounced;
            let queue = self.queue.as_mut().expect("queue");
            let submitted = queue.submit(cmd);
            debug_assert_eq!(submitted, Some(id));
            self.parent_of_command[id as usize] = piece.parent;
        }
        self.queue.as_mut().expect("queue").ring_doorbell();
    }

    fn reap(&mut self, out: &mut Vec<BackendCompletion>) -> usize {
        let queue = self.queue.as_mut().expect("queue");
        self.completions.clear();
        let n = queue.poll(&mut self.completions, usize::MAX);
        for c in &self.completions {
            if let Some(b) = self.bounced[c.command_id as usize].take() {
                if b.read && c.is_ok() {
                    let base = self.bounce.as_ref().expect("bounce memory").0.base as usize;
                    let slot_buf = base + b.slot * self.controller.max_transfer_bytes as usize;
                    // SAFETY: the device has finished writing the slot; the caller's buffer is
                    // valid for len bytes until its completion is returned.
                    unsafe { std::ptr::copy_nonoverlapping(slot_buf as *const u8, b.caller_buf as *mut u8, b.len) };
                }
                self.free_bounce_slots.push(b.slot);
            }
            let index = self.parent_of_command[c.command_id as usize];
            let parent = self.parents[index].as_mut().expect("completion for a request not in flight");
            if !c.is_ok() && parent.error == 0 {
                let (sct, sc) = c.status_code();
                parent.error = -spec::status_errno(sct, sc).max(1);
            }
            parent.pieces_left -= 1;
            if parent.pieces_left == 0 {
                let p = self.parents[index].take().unwrap();
                self.free_parents.push(index);
                out.push(BackendCompletion {
                    token: p.token,
                    result: if p.error != 0 { p.error } else { p.bytes as i32 },
                });
            }
        }
        n
    }
}

impl VfioBackend {
    /// Fails one piece of `parent` without sending it.
    fn fail_piece(&mut self, parent: usize, errno: i32) {
        let p = self.parents[parent].as_mut().expect("parent in flight");
        if p.error == 0 {
            p.error = errno;
        }
        p.pieces_left -= 1;
        if p.pieces_left == 0 {
            let p = self.parents[parent].take().unwrap();
            self.free_parents.push(parent);
            self.ready.push(BackendCompletion { token: p.token, result: p.error });
        }
    }
}

impl Backend for VfioBackend {
    fn name(&self) -> &'static str {
        "nvme-vfio"
    }

    unsafe fn push(&mut self, r: BackendRequest) {
        let lba_mask = (1u64 << self.lba_shift) - 1;
        if r.kind != IoKind::Flush {
            // Memory that is not registered (or not dword-aligned) is bounced, not refused.
            if r.offset & lba_mask != 0 || r.len as u64 & lba_mask != 0 || r.len == 0 {
                self.ready.push(BackendCompletion { token: r.token, result: -libc::EINVAL });
                return;
            }
        }
        let parent = self.free_parents.pop().expect("more requests in flight than the backend's depth");
        if r.kind == IoKind::Flush {
            self.parents[parent] = Some(Parent { token: r.token, pieces_left: 1, bytes: 0, error: 0 });
            self.waiting.push_back(Piece { parent, opcode: spec::IO_FLUSH, offset: 0, buf: 0, len: 0 });
            return;
        }
        let max = self.controller.max_transfer_bytes as u32;
        let pieces = r.len.div_ceil(max);
        self.parents[parent] = Some(Parent { token: r.token, pieces_left: pieces, bytes: r.len, error: 0 });
        let opcode = if r.kind == IoKind::Read { spec::IO_READ } else { spec::IO_WRITE };
        let mut done = 0u32;
        while done < r.len {
            let len = (r.len - done).min(max);
            self.waiting.push_back(Piece {
                parent,
                opcode,
                offset: r.offset + done as u64,
                buf: r.buf as usize + done as usize,
                len,
            });
            done += len;
        }
    }

    fn submit_and_reap(&mut self, wait: bool, out: &mut Vec<BackendCompletion>) -> io::Result<()> {
        out.append(&mut self.ready);
        self.issue();
        let mut spins = 0u32;
        loop {
            let n = self.reap(out);
            if n > 0 && !self.waiting.is_empty() {
                self.issue();
            }
            if !out.is_empty() || !wait || self.woken.swap(false, Ordering::AcqRel) {
                return Ok(());
            }
            // Poll: the completion shows up in memory, no interrupt. Yield now and then so a
            // descheduled device emulator (or another thread on this core) can run.
            spins += 1;
            if spins.is_multiple_of(1024) {
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
        }
    }

    fn waker(&self) -> Waker {
        let woken = self.woken.clone();
        Arc::new(move || woken.store(true, Ordering::Release))
    }
}

impl Drop for VfioBackend {
    fn drop(&mut self) {
        // Let every command finish (the device may still write into buffers), then delete the queues.
        let deadline = Instant::now() + Duration::from_secs(5);
        let mut sink = Vec::new();
        while self.queue.as_ref().is_some_and(|q| q.in_flight() > 0 || !self.waiting.is_empty())
            && Instant::now() < deadline
        {
            self.issue();
            self.reap(&mut sink);
        }
        if let Some(q) = self.queue.take() {
            if q.spurious_completions > 0 {
                tracing::warn!(queue = q.qid, count = q.spurious_completions, "spurious NVMe completions were ignored");
                eprintln!(
                    "teraio-nvme: {} ignored completions on queue {} of {}",
                    q.spurious_completions, q.qid, self.controller.bdf
                );
            }
            self.controller.delete_queue(q.qid);
        }
        let _ = &self.memory;
    }
}
