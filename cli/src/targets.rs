//! Checks on the files and block devices a command is pointed at, done before anything is opened
//! for writing, so that every mistake ends in one line that says what to do: a mounted device,
//! a directory, a missing or unwritable path, tmpfs (no O_DIRECT), or existing data that only
//! `--force` may overwrite. Also the embedded default target: a temporary 4-file store.

use crate::error::{CliError, CliResult};
use crate::units::format_bytes;
use std::ffi::CString;
use std::fs::{File, OpenOptions};
use std::io::Read;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::FileTypeExt;
use std::path::{Path, PathBuf};

/// tmpfs's statfs magic: it has no O_DIRECT.
const TMPFS_MAGIC: i64 = 0x0102_1994;

/// Bytes at the start of a target looked at to decide whether it holds data.
const PROBE_BYTES: usize = 64 * 1024;

/// What a command will do to its targets (used in messages).
#[derive(Debug, Clone, Copy)]
pub enum Intent {
    /// `teraio bench`: formats the targets and writes benchmark data.
    Bench,
    /// `teraio format`: writes a new store.
    Format,
}

impl Intent {
    fn command(self) -> &'static str {
        match self {
            Intent::Bench => "teraio bench",
            Intent::Format => "teraio format",
        }
    }
}

/// Checks every target before a store is formatted on them. `create_bytes` is the size for
/// missing files (None: they must exist); `buffered` lifts the O_DIRECT (tmpfs) check.
pub fn check_writable_targets(
    paths: &[PathBuf],
    intent: Intent,
    force: bool,
    create_bytes: Option<u64>,
    buffered: bool,
) -> CliResult<()> {
    if paths.is_empty() {
        return Err(CliError::input("no targets given; name the files or block devices to use"));
    }
    for (i, p) in paths.iter().enumerate() {
        if paths[..i].contains(p) {
            return Err(CliError::input(format!("{} is given twice; give each target once", p.display())));
        }
    }
    for path in paths {
        check_one(path, intent, force, create_bytes, buffered)?;
    }
    Ok(())
}

fn check_one(path: &Path, intent: Intent, force: bool, create_bytes: Option<u64>, buffered: bool) -> CliResult<()> {
    let shown = path.display();
    match std::fs::metadata(path) {
        Ok(meta) => {
            if meta.is_dir() {
                return Err(CliError::input(format!(
                    "{shown} is a directory; give a file or block device path (e.g. {shown}/d0)"
                )));
            }
            let is_block = meta.file_type().is_block_device();
            if !is_block && !meta.is_file() {
                return Err(CliError::input(format!(
                    "{shown} is neither a regular file nor a block device; give a file or block device path"
                )));
            }
            if is_block {
                if let Some(mount) = teraio_engine::device::mounted_at(path) {
                    return Err(CliError::input(format!(
                        "{shown} is mounted ({mount}) and holds a file system in use; unmount it or choose another device"
                    )));
                }
            }
            let mut file = OpenOptions::new().read(true).write(true).open(path).map_err(|e| {
                CliError::input(format!(
                    "cannot write {shown}: {e}; choose a target you may write, or fix its permissions"
                ))
            })?;
            if !buffered && !is_block {
                check_direct_io_fs(path)?;
            }
            if !force {
                if let Some(what) = existing_data(&mut file, is_block)? {
                    return Err(CliError::input(format!(
                        "{shown} holds {what}; `{}` would overwrite it: pass --force to use it anyway",
                        intent.command()
                    )));
                }
            }
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let parent = match path.parent() {
                Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
                _ => PathBuf::from("."),
            };
            if !parent.is_dir() {
                return Err(CliError::input(format!(
                    "cannot create {shown}: directory {} does not exist; create it first or choose another path",
                    parent.display()
                )));
            }
            if !is_writable_dir(&parent) {
                return Err(CliError::input(format!(
                    "cannot create {shown}: directory {} is not writable; choose a target you may write",
                    parent.display()
                )));
            }
            if create_bytes.is_none() {
                return Err(CliError::input(format!(
                    "{shown} does not exist; pass --file-size SIZE to create it (or name an existing file or device)"
                )));
            }
            if !buffered {
                check_direct_io_fs(&parent)?;
            }
        }
        Err(e) => {
            return Err(CliError::input(format!("cannot use {shown}: {e}; check the path and its permissions")));
        }
    }
    Ok(())
}

