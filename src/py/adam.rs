//! `cpu_adam_step`: the Adam kernel (`crate::adam`) over tensors that `zswap/optim/_kernel.py` has
//! validated (dtype, device, contiguity, sizes) and passes as addresses.

use pyo3::prelude::*;

use super::convert::to_pyerr;
use crate::adam::{self, Bf16, Grad, Hyper, Param, State, F16};
use crate::error::Error;
use crate::memcheck;

/// A refused tensor, as `zswap.errors.InvalidTensorError` (a `ValueError`).
fn bad(msg: String) -> PyErr {
    Python::attach(|py| to_pyerr(py, Error::Memory(msg)))
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Dtype {
    F32,
    Bf16,
    F16,
}

impl Dtype {
    fn parse(what: &str, s: &str) -> PyResult<Dtype> {
        match s {
            "float32" => Ok(Dtype::F32),
            "bfloat16" => Ok(Dtype::Bf16),
            "float16" => Ok(Dtype::F16),
            _ => Err(bad(format!(
                "{what} dtype must be 'float32', 'bfloat16' or 'float16', got {s:?}"
            ))),
        }
    }

    fn size(self) -> usize {
        match self {
            Dtype::F32 => 4,
            Dtype::Bf16 | Dtype::F16 => 2,
        }
    }
}

/// A tensor's memory as the binding sees it: address and byte length.
#[derive(Clone, Copy)]
struct Span {
    name: &'static str,
    addr: usize,
    len: usize,
}

impl Span {
    fn new(name: &'static str, addr: usize, numel: usize, size: usize) -> PyResult<Span> {
        let len = numel.checked_mul(size).ok_or_else(|| {
            bad(format!(
                "{name}: {numel} elements overflow the address space"
            ))
        })?;
        if numel > 0 && (addr == 0 || addr % size != 0 || addr.checked_add(len).is_none()) {
            return Err(bad(format!(
                "{name}: address {addr:#x} is null, misaligned for {size}-byte elements or too high"
            )));
        }
        Ok(Span { name, addr, len })
    }

    fn overlaps(&self, o: &Span) -> bool {
        self.len > 0 && o.len > 0 && self.addr < o.addr + o.len && o.addr < self.addr + self.len
    }
}

/// One Adam/AdamW step over `numel` elements. `master=None`: the `float32` param is its own master.
///
/// Addresses are of contiguous CPU tensors the caller keeps alive (and does not touch) until this
/// returns; dtypes are 'float32', 'bfloat16' or 'float16' for `param` and `grad`, `float32` for the
/// rest. `tail_from`: the elements from that index on are updated as torch's fused AdamW updates a
/// tensor's scalar tail (None: none). Runs without the GIL.
#[pyfunction]
#[pyo3(signature = (numel, param, param_dtype, grad, grad_dtype, master, exp_avg, exp_avg_sq, *,
                    step, lr, beta1, beta2, eps, weight_decay, decoupled, grad_scale=1.0,
                    tail_from=None))]
