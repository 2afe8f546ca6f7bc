//! A fault-injecting wrapper around any backend, for tests and reliability runs: errors (EIO,
//! ENOSPC, ...), short transfers, latency spikes and a device that vanishes, switched on and off
//! at run time through a shared [`FaultInjector`].

use super::{Backend, BackendCompletion, BackendRequest, IoKind, Waker};
use std::io;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// What to do to a matching request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// Fail it with this errno (e.g. `libc::EIO`) without touching the device.
    Errno(i32),
    /// Transfer only half of it (rounded down to 512 bytes); the queue must finish the rest.
    ShortTransfer,
    /// Delay it by this long before it reaches the device.
    Delay(Duration),
}

/// A rule: which requests, what fault, how often.
#[derive(Debug, Clone)]
pub struct FaultRule {
    /// Device index to match (None: every device).
    pub device: Option<u16>,
    /// Kind of request to match (None: every kind).
    pub kind: Option<IoKind>,
    pub fault: Fault,
    /// Matching requests to let through before the first fault.
    pub skip: u64,
    /// How many faults to inject (None: for ever).
    pub count: Option<u64>,
}

impl FaultRule {
    pub fn new(fault: Fault) -> Self {
        FaultRule { device: None, kind: None, fault, skip: 0, count: None }
    }
    pub fn on_device(mut self, device: u16) -> Self {
        self.device = Some(device);
        self
    }
    pub fn on(mut self, kind: IoKind) -> Self {
        self.kind = Some(kind);
        self
    }
    pub fn after(mut self, skip: u64) -> Self {
        self.skip = skip;
        self
    }
    pub fn times(mut self, count: u64) -> Self {
        self.count = Some(count);
        self
    }
}

/// The shared switchboard of faults; cheap to clone.
#[derive(Debug, Clone, Default)]
pub struct FaultInjector {
    rules: Arc<Mutex<Vec<FaultRule>>>,
    injected: Arc<AtomicU64>,
}

impl FaultInjector {
    pub fn new() -> Self {
        Self::default()
    }
    pub fn add(&self, rule: FaultRule) {
        self.rules.lock().expect("fault rules").push(rule);
    }
    pub fn clear(&self) {
        self.rules.lock().expect("fault rules").clear();
    }
    /// How many faults were injected so far.
    pub fn injected(&self) -> u64 {
        self.injected.load(Ordering::Relaxed)
    }

    fn decide(&self, device: u16, kind: IoKind) -> Option<Fault> {
        let mut rules = self.rules.lock().expect("fault rules");
        for rule in rules.iter_mut() {
            if rule.device.is_some_and(|d| d != device) || rule.kind.is_some_and(|k| k != kind) {
                continue;
            }
            if rule.skip > 0 {
                rule.skip -= 1;
                continue;
            }
            match &mut rule.count {
                Some(0) => continue,
                Some(n) => *n -= 1,
                None => {}
            }
            self.injected.fetch_add(1, Ordering::Relaxed);
            return Some(rule.fault);
        }
        None
    }
}

pub struct FaultyBackend {
    inner: Box<dyn Backend>,
    device: u16,
    injector: FaultInjector,
    failed: Vec<BackendCompletion>,
}

impl FaultyBackend {
    pub fn new(inner: Box<dyn Backend>, device: u16, injector: FaultInjector) -> Self {
        FaultyBackend { inner, device, injector, failed: Vec::new() }
    }
}

impl Backend for FaultyBackend {
    fn name(&self) -> &'static str {
        self.inner.name()
    }

    unsafe fn push(&mut self, mut request: BackendRequest) {
        match self.injector.decide(self.device, request.kind) {
            Some(Fault::Errno(errno)) => {
                self.failed.push(BackendCompletion { token: request.token, result: -errno });
                return;
            }
            Some(Fault::ShortTransfer) if request.kind != IoKind::Flush => {
                let half = (request.len / 2) & !511;
                if half > 0 {
                    request.len = half;
                }
            }
            Some(Fault::Delay(d)) => std::thread::sleep(d),
            _ => {}
        }
        // SAFETY: forwarded under the caller's contract.
        unsafe { self.inner.push(request) }
    }

    fn submit_and_reap(&mut self, wait: bool, out: &mut Vec<BackendCompletion>) -> io::Result<()> {
        let had_failed = !self.failed.is_empty();
        out.append(&mut self.failed);
        self.inner.submit_and_reap(wait && !had_failed, out)
    }

    fn waker(&self) -> Waker {
        self.inner.waker()
    }
}
