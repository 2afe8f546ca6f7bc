//! Errors of the raw NVMe paths. Each set-up failure is its own variant, and its message says what
//! to do about it; the engine sees them as `BackendUnavailable` with that message.

use std::path::PathBuf;

pub type Result<T> = std::result::Result<T, NvmeError>;

#[derive(Debug, thiserror::Error)]
pub enum NvmeError {
    #[error("{path}: no NVMe generic character device ({source}); passthrough needs Linux >= 5.19 with the nvme driver bound and /dev/ngXnY present (ls /dev/ng*)")]
    NoCharDevice { path: PathBuf, source: std::io::Error },

    #[error("{path}: not an NVMe namespace name (expected /dev/nvmeXnY or /dev/ngXnY)")]
    NotANamespace { path: PathBuf },

    #[error("{what} on {path} failed: {source}")]
    Ioctl { what: &'static str, path: PathBuf, source: std::io::Error },

    #[error("io_uring with 128-byte SQEs and 32-byte CQEs is unavailable ({0}); NVMe passthrough needs Linux >= 5.19")]
    BigRingUnavailable(std::io::Error),

    #[error("{device}: LBA format with {metadata_bytes} metadata bytes per block is unsupported; reformat the namespace to a format without metadata (nvme format -l)")]
    UnsupportedLbaFormat { device: String, metadata_bytes: u16 },

    #[error("{device}: logical block size {lba_bytes} is unsupported (teraio needs 512..=65536, a power of two)")]
    UnsupportedBlockSize { device: String, lba_bytes: u32 },

    #[error("{device}: the NVMe command {what} failed with status type {sct:#x} code {sc:#x}")]
    CommandFailed { device: String, what: &'static str, sct: u8, sc: u8 },

    #[error("{device}: the controller did not {what} within {timeout_ms} ms (CSTS={csts:#x}); check the device with lspci -vv and dmesg")]
    Timeout { device: String, what: &'static str, timeout_ms: u64, csts: u32 },

    #[error("PCI device {bdf} not found in /sys/bus/pci/devices; give the address as lspci -D prints it (e.g. 0000:00:04.0)")]
    NoSuchPciDevice { bdf: String },

    #[error("PCI device {bdf} is bound to the {driver} driver, not vfio-pci; unbind it first: echo {bdf} > /sys/bus/pci/devices/{bdf}/driver/unbind; echo vfio-pci > /sys/bus/pci/devices/{bdf}/driver_override; echo {bdf} > /sys/bus/pci/drivers_probe")]
    WrongDriver { bdf: String, driver: String },

    #[error("PCI device {bdf} has no IOMMU group: enable the IOMMU (intel_iommu=on / amd_iommu=on) or load vfio with enable_unsafe_noiommu_mode=1 (no isolation: test machines only)")]
    NoIommuGroup { bdf: String },

    #[error("opening VFIO {what} {path}: {source}; is vfio-pci loaded and are you root (or in the group's owner)?")]
    VfioOpen { what: &'static str, path: PathBuf, source: std::io::Error },

    #[error("VFIO {what}: {source}")]
    Vfio { what: &'static str, source: std::io::Error },

    #[error("PCI device {bdf} is not an NVMe controller (class {class:#08x}, expected 0x010802)")]
    NotNvme { bdf: String, class: u32 },

    #[error("cannot get {bytes} bytes of DMA memory: {reason}; reserve hugepages (echo N > /proc/sys/vm/nr_hugepages) and raise the locked-memory limit (ulimit -l unlimited)")]
    DmaMemory { bytes: usize, reason: String },

    #[error("cannot translate {addr:#x} to a physical address for no-IOMMU DMA (reading /proc/self/pagemap needs CAP_SYS_ADMIN): {reason}")]
    Pagemap { addr: usize, reason: String },

    #[error("invalid NVMe configuration: {0}")]
    Config(String),
}

impl From<NvmeError> for teraio_engine::Error {
    fn from(e: NvmeError) -> Self {
        teraio_engine::Error::BackendUnavailable { backend: "nvme", reason: e.to_string() }
    }
}
