//! End-to-end: round trips of many sizes and alignments on both backends, striping, reopen,
//! delete, ranged gets, the urgent lane and stats.

use teraio_e2e::*;
use teraio_engine::{AlignedBuf, Priority, Store};

#[test]
fn round_trips_of_awkward_sizes_on_both_backends() {
    for backend in BACKENDS {
        let devices = TempDevices::new(3, 64 << 20);
        let store = create(&devices, backend);
        let sizes = [0usize, 1, 511, 512, 513, 4095, 4096, 4097, 65535, 65536, 65537, 200_000, 1 << 20, (3 << 20) + 7];
        for (i, &len) in sizes.iter().enumerate() {
            let data = random_bytes(len, i as u64);
            store.put(i as u64, data.clone(), b"meta", Priority::Normal).unwrap().wait().unwrap();
            // Aligned destination (direct I/O) ...
            let out =
                store.get(i as u64, AlignedBuf::new(len, 4096).unwrap(), Priority::Normal).unwrap().wait().unwrap();
            assert_eq!(&out[..len], &data[..], "len {len} backend {backend:?} aligned");
            // ... and an unaligned one (bounced).
            let mut v = vec![0u8; len + 3];
            v.drain(..3);
            let out = store.get(i as u64, v, Priority::Normal).unwrap().wait().unwrap();
            assert_eq!(out, data, "len {len} backend {backend:?} unaligned");
        }
        let stats = store.stats();
        assert_eq!(stats.ops.puts, sizes.len() as u64);
        assert_eq!(stats.ops.gets, 2 * sizes.len() as u64);
        assert_eq!(stats.devices.len(), 3);
        assert_eq!(stats.total.errors, 0);
        assert_eq!(stats.backend, if backend == teraio_engine::BackendKind::Psync { "psync" } else { "io_uring" });
    }
}

#[test]
fn unaligned_source_buffers_put_correctly() {
    let devices = TempDevices::new(2, 32 << 20);
    let store = create(&devices, teraio_engine::BackendKind::Auto);
    let data = random_bytes(300_001, 9);
    let mut shifted = vec![0u8; 5];
    shifted.extend_from_slice(&data);
    // Borrowed, unaligned by 5 bytes.
    store.put_blocking(1, &shifted[5..], b"").unwrap();
    assert_eq!(store.get_to_vec(1).unwrap(), data);
}

#[test]
fn large_objects_stripe_over_every_device() {
    let devices = TempDevices::new(4, 64 << 20);
    let store = create(&devices, teraio_engine::BackendKind::Auto);
    let data = random_bytes(8 << 20, 1);
    store.put(7, data.clone(), b"", Priority::Normal).unwrap().wait().unwrap();
    let info = store.stat(7).unwrap();
    assert_eq!(info.devices.len(), 4);
    let before = store.stats();
    assert_eq!(store.get_to_vec(7).unwrap(), data);
    let after = store.stats();
    for d in 0..4 {
        let read = after.devices[d].read_bytes - before.devices[d].read_bytes;
        assert_eq!(read, 2 << 20, "device {d} should serve a quarter of the object");
    }
    // Small objects sit on one device.
    store.put(8, random_bytes(1000, 2), b"", Priority::Normal).unwrap().wait().unwrap();
    assert_eq!(store.stat(8).unwrap().devices.len(), 1);
}

#[test]
fn everything_survives_reopen_in_any_device_order() {
    let devices = TempDevices::new(3, 32 << 20);
    let mut expected = Vec::new();
    {
        let store = create(&devices, teraio_engine::BackendKind::Auto);
        for id in 0..40u64 {
            let data = random_bytes((id as usize * 7919) % 300_000, id);
            store.put(id, data.clone(), format!("f32[{id}]").as_bytes(), Priority::Normal).unwrap().wait().unwrap();
            expected.push(data);
        }
        assert!(store.delete(5).unwrap());
        assert!(!store.delete(5).unwrap());
        store.put(6, vec![42u8; 10], b"replaced", Priority::Normal).unwrap().wait().unwrap();
        expected[6] = vec![42u8; 10];
        store.close().unwrap();
    }
    let mut reversed = devices.paths.clone();
    reversed.reverse();
    let store = Store::open(&reversed, open_config(teraio_engine::BackendKind::Auto)).unwrap();
    assert_eq!(store.list().len(), 39);
    for id in 0..40u64 {
        if id == 5 {
            assert!(store.stat(5).is_none());
            continue;
        }
        assert_eq!(store.get_to_vec(id).unwrap(), expected[id as usize], "object {id}");
    }
    assert_eq!(store.stat(6).unwrap().meta, b"replaced");
    assert_eq!(store.stat(7).unwrap().meta, b"f32[7]");
    assert!(store.fsck().unwrap().is_clean());
}

#[test]
fn journal_replay_without_clean_close() {
    let devices = TempDevices::new(2, 32 << 20);
    let data = random_bytes(100_000, 3);
    {
        let store = create(&devices, teraio_engine::BackendKind::Auto);
        store.put(1, data.clone(), b"x", Priority::Normal).unwrap().wait().unwrap();
        store.put(2, data.clone(), b"y", Priority::Normal).unwrap().wait().unwrap();
        store.delete(2).unwrap();
        // Skip the final checkpoint: as if the process died here.
        std::mem::forget(store);
    }
    // The forgotten store still holds the device locks in this process; a real crash releases
    // them. Reopen through fresh paths to the same files (hard links share the lock-free inode).
    let links: Vec<_> = devices
        .paths
        .iter()
        .map(|p| {
            let l = p.with_extension("link");
            std::fs::hard_link(p, &l).unwrap();
            l
        })
        .collect();
    let err = Store::open(&links, open_config(teraio_engine::BackendKind::Auto)).err().expect("locked");
    assert!(matches!(err, teraio_engine::Error::Locked { .. }), "{err}");
}

