//! The store options every interface offers, declared once: name, when it is chosen (format or
//! open), what it takes, its default, its C field and its documentation. Python's
//! `Store.create`/`Store.open` keyword arguments are checked against and applied through this
//! table (`teraio._native.STORE_OPTIONS`), and tests hold `_native.pyi`, the C header's option
//! structs and docs/python.md to it, so no interface can drop or rename an option on its own.
//!
//! The defaults are [`FormatConfig::default`] and [`OpenConfig::default`]; a test checks that the
//! table states the same ones.

use crate::backend::throttle::DeviceModel;
use crate::backend::BackendKind;
use crate::config::{FormatConfig, GpuPath, OpenConfig};
use crate::error::{Error, Result};

/// When an option is chosen.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OptionStage {
    /// Fixed when a store is formatted (`create` only).
    Format,
    /// Chosen at every open (`create` and `open`).
    Open,
}

/// What an option takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OptionKind {
    /// true or false.
    Flag,
    /// A whole number.
    Count,
    /// A number of bytes, or a size such as `"64MiB"` (teraio-units).
    Bytes,
    /// One of the names the doc lists.
    Name,
}

impl OptionKind {
    /// The kind as Python's type stubs spell it.
    pub fn python_type(self) -> &'static str {
        match self {
            OptionKind::Flag => "bool",
            OptionKind::Count | OptionKind::Bytes => "int",
            OptionKind::Name => "str",
        }
    }
}

/// A value given for an option (or stated as its default).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OptionValue<'a> {
    Flag(bool),
    Count(u64),
    Text(&'a str),
    /// No value: the option's "not set" (only where `optional`).
    Unset,
}

/// Both configurations a store is made or opened with.
#[derive(Debug, Clone, Default)]
pub struct StoreConfigs {
    pub format: FormatConfig,
    pub open: OpenConfig,
}

/// One store option.
pub struct StoreOption {
    /// The name (Python keyword argument, docs).
    pub name: &'static str,
    pub stage: OptionStage,
    pub kind: OptionKind,
    /// `Unset` is accepted (and means what `doc` says).
    pub optional: bool,
    /// The default, as [`FormatConfig::default`] / [`OpenConfig::default`] have it.
    pub default: OptionValue<'static>,
    /// The field of `teraio_format_options` / `teraio_open_options` that carries it in the C
    /// API, if the C API offers it.
    pub c_field: Option<&'static str>,
    /// One sentence for users.
    pub doc: &'static str,
    apply: fn(&mut StoreConfigs, OptionValue<'_>) -> Result<()>,
}

impl std::fmt::Debug for StoreOption {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StoreOption").field("name", &self.name).field("default", &self.default).finish()
    }
}

const GIB: u64 = crate::config::GIB;
const MIB: u64 = crate::config::MIB;

