//! A userspace NVMe driver over VFIO: no kernel in the data path.
//!
//! Set-up ([`Controller::open`]): the PCI function must be bound to vfio-pci; we open its IOMMU
//! group (or the no-IOMMU group), put it in a container, map BAR0, enable bus mastering, reset the
//! controller, build the admin queue pair, identify the controller and namespace 1, and ask for
//! I/O queues. Each [`backend::VfioBackend`] then owns one I/O queue pair (one per engine worker)
//! and submits read/write/flush commands from registered DMA memory, building PRP lists for
//! transfers over two pages, and polls the completion queue. Drop deletes the I/O queues and
//! shuts the controller down (CC.SHN) so that the device ends in a clean state.

pub mod backend;
pub mod dma;
pub mod namespace;
pub mod queue;
pub mod sys;

use crate::error::{NvmeError, Result};
use crate::spec::{self, Command, ControllerInfo, NamespaceInfo};
use dma::{DmaMemory, Iova, PAGE_BYTES};
use queue::QueuePair;
use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::{AsRawFd, FromRawFd};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Entries of the admin queues.
const ADMIN_QUEUE_ENTRIES: u16 = 32;
/// The most I/O queue pairs we create per controller.
pub const MAX_IO_QUEUES: u16 = 64;
/// The most entries of one I/O queue (also capped by CAP.MQES).
pub const MAX_QUEUE_ENTRIES: u16 = 1024;
/// Largest transfer per command: one PRP list page holds 512 entries.
pub const MAX_TRANSFER_BYTES: u64 = 512 * PAGE_BYTES as u64;
/// Start of the I/O virtual addresses we hand out (type1 IOMMU mode).
const IOVA_BASE: u64 = 1 << 32;
/// How long an admin command may take.
const ADMIN_TIMEOUT: Duration = Duration::from_secs(5);

/// A DMA-visible memory region: the driver's own, or caller memory registered with it.
#[derive(Debug)]
pub struct DmaRegion {
    pub base: usize,
    pub len: usize,
    iova: Iova,
}

impl DmaRegion {
    /// The bus address of `addr` (which must lie inside the region).
    pub fn iova_of(&self, addr: usize) -> u64 {
        let off = addr - self.base;
        match &self.iova {
            Iova::Linear(start) => start + off as u64,
            Iova::Pages(pages) => pages[(addr / PAGE_BYTES) - (self.base / PAGE_BYTES)] + (addr % PAGE_BYTES) as u64,
        }
    }
    pub fn contains(&self, addr: usize, len: usize) -> bool {
        addr >= self.base && addr + len <= self.base + self.len
    }
}

/// Device registers (BAR0) mapped into our address space.
struct Bar {
    base: *mut u8,
    len: usize,
}

// SAFETY: MMIO registers; every access is a volatile read or write of an aligned u32/u64.
unsafe impl Send for Bar {}
unsafe impl Sync for Bar {}

impl Bar {
    fn read32(&self, offset: usize) -> u32 {
        assert!(offset + 4 <= self.len);
        // SAFETY: inside the mapping, 4-byte aligned.
        unsafe { std::ptr::read_volatile(self.base.add(offset) as *const u32) }
    }
    fn read64(&self, offset: usize) -> u64 {
        (self.read32(offset) as u64) | ((self.read32(offset + 4) as u64) << 32)
    }
    fn write32(&self, offset: usize, value: u32) {
        assert!(offset + 4 <= self.len);
        // SAFETY: inside the mapping, 4-byte aligned.
        unsafe { std::ptr::write_volatile(self.base.add(offset) as *mut u32, value) }
    }
    fn write64(&self, offset: usize, value: u64) {
        self.write32(offset, value as u32);
        self.write32(offset + 4, (value >> 32) as u32);
    }
}

impl Drop for Bar {
    fn drop(&mut self) {
        // SAFETY: unmapping the BAR mapping made in open.
        unsafe { libc::munmap(self.base as *mut _, self.len) };
    }
}

/// Whether DMA goes through the IOMMU or uses physical addresses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IommuMode {
    Type1,
    NoIommu,
}

struct Inner {
    admin: QueuePair,
    next_iova: u64,
    regions: Vec<Arc<DmaRegion>>,
    io_queues_created: u16,
    free_qids: Vec<u16>,
}

