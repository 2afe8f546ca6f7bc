//! The bench's I/O buffers. Large ones (2 MiB and up) are anonymous mappings aligned to 2 MiB
//! and backed by transparent huge pages where the kernel allows: a 4 MiB request then spans two
//! physically contiguous pieces instead of 1024 pages, which the block layer would otherwise
//! split into several device requests (a virtio disk takes 254 segments per request). Small
//! ones are ordinary page-aligned allocations. Pinned buffers are also locked in RAM. GPU
//! buffers are CUDA device allocations, moved by the engine's GPU paths (pinned bounce or cuFile).

use crate::error::{CliError, CliResult};
use crate::units::format_bytes;
use serde::Serialize;
use std::ops::{Deref, DerefMut};
use teraio_engine::cuda::DeviceBuffer;
use teraio_engine::GpuTicket;
use teraio_engine::{AlignedBuf, IoBuf, IoBufMut, Priority, Store, Ticket};

/// Where the bench's I/O buffers live.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum BufferKind {
    /// Page-aligned host memory.
    Host,
    /// Page-aligned host memory locked in RAM (mlock), as pinned buffers for GPU copies are.
    Pinned,
    /// CUDA device memory, moved by the engine's GPU path (pinned bounce or cuFile).
    Gpu,
}

/// Size and alignment of a transparent huge page on x86-64 and arm64 (4 KiB base pages).
const HUGE_PAGE_BYTES: usize = 2 << 20;

/// One op's buffer.
pub enum HostBuf {
    /// 2 MiB-aligned anonymous mapping; `map` is what to unmap.
    Huge {
        data: *mut u8,
        len: usize,
        map: *mut libc::c_void,
        map_len: usize,
    },
    Small(AlignedBuf),
}

// SAFETY: HostBuf owns its memory exclusively, like a Vec<u8>.
unsafe impl Send for HostBuf {}

impl HostBuf {
    /// A zeroed buffer of `len` bytes in memory of `kind`.
    pub fn new(len: usize, kind: BufferKind) -> CliResult<HostBuf> {
        let buf = if len >= HUGE_PAGE_BYTES { Self::huge(len)? } else { HostBuf::Small(AlignedBuf::new(len, 4096)?) };
        if kind == BufferKind::Pinned {
            // SAFETY: mlock on memory we own; unmapping or freeing it unlocks it.
            if unsafe { libc::mlock(buf.as_ptr() as *const libc::c_void, len) } != 0 {
                return Err(CliError::input(format!(
                    "cannot pin {} of buffer memory: {}; raise the locked-memory limit (ulimit -l) or use --buffer host",
                    format_bytes(len as u64),
                    std::io::Error::last_os_error()
                )));
            }
        }
        Ok(buf)
    }

    fn huge(len: usize) -> CliResult<HostBuf> {
        let data_len = len.next_multiple_of(HUGE_PAGE_BYTES);
        let map_len = data_len + HUGE_PAGE_BYTES;
        // SAFETY: a fresh private anonymous mapping; nothing else refers to it.
        let map = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                map_len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if map == libc::MAP_FAILED {
            return Err(CliError::failed(format!(
                "cannot map {} of buffer memory: {}",
                format_bytes(map_len as u64),
                std::io::Error::last_os_error()
            )));
        }
        let data = (map as usize).next_multiple_of(HUGE_PAGE_BYTES) as *mut u8;
        // SAFETY: `data..data + data_len` lies inside the mapping. A refused madvise only
        // means 4 KiB pages. Touching every page now faults it in (as a huge page where
        // granted) outside the timed phase.
        unsafe {
            libc::madvise(data as *mut libc::c_void, data_len, libc::MADV_HUGEPAGE);
            std::ptr::write_bytes(data, 0, len);
        }
        Ok(HostBuf::Huge { data, len, map, map_len })
    }
}

impl Drop for HostBuf {
    fn drop(&mut self) {
        if let HostBuf::Huge { map, map_len, .. } = *self {
            // SAFETY: unmapping the mapping made in `huge`, once.
            unsafe { libc::munmap(map, map_len) };
        }
    }
}

impl Deref for HostBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            // SAFETY: `len` initialised bytes owned by this buffer.
            HostBuf::Huge { data, len, .. } => unsafe { std::slice::from_raw_parts(*data, *len) },
            HostBuf::Small(b) => b,
        }
    }
}

impl DerefMut for HostBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        match self {
            // SAFETY: as in deref, and we hold the only reference.
            HostBuf::Huge { data, len, .. } => unsafe { std::slice::from_raw_parts_mut(*data, *len) },
            HostBuf::Small(b) => b,
        }
    }
}

// SAFETY: the bytes live in a mapping or allocation owned by the value, at a fixed address, until
// it is dropped.
unsafe impl IoBuf for HostBuf {
    fn io_ptr(&self) -> *const u8 {
        self.as_ptr()
    }
    fn io_len(&self) -> usize {
        self.len()
    }
}

