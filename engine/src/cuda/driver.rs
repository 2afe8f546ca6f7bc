//! The few CUDA driver calls the engine makes, through cudarc's bindings with the driver library
//! loaded at run time: a machine without CUDA builds and runs every host path, and each GPU call
//! there fails with a typed error that says what is missing.
//!
//! Contexts are the devices' primary contexts (the ones the CUDA runtime and PyTorch use), retained
//! once per device for the life of the process, so that pointers from the caller's framework are
//! valid in the engine's threads.

use crate::error::{Error, Result};
use cudarc::driver::sys;
use std::collections::HashMap;
use std::ffi::{c_void, CStr};
use std::sync::{Mutex, OnceLock};

/// A CUDA device address.
pub type DevicePtr = u64;

/// What loading the driver found.
#[derive(Debug, Clone)]
pub struct DriverInfo {
    /// As `cuDriverGetVersion` reports it: 1000 * major + 10 * minor (e.g. 13000).
    pub version: i32,
    pub device_count: u32,
}

static DRIVER: OnceLock<std::result::Result<DriverInfo, String>> = OnceLock::new();

fn load_driver() -> std::result::Result<DriverInfo, String> {
    // SAFETY: only tries dlopen on the candidate names; cudarc panics on first use otherwise.
    if !unsafe { sys::is_culib_present() } {
        return Err("no CUDA driver found: libcuda.so.1 not loadable".into());
    }
    // SAFETY: plain driver calls with valid out-pointers.
    unsafe {
        let r = sys::cuInit(0);
        if r != sys::CUresult::CUDA_SUCCESS {
            return Err(format!("CUDA driver found but cuInit failed: {}", error_name(r)));
        }
        let mut version = 0;
        let r = sys::cuDriverGetVersion(&mut version);
        if r != sys::CUresult::CUDA_SUCCESS {
            return Err(format!("cuDriverGetVersion failed: {}", error_name(r)));
        }
        let mut count = 0;
        let r = sys::cuDeviceGetCount(&mut count);
        if r != sys::CUresult::CUDA_SUCCESS {
            return Err(format!("cuDeviceGetCount failed: {}", error_name(r)));
        }
        Ok(DriverInfo { version, device_count: count.max(0) as u32 })
    }
}

/// The loaded driver, or why there is none (`BackendUnavailable { backend: "cuda" }`).
pub fn driver() -> Result<&'static DriverInfo> {
    match DRIVER.get_or_init(load_driver) {
        Ok(d) => Ok(d),
        Err(reason) => Err(Error::BackendUnavailable { backend: "cuda", reason: reason.clone() }),
    }
}

/// `CUDA_ERROR_...` name of a result code.
pub fn error_name(r: sys::CUresult) -> String {
    let mut name: *const std::ffi::c_char = std::ptr::null();
    // SAFETY: valid out-pointer; the string is static in the driver.
    if unsafe { sys::cuGetErrorName(r, &mut name) } == sys::CUresult::CUDA_SUCCESS && !name.is_null() {
        // SAFETY: a NUL-terminated static string.
        return unsafe { CStr::from_ptr(name) }.to_string_lossy().into_owned();
    }
    format!("{r:?}")
}

/// Turns a driver result into the engine's error, naming the call.
pub(crate) fn check(r: sys::CUresult, call: &'static str) -> Result<()> {
    if r == sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(Error::Gpu { call, detail: error_name(r) })
    }
}

/// One device's primary context, retained for the life of the process.
#[derive(Debug)]
pub struct Context {
    pub ordinal: u32,
    raw: sys::CUcontext,
}

// SAFETY: a CUcontext handle may be made current on any thread.
unsafe impl Send for Context {}
// SAFETY: as for Send; shared use goes through the same thread-safe handle.
unsafe impl Sync for Context {}

