//! Checksums are checked on every get by default: a damaged stripe unit fails the get with an
//! error naming the object, stripe unit, device and offset. A ranged get checks every stripe unit
//! it covers whole, and a unit it covers in part when reading the rest of it at most doubles the
//! get's I/O; `verify_checksums: false` turns the check off.

use teraio_e2e::*;
use teraio_engine::{BackendKind, Error, OpenConfig, Priority, Store};

/// The damage these tests do: one byte with bits flipped.
fn flip_byte(path: &std::path::Path, offset: u64) {
    flip_bits(path, offset, 0x01);
}

/// (device index, byte offset on it) where `needle` is stored.
fn locate(devices: &TempDevices, needle: &[u8]) -> (u16, u64) {
    for (i, p) in devices.paths.iter().enumerate() {
        let hay = std::fs::read(p).unwrap();
        if let Some(at) = hay.windows(needle.len()).position(|w| w == needle) {
            return (i as u16, at as u64);
        }
    }
    panic!("bytes not found on any device");
}

const SU: usize = 64 * 1024; // small_format's stripe unit

/// A 3-device store holding object 1 (5.5 stripe units of random bytes) with one flipped bit in
/// stripe unit 2; returns the devices, the data and where the flip is.
fn damaged_store() -> (TempDevices, Vec<u8>, u16, u64) {
    let devices = TempDevices::new(3, 16 << 20);
    let data = random_bytes(5 * SU + SU / 2, 21);
    {
        let store = create(&devices, BackendKind::Auto);
        store.put_blocking(1, &data, b"").unwrap();
    }
    let (device, at) = locate(&devices, &data[2 * SU + 1000..2 * SU + 1064]);
    flip_byte(&devices.paths[device as usize], at + 7);
    (devices, data, device, at + 7)
}

#[test]
fn a_damaged_unit_fails_a_default_get_naming_object_unit_device_and_offset() {
    let (devices, _data, device, flipped_at) = damaged_store();
    // Default open settings: checks are on without asking.
    let store = Store::open(&devices.paths, open_config(BackendKind::Auto)).unwrap();
    let err = store.get(1, vec![0u8; 6 * SU], Priority::Normal).unwrap().wait().unwrap_err();
    match &err {
        Error::ChecksumMismatch { id: 1, unit: 2, device: d, device_offset } => {
            assert_eq!(*d, device);
            // The offset is where the damaged unit starts on that device.
            assert!(*device_offset <= flipped_at && flipped_at < device_offset + SU as u64, "{err}");
        }
        other => panic!("expected a checksum mismatch in unit 2, got {other}"),
    }
    let message = err.to_string();
    for part in ["object 1", "stripe unit 2", &format!("device {device}"), "offset"] {
        assert!(message.contains(part), "{message:?} lacks {part:?}");
    }
    assert!(matches!(store.get_to_vec(1), Err(Error::ChecksumMismatch { .. })));
}

#[test]
fn a_ranged_get_checks_the_units_it_covers_and_cheap_partial_ones() {
    let (devices, data, _, _) = damaged_store();
    let store = Store::open(&devices.paths, open_config(BackendKind::Auto)).unwrap();
    let get = |start: usize, len: usize| store.get_range(1, start as u64, vec![0u8; len], Priority::Normal)?.wait();
    // Unit 2 (the damaged one) covered whole, with parts of units 1 and 3.
    let err = get(SU + 60_000, 2 * SU).unwrap_err();
    assert!(matches!(err, Error::ChecksumMismatch { id: 1, unit: 2, .. }), "{err}");
    // 40,000 bytes of unit 2 away from the flipped byte: reading the rest of the unit at most
    // doubles the I/O, so the whole unit is read and checked.
    let err = get(2 * SU + 20_000, 40_000).unwrap_err();
    assert!(matches!(err, Error::ChecksumMismatch { id: 1, unit: 2, .. }), "{err}");
    // 100 bytes of it away from the flip: checking would read the whole 64 KiB unit instead of
    // one 4 KiB block, so they are returned unchecked (docs/python.md says so).
    assert_eq!(get(2 * SU + 40_000, 100).unwrap(), data[2 * SU + 40_000..2 * SU + 40_100]);
    // Ranges that do not reach unit 2 come back whole and right.
    for (start, len) in [(SU + 123, SU - 123), (3 * SU + 5, 2 * SU + SU / 2 - 5), (0, 17), (5 * SU + 1, SU / 2 - 1)] {
        let buf = store.get_range(1, start as u64, vec![0u8; len], Priority::Normal).unwrap().wait().unwrap();
        assert_eq!(buf, data[start..start + len], "range {start}+{len}");
    }
}

#[test]
fn turning_checks_off_returns_the_damaged_bytes() {
    let (devices, data, _, _) = damaged_store();
    let config = OpenConfig { verify_checksums: false, ..open_config(BackendKind::Auto) };
    let store = Store::open(&devices.paths, config).unwrap();
    let got = store.get_to_vec(1).unwrap();
    assert_ne!(got, data, "with checks off the flipped bit comes back");
    assert_eq!(got.iter().zip(&data).filter(|(a, b)| a != b).count(), 1);
}

#[test]
fn verified_ranged_gets_return_exactly_the_range_on_both_backends() {
    for backend in BACKENDS {
        let devices = TempDevices::new(3, 16 << 20);
        let store = create(&devices, backend);
        let data = random_bytes(7 * SU + 777, 5);
        store.put_blocking(9, &data, b"").unwrap();
        let mut rng = 0x1234_5678u64;
        for _ in 0..200 {
            rng = rng.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            let start = (rng >> 33) as usize % data.len();
            let len = 1 + (rng >> 13) as usize % (data.len() - start);
            // Slack around the range must stay untouched: the rest of each unit goes to bounce memory.
            let mut buf = vec![0xA5u8; len + 64];
            // SAFETY: we wait before `buf` is used again.
            let t = unsafe {
                store.get_raw_ticket(9, start as u64, buf.as_mut_ptr().add(32), len, false, Priority::Normal)
            };
            t.unwrap().wait().unwrap();
            assert_eq!(&buf[32..32 + len], &data[start..start + len], "{backend:?} range {start}+{len}");
            assert!(buf[..32].iter().chain(&buf[32 + len..]).all(|&b| b == 0xA5), "bytes outside the range written");
        }
    }
}
