//! `teraio._native`: the Rust core of the Python package.
//!
//! Thin on purpose (the work is in `teraio-engine` and `teraio-planner`): a `Store` whose put/get
//! take raw host pointers with an owner object that keeps the memory alive (and CUDA device
//! pointers, optionally after a CUDA event), `Handle`s to wait on with the GIL released or to
//! make a CUDA stream wait for, engine errors as specific Python exceptions carrying the engine's
//! message, and the planner (`plan`: `teraio_planner::predict::plan_and_predict`, `simulate_plan`,
//! `replay_schedule`) on JSON traces. The typed Python face is
//! `teraio/__init__.py` and `teraio/_native.pyi`.

use std::path::PathBuf;
use std::time::Duration;

use pyo3::create_exception;
use pyo3::exceptions::{PyException, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict, PyFloat, PyInt, PyString};

use teraio_engine::options::{store_configs, OptionKind, OptionStage, OptionValue, StoreConfigs, STORE_OPTIONS};
use teraio_engine::{Error as EngineError, Priority, Store as EngineStore, Ticket};
use teraio_planner::greedy::{PlannerConfig, TierPreference};
use teraio_planner::hardware::Hardware;
use teraio_planner::plan::Plan;
use teraio_planner::predict::{plan_and_predict, PlanOptions};
use teraio_planner::replay::{replay, Schedule};
use teraio_planner::sim::{simulate, Policy, SimConfig};
use teraio_planner::trace::{TensorKind, Trace};
use teraio_units::ReadWriteBandwidth;

create_exception!(teraio, TeraioError, PyException, "Base class of every teraio error.");
create_exception!(teraio, NotFoundError, TeraioError, "No object with that id in the store.");
create_exception!(teraio, NoSpaceError, TeraioError, "The store's devices or object table are full.");
create_exception!(teraio, CorruptError, TeraioError, "Damaged data or metadata (checksum, superblock, table).");
create_exception!(teraio, LockedError, TeraioError, "Another writer holds the store's device lock.");
create_exception!(teraio, ClosedError, TeraioError, "The store is closed.");
create_exception!(teraio, DeviceError, TeraioError, "A device could not be opened, read or written.");
create_exception!(teraio, InvalidArgumentError, TeraioError, "A bad argument or configuration value.");
create_exception!(teraio, PlannerError, TeraioError, "The planner rejected a trace, a plan or hardware figures.");

/// Maps an engine error to the matching Python exception, keeping the engine's message.
fn to_py_err(error: EngineError) -> PyErr {
    let message = error.to_string();
    match error {
        EngineError::NotFound { .. } => NotFoundError::new_err(message),
        EngineError::NoSpace { .. } | EngineError::TableFull { .. } => NoSpaceError::new_err(message),
        EngineError::ChecksumMismatch { .. }
        | EngineError::CorruptMetadata { .. }
        | EngineError::CorruptSuperblock { .. } => CorruptError::new_err(message),
        EngineError::Locked { .. } => LockedError::new_err(message),
        EngineError::Closed => ClosedError::new_err(message),
        EngineError::DeviceOpen { .. }
        | EngineError::DirectIoUnsupported { .. }
        | EngineError::DeviceTooSmall { .. }
        | EngineError::NotATeraioDevice { .. }
        | EngineError::UnsupportedVersion { .. }
        | EngineError::WrongStore { .. }
        | EngineError::MissingDevice { .. }
        | EngineError::DuplicateDevice { .. }
        | EngineError::DeviceCountMismatch { .. }
        | EngineError::DeviceIo { .. }
        | EngineError::BackendUnavailable { .. }
        | EngineError::Io { .. } => DeviceError::new_err(message),
        EngineError::BufferTooSmall { .. }
        | EngineError::RangeOutOfBounds { .. }
        | EngineError::MetadataTooLarge { .. }
        | EngineError::InvalidConfig(_) => InvalidArgumentError::new_err(message),
        #[allow(unreachable_patterns)]
        _ => TeraioError::new_err(message),
    }
}

/// An object id from Python: an int in 0..2**64. Booleans, negative or too large numbers and
/// non-integers are refused with `InvalidArgumentError` (not Python's OverflowError, and `True`
/// is not taken as id 1).
struct ObjectId(u64);

impl<'py> FromPyObject<'py> for ObjectId {
    fn extract_bound(ob: &Bound<'py, PyAny>) -> PyResult<Self> {
        let refuse = || {
            let shown = ob.repr().map(|r| r.to_string()).unwrap_or_else(|_| "?".into());
            InvalidArgumentError::new_err(format!("object id {shown} is not an integer in 0..2**64"))
        };
        if ob.is_instance_of::<pyo3::types::PyBool>() {
            return Err(refuse());
        }
        ob.extract::<u64>().map(ObjectId).map_err(|_| refuse())
    }
}

/// Caller metadata from Python: any object with the buffer protocol (bytes, bytearray,
/// memoryview, a numpy array), taken as its raw bytes, or None for none. Anything else (a list of
/// ints, a str) is refused with `InvalidArgumentError` rather than converted.
struct MetaBytes(Vec<u8>);

impl<'py> FromPyObject<'py> for MetaBytes {
    fn extract_bound(ob: &Bound<'py, PyAny>) -> PyResult<Self> {
        if ob.is_none() {
            return Ok(MetaBytes(Vec::new()));
        }
        if let Ok(bytes) = ob.downcast::<pyo3::types::PyBytes>() {
            return Ok(MetaBytes(bytes.as_bytes().to_vec()));
        }
        let refuse = || {
            let kind = ob.get_type().name().map(|n| n.to_string()).unwrap_or_else(|_| "?".into());
            InvalidArgumentError::new_err(format!(
                "meta must be a bytes-like object (bytes, bytearray, memoryview) or None, not {kind}"
            ))
        };
        if ob.is_instance_of::<pyo3::types::PyString>() {
            return Err(refuse());
        }
        // The buffer protocol is outside the limited API before Python 3.11: go through
        // `memoryview`, which takes exactly the objects that have it.
        let view = PyModule::import(ob.py(), "builtins")?.getattr("memoryview")?.call1((ob,)).map_err(|_| refuse())?;
        let bytes = view.call_method0("tobytes")?;
        Ok(MetaBytes(bytes.downcast::<pyo3::types::PyBytes>()?.as_bytes().to_vec()))
    }
}

