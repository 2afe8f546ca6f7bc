//! Which GPU path a store uses: builds its GPU state on the first GPU op, and for `auto` measures
//! the pinned bounce path against cuFile on a free run of device 0.

use super::runtime::StoreGpu;
use crate::backend::IoKind;
use crate::cuda::copy::CopyDirection;
use crate::error::{Error, Result};
use crate::layout::codec::round_up;
use crate::queue::{DeviceQueue, Priority, Request};
use crate::store::place::no_space;
use crate::store::Shared;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// Builds a store's GPU state on its first GPU op (see `GpuOptions` and docs/gpu.md).
pub(crate) fn init_gpu(shared: &Arc<Shared>, ordinal: u32) -> Result<StoreGpu> {
    use super::GpuPathReport;
    use crate::config::GpuPath;
    use crate::cuda::{cufile, driver as cuda, probe};
    let options = shared.config.gpu.clone();
    let ctx = cuda::context(ordinal)?;
    let (slab, slab_bytes) = shared.pool.slab();
    // SAFETY: the slab lives in `shared.pool`, which is dropped after `shared.gpu`.
    let pinned = unsafe { cuda::PinnedRegistration::new(ctx, slab, slab_bytes)? };
    let mut report = GpuPathReport {
        path: GpuPath::Bounce,
        device: ordinal,
        cufile_mode: Vec::new(),
        reason: String::new(),
        measured_gbps: None,
        pinned_bytes: slab_bytes as u64,
        store_checksums: shared.geometry.checksums,
        verify_checksums: shared.config.verify_checksums,
    };
    let mut gpu = StoreGpu {
        cufile_queues: Vec::new(),
        devices: Mutex::new(HashMap::new()),
        report: report.clone(),
        copy_streams: options.copy_streams,
        _pinned: pinned,
    };
    if options.path == GpuPath::Bounce {
        gpu.report.reason = "bounce requested: pinned bounce chunks with overlapped copies".into();
        tracing::info!(report = %gpu.report, "teraio GPU path");
        return Ok(gpu);
    }
    // cuFile: what mode each device would run in, then its queues.
    let mut compat_reasons = Vec::new();
    for d in &shared.devices {
        let why = probe::gds_obstacles(&d.path);
        if why.is_empty() {
            report.cufile_mode.push(format!("{}: true GDS", d.path.display()));
        } else {
            report.cufile_mode.push(format!("{}: compatibility mode ({})", d.path.display(), why.join(", ")));
            compat_reasons.push(format!("{}: {}", d.path.display(), why.join(", ")));
        }
    }
    if options.path == GpuPath::Gds && !compat_reasons.is_empty() {
        return Err(Error::BackendUnavailable {
            backend: "gds",
            reason: format!(
                "true GDS is not possible, cuFile would run in compatibility mode: {}",
                compat_reasons.join("; ")
            ),
        });
    }
    let queues = cufile::cufile().and_then(|_| {
        shared
            .devices
            .iter()
            .enumerate()
            .map(|(i, d)| {
                let b = crate::backend::cufile::CufileBackend::new(d, options.cufile_threads_per_device, ordinal)?;
                // The same fault, power-cut and device-model wrappers as the device's host queue.
                let b = shared.wrappers[i].wrap(Box::new(b));
                DeviceQueue::start(i as u16, b, shared.config.queue_depth)
                    .map_err(|e| Error::io("starting a cuFile queue thread", e))
            })
            .collect::<Result<Vec<_>>>()
    });
    let queues = match (queues, options.path) {
        (Ok(q), _) => q,
        (Err(e), GpuPath::Auto) => {
            report.reason = format!("auto: cuFile unavailable ({e}); using the pinned bounce path");
            report.cufile_mode.clear();
            tracing::warn!("{}", report.reason);
            gpu.report = report;
            return Ok(gpu);
        }
        (Err(e), _) => return Err(e),
    };
    gpu.cufile_queues = queues;
    let mode = if compat_reasons.is_empty() { "true GDS".to_string() } else { "compatibility mode".to_string() };
    if options.path != GpuPath::Auto {
        report.path = options.path;
        report.reason = format!("{} requested: cuFile in {mode}", options.path.name());
        gpu.report = report;
        tracing::info!(report = %gpu.report, "teraio GPU path");
        return Ok(gpu);
    }
    let (bounce, direct) = match measure_gpu_paths(shared, &gpu, ordinal, options.auto_probe_bytes) {
        Ok((b, c)) => (Ok(b), Ok(c)),
        Err(e) => (Err(e.clone()), Err(e)),
    };
    match (bounce, direct) {
        (Ok(b), Ok(c)) => {
            report.measured_gbps = Some((b, c));
            if c > b {
                report.path = GpuPath::Cufile;
                report.reason = format!("auto: cuFile ({mode}) measured faster than the pinned bounce path");
            } else {
                report.path = GpuPath::Bounce;
                report.reason = format!("auto: the pinned bounce path measured faster than cuFile ({mode})");
                gpu.cufile_queues.clear();
            }
        }
        (_, Err(e)) | (Err(e), _) => {
            report.path = GpuPath::Bounce;
            report.reason = format!("auto: could not measure the two paths ({e}); using the pinned bounce path");
            tracing::warn!("{}", report.reason);
            gpu.cufile_queues.clear();
        }
    }
    gpu.report = report;
    tracing::info!(report = %gpu.report, "teraio GPU path");
    Ok(gpu)
}

