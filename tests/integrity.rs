//! Metadata integrity on real files, through the public API and raw byte flips only: a damaged
//! journal batch with valid ones after it refuses the open (only a torn tail is dropped), nothing
//! is written while checking (and an earlier store's leftovers are not this store's batches),
//! fsck reports each damaged part and writes only with `repair`, a
//! reader opens beside a writer, and stale, short and wiped member devices are named.
//!
//! Stores are left "crashed" (acknowledged puts in the journal, no closing checkpoint) by a
//! child process, this test binary re-run as `writer_child`, that exits without closing.

use std::io::{Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::process::Command;
use teraio_e2e::*;
use teraio_engine::{BackendKind, Error, OpenConfig, Store, MIB};

/// small_format: metadata at 4096, two 1 MiB slots, then the 1 MiB journal ring.
const JOURNAL_START: u64 = 4096 + 2 * MIB;
const JOURNAL_BYTES: u64 = MIB;
const BATCH_HEADER: u64 = 64;

fn config() -> OpenConfig {
    // A killed writer's locks go with its last requests: wait for them.
    OpenConfig { lock_wait_ms: 10_000, ..open_config(BackendKind::Auto) }
}

fn object(id: u64) -> Vec<u8> {
    random_bytes(1000 + (id as usize % 7) * 3000, id)
}

#[test]
#[ignore = "run by the tests below as their child"]
fn writer_child() {
    let Some(dir) = std::env::var_os("TERAIO_INTEGRITY_DIR").map(PathBuf::from) else { return };
    let count: usize = std::env::var("TERAIO_INTEGRITY_DEVICES").unwrap().parse().unwrap();
    let store = Store::open(&device_paths(&dir, count), config()).expect("child open");
    for id in 100..120u64 {
        // Each put acknowledged before the next: one journal batch each, sequences 0..=19.
        store.put_blocking(id, &object(id), &id.to_le_bytes()).unwrap();
    }
    // Gone without closing: no final checkpoint, the puts live only in the journal.
    std::process::exit(0);
}

/// With 2100 bytes of metadata each put is one 4 KiB journal batch, so a 512 KiB journal region
/// holds 128 of them: 300 puts checkpoint twice (after puts 128 and 256, each journal region used
/// in turn) and journal 44 more after the last checkpoint.
const WRAPPING_PUTS: u64 = 300;

fn wrapping_meta(id: u64) -> Vec<u8> {
    vec![id as u8; 2100]
}

#[test]
#[ignore = "run by the tests below as their child"]
fn wrapping_writer_child() {
    let Some(dir) = std::env::var_os("TERAIO_INTEGRITY_DIR").map(PathBuf::from) else { return };
    let store = Store::open(&device_paths(&dir, 2), config()).expect("child open");
    for id in 0..WRAPPING_PUTS {
        store.put_blocking(id, &object(id), &wrapping_meta(id)).unwrap();
    }
    std::process::exit(0);
}

/// A store whose writer put `WRAPPING_PUTS` objects, checkpointing as the journal filled, and
/// went away with puts journaled since its last checkpoint.
fn crashed_wrapped_store() -> TempDevices {
    let devices = TempDevices::new(2, 16 << 20);
    Store::format(&devices.paths, &small_format()).unwrap();
    let status = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "wrapping_writer_child", "--ignored", "--nocapture", "--test-threads", "1"])
        .env("TERAIO_INTEGRITY_DIR", devices.dir.path())
        .status()
        .unwrap();
    assert!(status.success());
    devices
}

/// Offset and generation of the newest checkpoint: the slot whose header names the higher
/// generation.
fn newest_checkpoint(device0: &Path) -> (u64, u64) {
    let bytes = std::fs::read(device0).unwrap();
    let generation_at = |at: usize| u64::from_le_bytes(bytes[at + 8..at + 16].try_into().unwrap());
    let slots = [4096u64, 4096 + MIB];
    let newest = slots.into_iter().max_by_key(|&at| generation_at(at as usize)).unwrap();
    (newest, generation_at(newest as usize))
}

fn assert_wrapped_objects(store: &Store) {
    assert_eq!(store.info().object_count as u64, WRAPPING_PUTS);
    for id in 0..WRAPPING_PUTS {
        assert_eq!(store.get_to_vec(id).unwrap(), object(id), "object {id}");
        assert_eq!(store.stat(id).unwrap().meta, wrapping_meta(id), "object {id}");
    }
}

