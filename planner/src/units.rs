//! Sizes (`40GiB`), bandwidths (`4x6.5GB/s`) and durations as the planner reads and prints them.
//!
//! Parsing is teraio-units', shared with the engine, the CLI and Python: `K`/`M`/`G` and
//! `KiB`/`MiB`/`GiB` are powers of 1024, `kB`/`MB`/`GB` powers of 1000, everywhere. Bandwidths
//! are bytes per second.

use crate::error::Result;
pub use teraio_units::{ReadWriteBandwidth, BANDWIDTH_BYTES_PER_S_MAX, DEVICE_COUNT_MAX, SIZE_BYTES_MAX};

/// Parses a size such as `40GiB`, `94GB`, `512M` or `1000` (bytes).
pub fn parse_size_bytes(input: &str) -> Result<u64> {
    Ok(teraio_units::parse_size_bytes(input)?)
}

/// Parses one bandwidth such as `6.5GB/s` or `4x800MiB/s` into bytes per second.
pub fn parse_bandwidth_bytes_per_s(input: &str) -> Result<f64> {
    Ok(teraio_units::parse_bandwidth_bytes_per_s(input)?)
}

/// Parses an SSD array: `4x6.5GB/s` (same read and write), `4x6.7/6.5GB/s` (read/write per
/// device), or `26GB/s` (one device or an aggregate).
pub fn parse_ssd_bandwidth(input: &str) -> Result<ReadWriteBandwidth> {
    Ok(teraio_units::parse_array_bandwidth(input)?)
}

/// Formats bytes as GiB with two decimals (the unit GPU memory is sold in).
pub fn format_gib(size_bytes: f64) -> String {
    format!("{:.2} GiB", size_bytes / (1u64 << 30) as f64)
}

/// Formats microseconds as milliseconds or seconds, whichever reads better.
pub fn format_duration_us(duration_us: f64) -> String {
    if duration_us >= 1e6 {
        format!("{:.3} s", duration_us / 1e6)
    } else {
        format!("{:.3} ms", duration_us / 1e3)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_planner_reads_units_as_the_engine_does() {
        // One meaning of G everywhere: `teraio plan --gpu-mem 1G` is the 1 GiB `teraio bench --size 1G` is.
        assert_eq!(parse_size_bytes("1G").unwrap(), 1 << 30);
        assert_eq!(parse_size_bytes("94GB").unwrap(), 94_000_000_000);
        assert_eq!(parse_bandwidth_bytes_per_s("4x6.5GB/s").unwrap(), 26e9);
        assert_eq!(parse_ssd_bandwidth("4x6.7/6.5GB/s").unwrap().write_bytes_per_s, 26e9);
        let message = parse_size_bytes("40 gigs").unwrap_err().to_string();
        assert!(message.contains("unknown unit"), "{message}");
    }

    #[test]
    fn durations_and_sizes_print() {
        assert_eq!(format_gib((3u64 << 29) as f64), "1.50 GiB");
        assert_eq!(format_duration_us(1500.0), "1.500 ms");
        assert_eq!(format_duration_us(2.5e6), "2.500 s");
    }
}
