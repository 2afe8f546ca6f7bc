//! The trace of one training iteration (format in docs/trace.md): ops in order with measured
//! durations, tensors with their sizes, kinds, lifetimes and uses, and the GPU capacity it ran
//! with. Loading validates every rule so that later stages may index without checks.

use std::collections::HashSet;
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// The trace format this code reads and writes.
pub const FORMAT_VERSION: u32 = 1;
/// Most ops in one trace (a 70B iteration has a few thousand).
pub const OPS_MAX: usize = 10_000_000;
/// Most tensors in one trace.
pub const TENSORS_MAX: usize = 10_000_000;
/// Longest op accepted: one hour.
pub const OP_DURATION_US_MAX: f64 = 3.6e9;

/// What a tensor is for; decides which baseline policies may move it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TensorKind {
    /// Model parameter; lives across iterations.
    Weight,
    /// Parameter gradient; allocated in the backward pass, freed after the optimizer step.
    Gradient,
    /// Optimizer state (AdamW moments); lives across iterations.
    OptimizerState,
    /// Forward activation saved for the backward pass.
    Activation,
    /// Short-lived intermediate (activation gradients, workspaces, logits).
    Temporary,
}

impl std::str::FromStr for TensorKind {
    type Err = Error;
    /// The kind as the trace format spells it (`"activation"`, `"optimizer_state"`, ...).
    fn from_str(name: &str) -> Result<Self> {
        serde_json::from_value(serde_json::Value::String(name.to_string())).map_err(|_| {
            Error::Config(format!(
                "unknown tensor kind {name:?}; known: weight, gradient, optimizer_state, activation, temporary"
            ))
        })
    }
}

/// Which pass of the iteration an op belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    /// Forward pass.
    Forward,
    /// Backward pass.
    Backward,
    /// Optimizer step.
    Optimizer,
    /// Anything else (communication, data loading, ...).
    #[default]
    Other,
}

/// How an op touches a tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Access {
    /// The op only reads the tensor; a copy elsewhere stays valid.
    Read,
    /// The op writes the tensor (possibly after reading it); copies elsewhere become stale.
    Write,
}

/// One GPU kernel / operator, in execution order.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Op {
    /// Human-readable name, such as `layers.3.attention.wq`.
    pub name: String,
    /// Measured (or modelled) execution time.
    pub duration_us: f64,
    /// Transformer layer the op belongs to, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub layer: Option<u32>,
    /// Pass of the iteration.
    #[serde(default)]
    pub phase: Phase,
}

/// One use of a tensor by an op.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct TensorUse {
    /// Index into `Trace::ops`.
    pub op: u32,
    /// Read or write.
    pub access: Access,
}

/// One tensor and its lifetime.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Tensor {
    /// Unique id (the runtime's tensor id).
    pub id: u64,
    /// Human-readable name.
    #[serde(default)]
    pub name: String,
    /// Bytes of GPU memory it takes.
    pub size_bytes: u64,
    /// What it is for.
    pub kind: TensorKind,
    /// Op at which it is allocated; `None` means it exists before the iteration starts
    /// (weights, optimizer states), and then `free_op` must be `None` too.
    pub alloc_op: Option<u32>,
    /// Op after which it is freed; `None` means it outlives the iteration.
    pub free_op: Option<u32>,
    /// Ops that use it, in increasing op order, at most one entry per op.
    pub uses: Vec<TensorUse>,
}

impl Tensor {
    /// Lives across iterations, so its last inactive period wraps into the next iteration.
    pub fn is_persistent(&self) -> bool {
        self.alloc_op.is_none()
    }

    /// First op at which it occupies GPU memory.
    pub fn live_from_op(&self) -> u32 {
        self.alloc_op.unwrap_or(0)
    }

    /// Last op at which it occupies GPU memory.
    pub fn live_to_op(&self, op_count: u32) -> u32 {
        self.free_op.unwrap_or(op_count - 1)
    }
}

/// One training iteration.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Trace {
    /// Must equal [`FORMAT_VERSION`].
    pub format_version: u32,
    /// Free text: model, batch, sequence, hardware.
    #[serde(default)]
    pub description: String,
    /// GPU memory capacity the trace ran with (planning may override it).
    pub gpu_capacity_bytes: u64,
    /// Ops in execution order.
    pub ops: Vec<Op>,
    /// All tensors the iteration touches.
    pub tensors: Vec<Tensor>,
}

fn invalid(message: String) -> Error {
    Error::InvalidTrace(message)
}

