//! teraio's raw NVMe backends, behind the engine's `Backend` trait:
//!
//! - [`passthru`]: NVMe commands through io_uring passthrough (`IORING_OP_URING_CMD`) on the
//!   namespace's generic character device /dev/ngXnY; big SQEs/CQEs, registered buffers,
//!   optional polled completions. Stores on whole namespaces use it through
//!   `BackendKind::External("nvme-passthru")` after [`register`].
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

use teraio_engine::backend::{self, Backend};
use teraio_engine::buffer::BouncePool;
use teraio_engine::device::Device;

/// Name of the passthrough backend for `BackendKind::External` and `--backend`.
pub const PASSTHRU: &str = "nvme-passthru";
/// The same with polled completions (needs nvme.poll_queues > 0).
pub const PASSTHRU_IOPOLL: &str = "nvme-passthru-iopoll";
/// The userspace driver, for stores on `/sys/bus/pci/devices/<PCI address>` paths.
pub const VFIO: &str = "nvme-vfio";

fn vfio_factory(device: &Device, depth: usize, pool: &BouncePool) -> teraio_engine::Result<Box<dyn Backend>> {
    let namespace =
        device.external.as_ref().and_then(|e| e.as_any().downcast_ref::<vfio::namespace::VfioNamespace>()).ok_or_else(
            || teraio_engine::Error::BackendUnavailable {
                backend: VFIO,
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
            backend: PASSTHRU,
            reason: format!("{} is not an NVMe namespace block device (/dev/nvmeXnY)", device.path.display()),
        });
    }
    let (slab, slab_len) = pool.slab();
    let b = PassthruBackend::new(&device.path, depth, PassthruOptions { iopoll }, &[(slab, slab_len)])?;
    Ok(Box::new(b))
}

/// Registers the passthrough backends with the engine so `Store::open` can use them:
/// `OpenConfig { backend: BackendKind::External(teraio_nvme::PASSTHRU), .. }` on /dev/nvmeXnY
/// paths. The store's layout goes on the whole namespace: superblocks and metadata are read at
/// open through the block device, every data-path request through /dev/ngXnY.
///
/// It also makes `/sys/bus/pci/devices/<PCI address>` paths of controllers bound to vfio-pci open
/// as userspace-driven namespaces, for stores with
/// `BackendKind::External(teraio_nvme::VFIO)`.
pub fn register() {
    backend::register_external(PASSTHRU, |d, depth, pool| passthru_factory(d, depth, pool, false));
    backend::register_external(PASSTHRU_IOPOLL, |d, depth, pool| passthru_factory(d, depth, pool, true));
    backend::register_external(VFIO, vfio_factory);
    teraio_engine::device::register_external_device(vfio::namespace::open_device);
}
