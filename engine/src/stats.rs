//! Counters and latency histograms (hdrhistogram, microseconds), per device and per store.
//! Each device worker owns its own numbers behind an uncontended lock; a snapshot merges them.

use hdrhistogram::Histogram;
use std::time::Duration;

/// Longest latency a histogram tracks exactly (60 s); longer ones are clamped to it.
const MAX_TRACKED_US: u64 = 60_000_000;

fn new_histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, MAX_TRACKED_US, 3).expect("valid histogram bounds")
}

/// Latency distribution summary in microseconds.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct LatencySummary {
    pub count: u64,
    pub mean_us: f64,
    pub p50_us: u64,
    pub p90_us: u64,
    pub p99_us: u64,
    pub p999_us: u64,
    pub max_us: u64,
}

/// A latency histogram.
#[derive(Debug, Clone)]
pub struct Latency(Histogram<u64>);

impl Default for Latency {
    fn default() -> Self {
        Latency(new_histogram())
    }
}

impl Latency {
    pub fn record(&mut self, elapsed: Duration) {
        let us = (elapsed.as_micros() as u64).clamp(1, MAX_TRACKED_US);
        self.0.record(us).expect("clamped into bounds");
    }
    pub fn merge(&mut self, other: &Latency) {
        self.0.add(&other.0).expect("same bounds");
    }
    pub fn reset(&mut self) {
        self.0.reset();
    }
    pub fn summary(&self) -> LatencySummary {
        let h = &self.0;
        if h.is_empty() {
            return LatencySummary::default();
        }
        LatencySummary {
            count: h.len(),
            mean_us: h.mean(),
            p50_us: h.value_at_quantile(0.50),
            p90_us: h.value_at_quantile(0.90),
            p99_us: h.value_at_quantile(0.99),
            p999_us: h.value_at_quantile(0.999),
            max_us: h.max(),
        }
    }
}

/// Device-level I/O counters (one per device, and their sum).
#[derive(Debug, Clone, Default)]
pub struct IoCounters {
    pub read_ops: u64,
    pub read_bytes: u64,
    pub write_ops: u64,
    pub write_bytes: u64,
    pub flush_ops: u64,
    /// Requests that failed with an error.
    pub errors: u64,
    /// Resubmissions after a short transfer or EAGAIN/EINTR.
    pub retries: u64,
    /// Requests that went through the urgent lane.
    pub urgent_ops: u64,
    pub read_latency: Latency,
    pub write_latency: Latency,
}

impl IoCounters {
    pub fn merge(&mut self, o: &IoCounters) {
        self.read_ops += o.read_ops;
        self.read_bytes += o.read_bytes;
        self.write_ops += o.write_ops;
        self.write_bytes += o.write_bytes;
        self.flush_ops += o.flush_ops;
        self.errors += o.errors;
        self.retries += o.retries;
        self.urgent_ops += o.urgent_ops;
        self.read_latency.merge(&o.read_latency);
        self.write_latency.merge(&o.write_latency);
    }
}

/// Object-level counters: whole puts and gets as the caller sees them.
#[derive(Debug, Clone, Default)]
pub struct OpCounters {
    pub puts: u64,
    pub put_bytes: u64,
    pub gets: u64,
    pub get_bytes: u64,
    pub deletes: u64,
    pub failed: u64,
    pub put_latency: Latency,
    pub get_latency: Latency,
}

/// A point-in-time copy of a store's statistics.
#[derive(Debug, Clone)]
pub struct StatsSnapshot {
    /// The backend in use and why it was chosen.
    pub backend: String,
    pub backend_reason: String,
    pub devices: Vec<IoCounters>,
    pub total: IoCounters,
    pub ops: OpCounters,
}
