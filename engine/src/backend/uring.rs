//! The io_uring backend: one ring per device, the device file registered, the bounce slab
//! registered as fixed buffers, requests batched into one submit, and an eventfd read kept armed
//! in the ring so that new work wakes a worker waiting for completions.

use super::{Backend, BackendCompletion, BackendRequest, IoKind, UringOptions, Waker};
use crate::buffer::BouncePool;
use crate::device::Device;
use crate::error::{Error, Result};
use io_uring::{opcode, types, IoUring};
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::Arc;

const WAKE_TOKEN: u64 = u64::MAX;
/// Registered buffers must each be at most 1 GiB.
const MAX_REGISTERED_BUFFER_BYTES: usize = 1 << 30;

/// Checks once that this kernel and process may use io_uring with these options.
pub fn probe(options: &UringOptions) -> io::Result<()> {
    let mut builder = IoUring::<io_uring::squeue::Entry, io_uring::cqueue::Entry>::builder();
    if let Some(idle) = options.sqpoll_idle_ms {
        builder.setup_sqpoll(idle);
    }
    builder.build(8).map(drop)
}

pub struct UringBackend {
    ring: IoUring,
    eventfd: Arc<OwnedFd>,
    eventfd_value: Box<u64>,
    eventfd_armed: bool,
    iopoll: bool,
    /// (start address, length) of each registered buffer, to find a request's fixed index.
    registered: Vec<(usize, usize)>,
}

impl UringBackend {
    pub fn new(device: &Device, depth: usize, options: &UringOptions, pool: &BouncePool) -> Result<Self> {
        let unavailable = |e: io::Error| Error::BackendUnavailable { backend: "io_uring", reason: e.to_string() };
        let entries = ((depth + 1).next_power_of_two()).max(8) as u32;
        let mut builder = IoUring::<io_uring::squeue::Entry, io_uring::cqueue::Entry>::builder();
        if let Some(idle) = options.sqpoll_idle_ms {
            builder.setup_sqpoll(idle);
        }
        if options.iopoll {
            builder.setup_iopoll();
        }
        builder.setup_cqsize(entries * 2);
        let ring = builder.build(entries).map_err(unavailable)?;
        ring.submitter().register_files(&[device.fd()]).map_err(unavailable)?;
        let (slab, slab_len) = pool.slab();
        let mut iovecs = Vec::new();
        let mut registered = Vec::new();
        let mut at = 0;
        while at < slab_len {
            let len = (slab_len - at).min(MAX_REGISTERED_BUFFER_BYTES);
            // SAFETY: inside the slab.
            let base = unsafe { slab.add(at) };
            iovecs.push(libc::iovec { iov_base: base as *mut _, iov_len: len });
            registered.push((base as usize, len));
            at += len;
        }
        // SAFETY: the slab outlives the ring (the store drops queues before the pool).
        if let Err(e) = unsafe { ring.submitter().register_buffers(&iovecs) } {
            // Some kernels refuse (RLIMIT_MEMLOCK); plain reads still work, just without fixed buffers.
            tracing::warn!(error = %e, "io_uring buffer registration failed; bounce I/O uses unregistered buffers");
            registered.clear();
        }
        // SAFETY: eventfd returns a new fd or -1.
        let raw = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC) };
        if raw < 0 {
            return Err(Error::io("creating an eventfd", io::Error::last_os_error()));
        }
        // SAFETY: raw is a fresh fd we own.
        let eventfd = Arc::new(unsafe { OwnedFd::from_raw_fd(raw) });
        Ok(UringBackend {
            ring,
            eventfd,
            eventfd_value: Box::new(0),
            eventfd_armed: false,
            iopoll: options.iopoll,
            registered,
        })
    }

    fn fixed_index_of(&self, buf: *mut u8, len: u32) -> Option<u16> {
        let (start, end) = (buf as usize, buf as usize + len as usize);
        self.registered.iter().position(|&(base, size)| start >= base && end <= base + size).map(|i| i as u16)
    }

    fn push_entry(&mut self, entry: io_uring::squeue::Entry) {
        // SAFETY: buffers stay valid until completion (the caller's contract on push).
        unsafe {
            while self.ring.submission().push(&entry).is_err() {
                // The ring holds depth + 1 entries, so this only happens after many pushes
                // without a submit; submitting frees the slots.
                self.ring.submit().expect("io_uring submit");
            }
        }
    }
}

impl Backend for UringBackend {
    fn name(&self) -> &'static str {
        "io_uring"
    }

    unsafe fn push(&mut self, r: BackendRequest) {
        let fd = types::Fixed(0);
        let fixed = r.fixed_index.or_else(|| self.fixed_index_of(r.buf, r.len));
        let entry = match (r.kind, fixed) {
            (IoKind::Read, Some(i)) => opcode::ReadFixed::new(fd, r.buf, r.len, i).offset(r.offset).build(),
            (IoKind::Read, None) => opcode::Read::new(fd, r.buf, r.len).offset(r.offset).build(),
            (IoKind::Write, Some(i)) => opcode::WriteFixed::new(fd, r.buf, r.len, i).offset(r.offset).build(),
            (IoKind::Write, None) => opcode::Write::new(fd, r.buf, r.len).offset(r.offset).build(),
            (IoKind::Flush, _) => opcode::Fsync::new(fd).flags(types::FsyncFlags::DATASYNC).build(),
        };
        self.push_entry(entry.user_data(r.token));
    }

    fn submit_and_reap(&mut self, wait: bool, out: &mut Vec<BackendCompletion>) -> io::Result<()> {
        // An IOPOLL ring can only hold polled file I/O, so it is woken by completions alone.
        if wait && !self.eventfd_armed && !self.iopoll {
            let ptr = &mut *self.eventfd_value as *mut u64 as *mut u8;
            let entry = opcode::Read::new(types::Fd(self.eventfd.as_raw_fd()), ptr, 8).build().user_data(WAKE_TOKEN);
            self.push_entry(entry);
            self.eventfd_armed = true;
        }
        let want = if wait { 1 } else { 0 };
        loop {
            match self.ring.submit_and_wait(want) {
                Ok(_) => break,
                Err(e) if e.raw_os_error() == Some(libc::EINTR) => continue,
                Err(e) if e.raw_os_error() == Some(libc::EBUSY) => break, // CQ overflow: reap first
                Err(e) => return Err(e),
            }
        }
        for cqe in self.ring.completion() {
            if cqe.user_data() == WAKE_TOKEN {
                self.eventfd_armed = false;
                continue;
            }
            out.push(BackendCompletion { token: cqe.user_data(), result: cqe.result() });
        }
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

impl Drop for UringBackend {
    fn drop(&mut self) {
        // Wake and drain an armed eventfd read so the ring owns no pointer into freed memory.
        if self.eventfd_armed {
            (self.waker())();
            let mut sink = Vec::new();
            while self.eventfd_armed {
                if self.submit_and_reap(false, &mut sink).is_err() {
                    break;
                }
                if self.eventfd_armed {
                    let _ = self.ring.submit_and_wait(1);
                }
            }
        }
    }
}
