//! A migration plan: per tensor and inactive period, where it goes and when it leaves and comes
//! back, plus the flat list of actions a runtime executes before each op. Plans are JSON so that
//! the runtime engine (and `teraio sim`) can read them.

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::trace::Trace;

/// Plan file format version.
pub const PLAN_FORMAT_VERSION: u32 = 1;

/// Where an offloaded tensor waits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, PartialOrd, Ord)]
#[serde(rename_all = "snake_case")]
pub enum Tier {
    /// The SSD array, through GPUDirect Storage.
    Ssd,
    /// Pinned host memory.
    Host,
}

impl Tier {
    /// Array index for per-tier tables.
    pub fn index(self) -> usize {
        match self {
            Tier::Ssd => 0,
            Tier::Host => 1,
        }
    }
}

/// What a runtime does with a tensor before an op.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, PartialOrd, Ord)]
#[serde(rename_all = "snake_case")]
pub enum ActionKind {
    /// Write the tensor to the tier, then free its GPU memory.
    Offload,
    /// The tier already holds an up-to-date copy: free the GPU memory without writing.
    Drop,
    /// Allocate GPU memory and read the tensor back.
    Prefetch,
}

/// One step of the plan, executed just before op `op` starts.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Action {
    /// The op before which it is issued.
    pub op: u32,
    /// What to do.
    pub kind: ActionKind,
    /// The trace's tensor id.
    pub tensor_id: u64,
    /// Source or destination tier.
    pub tier: Tier,
    /// Must run ahead of other pending migrations (its result is needed by the next op).
    pub urgent: bool,
    /// The op that needs the result (prefetch: the next use; offload: the op it is issued at);
    /// runtimes serve pending transfers earliest deadline first. May be lower than `op` when
    /// the deadline is in the next iteration.
    pub deadline_op: u32,
}

/// One planned offload of one inactive period.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Migration {
    /// The trace's tensor id.
    pub tensor_id: u64,
    /// Index into the trace's tensor list (for speed; checked against the id on load).
    pub tensor_index: u32,
    /// Destination tier.
    pub tier: Tier,
    /// Offload issue op (the op after the last use), as an op index of the iteration.
    pub offload_op: u32,
    /// Write needed (false: a clean copy is already on the tier).
    pub writes: bool,
    /// Prefetch issue op.
    pub prefetch_op: u32,
    /// The op that next uses the tensor (the prefetch deadline).
    pub next_use_op: u32,
    /// Planned slots of absence (GPU memory freed), as virtual slots `absent_from..absent_to`.
    pub absent_from_slot: u32,
    /// End (exclusive) of the planned absence, virtual slot.
    pub absent_to_slot: u32,
    /// The period crosses the iteration boundary.
    pub wraps: bool,
    /// The tensor is on its tier when an iteration starts (steady state): the period wraps and
    /// the prefetch is issued in the next iteration. Its write may still be in flight then; the
    /// tensor is not used before the prefetch, so starting on the tier is equivalent.
    pub offloaded_at_start: bool,
    /// Offload marked urgent.
    pub offload_urgent: bool,
    /// Prefetch marked urgent.
    pub prefetch_urgent: bool,
    /// The write does not fit in the bandwidth left; the planner expects the GPU to wait.
    #[serde(default)]
    pub offload_stalls: bool,
    /// The read does not fit in the bandwidth left; the planner expects the GPU to wait.
    #[serde(default)]
    pub prefetch_stalls: bool,
}

/// A whole plan.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Plan {
    /// Must equal [`PLAN_FORMAT_VERSION`].
    pub format_version: u32,
    /// Which policy produced it.
    pub policy: String,
    /// Op count of the trace it was made for (a cheap identity check).
    pub op_count: u32,
    /// GPU capacity it was made for.
    pub gpu_capacity_bytes: u64,
    /// Peak GPU memory the planner expects (stall-free timing).
    pub predicted_peak_bytes: u64,
    /// The planner expects every op to fit in GPU memory.
    pub fits: bool,
    /// Planned migrations.
    pub migrations: Vec<Migration>,
    /// Actions sorted by op, offloads before prefetches within an op.
    pub actions: Vec<Action>,
}

