//! The C ABI of teraio: `libteraio.so` / `libteraio.a` and the header `include/teraio.h`
//! (generated from this crate by cbindgen; `tests/header.rs` fails if it is stale).
//!
//! Design, in short:
//! - Opaque handles only (`teraio_store *`, `teraio_ticket *`). They are numbers looked up in a
//!   table ([`registry`]), so a NULL, stale or made-up handle gives `TERAIO_ERR_BAD_HANDLE`,
//!   not undefined behaviour.
//! - Every function returns a `teraio_status` and runs inside [`status::guard`], which records
//!   the calling thread's last error message and catches panics (`TERAIO_ERR_PANIC`).
//! - Closing and freeing are two steps: `teraio_close` shuts the store down and reports how
//!   that went, after which calls on the handle give `TERAIO_ERR_CLOSED`; `teraio_store_free`
//!   releases the handle (closing first if needed).
//! - Host memory only for now. Device (GPU) pointers will come as separate functions once the
//!   engine has GPU paths; the host functions will keep their meaning.
//! - The lifetime planner on JSON text ([`plan`]): `teraio_plan_json`, the planner's
//!   `plan_and_predict`, as `teraio plan --json` and Python's `teraio.plan` run it.

pub mod plan;
pub mod registry;
pub mod status;
pub mod types;

use std::ffi::{c_char, c_void, CStr};
use std::os::unix::ffi::OsStrExt;
use std::path::PathBuf;
use std::ptr::NonNull;
use std::sync::{RwLock, RwLockReadGuard};
use std::time::Duration;

use teraio_engine::cuda::DeviceSlice;
use teraio_engine::{BackendKind, Error, FormatConfig, OpenConfig, Priority, Store, Ticket};

use registry::Registry;
pub use status::teraio_status;
use status::teraio_status::*;
use status::{guard, Failure};
pub use types::*;

/// Version of this C API. Raised when a function or struct changes incompatibly; appending
/// fields to a versioned struct or adding functions does not raise it.
pub const TERAIO_ABI_VERSION: u32 = 1;

/// An open (or closed, not yet freed) store. Opaque: never dereference it.
#[allow(non_camel_case_types)]
pub struct teraio_store {
    _opaque: [u8; 0],
}

/// One asynchronous put or get in flight. Opaque: never dereference it.
#[allow(non_camel_case_types)]
pub struct teraio_ticket {
    _opaque: [u8; 0],
}

/// What a store handle stands for: the engine store until `teraio_close` takes it out.
struct StoreEntry {
    store: RwLock<Option<Store>>,
}

/// What a ticket handle stands for.
struct TicketEntry {
    ticket: Ticket<()>,
}

static STORES: Registry<StoreEntry> = Registry::new();
static TICKETS: Registry<TicketEntry> = Registry::new();

/// An `INVALID_ARGUMENT` failure.
fn invalid(message: impl Into<String>) -> Failure {
    Failure::new(TERAIO_ERR_INVALID_ARGUMENT, message)
}

/// Runs `f` on the open store behind `handle`, holding it open (a concurrent `teraio_close`
/// waits for `f`).
fn with_store<R>(handle: *const teraio_store, f: impl FnOnce(&Store) -> Result<R, Failure>) -> Result<R, Failure> {
    let entry =
        STORES.get(handle as usize).ok_or_else(|| Failure::new(TERAIO_ERR_BAD_HANDLE, bad_handle("store", handle)))?;
    let guard: RwLockReadGuard<'_, Option<Store>> = entry.store.read().unwrap_or_else(|p| p.into_inner());
    match guard.as_ref() {
        Some(store) => f(store),
        None => Err(Failure::new(TERAIO_ERR_CLOSED, "the store is closed; only teraio_store_free may be called on it")),
    }
}

/// Why a handle was refused, for the last-error message.
fn bad_handle<T>(kind: &str, handle: *const T) -> String {
    if handle.is_null() {
        format!("the {kind} handle is NULL")
    } else {
        format!("{handle:p} is not a live teraio {kind} handle (never issued, or already freed)")
    }
}

/// Writes `value` through an optional out-pointer.
///
/// # Safety
/// `out` must be NULL or valid for a write of `T`.
unsafe fn set_out<T>(out: *mut T, value: T) {
    if !out.is_null() {
        // SAFETY: caller contract.
        unsafe { out.write(value) };
    }
}

/// The engine priority for a `TERAIO_PRIORITY_*` value.
fn priority_of(priority: teraio_priority) -> Result<Priority, Failure> {
    match priority {
        TERAIO_PRIORITY_NORMAL => Ok(Priority::Normal),
        TERAIO_PRIORITY_URGENT => Ok(Priority::Urgent),
        other => Err(invalid(format!("priority {other} is not a TERAIO_PRIORITY_* value"))),
    }
}

/// A readable byte slice from a C pointer and length; NULL is allowed only with length 0.
///
/// # Safety
/// If non-NULL, `ptr` must be valid for reads of `len` bytes for `'a`.
unsafe fn bytes<'a>(ptr: *const c_void, len: usize, what: &str) -> Result<&'a [u8], Failure> {
    if len == 0 {
        return Ok(&[]);
    }
    if ptr.is_null() {
        return Err(invalid(format!("{what} is NULL but its length is {len}")));
    }
    // SAFETY: caller contract.
    Ok(unsafe { std::slice::from_raw_parts(ptr.cast::<u8>(), len) })
}

/// A data pointer for the engine: NULL is allowed only with length 0 (then a dangling,
/// never-accessed pointer stands in).
fn data_ptr(ptr: *const c_void, len: usize, what: &str) -> Result<*mut u8, Failure> {
    if ptr.is_null() {
        if len != 0 {
            return Err(invalid(format!("{what} is NULL but its length is {len}")));
        }
        return Ok(NonNull::<u8>::dangling().as_ptr());
    }
    Ok(ptr as *mut u8)
}

/// Refuses a NULL required out-pointer.
fn require_out<T>(out: *mut T, what: &str) -> Result<(), Failure> {
    if out.is_null() {
        return Err(invalid(format!("{what} is NULL")));
    }
    Ok(())
}

