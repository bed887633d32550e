//! Row-wise operations: layer and RMS norm, tanh GELU, SiLU, rotary positions.

use sched_ir::job::Norm;

/// Normalises each row of `x` (rows of `h`) into `out` with ε `eps` (the model's `norm_eps`);
/// `stats` gets (mean, 1/σ) per row, with mean 0 for RMS norm.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub(crate) fn norm_forward(
    kind: Norm,
    eps: f32,
    h: usize,
    x: &[f32],
    w: &[f32],
    b: Option<&[f32]>,
    out: &mut [f32],
    stats: &mut [f32],
) {
    let hf = h as f32;
    for ((xr, yr), st) in x
        .chunks_exact(h)
        .zip(out.chunks_exact_mut(h))
        .zip(stats.chunks_exact_mut(2))
    {
        let (mean, rstd) = match kind {
            Norm::LayerNorm => {
                let mean = xr.iter().sum::<f32>() / hf;
                let var = xr.iter().map(|&v| (v - mean) * (v - mean)).sum::<f32>() / hf;
                (mean, 1.0 / (var + eps).sqrt())
            }
            Norm::RmsNorm => {
                let ms = xr.iter().map(|&v| v * v).sum::<f32>() / hf;
                (0.0, 1.0 / (ms + eps).sqrt())
            }
        };
        st[0] = mean;
        st[1] = rstd;
        match b {
            Some(b) => {
                for (((y, &v), &g), &bb) in yr.iter_mut().zip(xr).zip(w).zip(b) {
                    *y = (v - mean) * rstd * g + bb;
                }
            }
            None => {
                for ((y, &v), &g) in yr.iter_mut().zip(xr).zip(w) {
                    *y = (v - mean) * rstd * g;
                }
            }
        }
    }
}

/// What a norm's backward reads besides the output gradient: the norm's kind and width `h`, the
/// input rows `x`, the weight `w` and the statistics the forward saved (two a row).
#[derive(Clone, Copy, Debug)]
pub(crate) struct NormRows<'a> {
    pub kind: Norm,
    pub h: usize,
    pub x: &'a [f32],
    pub w: &'a [f32],
    pub stats: &'a [f32],
}

/// The backward of [`norm_forward`] from the input `x` and the saved statistics. Accumulates into
/// `dw` and `db`; the input gradient (when asked for) goes into `dx`, added to `base` (the
/// residual stream's gradient, read in the same pass) or, without one, to `dx` itself.
#[inline(always)]
pub(crate) fn norm_backward(
    rows: NormRows<'_>,
    dy: &[f32],
    mut dx: Option<(&mut [f32], Option<&[f32]>)>,
    dw: &mut [f32],
    mut db: Option<&mut [f32]>,
) {
    let NormRows {
        kind,
        h,
        x,
        w,
        stats,
    } = rows;
    let hf = h as f32;
    let mut dxhat = vec![0f32; h];
    for (i, ((xr, dyr), st)) in x
        .chunks_exact(h)
        .zip(dy.chunks_exact(h))
        .zip(stats.chunks_exact(2))
        .enumerate()
    {
        let (mean, rstd) = (st[0], st[1]);
        let mut sum_d = 0f32;
        let mut sum_dx = 0f32;
        for j in 0..h {
            let xhat = (xr[j] - mean) * rstd;
            let d = dyr[j] * w[j];
            dxhat[j] = d;
            sum_d += d;
            sum_dx += d * xhat;
            dw[j] += dyr[j] * xhat;
        }
        if let Some(db) = db.as_deref_mut() {
            for (a, &g) in db.iter_mut().zip(dyr) {
                *a += g;
            }
        }
        if let Some((dx, base)) = dx.as_mut() {
            let mean_d = match kind {
                Norm::LayerNorm => sum_d / hf,
                Norm::RmsNorm => 0.0,
            };
            let mean_dx = sum_dx / hf;
            let row = i * h..(i + 1) * h;
            let term = |j: usize| rstd * (dxhat[j] - mean_d - (xr[j] - mean) * rstd * mean_dx);
            let dxr = &mut dx[row.clone()];
            match base {
                Some(base) => {
                    for (j, (d, &b)) in dxr.iter_mut().zip(&base[row]).enumerate() {
                        *d = b + term(j);
                    }
                }
                None => {
                    for (j, d) in dxr.iter_mut().enumerate() {
                        *d += term(j);
                    }
                }
            }
        }
    }
}