impl Trace {
    /// Checks every rule of docs/trace.md; the first broken one is returned.
    pub fn validate(&self) -> Result<()> {
        if self.format_version != FORMAT_VERSION {
            return Err(invalid(format!(
                "format_version is {}, this planner reads version {FORMAT_VERSION}",
                self.format_version
            )));
        }
        if self.ops.is_empty() {
            return Err(invalid("the trace has no ops".into()));
        }
        if self.ops.len() > OPS_MAX || self.tensors.len() > TENSORS_MAX {
            return Err(invalid(format!(
                "too large: {} ops (max {OPS_MAX}), {} tensors (max {TENSORS_MAX})",
                self.ops.len(),
                self.tensors.len()
            )));
        }
        for (index, op) in self.ops.iter().enumerate() {
            if !(op.duration_us.is_finite() && op.duration_us >= 0.0 && op.duration_us <= OP_DURATION_US_MAX) {
                return Err(invalid(format!(
                    "op {index} ({}) has duration_us {}, expected 0..={OP_DURATION_US_MAX}",
                    op.name, op.duration_us
                )));
            }
        }
        let op_count = self.ops.len() as u32;
        let mut ids = HashSet::with_capacity(self.tensors.len());
        for tensor in &self.tensors {
            let label = format!("tensor {} ({})", tensor.id, tensor.name);
            if !ids.insert(tensor.id) {
                return Err(invalid(format!("{label}: id is not unique")));
            }
            if tensor.size_bytes == 0 {
                return Err(invalid(format!("{label}: size_bytes is 0")));
            }
            if tensor.uses.is_empty() {
                return Err(invalid(format!("{label}: has no uses")));
            }
            match (tensor.alloc_op, tensor.free_op) {
                (None, None) | (Some(_), Some(_)) => {}
                _ => return Err(invalid(format!("{label}: alloc_op and free_op must both be set or both be null"))),
            }
            let mut previous: Option<u32> = None;
            for tensor_use in &tensor.uses {
                if tensor_use.op >= op_count {
                    return Err(invalid(format!(
                        "{label}: use at op {} is past the last op {}",
                        tensor_use.op,
                        op_count - 1
                    )));
                }
                if previous.is_some_and(|p| tensor_use.op <= p) {
                    return Err(invalid(format!(
                        "{label}: uses must be in strictly increasing op order (op {} after {})",
                        tensor_use.op,
                        previous.unwrap_or(0)
                    )));
                }
                previous = Some(tensor_use.op);
            }
            if let (Some(alloc), Some(free)) = (tensor.alloc_op, tensor.free_op) {
                let first = tensor.uses[0].op;
                let last = tensor.uses[tensor.uses.len() - 1].op;
                if free >= op_count {
                    return Err(invalid(format!("{label}: free_op {free} is past the last op {}", op_count - 1)));
                }
                if !(alloc <= first && last <= free) {
                    return Err(invalid(format!(
                        "{label}: needs alloc_op <= uses <= free_op, got alloc {alloc}, \
                         uses {first}..={last}, free {free}"
                    )));
                }
            }
        }
        Ok(())
    }

    /// Reads and validates a JSON trace.
    pub fn load(path: &Path) -> Result<Trace> {
        let text = std::fs::read_to_string(path).map_err(|source| Error::Io { path: path.to_path_buf(), source })?;
        let trace: Trace = serde_json::from_str(&text).map_err(|source| Error::decode(path, &text, &source))?;
        trace.validate().map_err(|error| match error {
            Error::InvalidTrace(message) => Error::InvalidTrace(format!("{}: {message}", path.display())),
            other => other,
        })?;
        Ok(trace)
    }

    /// Writes the trace as JSON.
    pub fn save(&self, path: &Path) -> Result<()> {
        let text = serde_json::to_string(self).map_err(|source| Error::Json { path: path.to_path_buf(), source })?;
        std::fs::write(path, text).map_err(|source| Error::Io { path: path.to_path_buf(), source })
    }

    /// Sum of op durations: the iteration time with unlimited GPU memory.
    pub fn compute_time_us(&self) -> f64 {
        self.ops.iter().map(|op| op.duration_us).sum()
    }

    /// Bytes of tensors that exist at some point of the iteration, by kind.
    pub fn bytes_by_kind(&self, kind: TensorKind) -> u64 {
        self.tensors.iter().filter(|tensor| tensor.kind == kind).map(|tensor| tensor.size_bytes).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn small_trace() -> Trace {
        Trace {
            format_version: FORMAT_VERSION,
            description: String::new(),
            gpu_capacity_bytes: 100,
            ops: (0..4)
                .map(|i| Op { name: format!("op{i}"), duration_us: 10.0, layer: None, phase: Phase::Other })
                .collect(),
            tensors: vec![Tensor {
                id: 7,
                name: "w".into(),
                size_bytes: 10,
                kind: TensorKind::Weight,
                alloc_op: None,
                free_op: None,
                uses: vec![TensorUse { op: 0, access: Access::Read }, TensorUse { op: 3, access: Access::Write }],
            }],
        }
    }

    #[test]
    fn a_good_trace_validates_and_round_trips() {
        let trace = small_trace();
        trace.validate().unwrap();
        let text = serde_json::to_string(&trace).unwrap();
        let back: Trace = serde_json::from_str(&text).unwrap();
        assert_eq!(back, trace);
    }

    #[test]
    fn broken_rules_are_named() {
        let mut trace = small_trace();
        trace.tensors.push(trace.tensors[0].clone());
        assert!(trace.validate().unwrap_err().to_string().contains("not unique"));

        let mut trace = small_trace();
        trace.tensors[0].uses[1].op = 4;
        assert!(trace.validate().unwrap_err().to_string().contains("past the last op"));

        let mut trace = small_trace();
        trace.tensors[0].uses.swap(0, 1);
        assert!(trace.validate().unwrap_err().to_string().contains("increasing"));

        let mut trace = small_trace();
        trace.tensors[0].alloc_op = Some(1);
        trace.tensors[0].free_op = Some(3);
        assert!(trace.validate().unwrap_err().to_string().contains("alloc_op <= uses"));

        let mut trace = small_trace();
        trace.tensors[0].free_op = Some(3);
        assert!(trace.validate().unwrap_err().to_string().contains("both be set"));

        let mut trace = small_trace();
        trace.format_version = 99;
        assert!(trace.validate().unwrap_err().to_string().contains("format_version"));

        let mut trace = small_trace();
        trace.ops[2].duration_us = f64::NAN;
        assert!(trace.validate().unwrap_err().to_string().contains("duration_us"));
    }
}
