//! Sizes and bandwidths as users write them (`24GiB`, `2G`, `6.5GB/s`, `4x6.7/6.5GB/s`), parsed
//! once for every interface: the engine's options, the planner, the `teraio` CLI and Python.
//!
//! One meaning per spelling, everywhere:
//! - binary: `K`, `M`, `G`, `T` (bare, as `fio`, `dd` and the CLI's help use them) and `KiB`,
//!   `MiB`, `GiB`, `TiB` are powers of 1024;
//! - decimal: `kB`, `MB`, `GB`, `TB` (a `B` after the prefix, as SSD vendors quote capacity and
//!   bandwidth) are powers of 1000;
//! - no unit, or `B`: bytes.
//!
//! Fractions are allowed anywhere (`53.86GiB`, `1.5`, `5.5e9`): the size is the product of the
//! number and its unit, rounded down to whole bytes (`0.5KiB` is 512 bytes, `1.9` is 1 byte).
//! Numbers (Python's `5.5e9`) go through [`size_bytes_from_number`], the same rounding.
//!
//! Letters are case-insensitive (`gib`, `Gb` and `gB` read as written above). A bandwidth is a
//! size followed by `/s`, in bytes per second; an SSD array is `N x bandwidth`, and a device's
//! read and write rates can differ: `7/6.5GB/s` (read/write, one unit at the end).

use thiserror::Error;

/// Largest size accepted: 1 EiB. Anything above is surely a typo.
pub const SIZE_BYTES_MAX: u64 = 1 << 60;
/// Largest bandwidth accepted: 100 TB/s.
pub const BANDWIDTH_BYTES_PER_S_MAX: f64 = 1e14;
/// Most devices accepted in `NxBW`.
pub const DEVICE_COUNT_MAX: u32 = 1024;

/// Why a size or bandwidth could not be read; the message names the input and the fix.
#[derive(Debug, Clone, PartialEq, Error)]
#[error("{input:?} is not a {what}: {reason}")]
pub struct ParseError {
    pub what: &'static str,
    pub input: String,
    pub reason: String,
}

fn error(what: &'static str, input: &str, reason: impl Into<String>) -> ParseError {
    ParseError { what, input: input.to_string(), reason: reason.into() }
}

/// Bytes per unit, or None for an unknown unit.
fn unit_multiplier(unit: &str) -> Option<f64> {
    const KIB: f64 = 1024.0;
    let multiplier = match unit.to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "k" | "kib" => KIB,
        "m" | "mib" => KIB * KIB,
        "g" | "gib" => KIB * KIB * KIB,
        "t" | "tib" => KIB * KIB * KIB * KIB,
        "kb" => 1e3,
        "mb" => 1e6,
        "gb" => 1e9,
        "tb" => 1e12,
        _ => return None,
    };
    Some(multiplier)
}

const UNIT_HELP: &str = "use K, M, G, T or KiB, MiB, GiB, TiB (powers of 1024), kB, MB, GB, TB (powers of 1000) or B";

/// Where the number at the start of `text` ends: digits and dots, then an optional exponent
/// (`5.5e9`, `1E-3`) when one follows (no unit starts with `e`).
fn number_end(text: &str) -> usize {
    let mantissa_end = text.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(text.len());
    let rest = &text[mantissa_end..];
    let Some(exponent) = rest.strip_prefix(['e', 'E']) else { return mantissa_end };
    let digits = exponent.strip_prefix(['+', '-']).unwrap_or(exponent);
    let digit_count = digits.find(|c: char| !c.is_ascii_digit()).unwrap_or(digits.len());
    if mantissa_end == 0 || digit_count == 0 {
        return mantissa_end;
    }
    mantissa_end + (rest.len() - digits.len()) + digit_count
}

/// Splits `12.5GiB` into (12.5, "GiB").
fn split_number<'a>(what: &'static str, input: &str, text: &'a str) -> Result<(f64, &'a str), ParseError> {
    let text = text.trim();
    let (number, unit) = text.split_at(number_end(text));
    if number.is_empty() {
        return Err(error(what, input, "expected a number first, e.g. 24GiB"));
    }
    let value: f64 = number.parse().map_err(|_| error(what, input, format!("{number:?} is not a number")))?;
    Ok((value, unit.trim()))
}

