//! `teraio bench`: what a set of SSDs delivers when teraio stripes tensors over them.
//!
//! A run: check the targets, format them as one store sized for the data set, write the data set,
//! optionally drop the page cache, warm up, then run the workload for a runtime or a byte count
//! while a progress bar shows the current throughput, and report per-device and aggregate GB/s,
//! IOPS, latency percentiles and host CPU. `--sweep` repeats the timed phase over a grid of
//! settings; `--compare-fio` runs fio's twin of the workload on the same files afterwards.

pub mod buffer;
pub mod fio;
pub mod pattern;
pub mod report;
pub mod sweep;
pub mod workload;

use crate::cpu::CpuTimes;
use crate::error::{CliError, CliResult};
use crate::targets::{
    check_free_space, check_writable_targets, free_bytes, space_needed, CreatedFiles, Intent, TempStore,
};
use crate::units::{duration_arg, format_bytes, size_arg};
use buffer::BufferKind;
use clap::{Args, ValueEnum};
use indicatif::{ProgressBar, ProgressStyle};
use report::BenchReport;
use serde::Serialize;
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::time::Duration;
use teraio_engine::backend::throttle::DeviceModel;
use teraio_engine::{BackendKind, FormatConfig, GpuOptions, GpuPath, OpenConfig, Store, GIB, MIB};
use workload::{Limit, Pattern, Progress, Workload};

/// Default data set: 4 GiB, shrunk to fit the targets.
const DEFAULT_DATA_BYTES: u64 = 4 * GIB;
/// Default largest object of the data set.
const DEFAULT_OBJECT_BYTES: u64 = 256 * MIB;
/// Largest queue depth per device: the engine's limit (4096) less its urgent reserve.
const MAX_QUEUE_DEPTH: usize = 3584;
/// Devices of the embedded default store.
const DEFAULT_DEVICE_COUNT: usize = 4;
/// Checkpoint slots of bench stores: the table of a bench store is small (at most a few
/// thousand extents and 16 Ki small objects).
const BENCH_CHECKPOINT_SLOT_BYTES: u64 = 8 * MIB;
/// Journal of bench stores: room for many small puts between checkpoints.
const BENCH_JOURNAL_BYTES: u64 = 16 * MIB;
/// Metadata on device 0: superblocks, two checkpoint slots, the journal, alignment.
const BENCH_METADATA_BYTES: u64 = 2 * BENCH_CHECKPOINT_SLOT_BYTES + BENCH_JOURNAL_BYTES + 2 * MIB;

/// fio-style access mode.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum RwMode {
    /// Sequential reads of whole objects.
    Read,
    /// Sequential writes (puts) of whole objects.
    Write,
    /// Sequential reads and writes mixed (--read-percent).
    Rw,
    /// Random reads of request-sized ranges.
    Randread,
    /// Random writes (puts of request-sized objects).
    Randwrite,
    /// Random reads and writes mixed (--read-percent).
    Randrw,
}

/// A switch given as `on` or `off`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Switch {
    On,
    Off,
}

/// I/O backends (cuFile is listed so that asking for it gets a clear answer).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum BackendArg {
    Auto,
    #[value(name = "io_uring", alias = "uring")]
    IoUring,
    Psync,
    /// GPUDirect Storage through libcufile, for --buffer gpu (the host path stays auto).
    Cufile,
}