/// Device paths from a C array of `count` NUL-terminated strings (any bytes, no UTF-8 needed).
///
/// # Safety
/// `paths` must be NULL or point to `count` pointers, each NULL or a NUL-terminated string.
unsafe fn device_paths(paths: *const *const c_char, count: usize) -> Result<Vec<PathBuf>, Failure> {
    if count == 0 {
        return Err(invalid("no device paths given (path_count is 0)"));
    }
    if paths.is_null() {
        return Err(invalid("paths is NULL"));
    }
    // SAFETY: caller contract.
    let pointers = unsafe { std::slice::from_raw_parts(paths, count) };
    pointers
        .iter()
        .enumerate()
        .map(|(i, &p)| {
            if p.is_null() {
                return Err(invalid(format!("paths[{i}] is NULL")));
            }
            // SAFETY: caller contract.
            let bytes = unsafe { CStr::from_ptr(p) }.to_bytes();
            Ok(PathBuf::from(std::ffi::OsStr::from_bytes(bytes)))
        })
        .collect()
}

/// `FormatConfig::default()` as the C struct (what `teraio_format_options_init` writes).
fn default_format_options() -> teraio_format_options {
    let d = FormatConfig::default();
    teraio_format_options {
        struct_size: std::mem::size_of::<teraio_format_options>() as u64,
        stripe_unit_bytes: d.stripe_unit_bytes,
        block_size: d.block_size,
        max_meta_bytes: d.max_meta_bytes,
        create_file_bytes: d.create_file_bytes.unwrap_or(0),
        checkpoint_slot_bytes: d.checkpoint_slot_bytes.unwrap_or(0),
        journal_bytes: d.journal_bytes.unwrap_or(0),
        checksums: d.checksums as u32,
        force: d.force as u32,
    }
}

/// `OpenConfig::default()` as the C struct (what `teraio_open_options_init` writes).
fn default_open_options() -> teraio_open_options {
    let d = OpenConfig::default();
    teraio_open_options {
        struct_size: std::mem::size_of::<teraio_open_options>() as u64,
        max_io_bytes: d.max_io_bytes,
        max_inflight_bytes: d.max_inflight_bytes,
        bounce_pool_bytes: d.bounce_pool_bytes,
        backend: TERAIO_BACKEND_AUTO,
        queue_depth: d.queue_depth as u32,
        direct_io: d.direct_io as u32,
        durable: d.durable as u32,
        verify_checksums: d.verify_checksums as u32,
        lock_wait_ms: d.lock_wait_ms.min(u32::MAX as u64) as u32,
    }
}

/// The engine's format configuration from the C struct (0 means "default" for the optional sizes).
fn format_config(o: &teraio_format_options) -> FormatConfig {
    let some = |v: u64| (v != 0).then_some(v);
    FormatConfig {
        stripe_unit_bytes: o.stripe_unit_bytes,
        block_size: o.block_size,
        checksums: o.checksums != 0,
        max_meta_bytes: o.max_meta_bytes,
        checkpoint_slot_bytes: some(o.checkpoint_slot_bytes),
        journal_bytes: some(o.journal_bytes),
        create_file_bytes: some(o.create_file_bytes),
        force: o.force != 0,
        // The C API formats with O_DIRECT (its stores live on disk file systems or devices).
        direct_io: true,
    }
}

/// The engine's open configuration from the C struct; fields the C API does not expose keep
/// their defaults.
fn open_config(o: &teraio_open_options) -> Result<OpenConfig, Failure> {
    let backend = match o.backend {
        TERAIO_BACKEND_AUTO => BackendKind::Auto,
        TERAIO_BACKEND_IO_URING => BackendKind::IoUring,
        TERAIO_BACKEND_PSYNC => BackendKind::Psync,
        other => return Err(invalid(format!("backend {other} is not a TERAIO_BACKEND_* value"))),
    };
    Ok(OpenConfig {
        backend,
        queue_depth: o.queue_depth as usize,
        direct_io: o.direct_io != 0,
        max_io_bytes: o.max_io_bytes,
        max_inflight_bytes: o.max_inflight_bytes,
        bounce_pool_bytes: o.bounce_pool_bytes,
        verify_checksums: o.verify_checksums != 0,
        durable: o.durable != 0,
        lock_wait_ms: o.lock_wait_ms as u64,
        ..OpenConfig::default()
    })
}

/// Registers an opened store and writes its handle to `out`.
///
/// # Safety
/// `out` must be valid for a write of a pointer.
unsafe fn hand_out_store(store: Store, out: *mut *mut teraio_store) {
    let handle = STORES.insert(StoreEntry { store: RwLock::new(Some(store)) });
    // SAFETY: caller contract.
    unsafe { out.write(handle as *mut teraio_store) };
}

/// Registers a ticket and writes its handle to `out`.
///
/// # Safety
/// `out` must be valid for a write of a pointer.
unsafe fn hand_out_ticket(ticket: Ticket<()>, out: *mut *mut teraio_ticket) {
    let handle = TICKETS.insert(TicketEntry { ticket });
    // SAFETY: caller contract.
    unsafe { out.write(handle as *mut teraio_ticket) };
}

// ------------------------------------------------------------------------------------------------
// Version and errors
// ------------------------------------------------------------------------------------------------

/// The library's version, e.g. `"0.1.0"`.
///
/// Ownership: a static string; do not free it. Threads: safe from any thread.
#[no_mangle]
pub extern "C" fn teraio_version() -> *const c_char {
    concat!(env!("CARGO_PKG_VERSION"), "\0").as_ptr().cast()
}

/// The C API version the library implements (`TERAIO_ABI_VERSION` of its own header). A program
/// should check that it equals the `TERAIO_ABI_VERSION` it was compiled with.
///
/// Threads: safe from any thread.
#[no_mangle]
pub extern "C" fn teraio_abi_version() -> u32 {
    TERAIO_ABI_VERSION
}

