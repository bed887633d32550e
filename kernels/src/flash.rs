//! The fused causal attention on tensor cores ([`super::Op::FlashForward`], and for the
//! backward [`super::Op::FlashBackwardQuery`] and [`super::Op::FlashBackwardKeys`]) as one warp
//! runs it, lane by lane: the reference the generated PTX kernels are written after
//! (`codegen/flash.rs` follows this code step for step) and what the host emulation of the CUDA
//! backend runs in their place, since a host cannot execute warp-wide matrix instructions.
//!
//! Forward ([`warp`], FlashAttention-2's): a warp takes [`QROWS`] query rows of one head of one
//! sequence and walks the keys up to its last row [`KEYS`] at a time: S = Q·Kᵀ on
//! `mma.m16n8k16` (bf16 operands, f32 accumulators), scaled into base 2 and masked above the
//! diagonal; an online softmax keeps each row's running max `m` and each lane's share of the
//! row's sum `l`, rescaling the output accumulators when the max grows; P = exp2(S − m) goes back
//! to bf16 as the A operand of O += P·V. At the end the four lanes of a row add their sums, O/l
//! is stored in the output's dtype and the row's natural log-sum-exp `(m + log2 l)·ln 2` into
//! `lse`. The s×s matrix never leaves registers.
//!
//! Backward (FlashAttention-2's, without atomics): with each row's `D = Σ dO·O`
//! ([`super::Op::FlashDot`]), [`warp_dq`] takes 16 query rows and walks their keys, recomputing
//! P from `lse` and dP = dO·Vᵀ, forming dS = P ∘ (dP − D) and dQ = dS·K/√d; [`warp_dkv`] takes
//! 16 keys of a kv head and walks every query head of its group and every query block from the
//! diagonal on, with keys as rows: Pᵀ, dPᵀ = V·dOᵀ, dSᵀ, dV = Pᵀ·dO and dK = dSᵀ·Q/√d. Each
//! element of dQ, dK and dV is written once.
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
/// Columns of dK and dV one key-side warp accumulates ([`warp_dkv`]): a head wider than this is
/// split over several warps, so that the accumulators stay in registers.
pub const KEY_COLUMNS: usize = 64;

/// Whether a model of `dtype` with heads `head_dim` wide runs its fused attention forward as
/// this kernel: bf16 operands, whole 16-column k-slices of the head, and at most 128 columns
/// (the output accumulators, `head_dim / 2` registers a lane, stay in registers).
pub fn supports(dtype: sched_ir::job::Dtype, head_dim: usize) -> bool {
    dtype == sched_ir::job::Dtype::Bf16
        && head_dim.is_multiple_of(16)
        && (16..=128).contains(&head_dim)
}

/// Whether its backward runs as this module's kernels too: heads at most [`KEY_COLUMNS`] wide,
/// or whole multiples of it (128), which the key side splits into parts so that its dK and dV
/// accumulators stay in registers (one 128-wide warp spilled: 255 registers, up to 224 words).
pub fn supports_backward(dtype: sched_ir::job::Dtype, head_dim: usize) -> bool {
    supports(dtype, head_dim) && (head_dim <= KEY_COLUMNS || head_dim.is_multiple_of(KEY_COLUMNS))
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

/// The shape a fused attention kernel is specialised to: query heads, kv heads, head width and
/// sequence length (qkv rows are [`Shape::width`] wide).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Shape {
    pub heads: usize,
    pub kv_heads: usize,
    pub d: usize,
    pub s: usize,
}

impl Shape {
    /// The kernel names' part for the shape.
    pub fn suffix(&self) -> String {
        format!(
            "_h{}_kv{}_d{}_s{}",
            self.heads, self.kv_heads, self.d, self.s
        )
    }

    pub fn width(&self) -> usize {
        (self.heads + 2 * self.kv_heads) * self.d
    }

    /// Warps (indices of the kernel) for `b` sequences.
    pub fn warps(&self, b: usize) -> usize {
        b * self.heads * self.s.div_ceil(QROWS)
    }

