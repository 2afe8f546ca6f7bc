//! `teraio bench --sweep`: the timed phase over a grid of request size x queue depth x threads x
//! stripe unit (as DeepSpeed's ds_nvme_tune sweeps its knobs), then the best settings and the
//! table behind them. The store is formatted and filled once per stripe unit; every other knob
//! is an open-time setting, so each point only reopens the store.

use super::report::BenchReport;
use super::workload::{Limit, Workload};
use super::{fill_and_measure, format_store, open_config, BenchArgs};
use crate::error::CliResult;
use crate::units::{format_bytes, group_thousands};
use serde::Serialize;
use std::path::PathBuf;
use teraio_engine::Store;

/// One point of the grid.
#[derive(Debug, Clone, Serialize)]
pub struct SweepPoint {
    pub request_bytes: u64,
    pub queue_depth: usize,
    pub threads: usize,
    pub stripe_unit_bytes: u64,
    pub gb_per_s: f64,
    /// Device requests per second.
    pub iops: f64,
    pub p99_us: u64,
    pub cores_per_gb_per_s: f64,
}

/// The grid's results and the best point.
#[derive(Debug, Clone, Serialize)]
pub struct SweepReport {
    pub workload: String,
    pub points: Vec<SweepPoint>,
    /// Combinations left out, and why.
    pub skipped: Vec<String>,
    pub best: Option<SweepPoint>,
}

/// Runs the grid on `targets` (already checked and formatted once).
pub fn run(args: &BenchArgs, targets: &[PathBuf], base: &Workload, names: &[String]) -> CliResult<SweepReport> {
    let mut points = Vec::new();
    let mut skipped = Vec::new();
    for &stripe_unit_bytes in &args.sweep_stripe_units {
        let fill_workload = Workload { stripe_unit_bytes, ..base.clone() };
        format_store(args, targets, stripe_unit_bytes, None)?;
        let mut filled = false;
        for &request_bytes in &args.sweep_request_sizes {
            if request_bytes > stripe_unit_bytes {
                skipped.push(format!(
                    "request {} > stripe unit {} (requests never cross a stripe unit)",
                    format_bytes(request_bytes),
                    format_bytes(stripe_unit_bytes)
                ));
                continue;
            }
            if request_bytes > base.object_bytes || !base.object_bytes.is_multiple_of(request_bytes) {
                skipped.push(format!(
                    "request {} does not divide the object size {}",
                    format_bytes(request_bytes),
                    format_bytes(base.object_bytes)
                ));
                continue;
            }
            for &queue_depth in &args.sweep_queue_depths {
                for &threads in &args.sweep_threads {
                    let w = Workload { request_bytes, queue_depth, threads, ..fill_workload.clone() };
                    let store = Store::open(targets, open_config(args, &w))?;
                    let report: BenchReport =
                        fill_and_measure(args, &store, &w, names, !filled, Some(Limit::Runtime(args.sweep_runtime)))?;
                    store.close()?;
                    filled = true;
                    let p99_us = if report.aggregate.read.ops > 0 {
                        report.aggregate.read.latency.p99_us
                    } else {
                        report.aggregate.write.latency.p99_us
                    };
                    let point = SweepPoint {
                        request_bytes,
                        queue_depth,
                        threads,
                        stripe_unit_bytes,
                        gb_per_s: report.gb_per_s,
                        iops: report.aggregate.read.iops + report.aggregate.write.iops,
                        p99_us,
                        cores_per_gb_per_s: report.cpu.cores_per_gb_per_s,
                    };
                    if !args.json {
                        eprintln!(
                            "  request {:>8}  qd {:>4}  threads {:>2}  stripe {:>8}: {:.3} GB/s",
                            format_bytes(request_bytes),
                            queue_depth,
                            threads,
                            format_bytes(stripe_unit_bytes),
                            point.gb_per_s
                        );
                    }
                    points.push(point);
                }
            }
        }
    }
    skipped.dedup();
    let best = best_point(&points);
    Ok(SweepReport { workload: base.describe(), points, skipped, best })
}

/// The fastest point; among points within 2% of it, the one with the fewest requests in
/// flight, then the least CPU per GB/s (cheaper settings that deliver the same).
fn best_point(points: &[SweepPoint]) -> Option<SweepPoint> {
    let top = points.iter().map(|p| p.gb_per_s).fold(0.0, f64::max);
    points
        .iter()
        .filter(|p| p.gb_per_s >= top * 0.98)
        .min_by(|a, b| {
            let inflight = |p: &SweepPoint| p.request_bytes * p.queue_depth as u64;
            inflight(a).cmp(&inflight(b)).then(a.cores_per_gb_per_s.total_cmp(&b.cores_per_gb_per_s))
        })
        .cloned()
}

impl SweepReport {
    /// The table, fastest first, and the best settings as flags.
    pub fn table(&self) -> String {
        let mut out = format!("teraio bench --sweep: {}\n{}\n", self.workload, super::report::UNITS_NOTE);
        out.push_str(&format!(
            "{:>10} {:>5} {:>7} {:>10} {:>9} {:>12} {:>8} {:>12}\n",
            "request", "qd", "threads", "stripe", "GB/s", "IOPS", "p99 ms", "cores/GB/s"
        ));
        let mut sorted = self.points.clone();
        sorted.sort_by(|a, b| b.gb_per_s.total_cmp(&a.gb_per_s));
        for p in &sorted {
            out.push_str(&format!(
                "{:>10} {:>5} {:>7} {:>10} {:>9.3} {:>12} {:>8} {:>12.2}\n",
                format_bytes(p.request_bytes),
                p.queue_depth,
                p.threads,
                format_bytes(p.stripe_unit_bytes),
                p.gb_per_s,
                group_thousands(p.iops.round() as u64),
                super::report::format_latency_ms(p.p99_us),
                p.cores_per_gb_per_s
            ));
        }
        for s in &self.skipped {
            out.push_str(&format!("skipped: {s}\n"));
        }
        if let Some(b) = &self.best {
            out.push_str(&format!(
                "\nbest: --request-size {} --queue-depth {} --threads {} --stripe-unit {}  ({:.3} GB/s, p99 {} ms; the fewest bytes in flight within 2% of the fastest)\n",
                crate::units::short_size(b.request_bytes),
                b.queue_depth,
                b.threads,
                crate::units::short_size(b.stripe_unit_bytes),
                b.gb_per_s,
                super::report::format_latency_ms(b.p99_us)
            ));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn point(request_bytes: u64, queue_depth: usize, gb_per_s: f64) -> SweepPoint {
        SweepPoint {
            request_bytes,
            queue_depth,
            threads: 1,
            stripe_unit_bytes: 4 << 20,
            gb_per_s,
            iops: 0.0,
            p99_us: 0,
            cores_per_gb_per_s: 0.1,
        }
    }

    #[test]
    fn best_prefers_cheaper_settings_within_two_percent() {
        let points = vec![point(4 << 20, 64, 3.00), point(4 << 20, 16, 2.97), point(1 << 20, 4, 1.0)];
        let best = best_point(&points).unwrap();
        assert_eq!(best.queue_depth, 16);
        assert!(best_point(&[]).is_none());
    }
}