/// `teraio bench [TARGET...]`
#[derive(Args, Debug, Clone)]
pub struct BenchArgs {
    /// Files or block devices to stripe over (formatted, so their data is lost). None: a
    /// temporary store of 4 files under the temp directory, removed afterwards.
    pub targets: Vec<PathBuf>,
    /// Access mode.
    #[arg(long, value_enum, default_value = "read")]
    pub rw: RwMode,
    /// Share of reads in mixed modes (rw, randrw), percent.
    #[arg(long, default_value_t = 50)]
    pub read_percent: u8,
    /// Bytes per device request [default: 4MiB sequential, 4KiB random].
    #[arg(long, alias = "bs", value_parser = size_arg)]
    pub request_size: Option<u64>,
    /// Bytes per object of the data set [default: the data size, at most 256MiB].
    #[arg(long, value_parser = size_arg)]
    pub object_size: Option<u64>,
    /// Bytes of data the workload runs over [default: 4GiB, shrunk to fit the targets].
    #[arg(long, value_parser = size_arg)]
    pub data_size: Option<u64>,
    /// Requests in flight per device.
    #[arg(long, alias = "iodepth", default_value_t = 32)]
    pub queue_depth: usize,
    /// Submitting threads.
    #[arg(long, default_value_t = 1)]
    pub threads: usize,
    /// Stripe unit of the store [default: the request size, at least 1MiB for sequential and
    /// 64KiB for random workloads].
    #[arg(long, value_parser = size_arg)]
    pub stripe_unit: Option<u64>,
    /// Store block size (I/O alignment).
    #[arg(long, value_parser = size_arg, default_value = "4096")]
    pub block_size: u64,
    /// I/O backend.
    #[arg(long, value_enum, default_value = "auto")]
    pub backend: BackendArg,
    /// Where the I/O buffers live.
    #[arg(long, value_enum, default_value = "host")]
    pub buffer: BufferKind,
    /// CUDA device of GPU buffers.
    #[arg(long, default_value_t = 0)]
    pub gpu_device: u32,
    /// Run the timed phase this long (e.g. 10s) [default: until the running mean rate holds
    /// within 2% for 2 s, at most 10 s].
    #[arg(long, value_parser = duration_arg, conflicts_with = "size")]
    pub runtime: Option<Duration>,
    /// Move this many bytes in the timed phase.
    #[arg(long, value_parser = size_arg)]
    pub size: Option<u64>,
    /// Run the workload this long before the timed phase (not counted).
    #[arg(long, value_parser = duration_arg, default_value = "0")]
    pub warmup: Duration,
    /// Drop the page cache after writing the data set (needs root; matters with --buffered).
    #[arg(long)]
    pub drop_caches: bool,
    /// Check every byte read back against what was written.
    #[arg(long)]
    pub verify: bool,
    /// Check the engine's stripe-unit checksums on every get (a random read of a partial stripe
    /// unit reads and checks the whole unit), as stores do by default; `off` measures without.
    #[arg(long, value_enum, default_value = "on")]
    pub verify_checksums: Switch,
    /// Go through the page cache instead of O_DIRECT.
    #[arg(long)]
    pub buffered: bool,
    /// Make every target behave like an SSD of this bandwidth and latency: `6.5GB/s`,
    /// `7/6.5GB/s` (read/write), optionally `@20us`. With targets on a fast medium (tmpfs with
    /// --buffered) this emulates arrays the machine does not have, e.g. 8 x 6.5 GB/s.
    #[arg(long, value_parser = parse_device_model)]
    pub emulate: Option<DeviceModel>,
    /// Flush before each put is acknowledged (fio: fsync per write). Default: like fio, no flush.
    #[arg(long)]
    pub durable: bool,
    /// Size of target files that do not exist yet [default: what the data set needs].
    #[arg(long, value_parser = size_arg)]
    pub file_size: Option<u64>,
    /// Use targets that hold data (they are overwritten).
    #[arg(long)]
    pub force: bool,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
    /// No progress bar.
    #[arg(long)]
    pub no_progress: bool,
    /// Sweep request size, queue depth, threads and stripe unit; print the best settings.
    #[arg(long)]
    pub sweep: bool,
    /// Request sizes the sweep tries.
    #[arg(long, value_parser = size_arg, value_delimiter = ',', default_value = "128k,1M,4M")]
    pub sweep_request_sizes: Vec<u64>,
    /// Queue depths the sweep tries.
    #[arg(long, value_delimiter = ',', default_value = "4,16,32,64")]
    pub sweep_queue_depths: Vec<usize>,
    /// Thread counts the sweep tries.
    #[arg(long, value_delimiter = ',', default_value = "1,2")]
    pub sweep_threads: Vec<usize>,
    /// Stripe units the sweep tries.
    #[arg(long, value_parser = size_arg, value_delimiter = ',', default_value = "1M,4M")]
    pub sweep_stripe_units: Vec<u64>,
    /// Timed phase of each sweep point.
    #[arg(long, value_parser = duration_arg, default_value = "2s")]
    pub sweep_runtime: Duration,
    /// Afterwards run fio's twin of the workload on the same files and print teraio/fio.
    #[arg(long)]
    pub compare_fio: bool,
    /// Print the fio job file of the workload and exit (nothing is touched).
    #[arg(long)]
    pub emit_fio: bool,
}

impl BenchArgs {
    fn pattern(&self) -> Pattern {
        match self.rw {
            RwMode::Read | RwMode::Write | RwMode::Rw => Pattern::Sequential,
            _ => Pattern::Random,
        }
    }
    fn read_percent(&self) -> u8 {
        match self.rw {
            RwMode::Read | RwMode::Randread => 100,
            RwMode::Write | RwMode::Randwrite => 0,
            RwMode::Rw | RwMode::Randrw => self.read_percent,
        }
    }
    fn request_bytes(&self) -> u64 {
        self.request_size.unwrap_or(match self.pattern() {
            Pattern::Sequential => 4 * MIB,
            Pattern::Random => 4096,
        })
    }
    fn device_count(&self) -> usize {
        if self.targets.is_empty() {
            DEFAULT_DEVICE_COUNT
        } else {
            self.targets.len()
        }
    }
}

