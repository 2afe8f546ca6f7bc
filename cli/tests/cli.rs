//! End-to-end tests of the `teraio` command: every sub-command, and every kind of bad input
//! ending in one line that says what to do, with nothing overwritten without `--force`.
//! Stores are small (tens of MiB) so that the suite stays fast.

use assert_cmd::Command;
use predicates::prelude::*;
use serde_json::Value;
use std::path::{Path, PathBuf};

/// A scratch directory on a disk file system (O_DIRECT does not work on tmpfs): $TERAIO_TEST_DIR,
/// else under the target directory (README: test files go under target/).
fn scratch() -> tempfile::TempDir {
    let base = std::env::var_os("TERAIO_TEST_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_TARGET_TMPDIR")));
    tempfile::Builder::new().prefix("teraio-cli-test").tempdir_in(base).expect("scratch directory")
}

fn teraio() -> Command {
    Command::cargo_bin("teraio").expect("the teraio binary")
}

fn paths(dir: &Path, count: usize) -> Vec<String> {
    (0..count).map(|i| dir.join(format!("d{i}")).display().to_string()).collect()
}

/// Runs a command that must fail with exit code `code` and one line on stderr; returns the line.
fn one_line_error(cmd: &mut Command, code: i32) -> String {
    let out = cmd.output().expect("runs");
    let stderr = String::from_utf8_lossy(&out.stderr).to_string();
    assert_eq!(out.status.code(), Some(code), "stderr: {stderr}");
    let lines: Vec<&str> = stderr.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(lines.len(), 1, "want one line, got: {stderr}");
    assert!(lines[0].starts_with("error: "), "{stderr}");
    lines[0].to_string()
}

/// A small bench run's flags.
const SMALL: [&str; 8] =
    ["--data-size", "32MiB", "--object-size", "8MiB", "--no-progress", "--json", "--runtime", "300ms"];

/// `SMALL` with a byte budget instead of a time limit: the same number of ops on a loaded machine
/// (300 ms let a busy CI machine finish a mixed run before its first read).
const SMALL_SIZED: [&str; 8] =
    ["--data-size", "32MiB", "--object-size", "8MiB", "--no-progress", "--json", "--size", "256MiB"];

fn bench_json(targets: &[String], extra: &[&str]) -> Value {
    bench_json_from(&SMALL, targets, extra)
}

