//! Every bad input and every device failure gives a clear error and loses nothing.

use teraio_e2e::*;
use teraio_engine::{BackendKind, Error, Fault, FaultInjector, FaultRule, IoKind, OpenConfig, Priority, Store};

/// The damage these tests do: one byte with bits flipped.
fn flip_byte(path: &std::path::Path, offset: u64) {
    flip_bits(path, offset, 0x20);
}

/// Offset of the first occurrence of `needle` in the file.
fn find(path: &std::path::Path, needle: &[u8]) -> Option<u64> {
    let hay = std::fs::read(path).unwrap();
    hay.windows(needle.len()).position(|w| w == needle).map(|p| p as u64)
}

fn faulty(devices: &TempDevices, injector: &FaultInjector) -> Store {
    let config = OpenConfig { fault_injector: Some(injector.clone()), ..open_config(BackendKind::Auto) };
    Store::create(&devices.paths, &small_format(), config).unwrap()
}

#[test]
fn an_object_larger_than_free_space_is_refused_and_the_store_is_intact() {
    let devices = TempDevices::new(2, 16 << 20);
    let store = create(&devices, BackendKind::Auto);
    let keep = random_bytes(1 << 20, 1);
    store.put_blocking(1, &keep, b"").unwrap();
    let free_before: u64 = store.info().devices.iter().map(|d| d.free_bytes).sum();
    let err = store.put(2, vec![0u8; 64 << 20], b"", Priority::Normal).err().expect("too big");
    assert!(matches!(err, Error::NoSpace { .. }), "{err}");
    assert!(err.to_string().contains("delete objects or add devices"), "{err}");
    let free_after: u64 = store.info().devices.iter().map(|d| d.free_bytes).sum();
    assert_eq!(free_before, free_after, "a failed put must not leak space");
    assert_eq!(store.get_to_vec(1).unwrap(), keep);
    store.put_blocking(3, &keep, b"").unwrap();
    assert!(store.fsck().unwrap().is_clean());
}

#[test]
fn filling_the_store_then_deleting_frees_the_space_again() {
    let devices = TempDevices::new(2, 16 << 20);
    let store = create(&devices, BackendKind::Auto);
    let mut id = 0;
    let chunk = random_bytes(1 << 20, 5);
    loop {
        match store.put(id, chunk.clone(), b"", Priority::Normal).and_then(|t| t.wait()) {
            Ok(_) => id += 1,
            Err(Error::NoSpace { .. }) => break,
            Err(e) => panic!("unexpected {e}"),
        }
    }
    assert!(id > 10);
    for i in 0..id {
        assert!(store.delete(i).unwrap());
    }
    for i in 0..id {
        store.put(i, chunk.clone(), b"", Priority::Normal).unwrap().wait().unwrap();
    }
}

#[test]
fn wrong_missing_extra_and_foreign_devices_are_named() {
    let a = TempDevices::new(3, 16 << 20);
    let b = TempDevices::new(1, 16 << 20);
    create(&a, BackendKind::Auto).close().unwrap();
    create(&b, BackendKind::Auto).close().unwrap();
    let cfg = || open_config(BackendKind::Auto);

    let err = Store::open(&a.paths[..2], cfg()).err().unwrap();
    assert!(matches!(err, Error::MissingDevice { index: 2, count: 3 }), "{err}");

    let mut with_foreign = a.paths.clone();
    with_foreign.push(b.paths[0].clone());
    let err = Store::open(&with_foreign, cfg()).err().unwrap();
    assert!(matches!(err, Error::WrongStore { .. }), "{err}");
    assert!(err.to_string().contains(&b.paths[0].display().to_string()), "{err}");

    let plain = a.dir.path().join("plain");
    teraio_engine::device::create_file(&plain, 1 << 20).unwrap();
    let mut with_plain = a.paths.clone();
    with_plain.push(plain);
    let err = Store::open(&with_plain, cfg()).err().unwrap();
    assert!(matches!(err, Error::NotATeraioDevice { .. }), "{err}");

    let err = Store::open(&[a.dir.path().join("nope")], cfg()).err().unwrap();
    assert!(matches!(err, Error::DeviceOpen { .. }), "{err}");

    let err = Store::open(&[&a.paths[0], &a.paths[0]], cfg()).err().unwrap();
    assert!(matches!(err, Error::InvalidConfig(_)), "{err}");

    // Still fine with the right set.
    Store::open(&a.paths, cfg()).unwrap().close().unwrap();
}