/// The metadata of an optional `meta` argument (none when it is left out or None).
fn meta_bytes(meta: Option<MetaBytes>) -> Vec<u8> {
    meta.map(|m| m.0).unwrap_or_default()
}

fn planner_err(error: teraio_planner::Error) -> PyErr {
    PlannerError::new_err(error.to_string())
}

/// A `CUevent` handle from Python as an address (sent to the engine's thread as one): 0 is
/// refused, since no live event has it.
fn raw_event(after: Option<u64>) -> PyResult<Option<usize>> {
    match after {
        Some(0) => Err(InvalidArgumentError::new_err(
            "after=0 is not a CUDA event; pass a recorded event's handle, or None to start at once",
        )),
        Some(handle) => Ok(Some(handle as usize)),
        None => Ok(None),
    }
}

fn priority(urgent: bool) -> Priority {
    if urgent {
        Priority::Urgent
    } else {
        Priority::Normal
    }
}

/// The engine's ticket behind a [`Handle`]: host memory or GPU memory.
enum AnyTicket {
    Host(Ticket<()>),
    Gpu(teraio_engine::GpuTicket<()>),
}

impl AnyTicket {
    fn wait(self) -> Result<(), EngineError> {
        match self {
            AnyTicket::Host(t) => t.wait(),
            AnyTicket::Gpu(t) => t.wait(),
        }
    }

    fn wait_timeout(&self, timeout: Duration) -> Option<Result<(), EngineError>> {
        match self {
            AnyTicket::Host(t) => t.wait_timeout(timeout),
            AnyTicket::Gpu(t) => t.wait_timeout(timeout),
        }
    }

    fn is_done(&self) -> bool {
        match self {
            AnyTicket::Host(t) => t.is_done(),
            AnyTicket::Gpu(t) => t.is_done(),
        }
    }

    fn object_len_bytes(&self) -> Option<u64> {
        match self {
            AnyTicket::Host(t) => t.object_len_bytes(),
            AnyTicket::Gpu(t) => t.object_len_bytes(),
        }
    }
}

/// An I/O in flight. Keeps the memory's owner alive until the I/O is done, also when the handle
/// is dropped without a wait (the drop then waits).
#[pyclass(module = "teraio._native")]
struct Handle {
    ticket: Option<AnyTicket>,
    owner: Option<PyObject>,
    /// The result once waited for (errors are kept so that a second wait raises again).
    result: Option<Result<(), EngineError>>,
    /// A get: the length of the object version it reads (`Ticket::object_len_bytes`).
    object_len_bytes: Option<u64>,
    /// An op on CUDA device memory (a stream can wait for it).
    gpu: bool,
}

impl Handle {
    /// The handle of an op the engine accepted, or of one it refused: as async APIs do, the
    /// refusal (no space, not found, metadata too large, closed meanwhile) is raised by `wait`,
    /// not by the call that started the op.
    fn started(ticket: Result<AnyTicket, EngineError>, owner: PyObject, gpu: bool) -> Self {
        match ticket {
            Ok(ticket) => {
                let object_len_bytes = ticket.object_len_bytes();
                Handle { ticket: Some(ticket), owner: Some(owner), result: None, object_len_bytes, gpu }
            }
            Err(e) => Handle { ticket: None, owner: None, result: Some(Err(e)), object_len_bytes: None, gpu },
        }
    }

    fn finish(&mut self, result: Result<(), EngineError>) -> PyResult<()> {
        self.ticket = None;
        self.owner = None;
        self.result = Some(result.clone());
        result.map_err(to_py_err)
    }
}

#[pymethods]
impl Handle {
    /// Waits (GIL released) until the I/O is done; raises the engine's error if it failed.
    /// With `timeout_s`, returns False if it is still running after that many seconds.
    #[pyo3(signature = (timeout_s=None))]
    fn wait(&mut self, py: Python<'_>, timeout_s: Option<&Bound<'_, PyAny>>) -> PyResult<bool> {
        let timeout_s =
            match timeout_s {
                Some(value) if !value.is_none() => Some(value.extract::<f64>().map_err(|_| {
                    InvalidArgumentError::new_err("timeout_s must be a number of seconds >= 0, or None")
                })?),
                _ => None,
            };
        if let Some(result) = &self.result {
            return result.clone().map(|_| true).map_err(to_py_err);
        }
        let ticket = self.ticket.take().expect("a handle holds a ticket until it has a result");
        match timeout_s {
            None => {
                let result = py.allow_threads(|| ticket.wait());
                self.finish(result).map(|_| true)
            }
            Some(seconds) => {
                if !(seconds.is_finite() && seconds >= 0.0) {
                    self.ticket = Some(ticket);
                    return Err(InvalidArgumentError::new_err("timeout_s must be a finite number >= 0"));
                }
                let timeout = Duration::from_secs_f64(seconds);
                let (ticket, outcome) = py.allow_threads(move || {
                    let outcome = ticket.wait_timeout(timeout);
                    (ticket, outcome)
                });
                if outcome.is_some() {
                    let result = py.allow_threads(|| ticket.wait());
                    self.finish(result).map(|_| true)
                } else {
                    self.ticket = Some(ticket);
                    Ok(false)
                }
            }
        }
    }

    /// Makes CUDA stream `stream` (a `CUstream` handle of the op's device; 0 is the legacy
    /// default stream) wait for this GPU op on the GPU: work queued on it after this call starts
    /// once the op has finished. The CPU waits (GIL released) only until the op's own GPU work
    /// is queued (a get: its bytes read and their copies queued), never for the copies. The op's
    /// outcome still comes from `wait` (the stream is released on failure too, and the data must
    /// then not be used). A finished op makes the stream wait for nothing; an op the engine
    /// refused raises its error here.
    ///
    /// Unsafe contract (the Python layer keeps it): `stream` is a live stream of the primary
    /// context of the op's device.
    fn enqueue_stream_wait(&self, py: Python<'_>, stream: u64) -> PyResult<()> {
        if !self.gpu {
            return Err(InvalidArgumentError::new_err(
                "only the handle of a put or get of CUDA memory can make a CUDA stream wait; wait for a host op with wait()",
            ));
        }
        match (&self.ticket, &self.result) {
            // SAFETY: as documented above.
            (Some(AnyTicket::Gpu(ticket)), _) => {
                let stream = stream as usize;
                py.allow_threads(|| unsafe { ticket.enqueue_stream_wait(stream as _) }).map_err(to_py_err)
            }
            (Some(AnyTicket::Host(_)), _) => unreachable!("a GPU handle holds a GPU ticket"),
            (None, Some(result)) => result.clone().map_err(to_py_err),
            (None, None) => unreachable!("a handle holds a ticket until it has a result"),
        }
    }