fn bench_json_from(base: &[&str], targets: &[String], extra: &[&str]) -> Value {
    let out = teraio().arg("bench").args(targets).args(base).args(extra).output().expect("runs");
    assert!(out.status.success(), "bench failed: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).expect("bench --json prints JSON")
}

#[test]
fn bench_default_store_is_temporary_and_reports_every_device() {
    let tmp = scratch();
    let out = teraio()
        .env("TMPDIR", tmp.path())
        .args(["bench", "--data-size", "32MiB", "--object-size", "8MiB", "--json", "--size", "64MiB"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    let report = &v["report"];
    assert_eq!(report["devices"].as_array().unwrap().len(), 4);
    assert!(report["gb_per_s"].as_f64().unwrap() > 0.0);
    assert_eq!(report["object_get"]["bytes"].as_u64().unwrap(), 64 << 20, "--size moves exactly that many bytes");
    assert!(report["aggregate"]["read"]["latency"]["p999_us"].as_u64().unwrap() > 0);
    assert!(report["cpu"]["cores_busy"].as_f64().unwrap() > 0.0);
    assert_eq!(std::fs::read_dir(tmp.path()).unwrap().count(), 0, "the default store must be removed afterwards");
}

#[test]
fn bench_every_mode_verifies_what_it_reads() {
    let tmp = scratch();
    let targets = paths(tmp.path(), 2);
    for (mode, reads, writes) in [
        ("read", true, false),
        ("write", false, true),
        ("rw", true, true),
        ("randread", true, false),
        ("randwrite", false, true),
        ("randrw", true, true),
    ] {
        let v = bench_json_from(&SMALL_SIZED, &targets, &["--rw", mode, "--verify", "--force", "--queue-depth", "8"]);
        let r = &v["report"];
        assert_eq!(r["workload"]["verify"], true);
        assert_eq!(r["object_get"]["ops"].as_u64().unwrap() > 0, reads, "{mode}: reads");
        assert_eq!(r["object_put"]["ops"].as_u64().unwrap() > 0, writes, "{mode}: writes");
        if reads {
            assert_eq!(r["verified_bytes"], r["object_get"]["bytes"], "{mode}: every byte read is checked");
        }
        for d in r["devices"].as_array().unwrap() {
            let busy = d["read"]["ops"].as_u64().unwrap() + d["write"]["ops"].as_u64().unwrap();
            assert!(busy > 0, "{mode}: each device does work");
        }
    }
}

#[test]
fn bench_checks_checksums_unless_told_not_to() {
    let tmp = scratch();
    let targets = paths(tmp.path(), 2);
    let on = bench_json(&targets, &["--rw", "randread", "--force"]);
    assert_eq!(on["report"]["workload"]["verify_checksums"], true, "checked by default");
    let off = bench_json(&targets, &["--rw", "randread", "--force", "--verify-checksums", "off"]);
    assert_eq!(off["report"]["workload"]["verify_checksums"], false);
    let table = teraio()
        .arg("bench")
        .args(&targets)
        .args(["--data-size", "32MiB", "--object-size", "8MiB", "--no-progress", "--runtime", "200ms", "--force"])
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&table.stdout).contains("checksums checked"));
    let line = one_line_error(teraio().args(["bench", "--verify-checksums", "maybe"]), 2);
    assert!(line.contains("maybe"), "{line}");
}

#[test]
fn bench_time_based_random_writes_on_three_files_keep_running() {
    // The reported case in small: a mixed random run on 3 files sized for the data set, where
    // device 0 (metadata) used to fill first and stop the run with "not enough free space".
    let tmp = scratch();
    let targets = paths(tmp.path(), 3);
    let out = teraio()
        .arg("bench")
        .args(&targets)
        .args(["--rw", "randrw", "--read-percent", "70", "--request-size", "256KiB", "--queue-depth", "8"])
        .args(["--data-size", "96MiB", "--object-size", "8MiB", "--runtime", "3s", "--no-progress", "--json"])
        .output()
        .unwrap();
    assert!(out.status.success(), "bench stopped: {}", String::from_utf8_lossy(&out.stderr));
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(v["report"]["object_put"]["ops"].as_u64().unwrap() > 0);
    assert!(v["report"]["elapsed_s"].as_f64().unwrap() >= 2.9, "the run lasted its runtime");
}

#[test]
fn bench_table_has_percentiles_per_device_and_cpu() {
    let tmp = scratch();
    let targets = paths(tmp.path(), 2);
    teraio()
        .arg("bench")
        .args(&targets)
        .args(["--rw", "randread", "--data-size", "32MiB", "--runtime", "300ms", "--no-progress", "--backend", "psync"])
        .assert()
        .success()
        .stdout(predicate::str::starts_with("targets: 2 files on one file system ("))
        .stdout(predicate::str::contains("GB/s = 10^9 bytes/s; latencies in ms"))
        .stdout(predicate::str::contains("p99.9 ms"))
        .stdout(predicate::str::contains(" s (the runtime)"))
        .stdout(predicate::str::contains("reference: none in this run; --compare-fio"))
        .stdout(predicate::str::contains("all 2 device(s)"))
        .stdout(predicate::str::contains("backend psync"))
        .stdout(predicate::str::contains("cores per GB/s"));
}

#[test]
fn bench_sweep_prints_best_settings_and_table() {
    let tmp = scratch();
    let targets = paths(tmp.path(), 1);
    let out = teraio()
        .arg("bench")
        .args(&targets)
        .args(["--data-size", "16MiB", "--object-size", "4MiB", "--sweep", "--no-progress"])
        .args(["--sweep-request-sizes", "64k,1M,2M", "--sweep-queue-depths", "2,8", "--sweep-threads", "1"])
        .args(["--sweep-stripe-units", "1M", "--sweep-runtime", "150ms"])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.contains("best: --request-size"), "{stdout}");
    // 2 request sizes x 2 queue depths measured; 2M > the 1M stripe unit is skipped.
    let rows =
        stdout.lines().filter(|l| l.trim_start().starts_with("64 KiB") || l.trim_start().starts_with("1 MiB")).count();
    assert_eq!(rows, 4, "{stdout}");
    assert!(stdout.contains("skipped: request 2 MiB > stripe unit 1 MiB"), "{stdout}");
}

#[test]
fn bench_compare_fio_runs_both_on_the_same_files() {
    if std::process::Command::new("fio").arg("--version").output().is_err() {
        eprintln!("fio is not installed; skipping");
        return;
    }
    let tmp = scratch();
    let targets = paths(tmp.path(), 2);
    let out = teraio()
        .arg("bench")
        .args(&targets)
        .args([
            "--rw",
            "randread",
            "--data-size",
            "32MiB",
            "--runtime",
            "1s",
            "--compare-fio",
            "--json",
            "--no-progress",
        ])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(v["fio"]["read_iops"].as_f64().unwrap() > 0.0);
    let ratio = v["teraio_over_fio"].as_f64().unwrap();
    let expected = v["report"]["gb_per_s"].as_f64().unwrap() * 1e9
        / (v["fio"]["read_bytes_per_s"].as_f64().unwrap() + v["fio"]["write_bytes_per_s"].as_f64().unwrap());
    assert!((ratio - expected).abs() < 1e-6 * expected.max(1.0));
    // fio wrote over the files; the bench formatted them again: a valid, empty store.
    assert_eq!(v["reformatted_after_fio"], Value::Bool(true));
    teraio().arg("fsck").args(&targets).assert().success();
    teraio()
        .arg("info")
        .args(&targets)
        .arg("--json")
        .assert()
        .success()
        .stdout(predicate::str::contains("\"object_count\": 0"));
}

