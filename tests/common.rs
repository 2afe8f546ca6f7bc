//! Helpers shared by the end-to-end tests: temporary stores on real files, random data.

use rand::{RngExt, SeedableRng};
use std::path::PathBuf;
use teraio_engine::{BackendKind, FormatConfig, OpenConfig, Store, MIB};

/// A temporary directory with `count` device files of `size` bytes.
pub struct TempDevices {
    pub dir: tempfile::TempDir,
    pub paths: Vec<PathBuf>,
}

impl TempDevices {
    pub fn new(count: usize, size: u64) -> Self {
        let dir = tempfile::Builder::new().prefix("teraio-test").tempdir_in(test_dir()).expect("temp dir");
        let paths = (0..count).map(|i| dir.path().join(format!("dev{i}"))).collect::<Vec<_>>();
        for p in &paths {
            teraio_engine::device::create_file(p, size).expect("device file");
        }
        TempDevices { dir, paths }
    }
}

/// Where test devices go: $TERAIO_TEST_DIR, else the target directory (a real file system that
/// supports O_DIRECT, unlike a tmpfs /tmp).
pub fn test_dir() -> PathBuf {
    std::env::var_os("TERAIO_TEST_DIR").map(PathBuf::from).unwrap_or_else(|| {
        let p = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target/test-devices");
        std::fs::create_dir_all(&p).expect("test dir");
        p
    })
}

/// A small-store format: 64 KiB stripe units so small objects still stripe, 1 MiB metadata.
pub fn small_format() -> FormatConfig {
    FormatConfig {
        stripe_unit_bytes: 64 * 1024,
        checkpoint_slot_bytes: Some(MIB),
        journal_bytes: Some(MIB),
        ..Default::default()
    }
}

pub fn open_config(backend: BackendKind) -> OpenConfig {
    OpenConfig {
        backend,
        queue_depth: 8,
        bounce_pool_bytes: 4 * MIB,
        max_io_bytes: 64 * 1024,
        max_inflight_bytes: 8 * MIB,
        ..Default::default()
    }
}

pub fn create(devices: &TempDevices, backend: BackendKind) -> Store {
    Store::create(&devices.paths, &small_format(), open_config(backend)).expect("create store")
}

pub fn random_bytes(len: usize, seed: u64) -> Vec<u8> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut v = vec![0u8; len];
    rng.fill(&mut v[..]);
    v
}

/// Both real backends, for tests that must pass on each.
pub const BACKENDS: [BackendKind; 2] = [BackendKind::IoUring, BackendKind::Psync];

/// Damages a device file as failing media would: XORs `mask` into the byte at `offset`, durably.
pub fn flip_bits(path: &std::path::Path, offset: u64, mask: u8) {
    use std::io::{Read, Seek, SeekFrom, Write};
    let mut f = std::fs::OpenOptions::new().read(true).write(true).open(path).unwrap();
    let mut b = [0u8; 1];
    f.seek(SeekFrom::Start(offset)).unwrap();
    f.read_exact(&mut b).unwrap();
    b[0] ^= mask;
    f.seek(SeekFrom::Start(offset)).unwrap();
    f.write_all(&b).unwrap();
    f.sync_all().unwrap();
}