/// Every store option, format options first.
pub const STORE_OPTIONS: &[StoreOption] = &[
    StoreOption {
        name: "file_size_bytes",
        stage: OptionStage::Format,
        kind: OptionKind::Bytes,
        optional: true,
        default: OptionValue::Unset,
        c_field: Some("create_file_bytes"),
        doc: "Create missing device files (regular files only) with this size; unset: they must exist.",
        apply: |c, v| {
            c.format.create_file_bytes = optional_bytes("file_size_bytes", v)?;
            Ok(())
        },
    },
    StoreOption {
        name: "stripe_unit_bytes",
        stage: OptionStage::Format,
        kind: OptionKind::Bytes,
        optional: false,
        default: OptionValue::Count(MIB),
        c_field: Some("stripe_unit_bytes"),
        doc: "Bytes of each stripe unit, a multiple of block_size.",
        apply: |c, v| {
            c.format.stripe_unit_bytes = bytes("stripe_unit_bytes", v)?;
            Ok(())
        },
    },
    StoreOption {
        name: "block_size",
        stage: OptionStage::Format,
        kind: OptionKind::Bytes,
        optional: false,
        default: OptionValue::Count(4096),
        c_field: Some("block_size"),
        doc: "Allocation and I/O unit, a power of two in 512..=65536.",
        apply: |c, v| {
            c.format.block_size = bytes("block_size", v)?;
            Ok(())
        },
    },
    StoreOption {
        name: "checksums",
        stage: OptionStage::Format,
        kind: OptionKind::Flag,
        optional: false,
        default: OptionValue::Flag(true),
        c_field: Some("checksums"),
        doc: "Keep a crc32c per stripe unit (checked by fsck and verified gets).",
        apply: |c, v| {
            c.format.checksums = flag("checksums", v)?;
            Ok(())
        },
    },
    StoreOption {
        name: "force",
        stage: OptionStage::Format,
        kind: OptionKind::Flag,
        optional: false,
        default: OptionValue::Flag(false),
        c_field: Some("force"),
        doc: "Overwrite devices that already hold a teraio store.",
        apply: |c, v| {
            c.format.force = flag("force", v)?;
            Ok(())
        },
    },
    StoreOption {
        name: "max_meta_bytes",
        stage: OptionStage::Format,
        kind: OptionKind::Bytes,
        optional: false,
        default: OptionValue::Count(4096),
        c_field: Some("max_meta_bytes"),
        doc: "Largest caller metadata blob per object, at most 65535.",
        apply: |c, v| {
            c.format.max_meta_bytes = bytes("max_meta_bytes", v)?;
            Ok(())
        },
    },
    StoreOption {
        name: "checkpoint_slot_bytes",
        stage: OptionStage::Format,
        kind: OptionKind::Bytes,
        optional: true,
        default: OptionValue::Unset,
        c_field: Some("checkpoint_slot_bytes"),
        doc: "Bytes of each checkpoint slot (a checkpoint of the whole object table must fit one); unset: room for one object with max_meta_bytes of metadata per stripe unit of all devices, at least the journal's default, at most 256 MiB and device 0's size / 8.",
        apply: |c, v| {
            c.format.checkpoint_slot_bytes = optional_bytes("checkpoint_slot_bytes", v)?;
            Ok(())
        },
    },
    StoreOption {
        name: "journal_bytes",
        stage: OptionStage::Format,
        kind: OptionKind::Bytes,
        optional: true,
        default: OptionValue::Unset,
        c_field: Some("journal_bytes"),
        doc: "Bytes of the journal ring; unset: device 0's size / 128, clamped to 1 MiB..=256 MiB.",
        apply: |c, v| {
            c.format.journal_bytes = optional_bytes("journal_bytes", v)?;
            Ok(())
        },
    },
    StoreOption {
        name: "durable",
        stage: OptionStage::Open,
        kind: OptionKind::Flag,
        optional: false,
        default: OptionValue::Flag(true),
        c_field: Some("durable"),
        doc: "A put or delete returns only once it would survive power loss (False: a process crash).",
        apply: |c, v| {
            c.open.durable = flag("durable", v)?;
            Ok(())
        },
    },
    StoreOption {
        name: "direct_io",
        stage: OptionStage::Open,
        kind: OptionKind::Flag,
        optional: false,
        default: OptionValue::Flag(true),
        c_field: Some("direct_io"),
        doc: "O_DIRECT (also while formatting); False for file systems without it, such as tmpfs.",
        apply: |c, v| {
            let direct_io = flag("direct_io", v)?;
            c.format.direct_io = direct_io;
            c.open.direct_io = direct_io;
            Ok(())
        },
    },
    StoreOption {
        name: "queue_depth",
        stage: OptionStage::Open,
        kind: OptionKind::Count,
        optional: false,
        default: OptionValue::Count(32),
        c_field: Some("queue_depth"),
        doc: "Requests in flight per device, 1..=4096.",
        apply: |c, v| {
            c.open.queue_depth = usize_count("queue_depth", v)?;
            Ok(())
        },
    },
    StoreOption {
        name: "backend",
        stage: OptionStage::Open,
        kind: OptionKind::Name,
        optional: false,
        default: OptionValue::Text("auto"),
        c_field: Some("backend"),
        doc: "I/O backend: auto (io_uring where the kernel allows it, else psync; says which), io_uring or psync.",
        apply: |c, v| {
            c.open.backend = text("backend", v)?.parse::<BackendKind>()?;
            Ok(())
        },
    },
    StoreOption {
        name: "max_inflight_bytes",
        stage: OptionStage::Open,
        kind: OptionKind::Bytes,
        optional: false,
        default: OptionValue::Count(GIB),
        c_field: Some("max_inflight_bytes"),
        doc: "Bytes of device requests in flight over the whole store (1/8 kept for urgent work).",
        apply: |c, v| {
            c.open.max_inflight_bytes = bytes("max_inflight_bytes", v)?;
            Ok(())
        },
    },
    StoreOption {
        name: "max_io_bytes",
        stage: OptionStage::Open,
        kind: OptionKind::Bytes,
        optional: false,
        default: OptionValue::Count(4 * MIB),
        c_field: Some("max_io_bytes"),
        doc: "Largest single device request, a multiple of the block size.",
        apply: |c, v| {
            c.open.max_io_bytes = bytes("max_io_bytes", v)?;
            Ok(())
        },
    },
    StoreOption {
        name: "bounce_pool_bytes",
        stage: OptionStage::Open,
        kind: OptionKind::Bytes,
        optional: false,
        default: OptionValue::Count(64 * MIB),
        c_field: Some("bounce_pool_bytes"),
        doc: "Bounce memory for unaligned buffers and the GPU bounce path, allocated at open.",
        apply: |c, v| {
            c.open.bounce_pool_bytes = bytes("bounce_pool_bytes", v)?;
            Ok(())
        },
    },
    StoreOption {
        name: "verify_checksums",
        stage: OptionStage::Open,
        kind: OptionKind::Flag,
        optional: false,
        default: OptionValue::Flag(true),
        c_field: Some("verify_checksums"),
        doc: "Check every stripe unit a get returns bytes of; damaged data fails the get instead of coming back.",
        apply: |c, v| {
            c.open.verify_checksums = flag("verify_checksums", v)?;
            Ok(())
        },
    },
    StoreOption {
        name: "lock_wait_ms",
        stage: OptionStage::Open,
        kind: OptionKind::Count,
        optional: false,
        default: OptionValue::Count(2000),
        c_field: Some("lock_wait_ms"),
        doc: "Milliseconds to wait for a device lock held by another writer before failing.",
        apply: |c, v| {
            c.open.lock_wait_ms = count("lock_wait_ms", v)?;
            Ok(())
        },
    },
    StoreOption {
        name: "emulate",
        stage: OptionStage::Open,
        kind: OptionKind::Name,
        optional: true,
        default: OptionValue::Unset,
        c_field: None,
        doc: "Make every device behave like an SSD of this bandwidth and latency, e.g. \"6.5GB/s@20us\".",
        apply: |c, v| {
            c.open.emulate = match v {
                OptionValue::Unset => None,
                _ => {
                    let model = text("emulate", v)?;
                    let parsed = DeviceModel::parse(model)
                        .map_err(|e| Error::InvalidConfig(format!("emulate={model:?}: {e}")))?;
                    Some(parsed)
                }
            };
            Ok(())
        },
    },
    StoreOption {
        name: "gpu",
        stage: OptionStage::Open,
        kind: OptionKind::Name,
        optional: false,
        default: OptionValue::Text("auto"),
        c_field: None,
        doc: "GPU data path: auto (measured choice), bounce, cufile or gds (true GDS only).",
        apply: |c, v| {
            c.open.gpu.path = text("gpu", v)?.parse::<GpuPath>()?;
            Ok(())
        },
    },
];

