//! io_uring NVMe passthrough: NVMe read/write/flush commands sent as `IORING_OP_URING_CMD` to the
//! namespace's generic character device (/dev/ngXnY). No file system and no block-layer request
//! merging or scheduling: the kernel maps the buffer and hands our command to the driver.
//!
//! Big SQEs/CQEs (128/32 bytes) carry the 72-byte `nvme_uring_cmd`; the engine's bounce slab is
//! registered once so its requests use `IORING_URING_CMD_FIXED`; with `iopoll` completions are
//! polled (this needs the nvme driver's poll queues: `nvme.poll_queues=N`). Requests longer than
//! the namespace's transfer limit (MDTS, and the kernel's `max_hw_sectors_kb`/`max_segments`) are
//! split into several commands and completed as one.

use crate::error::{NvmeError, Result};
use crate::spec::{self, ControllerInfo, NamespaceInfo};
use io_uring::{cqueue, opcode, squeue, types, IoUring};
use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use teraio_engine::backend::{Backend, BackendCompletion, BackendRequest, IoKind, Waker};

/// `_IO('N', 0x40)`: the namespace id of an NVMe namespace device.
const NVME_IOCTL_ID: libc::c_ulong = 0x4E40;
/// `_IOWR('N', 0x41, struct nvme_admin_cmd)`.
const NVME_IOCTL_ADMIN_CMD: libc::c_ulong = 0xC048_4E41;
/// `_IOWR('N', 0x80, struct nvme_uring_cmd)`: the io_uring command op for NVMe I/O commands.
const NVME_URING_CMD_IO: u32 = 0xC048_4E80;

/// The largest transfer we ever issue as one command, whatever the device says.
const MAX_TRANSFER_BYTES_CAP: u64 = 8 << 20;
/// The most requests a passthrough ring may hold in flight (each may be several commands).
pub const MAX_DEPTH: usize = 4096;
/// The most fixed buffers one ring may register (the kernel's IORING_MAX_REG_BUFFERS).
const MAX_REGISTERED_BUFFERS: usize = 1 << 14;
const WAKE_TOKEN: u64 = u64::MAX;

/// `struct nvme_passthru_cmd` / `struct nvme_uring_cmd` (identical layout, 72 bytes; the last
/// field is `result` for the ioctl and reserved for io_uring).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
struct PassthruCmd {
    opcode: u8,
    flags: u8,
    rsvd1: u16,
    nsid: u32,
    cdw2: u32,
    cdw3: u32,
    metadata: u64,
    addr: u64,
    metadata_len: u32,
    data_len: u32,
    cdw10: u32,
    cdw11: u32,
    cdw12: u32,
    cdw13: u32,
    cdw14: u32,
    cdw15: u32,
    timeout_ms: u32,
    result: u32,
}
const _: () = assert!(std::mem::size_of::<PassthruCmd>() == 72);

impl PassthruCmd {
    fn to_bytes(self) -> [u8; 80] {
        let mut out = [0u8; 80];
        // SAFETY: PassthruCmd is repr(C), 72 bytes of plain integers without padding.
        let bytes: [u8; 72] = unsafe { std::mem::transmute(self) };
        out[..72].copy_from_slice(&bytes);
        out
    }
}

/// A namespace as identify reports it, plus the transfer limit the kernel enforces.
#[derive(Debug, Clone)]
pub struct Namespace {
    pub char_path: PathBuf,
    pub nsid: u32,
    pub controller: ControllerInfo,
    pub namespace: NamespaceInfo,
    /// Largest single command in bytes (MDTS, max_hw_sectors_kb, max_segments; at most 8 MiB).
    pub max_transfer_bytes: u64,
}

/// `/dev/nvme0n1` -> `/dev/ng0n1`; a `/dev/ngXnY` path is returned as is.
pub fn char_device_for(path: &Path) -> Result<PathBuf> {
    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
    let rest = if let Some(r) = name.strip_prefix("nvme") {
        r
    } else if let Some(r) = name.strip_prefix("ng") {
        r
    } else {
        return Err(NvmeError::NotANamespace { path: path.to_path_buf() });
    };
    let (ctrl, ns) = rest.split_once('n').ok_or_else(|| NvmeError::NotANamespace { path: path.to_path_buf() })?;
    if ctrl.is_empty() || ns.is_empty() || !ctrl.chars().chain(ns.chars()).all(|c| c.is_ascii_digit()) {
        return Err(NvmeError::NotANamespace { path: path.to_path_buf() });
    }
    Ok(PathBuf::from(format!("/dev/ng{ctrl}n{ns}")))
}

