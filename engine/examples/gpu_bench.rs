//! GPU <-> SSD bandwidth, one run on one file (needs a CUDA GPU; run by `benches/gpu/run-gpu.sh`).
//!
//! On the data area of one store device file it measures, for writes then reads:
//! (a) O_DIRECT between the disk and pinned host memory (the ceiling: no GPU copy at all),
//! (b) libcufile straight from/into GPU memory (`cuFileWrite`/`cuFileRead`, `--threads` threads of
//!     `--io-bytes` each, as gdsio does), and (b1) the same as one call for the whole transfer,
//! (d) teraio `put_gpu`/`get_gpu` of one object through the bounce path and the cuFile path, and
//!     the path `auto` picks.
//! Each line gives GB/s (1e9 bytes/s), host CPU cores busy (process user+system time / wall
//! time) and cores per GB/s. kvikio (c) runs separately (`kvikio_bench.py`) on the same region.
//! Prints `RESULT name gbps cores` lines for the summary table, and the teraio get data is
//! compared with what was put.
//!
//! Each measurement runs `--rounds` times, interleaved with the others; the RESULT lines and the
//! summary give the median round, and every round is printed too.
//!
//! `--depths 8,32` also runs (a) with that many threads and teraio with that queue depth.
//!
//! `--checksum-pairs` measures instead what checking every get costs on the bounce path: one
//! object put through the bounce path (so it has stripe-unit checksums), then per round, in
//! turn: (e) O_DIRECT -> pinned host -> cudaMemcpy to the GPU with `--threads` threads (each
//! reads `--io-bytes`, then copies it on its own stream and waits), teraio `get_gpu` on the
//! bounce path with `verify_checksums` on, and with it off. It prints each round's on/off pair
//! against the peer and the medians.
//!
//! Usage: gpu_bench FILE [--bytes 4GiB] [--threads 8] [--io-bytes 4MiB] [--rounds 3] [--depths 8]
//!                  [--region-out PATH] [--checksum-pairs]

use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::sync::Arc;
use std::time::Instant;
use teraio_engine::cuda::{self as gpu, cufile, driver as cuda, DeviceBuffer};
use teraio_engine::{parse_size, FormatConfig, GpuOptions, GpuPath, OpenConfig, Priority, Store, GIB, MIB};

type Failure = Box<dyn std::error::Error>;

fn cpu_seconds() -> f64 {
    // SAFETY: rusage is plain old data, for which all zeros is a valid value.
    let mut u: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: valid out-pointer.
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut u) };
    let t = |tv: libc::timeval| tv.tv_sec as f64 + tv.tv_usec as f64 / 1e6;
    t(u.ru_utime) + t(u.ru_stime)
}

/// Drops the page cache (root only) so that no read is served from memory.
fn drop_caches() {
    // SAFETY: plain syscall.
    unsafe { libc::sync() };
    let _ = std::fs::write("/proc/sys/vm/drop_caches", "3");
}

fn measure(name: &str, bytes: u64, f: impl FnOnce() -> Result<(), Failure>) -> Result<(f64, f64), Failure> {
    drop_caches();
    let (cpu0, t0) = (cpu_seconds(), Instant::now());
    f()?;
    let wall = t0.elapsed().as_secs_f64();
    let cores = (cpu_seconds() - cpu0) / wall;
    let gbps = bytes as f64 / wall / 1e9;
    println!("  round {name:<34} {gbps:7.3} GB/s  {cores:6.3} cores busy  {:6.3} cores per GB/s", cores / gbps);
    Ok((gbps, cores))
}

/// Every round of every measurement, by name, in first-seen order.
#[derive(Default)]
struct Rounds(Vec<Measurement>);

/// (GB/s, cores busy) of each round of one measurement.
struct Measurement(String, String, Vec<(f64, f64)>);

impl Rounds {
    fn add(&mut self, name: &str, label: &str, r: (f64, f64)) {
        match self.0.iter_mut().find(|e| e.0 == name) {
            Some(e) => e.2.push(r),
            None => self.0.push(Measurement(name.into(), label.into(), vec![r])),
        }
    }

    /// The median round by GB/s (the upper middle one for an even count), with its CPU figure.
    fn median(v: &[(f64, f64)]) -> (f64, f64) {
        let mut v = v.to_vec();
        v.sort_by(|a, b| a.0.total_cmp(&b.0));
        v[v.len() / 2]
    }
}