    /// True once the I/O has completed (successfully or not); never blocks.
    fn is_done(&self) -> bool {
        match &self.ticket {
            Some(ticket) => ticket.is_done(),
            None => true,
        }
    }

    /// A get: the length of the object version it reads (the version is fixed when the get
    /// starts; its bytes are what the get returns). None for a put, or an op the engine refused.
    #[getter]
    fn object_len_bytes(&self) -> Option<u64> {
        self.object_len_bytes
    }

    fn __repr__(&self) -> String {
        let state = match (&self.result, self.is_done()) {
            (Some(Ok(())), _) => "ok",
            (Some(Err(_)), _) => "failed",
            (None, true) => "done",
            (None, false) => "running",
        };
        format!("<teraio.Handle {state}>")
    }
}

impl Drop for Handle {
    fn drop(&mut self) {
        // The memory must stay valid until the engine is done with it; wait without the GIL.
        if let Some(ticket) = self.ticket.take() {
            Python::with_gil(|py| py.allow_threads(|| drop(ticket.wait())));
        }
    }
}

/// A teraio store: tensor objects striped over one or more devices (files or block devices).
#[pyclass(module = "teraio._native", frozen)]
struct Store {
    /// The engine store, until `close` takes it out. Every call holds a share of it for its
    /// length (`InCall`); `close` waits until it holds the only one.
    inner: std::sync::Mutex<Option<std::sync::Arc<EngineStore>>>,
    /// Told whenever a call lets go of its share (under `inner`'s lock, so `close` never misses it).
    call_ended: std::sync::Condvar,
}

/// One call's share of the engine store: `close` waits for it to be dropped.
struct InCall<'a> {
    store: Option<std::sync::Arc<EngineStore>>,
    owner: &'a Store,
}

impl std::ops::Deref for InCall<'_> {
    type Target = EngineStore;
    fn deref(&self) -> &EngineStore {
        self.store.as_ref().expect("a call holds the store until it ends")
    }
}

impl Drop for InCall<'_> {
    fn drop(&mut self) {
        let lock = self.owner.inner.lock().expect("store lock");
        drop(self.store.take());
        drop(lock);
        self.owner.call_ended.notify_all();
    }
}

impl Store {
    fn new(store: EngineStore) -> Store {
        Store { inner: std::sync::Mutex::new(Some(std::sync::Arc::new(store))), call_ended: std::sync::Condvar::new() }
    }

    /// The open engine store for one call; ClosedError once `close` has begun.
    fn store(&self) -> PyResult<InCall<'_>> {
        let store = self
            .inner
            .lock()
            .expect("store lock")
            .clone()
            .ok_or_else(|| ClosedError::new_err("the store is closed"))?;
        Ok(InCall { store: Some(store), owner: self })
    }
}

/// One keyword argument's value, owned while the engine's option table reads it.
enum KeywordValue {
    Flag(bool),
    Count(u64),
    Text(String),
    Unset,
}

impl KeywordValue {
    fn extract(name: &str, value: &Bound<'_, PyAny>) -> PyResult<Self> {
        if value.is_none() {
            Ok(KeywordValue::Unset)
        } else if let Ok(flag) = value.downcast::<pyo3::types::PyBool>() {
            Ok(KeywordValue::Flag(flag.is_true()))
        } else if let Ok(text) = value.extract::<String>() {
            Ok(KeywordValue::Text(text))
        } else if let Ok(count) = value.extract::<u64>() {
            Ok(KeywordValue::Count(count))
        } else if value.is_instance_of::<PyFloat>() {
            // A float of bytes (`file_size_bytes=5.5e9`) reads as the size text it spells, so
            // size options round it down as every size is (teraio-units); count options refuse it.
            Ok(KeywordValue::Text(value.extract::<f64>()?.to_string()))
        } else {
            let shown = value.repr().map(|r| r.to_string()).unwrap_or_else(|_| "?".into());
            Err(InvalidArgumentError::new_err(format!(
                "{name}={shown}: store options take a bool, an int >= 0, a float of bytes, a str or None"
            )))
        }
    }

    fn as_option(&self) -> OptionValue<'_> {
        match self {
            KeywordValue::Flag(flag) => OptionValue::Flag(*flag),
            KeywordValue::Count(count) => OptionValue::Count(*count),
            KeywordValue::Text(text) => OptionValue::Text(text),
            KeywordValue::Unset => OptionValue::Unset,
        }
    }
}

/// The store configurations from `create`'s or `open`'s keyword arguments, through the engine's
/// option table (`teraio_engine::options`): unknown names and wrong kinds are refused there.
fn store_configs_from(options: Option<&Bound<'_, PyDict>>, creating: bool) -> PyResult<StoreConfigs> {
    let mut values = Vec::new();
    for (name, value) in options.into_iter().flat_map(|dict| dict.iter()) {
        let name: String = name.extract()?;
        let value = KeywordValue::extract(&name, &value)?;
        values.push((name, value));
    }
    store_configs(values.iter().map(|(name, value)| (name.as_str(), value.as_option())), creating).map_err(to_py_err)
}

