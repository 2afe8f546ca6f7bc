//! Status codes, the per-thread last error, and the guard every exported function runs in.
//!
//! Every exported function returns a [`teraio_status`]. On failure it also records a message (and
//! the errno behind it, where there is one) for the calling thread, which
//! `teraio_last_error_message` and `teraio_last_error_os_code` hand back. A panic inside the
//! library never unwinds into C: the guard catches it and turns it into `TERAIO_ERR_PANIC`.

use std::cell::RefCell;
use std::ffi::{c_char, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};

use teraio_engine::Error;

/// The outcome of a teraio call. Values are stable: new codes are only ever appended.
#[allow(non_camel_case_types)]
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum teraio_status {
    /// The call succeeded.
    TERAIO_OK = 0,
    /// A NULL pointer where one is not allowed, an unknown enum value, a bad size, metadata
    /// over the store's limit, or an invalid configuration.
    TERAIO_ERR_INVALID_ARGUMENT = 1,
    /// The store or ticket handle is NULL, was never issued, or was already freed or waited on.
    TERAIO_ERR_BAD_HANDLE = 2,
    /// The store was closed with `teraio_close`; only `teraio_store_free` is still useful.
    TERAIO_ERR_CLOSED = 3,
    /// No object has this id.
    TERAIO_ERR_NOT_FOUND = 4,
    /// The buffer is shorter than the object (or its metadata); the needed length is reported.
    TERAIO_ERR_BUFFER_TOO_SMALL = 5,
    /// A ranged read reaches past the end of the object.
    TERAIO_ERR_OUT_OF_RANGE = 6,
    /// Not enough free space on a device, or the object table is full.
    TERAIO_ERR_NO_SPACE = 7,
    /// A device could not be opened, read, written or flushed; see `teraio_last_error_os_code`.
    TERAIO_ERR_IO = 8,
    /// On-disk data or metadata failed its checksum or is inconsistent; nothing damaged was
    /// returned.
    TERAIO_ERR_CORRUPT = 9,
    /// Another process (or another open handle) holds the store's devices.
    TERAIO_ERR_LOCKED = 10,
    /// The paths given are not (all of, or only) the devices of one teraio store of a version
    /// this library reads, or a device is too small.
    TERAIO_ERR_BAD_DEVICES = 11,
    /// The requested backend or O_DIRECT is not available here.
    TERAIO_ERR_UNSUPPORTED = 12,
    /// A bug inside teraio panicked; the call was abandoned. The message says where.
    TERAIO_ERR_PANIC = 13,
    /// An engine error this version of the C API has no specific code for.
    TERAIO_ERR_INTERNAL = 14,
}

use teraio_status::*;

/// A failed call: the code returned to C plus what `teraio_last_error_*` will report.
#[derive(Debug)]
pub(crate) struct Failure {
    pub(crate) status: teraio_status,
    pub(crate) message: String,
    pub(crate) os_code: i32,
}

impl Failure {
    /// A failure found by the binding itself (argument checks, handle checks).
    pub(crate) fn new(status: teraio_status, message: impl Into<String>) -> Self {
        Failure { status, message: message.into(), os_code: 0 }
    }
}

impl From<Error> for Failure {
    fn from(error: Error) -> Self {
        Failure { status: status_of(&error), message: error.to_string(), os_code: error.raw_os_error().unwrap_or(0) }
    }
}