/// A page-aligned anonymous mapping registered (pinned) with CUDA.
struct PinnedHost {
    ptr: *mut u8,
    len: usize,
    _registration: Option<cuda::PinnedRegistration>,
}
// SAFETY: plain memory shared by worker threads on disjoint ranges.
unsafe impl Send for PinnedHost {}
// SAFETY: as for Send: threads touch disjoint ranges.
unsafe impl Sync for PinnedHost {}

impl PinnedHost {
    fn new(len: usize) -> Result<Self, Failure> {
        // SAFETY: anonymous private mapping.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err("mmap failed".into());
        }
        let ctx = cuda::context(0)?;
        // SAFETY: the mapping lives until drop, after the registration.
        let registration = unsafe { cuda::PinnedRegistration::new(ctx, ptr as *mut u8, len)? };
        Ok(PinnedHost { ptr: ptr as *mut u8, len, _registration: Some(registration) })
    }
    fn slice(&self, offset: usize, len: usize) -> &[u8] {
        assert!(offset + len <= self.len);
        // SAFETY: inside the mapping.
        unsafe { std::slice::from_raw_parts(self.ptr.add(offset), len) }
    }

    /// # Safety
    /// No two live slices may overlap (the workers use disjoint slots).
    #[allow(clippy::mut_from_ref)]
    unsafe fn slice_mut(&self, offset: usize, len: usize) -> &mut [u8] {
        assert!(offset + len <= self.len);
        // SAFETY: inside the mapping; the caller keeps slices disjoint.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(offset), len) }
    }
}
impl Drop for PinnedHost {
    fn drop(&mut self) {
        self._registration.take();
        // SAFETY: mapped in `new`.
        unsafe { libc::munmap(self.ptr as *mut _, self.len) };
    }
}

/// Runs `threads` workers over `bytes` in `io` pieces, piece i on worker i % threads.
fn parallel(
    threads: usize,
    bytes: u64,
    io: u64,
    f: impl Fn(u64, u64) -> Result<(), String> + Sync,
) -> Result<(), Failure> {
    let pieces = bytes.div_ceil(io);
    let errors: Vec<String> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads as u64)
            .map(|t| {
                let f = &f;
                s.spawn(move || -> Result<(), String> {
                    let mut i = t;
                    while i < pieces {
                        let at = i * io;
                        f(at, io.min(bytes - at))?;
                        i += threads as u64;
                    }
                    Ok(())
                })
            })
            .collect();
        handles.into_iter().filter_map(|h| h.join().expect("worker").err()).collect()
    });
    match errors.first() {
        Some(e) => Err(e.clone().into()),
        None => Ok(()),
    }
}