fn device_paths(dir: &Path, count: usize) -> Vec<PathBuf> {
    (0..count).map(|i| dir.join(format!("dev{i}"))).collect()
}

/// A store whose puts of ids 100..120 are acknowledged and in the journal only.
fn crashed_store(count: usize) -> TempDevices {
    let devices = TempDevices::new(count, 16 << 20);
    Store::format(&devices.paths, &small_format()).unwrap();
    let status = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "writer_child", "--ignored", "--nocapture", "--test-threads", "1"])
        .env("TERAIO_INTEGRITY_DIR", devices.dir.path())
        .env("TERAIO_INTEGRITY_DEVICES", count.to_string())
        .status()
        .unwrap();
    assert!(status.success());
    devices
}

/// The damage these tests do: one byte with bits flipped.
fn flip_byte(path: &std::path::Path, offset: u64) {
    flip_bits(path, offset, 0x20);
}

fn write_at(path: &Path, offset: u64, bytes: &[u8]) {
    let mut f = std::fs::OpenOptions::new().write(true).open(path).unwrap();
    f.seek(SeekFrom::Start(offset)).unwrap();
    f.write_all(bytes).unwrap();
    f.sync_all().unwrap();
}

/// Device offset of the journal batch with `sequence` in the newest generation in the ring.
fn batch_offset(device0: &Path, sequence: u64) -> u64 {
    let bytes = std::fs::read(device0).unwrap();
    let u64_at = |at: usize| u64::from_le_bytes(bytes[at..at + 8].try_into().unwrap());
    let batches: Vec<(u64, u64, u64)> = (JOURNAL_START..JOURNAL_START + JOURNAL_BYTES)
        .step_by(4096)
        .filter(|&at| &bytes[at as usize..at as usize + 8] == b"TIOJRNL1")
        .map(|at| (u64_at(at as usize + 8), u64_at(at as usize + 16), at))
        .collect();
    let newest = batches.iter().map(|b| b.0).max().expect("journal batches");
    batches.iter().find(|b| b.0 == newest && b.1 == sequence).expect("batch of that sequence").2
}

fn snapshot(paths: &[PathBuf]) -> Vec<Vec<u8>> {
    paths.iter().map(|p| std::fs::read(p).unwrap()).collect()
}

fn assert_all_present(paths: &[PathBuf]) {
    let store = Store::open(paths, config()).unwrap();
    for id in 100..120u64 {
        assert_eq!(store.get_to_vec(id).unwrap(), object(id), "object {id}");
    }
    assert!(store.fsck().unwrap().is_clean());
    store.close().unwrap();
}

/// The open is refused as damage naming device 0, the batch and its offset, and nothing on any
/// device changed: not by the writer's open, the reader's open, nor fsck.
fn assert_refused_untouched(devices: &TempDevices, batch: u64, offset: u64) {
    let before = snapshot(&devices.paths);
    let err = Store::open(&devices.paths, config()).err().expect("open must refuse a damaged journal");
    assert!(matches!(err, Error::CorruptMetadata { .. }), "{err}");
    let text = err.to_string();
    for needle in [
        devices.paths[0].display().to_string(),
        format!("batch {batch} "),
        format!("offset {offset}"),
        "restore device 0".to_string(),
    ] {
        assert!(text.contains(&needle), "{needle:?} missing from: {text}");
    }
    let err = Store::open_read_only(&devices.paths, config()).err().expect("read-only open refuses too");
    assert!(matches!(err, Error::CorruptMetadata { .. }), "{err}");
    let report = Store::fsck_paths(&devices.paths, config(), false).unwrap();
    assert_eq!(report.problems.len(), 1, "{:?}", report.problems);
    assert!(report.problems[0].contains(&format!("batch {batch} ")), "{:?}", report.problems);
    assert!(snapshot(&devices.paths) == before, "checking the store wrote to it");
}

#[test]
fn a_flipped_byte_in_a_middle_batch_refuses_the_open_and_loses_nothing() {
    let devices = crashed_store(3);
    let at = batch_offset(&devices.paths[0], 10);
    flip_byte(&devices.paths[0], at + BATCH_HEADER + 5);
    assert_refused_untouched(&devices, 10, at);
    // Nothing was dropped or overwritten: undo the flip and all 20 acknowledged puts are there.
    flip_byte(&devices.paths[0], at + BATCH_HEADER + 5);
    assert_all_present(&devices.paths);
}