/// A small ext4 file system on a loop device (CI runs as root on Debian, where `mount -o loop`
/// works), unmounted when dropped: a real too-small disk, not a simulated one.
struct SmallFileSystem {
    mount_point: PathBuf,
}

impl SmallFileSystem {
    /// None, saying why, where this is not root (mounting needs it).
    fn new(dir: &Path, size_mib: u64) -> Option<SmallFileSystem> {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            eprintln!("not root: cannot mount a small file system; the too-small disk test needs root (CI is)");
            return None;
        }
        let image = dir.join("small.img");
        std::fs::File::create(&image).unwrap().set_len(size_mib << 20).unwrap();
        let run = |program: &str, args: &[&std::ffi::OsStr]| {
            let out = std::process::Command::new(program).args(args).output().expect(program);
            assert!(out.status.success(), "{program}: {}", String::from_utf8_lossy(&out.stderr));
        };
        run("mkfs.ext4", &["-q".as_ref(), "-F".as_ref(), image.as_os_str()]);
        let mount_point = dir.join("small");
        std::fs::create_dir(&mount_point).unwrap();
        run("mount", &["-o".as_ref(), "loop".as_ref(), image.as_os_str(), mount_point.as_os_str()]);
        Some(SmallFileSystem { mount_point })
    }
}

impl Drop for SmallFileSystem {
    fn drop(&mut self) {
        let out = std::process::Command::new("umount").arg(&self.mount_point).output().expect("umount");
        assert!(out.status.success(), "umount: {}", String::from_utf8_lossy(&out.stderr));
    }
}

#[test]
fn bench_on_a_too_small_file_system_is_refused_and_leaves_nothing() {
    let tmp = scratch();
    let Some(small) = SmallFileSystem::new(tmp.path(), 64) else { return };
    let targets = paths(&small.mount_point, 2);
    let line = one_line_error(
        teraio().arg("bench").args(&targets).args(["--data-size", "256MiB", "--no-progress", "--size", "8MiB"]),
        2,
    );
    assert!(line.contains("more on the file system of") && line.contains(") free;"), "{line}");
    assert!(line.contains(&small.mount_point.display().to_string()), "{line}");
    let left: Vec<_> = std::fs::read_dir(&small.mount_point).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert_eq!(left, vec![std::ffi::OsString::from("lost+found")], "nothing created");
    // An existing file grown past the free space: refused before it is touched.
    std::fs::write(&targets[0], b"").unwrap();
    one_line_error(
        teraio().arg("bench").arg(&targets[0]).args(["--data-size", "256MiB", "--no-progress", "--force"]),
        2,
    );
    assert_eq!(std::fs::metadata(&targets[0]).unwrap().len(), 0, "the file is left as it was");
    std::fs::remove_file(&targets[0]).unwrap();
    drop(small);
}

#[test]
fn a_failed_bench_removes_the_files_it_created() {
    let tmp = scratch();
    let targets = paths(tmp.path(), 2);
    // The files fit the disk, but the data set does not fit a store of that file size: the run
    // fails after creating them.
    let out = teraio()
        .arg("bench")
        .args(&targets)
        .args(["--file-size", "80MiB", "--data-size", "512MiB", "--no-progress"])
        .output()
        .unwrap();
    assert_ne!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    for target in &targets {
        assert!(!Path::new(target).exists(), "{target} left behind");
    }
}

#[test]
fn fio_configs_are_the_jobs_bench_runs() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join("fio-configs");
    let cases: [(&str, &[&str]); 6] = [
        ("seq-read-4m-qd32", &["--rw", "read"]),
        ("seq-write-4m-qd32", &["--rw", "write"]),
        ("seq-rw70-4m-qd32", &["--rw", "rw", "--read-percent", "70"]),
        ("rand-read-4k-qd128", &["--rw", "randread", "--queue-depth", "128"]),
        ("rand-write-4k-qd128", &["--rw", "randwrite", "--queue-depth", "128"]),
        ("rand-rw70-4k-qd128", &["--rw", "randrw", "--read-percent", "70", "--queue-depth", "128"]),
    ];
    for (name, flags) in cases {
        let file = std::fs::read_to_string(root.join(format!("{name}.fio"))).expect("job file exists");
        let out = teraio().args(["bench", "--emit-fio"]).args(flags).output().unwrap();
        assert!(out.status.success());
        assert_eq!(
            String::from_utf8_lossy(&out.stdout),
            file,
            "fio-configs/{name}.fio is stale: regenerate it with --emit-fio"
        );
    }
    assert_eq!(std::fs::read_dir(&root).unwrap().count(), 6, "one job file per workload, each checked here");
}

