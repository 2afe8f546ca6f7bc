//! Checking a store (`fsck`) and repairing what can be fixed without loss: damaged superblock
//! copies and a damaged newest checkpoint.

use super::object::Object;
use super::ticket::Ticket;
use super::{commit, identity, verify, Store};
use crate::buffer::AlignedBuf;
use crate::config::OpenConfig;
use crate::device::{Access, Device};
use crate::error::{Error, Result};
use crate::layout::codec::round_up;
use crate::layout::table::ObjectRecord;
use crate::queue::Priority;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// What `fsck` found.
#[derive(Debug, Clone, Default)]
pub struct FsckReport {
    pub objects_checked: u64,
    pub bytes_checked: u64,
    pub units_checked: u64,
    /// One line per problem (still there after any repair); empty when the store is sound.
    pub problems: Vec<String>,
    /// Harmless findings, one line each: the remains of interrupted writes that recovery ignores.
    pub notes: Vec<String>,
    /// What `fsck_paths` with `repair` fixed, one line each.
    pub repairs: Vec<String>,
}

/// The problems of a check that `fsck_paths` with `repair` can fix.
#[derive(Debug, Default)]
struct Fixable {
    /// Damaged or disagreeing superblock copies (a writer's open rewrites both copies).
    superblock_copies: Vec<String>,
    /// A damaged newest checkpoint, recovered from without loss (a new checkpoint replaces it).
    checkpoint: bool,
}

impl Fixable {
    fn is_empty(&self) -> bool {
        self.superblock_copies.is_empty() && !self.checkpoint
    }

    /// Fixes these problems as a writer (none may hold the store); returns one line per repair.
    /// A writer's open does both: it rewrites both superblock copies of every device from the
    /// good one, and writes a new checkpoint over a damaged newest one (`repairs_at_open`).
    fn repair(&self, paths: &[impl AsRef<Path>], config: OpenConfig) -> Result<Vec<String>> {
        let store = Store::open(paths, config)?;
        let repairs = store.info().repairs_at_open;
        store.close()?;
        Ok(repairs)
    }
}

impl FsckReport {
    pub fn is_clean(&self) -> bool {
        self.problems.is_empty()
    }
}

impl Store {
    /// Checks the store and writes nothing: both superblock copies of every device (each bad
    /// copy reported on its own), what recovery found in the checkpoints and the journal at open
    /// (a damaged newest checkpoint; the remains of interrupted writes as notes), that no two
    /// objects share a block (already enforced at open), and every stripe unit's checksum,
    /// reading all data. A writer's open has already rewritten damaged superblock copies; for
    /// the store as it lies on disk, use [`Store::fsck_paths`].
    ///
    /// An object that fails its check while a writer changes the store is looked up again: only
    /// if its record is still the same is it reported as damaged; one that was replaced or
    /// deleted meanwhile is a note, "changed while checking", never damage.
    pub fn fsck(&self) -> Result<FsckReport> {
        let (mut report, _, suspects) = self.check()?;
        settle(&mut report, suspects, Reload::Live(self))?;
        Ok(report)
    }

    /// A note once the table takes 90% or more of a checkpoint slot: a full table is a limit of
    /// the format (puts that add objects or metadata fail), not damage.
    fn table_fullness_note(&self) -> Option<String> {
        let info = self.info();
        let percent = info.table_bytes * 100 / info.checkpoint_slot_bytes;
        (percent >= 90).then(|| {
            format!(
                "the object table is {percent}% full: a checkpoint of it takes {} of the {} bytes a checkpoint slot \
                 holds; puts that add objects or caller metadata fail with a table-full error once it is full \
                 (deletes and shrinking overwrites still succeed)",
                info.table_bytes, info.checkpoint_slot_bytes
            )
        })
    }

