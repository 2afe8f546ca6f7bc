//! Compares the raw paths on one drive with the same loop: the engine's io_uring backend on the
//! block device (O_DIRECT), NVMe passthrough on /dev/ngXnY, and the userspace VFIO driver.
//!
//! `teraio-nvme-bench <bdev|passthru|vfio> <device or PCI address> <workload> <seconds>`, where
//! workload is randread4k-qd1, randread4k-qd128, seqread1m-qd8 or seqwrite1m-qd8. Random reads
//! cover the first GiB (write it first). Prints one JSON line: IOPS, GB/s, latency percentiles
//! in microseconds and CPU microseconds (user + system of this process) per I/O.

use std::path::Path;
use std::time::{Duration, Instant};
use teraio_engine::backend::{uring::UringBackend, Backend, BackendCompletion, BackendRequest, IoKind};
use teraio_engine::buffer::BouncePool;
use teraio_engine::device::Device;
use teraio_engine::UringOptions;
use teraio_nvme::vfio::{backend::VfioBackend, dma::DmaMemory, Controller};
use teraio_nvme::{PassthruBackend, PassthruOptions};

const REGION_BYTES: u64 = 1 << 30;

fn cpu_seconds() -> f64 {
    // SAFETY: getrusage fills the struct.
    let mut u: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: a system call on our own fd/struct, whose arguments outlive it.
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut u) };
    let t = |v: libc::timeval| v.tv_sec as f64 + v.tv_usec as f64 / 1e6;
    t(u.ru_utime) + t(u.ru_stime)
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.len() != 5 {
        eprintln!("usage: teraio-nvme-bench <bdev|passthru|vfio> <device|bdf> <randread4k-qd1|randread4k-qd128|seqread1m-qd8|seqwrite1m-qd8> <seconds>");
        std::process::exit(2);
    }
    let (path_kind, target, workload) = (args[1].as_str(), args[2].as_str(), args[3].as_str());
    let seconds: f64 = args[4].parse().expect("seconds");
    let (kind, block, depth, random) = match workload {
        "randread4k-qd1" => (IoKind::Read, 4096usize, 1usize, true),
        "randread4k-qd128" => (IoKind::Read, 4096, 128, true),
        "seqread1m-qd8" => (IoKind::Read, 1 << 20, 8, false),
        "seqwrite1m-qd8" => (IoKind::Write, 1 << 20, 8, false),
        other => panic!("unknown workload {other}"),
    };
    let buffer_bytes = block * depth;
    // Buffers: the bounce slab (registered with io_uring), or DMA memory for VFIO.
    let pool = BouncePool::new(block, depth, 4096).expect("buffers");
    let mut _keep: Vec<Box<dyn std::any::Any>> = Vec::new();
    let (mut backend, base): (Box<dyn Backend>, *mut u8) = match path_kind {
        "bdev" => {
            let device = Device::open(Path::new(target), true).expect("open block device");
            let b = UringBackend::new(&device, depth, &UringOptions::default(), &pool).expect("io_uring");
            _keep.push(Box::new(device));
            (Box::new(b), pool.slab().0)
        }
        "passthru" => {
            let b = PassthruBackend::new(Path::new(target), depth, PassthruOptions::default(), &[pool.slab()])
                .unwrap_or_else(|e| panic!("{e}"));
            (Box::new(b), pool.slab().0)
        }
        "vfio" => {
            let controller = Controller::open(target).unwrap_or_else(|e| panic!("{e}"));
            let memory = DmaMemory::allocate(buffer_bytes).expect("DMA memory");
            controller.register(memory.base, memory.len).expect("register");
            let b = VfioBackend::new(controller, depth).unwrap_or_else(|e| panic!("{e}"));
            let base = memory.base;
            _keep.push(Box::new(memory));
            (Box::new(b), base)
        }
        other => panic!("unknown path {other}"),
    };
    let blocks = REGION_BYTES / block as u64;
    let mut rng = 0x2545_F491_4F6C_DD1Du64;
    let mut next_seq = 0u64;
    let mut next_offset = || {
        if random {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            (rng % blocks) * block as u64
        } else {
            let o = next_seq;
            next_seq = (next_seq + block as u64) % REGION_BYTES;
            o
        }
    };
    let mut started = vec![Instant::now(); depth];
    let mut latencies_ns: Vec<u32> = Vec::with_capacity(1 << 20);
    let mut out: Vec<BackendCompletion> = Vec::with_capacity(depth);
    let cpu_start = cpu_seconds();
    let begin = Instant::now();
    let end = begin + Duration::from_secs_f64(seconds);
    for (slot, start) in started.iter_mut().enumerate() {
        *start = Instant::now();
        // SAFETY: slot's buffer lies in memory kept alive until the end; one request per slot.
        unsafe {
            backend.push(BackendRequest {
                token: slot as u64,
                kind,
                offset: next_offset(),
                buf: base.add(slot * block),
                len: block as u32,
                fixed_index: None,
            })
        };
    }
    let mut in_flight = depth;
    let (mut ios, mut errors) = (0u64, 0u64);
    while in_flight > 0 {
        out.clear();
        backend.submit_and_reap(true, &mut out).expect("submit");
        let now = Instant::now();
        for c in &out {
            let slot = c.token as usize;
            if c.result < 0 {
                errors += 1;
            }
            latencies_ns.push(now.duration_since(started[slot]).as_nanos().min(u32::MAX as u128) as u32);
            ios += 1;
            if now < end {
                started[slot] = now;
                // SAFETY: as above.
                unsafe {
                    backend.push(BackendRequest {
                        token: slot as u64,
                        kind,
                        offset: next_offset(),
                        buf: base.add(slot * block),
                        len: block as u32,
                        fixed_index: None,
                    })
                };
            } else {
                in_flight -= 1;
            }
        }
    }
    let elapsed = begin.elapsed().as_secs_f64();
    let cpu = cpu_seconds() - cpu_start;
    latencies_ns.sort_unstable();
    let pct = |p: f64| latencies_ns[((latencies_ns.len() as f64 - 1.0) * p) as usize] as f64 / 1000.0;
    println!(
        "{{\"path\":\"{}\",\"workload\":\"{workload}\",\"ios\":{ios},\"errors\":{errors},\"seconds\":{elapsed:.3},\"iops\":{:.0},\"gbps\":{:.3},\"lat_us_p50\":{:.1},\"lat_us_p99\":{:.1},\"lat_us_p999\":{:.1},\"cpu_us_per_io\":{:.2}}}",
        backend.name(),
        ios as f64 / elapsed,
        ios as f64 * block as f64 / elapsed / 1e9,
        pct(0.5),
        pct(0.99),
        pct(0.999),
        cpu * 1e6 / ios as f64
    );
    if errors > 0 {
        std::process::exit(1);
    }
}
