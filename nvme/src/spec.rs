//! The parts of the NVMe specification (base 2.0, NVM command set 1.0) that teraio uses: the
//! 64-byte submission entry, the 16-byte completion entry, controller registers, and the fields
//! of the Identify Controller and Identify Namespace pages that size our I/O.

/// Admin opcodes.
pub const ADMIN_DELETE_SQ: u8 = 0x00;
pub const ADMIN_CREATE_SQ: u8 = 0x01;
pub const ADMIN_DELETE_CQ: u8 = 0x04;
pub const ADMIN_CREATE_CQ: u8 = 0x05;
pub const ADMIN_IDENTIFY: u8 = 0x06;
pub const ADMIN_SET_FEATURES: u8 = 0x09;

/// NVM command set opcodes.
pub const IO_FLUSH: u8 = 0x00;
pub const IO_WRITE: u8 = 0x01;
pub const IO_READ: u8 = 0x02;

/// Identify CNS values.
pub const CNS_NAMESPACE: u32 = 0x00;
pub const CNS_CONTROLLER: u32 = 0x01;

/// Feature id: number of queues.
pub const FEATURE_NUMBER_OF_QUEUES: u32 = 0x07;

/// Controller registers (offsets into BAR0).
pub const REG_CAP: usize = 0x00;
pub const REG_VS: usize = 0x08;
pub const REG_CC: usize = 0x14;
pub const REG_CSTS: usize = 0x1c;
pub const REG_AQA: usize = 0x24;
pub const REG_ASQ: usize = 0x28;
pub const REG_ACQ: usize = 0x30;
pub const REG_DOORBELLS: usize = 0x1000;

/// A submission queue entry.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct Command {
    pub opcode: u8,
    pub flags: u8,
    pub command_id: u16,
    pub nsid: u32,
    pub cdw2: u32,
    pub cdw3: u32,
    pub metadata: u64,
    pub prp1: u64,
    pub prp2: u64,
    pub cdw10: u32,
    pub cdw11: u32,
    pub cdw12: u32,
    pub cdw13: u32,
    pub cdw14: u32,
    pub cdw15: u32,
}
const _: () = assert!(std::mem::size_of::<Command>() == 64);

impl Command {
    /// A read or write of `blocks` logical blocks (1..=65536) at `lba`.
    pub fn read_write(opcode: u8, nsid: u32, lba: u64, blocks: u32) -> Command {
        debug_assert!((1..=65536).contains(&blocks));
        Command { opcode, nsid, cdw10: lba as u32, cdw11: (lba >> 32) as u32, cdw12: blocks - 1, ..Default::default() }
    }
}

/// A completion queue entry.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct Completion {
    pub result: u32,
    pub reserved: u32,
    pub sq_head: u16,
    pub sq_id: u16,
    pub command_id: u16,
    /// Bit 0: phase tag; bits 1..: status field (SC in 1..=8, SCT in 9..=11).
    pub status: u16,
}
const _: () = assert!(std::mem::size_of::<Completion>() == 16);

impl Completion {
    pub fn phase(&self) -> bool {
        self.status & 1 == 1
    }
    /// Status code type and status code; (0, 0) is success.
    pub fn status_code(&self) -> (u8, u8) {
        (((self.status >> 9) & 0x7) as u8, ((self.status >> 1) & 0xff) as u8)
    }
    pub fn is_ok(&self) -> bool {
        self.status_code() == (0, 0)
    }
}

/// Maps an NVMe status to the errno the engine's queue understands.
pub fn status_errno(sct: u8, sc: u8) -> i32 {
    match (sct, sc) {
        (0, 0) => 0,
        (0, 0x02) | (0, 0x0b) | (0, 0x80) => libc::EINVAL, // invalid field, invalid ns, LBA out of range
        (0, 0x81) => libc::ENOSPC,                         // capacity exceeded
        (0, 0x82) => libc::ENODEV,                         // namespace not ready
        (2, _) => libc::EIO,                               // media and data integrity errors
        _ => libc::EIO,
    }
}

