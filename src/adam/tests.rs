//! Conversions against the `half` crate, the kernel against a plain scalar transcription of torch's
//! AdamW, and every instruction set against the baseline build, bit for bit.

use super::*;
use proptest::prelude::*;

fn hyper(step: u64) -> Hyper {
    Hyper {
        lr: 1e-3,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay: 0.01,
        decoupled: true,
        step,
        grad_scale: 1.0,
    }
}

/// torch.optim.adam._single_tensor_adam for one element, written the obvious way (no fused ops except
/// the two torch's CPU kernels fuse), as an independent check of `kernel::update`.
fn reference(h: &Hyper, p: f32, m: f32, v: f32, g: f32) -> (f32, f32, f32) {
    let s = h.step as f64;
    let mut p = p;
    let mut g = g * h.grad_scale;
    if h.weight_decay != 0.0 {
        if h.decoupled {
            p *= (1.0 - h.lr * h.weight_decay) as f32;
        } else {
            g = p.mul_add(h.weight_decay as f32, g);
        }
    }
    let w = (1.0 - h.beta1) as f32;
    let m = if w < 0.5 {
        w.mul_add(g - m, m)
    } else {
        (w - 1.0).mul_add(g - m, g)
    };
    let v = ((1.0 - h.beta2) as f32 * g).mul_add(g, v * h.beta2 as f32);
    let bc2 = ((1.0 - h.beta2.powf(s)).powf(0.5)) as f32;
    let d = v.sqrt() / bc2 + h.eps as f32;
    let step_size = (-(h.lr / (1.0 - h.beta1.powf(s)))) as f32;
    (p + step_size * m / d, m, v)
}

fn data(n: usize, seed: u32) -> Vec<f32> {
    // A cheap deterministic spread over several orders of magnitude, both signs, with some zeros.
    (0..n as u32)
        .map(|i| {
            let x = (i
                .wrapping_mul(2654435761)
                .wrapping_add(seed.wrapping_mul(40503)))
                >> 8;
            let u = x as f32 / (1u32 << 24) as f32 - 0.5;
            if x % 17 == 0 {
                0.0
            } else {
                u * 10f32.powi((x % 7) as i32 - 3)
            }
        })
        .collect()
}

#[test]
fn bf16_matches_half_crate() {
    for bits in (0..=u32::MAX).step_by(997) {
        let x = f32::from_bits(bits);
        let ours = Bf16::store(x);
        if x.is_nan() {
            assert_eq!(ours.0, 0x7fc0);
        } else {
            assert_eq!(
                ours.0,
                half::bf16::from_f32(x).to_bits(),
                "{x:e} ({bits:#x})"
            );
            assert_eq!(Bf16(ours.0).load(), half::bf16::from_bits(ours.0).to_f32());
        }
    }
}

#[test]
fn f16_load_is_exact_for_every_pattern() {
    for h in 0..=u16::MAX {
        let want = half::f16::from_bits(h).to_f32();
        let got = F16(h).load();
        if want.is_nan() {
            assert!(got.is_nan(), "{h:#x}");
        } else {
            assert_eq!(got.to_bits(), want.to_bits(), "{h:#x}");
        }
    }
}

#[test]
fn f16_store_rounds_like_half_crate() {
    for bits in (0..=u32::MAX).step_by(251) {
        let x = f32::from_bits(bits);
        let got = F16::store(x);
        if x.is_nan() {
            assert!(got.load().is_nan(), "{bits:#x}");
        } else {
            assert_eq!(got.0, half::f16::from_f32(x).to_bits(), "{x:e} ({bits:#x})");
        }
    }
    // Ties at the subnormal and normal boundaries and just below overflow.
    for x in [
        65519.0f32,
        65520.0,
        65504.0,
        6.1035156e-5,
        2.9802322e-8,
        5.9604645e-8,
        1.0 + 1.0 / 2048.0,
    ] {
        assert_eq!(F16::store(x).0, half::f16::from_f32(x).to_bits(), "{x:e}");
    }
}

