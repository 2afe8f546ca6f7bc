//! The CPU Adam/AdamW step over host-resident optimizer state, for the offload runtime's CPU
//! update: one pass per element reads the fp32 master, the gradient (fp32, or bf16 as it came
//! off the GPU), the two moments, and writes the master, the moments and, where asked, the bf16
//! copy the GPU computes with. torch's fused CPU AdamW needs its gradient widened to fp32 and
//! the copy rounded in passes of their own; here they are part of the one pass, which halves the
//! gradient's bytes over the host link and adds no traffic to host memory, the step's bound.
//!
//! The arithmetic is that of torch's fused CPU kernel (`ATen/native/cpu/FusedAdamKernel.cpp`,
//! its vectorised loop): the scalars are formed in f64 and rounded to f32 once, the first moment
//! is a fused multiply-add (`lerp`), and every other operation rounds in the same order. Each
//! element depends on nothing but its own inputs, so the result does not depend on the number of
//! threads or on how the tensors are split among them.

use rayon::prelude::*;

/// Elements per task: large enough that a task's setup is noise, small enough to balance
/// threads over tensors of very different sizes. A multiple of 16 so that tasks start on cache
/// lines of every buffer (f32 and bf16).
pub const TASK_ELEMENTS: usize = 1 << 16;

/// The hyperparameters of one step of one parameter group.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Hyper {
    pub lr: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
    /// AdamW's decoupled decay (`param *= 1 - lr * weight_decay`); false: Adam's L2 term
    /// (`grad += weight_decay * param`).
    pub decoupled: bool,
    pub maximize: bool,
}

/// A gradient as the host holds it.
#[derive(Clone, Copy, Debug)]
pub enum Grad<'a> {
    F32(&'a [f32]),
    /// bf16 bit patterns, widened exactly (`f32::from_bits(bits << 16)`).
    Bf16(&'a [u16]),
}

impl Grad<'_> {
    fn len(&self) -> usize {
        match self {
            Grad::F32(values) => values.len(),
            Grad::Bf16(values) => values.len(),
        }
    }
}

/// One parameter's buffers and its step count (already advanced for this step, as torch does
/// before its kernel runs).
#[derive(Debug)]
pub struct Tensor<'a> {
    pub param: &'a mut [f32],
    pub grad: Grad<'a>,
    pub exp_avg: &'a mut [f32],
    pub exp_avg_sq: &'a mut [f32],
    /// Where the updated parameter's bf16 copy goes (round to nearest even, as torch casts).
    pub copy: Option<&'a mut [u16]>,
    pub step: f64,
}