const GELU_C: f32 = 0.797_884_6; // sqrt(2/π)
const GELU_A: f32 = 0.044_715;

/// e^x within 2 ulp, branch-free so loops over it vectorise (libm's `expf` is a call per element
/// and was a fifth of a training step). Cephes' reduction x = n·ln 2 + r and degree-6 polynomial;
/// 0 below −87.33 (where e^x leaves the normal range), +inf above 88.37 (a little before e^x
/// overflows), NaN stays NaN.
#[inline(always)]
pub(crate) fn exp(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    const ROUND: f32 = 12_582_912.0; // 1.5·2²³: adding it rounds to an integer, ties to even
    let xc = x.clamp(-87.33, 88.37);
    let t = xc * LOG2E + ROUND;
    let n = t - ROUND;
    let r = (xc - n * LN2_HI) - n * LN2_LO;
    let mut p = 1.987_569_1e-4f32;
    p = p * r + 1.398_199_9e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 1.666_666_5e-1;
    p = p * r + 0.5;
    let y = p * r * r + r + 1.0;
    // n as an integer, read from t's low mantissa bits (2²² + n): Rust's saturating `n as i32`
    // does not vectorise (a scalar conversion per lane). n lies in [−126, 127] for every x but
    // NaN, for which the clamp keeps the scale finite so the NaN passes through as it did.
    let k = (t.to_bits() as i32 - ROUND.to_bits() as i32).clamp(-126, 127);
    let scale = f32::from_bits(((k + 127) as u32) << 23);
    let v = y * scale;
    let v = if x < -87.33 { 0.0 } else { v };
    if x > 88.37 {
        f32::INFINITY
    } else {
        v
    }
}

/// Σ exp(x − shift) over `xs`, in eight lanes so it vectorises.
#[inline(always)]
pub(crate) fn sum_exp(xs: &[f32], shift: f32) -> f32 {
    let mut acc = [0f32; 8];
    let mut chunks = xs.chunks_exact(8);
    for c in &mut chunks {
        for k in 0..8 {
            acc[k] += exp(c[k] - shift);
        }
    }
    let tail: f32 = chunks.remainder().iter().map(|&x| exp(x - shift)).sum();
    acc.iter().sum::<f32>() + tail
}

/// tanh through one [`exp`]: (1 − e)/(1 + e) with e = exp(−2|u|), which never overflows.
#[inline(always)]
fn tanh(u: f32) -> f32 {
    let e = exp(-2.0 * u.abs());
    ((1.0 - e) / (1.0 + e)).copysign(u)
}

/// tanh-approximated GELU.
#[inline(always)]
pub(crate) fn gelu(x: f32) -> f32 {
    0.5 * x * (1.0 + tanh(GELU_C * (x + GELU_A * x * x * x)))
}

#[inline(always)]
pub(crate) fn gelu_grad(x: f32) -> f32 {
    let t = tanh(GELU_C * (x + GELU_A * x * x * x));
    0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * GELU_C * (1.0 + 3.0 * GELU_A * x * x)
}

#[inline(always)]
pub(crate) fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + exp(-x))
}

/// Rotary position tables for one head width: cos and sin of position·θ^(−2i/d), i < d/2, per
/// position (rows of d/2), θ the model's `rope_base`.
#[derive(Clone)]
pub(crate) struct Rope {
    pub half: usize,
    pub cos: Vec<f32>,
    pub sin: Vec<f32>,
}

impl Rope {
    pub fn new(head_dim: usize, seq_len: usize, base: f64) -> Self {
        let half = head_dim / 2;
        let mut cos = Vec::with_capacity(seq_len * half);
        let mut sin = Vec::with_capacity(seq_len * half);
        for pos in 0..seq_len {
            for i in 0..half {
                let inv_freq = base.powf(-2.0 * i as f64 / head_dim as f64);
                let angle = pos as f64 * inv_freq;
                cos.push(angle.cos() as f32);
                sin.push(angle.sin() as f32);
            }
        }
        Rope { half, cos, sin }
    }