/// Checks that the store's devices exist, for commands that open an existing store.
pub fn check_existing_store_paths(paths: &[PathBuf]) -> CliResult<()> {
    if paths.is_empty() {
        return Err(CliError::input("no devices given; name every device of the store (as given to `teraio format`)"));
    }
    for path in paths {
        match std::fs::metadata(path) {
            Ok(meta) if meta.is_dir() => {
                return Err(CliError::input(format!(
                    "{} is a directory; give the store's device files or block devices",
                    path.display()
                )))
            }
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(CliError::input(format!(
                    "{} does not exist; give every device of the store (as given to `teraio format`)",
                    path.display()
                )))
            }
            Err(e) => return Err(CliError::input(format!("cannot use {}: {e}", path.display()))),
        }
    }
    Ok(())
}

/// What the start of a target holds, if anything: a teraio store, an ext2/3/4 or xfs file
/// system, or some other non-zero data. Files created by `fallocate` read as zeros.
fn existing_data(file: &mut File, is_block: bool) -> CliResult<Option<&'static str>> {
    let mut head = vec![0u8; PROBE_BYTES];
    let mut filled = 0;
    while filled < head.len() {
        match file.read(&mut head[filled..]) {
            Ok(0) => break,
            Ok(n) => filled += n,
            Err(e) => return Err(CliError::failed(format!("cannot read the start of a target: {e}"))),
        }
    }
    let head = &head[..filled];
    if head.starts_with(b"TERAIOSB") {
        return Ok(Some("a teraio store"));
    }
    if head.len() > 1081 && head[1080] == 0x53 && head[1081] == 0xEF {
        return Ok(Some("an ext2/3/4 file system"));
    }
    if head.starts_with(b"XFSB") {
        return Ok(Some("an xfs file system"));
    }
    if head.iter().any(|&b| b != 0) {
        return Ok(Some(if is_block { "data (a partition table or file system?)" } else { "data" }));
    }
    Ok(None)
}

fn is_writable_dir(dir: &Path) -> bool {
    let Ok(c) = CString::new(dir.as_os_str().as_bytes()) else { return false };
    // SAFETY: access reads a NUL-terminated path.
    unsafe { libc::access(c.as_ptr(), libc::W_OK | libc::X_OK) == 0 }
}

fn statfs(path: &Path) -> Option<libc::statfs> {
    let c = CString::new(path.as_os_str().as_bytes()).ok()?;
    // SAFETY: statfs fills the struct for a NUL-terminated path.
    unsafe {
        let mut out: libc::statfs = std::mem::zeroed();
        (libc::statfs(c.as_ptr(), &mut out) == 0).then_some(out)
    }
}

/// Refuses paths on tmpfs, where O_DIRECT fails.
// statfs field types differ between libc targets; the casts are needed on some of them.
#[allow(clippy::unnecessary_cast)]
fn check_direct_io_fs(path: &Path) -> CliResult<()> {
    if let Some(fs) = statfs(path) {
        if fs.f_type as i64 == TMPFS_MAGIC {
            return Err(CliError::input(format!(
                "{} is on tmpfs, which has no O_DIRECT; put the targets on a disk file system (ext4, xfs), set TMPDIR to one, or pass --buffered",
                path.display()
            )));
        }
    }
    Ok(())
}

/// Free bytes available to us on the file system holding `dir`.
#[allow(clippy::unnecessary_cast)]
pub fn free_bytes(dir: &Path) -> CliResult<u64> {
    let fs = statfs(dir).ok_or_else(|| CliError::failed(format!("cannot read free space of {}", dir.display())))?;
    Ok(fs.f_bavail as u64 * fs.f_bsize as u64)
}

/// The embedded default target: `count` files in a fresh directory under the temp directory,
/// removed (with the directory) when dropped.
pub struct TempStore {
    pub dir: PathBuf,
    pub paths: Vec<PathBuf>,
}

impl TempStore {
    /// Picks the directory and file names; nothing is created until the store is formatted.
    /// `needed_bytes` is checked against the free space first.
    pub fn plan(count: usize, bytes_per_file: u64) -> CliResult<TempStore> {
        let base = std::env::temp_dir();
        check_direct_io_fs(&base)?;
        let free = free_bytes(&base)?;
        let needed = bytes_per_file * count as u64;
        if needed > free {
            return Err(CliError::input(format!(
                "the default store needs {} but {} has {} free; pass a smaller --data-size, set TMPDIR, or give targets",
                format_bytes(needed),
                base.display(),
                format_bytes(free)
            )));
        }
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.subsec_nanos());
        let dir = base.join(format!("teraio-bench-{}-{nanos}", std::process::id()));
        std::fs::create_dir(&dir).map_err(|e| {
            CliError::input(format!("cannot create {}: {e}; set TMPDIR to a writable disk directory", dir.display()))
        })?;
        let paths = (0..count).map(|i| dir.join(format!("d{i}"))).collect();
        Ok(TempStore { dir, paths })
    }
}