// SAFETY: as for IoBuf; the memory is writable.
unsafe impl IoBufMut for HostBuf {
    fn io_mut_ptr(&mut self) -> *mut u8 {
        self.as_mut_ptr()
    }
}

/// One op's buffer, in host or GPU memory.
pub enum OpBuf {
    Host(HostBuf),
    Gpu(DeviceBuffer),
}

impl OpBuf {
    /// A buffer of `len` bytes of `kind` (GPU memory on CUDA device `gpu_ordinal`).
    pub fn new(len: usize, kind: BufferKind, gpu_ordinal: u32) -> CliResult<OpBuf> {
        Ok(match kind {
            BufferKind::Gpu => OpBuf::Gpu(DeviceBuffer::new(gpu_ordinal, len)?),
            _ => OpBuf::Host(HostBuf::new(len, kind)?),
        })
    }

    /// Writes `bytes` at the start of the buffer (a copy to the GPU for GPU buffers).
    pub fn write_from(&mut self, bytes: &[u8]) -> CliResult<()> {
        match self {
            OpBuf::Host(b) => b[..bytes.len()].copy_from_slice(bytes),
            OpBuf::Gpu(b) => b.copy_from_host(0, bytes)?,
        }
        Ok(())
    }

    /// Runs `check` on the first `len` bytes (copied to the host first for GPU buffers).
    pub fn inspect<T>(&self, len: usize, check: impl FnOnce(&[u8]) -> T) -> CliResult<T> {
        Ok(match self {
            OpBuf::Host(b) => check(&b[..len]),
            OpBuf::Gpu(b) => {
                let mut host = vec![0u8; len];
                b.copy_to_host(0, &mut host)?;
                check(&host)
            }
        })
    }

    /// Starts a whole-object get into this buffer.
    pub fn get(self, store: &Store, id: u64) -> CliResult<OpTicket> {
        Ok(match self {
            OpBuf::Host(b) => OpTicket::Host(store.get(id, b, Priority::Normal)?),
            OpBuf::Gpu(b) => OpTicket::Gpu(store.get_gpu(id, b, Priority::Normal)?),
        })
    }

    /// Starts a get of the buffer's length from byte `offset` of object `id`.
    pub fn get_range(self, store: &Store, id: u64, offset: u64) -> CliResult<OpTicket> {
        Ok(match self {
            OpBuf::Host(b) => OpTicket::Host(store.get_range(id, offset, b, Priority::Normal)?),
            OpBuf::Gpu(b) => OpTicket::Gpu(store.get_gpu_range(id, offset, b, Priority::Normal)?),
        })
    }

    /// Starts a put of the whole buffer as object `id`.
    /// The engine's error is kept as it is, so that a full store can be told apart.
    pub fn put(self, store: &Store, id: u64) -> Result<OpTicket, teraio_engine::Error> {
        Ok(match self {
            OpBuf::Host(b) => OpTicket::Host(store.put(id, b, &[], Priority::Normal)?),
            OpBuf::Gpu(b) => OpTicket::Gpu(store.put_gpu(id, b, &[], Priority::Normal)?),
        })
    }
}

/// The ticket of an op on an [`OpBuf`].
pub enum OpTicket {
    Host(Ticket<HostBuf>),
    Gpu(GpuTicket<DeviceBuffer>),
}

impl OpTicket {
    pub fn is_done(&self) -> bool {
        match self {
            OpTicket::Host(t) => t.is_done(),
            OpTicket::Gpu(t) => t.is_done(),
        }
    }

    /// Bumps `signal` when the op finishes.
    pub fn signal_when_done(&self, signal: &std::sync::Arc<teraio_engine::DoneSignal>) {
        match self {
            OpTicket::Host(t) => t.signal_when_done(signal),
            OpTicket::Gpu(t) => t.signal_when_done(signal),
        }
    }

    /// Waits for the op and hands the buffer back.
    pub fn wait(self) -> CliResult<OpBuf> {
        Ok(match self {
            OpTicket::Host(t) => OpBuf::Host(t.wait()?),
            OpTicket::Gpu(t) => OpBuf::Gpu(t.wait()?),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_are_aligned_zeroed_and_writable() {
        for len in [4096, 3 << 20] {
            let mut b = HostBuf::new(len, BufferKind::Host).unwrap();
            assert_eq!(b.len(), len);
            assert_eq!(b.as_ptr() as usize % 4096, 0);
            assert!(b.iter().all(|&x| x == 0));
            b[len - 1] = 7;
            assert_eq!(b[len - 1], 7);
        }
        let huge = HostBuf::new(4 << 20, BufferKind::Host).unwrap();
        assert_eq!(huge.as_ptr() as usize % HUGE_PAGE_BYTES, 0);
    }
}
