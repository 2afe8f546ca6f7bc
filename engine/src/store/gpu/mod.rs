//! The store's GPU data paths: tensors in CUDA device memory move GPU <-> SSD without the caller
//! staging them (the CUDA calls themselves are [`crate::cuda`]).
//!
//! - [`crate::cuda::probe()`] reports what the machine has (CUDA driver, GPUs, libcufile,
//!   nvidia-fs, cuFile's configuration); with no CUDA every GPU call fails with a typed error
//!   saying so.
//! - The pinned bounce path (always there when CUDA is): each piece of an op goes through a chunk
//!   of the store's bounce slab, which is page-locked for CUDA on first GPU use and registered with
//!   io_uring as fixed buffers; copies run on the engine's own streams ([`crate::cuda::copy`])
//!   while the disk works on other chunks.
//! - The cuFile path ([`crate::backend::cufile`]): pieces go to libcufile straight from/to GPU
//!   memory, in true GDS mode where nvidia-fs serves the file, else in cuFile's compatibility mode.
//! - [`GpuTicket`] adds the stream hand-off ([`crate::cuda::handoff`]) to an ordinary ticket: a
//!   caller's stream waits for the op on the GPU.
//! - The other way round, an op can start after a caller's CUDA event ([`crate::cuda::gate`]): the
//!   engine waits for the event on its own thread before it touches the caller's GPU memory.
//!
//! Which path a store uses is decided on its first GPU op ([`GpuPathReport`] says which and why).

pub(crate) mod runtime;
pub(crate) mod select;

use crate::config::GpuPath;
use crate::cuda::handoff;
use crate::error::Result;
use crate::store::ticket::Ticket;
use std::sync::Arc;
use std::time::Duration;

/// What a store chose for GPU I/O, and why.
#[derive(Debug, Clone)]
pub struct GpuPathReport {
    /// `Bounce` or `Cufile` (never `Auto`; `Gds` only when true GDS was required and found).
    pub path: GpuPath,
    /// The CUDA device the cuFile path serves (ops on other devices use the bounce path).
    pub device: u32,
    /// For cuFile: "true GDS" or "compatibility mode (<reasons>)", per store device.
    pub cufile_mode: Vec<String>,
    /// One line: what was asked for, what was found, what is used.
    pub reason: String,
    /// GB/s of the short measurement `auto` made (bounce, cuFile), if it made one.
    pub measured_gbps: Option<(f64, f64)>,
    /// Bytes of pinned host memory the store uses (its bounce slab; bounded by `bounce_pool_bytes`).
    pub pinned_bytes: u64,
    /// The store keeps stripe-unit checksums (format option).
    pub store_checksums: bool,
    /// The store was opened with `verify_checksums`.
    pub verify_checksums: bool,
}

impl GpuPathReport {
    /// What GPU ops on this path check: checksums can be taken and checked only where the bytes
    /// pass through host memory (the pinned bounce chunks), never on the cuFile path.
    pub fn checksum_note(&self) -> &'static str {
        match (self.path, self.store_checksums, self.verify_checksums) {
            (_, false, _) => "none (the store keeps no checksums)",
            (GpuPath::Cufile | GpuPath::Gds, _, _) => {
                "NOT checked on cuFile gets, and cuFile puts keep none: their bytes never pass through host memory (gpu=bounce checks every get)"
            }
            (_, true, true) => "every get checked in the pinned bounce chunks",
            (_, true, false) => "not checked (verify_checksums is off)",
        }
    }
}

impl std::fmt::Display for GpuPathReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} (GPU {}): {}", self.path.name(), self.device, self.reason)?;
        if let Some((b, c)) = self.measured_gbps {
            write!(f, " [measured: bounce {b:.2} GB/s, cuFile {c:.2} GB/s]")?;
        }
        for m in &self.cufile_mode {
            write!(f, "; {m}")?;
        }
        write!(f, "; checksums: {}", self.checksum_note())
    }
}

/// The ticket of a GPU put or get: an ordinary [`Ticket`] plus the stream hand-off.
#[must_use = "a ticket must be waited on to learn whether the op succeeded"]
pub struct GpuTicket<B = ()> {
    pub(crate) ticket: Ticket<B>,
    pub(crate) handoff: Option<handoff::Handoff>,
}

