//! Trace-driven simulator: replays an iteration under a plan (or an on-demand policy) with a GPU
//! capacity and SSD / host bandwidths and latencies, and reports the iteration time, the stalls
//! and GPU memory over time.
//!
//! Model: ops run one after another; an op starts when every tensor it uses is on the GPU and its
//! new tensors fit. Each of the four channels (SSD write/read, host write/read) moves one
//! transfer at a time at its full rate after a fixed latency, urgent transfers first, then
//! earliest deadline first (the op that needs the result), then in issue order. An offload frees GPU memory when its write completes; a prefetch takes GPU memory
//! when it is issued (it waits while memory is short). GPU memory never exceeds capacity: when
//! nothing in flight can free memory the run ends as out of memory. Several iterations run back to
//! back and the last is reported, so that periods wrapping across iterations are in steady state.
//!
//! A runtime's own schedule (`crate::replay`) may add [`SideWork`]: writes that are never read
//! back in the iteration (a gradient that leaves for good), and a CPU worker that runs jobs of
//! measured duration one at a time in issue order, each once the writes it waits for are done;
//! a read of a tensor a job produces waits for the job's end.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};

use serde::{Deserialize, Serialize};

use crate::error::Result;
use crate::hardware::Hardware;
use crate::plan::{ActionKind, Plan, Tier};
use crate::trace::{Access, Trace};

/// How tensors move during the replay.
#[derive(Debug, Clone, Copy)]
pub enum Policy<'a> {
    /// Execute a plan's actions; fetch on demand only what the plan forgot.
    Planned(&'a Plan),
    /// No plan: when memory is short evict the least recently used tensors (host first, then
    /// SSD); fetch evicted tensors when an op needs them.
    Lru,
}

/// A write that is never read back in the iteration (a gradient the CPU step consumes on the
/// host): it moves its bytes on the tier's write channel and changes no tensor's place (its GPU
/// memory is the trace's, freed at its last use; its host memory is the runtime's own).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LoneDeparture {
    /// Issued before this op; the op count: after the iteration's last op.
    pub op: u32,
    /// Index into the trace's tensor list.
    pub tensor_index: u32,
    /// Destination tier.
    pub tier: Tier,
}

/// A job of the CPU worker (the CPU step's update of one unit), issued before op `op` (the op
/// count: after the iteration's last op). It starts once the worker is free, every job issued
/// before it has run (one thread, first in first out) and the departures of `waits_for` issued
/// before it (lone ones and the plan's writes) are done; a read of a tensor of `produces` issued before its end waits for
/// it.
#[derive(Debug, Clone, PartialEq)]
pub struct WorkerJob {
    /// Issued before this op; the op count: after the iteration's last op.
    pub op: u32,
    /// Time on the worker (measured, not counting its waits for `waits_for`).
    pub duration_us: f64,
    /// Indices of tensors whose departures (the last issued before the job) it reads.
    pub waits_for: Vec<u32>,
    /// Indices of tensors it writes on their tier (read back afterwards).
    pub produces: Vec<u32>,
}

/// Work a runtime's own schedule adds to a plan's migrations; both lists in issue order.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SideWork {
    /// Writes never read back in the iteration.
    pub lone_departures: Vec<LoneDeparture>,
    /// The CPU worker's jobs.
    pub jobs: Vec<WorkerJob>,
}

/// How the replay ended.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "status")]
pub enum Outcome {
    /// Every op ran.
    Completed,
    /// An op could not get the memory it needs and nothing in flight would free it.
    OutOfMemory {
        /// The op that could not start.
        op: u32,
        /// GPU memory it would have needed.
        needed_bytes: u64,
    },
}

/// What one replay measured (the last iteration).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SimReport {
    /// Policy name.
    pub policy: String,
    /// Completed or out of memory.
    pub outcome: Outcome,
    /// Wall time of the measured iteration.
    pub iteration_time_us: f64,
    /// Sum of op durations.
    pub compute_time_us: f64,
    /// Time ops waited for tensors or memory.
    pub stall_time_us: f64,
    /// Ops that waited.
    pub stalled_ops: u32,
    /// Highest GPU memory in use.
    pub peak_gpu_bytes: u64,
    /// Highest host memory held by offloaded tensors.
    pub peak_host_bytes: u64,
    /// Bytes written to the SSD array.
    pub ssd_written_bytes: u64,
    /// Bytes read from the SSD array.
    pub ssd_read_bytes: u64,
    /// Bytes written to host memory.
    pub host_written_bytes: u64,
    /// Bytes read from host memory.
    pub host_read_bytes: u64,
    /// Tensors fetched because an op needed them and no prefetch had brought them.
    pub demand_fetches: u32,
    /// Planned drops that found no valid copy and wrote instead.
    pub downgraded_drops: u32,
    /// Ops that started with a used tensor not resident (must be 0; an internal check).
    pub residency_violations: u32,
    /// GPU memory over time in the measured iteration: (microseconds since its start, bytes).
    #[serde(skip)]
    pub memory_timeline: Vec<(f64, u64)>,
}

/// Simulator settings.
#[derive(Debug, Clone, Copy)]
pub struct SimConfig {
    /// Iterations replayed back to back; the last is reported (default 2).
    pub iterations: u32,
    /// A tensor needed again while its write runs waits for the write, then is read back, as
    /// whole-model offload's tiers do (a read of an object waits for its write in flight).
    /// False (the default, the planner's executor): the write is cancelled and the tensor
    /// stays on the GPU.
    pub reads_wait_for_writes: bool,
}

