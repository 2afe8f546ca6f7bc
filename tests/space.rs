//! Space: a put fails with `NoSpace` only when no device placement exists, device 0 (which
//! also holds the metadata) does not fill first, and the error reports the store's free space
//! and the largest object it can place, with advice that fits the cause.

use teraio_e2e::*;
use teraio_engine::{BackendKind, Error, FormatConfig, OpenConfig, Priority, Store, KIB, MIB};

fn fast_config() -> OpenConfig {
    OpenConfig { durable: false, ..open_config(BackendKind::Auto) }
}

#[test]
fn small_puts_fill_every_device_before_no_space() {
    // The reported case: 3 x 64 MiB, 1 MiB stripe units, 512 KiB objects (one device each).
    let devices = TempDevices::new(3, 64 * MIB);
    let store = Store::create(&devices.paths, &FormatConfig::default(), fast_config()).unwrap();
    let data = random_bytes(512 * KIB as usize, 3);
    let mut puts = 0u64;
    let err = loop {
        match store.put(puts, data.clone(), b"", Priority::Normal).and_then(|t| t.wait()) {
            Ok(_) => puts += 1,
            Err(e) => break e,
        }
    };
    let Error::NoSpace { needed_bytes, free_bytes, largest_placeable_bytes } = err else { panic!("{err}") };
    assert_eq!(needed_bytes, 512 * KIB);
    let info = store.info();
    // No device had room left for the object.
    for d in &info.devices {
        assert!(d.largest_free_bytes < 512 * KIB, "device {} still had {} bytes free", d.index, d.free_bytes);
    }
    assert_eq!(free_bytes, info.devices.iter().map(|d| d.free_bytes).sum::<u64>());
    assert!(largest_placeable_bytes < 512 * KIB);
    let data_bytes: u64 = info.devices.iter().map(|d| d.data_bytes).sum();
    assert_eq!(puts, info.devices.iter().map(|d| d.data_bytes / (512 * KIB)).sum::<u64>(), "of {data_bytes}");
    // The failure took nothing; deleting one object makes room for one put again.
    assert!(store.delete(0).unwrap());
    store.put_blocking(puts, &data, b"").unwrap();
}

#[test]
fn devices_fill_evenly_though_device_0_holds_the_metadata() {
    let devices = TempDevices::new(3, 64 * MIB);
    let store = Store::create(&devices.paths, &FormatConfig::default(), fast_config()).unwrap();
    let data = random_bytes(512 * KIB as usize, 4);
    for id in 0..60 {
        store.put_blocking(id, &data, b"").unwrap();
    }
    let free: Vec<u64> = store.info().devices.iter().map(|d| d.free_bytes).collect();
    let (low, high) = (*free.iter().min().unwrap(), *free.iter().max().unwrap());
    assert!(high - low <= 512 * KIB, "free space per device drifted apart: {free:?}");
}

#[test]
fn scattered_free_space_gets_the_right_advice_and_an_exact_largest_size() {
    // One device, 4 KiB objects, every other one deleted: plenty of free space, but one object
    // can gather at most 64 runs of 4 KiB.
    let devices = TempDevices::new(1, 8 * MIB);
    let store = create(&devices, BackendKind::Auto);
    let store = {
        drop(store);
        Store::open(&devices.paths, fast_config()).unwrap()
    };
    let block = random_bytes(4096, 8);
    let mut count = 0;
    while store.put(count, block.clone(), b"", Priority::Normal).and_then(|t| t.wait()).is_ok() {
        count += 1;
    }
    for id in (0..count).step_by(2) {
        assert!(store.delete(id).unwrap());
    }
    let err = store.put(1 << 40, vec![7u8; MIB as usize], b"", Priority::Normal).err().expect("no placement");
    let Error::NoSpace { needed_bytes, free_bytes, largest_placeable_bytes } = err.clone() else { panic!("{err}") };
    assert_eq!(needed_bytes, MIB);
    assert!(free_bytes > MIB, "{free_bytes}");
    assert_eq!(largest_placeable_bytes, 64 * 4096);
    let message = err.to_string();
    assert!(message.contains(&format!("{free_bytes} bytes free")), "{message}");
    assert!(
        message.contains(&format!("largest object it can place now is {largest_placeable_bytes} bytes")),
        "{message}"
    );
    assert!(message.contains("smaller objects"), "{message}");
    assert!(!message.contains("add devices"), "{message}");
    // The reported size fits; one block more does not.
    let fits = random_bytes(largest_placeable_bytes as usize, 9);
    store.put_blocking(1 << 41, &fits, b"").unwrap();
    assert_eq!(store.get_to_vec(1 << 41).unwrap(), fits);
    assert!(store.delete(1 << 41).unwrap());
    let over = vec![1u8; largest_placeable_bytes as usize + 4096];
    assert!(matches!(store.put(1 << 42, over, b"", Priority::Normal).err(), Some(Error::NoSpace { .. })));
}

