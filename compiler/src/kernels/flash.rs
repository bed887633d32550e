//! The fused causal attention forward on tensor cores ([`super::Op::FlashForward`]), as one warp
//! runs it, lane by lane: the reference the generated PTX kernel is written after
//! (`codegen/flash.rs` follows this code step for step) and what the host emulation of the CUDA
//! backend runs in its place, since a host cannot execute warp-wide matrix instructions.
//!
//! A warp takes [`QROWS`] query rows of one head of one sequence and walks the keys up to its
//! last row [`KEYS`] at a time (FlashAttention-2's forward): S = Q·Kᵀ on `mma.m16n8k16` (bf16
//! operands, f32 accumulators), scaled into base 2 and masked above the diagonal; an online
//! softmax keeps each row's running max `m` and each lane's share of the row's sum `l`,
//! rescaling the output accumulators when the max grows; P = exp2(S − m) goes back to bf16 as
//! the A operand of O += P·V. At the end the four lanes of a row add their sums, O/l is stored
//! in the output's dtype and the row's natural log-sum-exp `(m + log2 l)·ln 2` into `lse`. The
//! s×s matrix never leaves registers.
//!
//! Fragments follow the PTX ISA's layouts for `mma.m16n8k16` with 16-bit operands ([`a_at`],
//! [`b_at`], [`c_at`]): lane `l` is thread `l mod 4` of group `l / 4`; a 32-bit register holds
//! two bf16, the lower-indexed element in its low half.

/// Query rows per warp: an `mma` tile's rows.
pub const QROWS: usize = 16;
/// Keys per step: one `mma` k-slice of P·V, two n-tiles of S.
pub const KEYS: usize = 16;
/// Lanes of a warp.
const LANES: usize = 32;

/// Whether a model of `dtype` with heads `head_dim` wide runs its fused attention forward as
/// this kernel: bf16 operands, whole 16-column k-slices of the head, and at most 128 columns
/// (the output accumulators, `head_dim / 2` registers a lane, stay in registers).
pub fn supports(dtype: crate::job::Dtype, head_dim: usize) -> bool {
    dtype == crate::job::Dtype::Bf16
        && head_dim.is_multiple_of(16)
        && (16..=128).contains(&head_dim)
}

/// (row, column) of the two elements of A-fragment register `r` (0..4) of `lane` (16×16).
pub fn a_at(lane: usize, r: usize) -> (usize, usize) {
    (lane / 4 + 8 * (r & 1), 2 * (lane % 4) + 8 * (r >> 1))
}

/// (k, n) of the two elements of B-fragment register `r` (0..2) of `lane` (16×8, k-major pairs).
pub fn b_at(lane: usize, r: usize) -> (usize, usize) {
    (2 * (lane % 4) + 8 * r, lane / 4)
}

/// (row, column) of accumulator `c` (0..4) of `lane` (16×8).
pub fn c_at(lane: usize, c: usize) -> (usize, usize) {
    (lane / 4 + 8 * (c >> 1), 2 * (lane % 4) + (c & 1))
}

/// bf16 bits of `x`, rounded to nearest even (NaN kept a NaN), as every store of the kernels.
pub fn bf16(x: f32) -> u16 {
    let b = x.to_bits();
    if x.is_nan() {
        return ((b >> 16) | 64) as u16;
    }
    ((b + 0x7fff + ((b >> 16) & 1)) >> 16) as u16
}

pub fn widen(h: u16) -> f32 {
    f32::from_bits(u32::from(h) << 16)
}

/// Two bf16 in a register: `lo` at the lower index.
pub fn pack(lo: u16, hi: u16) -> u32 {
    u32::from(lo) | (u32::from(hi) << 16)
}

/// `mma.m16n8k16.row.col` of a warp: D = A·B + C, each lane's fragments in its slot.
pub fn mma(a: &[[u32; 4]; LANES], b: &[[u32; 2]; LANES], c: &mut [[f32; 4]; LANES]) {
    let mut am = [[0f32; 16]; 16];
    let mut bm = [[0f32; 8]; 16];
    for lane in 0..LANES {
        for (r, &reg) in a[lane].iter().enumerate() {
            let (i, k) = a_at(lane, r);
            am[i][k] = widen(reg as u16);
            am[i][k + 1] = widen((reg >> 16) as u16);
        }
        for (r, &reg) in b[lane].iter().enumerate() {
            let (k, n) = b_at(lane, r);
            bm[k][n] = widen(reg as u16);
            bm[k + 1][n] = widen((reg >> 16) as u16);
        }
    }
    for (lane, acc) in c.iter_mut().enumerate() {
        for (ci, v) in acc.iter_mut().enumerate() {
            let (i, j) = c_at(lane, ci);
            *v += (0..16).map(|k| am[i][k] * bm[k][j]).sum::<f32>();
        }
    }
}

