//! Store administration: `teraio format`, `teraio info` and `teraio fsck`.

use crate::error::{CliError, CliResult};
use crate::targets::{check_existing_store_paths, check_writable_targets, Intent};
use crate::units::{format_bytes, size_arg};
use clap::Args;
use serde::Serialize;
use std::path::PathBuf;
use teraio_engine::{FormatConfig, OpenConfig, Store};

/// `teraio format DEVICE...`
#[derive(Args, Debug, Clone)]
pub struct FormatArgs {
    /// Files or block devices of the new store, in stripe order.
    #[arg(required = true)]
    pub devices: Vec<PathBuf>,
    /// Stripe unit: bytes of an object placed on one device before the next.
    #[arg(long, value_parser = size_arg, default_value = "1MiB")]
    pub stripe_unit: u64,
    /// Allocation and I/O alignment; a multiple of every device's logical block size.
    #[arg(long, value_parser = size_arg, default_value = "4096")]
    pub block_size: u64,
    /// Do not keep a checksum per stripe unit (fsck then checks only the metadata).
    #[arg(long)]
    pub no_checksums: bool,
    /// Create missing device files with this size.
    #[arg(long, value_parser = size_arg)]
    pub file_size: Option<u64>,
    /// Bytes of each of the two checkpoint slots on device 0: a checkpoint of the whole object
    /// table must fit one, so this bounds the object count and caller metadata. Default: room
    /// for one object with 4 KiB of metadata per stripe unit of space (at least 1 MiB).
    #[arg(long, value_parser = size_arg)]
    pub checkpoint_slot_bytes: Option<u64>,
    /// Overwrite devices that hold data (a teraio store, a file system, anything non-zero).
    #[arg(long)]
    pub force: bool,
    /// Print JSON instead of text.
    #[arg(long)]
    pub json: bool,
}

/// `teraio info DEVICE...`: opens the store read-only, so it works beside a writer.
#[derive(Args, Debug, Clone)]
pub struct InfoArgs {
    /// Every device of the store, in any order.
    #[arg(required = true)]
    pub devices: Vec<PathBuf>,
    /// Objects to list in the text output (JSON lists all).
    #[arg(long, default_value_t = 20)]
    pub show_objects: usize,
    /// Print JSON instead of text.
    #[arg(long)]
    pub json: bool,
}

/// `teraio fsck DEVICE...`: exit code 0 when no problem is found (or, with `--repair`, when
/// everything found was repaired; notes may come with it, e.g. objects a writer changed while
/// they were checked), 1 when anything is wrong (including a store that cannot be opened because
/// it is damaged), 2 for bad input. Writes nothing without `--repair`.
#[derive(Args, Debug, Clone)]
pub struct FsckArgs {
    /// Every device of the store, in any order.
    #[arg(required = true)]
    pub devices: Vec<PathBuf>,
    /// Fix what can be fixed without losing anything (a damaged superblock copy, a damaged
    /// newest checkpoint) and say what was done; needs the store closed by its writer.
    #[arg(long)]
    pub repair: bool,
    /// Print JSON instead of text.
    #[arg(long)]
    pub json: bool,
}

/// Formats the devices as one store.
pub fn format(args: &FormatArgs) -> CliResult<()> {
    if args.file_size == Some(0) {
        return Err(CliError::input("--file-size 0 is too small; give the size of each device file, e.g. 1GiB"));
    }
    check_writable_targets(&args.devices, Intent::Format, args.force, args.file_size, false)?;
    let config = FormatConfig {
        stripe_unit_bytes: args.stripe_unit,
        block_size: args.block_size,
        checksums: !args.no_checksums,
        create_file_bytes: args.file_size,
        checkpoint_slot_bytes: args.checkpoint_slot_bytes,
        force: args.force,
        ..FormatConfig::default()
    };
    // Files this command creates are removed again if it fails: bad input loses nothing and
    // leaves nothing behind.
    let created: Vec<&PathBuf> = args.devices.iter().filter(|path| !path.exists()).collect();
    let formatted_and_opened = Store::format(&args.devices, &config).and_then(|formatted| {
        let store = Store::open(&args.devices, OpenConfig { queue_depth: 4, ..OpenConfig::default() })?;
        let info = store.info();
        store.close()?;
        Ok((formatted, info))
    });
    let (formatted, info) = match formatted_and_opened {
        Ok(done) => done,
        Err(error) => {
            let mut error = CliError::from(error);
            for path in created {
                match std::fs::remove_file(path) {
                    Ok(()) => {}
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                    Err(e) => error.message.push_str(&format!("; could not remove {}: {e}", path.display())),
                }
            }
            return Err(error);
        }
    };
    if args.json {
        print_json(&InfoJson::from_info(&info, &[]))?;
    } else {
        println!(
            "formatted teraio store {} on {} device(s): {} of data space, stripe unit {}, block size {}",
            formatted.uuid,
            info.devices.len(),
            format_bytes(info.devices.iter().map(|d| d.data_bytes).sum()),
            format_bytes(info.stripe_unit_bytes),
            info.block_size
        );
    }
    Ok(())
}

