//! Causal (grouped-query) attention over the packed q/k/v projection, one (sequence, head) at a
//! time with sgemm.
//!
//! `qkv` rows are tokens: [q (heads·d) | k (kv_heads·d) | v (kv_heads·d)]; query head `n` reads
//! key/value head `n / (heads / kv_heads)`. Rows are processed in blocks of [`BLOCK`] queries against
//! the keys up to the block's last row, so the masked upper triangle is mostly never computed.
//! Probabilities are always formed as exp(s − lse) from the row's log-sum-exp, so `naive` (which
//! saves them) and `flash` (which saves lse and recomputes them) agree to the last bit in fp32.

use super::gemm::{gemm, Mat, MatMut};
use super::ops;
use super::precision::Precision;

pub(crate) const BLOCK: usize = 64;

#[derive(Clone, Copy)]
pub(crate) struct Shape {
    /// Sequences and tokens per sequence.
    pub b: usize,
    pub s: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub d: usize,
}

/// What forward keeps: the probabilities ([b][head][i][j], zero above the diagonal) or the
/// log-sum-exp of each row ([b][head][i]); `&mut [f32]` in forward, `&[f32]` in backward.
pub(crate) enum Keep<S> {
    Probs(S),
    Lse(S),
}

impl Shape {
    pub fn hidden(&self) -> usize {
        self.heads * self.d
    }

    pub fn width(&self) -> usize {
        (self.heads + 2 * self.kv_heads) * self.d
    }

    pub(crate) fn scale(&self) -> f32 {
        1.0 / (self.d as f32).sqrt()
    }

    /// Offsets in `qkv` of the first row of sequence `b`'s q, k and v for query head `n`.
    pub(crate) fn offsets(&self, b: usize, n: usize) -> (usize, usize, usize) {
        let row = b * self.s * self.width();
        let g = n / (self.heads / self.kv_heads);
        let k = self.hidden() + g * self.d;
        (row + n * self.d, row + k, row + k + self.kv_heads * self.d)
    }

    /// The blocks of at most [`BLOCK`] query rows of every head of every sequence, the unit
    /// [`forward`] and [`backward`] work in.
    fn row_blocks(&self) -> impl Iterator<Item = RowBlock> + '_ {
        (0..self.b).flat_map(move |b| {
            (0..self.heads).flat_map(move |n| {
                let (q, k, v) = self.offsets(b, n);
                (0..self.s).step_by(BLOCK).map(move |r0| RowBlock {
                    q,
                    k,
                    v,
                    bh: b * self.heads + n,
                    r0,
                    r1: (r0 + BLOCK).min(self.s),
                    o: (b * self.s + r0) * self.hidden() + n * self.d,
                })
            })
        })
    }

    /// The generated kernel that rotates this shape's q and k heads (`inverse` for gradients).
    pub(crate) fn rotary_op(&self, inverse: bool) -> sched_kernels::Op {
        sched_kernels::Op::Rotary {
            heads: self.heads as u32,
            kv_heads: self.kv_heads as u32,
            head_dim: self.d as u32,
            width: self.width() as u32,
            seq_len: self.s as u32,
            inverse,
        }
    }

    /// Scratch floats that [`forward`] needs ([`backward`] needs twice this).
    pub fn scratch(&self) -> usize {
        BLOCK.min(self.s) * self.s
    }
}

/// Query rows `r0..r1` of head `bh` (sequence · heads + head): the offsets in `qkv` of its q, k
/// and v columns (first row of the sequence), and `o`, the offset of row `r0`'s head slice in the
/// attention output.
struct RowBlock {
    q: usize,
    k: usize,
    v: usize,
    bh: usize,
    r0: usize,
    r1: usize,
    o: usize,
}

/// scores ← scale·Q[r0..r1]·K[0..r1]ᵀ, as a dense (r1−r0) × r1 block.
fn scores(sh: &Shape, qkv: &[f32], q: usize, k: usize, r0: usize, r1: usize, out: &mut [f32]) {
    let w = sh.width();
    gemm(
        sh.scale(),
        Mat::rows(&qkv[q + r0 * w..], r1 - r0, sh.d, w),
        Mat::rows(&qkv[k..], r1, sh.d, w).t(),
        0.0,
        MatMut::dense(out, r1 - r0, r1),
    );
}