/// Checks the workload numbers; every message names the flag to change.
fn workload_from_args(args: &BenchArgs, data_bytes: u64) -> CliResult<Workload> {
    let request_bytes = args.request_bytes();
    let block = args.block_size;
    let direct = !args.buffered;
    if args.read_percent > 100 {
        return Err(CliError::input(format!("--read-percent {} is over 100; give 0..=100", args.read_percent)));
    }
    if request_bytes == 0 {
        return Err(CliError::input("--request-size 0 is impossible; give a size such as 4KiB or 4MiB"));
    }
    if args.queue_depth == 0 || args.queue_depth > MAX_QUEUE_DEPTH {
        return Err(CliError::input(format!(
            "--queue-depth {} is impossible; give 1..={MAX_QUEUE_DEPTH}",
            args.queue_depth
        )));
    }
    if args.threads == 0 || args.threads > 256 {
        return Err(CliError::input(format!("--threads {} is impossible; give 1..=256", args.threads)));
    }
    if args.size == Some(0) {
        return Err(CliError::input("--size 0 moves nothing; give a byte count such as 4GiB, or use --runtime"));
    }
    if args.runtime == Some(Duration::ZERO) {
        return Err(CliError::input("--runtime 0 measures nothing; give a duration such as 10s"));
    }
    if !block.is_power_of_two() || !(512..=65536).contains(&block) {
        return Err(CliError::input(format!("--block-size {block} must be a power of two in 512..=65536")));
    }
    if direct && !request_bytes.is_multiple_of(block) {
        return Err(CliError::input(format!(
            "--request-size {request_bytes} is not a multiple of the {block}-byte block size O_DIRECT needs; use a multiple of {block} (e.g. 4KiB), or pass --buffered"
        )));
    }
    if data_bytes == 0 {
        return Err(CliError::input("--data-size 0 is impossible; give a size such as 1GiB"));
    }
    let object_bytes = args.object_size.unwrap_or(data_bytes.min(DEFAULT_OBJECT_BYTES).max(request_bytes));
    if object_bytes == 0 {
        return Err(CliError::input("--object-size 0 is impossible; give a size such as 256MiB"));
    }
    if request_bytes > object_bytes {
        return Err(CliError::input(format!(
            "--request-size {} is larger than the object size {}; use a smaller --request-size or a larger --object-size",
            format_bytes(request_bytes),
            format_bytes(object_bytes)
        )));
    }
    if direct && !object_bytes.is_multiple_of(block) {
        return Err(CliError::input(format!(
            "--object-size {object_bytes} is not a multiple of the {block}-byte block size O_DIRECT needs; use a multiple of {block}"
        )));
    }
    if !object_bytes.is_multiple_of(request_bytes) {
        return Err(CliError::input(format!(
            "--object-size {} is not a multiple of --request-size {}; make it one so every request is whole",
            format_bytes(object_bytes),
            format_bytes(request_bytes)
        )));
    }
    if object_bytes > data_bytes {
        return Err(CliError::input(format!(
            "--object-size {} is larger than the data size {}; use a smaller --object-size or a larger --data-size",
            format_bytes(object_bytes),
            format_bytes(data_bytes)
        )));
    }
    // Random reads of one whole stripe unit are checked without reading more than they return.
    let floor = if args.pattern() == Pattern::Random { 64 * 1024 } else { MIB };
    let stripe_unit_bytes = args.stripe_unit.unwrap_or(request_bytes.max(floor).next_multiple_of(block));
    if stripe_unit_bytes == 0 || !stripe_unit_bytes.is_multiple_of(block) {
        return Err(CliError::input(format!(
            "--stripe-unit {stripe_unit_bytes} must be a non-zero multiple of the block size {block}"
        )));
    }
    if request_bytes > stripe_unit_bytes {
        return Err(CliError::input(format!(
            "--request-size {} is larger than the stripe unit {}; requests never cross a stripe unit, so use --stripe-unit {} or more",
            format_bytes(request_bytes),
            format_bytes(stripe_unit_bytes),
            format_bytes(request_bytes)
        )));
    }
    if args.backend == BackendArg::Cufile && args.buffer != BufferKind::Gpu {
        return Err(CliError::input(
            "--backend cufile moves data between SSDs and GPU memory; add --buffer gpu (or use --backend auto, io_uring or psync)",
        ));
    }
    if args.compare_fio && args.emulate.is_some() {
        return Err(CliError::input(
            "--compare-fio measures the real devices; fio cannot emulate them: drop --emulate or --compare-fio",
        ));
    }
    if args.compare_fio && args.buffer == BufferKind::Gpu {
        return Err(CliError::input("fio's twin jobs use host memory; compare with --buffer host or pinned"));
    }
    Ok(Workload {
        pattern: args.pattern(),
        read_percent: args.read_percent(),
        request_bytes,
        object_bytes,
        object_count: data_bytes / object_bytes,
        queue_depth: args.queue_depth,
        threads: args.threads,
        stripe_unit_bytes,
        devices: args.device_count(),
        verify: args.verify,
        verify_checksums: args.verify_checksums == Switch::On,
        buffer: args.buffer,
        gpu_ordinal: args.gpu_device,
    })
}

