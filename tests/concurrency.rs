//! Many threads doing put/get/delete on overlapping ids under load for a bounded time: no
//! deadlock, no torn or wrong reads, no lost update, and the stats add up. Memory stays inside
//! the configured bounds.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use teraio_e2e::*;
use teraio_engine::{BackendKind, Error, Priority, Store};

/// Objects name their own seed in their first 8 bytes, so a reader can check what it got even
/// when the object was replaced between its `stat` and its `get`.
fn object(seed: u64) -> Vec<u8> {
    let mut v = seed.to_le_bytes().to_vec();
    v.extend(random_bytes((seed % 150_000) as usize, seed));
    v
}

/// Checks bytes read into a buffer that may be longer than the version that was read.
fn check_read(id: u64, buf: &[u8]) {
    let seed = u64::from_le_bytes(buf[..8].try_into().unwrap());
    let expected = object(seed);
    assert_eq!(&buf[..expected.len()], &expected[..], "torn read of object {id}");
    assert!(buf[expected.len()..].iter().all(|&b| b == 0), "bytes past object {id}'s end were written");
}

#[test]
fn threads_on_overlapping_ids_never_see_torn_data_and_stats_add_up() {
    for backend in BACKENDS {
        let devices = TempDevices::new(3, 96 << 20);
        let store = Arc::new(create(&devices, backend));
        let threads = 6;
        let shared_ids = 8u64; // every thread writes these
        let run_for = Duration::from_secs(3);
        let puts_acked = Arc::new(AtomicU64::new(0));
        let gets_ok = Arc::new(AtomicU64::new(0));
        // Last acknowledged seed per private id (ids >= 100 belong to one thread each).
        let private_last: Arc<Mutex<HashMap<u64, Option<u64>>>> = Arc::default();
        let started = Instant::now();
        let handles: Vec<_> = (0..threads)
            .map(|t| {
                let (store, puts_acked, gets_ok, private_last) =
                    (store.clone(), puts_acked.clone(), gets_ok.clone(), private_last.clone());
                std::thread::spawn(move || {
                    let mut n = 0u64;
                    while started.elapsed() < run_for {
                        n += 1;
                        let seed = (t as u64) << 40 | n;
                        let private = 100 + t as u64 * 10 + n % 3;
                        let shared = n.wrapping_mul(2654435761) % shared_ids;
                        let prio = if n.is_multiple_of(7) { Priority::Urgent } else { Priority::Normal };
                        match n % 5 {
                            0 | 1 => {
                                let id = if n.is_multiple_of(2) { shared } else { private };
                                store.put(id, object(seed), &seed.to_le_bytes(), prio).unwrap().wait().unwrap();
                                puts_acked.fetch_add(1, Ordering::Relaxed);
                                if id == private {
                                    private_last.lock().unwrap().insert(id, Some(seed));
                                }
                            }
                            2 | 3 => {
                                let id = if n.is_multiple_of(2) { shared } else { private };
                                // The object may be replaced or deleted between stat and get:
                                // then NotFound or the new version, never a mix.
                                let Some(info) = store.stat(id) else { continue };
                                let buf = vec![0u8; info.len_bytes as usize];
                                match store.get(id, buf, prio).and_then(|t| t.wait()) {
                                    Ok(data) => {
                                        check_read(id, &data);
                                        gets_ok.fetch_add(1, Ordering::Relaxed);
                                    }
                                    Err(Error::NotFound { .. } | Error::BufferTooSmall { .. }) => {}
                                    Err(e) => panic!("get {id}: {e}"),
                                }
                            }
                            _ => {
                                store.delete(private).unwrap();
                                private_last.lock().unwrap().insert(private, None);
                            }
                        }
                    }
                })
            })
            .collect();
        for h in handles {
            h.join().expect("worker thread");
        }
        assert!(started.elapsed() < run_for + Duration::from_secs(30), "ops hung past the run time");
        // No lost update: every private id holds exactly its last acknowledged version.
        for (id, last) in private_last.lock().unwrap().iter() {
            match last {
                Some(seed) => assert_eq!(store.get_to_vec(*id).unwrap(), object(*seed), "private object {id}"),
                None => assert!(store.stat(*id).is_none(), "deleted object {id} is back"),
            }
        }
        // Shared ids hold some acknowledged version, intact.
        for id in 0..shared_ids {
            if let Some(info) = store.stat(id) {
                let seed = u64::from_le_bytes(info.meta.try_into().unwrap());
                assert_eq!(store.get_to_vec(id).unwrap(), object(seed));
            }
        }
        let stats = store.stats();
        assert_eq!(stats.ops.puts, puts_acked.load(Ordering::Relaxed), "every acknowledged put is counted once");
        assert!(stats.ops.gets >= gets_ok.load(Ordering::Relaxed));
        assert_eq!(stats.total.errors, 0);
        let device_writes: u64 = stats.devices.iter().map(|d| d.write_ops).sum();
        assert_eq!(device_writes, stats.total.write_ops);
        println!(
            "{backend:?}: {} puts and {} verified gets acknowledged by {threads} threads in {:?}",
            puts_acked.load(Ordering::Relaxed),
            gets_ok.load(Ordering::Relaxed),
            run_for
        );
        assert!(puts_acked.load(Ordering::Relaxed) >= 20, "too little work to mean anything");
        let store = Arc::try_unwrap(store).ok().expect("threads are done");
        assert!(store.fsck().unwrap().is_clean());
        store.close().unwrap();
    }
}

fn rss_bytes() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap();
    let pages: u64 = statm.split_whitespace().nth(1).unwrap().parse().unwrap();
    pages * 4096
}