/// Why a step was refused (nothing was written).
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum StepError {
    #[error("tensor {index}: {what} holds {found} elements, the parameter {expected}")]
    Length { index: usize, what: &'static str, found: usize, expected: usize },
    #[error("tensor {index}: step {step} is not a positive count")]
    Step { index: usize, step: f64 },
    #[error("vector width {0} is not one of 0, 1, 2, 4, 8 or 16 f32 elements")]
    VectorWidth(usize),
}

/// The f32 constants of one tensor's step, formed as torch forms them (f64, rounded once).
#[derive(Clone, Copy, Debug)]
struct Constants {
    /// `1 - beta1`, the lerp's weight, and the lerp's form (`|weight| < 0.5`).
    lerp_weight: f32,
    lerp_small: bool,
    beta2: f32,
    one_minus_beta2: f32,
    bias_correction2_sqrt: f32,
    eps: f32,
    neg_step_size: f32,
    /// AdamW: the parameter's decay factor; Adam: the L2 coefficient. None: no weight decay.
    decay: Option<f32>,
    decoupled: bool,
    maximize: bool,
    grad_scale: Option<f32>,
}

impl Constants {
    fn new(hyper: &Hyper, step: f64, grad_scale: Option<f32>) -> Self {
        let bias_correction1 = 1.0 - hyper.beta1.powf(step);
        let bias_correction2 = 1.0 - hyper.beta2.powf(step);
        let step_size = hyper.lr / bias_correction1;
        let lerp_weight = (1.0 - hyper.beta1) as f32;
        let factor =
            if hyper.decoupled { (1.0 - hyper.lr * hyper.weight_decay) as f32 } else { hyper.weight_decay as f32 };
        let decay = (hyper.weight_decay != 0.0).then_some(factor);
        Constants {
            lerp_weight,
            lerp_small: lerp_weight.abs() < 0.5,
            beta2: hyper.beta2 as f32,
            one_minus_beta2: (1.0 - hyper.beta2) as f32,
            bias_correction2_sqrt: bias_correction2.sqrt() as f32,
            eps: hyper.eps as f32,
            neg_step_size: (-step_size) as f32,
            decay,
            decoupled: hyper.decoupled,
            maximize: hyper.maximize,
            grad_scale,
        }
    }
}

/// The bf16 bit pattern of `value`, rounded to nearest even; NaN is the canonical quiet NaN
/// (torch's `c10::BFloat16` cast).
#[inline(always)]
pub fn bf16_bits(value: f32) -> u16 {
    if value.is_nan() {
        return 0x7fc0;
    }
    let bits = value.to_bits();
    ((bits + 0x7fff + ((bits >> 16) & 1)) >> 16) as u16
}

/// One element: returns the new (param, exp_avg, exp_avg_sq). `TAIL`: the form torch's scalar
/// tail loop rounds in (see `Partition`), else its vectorised loop's; the two differ in which
/// products the compiler fused into multiply-adds.
#[inline(always)]
fn element<const TAIL: bool>(
    c: &Constants,
    param: f32,
    mut grad: f32,
    exp_avg: f32,
    exp_avg_sq: f32,
) -> (f32, f32, f32) {
    if let Some(scale) = c.grad_scale {
        grad *= scale;
    }
    if c.maximize {
        grad = -grad;
    }
    // AdamW decays the parameter (applied below; nothing reads it before); Adam adds its L2 term.
    let decayed = match c.decay {
        Some(factor) if c.decoupled => param * factor,
        Some(l2) => {
            grad = param.mul_add(l2, grad);
            param
        }
        None => param,
    };
    let exp_avg = if c.lerp_small {
        c.lerp_weight.mul_add(grad - exp_avg, exp_avg)
    } else {
        (c.lerp_weight - 1.0).mul_add(grad - exp_avg, grad)
    };
    let exp_avg_sq = if TAIL {
        exp_avg_sq.mul_add(c.beta2, c.one_minus_beta2 * grad * grad)
    } else {
        (c.one_minus_beta2 * grad).mul_add(grad, exp_avg_sq * c.beta2)
    };
    let denom = exp_avg_sq.sqrt() / c.bias_correction2_sqrt + c.eps;
    (decayed + c.neg_step_size * exp_avg / denom, exp_avg, exp_avg_sq)
}

/// One contiguous range of one tensor.
struct Task<'a> {
    constants: Constants,
    /// In the form of torch's scalar tail loop.
    tail: bool,
    param: &'a mut [f32],
    grad: Grad<'a>,
    exp_avg: &'a mut [f32],
    exp_avg_sq: &'a mut [f32],
    copy: Option<&'a mut [u16]>,
}

#[inline(always)]
fn run_generic(task: Task<'_>) {
    if task.tail {
        run_form::<true>(task)
    } else {
        run_form::<false>(task)
    }
}

