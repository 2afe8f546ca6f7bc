//! GPU correctness check (needs a CUDA GPU; run by `benches/gpu/run-gpu.sh`): round trips of
//! random data, 1 B up to `--max-bytes` (default 4 GiB), at odd device-memory alignments, through
//! each GPU path (bounce, cufile), in both directions (GPU put -> host get and GPU get, host put ->
//! GPU get, GPU range gets), compared byte for byte; the stream hand-off is checked by copying a
//! get's destination on a stream that only waited on the hand-off. Exits non-zero on any mismatch.
//!
//! Usage: gpu_roundtrip DIR [--max-bytes N] [--paths bounce,cufile]

use std::time::Instant;
use teraio_engine::cuda::{self as gpu, DeviceBuffer};
use teraio_engine::GpuTicket;
use teraio_engine::{parse_size, FormatConfig, GpuOptions, GpuPath, OpenConfig, Priority, Store, MIB};

type Failure = Box<dyn std::error::Error>;

fn random_bytes(len: usize, seed: u64) -> Vec<u8> {
    let mut v = vec![0u8; len];
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    for chunk in v.chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let b = x.to_le_bytes();
        chunk.copy_from_slice(&b[..chunk.len()]);
    }
    v
}

fn first_difference(a: &[u8], b: &[u8]) -> Option<usize> {
    if a.len() != b.len() {
        return Some(a.len().min(b.len()));
    }
    a.iter().zip(b).position(|(x, y)| x != y)
}

fn expect_equal(what: &str, got: &[u8], want: &[u8]) -> Result<(), Failure> {
    match first_difference(got, want) {
        None => Ok(()),
        Some(i) => Err(format!("{what}: {} bytes, first difference at byte {i}", want.len()).into()),
    }
}

fn main() -> Result<(), Failure> {
    let args: Vec<String> = std::env::args().collect();
    let dir = std::path::PathBuf::from(
        args.get(1).ok_or("usage: gpu_roundtrip DIR [--max-bytes N] [--paths bounce,cufile]")?,
    );
    let mut max_bytes = 4u64 << 30;
    let mut paths = vec![GpuPath::Bounce, GpuPath::Cufile];
    let mut i = 2;
    while i < args.len() {
        match args[i].as_str() {
            "--max-bytes" => max_bytes = parse_size(&args[i + 1])?,
            "--paths" => paths = args[i + 1].split(',').map(str::parse).collect::<Result<_, _>>()?,
            other => return Err(format!("unknown argument {other}").into()),
        }
        i += 2;
    }
    println!("{}", gpu::probe());
    let sizes: Vec<u64> = [
        1,
        7,
        511,
        4096,
        4097,
        65_537,
        MIB - 1,
        MIB + 3,
        4 * MIB + 4097,
        64 * MIB + 1,
        257 * MIB + 123,
        (1 << 30) + 5,
        4 << 30,
    ]
    .into_iter()
    .filter(|&s| s <= max_bytes)
    .collect();
    let alignments = [1usize, 3, 4095, 0, 256, 17];
    let mut checks = 0;
    let mut failures = Vec::new();
    for path in paths {
        let file = dir.join(format!("roundtrip-{}.dev", path.name()));
        let _ = std::fs::remove_file(&file);
        let format = FormatConfig {
            create_file_bytes: Some(2 * max_bytes + 512 * MIB),
            stripe_unit_bytes: MIB,
            force: true,
            ..Default::default()
        };
        let open =
            OpenConfig { gpu: GpuOptions { path, ..Default::default() }, verify_checksums: true, ..Default::default() };
        let store = Store::create(&[&file], &format, open)?;
        // On the cuFile path the put source and the GPU get/range destinations are registered with
        // cuFile (cuFileBufRegister) and the host-put -> GPU-get destination is not: both kinds.
        let register = path == GpuPath::Cufile;
        println!("path {}: {}", path.name(), store.gpu_setup(0)?);
        for (n, &size) in sizes.iter().enumerate() {
            let size = size as usize;
            let align = alignments[n % alignments.len()];
            let align2 = alignments[(n + 1) % alignments.len()];
            let started = Instant::now();
            let result = (|| -> Result<(), Failure> {
                let data = random_bytes(size, n as u64 + 1);
                let id = 1000 + n as u64;
                // GPU put (from an odd device address), checked by a host get.
                let mut src = DeviceBuffer::new(0, size + 8192)?;
                src.copy_from_host(align, &data)?;
                store.put_gpu(id, SubBuffer::new(src, align, size, register)?, b"gpu", Priority::Normal)?.wait()?;
                expect_equal("GPU put -> host get", &store.get_to_vec(id)?, &data)?;
                checks += 1;
                // GPU get into a poisoned buffer at another odd address; the stream hand-off
                // orders a copy on the caller's stream after it without the CPU waiting.
                let mut dst = DeviceBuffer::new(0, size + 8192)?;
                dst.fill(0xA5)?;
                let ticket =
                    store.get_gpu_range(id, 0, SubBuffer::new(dst, align2, size, register)?, Priority::Urgent)?;
                let mut via_stream = vec![0u8; size];
                let stream = StreamOwned::new()?;
                // SAFETY: our stream, of device 0's primary context.
                unsafe { ticket.enqueue_stream_wait(stream.0)? };
                let dst = ticket_buffer_after_stream_copy(ticket, &stream, &mut via_stream)?;
                expect_equal("GPU put -> GPU get (after stream hand-off)", &via_stream, &data)?;
                let mut whole = vec![0u8; size + 8192];
                dst.inner.copy_to_host(0, &mut whole)?;
                expect_equal("GPU get", &whole[align2..align2 + size], &data)?;
                if whole[..align2].iter().chain(&whole[align2 + size..]).any(|&b| b != 0xA5) {
                    return Err("GPU get wrote outside its range".into());
                }
                checks += 2;
                // Host put -> GPU get (whole object into a larger buffer), and a range get.
                let data2 = random_bytes(size, 1_000_003 + n as u64);
                store.put_blocking(id, &data2, b"host")?;
                let dst = DeviceBuffer::new(0, size + 4096)?;
                let dst = store.get_gpu(id, dst, Priority::Normal)?.wait()?;
                let mut back = vec![0u8; size];
                dst.copy_to_host(0, &mut back)?;
                expect_equal("host put -> GPU get", &back, &data2)?;
                checks += 1;
                if size > 10 {
                    let (offset, len) = ((size / 3) | 1, size / 3);
                    let dst = DeviceBuffer::new(0, len + 8192)?;
                    let dst = store
                        .get_gpu_range(id, offset as u64, SubBuffer::new(dst, 3, len, register)?, Priority::Normal)?
                        .wait()?;
                    let mut back = vec![0u8; len];
                    dst.inner.copy_to_host(3, &mut back)?;
                    expect_equal("GPU range get", &back, &data2[offset..offset + len])?;
                    checks += 1;
                }
                store.delete(id)?;
                Ok(())
            })();
            let seconds = started.elapsed().as_secs_f64();
            match result {
                Ok(()) => println!("  ok   {:>11} bytes  align {align:>4}/{align2:<4} {seconds:7.2} s", size),
                Err(e) => {
                    println!("  FAIL {:>11} bytes  align {align:>4}/{align2:<4}: {e}", size);
                    failures.push(format!("{} {size}: {e}", path.name()));
                }
            }
        }
        let fsck = store.fsck()?;
        if !fsck.is_clean() {
            failures.push(format!("{}: fsck: {:?}", path.name(), fsck.problems));
        }
        store.close()?;
        let _ = std::fs::remove_file(&file);
    }
    println!("GPU round trips: {checks} checks passed, {} failed", failures.len());
    if failures.is_empty() {
        Ok(())
    } else {
        Err(failures.join("\n").into())
    }
}