fn main() -> Result<(), Failure> {
    let args: Vec<String> = std::env::args().collect();
    let file =
        std::path::PathBuf::from(args.get(1).ok_or("usage: gpu_bench FILE [--bytes N] [--threads N] [--io-bytes N]")?);
    let (mut bytes, mut threads, mut io) = (4 * GIB, 8usize, 4 * MIB);
    let mut region_out = None;
    let mut rounds = 3usize;
    let mut depths = vec![8usize];
    let mut checksum_pairs = false;
    let mut i = 2;
    while i < args.len() {
        if args[i] == "--checksum-pairs" {
            checksum_pairs = true;
            i += 1;
            continue;
        }
        let value = args.get(i + 1).ok_or_else(|| format!("{} takes a value", args[i]))?;
        match args[i].as_str() {
            "--bytes" => bytes = parse_size(value)?,
            "--threads" => threads = value.parse()?,
            "--io-bytes" => io = parse_size(value)?,
            "--region-out" => region_out = Some(value.clone()),
            "--rounds" => rounds = value.parse()?,
            "--depths" => depths = value.split(',').map(str::parse).collect::<Result<_, _>>()?,
            other => return Err(format!("unknown argument {other}").into()),
        }
        i += 2;
    }
    println!("{}", gpu::probe());
    // Measurement names carry the depth only where it differs from --threads (the
    // comparison with (b) and kvikio, which run --threads I/Os at a time).
    let suffix = |depth: usize| if depth == threads { String::new() } else { format!("_qd{depth}") };
    let _ = std::fs::remove_file(&file);
    let format = FormatConfig {
        create_file_bytes: Some(2 * bytes + GIB),
        stripe_unit_bytes: 4 * MIB,
        force: true,
        ..Default::default()
    };
    let info = Store::format(&[&file], &format)?;
    let region = info.superblocks[0].data_start;
    println!("file {} region [{region}, {}) ({bytes} bytes)", file.display(), region + bytes);
    if let Some(p) = &region_out {
        std::fs::write(p, format!("{region}\n"))?;
    }
    // Requests in flight per device = the threads of (a) and (b) (and kvikio's), so every
    // contender keeps the same number of I/Os at the disk.
    let open = |path: GpuPath, queue_depth: usize| OpenConfig {
        queue_depth,
        max_io_bytes: 4 * MIB,
        max_inflight_bytes: 256 * MIB,
        bounce_pool_bytes: 256 * MIB,
        gpu: GpuOptions { path, ..Default::default() },
        ..Default::default()
    };

    // Source data on the GPU: random bytes made on the host once.
    let mut host_data = vec![0u8; bytes as usize];
    let mut x = 0x2545_F491_4F6C_DD1Du64;
    for c in host_data.chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        c.copy_from_slice(&x.to_le_bytes()[..c.len()]);
    }
    let mut gpu_src = DeviceBuffer::new(0, bytes as usize)?;
    gpu_src.copy_from_host(0, &host_data)?;
    let gpu_dst = DeviceBuffer::new(0, bytes as usize)?;
    let max_depth = depths.iter().copied().max().unwrap_or(threads).max(threads);
    let pinned = Arc::new(PinnedHost::new((max_depth as u64 * io) as usize)?);
    // SAFETY: no other slice is live yet.
    unsafe { pinned.slice_mut(0, pinned.len) }.iter_mut().enumerate().for_each(|(i, b)| *b = i as u8);

    let raw = std::fs::OpenOptions::new().read(true).write(true).custom_flags(libc::O_DIRECT).open(&file)?;
    let slot = |at: u64, t: usize| ((at / io) as usize % t) * io as usize;
    if checksum_pairs {
        let setup = ChecksumPairs { bytes, threads, io, rounds, region, open: open(GpuPath::Bounce, threads) };
        return setup.run(&file, &raw, &pinned, &gpu_src, &gpu_dst, &host_data);
    }

    let mut results = Rounds::default();
    let b1_io = bytes; // (b1): the whole transfer in one cuFile call, as a plain user would write it
    let lib = cufile::cufile()?;
    let handle = lib.register_file(std::os::fd::AsRawFd::as_raw_fd(&raw))?;
    let ctx = cuda::context(0)?;
    let mut path_reports = Vec::new();
    // Writes, `rounds` times, interleaved so that drifts of the (virtual) disk hit all alike.
    for _ in 0..rounds {
        for &depth in &depths {
            let name = format!("a_write_pinned_odirect{}", suffix(depth));
            let r = measure(&name, bytes, || {
                parallel(depth, bytes, io, |at, n| {
                    raw.write_all_at(pinned.slice(slot(at, depth), n as usize), region + at).map_err(|e| e.to_string())
                })?;
                raw.sync_data()?;
                Ok(())
            })?;
            results.add(&name, &format!("(a) write: pinned host -> O_DIRECT disk, {depth} threads"), r);
        }
        for (name, label, t, n) in [
            ("b_write_cufile", "(b) write: cuFile from GPU, 8 threads", threads, io),
            ("b1_write_cufile_one_call", "(b1) write: cuFile from GPU, one call", 1, b1_io),
        ] {
            let r = measure(name, bytes, || {
                parallel(t, bytes, n, |at, n| {
                    ctx.make_current().map_err(|e| e.to_string())?;
                    // SAFETY: inside gpu_src.
                    unsafe { handle.write(gpu_src.ptr() + at, n as usize, region + at) }.map(drop).map_err(|e| e.1)
                })?;
                raw.sync_data()?;
                Ok(())
            })?;
            results.add(name, label, r);
        }
        // One object id for both paths: each put replaces the last, so two regions suffice.
        for (path, depth) in depths.iter().flat_map(|&d| [(GpuPath::Bounce, d), (GpuPath::Cufile, d)]) {
            let store = Store::open(&[&file], open(path, depth))?;
            let report = store.gpu_setup(0)?;
            path_reports.push(format!("{}: {report}", path.name()));
            let slice = gpu_src.slice(0, bytes as usize);
            let name = format!("d_write_teraio_{}{}", path.name(), suffix(depth));
            let r = measure(&name, bytes, || {
                // SAFETY: gpu_src outlives the wait.
                unsafe { store.put_gpu_raw(1, slice, b"", Priority::Normal)? }.wait()?;
                Ok(())
            })?;
            results.add(&name, &format!("(d) write: teraio put_gpu, {}, depth {depth}", path.name()), r);
            store.close()?;
        }
    }
    // Reads.
    let mut check = vec![0u8; bytes as usize];
    for round in 0..rounds {
        for &depth in &depths {
            let name = format!("a_read_odirect_pinned{}", suffix(depth));
            let r = measure(&name, bytes, || {
                parallel(depth, bytes, io, |at, n| {
                    // SAFETY: each worker owns its slot of the pinned buffer.
                    let slot = unsafe { pinned.slice_mut(slot(at, depth), n as usize) };
                    raw.read_exact_at(slot, region + at).map_err(|e| e.to_string())
                })
            })?;
            results.add(&name, &format!("(a) read: O_DIRECT disk -> pinned host, {depth} threads"), r);
        }
        for (name, label, t, n) in [
            ("b_read_cufile", "(b) read: cuFile into GPU, 8 threads", threads, io),
            ("b1_read_cufile_one_call", "(b1) read: cuFile into GPU, one call", 1, b1_io),
        ] {
            let r = measure(name, bytes, || {
                parallel(t, bytes, n, |at, n| {
                    ctx.make_current().map_err(|e| e.to_string())?;
                    // SAFETY: inside gpu_dst.
                    unsafe { handle.read(gpu_dst.ptr() + at, n as usize, region + at) }.map(drop).map_err(|e| e.1)
                })
            })?;
            results.add(name, label, r);
        }
        let mut paths: Vec<(GpuPath, usize)> =
            depths.iter().flat_map(|&d| [(GpuPath::Bounce, d), (GpuPath::Cufile, d)]).collect();
        if round == 0 {
            paths.push((GpuPath::Auto, threads));
        }
        for (path, depth) in paths {
            let store = Store::open(&[&file], open(path, depth))?;
            let report = store.gpu_setup(0)?;
            path_reports.push(format!("{}: {report}", path.name()));
            let slice = gpu_dst.slice(0, bytes as usize);
            let name = format!("d_read_teraio_{}{}", path.name(), suffix(depth));
            let r = measure(&name, bytes, || {
                // SAFETY: gpu_dst outlives the wait.
                unsafe { store.get_gpu_raw(1, 0, slice, true, Priority::Normal)? }.wait()?;
                Ok(())
            })?;
            results.add(&name, &format!("(d) read: teraio get_gpu, {}, depth {depth}", path.name()), r);
            gpu_dst.copy_to_host(0, &mut check)?;
            if check != host_data {
                return Err(format!("teraio {} get returned different bytes than were put", path.name()).into());
            }
            store.close()?;
        }
    }
    drop(handle);
    path_reports.sort();
    path_reports.dedup();
    for Measurement(name, _, rounds) in &results.0 {
        let (gbps, cores) = Rounds::median(rounds);
        println!("RESULT {name} {gbps:.3} {cores:.3}");
    }
    println!("\nsummary: median of {rounds} rounds ({bytes} bytes; {threads} threads x {} MiB for (a)/(b)):", io >> 20);
    for Measurement(_, label, rounds) in &results.0 {
        let (gbps, cores) = Rounds::median(rounds);
        let all: Vec<String> = rounds.iter().map(|r| format!("{:.2}", r.0)).collect();
        println!(
            "  {label:<42} {gbps:7.3} GB/s {cores:6.3} cores {:6.3} cores/(GB/s)  rounds [{}]",
            cores / gbps,
            all.join(" ")
        );
    }
    for r in path_reports {
        println!("  path {r}");
    }
    Ok(())
}

