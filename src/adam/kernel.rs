//! The per-element Adam update and the loops around it, compiled once per instruction set.
//!
//! The loops are plain Rust that LLVM auto-vectorises; each `#[target_feature]` wrapper below inlines
//! them again so the same source becomes AVX-512, AVX2+FMA or baseline code. Rounding is identical on
//! every path: only IEEE `+ - * / sqrt` and fused multiply-adds written as `mul_add` are used, so the
//! paths agree bit for bit (a property test checks this).

use super::elem::{Load, Store};

/// The scalars of one step, rounded to `f32` the way torch rounds a Python float operand of an
/// `f32` tensor op. Built by `Coeffs::new`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Coeffs {
    /// `1 - lr * weight_decay` for decoupled decay, else 1 (an exact no-op multiply).
    pub decay: f32,
    /// `weight_decay` for L2 decay (added to the gradient), else 0.
    pub l2: f32,
    /// Multiplies every gradient before use (clipping, loss-scale removal); 1 = none.
    pub grad_scale: f32,
    /// `lerp` coefficient: `1 - beta1`, or `-beta1` when `1 - beta1 >= 0.5` (torch's two-sided lerp).
    pub lerp_w: f32,
    /// Whether `lerp` anchors at `exp_avg` (weight < 0.5) or at the gradient.
    pub lerp_from_avg: bool,
    pub beta2: f32,
    pub one_minus_beta2: f32,
    /// `sqrt(1 - beta2^step)`, computed as `(..) ** 0.5` like torch.
    pub bc2_sqrt: f32,
    pub eps: f32,
    /// `-lr / (1 - beta1^step)`.
    pub neg_step_size: f32,
    /// Index (in the slices a loop is given) from which elements are updated as torch's fused AdamW
    /// updates the last `numel % 8` elements of a tensor: in a scalar loop its compiler contracts
    /// differently (`update::<true>`). `usize::MAX`: none.
    pub tail_from: usize,
}

/// Hyper-parameters of one step as `f64`, the precision torch's Python side computes them in.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Hyper {
    /// Learning rate (>= 0).
    pub lr: f64,
    /// First-moment decay, in [0, 1).
    pub beta1: f64,
    /// Second-moment decay, in [0, 1).
    pub beta2: f64,
    /// Added to the denominator (>= 0).
    pub eps: f64,
    /// Weight decay (>= 0).
    pub weight_decay: f64,
    /// AdamW (`p -= lr * wd * p`) when true, Adam's L2 term (`g += wd * p`) when false.
    pub decoupled: bool,
    /// The step number after this update: 1 on the first step. Drives bias correction.
    pub step: u64,
    /// Gradients are multiplied by this before anything else (1.0 = unchanged).
    pub grad_scale: f32,
}

impl Coeffs {
    pub(crate) fn new(h: &Hyper) -> Coeffs {
        // Same expressions, in f64, as torch.optim.adam._single_tensor_adam; torch then rounds each
        // scalar to the tensor's dtype when the op runs.
        let wd = h.weight_decay;
        let step = h.step as f64;
        let w1 = (1.0 - h.beta1) as f32;
        let lerp_from_avg = w1.abs() < 0.5;
        Coeffs {
            decay: if h.decoupled && wd != 0.0 {
                (1.0 - h.lr * wd) as f32
            } else {
                1.0
            },
            l2: if h.decoupled { 0.0 } else { wd as f32 },
            grad_scale: h.grad_scale,
            lerp_w: if lerp_from_avg { w1 } else { w1 - 1.0 },
            lerp_from_avg,
            beta2: h.beta2 as f32,
            one_minus_beta2: (1.0 - h.beta2) as f32,
            bc2_sqrt: (1.0 - h.beta2.powf(step)).powf(0.5) as f32,
            eps: h.eps as f32,
            neg_step_size: (-(h.lr / (1.0 - h.beta1.powf(step)))) as f32,
            tail_from: usize::MAX,
        }
    }
}