/// The option table as Python sees it (`teraio._native.STORE_OPTIONS`): one dict per option.
fn store_options_table(py: Python<'_>) -> PyResult<Vec<Bound<'_, PyDict>>> {
    STORE_OPTIONS
        .iter()
        .map(|option| {
            let dict = PyDict::new(py);
            dict.set_item("name", option.name)?;
            dict.set_item("stage", if option.stage == OptionStage::Format { "format" } else { "open" })?;
            dict.set_item("type", option.kind.python_type())?;
            dict.set_item("accepts_size_text", option.kind == OptionKind::Bytes)?;
            dict.set_item("optional", option.optional)?;
            match option.default {
                OptionValue::Flag(flag) => dict.set_item("default", flag)?,
                OptionValue::Count(count) => dict.set_item("default", count)?,
                OptionValue::Text(text) => dict.set_item("default", text)?,
                OptionValue::Unset => dict.set_item("default", py.None())?,
            }
            dict.set_item("c_field", option.c_field)?;
            dict.set_item("doc", option.doc)?;
            Ok(dict)
        })
        .collect()
}

#[pymethods]
impl Store {
    /// Formats `paths` as a new store and opens it. Keyword arguments: the store options
    /// (`STORE_OPTIONS`, format and open ones); missing regular files are created with
    /// `file_size_bytes`.
    #[staticmethod]
    #[pyo3(signature = (paths, **options))]
    fn create(py: Python<'_>, paths: Vec<PathBuf>, options: Option<&Bound<'_, PyDict>>) -> PyResult<Store> {
        let StoreConfigs { format, open } = store_configs_from(options, true)?;
        let store = py.allow_threads(|| EngineStore::create(&paths, &format, open)).map_err(to_py_err)?;
        Ok(Store::new(store))
    }

    /// Opens the existing store on `paths` (all of its devices, in any order). Keyword
    /// arguments: the open-stage store options (`STORE_OPTIONS`).
    #[staticmethod]
    #[pyo3(signature = (paths, **options))]
    fn open(py: Python<'_>, paths: Vec<PathBuf>, options: Option<&Bound<'_, PyDict>>) -> PyResult<Store> {
        let StoreConfigs { open, .. } = store_configs_from(options, false)?;
        let store = py.allow_threads(|| EngineStore::open(&paths, open)).map_err(to_py_err)?;
        Ok(Store::new(store))
    }

    /// Opens the store on `paths` read-only (`Store::open_read_only`): beside a writer that may
    /// hold it, under a shared lock, writing nothing; puts, deletes and checkpoints are refused.
    /// Keyword arguments: as `open`.
    #[staticmethod]
    #[pyo3(signature = (paths, **options))]
    fn open_read_only(py: Python<'_>, paths: Vec<PathBuf>, options: Option<&Bound<'_, PyDict>>) -> PyResult<Store> {
        let StoreConfigs { open, .. } = store_configs_from(options, false)?;
        let store = py.allow_threads(|| EngineStore::open_read_only(&paths, open)).map_err(to_py_err)?;
        Ok(Store::new(store))
    }

    /// Starts writing `length` bytes at host address `address` as object `id`.
    ///
    /// Unsafe contract (the Python layer keeps it): the memory is valid for reads and unchanged
    /// until the handle is done; `owner` is kept alive by the handle until then.
    #[pyo3(signature = (id, address, length, owner, meta=None, urgent=false))]
    #[allow(clippy::too_many_arguments)]
    fn put_address(
        &self,
        py: Python<'_>,
        id: ObjectId,
        address: usize,
        length: usize,
        owner: PyObject,
        meta: Option<MetaBytes>,
        urgent: bool,
    ) -> PyResult<Handle> {
        let id = id.0;
        if address == 0 && length > 0 {
            return Err(InvalidArgumentError::new_err("null address"));
        }
        let store = self.store()?;
        // SAFETY: the caller guarantees the memory; the handle keeps `owner` until done.
        let ticket = py.allow_threads(|| unsafe {
            store.put_raw_ticket(id, address as *const u8, length, &meta_bytes(meta), priority(urgent))
        });
        Ok(Handle::started(ticket.map(AnyTicket::Host), owner, false))
    }

    /// Starts reading object `id` from byte `offset` into `length` bytes at `address`. With
    /// `whole`, the whole object is read and `length` may exceed it.
    ///
    /// Unsafe contract: the memory is valid for writes and not otherwise used until the handle is
    /// done; `owner` is kept alive by the handle until then.
    #[pyo3(signature = (id, address, length, owner, offset=0, whole=true, urgent=false))]
    #[allow(clippy::too_many_arguments)]
    fn get_address(
        &self,
        py: Python<'_>,
        id: ObjectId,
        address: usize,
        length: usize,
        owner: PyObject,
        offset: u64,
        whole: bool,
        urgent: bool,
    ) -> PyResult<Handle> {
        let id = id.0;
        if address == 0 && length > 0 {
            return Err(InvalidArgumentError::new_err("null address"));
        }
        let store = self.store()?;
        // SAFETY: as documented above.
        let ticket = py.allow_threads(|| unsafe {
            store.get_raw_ticket(id, offset, address as *mut u8, length, whole, priority(urgent))
        });
        Ok(Handle::started(ticket.map(AnyTicket::Host), owner, false))
    }

    /// Starts writing `length` bytes of CUDA device memory at `address` (device `device`) as
    /// object `id`, through the store's GPU path (pinned bounce or cuFile; `gpu_report` says
    /// which and why).
    ///
    /// With `after` (a `CUevent` handle), the engine starts reading the memory once that event
    /// has completed, as it was recorded when this is called (the event may be recorded again or
    /// destroyed afterwards); without it, at once.
    ///
    /// Unsafe contract (the Python layer keeps it): the memory is device memory of that device,
    /// its contents are final (the producing stream was synchronized, or its work is recorded in
    /// `after`) and unchanged until the handle is done; `after` is a live event; `owner` is kept
    /// alive by the handle until then.
    #[pyo3(signature = (id, address, length, device, owner, meta=None, urgent=false, after=None))]
    #[allow(clippy::too_many_arguments)]
    fn put_device(
        &self,
        py: Python<'_>,
        id: ObjectId,
        address: u64,
        length: usize,
        device: u32,
        owner: PyObject,
        meta: Option<MetaBytes>,
        urgent: bool,
        after: Option<u64>,
    ) -> PyResult<Handle> {
        let id = id.0;
        let after = raw_event(after)?;
        let store = self.store()?;
        let slice = teraio_engine::cuda::DeviceSlice { ptr: address, len: length, device };
        // SAFETY: as documented above; the engine checks that the pointer is device memory.
        let ticket = py.allow_threads(|| unsafe {
            store.put_gpu_raw_after(id, slice, &meta_bytes(meta), priority(urgent), after.map(|e| e as _))
        });
        Ok(Handle::started(ticket.map(AnyTicket::Gpu), owner, true))
    }

    /// Starts reading object `id` from byte `offset` into `length` bytes of CUDA device memory at
    /// `address` through the store's GPU path. With `whole`, the whole object is read.
    ///
    /// With `after` (a `CUevent` handle), the engine starts once that event has completed (as
    /// `put_device`).
    ///
    /// Unsafe contract: the memory is device memory of that device, not otherwise used until the
    /// handle is done (with `after`: from the event's completion on); `after` is a live event;
    /// `owner` is kept alive by the handle until then.
    #[pyo3(signature = (id, address, length, device, owner, offset=0, whole=true, urgent=false, after=None))]
    #[allow(clippy::too_many_arguments)]
    fn get_device(
        &self,
        py: Python<'_>,
        id: ObjectId,
        address: u64,
        length: usize,
        device: u32,
        owner: PyObject,
        offset: u64,
        whole: bool,
        urgent: bool,
        after: Option<u64>,
    ) -> PyResult<Handle> {
        let id = id.0;
        let after = raw_event(after)?;
        let store = self.store()?;
        let slice = teraio_engine::cuda::DeviceSlice { ptr: address, len: length, device };
        // SAFETY: as documented above.
        let ticket = py.allow_threads(|| unsafe {
            store.get_gpu_raw_after(id, offset, slice, whole, priority(urgent), after.map(|e| e as _))
        });
        Ok(Handle::started(ticket.map(AnyTicket::Gpu), owner, true))
    }

    /// What the store chose for GPU I/O and why (one line), or None before the first GPU op.
    fn gpu_report(&self) -> PyResult<Option<String>> {
        Ok(self.store()?.gpu_report().map(|r| r.to_string()))
    }

    /// Writes `data` as object `id` and waits until it is acknowledged.
    #[pyo3(signature = (id, data, meta=None))]
    fn put_bytes(&self, py: Python<'_>, id: ObjectId, data: Vec<u8>, meta: Option<MetaBytes>) -> PyResult<()> {
        let id = id.0;
        let store = self.store()?;
        let meta = meta_bytes(meta);
        py.allow_threads(|| store.put_blocking(id, &data, &meta)).map_err(to_py_err)
    }

    /// Reads the whole of object `id`.
    fn get_bytes<'py>(&self, py: Python<'py>, id: ObjectId) -> PyResult<Bound<'py, pyo3::types::PyBytes>> {
        let id = id.0;
        let store = self.store()?;
        let data = py.allow_threads(|| store.get_to_vec(id)).map_err(to_py_err)?;
        Ok(pyo3::types::PyBytes::new(py, &data))
    }

    /// Deletes object `id`; returns whether it existed.
    fn delete(&self, py: Python<'_>, id: ObjectId) -> PyResult<bool> {
        let id = id.0;
        let store = self.store()?;
        py.allow_threads(|| store.delete(id)).map_err(to_py_err)
    }

    /// Deletes objects `ids` in one journal batch; returns whether each existed.
    fn delete_many(&self, py: Python<'_>, ids: Vec<ObjectId>) -> PyResult<Vec<bool>> {
        let ids: Vec<u64> = ids.into_iter().map(|id| id.0).collect();
        let store = self.store()?;
        py.allow_threads(|| store.delete_many(&ids)).map_err(to_py_err)
    }

    /// Object metadata as a dict (`id`, `len_bytes`, `meta`, `devices`, `extent_count`), or None.
    fn stat<'py>(&self, py: Python<'py>, id: ObjectId) -> PyResult<Option<Bound<'py, PyDict>>> {
        let id = id.0;
        let store = self.store()?;
        store.stat(id).map(|info| object_dict(py, &info)).transpose()
    }

    /// Every object, as `stat` dicts.
    fn list<'py>(&self, py: Python<'py>) -> PyResult<Vec<Bound<'py, PyDict>>> {
        let store = self.store()?;
        store.list().iter().map(|info| object_dict(py, info)).collect()
    }

    /// Store layout, devices and backend, as a dict.
    fn info<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let store = self.store()?;
        let info = store.info();
        let dict = PyDict::new(py);
        dict.set_item("uuid", &info.uuid)?;
        dict.set_item("format_version", info.format_version)?;
        dict.set_item("block_size", info.block_size)?;
        dict.set_item("stripe_unit_bytes", info.stripe_unit_bytes)?;
        dict.set_item("checksums", info.checksums)?;
        dict.set_item("object_count", info.object_count)?;
        dict.set_item("object_bytes", info.object_bytes)?;
        dict.set_item("backend", &info.backend)?;
        dict.set_item("backend_reason", &info.backend_reason)?;
        dict.set_item("checkpoint_slot_bytes", info.checkpoint_slot_bytes)?;
        dict.set_item("table_bytes", info.table_bytes)?;
        dict.set_item("recovery_problems", &info.recovery_problems)?;
        dict.set_item("recovery_notes", &info.recovery_notes)?;
        dict.set_item("repairs_at_open", &info.repairs_at_open)?;
        let mut devices = Vec::new();
        for device in &info.devices {
            let d = PyDict::new(py);
            d.set_item("index", device.index)?;
            d.set_item("path", device.path.to_string_lossy().to_string())?;
            d.set_item("size_bytes", device.size_bytes)?;
            d.set_item("data_bytes", device.data_bytes)?;
            d.set_item("free_bytes", device.free_bytes)?;
            d.set_item("is_block_device", device.is_block_device)?;
            devices.push(d);
        }
        dict.set_item("devices", devices)?;
        Ok(dict)
    }

    /// Device I/O totals over the store since open: `read_ops`, `read_bytes`, `write_ops`,
    /// `write_bytes`, `flush_ops`, `errors`, `retries`, `urgent_ops`, and `backend`.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let snapshot = self.store()?.stats();
        let total = &snapshot.total;
        let dict = PyDict::new(py);
        dict.set_item("backend", &snapshot.backend)?;
        dict.set_item("read_ops", total.read_ops)?;
        dict.set_item("read_bytes", total.read_bytes)?;
        dict.set_item("write_ops", total.write_ops)?;
        dict.set_item("write_bytes", total.write_bytes)?;
        dict.set_item("flush_ops", total.flush_ops)?;
        dict.set_item("errors", total.errors)?;
        dict.set_item("retries", total.retries)?;
        dict.set_item("urgent_ops", total.urgent_ops)?;
        Ok(dict)
    }

    /// Engine counters (ops, bytes, latencies) as text; for logs.
    fn stats_text(&self) -> PyResult<String> {
        Ok(format!("{:#?}", self.store()?.stats()))
    }

    /// The block size: host buffers aligned to it (address and length) skip the bounce copy.
    fn block_size(&self) -> PyResult<u64> {
        Ok(self.store()?.block_size())
    }

    /// Closes the store. Calls that begin after this raise ClosedError; calls already running
    /// in other threads (each one put, get, delete, stat...) are waited for, then the engine
    /// waits for the I/O in flight, writes a checkpoint and releases the locks. The wait is
    /// bounded by those calls: none can start once the close has begun. Closing twice is allowed.
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        let taken = self.inner.lock().expect("store lock").take();
        let Some(store) = taken else { return Ok(()) };
        py.allow_threads(|| {
            let mut lock = self.inner.lock().expect("store lock");
            while std::sync::Arc::strong_count(&store) > 1 {
                lock = self.call_ended.wait(lock).expect("store lock");
            }
            drop(lock);
            let store = std::sync::Arc::try_unwrap(store).ok().expect("no call holds the store once all have ended");
            store.close()
        })
        .map_err(to_py_err)
    }

    fn is_closed(&self) -> bool {
        self.inner.lock().expect("store lock").is_none()
    }
}