#[test]
fn format_info_fsck_round_trip_and_damage_is_found() {
    let tmp = scratch();
    let targets = paths(tmp.path(), 2);
    // A bench leaves its data set in the store: 4 objects of 8 MiB.
    bench_json(&targets, &[]);
    let out = teraio().arg("info").args(&targets).arg("--json").output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let info: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(info["devices"].as_array().unwrap().len(), 2);
    assert_eq!(info["object_count"], 4);
    assert!(info["free_bytes"].as_u64().unwrap() > 0);
    // The table's checkpoint: a header block and the 4 records, well inside a slot.
    let (table, slot) = (info["table_bytes"].as_u64().unwrap(), info["checkpoint_slot_bytes"].as_u64().unwrap());
    assert!(table >= 4096 && table < slot, "table {table} of a {slot}-byte slot");
    teraio()
        .arg("info")
        .args(&targets)
        .assert()
        .success()
        .stdout(predicate::str::contains("largest free").and(predicate::str::contains("% full")));
    teraio().arg("fsck").args(&targets).assert().code(0).stdout(predicate::str::contains("clean: 4 object(s)"));

    // Damage data on device 1 (its data area starts at 1 MiB) and fsck must say so.
    let mut bytes = std::fs::read(&targets[1]).unwrap();
    for b in &mut bytes[(1 << 20)..(17 << 20)] {
        *b ^= 0x5A;
    }
    std::fs::write(&targets[1], &bytes).unwrap();
    teraio().arg("fsck").args(&targets).assert().code(1).stdout(predicate::str::contains("DAMAGED"));

    // format: a fresh store, refusing the old one without --force.
    let line = one_line_error(teraio().arg("format").args(&targets), 2);
    assert!(line.contains("teraio store") && line.contains("--force"), "{line}");
    teraio()
        .arg("format")
        .args(&targets)
        .arg("--force")
        .assert()
        .success()
        .stdout(predicate::str::contains("formatted"));
    teraio().arg("fsck").args(&targets).assert().code(0);
}

#[test]
fn fsck_only_reads_unless_told_to_repair() {
    let tmp = scratch();
    let targets = paths(tmp.path(), 2);
    teraio().arg("format").args(&targets).args(["--file-size", "16MiB"]).assert().success();
    // Damage only device 1's backup superblock (the last 4 KiB).
    let mut bytes = std::fs::read(&targets[1]).unwrap();
    let backup = bytes.len() - 4096;
    bytes[backup + 40] ^= 0x20;
    std::fs::write(&targets[1], &bytes).unwrap();
    let before: Vec<Vec<u8>> = targets.iter().map(|t| std::fs::read(t).unwrap()).collect();

    let out = teraio().arg("fsck").args(&targets).output().unwrap();
    assert_eq!(out.status.code(), Some(1));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("DAMAGED") && stdout.contains("1 problem(s)"), "{stdout}");
    assert!(stdout.contains("backup superblock") && !stdout.contains("primary superblock"), "{stdout}");
    let after: Vec<Vec<u8>> = targets.iter().map(|t| std::fs::read(t).unwrap()).collect();
    assert!(before == after, "fsck without --repair wrote to the store");

    let out = teraio().args(["fsck", "--repair", "--json"]).args(&targets).output().unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    let report: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["clean"], true);
    let repairs = report["repairs"].as_array().unwrap();
    assert_eq!(repairs.len(), 1, "{repairs:?}");
    assert!(repairs[0].as_str().unwrap().contains("backup superblock"), "{repairs:?}");
    teraio().arg("fsck").args(&targets).assert().code(0).stdout(predicate::str::contains("clean: 0 object(s)"));
}

#[test]
fn info_and_fsck_work_beside_a_writer() {
    let tmp = scratch();
    let targets = paths(tmp.path(), 2);
    teraio().arg("format").args(&targets).args(["--file-size", "16MiB"]).assert().success();
    let writer = teraio_engine::Store::open(&targets, teraio_engine::OpenConfig::default()).unwrap();
    writer.put_blocking(7, &[5u8; 100_000], b"").unwrap();

    let out = teraio().arg("info").args(&targets).arg("--json").output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let info: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(info["object_count"], 1);
    teraio().arg("fsck").args(&targets).assert().code(0).stdout(predicate::str::contains("clean: 1 object(s)"));
    // The writer is not disturbed, and a second writer is still refused.
    writer.put_blocking(8, &[6u8; 100_000], b"").unwrap();
    let again = teraio_engine::OpenConfig { lock_wait_ms: 0, ..Default::default() };
    let err = teraio_engine::Store::open(&targets, again).err().unwrap();
    assert!(matches!(err, teraio_engine::Error::Locked { .. }), "{err}");
    writer.close().unwrap();
    teraio().arg("fsck").args(&targets).assert().code(0).stdout(predicate::str::contains("clean: 2 object(s)"));
}