/// The option called `name`.
pub fn store_option(name: &str) -> Option<&'static StoreOption> {
    STORE_OPTIONS.iter().find(|option| option.name == name)
}

/// The configurations from the defaults and `values`, each checked against the table: an
/// unknown name, a format option while opening (`creating` false), or a value of the wrong kind
/// is `InvalidConfig` naming the option. The configurations' own `validate` still runs at open.
pub fn store_configs<'a>(
    values: impl IntoIterator<Item = (&'a str, OptionValue<'a>)>,
    creating: bool,
) -> Result<StoreConfigs> {
    let mut configs = StoreConfigs::default();
    for (name, value) in values {
        let option = store_option(name).ok_or_else(|| {
            let known: Vec<&str> =
                STORE_OPTIONS.iter().filter(|o| creating || o.stage == OptionStage::Open).map(|o| o.name).collect();
            Error::InvalidConfig(format!("unknown store option {name:?}; known: {}", known.join(", ")))
        })?;
        if option.stage == OptionStage::Format && !creating {
            return Err(Error::InvalidConfig(format!(
                "{name} is fixed when a store is formatted: pass it to create, not open"
            )));
        }
        if value == OptionValue::Unset && !option.optional {
            return Err(Error::InvalidConfig(format!("{name} needs a value (default {})", option.default)));
        }
        (option.apply)(&mut configs, value)?;
    }
    Ok(configs)
}