#[test]
fn a_second_writer_is_locked_out() {
    let devices = TempDevices::new(2, 16 << 20);
    let store = create(&devices, BackendKind::Auto);
    let err = Store::open(&devices.paths, open_config(BackendKind::Auto)).err().unwrap();
    assert!(matches!(err, Error::Locked { .. }), "{err}");
    drop(store);
    Store::open(&devices.paths, open_config(BackendKind::Auto)).unwrap();
}

#[test]
fn formatting_over_a_store_needs_force() {
    let devices = TempDevices::new(1, 16 << 20);
    create(&devices, BackendKind::Auto).close().unwrap();
    let err = Store::format(&devices.paths, &small_format()).err().unwrap();
    assert!(err.to_string().contains("force"), "{err}");
    let forced = teraio_engine::FormatConfig { force: true, ..small_format() };
    Store::format(&devices.paths, &forced).unwrap();
}

#[test]
fn a_damaged_primary_superblock_is_restored_from_its_backup() {
    let devices = TempDevices::new(2, 16 << 20);
    let data = random_bytes(300_000, 8);
    {
        let store = create(&devices, BackendKind::Auto);
        store.put_blocking(1, &data, b"m").unwrap();
    }
    flip_byte(&devices.paths[1], 40);
    let store = Store::open(&devices.paths, open_config(BackendKind::Auto)).unwrap();
    assert_eq!(store.get_to_vec(1).unwrap(), data);
    assert!(store.fsck().unwrap().is_clean(), "the primary was rewritten from the backup");
    drop(store);
    // Both copies damaged: a clear error.
    let size = std::fs::metadata(&devices.paths[1]).unwrap().len();
    flip_byte(&devices.paths[1], 40);
    flip_byte(&devices.paths[1], size - 4096 + 40);
    let err = Store::open(&devices.paths, open_config(BackendKind::Auto)).err().unwrap();
    assert!(matches!(err, Error::CorruptSuperblock { .. }), "{err}");
    assert!(err.to_string().contains("backup"), "{err}");
}

#[test]
fn a_corrupt_newest_checkpoint_falls_back_to_the_older_one_and_its_journal() {
    // small_format: metadata at 4096, slots of 1 MiB; generation g lives in slot g % 2.
    let devices = TempDevices::new(1, 16 << 20);
    let data = random_bytes(50_000, 2);
    {
        let store = create(&devices, BackendKind::Auto);
        store.put_blocking(1, &data, b"").unwrap();
        store.close().unwrap(); // checkpoint generation 2 -> slot 0
    }
    flip_byte(&devices.paths[0], 4096 + 70); // inside generation 2's payload
                                             // Generation 1 (empty) plus the generation-2 journal batches still in the ring rebuild it.
    let store = Store::open(&devices.paths, open_config(BackendKind::Auto)).unwrap();
    assert_eq!(store.get_to_vec(1).unwrap(), data);
    store.put_blocking(2, &data, b"").unwrap();
    store.close().unwrap(); // generation 2 again -> slot 0, now whole
    let store = Store::open(&devices.paths, open_config(BackendKind::Auto)).unwrap();
    assert_eq!(store.get_to_vec(2).unwrap(), data);
    store.close().unwrap();
    // Both checkpoints damaged (generation 2's payload, the empty generation 1's header):
    // nothing trustworthy to start from, so a clear error.
    flip_byte(&devices.paths[0], 4096 + 70);
    flip_byte(&devices.paths[0], 4096 + (1 << 20) + 10);
    let err = Store::open(&devices.paths, open_config(BackendKind::Auto)).err().unwrap();
    assert!(matches!(err, Error::CorruptMetadata { .. }), "{err}");
    assert!(err.to_string().contains("fsck"), "{err}");
}

