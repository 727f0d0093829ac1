//! CPU Adam / AdamW over `f32` master weights and states, with the gradient read and the model param
//! written in `f32`, bf16 or fp16 in the same pass.
//!
//! One pass per element: up-cast the gradient, apply weight decay (AdamW's decoupled `p *= 1 - lr*wd`
//! or Adam's L2 `g += wd*p`), update both moments, apply the bias-corrected step to the master, and
//! store the master rounded to the param dtype. The math follows torch's single-tensor AdamW op by op,
//! with its scalars rounded to `f32` where torch rounds them, so results agree with torch to an ulp or so.
//!
//! The instruction set is chosen at run time (`Isa::detect`): the same loops are compiled for AVX-512,
//! AVX2+FMA and the baseline target, so one wheel is fast on every x86-64 machine. Work is split over
//! rayon's global pool in chunks of `CHUNK` elements.

mod elem;
mod kernel;
#[cfg(test)]
mod tests;

use rayon::prelude::*;

use crate::error::{Error, Result};
pub use elem::{Bf16, Load, Store, F16};
use kernel::Coeffs;
pub use kernel::Hyper;

/// Elements per unit of parallel work (64 Ki: 256 KiB of each `f32` array, enough to amortise
/// scheduling and small enough to balance a few million elements over many cores).
pub const CHUNK: usize = 1 << 16;

/// A gradient, read-only, in one of the supported dtypes.
#[derive(Debug)]
pub enum Grad<'a> {
    F32(&'a [f32]),
    Bf16(&'a [Bf16]),
    F16(&'a [F16]),
}

/// A model param to receive the updated master, rounded to its dtype.
#[derive(Debug)]
pub enum Param<'a> {
    F32(&'a mut [f32]),
    Bf16(&'a mut [Bf16]),
    F16(&'a mut [F16]),
}

impl Param<'_> {
    /// Elements of the param.
    pub fn len(&self) -> usize {
        match self {
            Param::F32(p) => p.len(),
            Param::Bf16(p) => p.len(),
            Param::F16(p) => p.len(),
        }
    }

    /// Whether it has no element.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// The optimizer state of one tensor (or of a contiguous slice of one), all `f32`, updated in place.
#[derive(Debug)]
pub struct State<'a> {
    /// Master weights. With no separate `Param`, this is the model param itself.
    pub master: &'a mut [f32],
    /// First moment.
    pub exp_avg: &'a mut [f32],
    /// Second moment.
    pub exp_avg_sq: &'a mut [f32],
}

/// An instruction set the kernel is compiled for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Isa {
    /// x86-64 with AVX-512 F/BW/VL and FMA.
    Avx512,
    /// x86-64 with AVX2 and FMA.
    Avx2,
    /// The build target's baseline (SSE2 on x86-64, NEON on aarch64). On an x86-64 CPU without FMA
    /// (before 2013) `mul_add` is a libm call there: same bits, several times slower.
    Portable,
}

impl Isa {
    /// The best instruction set this CPU supports.
    pub fn detect() -> Isa {
        [Isa::Avx512, Isa::Avx2]
            .into_iter()
            .find(|i| i.available())
            .unwrap_or(Isa::Portable)
    }

    /// Whether this CPU can run the kernel compiled for `self`.
    pub fn available(self) -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::is_x86_feature_detected as has;
            match self {
                Isa::Avx512 => {
                    has!("avx512f") && has!("avx512bw") && has!("avx512vl") && has!("fma")
                }
                Isa::Avx2 => has!("avx2") && has!("fma"),
                Isa::Portable => true,
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            self == Isa::Portable
        }
    }

    /// Lower-case name: "avx512", "avx2" or "portable".
    pub fn name(self) -> &'static str {
        match self {
            Isa::Avx512 => "avx512",
            Isa::Avx2 => "avx2",
            Isa::Portable => "portable",
        }
    }
}

/// One Adam/AdamW step over a tensor, on the best instruction set of this CPU.
///
/// `param`: where to store the updated master rounded to the param dtype; `None` when `state.master`
/// is the (`f32`) model param itself. All slices must have the same length.
pub fn step(h: &Hyper, state: State<'_>, grad: Grad<'_>, param: Option<Param<'_>>) -> Result<()> {
    step_with(Isa::detect(), h, state, grad, param)
}

/// `step`, the elements from index `tail_from` on updated as torch's fused AdamW updates a tensor's
/// scalar tail (its last `numel % 8` elements; see `kernel::update`).
pub fn step_tail(
    h: &Hyper,
    tail_from: usize,
    state: State<'_>,
    grad: Grad<'_>,
    param: Option<Param<'_>>,
) -> Result<()> {
    run(Isa::detect(), h, tail_from, state, grad, param)
}