#[test]
fn format_creates_files_and_refuses_bad_devices() {
    let tmp = scratch();
    let targets = paths(tmp.path(), 2);
    teraio().arg("format").args(&targets).args(["--file-size", "16MiB"]).assert().success();
    teraio()
        .arg("info")
        .args(&targets)
        .arg("--json")
        .assert()
        .success()
        .stdout(predicate::str::contains("\"object_count\": 0"));
    let missing = tmp.path().join("nope").display().to_string();
    let line = one_line_error(teraio().arg("format").arg(&missing), 2);
    assert!(line.contains("--file-size"), "{line}");
    let line = one_line_error(teraio().arg("format").arg(tmp.path().join("small")).args(["--file-size", "8KiB"]), 2);
    assert!(line.contains("needs at least"), "{line}");
    // Refused after the file was made (too small for this stripe unit): the file goes again.
    let small = tmp.path().join("small-for-the-stripe-unit");
    let line =
        one_line_error(teraio().arg("format").arg(&small).args(["--file-size", "16MiB", "--stripe-unit", "64MiB"]), 2);
    assert!(line.contains("needs at least"), "{line}");
    assert!(!small.exists(), "a failed format leaves no file behind");
    // info/fsck: a missing device, a device of no store, only part of a store.
    let line = one_line_error(teraio().args(["info", &targets[0], &missing]), 2);
    assert!(line.contains("does not exist"), "{line}");
    let stranger = tmp.path().join("stranger");
    std::fs::write(&stranger, vec![0u8; 4 << 20]).unwrap();
    let line = one_line_error(teraio().arg("fsck").arg(&stranger), 2);
    assert!(line.contains("not a teraio device"), "{line}");
    let line = one_line_error(teraio().args(["fsck", &targets[0]]), 2);
    assert!(line.contains("device"), "{line}");
}

#[test]
fn bad_flags_and_impossible_sizes_get_one_line() {
    let tmp = scratch();
    let t = tmp.path().join("d0").display().to_string();
    let cases: [(&[&str], &str); 12] = [
        (&["bench", "--bogus"], "--bogus"),
        (&["frobnicate"], "frobnicate"),
        (&["bench", "--request-size", "0"], "--request-size 0"),
        (
            &["bench", "--request-size", "8MiB", "--object-size", "4MiB", "--data-size", "8MiB"],
            "larger than the object size",
        ),
        (&["bench", "--request-size", "1000"], "multiple of the 4096-byte block size"),
        (&["bench", "--request-size", "4MiB", "--stripe-unit", "1MiB"], "--stripe-unit"),
        (&["bench", "--queue-depth", "0"], "--queue-depth 0"),
        (&["bench", "--data-size", "0"], "--data-size 0"),
        (&["bench", "--request-size", "lots"], "not a size"),
        (&["bench", "--rw", "sideways"], "sideways"),
        (&["bench", "--backend", "cufile"], "add --buffer gpu"),
        (&["bench", "--buffer", "gpu", "--compare-fio"], "host memory"),
    ];
    for (args, needle) in cases {
        let line = one_line_error(teraio().args(args).arg(&t), 2);
        assert!(line.contains(needle), "{args:?}: {line}");
    }
    assert!(!Path::new(&t).exists(), "bad input must not create targets");
}

#[test]
fn bad_targets_are_refused_and_nothing_is_overwritten_without_force() {
    let tmp = scratch();
    // Existing data: refused, untouched, then used with --force.
    let data = tmp.path().join("precious");
    let content: Vec<u8> = (0..(48u32 << 20)).map(|i| (i % 251) as u8).collect();
    std::fs::write(&data, &content).unwrap();
    let d = data.display().to_string();
    let line = one_line_error(teraio().args(["bench", &d, "--data-size", "8MiB", "--object-size", "4MiB"]), 2);
    assert!(line.contains("holds data") && line.contains("--force"), "{line}");
    assert!(std::fs::read(&data).unwrap() == content, "the file must be untouched");
    let line = one_line_error(teraio().args(["format", &d]), 2);
    assert!(line.contains("--force"), "{line}");
    assert!(std::fs::read(&data).unwrap() == content, "the file must be untouched");
    bench_json(std::slice::from_ref(&d), &["--force"]);

    // A directory, a missing directory, an unwritable file.
    let line = one_line_error(teraio().args(["bench", &tmp.path().display().to_string()]), 2);
    assert!(line.contains("is a directory"), "{line}");
    let line = one_line_error(teraio().args(["bench", &tmp.path().join("no/such/d0").display().to_string()]), 2);
    assert!(line.contains("does not exist"), "{line}");
    let locked = tmp.path().join("locked");
    std::fs::write(&locked, vec![0u8; 1 << 20]).unwrap();
    let unwritable = make_unwritable(&locked);
    let l = locked.display().to_string();
    for cmd in ["bench", "format"] {
        let line = one_line_error(teraio().args([cmd, &l, "--force"]), 2);
        assert!(line.contains("cannot write"), "{line}");
    }
    drop(unwritable);
}

