//! The GPU data API: put and get from CUDA device memory, on the store's GPU path (chosen on the
//! first GPU op by `crate::store::gpu::select`).

use super::api::{GetSpec, Memory, PutSpec};
use super::op::GpuOp;
use super::ticket::Ticket;
use super::Store;
use crate::cuda::handoff::Unissued;
use crate::cuda::RawEvent;
use crate::error::Result;
use crate::queue::Priority;
use crate::store::gpu::runtime::StoreGpu;
use crate::store::gpu::GpuTicket;
use std::sync::atomic::AtomicBool;
use std::sync::Mutex;

/// GPU memory: put and get from CUDA device pointers, on the store's GPU path.
impl Store {
    /// Sets up GPU I/O for CUDA device `ordinal` now (else the first GPU op does it): pins the
    /// bounce slab, chooses the path per `OpenConfig::gpu` (measuring both where `auto` may pick
    /// either) and returns what was chosen and why. Later calls return the first outcome.
    pub fn gpu_setup(&self, ordinal: u32) -> Result<crate::store::gpu::GpuPathReport> {
        self.gpu_state(ordinal).map(|g| g.report.clone())
    }

    /// The GPU path report, if GPU I/O has been set up.
    pub fn gpu_report(&self) -> Option<crate::store::gpu::GpuPathReport> {
        self.shared.gpu.get().and_then(|r| r.as_ref().ok()).map(|g| g.report.clone())
    }

    pub(super) fn gpu_state(&self, ordinal: u32) -> Result<&StoreGpu> {
        self.shared
            .gpu
            .get_or_init(|| crate::store::gpu::select::init_gpu(&self.shared, ordinal))
            .as_ref()
            .map_err(Clone::clone)
    }

    /// Starts writing device memory `data` as object `id`; the ticket hands `data` back when the
    /// put is durable. The caller's writes to `data` must be complete (e.g. its stream
    /// synchronized) before this call.
    pub fn put_gpu<B: crate::cuda::DeviceIoBuf>(
        &self,
        id: u64,
        data: B,
        meta: &[u8],
        priority: Priority,
    ) -> Result<GpuTicket<B>> {
        let slice =
            crate::cuda::DeviceSlice { ptr: data.device_ptr(), len: data.device_len(), device: data.device_ordinal() };
        // SAFETY: the ticket owns `data`.
        let t = unsafe { self.put_gpu_raw(id, slice, meta, priority)? };
        Ok(t.holding(data))
    }

    /// Starts reading the whole of object `id` into device memory `buf` (at least as long as the
    /// object; the rest is left untouched).
    pub fn get_gpu<B: crate::cuda::DeviceIoBuf>(&self, id: u64, buf: B, priority: Priority) -> Result<GpuTicket<B>> {
        let slice =
            crate::cuda::DeviceSlice { ptr: buf.device_ptr(), len: buf.device_len(), device: buf.device_ordinal() };
        // SAFETY: the ticket owns `buf`.
        let t = unsafe { self.get_gpu_raw(id, 0, slice, true, priority)? };
        Ok(t.holding(buf))
    }

    /// Starts reading `buf.device_len()` bytes of object `id` from byte `offset` into device memory.
    pub fn get_gpu_range<B: crate::cuda::DeviceIoBuf>(
        &self,
        id: u64,
        offset: u64,
        buf: B,
        priority: Priority,
    ) -> Result<GpuTicket<B>> {
        let slice =
            crate::cuda::DeviceSlice { ptr: buf.device_ptr(), len: buf.device_len(), device: buf.device_ordinal() };
        // SAFETY: the ticket owns `buf`.
        let t = unsafe { self.get_gpu_raw(id, offset, slice, false, priority)? };
        Ok(t.holding(buf))
    }

    /// `put_gpu` from a raw device range (for the C ABI, Python and framework tensors).
    ///
    /// # Safety
    /// `src` must be device memory of `src.device`, unchanged and allocated until the ticket is done.
    pub unsafe fn put_gpu_raw(
        &self,
        id: u64,
        src: crate::cuda::DeviceSlice,
        meta: &[u8],
        priority: Priority,
    ) -> Result<GpuTicket<()>> {
        // SAFETY: forwarded contract.
        unsafe { self.put_gpu_raw_after(id, src, meta, priority, None) }
    }

