//! Where bytes live: a backing device is a regular file (pre-allocated) or a raw block device,
//! opened once with O_DIRECT and locked (one writer, any number of read-only inspectors, format
//! only when neither), or an external device that no kernel file reaches (an NVMe namespace
//! driven from userspace over VFIO, see teraio-nvme).

use crate::error::{Error, Result};
use std::fs::{File, OpenOptions};
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};

/// A device no kernel file reaches (teraio-nvme's VFIO namespaces): the store's synchronous
/// open-time I/O goes through it, the data path through the backend registered for it.
pub trait ExternalDevice: Send + Sync + std::fmt::Debug {
    fn size_bytes(&self) -> u64;
    fn read_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<()>;
    fn write_at(&self, buf: &[u8], offset: u64) -> std::io::Result<()>;
    fn flush(&self) -> std::io::Result<()>;
    /// For the backend factory to reach its own type.
    fn as_any(&self) -> &dyn std::any::Any;
}

/// Opens `path` as an external device, or says `None` when the path is not its kind.
pub type ExternalOpener = fn(&Path) -> Result<Option<std::sync::Arc<dyn ExternalDevice>>>;

static EXTERNAL_OPENERS: std::sync::Mutex<Vec<ExternalOpener>> = std::sync::Mutex::new(Vec::new());

/// Lets `Device::open` hand paths of another kind (e.g. `vfio:0000:00:04.0`) to `opener`.
pub fn register_external_device(opener: ExternalOpener) {
    let mut openers = EXTERNAL_OPENERS.lock().expect("external openers");
    if !openers.contains(&opener) {
        openers.push(opener);
    }
}

/// How a device is opened and locked. Two advisory open-file-description locks (`fcntl`
/// `F_OFD_SETLK`) on the device file: byte 0 is the writer lock, byte 1 the presence lock. A
/// writer holds byte 0 exclusively and byte 1 shared, a reader byte 1 shared only, so a reader
/// and a writer coexist, two writers do not, and format (both bytes exclusive) waits for both.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    /// Read-write, one at a time (`Store::open`).
    Writer,
    /// Read-only, beside a writer or other readers (`Store::open_read_only`): the file is opened
    /// O_RDONLY, so nothing can be written through it.
    Reader,
    /// Read-write with nobody else at all (`Store::format`).
    Exclusive,
}

