//! Parsing and printing of sizes, durations and rates on the command line and in reports.

use std::time::Duration;

/// clap value parser for sizes (`4k`, `1MiB`, `2G`; binary units), via the engine's parser.
pub fn size_arg(text: &str) -> Result<u64, String> {
    teraio_engine::parse_size(text).map_err(|e| e.to_string())
}

/// clap value parser for GPU and host memory sizes: as [`size_arg`], but a bare number under
/// 1 MiB (`--gpu-mem 40`) is refused with "did you mean 40GiB?" (teraio-units).
pub fn memory_size_arg(text: &str) -> Result<u64, String> {
    teraio_units::parse_memory_size_bytes(text).map_err(|e| e.to_string())
}

/// clap value parser for one bandwidth such as `6.5GB/s` or `4x800MiB/s`, in bytes per second.
pub fn bandwidth_arg(text: &str) -> Result<f64, String> {
    teraio_units::parse_bandwidth_bytes_per_s(text).map_err(|e| e.to_string())
}

/// clap value parser for an SSD array: `4x6.5GB/s` (same read and write), `4x6.7/6.5GB/s`
/// (read/write per device), or `26GB/s` (one device or an aggregate).
pub fn ssd_arg(text: &str) -> Result<teraio_units::ReadWriteBandwidth, String> {
    teraio_units::parse_array_bandwidth(text).map_err(|e| e.to_string())
}

/// clap value parser for durations: `10` or `10s`, `500ms`, `2m`.
pub fn duration_arg(text: &str) -> Result<Duration, String> {
    let t = text.trim();
    let (number, scale_s) = if let Some(n) = t.strip_suffix("ms") {
        (n, 0.001)
    } else if let Some(n) = t.strip_suffix('s') {
        (n, 1.0)
    } else if let Some(n) = t.strip_suffix('m') {
        (n, 60.0)
    } else {
        (t, 1.0)
    };
    let value: f64 = number.trim().parse().map_err(|_| format!("{text:?} is not a duration (e.g. 10s, 500ms, 2m)"))?;
    if !value.is_finite() || value < 0.0 {
        return Err(format!("{text:?} is not a duration (e.g. 10s, 500ms, 2m)"));
    }
    Ok(Duration::from_secs_f64(value * scale_s))
}

/// `4096` -> `4 KiB`, `1536 MiB` -> `1.5 GiB`.
pub fn format_bytes(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit < UNITS.len() - 1 {
        value /= 1024.0;
        unit += 1;
    }
    if value.fract() == 0.0 {
        format!("{value:.0} {}", UNITS[unit])
    } else {
        format!("{value:.2} {}", UNITS[unit])
    }
}

/// Bytes as GiB with two decimals (the unit GPU memory is sold in), for the planner's reports.
pub fn format_gib(size_bytes: f64) -> String {
    format!("{:.2} GiB", size_bytes / (1u64 << 30) as f64)
}

/// Microseconds as milliseconds or seconds, whichever reads better.
pub fn format_duration_us(duration_us: f64) -> String {
    if duration_us >= 1e6 {
        format!("{:.3} s", duration_us / 1e6)
    } else {
        format!("{:.3} ms", duration_us / 1e3)
    }
}

/// Short size for fio job files and file names: `4194304` -> `4m`, `4096` -> `4k`.
pub fn short_size(bytes: u64) -> String {
    const K: u64 = 1024;
    if bytes.is_multiple_of(K * K * K) {
        format!("{}g", bytes / (K * K * K))
    } else if bytes.is_multiple_of(K * K) {
        format!("{}m", bytes / (K * K))
    } else if bytes.is_multiple_of(K) {
        format!("{}k", bytes / K)
    } else {
        bytes.to_string()
    }
}

/// Thousands separators for counts: `80512` -> `80,512`.
pub fn group_thousands(value: u64) -> String {
    let digits = value.to_string();
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_parse() {
        assert_eq!(duration_arg("10").unwrap(), Duration::from_secs(10));
        assert_eq!(duration_arg("500ms").unwrap(), Duration::from_millis(500));
        assert_eq!(duration_arg("2m").unwrap(), Duration::from_secs(120));
        assert!(duration_arg("fast").is_err());
        assert!(duration_arg("-1s").is_err());
    }

    #[test]
    fn sizes_print() {
        assert_eq!(format_bytes(4096), "4 KiB");
        assert_eq!(format_bytes(1536 << 20), "1.50 GiB");
        assert_eq!(short_size(4 << 20), "4m");
        assert_eq!(short_size(4096), "4k");
        assert_eq!(group_thousands(80512), "80,512");
        assert_eq!(group_thousands(512), "512");
        assert_eq!(size_arg("1M").unwrap(), 1 << 20);
    }

    #[test]
    fn the_planner_commands_read_units_as_bench_does() {
        // One meaning of G everywhere: `teraio plan --gpu-mem 1G` is the 1 GiB `teraio bench --size 1G` is.
        assert_eq!(size_arg("1G").unwrap(), 1 << 30);
        assert_eq!(size_arg("94GB").unwrap(), 94_000_000_000);
        assert_eq!(bandwidth_arg("4x6.5GB/s").unwrap(), 26e9);
        assert_eq!(ssd_arg("4x6.7/6.5GB/s").unwrap().write_bytes_per_s, 26e9);
        let message = size_arg("40 gigs").unwrap_err();
        assert!(message.contains("unknown unit"), "{message}");
        let message = memory_size_arg("40").unwrap_err();
        assert!(message.contains("did you mean 40GiB?"), "{message}");
        assert_eq!(memory_size_arg("53.86GiB").unwrap(), 57_831_734_640);
    }

    #[test]
    fn planner_durations_and_sizes_print() {
        assert_eq!(format_gib((3u64 << 29) as f64), "1.50 GiB");
        assert_eq!(format_duration_us(1500.0), "1.500 ms");
        assert_eq!(format_duration_us(2.5e6), "2.500 s");
    }
}