/// One NVMe controller driven from userspace.
pub struct Controller {
    pub bdf: String,
    pub mode: IommuMode,
    pub controller: ControllerInfo,
    pub namespace: NamespaceInfo,
    pub nsid: u32,
    /// Largest transfer per command (MDTS and the PRP list limit).
    pub max_transfer_bytes: u64,
    /// Entries per I/O queue.
    pub queue_entries: u16,
    /// I/O queues the controller granted.
    pub io_queues_granted: u16,
    doorbell_stride: usize,
    bar: Bar,
    inner: Mutex<Inner>,
    /// Memory for the admin queues and identify pages.
    _admin_memory: DmaMemory,
    container: File,
    _group: File,
    _device: File,
}

fn sysfs(bdf: &str, leaf: &str) -> PathBuf {
    Path::new("/sys/bus/pci/devices").join(bdf).join(leaf)
}

fn ioctl_err(what: &'static str) -> NvmeError {
    NvmeError::Vfio { what, source: io::Error::last_os_error() }
}

impl Controller {
    /// Opens the NVMe controller at PCI address `bdf` (e.g. 0000:00:04.0), bound to vfio-pci.
    pub fn open(bdf: &str) -> Result<Arc<Controller>> {
        if !sysfs(bdf, "").exists() {
            return Err(NvmeError::NoSuchPciDevice { bdf: bdf.into() });
        }
        let class = std::fs::read_to_string(sysfs(bdf, "class")).unwrap_or_default();
        let class = u32::from_str_radix(class.trim().trim_start_matches("0x"), 16).unwrap_or(0);
        if class != 0x010802 {
            return Err(NvmeError::NotNvme { bdf: bdf.into(), class });
        }
        match std::fs::read_link(sysfs(bdf, "driver")) {
            Ok(link) => {
                let driver = link.file_name().unwrap_or_default().to_string_lossy().to_string();
                if driver != "vfio-pci" {
                    return Err(NvmeError::WrongDriver { bdf: bdf.into(), driver });
                }
            }
            Err(_) => return Err(NvmeError::WrongDriver { bdf: bdf.into(), driver: "(none)".into() }),
        }
        let group_link =
            std::fs::read_link(sysfs(bdf, "iommu_group")).map_err(|_| NvmeError::NoIommuGroup { bdf: bdf.into() })?;
        let group_id = group_link.file_name().unwrap_or_default().to_string_lossy().to_string();
        let noiommu_path = PathBuf::from(format!("/dev/vfio/noiommu-{group_id}"));
        let (group_path, mode) = if noiommu_path.exists() {
            (noiommu_path, IommuMode::NoIommu)
        } else {
            (PathBuf::from(format!("/dev/vfio/{group_id}")), IommuMode::Type1)
        };
        let open = |path: &Path, what: &'static str| {
            OpenOptions::new().read(true).write(true).open(path).map_err(|source| NvmeError::VfioOpen {
                what,
                path: path.to_path_buf(),
                source,
            })
        };
        let container = open(Path::new("/dev/vfio/vfio"), "container")?;
        let group = open(&group_path, "group")?;
        // SAFETY (all ioctls below): valid fds and argument structs that outlive the call.
        if unsafe { libc::ioctl(container.as_raw_fd(), sys::VFIO_GET_API_VERSION) } != sys::VFIO_API_VERSION {
            return Err(ioctl_err("API version mismatch"));
        }
        let mut status = sys::GroupStatus { argsz: 8, flags: 0 };
        // SAFETY: a system call on our own fd/struct, whose arguments outlive it.
        if unsafe { libc::ioctl(group.as_raw_fd(), sys::VFIO_GROUP_GET_STATUS, &mut status) } != 0 {
            return Err(ioctl_err("group status"));
        }
        if status.flags & sys::VFIO_GROUP_FLAGS_VIABLE == 0 {
            return Err(NvmeError::Vfio {
                what: "group not viable (bind every device of the IOMMU group to vfio-pci)",
                source: io::Error::from_raw_os_error(libc::EBUSY),
            });
        }
        let container_fd = container.as_raw_fd();
        // SAFETY: a system call on our own fd/struct, whose arguments outlive it.
        if unsafe { libc::ioctl(group.as_raw_fd(), sys::VFIO_GROUP_SET_CONTAINER, &container_fd) } != 0 {
            return Err(ioctl_err("set container"));
        }
        let iommu_type = match mode {
            IommuMode::NoIommu => sys::VFIO_NOIOMMU_IOMMU,
            IommuMode::Type1 => {
                // SAFETY: a system call on our own fd/struct, whose arguments outlive it.
                if unsafe { libc::ioctl(container_fd, sys::VFIO_CHECK_EXTENSION, sys::VFIO_TYPE1V2_IOMMU) } == 1 {
                    sys::VFIO_TYPE1V2_IOMMU
                } else {
                    sys::VFIO_TYPE1_IOMMU
                }
            }
        };
        // SAFETY: a system call on our own fd/struct, whose arguments outlive it.
        if unsafe { libc::ioctl(container_fd, sys::VFIO_SET_IOMMU, iommu_type) } != 0 {
            return Err(ioctl_err("set IOMMU type"));
        }
        let name = std::ffi::CString::new(bdf).map_err(|_| NvmeError::NoSuchPciDevice { bdf: bdf.into() })?;
        // SAFETY: a system call on our own fd/struct, whose arguments outlive it.
        let device_fd = unsafe { libc::ioctl(group.as_raw_fd(), sys::VFIO_GROUP_GET_DEVICE_FD, name.as_ptr()) };
        if device_fd < 0 {
            return Err(ioctl_err("get device fd"));
        }
        // SAFETY: a fresh fd returned by VFIO.
        let device = unsafe { File::from_raw_fd(device_fd) };