fn object_dict<'py>(py: Python<'py>, info: &teraio_engine::ObjectInfo) -> PyResult<Bound<'py, PyDict>> {
    let dict = PyDict::new(py);
    dict.set_item("id", info.id)?;
    dict.set_item("len_bytes", info.len_bytes)?;
    dict.set_item("meta", pyo3::types::PyBytes::new(py, &info.meta))?;
    dict.set_item("devices", info.devices.clone())?;
    dict.set_item("extent_count", info.extent_count)?;
    Ok(dict)
}

/// A trace from its JSON text, checked against the format's rules.
fn parse_trace(trace_json: &str) -> PyResult<Trace> {
    let trace: Trace =
        serde_json::from_str(trace_json).map_err(|e| PlannerError::new_err(format!("trace is not valid JSON: {e}")))?;
    trace.validate().map_err(planner_err)?;
    Ok(trace)
}

// The arguments mirror the Python keyword arguments one to one.
#[allow(clippy::too_many_arguments)]
fn hardware_from(
    gpu_memory_bytes: u64,
    ssd_read_bytes_per_s: f64,
    ssd_write_bytes_per_s: f64,
    host_memory_bytes: u64,
    host_link_bytes_per_s: f64,
    ssd_latency_us: f64,
    host_latency_us: f64,
    ssd_shared: bool,
    ssd_via_host_link: bool,
) -> PyResult<Hardware> {
    let ssd = ReadWriteBandwidth { read_bytes_per_s: ssd_read_bytes_per_s, write_bytes_per_s: ssd_write_bytes_per_s };
    let mut hardware = Hardware::new(gpu_memory_bytes, ssd, host_memory_bytes);
    hardware.host_link_bytes_per_s = host_link_bytes_per_s;
    hardware.ssd_latency_us = ssd_latency_us;
    hardware.host_latency_us = host_latency_us;
    hardware.ssd_shared = ssd_shared;
    hardware.ssd_via_host_link = ssd_via_host_link;
    hardware.validate().map_err(planner_err)?;
    Ok(hardware)
}

