//! Synthetic traces of Llama-shaped transformer training (one iteration: forward, backward, AdamW
//! step), with op times from a FLOP and HBM-bandwidth model of a GPU. Lets 8B and 70B models be
//! planned with no GPU. The op and tensor structure follows a PyTorch eager training step with
//! flash attention; see docs/trace.md for what each op reads and writes.

use std::collections::HashMap;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::hardware::GpuModel;
use crate::trace::{Access, Op, Phase, Tensor, TensorKind, TensorUse, Trace, FORMAT_VERSION};

/// Largest model dimension accepted (hidden, ffn, vocab, sequence).
pub const DIMENSION_MAX: u64 = 1 << 22;
/// Most layers accepted.
pub const LAYERS_MAX: u32 = 1024;

/// Numeric format of training.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Dtype {
    /// Everything fp32 (the TERAIO paper's setting).
    Fp32,
    /// bf16 weights, gradients and activations; fp32 master weights and AdamW moments.
    Bf16,
}

impl Dtype {
    /// The names [`str::parse`] takes.
    pub const NAMES: [&'static str; 2] = ["fp32", "bf16"];
}

impl std::str::FromStr for Dtype {
    type Err = Error;
    fn from_str(text: &str) -> Result<Self> {
        match text {
            "fp32" => Ok(Dtype::Fp32),
            "bf16" => Ok(Dtype::Bf16),
            other => Err(Error::Config(format!("unknown dtype {other:?}; known: fp32, bf16"))),
        }
    }
}

/// Shape of a Llama-style model and of the batch.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelConfig {
    /// Preset name or "custom".
    pub name: String,
    /// Transformer layers in the whole model.
    pub layers: u32,
    /// Model width.
    pub hidden: u64,
    /// Attention heads.
    pub heads: u64,
    /// Key/value heads (grouped-query attention).
    pub kv_heads: u64,
    /// Feed-forward width.
    pub ffn_hidden: u64,
    /// Vocabulary size.
    pub vocab: u64,
    /// Sequence length.
    pub sequence: u64,
    /// Sequences per iteration on this GPU.
    pub batch: u64,
    /// Numeric format.
    pub dtype: Dtype,
    /// Pipeline stages the layers are split over; the trace is of the last stage (it holds the
    /// output head, the largest activations).
    pub pipeline_stages: u32,
    /// Let fp32 matmuls use TF32 tensor cores (PyTorch's default is not to).
    pub allow_tf32: bool,
}

/// Model presets the generator knows.
pub fn model_preset(name: &str) -> Result<ModelConfig> {
    let base = |layers, hidden, heads, kv_heads, ffn_hidden, vocab| ModelConfig {
        name: name.to_ascii_lowercase(),
        layers,
        hidden,
        heads,
        kv_heads,
        ffn_hidden,
        vocab,
        sequence: 2048,
        batch: 1,
        dtype: Dtype::Fp32,
        pipeline_stages: 1,
        allow_tf32: false,
    };
    match name.to_ascii_lowercase().as_str() {
        "llama3-8b" => Ok(base(32, 4096, 32, 8, 14336, 128_256)),
        "llama3-70b" => Ok(base(80, 8192, 64, 8, 28672, 128_256)),
        "tiny" => Ok(ModelConfig { sequence: 128, batch: 2, ..base(4, 256, 4, 2, 688, 1024) }),
        _ => Err(Error::Config(format!("unknown model {name:?}; known: llama3-8b, llama3-70b, tiny"))),
    }
}

impl ModelConfig {
    /// Rejects shapes the generator cannot build.
    pub fn validate(&self) -> Result<()> {
        let dims = [
            ("hidden", self.hidden),
            ("heads", self.heads),
            ("kv_heads", self.kv_heads),
            ("ffn_hidden", self.ffn_hidden),
            ("vocab", self.vocab),
            ("sequence", self.sequence),
            ("batch", self.batch),
        ];
        for (what, value) in dims {
            if value == 0 || value > DIMENSION_MAX {
                return Err(Error::Config(format!("{what} must be 1..={DIMENSION_MAX}")));
            }
        }
        if self.layers == 0 || self.layers > LAYERS_MAX {
            return Err(Error::Config(format!("layers must be 1..={LAYERS_MAX}")));
        }
        if !self.hidden.is_multiple_of(self.heads) || !self.heads.is_multiple_of(self.kv_heads) {
            return Err(Error::Config("hidden must be a multiple of heads, heads a multiple of kv_heads".into()));
        }
        if self.pipeline_stages == 0 || self.pipeline_stages > self.layers {
            return Err(Error::Config("pipeline_stages must be 1..=layers".into()));
        }
        Ok(())
    }

