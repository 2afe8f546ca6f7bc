//! The plain-data types of the C API: option structs going in, info structs coming out, and the
//! small integer enums. All are `#[repr(C)]` and hold only integers, so any bytes a caller hands
//! in are a valid value.
//!
//! Structs are versioned by size so that fields can be appended without breaking callers:
//! options carry `struct_size` (set by the `*_init` function from the caller's header), and
//! output functions take the caller's `sizeof`. See [`read_versioned`] and [`write_versioned`].

use std::mem::size_of;

use crate::status::{teraio_status, Failure};

/// Which I/O backend a store uses (`teraio_open_options.backend`).
#[allow(non_camel_case_types)]
pub type teraio_backend = u32;
/// io_uring where the kernel allows it, else psync (the choice shows in the engine's log).
pub const TERAIO_BACKEND_AUTO: teraio_backend = 0;
/// io_uring; opening fails with `TERAIO_ERR_UNSUPPORTED` where the kernel forbids it.
pub const TERAIO_BACKEND_IO_URING: teraio_backend = 1;
/// pread/pwrite from one thread per device.
pub const TERAIO_BACKEND_PSYNC: teraio_backend = 2;

/// Queueing priority of a put or get.
#[allow(non_camel_case_types)]
pub type teraio_priority = u32;
/// Ordinary work; may use 7/8 of the store's in-flight budget.
pub const TERAIO_PRIORITY_NORMAL: teraio_priority = 0;
/// Goes ahead of normal work in every device queue and has budget kept back for it (use it
/// for the transfer a compute step is waiting on).
pub const TERAIO_PRIORITY_URGENT: teraio_priority = 1;

/// Options fixed when a store is formatted. Fill with `teraio_format_options_init`, then change
/// fields. A field's default is what `_init` writes.
#[allow(non_camel_case_types)]
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct teraio_format_options {
    /// `sizeof(teraio_format_options)` as the caller compiled it; set by `_init`.
    pub struct_size: u64,
    /// Bytes of each stripe unit, a multiple of `block_size`. Default 1 MiB.
    pub stripe_unit_bytes: u64,
    /// Allocation and I/O unit, a power of two in 512..=65536. Default 4096.
    pub block_size: u64,
    /// Largest caller metadata blob per object, at most 65535. Default 4096.
    pub max_meta_bytes: u64,
    /// Create missing device files of this many bytes (regular files only); 0: devices must
    /// exist. Default 0.
    pub create_file_bytes: u64,
    /// Bytes of each checkpoint slot (a checkpoint of the whole object table must fit one); 0: room for one object with max_meta_bytes of metadata per stripe unit of all devices, at least the journal's default, at most 256 MiB and device 0's size / 8.
    pub checkpoint_slot_bytes: u64,
    /// Bytes of the journal ring; 0: device 0's size / 128, clamped to 1 MiB..=256 MiB.
    pub journal_bytes: u64,
    /// Nonzero: keep a crc32c per stripe unit. Default 1.
    pub checksums: u32,
    /// Nonzero: overwrite devices that already hold a teraio store. Default 0.
    pub force: u32,
}

/// Options chosen at each open. Fill with `teraio_open_options_init`, then change fields.
#[allow(non_camel_case_types)]
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct teraio_open_options {
    /// `sizeof(teraio_open_options)` as the caller compiled it; set by `_init`.
    pub struct_size: u64,
    /// Largest single device request, a multiple of the block size. Default 4 MiB.
    pub max_io_bytes: u64,
    /// Bytes of device requests in flight over the whole store. Default 1 GiB.
    pub max_inflight_bytes: u64,
    /// Bounce memory for unaligned buffers, allocated at open. Default 64 MiB.
    pub bounce_pool_bytes: u64,
    /// A `TERAIO_BACKEND_*` value. Default `TERAIO_BACKEND_AUTO`.
    pub backend: teraio_backend,
    /// Requests in flight per device, 1..=4096. Default 32.
    pub queue_depth: u32,
    /// Nonzero: O_DIRECT (the file system must support it). Default 1.
    pub direct_io: u32,
    /// Nonzero: a put or delete returns only once it would survive power loss. Default 1.
    pub durable: u32,
    /// Nonzero: check the checksum of every stripe unit a get returns bytes of, failing it with
    /// `TERAIO_ERR_CORRUPT` (naming object, stripe unit, device and offset) instead of returning
    /// damaged data. A ranged get checks the units it covers whole, and a partly covered one
    /// when reading the rest of it at most doubles the get's I/O (else those bytes are unchecked).
    /// Default 1.
    pub verify_checksums: u32,
    /// Milliseconds to wait for a device lock held by another writer before failing with
    /// `TERAIO_ERR_LOCKED` (a crashed writer's lock is released only once the kernel has
    /// finished its last requests). Default 2000.
    pub lock_wait_ms: u32,
}

/// What `teraio_stat` reports about one object.
#[allow(non_camel_case_types)]
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct teraio_object_info {
    /// The object's id.
    pub id: u64,
    /// Length of the object's data in bytes.
    pub len_bytes: u64,
    /// Length of the caller metadata stored with it (`teraio_get_meta` reads it).
    pub meta_len: u64,
    /// Contiguous device extents the object occupies.
    pub extent_count: u64,
    /// Devices the object is striped over.
    pub device_count: u64,
}

