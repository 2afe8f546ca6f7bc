//! The in-flight byte budget: bytes of device requests submitted and not yet finished, over the
//! whole store. Normal work may use 7/8 of `OpenConfig::max_inflight_bytes`, urgent work all of
//! it, so an urgent op always finds room soon. The counter lives in `DispatchState`, under the
//! dispatch lock, so that a completion can free budget and wake the dispatcher in one step.

use super::{DispatchState, Shared};
use crate::queue::Priority;

/// The budget's accounting (see the module doc). Every change checks its invariants.
#[derive(Debug)]
pub(crate) struct Budget {
    /// The limit for urgent work: `max_inflight_bytes`.
    total: u64,
    /// The limit for normal work.
    normal: u64,
    /// The longest request the dispatcher cuts (a bounce chunk).
    largest_request: u64,
    in_flight: u64,
}

impl Budget {
    pub fn new(max_inflight_bytes: u64, largest_request: u64) -> Budget {
        let normal = max_inflight_bytes / 8 * 7;
        // OpenConfig::validate keeps max_inflight_bytes >= 2 * max_io_bytes >= 2 * a request:
        // a request always fits an empty budget of either lane.
        assert!(largest_request > 0, "requests carry bytes");
        assert!(largest_request <= normal, "the largest request fits the normal lane's budget");
        Budget { total: max_inflight_bytes, normal, largest_request, in_flight: 0 }
    }

    fn limit(&self, priority: Priority) -> u64 {
        match priority {
            Priority::Urgent => self.total,
            Priority::Normal => self.normal,
        }
    }

    /// Takes `bytes` for a request of `priority` if they fit under its limit now.
    pub fn try_take(&mut self, bytes: u64, priority: Priority) -> bool {
        assert!(bytes > 0 && bytes <= self.largest_request, "a request of {bytes} bytes");
        if self.in_flight + bytes > self.limit(priority) {
            return false;
        }
        self.in_flight += bytes;
        assert!(self.in_flight <= self.total);
        true
    }

    /// Gives back the bytes of a finished request.
    pub fn give_back(&mut self, bytes: u64) {
        assert!(bytes > 0 && bytes <= self.largest_request, "a request of {bytes} bytes");
        assert!(bytes <= self.in_flight, "giving back {bytes} bytes with {} in flight", self.in_flight);
        self.in_flight -= bytes;
    }

    pub fn in_flight(&self) -> u64 {
        self.in_flight
    }
}

impl Shared {
    /// Gives back a finished request's bytes and wakes the dispatcher if it waits.
    pub(crate) fn release_budget(&self, bytes: u64) {
        let mut st = self.dispatch.lock().expect("dispatch");
        st.budget.give_back(bytes);
        let wake = st.sleepers > 0;
        drop(st);
        if wake {
            self.dispatch_cv.notify_all();
        }
    }

    /// Takes `bytes` of budget for an op of `priority` if it is free now.
    pub(super) fn try_acquire_budget(&self, bytes: u64, priority: Priority) -> bool {
        self.dispatch.lock().expect("dispatch").budget.try_take(bytes, priority)
    }

    /// Takes `bytes` of budget for an op of `priority`, waiting for completions to free it.
    /// Returns false (taking nothing) if a normal op must yield because urgent work arrived.
    /// NOTE: the caller must have handed every request it built to the queues first, or the
    /// budget it waits for may be held by its own unsubmitted requests.
    pub(super) fn acquire_budget(&self, bytes: u64, priority: Priority) -> bool {
        let mut st = self.dispatch.lock().expect("dispatch");
        loop {
            if st.budget.try_take(bytes, priority) {
                return true;
            }
            if priority == Priority::Normal && !st.urgent.is_empty() {
                return false;
            }
            st = DispatchState::sleep(st, &self.dispatch_cv);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Budget;
    use crate::queue::Priority;

    #[test]
    fn normal_work_leaves_an_eighth_to_urgent_work() {
        let mut b = Budget::new(8 << 20, 1 << 20);
        for _ in 0..7 {
            assert!(b.try_take(1 << 20, Priority::Normal));
        }
        assert!(!b.try_take(1 << 20, Priority::Normal), "7/8 is the normal lane's limit");
        assert!(b.try_take(1 << 20, Priority::Urgent), "the last eighth is urgent work's");
        assert!(!b.try_take(1, Priority::Urgent));
        b.give_back(1 << 20);
        assert_eq!(b.in_flight(), 7 << 20);
    }

    #[test]
    #[should_panic(expected = "giving back")]
    fn giving_back_more_than_was_taken_is_a_bug() {
        let mut b = Budget::new(8 << 20, 1 << 20);
        assert!(b.try_take(4096, Priority::Normal));
        b.give_back(8192);
    }
}