/// The shape a kernel is specialised to: heads, kv heads, head width, sequence length, and the
/// qkv rows' width (`(heads + 2·kv_heads)·head_dim`).
#[derive(Clone, Copy, Debug)]
pub struct Shape {
    pub heads: usize,
    pub kv_heads: usize,
    pub d: usize,
    pub s: usize,
}

impl Shape {
    /// The shape of an [`Op::FlashForward`](super::Op::FlashForward).
    ///
    /// # Panics
    /// When `op` is another op (a caller's bug).
    pub fn of(op: super::Op) -> Shape {
        match op {
            super::Op::FlashForward {
                heads,
                kv_heads,
                head_dim,
                seq_len,
            } => Shape {
                heads: heads as usize,
                kv_heads: kv_heads as usize,
                d: head_dim as usize,
                s: seq_len as usize,
            },
            other => panic!("{other:?} is not the fused attention"),
        }
    }

    pub fn width(&self) -> usize {
        (self.heads + 2 * self.kv_heads) * self.d
    }

    /// Warps (indices of the kernel) for `b` sequences.
    pub fn warps(&self, b: usize) -> usize {
        b * self.heads * self.s.div_ceil(QROWS)
    }

    /// √d's reciprocal times log₂e: scores go straight into base 2.
    pub fn scale_log2(&self) -> f32 {
        (1.0 / (self.d as f32).sqrt()) * std::f32::consts::LOG2_E
    }
}

/// Where warp `w` works: sequence, query head, kv group and first query row.
pub fn place(sh: &Shape, w: usize) -> (usize, usize, usize, usize) {
    let blocks = sh.s.div_ceil(QROWS);
    let (q0, n, b) = (
        w % blocks * QROWS,
        w / blocks % sh.heads,
        w / blocks / sh.heads,
    );
    (b, n, n / (sh.heads / sh.kv_heads), q0)
}