/// The message of the calling thread's most recent failed teraio call (what went wrong and
/// what to do about it), or `""` if none failed yet. Successful calls leave it as it was.
///
/// Ownership: owned by the library; valid until the calling thread's next teraio call. Copy it
/// to keep it. Threads: each thread has its own last error.
#[no_mangle]
pub extern "C" fn teraio_last_error_message() -> *const c_char {
    status::last_message_ptr()
}

/// The errno behind the calling thread's most recent failed teraio call (e.g. `EIO`,
/// `ENOSPC`, `ENOENT`), or 0 if there was none.
///
/// Threads: each thread has its own last error.
#[no_mangle]
pub extern "C" fn teraio_last_error_os_code() -> i32 {
    status::last_os_code()
}

/// The constant name of a status, e.g. `"TERAIO_ERR_NOT_FOUND"`; `"TERAIO_UNKNOWN_STATUS"` for
/// a value this library does not know.
///
/// Ownership: a static string; do not free it. Threads: safe from any thread.
#[no_mangle]
pub extern "C" fn teraio_status_name(status: i32) -> *const c_char {
    status::status_name(status).as_ptr().cast()
}

// ------------------------------------------------------------------------------------------------
// Options
// ------------------------------------------------------------------------------------------------

/// Fills `*options` with the defaults and sets `options->struct_size`. Call it before changing
/// fields, so that a later library with more fields knows which ones you set.
///
/// Errors: `TERAIO_ERR_INVALID_ARGUMENT` if `options` is NULL.
/// Ownership: `options` is the caller's. Threads: safe from any thread.
///
/// # Safety
/// `options` must be NULL or valid for writes of `sizeof(teraio_format_options)` bytes.
#[no_mangle]
pub unsafe extern "C" fn teraio_format_options_init(options: *mut teraio_format_options) -> teraio_status {
    guard(|| {
        require_out(options, "options")?;
        // SAFETY: caller contract.
        unsafe { options.write_unaligned(default_format_options()) };
        Ok(())
    })
}

/// Fills `*options` with the defaults and sets `options->struct_size`. Call it before changing
/// fields.
///
/// Errors: `TERAIO_ERR_INVALID_ARGUMENT` if `options` is NULL.
/// Ownership: `options` is the caller's. Threads: safe from any thread.
///
/// # Safety
/// `options` must be NULL or valid for writes of `sizeof(teraio_open_options)` bytes.
#[no_mangle]
pub unsafe extern "C" fn teraio_open_options_init(options: *mut teraio_open_options) -> teraio_status {
    guard(|| {
        require_out(options, "options")?;
        // SAFETY: caller contract.
        unsafe { options.write_unaligned(default_open_options()) };
        Ok(())
    })
}

// ------------------------------------------------------------------------------------------------
// Store lifecycle
// ------------------------------------------------------------------------------------------------

/// Formats the devices at `paths[0..path_count]` as one new, empty store and opens it.
/// `format` and `open` may be NULL for the defaults. Formatting erases what the devices held.
///
/// On success `*out_store` is a new handle; on failure it is left unchanged.
/// Errors: `INVALID_ARGUMENT` (NULL/empty paths, bad options), `BAD_DEVICES` (a device too
/// small, or holding a store without `force`), `IO`, `LOCKED`, `UNSUPPORTED`.
/// Ownership: the paths and options are only read during the call. The caller owns the new
/// handle and must release it with `teraio_store_free`.
/// Threads: safe from any thread; a store's devices can be open in only one handle at a time.
///
/// # Safety
/// `paths` must point to `path_count` NUL-terminated strings; `format` and `open` must be NULL
/// or filled by their `_init` function; `out_store` must be valid for a write.
#[no_mangle]
pub unsafe extern "C" fn teraio_create(
    paths: *const *const c_char,
    path_count: usize,
    format: *const teraio_format_options,
    open: *const teraio_open_options,
    out_store: *mut *mut teraio_store,
) -> teraio_status {
    guard(|| {
        require_out(out_store, "out_store")?;
        // SAFETY: caller contract for each pointer.
        let paths = unsafe { device_paths(paths, path_count)? };
        let format =
            unsafe { types::read_versioned(format, "teraio_format_options")? }.unwrap_or_else(default_format_options);
        let open = unsafe { types::read_versioned(open, "teraio_open_options")? }.unwrap_or_else(default_open_options);
        let store = Store::create(&paths, &format_config(&format), open_config(&open)?)?;
        // SAFETY: checked non-NULL; caller contract.
        unsafe { hand_out_store(store, out_store) };
        Ok(())
    })
}

/// `teraio_open` and `teraio_open_read_only`: the same arguments, checked the same way, and the
/// engine's writer or reader open.
///
/// # Safety
/// As `teraio_create`.
unsafe fn open_existing(
    paths: *const *const c_char,
    path_count: usize,
    options: *const teraio_open_options,
    out_store: *mut *mut teraio_store,
    open: fn(&[PathBuf], OpenConfig) -> Result<Store, Error>,
) -> teraio_status {
    guard(|| {
        require_out(out_store, "out_store")?;
        // SAFETY: caller contract for each pointer.
        let paths = unsafe { device_paths(paths, path_count)? };
        let options =
            unsafe { types::read_versioned(options, "teraio_open_options")? }.unwrap_or_else(default_open_options);
        let store = open(&paths, open_config(&options)?)?;
        // SAFETY: checked non-NULL; caller contract.
        unsafe { hand_out_store(store, out_store) };
        Ok(())
    })
}

/// Opens the existing store whose devices are `paths[0..path_count]` (all of them, in any
/// order). `options` may be NULL for the defaults.
///
/// On success `*out_store` is a new handle; on failure it is left unchanged.
/// Errors: `INVALID_ARGUMENT`, `BAD_DEVICES` (not a teraio store, missing or foreign
/// devices), `CORRUPT`, `IO`, `LOCKED` (open elsewhere), `UNSUPPORTED`.
/// Ownership: as `teraio_create`. Threads: as `teraio_create`.
///
/// # Safety
/// As `teraio_create`.
#[no_mangle]
pub unsafe extern "C" fn teraio_open(
    paths: *const *const c_char,
    path_count: usize,
    options: *const teraio_open_options,
    out_store: *mut *mut teraio_store,
) -> teraio_status {
    // SAFETY: the caller's contract, passed on.
    unsafe { open_existing(paths, path_count, options, out_store, Store::open) }
}

