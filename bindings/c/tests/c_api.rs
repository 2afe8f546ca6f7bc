//! Runs the C test and the C example (`run-c-tests.sh`) against the library cargo just built for
//! this test, so `cargo test --workspace` covers the C API as a C compiler sees it.

use std::path::PathBuf;
use std::process::Command;

/// The directory holding the `libteraio.{a,so}` of this build. This test binary lives in
/// `<target>/<profile>/deps/`; when cargo builds the library only as this test's dependency it
/// leaves the artifacts there, and a `cargo build` copies them up to `<target>/<profile>/`. Take
/// whichever is newer, so that a stale copy from an earlier build is never tested.
fn library_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("test binary path");
    let deps = exe.parent().expect("<target>/<profile>/deps").to_path_buf();
    let profile = deps.parent().expect("<target>/<profile>").to_path_buf();
    let built_at = |dir: &PathBuf| {
        let a = std::fs::metadata(dir.join("libteraio.a")).and_then(|m| m.modified()).ok()?;
        let so = std::fs::metadata(dir.join("libteraio.so")).and_then(|m| m.modified()).ok()?;
        Some(a.min(so))
    };
    [deps, profile]
        .into_iter()
        .filter_map(|dir| built_at(&dir).map(|time| (time, dir)))
        .max_by_key(|(time, _)| *time)
        .map(|(_, dir)| dir)
        .unwrap_or_else(|| panic!("libteraio.a and libteraio.so not found next to {}", exe.display()))
}

#[test]
fn c_test_and_example_pass() {
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("run-c-tests.sh");
    // Under the target directory: a real file system (O_DIRECT), not /tmp's possible tmpfs.
    let work = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("teraio-c-api");
    let output = Command::new("bash")
        .arg(&script)
        .env("TERAIO_LIB_DIR", library_dir())
        .env("TERAIO_TEST_DIR", &work)
        .output()
        .expect("run run-c-tests.sh");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    println!("{stdout}");
    eprintln!("{stderr}");
    assert!(output.status.success(), "C tests failed ({}):\n{stdout}\n{stderr}", output.status);
    assert!(stdout.contains("test_teraio: all checks passed"), "{stdout}");
    assert!(stdout.contains("roundtrip example: ok"), "{stdout}");
}
