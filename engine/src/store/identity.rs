//! Device identity: reads both superblock copies of every device, matches the devices to one
//! store, finds damaged, short and stale members, and moves every device to a new store epoch.
//!
//! The epoch protocol: a writer's open and every checkpoint write the next epoch into both
//! superblock copies of device 0, flush, then into every other device, flush; only then do
//! checkpoints and journal batches record it. So, whatever a crash interrupts, device 0 is never
//! behind another device and no device is behind the newest recorded epoch. A device that is
//! behind either was put back from an older copy: its bytes are not the ones the table describes.

use super::Shared;
use crate::backend::IoKind;
use crate::buffer::AlignedBuf;
use crate::device::Device;
use crate::error::{Error, Result};
use crate::layout::codec::round_down;
use crate::layout::superblock::Superblock;
use crate::layout::SUPERBLOCK_BYTES;

/// What to do about a device whose identity cannot be trusted.
const RESTORE_DEVICE: &str = "put back the device's current copy, or restore every device of the store from copies \
     taken at one time (teraio stripes without redundancy: the store cannot be opened without each device intact)";

/// Both superblock copies of one device, as read.
pub(crate) struct Copies {
    pub primary: Result<Superblock>,
    /// The backup copy: at the offset the primary records, or at the end of the device when the
    /// primary is unusable.
    pub backup: Result<Superblock>,
    pub backup_offset: u64,
}

impl Copies {
    /// The copy in use: the primary when valid, else the backup.
    pub fn chosen(&self) -> Option<&Superblock> {
        self.primary.as_ref().or(self.backup.as_ref()).ok()
    }

    /// The device's epoch: the newest of its valid copies that agree on everything else (a crash
    /// between the writes of the two copies leaves them one epoch apart).
    fn epoch(&self) -> u64 {
        let chosen = self.chosen().expect("a valid copy");
        [&self.primary, &self.backup]
            .into_iter()
            .filter_map(|c| c.as_ref().ok())
            .filter(|c| chosen.same_identity(c))
            .map(|c| c.epoch)
            .max()
            .unwrap_or(chosen.epoch)
    }
}

/// Reads both copies. A copy that cannot be read counts as damaged, with the read error.
pub(crate) fn read_copies(d: &Device) -> Copies {
    if d.size_bytes < 2 * SUPERBLOCK_BYTES {
        let none = || Err(Error::NotATeraioDevice { path: d.path.clone() });
        return Copies { primary: none(), backup: none(), backup_offset: 0 };
    }
    let read = |offset: u64| -> Result<Superblock> {
        let mut block = AlignedBuf::new(SUPERBLOCK_BYTES as usize, 4096)?;
        d.read_exact_at(&mut block, offset)?;
        Superblock::decode(&block, &d.path)
    };
    let primary = read(0);
    let backup_offset = match &primary {
        Ok(sb) if sb.device_bytes <= d.size_bytes => sb.backup_offset(),
        _ => round_down(d.size_bytes, SUPERBLOCK_BYTES) - SUPERBLOCK_BYTES,
    };
    let backup = read(backup_offset).and_then(|sb| {
        if sb.backup_offset() == backup_offset {
            Ok(sb)
        } else {
            Err(Error::CorruptSuperblock {
                path: d.path.clone(),
                detail: format!(
                    "the backup copy at offset {backup_offset} records a device of {} bytes",
                    sb.device_bytes
                ),
            })
        }
    });
    Copies { primary, backup, backup_offset }
}

/// One copy's error as a short phrase.
fn copy_error(e: &Error) -> String {
    match e {
        Error::NotATeraioDevice { .. } => "no teraio superblock".into(),
        Error::CorruptSuperblock { detail, .. } => detail.clone(),
        other => other.to_string(),
    }
}

/// The devices of one store, sorted by index, with the superblock each uses (its `epoch` is the
/// device's epoch).
pub(crate) struct Members {
    pub devices: Vec<Device>,
    pub superblocks: Vec<Superblock>,
}