    /// Rotates `heads` consecutive heads of `row` (token at position `pos`) in the rotate-half
    /// pairing of HF LLaMA: element i pairs with i + d/2. `inverse` applies the transpose (for
    /// gradients).
    pub fn apply(&self, row: &mut [f32], heads: usize, pos: usize, inverse: bool) {
        let half = self.half;
        let cos = &self.cos[pos * half..(pos + 1) * half];
        let sin = &self.sin[pos * half..(pos + 1) * half];
        let sign = if inverse { -1.0 } else { 1.0 };
        for head in row.chunks_exact_mut(2 * half).take(heads) {
            let (a, b) = head.split_at_mut(half);
            for i in 0..half {
                let (x1, x2) = (a[i], b[i]);
                let s = sign * sin[i];
                a[i] = x1 * cos[i] - x2 * s;
                b[i] = x2 * cos[i] + x1 * s;
            }
        }
    }
}

/// Runs `f` (an `#[inline(always)]` closure holding a kernel's whole body) compiled for the widest
/// vectors the CPU has: AVX-512 (sixteen lanes), else AVX2 with FMA (eight), else plain x86-64
/// (SSE2, four). The results are the same bits on every path: Rust never contracts a·b + c into an
/// FMA nor reorders float sums, so only the instructions differ.
#[inline(always)]
pub(crate) fn wide<R>(f: impl FnOnce() -> R) -> R {
    #[cfg(target_arch = "x86_64")]
    {
        #[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx2,fma")]
        fn avx512<R>(f: impl FnOnce() -> R) -> R {
            f()
        }
        #[target_feature(enable = "avx2,fma")]
        fn avx2<R>(f: impl FnOnce() -> R) -> R {
            f()
        }
        use std::arch::is_x86_feature_detected as has;
        if has!("avx512f") && has!("avx512bw") && has!("avx512dq") && has!("avx512vl") {
            // SAFETY: the CPU was just found to have every feature `avx512` is compiled for.
            return unsafe { avx512(f) };
        }
        if has!("avx2") && has!("fma") {
            // SAFETY: the CPU was just found to have both features `avx2` is compiled for.
            return unsafe { avx2(f) };
        }
    }
    f()
}

/// Indices per block of [`prefetched`]: 8 KiB of f32 per stream. The generated kernels' host
/// loop walks the same blocks (`sched_kernels::Op::prefetched`), so the constant is theirs.
const BLOCK: usize = sched_kernels::PREFETCH_BLOCK as usize;

/// Calls `body(lo, hi)` over `0..n` in blocks of [`BLOCK`] indices, after asking the cache for
/// the next block of every stream in `streams` (f32 arrays indexed like `0..n`).
///
/// For kernels whose long dependency chain per vector keeps too few loads in flight for the
/// hardware prefetcher to hide memory latency, over data that is not in cache. GELU's backward
/// (a division and two polynomials per vector, over the pre-activations saved in the forward) is
/// one: in a bench step it took 3.6 ms on its first pass over a layer and 1.2 ms once the same
/// data was in cache; prefetched, it takes about half as long as before and the bench's DDP step
/// gains 5-7%. Timed per kernel over 12 bench_ddp steps (thread CPU time), the same prefetching
/// made GELU's forward 30% slower, the optimizer 87% and the norm forward 3% (their loads the
/// hardware prefetcher already covers; the hints add work and evict lines), so they do not use
/// it. It cut the norm backward's time by 23% (rows 8 ahead), about 0.5% of a step, which an
/// interleaved whole-step A/B could not tell from noise (−2.9% in 5 rounds): not used either. A
/// prefetch is only a hint: the results are the same bits.
#[inline(always)]
pub(crate) fn prefetched<const S: usize>(
    n: usize,
    streams: [*const f32; S],
    mut body: impl FnMut(usize, usize),
) {
    let mut lo = 0;
    while lo < n {
        let hi = (lo + BLOCK).min(n);
        let next = (hi + BLOCK).min(n);
        for s in streams {
            prefetch(s, hi, next);
        }
        body(lo, hi);
        lo = hi;
    }
}

/// Hints that the cache lines of `p[lo..hi]` will be read soon. Never faults (a prefetch of any
/// address is allowed), and does nothing off x86-64.
#[inline(always)]
fn prefetch(p: *const f32, lo: usize, hi: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        // One hint per 64-byte line.
        for i in (lo..hi).step_by(16) {
            // SAFETY: a prefetch reads nothing architecturally; wrapping_add only forms the address.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(i).cast()) };
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (p, lo, hi);
}

#[cfg(test)]
#[path = "../../tests/unit/math_ops.rs"]
mod tests;