        // Enable memory space and bus mastering in the PCI command register.
        let mut config = sys::RegionInfo { argsz: 32, index: sys::VFIO_PCI_CONFIG_REGION_INDEX, ..Default::default() };
        // SAFETY: a system call on our own fd/struct, whose arguments outlive it.
        if unsafe { libc::ioctl(device_fd, sys::VFIO_DEVICE_GET_REGION_INFO, &mut config) } != 0 {
            return Err(ioctl_err("config region info"));
        }
        let mut command = [0u8; 2];
        device
            .read_exact_at(&mut command, config.offset + 4)
            .map_err(|source| NvmeError::Vfio { what: "read PCI command", source })?;
        let command = u16::from_le_bytes(command) | 0x6;
        device
            .write_all_at(&command.to_le_bytes(), config.offset + 4)
            .map_err(|source| NvmeError::Vfio { what: "write PCI command", source })?;

        let mut bar0 = sys::RegionInfo { argsz: 32, index: sys::VFIO_PCI_BAR0_REGION_INDEX, ..Default::default() };
        // SAFETY: a system call on our own fd/struct, whose arguments outlive it.
        if unsafe { libc::ioctl(device_fd, sys::VFIO_DEVICE_GET_REGION_INFO, &mut bar0) } != 0 {
            return Err(ioctl_err("BAR0 region info"));
        }
        if bar0.flags & sys::VFIO_REGION_INFO_FLAG_MMAP == 0 || bar0.size < 0x2000 {
            return Err(NvmeError::Vfio {
                what: "BAR0 cannot be mapped",
                source: io::Error::from_raw_os_error(libc::EINVAL),
            });
        }
        // SAFETY: mapping the device's BAR0 as VFIO describes it.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                bar0.size as usize,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                device_fd,
                bar0.offset as i64,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(ioctl_err("mmap BAR0"));
        }
        let bar = Bar { base: base as *mut u8, len: bar0.size as usize };
        let admin_memory = DmaMemory::allocate(2 << 20)?;
        let admin_region =
            Arc::new(map_region(&container, mode, admin_memory.base as usize, admin_memory.len, IOVA_BASE)?);
        let next_iova = IOVA_BASE + admin_memory.len as u64;

        let cap = bar.read64(spec::REG_CAP);
        let max_entries = ((cap & 0xffff) + 1) as u16;
        let doorbell_stride = 4usize << ((cap >> 32) & 0xf);
        let timeout = Duration::from_millis(((cap >> 24) & 0xff).max(1) * 500);
        let mps_min = 4096u64 << ((cap >> 48) & 0xf);
        if mps_min != 4096 {
            return Err(NvmeError::Config(format!("controller minimum page size {mps_min} is not 4096")));
        }
        // Reset: disable, wait for not-ready.
        bar.write32(spec::REG_CC, 0);
        wait_ready(&bar, false, timeout, bdf)?;
        let admin_sq = admin_memory.base as usize;
        let admin_cq = admin_sq + PAGE_BYTES;
        // SAFETY: the admin SQ and CQ pages lie in admin_memory, kept as long as the controller,
        // and the doorbells in the BAR mapping.
        let admin = unsafe {
            QueuePair::new(
                0,
                ADMIN_QUEUE_ENTRIES,
                admin_sq as *mut Command,
                admin_cq as *mut spec::Completion,
                bar_doorbell(&bar, 0, doorbell_stride),
            )
        };
        let aqa = ((ADMIN_QUEUE_ENTRIES as u32 - 1) << 16) | (ADMIN_QUEUE_ENTRIES as u32 - 1);
        bar.write32(spec::REG_AQA, aqa);
        bar.write64(spec::REG_ASQ, admin_region.iova_of(admin_sq));
        bar.write64(spec::REG_ACQ, admin_region.iova_of(admin_cq));
        // Enable: 64-byte SQ entries, 16-byte CQ entries, 4 KiB pages, NVM command set.
        bar.write32(spec::REG_CC, (4 << 20) | (6 << 16) | 1);
        wait_ready(&bar, true, timeout, bdf)?;

        let scratch = admin_sq + 2 * PAGE_BYTES;
        let scratch_iova = admin_region.iova_of(scratch);
        let mut inner = Inner {
            admin,
            next_iova,
            regions: vec![admin_region.clone()],
            io_queues_created: 0,
            free_qids: Vec::new(),
        };
        let identify = |nsid: u32, cns: u32, what: &'static str, inner: &mut Inner| -> Result<Vec<u8>> {
            let cmd =
                Command { opcode: spec::ADMIN_IDENTIFY, nsid, prp1: scratch_iova, cdw10: cns, ..Default::default() };
            admin_command(&mut inner.admin, cmd, bdf, what)?;
            // SAFETY: the scratch page lies inside the admin memory and the command has finished.
            Ok(unsafe { std::slice::from_raw_parts(scratch as *const u8, 4096) }.to_vec())
        };
        let controller = ControllerInfo::parse(&identify(0, spec::CNS_CONTROLLER, "identify controller", &mut inner)?);
        let nsid = 1;
        let namespace = NamespaceInfo::parse(&identify(nsid, spec::CNS_NAMESPACE, "identify namespace", &mut inner)?);
        if namespace.metadata_bytes != 0 {
            return Err(NvmeError::UnsupportedLbaFormat {
                device: bdf.into(),
                metadata_bytes: namespace.metadata_bytes,
            });
        }
        if !namespace.lba_bytes.is_power_of_two() || !(512..=65536).contains(&namespace.lba_bytes) {
            return Err(NvmeError::UnsupportedBlockSize { device: bdf.into(), lba_bytes: namespace.lba_bytes });
        }
        let wanted = MAX_IO_QUEUES as u32 - 1;
        let cmd = Command {
            opcode: spec::ADMIN_SET_FEATURES,
            cdw10: spec::FEATURE_NUMBER_OF_QUEUES,
            cdw11: (wanted << 16) | wanted,
            ..Default::default()
        };
        let granted = admin_command(&mut inner.admin, cmd, bdf, "set number of queues")?;
        let io_queues_granted = ((granted & 0xffff).min(granted >> 16) + 1).min(MAX_IO_QUEUES as u32) as u16;
        inner.free_qids = (1..=io_queues_granted).rev().collect();
        let max_transfer_bytes = controller.max_transfer_bytes(4096, MAX_TRANSFER_BYTES);
        Ok(Arc::new(Controller {
            bdf: bdf.into(),
            mode,
            controller,
            namespace,
            nsid,
            max_transfer_bytes,
            queue_entries: max_entries.min(MAX_QUEUE_ENTRIES),
            io_queues_granted,
            doorbell_stride,
            bar,
            inner: Mutex::new(inner),
            _admin_memory: admin_memory,
            container,
            _group: group,
            _device: device,
        }))
    }

    /// Makes [base, base+len) usable as I/O buffers (the caller keeps it alive and locked as long
    /// as the controller). Regions are never unregistered before the controller is dropped.
    pub fn register(&self, base: *mut u8, len: usize) -> Result<Arc<DmaRegion>> {
        let mut inner = self.inner.lock().expect("controller");
        let start = (base as usize) & !(PAGE_BYTES - 1);
        let end = (base as usize + len).div_ceil(PAGE_BYTES) * PAGE_BYTES;
        if self.mode == IommuMode::NoIommu {
            // SAFETY: locking pages of memory the caller owns.
            if unsafe { libc::mlock(start as *const _, end - start) } != 0 {
                return Err(NvmeError::DmaMemory {
                    bytes: end - start,
                    reason: io::Error::last_os_error().to_string(),
                });
            }
        }
        let region = Arc::new(map_region(&self.container, self.mode, start, end - start, inner.next_iova)?);
        inner.next_iova += (end - start).div_ceil(2 << 20) as u64 * (2 << 20);
        inner.regions.push(region.clone());
        Ok(region)
    }

    /// Creates an I/O queue pair with `entries` slots (at most the controller's limit).
    pub(crate) fn create_queue(&self, entries: u16, memory: &DmaRegion, sq: usize, cq: usize) -> Result<QueuePair> {
        let mut inner = self.inner.lock().expect("controller");
        let qid = inner.free_qids.pop().ok_or_else(|| {
            NvmeError::Config(format!("{}: all {} I/O queues are in use", self.bdf, self.io_queues_granted))
        })?;
        let sq_iova = memory.iova_of(sq);
        let cq_iova = memory.iova_of(cq);
        let size = (entries as u32 - 1) << 16;
        let create_cq = Command {
            opcode: spec::ADMIN_CREATE_CQ,
            prp1: cq_iova,
            cdw10: size | qid as u32,
            cdw11: 1,
            ..Default::default()
        };
        admin_command(&mut inner.admin, create_cq, &self.bdf, "create I/O completion queue")?;
        let create_sq = Command {
            opcode: spec::ADMIN_CREATE_SQ,
            prp1: sq_iova,
            cdw10: size | qid as u32,
            cdw11: ((qid as u32) << 16) | 1,
            ..Default::default()
        };
        admin_command(&mut inner.admin, create_sq, &self.bdf, "create I/O submission queue")?;
        inner.io_queues_created += 1;
        // SAFETY: the caller's memory holds both rings and outlives the queue (the backend owns
        // it); the doorbells lie in our BAR mapping.
        Ok(unsafe {
            QueuePair::new(
                qid,
                entries,
                sq as *mut Command,
                cq as *mut spec::Completion,
                bar_doorbell(&self.bar, qid, self.doorbell_stride),
            )
        })
    }

    /// Deletes an I/O queue pair (after all its commands completed).
    pub(crate) fn delete_queue(&self, qid: u16) {
        let mut inner = self.inner.lock().expect("controller");
        for (opcode, what) in [(spec::ADMIN_DELETE_SQ, "delete I/O SQ"), (spec::ADMIN_DELETE_CQ, "delete I/O CQ")] {
            let cmd = Command { opcode, cdw10: qid as u32, ..Default::default() };
            if let Err(e) = admin_command(&mut inner.admin, cmd, &self.bdf, what) {
                tracing::warn!(error = %e, "NVMe queue deletion failed");
            }
        }
        inner.io_queues_created -= 1;
        inner.free_qids.push(qid);
    }

    /// The region holding [addr, addr+len), if registered.
    pub fn region_of(&self, addr: usize, len: usize) -> Option<Arc<DmaRegion>> {
        self.inner.lock().expect("controller").regions.iter().find(|r| r.contains(addr, len)).cloned()
    }
}