/// Plans migrations for a trace (JSON, docs/trace.md) and predicts the iteration with the
/// simulator: `teraio_planner::predict::plan_and_predict`, the call `teraio plan` makes. Returns
/// its `PlanAndPrediction` as JSON, `{"prediction": {...}, "plan": <plan file>}`, the document
/// `teraio plan --json` prints.
///
/// `movable_kinds` limits what the plan may move to the kinds the runtime can execute (the others
/// are pinned: they keep their memory for their whole live range).
#[pyfunction]
#[pyo3(signature = (trace_json, *, gpu_memory_bytes, ssd_read_bytes_per_s, ssd_write_bytes_per_s,
    host_memory_bytes=0, host_link_bytes_per_s=25e9, ssd_latency_us=20.0, host_latency_us=10.0,
    reserve_bytes=0, prefetch_slack=1.0, movable_kinds=None, ssd_shared=false, ssd_via_host_link=false,
    tier_preference="ssd"))]
#[allow(clippy::too_many_arguments)]
fn plan(
    py: Python<'_>,
    trace_json: &str,
    gpu_memory_bytes: u64,
    ssd_read_bytes_per_s: f64,
    ssd_write_bytes_per_s: f64,
    host_memory_bytes: u64,
    host_link_bytes_per_s: f64,
    ssd_latency_us: f64,
    host_latency_us: f64,
    reserve_bytes: u64,
    prefetch_slack: f64,
    movable_kinds: Option<Vec<String>>,
    ssd_shared: bool,
    ssd_via_host_link: bool,
    tier_preference: &str,
) -> PyResult<String> {
    let trace = parse_trace(trace_json)?;
    let hardware = hardware_from(
        gpu_memory_bytes,
        ssd_read_bytes_per_s,
        ssd_write_bytes_per_s,
        host_memory_bytes,
        host_link_bytes_per_s,
        ssd_latency_us,
        host_latency_us,
        ssd_shared,
        ssd_via_host_link,
    )?;
    // A misspelt name is the caller's bad argument (ValueError), as for any Python function.
    let value_error = |e: teraio_planner::Error| PyValueError::new_err(e.to_string());
    let movable_kinds = movable_kinds
        .map(|kinds| kinds.iter().map(|k| k.parse::<TensorKind>()).collect::<Result<Vec<_>, _>>())
        .transpose()
        .map_err(value_error)?;
    let tier_preference = tier_preference.parse::<TierPreference>().map_err(value_error)?;
    let planner = PlannerConfig { reserve_bytes, prefetch_slack, tier_preference, ..PlannerConfig::default() };
    let options = PlanOptions { planner, movable_kinds };
    py.allow_threads(move || {
        let result = plan_and_predict(&trace, &hardware, &options).map_err(planner_err)?;
        serde_json::to_string(&result).map_err(|e| PlannerError::new_err(e.to_string()))
    })
}