/// Makes `path` unwritable even for root (immutable attribute where chattr works, else mode
/// 0444); undone on drop.
struct Unwritable(PathBuf, bool);

fn make_unwritable(path: &Path) -> Unwritable {
    let immutable = std::process::Command::new("chattr").arg("+i").arg(path).status().is_ok_and(|s| s.success());
    if !immutable {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o444)).unwrap();
    }
    Unwritable(path.to_path_buf(), immutable)
}

impl Drop for Unwritable {
    fn drop(&mut self) {
        if self.1 {
            let _ = std::process::Command::new("chattr").arg("-i").arg(&self.0).status();
        }
    }
}

#[test]
fn a_mounted_block_device_is_refused_even_with_force() {
    let mounts = std::fs::read_to_string("/proc/self/mounts").unwrap();
    let Some(device) = mounts.lines().filter_map(|l| l.split_whitespace().next()).find(|s| {
        use std::os::unix::fs::FileTypeExt;
        s.starts_with("/dev/") && std::fs::metadata(s).is_ok_and(|m| m.file_type().is_block_device())
    }) else {
        eprintln!("no mounted block device here; skipping");
        return;
    };
    for cmd in [&["bench", device, "--force"][..], &["format", device, "--force"][..]] {
        let line = one_line_error(teraio().args(cmd), 2);
        assert!(line.contains("is mounted") && line.contains("unmount"), "{line}");
    }
}

#[test]
fn planner_commands_trace_plan_and_sim() {
    let tmp = scratch();
    let trace = tmp.path().join("tiny.json");
    teraio().args(["trace", "--model", "tiny", "-o"]).arg(&trace).assert().success();
    assert!(trace.exists());
    let plan = tmp.path().join("plan.json");
    teraio().arg("plan").arg(&trace).arg("-o").arg(&plan).assert().success();
    assert!(plan.exists());
    teraio().arg("sim").arg(&trace).arg("--json").assert().success();
    // A missing trace is bad input (exit 2), as a missing store device is.
    let line = one_line_error(teraio().arg("plan").arg(tmp.path().join("missing.json")), 2);
    assert!(line.contains("missing.json"), "{line}");
}

/// `--png` writes the plot as a PNG beside (or instead of) the SVG; a plot path that cannot be
/// written is a failed operation (exit 1) named in one line, as for `--svg`.
#[test]
fn plan_and_sim_write_png_plots_and_an_unwritable_plot_path_exits_1() {
    let tmp = scratch();
    let trace = tmp.path().join("tiny.json");
    teraio().args(["trace", "--model", "tiny", "-o"]).arg(&trace).assert().success();
    let small = ["--gpu-mem", "40MiB", "--ssd", "4x6.5GB/s", "--host-mem", "1GiB"];
    for command in ["plan", "sim"] {
        let (svg, png) = (tmp.path().join(format!("{command}.svg")), tmp.path().join(format!("{command}.png")));
        teraio().arg(command).arg(&trace).args(small).arg("--svg").arg(&svg).arg("--png").arg(&png).assert().success();
        assert!(std::fs::read_to_string(&svg).unwrap().starts_with("<svg width=\"1000\" height=\"560\""));
        let bytes = std::fs::read(&png).unwrap();
        assert!(bytes.starts_with(b"\x89PNG\r\n\x1a\n"), "{command} --png writes a PNG");
        // IHDR: width and height, big-endian, after the signature and the chunk's length and type.
        assert_eq!((&bytes[16..20], &bytes[20..24]), (&1000u32.to_be_bytes()[..], &560u32.to_be_bytes()[..]));
        let unwritable = tmp.path().join("no-such-directory").join("plot.png");
        let line = one_line_error(teraio().arg(command).arg(&trace).args(small).arg("--png").arg(&unwritable), 1);
        assert!(line.contains("cannot write the plot to") && line.contains("plot.png"), "{line}");
        assert!(!unwritable.exists());
    }
}