/// One element: returns the new (master, exp_avg, exp_avg_sq). The order of operations mirrors torch's
/// fused AdamW on CPU, including where its kernels fuse a multiply-add (`lerp`, `add(alpha=)`,
/// `addcmul`); checked bit for bit against torch 2.x on AVX-512. `TAIL`: an element of a tensor's scalar
/// tail in torch (its last `numel % 8`), whose second moment its compiler contracts the other way (found
/// element by element against torch 2.15's fused CPU AdamW; every other operation agrees).
#[inline(always)]
fn update<const TAIL: bool>(c: &Coeffs, p: f32, m: f32, v: f32, g: f32) -> (f32, f32, f32) {
    // param.mul_(1 - lr * wd)
    let p = p * c.decay;
    // clip_grad_norm_'s grad.mul_(clip_coef), then grad.add(param, alpha=wd)
    let g = p.mul_add(c.l2, g * c.grad_scale);
    // exp_avg.lerp_(grad, 1 - beta1)
    let base = if c.lerp_from_avg { m } else { g };
    let m = c.lerp_w.mul_add(g - m, base);
    // exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2): `self * beta2 + value * t1 * t2`,
    // contracted to fma(value * t1, t2, self * beta2) in torch's vector loop and to
    // fma(self, beta2, value * t1 * t2) in its scalar tail.
    let v = if TAIL {
        v.mul_add(c.beta2, (c.one_minus_beta2 * g) * g)
    } else {
        (c.one_minus_beta2 * g).mul_add(g, v * c.beta2)
    };
    (descend(c, p, m, v), m, v)
}

/// The bias-corrected step of a decayed master `p` from this step's moments: `update`'s last part, and
/// all of `redo`, so the two agree bit for bit.
#[inline(always)]
fn descend(c: &Coeffs, p: f32, m: f32, v: f32) -> f32 {
    // (exp_avg_sq.sqrt() / bc2_sqrt).add_(eps). Our sqrt is correctly rounded; torch's (MKL VML) can be
    // one ulp off: the one place where the two may differ by more than a rounding of the same expression.
    let d = v.sqrt() / c.bc2_sqrt + c.eps;
    // param.addcdiv_(exp_avg, denom, value=-step_size)
    p + c.neg_step_size * m / d
}

/// The master after this step from the master before it and moments that already hold this step's
/// gradient (`m`, `v` as `update` returned them): `update`'s master, bit for bit, for any lr, eps and
/// decoupled weight decay — the only coefficients the moments do not depend on. Written cast into `out`.
#[inline(always)]
pub(crate) fn redo_into<P: Store>(c: &Coeffs, w: &mut [f32], m: &[f32], v: &[f32], out: &mut [P]) {
    let n = w.len();
    let (m, v, out) = (&m[..n], &v[..n], &mut out[..n]);
    for i in 0..n {
        let p = descend(c, w[i] * c.decay, m[i], v[i]);
        w[i] = p;
        out[i] = P::store(p);
    }
}

/// As `redo_into`, for an `f32` param that is its own master.
#[inline(always)]
pub(crate) fn redo_in_place(c: &Coeffs, w: &mut [f32], m: &[f32], v: &[f32]) {
    let n = w.len();
    let (m, v) = (&m[..n], &v[..n]);
    for i in 0..n {
        w[i] = descend(c, w[i] * c.decay, m[i], v[i]);
    }
}

/// Updates `w`, `m`, `v` in place from `g` and writes the new master, cast, into `out`: the elements
/// before `c.tail_from` as torch's vector loop, the rest as its scalar tail.
/// All slices have the same length (checked by the caller).
#[inline(always)]
pub(crate) fn into<G: Load, P: Store>(
    c: &Coeffs,
    w: &mut [f32],
    m: &mut [f32],
    v: &mut [f32],
    g: &[G],
    out: &mut [P],
) {
    let t = c.tail_from.min(w.len());
    let (w, wt) = w.split_at_mut(t);
    let (m, mt) = m.split_at_mut(t);
    let (v, vt) = v.split_at_mut(t);
    let (g, gt) = g.split_at(t);
    let (out, outt) = out.split_at_mut(t);
    span_into::<false, G, P>(c, w, m, v, g, out);
    span_into::<true, G, P>(c, wt, mt, vt, gt, outt);
}

/// `into` over one kind of element (`TAIL`); re-sliced so bounds checks vanish.
#[inline(always)]
fn span_into<const TAIL: bool, G: Load, P: Store>(
    c: &Coeffs,
    w: &mut [f32],
    m: &mut [f32],
    v: &mut [f32],
    g: &[G],
    out: &mut [P],
) {
    let n = w.len();
    let (m, v, g, out) = (&mut m[..n], &mut v[..n], &g[..n], &mut out[..n]);
    for i in 0..n {
        let (p, mi, vi) = update::<TAIL>(c, w[i], m[i], v[i], g[i].load());
        w[i] = p;
        m[i] = mi;
        v[i] = vi;
        out[i] = P::store(p);
    }
}