/// Opens the existing store whose devices are `paths[0..path_count]` read-only: beside a writer
/// that may hold it (under a shared lock), writing and repairing nothing. Gets, `teraio_stat`,
/// `teraio_get_meta` and `teraio_get_stats` work; `teraio_put`, `teraio_delete` and their async
/// forms fail with `INVALID_ARGUMENT` and a message saying the store is read-only. Of a store a
/// writer is changing, the handle sees the objects as they were at one moment during the open.
/// `options` may be NULL for the defaults (`durable` means nothing here).
///
/// On success `*out_store` is a new handle; on failure it is left unchanged.
/// Errors: as `teraio_open` (`LOCKED` only while a format holds the devices).
/// Ownership: as `teraio_create`. Threads: as `teraio_create`; any number of read-only handles
/// may be open on one store at once.
///
/// # Safety
/// As `teraio_create`.
#[no_mangle]
pub unsafe extern "C" fn teraio_open_read_only(
    paths: *const *const c_char,
    path_count: usize,
    options: *const teraio_open_options,
    out_store: *mut *mut teraio_store,
) -> teraio_status {
    // SAFETY: the caller's contract, passed on.
    unsafe { open_existing(paths, path_count, options, out_store, Store::open_read_only) }
}

/// Closes the store: waits for every put and get in flight, writes a final checkpoint, stops
/// the engine's threads and releases the devices (another open may then take them). The
/// status says whether that went cleanly.
///
/// The handle stays valid: later calls on it return `TERAIO_ERR_CLOSED` (a second close too)
/// until `teraio_store_free`. Tickets issued before the close are finished by it and must still
/// be waited on.
/// Errors: `BAD_HANDLE`, `CLOSED`, `IO` (the final checkpoint failed).
/// Threads: safe to call while other threads use the store: it waits for calls already inside
/// the store to hand their work over, and later calls see `CLOSED`.
///
/// # Safety
/// None beyond passing a handle (any value is checked).
#[no_mangle]
pub unsafe extern "C" fn teraio_close(store: *mut teraio_store) -> teraio_status {
    guard(|| {
        let entry = STORES
            .get(store as usize)
            .ok_or_else(|| Failure::new(TERAIO_ERR_BAD_HANDLE, bad_handle("store", store)))?;
        close_entry(&entry, true)
    })
}

/// Takes the store out of its entry and closes it; an already closed entry is `CLOSED` for
/// `teraio_close` and fine for `teraio_store_free`.
fn close_entry(entry: &StoreEntry, closed_is_error: bool) -> Result<(), Failure> {
    let taken = entry.store.write().unwrap_or_else(|p| p.into_inner()).take();
    match taken {
        Some(store) => Ok(store.close()?),
        None if closed_is_error => Err(Failure::new(TERAIO_ERR_CLOSED, "the store is already closed")),
        None => Ok(()),
    }
}

/// Releases a store handle, closing the store first if `teraio_close` was not called (the
/// status is then that of the close; the handle is released either way). Afterwards the
/// handle is dead: every call on it returns `TERAIO_ERR_BAD_HANDLE`. Passing NULL is a no-op
/// returning `TERAIO_OK`.
///
/// Errors: `BAD_HANDLE` (not a live handle), or the close's error.
/// Ownership: ends the caller's ownership of the handle.
/// Threads: safe while other threads use the handle: calls already inside finish, later ones
/// get `BAD_HANDLE`. Freeing from two threads at once frees it once; the other gets
/// `BAD_HANDLE`.
///
/// # Safety
/// None beyond passing a handle (any value is checked).
#[no_mangle]
pub unsafe extern "C" fn teraio_store_free(store: *mut teraio_store) -> teraio_status {
    guard(|| {
        if store.is_null() {
            return Ok(());
        }
        let entry = STORES
            .remove(store as usize)
            .ok_or_else(|| Failure::new(TERAIO_ERR_BAD_HANDLE, bad_handle("store", store)))?;
        close_entry(&entry, false)
    })
}

// ------------------------------------------------------------------------------------------------
// Blocking put and get
// ------------------------------------------------------------------------------------------------

/// Writes `data[0..len]` as object `id` with caller metadata `meta[0..meta_len]`, replacing
/// any object of that id, and returns once the put is acknowledged (visible to gets, and
/// durable if the store was opened with `durable`). `len` may be 0; `data` and `meta` may be
/// NULL when their length is 0.
///
/// Errors: `BAD_HANDLE`, `CLOSED`, `INVALID_ARGUMENT` (NULL with a length, metadata over the
/// store's limit), `NO_SPACE`, `IO`.
/// Ownership: `data` and `meta` are only read during the call. Memory: host memory (GPU memory:
/// `teraio_put_gpu`). Any alignment works; 4096-byte aligned buffers avoid a bounce copy.
/// Threads: safe; any number of threads may put and get on one store at once. Concurrent puts
/// of the same id: one wins, each is whole.
///
/// # Safety
/// `data` must be valid for reads of `len` bytes and `meta` of `meta_len` bytes.
#[no_mangle]
pub unsafe extern "C" fn teraio_put(
    store: *mut teraio_store,
    id: u64,
    data: *const c_void,
    len: usize,
    meta: *const c_void,
    meta_len: usize,
) -> teraio_status {
    guard(|| {
        let mut ticket = None;
        // SAFETY: caller contract; we wait for the ticket before returning, so `data` outlives it.
        unsafe { put_ticket(store, id, data, len, meta, meta_len, TERAIO_PRIORITY_NORMAL, &mut ticket)? };
        // Waiting happens outside the store's lock so that a concurrent close is not held up
        // by the device I/O (close waits for the op itself).
        Ok(ticket.expect("put_ticket sets the ticket on success").wait()?)
    })
}

