//! What this machine offers for GPU I/O, found at run time and reported in words: the CUDA
//! driver and its devices, libcufile, the nvidia-fs kernel driver, cuFile's configuration, and for
//! each store file whether true GPUDirect Storage can work there or cuFile would run in
//! compatibility mode, and why. Nothing here falls back silently: the report says what was found
//! and the store says which path it uses.

use super::cufile;
use super::driver::{self as cuda, DeviceDescription, DriverInfo};
use std::fmt;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

/// The whole report of [`probe`].
#[derive(Debug, Clone)]
pub struct GpuProbe {
    /// The CUDA driver, or why there is none ("no CUDA driver found: libcuda.so.1 not loadable").
    pub driver: Result<DriverInfo, String>,
    pub devices: Vec<DeviceDescription>,
    /// libcufile with its driver opened: the file loaded and its version, or why not.
    pub cufile: Result<(String, Option<i32>), String>,
    /// Whether the nvidia-fs kernel driver is loaded (true GDS through it needs it).
    pub nvidia_fs_loaded: bool,
    /// The cuFile configuration file in effect and its `allow_compat_mode` setting, if readable.
    pub cufile_config: PathBuf,
    pub allow_compat_mode: Option<bool>,
}

/// Looks at the machine now (loads the CUDA driver and libcufile if present; opens cuFile's
/// driver once per process).
pub fn probe() -> GpuProbe {
    let driver = cuda::driver().cloned().map_err(|e| reason_of(&e));
    let devices = match &driver {
        Ok(d) => (0..d.device_count).filter_map(|i| cuda::describe(i).ok()).collect(),
        Err(_) => Vec::new(),
    };
    let cufile = match &driver {
        Ok(_) => cufile::cufile().map(|c| (c.library.clone(), c.version)).map_err(|e| reason_of(&e)),
        Err(_) => Err("not tried: no CUDA driver".into()),
    };
    let cufile_config = cufile_config_path();
    let allow_compat_mode =
        std::fs::read_to_string(&cufile_config).ok().and_then(|t| json_bool(&t, "allow_compat_mode"));
    GpuProbe { driver, devices, cufile, nvidia_fs_loaded: nvidia_fs_loaded(), cufile_config, allow_compat_mode }
}

fn reason_of(e: &crate::Error) -> String {
    match e {
        crate::Error::BackendUnavailable { reason, .. } => reason.clone(),
        other => other.to_string(),
    }
}

/// Whether the nvidia-fs kernel module is loaded.
pub fn nvidia_fs_loaded() -> bool {
    Path::new("/sys/module/nvidia_fs").exists() || Path::new("/proc/driver/nvidia-fs/version").exists()
}

/// `CUFILE_ENV_PATH_JSON`, else `/etc/cufile.json`.
pub fn cufile_config_path() -> PathBuf {
    std::env::var_os("CUFILE_ENV_PATH_JSON").map(PathBuf::from).unwrap_or_else(|| PathBuf::from("/etc/cufile.json"))
}

/// The boolean after `"key":` in a cufile.json text (which may hold // comments, so no JSON parser).
fn json_bool(text: &str, key: &str) -> Option<bool> {
    let quoted = format!("\"{key}\"");
    for line in text.lines() {
        let line = line.trim_start();
        if line.starts_with("//") {
            continue;
        }
        if let Some(at) = line.find(&quoted) {
            let rest = line[at + quoted.len()..].trim_start().strip_prefix(':')?.trim_start();
            return if rest.starts_with("true") {
                Some(true)
            } else if rest.starts_with("false") {
                Some(false)
            } else {
                None
            };
        }
    }
    None
}