impl Default for SimConfig {
    fn default() -> Self {
        SimConfig { iterations: 2, reads_wait_for_writes: false }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Place {
    Unallocated,
    Gpu,
    /// On the GPU, write to the tier in flight.
    Writing(Tier),
    OnTier(Tier),
    /// Prefetch issued, waiting for GPU memory.
    WaitingMemory(Tier),
    /// GPU memory taken, read in flight.
    Reading(Tier),
}

#[derive(Debug, Clone, Copy)]
struct TensorState {
    place: Place,
    ssd_copy_valid: bool,
    /// Host memory holds an up-to-date copy (written and not changed since): a drop to the host
    /// tier frees the GPU memory without writing. Runtimes that keep host copies (whole-model
    /// offload's home tier) plan such drops; the planner plans clean drops to the SSD only.
    host_copy_valid: bool,
    /// Keep the tensor on the GPU when its write completes (needed again meanwhile).
    cancel_offload: bool,
    /// An op wrote the tensor after its write to the tier began (the copy will be stale).
    written_during_offload: bool,
    /// Write again when the current write completes (it carries stale data).
    rewrite: bool,
    /// Global op index by which its pending transfer should be done.
    deadline: u64,
    urgent: bool,
    last_used_seq: u64,
    /// Needed again while its write runs (`SimConfig::reads_wait_for_writes`): read back once
    /// the write is done.
    read_after_write: bool,
    /// Worker jobs issued that produce it and have not ended: a read waits for them.
    jobs_pending: u32,
    /// A read waits for the jobs that produce it (issued when the last ends).
    read_after_job: bool,
    /// Its departures (lone ones and the plan's writes) issued and done so far: jobs wait for
    /// a count of done ones.
    departures_issued: u32,
    departures_done: u32,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
struct Transfer {
    /// Queue order: not urgent after urgent, then deadline (global op index), then issue order.
    not_urgent: bool,
    deadline: u64,
    sequence: u64,
    tensor: u32,
    size_bytes: u64,
    /// Bytes still to move (less than `size_bytes` after a preemption).
    remaining_bytes: u64,
    /// The fixed per-transfer latency has been paid (the transfer ran before).
    started: bool,
    /// Host-link time of an SSD transfer (`Hardware::ssd_via_host_link`): it takes the link
    /// and changes no tensor's place; the SSD channel's transfer does that.
    link_only: bool,
    /// A lone departure ([`LoneDeparture`]): changes no tensor's place; its end may start a
    /// worker job.
    lone: bool,
}

#[derive(Debug)]
struct Channel {
    rate_bytes_per_s: f64,
    latency_us: f64,
    /// The transfer running: (end time, start time, transfer).
    busy: Option<(f64, f64, Transfer)>,
    queue: BinaryHeap<Reverse<Transfer>>,
    moved_bytes: u64,
}

impl Channel {
    fn new(rate_bytes_per_s: f64, latency_us: f64) -> Self {
        Channel { rate_bytes_per_s, latency_us, busy: None, queue: BinaryHeap::new(), moved_bytes: 0 }
    }

    /// Starts the most urgent queued transfer, pausing the running one if the queued one goes
    /// first (transfers move in chunks, so a runtime can switch between them).
    fn start_next(&mut self, now_us: f64) {
        if let (Some((_, start_us, running)), Some(Reverse(first))) = (self.busy, self.queue.peek()) {
            if *first < running {
                let latency_us = if running.started { 0.0 } else { self.latency_us };
                let moved = ((now_us - start_us - latency_us).max(0.0) * 1e-6 * self.rate_bytes_per_s) as u64;
                let mut paused = running;
                paused.remaining_bytes = running.remaining_bytes.saturating_sub(moved).max(1);
                paused.started = now_us - start_us >= latency_us;
                self.queue.push(Reverse(paused));
                self.busy = None;
            }
        }
        if self.busy.is_some() {
            return;
        }
        if let Some(Reverse(mut transfer)) = self.queue.pop() {
            let latency_us = if transfer.started { 0.0 } else { self.latency_us };
            let end = now_us + latency_us + transfer.remaining_bytes as f64 / self.rate_bytes_per_s * 1e6;
            transfer.started = true;
            self.busy = Some((end, now_us, transfer));
        }
    }

    /// Moves the running transfer (if any) at `rate_bytes_per_s` from `now_us` on: what it moved
    /// so far at the old rate is kept, the rest (and any latency not yet paid) ends later or
    /// sooner.
    fn set_rate(&mut self, now_us: f64, rate_bytes_per_s: f64) {
        if rate_bytes_per_s == self.rate_bytes_per_s {
            return;
        }
        if let Some((end_us, _, mut transfer)) = self.busy {
            let data_begin_us = end_us - transfer.remaining_bytes as f64 / self.rate_bytes_per_s * 1e6;
            let moved = ((now_us - data_begin_us).max(0.0) * 1e-6 * self.rate_bytes_per_s) as u64;
            transfer.remaining_bytes = transfer.remaining_bytes.saturating_sub(moved).max(1);
            let resume_us = data_begin_us.max(now_us);
            let end_us = resume_us + transfer.remaining_bytes as f64 / rate_bytes_per_s * 1e6;
            self.busy = Some((end_us, resume_us, transfer));
        }
        self.rate_bytes_per_s = rate_bytes_per_s;
    }

    /// Makes a queued transfer of `tensor` urgent.
    fn promote(&mut self, tensor: u32) {
        if self.queue.iter().any(|Reverse(t)| t.tensor == tensor && t.not_urgent) {
            let mut items = std::mem::take(&mut self.queue).into_vec();
            for Reverse(transfer) in &mut items {
                if transfer.tensor == tensor {
                    transfer.not_urgent = false;
                }
            }
            self.queue = items.into();
        }
    }
}

const WRITE: usize = 0;
const READ: usize = 1;
/// The CPU worker's index among the completions (after the four channels).
const WORKER: usize = 4;

/// A worker job issued and not started: its index in [`SideWork::jobs`] and, per tensor it waits
/// for, the lone departures of it that must be done.
#[derive(Debug)]
struct QueuedJob {
    job: usize,
    needs: Vec<(u32, u32)>,
}

/// The CPU worker: one job at a time, in issue order.
#[derive(Debug, Default)]
struct Worker {
    /// The job running: (end time, job index).
    busy: Option<(f64, usize)>,
    queue: VecDeque<QueuedJob>,
}

fn channel_of(tier: Tier, direction: usize) -> usize {
    tier.index() * 2 + direction
}

struct Simulator<'a> {
    trace: &'a Trace,
    hardware: &'a Hardware,
    policy: Policy<'a>,
    capacity_bytes: u64,
    tensors: Vec<TensorState>,
    channels: [Channel; 4],
    waiting: VecDeque<u32>,
    gpu_used_bytes: u64,
    host_used_bytes: u64,
    now_us: f64,
    /// Bytes the current op is waiting to allocate; prefetches may not take them.
    reserved_bytes: u64,
    seq: u64,
    /// Transfers issued so far (queue tie-break).
    sequence: u64,
    /// Global index of the op being run (iteration × ops + op).
    global_op: u64,
    /// `SimConfig::reads_wait_for_writes`.
    reads_wait_for_writes: bool,
    report: SimReport,
    measuring: bool,
    iteration_start_us: f64,
    allocations_at_op: Vec<Vec<u32>>,
    frees_at_op: Vec<Vec<u32>>,
    /// Per op: indices into the plan's actions issued before it.
    actions_at_op: Vec<Vec<usize>>,
    /// Per op: tensors it uses and how.
    op_uses: Vec<Vec<(u32, Access)>>,
    /// Per plan action: the tensor's index.
    action_tensor: Vec<u32>,
    side: &'a SideWork,
    /// Per op, and after the last: indices into `side`'s lone departures and jobs issued there.
    lone_at_op: Vec<Vec<usize>>,
    jobs_at_op: Vec<Vec<usize>>,
    worker: Worker,
}

impl Simulator<'_> {
    fn size(&self, tensor: u32) -> u64 {
        self.trace.tensors[tensor as usize].size_bytes
    }

    fn set_gpu_used(&mut self, bytes: u64) {
        self.gpu_used_bytes = bytes;
        if self.measuring {
            self.report.peak_gpu_bytes = self.report.peak_gpu_bytes.max(bytes);
            self.report.memory_timeline.push((self.now_us - self.iteration_start_us, bytes));
        }
    }

    fn add_host(&mut self, bytes: u64) {
        self.host_used_bytes += bytes;
        if self.measuring {
            self.report.peak_host_bytes = self.report.peak_host_bytes.max(self.host_used_bytes);
        }
    }

    fn enqueue(&mut self, channel: usize, tensor: u32, urgent: bool) {
        let deadline = self.tensors[tensor as usize].deadline;
        self.push(channel, tensor, urgent, deadline, false);
    }

    /// Queues a transfer of `tensor` on `channel` (and on the host link where an SSD transfer
    /// also takes it).
    fn push(&mut self, channel: usize, tensor: u32, urgent: bool, deadline: u64, lone: bool) {
        self.sequence += 1;
        let transfer = Transfer {
            not_urgent: !urgent,
            deadline,
            sequence: self.sequence,
            tensor,
            size_bytes: self.size(tensor),
            remaining_bytes: self.size(tensor),
            started: false,
            link_only: false,
            lone,
        };
        self.channels[channel].queue.push(Reverse(transfer));
        self.kick(channel);
        if let Some(link) = self.link_of(channel) {
            self.channels[link].queue.push(Reverse(Transfer { link_only: true, ..transfer }));
            self.kick(link);
        }
    }

    /// The host-link channel an SSD channel's transfers also take (`Hardware::ssd_via_host_link`).
    fn link_of(&self, channel: usize) -> Option<usize> {
        (self.hardware.ssd_via_host_link && channel < 2).then_some(channel + 2)
    }

    /// Starts the next transfer on `channel` if it may run now. With a shared SSD
    /// (`Hardware::ssd_shared`) the SSD's read and write channels take turns: neither starts
    /// while the other runs, and when both are idle the more urgent head goes first.
    fn kick(&mut self, channel: usize) {
        let now = self.now_us;
        if channel >= 2 {
            self.channels[channel].start_next(now);
            self.rate_host_link();
            return;
        }
        if !self.hardware.ssd_shared {
            self.channels[channel].start_next(now);
            return;
        }
        let other = 1 - channel;
        if self.channels[other].busy.is_some() {
            return;
        }
        if self.channels[channel].busy.is_some() {
            self.channels[channel].start_next(now);
            return;
        }
        let first = match (self.channels[channel].queue.peek(), self.channels[other].queue.peek()) {
            (Some(Reverse(mine)), Some(Reverse(theirs))) if theirs < mine => other,
            (None, Some(_)) => other,
            _ => channel,
        };
        self.channels[first].start_next(now);
    }

    /// Gives each host-link direction its rate for what runs now: the duplex rate
    /// (`Hardware::host_link_duplex_bytes_per_s`) while both directions move data, else the
    /// one-way rate.
    fn rate_host_link(&mut self) {
        let one_way = self.hardware.host_link_bytes_per_s;
        let both_busy = self.channels[2].busy.is_some() && self.channels[3].busy.is_some();
        let rate = match self.hardware.host_link_duplex_bytes_per_s {
            Some(duplex) if both_busy => duplex,
            _ => one_way,
        };
        let now = self.now_us;
        for channel in &mut self.channels[2..] {
            channel.set_rate(now, rate);
        }
    }

    /// The earliest end among the channels' running transfers and the worker's job: (time,
    /// channel index or `WORKER`).
    fn next_completion(&self) -> Option<(f64, usize)> {
        let mut best: Option<(f64, usize)> = None;
        let ends = self.channels.iter().map(|c| c.busy.map(|(end, _, _)| end));
        for (index, end) in ends.chain(std::iter::once(self.worker.busy.map(|(end, _)| end))).enumerate() {
            if let Some(end) = end {
                if best.is_none_or(|(t, _)| end < t) {
                    best = Some((end, index));
                }
            }
        }
        best
    }

    fn complete(&mut self, channel_index: usize, end_us: f64) {
        if channel_index == WORKER {
            self.complete_job(end_us);
            return;
        }
        let Some((_, _, transfer)) = self.channels[channel_index].busy.take() else {
            return;
        };
        self.now_us = self.now_us.max(end_us);
        if transfer.link_only {
            self.kick(channel_index);
            return;
        }
        if self.measuring {
            self.channels[channel_index].moved_bytes += transfer.size_bytes;
        }
        let tier = if channel_index < 2 { Tier::Ssd } else { Tier::Host };
        let tensor = transfer.tensor as usize;
        let size = transfer.size_bytes;
        if transfer.lone {
            self.tensors[tensor].departures_done += 1;
            self.start_job();
        } else if channel_index % 2 == WRITE {
            let state = self.tensors[tensor];
            let stale = state.place == Place::Writing(tier) && state.rewrite && !state.cancel_offload;
            if stale {
                // The data written is stale: write again, the tensor stays on the GPU meanwhile.
                self.tensors[tensor].rewrite = false;
                self.tensors[tensor].written_during_offload = false;
                let urgent = self.tensors[tensor].urgent;
                self.enqueue(channel_index, transfer.tensor, urgent);
            } else if state.place == Place::Writing(tier) {
                if state.cancel_offload {
                    self.tensors[tensor].place = Place::Gpu;
                    self.tensors[tensor].cancel_offload = false;
                    if tier == Tier::Ssd && !state.written_during_offload {
                        self.tensors[tensor].ssd_copy_valid = true;
                    }
                    if tier == Tier::Host {
                        self.tensors[tensor].host_copy_valid = !state.written_during_offload;
                        self.host_used_bytes -= size;
                    }
                } else {
                    self.tensors[tensor].place = Place::OnTier(tier);
                    match tier {
                        Tier::Ssd => self.tensors[tensor].ssd_copy_valid = true,
                        Tier::Host => self.tensors[tensor].host_copy_valid = true,
                    }
                    let used = self.gpu_used_bytes - size;
                    self.set_gpu_used(used);
                    if state.read_after_write {
                        self.tensors[tensor].read_after_write = false;
                        self.prefetch(transfer.tensor, state.urgent, state.deadline);
                    }
                }
            } else if tier == Tier::Host {
                // The tensor was freed while being written: its host copy is not kept.
                self.host_used_bytes -= size;
            }
            if !stale {
                self.tensors[tensor].departures_done += 1;
                self.start_job();
            }
        } else {
            if self.tensors[tensor].place == Place::Reading(tier) {
                self.tensors[tensor].place = Place::Gpu;
            }
            if tier == Tier::Host {
                self.host_used_bytes -= size;
            }
        }
        self.kick(channel_index);
        if self.hardware.ssd_shared && channel_index < 2 {
            self.kick(1 - channel_index);
        }
        self.serve_waiting();
    }

    fn advance_to(&mut self, target_us: f64) {
        while let Some((end, channel)) = self.next_completion() {
            if end > target_us {
                break;
            }
            self.complete(channel, end);
        }
        self.now_us = self.now_us.max(target_us);
    }

    /// Gives GPU memory to waiting prefetches (urgent first, then in issue order, first fit).
    fn serve_waiting(&mut self) {
        let mut index = 0;
        while index < self.waiting.len() {
            let tensor = self.waiting[index];
            let size = self.size(tensor);
            if self.gpu_used_bytes + self.reserved_bytes + size <= self.capacity_bytes {
                self.waiting.remove(index);
                let Place::WaitingMemory(tier) = self.tensors[tensor as usize].place else {
                    continue;
                };
                self.tensors[tensor as usize].place = Place::Reading(tier);
                let used = self.gpu_used_bytes + size;
                self.set_gpu_used(used);
                let urgent = self.tensors[tensor as usize].urgent;
                self.enqueue(channel_of(tier, READ), tensor, urgent);
            } else {
                index += 1;
            }
        }
    }

    fn offload(&mut self, tensor: u32, tier: Tier, drop: bool, urgent: bool) {
        let state = &mut self.tensors[tensor as usize];
        if let Place::Writing(_) = state.place {
            // Still being written from an earlier period that was cancelled: let that write
            // finish the offload (again if the data changed meanwhile).
            if state.cancel_offload {
                state.cancel_offload = false;
                state.rewrite = state.written_during_offload;
            }
            return;
        }
        if state.place != Place::Gpu {
            return;
        }
        state.cancel_offload = false;
        if drop {
            let clean = match tier {
                Tier::Ssd => state.ssd_copy_valid,
                Tier::Host => state.host_copy_valid,
            };
            if clean {
                state.place = Place::OnTier(tier);
                let size = self.size(tensor);
                if tier == Tier::Host {
                    // Reads count the host copy as freed; the kept copy holds host memory again.
                    self.add_host(size);
                }
                let used = self.gpu_used_bytes - size;
                self.set_gpu_used(used);
                self.serve_waiting();
                return;
            }
            if self.measuring {
                self.report.downgraded_drops += 1;
            }
        }
        state.place = Place::Writing(tier);
        state.written_during_offload = false;
        state.rewrite = false;
        state.urgent = urgent;
        state.deadline = self.global_op;
        if tier == Tier::Host {
            self.add_host(self.size(tensor));
        }
        self.tensors[tensor as usize].departures_issued += 1;
        self.enqueue(channel_of(tier, WRITE), tensor, urgent);
    }

    fn prefetch(&mut self, tensor: u32, urgent: bool, deadline: u64) {
        let state = &mut self.tensors[tensor as usize];
        match state.place {
            Place::OnTier(_) if state.jobs_pending > 0 => {
                // The tier's copy is being produced: the read is issued at the job's end.
                if state.read_after_job {
                    state.urgent |= urgent;
                    state.deadline = state.deadline.min(deadline);
                } else {
                    state.read_after_job = true;
                    state.urgent = urgent;
                    state.deadline = deadline;
                }
            }
            Place::OnTier(tier) => {
                state.place = Place::WaitingMemory(tier);
                state.urgent = urgent;
                state.deadline = deadline;
                if urgent {
                    self.waiting.push_front(tensor);
                } else {
                    self.waiting.push_back(tensor);
                }
                self.serve_waiting();
            }
            Place::Writing(_) if self.reads_wait_for_writes => {
                state.read_after_write = true;
                state.urgent |= urgent;
                state.deadline = deadline;
            }
            Place::Writing(_) => state.cancel_offload = true,
            _ => {}
        }
    }

    /// Evicts least recently used tensors not used by `op` until `deficit_bytes` are on their
    /// way out; returns false when nothing is left to evict.
    fn evict_lru(&mut self, op: u32, deficit_bytes: u64) -> bool {
        let used_now: Vec<u32> = self.uses_of_op(op);
        let mut victims: Vec<(u64, u32)> = self
            .tensors
            .iter()
            .enumerate()
            .filter(|(index, state)| state.place == Place::Gpu && !used_now.contains(&(*index as u32)))
            .map(|(index, state)| (state.last_used_seq, index as u32))
            .collect();
        victims.sort_unstable();
        let mut freed = 0;
        let mut any = false;
        for (_, tensor) in victims {
            if freed >= deficit_bytes {
                break;
            }
            let size = self.size(tensor);
            let clean = self.tensors[tensor as usize].ssd_copy_valid;
            let tier = if clean {
                Tier::Ssd
            } else if self.host_used_bytes + size <= self.hardware.host_capacity_bytes {
                Tier::Host
            } else {
                Tier::Ssd
            };
            self.offload(tensor, tier, clean, true);
            freed += size;
            any = true;
        }
        any
    }

    fn uses_of_op(&self, op: u32) -> Vec<u32> {
        self.op_uses[op as usize].iter().map(|(t, _)| *t).collect()
    }

    /// Issues the side work of op `op` (the op count: after the last op), after the plan's
    /// actions there: lone departures, then worker jobs.
    fn issue_side_work(&mut self, op: u32) {
        let side = self.side;
        let lone = std::mem::take(&mut self.lone_at_op[op as usize]);
        for &index in &lone {
            let departure = side.lone_departures[index];
            let tensor = departure.tensor_index;
            self.tensors[tensor as usize].departures_issued += 1;
            let deadline = self.global_op;
            self.push(channel_of(departure.tier, WRITE), tensor, false, deadline, true);
        }
        self.lone_at_op[op as usize] = lone;
        let jobs = std::mem::take(&mut self.jobs_at_op[op as usize]);
        for &job in &jobs {
            let needs =
                side.jobs[job].waits_for.iter().map(|&t| (t, self.tensors[t as usize].departures_issued)).collect();
            for &tensor in &side.jobs[job].produces {
                self.tensors[tensor as usize].jobs_pending += 1;
            }
            self.worker.queue.push_back(QueuedJob { job, needs });
        }
        self.jobs_at_op[op as usize] = jobs;
        self.start_job();
    }

    /// Starts the worker's next job if the worker is free and the job's departures are done.
    fn start_job(&mut self) {
        if self.worker.busy.is_some() {
            return;
        }
        let Some(head) = self.worker.queue.front() else {
            return;
        };
        if head.needs.iter().any(|&(tensor, done)| self.tensors[tensor as usize].departures_done < done) {
            return;
        }
        let job = head.job;
        self.worker.queue.pop_front();
        self.worker.busy = Some((self.now_us + self.side.jobs[job].duration_us, job));
    }

    /// The worker's job ends: reads waiting for what it produced are issued, the next job starts.
    fn complete_job(&mut self, end_us: f64) {
        let Some((_, job)) = self.worker.busy.take() else {
            return;
        };
        self.now_us = self.now_us.max(end_us);
        let side = self.side;
        for &tensor in &side.jobs[job].produces {
            let state = &mut self.tensors[tensor as usize];
            state.jobs_pending -= 1;
            if state.jobs_pending == 0 && state.read_after_job {
                state.read_after_job = false;
                let (urgent, deadline) = (state.urgent, state.deadline);
                self.prefetch(tensor, urgent, deadline);
            }
        }
        self.start_job();
        self.serve_waiting();
    }
}

impl Simulator<'_> {
    fn initial_state(&mut self) {
        let mut on_tier: Vec<Option<Tier>> = vec![None; self.trace.tensors.len()];
        match self.policy {
            Policy::Planned(plan) => {
                for m in &plan.migrations {
                    if m.offloaded_at_start {
                        on_tier[m.tensor_index as usize] = Some(m.tier);
                    }
                }
            }
            Policy::Lru => {
                // Persistent tensors by first use fill the GPU; the rest start on the SSD.
                let mut order: Vec<u32> = (0..self.trace.tensors.len() as u32)
                    .filter(|&t| self.trace.tensors[t as usize].is_persistent())
                    .collect();
                order.sort_by_key(|&t| (self.trace.tensors[t as usize].uses[0].op, t));
                let mut used = 0u64;
                for t in order {
                    let size = self.size(t);
                    if used + size <= self.capacity_bytes / 2 {
                        used += size;
                    } else {
                        on_tier[t as usize] = Some(Tier::Ssd);
                    }
                }
            }
        }
        let mut used = 0u64;
        for (index, tensor) in self.trace.tensors.iter().enumerate() {
            let state = &mut self.tensors[index];
            if !tensor.is_persistent() {
                continue;
            }
            match on_tier[index] {
                Some(tier) => {
                    state.place = Place::OnTier(tier);
                    state.ssd_copy_valid = tier == Tier::Ssd;
                    state.host_copy_valid = tier == Tier::Host;
                    if tier == Tier::Host {
                        self.host_used_bytes += tensor.size_bytes;
                    }
                }
                None => {
                    state.place = Place::Gpu;
                    used += tensor.size_bytes;
                }
            }
        }
        self.gpu_used_bytes = used;
    }