#[test]
fn a_flipped_header_byte_of_the_first_batch_refuses_the_open_and_loses_nothing() {
    let devices = crashed_store(2);
    let at = batch_offset(&devices.paths[0], 0);
    flip_byte(&devices.paths[0], at + 20);
    assert_refused_untouched(&devices, 0, at);
    flip_byte(&devices.paths[0], at + 20);
    assert_all_present(&devices.paths);
}

/// The journal-flip harness: one flipped byte anywhere in a batch's header or payload either
/// refuses the open, naming that batch, or (only in the last batch, which a crash may tear)
/// drops that batch alone. Never is an acknowledged object lost silently.
#[test]
fn no_flipped_journal_byte_loses_an_acknowledged_object_silently() {
    let devices = crashed_store(2);
    let dev0 = &devices.paths[0];
    let mut refused = 0;
    for sequence in 0..20u64 {
        let at = batch_offset(dev0, sequence);
        for byte in (0..48).step_by(3).chain([BATCH_HEADER, BATCH_HEADER + 17, BATCH_HEADER + 40]) {
            flip_byte(dev0, at + byte);
            if sequence < 19 {
                // The writer's open: it must refuse before writing anything.
                let err = Store::open(&devices.paths, config()).err().unwrap_or_else(|| {
                    panic!("byte {byte} of batch {sequence} flipped: the store opened without batches after it")
                });
                assert!(err.to_string().contains(&format!("batch {sequence} ")), "{err}");
                refused += 1;
            } else {
                let store = Store::open_read_only(&devices.paths, config()).unwrap();
                for id in 100..119u64 {
                    assert_eq!(store.get_to_vec(id).unwrap(), object(id), "object {id}");
                }
                // Object 119 is dropped, never silently: the open says the batch may have held it.
                let info = store.info();
                let said = info
                    .recovery_problems
                    .iter()
                    .chain(&info.recovery_notes)
                    .any(|line| line.contains("batch 19") && line.contains("may have held acknowledged puts"));
                assert!(said, "byte {byte} of the last batch flipped: {info:?}");
            }
            flip_byte(dev0, at + byte);
        }
    }
    assert_eq!(refused, 19 * 19);
    assert_all_present(&devices.paths);
}

#[test]
fn a_torn_last_batch_is_dropped_and_said_so() {
    // The last batch's payload, then also its header, as an interrupted write leaves them.
    for wipe_header in [false, true] {
        let devices = crashed_store(2);
        let at = batch_offset(&devices.paths[0], 19);
        flip_byte(&devices.paths[0], at + BATCH_HEADER + 5);
        if wipe_header {
            write_at(&devices.paths[0], at, &[0u8; 64]);
        }
        let report = Store::fsck_paths(&devices.paths, config(), false).unwrap();
        assert!(report.is_clean(), "{:?}", report.problems);
        if !wipe_header {
            assert!(
                report.notes.iter().any(|n| n.contains("batch 19") && n.contains("cannot be told apart")),
                "{:?}",
                report.notes
            );
        }
        let store = Store::open(&devices.paths, config()).unwrap();
        for id in 100..119u64 {
            assert_eq!(store.get_to_vec(id).unwrap(), object(id), "object {id}");
        }
        assert!(store.stat(119).is_none(), "the torn batch was never acknowledged as far as the disk knows");
        // The store goes on from the torn batch's place.
        store.put_blocking(119, &object(119), b"").unwrap();
        drop(store);
        assert_all_present(&devices.paths);
    }
}