#[test]
fn eio_on_write_fails_the_put_and_keeps_the_old_object() {
    let devices = TempDevices::new(2, 32 << 20);
    let injector = FaultInjector::new();
    let store = faulty(&devices, &injector);
    let old = random_bytes(200_000, 1);
    store.put_blocking(1, &old, b"old").unwrap();
    injector.add(FaultRule::new(Fault::Errno(libc::EIO)).on(IoKind::Write).on_device(1).times(1));
    let err = store.put(1, random_bytes(200_000, 2), b"new", Priority::Normal).unwrap().wait().err().unwrap();
    assert!(matches!(&err, Error::DeviceIo { device: 1, op: "write", .. }), "{err}");
    assert_eq!(err.raw_os_error(), Some(libc::EIO));
    assert_eq!(store.get_to_vec(1).unwrap(), old);
    assert_eq!(store.stat(1).unwrap().meta, b"old");
    assert_eq!(injector.injected(), 1);
    // The store keeps working and its space accounting is whole.
    store.put_blocking(2, &old, b"").unwrap();
    drop(store);
    let store = Store::open(&devices.paths, open_config(BackendKind::Auto)).unwrap();
    assert_eq!(store.get_to_vec(1).unwrap(), old);
    assert!(store.fsck().unwrap().is_clean());
}

#[test]
fn eio_on_read_is_an_error_never_wrong_bytes() {
    let devices = TempDevices::new(2, 32 << 20);
    let injector = FaultInjector::new();
    let store = faulty(&devices, &injector);
    let data = random_bytes(500_000, 3);
    store.put_blocking(1, &data, b"").unwrap();
    injector.add(FaultRule::new(Fault::Errno(libc::EIO)).on(IoKind::Read).times(1));
    let err = store.get(1, vec![0u8; data.len()], Priority::Normal).unwrap().wait().err().unwrap();
    assert!(matches!(err, Error::DeviceIo { op: "read", .. }), "{err}");
    assert_eq!(store.get_to_vec(1).unwrap(), data, "the next get succeeds");
}

#[test]
fn short_transfers_are_finished_not_dropped() {
    for backend in BACKENDS {
        let devices = TempDevices::new(2, 32 << 20);
        let injector = FaultInjector::new();
        let config = OpenConfig { fault_injector: Some(injector.clone()), ..open_config(backend) };
        let store = Store::create(&devices.paths, &small_format(), config).unwrap();
        injector.add(FaultRule::new(Fault::ShortTransfer).times(40));
        let data = random_bytes(777_777, 4);
        store.put_blocking(1, &data, b"").unwrap();
        assert_eq!(store.get_to_vec(1).unwrap(), data);
        assert_eq!(injector.injected(), 40);
        assert!(store.stats().total.retries >= 20, "{:?}", store.stats().total.retries);
    }
}

#[test]
fn a_vanished_or_full_device_gives_errors_and_no_hang() {
    let devices = TempDevices::new(2, 32 << 20);
    let injector = FaultInjector::new();
    let store = faulty(&devices, &injector);
    let data = random_bytes(300_000, 5);
    store.put_blocking(1, &data, b"").unwrap();
    injector.add(FaultRule::new(Fault::Errno(libc::ENODEV)).on_device(0));
    let started = std::time::Instant::now();
    assert!(store.get(1, vec![0u8; data.len()], Priority::Normal).unwrap().wait().is_err());
    assert!(store.put(2, data.clone(), b"", Priority::Normal).unwrap().wait().is_err());
    assert!(started.elapsed() < std::time::Duration::from_secs(10));
    injector.clear();
    injector.add(FaultRule::new(Fault::Errno(libc::ENOSPC)).on(IoKind::Write).times(1));
    let err = store.put(3, data.clone(), b"", Priority::Normal).unwrap().wait().err().unwrap();
    assert_eq!(err.raw_os_error(), Some(libc::ENOSPC), "{err}");
    injector.clear();
    assert_eq!(store.get_to_vec(1).unwrap(), data);
}