/// Replays a trace under a plan (JSON plan file text) and returns the simulator's report as JSON.
#[pyfunction]
#[pyo3(signature = (trace_json, plan_json, *, gpu_memory_bytes, ssd_read_bytes_per_s, ssd_write_bytes_per_s,
    host_memory_bytes=0, host_link_bytes_per_s=25e9, ssd_latency_us=20.0, host_latency_us=10.0, ssd_shared=false,
    ssd_via_host_link=false))]
#[allow(clippy::too_many_arguments)]
fn simulate_plan(
    py: Python<'_>,
    trace_json: &str,
    plan_json: &str,
    gpu_memory_bytes: u64,
    ssd_read_bytes_per_s: f64,
    ssd_write_bytes_per_s: f64,
    host_memory_bytes: u64,
    host_link_bytes_per_s: f64,
    ssd_latency_us: f64,
    host_latency_us: f64,
    ssd_shared: bool,
    ssd_via_host_link: bool,
) -> PyResult<String> {
    let trace = parse_trace(trace_json)?;
    let plan: Plan =
        serde_json::from_str(plan_json).map_err(|e| PlannerError::new_err(format!("plan is not valid JSON: {e}")))?;
    plan.check_against(&trace).map_err(planner_err)?;
    let hardware = hardware_from(
        gpu_memory_bytes,
        ssd_read_bytes_per_s,
        ssd_write_bytes_per_s,
        host_memory_bytes,
        host_link_bytes_per_s,
        ssd_latency_us,
        host_latency_us,
        ssd_shared,
        ssd_via_host_link,
    )?;
    py.allow_threads(move || {
        let report = simulate(&trace, &hardware, Policy::Planned(&plan), SimConfig::default()).map_err(planner_err)?;
        serde_json::to_string(&report).map_err(|e| PlannerError::new_err(e.to_string()))
    })
}

/// Replays a runtime's own recorded schedule (`{"transfers": [...], "cpu_jobs": [...]}`: what it
/// issued before each op of the trace, `teraio_planner::replay`) in the simulator on `hardware_json` (the planner's
/// `Hardware`, every field named) and returns the simulator's report as JSON: how long that
/// schedule takes there.
#[pyfunction]
fn replay_schedule(py: Python<'_>, trace_json: &str, schedule_json: &str, hardware_json: &str) -> PyResult<String> {
    let trace = parse_trace(trace_json)?;
    let schedule: Schedule = serde_json::from_str(schedule_json).map_err(|e| {
        PlannerError::new_err(format!("the schedule is not {{\"transfers\": [...], \"cpu_jobs\": [...]}} JSON: {e}"))
    })?;
    let hardware: Hardware = serde_json::from_str(hardware_json)
        .map_err(|e| PlannerError::new_err(format!("the hardware is not the planner's Hardware JSON: {e}")))?;
    hardware.validate().map_err(planner_err)?;
    py.allow_threads(move || {
        let report = replay(&trace, &schedule, &hardware).map_err(planner_err)?;
        serde_json::to_string(&report).map_err(|e| PlannerError::new_err(e.to_string()))
    })
}

/// Checks a trace (JSON) against docs/trace.md; raises PlannerError naming the broken rule.
#[pyfunction]
fn validate_trace(trace_json: &str) -> PyResult<()> {
    parse_trace(trace_json).map(drop)
}

/// Bytes from a size: an int, a float of bytes (`5.5e9`) or a string such as "24GiB", "2G"
/// (powers of 1024), "94GB" (powers of 1000) or "53.86GiB", rounded down to whole bytes: the
/// parser the engine, planner and CLI use (teraio-units); ValueError says why a value is refused.
#[pyfunction]
fn parse_size(value: &Bound<'_, PyAny>) -> PyResult<u64> {
    let parsed = if value.is_instance_of::<PyBool>() {
        return Err(PyValueError::new_err(format!(
            "size must be a number of bytes or a string such as '24GiB', not {value}"
        )));
    } else if value.is_instance_of::<PyString>() {
        teraio_units::parse_size_bytes(&value.extract::<String>()?)
    } else if value.is_instance_of::<PyInt>() {
        let bytes: i128 =
            value.extract().map_err(|_| PyValueError::new_err(format!("size {value} is out of range")))?;
        teraio_units::size_bytes_from_integer(bytes)
    } else if value.is_instance_of::<PyFloat>() {
        teraio_units::size_bytes_from_number(value.extract::<f64>()?)
    } else {
        return Err(PyValueError::new_err(format!(
            "size must be a number of bytes or a string such as '24GiB', not {}",
            value.get_type().name()?
        )));
    };
    parsed.map_err(|e| PyValueError::new_err(e.to_string()))
}

/// Bytes per second from a bandwidth such as "6.5GB/s", "800MiB/s" or "4x6.5GB/s" (teraio-units).
#[pyfunction]
fn parse_bandwidth(text: &str) -> PyResult<f64> {
    teraio_units::parse_bandwidth_bytes_per_s(text).map_err(|e| PyValueError::new_err(e.to_string()))
}

/// What this machine offers for GPU I/O (CUDA driver, devices, cuFile and its mode), as text.
#[pyfunction]
fn gpu_probe(py: Python<'_>) -> String {
    py.allow_threads(|| teraio_engine::cuda::probe().to_string())
}

/// One parameter of a `CpuAdamW.step` call, as addresses: (param f32, grad, grad is bf16,
/// exp_avg f32, exp_avg_sq f32, bf16 copy or None, elements, step).
type AdamTensorAddresses = (usize, usize, bool, usize, usize, Option<usize>, usize, f64);

/// The CPU Adam/AdamW step over host buffers (`teraio_engine::adamw`), on its own threads, with
/// the GIL released while it runs.
#[pyclass(frozen)]
struct CpuAdamW {
    inner: teraio_engine::adamw::AdamW,
}

#[pymethods]
impl CpuAdamW {
    #[new]
    fn new(threads: usize) -> PyResult<Self> {
        let inner = teraio_engine::adamw::AdamW::new(threads).map_err(|e| PyValueError::new_err(e.to_string()))?;
        Ok(CpuAdamW { inner })
    }

