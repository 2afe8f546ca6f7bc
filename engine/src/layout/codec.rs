//! Little-endian encoding helpers for the on-disk structures. Decoding never panics on bad input:
//! every read is bounds-checked and reports what was being decoded.

use crate::error::{Error, Result};

/// Appends little-endian fields to a byte vector.
#[derive(Default)]
pub struct Encoder {
    pub bytes: Vec<u8>,
}

impl Encoder {
    pub fn with_capacity(capacity: usize) -> Self {
        Encoder { bytes: Vec::with_capacity(capacity) }
    }
    pub fn u8(&mut self, v: u8) {
        self.bytes.push(v);
    }
    pub fn u16(&mut self, v: u16) {
        self.bytes.extend_from_slice(&v.to_le_bytes());
    }
    pub fn u32(&mut self, v: u32) {
        self.bytes.extend_from_slice(&v.to_le_bytes());
    }
    pub fn u64(&mut self, v: u64) {
        self.bytes.extend_from_slice(&v.to_le_bytes());
    }
    pub fn raw(&mut self, v: &[u8]) {
        self.bytes.extend_from_slice(v);
    }
}

/// Reads little-endian fields from a byte slice; errors name the structure being decoded.
pub struct Decoder<'a> {
    bytes: &'a [u8],
    position: usize,
    what: &'static str,
}

impl<'a> Decoder<'a> {
    pub fn new(bytes: &'a [u8], what: &'static str) -> Self {
        Decoder { bytes, position: 0, what }
    }
    pub fn position(&self) -> usize {
        self.position
    }
    pub fn remaining(&self) -> usize {
        self.bytes.len() - self.position
    }
    pub fn raw(&mut self, len: usize) -> Result<&'a [u8]> {
        if self.remaining() < len {
            return Err(Error::CorruptMetadata {
                detail: format!(
                    "{} truncated: wanted {} bytes at {}, have {}",
                    self.what,
                    len,
                    self.position,
                    self.remaining()
                ),
            });
        }
        let s = &self.bytes[self.position..self.position + len];
        self.position += len;
        Ok(s)
    }
    pub fn u8(&mut self) -> Result<u8> {
        Ok(self.raw(1)?[0])
    }
    pub fn u16(&mut self) -> Result<u16> {
        Ok(u16::from_le_bytes(self.raw(2)?.try_into().expect("2 bytes")))
    }
    pub fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_le_bytes(self.raw(4)?.try_into().expect("4 bytes")))
    }
    pub fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_le_bytes(self.raw(8)?.try_into().expect("8 bytes")))
    }
}

/// Rounds `value` up to a multiple of `align` (a power of two).
pub fn round_up(value: u64, align: u64) -> u64 {
    debug_assert!(align.is_power_of_two());
    (value + align - 1) & !(align - 1)
}

/// Rounds `value` down to a multiple of `align` (a power of two).
pub fn round_down(value: u64, align: u64) -> u64 {
    debug_assert!(align.is_power_of_two());
    value & !(align - 1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_truncation() {
        let mut e = Encoder::default();
        e.u8(7);
        e.u16(0xBEEF);
        e.u32(0xDEAD_BEEF);
        e.u64(u64::MAX - 1);
        let mut d = Decoder::new(&e.bytes, "test");
        assert_eq!(d.u8().unwrap(), 7);
        assert_eq!(d.u16().unwrap(), 0xBEEF);
        assert_eq!(d.u32().unwrap(), 0xDEAD_BEEF);
        assert_eq!(d.u64().unwrap(), u64::MAX - 1);
        assert!(matches!(d.u8(), Err(Error::CorruptMetadata { .. })));
    }

    #[test]
    fn rounding() {
        assert_eq!(round_up(0, 4096), 0);
        assert_eq!(round_up(1, 4096), 4096);
        assert_eq!(round_up(4096, 4096), 4096);
        assert_eq!(round_down(8191, 4096), 4096);
    }
}