/// The last batch (object 119, acknowledged before the writer went away) with one flipped bit:
/// in its header, a damage fsck reports as a problem; in its payload, which a torn write can
/// look like too, a note that says it may have held acknowledged puts. Either way the open says
/// so through `info()` and never calls the batch "never acknowledged".
#[test]
fn a_flipped_last_batch_is_reported_as_possibly_acknowledged() {
    for (byte, in_header) in [(20, true), (3, true), (40, true), (BATCH_HEADER + 5, false)] {
        let devices = crashed_store(2);
        let at = batch_offset(&devices.paths[0], 19);
        flip_byte(&devices.paths[0], at + byte);
        let report = Store::fsck_paths(&devices.paths, config(), false).unwrap();
        let lines = if in_header { &report.problems } else { &report.notes };
        assert!(
            lines.iter().any(|l| l.contains("batch 19") && l.contains("may have held acknowledged puts")),
            "byte {byte}: {report:?}"
        );
        assert_eq!(report.is_clean(), !in_header, "byte {byte}: {:?}", report.problems);
        let every_line = report.problems.iter().chain(&report.notes);
        assert!(every_line.clone().all(|l| !l.contains("never acknowledged")), "byte {byte}: {report:?}");
        assert_eq!(report.objects_checked, 19, "byte {byte}");

        let store = Store::open(&devices.paths, config()).unwrap();
        assert!(store.stat(119).is_none(), "byte {byte}");
        let info = store.info();
        let said = if in_header { &info.recovery_problems } else { &info.recovery_notes };
        assert!(said.iter().any(|l| l.contains("batch 19") && l.contains("may have held")), "byte {byte}: {info:?}");
        for id in 100..119u64 {
            assert_eq!(store.get_to_vec(id).unwrap(), object(id), "object {id}");
        }
    }
}

#[test]
fn batches_of_a_store_formatted_earlier_on_the_device_never_count() {
    // The old store's batches 1..19 stay in the ring (format wipes only its head) and carry the
    // same generation numbers as the new store's will.
    let devices = crashed_store(2);
    let forced = teraio_engine::FormatConfig { force: true, ..small_format() };
    let started = std::time::Instant::now();
    // Format does not wait for locks: the killed writer's go with its last requests.
    loop {
        match Store::format(&devices.paths, &forced) {
            Ok(_) => break,
            Err(Error::Locked { .. }) if started.elapsed().as_secs() < 10 => {
                std::thread::sleep(std::time::Duration::from_millis(20))
            }
            Err(e) => panic!("{e}"),
        }
    }
    let store = Store::open(&devices.paths, config()).unwrap();
    assert!(store.list().is_empty());
    store.put_blocking(1, &object(1), b"").unwrap();
    drop(store);
    let report = Store::fsck_paths(&devices.paths, config(), false).unwrap();
    assert!(report.is_clean() && report.objects_checked == 1, "{:?}", report.problems);
}

#[test]
fn fsck_is_read_only_and_reports_each_damaged_superblock_copy() {
    let devices = TempDevices::new(2, 16 << 20);
    create(&devices, BackendKind::Auto).close().unwrap();
    let dev1 = &devices.paths[1];
    let size = std::fs::metadata(dev1).unwrap().len();

    // Only the backup copy: only the backup is reported.
    flip_byte(dev1, size - 4096 + 40);
    let before = snapshot(&devices.paths);
    let report = Store::fsck_paths(&devices.paths, config(), false).unwrap();
    assert_eq!(report.problems.len(), 1, "{:?}", report.problems);
    assert!(report.problems[0].contains("backup superblock"), "{:?}", report.problems);
    assert!(report.problems[0].contains("primary is good"), "{:?}", report.problems);
    assert!(report.problems[0].contains(&dev1.display().to_string()), "{:?}", report.problems);
    assert!(report.repairs.is_empty());
    assert!(snapshot(&devices.paths) == before, "fsck without repair wrote to the store");

    // The primary too on the other device: two problems, each on its own.
    flip_byte(&devices.paths[0], 40);
    let report = Store::fsck_paths(&devices.paths, config(), false).unwrap();
    assert_eq!(report.problems.len(), 2, "{:?}", report.problems);
    assert!(report.problems.iter().any(|p| p.contains("primary superblock") && p.contains("device 0")));

    // Repair rewrites each from its good copy and says so; then the store is clean.
    let report = Store::fsck_paths(&devices.paths, config(), true).unwrap();
    assert!(report.is_clean(), "{:?}", report.problems);
    assert_eq!(report.repairs.len(), 2, "{:?}", report.repairs);
    assert!(Store::fsck_paths(&devices.paths, config(), false).unwrap().is_clean());
}