/// Bytes from a size such as `24GiB`, `2G` (binary), `94GB` (decimal), `53.86GiB`, `4k`,
/// `4096` or `5.5e9`, rounded down to whole bytes.
pub fn parse_size_bytes(input: &str) -> Result<u64, ParseError> {
    let (value, unit) = split_number("size", input, input)?;
    let multiplier =
        unit_multiplier(unit).ok_or_else(|| error("size", input, format!("unknown unit {unit:?}; {UNIT_HELP}")))?;
    whole_bytes("size", input, value * multiplier)
}

/// Bytes from a number of bytes (an int or a float, as Python passes them): rounded down, as
/// [`parse_size_bytes`] rounds.
pub fn size_bytes_from_number(bytes: f64) -> Result<u64, ParseError> {
    whole_bytes("size", &bytes.to_string(), bytes)
}

/// Bytes from a whole number of bytes (a Python int, whatever its size): 0 to [`SIZE_BYTES_MAX`].
pub fn size_bytes_from_integer(bytes: i128) -> Result<u64, ParseError> {
    if bytes < 0 || bytes > i128::from(SIZE_BYTES_MAX) {
        return Err(error("size", &bytes.to_string(), "must be 0 bytes to 1 EiB"));
    }
    Ok(bytes as u64)
}

/// The rounding every size goes through: finite, not negative, at most [`SIZE_BYTES_MAX`], and
/// rounded down to whole bytes.
fn whole_bytes(what: &'static str, input: &str, bytes: f64) -> Result<u64, ParseError> {
    if !bytes.is_finite() || bytes < 0.0 {
        return Err(error(what, input, "must be a finite number of bytes, 0 or more"));
    }
    if bytes > SIZE_BYTES_MAX as f64 {
        return Err(error(what, input, "larger than 1 EiB"));
    }
    Ok(bytes.floor() as u64)
}

/// Smallest bare number (no unit) read as a memory size: below it, `40` is far more likely a
/// forgotten `GiB` than 40 bytes of GPU or host memory.
pub const BARE_MEMORY_BYTES_MIN: u64 = 1 << 20;

/// A memory size (GPU or host memory) as [`parse_size_bytes`] reads it, but a bare number (no
/// unit) other than 0 and under [`BARE_MEMORY_BYTES_MIN`] is refused with the size it probably
/// meant: `40` asks "did you mean 40GiB?". Write `40B` for 40 bytes; `0` means none.
pub fn parse_memory_size_bytes(input: &str) -> Result<u64, ParseError> {
    let bytes = parse_size_bytes(input)?;
    let (value, unit) = split_number("memory size", input, input)?;
    let number = &input.trim()[..number_end(input.trim())];
    if unit.is_empty() && value != 0.0 && value < BARE_MEMORY_BYTES_MIN as f64 {
        return Err(error(
            "memory size",
            input,
            format!("a bare number is bytes; did you mean {number}GiB? (write {number}B for bytes)"),
        ));
    }
    Ok(bytes)
}

/// Bytes per second from one rate such as `6.5GB/s`, `800MiB/s` or `2G/s`.
fn parse_rate(what: &'static str, input: &str, text: &str) -> Result<f64, ParseError> {
    let Some(size) = text.trim().strip_suffix("/s") else {
        return Err(error(what, input, "expected a rate ending in /s, such as 6.5GB/s"));
    };
    let (value, unit) = split_number(what, input, size)?;
    let multiplier =
        unit_multiplier(unit).ok_or_else(|| error(what, input, format!("unknown unit {unit:?}; {UNIT_HELP}")))?;
    checked_bandwidth(what, input, value * multiplier)
}

fn checked_bandwidth(what: &'static str, input: &str, bytes_per_s: f64) -> Result<f64, ParseError> {
    if bytes_per_s <= 0.0 {
        return Err(error(what, input, "must be greater than zero"));
    }
    if bytes_per_s > BANDWIDTH_BYTES_PER_S_MAX {
        return Err(error(what, input, "larger than 100 TB/s"));
    }
    Ok(bytes_per_s)
}

/// Splits `4x6.5GB/s` into (4, "6.5GB/s"); no prefix means one device.
fn split_count<'a>(what: &'static str, input: &'a str) -> Result<(u32, &'a str), ParseError> {
    let text = input.trim();
    match text.split_once(['x', 'X', '*']) {
        Some((count, rest)) if !count.is_empty() && count.chars().all(|c| c.is_ascii_digit()) => {
            let count: u32 = count.parse().map_err(|_| error(what, input, "device count too large"))?;
            if count == 0 || count > DEVICE_COUNT_MAX {
                return Err(error(what, input, format!("device count must be 1..={DEVICE_COUNT_MAX}")));
            }
            Ok((count, rest))
        }
        _ => Ok((1, text)),
    }
}