#[test]
fn bounce_memory_stays_inside_its_pool_under_a_large_unaligned_load() {
    let devices = TempDevices::new(2, 400 << 20);
    let store = Store::create(&devices.paths, &small_format(), open_config(BackendKind::Auto)).unwrap();
    // 128 MiB through a 4 MiB bounce pool and an 8 MiB in-flight budget (open_config).
    let data = random_bytes(128 << 20, 1);
    let unaligned = &data[1..];
    let before = rss_bytes();
    store.put_blocking(1, unaligned, b"").unwrap();
    let mut out = vec![0u8; unaligned.len() + 1];
    out.remove(0);
    let out = store.get(1, out, Priority::Normal).unwrap().wait().unwrap();
    // `out` itself is 128 MiB; anything beyond it (plus slack) would be the engine hoarding.
    let grown = rss_bytes().saturating_sub(before);
    assert!(grown < (128 << 20) + (32 << 20), "RSS grew by {} MiB", grown >> 20);
    assert!(out[..] == unaligned[..]);
}

/// The two versions the overwrite tests alternate: a short one and a long one, each one byte
/// value throughout, so any mix of them (or zero padding) shows.
fn short_version() -> Vec<u8> {
    vec![0xf7; 1000]
}

fn long_version() -> Vec<u8> {
    vec![0x95; 1 << 20]
}

/// Overwrites object 1 with the short and the long version in turn until `stop` is set (or an
/// iteration bound is reached, so a broken reader cannot make the test run forever).
fn overwrite_until(store: Arc<Store>, stop: Arc<std::sync::atomic::AtomicBool>) -> std::thread::JoinHandle<u64> {
    std::thread::spawn(move || {
        let (short, long) = (short_version(), long_version());
        let mut puts = 0u64;
        while !stop.load(Ordering::Acquire) && puts < 1_000_000 {
            let data = if puts.is_multiple_of(2) { &short } else { &long };
            store.put_blocking(1, data, b"").unwrap();
            puts += 1;
        }
        puts
    })
}

/// A store of one device, without flushes (the puts are only there to race the reads).
fn overwrite_store(devices: &TempDevices) -> Arc<Store> {
    let open = teraio_engine::OpenConfig { durable: false, ..open_config(BackendKind::Auto) };
    Arc::new(Store::create(&devices.paths, &small_format(), open).unwrap())
}

/// Every whole-object get returns one version whole, while another thread overwrites the object
/// with a shorter and a longer one: never the length of one with the bytes of the other (zero
/// padded), never "buffer too small" because the object grew between its length lookup and its
/// read. `get_to_vec` sizes its buffer from the version it reads; a get into a buffer longer
/// than the object reports the length of the version it read.
#[test]
fn whole_gets_under_concurrent_overwrite_return_one_version() {
    let devices = TempDevices::new(1, 64 << 20);
    let store = overwrite_store(&devices);
    let (short, long) = (short_version(), long_version());
    store.put_blocking(1, &short, b"").unwrap();
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let writer = overwrite_until(store.clone(), stop.clone());
    let reads = 3000;
    let mut seen = [0u64; 2];
    for i in 0..reads {
        if i % 2 == 0 {
            let data = store.get_to_vec(1).unwrap();
            assert!(
                data == short || data == long,
                "get_to_vec: {} bytes, first {:#x}, last {:#x}",
                data.len(),
                data[0],
                data[data.len() - 1]
            );
            seen[(data.len() == long.len()) as usize] += 1;
        } else {
            // A buffer that fits either version: the ticket says which length was read.
            let ticket = store.get(1, vec![0u8; long.len() + 4096], Priority::Normal).unwrap();
            let len = ticket.object_len_bytes().expect("a get knows its version's length") as usize;
            let buf = ticket.wait().unwrap();
            let data = &buf[..len];
            assert!(data == short || data == long, "get: {len} bytes, first {:#x}, last {:#x}", data[0], data[len - 1]);
            assert!(buf[len..].iter().all(|&b| b == 0), "bytes past the version read were written");
        }
    }
    stop.store(true, Ordering::Release);
    let puts = writer.join().unwrap();
    println!("{reads} gets ({} short, {} long among get_to_vec) beside {puts} overwrites", seen[0], seen[1]);
    assert!(puts >= 2, "the writer overwrote the object while the gets ran");
}

/// A ranged get reads its range of one version while another thread overwrites the object with
/// versions of the same length but other bytes: never part of one and part of the other.
#[test]
fn ranged_gets_under_concurrent_overwrite_return_one_version() {
    let devices = TempDevices::new(1, 64 << 20);
    let store = overwrite_store(&devices);
    let len = 300_000usize; // several stripe units (64 KiB) and pieces
    store.put_blocking(1, &vec![1u8; len], b"").unwrap();
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let writer = {
        let (store, stop) = (store.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut puts = 0u64;
            while !stop.load(Ordering::Acquire) && puts < 1_000_000 {
                store.put_blocking(1, &vec![(puts % 250) as u8 + 2; len], b"").unwrap();
                puts += 1;
            }
            puts
        })
    };
    for i in 0..2000u64 {
        let offset = (i * 7919) % 4096;
        let part = store.get_range(1, offset, vec![0u8; len - 8192], Priority::Normal).unwrap().wait().unwrap();
        assert!(part.iter().all(|&b| b == part[0]), "ranged get {i} mixes versions {:#x} and others", part[0]);
    }
    stop.store(true, Ordering::Release);
    assert!(writer.join().unwrap() >= 2, "the writer overwrote the object while the gets ran");
}