    /// Runs one op; returns false when it cannot get its memory.
    fn run_op(&mut self, op: u32) -> bool {
        let ready_us = self.now_us;
        self.advance_to(ready_us);
        if let Policy::Planned(plan) = self.policy {
            let actions = std::mem::take(&mut self.actions_at_op[op as usize]);
            for &action_index in &actions {
                let action = plan.actions[action_index];
                let tensor = self.action_tensor[action_index];
                match action.kind {
                    ActionKind::Offload => self.offload(tensor, action.tier, false, action.urgent),
                    ActionKind::Drop => self.offload(tensor, action.tier, true, action.urgent),
                    ActionKind::Prefetch => {
                        let n = self.trace.ops.len() as u64;
                        let base = self.global_op - u64::from(op);
                        let wraps = action.deadline_op < op;
                        let deadline = base + u64::from(action.deadline_op) + if wraps { n } else { 0 };
                        self.prefetch(tensor, action.urgent, deadline)
                    }
                }
            }
            self.actions_at_op[op as usize] = actions;
        }
        self.issue_side_work(op);
        let allocation_bytes: u64 = self.allocations_at_op[op as usize].iter().map(|&t| self.size(t)).sum();
        let uses = self.op_uses[op as usize].clone();
        for &(tensor, _) in &uses {
            let state = &mut self.tensors[tensor as usize];
            match state.place {
                Place::OnTier(_) if state.jobs_pending > 0 => {
                    // Read at the end of the job that produces it (unless a prefetch waits so).
                    let demanded = !state.read_after_job;
                    state.read_after_job = true;
                    state.urgent = true;
                    state.deadline = self.global_op;
                    if demanded && self.measuring {
                        self.report.demand_fetches += 1;
                    }
                }
                Place::OnTier(tier) => {
                    state.place = Place::WaitingMemory(tier);
                    state.urgent = true;
                    state.deadline = self.global_op;
                    self.waiting.push_front(tensor);
                    if self.measuring {
                        self.report.demand_fetches += 1;
                    }
                }
                Place::WaitingMemory(_) => {
                    state.urgent = true;
                    if let Some(position) = self.waiting.iter().position(|&t| t == tensor) {
                        self.waiting.remove(position);
                    }
                    self.waiting.push_front(tensor);
                }
                Place::Reading(tier) => {
                    let channel = channel_of(tier, READ);
                    for c in std::iter::once(channel).chain(self.link_of(channel)) {
                        self.channels[c].promote(tensor);
                        self.kick(c);
                    }
                }
                Place::Writing(_) if self.reads_wait_for_writes => {
                    state.read_after_write = true;
                    state.urgent = true;
                    state.deadline = self.global_op;
                }
                Place::Writing(_) => state.cancel_offload = true,
                Place::Gpu | Place::Unallocated => {}
            }
        }
        self.reserved_bytes = allocation_bytes;
        loop {
            self.serve_waiting();
            let resident = uses.iter().all(|&(tensor, _)| {
                let state = &self.tensors[tensor as usize];
                match state.place {
                    Place::Gpu | Place::Unallocated => true,
                    Place::Writing(_) => !state.read_after_write,
                    _ => false,
                }
            });
            let fits = self.gpu_used_bytes + allocation_bytes <= self.capacity_bytes;
            if resident && fits {
                break;
            }
            if let Policy::Lru = self.policy {
                let waiting_needed: u64 = uses
                    .iter()
                    .filter(|&&(t, _)| matches!(self.tensors[t as usize].place, Place::WaitingMemory(_)))
                    .map(|&(t, _)| self.size(t))
                    .sum();
                let leaving: u64 = self
                    .tensors
                    .iter()
                    .enumerate()
                    .filter(|(_, s)| matches!(s.place, Place::Writing(_)) && !s.cancel_offload)
                    .map(|(t, _)| self.size(t as u32))
                    .sum();
                let need = self.gpu_used_bytes + allocation_bytes + waiting_needed;
                let deficit = need.saturating_sub(self.capacity_bytes + leaving);
                if deficit > 0 && self.evict_lru(op, deficit) {
                    continue;
                }
            }
            match self.next_completion() {
                Some((end, channel)) => self.complete(channel, end),
                None => {
                    self.report.outcome =
                        Outcome::OutOfMemory { op, needed_bytes: self.gpu_used_bytes + allocation_bytes };
                    return false;
                }
            }
        }
        self.reserved_bytes = 0;
        if self.measuring && self.now_us > ready_us {
            self.report.stall_time_us += self.now_us - ready_us;
            self.report.stalled_ops += 1;
        }
        // The op runs.
        self.seq += 1;
        for &tensor in &self.allocations_at_op[op as usize] {
            let state = &mut self.tensors[tensor as usize];
            state.place = Place::Gpu;
            state.ssd_copy_valid = false;
            state.host_copy_valid = false;
            state.cancel_offload = false;
        }
        let used = self.gpu_used_bytes + allocation_bytes;
        self.set_gpu_used(used);
        for &(tensor, access) in &uses {
            let state = &mut self.tensors[tensor as usize];
            if !matches!(state.place, Place::Gpu | Place::Writing(_)) && self.measuring {
                self.report.residency_violations += 1;
            }
            state.last_used_seq = self.seq;
            if access == Access::Write {
                state.ssd_copy_valid = false;
                state.host_copy_valid = false;
                state.written_during_offload = true;
            }
        }
        let end_us = self.now_us + self.trace.ops[op as usize].duration_us;
        self.advance_to(end_us);
        let frees = std::mem::take(&mut self.frees_at_op[op as usize]);
        for &tensor in &frees {
            let size = self.size(tensor);
            let state = &mut self.tensors[tensor as usize];
            let on_gpu = matches!(state.place, Place::Gpu | Place::Writing(_) | Place::Reading(_));
            if let Place::OnTier(Tier::Host) = state.place {
                self.host_used_bytes -= size;
            }
            if let Place::WaitingMemory(_) = state.place {
                self.waiting.retain(|&t| t != tensor);
            }
            state.place = Place::Unallocated;
            state.read_after_write = false;
            state.ssd_copy_valid = false;
            state.host_copy_valid = false;
            if on_gpu {
                let used = self.gpu_used_bytes - size;
                self.set_gpu_used(used);
            }
        }
        self.frees_at_op[op as usize] = frees;
        self.serve_waiting();
        true
    }
}

