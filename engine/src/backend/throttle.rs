//! A device model in front of any backend: each device behaves like an SSD of a given read and
//! write bandwidth and access latency. Requests are served one after another at the modelled rate
//! (a device is busy until the previous transfer ends), and a completion is handed back no earlier
//! than its modelled finish plus the latency. With the data in files on a fast medium (tmpfs, the
//! page cache) this stands in for arrays the machine does not have, e.g. 8 x 6.5 GB/s.

use super::{Backend, BackendCompletion, BackendRequest, IoKind, Waker};
use std::collections::HashMap;
use std::io;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The modelled device.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DeviceModel {
    pub read_bytes_per_s: f64,
    pub write_bytes_per_s: f64,
    /// Added to every request (command overhead, flash access).
    pub latency: Duration,
}

impl DeviceModel {
    /// Parses `6.5GB/s`, `7/6.5GB/s` (read/write) with an optional `@20us` latency.
    pub fn parse(text: &str) -> Result<DeviceModel, String> {
        let (rates, latency) = match text.split_once('@') {
            Some((r, l)) => (r, Some(l)),
            None => (text, None),
        };
        let rates = teraio_units::parse_device_bandwidth(rates)
            .map_err(|e| format!("{e}; give a rate like 6.5GB/s or 7/6.5GB/s (read/write), optionally @20us"))?;
        let latency = match latency {
            None => Duration::from_micros(20),
            Some(l) => {
                let us = l.trim().strip_suffix("us").and_then(|v| v.trim().parse::<u64>().ok());
                Duration::from_micros(us.ok_or_else(|| format!("{text:?}: latency like @20us"))?)
            }
        };
        Ok(DeviceModel {
            read_bytes_per_s: rates.read_bytes_per_s,
            write_bytes_per_s: rates.write_bytes_per_s,
            latency,
        })
    }

    fn transfer_time(&self, kind: IoKind, len: u32) -> Duration {
        let rate = match kind {
            IoKind::Read => self.read_bytes_per_s,
            IoKind::Write => self.write_bytes_per_s,
            IoKind::Flush => return Duration::ZERO,
        };
        Duration::from_secs_f64(len as f64 / rate)
    }
}

/// When a modelled device finishes the transfers accepted so far: one per device, shared by every
/// backend stack of it (its host queue and its cuFile queue), since they share its bandwidth.
pub type BusyUntil = Arc<Mutex<Instant>>;

pub struct ThrottledBackend {
    inner: Box<dyn Backend>,
    model: DeviceModel,
    busy_until: BusyUntil,
    deadlines: HashMap<u64, Instant>,
    /// Completions the inner backend finished but the model has not yet.
    held: Vec<(Instant, BackendCompletion)>,
}

impl ThrottledBackend {
    /// Wraps `inner` as a device of `model` whose transfers `busy_until` orders.
    pub fn new(inner: Box<dyn Backend>, model: DeviceModel, busy_until: &BusyUntil) -> Self {
        ThrottledBackend { inner, model, busy_until: busy_until.clone(), deadlines: HashMap::new(), held: Vec::new() }
    }

    fn release_due(&mut self, now: Instant, out: &mut Vec<BackendCompletion>) {
        let mut i = 0;
        while i < self.held.len() {
            if self.held[i].0 <= now {
                out.push(self.held.swap_remove(i).1);
            } else {
                i += 1;
            }
        }
    }
}

impl Backend for ThrottledBackend {
    fn name(&self) -> &'static str {
        "emulated"
    }

    unsafe fn push(&mut self, request: BackendRequest) {
        let now = Instant::now();
        let end = {
            let mut busy_until = self.busy_until.lock().expect("device model");
            *busy_until = (*busy_until).max(now) + self.model.transfer_time(request.kind, request.len);
            *busy_until
        };
        self.deadlines.insert(request.token, end + self.model.latency);
        // SAFETY: forwarded under the caller's contract.
        unsafe { self.inner.push(request) }
    }

    fn submit_and_reap(&mut self, wait: bool, out: &mut Vec<BackendCompletion>) -> io::Result<()> {
        let mut finished = Vec::new();
        self.inner.submit_and_reap(wait && self.held.is_empty(), &mut finished)?;
        for c in finished {
            let due = self.deadlines.remove(&c.token).unwrap_or_else(Instant::now);
            self.held.push((due, c));
        }
        let start = out.len();
        self.release_due(Instant::now(), out);
        if wait && out.len() == start {
            if let Some(next) = self.held.iter().map(|(due, _)| *due).min() {
                std::thread::sleep(next.saturating_duration_since(Instant::now()));
                self.release_due(Instant::now(), out);
            }
        }
        Ok(())
    }

    fn waker(&self) -> Waker {
        self.inner.waker()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn models_parse() {
        let m = DeviceModel::parse("7/6.5GB/s@30us").unwrap();
        assert_eq!(m.read_bytes_per_s, 7e9);
        assert_eq!(m.write_bytes_per_s, 6.5e9);
        assert_eq!(m.latency, Duration::from_micros(30));
        assert_eq!(DeviceModel::parse("500MB/s").unwrap().read_bytes_per_s, 5e8);
        assert!(DeviceModel::parse("fast").is_err());
        assert!(DeviceModel::parse("0GB/s").is_err());
        assert!(DeviceModel::parse("1GB/s@soon").is_err());
    }

    #[test]
    fn a_throttled_device_delivers_at_the_modelled_rate() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("d");
        crate::device::create_file(&path, 64 << 20).unwrap();
        let device = crate::device::Device::open(&path, false).unwrap();
        let inner = Box::new(super::super::psync::PsyncBackend::new(&device, 4).unwrap());
        // 200 MB/s: 32 MiB take ~168 ms whatever the file underneath can do.
        let model =
            DeviceModel { read_bytes_per_s: 200e6, write_bytes_per_s: 200e6, latency: Duration::from_micros(50) };
        let mut b = ThrottledBackend::new(inner, model, &Arc::new(Mutex::new(Instant::now())));
        let mut buf = vec![0u8; 1 << 20];
        let started = Instant::now();
        let mut done = 0;
        let mut out = Vec::new();
        let mut next = 0u64;
        while done < 32 {
            while next < 32 && next - done < 4 {
                // SAFETY: buf outlives the requests; at most 4 in flight (the pool's depth). The
                // requests all read into one buffer: the bytes do not matter here.
                unsafe {
                    b.push(BackendRequest {
                        token: next,
                        kind: IoKind::Read,
                        offset: next << 20,
                        buf: buf.as_mut_ptr(),
                        len: 1 << 20,
                        fixed_index: None,
                    })
                };
                next += 1;
            }
            out.clear();
            b.submit_and_reap(true, &mut out).unwrap();
            assert!(out.iter().all(|c| c.result == 1 << 20));
            done += out.len() as u64;
        }
        let elapsed = started.elapsed().as_secs_f64();
        let expected = 32.0 * (1 << 20) as f64 / 200e6;
        assert!(elapsed >= expected * 0.98, "{elapsed:.3}s is faster than the model's {expected:.3}s");
        assert!(elapsed < expected * 1.5 + 0.05, "{elapsed:.3}s is far slower than the model's {expected:.3}s");
    }
}