/// Attention forward: `out` ([b·s, hidden]) gets softmax(scale·QKᵀ, causal)·V per head.
pub(crate) fn forward(
    sh: &Shape,
    qkv: &[f32],
    out: &mut [f32],
    mut keep: Keep<&mut [f32]>,
    prec: Precision,
    scratch: &mut [f32],
) {
    super::ops::wide(
        #[inline(always)]
        || {
            let (s, w, h) = (sh.s, sh.width(), sh.hidden());
            for RowBlock {
                q,
                k,
                v,
                bh,
                r0,
                r1,
                o,
            } in sh.row_blocks()
            {
                let p = &mut scratch[..(r1 - r0) * r1];
                scores(sh, qkv, q, k, r0, r1, p);
                for (ii, row) in p.chunks_exact_mut(r1).enumerate() {
                    let i = r0 + ii;
                    let live = &mut row[..=i];
                    let max = live.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x));
                    let sum = ops::sum_exp(live, max);
                    let lse = max + sum.ln();
                    live.iter_mut().for_each(|x| *x = ops::exp(*x - lse));
                    row[i + 1..].fill(0.0);
                    match &mut keep {
                        Keep::Lse(l) => l[bh * s + i] = lse,
                        Keep::Probs(pr) => {
                            prec.round(row);
                            let dst = &mut pr[(bh * s + i) * s..(bh * s + i + 1) * s];
                            dst[..r1].copy_from_slice(row);
                            dst[r1..].fill(0.0);
                        }
                    }
                }
                gemm(
                    1.0,
                    Mat::dense(p, r1 - r0, r1),
                    Mat::rows(&qkv[v..], r1, sh.d, w),
                    0.0,
                    MatMut::rows(&mut out[o..], r1 - r0, sh.d, h),
                );
            }
        },
    )
}

/// Attention backward: `dqkv` (same layout as `qkv`) is overwritten with the gradient of the
/// (already rotated) q, k and v given `dout`, the gradient of the attention output.
pub(crate) fn backward(
    sh: &Shape,
    qkv: &[f32],
    kept: Keep<&[f32]>,
    dout: &[f32],
    dqkv: &mut [f32],
    scratch: &mut [f32],
) {
    super::ops::wide(
        #[inline(always)]
        || {
            let (s, w, h) = (sh.s, sh.width(), sh.hidden());
            dqkv.fill(0.0);
            let (p_buf, dp_buf) = scratch.split_at_mut(sh.scratch());
            for RowBlock {
                q,
                k,
                v,
                bh,
                r0,
                r1,
                o,
            } in sh.row_blocks()
            {
                let rows = r1 - r0;
                let p = &mut p_buf[..rows * r1];
                match kept {
                    Keep::Probs(pr) => {
                        for (ii, row) in p.chunks_exact_mut(r1).enumerate() {
                            let src = (bh * s + r0 + ii) * s;
                            row.copy_from_slice(&pr[src..src + r1]);
                        }
                    }
                    Keep::Lse(l) => {
                        scores(sh, qkv, q, k, r0, r1, p);
                        for (ii, row) in p.chunks_exact_mut(r1).enumerate() {
                            let i = r0 + ii;
                            let lse = l[bh * s + i];
                            row[..=i].iter_mut().for_each(|x| *x = ops::exp(*x - lse));
                            row[i + 1..].fill(0.0);
                        }
                    }
                }
                let d_o = Mat::rows(&dout[o..], rows, sh.d, h);
                // dV[0..r1] += Pᵀ·dO
                gemm(
                    1.0,
                    Mat::dense(p, rows, r1).t(),
                    d_o,
                    1.0,
                    MatMut::rows(&mut dqkv[v..], r1, sh.d, w),
                );
                // dP = dO·V[0..r1]ᵀ, then dS = P ∘ (dP − rowsum(P ∘ dP)) · scale
                let dp = &mut dp_buf[..rows * r1];
                gemm(
                    1.0,
                    d_o,
                    Mat::rows(&qkv[v..], r1, sh.d, w).t(),
                    0.0,
                    MatMut::dense(dp, rows, r1),
                );
                let scale = sh.scale();
                for (prow, dprow) in p.chunks_exact(r1).zip(dp.chunks_exact_mut(r1)) {
                    let dot: f32 = prow.iter().zip(dprow.iter()).map(|(a, b)| a * b).sum();
                    for (d, &pv) in dprow.iter_mut().zip(prow) {
                        *d = pv * (*d - dot) * scale;
                    }
                }
                // dQ[r0..r1] = dS·K[0..r1]; dK[0..r1] += dSᵀ·Q[r0..r1]
                gemm(
                    1.0,
                    Mat::dense(dp, rows, r1),
                    Mat::rows(&qkv[k..], r1, sh.d, w),
                    0.0,
                    MatMut::rows(&mut dqkv[q + r0 * w..], rows, sh.d, w),
                );
                gemm(
                    1.0,
                    Mat::dense(dp, rows, r1).t(),
                    Mat::rows(&qkv[q + r0 * w..], rows, sh.d, w),
                    1.0,
                    MatMut::rows(&mut dqkv[k..], r1, sh.d, w),
                );
            }
        },
    )
}
