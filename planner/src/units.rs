//! Parsing and printing of sizes (`40GiB`), bandwidths (`4x6.5GB/s`) and durations.
//!
//! Decimal units (kB, MB, GB, TB) are powers of 1000, binary units (KiB, MiB, GiB, TiB) powers of
//! 1024, as storage vendors and `lsblk` use them. Bandwidths are bytes per second.

use crate::error::{Error, Result};

/// Largest size accepted: 1 EiB. Anything above is surely a typo.
pub const SIZE_BYTES_MAX: u64 = 1 << 60;
/// Largest bandwidth accepted: 100 TB/s.
pub const BANDWIDTH_BYTES_PER_S_MAX: f64 = 1e14;
/// Most devices accepted in `NxBW`.
pub const DEVICE_COUNT_MAX: u32 = 1024;

fn parse_error(what: &'static str, input: &str, reason: impl Into<String>) -> Error {
    Error::Parse { what, input: input.to_string(), reason: reason.into() }
}

/// Splits `12.5GiB` into (12.5, "GiB").
fn split_number(what: &'static str, input: &str) -> Result<(f64, String)> {
    let text = input.trim();
    let split_at = text.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(text.len());
    let (number, unit) = text.split_at(split_at);
    if number.is_empty() {
        return Err(parse_error(what, input, "expected a number first"));
    }
    let value: f64 = number.parse().map_err(|_| parse_error(what, input, format!("{number:?} is not a number")))?;
    if !value.is_finite() {
        return Err(parse_error(what, input, "not a finite number"));
    }
    Ok((value, unit.trim().to_string()))
}

fn unit_multiplier(unit: &str) -> Option<f64> {
    let multiplier = match unit.to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "k" | "kb" => 1e3,
        "m" | "mb" => 1e6,
        "g" | "gb" => 1e9,
        "t" | "tb" => 1e12,
        "kib" => 1024.0,
        "mib" => 1024.0 * 1024.0,
        "gib" => 1024.0 * 1024.0 * 1024.0,
        "tib" => 1024.0 * 1024.0 * 1024.0 * 1024.0,
        _ => return None,
    };
    Some(multiplier)
}

/// Parses a size such as `40GiB`, `94GB`, `512MiB` or `1000` (bytes).
pub fn parse_size_bytes(input: &str) -> Result<u64> {
    let (value, unit) = split_number("size", input)?;
    let multiplier = unit_multiplier(&unit).ok_or_else(|| {
        parse_error("size", input, format!("unknown unit {unit:?}; use B, KB, MB, GB, TB, KiB, MiB, GiB or TiB"))
    })?;
    let bytes = value * multiplier;
    if bytes > SIZE_BYTES_MAX as f64 {
        return Err(parse_error("size", input, "larger than 1 EiB"));
    }
    Ok(bytes.round() as u64)
}

/// Parses one bandwidth such as `6.5GB/s` or `800MiB/s` into bytes per second.
pub fn parse_bandwidth_bytes_per_s(input: &str) -> Result<f64> {
    let (count, rest) = split_count("bandwidth", input)?;
    let per_device = parse_single_bandwidth(input, rest)?;
    checked_bandwidth(input, per_device * f64::from(count))
}

fn checked_bandwidth(input: &str, bytes_per_s: f64) -> Result<f64> {
    if bytes_per_s <= 0.0 {
        return Err(parse_error("bandwidth", input, "must be greater than zero"));
    }
    if bytes_per_s > BANDWIDTH_BYTES_PER_S_MAX {
        return Err(parse_error("bandwidth", input, "larger than 100 TB/s"));
    }
    Ok(bytes_per_s)
}

fn parse_single_bandwidth(input: &str, text: &str) -> Result<f64> {
    let Some(stripped) = text.trim().strip_suffix("/s") else {
        return Err(parse_error("bandwidth", input, "expected a rate ending in /s, such as 6.5GB/s"));
    };
    let (value, unit) = split_number("bandwidth", stripped)
        .map_err(|_| parse_error("bandwidth", input, "expected a number before the unit"))?;
    let multiplier = unit_multiplier(&unit).ok_or_else(|| {
        parse_error("bandwidth", input, format!("unknown unit {unit:?}; use B/s, MB/s, GB/s, MiB/s or GiB/s"))
    })?;
    Ok(value * multiplier)
}

