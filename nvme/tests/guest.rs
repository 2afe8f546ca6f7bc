//! Backend and store tests on real (emulated) NVMe drives. They run inside the KVM guest that
//! scripts/kvm/run-guest-tests.sh boots, where these variables name the drives:
//!
//! - `TERAIO_NVME_NAMESPACES`: space-separated /dev/nvmeXnY bound to the kernel nvme driver
//!   (passthrough and store tests; at least 2 for striping);
//! - `TERAIO_NVME_VFIO`: space-separated PCI addresses of NVMe controllers bound to vfio-pci;
//! - `TERAIO_NVME_REQUIRED=1`: a missing variable is a failure, not a skip (set in the guest).
//!
//! The tests that need the drives are `#[ignore]`d, so that outside the guest they count as
//! ignored, not passed; the guest runs them with `--include-ignored`. Run by hand with
//! `--ignored` but without the variables, each says what is missing and returns.

use std::path::PathBuf;
use std::sync::mpsc::{channel, Receiver};
use std::sync::Arc;
use teraio_engine::backend::{Backend, IoKind};
use teraio_engine::queue::{DeviceQueue, Priority as QueuePriority, Request};
use teraio_engine::{AlignedBuf, BackendKind, FormatConfig, OpenConfig, Priority, Store, MIB};
use teraio_nvme::vfio::dma::DmaMemory;
use teraio_nvme::vfio::{backend::VfioBackend, Controller};
use teraio_nvme::{NvmeError, PassthruBackend, PassthruOptions};

fn list(var: &str) -> Option<Vec<String>> {
    let required = std::env::var("TERAIO_NVME_REQUIRED").is_ok_and(|v| v == "1");
    match std::env::var(var) {
        Ok(v) if !v.trim().is_empty() => Some(v.split_whitespace().map(String::from).collect()),
        _ if required => panic!("{var} is not set but TERAIO_NVME_REQUIRED=1"),
        _ => {
            eprintln!("skipped: {var} not set (these tests run in the KVM guest: scripts/kvm/run-guest-tests.sh)");
            None
        }
    }
}

fn namespaces() -> Option<Vec<PathBuf>> {
    list("TERAIO_NVME_NAMESPACES").map(|v| v.into_iter().map(PathBuf::from).collect())
}

