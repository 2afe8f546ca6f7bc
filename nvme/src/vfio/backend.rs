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

    /// Submits waiting pieces while the SQ has room.
    fn issue(&mut self) {
        while let Some(piece) = self.waiting.front().copied() {
            let queue = self.queue.as_mut().expect("queue");
            let Some(id) = queue.next_id() else { break };
            self.waiting.pop_front();
            let mut cmd = if piece.opcode == spec::IO_FLUSH {
                Command { opcode: spec::IO_FLUSH, nsid: self.controller.nsid, ..Default::default() }
            } else {
                let blocks = piece.len >> self.lba_shift;
                Command::read_write(piece.opcode, self.controller.nsid, piece.offset >> self.lba_shift, blocks)
            };
            if piece.opcode != spec::IO_FLUSH {
                let region = self.region_of(piece.buf, piece.len as usize).expect("checked in push");
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

impl Backend for VfioBackend {
    fn name(&self) -> &'static str {
        "nvme-vfio"
    }

    unsafe fn push(&mut self, r: BackendRequest) {
        let lba_mask = (1u64 << self.lba_shift) - 1;
        if r.kind != IoKind::Flush {
            if r.offset & lba_mask != 0
                || r.len as u64 & lba_mask != 0
                || r.len == 0
                || !(r.buf as usize).is_multiple_of(4)
            {
                self.ready.push(BackendCompletion { token: r.token, result: -libc::EINVAL });
                return;
            }
            if self.region_of(r.buf as usize, r.len as usize).is_none() {
                tracing::error!("nvme-vfio: buffer {:p}+{} is not registered DMA memory", r.buf, r.len);
                self.ready.push(BackendCompletion { token: r.token, result: -libc::EFAULT });
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