impl Plan {
    /// Builds the action list from the migrations (sorted, deterministic).
    pub fn new(
        policy: &str,
        trace: &Trace,
        gpu_capacity_bytes: u64,
        predicted_peak_bytes: u64,
        mut migrations: Vec<Migration>,
    ) -> Plan {
        migrations.sort_by_key(|m| (m.offload_op, m.tensor_index, m.absent_from_slot));
        let mut actions = Vec::with_capacity(migrations.len() * 2);
        for m in &migrations {
            actions.push(Action {
                op: m.offload_op,
                kind: if m.writes { ActionKind::Offload } else { ActionKind::Drop },
                tensor_id: m.tensor_id,
                tier: m.tier,
                urgent: m.offload_urgent,
                deadline_op: m.offload_op,
            });
            actions.push(Action {
                op: m.prefetch_op,
                kind: ActionKind::Prefetch,
                tensor_id: m.tensor_id,
                tier: m.tier,
                urgent: m.prefetch_urgent,
                deadline_op: m.next_use_op,
            });
        }
        actions.sort_by_key(|a| (a.op, a.kind == ActionKind::Prefetch, a.tensor_id, a.kind));
        Plan {
            format_version: PLAN_FORMAT_VERSION,
            policy: policy.to_string(),
            op_count: trace.ops.len() as u32,
            gpu_capacity_bytes,
            predicted_peak_bytes,
            fits: predicted_peak_bytes <= gpu_capacity_bytes,
            migrations,
            actions,
        }
    }

    /// An empty plan (nothing moves).
    pub fn empty(policy: &str, trace: &Trace, gpu_capacity_bytes: u64, peak_bytes: u64) -> Plan {
        Plan::new(policy, trace, gpu_capacity_bytes, peak_bytes, Vec::new())
    }

    /// Bytes written to / read from each tier per iteration.
    pub fn bytes_moved(&self, trace: &Trace) -> PlanTraffic {
        let mut traffic = PlanTraffic::default();
        for m in &self.migrations {
            let size = trace.tensors[m.tensor_index as usize].size_bytes;
            let tier = m.tier.index();
            if m.writes {
                traffic.written_bytes[tier] += size;
            }
            traffic.read_bytes[tier] += size;
        }
        traffic
    }

    /// Checks that the plan refers to this trace.
    pub fn check_against(&self, trace: &Trace) -> Result<()> {
        if self.format_version != PLAN_FORMAT_VERSION {
            return Err(Error::InvalidPlan(format!(
                "format_version {} (expected {PLAN_FORMAT_VERSION})",
                self.format_version
            )));
        }
        if self.op_count as usize != trace.ops.len() {
            return Err(Error::InvalidPlan(format!(
                "made for {} ops, the trace has {}",
                self.op_count,
                trace.ops.len()
            )));
        }
        for m in &self.migrations {
            let ok = trace.tensors.get(m.tensor_index as usize).is_some_and(|t| t.id == m.tensor_id);
            if !ok || m.offload_op >= self.op_count || m.prefetch_op >= self.op_count {
                return Err(Error::InvalidPlan(format!(
                    "migration of tensor {} does not match the trace",
                    m.tensor_id
                )));
            }
        }
        Ok(())
    }

    /// Reads a plan file.
    pub fn load(path: &Path) -> Result<Plan> {
        let text = std::fs::read_to_string(path).map_err(|source| Error::Io { path: path.to_path_buf(), source })?;
        serde_json::from_str(&text).map_err(|source| Error::decode(path, &text, &source))
    }

    /// Writes a plan file.
    pub fn save(&self, path: &Path) -> Result<()> {
        let text =
            serde_json::to_string_pretty(self).map_err(|source| Error::Json { path: path.to_path_buf(), source })?;
        std::fs::write(path, text).map_err(|source| Error::Io { path: path.to_path_buf(), source })
    }
}

/// Bytes a plan moves per iteration, per tier (index by [`Tier::index`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct PlanTraffic {
    /// Bytes written to SSD, host.
    pub written_bytes: [u64; 2],
    /// Bytes read back from SSD, host.
    pub read_bytes: [u64; 2],
}