#[inline(always)]
fn run_form<const TAIL: bool>(task: Task<'_>) {
    let Task { constants: c, param, grad, exp_avg, exp_avg_sq, copy, .. } = task;
    // Monomorphised per gradient kind and copy, so that each loop vectorises with no branch.
    macro_rules! body {
        ($grad:expr, $copy:expr) => {
            for i in 0..param.len() {
                let (p, m, v) = element::<TAIL>(&c, param[i], $grad(i), exp_avg[i], exp_avg_sq[i]);
                param[i] = p;
                exp_avg[i] = m;
                exp_avg_sq[i] = v;
                $copy(i, p);
            }
        };
    }
    match (grad, copy) {
        (Grad::F32(g), None) => body!(|i: usize| g[i], |_: usize, _: f32| ()),
        (Grad::Bf16(g), None) => body!(|i: usize| f32::from_bits((g[i] as u32) << 16), |_: usize, _: f32| ()),
        (Grad::F32(g), Some(out)) => body!(|i: usize| g[i], |i: usize, p: f32| out[i] = bf16_bits(p)),
        (Grad::Bf16(g), Some(out)) => {
            body!(|i: usize| f32::from_bits((g[i] as u32) << 16), |i: usize, p: f32| out[i] = bf16_bits(p))
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn run_avx2_fma(task: Task<'_>) {
    run_generic(task)
}

fn run(task: Task<'_>, fma: bool) {
    #[cfg(target_arch = "x86_64")]
    if fma {
        // SAFETY: `fma` is true only where the CPU reports AVX2 and FMA (`cpu_has_fma`).
        unsafe { run_avx2_fma(task) };
        return;
    }
    let _ = fma;
    // Elsewhere `mul_add` is the library's fused multiply-add: the same bits, more slowly.
    run_generic(task)
}

fn cpu_has_fma() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Runs the CPU step on a pool of its own threads.
pub struct AdamW {
    pool: rayon::ThreadPool,
    fma: bool,
}

impl AdamW {
    /// A step over `threads` threads (at least one).
    pub fn new(threads: usize) -> std::io::Result<Self> {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads.max(1))
            .thread_name(|i| format!("teraio-adamw-{i}"))
            .build()
            .map_err(std::io::Error::other)?;
        Ok(AdamW { pool, fma: cpu_has_fma() })
    }

    pub fn threads(&self) -> usize {
        self.pool.current_num_threads()
    }

    /// Steps every tensor of one parameter group with `hyper`, the gradients first multiplied
    /// by `grad_scale` where given (a clip's coefficient, as `clip_grad_norm_` scales them in
    /// place). `vector_width`: which trailing elements round as torch's scalar tail does
    /// (`split`). Every length is checked before anything is written.
    pub fn step(
        &self,
        hyper: &Hyper,
        tensors: Vec<Tensor<'_>>,
        grad_scale: Option<f32>,
        vector_width: usize,
    ) -> Result<(), StepError> {
        for (index, t) in tensors.iter().enumerate() {
            let expected = t.param.len();
            let lengths = [
                ("the gradient", t.grad.len()),
                ("exp_avg", t.exp_avg.len()),
                ("exp_avg_sq", t.exp_avg_sq.len()),
                ("the copy", t.copy.as_ref().map_or(expected, |c| c.len())),
            ];
            if let Some((what, found)) = lengths.into_iter().find(|(_, n)| *n != expected) {
                return Err(StepError::Length { index, what, found, expected });
            }
            if !(t.step >= 1.0 && t.step.is_finite()) {
                return Err(StepError::Step { index, step: t.step });
            }
        }
        if !matches!(vector_width, 0 | 1 | 2 | 4 | 8 | 16) {
            return Err(StepError::VectorWidth(vector_width));
        }
        let mut tasks = Vec::new();
        for t in tensors {
            let constants = Constants::new(hyper, t.step, grad_scale);
            split(constants, t, vector_width, &mut tasks);
        }
        let fma = self.fma;
        self.pool.install(|| tasks.into_par_iter().for_each(|task| run(task, fma)));
        Ok(())
    }
}

/// `t` as tasks of at most `TASK_ELEMENTS` elements: its last `len % vector_width` elements in
/// the form of torch's scalar tail loop, the others in its vectorised loop's (0: none in the
/// tail's). torch's fused CPU kernel splits a tensor among threads in whole 64-byte lines, so
/// only the tensor's last range can end off a vector's boundary; measured against torch, its
/// AVX2 and AVX-512 builds alike round the last `len % 8` elements in the tail's order (the
/// AVX-512 build's compiler vectorises the tail loop 8 wide, in the vector loop's order).
fn split<'a>(constants: Constants, t: Tensor<'a>, vector_width: usize, tasks: &mut Vec<Task<'a>>) {
    let Tensor { mut param, mut grad, mut exp_avg, mut exp_avg_sq, mut copy, .. } = t;
    let tail_start = match vector_width {
        0 => param.len(),
        width => param.len() - param.len() % width,
    };
    let mut at = 0;
    while !param.is_empty() {
        let boundary = if at < tail_start { tail_start - at } else { param.len() };
        let n = param.len().min(TASK_ELEMENTS).min(boundary);
        let (p, p_rest) = std::mem::take(&mut param).split_at_mut(n);
        let (m, m_rest) = std::mem::take(&mut exp_avg).split_at_mut(n);
        let (v, v_rest) = std::mem::take(&mut exp_avg_sq).split_at_mut(n);
        let (g, g_rest) = match grad {
            Grad::F32(values) => {
                let (a, b) = values.split_at(n);
                (Grad::F32(a), Grad::F32(b))
            }
            Grad::Bf16(values) => {
                let (a, b) = values.split_at(n);
                (Grad::Bf16(a), Grad::Bf16(b))
            }
        };
        let (c, c_rest) = match copy.take() {
            Some(values) => {
                let (a, b) = values.split_at_mut(n);
                (Some(a), Some(b))
            }
            None => (None, None),
        };
        tasks.push(Task { constants, tail: at >= tail_start, param: p, grad: g, exp_avg: m, exp_avg_sq: v, copy: c });
        (param, exp_avg, exp_avg_sq, grad, copy) = (p_rest, m_rest, v_rest, g_rest, c_rest);
        at += n;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const ADAMW: Hyper =
        Hyper { lr: 1e-3, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.01, decoupled: true, maximize: false };

    /// torch's `AdamW` update in f64 (the reference formula, not the kernel's rounding).
    fn reference(h: &Hyper, step: f64, p: f64, g: f64, m: f64, v: f64) -> (f64, f64, f64) {
        let mut p = p;
        let mut g = if h.maximize { -g } else { g };
        if h.decoupled {
            p *= 1.0 - h.lr * h.weight_decay;
        } else {
            g += h.weight_decay * p;
        }
        let m = m + (1.0 - h.beta1) * (g - m);
        let v = h.beta2 * v + (1.0 - h.beta2) * g * g;
        let bc1 = 1.0 - h.beta1.powf(step);
        let bc2 = 1.0 - h.beta2.powf(step);
        (p - h.lr / bc1 * m / (v.sqrt() / bc2.sqrt() + h.eps), m, v)
    }

    fn run_one(h: &Hyper, threads: usize, tensor: Tensor<'_>) {
        AdamW::new(threads).unwrap().step(h, vec![tensor], None, 8).unwrap();
    }

    #[test]
    fn close_to_the_f64_formula_over_steps() {
        for hyper in [ADAMW, Hyper { decoupled: false, maximize: true, ..ADAMW }] {
            let n = 1000;
            let mut p: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin()).collect();
            let mut m = vec![0f32; n];
            let mut v = vec![0f32; n];
            let (mut rp, mut rm, mut rv): (Vec<f64>, Vec<f64>, Vec<f64>) =
                (p.iter().map(|&x| x as f64).collect(), vec![0.0; n], vec![0.0; n]);
            for step in 1..=5 {
                let g: Vec<f32> = (0..n).map(|i| ((i * step) as f32 * 0.11).cos() * 0.1).collect();
                let t = Tensor {
                    param: &mut p,
                    grad: Grad::F32(&g),
                    exp_avg: &mut m,
                    exp_avg_sq: &mut v,
                    copy: None,
                    step: step as f64,
                };
                run_one(&hyper, 3, t);
                for i in 0..n {
                    (rp[i], rm[i], rv[i]) = reference(&hyper, step as f64, rp[i], g[i] as f64, rm[i], rv[i]);
                }
            }
            for i in 0..n {
                assert!((p[i] as f64 - rp[i]).abs() <= 1e-6 * rp[i].abs().max(1e-3), "{i}: {} vs {}", p[i], rp[i]);
                // The moments may cancel to near zero: within a few ulps of the gradients' scale.
                assert!((m[i] as f64 - rm[i]).abs() <= 1e-7, "{i}: {} vs {}", m[i], rm[i]);
                assert!((v[i] as f64 - rv[i]).abs() <= 1e-10, "{i}: {} vs {}", v[i], rv[i]);
            }
        }
    }

    #[test]
    fn bf16_rounding_is_nearest_even_with_a_canonical_nan() {
        assert_eq!(bf16_bits(1.0), 0x3f80);
        // Halfway between 0x3f80 and 0x3f81: to even (down); above half: up.
        assert_eq!(bf16_bits(f32::from_bits(0x3f80_8000)), 0x3f80);
        assert_eq!(bf16_bits(f32::from_bits(0x3f81_8000)), 0x3f82);
        assert_eq!(bf16_bits(f32::from_bits(0x3f80_8001)), 0x3f81);
        assert_eq!(bf16_bits(f32::NAN), 0x7fc0);
        assert_eq!(bf16_bits(f32::INFINITY), 0x7f80);
        assert_eq!(bf16_bits(f32::MAX), 0x7f80); // rounds up to infinity, as torch's cast does
    }

    #[test]
    fn lengths_steps_and_widths_are_checked_before_anything_is_written() {
        let adam = AdamW::new(1).unwrap();
        let (mut p, mut m, g) = (vec![1f32; 4], vec![0f32; 4], vec![1f32; 4]);
        let mut attempt = |v_len: usize, step: f64, width: usize| {
            let mut v = vec![0f32; v_len];
            let t =
                Tensor { param: &mut p, grad: Grad::F32(&g), exp_avg: &mut m, exp_avg_sq: &mut v, copy: None, step };
            adam.step(&ADAMW, vec![t], None, width).unwrap_err()
        };
        assert_eq!(attempt(3, 1.0, 8), StepError::Length { index: 0, what: "exp_avg_sq", found: 3, expected: 4 });
        assert_eq!(attempt(4, 0.0, 8), StepError::Step { index: 0, step: 0.0 });
        assert_eq!(attempt(4, 1.0, 3), StepError::VectorWidth(3));
        assert_eq!((p, m), (vec![1f32; 4], vec![0f32; 4]));
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(24))]
        /// The same bits whatever the threads, the split into tasks or the gradient's form: a
        /// bf16 gradient equals its exact widening, the copy is the rounded master, and a
        /// gradient scale equals the gradient scaled beforehand.
        #[test]
        fn bits_do_not_depend_on_threads_split_or_gradient_form(
            n in 1usize..(2 * TASK_ELEMENTS + 40),
            threads in 1usize..5,
            seed in 0u32..1000,
            scale in prop::option::of(0.01f32..1.0),
        ) {
            let value = |i: usize, k: u32| (((i as u32).wrapping_mul(2654435761) ^ seed.wrapping_mul(k)) as f32 / u32::MAX as f32) - 0.5;
            let p0: Vec<f32> = (0..n).map(|i| value(i, 7)).collect();
            let m0: Vec<f32> = (0..n).map(|i| value(i, 11) * 0.01).collect();
            let v0: Vec<f32> = (0..n).map(|i| value(i, 13).abs() * 1e-4).collect();
            let g16: Vec<u16> = (0..n).map(|i| bf16_bits(value(i, 17))).collect();
            let g32: Vec<f32> = g16.iter().map(|&b| f32::from_bits((b as u32) << 16)).collect();
            let scaled: Vec<f32> = g32.iter().map(|&g| scale.map_or(g, |s| g * s)).collect();

            let (mut p1, mut m1, mut v1) = (p0.clone(), m0.clone(), v0.clone());
            let mut copy = vec![0u16; n];
            AdamW::new(threads).unwrap().step(&ADAMW, vec![Tensor {
                param: &mut p1, grad: Grad::Bf16(&g16), exp_avg: &mut m1, exp_avg_sq: &mut v1,
                copy: Some(&mut copy), step: 3.0,
            }], scale, 8).unwrap();

            let (mut p2, mut m2, mut v2) = (p0.clone(), m0.clone(), v0.clone());
            let t = Tensor { param: &mut p2, grad: Grad::F32(&scaled), exp_avg: &mut m2, exp_avg_sq: &mut v2, copy: None, step: 3.0 };
            run_one(&ADAMW, 1, t);
            prop_assert!(p1.iter().zip(&p2).all(|(a, b)| a.to_bits() == b.to_bits()));
            prop_assert!(m1.iter().zip(&m2).all(|(a, b)| a.to_bits() == b.to_bits()));
            prop_assert!(v1.iter().zip(&v2).all(|(a, b)| a.to_bits() == b.to_bits()));
            prop_assert!(copy.iter().zip(&p1).all(|(&c, &p)| c == bf16_bits(p)));
        }
    }
}