#[test]
fn a_full_object_table_refuses_growth_but_never_wedges() {
    // The reported case: 3 x 64 MiB with default options, small objects with 4 KiB of metadata
    // each. The table fills long before the data area; puts that grow it fail with a table-full
    // error naming the limit, and deletes and shrinking overwrites go on succeeding, also across
    // journal wraps and a reopen.
    let devices = TempDevices::new(3, 64 * MIB);
    let store = Store::create(&devices.paths, &FormatConfig::default(), fast_config()).unwrap();
    let meta = vec![0x5au8; 4096];
    let data = random_bytes(4096, 10);
    let mut stored = 0u64;
    let err = loop {
        assert!(stored < 2048, "the table never filled");
        match store.put(stored, data.clone(), &meta, Priority::Normal).and_then(|t| t.wait()) {
            Ok(_) => stored += 1,
            Err(e) => break e,
        }
    };
    let Error::TableFull { .. } = err else { panic!("expected a table-full error, got {err}") };
    let message = err.to_string();
    assert!(message.contains("the object table is full"), "{message}");
    assert!(message.contains("checkpoint slot"), "{message}");
    assert!(message.contains("not data space"), "{message}");
    let info = store.info();
    assert!(info.table_bytes <= info.checkpoint_slot_bytes, "{} > {}", info.table_bytes, info.checkpoint_slot_bytes);
    assert!(info.table_bytes + 4096 + 64 > info.checkpoint_slot_bytes, "full well before the slot: {info:?}");
    let free: u64 = info.devices.iter().map(|d| d.free_bytes).sum();
    assert!(free > 100 * MIB, "data space is not the limit here: {free}");
    assert_eq!(info.object_count as u64, stored);
    // fsck calls the table full, and nothing damaged.
    let report = store.fsck().unwrap();
    assert!(report.is_clean(), "{:?}", report.problems);
    assert!(report.notes.iter().any(|n| n.contains("object table is") && n.contains("% full")), "{:?}", report.notes);

    // Shrinking overwrites and deletes always commit: hundreds of them, so that the journal
    // fills and is checkpointed many times over while the table stays full.
    for round in 0..3u64 {
        for id in 0..stored {
            store.put_blocking(id, &data, &meta[..(round as usize + 1) * 8]).unwrap();
        }
        for id in 0..stored {
            store.put_blocking(id, &data, &meta).unwrap_or_else(|e| panic!("round {round}, id {id}: {e}"));
        }
    }
    for id in 0..stored / 2 {
        assert!(store.delete(id).unwrap());
    }
    // Room again: new objects fit.
    store.put_blocking(1 << 40, &data, &meta).unwrap();
    drop(store);
    let store = Store::open(&devices.paths, fast_config()).unwrap();
    assert_eq!(store.info().object_count as u64, stored - stored / 2 + 1);
    assert_eq!(store.get_to_vec(stored - 1).unwrap(), data);
    for id in stored / 2..stored {
        assert!(store.delete(id).unwrap());
    }
    assert_eq!(store.info().object_count, 1);
}
