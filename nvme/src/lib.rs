//! teraio's raw NVMe backends, behind the engine's `Backend` trait:
//!
//! - [`passthru`]: NVMe commands through io_uring passthrough (`IORING_OP_URING_CMD`) on the
//!   namespace's generic character device /dev/ngXnY; big SQEs/CQEs, registered buffers,
//!   optional polled completions. Stores on whole namespaces use it through
//!   `BackendKind::External(teraio_nvme::PASSTHRU)`.
//! - [`vfio`]: a userspace NVMe driver over VFIO: BAR0 mapped, admin queue, identify, one I/O
//!   queue pair per engine worker, PRP lists, polled completions; no kernel on the data path.
//!
//! [`spec`] holds the NVMe structures both share. See docs/nvme.md.

pub mod error;
pub mod passthru;
pub mod spec;
pub mod vfio;

pub use error::{NvmeError, Result};
pub use passthru::{identify, Namespace, PassthruBackend, PassthruOptions};

use teraio_engine::backend::{Backend, BackendFactory};
use teraio_engine::buffer::BouncePool;
use teraio_engine::device::Device;

/// The passthrough backend, for `BackendKind::External`: on /dev/nvmeXnY paths. The store's
/// layout goes on the whole namespace: superblocks and metadata are read at open through the
/// block device, every data-path request through /dev/ngXnY.
pub const PASSTHRU: BackendFactory =
    BackendFactory { name: "nvme-passthru", build: |d, depth, pool| passthru_factory(d, depth, pool, false) };
/// The same with polled completions (needs nvme.poll_queues > 0).
pub const PASSTHRU_IOPOLL: BackendFactory =
    BackendFactory { name: "nvme-passthru-iopoll", build: |d, depth, pool| passthru_factory(d, depth, pool, true) };
/// The userspace driver, for stores on `/sys/bus/pci/devices/<PCI address>` paths (after
/// [`register`]).
pub const VFIO: BackendFactory = BackendFactory { name: "nvme-vfio", build: vfio_factory };

fn vfio_factory(device: &Device, depth: usize, pool: &BouncePool) -> teraio_engine::Result<Box<dyn Backend>> {
    let namespace =
        device.external.as_ref().and_then(|e| e.as_any().downcast_ref::<vfio::namespace::VfioNamespace>()).ok_or_else(
            || teraio_engine::Error::BackendUnavailable {
                backend: VFIO.name,
                reason: format!(
                    "{} is not a VFIO namespace (give it as /sys/bus/pci/devices/<PCI address>)",
                    device.path.display()
                ),
            },
        )?;
    // The store's bounce slab becomes DMA memory once, so bounced requests go to the device directly.
    let (slab, slab_len) = pool.slab();
    namespace.register_once(slab, slab_len)?;
    Ok(Box::new(vfio::backend::VfioBackend::new(namespace.controller.clone(), depth)?))
}

fn passthru_factory(
    device: &Device,
    depth: usize,
    pool: &BouncePool,
    iopoll: bool,
) -> teraio_engine::Result<Box<dyn Backend>> {
    if !device.is_block_device {
        return Err(teraio_engine::Error::BackendUnavailable {
            backend: PASSTHRU.name,
            reason: format!("{} is not an NVMe namespace block device (/dev/nvmeXnY)", device.path.display()),
        });
    }
    let (slab, slab_len) = pool.slab();
    let b = PassthruBackend::new(&device.path, depth, PassthruOptions { iopoll }, &[(slab, slab_len)])?;
    Ok(Box::new(b))
}

/// Makes `/sys/bus/pci/devices/<PCI address>` paths of controllers bound to vfio-pci open as
/// userspace-driven namespaces, for stores with `BackendKind::External(teraio_nvme::VFIO)`. The
/// passthrough backends need nothing registered.
pub fn register() {
    teraio_engine::device::register_external_device(vfio::namespace::open_device);
}