fn parse_device_model(text: &str) -> Result<DeviceModel, String> {
    DeviceModel::parse(text)
}

fn backend_kind(b: BackendArg) -> BackendKind {
    match b {
        BackendArg::Auto | BackendArg::Cufile => BackendKind::Auto,
        BackendArg::IoUring => BackendKind::IoUring,
        BackendArg::Psync => BackendKind::Psync,
    }
}

/// The engine's open settings for a workload: queue depth per device, requests of the
/// request size, and an in-flight budget that lets every device hold its queue depth.
pub fn open_config(args: &BenchArgs, w: &Workload) -> OpenConfig {
    let max_io_bytes = w.request_bytes.next_multiple_of(args.block_size);
    let queued = max_io_bytes * (w.queue_depth * w.devices) as u64;
    // Normal-priority work may use 7/8 of the budget; leave room for the queued ops' next request.
    let max_inflight_bytes = (queued * 8 / 7 + 2 * max_io_bytes).max(64 * MIB);
    OpenConfig {
        backend: backend_kind(args.backend),
        queue_depth: engine_queue_depth(w.queue_depth),
        direct_io: !args.buffered,
        max_io_bytes,
        max_inflight_bytes,
        // Host buffers are aligned and never bounce (but for partial blocks); GPU ops on the
        // bounce path go through it, so there it must hold a full queue of requests.
        bounce_pool_bytes: if w.buffer == BufferKind::Gpu {
            (queued + 2 * max_io_bytes).clamp(64 * MIB, GIB)
        } else {
            16 * MIB
        },
        verify_checksums: w.verify_checksums,
        durable: args.durable,
        emulate: args.emulate,
        gpu: GpuOptions {
            path: if args.backend == BackendArg::Cufile { GpuPath::Cufile } else { GpuPath::Auto },
            ..GpuOptions::default()
        },
        ..OpenConfig::default()
    }
}

/// The engine holds back max(depth / 8, 1) of each device queue (depth > 1) for urgent work;
/// the bench's ops are normal priority, so it asks for the smallest depth that leaves exactly
/// `queue_depth` for them, as fio's `iodepth` would.
pub fn engine_queue_depth(queue_depth: usize) -> usize {
    let normal = |depth: usize| if depth > 1 { depth - (depth / 8).max(1) } else { depth };
    (queue_depth..).find(|&d| normal(d) >= queue_depth).expect("a depth exists")
}

/// Bytes each device must hold for the data set, replacements in flight and metadata.
fn bytes_per_device(w: &Workload) -> u64 {
    let devices = w.devices as u64;
    let mut total = w.data_bytes();
    // Objects that may exist twice while a put replaces them.
    let mut replacing_objects = 0;
    if w.writes() {
        match w.pattern {
            Pattern::Sequential => {
                replacing_objects = (w.ops_in_flight_per_worker() * w.threads) as u64 + 1;
                total += replacing_objects * w.object_bytes;
            }
            Pattern::Random => {
                let small_objects = w.random_write_ids() + (w.ops_in_flight_per_worker() * w.threads) as u64;
                total += small_objects * w.request_bytes.next_multiple_of(4096);
            }
        }
    }
    // Each large object wastes at most one stripe unit per device to rounding.
    let rounding = (w.object_count + replacing_objects) * w.stripe_unit_bytes;
    let metadata = BENCH_METADATA_BYTES;
    (total.div_ceil(devices) + rounding + metadata).next_multiple_of(MIB)
}

/// Everything a run prints with `--json`.
#[derive(Debug, Serialize)]
struct JsonOutput<'a> {
    report: Option<&'a BenchReport>,
    sweep: Option<&'a sweep::SweepReport>,
    fio: Option<&'a fio::FioResult>,
    /// teraio GB/s over fio GB/s.
    teraio_over_fio: Option<f64>,
    /// With --compare-fio: fio wrote over the store's files, so they were formatted again as an
    /// empty store.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    reformatted_after_fio: bool,
}