fn admin_identify(file: &File, path: &Path, nsid: u32, cns: u32) -> Result<Vec<u8>> {
    let mut page = vec![0u8; 4096];
    let mut cmd = PassthruCmd {
        opcode: spec::ADMIN_IDENTIFY,
        nsid,
        addr: page.as_mut_ptr() as u64,
        data_len: 4096,
        cdw10: cns,
        ..Default::default()
    };
    // SAFETY: the ioctl reads `cmd` and writes at most data_len bytes into `page`, both alive.
    let rc = unsafe { libc::ioctl(file.as_raw_fd(), NVME_IOCTL_ADMIN_CMD, &mut cmd) };
    if rc < 0 {
        return Err(NvmeError::Ioctl {
            what: "identify",
            path: path.to_path_buf(),
            source: io::Error::last_os_error(),
        });
    }
    if rc > 0 {
        let status = rc as u16;
        return Err(NvmeError::CommandFailed {
            device: path.display().to_string(),
            what: "identify",
            sct: ((status >> 8) & 0x7) as u8,
            sc: (status & 0xff) as u8,
        });
    }
    Ok(page)
}

fn sysfs_u64(path: &str) -> Option<u64> {
    std::fs::read_to_string(path).ok()?.trim().parse().ok()
}

/// Identifies the namespace behind `path` (/dev/nvmeXnY or /dev/ngXnY) through the kernel's
/// admin passthrough ioctl, and checks that teraio can use its LBA format.
pub fn identify(path: &Path) -> Result<Namespace> {
    let char_path = char_device_for(path)?;
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .open(&char_path)
        .map_err(|source| NvmeError::NoCharDevice { path: char_path.clone(), source })?;
    // SAFETY: NVME_IOCTL_ID takes no argument and returns the nsid.
    let nsid = unsafe { libc::ioctl(file.as_raw_fd(), NVME_IOCTL_ID) };
    if nsid <= 0 {
        return Err(NvmeError::Ioctl { what: "NVME_IOCTL_ID", path: char_path, source: io::Error::last_os_error() });
    }
    let nsid = nsid as u32;
    let controller = ControllerInfo::parse(&admin_identify(&file, &char_path, 0, spec::CNS_CONTROLLER)?);
    let namespace = NamespaceInfo::parse(&admin_identify(&file, &char_path, nsid, spec::CNS_NAMESPACE)?);
    let device = char_path.display().to_string();
    if namespace.metadata_bytes != 0 {
        return Err(NvmeError::UnsupportedLbaFormat { device, metadata_bytes: namespace.metadata_bytes });
    }
    if !namespace.lba_bytes.is_power_of_two() || !(512..=65536).contains(&namespace.lba_bytes) {
        return Err(NvmeError::UnsupportedBlockSize { device, lba_bytes: namespace.lba_bytes });
    }
    // The kernel's limits for this queue (passthrough requests are refused above them).
    let name = char_path.file_name().unwrap().to_string_lossy().replacen("ng", "nvme", 1);
    let mut max = controller.max_transfer_bytes(4096, MAX_TRANSFER_BYTES_CAP);
    if let Some(kb) = sysfs_u64(&format!("/sys/block/{name}/queue/max_hw_sectors_kb")) {
        max = max.min(kb * 1024);
    }
    if let Some(segments) = sysfs_u64(&format!("/sys/block/{name}/queue/max_segments")) {
        // Registered buffers are mapped page by page: one segment per 4 KiB page at worst.
        max = max.min(segments.saturating_sub(1).max(1) * 4096);
    }
    let max_transfer_bytes = (max / namespace.lba_bytes as u64).max(1) * namespace.lba_bytes as u64;
    Ok(Namespace { char_path, nsid, controller, namespace, max_transfer_bytes })
}

/// The first kernel release on which we allow polled passthrough completions.
pub const IOPOLL_MIN_KERNEL: (u32, u32) = (6, 6);