impl Drop for TempStore {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Bytes a set of target files still needs on one file system, and what it has free.
#[derive(Debug, Clone, PartialEq)]
pub struct SpaceNeed {
    /// A directory on that file system (the first target's).
    pub dir: PathBuf,
    /// Bytes the files to create or grow add.
    pub needed_bytes: u64,
}

/// What creating or growing `paths` to `file_bytes` each adds, per file system (its device
/// number); block devices and files already that large add nothing.
pub fn space_needed(paths: &[PathBuf], file_bytes: u64) -> Vec<SpaceNeed> {
    use std::os::unix::fs::MetadataExt;
    let mut by_device: Vec<(u64, SpaceNeed)> = Vec::new();
    for path in paths {
        let (current, dir) = match std::fs::metadata(path) {
            Ok(meta) if meta.is_file() => (meta.len(), path.parent().map(Path::to_path_buf).unwrap_or_default()),
            Ok(_) => continue, // a block device: nothing to allocate
            Err(_) => (0, path.parent().map(Path::to_path_buf).unwrap_or_default()),
        };
        let dir = if dir.as_os_str().is_empty() { PathBuf::from(".") } else { dir };
        let Ok(device) = std::fs::metadata(&dir).map(|m| m.dev()) else { continue };
        let adds = file_bytes.saturating_sub(current);
        match by_device.iter_mut().find(|(d, _)| *d == device) {
            Some((_, need)) => need.needed_bytes += adds,
            None => by_device.push((device, SpaceNeed { dir, needed_bytes: adds })),
        }
    }
    by_device.into_iter().map(|(_, need)| need).filter(|need| need.needed_bytes > 0).collect()
}

/// Refuses to create or grow targets where their file system has less free space than they
/// need: the message names both, in bytes. `free_bytes_of` reads a directory's free space
/// (`free_bytes`; the tests feed their own).
pub fn check_free_space(needs: &[SpaceNeed], free_bytes_of: impl Fn(&Path) -> CliResult<u64>) -> CliResult<()> {
    for need in needs {
        let free = free_bytes_of(&need.dir)?;
        if need.needed_bytes > free {
            return Err(CliError::input(format!(
                "the targets need {} bytes ({}) more on the file system of {}, which has {} bytes ({}) free; pass a smaller --data-size or --file-size, or put the targets on a larger disk",
                need.needed_bytes,
                format_bytes(need.needed_bytes),
                need.dir.display(),
                free,
                format_bytes(free)
            )));
        }
    }
    Ok(())
}

/// Target files a run created: removed when dropped unless the run succeeded (`keep`), so that a
/// failed run leaves nothing behind.
pub struct CreatedFiles {
    paths: Vec<PathBuf>,
}

impl CreatedFiles {
    /// Notes which of `paths` do not exist yet (call before creating them).
    pub fn before_creating(paths: &[PathBuf]) -> CreatedFiles {
        CreatedFiles { paths: paths.iter().filter(|p| std::fs::symlink_metadata(p).is_err()).cloned().collect() }
    }

    /// The run succeeded: the files stay.
    pub fn keep(mut self) {
        self.paths.clear();
    }
}

impl Drop for CreatedFiles {
    fn drop(&mut self) {
        for path in &self.paths {
            match std::fs::remove_file(path) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => eprintln!("warning: could not remove {} which this run created: {e}", path.display()),
            }
        }
    }
}

#[cfg(test)]
mod space_tests {
    use super::*;