impl std::fmt::Display for OptionValue<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            OptionValue::Flag(value) => write!(f, "{value}"),
            OptionValue::Count(value) => write!(f, "{value}"),
            OptionValue::Text(value) => write!(f, "{value:?}"),
            OptionValue::Unset => write!(f, "unset"),
        }
    }
}

fn wrong_kind(name: &str, wanted: &str, value: OptionValue<'_>) -> Error {
    Error::InvalidConfig(format!("{name} takes {wanted}, not {value}"))
}

fn flag(name: &str, value: OptionValue<'_>) -> Result<bool> {
    match value {
        OptionValue::Flag(value) => Ok(value),
        other => Err(wrong_kind(name, "true or false", other)),
    }
}

fn count(name: &str, value: OptionValue<'_>) -> Result<u64> {
    match value {
        OptionValue::Count(value) => Ok(value),
        other => Err(wrong_kind(name, "a whole number", other)),
    }
}

fn usize_count(name: &str, value: OptionValue<'_>) -> Result<usize> {
    let value = count(name, value)?;
    usize::try_from(value).map_err(|_| Error::InvalidConfig(format!("{name} {value} is too large")))
}

fn bytes(name: &str, value: OptionValue<'_>) -> Result<u64> {
    match value {
        OptionValue::Count(value) => Ok(value),
        OptionValue::Text(size) => {
            crate::config::parse_size(size).map_err(|e| Error::InvalidConfig(format!("{name}: {e}")))
        }
        other => Err(wrong_kind(name, "a number of bytes or a size such as \"64MiB\"", other)),
    }
}

fn optional_bytes(name: &str, value: OptionValue<'_>) -> Result<Option<u64>> {
    match value {
        OptionValue::Unset => Ok(None),
        other => bytes(name, other).map(Some),
    }
}