    /// Warps of the backward's key side ([`warp_dkv`]) for `b` sequences.
    pub fn key_warps(&self, b: usize) -> usize {
        b * self.kv_heads * self.s.div_ceil(KEYS) * self.key_parts()
    }

    /// The [`KEY_COLUMNS`]-column parts of a head the key side splits it into.
    pub fn key_parts(&self) -> usize {
        self.d.div_ceil(KEY_COLUMNS)
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

/// A warp's fragment registers: four per lane for A, two for B.
type AFrag = [[u32; 4]; LANES];
type BFrag = [[u32; 2]; LANES];
/// A warp's accumulators of one 16×8 tile.
type CFrag = [[f32; 4]; LANES];

/// The A fragment (16×16) of a row-major source: element (i, c) is `at(i, c)` (bf16 bits).
fn a_rows(at: &dyn Fn(usize, usize) -> u16) -> AFrag {
    std::array::from_fn(|lane| {
        std::array::from_fn(|r| {
            let (i, c) = a_at(lane, r);
            pack(at(i, c), at(i, c + 1))
        })
    })
}

/// The B fragment (16×8) whose element (k, n) is `at(n, k)`: pairs along a source row.
fn b_rows(at: &dyn Fn(usize, usize) -> u16) -> BFrag {
    std::array::from_fn(|lane| {
        std::array::from_fn(|r| {
            let (k, n) = b_at(lane, r);
            pack(at(n, k), at(n, k + 1))
        })
    })
}

/// The B fragment (16×8) whose element (k, n) is `at(k, n)`: pairs down a source column.
fn b_cols(at: &dyn Fn(usize, usize) -> u16) -> BFrag {
    std::array::from_fn(|lane| {
        std::array::from_fn(|r| {
            let (k, n) = b_at(lane, r);
            pack(at(k, n), at(k + 1, n))
        })
    })
}

/// Two accumulator tiles side by side (16×16) as the A fragment of the next product, rounded to
/// bf16: registers 0/1 from tile 0, 2/3 from tile 1.
fn c_to_a(t: &[CFrag; 2]) -> AFrag {
    std::array::from_fn(|lane| {
        std::array::from_fn(|r| {
            let (nt, h) = (r >> 1, r & 1);
            pack(bf16(t[nt][lane][2 * h]), bf16(t[nt][lane][2 * h + 1]))
        })
    })
}

/// What the backward reads: qkv (bf16 bits), the output gradient dO (bf16 bits, rows of the
/// heads' width), each row's natural log-sum-exp and its `D = Σ dO·O` (`[seq][head][row]`).
pub struct Grads<'a> {
    pub qkv: &'a [u16],
    pub dout: &'a [u16],
    pub lse: &'a [f32],
    pub dot: &'a [f32],
}

impl Grads<'_> {
    /// Element (token row t of sequence `b`, column c) of qkv and of dO; 0 past the sequence.
    fn readers(
        &self,
        sh: &Shape,
        b: usize,
    ) -> (
        impl Fn(usize, usize) -> u16 + '_,
        impl Fn(usize, usize) -> u16 + '_,
    ) {
        let (s, width, hidden) = (sh.s, sh.width(), sh.heads * sh.d);
        let read = move |m: &'_ [u16], w: usize, t: usize, c: usize| {
            if t < s {
                m[(b * s + t) * w + c]
            } else {
                0
            }
        };
        (
            move |t, c| read(self.qkv, width, t, c),
            move |t, c| read(self.dout, hidden, t, c),
        )
    }
}