/// Bytes per second from a bandwidth: `6.5GB/s`, or `4x6.5GB/s` for an array (the sum).
pub fn parse_bandwidth_bytes_per_s(input: &str) -> Result<f64, ParseError> {
    let (count, rest) = split_count("bandwidth", input)?;
    let per_device = parse_rate("bandwidth", input, rest)?;
    checked_bandwidth("bandwidth", input, per_device * f64::from(count))
}

/// Read and write bandwidth, in bytes per second.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ReadWriteBandwidth {
    pub read_bytes_per_s: f64,
    pub write_bytes_per_s: f64,
}

/// One device's rates: `6.5GB/s` (read and write) or `7/6.5GB/s` (read/write, one unit at the
/// end). No device count: this is what one device does.
pub fn parse_device_bandwidth(input: &str) -> Result<ReadWriteBandwidth, ParseError> {
    read_write("device bandwidth", input, input.trim())
}

/// An SSD array: `4x6.5GB/s`, `4x6.7/6.5GB/s` (read/write per device) or `26GB/s` (one device or
/// an aggregate); the rates returned are the array's sums.
pub fn parse_array_bandwidth(input: &str) -> Result<ReadWriteBandwidth, ParseError> {
    let what = "array bandwidth";
    let (count, rest) = split_count(what, input)?;
    let device = read_write(what, input, rest.trim())?;
    let count = f64::from(count);
    Ok(ReadWriteBandwidth {
        read_bytes_per_s: checked_bandwidth(what, input, device.read_bytes_per_s * count)?,
        write_bytes_per_s: checked_bandwidth(what, input, device.write_bytes_per_s * count)?,
    })
}