/// Runs warp `w` on `qkv` (bf16 bits, token rows of [`Shape::width`]), writing its rows of `out`
/// (`[token][heads·d]`, through `store(index, value)`) and of `lse` (`[b][head][s]`).
pub fn warp(sh: &Shape, w: usize, qkv: &[u16], store: &mut dyn FnMut(usize, f32), lse: &mut [f32]) {
    let (d, s, width) = (sh.d, sh.s, sh.width());
    let (b, n, g, q0) = place(sh, w);
    let hidden = sh.heads * d;
    let (qcol, kcol, vcol) = (n * d, hidden + g * d, hidden + sh.kv_heads * d + g * d);
    // Element (token row t of the sequence, column c) of qkv, 0 past the sequence.
    let at = |t: usize, c: usize| {
        if t < s {
            qkv[(b * s + t) * width + c]
        } else {
            0
        }
    };
    let pair = |t: usize, c: usize| pack(at(t, c), at(t, c + 1));

    // Q's A fragments, one per 16 columns of the head.
    let kk = d / 16;
    let qa: Vec<[[u32; 4]; LANES]> = (0..kk)
        .map(|k| {
            std::array::from_fn(|lane| {
                std::array::from_fn(|r| {
                    let (i, c) = a_at(lane, r);
                    pair(q0 + i, qcol + 16 * k + c)
                })
            })
        })
        .collect();
    let mut m = [[f32::NEG_INFINITY; 2]; LANES];
    let mut l = [[0f32; 2]; LANES];
    let mut o = vec![[[0f32; 4]; LANES]; d / 8];
    let last = (q0 + QROWS).min(s);
    for j0 in (0..last).step_by(KEYS) {
        // S for keys j0..j0 + 16 as two n-tiles of 8 keys.
        let mut st = [[[0f32; 4]; LANES]; 2];
        for (nt, tile) in st.iter_mut().enumerate() {
            for (k, a) in qa.iter().enumerate() {
                let kb: [[u32; 2]; LANES] = std::array::from_fn(|lane| {
                    std::array::from_fn(|r| {
                        let (c, key) = b_at(lane, r);
                        pair(j0 + 8 * nt + key, kcol + 16 * k + c)
                    })
                });
                mma(a, &kb, tile);
            }
        }
        // Scale into base 2, mask, and each row's max over the block.
        let mut x = [[[0f32; 4]; 2]; LANES];
        let mut block_max = [[f32::NEG_INFINITY; 2]; LANES];
        for lane in 0..LANES {
            for nt in 0..2 {
                for c in 0..4 {
                    let (i, j) = c_at(lane, c);
                    let (row, key) = (q0 + i, j0 + 8 * nt + j);
                    let v = if key > row || key >= s {
                        f32::NEG_INFINITY
                    } else {
                        st[nt][lane][c] * sh.scale_log2()
                    };
                    x[lane][nt][c] = v;
                    block_max[lane][c >> 1] = block_max[lane][c >> 1].max(v);
                }
            }
        }
        // The four lanes of a row agree on its max (butterfly over lane bits 0 and 1).
        for bit in [1, 2] {
            let prev = block_max;
            for lane in 0..LANES {
                for h in 0..2 {
                    block_max[lane][h] = prev[lane][h].max(prev[lane ^ bit][h]);
                }
            }
        }
        // Online softmax: rescale by the max's growth, add this block's exponentials.
        let mut pa = [[0u32; 4]; LANES];
        for lane in 0..LANES {
            let mut p = [[0f32; 4]; 2];
            for h in 0..2 {
                let new = m[lane][h].max(block_max[lane][h]);
                let corr = (m[lane][h] - new).exp2();
                m[lane][h] = new;
                let mut sum = 0f32;
                for nt in 0..2 {
                    for e in 0..2 {
                        let v = (x[lane][nt][2 * h + e] - new).exp2();
                        p[nt][2 * h + e] = v;
                        sum += v;
                    }
                }
                l[lane][h] = l[lane][h] * corr + sum;
                for tile in o.iter_mut() {
                    tile[lane][2 * h] *= corr;
                    tile[lane][2 * h + 1] *= corr;
                }
            }
            // P's accumulators are its A fragment: registers 0/1 from n-tile 0, 2/3 from 1.
            for (r, reg) in pa[lane].iter_mut().enumerate() {
                let (nt, h) = (r >> 1, r & 1);
                *reg = pack(bf16(p[nt][2 * h]), bf16(p[nt][2 * h + 1]));
            }
        }
        // O += P·V, 8 columns of the head at a time.
        for (nt, tile) in o.iter_mut().enumerate() {
            let vb: [[u32; 2]; LANES] = std::array::from_fn(|lane| {
                std::array::from_fn(|r| {
                    let (key, c) = b_at(lane, r);
                    let col = vcol + 8 * nt + c;
                    pack(at(j0 + key, col), at(j0 + key + 1, col))
                })
            });
            mma(&pa, &vb, tile);
        }
    }
    // Each row's sum over its four lanes, then O/l and the log-sum-exp.
    for bit in [1, 2] {
        let prev = l;
        for lane in 0..LANES {
            for h in 0..2 {
                l[lane][h] = prev[lane][h] + prev[lane ^ bit][h];
            }
        }
    }
    for lane in 0..LANES {
        for h in 0..2 {
            let row = q0 + lane / 4 + 8 * h;
            if row >= s {
                continue;
            }
            for (nt, tile) in o.iter().enumerate() {
                for e in 0..2 {
                    let col = 8 * nt + 2 * (lane % 4) + e;
                    store(
                        (b * s + row) * hidden + qcol + col,
                        tile[lane][2 * h + e] / l[lane][h],
                    );
                }
            }
            if lane % 4 == 0 {
                let ln2 = std::f32::consts::LN_2;
                lse[(b * sh.heads + n) * s + row] = (m[lane][h] + l[lane][h].log2()) * ln2;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Causal attention in f64 on the bf16 inputs: the output and each row's log-sum-exp.
    fn reference(sh: &Shape, b: usize, qkv: &[u16]) -> (Vec<f64>, Vec<f64>) {
        let (d, s, w, hidden) = (sh.d, sh.s, sh.width(), sh.heads * sh.d);
        let x = |t: usize, c: usize| f64::from(widen(qkv[t * w + c]));
        let mut out = vec![0f64; b * s * hidden];
        let mut lse = vec![0f64; b * sh.heads * s];
        for bi in 0..b {
            for n in 0..sh.heads {
                let g = n / (sh.heads / sh.kv_heads);
                let (qc, kc) = (n * d, hidden + g * d);
                let vc = hidden + sh.kv_heads * d + g * d;
                for i in 0..s {
                    let scores: Vec<f64> = (0..=i)
                        .map(|j| {
                            let dot: f64 = (0..d)
                                .map(|c| x(bi * s + i, qc + c) * x(bi * s + j, kc + c))
                                .sum();
                            dot / (d as f64).sqrt()
                        })
                        .collect();
                    let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                    let sum: f64 = scores.iter().map(|v| (v - max).exp()).sum();
                    lse[(bi * sh.heads + n) * s + i] = max + sum.ln();
                    for c in 0..d {
                        let v: f64 = (0..=i)
                            .map(|j| (scores[j] - max).exp() / sum * x(bi * s + j, vc + c))
                            .sum();
                        out[(bi * s + i) * hidden + qc + c] = v;
                    }
                }
            }
        }
        (out, lse)
    }

    /// Every warp of the model against the f64 attention: outputs within 5e-3 (P goes to bf16
    /// before P·V, as FlashAttention's does: errors up to 2.4e-3 here), log-sum-exps within
    /// 1e-4. Shapes cover grouped-query heads, head widths of 32, 64 and 128, and sequences that
    /// are not a multiple of the 16-row block (the last warp's padding rows are computed, never
    /// stored).
    #[test]
    fn warps_compute_causal_attention() {
        let shapes = [
            (
                Shape {
                    heads: 2,
                    kv_heads: 2,
                    d: 64,
                    s: 48,
                },
                2,
            ),
            (
                Shape {
                    heads: 4,
                    kv_heads: 2,
                    d: 32,
                    s: 37,
                },
                1,
            ),
            (
                Shape {
                    heads: 2,
                    kv_heads: 1,
                    d: 128,
                    s: 20,
                },
                2,
            ),
        ];
        for (sh, b) in shapes {
            let mut seed = 0x2545_f491_4f6c_dd1du64;
            let mut rnd = || {
                seed ^= seed << 13;
                seed ^= seed >> 7;
                seed ^= seed << 17;
                (seed >> 40) as f32 / (1u64 << 24) as f32 * 4.0 - 2.0
            };
            let qkv: Vec<u16> = (0..b * sh.s * sh.width()).map(|_| bf16(rnd())).collect();
            let hidden = sh.heads * sh.d;
            let mut out = vec![f32::NAN; b * sh.s * hidden];
            let mut lse = vec![f32::NAN; b * sh.heads * sh.s];
            for w in 0..sh.warps(b) {
                warp(&sh, w, &qkv, &mut |i, v| out[i] = v, &mut lse);
            }
            let (want, want_lse) = reference(&sh, b, &qkv);
            for (i, (&got, &want)) in out.iter().zip(&want).enumerate() {
                let err = (f64::from(got) - want).abs();
                assert!(
                    err <= 5e-3 * (1.0 + want.abs()),
                    "{sh:?} out[{i}]: {got} vs {want}"
                );
            }
            for (i, (&got, &want)) in lse.iter().zip(&want_lse).enumerate() {
                let err = (f64::from(got) - want).abs();
                assert!(
                    err <= 1e-4 * (1.0 + want.abs()),
                    "{sh:?} lse[{i}]: {got} vs {want}"
                );
            }
        }
    }

    /// The fragment layouts cover each tile exactly once (two elements per register).
    #[test]
    fn fragments_tile_their_matrices() {
        let mut a = [[0u8; 16]; 16];
        let mut b = [[0u8; 8]; 16];
        let mut c = [[0u8; 8]; 16];
        for lane in 0..LANES {
            for r in 0..4 {
                let (i, k) = a_at(lane, r);
                a[i][k] += 1;
                a[i][k + 1] += 1;
                let (i, j) = c_at(lane, r);
                c[i][j] += 1;
            }
            for r in 0..2 {
                let (k, n) = b_at(lane, r);
                b[k][n] += 1;
                b[k + 1][n] += 1;
            }
        }
        assert!(a
            .iter()
            .flatten()
            .chain(b.iter().flatten())
            .all(|&x| x == 1));
        assert!(c.iter().flatten().all(|&x| x == 1));
    }
}