/// Reads the whole of object `id` into `buf[0..buf_len]`; `buf_len` may exceed the object
/// (bytes past it are left untouched). On success `*out_len` (if not NULL) is the object's
/// length. If `buf_len` is too small the call fails with `TERAIO_ERR_BUFFER_TOO_SMALL` and
/// `*out_len` is the length needed.
///
/// Errors: `BAD_HANDLE`, `CLOSED`, `NOT_FOUND`, `BUFFER_TOO_SMALL`, `INVALID_ARGUMENT`
/// (`buf` NULL with a length), `IO`, `CORRUPT`.
/// Ownership: `buf` is written during the call only. Memory: host memory (GPU memory:
/// `teraio_get_gpu`).
/// Threads: safe. If another thread replaces or deletes the object meanwhile, the call returns
/// one version whole (the one current when the read was queued) and `*out_len` is that
/// version's length, or `NOT_FOUND`.
///
/// # Safety
/// `buf` must be valid for writes of `buf_len` bytes; `out_len` NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn teraio_get(
    store: *mut teraio_store,
    id: u64,
    buf: *mut c_void,
    buf_len: usize,
    out_len: *mut u64,
) -> teraio_status {
    guard(|| {
        let ptr = data_ptr(buf, buf_len, "buf")?;
        // SAFETY: caller contract; get_whole waits for the ticket before returning.
        unsafe {
            get_whole(
                store,
                out_len,
                |s| s.get_raw_ticket(id, 0, ptr, buf_len, true, Priority::Normal),
                |t| t.object_len_bytes(),
                |t| t.wait(),
            )
        }
    })
}

/// Writes `len` bytes of CUDA device memory at `device_ptr` (on GPU `device`, a CUDA device
/// ordinal) as object `id`, and waits until it is durable. The engine moves the data through its
/// pinned bounce path or cuFile, whichever its GPU set-up chose (see docs/gpu.md).
///
/// Errors: as `teraio_put`, plus `UNSUPPORTED` where no CUDA driver is found (the message says
/// what is missing) and `INVALID_ARGUMENT` where `device_ptr` is not memory of GPU `device`.
/// Ownership: the device memory is only read during the call; the caller's work on it must be
/// finished (stream synchronized) before the call. Threads: as `teraio_put`.
///
/// # Safety
/// `device_ptr` must be device memory of `len` bytes on GPU `device`; `meta` valid for reads of
/// `meta_len` bytes.
#[no_mangle]
pub unsafe extern "C" fn teraio_put_gpu(
    store: *mut teraio_store,
    id: u64,
    device_ptr: u64,
    len: usize,
    device: u32,
    meta: *const c_void,
    meta_len: usize,
) -> teraio_status {
    guard(|| {
        // SAFETY: caller contract (meta is copied by the engine before put_gpu_raw returns).
        let meta = unsafe { bytes(meta, meta_len, "meta")? };
        let slice = DeviceSlice { ptr: device_ptr, len, device };
        // SAFETY: caller contract; we wait for the ticket before returning.
        let ticket = with_store(store, |s| Ok(unsafe { s.put_gpu_raw(id, slice, meta, Priority::Normal)? }))?;
        Ok(ticket.wait()?)
    })
}

/// Reads the whole of object `id` into CUDA device memory `device_ptr[0..buf_len]` on GPU
/// `device` and waits for it; `*out_len` (if not NULL) is the object's length, or on
/// `BUFFER_TOO_SMALL` the length needed.
///
/// Errors: as `teraio_get`, plus `UNSUPPORTED` (no CUDA driver) and `INVALID_ARGUMENT`
/// (`device_ptr` is not memory of GPU `device`). Threads: as `teraio_get`.
///
/// # Safety
/// `device_ptr` must be device memory of `buf_len` bytes on GPU `device`, not used by other
/// work until the call returns; `out_len` NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn teraio_get_gpu(
    store: *mut teraio_store,
    id: u64,
    device_ptr: u64,
    buf_len: usize,
    device: u32,
    out_len: *mut u64,
) -> teraio_status {
    guard(|| {
        let slice = DeviceSlice { ptr: device_ptr, len: buf_len, device };
        // SAFETY: caller contract; get_whole waits for the ticket before returning.
        unsafe {
            get_whole(
                store,
                out_len,
                |s| s.get_gpu_raw(id, 0, slice, true, Priority::Normal),
                |t| t.object_len_bytes(),
                |t| t.wait(),
            )
        }
    })
}

/// Reads exactly `len` bytes of object `id` starting at byte `offset` into `buf`.
///
/// Errors: `BAD_HANDLE`, `CLOSED`, `NOT_FOUND`, `OUT_OF_RANGE` (`offset + len` past the end),
/// `INVALID_ARGUMENT`, `IO`, `CORRUPT`.
/// Ownership, memory and threads: as `teraio_get`.
///
/// # Safety
/// `buf` must be valid for writes of `len` bytes.
#[no_mangle]
pub unsafe extern "C" fn teraio_get_range(
    store: *mut teraio_store,
    id: u64,
    offset: u64,
    buf: *mut c_void,
    len: usize,
) -> teraio_status {
    guard(|| {
        let mut ticket = None;
        // SAFETY: caller contract; we wait for the ticket before returning.
        unsafe { get_ticket(store, id, offset, buf, len, false, TERAIO_PRIORITY_NORMAL, &mut ticket)? };
        Ok(ticket.expect("get_ticket sets the ticket on success").wait()?)
    })
}

// ------------------------------------------------------------------------------------------------
// Asynchronous put and get: tickets
// ------------------------------------------------------------------------------------------------

/// Starts a put.
///
/// # Safety
/// As `teraio_put_async`.
#[allow(clippy::too_many_arguments)]
unsafe fn put_ticket(
    store: *mut teraio_store,
    id: u64,
    data: *const c_void,
    len: usize,
    meta: *const c_void,
    meta_len: usize,
    priority: teraio_priority,
    out: &mut Option<Ticket<()>>,
) -> Result<(), Failure> {
    let priority = priority_of(priority)?;
    let ptr = data_ptr(data, len, "data")?;
    // SAFETY: caller contract (meta is copied by the engine before put returns).
    let meta = unsafe { bytes(meta, meta_len, "meta")? };
    // SAFETY: caller contract: `data` stays valid until the ticket is done.
    *out = Some(with_store(store, |s| Ok(unsafe { s.put_raw_ticket(id, ptr, len, meta, priority)? }))?);
    Ok(())
}