impl Drop for Controller {
    fn drop(&mut self) {
        // Normal shutdown notification, then wait for CSTS.SHST = complete (up to 2 s).
        let cc = self.bar.read32(spec::REG_CC);
        self.bar.write32(spec::REG_CC, (cc & !(3 << 14)) | (1 << 14));
        let deadline = Instant::now() + Duration::from_secs(2);
        while (self.bar.read32(spec::REG_CSTS) >> 2) & 3 != 2 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(1));
        }
        self.bar.write32(spec::REG_CC, 0);
        if self.mode == IommuMode::Type1 {
            for r in &self.inner.lock().expect("controller").regions {
                if let Iova::Linear(iova) = r.iova {
                    let mut unmap = sys::DmaUnmap { argsz: 24, flags: 0, iova, size: r.len as u64 };
                    // SAFETY: unmapping an IOVA range we mapped, with the device disabled.
                    unsafe { libc::ioctl(self.container.as_raw_fd(), sys::VFIO_IOMMU_UNMAP_DMA, &mut unmap) };
                }
            }
        }
    }
}

fn bar_doorbell(bar: &Bar, qid: u16, stride: usize) -> (*mut u32, *mut u32) {
    let sq = spec::REG_DOORBELLS + (2 * qid as usize) * stride;
    let cq = spec::REG_DOORBELLS + (2 * qid as usize + 1) * stride;
    assert!(cq + 4 <= bar.len, "doorbell of queue {qid} outside BAR0");
    // SAFETY: both offsets are inside the BAR mapping (checked above).
    unsafe { (bar.base.add(sq) as *mut u32, bar.base.add(cq) as *mut u32) }
}

