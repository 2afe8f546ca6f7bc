//! The data pattern bench writes and `--verify` checks: every 8-byte word is a hash of the
//! object id and the word's offset in the object, so any byte read back can be checked without
//! keeping a copy, and misplaced data (right bytes, wrong offset or object) is caught too.

/// splitmix64's finalizer: a cheap, well-mixed 64-bit hash.
fn mix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// The word at byte `offset` (a multiple of 8) of object `id`.
fn word(id: u64, offset: u64) -> u64 {
    mix(id.wrapping_mul(0xD1B5_4A32_D192_ED03) ^ (offset >> 3))
}

/// Fills `buf` with object `id`'s bytes from `object_offset` (a multiple of 8).
pub fn fill(buf: &mut [u8], id: u64, object_offset: u64) {
    debug_assert!(object_offset.is_multiple_of(8));
    for (i, chunk) in buf.chunks_mut(8).enumerate() {
        let bytes = word(id, object_offset + 8 * i as u64).to_le_bytes();
        chunk.copy_from_slice(&bytes[..chunk.len()]);
    }
}

/// Checks `buf` against object `id`'s bytes from `object_offset`; returns the object offset of
/// the first wrong byte.
pub fn check(buf: &[u8], id: u64, object_offset: u64) -> Option<u64> {
    for (i, chunk) in buf.chunks(8).enumerate() {
        let at = object_offset + 8 * i as u64;
        let expected = word(id, at).to_le_bytes();
        if chunk != &expected[..chunk.len()] {
            let byte = chunk.iter().zip(expected).position(|(a, b)| *a != b).unwrap_or(0);
            return Some(at + byte as u64);
        }
    }
    None
}

/// A small, fast random source for offsets and op choices (xorshift64*), seeded per worker.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(mix(seed) | 1)
    }
    pub fn next_u64(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    /// Uniform in `0..bound` (bound > 0).
    pub fn below(&mut self, bound: u64) -> u64 {
        ((self.next_u64() as u128 * bound as u128) >> 64) as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn filled_data_checks_and_damage_is_found() {
        let mut buf = vec![0u8; 8192];
        fill(&mut buf, 7, 4096);
        assert_eq!(check(&buf, 7, 4096), None);
        assert_eq!(check(&buf, 8, 4096), Some(4096), "another object's bytes must not pass");
        assert!(check(&buf, 7, 0).is_some(), "bytes from another offset must not pass");
        buf[5000] ^= 1;
        assert_eq!(check(&buf, 7, 4096), Some(4096 + 5000));
    }

    #[test]
    fn rng_stays_in_bounds() {
        let mut rng = Rng::new(3);
        let mut seen = [false; 10];
        for _ in 0..1000 {
            let v = rng.below(10);
            seen[v as usize] = true;
        }
        assert!(seen.iter().all(|&s| s));
    }
}
