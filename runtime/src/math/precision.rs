//! Storage rounding: what a value becomes when it is stored in bf16 or fp16 and read back.
//!
//! All math runs in f32; a tensor the model stores in a 16-bit dtype is rounded in place (round to
//! nearest, ties to even) at the point where it would be written, and later steps use the rounded
//! values, so a run that really stores 16-bit words computes exactly the same numbers.

use sched_ir::job::Dtype;

/// bf16 bits of `x`, rounded to nearest even. NaN stays NaN (quiet, sign kept); overflow gives ±inf.
pub fn f32_to_bf16_bits(x: f32) -> u16 {
    let b = x.to_bits();
    if x.is_nan() {
        return ((b >> 16) as u16) | 0x0040;
    }
    let lsb = (b >> 16) & 1;
    (b.wrapping_add(0x7fff + lsb) >> 16) as u16
}

pub fn bf16_bits_to_f32(b: u16) -> f32 {
    f32::from_bits(u32::from(b) << 16)
}

/// `x` rounded to the nearest bf16 value (ties to even).
pub fn round_bf16(x: f32) -> f32 {
    bf16_bits_to_f32(f32_to_bf16_bits(x))
}

/// `x` rounded to the nearest IEEE half value (ties to even), subnormals included; ±inf past 65504.
pub fn round_f16(x: f32) -> f32 {
    if !x.is_finite() {
        return x;
    }
    let a = x.abs();
    if a >= 65520.0 {
        return f32::INFINITY.copysign(x);
    }
    let exp = if a < 2f32.powi(-14) {
        -24
    } else {
        ((a.to_bits() >> 23) & 0xff) as i32 - 127 - 10
    };
    let q = 2f32.powi(exp);
    (x / q).round_ties_even() * q
}

/// How a dtype's stored values are rounded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Precision {
    F32,
    Bf16,
    F16,
}

impl Precision {
    pub fn of(d: Dtype) -> Self {
        match d {
            Dtype::Fp32 => Precision::F32,
            Dtype::Bf16 => Precision::Bf16,
            Dtype::Fp16 => Precision::F16,
        }
    }

    pub fn round(self, xs: &mut [f32]) {
        match self {
            Precision::F32 => {}
            Precision::Bf16 => xs.iter_mut().for_each(|x| *x = round_bf16(*x)),
            Precision::F16 => xs.iter_mut().for_each(|x| *x = round_f16(*x)),
        }
    }
}