/// As `into`, for an `f32` param that is its own master.
#[inline(always)]
pub(crate) fn in_place<G: Load>(c: &Coeffs, w: &mut [f32], m: &mut [f32], v: &mut [f32], g: &[G]) {
    let t = c.tail_from.min(w.len());
    let (w, wt) = w.split_at_mut(t);
    let (m, mt) = m.split_at_mut(t);
    let (v, vt) = v.split_at_mut(t);
    let (g, gt) = g.split_at(t);
    span_in_place::<false, G>(c, w, m, v, g);
    span_in_place::<true, G>(c, wt, mt, vt, gt);
}

/// `in_place` over one kind of element (`TAIL`); re-sliced so bounds checks vanish.
#[inline(always)]
fn span_in_place<const TAIL: bool, G: Load>(
    c: &Coeffs,
    w: &mut [f32],
    m: &mut [f32],
    v: &mut [f32],
    g: &[G],
) {
    let n = w.len();
    let (m, v, g) = (&mut m[..n], &mut v[..n], &g[..n]);
    for i in 0..n {
        let (p, mi, vi) = update::<TAIL>(c, w[i], m[i], v[i], g[i].load());
        w[i] = p;
        m[i] = mi;
        v[i] = vi;
    }
}

/// The loops compiled for AVX-512 (F, BW, VL) with FMA.
#[cfg(target_arch = "x86_64")]
pub(crate) mod avx512 {
    use super::*;

    /// # Safety
    /// The CPU must support avx512f, avx512bw, avx512vl, avx2 and fma (`Isa::Avx512` is only chosen
    /// after `is_x86_feature_detected!` says so).
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
    pub(crate) unsafe fn into<G: Load, P: Store>(
        c: &Coeffs,
        w: &mut [f32],
        m: &mut [f32],
        v: &mut [f32],
        g: &[G],
        out: &mut [P],
    ) {
        super::into(c, w, m, v, g, out)
    }

    /// # Safety
    /// As for `into`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
    pub(crate) unsafe fn in_place<G: Load>(
        c: &Coeffs,
        w: &mut [f32],
        m: &mut [f32],
        v: &mut [f32],
        g: &[G],
    ) {
        super::in_place(c, w, m, v, g)
    }

    /// # Safety
    /// As for `into`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
    pub(crate) unsafe fn redo_into<P: Store>(
        c: &Coeffs,
        w: &mut [f32],
        m: &[f32],
        v: &[f32],
        out: &mut [P],
    ) {
        super::redo_into(c, w, m, v, out)
    }

    /// # Safety
    /// As for `into`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
    pub(crate) unsafe fn redo_in_place(c: &Coeffs, w: &mut [f32], m: &[f32], v: &[f32]) {
        super::redo_in_place(c, w, m, v)
    }
}

/// The loops compiled for AVX2 with FMA.
#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2 {
    use super::*;

    /// # Safety
    /// The CPU must support avx2 and fma (`Isa::Avx2` is only chosen after detection).
    #[target_feature(enable = "avx2,fma")]
    pub(crate) unsafe fn into<G: Load, P: Store>(
        c: &Coeffs,
        w: &mut [f32],
        m: &mut [f32],
        v: &mut [f32],
        g: &[G],
        out: &mut [P],
    ) {
        super::into(c, w, m, v, g, out)
    }

    /// # Safety
    /// As for `into`.
    #[target_feature(enable = "avx2,fma")]
    pub(crate) unsafe fn in_place<G: Load>(
        c: &Coeffs,
        w: &mut [f32],
        m: &mut [f32],
        v: &mut [f32],
        g: &[G],
    ) {
        super::in_place(c, w, m, v, g)
    }

    /// # Safety
    /// As for `into`.
    #[target_feature(enable = "avx2,fma")]
    pub(crate) unsafe fn redo_into<P: Store>(
        c: &Coeffs,
        w: &mut [f32],
        m: &[f32],
        v: &[f32],
        out: &mut [P],
    ) {
        super::redo_into(c, w, m, v, out)
    }

    /// # Safety
    /// As for `into`.
    #[target_feature(enable = "avx2,fma")]
    pub(crate) unsafe fn redo_in_place(c: &Coeffs, w: &mut [f32], m: &[f32], v: &[f32]) {
        super::redo_in_place(c, w, m, v)
    }
}