#[allow(clippy::too_many_arguments)]
pub(super) fn cpu_adam_step(
    py: Python<'_>,
    numel: usize,
    param: usize,
    param_dtype: &str,
    grad: usize,
    grad_dtype: &str,
    master: Option<usize>,
    exp_avg: usize,
    exp_avg_sq: usize,
    step: u64,
    lr: f64,
    beta1: f64,
    beta2: f64,
    eps: f64,
    weight_decay: f64,
    decoupled: bool,
    grad_scale: f32,
    tail_from: Option<usize>,
) -> PyResult<()> {
    let pdt = Dtype::parse("param", param_dtype)?;
    let gdt = Dtype::parse("grad", grad_dtype)?;
    if master.is_none() && pdt != Dtype::F32 {
        return Err(bad("a bfloat16/float16 param needs a float32 master".into()));
    }
    let p = Span::new("param", param, numel, pdt.size())?;
    let g = Span::new("grad", grad, numel, gdt.size())?;
    let w = master
        .map(|a| Span::new("master", a, numel, 4))
        .transpose()?;
    let m = Span::new("exp_avg", exp_avg, numel, 4)?;
    let v = Span::new("exp_avg_sq", exp_avg_sq, numel, 4)?;
    let all: Vec<Span> = [Some(p), Some(g), w, Some(m), Some(v)]
        .into_iter()
        .flatten()
        .collect();
    if numel == 0 || !usable(py, &all, &["grad"])? {
        return Ok(()); // an empty tensor's address may be null, which no slice may hold
    }
    let h = Hyper {
        lr,
        beta1,
        beta2,
        eps,
        weight_decay,
        decoupled,
        step,
        grad_scale,
    };
    let r = py.detach(move || {
        // SAFETY: each span is `numel` elements of its dtype at a non-null address aligned for it
        // (checked in `Span::new`); the tensors behind them are kept alive and left alone by the Python
        // caller (`zswap.optim.cpu_adam_step` holds them for the duration of this call); no written span
        // overlaps another span (checked above), so the `&mut` slices are unique. `f32`, `Bf16` and
        // `F16` have no invalid bit patterns.
        unsafe {
            let f32_mut = |s: Span| std::slice::from_raw_parts_mut(s.addr as *mut f32, numel);
            let (mm, vv) = (f32_mut(m), f32_mut(v));
            let grad = match gdt {
                Dtype::F32 => Grad::F32(std::slice::from_raw_parts(g.addr as *const f32, numel)),
                Dtype::Bf16 => Grad::Bf16(std::slice::from_raw_parts(g.addr as *const Bf16, numel)),
                Dtype::F16 => Grad::F16(std::slice::from_raw_parts(g.addr as *const F16, numel)),
            };
            let (master, param) = master_and_param(pdt, p, w, numel);
            let state = State {
                master,
                exp_avg: mm,
                exp_avg_sq: vv,
            };
            adam::step_tail(&h, tail_from.unwrap_or(usize::MAX), state, grad, param)
        }
    });
    r.map_err(|e| to_pyerr(py, e))
}

/// Whether the kernel may run over `spans` (false: they are empty); an error where two share memory or
/// one is not mapped (writable, except those named in `read_only`). Every written span must be apart from
/// every other, or a `&mut` would alias (undefined behaviour); a bad address is an error, not a SIGSEGV.
fn usable(py: Python<'_>, spans: &[Span], read_only: &[&str]) -> PyResult<bool> {
    for (i, a) in spans.iter().enumerate() {
        for b in &spans[i + 1..] {
            if a.overlaps(b) {
                return Err(bad(format!(
                    "{} and {} share memory; each must be a separate tensor",
                    a.name, b.name
                )));
            }
        }
    }
    if spans.iter().all(|s| s.len == 0) {
        return Ok(false);
    }
    for s in spans {
        let access = if read_only.contains(&s.name) {
            memcheck::Access::Read
        } else {
            memcheck::Access::Write
        };
        memcheck::check(s.name, s.addr, s.len, access).map_err(|e| to_pyerr(py, e))?;
    }
    Ok(true)
}

/// One Adam/AdamW step over `numel` elements run again from moments that already hold its gradient:
/// the master (`param` itself with `master=None`) is set from its value before the step and `exp_avg`,
/// `exp_avg_sq` (read only) with this `lr`, `eps` and decoupled `weight_decay`, and cast into `param`;
/// bit for bit what `cpu_adam_step` gives with them (`crate::adam::redo`). Runs without the GIL.
#[pyfunction]
#[pyo3(signature = (numel, param, param_dtype, master, exp_avg, exp_avg_sq, *,
                    step, lr, beta1, beta2, eps, weight_decay, decoupled))]