#[test]
fn matches_scalar_reference_for_each_decay_mode_and_beta() {
    let n = 1000;
    for (decoupled, wd, beta1, beta2) in [
        (true, 0.01, 0.9, 0.999),
        (false, 0.1, 0.8, 0.99),
        (true, 0.0, 0.3, 0.5),
        (false, 0.0, 0.0, 0.0),
    ] {
        let (mut w, mut m, mut v) = (data(n, 1), vec![0.0; n], vec![0.0; n]);
        let (mut rw, mut rm, mut rv) = (w.clone(), m.clone(), v.clone());
        for step in 1..=5 {
            let g = data(n, 10 + step as u32);
            let h = Hyper {
                decoupled,
                weight_decay: wd,
                beta1,
                beta2,
                ..hyper(step)
            };
            let st = State {
                master: &mut w,
                exp_avg: &mut m,
                exp_avg_sq: &mut v,
            };
            super::step(&h, st, Grad::F32(&g), None).unwrap();
            for i in 0..n {
                (rw[i], rm[i], rv[i]) = reference(&h, rw[i], rm[i], rv[i], g[i]);
            }
            assert_eq!(w, rw, "params, step {step}, {h:?}");
            assert_eq!(m, rm, "exp_avg, step {step}");
            assert_eq!(v, rv, "exp_avg_sq, step {step}");
        }
    }
}

#[test]
fn first_step_moves_each_weight_by_about_lr() {
    let n = 64;
    let mut w = vec![1.0f32; n];
    let (mut m, mut v) = (vec![0.0; n], vec![0.0; n]);
    let g: Vec<f32> = (0..n)
        .map(|i| if i % 2 == 0 { 3.0 } else { -0.5 })
        .collect();
    let h = Hyper {
        weight_decay: 0.0,
        ..hyper(1)
    };
    let st = State {
        master: &mut w,
        exp_avg: &mut m,
        exp_avg_sq: &mut v,
    };
    super::step(&h, st, Grad::F32(&g), None).unwrap();
    for (i, x) in w.iter().enumerate() {
        let want = if i % 2 == 0 { 1.0 - 1e-3 } else { 1.0 + 1e-3 };
        assert!((x - want).abs() < 1e-6, "{i}: {x}");
    }
}

/// Runs `f` over copies of the inputs, returning (master, exp_avg, exp_avg_sq, param) as bits.
/// `dt`: (grad dtype f32/bf16/f16, param none/f32/bf16/f16).
fn run_with(
    f: impl FnOnce(&Hyper, State<'_>, Grad<'_>, Option<Param<'_>>),
    h: &Hyper,
    dt: (u8, u8),
    base: &[f32],
    g: &[f32],
) -> [Vec<u32>; 4] {
    let n = base.len();
    let mut w = base.to_vec();
    let mut m: Vec<f32> = g.iter().map(|x| x * 0.5).collect();
    let mut v: Vec<f32> = g.iter().map(|x| x * x * 0.25).collect();
    let gb: Vec<Bf16> = g.iter().map(|&x| Bf16::store(x)).collect();
    let gh: Vec<F16> = g.iter().map(|&x| F16::store(x)).collect();
    let grad = match dt.0 {
        0 => Grad::F32(g),
        1 => Grad::Bf16(&gb),
        _ => Grad::F16(&gh),
    };
    let (mut pf, mut pb, mut ph) = (vec![0.0f32; n], vec![Bf16(0); n], vec![F16(0); n]);
    let param = match dt.1 {
        0 => None,
        1 => Some(Param::F32(&mut pf)),
        2 => Some(Param::Bf16(&mut pb)),
        _ => Some(Param::F16(&mut ph)),
    };
    let st = State {
        master: &mut w,
        exp_avg: &mut m,
        exp_avg_sq: &mut v,
    };
    f(h, st, grad, param);
    let p: Vec<u32> = match dt.1 {
        1 => pf.iter().map(|x| x.to_bits()).collect(),
        2 => pb.iter().map(|x| u32::from(x.0)).collect(),
        3 => ph.iter().map(|x| u32::from(x.0)).collect(),
        _ => vec![],
    };
    let bits = |x: &[f32]| x.iter().map(|x| x.to_bits()).collect();
    [bits(&w), bits(&m), bits(&v), p]
}

fn run(isa: Isa, h: &Hyper, dt: (u8, u8), base: &[f32], g: &[f32]) -> [Vec<u32>; 4] {
    run_with(
        |h, s, g, p| step_with(isa, h, s, g, p).unwrap(),
        h,
        dt,
        base,
        g,
    )
}

/// The kernel loop over the whole range in one call: no chunking, no threads.
fn sequential(h: &Hyper, s: State<'_>, g: Grad<'_>, p: Option<Param<'_>>) {
    fn go<G: Load>(c: &Coeffs, s: State<'_>, g: &[G], p: Option<Param<'_>>) {
        match p {
            None => kernel::in_place(c, s.master, s.exp_avg, s.exp_avg_sq, g),
            Some(Param::F32(p)) => kernel::into(c, s.master, s.exp_avg, s.exp_avg_sq, g, p),
            Some(Param::Bf16(p)) => kernel::into(c, s.master, s.exp_avg, s.exp_avg_sq, g, p),
            Some(Param::F16(p)) => kernel::into(c, s.master, s.exp_avg, s.exp_avg_sq, g, p),
        }
    }
    let c = Coeffs::new(h);
    match g {
        Grad::F32(g) => go(&c, s, g, p),
        Grad::Bf16(g) => go(&c, s, g, p),
        Grad::F16(g) => go(&c, s, g, p),
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(96))]

    #[test]
    fn every_isa_agrees_with_the_portable_build(
        base in prop::collection::vec(-1e3f32..1e3, 0..300),
        seed in any::<u32>(),
        lr in 0.0f64..0.1,
        beta1 in 0.0f64..0.999,
        beta2 in 0.0f64..0.9999,
        eps in prop::sample::select(vec![0.0, 1e-8, 1e-6]),
        wd in prop::sample::select(vec![0.0, 1e-4, 0.1]),
        decoupled in any::<bool>(),
        step in 1u64..10_000,
        scale in prop::sample::select(vec![1.0f32, 0.25, 0.37]),
        dt in (0u8..3, 0u8..4),
    ) {
        let g: Vec<f32> = data(base.len(), seed).iter().map(|x| x * 100.0).collect();
        let h = Hyper { lr, beta1, beta2, eps, weight_decay: wd, decoupled, step, grad_scale: scale };
        let want = run(Isa::Portable, &h, dt, &base, &g);
        for isa in [Isa::Avx512, Isa::Avx2] {
            if isa.available() {
                prop_assert_eq!(&run(isa, &h, dt, &base, &g), &want, "{}", isa.name());
            }
        }
    }
}