thread_local! {
    static CURRENT: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

impl Context {
    /// Makes this context current on the calling thread (a no-op when it already is).
    pub fn make_current(&self) -> Result<()> {
        if CURRENT.with(|c| c.get()) == self.raw as usize {
            return Ok(());
        }
        // SAFETY: a retained primary context.
        check(unsafe { sys::cuCtxSetCurrent(self.raw) }, "cuCtxSetCurrent")?;
        CURRENT.with(|c| c.set(self.raw as usize));
        Ok(())
    }
}

static CONTEXTS: OnceLock<Mutex<HashMap<u32, &'static Context>>> = OnceLock::new();

/// The primary context of device `ordinal`, retained on first use.
pub fn context(ordinal: u32) -> Result<&'static Context> {
    let d = driver()?;
    if ordinal >= d.device_count {
        return Err(Error::InvalidConfig(format!(
            "CUDA device {ordinal} does not exist ({} device(s) found)",
            d.device_count
        )));
    }
    let mut map = CONTEXTS.get_or_init(Default::default).lock().expect("contexts");
    if let Some(c) = map.get(&ordinal) {
        return Ok(c);
    }
    let mut device = 0;
    let mut raw = std::ptr::null_mut();
    // SAFETY: valid out-pointers; the ordinal was checked against the device count.
    unsafe {
        check(sys::cuDeviceGet(&mut device, ordinal as i32), "cuDeviceGet")?;
        check(sys::cuDevicePrimaryCtxRetain(&mut raw, device), "cuDevicePrimaryCtxRetain")?;
    }
    let c: &'static Context = Box::leak(Box::new(Context { ordinal, raw }));
    map.insert(ordinal, c);
    Ok(c)
}

/// What the driver says about one device.
#[derive(Debug, Clone)]
pub struct DeviceDescription {
    pub ordinal: u32,
    pub name: String,
    pub memory_bytes: u64,
    pub pci_bus_id: String,
    /// Whether a stream can wait on a 32-bit value in memory (the get hand-off needs it).
    pub stream_wait_value: bool,
}

/// Name, memory and PCI address of device `ordinal`.
pub fn describe(ordinal: u32) -> Result<DeviceDescription> {
    driver()?;
    let mut device = 0;
    let mut name = [0 as std::ffi::c_char; 256];
    let mut bus = [0 as std::ffi::c_char; 64];
    let mut bytes = 0usize;
    let mut wait_value = 0;
    // SAFETY: valid out-pointers and lengths.
    unsafe {
        check(sys::cuDeviceGet(&mut device, ordinal as i32), "cuDeviceGet")?;
        check(sys::cuDeviceGetName(name.as_mut_ptr(), name.len() as i32, device), "cuDeviceGetName")?;
        check(sys::cuDeviceTotalMem_v2(&mut bytes, device), "cuDeviceTotalMem")?;
        check(sys::cuDeviceGetPCIBusId(bus.as_mut_ptr(), bus.len() as i32, device), "cuDeviceGetPCIBusId")?;
        // Absent on old drivers: treated as "no".
        let _ = sys::cuDeviceGetAttribute(
            &mut wait_value,
            sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_WAIT_VALUE_NOR,
            device,
        );
    }
    // SAFETY: the driver NUL-terminates both.
    let text = |b: &[std::ffi::c_char]| unsafe { CStr::from_ptr(b.as_ptr()) }.to_string_lossy().into_owned();
    Ok(DeviceDescription {
        ordinal,
        name: text(&name),
        memory_bytes: bytes as u64,
        pci_bus_id: text(&bus),
        // Stream memory operations are on by default since CUDA 11.7; the attribute above only
        // covers the NOR flavour, so any device of a driver >= 11070 counts.
        stream_wait_value: wait_value != 0 || driver()?.version >= 11070,
    })
}