/// Runs `teraio bench`.
pub fn run(args: &BenchArgs) -> CliResult<()> {
    // Check the workload numbers before touching anything (the data size is re-checked once
    // the targets are known).
    let requested_data = args.data_size.unwrap_or(DEFAULT_DATA_BYTES);
    if args.object_size.is_some_and(|o| o > requested_data) && args.data_size.is_none() {
        return Err(CliError::input("--object-size is larger than the default 4 GiB data size; give --data-size too"));
    }
    let draft = workload_from_args(args, requested_data)?;
    if args.emit_fio {
        print!("{}", fio::job_text(&draft));
        return Ok(());
    }
    if args.buffer == BufferKind::Gpu {
        // Fail on a machine without CUDA (or that GPU) before any target is touched.
        buffer::OpBuf::new(4096, BufferKind::Gpu, args.gpu_device).map_err(|e| {
            CliError::input(format!("--buffer gpu: {}; use --buffer host or pinned on this machine", e.message))
        })?;
    }
    if args.compare_fio {
        fio::check_fio()?;
        if args.sweep {
            return Err(CliError::input("--compare-fio compares one workload; leave out --sweep"));
        }
    }
    if args.sweep {
        for &stripe in &args.sweep_stripe_units {
            if stripe == 0 || !stripe.is_multiple_of(args.block_size) {
                return Err(CliError::input(format!(
                    "--sweep-stripe-units {stripe} must be a non-zero multiple of the block size {}",
                    args.block_size
                )));
            }
        }
        for &r in &args.sweep_request_sizes {
            if r == 0 || (!args.buffered && !r.is_multiple_of(args.block_size)) {
                return Err(CliError::input(format!(
                    "--sweep-request-sizes {r} must be a non-zero multiple of the block size {}",
                    args.block_size
                )));
            }
        }
        if args.sweep_queue_depths.iter().chain(&args.sweep_threads).any(|&n| n == 0) {
            return Err(CliError::input("--sweep-queue-depths and --sweep-threads take counts of 1 or more"));
        }
    }

    // From here on Ctrl-C stops the run cleanly (the temporary store is removed).
    workload::catch_interrupts();

    // Target files this run creates are removed again if it fails.
    let created = CreatedFiles::before_creating(&args.targets);
    let result = measure(args, &draft);
    if result.is_ok() {
        created.keep();
    }
    result
}

/// The run from the targets on: formats them (or the temporary store), fills the data set,
/// measures, and runs fio's twin with --compare-fio.
fn measure(args: &BenchArgs, draft: &Workload) -> CliResult<()> {
    let draft = draft.clone();
    // Targets: explicit ones, or the embedded temporary store.
    let file_bytes =
        args.file_size.unwrap_or_else(|| sizing_workload(args, &draft).map_or(0, |w| bytes_per_device(&w)));
    let temp_store;
    let targets: Vec<PathBuf> = if args.targets.is_empty() {
        let data = fit_default_data(args, &draft)?;
        let w = workload_from_args(args, data)?;
        let per_file = bytes_per_device(&sizing_workload(args, &w)?);
        temp_store = Some(TempStore::plan(DEFAULT_DEVICE_COUNT, per_file)?);
        let t = temp_store.as_ref().expect("just set");
        format_store(args, &t.paths, w.stripe_unit_bytes, Some(per_file))?;
        t.paths.clone()
    } else {
        temp_store = None;
        check_writable_targets(&args.targets, Intent::Bench, args.force, Some(file_bytes), args.buffered)?;
        // Files to create, and with --data-size those to grow: their file system must have room
        // before any is touched (a file that fills the disk halfway helps nobody).
        let allocated: Vec<PathBuf> = if args.data_size.is_some() {
            args.targets.clone()
        } else {
            args.targets.iter().filter(|p| std::fs::symlink_metadata(p).is_err()).cloned().collect()
        };
        check_free_space(&space_needed(&allocated, file_bytes), free_bytes)?;
        if args.data_size.is_some() {
            grow_small_files(args, &args.targets, file_bytes)?;
        }
        format_store(args, &args.targets, draft.stripe_unit_bytes, Some(file_bytes))?;
        args.targets.clone()
    };
    let _keep_until_done = &temp_store;

    // The data set must fit what the store has.
    let w = fit_to_store(args, &targets, &draft)?;
    check_buffer_memory(&w)?;
    // Device names fit the table's column: the index, then the path's distinctive end.
    let names: Vec<String> = targets
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let index = i.to_string();
            format!("{index} {}", report::shorten(&p.display().to_string(), 33 - index.len()))
        })
        .collect();
    let targets_text = crate::targets::describe_targets(&targets);
    if !args.json {
        eprintln!("teraio bench on {targets_text}");
    }

    if args.sweep {
        let report = sweep::run(args, &targets, &w, &names)?;
        if args.json {
            print_json(&JsonOutput {
                report: None,
                sweep: Some(&report),
                fio: None,
                teraio_over_fio: None,
                reformatted_after_fio: false,
            })?;
        } else {
            print!("{}", report.table());
        }
        return Ok(());
    }

    let store = Store::open(&targets, open_config(args, &w))?;
    let mut report = fill_and_measure(args, &store, &w, &names, true, None)?;
    report.targets = targets_text;
    store.close()?;
    let mut fio_result = None;
    let mut ratio = None;
    if args.compare_fio {
        let runtime = args.runtime.unwrap_or(Duration::from_secs(10));
        if !args.json {
            eprintln!("running fio's twin ({}) on the same files...", fio::config_path(&PathBuf::new(), &w).display());
        }
        let fio_run = fio::run(&w, &targets, runtime, args.warmup);
        // fio writes over the files from their first byte (its data set, or a read job's
        // preparation), the store's superblocks included: format them again, whatever fio did,
        // so that they hold a valid (empty) store rather than a damaged one.
        format_store(args, &targets, w.stripe_unit_bytes, None)?;
        if !args.json && temp_store.is_none() {
            eprintln!("fio wrote over the store: the targets were formatted again and hold an empty teraio store");
        }
        let r = fio_run?;
        ratio = Some(report.gb_per_s / r.gb_per_s().max(1e-12));
        fio_result = Some(r);
    }
    if args.json {
        print_json(&JsonOutput {
            report: Some(&report),
            sweep: None,
            fio: fio_result.as_ref(),
            teraio_over_fio: ratio,
            reformatted_after_fio: args.compare_fio,
        })?;
    } else {
        print!("{}", report.table());
        if fio_result.is_none() {
            println!("{}", report::REFERENCE_NOTE);
        }
        if let (Some(f), Some(ratio)) = (&fio_result, ratio) {
            println!();
            let ms = |us: f64| report::format_latency_ms(us.max(0.0).round() as u64);
            println!("fio ({}, same files, the reference): {:.3} GB/s, {:.0} IOPS, p50 {} ms, p99 {} ms, p99.9 {} ms, {:.2} cores busy",
                f.job_file, f.gb_per_s(), f.read_iops + f.write_iops, ms(f.p50_us), ms(f.p99_us), ms(f.p999_us), f.cores_busy);
            println!("teraio/fio: {ratio:.3}");
        }
    }
    Ok(())
}