#[test]
fn a_damaged_newest_checkpoint_is_reported_and_repaired() {
    let devices = TempDevices::new(1, 16 << 20);
    let data = random_bytes(50_000, 2);
    {
        let store = create(&devices, BackendKind::Auto);
        store.put_blocking(1, &data, b"").unwrap();
        store.close().unwrap(); // checkpoint generation 2 -> slot 0, at 4096
    }
    flip_byte(&devices.paths[0], 4096 + 70); // its payload
    let before = snapshot(&devices.paths);
    let report = Store::fsck_paths(&devices.paths, config(), false).unwrap();
    assert_eq!(report.problems.len(), 1, "{:?}", report.problems);
    assert!(report.problems[0].contains("newest checkpoint generation 2"), "{:?}", report.problems);
    assert_eq!(report.objects_checked, 1, "the older checkpoint and its journal still hold the object");
    assert!(snapshot(&devices.paths) == before, "fsck without repair wrote to the store");
    let report = Store::fsck_paths(&devices.paths, config(), true).unwrap();
    assert!(report.is_clean(), "{:?}", report.problems);
    assert!(report.repairs.iter().any(|r| r.contains("checkpoint")), "{:?}", report.repairs);
    let store = Store::open_read_only(&devices.paths, config()).unwrap();
    assert_eq!(store.get_to_vec(1).unwrap(), data);
}

/// After a crash with puts journaled since the last checkpoint, and the journal wrapped twice,
/// one flipped byte in the newest checkpoint (its payload, or its header's magic, generation or
/// checksum) loses nothing: the open recovers from the older checkpoint, the journal after it
/// and the journal after the damaged one; fsck reports the damage (not clean), writes nothing,
/// and `--repair` (a writer's open) writes a new checkpoint and says so.
#[test]
fn a_damaged_newest_checkpoint_after_a_crash_loses_nothing() {
    for (byte, what) in [(64 + 100, "payload"), (3, "magic"), (9, "generation"), (45, "header checksum")] {
        let devices = crashed_wrapped_store();
        let (at, generation) = newest_checkpoint(&devices.paths[0]);
        assert_eq!(generation, 3, "two checkpoints after format's");
        flip_byte(&devices.paths[0], at + byte);
        let before = snapshot(&devices.paths);
        let report = Store::fsck_paths(&devices.paths, config(), false).unwrap();
        assert_eq!(report.problems.len(), 1, "{what}: {:?}", report.problems);
        let problem = &report.problems[0];
        assert!(
            problem.contains("newest checkpoint") && problem.contains("recovered without loss"),
            "{what}: {problem}"
        );
        // The puts after the damaged checkpoint came from its generation's journal region.
        assert!(problem.contains("the journal after generation 3"), "{what}: {problem}");
        assert_eq!(report.objects_checked, WRAPPING_PUTS, "{what}");
        assert!(snapshot(&devices.paths) == before, "{what}: fsck without repair wrote to the store");
        {
            let reader = Store::open_read_only(&devices.paths, config()).unwrap();
            assert_wrapped_objects(&reader);
        }

        if byte == 9 {
            // fsck --repair: the repair is the writer's open.
            let report = Store::fsck_paths(&devices.paths, config(), true).unwrap();
            assert!(report.is_clean(), "{what}: {:?}", report.problems);
            assert!(report.repairs.iter().any(|r| r.contains("new checkpoint")), "{what}: {:?}", report.repairs);
        }
        let store = Store::open(&devices.paths, config()).unwrap();
        assert_wrapped_objects(&store);
        if byte != 9 {
            let info = store.info();
            assert!(info.repairs_at_open.iter().any(|r| r.contains("new checkpoint")), "{what}: {info:?}");
            assert!(info.recovery_problems.iter().any(|p| p.contains("newest checkpoint")), "{what}: {info:?}");
        }
        // The store goes on, and the next open finds nothing wrong.
        store.put_blocking(WRAPPING_PUTS, &object(1), b"").unwrap();
        store.close().unwrap();
        let report = Store::fsck_paths(&devices.paths, config(), false).unwrap();
        assert!(report.is_clean(), "{what}: {:?}", report.problems);
        assert_eq!(report.objects_checked, WRAPPING_PUTS + 1, "{what}");
    }
}