/// What teraio needs from Identify Controller (4096 bytes).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ControllerInfo {
    pub model: String,
    pub serial: String,
    /// Maximum data transfer size as a power of two of the minimum page size; 0 = no limit.
    pub mdts: u8,
    /// Number of namespaces.
    pub namespace_count: u32,
}

impl ControllerInfo {
    pub fn parse(page: &[u8]) -> ControllerInfo {
        let text = |r: std::ops::Range<usize>| {
            String::from_utf8_lossy(&page[r]).trim_matches(|c: char| c == '\0' || c.is_whitespace()).to_string()
        };
        ControllerInfo {
            serial: text(4..24),
            model: text(24..64),
            mdts: page[77],
            namespace_count: u32::from_le_bytes(page[516..520].try_into().unwrap()),
        }
    }

    /// The largest transfer in bytes, given the controller's minimum page size; capped at `cap`.
    pub fn max_transfer_bytes(&self, min_page_bytes: u64, cap: u64) -> u64 {
        if self.mdts == 0 || self.mdts >= 32 {
            cap
        } else {
            (min_page_bytes << self.mdts).min(cap)
        }
    }
}

/// What teraio needs from Identify Namespace (4096 bytes).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NamespaceInfo {
    /// Namespace size in logical blocks.
    pub size_blocks: u64,
    /// Logical block size in bytes (from the LBA format in use).
    pub lba_bytes: u32,
    /// Metadata bytes per block of the LBA format in use (teraio supports 0 only).
    pub metadata_bytes: u16,
}

impl NamespaceInfo {
    pub fn parse(page: &[u8]) -> NamespaceInfo {
        let flbas = page[26];
        // Format index: bits 0..4, plus bits 5..7 as the upper bits when more than 16 formats.
        let index = ((flbas & 0x0f) | ((flbas >> 5) & 0x3) << 4) as usize;
        let lbaf = u32::from_le_bytes(page[128 + 4 * index..132 + 4 * index].try_into().unwrap());
        let lbads = (lbaf >> 16) & 0xff;
        NamespaceInfo {
            size_blocks: u64::from_le_bytes(page[0..8].try_into().unwrap()),
            lba_bytes: if (9..=16).contains(&lbads) { 1 << lbads } else { 0 },
            metadata_bytes: (lbaf & 0xffff) as u16,
        }
    }

    pub fn size_bytes(&self) -> u64 {
        self.size_blocks * self.lba_bytes as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_identify_pages() {
        let mut c = vec![0u8; 4096];
        c[4..12].copy_from_slice(b"SERIAL01");
        c[24..30].copy_from_slice(b"QEMU X");
        c[77] = 5;
        c[516] = 2;
        let info = ControllerInfo::parse(&c);
        assert_eq!((info.serial.as_str(), info.model.as_str(), info.namespace_count), ("SERIAL01", "QEMU X", 2));
        assert_eq!(info.max_transfer_bytes(4096, 1 << 30), 128 << 10);
        let mut n = vec![0u8; 4096];
        n[0..8].copy_from_slice(&1000u64.to_le_bytes());
        n[26] = 1;
        n[132..136].copy_from_slice(&(12u32 << 16).to_le_bytes());
        let ns = NamespaceInfo::parse(&n);
        assert_eq!((ns.size_blocks, ns.lba_bytes, ns.metadata_bytes), (1000, 4096, 0));
        assert_eq!(ns.size_bytes(), 4096 * 1000);
    }

    #[test]
    fn completion_status() {
        let c = Completion { status: 1, ..Default::default() };
        assert!(c.phase() && c.is_ok());
        let c = Completion { status: 0x80 << 1, ..Default::default() };
        assert_eq!(status_errno(c.status_code().0, c.status_code().1), libc::EINVAL);
    }
}