/// Grows existing regular target files smaller than `file_bytes` (they are overwritten anyway,
/// which the target checks allowed), so that an explicit --data-size fits.
fn grow_small_files(args: &BenchArgs, targets: &[PathBuf], file_bytes: u64) -> CliResult<()> {
    for path in targets {
        let Ok(meta) = std::fs::metadata(path) else { continue };
        if meta.is_file() && meta.len() < file_bytes {
            if !args.json {
                eprintln!("growing {} to {} for the data set", path.display(), format_bytes(file_bytes));
            }
            teraio_engine::device::create_file(path, file_bytes)?;
        }
    }
    Ok(())
}

/// The workload used to size files: the sweep's largest settings when sweeping.
fn sizing_workload(args: &BenchArgs, w: &Workload) -> CliResult<Workload> {
    let mut sized = w.clone();
    if args.sweep {
        sized.threads = args.sweep_threads.iter().copied().max().unwrap_or(1);
        sized.queue_depth = args.sweep_queue_depths.iter().copied().max().unwrap_or(1);
        sized.request_bytes =
            args.sweep_request_sizes.iter().copied().max().unwrap_or(w.request_bytes).min(w.object_bytes);
        sized.stripe_unit_bytes = args.sweep_stripe_units.iter().copied().max().unwrap_or(w.stripe_unit_bytes);
    }
    Ok(sized)
}

/// The default store's data size: the requested (or default) size, shrunk to half the free
/// space of the temp directory.
fn fit_default_data(args: &BenchArgs, draft: &Workload) -> CliResult<u64> {
    let free = crate::targets::free_bytes(&std::env::temp_dir())?;
    let wanted = draft.data_bytes();
    if args.data_size.is_some() {
        return Ok(wanted);
    }
    let fits = (free / 2).min(wanted) / draft.object_bytes * draft.object_bytes;
    if fits > 0 && fits < wanted && !args.json {
        eprintln!(
            "data set shrunk from {} to {}: half the free space of {} ({} free); set TMPDIR or give --data-size",
            format_bytes(wanted),
            format_bytes(fits),
            std::env::temp_dir().display(),
            format_bytes(free)
        );
    }
    if fits == 0 {
        return Err(CliError::input(format!(
            "{} has only {} free; set TMPDIR to a disk with more room, or give targets",
            std::env::temp_dir().display(),
            format_bytes(free)
        )));
    }
    Ok(fits)
}

fn format_store(args: &BenchArgs, paths: &[PathBuf], stripe_unit_bytes: u64, create: Option<u64>) -> CliResult<()> {
    let config = FormatConfig {
        stripe_unit_bytes,
        block_size: args.block_size,
        checksums: true,
        checkpoint_slot_bytes: Some(BENCH_CHECKPOINT_SLOT_BYTES),
        journal_bytes: Some(BENCH_JOURNAL_BYTES),
        create_file_bytes: create,
        // The targets were checked (and --force given where they hold data) above.
        force: true,
        direct_io: !args.buffered,
        ..FormatConfig::default()
    };
    Store::format(paths, &config)?;
    Ok(())
}

