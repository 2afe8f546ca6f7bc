//! GPU presets (for the op-time model) and the migration hardware a plan is made for: GPU memory,
//! the SSD array and the host-memory tier.

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use teraio_units::ReadWriteBandwidth;

/// Compute and memory figures of one GPU model, from the vendors' data sheets (dense, no sparsity).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct GpuModel {
    /// Preset name.
    pub name: &'static str,
    /// HBM capacity.
    pub memory_bytes: u64,
    /// FP32 rate on CUDA cores (what PyTorch uses for fp32 matmuls unless TF32 is allowed).
    pub fp32_flops_per_s: f64,
    /// TF32 tensor-core rate.
    pub tf32_flops_per_s: f64,
    /// BF16 tensor-core rate.
    pub bf16_flops_per_s: f64,
    /// HBM bandwidth.
    pub hbm_bytes_per_s: f64,
}

/// GPU presets the trace generator knows.
pub const GPU_PRESETS: [GpuModel; 4] = [
    GpuModel {
        name: "h100",
        memory_bytes: 80_000_000_000,
        fp32_flops_per_s: 67e12,
        tf32_flops_per_s: 494e12,
        bf16_flops_per_s: 989e12,
        hbm_bytes_per_s: 3.35e12,
    },
    GpuModel {
        name: "h100-nvl",
        memory_bytes: 94_000_000_000,
        fp32_flops_per_s: 60e12,
        tf32_flops_per_s: 417e12,
        bf16_flops_per_s: 835e12,
        hbm_bytes_per_s: 3.9e12,
    },
    GpuModel {
        name: "h100-pcie",
        memory_bytes: 80_000_000_000,
        fp32_flops_per_s: 51e12,
        tf32_flops_per_s: 378e12,
        bf16_flops_per_s: 756e12,
        hbm_bytes_per_s: 2.0e12,
    },
    GpuModel {
        name: "a100",
        memory_bytes: 80_000_000_000,
        fp32_flops_per_s: 19.5e12,
        tf32_flops_per_s: 156e12,
        bf16_flops_per_s: 312e12,
        hbm_bytes_per_s: 2.039e12,
    },
];

/// Finds a GPU preset by name.
pub fn gpu_preset(name: &str) -> Result<GpuModel> {
    GPU_PRESETS.iter().find(|gpu| gpu.name.eq_ignore_ascii_case(name)).copied().ok_or_else(|| {
        let names: Vec<&str> = GPU_PRESETS.iter().map(|gpu| gpu.name).collect();
        Error::Config(format!("unknown GPU {name:?}; known: {}", names.join(", ")))
    })
}

/// The memory and migration resources of one GPU that a plan is made for.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Hardware {
    /// GPU memory the iteration must fit in.
    pub gpu_capacity_bytes: u64,
    /// SSD array bandwidth (GPUDirect Storage, aggregate over the array).
    pub ssd_read_bytes_per_s: f64,
    /// SSD array write bandwidth.
    pub ssd_write_bytes_per_s: f64,
    /// Fixed cost per SSD transfer (submission + device latency).
    pub ssd_latency_us: f64,
    /// Host memory the planner may use (0 disables the host tier).
    pub host_capacity_bytes: u64,
    /// Host link bandwidth per direction left for offloading, with one direction busy.
    pub host_link_bytes_per_s: f64,
    /// Host link bandwidth per direction while both directions move data at once (a PCIe link
    /// gives each direction less then: measure it with both directions busy). None (the
    /// default): `host_link_bytes_per_s` either way.
    #[serde(default)]
    pub host_link_duplex_bytes_per_s: Option<f64>,
    /// Fixed cost per host transfer.
    pub host_latency_us: f64,
    /// Reads and writes share the SSDs' time (a drive serves one request after another): the
    /// read and write bandwidths are each what the array gives doing only that, and a slot's
    /// SSD time is split between them. False (the default): independent channels, as for an
    /// array whose reads and writes overlap (the paper's model).
    #[serde(default)]
    pub ssd_shared: bool,
    /// SSD transfers also cross the host link, in the same direction: the runtime stages them
    /// in pinned host memory (as teraio's bounce path does), or GPUDirect Storage shares the
    /// GPU's one PCIe link with host copies. Each SSD byte then also takes a host-link byte, so
    /// the SSD tier adds capacity, not link bandwidth. False (the default): the SSD array has
    /// its own path (the paper's model).
    #[serde(default)]
    pub ssd_via_host_link: bool,
}

impl Hardware {
    /// Defaults: SSD latency 20 us, host link 25 GB/s per direction (a PCIe Gen5 x16 link after
    /// the SSD array's share), host latency 10 us.
    pub fn new(gpu_capacity_bytes: u64, ssd: ReadWriteBandwidth, host_capacity_bytes: u64) -> Self {
        Hardware {
            gpu_capacity_bytes,
            ssd_read_bytes_per_s: ssd.read_bytes_per_s,
            ssd_write_bytes_per_s: ssd.write_bytes_per_s,
            ssd_latency_us: 20.0,
            host_capacity_bytes,
            host_link_bytes_per_s: 25e9,
            host_link_duplex_bytes_per_s: None,
            host_latency_us: 10.0,
            ssd_shared: false,
            ssd_via_host_link: false,
        }
    }

    /// Rejects values the planner cannot work with.
    pub fn validate(&self) -> Result<()> {
        let duplex = self.host_link_duplex_bytes_per_s.unwrap_or(self.host_link_bytes_per_s);
        let rates = [self.ssd_read_bytes_per_s, self.ssd_write_bytes_per_s, self.host_link_bytes_per_s, duplex];
        if rates.iter().any(|rate| !(rate.is_finite() && *rate > 0.0)) {
            return Err(Error::Config("bandwidths must be finite and > 0".into()));
        }
        let latencies = [self.ssd_latency_us, self.host_latency_us];
        if latencies.iter().any(|l| !(l.is_finite() && *l >= 0.0 && *l <= 1e6)) {
            return Err(Error::Config("latencies must be within 0..=1 s".into()));
        }
        if self.gpu_capacity_bytes == 0 {
            return Err(Error::Config("GPU capacity must be > 0".into()));
        }
        Ok(())
    }
}