/// Polled passthrough completions crash Linux 6.1 (a general protection fault in `bio_poll`
/// under `nvme_ns_chr_uring_cmd_iopoll`, seen with Debian's 6.1.0 when several rings poll); the
/// passthrough IOPOLL path was reworked in later releases. We refuse it below 6.6 (the next LTS).
pub fn check_iopoll_kernel() -> Result<()> {
    // SAFETY: uname fills the struct.
    let mut u: libc::utsname = unsafe { std::mem::zeroed() };
    // SAFETY: a system call on our own fd/struct, whose arguments outlive it.
    unsafe { libc::uname(&mut u) };
    // SAFETY: release is a NUL-terminated string.
    let release = unsafe { std::ffi::CStr::from_ptr(u.release.as_ptr()) }.to_string_lossy().to_string();
    let mut parts = release.split(|c: char| !c.is_ascii_digit()).filter_map(|p| p.parse::<u32>().ok());
    let version = (parts.next().unwrap_or(0), parts.next().unwrap_or(0));
    if version < IOPOLL_MIN_KERNEL {
        return Err(NvmeError::Config(format!(
            "polled NVMe passthrough (iopoll) is disabled on Linux {release}: it crashes the kernel before {}.{} \
             (use-after-free in nvme_ns_chr_uring_cmd_iopoll); use interrupt completions (nvme-passthru)",
            IOPOLL_MIN_KERNEL.0, IOPOLL_MIN_KERNEL.1
        )));
    }
    Ok(())
}

/// Options of a passthrough backend.
#[derive(Debug, Clone, Copy, Default)]
pub struct PassthruOptions {
    /// Polled completions (IORING_SETUP_IOPOLL); needs `nvme.poll_queues` > 0. Default off.
    pub iopoll: bool,
}

/// One in-flight engine request, possibly split into several NVMe commands.
#[derive(Debug, Clone, Copy)]
struct Parent {
    token: u64,
    pieces_left: u32,
    bytes: u32,
    error: i32,
}

/// The passthrough backend for one namespace.
pub struct PassthruBackend {
    ring: IoUring<squeue::Entry128, cqueue::Entry32>,
    namespace: Namespace,
    lba_shift: u32,
    depth: usize,
    parents: Vec<Option<Parent>>,
    free_parents: Vec<usize>,
    /// Requests finished without reaching the device (misaligned ones).
    ready: Vec<BackendCompletion>,
    /// Registered areas: (start, length, index of their first fixed buffer). Each area is
    /// registered as fixed buffers of `chunk_bytes`: a command's buffer must lie in one of them.
    registered: Vec<(usize, usize, usize)>,
    /// Bytes of each fixed buffer: the transfer limit, because Linux 6.1 counts every segment
    /// of a fixed buffer from the command's start to the buffer's end against the queue's
    /// max_segments and refuses longer ones with EINVAL.
    chunk_bytes: usize,
    eventfd: Arc<OwnedFd>,
    eventfd_value: Box<u64>,
    eventfd_armed: bool,
    iopoll: bool,
    /// Kept open for the ring's lifetime (the ring refers to it by its registered index).
    _file: File,
}

