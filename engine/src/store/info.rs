//! What the store reports about itself: `info`, statistics and geometry.

use super::Store;
use crate::queue::DeviceQueue;
use crate::stats::{IoCounters, OpCounters, StatsSnapshot};
use std::path::PathBuf;

/// One device as `info` reports it.
#[derive(Debug, Clone)]
pub struct DeviceInfo {
    pub index: u16,
    pub path: PathBuf,
    pub size_bytes: u64,
    pub data_bytes: u64,
    pub free_bytes: u64,
    pub largest_free_bytes: u64,
    pub free_runs: usize,
    pub is_block_device: bool,
}

/// The store as `info` reports it.
#[derive(Debug, Clone)]
pub struct StoreInfo {
    pub uuid: String,
    pub format_version: u32,
    pub block_size: u64,
    pub stripe_unit_bytes: u64,
    pub checksums: bool,
    pub devices: Vec<DeviceInfo>,
    pub object_count: usize,
    pub object_bytes: u64,
    pub backend: String,
    pub backend_reason: String,
    pub checkpoint_slot_bytes: u64,
    pub journal_bytes: u64,
    /// Bytes a checkpoint of the table takes now. The table is full when it reaches
    /// `checkpoint_slot_bytes`: then puts that add objects or metadata fail with `TableFull`
    /// (deletes and shrinking overwrites still succeed).
    pub table_bytes: u64,
    /// What the open found damaged in the metadata and recovered around, one line each (the
    /// lines `fsck` reports as problems; e.g. a damaged last journal batch that was dropped).
    pub recovery_problems: Vec<String>,
    /// The harmless remains of interrupted writes the open found, one line each.
    pub recovery_notes: Vec<String>,
    /// What a writer's open repaired, one line each: a damaged superblock copy rewritten from the
    /// good one, a new checkpoint written in place of a damaged newest one. Also logged.
    pub repairs_at_open: Vec<String>,
}

impl Store {
    pub fn info(&self) -> StoreInfo {
        let sb0 = &self.shared.superblocks[0];
        let g = &self.shared.geometry;
        let allocators = self.shared.allocators.lock().expect("allocators");
        let devices = self
            .shared
            .devices
            .iter()
            .zip(&self.shared.superblocks)
            .zip(allocators.iter())
            .map(|((d, sb), a)| DeviceInfo {
                index: sb.device_index,
                path: d.path.clone(),
                size_bytes: d.size_bytes,
                data_bytes: sb.data_end - sb.data_start,
                free_bytes: a.free_blocks() * g.block_size,
                largest_free_bytes: a.largest_free_blocks() * g.block_size,
                free_runs: a.free_runs(),
                is_block_device: d.is_block_device,
            })
            .collect();
        drop(allocators);
        let table = self.shared.table.read().expect("table");
        StoreInfo {
            uuid: sb0.uuid_string(),
            format_version: sb0.format_version,
            block_size: g.block_size,
            stripe_unit_bytes: g.stripe_unit,
            checksums: g.checksums,
            devices,
            object_count: table.len(),
            object_bytes: table.values().map(|o| o.record.len_bytes).sum(),
            backend: self.shared.queues[0].backend_name.to_string(),
            backend_reason: self.shared.backend_choice.reason.clone(),
            checkpoint_slot_bytes: sb0.checkpoint_slot_bytes,
            journal_bytes: sb0.journal_bytes,
            table_bytes: super::commit::checkpoint_bytes(
                self.shared.table_bytes.load(std::sync::atomic::Ordering::Relaxed),
                g.block_size,
            ),
            recovery_problems: self.shared.recovery.problems.clone(),
            recovery_notes: self.shared.recovery.notes.clone(),
            repairs_at_open: self.shared.repairs_at_open.lock().expect("repairs").clone(),
        }
    }

    pub fn stats(&self) -> StatsSnapshot {
        let devices: Vec<IoCounters> = self.shared.queues.iter().map(DeviceQueue::counters).collect();
        let mut total = IoCounters::default();
        for d in &devices {
            total.merge(d);
        }
        StatsSnapshot {
            backend: self.shared.queues[0].backend_name.to_string(),
            backend_reason: self.shared.backend_choice.reason.clone(),
            devices,
            total,
            ops: self.shared.op_counters.lock().expect("op counters").clone(),
        }
    }

    /// Zeroes all counters (e.g. after a warm-up).
    pub fn reset_stats(&self) {
        for q in &self.shared.queues {
            q.reset_counters();
        }
        *self.shared.op_counters.lock().expect("op counters") = OpCounters::default();
    }

    /// The store's block size: O_DIRECT-friendly buffers are aligned to it.
    pub fn block_size(&self) -> u64 {
        self.shared.geometry.block_size
    }

    pub fn device_count(&self) -> u16 {
        self.shared.geometry.device_count
    }
}