/// A closed store (its last checkpoint holds everything) with the newest checkpoint's header
/// flipped: the older checkpoint and its journal still recover everything, but the damage is a
/// problem (fsck exits 1), not a clean store with a note.
#[test]
fn a_damaged_newest_checkpoint_header_of_a_closed_store_is_a_problem() {
    let devices = TempDevices::new(1, 16 << 20);
    let data = random_bytes(50_000, 2);
    {
        let store = create(&devices, BackendKind::Auto);
        store.put_blocking(1, &data, b"").unwrap();
        store.close().unwrap(); // checkpoint generation 2 -> slot 0, at 4096
    }
    flip_byte(&devices.paths[0], 4096 + 20); // its record count
    let report = Store::fsck_paths(&devices.paths, config(), false).unwrap();
    assert!(!report.is_clean(), "{report:?}");
    assert!(report.problems[0].contains("newest checkpoint's header"), "{:?}", report.problems);
    assert_eq!(report.objects_checked, 1);
    let report = Store::fsck_paths(&devices.paths, config(), true).unwrap();
    assert!(report.is_clean(), "{:?}", report.problems);
    let store = Store::open_read_only(&devices.paths, config()).unwrap();
    assert_eq!(store.get_to_vec(1).unwrap(), data);
}

#[test]
fn a_reader_opens_beside_the_writer_and_writes_nothing() {
    let devices = TempDevices::new(2, 16 << 20);
    let writer = create(&devices, BackendKind::Auto);
    let data = random_bytes(300_000, 3);
    writer.put_blocking(1, &data, b"m").unwrap();

    let reader = Store::open_read_only(&devices.paths, config()).unwrap();
    assert_eq!(reader.get_to_vec(1).unwrap(), data);
    assert_eq!(reader.info().object_count, 1);
    let err = reader.put_blocking(2, &data, b"").err().unwrap();
    assert!(err.to_string().contains("read-only"), "{err}");
    assert!(reader.delete(1).is_err());
    assert!(reader.checkpoint().is_err());
    // fsck beside the writer; a second writer is still refused.
    let report = Store::fsck_paths(&devices.paths, config(), false).unwrap();
    assert!(report.is_clean(), "{:?}", report.problems);
    assert_eq!(report.objects_checked, 1);
    let quick = OpenConfig { lock_wait_ms: 0, ..config() };
    assert!(matches!(Store::open(&devices.paths, quick.clone()).err().unwrap(), Error::Locked { .. }));
    // Readers do not keep the writer from working, nor from reopening.
    writer.put_blocking(2, &data, b"").unwrap();
    writer.close().unwrap();
    let writer = Store::open(&devices.paths, quick.clone()).unwrap();
    assert_eq!(writer.get_to_vec(2).unwrap(), data);
    drop(reader);
    drop(writer);
    // Format waits for nobody: with a reader there, it is refused.
    let reader = Store::open_read_only(&devices.paths, config()).unwrap();
    let forced = teraio_engine::FormatConfig { force: true, ..small_format() };
    assert!(matches!(Store::format(&devices.paths, &forced).err().unwrap(), Error::Locked { .. }));
    drop(reader);
}

/// Formats `devices`, puts object 1 and closes the store; returns its uuid.
fn closed_store_with_one_object(devices: &TempDevices) -> String {
    let store = create(devices, BackendKind::Auto);
    store.put_blocking(1, &random_bytes(400_000, 1), b"").unwrap();
    let uuid = store.info().uuid;
    store.close().unwrap();
    uuid
}

#[test]
fn a_device_put_back_from_an_older_copy_is_stale() {
    let devices = TempDevices::new(3, 16 << 20);
    let uuid = closed_store_with_one_object(&devices);
    // Copies of device 2 (closed store) and of device 0 (taken while the writer had it open).
    let old2 = std::fs::read(&devices.paths[2]).unwrap();
    let store = Store::open(&devices.paths, config()).unwrap();
    let old0 = std::fs::read(&devices.paths[0]).unwrap();
    store.put_blocking(1, &random_bytes(400_000, 2), b"").unwrap();
    store.close().unwrap();

    let current2 = std::fs::read(&devices.paths[2]).unwrap();
    std::fs::write(&devices.paths[2], &old2).unwrap();
    for open in [Store::open, Store::open_read_only] {
        let err = open(&devices.paths, config()).err().expect("a stale device must not open");
        assert!(matches!(err, Error::CorruptSuperblock { .. }), "{err}");
        let text = err.to_string();
        assert!(text.contains(&format!("device 2 of store {uuid} is stale")), "{text}");
        assert!(text.contains(&devices.paths[2].display().to_string()), "{text}");
    }
    let report = Store::fsck_paths(&devices.paths, config(), true).unwrap();
    assert!(report.problems.iter().any(|p| p.contains("is stale")), "{:?}", report.problems);
    assert!(report.repairs.is_empty(), "a stale device cannot be repaired: {:?}", report.repairs);

    // Device 0 from a copy taken in the middle of the last session: its own metadata agrees
    // with it, the other devices do not.
    std::fs::write(&devices.paths[2], &current2).unwrap();
    Store::open(&devices.paths, config()).unwrap().close().unwrap();
    std::fs::write(&devices.paths[0], &old0).unwrap();
    let err = Store::open(&devices.paths, config()).err().expect("a stale device 0 must not open");
    assert!(err.to_string().contains(&format!("device 0 of store {uuid} is stale")), "{err}");
}

