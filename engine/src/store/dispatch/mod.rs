//! From ops to device requests: the dispatcher thread takes queued puts and gets (urgent lane
//! first, even in the middle of a large normal op), cuts them slice by slice along the stripe map
//! into device requests ([`slice`]), holds them to the in-flight byte budget ([`budget`]),
//! bounces what O_DIRECT or the GPU cannot take straight from the caller's memory, and hands the
//! requests to the per-device queues ([`request`] builds one per piece).

pub(crate) mod budget;
mod request;
mod slice;

use super::op::Op;
use super::Shared;
use crate::queue::Priority;
use budget::Budget;
use slice::dispatch_slice;
use std::collections::VecDeque;
use std::sync::{Arc, Condvar, MutexGuard};

/// Ops up to this size are cut into requests on the caller's thread when nothing is queued
/// ahead of them, saving a thread hop per small op (4 KiB random reads live on this path).
const INLINE_DISPATCH_MAX_BYTES: u64 = 1 << 20;

/// An op waiting in a lane, with how far it has been cut into requests.
pub(crate) struct PendingOp {
    pub op: Arc<Op>,
    /// Next block-aligned object offset to dispatch, and where to stop.
    pub cursor: u64,
    pub end: u64,
    /// Put only: checksums of the stripe units dispatched so far.
    pub unit_crcs: Vec<u32>,
}

/// Lanes and the in-flight byte budget, under one lock so that a completion can both free budget
/// and wake the dispatcher.
pub(crate) struct DispatchState {
    pub urgent: VecDeque<PendingOp>,
    pub normal: VecDeque<PendingOp>,
    pub budget: Budget,
    pub shutdown: bool,
    /// Threads asleep on `dispatch_cv`: completions and new ops wake it only when this is
    /// non-zero, since a wake is a system call on every request otherwise.
    pub sleepers: usize,
}

impl DispatchState {
    pub fn new(budget: Budget) -> DispatchState {
        DispatchState { urgent: VecDeque::new(), normal: VecDeque::new(), budget, shutdown: false, sleepers: 0 }
    }

    /// Sleeps on `cv`, counted in `sleepers`.
    fn sleep<'a>(mut guard: MutexGuard<'a, DispatchState>, cv: &Condvar) -> MutexGuard<'a, DispatchState> {
        guard.sleepers += 1;
        let mut guard = cv.wait(guard).expect("dispatch");
        guard.sleepers -= 1;
        guard
    }

    /// Puts `pending` in its lane: at the back when new, at the front when it yielded part-way.
    fn queue(&mut self, pending: PendingOp, front: bool) {
        assert!(pending.cursor <= pending.end, "op {}: the cursor within the op", pending.op.id);
        assert!(!front || pending.cursor < pending.end, "op {}: an op yields with bytes left", pending.op.id);
        let lane = match pending.op.priority {
            Priority::Urgent => &mut self.urgent,
            Priority::Normal => &mut self.normal,
        };
        if front {
            lane.push_front(pending);
        } else {
            lane.push_back(pending);
        }
    }

    /// The next op to cut: urgent first.
    fn next(&mut self) -> Option<PendingOp> {
        if let Some(p) = self.urgent.pop_front() {
            assert_eq!(p.op.priority, Priority::Urgent, "the urgent lane holds urgent ops");
            return Some(p);
        }
        let p = self.normal.pop_front()?;
        assert_eq!(p.op.priority, Priority::Normal, "the normal lane holds normal ops");
        Some(p)
    }
}

impl Shared {
    /// Queues an op for the dispatcher, or dispatches a small one right here when no other op
    /// waits (it then cannot overtake anything, so priorities hold).
    pub(crate) fn enqueue(self: &Arc<Self>, op: Arc<Op>, start: u64, end: u64) {
        let block = self.geometry.block_size;
        assert!(
            start <= end && start.is_multiple_of(block) && end.is_multiple_of(block),
            "op {}: a block-aligned range",
            op.id
        );
        let mut pending = PendingOp { op, cursor: start, end, unit_crcs: Vec::new() };
        if end - start <= INLINE_DISPATCH_MAX_BYTES {
            let idle = {
                let st = self.dispatch.lock().expect("dispatch");
                st.urgent.is_empty() && st.normal.is_empty()
            };
            if idle && dispatch_slice(self, &mut pending, false) {
                finish_dispatch(self, &mut pending);
                return;
            }
        }
        let mut st = self.dispatch.lock().expect("dispatch");
        st.queue(pending, false);
        let wake = st.sleepers > 0;
        drop(st);
        if wake {
            self.dispatch_cv.notify_all();
        }
    }
}

/// The dispatcher thread's loop.
pub(crate) fn run_dispatcher(shared: Arc<Shared>) {
    loop {
        let mut pending = {
            let mut st = shared.dispatch.lock().expect("dispatch");
            loop {
                if let Some(p) = st.next() {
                    break p;
                }
                if st.shutdown {
                    // `close` stops the dispatcher only once every op has finished.
                    assert_eq!(st.budget.in_flight(), 0, "no request outlives its op");
                    return;
                }
                st = DispatchState::sleep(st, &shared.dispatch_cv);
            }
        };
        if dispatch_slice(&shared, &mut pending, true) {
            finish_dispatch(&shared, &mut pending);
        } else {
            shared.dispatch.lock().expect("dispatch").queue(pending, true);
        }
    }
}

/// Called once an op is fully cut into requests: a put's checksums join its record, and the
/// dispatch's own hold on the op is released.
fn finish_dispatch(shared: &Arc<Shared>, pending: &mut PendingOp) {
    assert_eq!(pending.cursor, pending.end, "op {}: fully dispatched", pending.op.id);
    if let Some(gpu) = &pending.op.gpu {
        gpu.dispatched();
    }
    if let super::op::OpObject::Put(object) = &pending.op.object {
        if let Some(o) = object.lock().expect("put object").as_mut() {
            o.record.unit_crcs = std::mem::take(&mut pending.unit_crcs);
        }
    }
    shared.request_done(&pending.op);
}