#[test]
fn ranged_gets_read_any_window() {
    let devices = TempDevices::new(3, 32 << 20);
    let store = create(&devices, teraio_engine::BackendKind::Auto);
    let data = random_bytes(1_000_000, 4);
    store.put(1, data.clone(), b"", Priority::Normal).unwrap().wait().unwrap();
    for (offset, len) in [(0u64, 1usize), (1, 4096), (4096, 4096), (65535, 3), (999_999, 1), (123_457, 400_000)] {
        let out = store.get_range(1, offset, vec![0u8; len], Priority::Normal).unwrap().wait().unwrap();
        assert_eq!(&out[..], &data[offset as usize..offset as usize + len], "window {offset}+{len}");
    }
    let aligned =
        store.get_range(1, 8192, AlignedBuf::new(8192, 4096).unwrap(), Priority::Urgent).unwrap().wait().unwrap();
    assert_eq!(&aligned[..], &data[8192..16384]);
}

#[test]
fn many_async_ops_in_flight_with_both_lanes() {
    let devices = TempDevices::new(2, 64 << 20);
    let store = create(&devices, teraio_engine::BackendKind::Auto);
    let tickets: Vec<_> = (0..64u64)
        .map(|id| {
            let p = if id % 5 == 0 { Priority::Urgent } else { Priority::Normal };
            store.put(id, random_bytes(100_000 + id as usize, id), b"", p).unwrap()
        })
        .collect();
    teraio_engine::wait_all_ok(tickets).unwrap();
    let gets: Vec<_> =
        (0..64u64).map(|id| store.get(id, vec![0u8; 100_000 + id as usize], Priority::Normal).unwrap()).collect();
    for (id, r) in teraio_engine::wait_all(gets).into_iter().enumerate() {
        assert_eq!(r.unwrap(), random_bytes(100_000 + id, id as u64));
    }
    assert!(store.stats().total.urgent_ops > 0);
}

#[test]
fn urgent_get_overtakes_a_long_normal_backlog() {
    // One emulated 100 MB/s device at depth 1: the 60 MiB normal backlog takes about 0.6 s to
    // drain, one request at a time. An urgent get issued behind it must wait for at most the
    // request in flight, not the backlog. Both times come from the same run, so machine load
    // does not decide the outcome.
    let devices = TempDevices::new(1, 256 << 20);
    let mut config = open_config(teraio_engine::BackendKind::Auto);
    config.queue_depth = 1;
    config.durable = false;
    config.emulate = Some(teraio_engine::backend::throttle::DeviceModel::parse("100MB/s@20us").unwrap());
    let store = Store::create(&devices.paths, &small_format(), config).unwrap();
    store.put(1, random_bytes(4096, 1), b"", Priority::Normal).unwrap().wait().unwrap();
    // Buffers first, so the clock covers issuing and serving, not filling memory (slow in an
    // emulated guest).
    let buffers: Vec<Vec<u8>> = (10..40u64).map(|id| vec![id as u8; 2 << 20]).collect();
    let started = std::time::Instant::now();
    let backlog: Vec<_> =
        (10..40u64).zip(buffers).map(|(id, buffer)| store.put(id, buffer, b"", Priority::Normal).unwrap()).collect();
    let urgent = store.get(1, vec![0u8; 4096], Priority::Urgent).unwrap();
    let got = urgent.wait().unwrap();
    let urgent_latency = started.elapsed();
    assert_eq!(got, random_bytes(4096, 1));
    teraio_engine::wait_all_ok(backlog).unwrap();
    let drain = started.elapsed();
    assert!(
        urgent_latency * 5 < drain,
        "urgent get took {urgent_latency:?}; the whole backlog {drain:?}: it waited behind normal work"
    );
    assert!(store.stats().total.urgent_ops >= 1);
}

#[test]
fn sqpoll_rings_round_trip() {
    let devices = TempDevices::new(2, 32 << 20);
    let mut config = open_config(teraio_engine::BackendKind::IoUring);
    config.uring.sqpoll_idle_ms = Some(50);
    let store = Store::create(&devices.paths, &small_format(), config).unwrap();
    let data = random_bytes(1 << 20, 77);
    store.put_blocking(1, &data, b"").unwrap();
    assert_eq!(store.get_to_vec(1).unwrap(), data);
    let info = store.info();
    assert_eq!(info.backend, "io_uring");
    assert!(info.backend_reason.contains("io_uring"), "{}", info.backend_reason);
}

#[test]
fn auto_backend_says_what_it_chose_and_why() {
    let devices = TempDevices::new(1, 16 << 20);
    let store = create(&devices, teraio_engine::BackendKind::Auto);
    let info = store.info();
    assert!(info.backend_reason.starts_with("auto:"), "{}", info.backend_reason);
    assert_eq!(store.stats().backend, info.backend);
}