/// `--checksum-pairs`: teraio's bounce-path get with checksums checked and not, against an
/// O_DIRECT -> pinned -> cudaMemcpy peer, in one run (see the module doc).
struct ChecksumPairs {
    bytes: u64,
    threads: usize,
    io: u64,
    rounds: usize,
    /// Where the store's data area starts in the file (the peer reads what teraio put there).
    region: u64,
    /// The bounce-path store configuration at queue depth `threads`.
    open: OpenConfig,
}

impl ChecksumPairs {
    fn run(
        &self,
        file: &std::path::Path,
        raw: &std::fs::File,
        pinned: &PinnedHost,
        gpu_src: &DeviceBuffer,
        gpu_dst: &DeviceBuffer,
        host_data: &[u8],
    ) -> Result<(), Failure> {
        let (bytes, threads, io) = (self.bytes, self.threads, self.io);
        {
            let store = Store::open(&[file], self.open.clone())?;
            store.gpu_setup(0)?;
            // SAFETY: gpu_src outlives the wait.
            unsafe { store.put_gpu_raw(1, gpu_src.slice(0, bytes as usize), b"", Priority::Normal)? }.wait()?;
            store.close()?;
        }
        let ctx = cuda::context(0)?;
        // One stream and event per peer thread: worker t handles pieces t, t + threads, ...
        let streams = (0..threads).map(|_| cuda::Stream::new(ctx)).collect::<Result<Vec<_>, _>>()?;
        let events = (0..threads).map(|_| cuda::Event::new(ctx)).collect::<Result<Vec<_>, _>>()?;
        let mut results = Rounds::default();
        let mut check = vec![0u8; bytes as usize];
        let mut pairs = Vec::new();
        for _ in 0..self.rounds {
            let peer = measure("e_read_odirect_pinned_memcpy", bytes, || {
                parallel(threads, bytes, io, |at, n| {
                    let worker = (at / io) as usize % threads;
                    // SAFETY: each worker owns its slot of the pinned buffer.
                    let slot = unsafe { pinned.slice_mut(worker * io as usize, n as usize) };
                    raw.read_exact_at(slot, self.region + at).map_err(|e| e.to_string())?;
                    ctx.make_current().map_err(|e| e.to_string())?;
                    // SAFETY: the slot is pinned and stays untouched until the event is done;
                    // the destination lies inside gpu_dst.
                    unsafe {
                        cuda::copy_to_device_async(gpu_dst.ptr() + at, slot.as_ptr(), n as usize, &streams[worker])
                    }
                    .map_err(|e| e.to_string())?;
                    events[worker].record(&streams[worker]).map_err(|e| e.to_string())?;
                    events[worker].synchronize().map_err(|e| e.to_string())
                })
            })?;
            results.add(
                "e_read_odirect_pinned_memcpy",
                &format!("(e) read: O_DIRECT -> pinned -> cudaMemcpy, {threads} threads"),
                peer,
            );
            let mut pair = [0.0f64; 2];
            for (i, verify) in [true, false].into_iter().enumerate() {
                let store = Store::open(&[file], OpenConfig { verify_checksums: verify, ..self.open.clone() })?;
                let report = store.gpu_setup(0)?;
                let on = if verify { "on" } else { "off" };
                let name = format!("d_read_teraio_bounce_checksums_{on}");
                let r = measure(&name, bytes, || {
                    // SAFETY: gpu_dst outlives the wait.
                    unsafe { store.get_gpu_raw(1, 0, gpu_dst.slice(0, bytes as usize), true, Priority::Normal)? }
                        .wait()?;
                    Ok(())
                })?;
                results.add(&name, &format!("(d) read: teraio get_gpu, bounce, checksums {on}"), r);
                println!("  path {report}");
                pair[i] = r.0;
                gpu_dst.copy_to_host(0, &mut check)?;
                if check != host_data {
                    return Err(format!("teraio get with checksums {on} returned different bytes than were put").into());
                }
                store.close()?;
            }
            println!(
                "PAIR peer {:.3} GB/s, checksums on {:.3} ({:.3}x), off {:.3} ({:.3}x)",
                peer.0,
                pair[0],
                pair[0] / peer.0,
                pair[1],
                pair[1] / peer.0
            );
            pairs.push((pair[0] / peer.0, pair[1] / peer.0));
        }
        for Measurement(name, label, rounds) in &results.0 {
            let (gbps, cores) = Rounds::median(rounds);
            println!("RESULT {name} {gbps:.3} {cores:.3}");
            let all: Vec<String> = rounds.iter().map(|r| format!("{:.2}", r.0)).collect();
            println!("  {label:<52} {gbps:7.3} GB/s {cores:6.3} cores  rounds [{}]", all.join(" "));
        }
        let median = |mut v: Vec<f64>| {
            v.sort_by(f64::total_cmp);
            v[v.len() / 2]
        };
        println!(
            "checksum pairs over {} rounds: get on/peer median {:.3}x, off/peer median {:.3}x",
            pairs.len(),
            median(pairs.iter().map(|p| p.0).collect()),
            median(pairs.iter().map(|p| p.1).collect())
        );
        Ok(())
    }
}