impl PassthruBackend {
    /// Opens the namespace's character device and builds a ring for `depth` requests in flight;
    /// `buffers` are registered as fixed buffers (at most 1 GiB each is used per registration).
    pub fn new(path: &Path, depth: usize, options: PassthruOptions, buffers: &[(*mut u8, usize)]) -> Result<Self> {
        if depth == 0 || depth > MAX_DEPTH {
            return Err(NvmeError::Config(format!("queue depth {depth} must be in 1..={MAX_DEPTH}")));
        }
        if options.iopoll {
            check_iopoll_kernel()?;
        }
        let namespace = identify(path)?;
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .open(&namespace.char_path)
            .map_err(|source| NvmeError::NoCharDevice { path: namespace.char_path.clone(), source })?;
        let entries = ((depth + 1).next_power_of_two()).max(8) as u32;
        let mut builder = IoUring::<squeue::Entry128, cqueue::Entry32>::builder();
        if options.iopoll {
            builder.setup_iopoll();
        }
        builder.setup_cqsize(entries * 4);
        let ring = builder.build(entries).map_err(NvmeError::BigRingUnavailable)?;
        ring.submitter().register_files(&[file.as_raw_fd()]).map_err(|source| NvmeError::Ioctl {
            what: "io_uring file registration",
            path: namespace.char_path.clone(),
            source,
        })?;
        let chunk_bytes = namespace.max_transfer_bytes as usize;
        let mut iovecs = Vec::new();
        let mut registered = Vec::new();
        for &(base, len) in buffers {
            // Whole chunks only, from the first 4 KiB boundary.
            let start = (base as usize).div_ceil(4096) * 4096;
            let chunks = (base as usize + len).saturating_sub(start) / chunk_bytes;
            let chunks = chunks.min(MAX_REGISTERED_BUFFERS - iovecs.len());
            if chunks == 0 {
                continue;
            }
            registered.push((start, chunks * chunk_bytes, iovecs.len()));
            for k in 0..chunks {
                iovecs.push(libc::iovec { iov_base: (start + k * chunk_bytes) as *mut _, iov_len: chunk_bytes });
            }
        }
        if !iovecs.is_empty() {
            // SAFETY: the caller keeps the buffers alive as long as the backend.
            if let Err(e) = unsafe { ring.submitter().register_buffers(&iovecs) } {
                tracing::warn!(error = %e, "NVMe passthrough: buffer registration failed; using unregistered buffers");
                registered.clear();
            }
        }
        // SAFETY: eventfd returns a new fd or -1.
        let raw = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC) };
        if raw < 0 {
            return Err(NvmeError::Ioctl {
                what: "eventfd",
                path: namespace.char_path.clone(),
                source: io::Error::last_os_error(),
            });
        }
        // SAFETY: raw is a fresh fd we own.
        let eventfd = Arc::new(unsafe { OwnedFd::from_raw_fd(raw) });
        let lba_shift = namespace.namespace.lba_bytes.trailing_zeros();
        Ok(PassthruBackend {
            ring,
            namespace,
            lba_shift,
            depth,
            parents: vec![None; depth],
            free_parents: (0..depth).rev().collect(),
            ready: Vec::new(),
            registered,
            chunk_bytes,
            eventfd,
            eventfd_value: Box::new(0),
            eventfd_armed: false,
            iopoll: options.iopoll,
            _file: file,
        })
    }

    pub fn namespace(&self) -> &Namespace {
        &self.namespace
    }

    /// How many bytes of [start, start+len) one command takes, and its fixed buffer if any: a
    /// piece in a registered area stops at the end of its fixed buffer (where that keeps it a
    /// whole number of blocks).
    fn piece(&self, start: usize, len: usize) -> (usize, Option<u16>) {
        let lba = 1usize << self.lba_shift;
        for &(base, size, first) in &self.registered {
            if start >= base && start < base + size {
                let index = (start - base) / self.chunk_bytes;
                let chunk_end = base + (index + 1) * self.chunk_bytes;
                let take = len.min(chunk_end - start);
                if take == len || take.is_multiple_of(lba) {
                    return (take, Some((first + index) as u16));
                }
                return (len, None);
            }
        }
        (len, None)
    }

    fn push_entry(&mut self, entry: squeue::Entry128) {
        // SAFETY: buffers stay valid until completion (the caller's contract on push).
        unsafe {
            while self.ring.submission().push(&entry).is_err() {
                self.ring.submit().expect("io_uring submit");
            }
        }
    }

    fn command(&self, opcode: u8, offset: u64, buf: usize, len: u32) -> PassthruCmd {
        let lba = offset >> self.lba_shift;
        let blocks = len >> self.lba_shift;
        PassthruCmd {
            opcode,
            nsid: self.namespace.nsid,
            addr: buf as u64,
            data_len: len,
            cdw10: lba as u32,
            cdw11: (lba >> 32) as u32,
            cdw12: blocks.saturating_sub(1),
            ..Default::default()
        }
    }
}