/// `step` on a given instruction set (tests and benchmarks compare them); an error if this CPU lacks it.
pub fn step_with(
    isa: Isa,
    h: &Hyper,
    state: State<'_>,
    grad: Grad<'_>,
    param: Option<Param<'_>>,
) -> Result<()> {
    run(isa, h, usize::MAX, state, grad, param)
}

fn run(
    isa: Isa,
    h: &Hyper,
    tail_from: usize,
    state: State<'_>,
    grad: Grad<'_>,
    param: Option<Param<'_>>,
) -> Result<()> {
    if !isa.available() {
        return bad(format!("this CPU cannot run the {} kernel", isa.name()));
    }
    check(h, &state, &grad, param.as_ref())?;
    let c = Coeffs {
        tail_from,
        ..Coeffs::new(h)
    };
    match grad {
        Grad::F32(g) => with_grad(isa, &c, state, g, param),
        Grad::Bf16(g) => with_grad(isa, &c, state, g, param),
        Grad::F16(g) => with_grad(isa, &c, state, g, param),
    }
    Ok(())
}

/// The master (and `param`) after this step, from the master before it and moments that already hold
/// this step's gradient — the same step run again with another lr, eps or decoupled weight decay, the
/// coefficients the moments do not depend on (`Hyper::grad_scale` is not used). Bit for bit what `step`
/// gives for the master with those coefficients. All slices have the same length.
pub fn redo(
    h: &Hyper,
    master: &mut [f32],
    exp_avg: &[f32],
    exp_avg_sq: &[f32],
    param: Option<Param<'_>>,
) -> Result<()> {
    redo_with(Isa::detect(), h, master, exp_avg, exp_avg_sq, param)
}

/// `redo` on a given instruction set (tests compare them); an error if this CPU lacks it.
pub fn redo_with(
    isa: Isa,
    h: &Hyper,
    master: &mut [f32],
    exp_avg: &[f32],
    exp_avg_sq: &[f32],
    param: Option<Param<'_>>,
) -> Result<()> {
    if !isa.available() {
        return bad(format!("this CPU cannot run the {} kernel", isa.name()));
    }
    let n = master.len();
    let plen = param.as_ref().map(Param::len);
    if exp_avg.len() != n || exp_avg_sq.len() != n || plen.is_some_and(|l| l != n) {
        return bad(format!(
            "adam redo: lengths differ: master {n}, exp_avg {}, exp_avg_sq {}, param {plen:?}",
            exp_avg.len(),
            exp_avg_sq.len()
        ));
    }
    check_hyper(h)?;
    let c = Coeffs::new(h);
    match param {
        None => par_redo_in_place(isa, &c, master, exp_avg, exp_avg_sq),
        Some(Param::F32(p)) => par_redo_into(isa, &c, master, exp_avg, exp_avg_sq, p),
        Some(Param::Bf16(p)) => par_redo_into(isa, &c, master, exp_avg, exp_avg_sq, p),
        Some(Param::F16(p)) => par_redo_into(isa, &c, master, exp_avg, exp_avg_sq, p),
    }
    Ok(())
}

