//! The checked-in `include/teraio.h` must be what cbindgen generates from the current source.
//! After changing the API, regenerate it with
//! `TERAIO_BLESS_HEADER=1 cargo test -p teraio-c --test header` and review the diff.

use std::path::Path;

#[test]
fn header_is_up_to_date() {
    let crate_dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let config = cbindgen::Config::from_file(crate_dir.join("cbindgen.toml")).expect("read cbindgen.toml");
    let bindings = cbindgen::Builder::new()
        .with_config(config)
        .with_src(crate_dir.join("src/lib.rs"))
        .generate()
        .expect("cbindgen generates the header");
    let mut generated = Vec::new();
    bindings.write(&mut generated);
    let generated = String::from_utf8(generated).expect("header is UTF-8");
    for name in
        ["teraio_create", "teraio_ticket_wait", "TERAIO_ERR_BAD_HANDLE", "teraio_stats", "TERAIO_PRIORITY_URGENT"]
    {
        assert!(generated.contains(name), "generated header lacks {name}: is a module not parsed?");
    }
    let path = crate_dir.join("include/teraio.h");
    if std::env::var_os("TERAIO_BLESS_HEADER").is_some() {
        std::fs::write(&path, &generated).expect("write include/teraio.h");
        return;
    }
    let checked_in = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        checked_in == generated,
        "include/teraio.h is stale; regenerate it with \
         `TERAIO_BLESS_HEADER=1 cargo test -p teraio-c --test header` and commit it"
    );
}
