//! Aligned memory: the buffers O_DIRECT needs, and the bounded pool of bounce chunks that every
//! device ring registers once (io_uring fixed buffers), used for unaligned caller memory and for
//! the zero-padded last block of an object.

use crate::error::{Error, Result};
use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::ptr::NonNull;
use std::sync::{Arc, Condvar, Mutex};

/// A zeroed, aligned heap buffer. Buffers of 2 MiB and more are their own anonymous mappings,
/// 2 MiB aligned and advised to use transparent huge pages: an O_DIRECT request into 4 KiB pages
/// has one segment per page, and devices split requests with too many segments (a virtio disk
/// takes 254), which halves large sequential transfers into unregistered memory.
pub struct AlignedBuf {
    ptr: NonNull<u8>,
    len: usize,
    storage: Storage,
}

enum Storage {
    Heap(Layout),
    /// An mmap of this many bytes (the pointer is inside it, 2 MiB aligned).
    Mapping {
        base: *mut libc::c_void,
        bytes: usize,
    },
}

/// Buffers at least this large are huge-page mappings.
const HUGE_PAGE_BYTES: usize = 2 << 20;

// SAFETY: AlignedBuf owns its allocation exclusively, like a Vec<u8>.
unsafe impl Send for AlignedBuf {}
// SAFETY: shared references give only reads of the bytes, like &[u8].
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    /// `len` bytes aligned to `align` (a power of two); a zero length still allocates one block.
    pub fn new(len: usize, align: usize) -> Result<Self> {
        if len >= HUGE_PAGE_BYTES && align <= HUGE_PAGE_BYTES {
            return Self::mapped(len);
        }
        let layout = Layout::from_size_align(len.max(align), align)
            .map_err(|e| Error::InvalidConfig(format!("buffer of {len} bytes aligned to {align}: {e}")))?;
        // SAFETY: the layout has a non-zero size.
        let ptr = NonNull::new(unsafe { alloc_zeroed(layout) }).ok_or_else(|| {
            Error::io(format!("allocating a {len}-byte buffer"), std::io::ErrorKind::OutOfMemory.into())
        })?;
        Ok(AlignedBuf { ptr, len, storage: Storage::Heap(layout) })
    }

    fn mapped(len: usize) -> Result<Self> {
        let bytes = len.div_ceil(HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES + HUGE_PAGE_BYTES;
        // SAFETY: a fresh private anonymous mapping (zero-filled by the kernel).
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                bytes,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(Error::io(format!("mapping a {len}-byte buffer"), std::io::Error::last_os_error()));
        }
        let aligned = (base as usize).next_multiple_of(HUGE_PAGE_BYTES);
        // SAFETY: inside the mapping; advice only (ignored where THP is off).
        unsafe { libc::madvise(aligned as *mut libc::c_void, bytes - (aligned - base as usize), libc::MADV_HUGEPAGE) };
        let ptr = NonNull::new(aligned as *mut u8).expect("mmap never returns null on success");
        Ok(AlignedBuf { ptr, len, storage: Storage::Mapping { base, bytes } })
    }

    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    pub fn as_ptr(&self) -> *const u8 {
        self.ptr.as_ptr()
    }
    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ptr.as_ptr()
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        match self.storage {
            // SAFETY: allocated in `new` with this layout.
            Storage::Heap(layout) => unsafe { dealloc(self.ptr.as_ptr(), layout) },
            // SAFETY: the mapping made in `mapped`.
            Storage::Mapping { base, bytes } => unsafe {
                libc::munmap(base, bytes);
            },
        }
    }
}

impl std::ops::Deref for AlignedBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: ptr is valid for len bytes (the allocation is at least that long).
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl std::ops::DerefMut for AlignedBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as above, and we hold &mut self.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl AsRef<[u8]> for AlignedBuf {
    fn as_ref(&self) -> &[u8] {
        self
    }
}

impl AsMut<[u8]> for AlignedBuf {
    fn as_mut(&mut self) -> &mut [u8] {
        self
    }
}

/// A fixed set of equal, aligned chunks carved from one slab allocated at start-up. Taking a chunk
/// blocks while all are in use, which bounds the bounce memory. A chunk goes back to the pool when
/// it is dropped, wherever that happens (a request's completion, a copy's continuation, an error
/// path), so none can leak or be given back twice.
pub struct BouncePool {
    inner: Arc<PoolInner>,
}

struct PoolInner {
    slab: AlignedBuf,
    chunk_bytes: usize,
    chunk_count: usize,
    /// Free chunk indexes, and per chunk whether it is taken (to assert no chunk is handed out
    /// twice or comes back twice).
    free: Mutex<FreeList>,
    available: Condvar,
}

struct FreeList {
    indexes: Vec<u16>,
    taken: Vec<bool>,
}

/// A chunk taken from the pool, exclusively its holder's; dropping it gives it back.
#[derive(Debug)]
pub struct BounceChunk {
    pub index: u16,
    pub ptr: *mut u8,
    pool: Arc<PoolInner>,
}