/// A blocking whole-object get for `teraio_get` and `teraio_get_gpu`: `start` queues it under the
/// store's lock, `wait` waits outside it (so a concurrent close is not held up by the I/O), and
/// `*out_len` gets the length of the version read (`version_len` of the ticket: the get pins
/// one version, so its length and its bytes agree), or the length needed when the buffer is
/// too small.
///
/// # Safety
/// `out_len` NULL or valid for a write; `start`'s memory valid until `wait` returns.
unsafe fn get_whole<T>(
    store: *mut teraio_store,
    out_len: *mut u64,
    start: impl FnOnce(&Store) -> Result<T, Error>,
    version_len: impl FnOnce(&T) -> Option<u64>,
    wait: impl FnOnce(T) -> Result<(), Error>,
) -> Result<(), Failure> {
    let (ticket, object_len) = with_store(store, |s| {
        match start(s) {
            Ok(ticket) => {
                let object_len = version_len(&ticket).expect("a get's ticket knows its version's length");
                Ok((ticket, object_len))
            }
            Err(Error::BufferTooSmall { needed_bytes, given_bytes }) => {
                // SAFETY: caller contract.
                unsafe { set_out(out_len, needed_bytes) };
                Err(Error::BufferTooSmall { needed_bytes, given_bytes }.into())
            }
            Err(e) => Err(e.into()),
        }
    })?;
    wait(ticket)?;
    // SAFETY: caller contract.
    unsafe { set_out(out_len, object_len) };
    Ok(())
}

/// Starts a get.
///
/// # Safety
/// As `teraio_get_range_async`.
#[allow(clippy::too_many_arguments)]
unsafe fn get_ticket(
    store: *mut teraio_store,
    id: u64,
    offset: u64,
    buf: *mut c_void,
    len: usize,
    whole: bool,
    priority: teraio_priority,
    out: &mut Option<Ticket<()>>,
) -> Result<(), Failure> {
    let priority = priority_of(priority)?;
    let ptr = data_ptr(buf, len, "buf")?;
    // SAFETY: caller contract: `buf` stays valid and untouched until the ticket is done.
    *out = Some(with_store(store, |s| Ok(unsafe { s.get_raw_ticket(id, offset, ptr, len, whole, priority)? }))?);
    Ok(())
}

/// Starts writing `data[0..len]` as object `id` (see `teraio_put`) and returns at once with a
/// ticket in `*out_ticket`. `priority` is a `TERAIO_PRIORITY_*` value. Errors found before any
/// I/O (bad handle, closed, bad arguments, no space) are returned here and no ticket is made;
/// errors of the I/O itself come from `teraio_ticket_wait`.
///
/// Ownership: `data` must stay valid and unchanged until the ticket is done (waited on, or
/// polled done); `meta` is copied before the call returns. The caller owns the ticket and must
/// pass it to `teraio_ticket_wait` exactly once. Memory: host memory (the GPU calls are blocking).
/// Threads: safe; the ticket may be polled and waited on from any thread.
///
/// # Safety
/// `data` valid for reads of `len` bytes until the ticket is done; `meta` for reads of
/// `meta_len` bytes during the call; `out_ticket` valid for a write.
#[no_mangle]
pub unsafe extern "C" fn teraio_put_async(
    store: *mut teraio_store,
    id: u64,
    data: *const c_void,
    len: usize,
    meta: *const c_void,
    meta_len: usize,
    priority: teraio_priority,
    out_ticket: *mut *mut teraio_ticket,
) -> teraio_status {
    guard(|| {
        require_out(out_ticket, "out_ticket")?;
        let mut ticket = None;
        // SAFETY: caller contract.
        unsafe { put_ticket(store, id, data, len, meta, meta_len, priority, &mut ticket)? };
        // SAFETY: checked non-NULL; caller contract.
        unsafe { hand_out_ticket(ticket.expect("set on success"), out_ticket) };
        Ok(())
    })
}

/// Starts reading the whole of object `id` into `buf[0..buf_len]` (see `teraio_get`) and returns
/// at once with a ticket in `*out_ticket`; `teraio_ticket_object_len` gives the length of the
/// version it reads.
/// `NOT_FOUND` and `BUFFER_TOO_SMALL` are returned here, with no ticket made.
///
/// Ownership: `buf` must stay valid, and must not be read or written, until the ticket is
/// done. The caller owns the ticket and must pass it to `teraio_ticket_wait` exactly once.
/// Memory: host memory (the GPU calls are blocking). Threads: as `teraio_put_async`.
///
/// # Safety
/// `buf` valid for writes of `buf_len` bytes until the ticket is done; `out_ticket` valid for
/// a write.
#[no_mangle]
pub unsafe extern "C" fn teraio_get_async(
    store: *mut teraio_store,
    id: u64,
    buf: *mut c_void,
    buf_len: usize,
    priority: teraio_priority,
    out_ticket: *mut *mut teraio_ticket,
) -> teraio_status {
    guard(|| {
        require_out(out_ticket, "out_ticket")?;
        let mut ticket = None;
        // SAFETY: caller contract.
        unsafe { get_ticket(store, id, 0, buf, buf_len, true, priority, &mut ticket)? };
        // SAFETY: checked non-NULL; caller contract.
        unsafe { hand_out_ticket(ticket.expect("set on success"), out_ticket) };
        Ok(())
    })
}