/// One exit-code convention for every subcommand: 2 for bad input (flags, sizes, files that are
/// missing or do not decode, unknown names), 1 for an operation that failed.
#[test]
fn bad_input_exits_2_and_names_what_is_wrong_in_every_planner_command() {
    let tmp = scratch();
    let trace = tmp.path().join("tiny.json");
    teraio().args(["trace", "--model", "tiny", "-o"]).arg(&trace).assert().success();
    let missing = tmp.path().join("missing.json");
    // A bare memory size under 1 MiB: a forgotten unit.
    for command in ["plan", "sim"] {
        let line = one_line_error(teraio().arg(command).arg(&trace).args(["--gpu-mem", "40"]), 2);
        assert!(line.contains("did you mean 40GiB?"), "{line}");
        let line = one_line_error(teraio().arg(command).arg(&missing), 2);
        assert!(line.contains("missing.json"), "{line}");
    }
    let line = one_line_error(teraio().args(["trace", "--model", "tiny", "--gpu-mem", "80", "-o"]).arg(&trace), 2);
    assert!(line.contains("did you mean 80GiB?"), "{line}");
    // A fractional size with a unit is taken, rounded down to whole bytes.
    teraio().arg("plan").arg(&trace).args(["--gpu-mem", "53.86GiB", "--host-mem", "0.5GiB"]).assert().success();
    let line = one_line_error(teraio().args(["trace", "--model", "gpt-17", "-o"]).arg(&trace), 2);
    assert!(line.contains("gpt-17"), "{line}");
    let line = one_line_error(teraio().args(["trace", "--model", "tiny"]), 2);
    assert!(line.contains("--output"), "the missing argument is named: {line}");
    // A trace that does not decode: the file, the line and the field.
    let bad = tmp.path().join("bad.json");
    let text = std::fs::read_to_string(&trace).unwrap();
    let value: Value = serde_json::from_str(&text).unwrap();
    let mut pretty = serde_json::to_string_pretty(&value).unwrap();
    let at = pretty.find("\"duration_us\": ").unwrap() + "\"duration_us\": ".len();
    pretty.insert_str(at, "\"slow\", \"was\": ");
    std::fs::write(&bad, &pretty).unwrap();
    let line_number = pretty[..at].lines().count();
    let line = one_line_error(teraio().arg("plan").arg(&bad), 2);
    assert!(line.contains("bad.json"), "{line}");
    assert!(line.contains(&format!("line {line_number}")), "{line}");
    assert!(line.contains("field \"duration_us\""), "{line}");
    // A trace that decodes but breaks a rule: the file too.
    let mut broken = value.clone();
    broken["ops"] = serde_json::json!([]);
    std::fs::write(&bad, broken.to_string()).unwrap();
    let line = one_line_error(teraio().arg("sim").arg(&bad), 2);
    assert!(line.contains("bad.json") && line.contains("no ops"), "{line}");
}