/// Takes (or with `F_UNLCK` drops) one OFD lock on `len` bytes at `start` without waiting.
fn ofd_lock(file: &File, kind: libc::c_int, start: i64, len: i64) -> std::io::Result<()> {
    // SAFETY: an all-zero flock is a valid value; fcntl reads it and does not keep the pointer.
    let mut lock: libc::flock = unsafe { std::mem::zeroed() };
    lock.l_type = kind as libc::c_short;
    lock.l_whence = libc::SEEK_SET as libc::c_short;
    lock.l_start = start;
    lock.l_len = len;
    // SAFETY: fcntl on a valid fd with a valid flock.
    if unsafe { libc::fcntl(file.as_raw_fd(), libc::F_OFD_SETLK, &lock) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

fn take_locks(file: &File, access: Access) -> std::io::Result<()> {
    match access {
        Access::Writer => {
            ofd_lock(file, libc::F_WRLCK, 0, 1)?;
            ofd_lock(file, libc::F_RDLCK, 1, 1)
        }
        Access::Reader => ofd_lock(file, libc::F_RDLCK, 1, 1),
        Access::Exclusive => ofd_lock(file, libc::F_WRLCK, 0, 2),
    }
}

/// An open, locked backing device.
#[derive(Debug)]
pub struct Device {
    pub path: PathBuf,
    /// For an external device: /dev/null, a placeholder that holds no data (the external device
    /// keeps other writers out itself: a VFIO group opens once).
    pub file: File,
    pub size_bytes: u64,
    pub is_block_device: bool,
    pub external: Option<std::sync::Arc<dyn ExternalDevice>>,
    pub access: Access,
}

impl Device {
    /// Opens `path` for `access` (O_DIRECT unless `direct_io` is false) and takes its locks,
    /// waiting up to `lock_wait` for them.
    ///
    /// NOTE: the lock sits on the file that does the I/O on purpose. An io_uring that registered
    /// the file keeps it (and so the lock) until the kernel has finished the ring's requests, which
    /// after a crash happens a little after the process is gone; waiting for the lock is what keeps
    /// a new writer from reusing blocks that a dead writer's last requests still write to.
    pub fn open_locked(path: &Path, direct_io: bool, access: Access, lock_wait: std::time::Duration) -> Result<Device> {
        let deadline = std::time::Instant::now() + lock_wait;
        loop {
            match Device::open_for(path, direct_io, access) {
                Err(Error::Locked { .. }) if std::time::Instant::now() < deadline => {
                    std::thread::sleep(std::time::Duration::from_millis(10));
                }
                other => return other,
            }
        }
    }

    /// Opens `path` read-write (O_DIRECT unless `direct_io` is false) as its one writer.
    pub fn open(path: &Path, direct_io: bool) -> Result<Device> {
        Device::open_for(path, direct_io, Access::Writer)
    }

    /// Opens `path` for `access` (O_DIRECT unless `direct_io` is false) and takes its locks.
    pub fn open_for(path: &Path, direct_io: bool, access: Access) -> Result<Device> {
        let openers = EXTERNAL_OPENERS.lock().expect("external openers").clone();
        for opener in openers {
            if let Some(external) = opener(path)? {
                let file = OpenOptions::new()
                    .read(true)
                    .write(true)
                    .open("/dev/null")
                    .map_err(|source| Error::DeviceOpen { path: path.to_path_buf(), source })?;
                let size_bytes = external.size_bytes();
                return Ok(Device {
                    path: path.to_path_buf(),
                    file,
                    size_bytes,
                    is_block_device: true,
                    external: Some(external),
                    access,
                });
            }
        }
        let mut options = OpenOptions::new();
        options.read(true).write(access != Access::Reader);
        if direct_io {
            options.custom_flags(libc::O_DIRECT);
        }
        let file = options.open(path).map_err(|source| {
            if source.raw_os_error() == Some(libc::EINVAL) && direct_io {
                Error::DirectIoUnsupported { path: path.to_path_buf(), source }
            } else {
                Error::DeviceOpen { path: path.to_path_buf(), source }
            }
        })?;
        if let Err(e) = take_locks(&file, access) {
            return Err(if matches!(e.raw_os_error(), Some(libc::EAGAIN | libc::EACCES)) {
                Error::Locked { path: path.to_path_buf() }
            } else {
                Error::io(format!("locking {}", path.display()), e)
            });
        }
        let metadata = file.metadata().map_err(|e| Error::io(format!("stat {}", path.display()), e))?;
        let is_block_device = metadata.file_type().is_block_device();
        let size_bytes = if is_block_device { block_device_size(&file, path)? } else { metadata.len() };
        Ok(Device { path: path.to_path_buf(), file, size_bytes, is_block_device, external: None, access })
    }

    pub fn fd(&self) -> i32 {
        self.file.as_raw_fd()
    }

    /// Reads exactly `buf.len()` bytes at `offset` (synchronously; for superblocks at open time).
    pub fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        use std::os::unix::fs::FileExt;
        match &self.external {
            Some(e) => e.read_at(buf, offset),
            None => self.file.read_exact_at(buf, offset),
        }
        .map_err(|e| Error::io(format!("reading {} bytes at {} of {}", buf.len(), offset, self.path.display()), e))
    }

    /// Writes all of `buf` at `offset` (synchronously; for superblocks at format time).
    pub fn write_all_at(&self, buf: &[u8], offset: u64) -> Result<()> {
        use std::os::unix::fs::FileExt;
        match &self.external {
            Some(e) => e.write_at(buf, offset),
            None => self.file.write_all_at(buf, offset),
        }
        .map_err(|e| Error::io(format!("writing {} bytes at {} of {}", buf.len(), offset, self.path.display()), e))
    }

    pub fn sync(&self) -> Result<()> {
        match &self.external {
            Some(e) => e.flush(),
            None => self.file.sync_data(),
        }
        .map_err(|e| Error::io(format!("flushing {}", self.path.display()), e))
    }
}

impl Drop for Device {
    fn drop(&mut self) {
        // Release the locks now: an io_uring ring that registered this file drops its reference
        // asynchronously, which would otherwise keep them held for a while after close.
        if self.external.is_none() {
            let _ = ofd_lock(&self.file, libc::F_UNLCK, 0, 0);
        }
    }
}

fn block_device_size(file: &File, path: &Path) -> Result<u64> {
    let mut size: u64 = 0;
    // BLKGETSIZE64 = _IOR(0x12, 114, size_t)
    const BLKGETSIZE64: libc::c_ulong = 0x8008_1272;
    // SAFETY: the ioctl writes one u64 into `size`.
    if unsafe { libc::ioctl(file.as_raw_fd(), BLKGETSIZE64, &mut size) } != 0 {
        return Err(Error::io(format!("reading the size of {}", path.display()), std::io::Error::last_os_error()));
    }
    Ok(size)
}

/// Creates (or grows) a regular file of `size_bytes` with its blocks allocated up front, so a full
/// file system shows up now and not in the middle of a put.
pub fn create_file(path: &Path, size_bytes: u64) -> Result<()> {
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(path)
        .map_err(|source| Error::DeviceOpen { path: path.to_path_buf(), source })?;
    // SAFETY: fallocate on a valid fd.
    let rc = unsafe { libc::fallocate(file.as_raw_fd(), 0, 0, size_bytes as libc::off_t) };
    if rc != 0 {
        let e = std::io::Error::last_os_error();
        if e.raw_os_error() == Some(libc::ENOSPC) {
            // The file system is full, not a store: say which file could not get its blocks.
            return Err(Error::io(
                format!("reserving {size_bytes} bytes for {} (its file system is full)", path.display()),
                e,
            ));
        }
        // File systems without fallocate: fall back to a sparse file, and say so.
        tracing::warn!(path = %path.display(), error = %e, "fallocate failed; the device file is sparse");
        file.set_len(size_bytes).map_err(|e| Error::io(format!("sizing {}", path.display()), e))?;
    }
    Ok(())
}

/// Whether a block device (or one of its partitions) is mounted, from /proc/self/mounts.
pub fn mounted_at(path: &Path) -> Option<String> {
    let canonical = std::fs::canonicalize(path).ok()?;
    let mounts = std::fs::read_to_string("/proc/self/mounts").ok()?;
    let name = canonical.to_string_lossy().to_string();
    mounts.lines().find_map(|line| {
        let mut fields = line.split_whitespace();
        let source = fields.next()?;
        let target = fields.next()?;
        (source == name
            || source.starts_with(&name) && source[name.len()..].chars().all(|c| c.is_ascii_digit() || c == 'p'))
        .then(|| format!("{source} on {target}"))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn second_open_is_refused_with_locked() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("d0");
        create_file(&p, 1 << 20).unwrap();
        let d = Device::open(&p, true).unwrap();
        assert_eq!(d.size_bytes, 1 << 20);
        assert!(matches!(Device::open(&p, true), Err(Error::Locked { .. })));
        drop(d);
        Device::open(&p, true).unwrap();
    }

    #[test]
    fn readers_beside_a_writer_but_format_alone() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("d0");
        create_file(&p, 1 << 20).unwrap();
        let writer = Device::open_for(&p, false, Access::Writer).unwrap();
        let reader = Device::open_for(&p, false, Access::Reader).unwrap();
        let second_reader = Device::open_for(&p, false, Access::Reader).unwrap();
        assert!(matches!(Device::open_for(&p, false, Access::Writer), Err(Error::Locked { .. })));
        assert!(matches!(Device::open_for(&p, false, Access::Exclusive), Err(Error::Locked { .. })));
        assert!(reader.write_all_at(&[1], 0).is_err(), "a reader's file is opened read-only");
        drop(writer);
        assert!(matches!(Device::open_for(&p, false, Access::Exclusive), Err(Error::Locked { .. })));
        let writer = Device::open_for(&p, false, Access::Writer).unwrap();
        drop((writer, reader, second_reader));
        let format = Device::open_for(&p, false, Access::Exclusive).unwrap();
        assert!(matches!(Device::open_for(&p, false, Access::Reader), Err(Error::Locked { .. })));
        drop(format);
    }

    #[test]
    fn missing_device_says_which() {
        let err = Device::open(Path::new("/nonexistent/teraio-dev"), true).unwrap_err();
        assert!(err.to_string().contains("/nonexistent/teraio-dev"), "{err}");
    }
}