/// Starts reading exactly `len` bytes of object `id` from byte `offset` into `buf` (see
/// `teraio_get_range`) and returns at once with a ticket in `*out_ticket`. `NOT_FOUND` and
/// `OUT_OF_RANGE` are returned here, with no ticket made.
///
/// Ownership, memory and threads: as `teraio_get_async`.
///
/// # Safety
/// As `teraio_get_async`, with `len` for `buf_len`.
#[no_mangle]
pub unsafe extern "C" fn teraio_get_range_async(
    store: *mut teraio_store,
    id: u64,
    offset: u64,
    buf: *mut c_void,
    len: usize,
    priority: teraio_priority,
    out_ticket: *mut *mut teraio_ticket,
) -> teraio_status {
    guard(|| {
        require_out(out_ticket, "out_ticket")?;
        let mut ticket = None;
        // SAFETY: caller contract.
        unsafe { get_ticket(store, id, offset, buf, len, false, priority, &mut ticket)? };
        // SAFETY: checked non-NULL; caller contract.
        unsafe { hand_out_ticket(ticket.expect("set on success"), out_ticket) };
        Ok(())
    })
}

/// Sets `*out_done` to whether the ticket's op has finished (successfully or not). Never
/// blocks and does not consume the ticket: call `teraio_ticket_wait` for the outcome. Once
/// done, the op no longer touches its buffer.
///
/// Errors: `BAD_HANDLE` (not a live ticket), `INVALID_ARGUMENT` (`out_done` NULL).
/// Threads: safe from any thread, also while another thread waits on the ticket.
///
/// # Safety
/// `out_done` must be valid for a write.
#[no_mangle]
pub unsafe extern "C" fn teraio_ticket_poll(ticket: *mut teraio_ticket, out_done: *mut bool) -> teraio_status {
    guard(|| {
        require_out(out_done, "out_done")?;
        let entry = TICKETS
            .get(ticket as usize)
            .ok_or_else(|| Failure::new(TERAIO_ERR_BAD_HANDLE, bad_handle("ticket", ticket)))?;
        // SAFETY: checked non-NULL; caller contract.
        unsafe { out_done.write(entry.ticket.is_done()) };
        Ok(())
    })
}

/// Sets `*out_len` to the length of the object version a get's ticket reads. A get fixes that
/// version when it is queued and returns its bytes alone, even if another thread replaces the
/// object meanwhile; a whole-object get (`teraio_get_async`) into a longer buffer fills this
/// many leading bytes. Known as soon as the ticket exists; call it before `teraio_ticket_wait`,
/// which releases the ticket.
///
/// Errors: `BAD_HANDLE` (not a live ticket), `INVALID_ARGUMENT` (`out_len` NULL, or the ticket
/// is a put's).
/// Threads: safe from any thread, also while another thread waits on the ticket.
///
/// # Safety
/// `out_len` must be valid for a write.
#[no_mangle]
pub unsafe extern "C" fn teraio_ticket_object_len(ticket: *mut teraio_ticket, out_len: *mut u64) -> teraio_status {
    guard(|| {
        require_out(out_len, "out_len")?;
        let entry = TICKETS
            .get(ticket as usize)
            .ok_or_else(|| Failure::new(TERAIO_ERR_BAD_HANDLE, bad_handle("ticket", ticket)))?;
        let len = entry
            .ticket
            .object_len_bytes()
            .ok_or_else(|| invalid("the ticket is a put's; only a get reads a version"))?;
        // SAFETY: checked non-NULL; caller contract.
        unsafe { out_len.write(len) };
        Ok(())
    })
}

/// Waits until the ticket's op has finished, releases the ticket, and returns the op's
/// outcome (`TERAIO_OK`, or e.g. `IO`, `CORRUPT`, `NO_SPACE`). Afterwards the buffer is the
/// caller's again and the ticket handle is dead (`BAD_HANDLE` if used again).
///
/// Errors: `BAD_HANDLE` (not a live ticket, e.g. already waited on), or the op's error.
/// Ownership: consumes the ticket, whatever the outcome.
/// Threads: any thread may wait; if two wait on one ticket, one gets the outcome and the
/// other `BAD_HANDLE`.
///
/// # Safety
/// None beyond passing a handle (any value is checked).
#[no_mangle]
pub unsafe extern "C" fn teraio_ticket_wait(ticket: *mut teraio_ticket) -> teraio_status {
    guard(|| {
        let entry = TICKETS
            .remove(ticket as usize)
            .ok_or_else(|| Failure::new(TERAIO_ERR_BAD_HANDLE, bad_handle("ticket", ticket)))?;
        // `wait_timeout` borrows, so a concurrent poll holding another reference is fine.
        loop {
            if let Some(outcome) = entry.ticket.wait_timeout(Duration::from_secs(3600)) {
                return Ok(outcome?);
            }
        }
    })
}

// ------------------------------------------------------------------------------------------------
// Delete, stat, stats
// ------------------------------------------------------------------------------------------------

/// Deletes object `id` durably.
///
/// Errors: `NOT_FOUND` (no such object; nothing changed), `BAD_HANDLE`, `CLOSED`, `IO`.
/// Threads: safe. A get already started on the object completes with the old data.
///
/// # Safety
/// None beyond passing a handle (any value is checked).
#[no_mangle]
pub unsafe extern "C" fn teraio_delete(store: *mut teraio_store, id: u64) -> teraio_status {
    guard(|| {
        let existed = with_store(store, |s| Ok(s.delete(id)?))?;
        if existed {
            Ok(())
        } else {
            Err(Error::NotFound { id }.into())
        }
    })
}

/// Describes object `id` in `*out_info`. Pass `sizeof(teraio_object_info)` as `info_size`
/// (fields added later are then filled only for callers that know them).
///
/// Errors: `NOT_FOUND`, `BAD_HANDLE`, `CLOSED`, `INVALID_ARGUMENT` (`out_info` NULL).
/// Threads: safe.
///
/// # Safety
/// `out_info` must be valid for writes of `info_size` bytes.
#[no_mangle]
pub unsafe extern "C" fn teraio_stat(
    store: *mut teraio_store,
    id: u64,
    out_info: *mut teraio_object_info,
    info_size: usize,
) -> teraio_status {
    guard(|| {
        require_out(out_info, "out_info")?;
        let info = with_store(store, |s| s.stat(id).ok_or_else(|| Error::NotFound { id }.into()))?;
        let c = teraio_object_info {
            id: info.id,
            len_bytes: info.len_bytes,
            meta_len: info.meta.len() as u64,
            extent_count: info.extent_count as u64,
            device_count: info.devices.len() as u64,
        };
        // SAFETY: caller contract.
        unsafe { types::write_versioned(&c, out_info, info_size) };
        Ok(())
    })
}

