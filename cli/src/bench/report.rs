//! Bench results: built from the engine's counters and the bench's own, printed as a table
//! for people or as JSON for scripts.

use super::workload::{PhaseTotals, StopReason, Workload};
use crate::cpu::CpuTimes;
use crate::units::{format_bytes, group_thousands};
use serde::Serialize;
use teraio_engine::{IoCounters, LatencySummary, StatsSnapshot};

/// Latency percentiles in microseconds.
#[derive(Debug, Clone, Default, Serialize)]
pub struct LatencyUs {
    pub count: u64,
    pub mean_us: f64,
    pub p50_us: u64,
    pub p90_us: u64,
    pub p99_us: u64,
    pub p999_us: u64,
    pub max_us: u64,
}

impl From<LatencySummary> for LatencyUs {
    fn from(s: LatencySummary) -> Self {
        LatencyUs {
            count: s.count,
            mean_us: s.mean_us,
            p50_us: s.p50_us,
            p90_us: s.p90_us,
            p99_us: s.p99_us,
            p999_us: s.p999_us,
            max_us: s.max_us,
        }
    }
}

/// One direction (read or write) of one device, or of all of them.
#[derive(Debug, Clone, Default, Serialize)]
pub struct DirectionResult {
    pub ops: u64,
    pub bytes: u64,
    /// Decimal gigabytes (1e9 bytes) per second.
    pub gb_per_s: f64,
    pub iops: f64,
    pub latency: LatencyUs,
}

impl DirectionResult {
    fn new(ops: u64, bytes: u64, latency: LatencySummary, elapsed_s: f64) -> Self {
        DirectionResult {
            ops,
            bytes,
            gb_per_s: bytes as f64 / elapsed_s / 1e9,
            iops: ops as f64 / elapsed_s,
            latency: latency.into(),
        }
    }
}

/// Device requests of one device (or the whole store), as the engine's queues counted them.
#[derive(Debug, Clone, Serialize)]
pub struct DeviceResult {
    pub name: String,
    pub read: DirectionResult,
    pub write: DirectionResult,
    pub errors: u64,
    pub retries: u64,
}

impl DeviceResult {
    fn new(name: String, c: &IoCounters, elapsed_s: f64) -> Self {
        DeviceResult {
            name,
            read: DirectionResult::new(c.read_ops, c.read_bytes, c.read_latency.summary(), elapsed_s),
            write: DirectionResult::new(c.write_ops, c.write_bytes, c.write_latency.summary(), elapsed_s),
            errors: c.errors,
            retries: c.retries,
        }
    }
}

/// Host CPU the whole process used in the timed phase.
#[derive(Debug, Clone, Serialize)]
pub struct CpuResult {
    pub user_s: f64,
    pub system_s: f64,
    /// Average cores busy: CPU seconds / wall seconds.
    pub cores_busy: f64,
    /// Cores busy per GB/s moved: what the host must supply per unit of bandwidth.
    pub cores_per_gb_per_s: f64,
}

/// A finished bench run.
#[derive(Debug, Clone, Serialize)]
pub struct BenchReport {
    pub workload: Workload,
    pub backend: String,
    pub backend_reason: String,
    pub elapsed_s: f64,
    /// What ended the timed phase.
    pub stopped_by: StopReason,
    /// What the targets are (files on which file systems, or block devices).
    pub targets: String,
    /// Bytes moved per second by the bench's ops (reads plus writes), decimal GB/s.
    pub gb_per_s: f64,
    /// Ops (gets and puts) per second.
    pub ops_per_s: f64,
    pub devices: Vec<DeviceResult>,
    /// All devices together.
    pub aggregate: DeviceResult,
    /// Whole ops as the caller sees them (a sequential op is a whole object).
    pub object_get: DirectionResult,
    pub object_put: DirectionResult,
    pub cpu: CpuResult,
    pub verified_bytes: u64,
    /// Objects of the random-write set deleted so that random writes found room.
    pub room_deletes: u64,
    /// With GPU buffers: the engine's GPU path (bounce or cuFile) and why it was chosen.
    pub gpu_path: Option<String>,
}