    /// `put_gpu_raw` that starts once CUDA event `after` has completed (as recorded when this is
    /// called; the caller may record or destroy the event afterwards): the work recorded in it
    /// may still be writing `src` when this is called. The engine waits for the event on its own
    /// thread; nothing blocks the caller. With `None`, as `put_gpu_raw`.
    ///
    /// # Safety
    /// `src` must be device memory of `src.device`, allocated until the ticket is done and
    /// unchanged from the event's completion until then; `after` must be a live CUDA event.
    pub unsafe fn put_gpu_raw_after(
        &self,
        id: u64,
        src: crate::cuda::DeviceSlice,
        meta: &[u8],
        priority: Priority,
        after: Option<RawEvent>,
    ) -> Result<GpuTicket<()>> {
        // SAFETY: forwarded contract.
        let started = unsafe { self.start_put(PutSpec { id, meta, priority }, Memory::Gpu { slice: src, after })? };
        Ok(GpuTicket { ticket: Ticket { completion: started.completion, buffer: Some(()) }, handoff: started.handoff })
    }

    /// `get_gpu_range` into a raw device range; with `whole`, `dst.len` may exceed the object.
    ///
    /// # Safety
    /// `dst` must be device memory of `dst.device`, allocated and not otherwise accessed until the
    /// ticket is done.
    pub unsafe fn get_gpu_raw(
        &self,
        id: u64,
        offset: u64,
        dst: crate::cuda::DeviceSlice,
        whole: bool,
        priority: Priority,
    ) -> Result<GpuTicket<()>> {
        // SAFETY: forwarded contract.
        unsafe { self.get_gpu_raw_after(id, offset, dst, whole, priority, None) }
    }

    /// `get_gpu_raw` that starts once CUDA event `after` has completed (as recorded when this is
    /// called): the work recorded in it may still be using `dst` when this is called. With
    /// `None`, as `get_gpu_raw`.
    ///
    /// # Safety
    /// `dst` must be device memory of `dst.device`, allocated until the ticket is done and not
    /// accessed from the event's completion until then; `after` must be a live CUDA event.
    pub unsafe fn get_gpu_raw_after(
        &self,
        id: u64,
        offset: u64,
        dst: crate::cuda::DeviceSlice,
        whole: bool,
        priority: Priority,
        after: Option<RawEvent>,
    ) -> Result<GpuTicket<()>> {
        // SAFETY: forwarded contract.
        let started =
            unsafe { self.start_get(GetSpec { id, offset, whole, priority }, Memory::Gpu { slice: dst, after })? };
        Ok(GpuTicket { ticket: Ticket { completion: started.completion, buffer: Some(()) }, handoff: started.handoff })
    }

    /// The GPU part of a new op on `mem`: checks the pointer, finds the device's state and path,
    /// and captures `after` on the device's gate.
    ///
    /// # Safety
    /// `after`, if any, must be a live CUDA event for this call's length.
    pub(super) unsafe fn gpu_op(&self, mem: crate::cuda::DeviceSlice, after: Option<RawEvent>) -> Result<GpuOp> {
        let state = self.gpu_state(mem.device)?;
        if mem.len > 0 {
            crate::cuda::driver::check_device_pointer(mem.ptr, mem.len, mem.device)?;
        }
        let device = state.device(mem.device)?;
        let use_cufile = state.uses_cufile(mem.device);
        // SAFETY: forwarded contract.
        let after = after.map(|event| unsafe { device.gate.mark(event) }).transpose()?;
        let handoff = device.handoff.claim();
        let (unissued, dispatching) = Unissued::new();
        Ok(GpuOp {
            device,
            use_cufile,
            handoff,
            handoff_signalled: AtomicBool::new(false),
            unissued,
            dispatching: Mutex::new(Some(dispatching)),
            after,
        })
    }
}
