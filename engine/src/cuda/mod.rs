//! CUDA as the engine reaches it, below the backends and the store: the driver calls (through
//! cudarc, loaded at run time), libcufile, the machine probe, device memory, the copy engine and
//! its event waiter, the stream hand-off and the gate that starts an op after a caller's event.
//! A machine without CUDA builds and runs every host path; each call here fails there with a typed
//! error that says what is missing. The store's GPU policy (which path, its tickets) is
//! [`crate::store::gpu`].

pub mod copy;
pub mod cufile;
pub mod driver;
pub mod gate;
pub mod handoff;
pub mod memory;
pub mod probe;
pub mod waiter;

pub use driver::DevicePtr;
pub use gate::RawEvent;
pub use memory::{DeviceBuffer, DeviceIoBuf, DeviceSlice};
pub use probe::{gds_obstacles, probe, GpuProbe};

use crate::error::Result;

/// Registers device memory with cuFile once (`cuFileBufRegister`), so that cuFile-path I/O into
/// any part of it uses the registration instead of a per-I/O mapping or cuFile's bounce buffers
/// (this matters in true GDS mode; compatibility mode ignores it). Registration is per process.
///
/// # Safety
/// `mem` must stay allocated until [`deregister_gpu_buffer`] is called with `mem.ptr`, and no I/O
/// into it may run during deregistration.
pub unsafe fn register_gpu_buffer(mem: DeviceSlice) -> Result<()> {
    driver::check_device_pointer(mem.ptr, mem.len, mem.device)?;
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