impl BenchReport {
    pub fn new(
        workload: &Workload,
        device_names: &[String],
        stats: &StatsSnapshot,
        totals: &PhaseTotals,
        cpu: CpuTimes,
    ) -> BenchReport {
        let elapsed_s = totals.elapsed_s.max(1e-9);
        let bytes = totals.read_bytes + totals.write_bytes;
        let gb_per_s = bytes as f64 / elapsed_s / 1e9;
        let cpu_s = cpu.user.as_secs_f64() + cpu.system.as_secs_f64();
        let cores_busy = cpu_s / elapsed_s;
        BenchReport {
            workload: workload.clone(),
            backend: stats.backend.clone(),
            backend_reason: stats.backend_reason.clone(),
            elapsed_s,
            stopped_by: totals.stopped_by,
            targets: String::new(),
            gb_per_s,
            ops_per_s: (totals.read_ops + totals.write_ops) as f64 / elapsed_s,
            devices: stats
                .devices
                .iter()
                .enumerate()
                .map(|(i, c)| {
                    DeviceResult::new(
                        device_names.get(i).cloned().unwrap_or_else(|| format!("device {i}")),
                        c,
                        elapsed_s,
                    )
                })
                .collect(),
            aggregate: DeviceResult::new(format!("all {} device(s)", stats.devices.len()), &stats.total, elapsed_s),
            object_get: DirectionResult::new(
                totals.read_ops,
                totals.read_bytes,
                stats.ops.get_latency.summary(),
                elapsed_s,
            ),
            object_put: DirectionResult::new(
                totals.write_ops,
                totals.write_bytes,
                stats.ops.put_latency.summary(),
                elapsed_s,
            ),
            cpu: CpuResult {
                user_s: cpu.user.as_secs_f64(),
                system_s: cpu.system.as_secs_f64(),
                cores_busy,
                cores_per_gb_per_s: if gb_per_s > 0.0 { cores_busy / gb_per_s } else { 0.0 },
            },
            verified_bytes: totals.verified_bytes,
            room_deletes: totals.room_deletes,
            gpu_path: None,
        }
    }

    /// The readable table.
    pub fn table(&self) -> String {
        let mut out = String::new();
        if !self.targets.is_empty() {
            out.push_str(&format!("targets: {}\n", self.targets));
        }
        out.push_str(&format!("teraio bench: {}\n", self.workload.describe()));
        out.push_str(&format!(
            "backend {} ({}); timed phase {:.1} s ({})\n",
            self.backend,
            self.backend_reason,
            self.elapsed_s,
            self.stopped_by.describe()
        ));
        out.push_str(UNITS_NOTE);
        if let Some(gpu) = &self.gpu_path {
            out.push_str(&format!("GPU path: {gpu}\n"));
        }
        out.push('\n');
        out.push_str(&table_header());
        for d in &self.devices {
            push_device_rows(&mut out, d);
        }
        push_device_rows(&mut out, &self.aggregate);
        out.push_str(&format!("{:-<104}\n", ""));
        let whole = |what: &str| format!("objects: {what} (whole op)");
        if self.object_get.ops > 0 {
            out.push_str(&row(&whole("get"), "read", &self.object_get));
        }
        if self.object_put.ops > 0 {
            out.push_str(&row(&whole("put"), "write", &self.object_put));
        }
        out.push('\n');
        out.push_str(&format!(
            "total: {:.3} GB/s, {} ops/s of {}\n",
            self.gb_per_s,
            group_thousands(self.ops_per_s.round() as u64),
            format_bytes(self.workload.op_bytes())
        ));
        out.push_str(&format!(
            "host CPU: {:.2} cores busy (user {:.2} s, system {:.2} s) = {:.2} cores per GB/s\n",
            self.cpu.cores_busy, self.cpu.user_s, self.cpu.system_s, self.cpu.cores_per_gb_per_s
        ));
        if self.room_deletes > 0 {
            out.push_str(&format!(
                "store full: {} older object(s) of the random-write set deleted to make room\n",
                self.room_deletes
            ));
        }
        if self.workload.verify {
            out.push_str(&format!("verify: {} read back, every byte matched\n", format_bytes(self.verified_bytes)));
        }
        out
    }
}

