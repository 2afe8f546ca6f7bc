//! A store's GPU state, built on its first GPU op: the pinned registration of the bounce slab,
//! per CUDA device a copy engine, hand-off flags and a gate (ops that start after a caller's
//! event), and the cuFile queues when that path is used.

use super::GpuPathReport;
use crate::cuda::copy::CopyEngine;
use crate::cuda::driver::{self as cuda, PinnedRegistration};
use crate::cuda::gate::Gate;
use crate::cuda::handoff::HandoffFlags;
use crate::error::Result;
use crate::queue::DeviceQueue;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// One CUDA device as a store uses it.
pub(crate) struct GpuDevice {
    pub copy: CopyEngine,
    pub handoff: Arc<HandoffFlags>,
    pub gate: Gate,
}

impl GpuDevice {
    pub fn new(ordinal: u32, copy_streams: usize) -> Result<GpuDevice> {
        let ctx = cuda::context(ordinal)?;
        Ok(GpuDevice {
            copy: CopyEngine::new(ordinal, copy_streams)?,
            handoff: Arc::new(HandoffFlags::new(ctx)?),
            gate: Gate::new(ordinal)?,
        })
    }
}

/// Everything GPU of one store. Field order is drop order: the cuFile queues stop first, the copy
/// engines next (finishing queued copies), the slab's pinning goes last.
pub(crate) struct StoreGpu {
    /// One per store device when the cuFile path is used, else empty.
    pub cufile_queues: Vec<DeviceQueue>,
    pub devices: Mutex<HashMap<u32, Arc<GpuDevice>>>,
    pub report: GpuPathReport,
    pub copy_streams: usize,
    pub _pinned: PinnedRegistration,
}

impl StoreGpu {
    /// The state of CUDA device `ordinal`, built on first use.
    pub fn device(&self, ordinal: u32) -> Result<Arc<GpuDevice>> {
        let mut map = self.devices.lock().expect("gpu devices");
        if let Some(d) = map.get(&ordinal) {
            return Ok(d.clone());
        }
        let d = Arc::new(GpuDevice::new(ordinal, self.copy_streams)?);
        map.insert(ordinal, d.clone());
        Ok(d)
    }

    /// Whether ops on `ordinal` go through cuFile.
    pub fn uses_cufile(&self, ordinal: u32) -> bool {
        !self.cufile_queues.is_empty() && ordinal == self.report.device
    }
}