/// Prints a store's devices, layout, free space and objects.
pub fn info(args: &InfoArgs) -> CliResult<()> {
    check_existing_store_paths(&args.devices)?;
    let store = Store::open_read_only(&args.devices, OpenConfig { queue_depth: 4, ..OpenConfig::default() })?;
    let info = store.info();
    let objects = store.list();
    store.close()?;
    let json = InfoJson::from_info(&info, &objects);
    if args.json {
        return print_json(&json);
    }
    println!("store        {} (format version {})", json.uuid, json.format_version);
    println!(
        "layout       {} device(s), stripe unit {}, block size {}, checksums {}",
        json.devices.len(),
        format_bytes(json.stripe_unit_bytes),
        json.block_size,
        if json.checksums { "on" } else { "off" }
    );
    println!(
        "metadata     checkpoint slots 2 x {}, journal {} (on device 0)",
        format_bytes(json.checkpoint_slot_bytes),
        format_bytes(json.journal_bytes)
    );
    println!(
        "table        {} of {} a checkpoint slot holds ({}% full{})",
        format_bytes(json.table_bytes),
        format_bytes(json.checkpoint_slot_bytes),
        json.table_bytes * 100 / json.checkpoint_slot_bytes,
        if json.table_bytes * 100 / json.checkpoint_slot_bytes >= 90 {
            "; when full, puts that add objects or metadata fail while deletes still succeed"
        } else {
            ""
        }
    );
    println!("backend      {} ({})", json.backend, json.backend_reason);
    println!(
        "space        {} free of {} data space; {} object(s) hold {}",
        format_bytes(json.free_bytes),
        format_bytes(json.data_bytes),
        json.object_count,
        format_bytes(json.object_bytes)
    );
    println!();
    println!(
        "{:>3}  {:<40} {:>6} {:>12} {:>12} {:>12} {:>14} {:>9}",
        "dev", "path", "kind", "size", "data", "free", "largest free", "free runs"
    );
    for d in &json.devices {
        println!(
            "{:>3}  {:<40} {:>6} {:>12} {:>12} {:>12} {:>14} {:>9}",
            d.index,
            d.path,
            if d.is_block_device { "block" } else { "file" },
            format_bytes(d.size_bytes),
            format_bytes(d.data_bytes),
            format_bytes(d.free_bytes),
            format_bytes(d.largest_free_bytes),
            d.free_runs
        );
    }
    if !json.objects.is_empty() {
        println!();
        println!("{:>20}  {:>12}  {:>8}  {:>10}  devices", "object id", "size", "extents", "meta bytes");
        for o in json.objects.iter().take(args.show_objects) {
            println!(
                "{:>20}  {:>12}  {:>8}  {:>10}  {}",
                o.id,
                format_bytes(o.len_bytes),
                o.extent_count,
                o.meta_bytes,
                o.devices.iter().map(|d| d.to_string()).collect::<Vec<_>>().join(",")
            );
        }
        if json.objects.len() > args.show_objects {
            println!(
                "... and {} more (--show-objects N or --json to see them)",
                json.objects.len() - args.show_objects
            );
        }
    }
    Ok(())
}