fn text<'a>(name: &str, value: OptionValue<'a>) -> Result<&'a str> {
    match value {
        OptionValue::Text(value) => Ok(value),
        other => Err(wrong_kind(name, "a name", other)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn configs(values: &[(&str, OptionValue<'_>)], creating: bool) -> Result<StoreConfigs> {
        store_configs(values.iter().copied(), creating)
    }

    fn message(result: Result<StoreConfigs>) -> String {
        result.unwrap_err().to_string()
    }

    #[test]
    fn the_table_states_the_configs_own_defaults() {
        // Applying every stated default gives what `Default` gives (compared field by field
        // through Debug: the configs hold types without PartialEq).
        let defaults: Vec<(&str, OptionValue<'_>)> = STORE_OPTIONS.iter().map(|o| (o.name, o.default)).collect();
        let applied = configs(&defaults, true).unwrap();
        let plain = StoreConfigs::default();
        assert_eq!(format!("{:?}", applied.format), format!("{:?}", plain.format));
        assert_eq!(format!("{:?}", applied.open), format!("{:?}", plain.open));
    }

    #[test]
    fn every_option_reaches_its_field() {
        let values = [
            ("file_size_bytes", OptionValue::Text("1GiB")),
            ("stripe_unit_bytes", OptionValue::Count(2 * MIB)),
            ("block_size", OptionValue::Count(8192)),
            ("checksums", OptionValue::Flag(false)),
            ("force", OptionValue::Flag(true)),
            ("max_meta_bytes", OptionValue::Count(100)),
            ("checkpoint_slot_bytes", OptionValue::Count(2 * MIB)),
            ("journal_bytes", OptionValue::Count(4 * MIB)),
            ("durable", OptionValue::Flag(false)),
            ("direct_io", OptionValue::Flag(false)),
            ("queue_depth", OptionValue::Count(7)),
            ("backend", OptionValue::Text("psync")),
            ("max_inflight_bytes", OptionValue::Text("256MiB")),
            ("max_io_bytes", OptionValue::Count(MIB)),
            ("bounce_pool_bytes", OptionValue::Count(8 * MIB)),
            ("verify_checksums", OptionValue::Flag(false)),
            ("lock_wait_ms", OptionValue::Count(5)),
            ("emulate", OptionValue::Text("1GB/s@10us")),
            ("gpu", OptionValue::Text("bounce")),
        ];
        assert_eq!(values.len(), STORE_OPTIONS.len(), "a new option needs a line here");
        let c = configs(&values, true).unwrap();
        let (f, o) = (&c.format, &c.open);
        assert_eq!(f.create_file_bytes, Some(GIB));
        assert_eq!((f.stripe_unit_bytes, f.block_size, f.checksums, f.force), (2 * MIB, 8192, false, true));
        assert_eq!((f.max_meta_bytes, f.checkpoint_slot_bytes, f.journal_bytes), (100, Some(2 * MIB), Some(4 * MIB)));
        assert!(!o.durable && !o.direct_io && !f.direct_io);
        assert_eq!((o.queue_depth, o.backend), (7, BackendKind::Psync));
        assert_eq!((o.max_inflight_bytes, o.max_io_bytes, o.bounce_pool_bytes), (256 * MIB, MIB, 8 * MIB));
        assert!(!o.verify_checksums);
        assert_eq!(o.lock_wait_ms, 5);
        assert_eq!(o.emulate.as_ref().map(|m| m.read_bytes_per_s), Some(1e9));
        assert_eq!(o.gpu.path, GpuPath::Bounce);
    }

    #[test]
    fn bad_options_are_refused_by_name() {
        let m = message(configs(&[("verify_checksum", OptionValue::Flag(true))], true));
        assert!(m.contains("verify_checksum") && m.contains("verify_checksums"), "{m}");
        let m = message(configs(&[("block_size", OptionValue::Count(8192))], false));
        assert!(m.contains("block_size") && m.contains("create"), "{m}");
        let m = message(configs(&[("queue_depth", OptionValue::Text("deep"))], false));
        assert!(m.contains("queue_depth") && m.contains("whole number"), "{m}");
        let m = message(configs(&[("durable", OptionValue::Count(1))], false));
        assert!(m.contains("durable") && m.contains("true or false"), "{m}");
        let m = message(configs(&[("gpu", OptionValue::Unset)], false));
        assert!(m.contains("gpu") && m.contains("needs a value"), "{m}");
        let m = message(configs(&[("backend", OptionValue::Text("spdk"))], false));
        assert!(m.contains("spdk"), "{m}");
        let m = message(configs(&[("emulate", OptionValue::Text("fast"))], false));
        assert!(m.contains("emulate"), "{m}");
        let m = message(configs(&[("max_io_bytes", OptionValue::Text("4 megs"))], false));
        assert!(m.contains("max_io_bytes"), "{m}");
        assert!(configs(&[("emulate", OptionValue::Unset), ("durable", OptionValue::Flag(false))], false).is_ok());
    }

    #[test]
    fn names_are_unique_and_documented() {
        for (index, option) in STORE_OPTIONS.iter().enumerate() {
            assert!(!option.doc.is_empty() && option.doc.ends_with('.'), "{}: {:?}", option.name, option.doc);
            assert!(STORE_OPTIONS[..index].iter().all(|o| o.name != option.name), "{} twice", option.name);
            assert_eq!(option.optional, option.default == OptionValue::Unset, "{}", option.name);
        }
    }
}