    #[getter]
    fn threads(&self) -> usize {
        self.inner.threads()
    }

    /// Steps one parameter group. The caller (`teraio.runtime.modes.cpu_update`) passes the
    /// addresses of live, contiguous CPU tensors of the stated dtypes and `numel` elements, which
    /// nothing else touches until this returns; null, misaligned and overlapping buffers are
    /// refused here before anything is written. `vector_width`: each tensor's last
    /// `numel % vector_width` elements are rounded in the order of torch's scalar tail loop
    /// (`teraio.cpu_adamw.TORCH_TAIL_WIDTH`, 8: where torch's fused CPU kernel puts them with AVX2
    /// and AVX-512 alike); 0: every element in its vector loop's order.
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (*, lr, beta1, beta2, eps, weight_decay, decoupled, maximize, tensors, grad_scale=None, vector_width=8))]
    fn step(
        &self,
        py: Python<'_>,
        lr: f64,
        beta1: f64,
        beta2: f64,
        eps: f64,
        weight_decay: f64,
        decoupled: bool,
        maximize: bool,
        tensors: Vec<AdamTensorAddresses>,
        grad_scale: Option<f32>,
        vector_width: usize,
    ) -> PyResult<()> {
        use teraio_engine::adamw::{Grad, Hyper, Tensor};
        // A tensor of no elements has nothing to step (and its address may be null).
        let tensors: Vec<AdamTensorAddresses> = tensors.into_iter().filter(|t| t.6 > 0).collect();
        check_adam_addresses(&tensors)?;
        let hyper = Hyper { lr, beta1, beta2, eps, weight_decay, decoupled, maximize };
        py.allow_threads(|| {
            let views = tensors
                .iter()
                .map(|&(param, grad, bf16, exp_avg, exp_avg_sq, copy, n, step)| {
                    // SAFETY: checked non-null, aligned and disjoint (`check_adam_addresses`);
                    // live and unshared for the call by the caller's contract above.
                    unsafe {
                        Tensor {
                            param: std::slice::from_raw_parts_mut(param as *mut f32, n),
                            grad: if bf16 {
                                Grad::Bf16(std::slice::from_raw_parts(grad as *const u16, n))
                            } else {
                                Grad::F32(std::slice::from_raw_parts(grad as *const f32, n))
                            },
                            exp_avg: std::slice::from_raw_parts_mut(exp_avg as *mut f32, n),
                            exp_avg_sq: std::slice::from_raw_parts_mut(exp_avg_sq as *mut f32, n),
                            copy: copy.map(|c| std::slice::from_raw_parts_mut(c as *mut u16, n)),
                            step,
                        }
                    }
                })
                .collect();
            self.inner.step(&hyper, views, grad_scale, vector_width)
        })
        .map_err(|e| PyValueError::new_err(e.to_string()))
    }
}

/// Every buffer of a `CpuAdamW.step` call non-null, aligned and within the address space, and
/// no buffer written overlapping any other buffer of the call. Tensors of no elements are left
/// out by the caller (their address may be null).
fn check_adam_addresses(tensors: &[AdamTensorAddresses]) -> PyResult<()> {
    let mut ranges: Vec<(usize, usize, bool)> = Vec::new();
    for (index, &(param, grad, bf16, exp_avg, exp_avg_sq, copy, n, _)) in tensors.iter().enumerate() {
        let grad_size = if bf16 { 2 } else { 4 };
        let buffers = [(param, 4, true), (grad, grad_size, false), (exp_avg, 4, true), (exp_avg_sq, 4, true)];
        for (address, size, writes) in buffers.into_iter().chain(copy.map(|c| (c, 2, true))) {
            if address == 0 || address % size != 0 {
                return Err(PyValueError::new_err(format!(
                    "CpuAdamW.step: tensor {index}: address {address:#x} is null or not aligned to {size} bytes"
                )));
            }
            let end = n.checked_mul(size).and_then(|bytes| address.checked_add(bytes)).ok_or_else(|| {
                PyValueError::new_err(format!("CpuAdamW.step: tensor {index}: {n} elements overflow the address space"))
            })?;
            ranges.push((address, end, writes));
        }
    }
    // By start: a range overlaps an earlier one where it starts before the furthest end so far
    // (of any range, if it is written; of the written ones, if it is read).
    ranges.sort_unstable();
    let (mut furthest, mut furthest_written) = (0, 0);
    for (start, end, writes) in ranges {
        if start < if writes { furthest } else { furthest_written } {
            return Err(PyValueError::new_err("CpuAdamW.step: a buffer it writes overlaps another buffer of the call"));
        }
        furthest = furthest.max(end);
        if writes {
            furthest_written = furthest_written.max(end);
        }
    }
    Ok(())
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add_function(wrap_pyfunction!(gpu_probe, m)?)?;
    m.add_class::<Store>()?;
    m.add_class::<Handle>()?;
    m.add_class::<CpuAdamW>()?;
    m.add_function(wrap_pyfunction!(plan, m)?)?;
    m.add_function(wrap_pyfunction!(simulate_plan, m)?)?;
    m.add_function(wrap_pyfunction!(replay_schedule, m)?)?;
    m.add_function(wrap_pyfunction!(validate_trace, m)?)?;
    m.add_function(wrap_pyfunction!(parse_size, m)?)?;
    m.add_function(wrap_pyfunction!(parse_bandwidth, m)?)?;
    m.add("TeraioError", py.get_type::<TeraioError>())?;
    m.add("NotFoundError", py.get_type::<NotFoundError>())?;
    m.add("NoSpaceError", py.get_type::<NoSpaceError>())?;
    m.add("CorruptError", py.get_type::<CorruptError>())?;
    m.add("LockedError", py.get_type::<LockedError>())?;
    m.add("ClosedError", py.get_type::<ClosedError>())?;
    m.add("DeviceError", py.get_type::<DeviceError>())?;
    m.add("InvalidArgumentError", py.get_type::<InvalidArgumentError>())?;
    m.add("PlannerError", py.get_type::<PlannerError>())?;
    m.add("TRACE_FORMAT_VERSION", teraio_planner::trace::FORMAT_VERSION)?;
    m.add("STORE_OPTIONS", pyo3::types::PyTuple::new(py, store_options_table(py)?)?)?;
    Ok(())
}
