//! Stripe-unit checksums from the crcs pieces took in flight: a GPU put's record and a verified
//! get's check are both built here. Below `op` and `verify`, which both use it.

/// Per stripe unit lying wholly in `[start, end)` (a unit ends at the next unit or at
/// `object_len`), the crc32c of its bytes, combined from the crcs of the pieces that tile it.
pub(crate) fn unit_crcs_from_pieces(
    mut pieces: Vec<(u64, u64, u32)>,
    stripe_unit: u64,
    object_len: u64,
    start: u64,
    end: u64,
) -> Vec<(u64, u32)> {
    pieces.sort_unstable_by_key(|p| p.0);
    let mut out = Vec::new();
    let mut current: Option<(u64, u64, u32)> = None; // (unit, bytes covered so far from the unit start, crc)
    for (offset, len, crc) in pieces {
        let unit = offset / stripe_unit;
        let unit_start = unit * stripe_unit;
        let unit_end = (unit_start + stripe_unit).min(object_len);
        if unit_start < start || unit_end > end {
            continue;
        }
        current = match current {
            Some((u, covered, c)) if u == unit && unit_start + covered == offset => {
                Some((u, covered + len, crc32c::crc32c_combine(c, crc, len as usize)))
            }
            _ if offset == unit_start => Some((unit, len, crc)),
            _ => None,
        };
        if let Some((u, covered, c)) = current {
            if unit_start + covered == unit_end {
                out.push((u, c));
                current = None;
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::unit_crcs_from_pieces;

    #[test]
    fn unit_crcs_combine_pieces_and_skip_partial_units() {
        let data: Vec<u8> = (0..10_000u32).map(|i| (i * 7 + 3) as u8).collect();
        let crc = |a: usize, b: usize| crc32c::crc32c(&data[a..b]);
        // Stripe unit 4096, object of 10_000 bytes cut into pieces of at most 1024 (shuffled).
        let mut pieces: Vec<(u64, u64, u32)> = (0..10_000usize)
            .step_by(1024)
            .map(|a| (a as u64, (10_000 - a).min(1024) as u64, crc(a, (a + 1024).min(10_000))))
            .collect();
        pieces.reverse();
        let all = unit_crcs_from_pieces(pieces.clone(), 4096, 10_000, 0, 10_000);
        assert_eq!(all, vec![(0, crc(0, 4096)), (1, crc(4096, 8192)), (2, crc(8192, 10_000))]);
        // A range that ends inside unit 2 and starts inside unit 0 checks unit 1 only.
        let inner: Vec<_> = pieces.into_iter().filter(|p| p.0 >= 1024 && p.0 + p.1 <= 9216).collect();
        assert_eq!(unit_crcs_from_pieces(inner, 4096, 10_000, 1024, 9216), vec![(1, crc(4096, 8192))]);
    }
}