#[test]
fn interrupted_bench_removes_its_temporary_store() {
    let tmp = scratch();
    let child = std::process::Command::new(assert_cmd::cargo::cargo_bin("teraio"))
        .env("TMPDIR", tmp.path())
        .args(["bench", "--data-size", "32MiB", "--object-size", "8MiB", "--runtime", "60s", "--no-progress"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // Wait until the store exists, then a little into the run, and interrupt.
    let started = std::time::Instant::now();
    while std::fs::read_dir(tmp.path()).unwrap().count() == 0 && started.elapsed().as_secs() < 20 {
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    std::thread::sleep(std::time::Duration::from_millis(1500));
    // SAFETY: signalling our own child.
    unsafe { libc::kill(child.id() as i32, libc::SIGINT) };
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("interrupted"), "{stderr}");
    assert!(started.elapsed().as_secs() < 30, "the run must stop soon after the signal");
    assert_eq!(std::fs::read_dir(tmp.path()).unwrap().count(), 0, "the temporary store must be removed");
}

/// A small xorshift generator: seeded bytes and sizes without a dependency.
fn xorshift(state: &mut u64) -> u64 {
    *state ^= *state << 13;
    *state ^= *state >> 7;
    *state ^= *state << 17;
    *state
}

fn seeded_bytes(len: usize, seed: u64) -> Vec<u8> {
    let mut state = seed | 1;
    (0..len).map(|_| xorshift(&mut state) as u8).collect()
}

#[test]
fn fsck_beside_a_busy_writer_reports_only_real_damage() {
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    let tmp = scratch();
    let targets = paths(tmp.path(), 2);
    teraio().arg("format").args(&targets).args(["--file-size", "64MiB"]).assert().success();
    let config = teraio_engine::OpenConfig { durable: false, ..Default::default() };
    let writer = teraio_engine::Store::open(&targets, config).unwrap();
    // One object the writer never touches, with bytes found nowhere else on the devices.
    let kept = seeded_bytes(256 << 10, 0xfeed);
    writer.put_blocking(1000, &kept, b"kept").unwrap();
    let stop = AtomicBool::new(false);
    let writer_ops = AtomicU64::new(0);
    let fsck_runs = 6;
    std::thread::scope(|scope| {
        scope.spawn(|| {
            // Overwrites and deletes of 24 ids with sizes of 4 KiB .. 1 MiB, reusing the same
            // blocks over and over, until the fsck runs are done (or a bound is reached).
            let mut state = 0x1234_5678u64;
            for i in 0..1_000_000u64 {
                if stop.load(Ordering::Relaxed) {
                    break;
                }
                let id = xorshift(&mut state) % 24;
                if i % 5 == 4 {
                    writer.delete(id).unwrap();
                } else {
                    let len = 4096 + (xorshift(&mut state) % (1 << 20)) as usize;
                    writer.put_blocking(id, &seeded_bytes(len, i + 1), b"").unwrap();
                }
                writer_ops.fetch_add(1, Ordering::Relaxed);
            }
        });
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let ops_before = writer_ops.load(Ordering::Relaxed);
            for run in 0..fsck_runs {
                let out = teraio().arg("fsck").args(&targets).output().unwrap();
                let stdout = String::from_utf8_lossy(&out.stdout);
                assert_eq!(out.status.code(), Some(0), "run {run}: {stdout}{}", String::from_utf8_lossy(&out.stderr));
                assert!(!stdout.contains("problem:"), "run {run}: {stdout}");
            }
            assert!(writer_ops.load(Ordering::Relaxed) > ops_before, "the writer made no change during the checks");

            // A real flipped bit in the kept object, while the writer goes on: reported, and
            // nothing else is.
            let device = targets.iter().find_map(|t| {
                let bytes = std::fs::read(t).unwrap();
                bytes.windows(64).position(|w| w == &kept[..64]).map(|at| (t.clone(), at as u64))
            });
            let (path, at) = device.expect("the kept object's bytes on a device");
            flip_one_bit(Path::new(&path), at + 5000);
            let out = teraio().arg("fsck").args(&targets).output().unwrap();
            let stdout = String::from_utf8_lossy(&out.stdout);
            assert_eq!(out.status.code(), Some(1), "{stdout}");
            let problems: Vec<&str> = stdout.lines().filter(|l| l.starts_with("problem:")).collect();
            assert_eq!(problems.len(), 1, "{stdout}");
            assert!(problems[0].contains("checksum mismatch in object 1000"), "{stdout}");
        }));
        stop.store(true, Ordering::Relaxed);
        if let Err(panic) = result {
            std::panic::resume_unwind(panic);
        }
    });
    writer.close().unwrap();
}

/// Flips one bit of a device file durably, as failing media would.
fn flip_one_bit(path: &Path, offset: u64) {
    use std::io::{Read, Seek, SeekFrom, Write};
    let mut f = std::fs::OpenOptions::new().read(true).write(true).open(path).unwrap();
    let mut b = [0u8; 1];
    f.seek(SeekFrom::Start(offset)).unwrap();
    f.read_exact(&mut b).unwrap();
    b[0] ^= 0x10;
    f.seek(SeekFrom::Start(offset)).unwrap();
    f.write_all(&b).unwrap();
    f.sync_all().unwrap();
}

#[test]
fn fsck_exits_1_for_a_damaged_newest_checkpoint_header_and_repair_fixes_it() {
    let tmp = scratch();
    let targets = paths(tmp.path(), 1);
    teraio().arg("format").args(&targets).args(["--file-size", "16MiB"]).assert().success();
    let store = teraio_engine::Store::open(&targets, teraio_engine::OpenConfig::default()).unwrap();
    store.put_blocking(1, &seeded_bytes(50_000, 3), b"").unwrap();
    store.close().unwrap(); // checkpoint generation 2 -> slot 0, right after the superblock
    flip_one_bit(Path::new(&targets[0]), 4096 + 20); // its record count: the header's checksum fails
    let out = teraio().arg("fsck").args(&targets).output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{stdout}");
    assert!(stdout.contains("problem:") && stdout.contains("newest checkpoint"), "{stdout}");
    assert!(stdout.contains("DAMAGED: 1 object(s)"), "{stdout}");
    let out = teraio().args(["fsck", "--repair"]).args(&targets).output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{stdout}");
    assert!(stdout.contains("repaired:") && stdout.contains("new checkpoint"), "{stdout}");
    teraio().arg("fsck").args(&targets).assert().code(0).stdout(predicate::str::contains("clean: 1 object(s)"));
}