/// `reference` for an element of torch's fused scalar tail (`kernel::update::<true>`): only the second
/// moment's contraction differs.
fn reference_tail(h: &Hyper, p: f32, m: f32, v: f32, g: f32) -> (f32, f32, f32) {
    let (_, m_new, _) = reference(h, p, m, v, g);
    let mut gg = g * h.grad_scale;
    let mut pp = p;
    if h.weight_decay != 0.0 {
        if h.decoupled {
            pp *= (1.0 - h.lr * h.weight_decay) as f32;
        } else {
            gg = pp.mul_add(h.weight_decay as f32, gg);
        }
    }
    let s = h.step as f64;
    let v = v.mul_add(h.beta2 as f32, ((1.0 - h.beta2) as f32 * gg) * gg);
    let bc2 = ((1.0 - h.beta2.powf(s)).powf(0.5)) as f32;
    let d = v.sqrt() / bc2 + h.eps as f32;
    let step_size = (-(h.lr / (1.0 - h.beta1.powf(s)))) as f32;
    (pp + step_size * m_new / d, m_new, v)
}

#[test]
fn the_tail_takes_torchs_scalar_formula_across_chunks_and_isas() {
    // The tail starts inside the last chunk, and (second case) before a chunk boundary.
    let n = 2 * CHUNK + 11;
    let (base, g) = (data(n, 5), data(n, 6));
    let h = Hyper {
        grad_scale: 0.37,
        ..hyper(3)
    };
    for tail_from in [n - 11, CHUNK - 5] {
        let mut want: Option<[Vec<u32>; 4]> = None;
        for isa in [Isa::Portable, Isa::Avx2, Isa::Avx512] {
            if !isa.available() {
                continue;
            }
            let got = run_with(
                |h, s, g, p| super::run(isa, h, tail_from, s, g, p).unwrap(),
                &h,
                (0, 0),
                &base,
                &g,
            );
            for i in [0, tail_from - 1, tail_from, n - 1] {
                let (m0, v0) = (g[i] * 0.5, g[i] * g[i] * 0.25);
                let f = if i < tail_from {
                    reference
                } else {
                    reference_tail
                };
                let (p, m, v) = f(&h, base[i], m0, v0, g[i]);
                assert_eq!(
                    [got[0][i], got[1][i], got[2][i]],
                    [p.to_bits(), m.to_bits(), v.to_bits()],
                    "{} element {i}",
                    isa.name()
                );
            }
            match &want {
                None => want = Some(got),
                Some(w) => assert!(*w == got, "{} differs from the portable build", isa.name()),
            }
        }
    }
}

#[test]
fn parallel_chunks_match_one_sequential_pass() {
    let n = 3 * CHUNK + 123;
    let (base, g) = (data(n, 3), data(n, 4));
    for dt in [(0, 0), (0, 1), (1, 2), (2, 3)] {
        let par = run(Isa::detect(), &hyper(7), dt, &base, &g);
        let seq = run_with(sequential, &hyper(7), dt, &base, &g);
        assert!(par == seq, "dtypes {dt:?}");
    }
}