#[test]
fn a_failed_journal_write_fails_the_put_and_the_store_reopens() {
    let devices = TempDevices::new(1, 32 << 20);
    let injector = FaultInjector::new();
    let store = faulty(&devices, &injector);
    let data = random_bytes(10_000, 6);
    store.put_blocking(1, &data, b"").unwrap();
    // A flush failure stands for a journal that cannot be made durable.
    injector.add(FaultRule::new(Fault::Errno(libc::EIO)).on(IoKind::Flush).times(1));
    assert!(store.put(2, data.clone(), b"", Priority::Normal).unwrap().wait().is_err());
    assert!(store.stat(2).is_none());
    store.put_blocking(3, &data, b"").unwrap();
    drop(store);
    let store = Store::open(&devices.paths, open_config(BackendKind::Auto)).unwrap();
    assert_eq!(store.get_to_vec(1).unwrap(), data);
    assert_eq!(store.get_to_vec(3).unwrap(), data);
    assert!(store.fsck().unwrap().is_clean());
}

#[test]
fn a_flipped_bit_in_data_is_reported_not_returned() {
    let devices = TempDevices::new(1, 16 << 20);
    let data = random_bytes(200_000, 7);
    {
        let store = create(&devices, BackendKind::Auto);
        store.put_blocking(1, &data, b"").unwrap();
    }
    let at = find(&devices.paths[0], &data[100_000..100_064]).expect("object bytes on disk");
    flip_byte(&devices.paths[0], at + 10);
    let config = OpenConfig { verify_checksums: true, ..open_config(BackendKind::Auto) };
    let store = Store::open(&devices.paths, config).unwrap();
    let err = store.get(1, vec![0u8; data.len()], Priority::Normal).unwrap().wait().err().unwrap();
    assert!(matches!(err, Error::ChecksumMismatch { id: 1, .. }), "{err}");
    let report = store.fsck().unwrap();
    assert_eq!(report.problems.len(), 1, "{:?}", report.problems);
    assert!(report.problems[0].contains("object 1"), "{:?}", report.problems);
}

#[test]
fn bad_arguments_are_named() {
    let devices = TempDevices::new(1, 16 << 20);
    let store = create(&devices, BackendKind::Auto);
    store.put_blocking(1, &[1, 2, 3], b"").unwrap();
    assert!(matches!(store.get(9, vec![0u8; 8], Priority::Normal).err().unwrap(), Error::NotFound { id: 9 }));
    assert!(matches!(store.get(1, vec![0u8; 2], Priority::Normal).err().unwrap(), Error::BufferTooSmall { .. }));
    assert!(matches!(
        store.get_range(1, 2, vec![0u8; 2], Priority::Normal).err().unwrap(),
        Error::RangeOutOfBounds { .. }
    ));
    assert!(matches!(
        store.put(2, vec![0u8; 1], &[0u8; 5000], Priority::Normal).err().unwrap(),
        Error::MetadataTooLarge { .. }
    ));
    let bad = teraio_engine::FormatConfig { stripe_unit_bytes: 3000, ..small_format() };
    assert!(matches!(Store::format(&devices.paths, &bad).err().unwrap(), Error::InvalidConfig(_)));
    let tiny = TempDevices::new(1, 64 << 10);
    assert!(matches!(Store::format(&tiny.paths, &small_format()).err().unwrap(), Error::DeviceTooSmall { .. }));
    let err = Store::format(&[tiny.dir.path().join("missing")], &small_format()).err().unwrap();
    assert!(err.to_string().contains("give a size"), "{err}");
    assert!("bogus".parse::<BackendKind>().is_err());
}

#[test]
fn ops_after_close_say_closed() {
    let devices = TempDevices::new(1, 16 << 20);
    let store = create(&devices, BackendKind::Auto);
    let data = random_bytes(5000, 1);
    let pending = store.put(1, data, b"", Priority::Normal).unwrap();
    store.close().unwrap();
    // close waited for the put.
    assert!(pending.is_done());
    pending.wait().unwrap();
}