/// Copies the caller metadata stored with object `id` into `buf[0..buf_len]`. `*out_len` (if
/// not NULL) is set to the metadata's length, also when the call fails with
/// `BUFFER_TOO_SMALL`. `buf` may be NULL when `buf_len` is 0 (to ask for the length).
///
/// Errors: `NOT_FOUND`, `BUFFER_TOO_SMALL`, `BAD_HANDLE`, `CLOSED`, `INVALID_ARGUMENT`.
/// Threads: safe.
///
/// # Safety
/// `buf` valid for writes of `buf_len` bytes; `out_len` NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn teraio_get_meta(
    store: *mut teraio_store,
    id: u64,
    buf: *mut c_void,
    buf_len: usize,
    out_len: *mut u64,
) -> teraio_status {
    guard(|| {
        let ptr = data_ptr(buf, buf_len, "buf")?;
        let meta = with_store(store, |s| s.stat(id).map(|i| i.meta).ok_or_else(|| Error::NotFound { id }.into()))?;
        // SAFETY: caller contract.
        unsafe { set_out(out_len, meta.len() as u64) };
        if meta.len() > buf_len {
            return Err(Error::BufferTooSmall { needed_bytes: meta.len() as u64, given_bytes: buf_len as u64 }.into());
        }
        // SAFETY: `ptr` is valid for `buf_len >= meta.len()` bytes (caller contract).
        unsafe { std::ptr::copy_nonoverlapping(meta.as_ptr(), ptr, meta.len()) };
        Ok(())
    })
}

/// Copies the store's counters into `*out_stats`. Pass `sizeof(teraio_stats)` as `stats_size`.
///
/// Errors: `BAD_HANDLE`, `CLOSED`, `INVALID_ARGUMENT` (`out_stats` NULL).
/// Threads: safe; the counters are a consistent-enough snapshot while other threads work.
///
/// # Safety
/// `out_stats` must be valid for writes of `stats_size` bytes.
#[no_mangle]
pub unsafe extern "C" fn teraio_get_stats(
    store: *mut teraio_store,
    out_stats: *mut types::teraio_stats,
    stats_size: usize,
) -> teraio_status {
    guard(|| {
        require_out(out_stats, "out_stats")?;
        let snapshot = with_store(store, |s| Ok(s.stats()))?;
        let (total, ops) = (&snapshot.total, &snapshot.ops);
        let (put_latency, get_latency) = (ops.put_latency.summary(), ops.get_latency.summary());
        let c = types::teraio_stats {
            puts: ops.puts,
            put_bytes: ops.put_bytes,
            gets: ops.gets,
            get_bytes: ops.get_bytes,
            deletes: ops.deletes,
            failed_ops: ops.failed,
            read_ops: total.read_ops,
            read_bytes: total.read_bytes,
            write_ops: total.write_ops,
            write_bytes: total.write_bytes,
            flush_ops: total.flush_ops,
            io_errors: total.errors,
            io_retries: total.retries,
            urgent_ops: total.urgent_ops,
            put_latency_p50_us: put_latency.p50_us,
            put_latency_p99_us: put_latency.p99_us,
            get_latency_p50_us: get_latency.p50_us,
            get_latency_p99_us: get_latency.p99_us,
            device_count: snapshot.devices.len() as u64,
        };
        // SAFETY: caller contract.
        unsafe { types::write_versioned(&c, out_stats, stats_size) };
        Ok(())
    })
}

#[cfg(test)]
mod gpu_tests {
    use super::*;

    /// Without a CUDA driver (CI) the GPU calls fail with UNSUPPORTED and a message naming what
    /// is missing; on a GPU machine a host pointer is refused as not being device memory.
    #[test]
    fn gpu_calls_say_what_is_missing() {
        let dir = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../target/c-gpu-test");
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join(format!("d0-{}", std::process::id()));
        let _ = std::fs::remove_file(&path);
        teraio_engine::device::create_file(&path, 16 << 20).unwrap();
        let format = FormatConfig {
            stripe_unit_bytes: 64 * 1024,
            checkpoint_slot_bytes: Some(1 << 20),
            journal_bytes: Some(1 << 20),
            ..FormatConfig::default()
        };
        let store = Store::create(&[&path], &format, OpenConfig::default()).unwrap();
        let mut handle: *mut teraio_store = std::ptr::null_mut();
        // SAFETY: `handle` is a valid place for the handle.
        unsafe { hand_out_store(store, &mut handle) };
        let host = vec![7u8; 4096];
        // SAFETY: a registered handle; the pointer is deliberately not device memory.
        let status = unsafe { teraio_put_gpu(handle, 1, host.as_ptr() as u64, host.len(), 0, std::ptr::null(), 0) };
        assert_ne!(status, TERAIO_OK);
        let cuda_present = teraio_engine::cuda::probe().to_string().contains("CUDA driver: version");
        if cuda_present {
            assert_eq!(status, TERAIO_ERR_INVALID_ARGUMENT);
        } else {
            assert_eq!(status, TERAIO_ERR_UNSUPPORTED);
            let message =
                unsafe { std::ffi::CStr::from_ptr(teraio_last_error_message()) }.to_string_lossy().into_owned();
            assert!(message.contains("CUDA"), "{message}");
        }
        let mut len = 0u64;
        // SAFETY: as above.
        let status = unsafe { teraio_get_gpu(handle, 1, host.as_ptr() as u64, host.len(), 0, &mut len) };
        assert_ne!(status, TERAIO_OK);
        // SAFETY: the handle is ours.
        unsafe {
            assert_eq!(teraio_close(handle), TERAIO_OK);
            assert_eq!(teraio_store_free(handle), TERAIO_OK);
        }
        std::fs::remove_file(&path).unwrap();
    }
}