    /// Parameters in the whole model.
    pub fn parameter_count(&self) -> u64 {
        let kv = self.hidden / self.heads * self.kv_heads;
        let per_layer =
            2 * self.hidden * self.hidden + 2 * self.hidden * kv + 3 * self.hidden * self.ffn_hidden + 2 * self.hidden;
        u64::from(self.layers) * per_layer + 2 * self.vocab * self.hidden + self.hidden
    }
}

/// Fraction of peak FLOP rate a large matmul reaches.
const MATMUL_EFFICIENCY: f64 = 0.7;
/// Fraction of peak FLOP rate flash attention reaches.
const ATTENTION_EFFICIENCY: f64 = 0.5;
/// Fraction of HBM bandwidth element-wise kernels reach.
const HBM_EFFICIENCY: f64 = 0.8;
/// Fixed cost per kernel (launch and tail).
const KERNEL_OVERHEAD_US: f64 = 5.0;

/// Collects ops and tensor uses, then closes lifetimes.
struct Builder {
    gpu: GpuModel,
    matmul_flops_per_s: f64,
    ops: Vec<Op>,
    tensors: Vec<Tensor>,
    layer: Option<u32>,
    phase: Phase,
}

type TensorIndex = usize;

impl Builder {
    fn tensor(&mut self, name: String, size_bytes: u64, kind: TensorKind) -> TensorIndex {
        let persistent = matches!(kind, TensorKind::Weight | TensorKind::OptimizerState);
        self.tensors.push(Tensor {
            id: self.tensors.len() as u64,
            name,
            size_bytes,
            kind,
            alloc_op: if persistent { None } else { Some(u32::MAX) },
            free_op: if persistent { None } else { Some(0) },
            uses: Vec::new(),
        });
        self.tensors.len() - 1
    }

    /// Adds one op that reads `reads` and writes `writes`; its time is the larger of its FLOP
    /// time and its HBM time, plus launch overhead.
    fn op(&mut self, name: String, flops: f64, flops_per_s: f64, reads: &[TensorIndex], writes: &[TensorIndex]) {
        let index = self.ops.len() as u32;
        let bytes: u64 = reads.iter().chain(writes).map(|&t| self.tensors[t].size_bytes).sum();
        let compute_us = flops / flops_per_s * 1e6;
        let memory_us = bytes as f64 / (self.gpu.hbm_bytes_per_s * HBM_EFFICIENCY) * 1e6;
        self.ops.push(Op {
            name,
            duration_us: compute_us.max(memory_us) + KERNEL_OVERHEAD_US,
            layer: self.layer,
            phase: self.phase,
        });
        for (&tensor, access) in
            reads.iter().map(|t| (t, Access::Read)).chain(writes.iter().map(|t| (t, Access::Write)))
        {
            let entry = &mut self.tensors[tensor];
            match entry.uses.last_mut() {
                Some(last) if last.op == index => {
                    if access == Access::Write {
                        last.access = Access::Write;
                    }
                }
                _ => entry.uses.push(TensorUse { op: index, access }),
            }
        }
    }

    fn matmul(&mut self, name: String, flops: f64, reads: &[TensorIndex], writes: &[TensorIndex]) {
        let rate = self.matmul_flops_per_s * MATMUL_EFFICIENCY;
        self.op(name, flops, rate, reads, writes);
    }

    fn elementwise(&mut self, name: String, reads: &[TensorIndex], writes: &[TensorIndex]) {
        self.op(name, 0.0, 1.0, reads, writes);
    }

    fn finish(mut self, description: String) -> Trace {
        for tensor in &mut self.tensors {
            if tensor.alloc_op.is_some() {
                tensor.alloc_op = Some(tensor.uses[0].op);
                tensor.free_op = Some(tensor.uses[tensor.uses.len() - 1].op);
            }
        }
        Trace {
            format_version: FORMAT_VERSION,
            description,
            gpu_capacity_bytes: self.gpu.memory_bytes,
            ops: self.ops,
            tensors: self.tensors,
        }
    }
}

