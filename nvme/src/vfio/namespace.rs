//! A VFIO-driven namespace as an engine device, so stores live on it: `Device::open` hands
//! the controller's sysfs path, `/sys/bus/pci/devices/<PCI address>`, here (after [`crate::register`]); the store's synchronous open-time
//! I/O (superblocks, metadata recovery, format) runs on a queue pair of its own, and the
//! `nvme-vfio` backend gives each store worker another one.

use super::backend::VfioBackend;
use super::Controller;
use std::io;
use std::path::Path;
use std::sync::{Arc, Mutex};
use teraio_engine::backend::{Backend, BackendRequest, IoKind};
use teraio_engine::device::ExternalDevice;

/// Store device paths of VFIO namespaces are the controllers' sysfs directories:
/// `/sys/bus/pci/devices/0000:00:04.0` (a path that exists, names the PCI function, and that the
/// kernel never serves I/O on).
pub const PATH_PREFIX: &str = "/sys/bus/pci/devices/";

/// Namespace 1 of a userspace-driven controller.
pub struct VfioNamespace {
    pub controller: Arc<Controller>,
    sync: Mutex<VfioBackend>,
    /// Start addresses of memory already registered with the controller (the stores' slabs).
    registered: Mutex<Vec<usize>>,
}

impl std::fmt::Debug for VfioNamespace {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "VfioNamespace({})", self.controller.bdf)
    }
}

impl VfioNamespace {
    pub fn open(bdf: &str) -> crate::Result<VfioNamespace> {
        let controller = Controller::open(bdf)?;
        let sync = Mutex::new(VfioBackend::new(controller.clone(), 1)?);
        Ok(VfioNamespace { controller, sync, registered: Mutex::new(Vec::new()) })
    }

    /// Registers [base, base+len) with the controller once (later calls for the same base are no-ops).
    pub fn register_once(&self, base: *mut u8, len: usize) -> crate::Result<()> {
        let mut done = self.registered.lock().expect("registered");
        if !done.contains(&(base as usize)) {
            self.controller.register(base, len)?;
            done.push(base as usize);
        }
        Ok(())
    }

    fn run(&self, kind: IoKind, buf: *mut u8, len: usize, offset: u64) -> io::Result<()> {
        let mut backend = self.sync.lock().expect("sync queue");
        // SAFETY: `buf` is valid for `len` bytes for this whole call, which waits for completion.
        unsafe { backend.push(BackendRequest { token: 0, kind, offset, buf, len: len as u32, fixed_index: None }) };
        let mut out = Vec::with_capacity(1);
        while out.is_empty() {
            backend.submit_and_reap(true, &mut out)?;
        }
        match out[0].result {
            r if r < 0 => Err(io::Error::from_raw_os_error(-r)),
            _ => Ok(()),
        }
    }

    fn chunked(&self, kind: IoKind, buf: *mut u8, len: usize, offset: u64) -> io::Result<()> {
        // One request per 1 GiB at most (the request length is a u32).
        let mut done = 0usize;
        while done < len {
            let n = (len - done).min(1 << 30);
            // SAFETY: inside the caller's buffer.
            self.run(kind, unsafe { buf.add(done) }, n, offset + done as u64)?;
            done += n;
        }
        Ok(())
    }
}

impl ExternalDevice for VfioNamespace {
    fn size_bytes(&self) -> u64 {
        self.controller.namespace.size_bytes()
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        self.chunked(IoKind::Read, buf.as_mut_ptr(), buf.len(), offset)
    }
    fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        // The backend only reads from the buffer for a write.
        self.chunked(IoKind::Write, buf.as_ptr() as *mut u8, buf.len(), offset)
    }
    fn flush(&self) -> io::Result<()> {
        self.run(IoKind::Flush, std::ptr::null_mut(), 0, 0)
    }
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

/// The engine's opener for `/sys/bus/pci/devices/<PCI address>` paths.
pub fn open_device(path: &Path) -> teraio_engine::Result<Option<Arc<dyn ExternalDevice>>> {
    let Some(bdf) = path.to_str().and_then(|p| p.strip_prefix(PATH_PREFIX)).map(|b| b.trim_end_matches('/')) else {
        return Ok(None);
    };
    match VfioNamespace::open(bdf) {
        Ok(ns) => Ok(Some(Arc::new(ns))),
        Err(e) => {
            Err(teraio_engine::Error::DeviceOpen { path: path.to_path_buf(), source: io::Error::other(e.to_string()) })
        }
    }
}