/// Checks that `[ptr, ptr + len)` is device memory of device `ordinal` (catches a host pointer or
/// the wrong device before any I/O is queued).
pub fn check_device_pointer(ptr: DevicePtr, len: usize, ordinal: u32) -> Result<()> {
    let ctx = context(ordinal)?;
    ctx.make_current()?;
    for probe in [ptr, ptr + len.saturating_sub(1) as u64] {
        let mut memory_type: u32 = 0;
        let mut device: i32 = -1;
        // SAFETY: valid out-pointers of the attribute's size.
        unsafe {
            check(
                sys::cuPointerGetAttribute(
                    &mut memory_type as *mut u32 as *mut c_void,
                    sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
                    probe,
                ),
                "cuPointerGetAttribute(MEMORY_TYPE)",
            )
            .map_err(|_| not_device(ptr, ordinal, "not a CUDA allocation"))?;
            check(
                sys::cuPointerGetAttribute(
                    &mut device as *mut i32 as *mut c_void,
                    sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
                    probe,
                ),
                "cuPointerGetAttribute(DEVICE_ORDINAL)",
            )?;
        }
        if memory_type != sys::CUmemorytype::CU_MEMORYTYPE_DEVICE as u32 {
            return Err(not_device(ptr, ordinal, "host or managed memory, not device memory"));
        }
        if device != ordinal as i32 {
            return Err(not_device(ptr, ordinal, &format!("it lives on device {device}")));
        }
    }
    Ok(())
}

fn not_device(ptr: DevicePtr, ordinal: u32, why: &str) -> Error {
    Error::InvalidConfig(format!("pointer {ptr:#x} is not device memory of CUDA device {ordinal}: {why}"))
}

/// A CUDA stream of the engine's own (non-blocking: never ordered after the legacy default stream).
pub struct Stream {
    pub raw: sys::CUstream,
}

// SAFETY: stream handles are thread-safe in the driver API.
unsafe impl Send for Stream {}
// SAFETY: as for Send; shared use goes through the same thread-safe handle.
unsafe impl Sync for Stream {}

impl Stream {
    pub fn new(ctx: &Context) -> Result<Stream> {
        ctx.make_current()?;
        let mut raw = std::ptr::null_mut();
        check(
            // SAFETY: valid out-pointer.
            unsafe { sys::cuStreamCreate(&mut raw, sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32) },
            "cuStreamCreate",
        )?;
        Ok(Stream { raw })
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        // SAFETY: created in `new`; the engine synchronizes its work before dropping.
        unsafe { sys::cuStreamDestroy_v2(self.raw) };
    }
}

/// An event that a waiting thread can sleep on (blocking sync: no spinning core).
pub struct Event {
    pub raw: sys::CUevent,
}

// SAFETY: event handles are thread-safe in the driver API.
unsafe impl Send for Event {}
// SAFETY: as for Send; shared use goes through the same thread-safe handle.
unsafe impl Sync for Event {}

impl Event {
    pub fn new(ctx: &Context) -> Result<Event> {
        ctx.make_current()?;
        let mut raw = std::ptr::null_mut();
        let flags =
            sys::CUevent_flags::CU_EVENT_BLOCKING_SYNC as u32 | sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32;
        // SAFETY: valid out-pointer.
        check(unsafe { sys::cuEventCreate(&mut raw, flags) }, "cuEventCreate")?;
        Ok(Event { raw })
    }

    pub fn record(&self, stream: &Stream) -> Result<()> {
        // SAFETY: both handles live.
        check(unsafe { sys::cuEventRecord(self.raw, stream.raw) }, "cuEventRecord")
    }

    pub fn synchronize(&self) -> Result<()> {
        // SAFETY: a live event.
        check(unsafe { sys::cuEventSynchronize(self.raw) }, "cuEventSynchronize")
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        // SAFETY: created in `new`.
        unsafe { sys::cuEventDestroy_v2(self.raw) };
    }
}

