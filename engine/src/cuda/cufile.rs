//! libcufile, loaded at run time with our own minimal declarations. cudarc has cuFile bindings, but
//! its loader only tries sonames such as `libcufile.so` and `libcufile.so.12`, while the library of
//! CUDA 13 and of the `nvidia-cufile` wheel is `libcufile.so.0`; we try that, the usual names, and
//! the path in `TERAIO_CUFILE_LIB`.
//!
//! The driver is opened once per process (`cuFileDriverOpen`) and never closed: cuFile forbids
//! re-opening in some versions, and the engine's handles may be used until exit.

use crate::error::{Error, Result};
use libloading::Library;
use std::collections::BTreeMap;
use std::ffi::{c_int, c_void};
use std::sync::{Mutex, OnceLock};

/// GPU buffers registered with cuFile (base address -> bytes): an I/O into one is issued as
/// (base, offset), the form under which cuFile uses the registration instead of its own bounce
/// buffers.
static REGISTERED: Mutex<BTreeMap<u64, usize>> = Mutex::new(BTreeMap::new());

/// The registered buffer holding `[ptr, ptr + len)`, as (base, offset of ptr in it).
fn registered_base(ptr: u64, len: usize) -> Option<(u64, u64)> {
    let map = REGISTERED.lock().expect("cufile registrations");
    let (&base, &bytes) = map.range(..=ptr).next_back()?;
    (ptr + len as u64 <= base + bytes as u64).then_some((base, ptr - base))
}

/// `CUfileError_t`: a cuFile status and, for `CU_FILE_CUDA_DRIVER_ERROR`, the CUDA result.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct CuFileStatus {
    pub err: c_int,
    pub cu_err: c_int,
}

#[repr(C)]
union DescrHandle {
    fd: c_int,
    handle: *mut c_void,
}

/// `CUfileDescr_t`.
#[repr(C)]
struct Descr {
    kind: c_int,
    handle: DescrHandle,
    fs_ops: *const c_void,
}

const CU_FILE_HANDLE_TYPE_OPAQUE_FD: c_int = 1;

/// An opaque `CUfileHandle_t`.
pub type RawHandle = *mut c_void;

type DriverOpen = unsafe extern "C" fn() -> CuFileStatus;
type HandleRegister = unsafe extern "C" fn(*mut RawHandle, *mut Descr) -> CuFileStatus;
type HandleDeregister = unsafe extern "C" fn(RawHandle);
type BufRegister = unsafe extern "C" fn(*const c_void, usize, c_int) -> CuFileStatus;
type BufDeregister = unsafe extern "C" fn(*const c_void) -> CuFileStatus;
type ReadFn = unsafe extern "C" fn(RawHandle, *mut c_void, usize, i64, i64) -> isize;
type WriteFn = unsafe extern "C" fn(RawHandle, *const c_void, usize, i64, i64) -> isize;
type GetVersion = unsafe extern "C" fn(*mut c_int) -> CuFileStatus;

/// The loaded library and its opened driver.
pub struct CuFile {
    /// Which file was loaded.
    pub library: String,
    /// `cuFileGetVersion` (e.g. 1150 for 1.15.0), where the library has it.
    pub version: Option<i32>,
    handle_register: HandleRegister,
    handle_deregister: HandleDeregister,
    buf_register: BufRegister,
    buf_deregister: BufDeregister,
    read: ReadFn,
    write: WriteFn,
    _lib: Library,
}

static CUFILE: OnceLock<std::result::Result<CuFile, String>> = OnceLock::new();

/// Names `load` tries, in order.
pub fn candidates() -> Vec<String> {
    let mut v = Vec::new();
    if let Ok(p) = std::env::var("TERAIO_CUFILE_LIB") {
        v.push(p);
    }
    v.extend(
        ["libcufile.so.0", "libcufile.so", "libcufile.so.1", "libcufile.so.13", "libcufile.so.12"].map(String::from),
    );
    v
}

