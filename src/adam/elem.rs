//! Element types the kernel reads and writes, with conversions to and from `f32` written as
//! branch-free integer arithmetic so that LLVM vectorises them inside the kernel loops (per-element
//! calls into a library with its own run-time CPU detection would not vectorise).

/// A bfloat16 value, as its bit pattern (the upper 16 bits of an IEEE `f32`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[repr(transparent)]
pub struct Bf16(pub u16);

/// An IEEE binary16 value, as its bit pattern.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[repr(transparent)]
pub struct F16(pub u16);

/// An element the kernel reads as `f32` (gradients). Conversions are exact.
pub trait Load: Copy + Send + Sync {
    fn load(self) -> f32;
}

/// An element the kernel writes from an `f32` (model params), rounding to nearest, ties to even.
pub trait Store: Copy + Send + Sync {
    fn store(x: f32) -> Self;
}

impl Load for f32 {
    #[inline(always)]
    fn load(self) -> f32 {
        self
    }
}

impl Store for f32 {
    #[inline(always)]
    fn store(x: f32) -> f32 {
        x
    }
}

impl Load for Bf16 {
    #[inline(always)]
    fn load(self) -> f32 {
        f32::from_bits(u32::from(self.0) << 16)
    }
}

impl Store for Bf16 {
    /// Round to nearest even as `c10::BFloat16` does; NaN becomes torch's canonical quiet NaN `0x7fc0`.
    #[inline(always)]
    fn store(x: f32) -> Bf16 {
        let b = x.to_bits();
        let rounded = (b.wrapping_add(0x7fff + ((b >> 16) & 1)) >> 16) as u16;
        Bf16(if x.is_nan() { 0x7fc0 } else { rounded })
    }
}

impl Load for F16 {
    /// Exact widening: the exponent is rebiased, subnormals are renormalised through one float
    /// subtraction, infinities and NaNs keep their payload (after F. Giesen's `half_to_float_fast`).
    #[inline(always)]
    fn load(self) -> f32 {
        const EXP_F16_IN_F32: u32 = 0x1f << 23; // the f16 exponent field after the shift below
        const REBIAS: u32 = (127 - 15) << 23;
        let h = u32::from(self.0);
        let sign = (h & 0x8000) << 16;
        let shifted = (h & 0x7fff) << 13;
        let exp = shifted & EXP_F16_IN_F32;
        let normal = shifted + REBIAS;
        // Inf/NaN: push the exponent up to 255.
        let special = normal + ((128 - 16) << 23);
        // Subnormal (exp == 0): treat the mantissa as a normal number with exponent -14, then subtract
        // the implicit one; the subtraction is exact.
        let sub = (f32::from_bits(normal + (1 << 23)) - f32::from_bits(113 << 23)).to_bits();
        let mag = if exp == EXP_F16_IN_F32 {
            special
        } else if exp == 0 {
            sub
        } else {
            normal
        };
        f32::from_bits(mag | sign)
    }
}

impl Store for F16 {
    /// Round to nearest even, overflow to ±inf, NaN to a quiet NaN (after F. Giesen's
    /// `float_to_half_fast3_rtne`).
    #[inline(always)]
    fn store(x: f32) -> F16 {
        const F32_INF: u32 = 255 << 23;
        const F16_OVERFLOW: u32 = (127 + 16) << 23; // 65536.0: rounds to inf in f16
        const F16_MIN_NORMAL: u32 = 113 << 23; // 2^-14
        const DENORM_MAGIC: u32 = ((127 - 15) + (23 - 10) + 1) << 23; // 0.5: aligns the f16 ulp
        let b = x.to_bits();
        let sign = ((b >> 16) & 0x8000) as u16;
        let f = b & 0x7fff_ffff;
        let big = if f > F32_INF { 0x7e00 } else { 0x7c00 };
        // Subnormal: adding 0.5 lets the FPU round at the f16 subnormal ulp; the low bits are the result.
        let small = (f32::from_bits(f) + f32::from_bits(DENORM_MAGIC))
            .to_bits()
            .wrapping_sub(DENORM_MAGIC);
        let odd = (f >> 13) & 1;
        let normal = (f
            .wrapping_add(((15u32.wrapping_sub(127)) << 23).wrapping_add(0xfff))
            .wrapping_add(odd))
            >> 13;
        let mag = if f >= F16_OVERFLOW {
            big
        } else if f < F16_MIN_NORMAL {
            small
        } else {
            normal
        };
        F16(sign | mag as u16)
    }
}