/// Matches opened devices to one store: same uuid and layout, each index once, none missing,
/// none shorter than its superblock records, device 0 not behind another device.
pub(crate) fn assemble(found: Vec<(Device, Copies)>) -> Result<Members> {
    let given = found.len();
    let (known, unknown): (Vec<_>, Vec<_>) = found.into_iter().partition(|(_, c)| c.chosen().is_some());
    let Some((_, first)) = known.first() else {
        let (d, copies) = unknown.into_iter().next().expect("at least one device");
        return Err(unidentified(&d, copies));
    };
    let expected = first.chosen().expect("known").clone();
    let count = expected.device_count;
    let uuid = expected.uuid_string();
    let mut slots: Vec<Option<(Device, Superblock)>> = (0..count).map(|_| None).collect();
    for (d, copies) in known {
        let mut sb = copies.chosen().expect("known").clone();
        if sb.store_uuid != expected.store_uuid {
            return Err(Error::WrongStore { path: d.path.clone(), expected: uuid, found: sb.uuid_string() });
        }
        sb.epoch = copies.epoch();
        let i = sb.device_index as usize;
        if i >= slots.len() {
            return Err(Error::CorruptSuperblock {
                path: d.path.clone(),
                detail: format!(
                    "its superblock says device {i} of store {uuid}, which has {count} devices; {RESTORE_DEVICE}"
                ),
            });
        }
        if let Some((first, _)) = &slots[i] {
            return Err(Error::DuplicateDevice {
                index: sb.device_index,
                first: first.path.clone(),
                second: d.path.clone(),
            });
        }
        slots[i] = Some((d, sb));
    }
    let missing: Vec<u16> = (0..count).filter(|&i| slots[i as usize].is_none()).collect();
    if let Some((d, copies)) = unknown.into_iter().next() {
        if missing.is_empty() {
            // Every member is here: this is an extra device, of no store or a damaged one.
            return Err(unidentified(&d, copies));
        }
        let which = match missing.as_slice() {
            [one] => format!("device {one}"),
            many => format!("one of devices {many:?}"),
        };
        return Err(Error::CorruptSuperblock {
            path: d.path.clone(),
            detail: format!(
                "{which} of store {uuid} is damaged or missing its superblock (primary copy: {}; backup copy: {}), \
                 while the store's other devices name it as a member; {RESTORE_DEVICE}",
                copy_error(copies.primary.as_ref().expect_err("unknown")),
                copy_error(copies.backup.as_ref().expect_err("unknown")),
            ),
        });
    }
    if let Some(&index) = missing.first() {
        return Err(Error::MissingDevice { index, count });
    }
    if given != count as usize {
        return Err(Error::DeviceCountMismatch { given, count });
    }
    let (devices, superblocks): (Vec<Device>, Vec<Superblock>) = slots.into_iter().map(Option::unwrap).unzip();
    for (d, sb) in devices.iter().zip(&superblocks) {
        if (sb.block_size, sb.stripe_unit_bytes, sb.flags)
            != (expected.block_size, expected.stripe_unit_bytes, expected.flags)
        {
            return Err(Error::CorruptSuperblock {
                path: d.path.clone(),
                detail: format!(
                    "device {} of store {uuid}: its layout parameters (block size, stripe unit, flags) differ from \
                     the other devices'; {RESTORE_DEVICE}",
                    sb.device_index
                ),
            });
        }
        if d.size_bytes < sb.device_bytes {
            return Err(Error::CorruptSuperblock {
                path: d.path.clone(),
                detail: format!(
                    "device {} of store {uuid} is {} bytes, shorter than the {} bytes its superblock records: it was \
                     truncated or replaced by a smaller device, and whatever was stored past its end is gone; \
                     {RESTORE_DEVICE}",
                    sb.device_index, d.size_bytes, sb.device_bytes
                ),
            });
        }
    }
    let ahead = (1..superblocks.len()).max_by_key(|&i| superblocks[i].epoch);
    if let Some(i) = ahead.filter(|&i| superblocks[i].epoch > superblocks[0].epoch) {
        return Err(stale(&devices[0], &superblocks[0], superblocks[i].epoch, &format!("device {i} is")));
    }
    Ok(Members { devices, superblocks })
}

/// The error for a device no copy of whose superblock is usable, when no other device names it.
fn unidentified(d: &Device, copies: Copies) -> Error {
    match (copies.primary, copies.backup) {
        (
            Err(Error::NotATeraioDevice { .. }),
            Err(Error::NotATeraioDevice { .. } | Error::CorruptSuperblock { .. }),
        ) => Error::NotATeraioDevice { path: d.path.clone() },
        (Err(e @ Error::UnsupportedVersion { .. }), _) | (_, Err(e @ Error::UnsupportedVersion { .. })) => e,
        (Err(primary), Err(backup)) => Error::CorruptSuperblock {
            path: d.path.clone(),
            detail: format!(
                "the superblock is damaged ({}) and its backup copy is unusable too ({}), so the device cannot be \
                 identified; if it belongs to a store, give it with the store's other devices to learn which one it \
                 is, and restore it from a copy taken together with them",
                copy_error(&primary),
                copy_error(&backup)
            ),
        },
        _ => unreachable!("a device with a valid copy is identified"),
    }
}