/// The stable C code of an engine error.
pub(crate) fn status_of(error: &Error) -> teraio_status {
    match error {
        Error::NotFound { .. } => TERAIO_ERR_NOT_FOUND,
        Error::BufferTooSmall { .. } => TERAIO_ERR_BUFFER_TOO_SMALL,
        Error::RangeOutOfBounds { .. } => TERAIO_ERR_OUT_OF_RANGE,
        Error::MetadataTooLarge { .. } | Error::InvalidConfig(_) => TERAIO_ERR_INVALID_ARGUMENT,
        Error::NoSpace { .. } | Error::TableFull { .. } => TERAIO_ERR_NO_SPACE,
        Error::DeviceOpen { .. } | Error::DeviceIo { .. } | Error::Io { .. } => TERAIO_ERR_IO,
        Error::ChecksumMismatch { .. } | Error::CorruptMetadata { .. } | Error::CorruptSuperblock { .. } => {
            TERAIO_ERR_CORRUPT
        }
        Error::Locked { .. } => TERAIO_ERR_LOCKED,
        Error::Closed => TERAIO_ERR_CLOSED,
        Error::DeviceTooSmall { .. }
        | Error::NotATeraioDevice { .. }
        | Error::UnsupportedVersion { .. }
        | Error::WrongStore { .. }
        | Error::MissingDevice { .. }
        | Error::DuplicateDevice { .. }
        | Error::DeviceCountMismatch { .. } => TERAIO_ERR_BAD_DEVICES,
        Error::DirectIoUnsupported { .. } | Error::BackendUnavailable { .. } => TERAIO_ERR_UNSUPPORTED,
        // The engine may grow variants; they reach C as INTERNAL (with their message) until
        // this table learns them, rather than breaking the build of every other crate.
        #[allow(unreachable_patterns)]
        _ => TERAIO_ERR_INTERNAL,
    }
}

/// The message and errno of the calling thread's last failed call.
struct LastError {
    message: CString,
    os_code: i32,
}

thread_local! {
    static LAST_ERROR: RefCell<LastError> =
        RefCell::new(LastError { message: CString::default(), os_code: 0 });
}

fn record(failure: &Failure) {
    // An interior NUL would cut the C string short; show it instead of failing.
    let message = CString::new(failure.message.replace('\0', "\\0")).unwrap_or_default();
    // `try_with` fails only while the thread is being torn down; the status code still tells.
    let _ = LAST_ERROR.try_with(|last| {
        if let Ok(mut last) = last.try_borrow_mut() {
            *last = LastError { message, os_code: failure.os_code };
        }
    });
}

/// The calling thread's last error message; valid until that thread's next teraio call.
pub(crate) fn last_message_ptr() -> *const c_char {
    static EMPTY: &[u8] = b"\0";
    LAST_ERROR
        .try_with(|last| last.try_borrow().map(|l| l.message.as_ptr()).unwrap_or(EMPTY.as_ptr().cast()))
        .unwrap_or(EMPTY.as_ptr().cast())
}

/// The errno behind the calling thread's last error, or 0.
pub(crate) fn last_os_code() -> i32 {
    LAST_ERROR.try_with(|last| last.try_borrow().map(|l| l.os_code).unwrap_or(0)).unwrap_or(0)
}

/// Runs the body of an exported function: failures are recorded for `teraio_last_error_*` and
/// returned as their code; a panic is caught here so that it never unwinds into C.
pub(crate) fn guard(body: impl FnOnce() -> Result<(), Failure>) -> teraio_status {
    let failure = match catch_unwind(AssertUnwindSafe(body)) {
        Ok(Ok(())) => return TERAIO_OK,
        Ok(Err(failure)) => failure,
        Err(payload) => {
            let what = payload
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| payload.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "a panic with a non-text payload".to_string());
            Failure::new(TERAIO_ERR_PANIC, format!("internal error (panic) in teraio: {what}; please report it"))
        }
    };
    record(&failure);
    failure.status
}