/// Replays `trace` under `policy` on `hardware`.
pub fn simulate(trace: &Trace, hardware: &Hardware, policy: Policy<'_>, config: SimConfig) -> Result<SimReport> {
    simulate_with(trace, hardware, policy, config, &SideWork::default())
}

/// [`simulate`] with a runtime's side work (lone departures and CPU worker jobs; their tensor
/// indices and ops are the caller's to check, as `crate::replay` does).
pub fn simulate_with(
    trace: &Trace,
    hardware: &Hardware,
    policy: Policy<'_>,
    config: SimConfig,
    side: &SideWork,
) -> Result<SimReport> {
    trace.validate()?;
    hardware.validate()?;
    let n = trace.ops.len();
    let mut allocations_at_op = vec![Vec::new(); n];
    let mut frees_at_op = vec![Vec::new(); n];
    let mut op_uses = vec![Vec::new(); n];
    for (index, tensor) in trace.tensors.iter().enumerate() {
        if let (Some(alloc), Some(free)) = (tensor.alloc_op, tensor.free_op) {
            allocations_at_op[alloc as usize].push(index as u32);
            frees_at_op[free as usize].push(index as u32);
        }
        for tensor_use in &tensor.uses {
            op_uses[tensor_use.op as usize].push((index as u32, tensor_use.access));
        }
    }
    let mut lone_at_op = vec![Vec::new(); n + 1];
    for (index, departure) in side.lone_departures.iter().enumerate() {
        lone_at_op[departure.op as usize].push(index);
    }
    let mut jobs_at_op = vec![Vec::new(); n + 1];
    for (index, job) in side.jobs.iter().enumerate() {
        jobs_at_op[job.op as usize].push(index);
    }
    let mut actions_at_op = vec![Vec::new(); n];
    let mut action_tensor = Vec::new();
    let policy_name = match policy {
        Policy::Planned(plan) => {
            plan.check_against(trace)?;
            let by_id: std::collections::HashMap<u64, u32> =
                plan.migrations.iter().map(|m| (m.tensor_id, m.tensor_index)).collect();
            for (index, action) in plan.actions.iter().enumerate() {
                actions_at_op[action.op as usize].push(index);
                action_tensor.push(by_id[&action.tensor_id]);
            }
            plan.policy.clone()
        }
        Policy::Lru => "lru".to_string(),
    };
    let tier_rates = [
        (hardware.ssd_write_bytes_per_s, hardware.ssd_latency_us),
        (hardware.ssd_read_bytes_per_s, hardware.ssd_latency_us),
        (hardware.host_link_bytes_per_s, hardware.host_latency_us),
        (hardware.host_link_bytes_per_s, hardware.host_latency_us),
    ];
    let mut sim = Simulator {
        trace,
        hardware,
        policy,
        capacity_bytes: hardware.gpu_capacity_bytes,
        tensors: vec![
            TensorState {
                place: Place::Unallocated,
                ssd_copy_valid: false,
                host_copy_valid: false,
                cancel_offload: false,
                written_during_offload: false,
                rewrite: false,
                deadline: 0,
                urgent: false,
                last_used_seq: 0,
                read_after_write: false,
                jobs_pending: 0,
                read_after_job: false,
                departures_issued: 0,
                departures_done: 0,
            };
            trace.tensors.len()
        ],
        channels: tier_rates.map(|(rate, latency)| Channel::new(rate, latency)),
        waiting: VecDeque::new(),
        gpu_used_bytes: 0,
        host_used_bytes: 0,
        now_us: 0.0,
        reserved_bytes: 0,
        seq: 0,
        sequence: 0,
        global_op: 0,
        reads_wait_for_writes: config.reads_wait_for_writes,
        report: SimReport {
            policy: policy_name,
            outcome: Outcome::Completed,
            iteration_time_us: 0.0,
            compute_time_us: trace.compute_time_us(),
            stall_time_us: 0.0,
            stalled_ops: 0,
            peak_gpu_bytes: 0,
            peak_host_bytes: 0,
            ssd_written_bytes: 0,
            ssd_read_bytes: 0,
            host_written_bytes: 0,
            host_read_bytes: 0,
            demand_fetches: 0,
            downgraded_drops: 0,
            residency_violations: 0,
            memory_timeline: Vec::new(),
        },
        measuring: false,
        iteration_start_us: 0.0,
        allocations_at_op,
        frees_at_op,
        actions_at_op,
        op_uses,
        action_tensor,
        side,
        lone_at_op,
        jobs_at_op,
        worker: Worker::default(),
    };
    sim.initial_state();
    if sim.gpu_used_bytes > sim.capacity_bytes {
        sim.report.outcome = Outcome::OutOfMemory { op: 0, needed_bytes: sim.gpu_used_bytes };
        return Ok(sim.report);
    }
    let iterations = config.iterations.max(1);
    for iteration in 0..iterations {
        if iteration + 1 == iterations {
            sim.measuring = true;
            sim.iteration_start_us = sim.now_us;
            sim.report.peak_gpu_bytes = sim.gpu_used_bytes;
            sim.report.peak_host_bytes = sim.host_used_bytes;
            let start = (0.0, sim.gpu_used_bytes);
            sim.report.memory_timeline.push(start);
            for channel in &mut sim.channels {
                channel.moved_bytes = 0;
            }
        }
        for op in 0..n as u32 {
            sim.global_op = u64::from(iteration) * n as u64 + u64::from(op);
            if !sim.run_op(op) {
                return Ok(sim.report);
            }
        }
        sim.issue_side_work(n as u32);
    }
    sim.report.iteration_time_us = sim.now_us - sim.iteration_start_us;
    // Transfers of the measured iteration still in flight are counted as issued traffic below.
    let moved: Vec<u64> = sim.channels.iter().map(|c| c.moved_bytes).collect();
    sim.report.ssd_written_bytes = moved[0];
    sim.report.ssd_read_bytes = moved[1];
    sim.report.host_written_bytes = moved[2];
    sim.report.host_read_bytes = moved[3];
    Ok(sim.report)
}

impl SimReport {
    /// Throughput relative to a reference iteration time (ideal), in percent; 0 when the run
    /// did not complete.
    pub fn percent_of(&self, reference_time_us: f64) -> f64 {
        match self.outcome {
            Outcome::Completed if self.iteration_time_us > 0.0 => 100.0 * reference_time_us / self.iteration_time_us,
            _ => 0.0,
        }
    }
}
