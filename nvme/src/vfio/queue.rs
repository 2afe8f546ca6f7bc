//! One NVMe submission/completion queue pair in DMA memory, driven by polling: commands are
//! written to the SQ ring and the tail doorbell rung once per batch; completions are found by
//! their phase tag and the head doorbell rung once per batch.

use crate::spec::{Command, Completion};
use std::sync::atomic::{fence, Ordering};

pub struct QueuePair {
    pub qid: u16,
    entries: u16,
    sq: *mut Command,
    cq: *mut Completion,
    sq_tail: u16,
    cq_head: u16,
    phase: bool,
    sq_doorbell: *mut u32,
    cq_doorbell: *mut u32,
    /// Command ids not in flight; at most entries - 1 in flight so the SQ can never overflow.
    free_ids: Vec<u16>,
    /// Which command ids are in flight: a completion for any other id is ignored and counted
    /// (as Linux's nvme driver does with "invalid id ... completed").
    in_flight: Vec<bool>,
    /// Completions ignored because their command id was not in flight.
    pub spurious_completions: u64,
    unrung: bool,
    /// The CQ head moved since the head doorbell was last rung.
    head_moved: bool,
}

// SAFETY: the queue's memory and doorbells are used by one thread at a time (the owner).
unsafe impl Send for QueuePair {}

impl QueuePair {
    /// A queue pair over `entries` commands at `sq` and completions at `cq`.
    ///
    /// # Safety
    /// `sq` and `cq` must point to DMA memory for `entries` entries each that outlives the
    /// queue, and the doorbells must be this queue's registers in a BAR mapping that outlives it.
    pub unsafe fn new(
        qid: u16,
        entries: u16,
        sq: *mut Command,
        cq: *mut Completion,
        doorbells: (*mut u32, *mut u32),
    ) -> QueuePair {
        assert!(entries >= 2);
        // SAFETY: the CQ memory holds `entries` completions; zero it so no stale phase bit shows.
        unsafe { std::ptr::write_bytes(cq, 0, entries as usize) };
        QueuePair {
            qid,
            entries,
            sq,
            cq,
            sq_tail: 0,
            cq_head: 0,
            phase: true,
            sq_doorbell: doorbells.0,
            cq_doorbell: doorbells.1,
            free_ids: (0..entries - 1).rev().collect(),
            in_flight: vec![false; entries as usize],
            spurious_completions: 0,
            unrung: false,
            head_moved: false,
        }
    }

    /// Commands that can still be submitted.
    pub fn free_slots(&self) -> usize {
        self.free_ids.len()
    }

    pub fn capacity(&self) -> usize {
        self.entries as usize - 1
    }

    /// The command id the next `submit` will use.
    pub fn next_id(&self) -> Option<u16> {
        self.free_ids.last().copied()
    }

    /// Queues `cmd` (its command id is assigned here and returned); None when full.
    pub fn submit(&mut self, mut cmd: Command) -> Option<u16> {
        let id = self.free_ids.pop()?;
        debug_assert!(!self.in_flight[id as usize]);
        self.in_flight[id as usize] = true;
        cmd.command_id = id;
        // SAFETY: sq_tail < entries, inside the SQ memory.
        unsafe { std::ptr::write_volatile(self.sq.add(self.sq_tail as usize), cmd) };
        self.sq_tail = (self.sq_tail + 1) % self.entries;
        self.unrung = true;
        Some(id)
    }

    /// Tells the controller about the commands queued since the last call.
    pub fn ring_doorbell(&mut self) {
        if self.unrung {
            // The entries must be visible in memory before the device sees the new tail.
            fence(Ordering::SeqCst);
            // SAFETY: the doorbell register of this queue inside the mapped BAR.
            unsafe { std::ptr::write_volatile(self.sq_doorbell, self.sq_tail as u32) };
            self.unrung = false;
        }
    }

    fn take(&mut self) -> Option<Completion> {
        loop {
            // SAFETY: cq_head < entries, inside the CQ memory written by the device.
            let entry = unsafe { self.cq.add(self.cq_head as usize) };
            // The status word (with the phase tag) first; the rest only once it is current.
            // SAFETY: as above; `status` is the last, 2-byte aligned field of the entry.
            let status = unsafe { std::ptr::read_volatile(std::ptr::addr_of!((*entry).status)) };
            if (status & 1 == 1) != self.phase {
                return None;
            }
            fence(Ordering::Acquire);
            // SAFETY: as above.
            let c = unsafe { std::ptr::read_volatile(entry) };
            self.head_moved = true;
            self.cq_head += 1;
            if self.cq_head == self.entries {
                self.cq_head = 0;
                self.phase = !self.phase;
            }
            let id = c.command_id as usize;
            if id >= self.in_flight.len() || !self.in_flight[id] {
                self.spurious_completions += 1;
                tracing::warn!(
                    queue = self.qid,
                    command_id = id,
                    "NVMe completion for a command not in flight; ignored"
                );
                continue;
            }
            self.in_flight[id] = false;
            self.free_ids.push(c.command_id);
            return Some(c);
        }
    }

    fn ring_head(&mut self) {
        if !self.head_moved {
            return;
        }
        fence(Ordering::SeqCst);
        // SAFETY: the completion doorbell of this queue inside the mapped BAR.
        unsafe { std::ptr::write_volatile(self.cq_doorbell, self.cq_head as u32) };
        self.head_moved = false;
    }

    /// One completion, if there is one (rings the head doorbell).
    pub fn poll_one(&mut self) -> Option<Completion> {
        let c = self.take();
        self.ring_head();
        c
    }

    /// Moves up to `max` completions into `out`; rings the head doorbell once. Returns how many.
    pub fn poll(&mut self, out: &mut Vec<Completion>, max: usize) -> usize {
        let mut n = 0;
        while n < max {
            let Some(c) = self.take() else { break };
            out.push(c);
            n += 1;
        }
        self.ring_head();
        n
    }

    /// Commands in flight.
    pub fn in_flight(&self) -> usize {
        self.capacity() - self.free_ids.len()
    }
}