/// A fresh directory for one test's files: under the build's target directory on the machine
/// that built the tests, under the temp directory in the guest (which has no target directory).
fn scratch_dir(test: &str) -> PathBuf {
    let target = PathBuf::from(env!("CARGO_TARGET_TMPDIR"));
    let base = if target.is_dir() { target } else { std::env::temp_dir() };
    let dir = base.join(format!("teraio-nvme-{test}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn pattern(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// Runs requests through the engine's own per-device queue (both lanes) and waits for them.
struct Harness {
    queue: DeviceQueue,
    done: Receiver<(u64, std::io::Result<()>)>,
    sender: std::sync::mpsc::Sender<(u64, std::io::Result<()>)>,
}

impl Harness {
    fn new(backend: Box<dyn Backend>, depth: usize) -> Harness {
        let (sender, done) = channel();
        Harness { queue: DeviceQueue::start(0, backend, depth).unwrap(), done, sender }
    }

    fn submit(&self, id: u64, kind: IoKind, offset: u64, buf: *mut u8, len: usize, priority: QueuePriority) {
        let s = self.sender.clone();
        self.queue.submit([Request {
            kind,
            offset,
            buf,
            len: len as u32,
            fixed_index: None,
            priority,
            on_complete: Box::new(move |r| {
                let _ = s.send((id, r));
            }),
        }]);
    }

    fn wait(&self, count: usize) -> Vec<(u64, std::io::Result<()>)> {
        (0..count).map(|_| self.done.recv_timeout(std::time::Duration::from_secs(30)).expect("completion")).collect()
    }

    fn run(&self, kind: IoKind, offset: u64, buf: *mut u8, len: usize) -> std::io::Result<()> {
        self.submit(0, kind, offset, buf, len, QueuePriority::Normal);
        self.wait(1).pop().unwrap().1
    }
}

/// The backend-level checks every raw backend must pass, on `memory` (DMA-able for VFIO).
fn backend_round_trips(h: &Harness, memory: *mut u8, memory_len: usize, lba: usize, max_transfer: usize) {
    // Many sizes, deep queue: write patterns, read back into zeroed memory, compare.
    let sizes =
        [lba, 4096, 8192, 12288, 65536, 131072, max_transfer, max_transfer + lba, 2 * max_transfer + 4096, 3 << 20];
    let mut offset = 0u64;
    let mut spans = Vec::new();
    let mut at = 0usize;
    for (i, &len) in sizes.iter().enumerate() {
        assert!(at + len <= memory_len / 2);
        let data = pattern(len, i as u64 + 1);
        // SAFETY: inside `memory`, which the test owns.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), memory.add(at), len) };
        spans.push((offset, at, len, data));
        offset += (len as u64).div_ceil(1 << 20) * (1 << 20);
        at += len.div_ceil(4096) * 4096;
    }
    for (i, (offset, at, len, _)) in spans.iter().enumerate() {
        let p = if i % 3 == 0 { QueuePriority::Urgent } else { QueuePriority::Normal };
        // SAFETY: as above.
        h.submit(i as u64, IoKind::Write, *offset, unsafe { memory.add(*at) }, *len, p);
    }
    for (id, r) in h.wait(spans.len()) {
        r.unwrap_or_else(|e| panic!("write {id}: {e}"));
    }
    h.run(IoKind::Flush, 0, std::ptr::null_mut(), 0).unwrap();
    let half = memory_len / 2;
    // SAFETY: the second half of `memory` is ours.
    unsafe { std::ptr::write_bytes(memory.add(half), 0, half) };
    for (i, (offset, at, len, _)) in spans.iter().enumerate() {
        // SAFETY: as above.
        h.submit(i as u64, IoKind::Read, *offset, unsafe { memory.add(half + at) }, *len, QueuePriority::Normal);
    }
    for (id, r) in h.wait(spans.len()) {
        r.unwrap_or_else(|e| panic!("read {id}: {e}"));
    }
    for (offset, at, len, data) in &spans {
        // SAFETY: as above.
        let got = unsafe { std::slice::from_raw_parts(memory.add(half + at), *len) };
        assert!(got == &data[..], "data mismatch at device offset {offset}, {len} bytes");
    }
    // Misaligned requests are refused, not silently rounded.
    let e = h.run(IoKind::Read, (lba / 2) as u64, memory, lba).unwrap_err();
    assert_eq!(e.raw_os_error(), Some(libc::EINVAL), "{e}");
    // 256 random 4 KiB reads at depth: every one must return what was written there.
    let blocks = spans[sizes.len() - 1].2 / 4096;
    let (last_offset, ..) = spans[sizes.len() - 1];
    for k in 0..256u64 {
        let b = (k * 7919) as usize % blocks;
        // SAFETY: inside the second half (256 * 4 KiB < half).
        h.submit(
            k,
            IoKind::Read,
            last_offset + (b * 4096) as u64,
            unsafe { memory.add(half + k as usize * 4096) },
            4096,
            QueuePriority::Normal,
        );
    }
    h.wait(256).into_iter().for_each(|(_, r)| r.unwrap());
    let data = &spans[sizes.len() - 1].3;
    for k in 0..256usize {
        let b = (k * 7919) % blocks;
        // SAFETY: as above.
        let got = unsafe { std::slice::from_raw_parts(memory.add(half + k * 4096), 4096) };
        assert!(got == &data[b * 4096..(b + 1) * 4096], "random read {k}");
    }
}

#[test]
#[ignore = "needs NVMe drives: runs in the KVM guest (scripts/kvm/run-guest-tests.sh)"]
fn passthrough_identify_matches_the_block_device() {
    let Some(namespaces) = namespaces() else { return };
    for path in &namespaces {
        let ns = teraio_nvme::identify(path).unwrap();
        let d = teraio_engine::device::Device::open(path, true).unwrap();
        assert_eq!(ns.namespace.size_bytes(), d.size_bytes, "{}", path.display());
        assert!(ns.max_transfer_bytes >= 4096 && ns.max_transfer_bytes <= 8 << 20);
        assert!(!ns.controller.model.is_empty());
        eprintln!(
            "{}: nsid {} lba {} blocks {} mdts {} max transfer {} model {:?}",
            ns.char_path.display(),
            ns.nsid,
            ns.namespace.lba_bytes,
            ns.namespace.size_blocks,
            ns.controller.mdts,
            ns.max_transfer_bytes,
            ns.controller.model
        );
    }
}

#[test]
#[ignore = "needs NVMe drives: runs in the KVM guest (scripts/kvm/run-guest-tests.sh)"]
fn passthrough_backend_round_trips_registered_and_plain_buffers() {
    let Some(namespaces) = namespaces() else { return };
    let ns = teraio_nvme::identify(&namespaces[0]).unwrap();
    for (registered, iopoll) in [(true, false), (false, false), (true, true)] {
        let mut memory = AlignedBuf::new(32 << 20, 4096).unwrap();
        let buffers = if registered { vec![(memory.as_mut_ptr(), memory.len())] } else { vec![] };
        let backend = match PassthruBackend::new(&namespaces[0], 64, PassthruOptions { iopoll }, &buffers) {
            Ok(b) => b,
            Err(e) if iopoll && teraio_nvme::passthru::check_iopoll_kernel().is_err() => {
                assert!(e.to_string().contains("interrupt completions"), "{e}");
                eprintln!("iopoll refused on this kernel, as it must be: {e}");
                continue;
            }
            Err(e) => panic!("{e}"),
        };
        eprintln!("passthrough backend: registered buffers {registered}, iopoll {iopoll}");
        let h = Harness::new(Box::new(backend), 64);
        let len = memory.len();
        backend_round_trips(
            &h,
            memory.as_mut_ptr(),
            len,
            ns.namespace.lba_bytes as usize,
            ns.max_transfer_bytes as usize,
        );
    }
}

#[test]
fn passthrough_refuses_what_is_not_a_namespace() {
    let dir = scratch_dir("not-a-namespace");
    let file = dir.join("plain-file");
    std::fs::write(&file, b"").unwrap();
    assert!(matches!(teraio_nvme::identify(&file), Err(NvmeError::NotANamespace { .. })));
    std::fs::remove_dir_all(&dir).unwrap();
    let e = teraio_nvme::identify(std::path::Path::new("/dev/nvme99n1")).unwrap_err();
    assert!(matches!(e, NvmeError::NoCharDevice { .. }), "{e}");
    assert!(e.to_string().contains("/dev/ng99n1"), "{e}");
}

fn format_config() -> FormatConfig {
    FormatConfig {
        stripe_unit_bytes: 256 * 1024,
        checkpoint_slot_bytes: Some(MIB),
        journal_bytes: Some(MIB),
        force: true,
        ..Default::default()
    }
}

fn open_config(backend: BackendKind) -> OpenConfig {
    OpenConfig {
        backend,
        queue_depth: 32,
        bounce_pool_bytes: 16 * MIB,
        max_io_bytes: MIB,
        max_inflight_bytes: 64 * MIB,
        ..Default::default()
    }
}

#[test]
#[ignore = "needs NVMe drives: runs in the KVM guest (scripts/kvm/run-guest-tests.sh)"]
fn whole_namespace_stores_stripe_and_survive_reopen_on_passthrough() {
    let Some(namespaces) = namespaces() else { return };
    assert!(namespaces.len() >= 2, "striping needs at least 2 namespaces");
    teraio_nvme::register();
    let kinds: &[teraio_engine::backend::BackendFactory] = if teraio_nvme::passthru::check_iopoll_kernel().is_ok() {
        &[teraio_nvme::PASSTHRU, teraio_nvme::PASSTHRU_IOPOLL]
    } else {
        &[teraio_nvme::PASSTHRU]
    };
    for &kind in kinds {
        let backend = BackendKind::External(kind);
        let store = Store::create(&namespaces, &format_config(), open_config(backend)).unwrap();
        assert_eq!(store.info().backend, "nvme-passthru");
        // Awkward sizes, aligned and unaligned destinations.
        let sizes = [0usize, 1, 511, 512, 4095, 4096, 4097, 65537, 200_000, 1 << 20, (3 << 20) + 7];
        for (i, &len) in sizes.iter().enumerate() {
            let data = pattern(len, i as u64);
            store.put(i as u64, data.clone(), b"meta", Priority::Normal).unwrap().wait().unwrap();
            let out =
                store.get(i as u64, AlignedBuf::new(len, 4096).unwrap(), Priority::Normal).unwrap().wait().unwrap();
            assert_eq!(&out[..len], &data[..], "len {len} aligned");
            let out = store.get(i as u64, vec![0u8; len], Priority::Urgent).unwrap().wait().unwrap();
            assert_eq!(out, data, "len {len} urgent");
        }
        // A large object stripes over every namespace, each serving its share.
        let big = pattern(8 << 20, 99);
        store.put(100, big.clone(), b"", Priority::Normal).unwrap().wait().unwrap();
        assert_eq!(store.stat(100).unwrap().devices.len(), namespaces.len());
        let before = store.stats();
        assert_eq!(store.get_to_vec(100).unwrap(), big);
        let after = store.stats();
        for d in 0..namespaces.len() {
            assert!(after.devices[d].read_bytes > before.devices[d].read_bytes, "namespace {d} served no part");
        }
        // Both lanes with many ops in flight.
        let tickets: Vec<_> = (200..264u64)
            .map(|id| {
                let p = if id % 5 == 0 { Priority::Urgent } else { Priority::Normal };
                store.put(id, pattern(100_000 + id as usize, id), b"", p).unwrap()
            })
            .collect();
        teraio_engine::wait_all_ok(tickets).unwrap();
        let stats = store.stats();
        assert!(stats.total.urgent_ops > 0);
        assert_eq!(stats.total.errors, 0);
        assert!(store.delete(5).unwrap());
        store.close().unwrap();
        // Reopen in reverse order, on the kernel block path: the layout is the same bytes.
        let mut reversed = namespaces.clone();
        reversed.reverse();
        let store = Store::open(&reversed, open_config(BackendKind::IoUring)).unwrap();
        assert_eq!(store.get_to_vec(100).unwrap(), big);
        for id in 200..264u64 {
            assert_eq!(store.get_to_vec(id).unwrap(), pattern(100_000 + id as usize, id), "object {id}");
        }
        assert!(store.stat(5).is_none());
        assert!(store.fsck().unwrap().is_clean());
        store.close().unwrap();
        // And back on passthrough, which reads what the block path wrote.
        let store = Store::open(&namespaces, open_config(backend)).unwrap();
        store.put_blocking(300, &pattern(777_777, 300), b"").unwrap();
        assert_eq!(store.get_to_vec(300).unwrap(), pattern(777_777, 300));
        assert_eq!(store.get_to_vec(7).unwrap(), pattern(sizes[7], 7));
        store.close().unwrap();
    }
}

#[test]
#[ignore = "needs NVMe drives: runs in the KVM guest (scripts/kvm/run-guest-tests.sh)"]
fn passthrough_urgent_get_overtakes_a_normal_backlog() {
    let Some(namespaces) = namespaces() else { return };
    teraio_nvme::register();
    // As the file-backed test of the same name (tests/store.rs): one namespace at depth 1 behind
    // a 100 MB/s device model, so the 60 MiB normal backlog drains one small request at a time
    // for at least 0.6 s. The urgent get must wait for the request in flight, not the backlog;
    // both times come from the same run, so an emulated guest's speed does not decide it.
    let mut config = open_config(BackendKind::External(teraio_nvme::PASSTHRU));
    config.queue_depth = 1;
    config.max_io_bytes = 64 * 1024;
    config.max_inflight_bytes = 8 * MIB;
    config.durable = false;
    config.emulate = Some(teraio_engine::backend::throttle::DeviceModel::parse("100MB/s@20us").unwrap());
    let format = FormatConfig { stripe_unit_bytes: 64 * 1024, ..format_config() };
    let store = Store::create(&namespaces[..1], &format, config).unwrap();
    store.put(1, pattern(4096, 1), b"", Priority::Normal).unwrap().wait().unwrap();
    // Buffers first, so the clock covers issuing and serving, not filling memory (slow in an
    // emulated guest).
    let buffers: Vec<Vec<u8>> = (10..40u64).map(|id| vec![id as u8; 2 << 20]).collect();
    let started = std::time::Instant::now();
    let backlog: Vec<_> =
        (10..40u64).zip(buffers).map(|(id, buffer)| store.put(id, buffer, b"", Priority::Normal).unwrap()).collect();
    let got = store.get(1, vec![0u8; 4096], Priority::Urgent).unwrap().wait().unwrap();
    let urgent_latency = started.elapsed();
    assert_eq!(got, pattern(4096, 1));
    teraio_engine::wait_all_ok(backlog).unwrap();
    let drain = started.elapsed();
    assert!(
        urgent_latency * 5 < drain,
        "urgent get took {urgent_latency:?}; the whole backlog {drain:?}: it waited behind normal work"
    );
    store.close().unwrap();
}

#[test]
fn passthrough_on_a_regular_file_is_a_clear_error() {
    teraio_nvme::register();
    let dir = scratch_dir("regular-file");
    let path = dir.join("dev0");
    teraio_engine::device::create_file(&path, 16 << 20).unwrap();
    let device = teraio_engine::device::Device::open(&path, false).unwrap();
    let pool = teraio_engine::buffer::BouncePool::new(65536, 4, 4096).unwrap();
    let kind = BackendKind::External(teraio_nvme::PASSTHRU);
    let err = teraio_engine::backend::build(kind, &device, 8, &Default::default(), &pool).err().expect("must fail");
    assert!(err.to_string().contains("not an NVMe namespace"), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}

fn vfio_controllers() -> Option<Vec<String>> {
    list("TERAIO_NVME_VFIO")
}

#[test]
#[ignore = "needs NVMe drives: runs in the KVM guest (scripts/kvm/run-guest-tests.sh)"]
fn vfio_driver_round_trips_on_two_queue_pairs_and_restarts_cleanly() {
    let Some(bdfs) = vfio_controllers() else { return };
    let bdf = &bdfs[0];
    let memory = DmaMemory::allocate(32 << 20).unwrap();
    let (data_a, data_b);
    {
        let controller = Controller::open(bdf).unwrap();
        eprintln!(
            "{bdf}: {:?} model {:?} lba {} blocks {} max transfer {} queues {} x {} entries",
            controller.mode,
            controller.controller.model,
            controller.namespace.lba_bytes,
            controller.namespace.size_blocks,
            controller.max_transfer_bytes,
            controller.io_queues_granted,
            controller.queue_entries
        );
        controller.register(memory.base, memory.len).unwrap();
        let lba = controller.namespace.lba_bytes as usize;
        let max = controller.max_transfer_bytes as usize;
        // Two workers, two queue pairs on one controller, both lanes.
        let h1 = Harness::new(Box::new(VfioBackend::new(controller.clone(), 64).unwrap()), 64);
        let h2 = Harness::new(Box::new(VfioBackend::new(controller.clone(), 8).unwrap()), 8);
        backend_round_trips(&h1, memory.base, 16 << 20, lba, max);
        // SAFETY: the second 16 MiB of `memory` is ours.
        let second = unsafe { memory.base.add(16 << 20) };
        data_a = pattern(1 << 20, 41);
        data_b = pattern(1 << 20, 42);
        // SAFETY: as above.
        unsafe { std::ptr::copy_nonoverlapping(data_a.as_ptr(), second, 1 << 20) };
        h2.run(IoKind::Write, 64 << 20, second, 1 << 20).unwrap();
        // SAFETY: as above.
        unsafe { std::ptr::copy_nonoverlapping(data_b.as_ptr(), second, 1 << 20) };
        h1.run(IoKind::Write, 65 << 20, second, 1 << 20).unwrap();
        h2.run(IoKind::Flush, 0, std::ptr::null_mut(), 0).unwrap();
        // Unregistered and unaligned memory goes through the bounce slots: write from a plain
        // heap buffer at an odd address, read back into another, at depth.
        let mut plain = vec![0u8; (3 << 20) + 1];
        let expected = pattern(3 << 20, 43);
        plain[1..].copy_from_slice(&expected);
        h1.run(IoKind::Write, 70 << 20, plain[1..].as_mut_ptr(), 3 << 20).unwrap();
        let mut back = vec![0u8; (3 << 20) + 3];
        for k in 0..12usize {
            let at = k * (256 << 10);
            let buf = back[3 + at..].as_mut_ptr();
            h1.submit(k as u64, IoKind::Read, (70 << 20) + at as u64, buf, 256 << 10, QueuePriority::Normal);
        }
        h1.wait(12).into_iter().for_each(|(_, r)| r.unwrap());
        assert!(back[3..] == expected[..], "bounced round trip");
        drop(h1);
        drop(h2);
        // All I/O queues were deleted: a new one gets a queue again.
        drop(VfioBackend::new(controller.clone(), 4).unwrap());
    }
    // The controller was shut down; a fresh open resets it and reads what was written.
    let controller = Controller::open(bdf).unwrap();
    controller.register(memory.base, memory.len).unwrap();
    let h = Harness::new(Box::new(VfioBackend::new(controller.clone(), 4).unwrap()), 4);
    // SAFETY: inside `memory`.
    let out = unsafe { memory.base.add(8 << 20) };
    h.run(IoKind::Read, 64 << 20, out, 2 << 20).unwrap();
    // SAFETY: as above.
    let got = unsafe { std::slice::from_raw_parts(out, 2 << 20) };
    assert!(got[..1 << 20] == data_a[..] && got[1 << 20..] == data_b[..], "data written by two queue pairs");
    drop(h);
    drop(controller);
}

#[test]
#[ignore = "needs NVMe drives: runs in the KVM guest (scripts/kvm/run-guest-tests.sh)"]
fn vfio_stripes_over_several_controllers() {
    let Some(bdfs) = vfio_controllers() else { return };
    if bdfs.len() < 2 {
        panic!("striping over VFIO controllers needs 2 in TERAIO_NVME_VFIO");
    }
    let memory = DmaMemory::allocate(16 << 20).unwrap();
    let unit = 256 * 1024usize;
    let data = pattern(8 << 20, 5);
    let harnesses: Vec<_> = bdfs
        .iter()
        .map(|bdf| {
            let c = Controller::open(bdf).unwrap();
            c.register(memory.base, memory.len).unwrap();
            (Harness::new(Box::new(VfioBackend::new(c.clone(), 32).unwrap()), 32), c)
        })
        .collect();
    // SAFETY: the first 8 MiB of memory is ours.
    unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), memory.base, data.len()) };
    let units = data.len() / unit;
    for k in 0..units {
        let (h, _) = &harnesses[k % harnesses.len()];
        let offset = ((k / harnesses.len()) * unit) as u64 + (128 << 20);
        // SAFETY: inside memory.
        h.submit(k as u64, IoKind::Write, offset, unsafe { memory.base.add(k * unit) }, unit, QueuePriority::Normal);
    }
    for (h, _) in &harnesses {
        h.wait(units / harnesses.len()).into_iter().for_each(|(_, r)| r.unwrap());
    }
    for k in 0..units {
        let (h, _) = &harnesses[k % harnesses.len()];
        let offset = ((k / harnesses.len()) * unit) as u64 + (128 << 20);
        let p = if k % 4 == 0 { QueuePriority::Urgent } else { QueuePriority::Normal };
        // SAFETY: the second 8 MiB of memory is ours.
        h.submit(k as u64, IoKind::Read, offset, unsafe { memory.base.add((8 << 20) + k * unit) }, unit, p);
    }
    for (h, _) in &harnesses {
        h.wait(units / harnesses.len()).into_iter().for_each(|(_, r)| r.unwrap());
    }
    // SAFETY: as above.
    let got = unsafe { std::slice::from_raw_parts(memory.base.add(8 << 20), 8 << 20) };
    assert!(got == &data[..], "striped data differs");
    drop(harnesses);
    let _: Arc<()> = Arc::new(());
}

#[test]
fn vfio_refuses_a_pci_address_that_does_not_exist() {
    let e = Controller::open("0000:ff:1f.7").err().unwrap();
    assert!(matches!(e, NvmeError::NoSuchPciDevice { .. }), "{e}");
}

#[test]
#[ignore = "needs NVMe drives: runs in the KVM guest (scripts/kvm/run-guest-tests.sh)"]
fn vfio_set_up_errors_say_what_to_do() {
    let Some(namespaces) = namespaces() else { return };
    // A controller still bound to the kernel nvme driver.
    let name = namespaces[0].file_name().unwrap().to_string_lossy().to_string();
    let ctrl = name.strip_prefix("nvme").and_then(|r| r.split_once('n')).map(|(c, _)| c.to_string()).unwrap();
    let link = std::fs::read_link(format!("/sys/class/nvme/nvme{ctrl}/device")).unwrap();
    let bdf = link.file_name().unwrap().to_string_lossy().to_string();
    let e = Controller::open(&bdf).err().unwrap();
    assert!(matches!(&e, NvmeError::WrongDriver { driver, .. } if driver == "nvme"), "{e}");
    assert!(e.to_string().contains("driver_override"), "{e}");
    // A PCI function that is not an NVMe controller (the host bridge).
    let e = Controller::open("0000:00:00.0").err().unwrap();
    assert!(matches!(e, NvmeError::NotNvme { .. }), "{e}");
}

#[test]
#[ignore = "needs NVMe drives: runs in the KVM guest (scripts/kvm/run-guest-tests.sh)"]
fn whole_namespace_stores_on_the_vfio_driver_stripe_and_survive_reopen() {
    let Some(bdfs) = vfio_controllers() else { return };
    assert!(bdfs.len() >= 2, "striping needs at least 2 VFIO controllers");
    teraio_nvme::register();
    let paths: Vec<String> = bdfs.iter().map(|b| format!("{}{b}", teraio_nvme::vfio::namespace::PATH_PREFIX)).collect();
    let backend = BackendKind::External(teraio_nvme::VFIO);
    // The kernel backends refuse a userspace-driven device with a clear error.
    let err = Store::create(&paths, &format_config(), open_config(BackendKind::IoUring)).err().expect("must fail");
    assert!(err.to_string().contains("driven from userspace"), "{err}");
    let store = Store::create(&paths, &format_config(), open_config(backend)).unwrap();
    assert_eq!(store.info().backend, "nvme-vfio");
    // A second opener of the same controllers is refused (a VFIO group opens once).
    assert!(Store::open(&paths, open_config(backend)).is_err());
    let sizes = [0usize, 1, 511, 512, 4095, 4096, 4097, 65537, 200_000, 1 << 20, (3 << 20) + 7];
    for (i, &len) in sizes.iter().enumerate() {
        let data = pattern(len, i as u64 + 50);
        store.put(i as u64, data.clone(), b"meta", Priority::Normal).unwrap().wait().unwrap();
        let out = store.get(i as u64, AlignedBuf::new(len, 4096).unwrap(), Priority::Normal).unwrap().wait().unwrap();
        assert_eq!(&out[..len], &data[..], "len {len} aligned");
        let out = store.get(i as u64, vec![0u8; len], Priority::Urgent).unwrap().wait().unwrap();
        assert_eq!(out, data, "len {len} urgent");
    }
    let big = pattern(8 << 20, 199);
    store.put(100, big.clone(), b"", Priority::Normal).unwrap().wait().unwrap();
    assert_eq!(store.stat(100).unwrap().devices.len(), paths.len());
    let before = store.stats();
    assert_eq!(store.get_to_vec(100).unwrap(), big);
    let after = store.stats();
    for d in 0..paths.len() {
        assert!(after.devices[d].read_bytes > before.devices[d].read_bytes, "controller {d} served no part");
    }
    let tickets: Vec<_> = (200..264u64)
        .map(|id| {
            let p = if id % 5 == 0 { Priority::Urgent } else { Priority::Normal };
            store.put(id, pattern(100_000 + id as usize, id + 7), b"", p).unwrap()
        })
        .collect();
    teraio_engine::wait_all_ok(tickets).unwrap();
    assert!(store.stats().total.urgent_ops > 0);
    assert_eq!(store.stats().total.errors, 0);
    assert!(store.delete(5).unwrap());
    store.close().unwrap();
    // Reopen in the other order: superblocks, checkpoint and journal read back through the driver.
    let mut reversed = paths.clone();
    reversed.reverse();
    let store = Store::open(&reversed, open_config(backend)).unwrap();
    assert_eq!(store.get_to_vec(100).unwrap(), big);
    for id in 200..264u64 {
        assert_eq!(store.get_to_vec(id).unwrap(), pattern(100_000 + id as usize, id + 7), "object {id}");
    }
    assert!(store.stat(5).is_none());
    assert!(store.fsck().unwrap().is_clean());
    store.close().unwrap();
}