/// Re-derives the workload against the formatted store: the default data size shrinks to what
/// fits; an explicit one that does not fit is an error that says how much does.
fn fit_to_store(args: &BenchArgs, targets: &[PathBuf], draft: &Workload) -> CliResult<Workload> {
    let store =
        Store::open(targets, OpenConfig { queue_depth: 4, direct_io: !args.buffered, ..OpenConfig::default() })?;
    let info = store.info();
    store.close()?;
    let free_per_device = info.devices.iter().map(|d| d.free_bytes).min().unwrap_or(0);
    let mut data = draft.data_bytes();
    loop {
        let w = workload_from_args(args, data)?;
        let sized = sizing_workload(args, &w)?;
        if bytes_per_device(&sized) - BENCH_METADATA_BYTES <= free_per_device {
            if data < draft.data_bytes() && !args.json {
                eprintln!(
                    "data set shrunk from {} to {}: the targets have {} free per device; give larger targets",
                    format_bytes(draft.data_bytes()),
                    format_bytes(data),
                    format_bytes(free_per_device)
                );
            }
            return Ok(w);
        }
        if args.data_size.is_some() || data <= w.object_bytes {
            return Err(CliError::input(format!(
                "the data set ({}) and room to replace objects do not fit the targets ({} free per device); give a smaller --data-size or larger targets",
                format_bytes(w.data_bytes()),
                format_bytes(free_per_device)
            )));
        }
        data = (data / 2).max(w.object_bytes) / w.object_bytes * w.object_bytes;
    }
}

/// Writes the data set (with `fill`), drops caches, warms up and runs the timed phase on an
/// open store; `limit` overrides the runtime or size the arguments give.
pub fn fill_and_measure(
    args: &BenchArgs,
    store: &Store,
    w: &Workload,
    names: &[String],
    fill: bool,
    limit: Option<Limit>,
) -> CliResult<BenchReport> {
    let show = !args.json && !args.no_progress;
    // GPU buffers: set the GPU path up now (pinning, and auto's measurement) so that it is not
    // timed, and so that a machine without CUDA or cuFile fails here with the engine's reason.
    let gpu_path = match w.buffer {
        BufferKind::Gpu => Some(store.gpu_setup(w.gpu_ordinal)?.to_string()),
        _ => None,
    };
    if fill {
        let progress = Progress::default();
        with_progress(show, "writing data set", ProgressKind::Bytes(w.data_bytes()), &progress, || {
            workload::prefill(store, w, &progress)
        })?;
    }
    if args.drop_caches {
        drop_page_cache()?;
    }
    if workload::interrupted() {
        return Err(CliError::failed("interrupted while writing the data set"));
    }
    if !args.warmup.is_zero() {
        let warm = Progress::default();
        with_progress(show, "warm-up", ProgressKind::Time(args.warmup), &warm, || {
            workload::run_phase(store, w, Limit::Runtime(args.warmup), &warm)
        })?;
    }
    let limit = limit.unwrap_or(match (args.runtime, args.size) {
        (Some(d), _) => Limit::Runtime(d),
        (None, Some(b)) => Limit::Bytes(b),
        (None, None) => Limit::Steady,
    });
    let kind = match limit {
        Limit::Runtime(d) => ProgressKind::Time(d),
        Limit::Steady => ProgressKind::Time(workload::STEADY_MAX),
        Limit::Bytes(b) => ProgressKind::Bytes(b),
    };
    store.reset_stats();
    let measured = Progress::default();
    let cpu_before = CpuTimes::now();
    let totals = with_progress(show, "measuring", kind, &measured, || workload::run_phase(store, w, limit, &measured))?;
    if workload::interrupted() {
        return Err(CliError::failed("interrupted; the timed phase was cut short and is not reported"));
    }
    let cpu = CpuTimes::now().since(&cpu_before);
    let mut report = BenchReport::new(w, names, &store.stats(), &totals, cpu);
    report.gpu_path = gpu_path;
    Ok(report)
}

/// Samples the progress bar's rate spans: 2 s of 250 ms ticks, so that ops completing in bursts
/// (a whole 256 MiB object at once) do not make the rate jump between 0 and its peak.
const PROGRESS_RATE_WINDOW: usize = 8;

/// A rate over a moving window of (seconds, bytes done) samples.
struct MovingRate {
    samples: std::collections::VecDeque<(f64, u64)>,
    window: usize,
}

impl MovingRate {
    fn new(window: usize) -> MovingRate {
        assert!(window >= 1);
        MovingRate { samples: std::collections::VecDeque::with_capacity(window + 1), window }
    }