/// Weights of one layer, in the order the optimizer visits them.
struct LayerParameters {
    names: Vec<&'static str>,
    weights: HashMap<&'static str, TensorIndex>,
    gradients: HashMap<&'static str, TensorIndex>,
}

/// Builds the trace of one training iteration of `model` on `gpu`.
pub fn generate(model: &ModelConfig, gpu: &GpuModel) -> Result<Trace> {
    model.validate()?;
    let element_bytes: u64 = match model.dtype {
        Dtype::Fp32 => 4,
        Dtype::Bf16 => 2,
    };
    let matmul_flops_per_s = match (model.dtype, model.allow_tf32) {
        (Dtype::Fp32, false) => gpu.fp32_flops_per_s,
        (Dtype::Fp32, true) => gpu.tf32_flops_per_s,
        (Dtype::Bf16, _) => gpu.bf16_flops_per_s,
    };
    let mut b = Builder {
        gpu: *gpu,
        matmul_flops_per_s,
        ops: Vec::new(),
        tensors: Vec::new(),
        layer: None,
        phase: Phase::Forward,
    };
    let h = model.hidden;
    let kv = model.hidden / model.heads * model.kv_heads;
    let f = model.ffn_hidden;
    let tokens = model.batch * model.sequence;
    let tokens_f = tokens as f64;
    let layers_here = model.layers.div_ceil(model.pipeline_stages);
    let first_layer = model.layers - layers_here;
    let has_embedding = model.pipeline_stages == 1;
    let e = element_bytes;

    // Parameters of this stage.
    let mut parameters: Vec<LayerParameters> = Vec::new();
    let mut add_parameters = |b: &mut Builder, layer: Option<u32>, shapes: &[(&'static str, u64)]| {
        let prefix = match layer {
            Some(l) => format!("layers.{l}."),
            None => String::new(),
        };
        let mut entry = LayerParameters { names: Vec::new(), weights: HashMap::new(), gradients: HashMap::new() };
        for &(name, elements) in shapes {
            let w = b.tensor(format!("{prefix}{name}"), elements * e, TensorKind::Weight);
            entry.names.push(name);
            entry.weights.insert(name, w);
        }
        parameters.push(entry);
    };
    if has_embedding {
        add_parameters(&mut b, None, &[("tok_embeddings", model.vocab * h)]);
    }
    for l in first_layer..model.layers {
        add_parameters(
            &mut b,
            Some(l),
            &[
                ("attention_norm", h),
                ("wq", h * h),
                ("wk", h * kv),
                ("wv", h * kv),
                ("wo", h * h),
                ("ffn_norm", h),
                ("w1", h * f),
                ("w3", h * f),
                ("w2", f * h),
            ],
        );
    }
    add_parameters(&mut b, None, &[("norm", h), ("output", h * model.vocab)]);

    let act = |b: &mut Builder, name: String, elements: u64| b.tensor(name, elements * e, TensorKind::Activation);
    let tmp = |b: &mut Builder, name: String, elements: u64| b.tensor(name, elements * e, TensorKind::Temporary);

    // Forward.
    b.phase = Phase::Forward;
    let mut x = act(&mut b, "x.input".into(), tokens * h);
    let param_offset = usize::from(has_embedding);
    if has_embedding {
        let embedding = parameters[0].weights["tok_embeddings"];
        b.elementwise("tok_embeddings".into(), &[embedding], &[x]);
    } else {
        b.elementwise("recv_activations".into(), &[], &[x]);
    }
    struct Saved {
        x: TensorIndex,
        n1: TensorIndex,
        q_r: TensorIndex,
        k_r: TensorIndex,
        v: TensorIndex,
        attn: TensorIndex,
        lse: TensorIndex,
        h1: TensorIndex,
        n2: TensorIndex,
        g: TensorIndex,
        u: TensorIndex,
        a: TensorIndex,
    }
    let attention_flops = 2.0 * model.batch as f64 * (model.sequence as f64).powi(2) * h as f64;
    let attention_rate = matmul_flops_per_s * ATTENTION_EFFICIENCY;
    let mut saved: Vec<Saved> = Vec::new();
    for (index, l) in (first_layer..model.layers).enumerate() {
        b.layer = Some(l);
        let w = parameters[param_offset + index].weights.clone();
        let p = |name: &str| format!("layers.{l}.{name}");
        let n1 = act(&mut b, p("attention_norm.out"), tokens * h);
        b.elementwise(p("attention_norm"), &[x, w["attention_norm"]], &[n1]);
        let q = tmp(&mut b, p("q"), tokens * h);
        let k = tmp(&mut b, p("k"), tokens * kv);
        let v = act(&mut b, p("v"), tokens * kv);
        b.matmul(p("wq"), 2.0 * tokens_f * (h * h) as f64, &[n1, w["wq"]], &[q]);
        b.matmul(p("wk"), 2.0 * tokens_f * (h * kv) as f64, &[n1, w["wk"]], &[k]);
        b.matmul(p("wv"), 2.0 * tokens_f * (h * kv) as f64, &[n1, w["wv"]], &[v]);
        let q_r = act(&mut b, p("q_rope"), tokens * h);
        let k_r = act(&mut b, p("k_rope"), tokens * kv);
        b.elementwise(p("rope"), &[q, k], &[q_r, k_r]);
        let attn = act(&mut b, p("attention.out"), tokens * h);
        let lse = b.tensor(p("attention.lse"), model.batch * model.heads * model.sequence * 4, TensorKind::Activation);
        b.op(p("flash_attention"), attention_flops, attention_rate, &[q_r, k_r, v], &[attn, lse]);
        let o = tmp(&mut b, p("wo.out"), tokens * h);
        b.matmul(p("wo"), 2.0 * tokens_f * (h * h) as f64, &[attn, w["wo"]], &[o]);
        let h1 = act(&mut b, p("attention_residual"), tokens * h);
        b.elementwise(p("attention_residual"), &[x, o], &[h1]);
        let n2 = act(&mut b, p("ffn_norm.out"), tokens * h);
        b.elementwise(p("ffn_norm"), &[h1, w["ffn_norm"]], &[n2]);
        let g = act(&mut b, p("w1.out"), tokens * f);
        let u = act(&mut b, p("w3.out"), tokens * f);
        b.matmul(p("w1"), 2.0 * tokens_f * (h * f) as f64, &[n2, w["w1"]], &[g]);
        b.matmul(p("w3"), 2.0 * tokens_f * (h * f) as f64, &[n2, w["w3"]], &[u]);
        let a = act(&mut b, p("silu_mul.out"), tokens * f);
        b.elementwise(p("silu_mul"), &[g, u], &[a]);
        let d = tmp(&mut b, p("w2.out"), tokens * h);
        b.matmul(p("w2"), 2.0 * tokens_f * (f * h) as f64, &[a, w["w2"]], &[d]);
        let next = act(&mut b, p("ffn_residual"), tokens * h);
        b.elementwise(p("ffn_residual"), &[h1, d], &[next]);
        saved.push(Saved { x, n1, q_r, k_r, v, attn, lse, h1, n2, g, u, a });
        x = next;
    }
    b.layer = None;
    let head = parameters.len() - 1;
    let head_w = parameters[head].weights.clone();
    let nf = act(&mut b, "norm.out".into(), tokens * h);
    b.elementwise("norm".into(), &[x, head_w["norm"]], &[nf]);
    // Cross entropy runs in fp32 on the logits.
    let logits = b.tensor("logits".into(), tokens * model.vocab * 4, TensorKind::Temporary);
    b.matmul("output".into(), 2.0 * tokens_f * (h * model.vocab) as f64, &[nf, head_w["output"]], &[logits]);
    let dlogits = b.tensor("logits.grad".into(), tokens * model.vocab * 4, TensorKind::Temporary);
    b.elementwise("cross_entropy".into(), &[logits], &[dlogits]);

    // Backward.
    b.phase = Phase::Backward;
    let grad = |b: &mut Builder, params: &mut LayerParameters, name: &'static str, label: String| {
        let size = b.tensors[params.weights[name]].size_bytes;
        let g = b.tensor(label, size, TensorKind::Gradient);
        params.gradients.insert(name, g);
        g
    };
    let dnf = tmp(&mut b, "norm.out.grad".into(), tokens * h);
    b.matmul("output.dgrad".into(), 2.0 * tokens_f * (h * model.vocab) as f64, &[dlogits, head_w["output"]], &[dnf]);
    let g_out = grad(&mut b, &mut parameters[head], "output", "output.grad".into());
    b.matmul("output.wgrad".into(), 2.0 * tokens_f * (h * model.vocab) as f64, &[dlogits, nf], &[g_out]);
    let mut dx = tmp(&mut b, "x.grad".into(), tokens * h);
    let g_norm = grad(&mut b, &mut parameters[head], "norm", "norm.grad".into());
    b.elementwise("norm.backward".into(), &[dnf, x, head_w["norm"]], &[dx, g_norm]);

    for (index, l) in (first_layer..model.layers).enumerate().rev() {
        b.layer = Some(l);
        let s = &saved[index];
        let (sx, n1, q_r, k_r, v, attn, lse, h1, n2, g, u, a) =
            (s.x, s.n1, s.q_r, s.k_r, s.v, s.attn, s.lse, s.h1, s.n2, s.g, s.u, s.a);
        let params = &mut parameters[param_offset + index];
        let w = params.weights.clone();
        let p = |name: &str| format!("layers.{l}.{name}");
        let mm = |rows: u64, cols: u64| 2.0 * tokens_f * (rows * cols) as f64;
        let da = tmp(&mut b, p("silu_mul.out.grad"), tokens * f);
        b.matmul(p("w2.dgrad"), mm(f, h), &[dx, w["w2"]], &[da]);
        let gw2 = grad(&mut b, params, "w2", p("w2.grad"));
        b.matmul(p("w2.wgrad"), mm(f, h), &[dx, a], &[gw2]);
        let dg = tmp(&mut b, p("w1.out.grad"), tokens * f);
        let du = tmp(&mut b, p("w3.out.grad"), tokens * f);
        b.elementwise(p("silu_mul.backward"), &[da, g, u], &[dg, du]);
        let dn2 = tmp(&mut b, p("ffn_norm.out.grad"), tokens * h);
        b.matmul(p("w3.dgrad"), mm(h, f), &[du, w["w3"]], &[dn2]);
        let gw3 = grad(&mut b, params, "w3", p("w3.grad"));
        b.matmul(p("w3.wgrad"), mm(h, f), &[du, n2], &[gw3]);
        b.matmul(p("w1.dgrad"), mm(h, f), &[dg, w["w1"], dn2], &[dn2]);
        let gw1 = grad(&mut b, params, "w1", p("w1.grad"));
        b.matmul(p("w1.wgrad"), mm(h, f), &[dg, n2], &[gw1]);
        let dh1 = tmp(&mut b, p("attention_residual.grad"), tokens * h);
        let g_fn = grad(&mut b, params, "ffn_norm", p("ffn_norm.grad"));
        b.elementwise(p("ffn_norm.backward"), &[dn2, h1, w["ffn_norm"], dx], &[dh1, g_fn]);
        let dattn = tmp(&mut b, p("attention.out.grad"), tokens * h);
        b.matmul(p("wo.dgrad"), mm(h, h), &[dh1, w["wo"]], &[dattn]);
        let gwo = grad(&mut b, params, "wo", p("wo.grad"));
        b.matmul(p("wo.wgrad"), mm(h, h), &[dh1, attn], &[gwo]);
        let dq = tmp(&mut b, p("q.grad"), tokens * h);
        let dk = tmp(&mut b, p("k.grad"), tokens * kv);
        let dv = tmp(&mut b, p("v.grad"), tokens * kv);
        b.op(
            p("flash_attention.backward"),
            2.5 * attention_flops,
            attention_rate,
            &[dattn, q_r, k_r, v, attn, lse],
            &[dq, dk, dv],
        );
        b.elementwise(p("rope.backward"), &[dq, dk], &[dq, dk]);
        let dn1 = tmp(&mut b, p("attention_norm.out.grad"), tokens * h);
        b.matmul(p("wq.dgrad"), mm(h, h), &[dq, w["wq"]], &[dn1]);
        let gwq = grad(&mut b, params, "wq", p("wq.grad"));
        b.matmul(p("wq.wgrad"), mm(h, h), &[dq, n1], &[gwq]);
        b.matmul(p("wk.dgrad"), mm(h, kv), &[dk, w["wk"], dn1], &[dn1]);
        let gwk = grad(&mut b, params, "wk", p("wk.grad"));
        b.matmul(p("wk.wgrad"), mm(h, kv), &[dk, n1], &[gwk]);
        b.matmul(p("wv.dgrad"), mm(h, kv), &[dv, w["wv"], dn1], &[dn1]);
        let gwv = grad(&mut b, params, "wv", p("wv.grad"));
        b.matmul(p("wv.wgrad"), mm(h, kv), &[dv, n1], &[gwv]);
        let dx_in = tmp(&mut b, p("x.grad"), tokens * h);
        let g_an = grad(&mut b, params, "attention_norm", p("attention_norm.grad"));
        b.elementwise(p("attention_norm.backward"), &[dn1, sx, w["attention_norm"], dh1], &[dx_in, g_an]);
        dx = dx_in;
    }
    b.layer = None;
    if has_embedding {
        let g_emb = grad(&mut b, &mut parameters[0], "tok_embeddings", "tok_embeddings.grad".into());
        b.elementwise("tok_embeddings.backward".into(), &[dx], &[g_emb]);
    } else {
        b.elementwise("send_gradients".into(), &[dx], &[]);
    }

    // AdamW step, one fused kernel per parameter tensor (reads g, w, m, v; writes w, m, v).
    b.phase = Phase::Optimizer;
    for (index, params) in parameters.iter().enumerate() {
        b.layer = if has_embedding && index == 0 || index == parameters.len() - 1 {
            None
        } else {
            Some(first_layer + (index - param_offset) as u32)
        };
        for name in &params.names {
            let w = params.weights[name];
            let g = params.gradients[name];
            let label = b.tensors[w].name.clone();
            let elements = b.tensors[w].size_bytes / e;
            let m = b.tensor(format!("{label}.exp_avg"), elements * 4, TensorKind::OptimizerState);
            let v = b.tensor(format!("{label}.exp_avg_sq"), elements * 4, TensorKind::OptimizerState);
            let mut state = vec![m, v];
            if model.dtype == Dtype::Bf16 {
                let master = b.tensor(format!("{label}.master"), elements * 4, TensorKind::OptimizerState);
                state.push(master);
            }
            let mut reads = vec![g];
            reads.extend(&state);
            let mut writes = vec![w];
            writes.extend(&state);
            b.elementwise(format!("{label}.adamw"), &reads, &writes);
        }
    }

    let description = format!(
        "{} {:?} layers {} (this stage {}..{}) hidden {} heads {}/{} ffn {} vocab {} seq {} batch {} on {}",
        model.name,
        model.dtype,
        model.layers,
        first_layer,
        model.layers,
        h,
        model.heads,
        model.kv_heads,
        f,
        model.vocab,
        model.sequence,
        model.batch,
        gpu.name
    );
    let trace = b.finish(description);
    trace.validate()?;
    Ok(trace)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hardware::gpu_preset;

    #[test]
    fn llama3_8b_has_8b_parameters() {
        let model = model_preset("llama3-8b").unwrap();
        let count = model.parameter_count() as f64;
        assert!((7.9e9..8.2e9).contains(&count), "{count}");
        let model = model_preset("llama3-70b").unwrap();
        let count = model.parameter_count() as f64;
        assert!((70.0e9..71.0e9).contains(&count), "{count}");
    }

    #[test]
    fn generated_trace_is_valid_and_sized_like_the_model() {
        let model = model_preset("tiny").unwrap();
        let gpu = gpu_preset("h100").unwrap();
        let trace = generate(&model, &gpu).unwrap();
        trace.validate().unwrap();
        let weight_bytes = trace.bytes_by_kind(TensorKind::Weight);
        assert_eq!(weight_bytes, model.parameter_count() * 4);
        // AdamW keeps two fp32 moments per parameter.
        assert_eq!(trace.bytes_by_kind(TensorKind::OptimizerState), 2 * weight_bytes);
        assert_eq!(trace.bytes_by_kind(TensorKind::Gradient), weight_bytes);
        assert!(trace.compute_time_us() > 0.0);
    }

    #[test]
    fn bf16_adds_master_weights() {
        let mut model = model_preset("tiny").unwrap();
        model.dtype = Dtype::Bf16;
        let trace = generate(&model, &gpu_preset("a100").unwrap()).unwrap();
        let params = model.parameter_count();
        assert_eq!(trace.bytes_by_kind(TensorKind::Weight), params * 2);
        assert_eq!(trace.bytes_by_kind(TensorKind::OptimizerState), params * 12);
    }

    #[test]
    fn pipeline_stage_holds_its_share_of_layers() {
        let mut model = model_preset("tiny").unwrap();
        model.pipeline_stages = 2;
        let trace = generate(&model, &gpu_preset("h100").unwrap()).unwrap();
        let layers: std::collections::BTreeSet<u32> = trace.ops.iter().filter_map(|op| op.layer).collect();
        assert_eq!(layers.into_iter().collect::<Vec<_>>(), vec![2, 3]);
    }
}