impl GpuTicket<()> {
    /// The same op's ticket, now owning the caller's buffer. The raw ticket lets go of the op
    /// without waiting for it (a ticket that still held its buffer would wait when dropped).
    pub(crate) fn holding<B>(mut self, buffer: B) -> GpuTicket<B> {
        self.ticket.buffer = None;
        GpuTicket {
            ticket: Ticket { completion: self.ticket.completion.clone(), buffer: Some(buffer) },
            handoff: self.handoff,
        }
    }
}

impl<B> GpuTicket<B> {
    /// Waits for the op; returns the buffer or the op's error.
    pub fn wait(self) -> Result<B> {
        self.ticket.wait()
    }

    /// The buffer the ticket holds (e.g. to queue work on it behind the stream hand-off).
    pub fn buffer(&self) -> &B {
        self.ticket.buffer.as_ref().expect("a live ticket holds its buffer")
    }

    /// Whether the op has finished; never blocks.
    pub fn is_done(&self) -> bool {
        self.ticket.is_done()
    }

    /// See [`Ticket::object_len_bytes`].
    pub fn object_len_bytes(&self) -> Option<u64> {
        self.ticket.object_len_bytes()
    }

    /// See [`Ticket::signal_when_done`].
    pub fn signal_when_done(&self, signal: &Arc<crate::store::ticket::DoneSignal>) {
        self.ticket.signal_when_done(signal)
    }

    /// Waits at most `timeout`; `None` if the op is still running.
    pub fn wait_timeout(&self, timeout: Duration) -> Option<Result<()>> {
        self.ticket.wait_timeout(timeout)
    }

    /// Makes the caller's CUDA `stream` wait for this op: work queued on the stream after this
    /// call starts only once the op has finished. The calling thread waits on the host until the
    /// op's own GPU work is queued (a get: its bytes are read and their copies to the GPU queued,
    /// not done; on the cuFile path: its reads have returned), never for the copies, so that the
    /// stream waits for work queued before it only (see [`handoff`]). The op's outcome still
    /// comes from [`GpuTicket::wait`]: after a failed get the data must not be used.
    ///
    /// # Safety
    /// `stream` must be a live stream (or null, the legacy default stream) of the primary context
    /// of the op's device.
    pub unsafe fn enqueue_stream_wait(&self, stream: cudarc::driver::sys::CUstream) -> Result<()> {
        match &self.handoff {
            Some(h) => {
                h.unissued.wait();
                // SAFETY: forwarded contract.
                unsafe { h.flags.enqueue_wait(h.slot, stream) }
            }
            None => Err(handoff::no_handoff("all hand-off slots were taken when the op started")),
        }
    }