    /// `fsck`, and which of its problems a writer's open and a checkpoint would fix.
    fn check(&self) -> Result<(FsckReport, Fixable, Vec<Suspect>)> {
        let mut report = FsckReport::default();
        for (d, sb) in self.shared.devices.iter().zip(&self.shared.superblocks) {
            let copies = identity::read_copies(d);
            if copies.chosen().is_some_and(|c| !c.same_identity(sb)) {
                report.problems.push(format!(
                    "{}: device {}: the superblock on disk differs from the one read at open",
                    d.path.display(),
                    sb.device_index
                ));
            }
        }
        let fixable = Fixable {
            superblock_copies: identity::copy_problems(&self.shared.devices),
            checkpoint: self.shared.recovery.checkpoint_damaged,
        };
        report.problems.extend(fixable.superblock_copies.iter().cloned());
        if self.shared.read_only {
            report.problems.extend(self.shared.recovery.problems.iter().cloned());
        } else {
            // A writer's open has repaired what it could (`repairs_at_open`) and written since:
            // what it found is history here, not the state on disk.
            report.notes.extend(self.shared.recovery.problems.iter().map(|p| format!("found at open: {p}")));
        }
        report.notes.extend(self.shared.recovery.notes.iter().cloned());
        report.notes.extend(self.table_fullness_note());
        let objects: Vec<Arc<Object>> = self.shared.table.read().expect("table").values().cloned().collect();
        let mut suspects = Vec::new();
        for o in objects {
            let r = &o.record;
            report.objects_checked += 1;
            if let Err(e) = self.shared.geometry.validate(r) {
                report.problems.push(e.to_string());
                continue;
            }
            match self.check_object(r)? {
                Checked::Sound => {
                    report.bytes_checked += r.len_bytes;
                    report.units_checked += r.unit_crcs.len() as u64;
                }
                Checked::Failed(problem) => suspects.push(Suspect { record: r.clone(), problem }),
            }
        }
        Ok((report, fixable, suspects))
    }

    /// Reads object `r.id` whole with every stripe unit checked, then checks the bytes against
    /// `r`'s crcs too (the table may have moved on since `r` was taken).
    fn check_object(&self, r: &ObjectRecord) -> Result<Checked> {
        let g = &self.shared.geometry;
        let padded = round_up(r.len_bytes, g.block_size);
        let mut buf = AlignedBuf::new(padded as usize, g.block_size as usize)?;
        // SAFETY: we wait before `buf` goes away.
        let got = unsafe { self.get_raw_ticket(r.id, 0, buf.as_mut_ptr(), padded as usize, true, Priority::Normal) }
            .and_then(Ticket::wait);
        if let Err(e) = got {
            return Ok(Checked::Failed(format!("object {}: {e}", r.id)));
        }
        for (unit, crc) in r.unit_crcs.iter().enumerate() {
            let start = unit as u64 * g.stripe_unit;
            let end = (start + g.stripe_unit).min(r.len_bytes);
            if crc32c::crc32c(&buf[start as usize..end as usize]) != *crc {
                let (device, device_offset) = verify::unit_location(g, r, unit as u64);
                return Ok(Checked::Failed(
                    Error::ChecksumMismatch { id: r.id, unit: unit as u64, device, device_offset }.to_string(),
                ));
            }
        }
        Ok(Checked::Sound)
    }
}

/// How many times an object that failed its check is looked up again in a fresh load of the
/// table before fsck gives up on it as changing faster than it can be checked.
const RECHECK_ROUNDS: usize = 3;

/// Where fsck finds the table as it is now: the store it checks (a writer's own, whose table is
/// live), or a fresh read-only open of the devices (a snapshot taken again).
enum Reload<'a> {
    Live(&'a Store),
    Reopen(&'a [PathBuf], &'a OpenConfig),
}

/// An object whose check failed. It is damaged only if a later load of the table still holds the
/// very same record: a writer frees an object's extents only after the batch that replaces or
/// deletes it is durable, so while the record stands its blocks are its own.
struct Suspect {
    record: ObjectRecord,
    problem: String,
}

enum Checked {
    Sound,
    Failed(String),
}