/// The constant name of a status code, e.g. `"TERAIO_ERR_NOT_FOUND"`.
pub(crate) fn status_name(status: i32) -> &'static [u8] {
    match status {
        0 => b"TERAIO_OK\0",
        1 => b"TERAIO_ERR_INVALID_ARGUMENT\0",
        2 => b"TERAIO_ERR_BAD_HANDLE\0",
        3 => b"TERAIO_ERR_CLOSED\0",
        4 => b"TERAIO_ERR_NOT_FOUND\0",
        5 => b"TERAIO_ERR_BUFFER_TOO_SMALL\0",
        6 => b"TERAIO_ERR_OUT_OF_RANGE\0",
        7 => b"TERAIO_ERR_NO_SPACE\0",
        8 => b"TERAIO_ERR_IO\0",
        9 => b"TERAIO_ERR_CORRUPT\0",
        10 => b"TERAIO_ERR_LOCKED\0",
        11 => b"TERAIO_ERR_BAD_DEVICES\0",
        12 => b"TERAIO_ERR_UNSUPPORTED\0",
        13 => b"TERAIO_ERR_PANIC\0",
        14 => b"TERAIO_ERR_INTERNAL\0",
        _ => b"TERAIO_UNKNOWN_STATUS\0",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::ffi::CStr;

    fn last_message() -> String {
        // SAFETY: the pointer is a NUL-terminated string owned by this thread's slot.
        unsafe { CStr::from_ptr(last_message_ptr()) }.to_string_lossy().into_owned()
    }

    #[test]
    fn panics_become_a_status_and_a_message() {
        let status = guard(|| panic!("boom {}", 42));
        assert_eq!(status, TERAIO_ERR_PANIC);
        assert!(last_message().contains("boom 42"), "{}", last_message());
        let status = guard(|| std::panic::panic_any(7u32));
        assert_eq!(status, TERAIO_ERR_PANIC);
        assert!(last_message().contains("non-text payload"));
    }

    #[test]
    fn failures_record_message_and_errno_per_thread() {
        let status = guard(|| Err(Error::NotFound { id: 9 }.into()));
        assert_eq!(status, TERAIO_ERR_NOT_FOUND);
        assert_eq!(last_message(), "object 9 not found");
        assert_eq!(last_os_code(), libc_enoent());
        // Another thread has its own slot, untouched by this one's failure.
        std::thread::spawn(|| assert_eq!(last_message(), "")).join().unwrap();
        // Success leaves the last failure in place (errno-like).
        assert_eq!(guard(|| Ok(())), TERAIO_OK);
        assert_eq!(last_message(), "object 9 not found");
        // Interior NULs do not truncate or fail.
        guard(|| Err(Failure::new(TERAIO_ERR_INVALID_ARGUMENT, "a\0b")));
        assert_eq!(last_message(), "a\\0b");
    }

    fn libc_enoent() -> i32 {
        std::io::Error::from(std::io::ErrorKind::NotFound).raw_os_error().unwrap_or(2)
    }

    #[test]
    fn every_code_has_its_name() {
        for (code, name) in [(TERAIO_OK, "TERAIO_OK"), (TERAIO_ERR_INTERNAL, "TERAIO_ERR_INTERNAL")] {
            assert_eq!(CStr::from_bytes_with_nul(status_name(code as i32)).unwrap().to_str().unwrap(), name);
        }
        for code in 0..=14 {
            let name = CStr::from_bytes_with_nul(status_name(code)).unwrap().to_str().unwrap();
            assert!(name.starts_with("TERAIO_") && name != "TERAIO_UNKNOWN_STATUS", "{code}");
        }
        assert_eq!(status_name(99), b"TERAIO_UNKNOWN_STATUS\0");
    }

    #[test]
    fn engine_errors_map_to_stable_codes() {
        let io = || std::io::Error::from_raw_os_error(5);
        let cases = [
            (Error::BufferTooSmall { needed_bytes: 2, given_bytes: 1 }, TERAIO_ERR_BUFFER_TOO_SMALL),
            (Error::RangeOutOfBounds { id: 1, offset: 0, len: 2, object_len: 1 }, TERAIO_ERR_OUT_OF_RANGE),
            (Error::MetadataTooLarge { len: 9, max: 8 }, TERAIO_ERR_INVALID_ARGUMENT),
            (Error::TableFull { detail: "x".into() }, TERAIO_ERR_NO_SPACE),
            (Error::io("reading", io()), TERAIO_ERR_IO),
            (Error::CorruptMetadata { detail: "x".into() }, TERAIO_ERR_CORRUPT),
            (Error::Locked { path: "/d".into() }, TERAIO_ERR_LOCKED),
            (Error::Closed, TERAIO_ERR_CLOSED),
            (Error::MissingDevice { index: 1, count: 2 }, TERAIO_ERR_BAD_DEVICES),
            (Error::BackendUnavailable { backend: "io_uring", reason: "x".into() }, TERAIO_ERR_UNSUPPORTED),
        ];
        for (error, status) in cases {
            let failure = Failure::from(error);
            assert_eq!(failure.status, status, "{}", failure.message);
        }
        assert_eq!(Failure::from(Error::io("reading", io())).os_code, 5);
    }
}