/// Splits `4x6.5GB/s` into (4, "6.5GB/s"); no prefix means one device.
fn split_count<'a>(what: &'static str, input: &'a str) -> Result<(u32, &'a str)> {
    let text = input.trim();
    match text.split_once(['x', 'X', '*']) {
        Some((count, rest)) if !count.is_empty() && count.chars().all(|c| c.is_ascii_digit()) => {
            let count: u32 = count.parse().map_err(|_| parse_error(what, input, "device count too large"))?;
            if count == 0 || count > DEVICE_COUNT_MAX {
                return Err(parse_error(what, input, format!("device count must be 1..={DEVICE_COUNT_MAX}")));
            }
            Ok((count, rest))
        }
        _ => Ok((1, text)),
    }
}

/// Read and write bandwidth of an SSD array, in bytes per second.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ReadWriteBandwidth {
    /// Aggregate read bandwidth (SSD to GPU).
    pub read_bytes_per_s: f64,
    /// Aggregate write bandwidth (GPU to SSD).
    pub write_bytes_per_s: f64,
}

/// Parses an SSD array: `4x6.5GB/s` (same read and write), `4x6.7/6.5GB/s` (read/write per
/// device), or `26GB/s` (one device or an aggregate).
pub fn parse_ssd_bandwidth(input: &str) -> Result<ReadWriteBandwidth> {
    let (count, rest) = split_count("SSD bandwidth", input)?;
    let rest = rest.trim();
    let (read, write) = match rest.split_once('/') {
        Some((read, write)) if write != "s" && !read.is_empty() => {
            // "6.7/6.5GB/s": the unit follows the write figure; apply it to both.
            let write_bytes = parse_single_bandwidth(input, write)?;
            let (write_value, _) = split_number("SSD bandwidth", write)?;
            let (read_value, read_unit) = split_number("SSD bandwidth", read)?;
            if !read_unit.is_empty() {
                return Err(parse_error(
                    "SSD bandwidth",
                    input,
                    "write read/write as 6.7/6.5GB/s (one unit at the end)",
                ));
            }
            (write_bytes * read_value / write_value, write_bytes)
        }
        _ => {
            let both = parse_single_bandwidth(input, rest)?;
            (both, both)
        }
    };
    let count = f64::from(count);
    Ok(ReadWriteBandwidth {
        read_bytes_per_s: checked_bandwidth(input, read * count)?,
        write_bytes_per_s: checked_bandwidth(input, write * count)?,
    })
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
    fn sizes_parse_in_both_unit_systems() {
        assert_eq!(parse_size_bytes("40GiB").unwrap(), 40 << 30);
        assert_eq!(parse_size_bytes("94GB").unwrap(), 94_000_000_000);
        assert_eq!(parse_size_bytes("1.5 KiB").unwrap(), 1536);
        assert_eq!(parse_size_bytes("1000").unwrap(), 1000);
        assert_eq!(parse_size_bytes("0").unwrap(), 0);
    }

    #[test]
    fn bad_sizes_say_why() {
        let message = parse_size_bytes("40 gigs").unwrap_err().to_string();
        assert!(message.contains("unknown unit"), "{message}");
        assert!(parse_size_bytes("GiB").is_err());
        assert!(parse_size_bytes("").is_err());
        assert!(parse_size_bytes("-3GB").is_err());
        assert!(parse_size_bytes("2000000TiB").is_err());
    }

    #[test]
    fn bandwidths_parse_with_device_counts() {
        assert_eq!(parse_bandwidth_bytes_per_s("6.5GB/s").unwrap(), 6.5e9);
        assert_eq!(parse_bandwidth_bytes_per_s("4x6.5GB/s").unwrap(), 26e9);
        let ssd = parse_ssd_bandwidth("4x6.5GB/s").unwrap();
        assert_eq!(ssd.read_bytes_per_s, 26e9);
        assert_eq!(ssd.write_bytes_per_s, 26e9);
        let ssd = parse_ssd_bandwidth("4x6.7/6.5GB/s").unwrap();
        assert!((ssd.read_bytes_per_s - 26.8e9).abs() < 1.0);
        assert!((ssd.write_bytes_per_s - 26e9).abs() < 1.0);
    }

    #[test]
    fn bad_bandwidths_say_why() {
        let message = parse_bandwidth_bytes_per_s("6.5GB").unwrap_err().to_string();
        assert!(message.contains("/s"), "{message}");
        assert!(parse_ssd_bandwidth("0x6.5GB/s").is_err());
        assert!(parse_ssd_bandwidth("4x0GB/s").is_err());
        assert!(parse_ssd_bandwidth("4xfastGB/s").is_err());
        assert!(parse_ssd_bandwidth("4x6.7GB/6.5GB/s").is_err());
    }
}
