//! GPU data paths: tensors in CUDA device memory move GPU <-> SSD without the caller staging them.
//!
//! - [`probe()`] reports what the machine has (CUDA driver, GPUs, libcufile, nvidia-fs, cuFile's
//!   configuration); with no CUDA every GPU call fails with a typed error saying so.
//! - The pinned bounce path (always there when CUDA is): each piece of an op goes through a chunk
//!   of the store's bounce slab, which is page-locked for CUDA on first GPU use and registered with
//!   io_uring as fixed buffers; copies run on the engine's own streams ([`copy`]) while the disk
//!   works on other chunks.
//! - The cuFile path ([`crate::backend::cufile`]): pieces go to libcufile straight from/to GPU
//!   memory, in true GDS mode where nvidia-fs serves the file, else in cuFile's compatibility mode.
//! - [`GpuTicket`] adds the stream hand-off ([`handoff`]) to an ordinary ticket.
//!
//! Which path a store uses is decided on its first GPU op ([`GpuPathReport`] says which and why).

pub mod copy;
pub mod cuda;
pub mod cufile;
pub mod handoff;
pub mod memory;
pub mod probe;
pub(crate) mod runtime;
pub(crate) mod select;

pub use cuda::DevicePtr;
pub use memory::{DeviceBuffer, DeviceIoBuf, DeviceSlice};
pub use probe::{gds_obstacles, probe, GpuProbe};

use crate::config::GpuPath;
use crate::error::Result;
use crate::store::ticket::Ticket;
use handoff::{HandoffFlags, HandoffSlot};
use std::sync::Arc;
use std::time::Duration;

/// Registers device memory with cuFile once (`cuFileBufRegister`), so that cuFile-path I/O into
/// any part of it uses the registration instead of a per-I/O mapping or cuFile's bounce buffers
/// (this matters in true GDS mode; compatibility mode ignores it). Registration is per process.
///
/// # Safety
/// `mem` must stay allocated until [`deregister_gpu_buffer`] is called with `mem.ptr`, and no I/O
/// into it may run during deregistration.
pub unsafe fn register_gpu_buffer(mem: DeviceSlice) -> Result<()> {
    cuda::check_device_pointer(mem.ptr, mem.len, mem.device)?;
    // SAFETY: forwarded contract.
    unsafe { cufile::cufile()?.register_buffer(mem.ptr, mem.len) }
}

/// Undoes [`register_gpu_buffer`].
///
/// # Safety
/// `ptr` must have been registered, and no I/O into it may be running.
pub unsafe fn deregister_gpu_buffer(ptr: DevicePtr) -> Result<()> {
    // SAFETY: forwarded contract.
    unsafe { cufile::cufile()?.deregister_buffer(ptr) }
}

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
    pub(crate) handoff: Option<(Arc<HandoffFlags>, HandoffSlot)>,
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

    /// Makes the caller's CUDA `stream` wait for this op (no CPU blocking): work queued on the
    /// stream after this call starts only once the op has finished. The op's outcome still comes
    /// from [`GpuTicket::wait`]: after a failed get the data must not be used.
    ///
    /// # Safety
    /// `stream` must be a live stream (or null, the legacy default stream) of the primary context
    /// of the op's device.
    pub unsafe fn enqueue_stream_wait(&self, stream: cudarc::driver::sys::CUstream) -> Result<()> {
        match &self.handoff {
            // SAFETY: forwarded contract.
            Some((flags, slot)) => unsafe { flags.enqueue_wait(*slot, stream) },
            None => Err(handoff::no_handoff("all hand-off slots were taken when the op started")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{FormatConfig, OpenConfig, Priority, Store, MIB};

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
}