    fn scratch(name: &str) -> PathBuf {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../target/test-files")
            .join(format!("teraio-space-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn new_and_growing_files_need_their_missing_bytes_on_their_file_system() {
        let dir = scratch("need");
        let existing = dir.join("d0");
        std::fs::write(&existing, vec![0u8; 1000]).unwrap();
        let paths = [existing, dir.join("d1")];
        let needs = space_needed(&paths, 4096);
        assert_eq!(needs, vec![SpaceNeed { dir: dir.clone(), needed_bytes: (4096 - 1000) + 4096 }]);
        assert!(space_needed(&paths[..1], 1000).is_empty(), "a file already that large needs nothing");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn too_little_free_space_is_refused_naming_both_figures() {
        let needs = [SpaceNeed { dir: PathBuf::from("/data"), needed_bytes: 200 << 30 }];
        let error = check_free_space(&needs, |_| Ok(41 << 30)).unwrap_err();
        assert_eq!(error.exit_code, crate::error::EXIT_BAD_INPUT);
        assert!(error.message.contains(&format!("need {} bytes (200 GiB)", 200u64 << 30)), "{}", error.message);
        assert!(error.message.contains(&format!("has {} bytes (41 GiB) free", 41u64 << 30)), "{}", error.message);
        assert!(error.message.contains("/data"), "{}", error.message);
        check_free_space(&needs, |_| Ok(200 << 30)).expect("exactly enough is enough");
    }

    #[test]
    fn created_files_go_unless_kept() {
        let dir = scratch("created");
        let old = dir.join("old");
        std::fs::write(&old, b"x").unwrap();
        let paths = [old.clone(), dir.join("new")];
        let created = CreatedFiles::before_creating(&paths);
        std::fs::write(&paths[1], b"y").unwrap();
        drop(created);
        assert!(old.exists() && !paths[1].exists(), "only the file the run made is removed");
        let created = CreatedFiles::before_creating(&paths);
        std::fs::write(&paths[1], b"y").unwrap();
        created.keep();
        assert!(paths[1].exists());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

/// File-system name of a statfs magic number, for the bench's first line.
fn file_system_name(magic: i64) -> &'static str {
    match magic {
        0xEF53 => "ext4",
        0x5846_5342 => "xfs",
        0x9123_683E => "btrfs",
        0x0102_1994 => "tmpfs",
        0x794C_7630 => "overlayfs",
        0x6969 => "nfs",
        0x2FC1_2FC1 => "zfs",
        _ => "a file system",
    }
}

/// What the targets are, in words: `4 files on one file system (ext4, under /tmp/x): d0, d1, ...`
/// or `2 block devices: /dev/nvme0n1, /dev/nvme1n1` (a mix lists both). Files on one file system
/// share its disk, which the figures then measure, not one disk each.
// statfs field types differ between libc targets; the casts are needed on some of them.
#[allow(clippy::unnecessary_cast)]
pub fn describe_targets(paths: &[PathBuf]) -> String {
    use std::os::unix::fs::MetadataExt;
    let mut devices = Vec::new();
    let mut files = Vec::new();
    let mut file_systems: Vec<(u64, String)> = Vec::new();
    for path in paths {
        match std::fs::metadata(path) {
            Ok(meta) if meta.file_type().is_block_device() => devices.push(path.display().to_string()),
            Ok(meta) => {
                files.push(path.file_name().map_or_else(|| path.display().to_string(), |n| n.to_string_lossy().into()));
                if !file_systems.iter().any(|(dev, _)| *dev == meta.dev()) {
                    let name = statfs(path).map_or("a file system", |fs| file_system_name(fs.f_type as i64));
                    let dir = path.parent().map_or_else(String::new, |d| d.display().to_string());
                    file_systems.push((meta.dev(), format!("{name}, under {dir}")));
                }
            }
            Err(_) => files.push(path.display().to_string()),
        }
    }
    let mut parts = Vec::new();
    if !files.is_empty() {
        let count = match file_systems.len() {
            1 => "one file system".to_string(),
            n => format!("{n} file systems"),
        };
        let where_ = file_systems.iter().map(|(_, text)| text.as_str()).collect::<Vec<_>>().join("; ");
        let noun = if files.len() == 1 { "file" } else { "files" };
        parts.push(format!("{} {noun} on {count} ({where_}): {}", files.len(), files.join(", ")));
    }
    if !devices.is_empty() {
        let noun = if devices.len() == 1 { "block device" } else { "block devices" };
        parts.push(format!("{} {noun}: {}", devices.len(), devices.join(", ")));
    }
    parts.join("; ")
}

#[cfg(test)]
mod describe_tests {
    use super::*;

    #[test]
    fn files_on_one_file_system_say_so() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../target/test-files")
            .join(format!("teraio-describe-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let paths: Vec<PathBuf> = (0..4).map(|i| dir.join(format!("d{i}"))).collect();
        for path in &paths {
            std::fs::write(path, b"").unwrap();
        }
        let text = describe_targets(&paths);
        assert!(text.starts_with("4 files on one file system ("), "{text}");
        assert!(text.ends_with("): d0, d1, d2, d3"), "{text}");
        assert!(text.contains(&format!("under {}", dir.display())), "{text}");
        assert_eq!(file_system_name(0xEF53), "ext4");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
