//! Handle tables: what the opaque pointers handed to C stand for.
//!
//! A handle's pointer value is a number from a process-wide counter, never the address of
//! anything, and the library never dereferences it. Each call looks the number up in a table;
//! a NULL, never-issued, freed or already-waited handle is simply absent and gives
//! `TERAIO_ERR_BAD_HANDLE` instead of undefined behaviour. Numbers are never reused, so a stale
//! handle cannot alias a newer store or ticket. The table hands out `Arc`s, so freeing a handle
//! while another thread is inside a call on it is safe: that call finishes on its own reference.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

/// Next handle number, shared by every table so that a store and a ticket never share one.
/// Starts high and steps by 16 so that small integers and typical heap addresses are not valid.
static NEXT_HANDLE: AtomicUsize = AtomicUsize::new(0x7e4a_0010);
const HANDLE_STEP: usize = 16;

/// A table of live handles of one kind.
pub(crate) struct Registry<T> {
    live: Mutex<Option<HashMap<usize, Arc<T>>>>,
}

impl<T> Registry<T> {
    /// An empty table (usable in a `static`).
    pub(crate) const fn new() -> Self {
        Registry { live: Mutex::new(None) }
    }

    fn table(&self) -> MutexGuard<'_, Option<HashMap<usize, Arc<T>>>> {
        // The lock only guards map operations that cannot leave it half-updated, so a poisoned
        // lock (a panic elsewhere while holding it) still holds a consistent map.
        self.live.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Registers `value` and returns its new handle number (never 0, never reused).
    pub(crate) fn insert(&self, value: T) -> usize {
        let handle = NEXT_HANDLE.fetch_add(HANDLE_STEP, Ordering::Relaxed);
        self.table().get_or_insert_with(HashMap::new).insert(handle, Arc::new(value));
        handle
    }

    /// The value behind `handle`, if it is live.
    pub(crate) fn get(&self, handle: usize) -> Option<Arc<T>> {
        self.table().as_ref()?.get(&handle).cloned()
    }

    /// Unregisters `handle` and returns its value; `None` if it was not live. Exactly one of
    /// several racing callers gets the value.
    pub(crate) fn remove(&self, handle: usize) -> Option<Arc<T>> {
        self.table().as_mut()?.remove(&handle)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn handles_are_unique_and_die_once() {
        let table: Registry<&str> = Registry::new();
        assert!(table.get(0).is_none());
        let a = table.insert("a");
        let b = table.insert("b");
        assert_ne!(a, b);
        assert_ne!(a, 0);
        assert_eq!(*table.get(a).unwrap(), "a");
        assert_eq!(*table.remove(a).unwrap(), "a");
        assert!(table.get(a).is_none());
        assert!(table.remove(a).is_none());
        assert_eq!(*table.get(b).unwrap(), "b");
        let c = table.insert("c");
        assert!(c != a && c != b, "numbers are not reused");
    }
}
