//! VFIO ioctls and structures (linux/vfio.h) and the sysfs facts VFIO set-up needs.

pub const VFIO_API_VERSION: i32 = 0;
pub const VFIO_TYPE1_IOMMU: libc::c_ulong = 1;
pub const VFIO_TYPE1V2_IOMMU: libc::c_ulong = 3;
pub const VFIO_NOIOMMU_IOMMU: libc::c_ulong = 8;

// _IO(';', 100 + n)
pub const VFIO_GET_API_VERSION: libc::c_ulong = 0x3B64;
pub const VFIO_CHECK_EXTENSION: libc::c_ulong = 0x3B65;
pub const VFIO_SET_IOMMU: libc::c_ulong = 0x3B66;
pub const VFIO_GROUP_GET_STATUS: libc::c_ulong = 0x3B67;
pub const VFIO_GROUP_SET_CONTAINER: libc::c_ulong = 0x3B68;
pub const VFIO_GROUP_GET_DEVICE_FD: libc::c_ulong = 0x3B6A;
pub const VFIO_DEVICE_GET_REGION_INFO: libc::c_ulong = 0x3B6C;
pub const VFIO_DEVICE_RESET: libc::c_ulong = 0x3B6F;
pub const VFIO_IOMMU_MAP_DMA: libc::c_ulong = 0x3B71;
pub const VFIO_IOMMU_UNMAP_DMA: libc::c_ulong = 0x3B72;

pub const VFIO_GROUP_FLAGS_VIABLE: u32 = 1;
pub const VFIO_DMA_MAP_FLAG_READ: u32 = 1;
pub const VFIO_DMA_MAP_FLAG_WRITE: u32 = 2;
pub const VFIO_REGION_INFO_FLAG_MMAP: u32 = 4;
pub const VFIO_PCI_BAR0_REGION_INDEX: u32 = 0;
pub const VFIO_PCI_CONFIG_REGION_INDEX: u32 = 7;

#[repr(C)]
#[derive(Debug, Default)]
pub struct GroupStatus {
    pub argsz: u32,
    pub flags: u32,
}

#[repr(C)]
#[derive(Debug, Default)]
pub struct RegionInfo {
    pub argsz: u32,
    pub flags: u32,
    pub index: u32,
    pub cap_offset: u32,
    pub size: u64,
    pub offset: u64,
}

#[repr(C)]
#[derive(Debug, Default)]
pub struct DmaMap {
    pub argsz: u32,
    pub flags: u32,
    pub vaddr: u64,
    pub iova: u64,
    pub size: u64,
}

#[repr(C)]
#[derive(Debug, Default)]
pub struct DmaUnmap {
    pub argsz: u32,
    pub flags: u32,
    pub iova: u64,
    pub size: u64,
}