fn read_write(what: &'static str, input: &str, text: &str) -> Result<ReadWriteBandwidth, ParseError> {
    match text.split_once('/') {
        Some((read, write)) if write != "s" && !read.is_empty() => {
            // "6.7/6.5GB/s": the unit follows the write figure; it applies to both.
            let write_bytes_per_s = parse_rate(what, input, write)?;
            let (write_value, _) = split_number(what, input, write)?;
            let (read_value, read_unit) = split_number(what, input, read)?;
            if !read_unit.is_empty() {
                return Err(error(what, input, "write read/write as 6.7/6.5GB/s (one unit at the end)"));
            }
            let read_bytes_per_s = checked_bandwidth(what, input, write_bytes_per_s * read_value / write_value)?;
            Ok(ReadWriteBandwidth { read_bytes_per_s, write_bytes_per_s })
        }
        _ => {
            let both = parse_rate(what, input, text)?;
            Ok(ReadWriteBandwidth { read_bytes_per_s: both, write_bytes_per_s: both })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    #[test]
    fn bare_prefixes_and_iec_units_are_binary() {
        for (text, bytes) in [("1G", GIB), ("1GiB", GIB), ("1g", GIB), ("1gib", GIB), ("4k", 4096), ("4KiB", 4096)] {
            assert_eq!(parse_size_bytes(text).unwrap(), bytes, "{text}");
        }
        assert_eq!(parse_size_bytes("1.5G").unwrap(), 3 * GIB / 2);
        assert_eq!(parse_size_bytes("64M").unwrap(), 64 << 20);
        assert_eq!(parse_size_bytes("2T").unwrap(), 2 << 40);
        assert_eq!(parse_size_bytes(" 24 GiB ").unwrap(), 24 * GIB);
    }

    #[test]
    fn si_units_with_a_b_are_decimal() {
        assert_eq!(parse_size_bytes("94GB").unwrap(), 94_000_000_000);
        assert_eq!(parse_size_bytes("1kB").unwrap(), 1000);
        assert_eq!(parse_size_bytes("1KB").unwrap(), 1000);
        assert_eq!(parse_size_bytes("2MB").unwrap(), 2_000_000);
        assert_eq!(parse_size_bytes("1TB").unwrap(), 1_000_000_000_000);
    }

    #[test]
    fn plain_numbers_are_bytes() {
        assert_eq!(parse_size_bytes("4096").unwrap(), 4096);
        assert_eq!(parse_size_bytes("4096B").unwrap(), 4096);
        assert_eq!(parse_size_bytes("0").unwrap(), 0);
    }

    #[test]
    fn bad_sizes_say_why() {
        let message = parse_size_bytes("40 gigs").unwrap_err().to_string();
        assert!(message.contains("unknown unit") && message.contains("powers of 1024"), "{message}");
        for bad in ["GiB", "", "-3GB", "2000000TiB", "4q", "abc", "1.2.3G", "1e", "e9", "1e400"] {
            assert!(parse_size_bytes(bad).is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn fractions_round_down_to_whole_bytes() {
        // 53.86 GiB = 57831734640.64 bytes.
        assert_eq!(parse_size_bytes("53.86GiB").unwrap(), 57_831_734_640);
        assert_eq!(parse_size_bytes("1.5").unwrap(), 1);
        assert_eq!(parse_size_bytes("0.9").unwrap(), 0);
        assert_eq!(parse_size_bytes("0.5KiB").unwrap(), 512);
        assert_eq!(parse_size_bytes("0.0001KiB").unwrap(), 0);
        assert_eq!(parse_size_bytes("5.5e9").unwrap(), 5_500_000_000);
        assert_eq!(parse_size_bytes("2.5E3B").unwrap(), 2500);
        assert_eq!(parse_size_bytes("1e-1GB").unwrap(), 100_000_000);
        assert_eq!(size_bytes_from_number(5.5e9).unwrap(), 5_500_000_000);
        assert_eq!(size_bytes_from_number(4096.99).unwrap(), 4096);
        assert_eq!(size_bytes_from_number(0.0).unwrap(), 0);
        assert_eq!(size_bytes_from_integer((1 << 60) - 1).unwrap(), (1 << 60) - 1, "exact past 2^53");
        assert!(size_bytes_from_integer(-1).is_err() && size_bytes_from_integer((1 << 60) + 1).is_err());
        for bad in [-1.0, f64::NAN, f64::INFINITY, 2e18] {
            assert!(size_bytes_from_number(bad).is_err(), "{bad} accepted");
        }
    }

    #[test]
    fn bare_small_memory_sizes_ask_for_a_unit() {
        let message = parse_memory_size_bytes("40").unwrap_err().to_string();
        assert!(message.contains("did you mean 40GiB?"), "{message}");
        let message = parse_memory_size_bytes(" 53.5 ").unwrap_err().to_string();
        assert!(message.contains("did you mean 53.5GiB?"), "{message}");
        assert_eq!(parse_memory_size_bytes("40B").unwrap(), 40);
        assert_eq!(parse_memory_size_bytes("40GiB").unwrap(), 40 << 30);
        assert_eq!(parse_memory_size_bytes("1048576").unwrap(), BARE_MEMORY_BYTES_MIN);
        assert!(parse_memory_size_bytes("1048575").is_err());
        assert_eq!(parse_memory_size_bytes("4e10").unwrap(), 40_000_000_000);
        assert_eq!(parse_memory_size_bytes("0").unwrap(), 0, "0 is none, not a forgotten unit");
    }

    #[test]
    fn bandwidths_follow_the_size_units() {
        assert_eq!(parse_bandwidth_bytes_per_s("6.5GB/s").unwrap(), 6.5e9);
        assert_eq!(parse_bandwidth_bytes_per_s("1GiB/s").unwrap(), GIB as f64);
        assert_eq!(parse_bandwidth_bytes_per_s("1G/s").unwrap(), GIB as f64);
        assert_eq!(parse_bandwidth_bytes_per_s("4x6.5GB/s").unwrap(), 26e9);
    }

    #[test]
    fn arrays_and_read_write_pairs() {
        let array = parse_array_bandwidth("4x6.5GB/s").unwrap();
        assert_eq!((array.read_bytes_per_s, array.write_bytes_per_s), (26e9, 26e9));
        let array = parse_array_bandwidth("4x6.7/6.5GB/s").unwrap();
        assert!((array.read_bytes_per_s - 26.8e9).abs() < 1.0);
        assert!((array.write_bytes_per_s - 26e9).abs() < 1.0);
        let device = parse_device_bandwidth("7/6.5GB/s").unwrap();
        assert!((device.read_bytes_per_s - 7e9).abs() < 1.0);
        assert_eq!(device.write_bytes_per_s, 6.5e9);
    }

    #[test]
    fn bad_bandwidths_say_why() {
        let message = parse_bandwidth_bytes_per_s("6.5GB").unwrap_err().to_string();
        assert!(message.contains("/s"), "{message}");
        for bad in ["0x6.5GB/s", "4x0GB/s", "4xfastGB/s", "4x6.7GB/6.5GB/s", "0GB/s", "200TB/s"] {
            assert!(parse_array_bandwidth(bad).is_err(), "{bad:?} accepted");
        }
        assert!(parse_device_bandwidth("4x6.5GB/s").is_err(), "a device has no count");
    }
}