impl std::fmt::Debug for PoolInner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "BouncePool({} chunks of {} bytes)", self.chunk_count, self.chunk_bytes)
    }
}

// SAFETY: a chunk's bytes are exclusively its holder's until it is dropped, and the pool's state is
// behind its mutex.
unsafe impl Send for BounceChunk {}

impl Drop for BounceChunk {
    fn drop(&mut self) {
        let mut free = self.pool.free.lock().expect("pool lock");
        let taken = &mut free.taken[self.index as usize];
        assert!(*taken, "bounce chunk {} given back twice", self.index);
        *taken = false;
        free.indexes.push(self.index);
        assert!(free.indexes.len() <= self.pool.chunk_count);
        drop(free);
        self.pool.available.notify_one();
    }
}

impl PoolInner {
    /// Hands out chunk `index`, just popped from the free list.
    fn chunk(self: &Arc<Self>, free: &mut FreeList, index: u16) -> BounceChunk {
        let taken = &mut free.taken[index as usize];
        assert!(!*taken, "bounce chunk {index} handed out twice");
        *taken = true;
        assert!((index as usize) < self.chunk_count);
        // SAFETY: index < chunk_count, so the chunk lies inside the slab.
        let ptr = unsafe { (self.slab.as_ptr() as *mut u8).add(index as usize * self.chunk_bytes) };
        BounceChunk { index, ptr, pool: self.clone() }
    }
}

impl BouncePool {
    pub fn new(chunk_bytes: usize, chunk_count: usize, align: usize) -> Result<Self> {
        if chunk_count == 0 || chunk_count > u16::MAX as usize || !chunk_bytes.is_multiple_of(align) {
            return Err(Error::InvalidConfig(format!(
                "bounce pool of {chunk_count} chunks of {chunk_bytes} bytes (need 1..=65535 chunks, a multiple of {align} bytes each)"
            )));
        }
        let slab = AlignedBuf::new(chunk_bytes * chunk_count, align)?;
        let free = FreeList { indexes: (0..chunk_count as u16).rev().collect(), taken: vec![false; chunk_count] };
        Ok(BouncePool {
            inner: Arc::new(PoolInner {
                slab,
                chunk_bytes,
                chunk_count,
                free: Mutex::new(free),
                available: Condvar::new(),
            }),
        })
    }

    pub fn chunk_bytes(&self) -> usize {
        self.inner.chunk_bytes
    }

    /// The whole slab, for registration with io_uring.
    pub fn slab(&self) -> (*mut u8, usize) {
        (self.inner.slab.as_ptr() as *mut u8, self.inner.slab.len())
    }

    /// Takes a chunk, waiting while none is free. The chunk's bytes are whatever the last user left.
    pub fn take(&self) -> BounceChunk {
        let mut free = self.inner.free.lock().expect("pool lock");
        loop {
            if let Some(index) = free.indexes.pop() {
                return self.inner.chunk(&mut free, index);
            }
            free = self.inner.available.wait(free).expect("pool lock");
        }
    }

    /// Takes a chunk if one is free now.
    pub fn try_take(&self) -> Option<BounceChunk> {
        let mut free = self.inner.free.lock().expect("pool lock");
        let index = free.indexes.pop()?;
        Some(self.inner.chunk(&mut free, index))
    }

    pub fn chunk_count(&self) -> usize {
        self.inner.chunk_count
    }

    pub fn free_chunks(&self) -> usize {
        self.inner.free.lock().expect("pool lock").indexes.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn large_buffers_are_huge_page_aligned_mappings() {
        let mut b = AlignedBuf::new((5 << 20) + 3, 4096).unwrap();
        assert_eq!(b.as_ptr() as usize % (2 << 20), 0);
        assert_eq!(b.len(), (5 << 20) + 3);
        assert!(b.iter().all(|&x| x == 0));
        b[(5 << 20) + 2] = 7;
        assert_eq!(b[(5 << 20) + 2], 7);
    }

    #[test]
    fn aligned_and_zeroed() {
        let b = AlignedBuf::new(10000, 4096).unwrap();
        assert_eq!(b.as_ptr() as usize % 4096, 0);
        assert!(b.iter().all(|&x| x == 0));
        assert_eq!(b.len(), 10000);
    }

    #[test]
    fn pool_hands_out_distinct_chunks_and_blocks_when_empty() {
        let pool = std::sync::Arc::new(BouncePool::new(4096, 2, 4096).unwrap());
        let a = pool.take();
        let b = pool.take();
        assert_ne!(a.ptr, b.ptr);
        let p2 = pool.clone();
        let waiter = std::thread::spawn(move || p2.take().index);
        std::thread::sleep(std::time::Duration::from_millis(50));
        assert!(!waiter.is_finished());
        let freed = a.index;
        drop(a);
        assert_eq!(waiter.join().unwrap(), freed, "a dropped chunk goes back to the pool");
        drop(b);
        assert_eq!(pool.free_chunks(), 2);
    }
}