fn par_redo_in_place(isa: Isa, c: &Coeffs, w: &mut [f32], m: &[f32], v: &[f32]) {
    w.par_chunks_mut(CHUNK)
        .zip(m.par_chunks(CHUNK))
        .zip(v.par_chunks(CHUNK))
        .for_each(|((w, m), v)| match isa {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `redo_with` returned early unless `isa.available()` confirmed these CPU features.
            Isa::Avx512 => unsafe { kernel::avx512::redo_in_place(c, w, m, v) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: as above.
            Isa::Avx2 => unsafe { kernel::avx2::redo_in_place(c, w, m, v) },
            _ => kernel::redo_in_place(c, w, m, v),
        });
}

fn par_redo_into<P: Store>(isa: Isa, c: &Coeffs, w: &mut [f32], m: &[f32], v: &[f32], p: &mut [P]) {
    w.par_chunks_mut(CHUNK)
        .zip(m.par_chunks(CHUNK))
        .zip(v.par_chunks(CHUNK))
        .zip(p.par_chunks_mut(CHUNK))
        .for_each(|(((w, m), v), p)| match isa {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `redo_with` returned early unless `isa.available()` confirmed these CPU features.
            Isa::Avx512 => unsafe { kernel::avx512::redo_into(c, w, m, v, p) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: as above.
            Isa::Avx2 => unsafe { kernel::avx2::redo_into(c, w, m, v, p) },
            _ => kernel::redo_into(c, w, m, v, p),
        });
}

fn bad<T>(msg: String) -> Result<T> {
    Err(Error::InvalidArgument(msg))
}

fn check(h: &Hyper, s: &State<'_>, g: &Grad<'_>, p: Option<&Param<'_>>) -> Result<()> {
    let n = s.master.len();
    let glen = match g {
        Grad::F32(g) => g.len(),
        Grad::Bf16(g) => g.len(),
        Grad::F16(g) => g.len(),
    };
    let plen = p.map(Param::len);
    if s.exp_avg.len() != n || s.exp_avg_sq.len() != n || glen != n || plen.is_some_and(|l| l != n)
    {
        return bad(format!(
            "adam: lengths differ: master {n}, exp_avg {}, exp_avg_sq {}, grad {glen}, param {plen:?}",
            s.exp_avg.len(),
            s.exp_avg_sq.len()
        ));
    }
    check_hyper(h)
}

fn check_hyper(h: &Hyper) -> Result<()> {
    if h.step == 0 {
        return bad("adam: step counts from 1 (the step being taken)".into());
    }
    let in_unit = |b: f64| (0.0..1.0).contains(&b);
    if !(h.lr >= 0.0
        && h.eps >= 0.0
        && h.weight_decay >= 0.0
        && in_unit(h.beta1)
        && in_unit(h.beta2))
    {
        return bad(format!(
            "adam: need lr >= 0, eps >= 0, weight_decay >= 0 and betas in [0, 1); got lr={}, eps={}, \
             weight_decay={}, betas=({}, {})",
            h.lr, h.eps, h.weight_decay, h.beta1, h.beta2
        ));
    }
    Ok(())
}

fn with_grad<G: Load>(isa: Isa, c: &Coeffs, s: State<'_>, g: &[G], p: Option<Param<'_>>) {
    match p {
        None => par_in_place(isa, c, s, g),
        Some(Param::F32(p)) => par_into(isa, c, s, g, p),
        Some(Param::Bf16(p)) => par_into(isa, c, s, g, p),
        Some(Param::F16(p)) => par_into(isa, c, s, g, p),
    }
}

fn par_into<G: Load, P: Store>(isa: Isa, c: &Coeffs, s: State<'_>, g: &[G], p: &mut [P]) {
    if s.master.len() <= CHUNK {
        return chunk_into(isa, c, s.master, s.exp_avg, s.exp_avg_sq, g, p);
    }
    s.master
        .par_chunks_mut(CHUNK)
        .zip(s.exp_avg.par_chunks_mut(CHUNK))
        .zip(s.exp_avg_sq.par_chunks_mut(CHUNK))
        .zip(g.par_chunks(CHUNK))
        .zip(p.par_chunks_mut(CHUNK))
        .enumerate()
        .for_each(|(i, ((((w, m), v), g), p))| chunk_into(isa, &at(c, i), w, m, v, g, p));
}

fn par_in_place<G: Load>(isa: Isa, c: &Coeffs, s: State<'_>, g: &[G]) {
    if s.master.len() <= CHUNK {
        return chunk_in_place(isa, c, s.master, s.exp_avg, s.exp_avg_sq, g);
    }
    s.master
        .par_chunks_mut(CHUNK)
        .zip(s.exp_avg.par_chunks_mut(CHUNK))
        .zip(s.exp_avg_sq.par_chunks_mut(CHUNK))
        .zip(g.par_chunks(CHUNK))
        .enumerate()
        .for_each(|(i, (((w, m), v), g))| chunk_in_place(isa, &at(c, i), w, m, v, g));
}

/// `c` for chunk `i` (its `tail_from` counted from the chunk's first element).
fn at(c: &Coeffs, i: usize) -> Coeffs {
    Coeffs {
        tail_from: c.tail_from.saturating_sub(i * CHUNK),
        ..*c
    }
}

fn chunk_into<G: Load, P: Store>(
    isa: Isa,
    c: &Coeffs,
    w: &mut [f32],
    m: &mut [f32],
    v: &mut [f32],
    g: &[G],
    p: &mut [P],
) {
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `step_with` returned early unless `isa.available()` confirmed these CPU features.
        Isa::Avx512 => unsafe { kernel::avx512::into(c, w, m, v, g, p) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        Isa::Avx2 => unsafe { kernel::avx2::into(c, w, m, v, g, p) },
        _ => kernel::into(c, w, m, v, g, p),
    }
}

fn chunk_in_place<G: Load>(
    isa: Isa,
    c: &Coeffs,
    w: &mut [f32],
    m: &mut [f32],
    v: &mut [f32],
    g: &[G],
) {
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `step_with` returned early unless `isa.available()` confirmed these CPU features.
        Isa::Avx512 => unsafe { kernel::avx512::in_place(c, w, m, v, g) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        Isa::Avx2 => unsafe { kernel::avx2::in_place(c, w, m, v, g) },
        _ => kernel::in_place(c, w, m, v, g),
    }
}