impl Backend for PassthruBackend {
    fn name(&self) -> &'static str {
        "nvme-passthru"
    }

    unsafe fn push(&mut self, r: BackendRequest) {
        let lba_mask = (1u64 << self.lba_shift) - 1;
        if r.kind != IoKind::Flush && (r.offset & lba_mask != 0 || r.len as u64 & lba_mask != 0 || r.len == 0) {
            self.ready.push(BackendCompletion { token: r.token, result: -libc::EINVAL });
            return;
        }
        let parent_index = self.free_parents.pop().expect("more requests in flight than the backend's depth");
        let fd = types::Fixed(0);
        if r.kind == IoKind::Flush {
            self.parents[parent_index] = Some(Parent { token: r.token, pieces_left: 1, bytes: 0, error: 0 });
            let cmd = PassthruCmd { opcode: spec::IO_FLUSH, nsid: self.namespace.nsid, ..Default::default() };
            let entry = opcode::UringCmd80::new(fd, NVME_URING_CMD_IO).cmd(cmd.to_bytes()).build();
            self.push_entry(entry.user_data(parent_index as u64));
            return;
        }
        let max = self.namespace.max_transfer_bytes as usize;
        let mut pieces = Vec::new();
        let mut done = 0usize;
        while done < r.len as usize {
            let (len, fixed) = self.piece(r.buf as usize + done, (r.len as usize - done).min(max));
            pieces.push((done, len, fixed));
            done += len;
        }
        self.parents[parent_index] =
            Some(Parent { token: r.token, pieces_left: pieces.len() as u32, bytes: r.len, error: 0 });
        let opcode_nvme = if r.kind == IoKind::Read { spec::IO_READ } else { spec::IO_WRITE };
        for (at, len, fixed) in pieces {
            let cmd = self.command(opcode_nvme, r.offset + at as u64, r.buf as usize + at, len as u32);
            let op = opcode::UringCmd80::new(fd, NVME_URING_CMD_IO).cmd(cmd.to_bytes()).buf_index(fixed);
            self.push_entry(op.build().user_data(parent_index as u64));
        }
    }

    fn submit_and_reap(&mut self, wait: bool, out: &mut Vec<BackendCompletion>) -> io::Result<()> {
        out.append(&mut self.ready);
        let wait = wait && out.is_empty();
        if wait && !self.eventfd_armed && !self.iopoll {
            let ptr = &mut *self.eventfd_value as *mut u64 as *mut u8;
            let entry = opcode::Read::new(types::Fd(self.eventfd.as_raw_fd()), ptr, 8).build().user_data(WAKE_TOKEN);
            self.push_entry(entry.into());
            self.eventfd_armed = true;
        }
        loop {
            match self.ring.submit_and_wait(usize::from(wait)) {
                Ok(_) => break,
                Err(e) if e.raw_os_error() == Some(libc::EINTR) => continue,
                Err(e) if e.raw_os_error() == Some(libc::EBUSY) => break,
                Err(e) => return Err(e),
            }
        }
        let mut cq = self.ring.completion();
        cq.sync();
        for cqe in &mut cq {
            if cqe.user_data() == WAKE_TOKEN {
                self.eventfd_armed = false;
                continue;
            }
            let index = cqe.user_data() as usize;
            let parent = self.parents[index].as_mut().expect("completion for a request not in flight");
            // res < 0: an errno; res > 0: the NVMe status of a failed command.
            if cqe.result() < 0 && parent.error == 0 {
                parent.error = cqe.result();
            } else if cqe.result() > 0 && parent.error == 0 {
                let status = cqe.result() as u16;
                parent.error = -spec::status_errno(((status >> 8) & 0x7) as u8, (status & 0xff) as u8).max(1);
            }
            parent.pieces_left -= 1;
            if parent.pieces_left == 0 {
                let p = self.parents[index].take().unwrap();
                self.free_parents.push(index);
                out.push(BackendCompletion {
                    token: p.token,
                    result: if p.error != 0 { p.error } else { p.bytes as i32 },
                });
            }
        }
        debug_assert!(self.free_parents.len() <= self.depth);
        Ok(())
    }

    fn waker(&self) -> Waker {
        let fd = self.eventfd.clone();
        Arc::new(move || {
            let one: u64 = 1;
            // SAFETY: writing 8 bytes from a valid u64 to an eventfd we keep alive.
            unsafe { libc::write(fd.as_raw_fd(), &one as *const u64 as *const _, 8) };
        })
    }
}

impl Drop for PassthruBackend {
    fn drop(&mut self) {
        // Wait for every command still in flight and the armed eventfd read, so that the kernel
        // holds no pointer into memory that is about to be freed.
        if self.eventfd_armed {
            (self.waker())();
        }
        let mut sink = Vec::new();
        let mut rounds = 0;
        while (self.eventfd_armed || self.free_parents.len() < self.depth) && rounds < 100_000 {
            if self.submit_and_reap(false, &mut sink).is_err() {
                break;
            }
            if self.eventfd_armed || self.free_parents.len() < self.depth {
                let _ = self.ring.submit_and_wait(1);
            }
            rounds += 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn char_device_names() {
        assert_eq!(char_device_for(Path::new("/dev/nvme0n1")).unwrap(), PathBuf::from("/dev/ng0n1"));
        assert_eq!(char_device_for(Path::new("/dev/ng12n3")).unwrap(), PathBuf::from("/dev/ng12n3"));
        assert!(char_device_for(Path::new("/dev/sda")).is_err());
        assert!(char_device_for(Path::new("/dev/nvme0")).is_err());
        assert!(char_device_for(Path::new("/dev/nvme0n1p1")).is_err());
    }
}