    /// Adds a sample; returns bytes per second from the oldest sample kept to this one.
    fn add(&mut self, at_s: f64, bytes_done: u64) -> f64 {
        self.samples.push_back((at_s, bytes_done));
        if self.samples.len() > self.window + 1 {
            self.samples.pop_front();
        }
        let (first_s, first_bytes) = self.samples[0];
        (bytes_done - first_bytes) as f64 / (at_s - first_s).max(1e-9)
    }
}

/// What a progress bar counts.
#[derive(Debug, Clone, Copy)]
enum ProgressKind {
    Time(Duration),
    Bytes(u64),
}

/// Runs `work` while a progress bar (on a terminal) shows how far it is and the current GB/s.
fn with_progress<T>(
    show: bool,
    label: &str,
    kind: ProgressKind,
    progress: &Progress,
    work: impl FnOnce() -> CliResult<T>,
) -> CliResult<T> {
    if !show {
        return work();
    }
    let (length, template) = match kind {
        ProgressKind::Time(d) => (d.as_millis() as u64, "{prefix:>18} [{bar:30}] {elapsed}/{duration} {msg}"),
        ProgressKind::Bytes(b) => (b, "{prefix:>18} [{bar:30}] {bytes}/{total_bytes} {msg}"),
    };
    let bar = ProgressBar::new(length);
    bar.set_style(ProgressStyle::with_template(template).expect("valid template").progress_chars("=> "));
    bar.set_prefix(label.to_string());
    let done = std::sync::atomic::AtomicBool::new(false);
    let result = std::thread::scope(|scope| {
        scope.spawn(|| {
            let started = std::time::Instant::now();
            let mut rate = MovingRate::new(PROGRESS_RATE_WINDOW);
            rate.add(0.0, 0);
            while !done.load(Ordering::Relaxed) {
                std::thread::sleep(Duration::from_millis(250));
                let now = std::time::Instant::now();
                let bytes = progress.bytes_done.load(Ordering::Relaxed);
                let rate = rate.add(now.duration_since(started).as_secs_f64(), bytes) / 1e9;
                bar.set_position(match kind {
                    ProgressKind::Time(_) => now.duration_since(started).as_millis() as u64,
                    ProgressKind::Bytes(_) => bytes,
                });
                bar.set_message(format!("{rate:.2} GB/s"));
            }
        });
        let result = work();
        done.store(true, Ordering::Relaxed);
        result
    });
    bar.finish_and_clear();
    result
}

/// Refuses buffer sets larger than half the host's memory (pinned ones would lock it up).
fn check_buffer_memory(w: &Workload) -> CliResult<()> {
    // SAFETY: sysconf has no memory effects.
    let physical = unsafe { libc::sysconf(libc::_SC_PHYS_PAGES) as u64 * libc::sysconf(libc::_SC_PAGESIZE) as u64 };
    if physical > 0 && w.buffer_bytes() > physical / 2 {
        return Err(CliError::input(format!(
            "the bench's buffers would take {} ({} ops in flight of {}), over half this host's memory; use a smaller --object-size or --queue-depth",
            format_bytes(w.buffer_bytes()),
            w.ops_in_flight_per_worker() * w.threads,
            format_bytes(w.op_bytes())
        )));
    }
    Ok(())
}

/// Flushes dirty pages and drops the page cache, so reads come from the devices.
fn drop_page_cache() -> CliResult<()> {
    // SAFETY: sync has no arguments and cannot fail.
    unsafe { libc::sync() };
    std::fs::write("/proc/sys/vm/drop_caches", "3").map_err(|e| {
        CliError::input(format!("cannot drop the page cache ({e}); run as root or leave out --drop-caches"))
    })
}

fn print_json<T: Serialize>(value: &T) -> CliResult<()> {
    let text = serde_json::to_string_pretty(value).map_err(|e| CliError::failed(format!("cannot write JSON: {e}")))?;
    println!("{text}");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_progress_rate_is_a_moving_window_not_the_last_tick() {
        // 256 MiB objects completing every second, sampled every 250 ms: the last tick alone reads
        // 0 or 1 GB/s; the 2 s window reads the true 268 MB/s once it is full.
        let mut rate = MovingRate::new(8);
        let object = 256u64 << 20;
        let mut readings = Vec::new();
        for tick in 0..=16u64 {
            let done = tick / 4 * object;
            readings.push(rate.add(tick as f64 * 0.25, done));
        }
        for reading in &readings[8..] {
            let want = object as f64; // bytes per second
            assert!((reading - want).abs() <= 0.25 * want, "{reading} against {want}");
        }
    }

    #[test]
    fn engine_depth_leaves_the_asked_depth_for_normal_ops() {
        assert_eq!(engine_queue_depth(1), 1);
        assert_eq!(engine_queue_depth(32), 36);
        assert_eq!(engine_queue_depth(128), 146);
        assert!(engine_queue_depth(MAX_QUEUE_DEPTH) <= 4096);
    }
}