fn map_region(container: &File, mode: IommuMode, base: usize, len: usize, iova: u64) -> Result<DmaRegion> {
    match mode {
        IommuMode::NoIommu => Ok(DmaRegion { base, len, iova: Iova::Pages(dma::physical_pages(base, len)?) }),
        IommuMode::Type1 => {
            let mut map = sys::DmaMap {
                argsz: std::mem::size_of::<sys::DmaMap>() as u32,
                flags: sys::VFIO_DMA_MAP_FLAG_READ | sys::VFIO_DMA_MAP_FLAG_WRITE,
                vaddr: base as u64,
                iova,
                size: len as u64,
            };
            // SAFETY: maps memory we own (kept alive as long as the controller) into the IOMMU.
            if unsafe { libc::ioctl(container.as_raw_fd(), sys::VFIO_IOMMU_MAP_DMA, &mut map) } != 0 {
                let e = io::Error::last_os_error();
                return Err(NvmeError::DmaMemory { bytes: len, reason: format!("VFIO_IOMMU_MAP_DMA: {e}") });
            }
            Ok(DmaRegion { base, len, iova: Iova::Linear(iova) })
        }
    }
}

fn wait_ready(bar: &Bar, ready: bool, timeout: Duration, bdf: &str) -> Result<()> {
    let deadline = Instant::now() + timeout;
    loop {
        let csts = bar.read32(spec::REG_CSTS);
        if csts & 2 != 0 {
            return Err(NvmeError::Timeout { device: bdf.into(), what: "report no fatal status", timeout_ms: 0, csts });
        }
        if (csts & 1 == 1) == ready {
            return Ok(());
        }
        if Instant::now() > deadline {
            let what = if ready { "become ready" } else { "reset" };
            return Err(NvmeError::Timeout { device: bdf.into(), what, timeout_ms: timeout.as_millis() as u64, csts });
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Runs one admin command to completion; returns completion dword 0.
fn admin_command(admin: &mut QueuePair, cmd: Command, bdf: &str, what: &'static str) -> Result<u32> {
    let id = admin.submit(cmd).ok_or_else(|| NvmeError::Config("admin queue full".into()))?;
    admin.ring_doorbell();
    let deadline = Instant::now() + ADMIN_TIMEOUT;
    loop {
        if let Some(c) = admin.poll_one() {
            if c.command_id != id {
                continue;
            }
            let (sct, sc) = c.status_code();
            if (sct, sc) != (0, 0) {
                return Err(NvmeError::CommandFailed { device: bdf.into(), what, sct, sc });
            }
            return Ok(c.result);
        }
        if Instant::now() > deadline {
            return Err(NvmeError::Timeout {
                device: bdf.into(),
                what,
                timeout_ms: ADMIN_TIMEOUT.as_millis() as u64,
                csts: 0,
            });
        }
        std::hint::spin_loop();
    }
}