#[allow(clippy::too_many_arguments)]
pub(super) fn cpu_adam_redo(
    py: Python<'_>,
    numel: usize,
    param: usize,
    param_dtype: &str,
    master: Option<usize>,
    exp_avg: usize,
    exp_avg_sq: usize,
    step: u64,
    lr: f64,
    beta1: f64,
    beta2: f64,
    eps: f64,
    weight_decay: f64,
    decoupled: bool,
) -> PyResult<()> {
    let pdt = Dtype::parse("param", param_dtype)?;
    if master.is_none() && pdt != Dtype::F32 {
        return Err(bad("a bfloat16/float16 param needs a float32 master".into()));
    }
    let p = Span::new("param", param, numel, pdt.size())?;
    let w = master
        .map(|a| Span::new("master", a, numel, 4))
        .transpose()?;
    let m = Span::new("exp_avg", exp_avg, numel, 4)?;
    let v = Span::new("exp_avg_sq", exp_avg_sq, numel, 4)?;
    let all: Vec<Span> = [Some(p), w, Some(m), Some(v)]
        .into_iter()
        .flatten()
        .collect();
    if numel == 0 || !usable(py, &all, &["exp_avg", "exp_avg_sq"])? {
        return Ok(());
    }
    let h = Hyper {
        lr,
        beta1,
        beta2,
        eps,
        weight_decay,
        decoupled,
        step,
        grad_scale: 1.0,
    };
    let r = py.detach(move || {
        // SAFETY: as in `cpu_adam_step`: each span is `numel` elements of its dtype at a non-null aligned
        // address (`Span::new`) of a tensor the Python caller keeps alive and untouched during this call
        // (`zswap.step.optim._kernel.cpu_adam_redo`), no two overlap (`usable`), so the `&mut` slices are
        // unique; every bit pattern is a valid `f32`, `Bf16` and `F16`.
        unsafe {
            let f32_ref = |s: Span| std::slice::from_raw_parts(s.addr as *const f32, numel);
            let (master, param) = master_and_param(pdt, p, w, numel);
            adam::redo(&h, master, f32_ref(m), f32_ref(v), param)
        }
    });
    r.map_err(|e| to_pyerr(py, e))
}

/// The master the kernel updates and the param it is cast into: `param` itself (an `f32` param is its
/// own master) when there is no `master` span.
///
/// # Safety
/// As for the slices of `cpu_adam_step`: `p` (of `pdt`) and `w` are `numel` elements at aligned, live
/// addresses no other slice of the call overlaps.
unsafe fn master_and_param<'a>(
    pdt: Dtype,
    p: Span,
    w: Option<Span>,
    numel: usize,
) -> (&'a mut [f32], Option<Param<'a>>) {
    // SAFETY: the caller's contract above.
    unsafe {
        let f32_mut = |s: Span| std::slice::from_raw_parts_mut(s.addr as *mut f32, numel);
        match w {
            None => (f32_mut(p), None),
            Some(w) => {
                let out = match pdt {
                    Dtype::F32 => Param::F32(f32_mut(p)),
                    Dtype::Bf16 => {
                        Param::Bf16(std::slice::from_raw_parts_mut(p.addr as *mut Bf16, numel))
                    }
                    Dtype::F16 => {
                        Param::F16(std::slice::from_raw_parts_mut(p.addr as *mut F16, numel))
                    }
                };
                (f32_mut(w), Some(out))
            }
        }
    }
}

/// The instruction set `cpu_adam_step` runs on here: "avx512", "avx2" or "portable".
#[pyfunction]
pub(super) fn cpu_adam_isa() -> &'static str {
    adam::Isa::detect().name()
}

/// Adds this file's functions to the extension module.
pub(super) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(cpu_adam_step, m)?)?;
    m.add_function(wrap_pyfunction!(cpu_adam_redo, m)?)?;
    m.add_function(wrap_pyfunction!(cpu_adam_isa, m)?)?;
    Ok(())
}