#[test]
fn a_short_or_wiped_member_device_is_named() {
    let devices = TempDevices::new(3, 16 << 20);
    let uuid = closed_store_with_one_object(&devices);
    let full = std::fs::read(&devices.paths[1]).unwrap();

    // Shorter than its superblock records: refused, never grown back with zeros.
    std::fs::OpenOptions::new().write(true).open(&devices.paths[1]).unwrap().set_len((16 << 20) - MIB).unwrap();
    let err = Store::open(&devices.paths, config()).err().expect("a short device must not open");
    assert!(matches!(err, Error::CorruptSuperblock { .. }), "{err}");
    assert!(err.to_string().contains(&format!("device 1 of store {uuid} is {} bytes, shorter", (16 << 20) - MIB)));
    assert_eq!(std::fs::metadata(&devices.paths[1]).unwrap().len(), (16 << 20) - MIB, "the open grew it");

    // Wiped: named as the store's damaged device 1, not as a stranger to format.
    std::fs::write(&devices.paths[1], vec![0u8; full.len()]).unwrap();
    let err = Store::open(&devices.paths, config()).err().expect("a wiped device must not open");
    assert!(matches!(err, Error::CorruptSuperblock { .. }), "{err}");
    let text = err.to_string();
    assert!(text.contains(&format!("device 1 of store {uuid} is damaged or missing its superblock")), "{text}");
    assert!(text.contains(&devices.paths[1].display().to_string()) && !text.contains("format it"), "{text}");
    let report = Store::fsck_paths(&devices.paths, config(), false).unwrap();
    assert!(report.problems.iter().any(|p| p.contains("damaged or missing its superblock")), "{:?}", report.problems);

    std::fs::write(&devices.paths[1], &full).unwrap();
    Store::open(&devices.paths, config()).unwrap().close().unwrap();
}

/// Rewrites both superblock copies of every device as format version 2 (the same superblock
/// layout; version 2 keeps one journal region for every generation).
fn make_version_2(paths: &[PathBuf]) {
    use teraio_engine::layout::superblock::Superblock;
    for path in paths {
        let bytes = std::fs::read(path).unwrap();
        let mut sb = Superblock::decode(&bytes[..4096], path).unwrap();
        assert_eq!(sb.format_version, 3);
        sb.format_version = 2;
        let encoded = sb.encode();
        write_at(path, 0, &encoded);
        write_at(path, sb.backup_offset(), &encoded);
    }
}

#[test]
fn a_format_version_2_store_still_opens_and_works() {
    let devices = TempDevices::new(2, 16 << 20);
    create(&devices, BackendKind::Auto).close().unwrap();
    make_version_2(&devices.paths);
    // Enough puts to fill its one journal region and checkpoint, then a reopen.
    {
        let store = Store::open(&devices.paths, config()).unwrap();
        assert_eq!(store.info().format_version, 2);
        for id in 0..WRAPPING_PUTS {
            store.put_blocking(id, &object(id), &wrapping_meta(id)).unwrap();
        }
        for id in (0..WRAPPING_PUTS).step_by(3) {
            assert!(store.delete(id).unwrap());
        }
    }
    let store = Store::open(&devices.paths, config()).unwrap();
    assert_eq!(store.info().format_version, 2, "a writer's open keeps the version");
    for id in 0..WRAPPING_PUTS {
        if id % 3 == 0 {
            assert!(store.stat(id).is_none(), "object {id}");
        } else {
            assert_eq!(store.get_to_vec(id).unwrap(), object(id), "object {id}");
        }
    }
    drop(store);
    let report = Store::fsck_paths(&devices.paths, config(), false).unwrap();
    assert!(report.is_clean(), "{:?}", report.problems);
}