/// Why true GDS cannot serve `path` (empty when nothing stands in the way as far as we can tell):
/// the reasons cuFile would run in compatibility mode for it.
pub fn gds_obstacles(path: &Path) -> Vec<String> {
    let mut why = Vec::new();
    if !nvidia_fs_loaded() {
        why.push("nvidia-fs not loaded".to_string());
    }
    let Ok(meta) = std::fs::metadata(path) else {
        why.push(format!("cannot stat {}", path.display()));
        return why;
    };
    let (block_dev, raw_device) =
        if meta.file_type().is_block_device_like() { (meta.rdev(), true) } else { (meta.dev(), false) };
    if !raw_device {
        match fs_type(path) {
            Some(FS_EXT4) | Some(FS_XFS) => {}
            Some(t) => why.push(format!("file system not supported (type {t:#x}; GDS needs ext4 or xfs)")),
            None => why.push("file system type unknown (statfs failed)".into()),
        }
    }
    let (major, minor) = (libc::major(block_dev), libc::minor(block_dev));
    let record = format!("/run/udev/data/b{major}:{minor}");
    if !Path::new(&record).exists() {
        why.push(format!("no udev record ({record} missing)"));
    }
    why
}

trait BlockDeviceLike {
    fn is_block_device_like(&self) -> bool;
}
impl BlockDeviceLike for std::fs::FileType {
    fn is_block_device_like(&self) -> bool {
        use std::os::unix::fs::FileTypeExt;
        self.is_block_device()
    }
}

const FS_EXT4: i64 = 0xEF53;
const FS_XFS: i64 = 0x5846_5342;

fn fs_type(path: &Path) -> Option<i64> {
    let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).ok()?;
    // SAFETY: statfs is plain old data, for which all zeros is a valid value.
    let mut s: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: valid path and out-pointer.
    (unsafe { libc::statfs(c.as_ptr(), &mut s) } == 0).then_some(s.f_type as i64)
}

impl fmt::Display for GpuProbe {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.driver {
            Ok(d) => writeln!(
                f,
                "CUDA driver: version {}.{}, {} device(s)",
                d.version / 1000,
                d.version % 1000 / 10,
                d.device_count
            )?,
            Err(e) => writeln!(f, "CUDA driver: {e}")?,
        }
        for d in &self.devices {
            writeln!(
                f,
                "  GPU {}: {} ({} MiB, PCI {}, stream wait-value {})",
                d.ordinal,
                d.name,
                d.memory_bytes >> 20,
                d.pci_bus_id,
                if d.stream_wait_value { "yes" } else { "no" }
            )?;
        }
        match &self.cufile {
            Ok((lib, v)) => writeln!(
                f,
                "libcufile: {lib}, version {}",
                v.map_or("unknown".into(), |v| format!("{}.{}", v / 1000, v % 1000 / 10))
            )?,
            Err(e) => writeln!(f, "libcufile: {e}")?,
        }
        writeln!(f, "nvidia-fs kernel driver: {}", if self.nvidia_fs_loaded { "loaded" } else { "not loaded" })?;
        writeln!(
            f,
            "cuFile config: {} (allow_compat_mode: {})",
            self.cufile_config.display(),
            self.allow_compat_mode.map_or("unset/unreadable".into(), |b| b.to_string())
        )?;
        let paths = match (&self.driver, &self.cufile) {
            (Err(_), _) => "GPU paths: none (host memory only)".to_string(),
            (Ok(_), Err(_)) => "GPU paths: pinned bounce (cuFile unavailable)".to_string(),
            (Ok(_), Ok(_)) if self.nvidia_fs_loaded => "GPU paths: pinned bounce, cuFile (GDS possible)".to_string(),
            (Ok(_), Ok(_)) => {
                "GPU paths: pinned bounce, cuFile in compatibility mode (nvidia-fs not loaded)".to_string()
            }
        };
        writeln!(f, "{paths}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_bool_skips_comments() {
        let t = "{\n // \"allow_compat_mode\": false,\n \"properties\": {\n   \"allow_compat_mode\" : true,\n";
        assert_eq!(json_bool(t, "allow_compat_mode"), Some(true));
        assert_eq!(json_bool(t, "use_poll_mode"), None);
    }
}
