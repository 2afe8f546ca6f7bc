//! Parsing and printing of sizes, durations and rates on the command line and in reports.

use std::time::Duration;

/// clap value parser for sizes (`4k`, `1MiB`, `2G`; binary units), via the engine's parser.
pub fn size_arg(text: &str) -> Result<u64, String> {
    teraio_engine::parse_size(text).map_err(|e| e.to_string())
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
}