#[test]
fn rejects_bad_lengths_steps_and_hyper_parameters() {
    let (mut w, mut m, mut v) = (vec![0.0f32; 4], vec![0.0f32; 4], vec![0.0f32; 3]);
    let g = vec![0.0f32; 4];
    let err = |h: &Hyper, w: &mut [f32], m: &mut [f32], v: &mut [f32]| {
        let st = State {
            master: w,
            exp_avg: m,
            exp_avg_sq: v,
        };
        super::step(h, st, Grad::F32(&g), None)
            .unwrap_err()
            .to_string()
    };
    assert!(err(&hyper(1), &mut w, &mut m, &mut v).contains("lengths differ"));
    let mut v = vec![0.0f32; 4];
    assert!(err(&hyper(0), &mut w, &mut m, &mut v).contains("step counts from 1"));
    let h = Hyper {
        beta2: 1.0,
        ..hyper(1)
    };
    assert!(err(&h, &mut w, &mut m, &mut v).contains("betas in [0, 1)"));
    let h = Hyper {
        lr: f64::NAN,
        ..hyper(1)
    };
    assert!(err(&h, &mut w, &mut m, &mut v).contains("lr=NaN"));
}

#[test]
fn empty_tensors_are_a_no_op() {
    let st = State {
        master: &mut [],
        exp_avg: &mut [],
        exp_avg_sq: &mut [],
    };
    super::step(&hyper(1), st, Grad::Bf16(&[]), Some(Param::F16(&mut []))).unwrap();
}

/// A step run again with another lr, eps and decoupled weight decay from the moments the first run left
/// (`redo`) gives the master and param a step with those coefficients gives, bit for bit: on every
/// instruction set, for f32 and bf16 params, with a tail and across chunks.
#[test]
fn redo_from_the_moments_matches_a_step_with_the_new_coefficients() {
    let n = CHUNK + 1000;
    let (base, g) = (data(n, 3), data(n, 4));
    let (m0, v0) = (
        data(n, 5),
        data(n, 6).iter().map(|x| x * x).collect::<Vec<_>>(),
    );
    let first = hyper(7);
    for (lr, eps, wd) in [(3e-4, 1e-8, 0.01), (1e-3, 1e-6, 0.1), (0.0, 1e-8, 0.0)] {
        let again = Hyper {
            lr,
            eps,
            weight_decay: wd,
            ..first
        };
        for isa in [Isa::Avx512, Isa::Avx2, Isa::Portable] {
            if !isa.available() {
                continue;
            }
            for bf16 in [false, true] {
                let tail = n - 5;
                // The step with the new coefficients, and the one with the old whose moments are redone.
                let (mut w_new, mut m_new, mut v_new) = (base.clone(), m0.clone(), v0.clone());
                let (mut w_old, mut m_old, mut v_old) = (base.clone(), m0.clone(), v0.clone());
                let (mut p_new, mut p_redo) =
                    (vec![Bf16::store(0.0); n], vec![Bf16::store(0.0); n]);
                let out_new = bf16.then(|| Param::Bf16(&mut p_new));
                let state = State {
                    master: &mut w_new,
                    exp_avg: &mut m_new,
                    exp_avg_sq: &mut v_new,
                };
                run(isa, &again, tail, state, Grad::F32(&g), out_new);
                let state = State {
                    master: &mut w_old,
                    exp_avg: &mut m_old,
                    exp_avg_sq: &mut v_old,
                };
                run(isa, &first, tail, state, Grad::F32(&g), None);
                assert_eq!(
                    bits(&m_new),
                    bits(&m_old),
                    "the moments do not depend on lr, eps or wd"
                );
                assert_eq!(bits(&v_new), bits(&v_old));
                let mut w_redo = base.clone();
                let out_redo = bf16.then(|| Param::Bf16(&mut p_redo));
                redo_with(isa, &again, &mut w_redo, &m_old, &v_old, out_redo).unwrap();
                assert_eq!(
                    bits(&w_redo),
                    bits(&w_new),
                    "{isa:?} lr {lr} eps {eps} wd {wd} bf16 {bf16}"
                );
                if bf16 {
                    assert!(p_new.iter().zip(&p_redo).all(|(a, b)| a.0 == b.0));
                }
            }
        }
    }

    fn run(isa: Isa, h: &Hyper, tail: usize, s: State<'_>, g: Grad<'_>, p: Option<Param<'_>>) {
        assert!(isa.available());
        super::run(isa, h, tail, s, g, p).unwrap();
    }

    fn bits(x: &[f32]) -> Vec<u32> {
        x.iter().map(|f| f.to_bits()).collect()
    }
}
