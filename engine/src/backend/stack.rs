//! One backend stack for every queue of a device: whatever moves the bytes (io_uring, psync, an
//! external backend, cuFile), the same wrappers go around it, in the same order: fault injection
//! innermost, then the power-cut undo log, then the device model. Their per-device state (the
//! undo log, the model's clock) is built once per device and shared by all of its stacks.

use super::fault::FaultyBackend;
use super::powercut::{PowerCutBackend, PowerCutLog};
use super::throttle::{BusyUntil, DeviceModel, ThrottledBackend};
use super::Backend;
use crate::backend::fault::FaultInjector;
use crate::config::OpenConfig;
use crate::device::Device;
use crate::error::Result;
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// The wrappers of one device's backends (see the module doc).
pub(crate) struct DeviceWrappers {
    device: u16,
    faults: Option<FaultInjector>,
    power_cut: Option<Arc<PowerCutLog>>,
    emulate: Option<(DeviceModel, BusyUntil)>,
}

impl DeviceWrappers {
    /// The wrappers `config` asks for on device `index`. A power-cut log is kept only for a
    /// writer (`writable`): a reader writes nothing.
    pub fn new(index: u16, device: &Device, config: &OpenConfig, writable: bool, block_size: u64) -> Result<Self> {
        let power_cut = match config.power_cut_log_dir.as_ref().filter(|_| writable) {
            Some(dir) => Some(PowerCutLog::new(index, &device.file, dir, block_size as usize)?),
            None => None,
        };
        Ok(DeviceWrappers {
            device: index,
            faults: config.fault_injector.clone(),
            power_cut,
            emulate: config.emulate.map(|model| (model, Arc::new(Mutex::new(Instant::now())))),
        })
    }

    /// `base` inside this device's wrappers.
    pub fn wrap(&self, base: Box<dyn Backend>) -> Box<dyn Backend> {
        let mut b = base;
        if let Some(injector) = &self.faults {
            b = Box::new(FaultyBackend::new(b, self.device, injector.clone()));
        }
        if let Some(log) = &self.power_cut {
            b = Box::new(PowerCutBackend::new(b, log));
        }
        if let Some((model, busy_until)) = &self.emulate {
            b = Box::new(ThrottledBackend::new(b, *model, busy_until));
        }
        b
    }
}