/// The short measurement of `auto`: takes a free run of device 0 (no object lives there), writes
/// `bytes` to it so that the reads below hit the disk rather than a hole of a sparse file, then
/// reads it into GPU memory through each path twice, alternating, and keeps each path's best GB/s.
/// The run is given back to the allocator before returning.
fn measure_gpu_paths(shared: &Arc<Shared>, gpu: &StoreGpu, ordinal: u32, bytes: u64) -> Result<(f64, f64)> {
    if shared.read_only {
        return Err(Error::InvalidConfig("a read-only store writes no measurement run".into()));
    }
    let g = &shared.geometry;
    let chunk = shared.pool.chunk_bytes() as u64;
    let bytes = round_up(bytes.max(chunk), chunk);
    let extent = {
        let mut allocators = shared.allocators.lock().expect("allocators");
        let run = allocators[0].allocate(bytes / g.block_size, 1);
        run.ok_or_else(|| no_space(&allocators, g, bytes))?.pop().expect("one extent")
    };
    let start = extent.start_block * g.block_size;
    let result = (|| {
        write_measurement_run(shared, start, bytes)?;
        let (mut bounce, mut direct) = (0f64, 0f64);
        for _ in 0..2 {
            bounce = bounce.max(measure_gpu_read(shared, gpu, ordinal, false, start, bytes)?);
            direct = direct.max(measure_gpu_read(shared, gpu, ordinal, true, start, bytes)?);
        }
        Ok((bounce, direct))
    })();
    shared.allocators.lock().expect("allocators")[0].free(extent);
    result
}

/// One request of the measurement: `len` bytes at `offset` from/to `buf`; `then` gets its result.
fn measurement_request(
    kind: IoKind,
    offset: u64,
    buf: *mut u8,
    len: u64,
    then: impl FnOnce(std::io::Result<()>) + Send + 'static,
) -> Request {
    Request {
        kind,
        offset,
        buf,
        len: len as u32,
        fixed_index: None,
        priority: Priority::Normal,
        on_complete: Box::new(then),
    }
}

/// Writes `bytes` at `start` of device 0 from bounce chunks (whatever they hold), waiting.
fn write_measurement_run(shared: &Arc<Shared>, start: u64, bytes: u64) -> Result<()> {
    let chunk = shared.pool.chunk_bytes() as u64;
    let (tx, rx) = std::sync::mpsc::channel::<Result<()>>();
    let pieces = bytes / chunk;
    for i in 0..pieces {
        let (c, tx) = (shared.pool.take(), tx.clone());
        let buf = c.ptr;
        let request = measurement_request(IoKind::Write, start + i * chunk, buf, chunk, move |r| {
            drop(c);
            let _ = tx.send(r.map_err(|e| Error::io("writing the GPU path measurement run", e)));
        });
        shared.queues[0].submit(std::iter::once(request));
    }
    drop(tx);
    for _ in 0..pieces {
        rx.recv().map_err(|_| Error::Closed)??;
    }
    Ok(())
}

/// Reads `bytes` at `start` of device 0 into GPU memory through one path; returns GB/s.
/// Bounce: disk -> pinned chunk -> copy engine; cuFile: the cuFile queue straight into GPU memory.
fn measure_gpu_read(
    shared: &Arc<Shared>,
    gpu: &StoreGpu,
    ordinal: u32,
    via_cufile: bool,
    start: u64,
    bytes: u64,
) -> Result<f64> {
    let chunk = shared.pool.chunk_bytes() as u64;
    let scratch = crate::cuda::DeviceBuffer::new(ordinal, bytes as usize)?;
    let device = gpu.device(ordinal)?;
    let (tx, rx) = std::sync::mpsc::channel::<Result<()>>();
    let pieces = bytes / chunk;
    let begin = std::time::Instant::now();
    for i in 0..pieces {
        let (offset, dst, tx) = (start + i * chunk, scratch.ptr() + i * chunk, tx.clone());
        if via_cufile {
            let request = measurement_request(IoKind::Read, offset, dst as usize as *mut u8, chunk, move |r| {
                let _ = tx.send(r.map_err(|e| Error::io("cuFile read while measuring", e)));
            });
            gpu.cufile_queues[0].submit(std::iter::once(request));
        } else {
            let (c, device) = (shared.pool.take(), device.clone());
            let buf = c.ptr;
            let request = measurement_request(IoKind::Read, offset, buf, chunk, move |r| match r {
                Err(e) => drop(tx.send(Err(Error::io("read while measuring", e)))),
                // SAFETY: the chunk is pinned and moves into the continuation; dst is ours.
                Ok(()) => unsafe {
                    let host = c.ptr;
                    device.copy.copy(
                        CopyDirection::HostToDevice,
                        host,
                        dst,
                        chunk as usize,
                        Box::new(move |r| drop((c, tx.send(r)))),
                    )
                },
            });
            shared.queues[0].submit(std::iter::once(request));
        }
    }
    drop(tx);
    for _ in 0..pieces {
        rx.recv().map_err(|_| Error::Closed)??;
    }
    let seconds = begin.elapsed().as_secs_f64();
    Ok(bytes as f64 / seconds / 1e9)
}