/// `len` bytes at byte `offset` of an owned buffer, handed to the store as device memory;
/// optionally registered with cuFile for its life.
struct SubBuffer {
    inner: DeviceBuffer,
    offset: usize,
    len: usize,
    registered: bool,
}

impl SubBuffer {
    fn new(inner: DeviceBuffer, offset: usize, len: usize, register: bool) -> Result<Self, Failure> {
        assert!(offset + len <= inner.len());
        if register {
            // SAFETY: deregistered in Drop, before the allocation is freed.
            unsafe { gpu::register_gpu_buffer(inner.slice(0, inner.len()))? };
        }
        Ok(SubBuffer { inner, offset, len, registered: register })
    }
}

impl Drop for SubBuffer {
    fn drop(&mut self) {
        if self.registered {
            // SAFETY: registered in `new`; the ticket that used it is done.
            if let Err(e) = unsafe { gpu::deregister_gpu_buffer(self.inner.ptr()) } {
                eprintln!("cuFileBufDeregister: {e}");
            }
        }
    }
}

// SAFETY: a sub-range of an owned allocation.
unsafe impl gpu::DeviceIoBuf for SubBuffer {
    fn device_ptr(&self) -> gpu::DevicePtr {
        self.inner.ptr() + self.offset as u64
    }
    fn device_len(&self) -> usize {
        self.len
    }
    fn device_ordinal(&self) -> u32 {
        0
    }
}

struct StreamOwned(cudarc::driver::sys::CUstream);

impl StreamOwned {
    fn new() -> Result<Self, Failure> {
        let mut s = std::ptr::null_mut();
        // SAFETY: device 0's primary context is current on this thread (DeviceBuffer made it so).
        let r = unsafe { cudarc::driver::sys::cuStreamCreate(&mut s, 1) };
        if r != cudarc::driver::sys::CUresult::CUDA_SUCCESS {
            return Err(format!("cuStreamCreate: {r:?}").into());
        }
        Ok(StreamOwned(s))
    }
}

impl Drop for StreamOwned {
    fn drop(&mut self) {
        // SAFETY: created above.
        unsafe { cudarc::driver::sys::cuStreamDestroy_v2(self.0) };
    }
}

/// Copies the get's destination to `out` on `stream` (which waits on the hand-off), waits for the
/// stream only, then checks the ticket and returns the buffer.
fn ticket_buffer_after_stream_copy(
    ticket: GpuTicket<SubBuffer>,
    stream: &StreamOwned,
    out: &mut [u8],
) -> Result<SubBuffer, Failure> {
    use cudarc::driver::sys;
    // The ticket owns the buffer; its address stays valid while the ticket lives.
    let (ptr, len) = (gpu::DeviceIoBuf::device_ptr(ticket.buffer()), out.len());
    // SAFETY: the device range lies in the ticket's buffer; `out` is pageable host memory, so the
    // copy is staged by the driver, and we synchronize the stream before reading it.
    unsafe {
        let r = sys::cuMemcpyDtoHAsync_v2(out.as_mut_ptr() as *mut _, ptr, len, stream.0);
        if r != sys::CUresult::CUDA_SUCCESS {
            return Err(format!("cuMemcpyDtoHAsync: {r:?}").into());
        }
        let r = sys::cuStreamSynchronize(stream.0);
        if r != sys::CUresult::CUDA_SUCCESS {
            return Err(format!("cuStreamSynchronize: {r:?}").into());
        }
    }
    // The stream ran the copy only after the hand-off flag was set, so the op must be done now.
    if !ticket.is_done() {
        return Err("stream passed the hand-off before the get finished".into());
    }
    Ok(ticket.wait()?)
}