/// A writer's open that rewrites a damaged superblock copy says so: in `info().repairs_at_open`
/// (a log line too), and fsck finds nothing left.
#[test]
fn a_writers_open_reports_what_it_repaired() {
    let devices = TempDevices::new(2, 16 << 20);
    create(&devices, BackendKind::Auto).close().unwrap();
    let dev1 = &devices.paths[1];
    let size = std::fs::metadata(dev1).unwrap().len();
    flip_byte(dev1, size - 4096 + 40);
    {
        // A read-only open repairs nothing, and says nothing was repaired.
        let reader = Store::open_read_only(&devices.paths, config()).unwrap();
        assert!(reader.info().repairs_at_open.is_empty());
    }
    let store = Store::open(&devices.paths, config()).unwrap();
    let repairs = store.info().repairs_at_open;
    assert_eq!(repairs.len(), 1, "{repairs:?}");
    assert!(repairs[0].contains("rewrote") && repairs[0].contains("backup superblock"), "{repairs:?}");
    assert!(repairs[0].contains(&dev1.display().to_string()), "{repairs:?}");
    store.close().unwrap();
    assert!(Store::fsck_paths(&devices.paths, config(), false).unwrap().is_clean());
    let store = Store::open(&devices.paths, config()).unwrap();
    assert!(store.info().repairs_at_open.is_empty(), "nothing left to repair");
}

/// A version 2 store as an earlier release could leave it: a table larger than a checkpoint slot
/// (crafted here as journal batches of 256 more records, which fill the ring) and no room left
/// in the journal. Single deletes cannot commit there and say how to proceed; `delete_many`
/// commits deletes that bring the table under the slot, and then the store works again.
#[test]
fn a_version_2_store_over_its_table_limit_is_freed_by_delete_many() {
    use teraio_engine::layout::metadata::encode_batch;
    use teraio_engine::layout::superblock::Superblock;
    use teraio_engine::layout::table::{ObjectRecord, TableChange};
    let devices = TempDevices::new(1, 16 << 20);
    create(&devices, BackendKind::Auto).close().unwrap();
    make_version_2(&devices.paths);
    let meta = vec![3u8; 3900]; // one record and its batch header fit one 4 KiB block
    let mut stored = 0u64;
    {
        let store = Store::open(&devices.paths, config()).unwrap();
        while store.put_blocking(stored, &[], &meta).is_ok() {
            stored += 1;
            assert!(stored < 1000, "the table never filled");
        }
    } // closed: a checkpoint holds them all, and the ring restarts
    let dev0 = &devices.paths[0];
    let (_, generation) = newest_checkpoint(dev0);
    let sb = Superblock::decode(&std::fs::read(dev0).unwrap()[..4096], dev0).unwrap();
    let crafted = JOURNAL_BYTES / 4096;
    for sequence in 0..crafted {
        let record = ObjectRecord {
            id: 1000 + sequence,
            len_bytes: 0,
            meta: meta.clone(),
            first_device: 0,
            spread: 1,
            extents: vec![],
            unit_crcs: vec![],
        };
        let batch = encode_batch(&sb.store_uuid, generation + 1, sequence, sb.epoch, &[TableChange::Put(record)], 4096);
        assert_eq!(batch.len(), 4096);
        write_at(dev0, JOURNAL_START + sequence * 4096, &batch);
    }

    let store = Store::open(&devices.paths, config()).unwrap();
    assert_eq!(store.info().object_count as u64, stored + crafted);
    assert!(store.info().table_bytes > store.info().checkpoint_slot_bytes);
    let err = store.delete(0).expect_err("a single delete cannot bring the table under the slot");
    assert!(err.to_string().contains("delete_many"), "{err}");
    assert!(store.stat(0).is_some(), "the failed delete changed nothing");
    let ids: Vec<u64> = (1000..1000 + crafted).chain([0]).collect();
    assert_eq!(store.delete_many(&ids).unwrap(), vec![true; ids.len()]);
    assert!(store.info().table_bytes <= store.info().checkpoint_slot_bytes);
    // Single deletes and puts work again.
    assert!(store.delete(1).unwrap());
    store.put_blocking(1, &[], &meta).unwrap();
    drop(store);
    let store = Store::open(&devices.paths, config()).unwrap();
    assert_eq!(store.info().object_count as u64, stored - 1);
    assert_eq!(store.stat(1).unwrap().meta, meta);
    drop(store);
    assert!(Store::fsck_paths(&devices.paths, config(), false).unwrap().is_clean());
}