    /// Whether [`GpuTicket::enqueue_stream_wait`] would return without waiting on the host: the
    /// op's GPU work is all queued (or it has no hand-off).
    pub fn stream_wait_ready(&self) -> bool {
        self.handoff.as_ref().is_none_or(|h| h.unissued.is_issued())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda::{cufile, driver as cuda, probe, DeviceBuffer, DevicePtr, DeviceSlice, RawEvent};
    use crate::{FormatConfig, OpenConfig, Priority, Store, MIB};
    use handoff::HandoffSlot;

    /// Without CUDA (CI, this dev machine) the probe and every GPU call say so with a typed error;
    /// with CUDA the probe lists the devices. Host I/O works either way.
    #[test]
    fn gpu_calls_report_what_is_missing() {
        let report = probe();
        let text = report.to_string();
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("dev0");
        let format = FormatConfig { create_file_bytes: Some(64 * MIB), ..Default::default() };
        let store = Store::create(&[&file], &format, OpenConfig { direct_io: false, ..Default::default() }).unwrap();
        store.put_blocking(1, b"host bytes", b"").unwrap();
        let slice = DeviceSlice { ptr: 0x1000, len: 16, device: 0 };
        // SAFETY: with no CUDA nothing is queued; with CUDA the pointer check refuses 0x1000.
        let put = unsafe { store.put_gpu_raw(2, slice, b"", Priority::Normal) };
        match &report.driver {
            Err(reason) => {
                assert!(reason.contains("libcuda.so.1 not loadable"), "{reason}");
                assert!(text.contains("no CUDA driver found"), "{text}");
                assert!(text.contains("GPU paths: none"), "{text}");
                match put {
                    Err(crate::Error::BackendUnavailable { backend: "cuda", reason }) => {
                        assert!(reason.contains("no CUDA driver found"), "{reason}")
                    }
                    Err(other) => panic!("expected BackendUnavailable(cuda), got {other}"),
                    Ok(_) => panic!("a GPU put succeeded without CUDA"),
                }
                // A put or get after an event says the same, before it looks at the event.
                let event = 0x2000 as RawEvent;
                // SAFETY: with no CUDA nothing is queued and the event is never used.
                let after = unsafe { store.put_gpu_raw_after(3, slice, b"", Priority::Normal, Some(event)) };
                assert!(matches!(after, Err(crate::Error::BackendUnavailable { backend: "cuda", .. })));
                // SAFETY: as above.
                let after = unsafe { store.get_gpu_raw_after(1, 0, slice, true, Priority::Normal, Some(event)) };
                assert!(matches!(after, Err(crate::Error::BackendUnavailable { backend: "cuda", .. })));
                assert!(store.gpu_report().is_none());
                assert!(DeviceBuffer::new(0, 16).is_err());
            }
            Ok(d) => {
                assert_eq!(report.devices.len() as u32, d.device_count);
                assert!(put.is_err(), "a host address was accepted as device memory");
            }
        }
        assert_eq!(store.get_to_vec(1).unwrap(), b"host bytes");
        store.close().unwrap();
    }

    /// A caller's stream held on a flag that only the test sets (the hand-off's
    /// `cuStreamWaitValue32`), then the work queued behind it, then an event: an op after that
    /// event cannot run before the test releases the stream, whatever the timing.
    struct HeldStream {
        ctx: &'static cuda::Context,
        stream: cuda::Stream,
        flags: handoff::HandoffFlags,
        slot: HandoffSlot,
        // Declared before `memory`: unregistered before it is freed.
        _registration: cuda::PinnedRegistration,
        _memory: crate::AlignedBuf,
    }

    impl HeldStream {
        /// A held stream that will copy `bytes` into `dst` once released.
        fn copying(bytes: &[u8], dst: DevicePtr) -> HeldStream {
            let ctx = cuda::context(0).unwrap();
            let stream = cuda::Stream::new(ctx).unwrap();
            let flags = handoff::HandoffFlags::new(ctx).unwrap();
            let slot = flags.claim().unwrap();
            let mut memory = crate::AlignedBuf::new(bytes.len(), 4096).unwrap();
            memory.copy_from_slice(bytes);
            // SAFETY: `memory` outlives the registration (field order).
            let registration =
                unsafe { cuda::PinnedRegistration::new(ctx, memory.as_mut_ptr(), memory.len()) }.unwrap();
            // SAFETY: our stream; the flags and the pinned source live as long as `self`, which
            // the test releases and synchronizes before dropping.
            unsafe {
                flags.enqueue_wait(slot, stream.raw).unwrap();
                cuda::copy_to_device_async(dst, memory.as_ptr(), bytes.len(), &stream).unwrap();
            }
            HeldStream { ctx, stream, flags, slot, _registration: registration, _memory: memory }
        }

        /// An event after the held copy (the caller may destroy it once the op has started).
        fn event(&self) -> cuda::Event {
            let event = cuda::Event::new(self.ctx).unwrap();
            event.record(&self.stream).unwrap();
            event
        }

        fn release(self) {
            self.flags.signal(self.slot);
            let done = cuda::Event::new(self.ctx).unwrap();
            done.record(&self.stream).unwrap();
            done.synchronize().unwrap();
        }
    }

    /// A store whose GPU state for device 0 is set up by a first GPU op: setting it up (pinning,
    /// streams, maybe measuring) may synchronize the device, which must not happen while a
    /// stream is held.
    fn gpu_store(dir: &std::path::Path) -> Store {
        let format = FormatConfig { create_file_bytes: Some(64 * MIB), ..Default::default() };
        let store =
            Store::create(&[dir.join("dev0")], &format, OpenConfig { direct_io: false, ..Default::default() }).unwrap();
        let mut first = DeviceBuffer::new(0, 4096).unwrap();
        first.fill(1).unwrap();
        store.put_gpu(99, first, b"", Priority::Normal).unwrap().wait().unwrap();
        store
    }

    /// A put after an event on a stream that is still to write the source stores the bytes the
    /// stream writes, not those the source held when the put was called. Needs a GPU (skipped
    /// without CUDA: `gpu_calls_report_what_is_missing` covers that case).
    #[test]
    fn a_put_after_an_event_stores_the_bytes_written_before_it() {
        if cuda::driver().is_err() {
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let store = gpu_store(dir.path());
        let len = 3 * MIB as usize + 512;
        let final_bytes: Vec<u8> = (0..len).map(|i| (i * 31 % 251) as u8).collect();
        let mut src = DeviceBuffer::new(0, len).unwrap();
        src.fill(0x11).unwrap();
        let held = HeldStream::copying(&final_bytes, src.ptr());
        let event = held.event();
        // SAFETY: `src` lives until the ticket is waited for; the event is live for the call.
        let ticket =
            unsafe { store.put_gpu_raw_after(7, src.slice(0, len), b"", Priority::Normal, Some(event.raw)) }.unwrap();
        drop(event); // the engine took the event as recorded at the call
        assert!(!ticket.is_done(), "the put ran before the event it was to start after");
        held.release();
        ticket.wait().unwrap();
        assert!(store.get_to_vec(7).unwrap() == final_bytes, "the put stored the bytes from before the event");
        store.close().unwrap();
    }

    /// A get after an event on a stream that still writes the target lands after that write.
    #[test]
    fn a_get_after_an_event_writes_after_the_work_before_it() {
        if cuda::driver().is_err() {
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let store = gpu_store(dir.path());
        let len = 2 * MIB as usize + 4096;
        let object: Vec<u8> = (0..len).map(|i| (i * 7 % 253) as u8).collect();
        store.put_blocking(9, &object, b"").unwrap();
        let dst = DeviceBuffer::new(0, len).unwrap();
        let held = HeldStream::copying(&vec![0xEE; len], dst.ptr());
        let event = held.event();
        // SAFETY: `dst` lives until the ticket is waited for; the event is live for the call.
        let ticket =
            unsafe { store.get_gpu_raw_after(9, 0, dst.slice(0, len), true, Priority::Normal, Some(event.raw)) }
                .unwrap();
        assert!(!ticket.is_done(), "the get ran before the event it was to start after");
        held.release();
        ticket.wait().unwrap();
        let mut back = vec![0u8; len];
        dst.copy_to_host(0, &mut back).unwrap();
        assert!(back == object, "the stream's earlier write landed over the get");
        drop(event);
        store.close().unwrap();
    }

    /// Whole-model mode's pattern of GPU ops, on the legacy default stream (PyTorch's default
    /// "compute" stream): per round, every key is produced by work on the stream and put after
    /// an event (each put once its key's last one is done, waited for on the host), then read
    /// back after an event, the stream made to wait for the get, and the data copied aside by
    /// work queued behind that wait. A stream wait enqueued before the get's own GPU work was
    /// queued could hold that work up and hang (see [`handoff`]); a watchdog turns a hang into a
    /// failure, and every stream wait must find the get's GPU work queued.
    #[test]
    fn gated_puts_and_gets_with_stream_waits_on_the_default_stream_finish() {
        if cuda::driver().is_err() {
            return;
        }
        let mut paths = vec![GpuPath::Bounce];
        if cufile::cufile().is_ok() {
            paths.push(GpuPath::Cufile);
        }
        for path in paths {
            let (done, finished) = std::sync::mpsc::channel();
            std::thread::spawn(move || {
                rounds_of_gated_ops(path);
                let _ = done.send(());
            });
            match finished.recv_timeout(Duration::from_secs(300)) {
                Ok(()) => {}
                Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => panic!("{path:?}: the pattern failed (above)"),
                Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
                    panic!("{path:?}: gated puts and gets with stream waits hung (no progress in 300 s)")
                }
            }
        }
    }

    fn rounds_of_gated_ops(path: GpuPath) {
        use cudarc::driver::sys;
        const KEYS: usize = 6;
        const ROUNDS: usize = 8;
        let len = MIB as usize + 4099;
        let dir = tempfile::tempdir().unwrap();
        let format = FormatConfig { create_file_bytes: Some(256 * MIB), ..Default::default() };
        let gpu = crate::config::GpuOptions { path, ..Default::default() };
        let open = OpenConfig { direct_io: false, gpu, ..Default::default() };
        let store = Store::create(&[dir.path().join("dev0")], &format, open).unwrap();
        let ctx = cuda::context(0).unwrap();
        // Everything is allocated before the first stream wait: nothing may synchronize the
        // device while the stream waits for the engine.
        let sources: Vec<DeviceBuffer> = (0..KEYS).map(|_| DeviceBuffer::new(0, len).unwrap()).collect();
        let targets: Vec<DeviceBuffer> = (0..KEYS).map(|_| DeviceBuffer::new(0, len).unwrap()).collect();
        let mut seen = DeviceBuffer::new(0, KEYS * ROUNDS * len).unwrap();
        seen.fill(0).unwrap();
        let mut first = DeviceBuffer::new(0, 4096).unwrap();
        first.fill(1).unwrap();
        store.put_gpu(99, first, b"", Priority::Normal).unwrap().wait().unwrap();
        let legacy: sys::CUstream = std::ptr::null_mut();
        let value = |round: usize, key: usize| (round * KEYS + key + 1) as u8;
        let mut puts: Vec<Option<GpuTicket>> = (0..KEYS).map(|_| None).collect();
        let mut gets = Vec::new();
        let mut events = Vec::new();
        let mut after = || {
            let event = cuda::Event::new(ctx).unwrap();
            // SAFETY: a live event on the legacy stream of the current context.
            cuda::check(unsafe { sys::cuEventRecord(event.raw, legacy) }, "cuEventRecord").unwrap();
            let raw = event.raw;
            events.push(event); // destroyed only once the device is idle
            raw
        };
        for round in 0..ROUNDS {
            for key in 0..KEYS {
                if let Some(previous) = puts[key].take() {
                    previous.wait().unwrap(); // one version of a key in flight at a time
                }
                ctx.make_current().unwrap();
                // SAFETY: our buffer; the producer of the put's bytes, still queued when it starts.
                let set = unsafe { sys::cuMemsetD8Async(sources[key].ptr(), value(round, key), len, legacy) };
                cuda::check(set, "cuMemsetD8Async").unwrap();
                let event = after();
                // SAFETY: the buffers and events outlive the tickets, which are waited for below.
                let put = unsafe {
                    store.put_gpu_raw_after(key as u64, sources[key].slice(0, len), b"", Priority::Normal, Some(event))
                };
                puts[key] = Some(put.unwrap());
            }
            for key in 0..KEYS {
                puts[key].take().unwrap().wait().unwrap(); // the read needs the key as last written
                let event = after();
                // SAFETY: as above.
                let get = unsafe {
                    store.get_gpu_raw_after(
                        key as u64,
                        0,
                        targets[key].slice(0, len),
                        true,
                        Priority::Normal,
                        Some(event),
                    )
                }
                .unwrap();
                // SAFETY: the legacy stream of the op's device.
                unsafe { get.enqueue_stream_wait(legacy) }.unwrap();
                assert!(get.stream_wait_ready(), "the stream wait went in before the get's GPU work was queued");
                let at = seen.ptr() + ((round * KEYS + key) * len) as u64;
                // SAFETY: both ranges lie in our buffers; queued behind the stream wait.
                let copy = unsafe { sys::cuMemcpyDtoDAsync_v2(at, targets[key].ptr(), len, legacy) };
                cuda::check(copy, "cuMemcpyDtoDAsync").unwrap();
                gets.push(get);
            }
        }
        for get in gets {
            get.wait().unwrap();
        }
        // SAFETY: waits for the legacy stream's work.
        cuda::check(unsafe { sys::cuCtxSynchronize() }, "cuCtxSynchronize").unwrap();
        let mut back = vec![0u8; len];
        for round in 0..ROUNDS {
            for key in 0..KEYS {
                seen.copy_to_host((round * KEYS + key) * len, &mut back).unwrap();
                let expected = value(round, key);
                assert!(
                    back.iter().all(|b| *b == expected),
                    "{path:?} round {round} key {key}: the work after the stream wait saw other bytes than the put's"
                );
            }
        }
        drop(events);
        store.close().unwrap();
    }
}