/// The query-side warp `w` of the backward ([`place`]'s numbering): for its 16 query rows of
/// one head it walks the keys up to its last row, recomputes P = exp(S − lse) and
/// dP = dO·Vᵀ, forms dS = P ∘ (dP − D) and accumulates dQ = dS·K/√d, stored through
/// `store(index into qkv's layout, value)`.
pub fn warp_dq(sh: &Shape, w: usize, x: &Grads<'_>, store: &mut dyn FnMut(usize, f32)) {
    let (d, s, width) = (sh.d, sh.s, sh.width());
    let (b, n, g, q0) = place(sh, w);
    let hidden = sh.heads * d;
    let (qcol, kcol, vcol) = (n * d, hidden + g * d, hidden + sh.kv_heads * d + g * d);
    let (at, dat) = x.readers(sh, b);
    let row_at = |i: usize| (b * sh.heads + n) * s + (q0 + i).min(s - 1);
    let kk = d / 16;
    let qa: Vec<AFrag> = (0..kk)
        .map(|k| a_rows(&|i, c| at(q0 + i, qcol + 16 * k + c)))
        .collect();
    let da: Vec<AFrag> = (0..kk)
        .map(|k| a_rows(&|i, c| dat(q0 + i, qcol + 16 * k + c)))
        .collect();
    let mut dq = vec![[[0f32; 4]; LANES]; d / 8];
    let last = (q0 + QROWS).min(s);
    for j0 in (0..last).step_by(KEYS) {
        let mut st = [[[0f32; 4]; LANES]; 2];
        let mut dp = [[[0f32; 4]; LANES]; 2];
        for nt in 0..2 {
            for k in 0..kk {
                mma(
                    &qa[k],
                    &b_rows(&|key, c| at(j0 + 8 * nt + key, kcol + 16 * k + c)),
                    &mut st[nt],
                );
                mma(
                    &da[k],
                    &b_rows(&|key, c| at(j0 + 8 * nt + key, vcol + 16 * k + c)),
                    &mut dp[nt],
                );
            }
        }
        let mut ds = [[[0f32; 4]; LANES]; 2];
        for lane in 0..LANES {
            for nt in 0..2 {
                for c in 0..4 {
                    let (i, j) = c_at(lane, c);
                    let (row, key) = (q0 + i, j0 + 8 * nt + j);
                    let masked = key > row || key >= s || row >= s;
                    let stats = (x.lse[row_at(i)], x.dot[row_at(i)]);
                    ds[nt][lane][c] =
                        p_and_ds(sh, (st[nt][lane][c], dp[nt][lane][c]), masked, stats).1;
                }
            }
        }
        let dsa = c_to_a(&ds);
        for (nt, tile) in dq.iter_mut().enumerate() {
            mma(
                &dsa,
                &b_cols(&|key, c| at(j0 + key, kcol + 8 * nt + c)),
                tile,
            );
        }
    }
    let scale = 1.0 / (d as f32).sqrt();
    for lane in 0..LANES {
        for c in 0..4 {
            let (i, col) = c_at(lane, c);
            if q0 + i < s {
                for (nt, tile) in dq.iter().enumerate() {
                    store(
                        (b * s + q0 + i) * width + qcol + 8 * nt + col,
                        tile[lane][c] * scale,
                    );
                }
            }
        }
    }
}

/// The probability and score gradient of one accumulator of an S-like tile with its dP: 0 where
/// `masked`, else P = exp2(S·scale·log₂e − lse·log₂e) and dS = P·(dP − D) (the kernels'
/// `codegen::flash::p_and_ds`).
fn p_and_ds(sh: &Shape, (st, dp): (f32, f32), masked: bool, (lse, dot): (f32, f32)) -> (f32, f32) {
    let p = if masked {
        0.0
    } else {
        (st * sh.scale_log2() - lse * std::f32::consts::LOG2_E).exp2()
    };
    (p, p * (dp - dot))
}