/// Settles each suspect against fresh loads of the table: the same record as before is damage
/// (a problem); a record gone or replaced was changed by a writer while fsck read it (a note), and
/// a replacement is checked in turn.
fn settle(report: &mut FsckReport, mut suspects: Vec<Suspect>, reload: Reload<'_>) -> Result<()> {
    for _ in 0..RECHECK_ROUNDS {
        if suspects.is_empty() {
            return Ok(());
        }
        let reopened;
        let store = match reload {
            Reload::Live(store) => store,
            Reload::Reopen(paths, config) => {
                reopened = Store::open_read_only(paths, config.clone())?;
                &reopened
            }
        };
        let mut still = Vec::new();
        for s in suspects {
            let id = s.record.id;
            let now = store.shared.table.read().expect("table").get(&id).cloned();
            match now {
                None => report.notes.push(format!(
                    "object {id} changed while checking: a writer deleted it while fsck read it ({}); not damage",
                    s.problem
                )),
                Some(o) if o.record == s.record => report.problems.push(s.problem),
                Some(o) => match store.check_object(&o.record)? {
                    Checked::Sound => report.notes.push(format!(
                        "object {id} changed while checking: a writer replaced it while fsck read it ({}); its new \
                         version checks out",
                        s.problem
                    )),
                    Checked::Failed(problem) => still.push(Suspect { record: o.record.clone(), problem }),
                },
            }
        }
        suspects = still;
    }
    for s in suspects {
        report.notes.push(format!(
            "object {} changed while checking on each of {RECHECK_ROUNDS} rechecks (a writer keeps replacing it); \
             not checked: {}",
            s.record.id, s.problem
        ));
    }
    Ok(())
}

impl Store {
    /// Checks the store on `paths` as it lies on disk, beside a writer if one holds it: opens it
    /// read-only and runs [`Store::fsck`]. A store too damaged to open is one problem (the open
    /// error, which names what and where), after each damaged superblock copy.
    ///
    /// With `repair`, and when no writer holds the store, then fixes what can be fixed without
    /// losing anything, lists it in `repairs`, and checks again (`problems` is what is left): a
    /// damaged superblock copy is rewritten from the good one, a damaged newest checkpoint is
    /// replaced by a new one. Damaged object data, journal batches and devices cannot be rebuilt
    /// (teraio keeps no second copy): they stay problems.
    pub fn fsck_paths(paths: &[impl AsRef<Path>], config: OpenConfig, repair: bool) -> Result<FsckReport> {
        let owned_paths: Vec<PathBuf> = paths.iter().map(|p| p.as_ref().to_path_buf()).collect();
        let found = match Store::open_read_only(paths, config.clone()) {
            Ok(store) => {
                let found = store.check();
                store.close()?;
                let (mut report, fixable, suspects) = found?;
                settle(&mut report, suspects, Reload::Reopen(&owned_paths, &config))?;
                (report, fixable)
            }
            Err(e @ (Error::CorruptMetadata { .. } | Error::CorruptSuperblock { .. })) => {
                let mut report = FsckReport::default();
                let mut devices = Vec::new();
                for p in paths {
                    let lock_wait = std::time::Duration::from_millis(config.lock_wait_ms);
                    devices.push(Device::open_locked(p.as_ref(), config.direct_io, Access::Reader, lock_wait)?);
                }
                report.problems.extend(identity::copy_problems(&devices));
                report
                    .problems
                    .push(format!("the store cannot be opened: {}", e.to_string().replace(commit::FSCK_HINT, "")));
                return Ok(report);
            }
            Err(e) => return Err(e),
        };
        let (report, fixable) = found;
        if !repair || fixable.is_empty() {
            return Ok(report);
        }
        let repairs = fixable.repair(paths, config.clone())?;
        let mut after = Store::open_read_only(paths, config.clone())?.check()?;
        settle(&mut after.0, after.2, Reload::Reopen(&owned_paths, &config))?;
        let mut after = after.0;
        after.repairs = repairs;
        Ok(after)
    }
}