/// `CU_FILE_*` name of a cuFile status code.
pub fn status_name(code: i32) -> String {
    let name = match code {
        0 => "CU_FILE_SUCCESS",
        5001 => "CU_FILE_DRIVER_NOT_INITIALIZED",
        5002 => "CU_FILE_DRIVER_INVALID_PROPS",
        5003 => "CU_FILE_DRIVER_UNSUPPORTED_LIMIT",
        5004 => "CU_FILE_DRIVER_VERSION_MISMATCH",
        5005 => "CU_FILE_DRIVER_VERSION_READ_ERROR",
        5006 => "CU_FILE_DRIVER_CLOSING",
        5007 => "CU_FILE_PLATFORM_NOT_SUPPORTED",
        5008 => "CU_FILE_IO_NOT_SUPPORTED",
        5009 => "CU_FILE_DEVICE_NOT_SUPPORTED",
        5010 => "CU_FILE_NVFS_DRIVER_ERROR",
        5011 => "CU_FILE_CUDA_DRIVER_ERROR",
        5012 => "CU_FILE_CUDA_POINTER_INVALID",
        5013 => "CU_FILE_CUDA_MEMORY_TYPE_INVALID",
        5014 => "CU_FILE_CUDA_POINTER_RANGE_ERROR",
        5015 => "CU_FILE_CUDA_CONTEXT_MISMATCH",
        5018 => "CU_FILE_INVALID_FILE_TYPE",
        5019 => "CU_FILE_INVALID_FILE_OPEN_FLAG",
        5020 => "CU_FILE_DIO_NOT_SET",
        5022 => "CU_FILE_INVALID_VALUE",
        5023 => "CU_FILE_MEMORY_ALREADY_REGISTERED",
        5024 => "CU_FILE_MEMORY_NOT_REGISTERED",
        5025 => "CU_FILE_PERMISSION_DENIED",
        5026 => "CU_FILE_DRIVER_ALREADY_OPEN",
        5027 => "CU_FILE_HANDLE_NOT_REGISTERED",
        5028 => "CU_FILE_HANDLE_ALREADY_REGISTERED",
        5029 => "CU_FILE_DEVICE_NOT_FOUND",
        5030 => "CU_FILE_INTERNAL_ERROR",
        5031 => "CU_FILE_GETNEWFD_FAILED",
        5033 => "CU_FILE_NVFS_SETUP_ERROR",
        5034 => "CU_FILE_IO_DISABLED",
        _ => return format!("cuFile status {code}"),
    };
    name.into()
}

fn status_result(s: CuFileStatus, call: &'static str) -> Result<()> {
    match s.err {
        0 => Ok(()),
        5011 => Err(Error::Gpu { call, detail: format!("CU_FILE_CUDA_DRIVER_ERROR (CUDA result {})", s.cu_err) }),
        code => Err(Error::Gpu { call, detail: status_name(code) }),
    }
}

fn load() -> std::result::Result<CuFile, String> {
    let mut tried = Vec::new();
    for name in candidates() {
        // SAFETY: loading libcufile runs its initialisers, which only set up the library.
        match unsafe { Library::new(&name) } {
            Ok(lib) => return open(lib, name),
            Err(e) => tried.push(format!("{name}: {e}")),
        }
    }
    Err(format!("libcufile not loadable (tried {}); set TERAIO_CUFILE_LIB to its path", tried.join("; ")))
}

fn open(lib: Library, name: String) -> std::result::Result<CuFile, String> {
    // SAFETY: symbol types match the cuFile C API (cufile.h).
    unsafe {
        fn sym<T: Copy>(lib: &Library, name: &str) -> std::result::Result<T, String> {
            // SAFETY: caller states the type.
            unsafe { lib.get::<T>(name.as_bytes()) }.map(|s| *s).map_err(|e| format!("libcufile lacks {name}: {e}"))
        }
        let driver_open: DriverOpen = sym(&lib, "cuFileDriverOpen")?;
        let version = sym::<GetVersion>(&lib, "cuFileGetVersion").ok().and_then(|f| {
            let mut v = 0;
            (f(&mut v).err == 0).then_some(v)
        });
        let s = driver_open();
        if s.err != 0 && s.err != 5026 {
            return Err(format!("cuFileDriverOpen failed: {}", status_name(s.err)));
        }
        Ok(CuFile {
            library: name,
            version,
            handle_register: sym(&lib, "cuFileHandleRegister")?,
            handle_deregister: sym(&lib, "cuFileHandleDeregister")?,
            buf_register: sym(&lib, "cuFileBufRegister")?,
            buf_deregister: sym(&lib, "cuFileBufDeregister")?,
            read: sym(&lib, "cuFileRead")?,
            write: sym(&lib, "cuFileWrite")?,
            _lib: lib,
        })
    }
}

