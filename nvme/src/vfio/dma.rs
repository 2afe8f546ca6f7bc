//! DMA memory for the userspace driver: allocated once (2 MiB hugepages where reserved, else
//! locked 4 KiB pages), and made visible to the device either through the IOMMU (VFIO type1:
//! we choose the I/O virtual addresses) or, in VFIO no-IOMMU mode, by physical address read from
//! /proc/self/pagemap (the pages are locked, so they do not move).

use crate::error::{NvmeError, Result};
use std::io;

pub const PAGE_BYTES: usize = 4096;
const HUGEPAGE_BYTES: usize = 2 << 20;

/// How addresses in a region translate to bus addresses.
#[derive(Debug)]
pub enum Iova {
    /// Mapped through the IOMMU at one contiguous I/O virtual address.
    Linear(u64),
    /// No IOMMU: the physical address of each 4 KiB page.
    Pages(Vec<u64>),
}

/// An anonymous, locked memory area owned by the driver.
#[derive(Debug)]
pub struct DmaMemory {
    pub base: *mut u8,
    pub len: usize,
    pub hugepages: bool,
}

// SAFETY: plain memory; who writes where is governed by the queues that hand it out.
unsafe impl Send for DmaMemory {}
unsafe impl Sync for DmaMemory {}

impl DmaMemory {
    /// `len` bytes (rounded up to 2 MiB), zeroed and locked.
    pub fn allocate(len: usize) -> Result<DmaMemory> {
        let len = len.div_ceil(HUGEPAGE_BYTES) * HUGEPAGE_BYTES;
        let prot = libc::PROT_READ | libc::PROT_WRITE;
        let flags = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_POPULATE;
        // SAFETY: a fresh anonymous mapping; checked for MAP_FAILED.
        let huge = unsafe { libc::mmap(std::ptr::null_mut(), len, prot, flags | libc::MAP_HUGETLB, -1, 0) };
        let (base, hugepages) = if huge != libc::MAP_FAILED {
            (huge, true)
        } else {
            // SAFETY: as above, without hugepages.
            let p = unsafe { libc::mmap(std::ptr::null_mut(), len, prot, flags, -1, 0) };
            if p == libc::MAP_FAILED {
                return Err(NvmeError::DmaMemory { bytes: len, reason: io::Error::last_os_error().to_string() });
            }
            (p, false)
        };
        // SAFETY: locking our own mapping.
        if unsafe { libc::mlock(base, len) } != 0 {
            let e = io::Error::last_os_error();
            // SAFETY: unmapping what we mapped.
            unsafe { libc::munmap(base, len) };
            return Err(NvmeError::DmaMemory { bytes: len, reason: format!("mlock: {e} (RLIMIT_MEMLOCK too low?)") });
        }
        Ok(DmaMemory { base: base as *mut u8, len, hugepages })
    }
}

impl Drop for DmaMemory {
    fn drop(&mut self) {
        // SAFETY: unmapping what allocate mapped; the controller is stopped first.
        unsafe { libc::munmap(self.base as *mut _, self.len) };
    }
}

/// Physical addresses of the 4 KiB pages of [base, base+len) (no-IOMMU mode).
pub fn physical_pages(base: usize, len: usize) -> Result<Vec<u64>> {
    use std::os::unix::fs::FileExt;
    let file = std::fs::File::open("/proc/self/pagemap")
        .map_err(|e| NvmeError::Pagemap { addr: base, reason: e.to_string() })?;
    let first = base / PAGE_BYTES;
    let count = (base + len).div_ceil(PAGE_BYTES) - first;
    let mut raw = vec![0u8; count * 8];
    file.read_exact_at(&mut raw, (first * 8) as u64)
        .map_err(|e| NvmeError::Pagemap { addr: base, reason: e.to_string() })?;
    raw.chunks_exact(8)
        .enumerate()
        .map(|(i, e)| {
            let entry = u64::from_le_bytes(e.try_into().unwrap());
            let pfn = entry & ((1 << 55) - 1);
            if entry >> 63 == 0 || pfn == 0 {
                Err(NvmeError::Pagemap {
                    addr: (first + i) * PAGE_BYTES,
                    reason: "page not present or PFN hidden (need root)".into(),
                })
            } else {
                Ok(pfn * PAGE_BYTES as u64)
            }
        })
        .collect()
}