/// Page-locks existing host memory for every context (`cuMemHostRegister`, portable and mapped),
/// so that copies from and to it are true DMA and run asynchronously. Unregistered on drop.
///
/// NOTE: the memory must outlive the registration; register anonymous (mmap'd) memory, which
/// io_uring can also register as fixed buffers (memory from cuMemHostAlloc cannot be, on some
/// kernels).
pub struct PinnedRegistration {
    ptr: *mut u8,
    pub len: usize,
}

// SAFETY: only the address is kept.
unsafe impl Send for PinnedRegistration {}
// SAFETY: as for Send; shared use goes through the same thread-safe handle.
unsafe impl Sync for PinnedRegistration {}

impl PinnedRegistration {
    /// # Safety
    /// `[ptr, ptr + len)` must be host memory that outlives the returned value.
    pub unsafe fn new(ctx: &Context, ptr: *mut u8, len: usize) -> Result<PinnedRegistration> {
        ctx.make_current()?;
        let flags = sys::CU_MEMHOSTREGISTER_PORTABLE | sys::CU_MEMHOSTREGISTER_DEVICEMAP;
        // SAFETY: forwarded contract.
        check(unsafe { sys::cuMemHostRegister_v2(ptr as *mut c_void, len, flags) }, "cuMemHostRegister")?;
        Ok(PinnedRegistration { ptr, len })
    }

    /// The device address of a host byte inside the registration (mapped memory).
    pub fn device_address(&self, ctx: &Context, host: *mut u8) -> Result<DevicePtr> {
        debug_assert!(host as usize >= self.ptr as usize && (host as usize) < self.ptr as usize + self.len);
        ctx.make_current()?;
        let mut d: DevicePtr = 0;
        check(
            // SAFETY: `host` lies in registered, mapped memory.
            unsafe { sys::cuMemHostGetDevicePointer_v2(&mut d, host as *mut c_void, 0) },
            "cuMemHostGetDevicePointer",
        )?;
        Ok(d)
    }
}

impl Drop for PinnedRegistration {
    fn drop(&mut self) {
        // SAFETY: registered in `new`.
        unsafe { sys::cuMemHostUnregister(self.ptr as *mut c_void) };
    }
}

/// Enqueues an asynchronous copy host -> device on `stream`.
///
/// # Safety
/// Both ranges must stay valid until the copy has finished on the stream.
pub unsafe fn copy_to_device_async(dst: DevicePtr, src: *const u8, len: usize, stream: &Stream) -> Result<()> {
    // SAFETY: forwarded contract.
    check(unsafe { sys::cuMemcpyHtoDAsync_v2(dst, src as *const c_void, len, stream.raw) }, "cuMemcpyHtoDAsync")
}

/// Enqueues an asynchronous copy device -> host on `stream`.
///
/// # Safety
/// Both ranges must stay valid until the copy has finished on the stream.
pub unsafe fn copy_to_host_async(dst: *mut u8, src: DevicePtr, len: usize, stream: &Stream) -> Result<()> {
    // SAFETY: forwarded contract.
    check(unsafe { sys::cuMemcpyDtoHAsync_v2(dst as *mut c_void, src, len, stream.raw) }, "cuMemcpyDtoHAsync")
}

/// Makes `stream` (a caller's CUstream) wait until the 32-bit word at device address `addr` is at
/// least `value`. Nothing blocks on the host.
///
/// # Safety
/// `stream` must be a live stream of the current context; `addr` must stay mapped until the
/// stream has passed the wait.
pub unsafe fn stream_wait_value_geq(stream: sys::CUstream, addr: DevicePtr, value: u32) -> Result<()> {
    // SAFETY: forwarded contract.
    check(
        unsafe {
            sys::cuStreamWaitValue32_v2(
                stream,
                addr,
                value,
                sys::CUstreamWaitValue_flags::CU_STREAM_WAIT_VALUE_GEQ as u32,
            )
        },
        "cuStreamWaitValue32",
    )
}
