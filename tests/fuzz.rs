//! Malformed metadata: random bytes written over the superblock, the checkpoint slots and the
//! journal never make open panic; it either opens a consistent store or returns an error.
//! The decoders themselves are fuzzed with arbitrary bytes in their unit tests (engine/src/layout).

use proptest::prelude::*;
use std::os::unix::fs::FileExt;
use teraio_e2e::*;
use teraio_engine::{BackendKind, Priority, Store};

fn cases() -> u32 {
    std::env::var("TERAIO_FUZZ_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(48)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(cases()))]

    #[test]
    fn damaged_metadata_never_panics_open(
        // (region, offset within region, bytes): region 0 superblock, 1/2 checkpoint slots, 3 journal.
        damage in proptest::collection::vec((0u8..4, 0u64..8192, proptest::collection::vec(any::<u8>(), 1..64)), 1..6),
        close_cleanly in any::<bool>(),
    ) {
        let devices = TempDevices::new(2, 16 << 20);
        {
            let store = create(&devices, BackendKind::Auto);
            for id in 0..6u64 {
                store.put(id, random_bytes(10_000 * id as usize + 1, id), b"m", Priority::Normal).unwrap().wait().unwrap();
            }
            store.delete(2).unwrap();
            if close_cleanly { store.close().unwrap(); }
        }
        let f = std::fs::OpenOptions::new().write(true).open(&devices.paths[0]).unwrap();
        for (region, offset, bytes) in &damage {
            let base = match region { 0 => 0, 1 => 4096, 2 => 4096 + (1 << 20), _ => 4096 + (2 << 20) };
            f.write_all_at(bytes, base + offset).unwrap();
        }
        f.sync_all().unwrap();
        drop(f);
        if let Ok(store) = Store::open(&devices.paths, open_config(BackendKind::Auto)) {
            // Whatever it recovered must be readable and self-consistent.
            for info in store.list() {
                let _ = store.get_to_vec(info.id);
            }
            let _ = store.fsck().unwrap();
        }
    }
}