/// The key-side warps of the backward: [`Shape::key_warps`] of them, warp `w` taking 16 keys of
/// one kv head of one sequence and one [`KEY_COLUMNS`]-column part of their dK and dV (the
/// parts of a head are neighbouring warps). Over every query head of its group and every query
/// block from its keys' own on, it recomputes Pᵀ and dPᵀ = V·dOᵀ with keys as rows, forms dSᵀ and
/// accumulates dV = Pᵀ·dO and dK = dSᵀ·Q/√d, stored through `store`.
pub fn warp_dkv(sh: &Shape, w: usize, x: &Grads<'_>, store: &mut dyn FnMut(usize, f32)) {
    let (d, s, width) = (sh.d, sh.s, sh.width());
    let blocks = s.div_ceil(KEYS);
    let (part, w) = (w % sh.key_parts(), w / sh.key_parts());
    let (k0, g, b) = (
        w % blocks * KEYS,
        w / blocks % sh.kv_heads,
        w / blocks / sh.kv_heads,
    );
    // This warp's n-tiles of dK and dV: 8 columns each, KEY_COLUMNS of the head at most.
    let tiles = part * KEY_COLUMNS / 8..(d.min((part + 1) * KEY_COLUMNS)) / 8;
    let hidden = sh.heads * d;
    let (kcol, vcol) = (hidden + g * d, hidden + sh.kv_heads * d + g * d);
    let (at, dat) = x.readers(sh, b);
    let kk = d / 16;
    let ka: Vec<AFrag> = (0..kk)
        .map(|k| a_rows(&|i, c| at(k0 + i, kcol + 16 * k + c)))
        .collect();
    let va: Vec<AFrag> = (0..kk)
        .map(|k| a_rows(&|i, c| at(k0 + i, vcol + 16 * k + c)))
        .collect();
    let mut dk = vec![[[0f32; 4]; LANES]; tiles.len()];
    let mut dv = vec![[[0f32; 4]; LANES]; tiles.len()];
    let group = sh.heads / sh.kv_heads;
    for n in g * group..(g + 1) * group {
        let qcol = n * d;
        let row_at = |q: usize| (b * sh.heads + n) * s + q.min(s - 1);
        for q0 in (k0..s).step_by(QROWS) {
            let mut st = [[[0f32; 4]; LANES]; 2];
            let mut dp = [[[0f32; 4]; LANES]; 2];
            for nt in 0..2 {
                for k in 0..kk {
                    let q = |qi: usize, c: usize| at(q0 + 8 * nt + qi, qcol + 16 * k + c);
                    mma(&ka[k], &b_rows(&q), &mut st[nt]);
                    let o = |qi: usize, c: usize| dat(q0 + 8 * nt + qi, qcol + 16 * k + c);
                    mma(&va[k], &b_rows(&o), &mut dp[nt]);
                }
            }
            let mut p = [[[0f32; 4]; LANES]; 2];
            let mut ds = [[[0f32; 4]; LANES]; 2];
            for lane in 0..LANES {
                for nt in 0..2 {
                    for c in 0..4 {
                        let (i, j) = c_at(lane, c);
                        let (key, q) = (k0 + i, q0 + 8 * nt + j);
                        let masked = key > q || q >= s || key >= s;
                        let stats = (x.lse[row_at(q)], x.dot[row_at(q)]);
                        (p[nt][lane][c], ds[nt][lane][c]) =
                            p_and_ds(sh, (st[nt][lane][c], dp[nt][lane][c]), masked, stats);
                    }
                }
            }
            let (pa, dsa) = (c_to_a(&p), c_to_a(&ds));
            for (t, nt) in tiles.clone().enumerate() {
                mma(
                    &pa,
                    &b_cols(&|qi, c| dat(q0 + qi, qcol + 8 * nt + c)),
                    &mut dv[t],
                );
                mma(
                    &dsa,
                    &b_cols(&|qi, c| at(q0 + qi, qcol + 8 * nt + c)),
                    &mut dk[t],
                );
            }
        }
    }
    let scale = 1.0 / (d as f32).sqrt();
    for lane in 0..LANES {
        for c in 0..4 {
            let (i, col) = c_at(lane, c);
            if k0 + i < s {
                let row = (b * s + k0 + i) * width;
                for (t, nt) in tiles.clone().enumerate() {
                    store(row + kcol + 8 * nt + col, dk[t][lane][c] * scale);
                    store(row + vcol + 8 * nt + col, dv[t][lane][c]);
                }
            }
        }
    }
}

#[cfg(test)]
#[path = "../tests/unit/flash.rs"]
pub(crate) mod tests;