/// The library with its driver open, or why not (`BackendUnavailable { backend: "cufile" }`).
/// The CUDA driver must be loadable first.
pub fn cufile() -> Result<&'static CuFile> {
    super::driver::driver()?;
    match CUFILE.get_or_init(load) {
        Ok(c) => Ok(c),
        Err(reason) => Err(Error::BackendUnavailable { backend: "cufile", reason: reason.clone() }),
    }
}

/// A file registered with cuFile once; deregistered on drop.
pub struct FileHandle {
    lib: &'static CuFile,
    raw: RawHandle,
}

// SAFETY: cuFile handles may be used from any thread ("all APIs are thread-safe").
unsafe impl Send for FileHandle {}
// SAFETY: as for Send; shared use goes through the same thread-safe handle.
unsafe impl Sync for FileHandle {}

impl CuFile {
    /// Registers an open (O_DIRECT for GDS) file descriptor.
    pub fn register_file(&'static self, fd: i32) -> Result<FileHandle> {
        let mut descr =
            Descr { kind: CU_FILE_HANDLE_TYPE_OPAQUE_FD, handle: DescrHandle { fd }, fs_ops: std::ptr::null() };
        let mut raw: RawHandle = std::ptr::null_mut();
        // SAFETY: valid descriptor and out-pointer.
        status_result(unsafe { (self.handle_register)(&mut raw, &mut descr) }, "cuFileHandleRegister")?;
        Ok(FileHandle { lib: self, raw })
    }

    /// Registers a GPU buffer for direct I/O (pins its BAR1 mapping once instead of per I/O).
    ///
    /// # Safety
    /// `[ptr, ptr + len)` must be a device allocation that outlives the registration.
    pub unsafe fn register_buffer(&self, ptr: u64, len: usize) -> Result<()> {
        // SAFETY: forwarded contract.
        status_result(unsafe { (self.buf_register)(ptr as *const c_void, len, 0) }, "cuFileBufRegister")?;
        REGISTERED.lock().expect("cufile registrations").insert(ptr, len);
        Ok(())
    }

    /// # Safety
    /// `ptr` must have been registered with `register_buffer`.
    pub unsafe fn deregister_buffer(&self, ptr: u64) -> Result<()> {
        REGISTERED.lock().expect("cufile registrations").remove(&ptr);
        // SAFETY: forwarded contract.
        status_result(unsafe { (self.buf_deregister)(ptr as *const c_void) }, "cuFileBufDeregister")
    }
}

/// What a cuFile read or write returned, as a byte count or an error message.
fn io_result(n: isize, call: &'static str) -> std::result::Result<usize, (i32, String)> {
    if n >= 0 {
        Ok(n as usize)
    } else if n == -1 {
        let e = std::io::Error::last_os_error();
        Err((e.raw_os_error().unwrap_or(libc::EIO), format!("{call}: {e}")))
    } else {
        Err((libc::EIO, format!("{call}: {}", status_name((-n) as i32))))
    }
}

impl FileHandle {
    /// Reads `len` bytes at file `offset` into device (or registered host) memory at `buf`.
    ///
    /// # Safety
    /// `buf` must be valid for `len` bytes.
    pub unsafe fn read(&self, buf: u64, len: usize, offset: u64) -> std::result::Result<usize, (i32, String)> {
        let (base, at) = registered_base(buf, len).unwrap_or((buf, 0));
        // SAFETY: forwarded contract.
        io_result(
            unsafe { (self.lib.read)(self.raw, base as *mut c_void, len, offset as i64, at as i64) },
            "cuFileRead",
        )
    }

    /// Writes `len` bytes from device (or registered host) memory at `buf` to file `offset`.
    ///
    /// # Safety
    /// `buf` must be valid for `len` bytes.
    pub unsafe fn write(&self, buf: u64, len: usize, offset: u64) -> std::result::Result<usize, (i32, String)> {
        let (base, at) = registered_base(buf, len).unwrap_or((buf, 0));
        // SAFETY: forwarded contract.
        io_result(
            unsafe { (self.lib.write)(self.raw, base as *const c_void, len, offset as i64, at as i64) },
            "cuFileWrite",
        )
    }
}

impl Drop for FileHandle {
    fn drop(&mut self) {
        // SAFETY: registered in `register_file`; no I/O is in flight (the queue has stopped).
        unsafe { (self.lib.handle_deregister)(self.raw) };
    }
}