/// Checks a store; the exit code says whether anything is (still) wrong.
pub fn fsck(args: &FsckArgs) -> CliResult<()> {
    check_existing_store_paths(&args.devices)?;
    let config = OpenConfig { queue_depth: 8, ..OpenConfig::default() };
    let report = Store::fsck_paths(&args.devices, config, args.repair).map_err(|e| {
        let locked = matches!(e, teraio_engine::Error::Locked { .. });
        let mut error = CliError::from(e);
        if locked && args.repair {
            error.message =
                format!("{}; --repair needs the store closed (fsck without it works beside a writer)", error.message);
        }
        error
    })?;
    let json = FsckJson {
        clean: report.is_clean(),
        objects_checked: report.objects_checked,
        bytes_checked: report.bytes_checked,
        units_checked: report.units_checked,
        problems: report.problems.clone(),
        notes: report.notes.clone(),
        repairs: report.repairs.clone(),
    };
    if args.json {
        print_json(&json)?;
    } else {
        for r in &json.repairs {
            println!("repaired: {r}");
        }
        for p in &json.problems {
            println!("problem: {p}");
        }
        for n in &json.notes {
            println!("note: {n}");
        }
        println!(
            "{}: {} object(s), {} in {} stripe unit(s) checked, {} problem(s){}",
            if json.clean { "clean" } else { "DAMAGED" },
            json.objects_checked,
            format_bytes(json.bytes_checked),
            json.units_checked,
            json.problems.len(),
            if args.repair { format!(", {} repaired", json.repairs.len()) } else { String::new() }
        );
    }
    if json.clean {
        Ok(())
    } else {
        Err(CliError::failed(format!(
            "fsck found {} problem(s) (listed above): put damaged objects again from their source; for damaged \
             devices or metadata, follow the advice on each line{}",
            json.problems.len(),
            if args.repair { "; what is left cannot be repaired without a copy of the damaged part" } else { "" }
        )))
    }
}

fn print_json<T: Serialize>(value: &T) -> CliResult<()> {
    let text = serde_json::to_string_pretty(value).map_err(|e| CliError::failed(format!("cannot write JSON: {e}")))?;
    println!("{text}");
    Ok(())
}

/// `teraio info --json`.
#[derive(Debug, Serialize)]
struct InfoJson {
    uuid: String,
    format_version: u32,
    block_size: u64,
    stripe_unit_bytes: u64,
    checksums: bool,
    backend: String,
    backend_reason: String,
    checkpoint_slot_bytes: u64,
    journal_bytes: u64,
    /// Bytes a checkpoint of the object table takes now; full at `checkpoint_slot_bytes`.
    table_bytes: u64,
    data_bytes: u64,
    free_bytes: u64,
    object_count: usize,
    object_bytes: u64,
    devices: Vec<DeviceJson>,
    objects: Vec<ObjectJson>,
}

#[derive(Debug, Serialize)]
struct DeviceJson {
    index: u16,
    path: String,
    is_block_device: bool,
    size_bytes: u64,
    data_bytes: u64,
    free_bytes: u64,
    largest_free_bytes: u64,
    free_runs: usize,
}

#[derive(Debug, Serialize)]
struct ObjectJson {
    id: u64,
    len_bytes: u64,
    meta_bytes: usize,
    devices: Vec<u16>,
    extent_count: usize,
}

impl InfoJson {
    fn from_info(info: &teraio_engine::StoreInfo, objects: &[teraio_engine::ObjectInfo]) -> InfoJson {
        InfoJson {
            uuid: info.uuid.clone(),
            format_version: info.format_version,
            block_size: info.block_size,
            stripe_unit_bytes: info.stripe_unit_bytes,
            checksums: info.checksums,
            backend: info.backend.clone(),
            backend_reason: info.backend_reason.clone(),
            checkpoint_slot_bytes: info.checkpoint_slot_bytes,
            journal_bytes: info.journal_bytes,
            table_bytes: info.table_bytes,
            data_bytes: info.devices.iter().map(|d| d.data_bytes).sum(),
            free_bytes: info.devices.iter().map(|d| d.free_bytes).sum(),
            object_count: info.object_count,
            object_bytes: info.object_bytes,
            devices: info
                .devices
                .iter()
                .map(|d| DeviceJson {
                    index: d.index,
                    path: d.path.display().to_string(),
                    is_block_device: d.is_block_device,
                    size_bytes: d.size_bytes,
                    data_bytes: d.data_bytes,
                    free_bytes: d.free_bytes,
                    largest_free_bytes: d.largest_free_bytes,
                    free_runs: d.free_runs,
                })
                .collect(),
            objects: objects
                .iter()
                .map(|o| ObjectJson {
                    id: o.id,
                    len_bytes: o.len_bytes,
                    meta_bytes: o.meta.len(),
                    devices: o.devices.clone(),
                    extent_count: o.extent_count,
                })
                .collect(),
        }
    }
}

/// `teraio fsck --json`.
#[derive(Debug, Serialize)]
struct FsckJson {
    clean: bool,
    objects_checked: u64,
    bytes_checked: u64,
    units_checked: u64,
    problems: Vec<String>,
    notes: Vec<String>,
    repairs: Vec<String>,
}