/// What the table's figures are, under its header.
pub const UNITS_NOTE: &str = "GB/s = 10^9 bytes/s; latencies in ms (device rows: request submit to completion)\n";

/// What the run is compared with: printed after the table when there is no fio run.
pub const REFERENCE_NOTE: &str =
    "reference: none in this run; --compare-fio runs fio's twin of this workload (fio-configs/) on the same files";

/// Column titles of the device table.
pub fn table_header() -> String {
    format!(
        "{:<34} {:<5} {:>8} {:>10} {:>8} {:>8} {:>8} {:>9} {:>8}\n",
        "device", "op", "GB/s", "IOPS", "p50 ms", "p90 ms", "p99 ms", "p99.9 ms", "max ms"
    )
}

/// A latency in microseconds as milliseconds with 3 significant digits (`15.9`, `285`,
/// `4.93`, `0.077`); at least 1 us resolution below 1 ms.
pub fn format_latency_ms(latency_us: u64) -> String {
    let ms = latency_us as f64 / 1e3;
    if ms >= 100.0 {
        format!("{ms:.0}")
    } else if ms >= 10.0 {
        format!("{ms:.1}")
    } else if ms >= 1.0 {
        format!("{ms:.2}")
    } else {
        format!("{ms:.3}")
    }
}

fn push_device_rows(out: &mut String, d: &DeviceResult) {
    let mut any = false;
    if d.read.ops > 0 {
        out.push_str(&row(&d.name, "read", &d.read));
        any = true;
    }
    if d.write.ops > 0 {
        out.push_str(&row(&d.name, "write", &d.write));
        any = true;
    }
    if !any {
        out.push_str(&format!("{:<34} (no requests)\n", shorten(&d.name, 34)));
    }
}

/// One table row.
pub fn row(name: &str, op: &str, r: &DirectionResult) -> String {
    format!(
        "{:<34} {:<5} {:>8.3} {:>10} {:>8} {:>8} {:>8} {:>9} {:>8}\n",
        shorten(name, 34),
        op,
        r.gb_per_s,
        group_thousands(r.iops.round() as u64),
        format_latency_ms(r.latency.p50_us),
        format_latency_ms(r.latency.p90_us),
        format_latency_ms(r.latency.p99_us),
        format_latency_ms(r.latency.p999_us),
        format_latency_ms(r.latency.max_us)
    )
}

/// Keeps the end of long paths (the distinctive part).
pub fn shorten(name: &str, width: usize) -> String {
    let count = name.chars().count();
    if count <= width {
        name.to_string()
    } else {
        format!("...{}", name.chars().skip(count - (width - 3)).collect::<String>())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn latencies_print_in_ms_with_three_significant_digits() {
        let cases = [(285_439, "285"), (15_919, "15.9"), (27_743, "27.7"), (10_000, "10.0"), (4_927, "4.93")];
        for (us, text) in cases {
            assert_eq!(format_latency_ms(us), text, "{us} us");
        }
        assert_eq!(format_latency_ms(999), "0.999");
        assert_eq!(format_latency_ms(77), "0.077");
        assert_eq!(format_latency_ms(0), "0.000");
    }

    #[test]
    fn the_header_says_its_units() {
        let header = table_header();
        assert!(header.contains("GB/s") && header.contains("p99 ms") && !header.contains(" us"), "{header}");
        assert!(UNITS_NOTE.contains("GB/s = 10^9 bytes/s") && UNITS_NOTE.contains("ms"));
        // A row's figures line up under the header's columns.
        let result = DirectionResult {
            ops: 10,
            bytes: 40960,
            gb_per_s: 0.062,
            iops: 15_107.0,
            latency: LatencyUs {
                count: 10,
                mean_us: 5.0,
                p50_us: 4927,
                p90_us: 9063,
                p99_us: 15919,
                p999_us: 27743,
                max_us: 285_439,
            },
        };
        let line = row("0 d0", "read", &result);
        assert_eq!(line.len(), header.len(), "{header}{line}");
        assert!(line.contains(" 4.93 ") && line.contains(" 15.9 ") && line.trim_end().ends_with(" 285"), "{line}");
    }
}