/// A snapshot of a store's counters since it was opened. Latencies are in microseconds.
#[allow(non_camel_case_types)]
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct teraio_stats {
    /// Puts acknowledged.
    pub puts: u64,
    /// Bytes of acknowledged puts.
    pub put_bytes: u64,
    /// Gets completed.
    pub gets: u64,
    /// Bytes of completed gets.
    pub get_bytes: u64,
    /// Objects deleted.
    pub deletes: u64,
    /// Puts and gets that failed.
    pub failed_ops: u64,
    /// Device read requests.
    pub read_ops: u64,
    /// Bytes of device reads.
    pub read_bytes: u64,
    /// Device write requests.
    pub write_ops: u64,
    /// Bytes of device writes.
    pub write_bytes: u64,
    /// Device flushes.
    pub flush_ops: u64,
    /// Device requests that failed.
    pub io_errors: u64,
    /// Resubmissions after a short transfer or EAGAIN/EINTR.
    pub io_retries: u64,
    /// Device requests that went through the urgent lane.
    pub urgent_ops: u64,
    /// Median put latency.
    pub put_latency_p50_us: u64,
    /// 99th percentile put latency.
    pub put_latency_p99_us: u64,
    /// Median get latency.
    pub get_latency_p50_us: u64,
    /// 99th percentile get latency.
    pub get_latency_p99_us: u64,
    /// Devices the store spans.
    pub device_count: u64,
}

/// Reads a caller's options struct whose first field is its `struct_size`.
///
/// A smaller struct (an older header) is an error while this is version 1 of every struct; a
/// larger one (a newer header) is accepted only if every byte this library does not know is
/// zero, so that a setting it cannot honour is never silently dropped.
///
/// # Safety
/// `ptr` must be NULL or point to at least 8 readable bytes, and to `struct_size` readable
/// bytes if that is larger.
pub(crate) unsafe fn read_versioned<T: Copy>(ptr: *const T, name: &str) -> Result<Option<T>, Failure> {
    if ptr.is_null() {
        return Ok(None);
    }
    // SAFETY: caller contract; every options struct starts with a `u64` struct_size.
    let given = unsafe { std::ptr::read_unaligned(ptr.cast::<u64>()) };
    let ours = size_of::<T>() as u64;
    if given < ours {
        return Err(Failure::new(
            teraio_status::TERAIO_ERR_INVALID_ARGUMENT,
            format!("{name}.struct_size is {given}, expected at least {ours}; fill the struct with its _init function"),
        ));
    }
    let bytes = ptr.cast::<u8>();
    for i in ours..given.min(1 << 20) {
        // SAFETY: the caller says `given` bytes are readable.
        if unsafe { *bytes.add(i as usize) } != 0 {
            return Err(Failure::new(
                teraio_status::TERAIO_ERR_INVALID_ARGUMENT,
                format!("{name} sets a field (byte {i}) this teraio library does not know; upgrade the library"),
            ));
        }
    }
    // SAFETY: at least size_of::<T>() readable bytes, and every bit pattern is a valid T
    // (the structs hold integers only).
    Ok(Some(unsafe { std::ptr::read_unaligned(ptr) }))
}

/// Writes `value` into a caller's output struct of `out_size` bytes: a smaller struct (an older
/// header) gets the fields it knows, a larger one (a newer header) gets zeros past ours.
///
/// # Safety
/// `out` must be valid for writes of `out_size` bytes.
pub(crate) unsafe fn write_versioned<T: Copy>(value: &T, out: *mut T, out_size: usize) {
    let ours = size_of::<T>();
    let n = out_size.min(ours);
    // SAFETY: `value` has `ours` bytes; the caller says `out` has `out_size`.
    unsafe {
        std::ptr::copy_nonoverlapping((value as *const T).cast::<u8>(), out.cast::<u8>(), n);
        if out_size > ours {
            std::ptr::write_bytes(out.cast::<u8>().add(ours), 0, out_size - ours);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versioned_structs_grow_safely() {
        #[repr(C)]
        #[derive(Clone, Copy)]
        struct Newer {
            base: teraio_open_options,
            extra: u64,
        }
        let mut base: teraio_open_options = unsafe { std::mem::zeroed() };
        base.struct_size = size_of::<teraio_open_options>() as u64;
        base.queue_depth = 7;
        let read = unsafe { read_versioned(&base, "opts") }.unwrap().unwrap();
        assert_eq!(read.queue_depth, 7);
        assert!(unsafe { read_versioned::<teraio_open_options>(std::ptr::null(), "opts") }.unwrap().is_none());

        let mut newer = Newer { base, extra: 0 };
        newer.base.struct_size = size_of::<Newer>() as u64;
        let as_base = |n: &Newer| (n as *const Newer).cast::<teraio_open_options>();
        assert_eq!(unsafe { read_versioned(as_base(&newer), "opts") }.unwrap().unwrap().queue_depth, 7);
        newer.extra = 1;
        assert!(unsafe { read_versioned(as_base(&newer), "opts") }.is_err(), "unknown nonzero field is refused");
        base.struct_size = 8;
        assert!(unsafe { read_versioned(&base, "opts") }.is_err(), "short struct is refused");

        let stats = teraio_stats { puts: 3, gets: 4, ..Default::default() };
        let mut out = [0xffu8; size_of::<teraio_stats>() + 8];
        unsafe { write_versioned(&stats, out.as_mut_ptr().cast::<teraio_stats>(), out.len()) };
        assert_eq!(&out[0..8], &3u64.to_ne_bytes());
        assert!(out[size_of::<teraio_stats>()..].iter().all(|&b| b == 0));
        let mut short = [0xffu8; 12];
        unsafe { write_versioned(&stats, short.as_mut_ptr().cast::<teraio_stats>(), 8) };
        assert_eq!(&short[0..8], &3u64.to_ne_bytes());
        assert_eq!(&short[8..], &[0xff; 4], "nothing written past out_size");
    }
}
