//! GPU memory as the store sees it: the [`DeviceIoBuf`] contract for caller-owned device memory
//! (what `put_gpu`/`get_gpu` take and hand back through the ticket), and [`DeviceBuffer`], an
//! owned `cuMemAlloc` allocation for tests, benchmarks and bindings.

use super::driver::{self as cuda, check, Context, DevicePtr};
use crate::error::Result;
use cudarc::driver::sys;
use std::ffi::c_void;

/// Device memory the engine may read (put) or write (get) while an op runs.
///
/// # Safety
/// `device_ptr()..device_ptr() + device_len()` must be device memory of CUDA device
/// `device_ordinal()` that stays allocated, at the same address, for the value's life.
pub unsafe trait DeviceIoBuf: Send + 'static {
    fn device_ptr(&self) -> DevicePtr;
    fn device_len(&self) -> usize;
    fn device_ordinal(&self) -> u32;
}

/// A region of device memory given as raw parts (for the C ABI, Python and framework tensors):
/// the caller keeps the allocation alive until the ticket is done.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceSlice {
    pub ptr: DevicePtr,
    pub len: usize,
    pub device: u32,
}

/// An owned device allocation (`cuMemAlloc`), freed on drop.
pub struct DeviceBuffer {
    ctx: &'static Context,
    ptr: DevicePtr,
    len: usize,
}

impl DeviceBuffer {
    /// `len` bytes (at least one) on device `ordinal`; the contents are undefined.
    pub fn new(ordinal: u32, len: usize) -> Result<DeviceBuffer> {
        let ctx = cuda::context(ordinal)?;
        ctx.make_current()?;
        let mut ptr: DevicePtr = 0;
        // SAFETY: valid out-pointer.
        check(unsafe { sys::cuMemAlloc_v2(&mut ptr, len.max(1)) }, "cuMemAlloc")?;
        Ok(DeviceBuffer { ctx, ptr, len })
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn ptr(&self) -> DevicePtr {
        self.ptr
    }

    /// The sub-range `offset..offset + len` as a raw slice.
    pub fn slice(&self, offset: usize, len: usize) -> DeviceSlice {
        assert!(offset + len <= self.len, "slice {offset}+{len} outside a {}-byte buffer", self.len);
        DeviceSlice { ptr: self.ptr + offset as u64, len, device: self.ctx.ordinal }
    }

    /// Copies `src` to byte `offset` (synchronously).
    pub fn copy_from_host(&mut self, offset: usize, src: &[u8]) -> Result<()> {
        assert!(offset + src.len() <= self.len);
        self.ctx.make_current()?;
        // SAFETY: the range lies in our allocation; the copy is synchronous.
        check(
            unsafe { sys::cuMemcpyHtoD_v2(self.ptr + offset as u64, src.as_ptr() as *const c_void, src.len()) },
            "cuMemcpyHtoD",
        )
    }

    /// Copies bytes from `offset` into `dst` (synchronously).
    pub fn copy_to_host(&self, offset: usize, dst: &mut [u8]) -> Result<()> {
        assert!(offset + dst.len() <= self.len);
        self.ctx.make_current()?;
        // SAFETY: the range lies in our allocation; the copy is synchronous.
        check(
            unsafe { sys::cuMemcpyDtoH_v2(dst.as_mut_ptr() as *mut c_void, self.ptr + offset as u64, dst.len()) },
            "cuMemcpyDtoH",
        )
    }

    /// Sets every byte to `value` (synchronously).
    pub fn fill(&mut self, value: u8) -> Result<()> {
        self.ctx.make_current()?;
        // SAFETY: our allocation.
        check(unsafe { sys::cuMemsetD8_v2(self.ptr, value, self.len) }, "cuMemsetD8")?;
        // SAFETY: waits for the legacy stream the memset ran on.
        check(unsafe { sys::cuCtxSynchronize() }, "cuCtxSynchronize")
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        if self.ctx.make_current().is_ok() {
            // SAFETY: allocated in `new`; the ticket that used it is done.
            unsafe { sys::cuMemFree_v2(self.ptr) };
        }
    }
}

// SAFETY: the allocation is owned and fixed for the value's life.
unsafe impl DeviceIoBuf for DeviceBuffer {
    fn device_ptr(&self) -> DevicePtr {
        self.ptr
    }
    fn device_len(&self) -> usize {
        self.len
    }
    fn device_ordinal(&self) -> u32 {
        self.ctx.ordinal
    }
}
