//! The C option structs carry the engine's store options (`teraio_engine::options`, the one
//! table every interface follows): each field of `teraio_format_options` and
//! `teraio_open_options` but `struct_size` is a `c_field` of an option of that stage, and every
//! `c_field` is a field of its stage's struct.

use teraio_engine::options::{OptionStage, STORE_OPTIONS};

/// The field names of `typedef struct NAME { ... } NAME;` in the checked-in header.
fn header_fields(struct_name: &str) -> Vec<String> {
    let header = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/include/teraio.h")).unwrap();
    let start = header.find(&format!("typedef struct {struct_name} {{")).unwrap_or_else(|| panic!("{struct_name}"));
    let body = &header[start..start + header[start..].find(&format!("}} {struct_name};")).unwrap()];
    body.lines()
        .map(str::trim)
        .filter(|line| line.ends_with(';') && !line.starts_with('*') && !line.starts_with("/*"))
        .map(|line| line.trim_end_matches(';').split_whitespace().last().unwrap().to_string())
        .filter(|field| field != "struct_size")
        .collect()
}

fn table_fields(stage: OptionStage) -> Vec<String> {
    let mut fields: Vec<String> =
        STORE_OPTIONS.iter().filter(|o| o.stage == stage).filter_map(|o| o.c_field.map(String::from)).collect();
    fields.sort();
    fields
}

#[test]
fn the_c_option_structs_carry_the_table() {
    for (struct_name, stage) in
        [("teraio_format_options", OptionStage::Format), ("teraio_open_options", OptionStage::Open)]
    {
        let mut fields = header_fields(struct_name);
        assert!(!fields.is_empty(), "{struct_name} not parsed");
        fields.sort();
        assert_eq!(fields, table_fields(stage), "{struct_name} against teraio_engine::options::STORE_OPTIONS");
    }
}
