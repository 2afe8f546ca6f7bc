//! docs/reliability.md's fault table names, in each row, the tests that show its promise, as
//! `path::function`. This checks that every row names at least one and that each named test is
//! defined in that file, so that the table cannot drift from the tree.

use std::path::{Path, PathBuf};

fn repository_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The rows of the table under "## Fault model", as their cells.
fn fault_rows(reliability: &str) -> Vec<Vec<String>> {
    let section = reliability.split("## Fault model").nth(1).expect("a \"## Fault model\" section");
    let table = section.lines().skip_while(|l| !l.starts_with('|')).take_while(|l| l.starts_with('|'));
    table
        .skip(2) // the header and its rule
        .map(|line| line.trim_matches('|').split(" | ").map(|cell| cell.trim().to_string()).collect())
        .collect()
}

/// The `path::function` names in a cell, from its backquoted spans.
fn named_tests(cell: &str) -> Vec<(String, String)> {
    cell.split('`')
        .skip(1)
        .step_by(2)
        .filter_map(|span| span.split_once("::"))
        .map(|(path, name)| (path.to_string(), name.to_string()))
        .collect()
}

/// Whether `source` (a Rust, Python or C file) defines a function called `name`.
fn defines(path: &str, source: &str, name: &str) -> bool {
    let definition = match Path::new(path).extension().and_then(|e| e.to_str()) {
        Some("rs") => format!("fn {name}("),
        Some("py") => format!("def {name}("),
        Some("c") => format!("void {name}("),
        other => panic!("{path}: no rule for files ending in {other:?}"),
    };
    source.contains(&definition)
}

#[test]
fn every_fault_row_names_tests_that_exist() {
    let root = repository_root();
    let reliability = std::fs::read_to_string(root.join("docs/reliability.md")).expect("docs/reliability.md");
    let rows = fault_rows(&reliability);
    assert!(rows.len() >= 10, "the fault table has only {} rows: was it found?", rows.len());
    let mut missing = Vec::new();
    for row in &rows {
        assert_eq!(row.len(), 3, "a fault row has three cells: {row:?}");
        let tests = named_tests(&row[2]);
        if tests.is_empty() {
            missing.push(format!("the row {:?} names no test as path::function", row[0]));
        }
        for (path, name) in tests {
            match std::fs::read_to_string(root.join(&path)) {
                Ok(source) if defines(&path, &source, &name) => {}
                Ok(_) => missing.push(format!("{path} defines no test {name} (row {:?})", row[0])),
                Err(e) => missing.push(format!("{path}: {e} (row {:?})", row[0])),
            }
        }
    }
    assert!(missing.is_empty(), "docs/reliability.md's fault table:\n{}", missing.join("\n"));
}

#[test]
fn the_checker_finds_names_and_misses() {
    let cell = "`tests/a.rs::one` (note), `bindings/c/tests/t.c::two`, `not a name`";
    assert_eq!(
        named_tests(cell),
        vec![("tests/a.rs".to_string(), "one".to_string()), ("bindings/c/tests/t.c".to_string(), "two".to_string())]
    );
    assert!(defines("x.rs", "#[test]\nfn one() {}", "one"));
    assert!(!defines("x.rs", "fn one_more() {}", "one"));
    assert!(defines("x.py", "def test_a(store) -> None:", "test_a"));
    assert!(defines("x.c", "static void test_b(const char *dir) {", "test_b"));
}