fn stale(d: &Device, sb: &Superblock, expected: u64, by: &str) -> Error {
    Error::CorruptSuperblock {
        path: d.path.clone(),
        detail: format!(
            "device {} of store {} is stale: it is at epoch {}, but {by} at epoch {expected}; it was put back from an \
             older copy, so its bytes are not the ones the object table describes; {RESTORE_DEVICE}",
            sb.device_index,
            sb.uuid_string(),
            sb.epoch
        ),
    }
}

/// Checks every device against the newest epoch the checkpoint and journal record.
pub(crate) fn check_recorded_epoch(members: &Members, recorded: u64) -> Result<()> {
    for (d, sb) in members.devices.iter().zip(&members.superblocks) {
        if sb.epoch < recorded {
            return Err(stale(d, sb, recorded, "the store's metadata on device 0 was last written"));
        }
    }
    Ok(())
}

/// Problems with single superblock copies, one line each: damaged, or disagreeing with the other
/// copy. Devices with no usable copy at all are left to `assemble`'s error.
pub(crate) fn copy_problems(devices: &[Device]) -> Vec<String> {
    let mut problems = Vec::new();
    for d in devices {
        let copies = read_copies(d);
        let name = match copies.chosen() {
            Some(sb) => format!("{}: device {} of store {}", d.path.display(), sb.device_index, sb.uuid_string()),
            None => continue,
        };
        match (&copies.primary, &copies.backup) {
            (Ok(p), Ok(b)) if !p.same_identity(b) => problems.push(format!(
                "{name}: the backup superblock (offset {}) differs from the primary",
                copies.backup_offset
            )),
            (Ok(_), Ok(_)) => {}
            (Err(e), Ok(_)) => problems.push(format!(
                "{name}: the primary superblock is damaged ({}); the backup copy is good",
                copy_error(e)
            )),
            (Ok(_), Err(e)) => problems.push(format!(
                "{name}: the backup superblock (offset {}) is damaged ({}); the primary is good",
                copies.backup_offset,
                copy_error(e)
            )),
            (Err(_), Err(_)) => unreachable!("chosen() found a valid copy"),
        }
    }
    problems
}

/// The epoch a writer's open moves the store to: past every device and every record.
pub(crate) fn next_epoch(superblocks: &[Superblock], recorded: u64) -> u64 {
    superblocks.iter().map(|s| s.epoch).max().unwrap_or(0).max(recorded) + 1
}

/// At a writer's open, before any other write: every device's two copies rewritten at `epoch`,
/// device 0 first. This also rewrites a damaged copy from the good one (logged).
pub(crate) fn write_epoch_at_open(devices: &[Device], superblocks: &mut [Superblock], epoch: u64) -> Result<()> {
    for d in devices {
        let copies = read_copies(d);
        for (which, copy) in [("primary", &copies.primary), ("backup", &copies.backup)] {
            if let Err(e) = copy {
                tracing::warn!(path = %d.path.display(), error = %e, "{which} superblock damaged; rewritten from the other copy");
            }
        }
    }
    for (d, sb) in devices.iter().zip(superblocks.iter_mut()) {
        sb.epoch = epoch;
        write_superblock_copies(d, sb)?;
    }
    Ok(())
}

/// Writes both copies of a device's superblock (at its start and its backup offset) directly,
/// before the device queues exist (format, open), and syncs the device.
pub(crate) fn write_superblock_copies(d: &Device, sb: &Superblock) -> Result<()> {
    let encoded = sb.encode();
    let mut buf = AlignedBuf::new(encoded.len(), 4096)?;
    buf.copy_from_slice(&encoded);
    d.write_all_at(&buf, 0)?;
    d.write_all_at(&buf, sb.backup_offset())?;
    d.sync()
}

/// At a checkpoint: every device's two copies rewritten at `epoch` through the device queues,
/// device 0 first, each device flushed before the next.
pub(crate) fn write_epoch(shared: &Shared, epoch: u64) -> Result<()> {
    for (i, sb) in shared.superblocks.iter().enumerate() {
        let encoded = Superblock { epoch, ..sb.clone() }.encode();
        let mut buf = AlignedBuf::new(encoded.len(), 4096)?;
        buf.copy_from_slice(&encoded);
        let len = buf.len() as u64;
        for offset in [0, sb.backup_offset()] {
            shared.sync_io(i as u16, IoKind::Write, offset, buf.as_mut_ptr(), len)?;
        }
        shared.sync_io(i as u16, IoKind::Flush, 0, std::ptr::null_mut(), 0)?;
    }
    Ok(())
}
