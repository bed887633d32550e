//! The fused causal attention kernels on tensor cores: the forward
//! ([`crate::Op::FlashForward`]) and the backward's two sides
//! ([`crate::Op::FlashBackwardQuery`], [`crate::Op::FlashBackwardKeys`]), each
//! `crate::flash`'s model (`warp`, `warp_dq`, `warp_dkv`) step for step, every lane its
//! own slot of the model's arrays; and the backward's row sums `D` ([`crate::Op::FlashDot`],
//! an ordinary warp-per-row kernel that the host runs too). Loops over a head's columns and over
//! the 16×8 tiles are unrolled here (the head width is a constant of the kernel); the walks over
//! key or query blocks (and, for the key side, over its group's query heads) are the only loops
//! of the code, with running maxima, sums and accumulators in registers. Built for a warp on the
//! host ([`super::Target::Warp`]), the kernels give their models' bits exactly (`warp.rs`'s test).

use super::fx::{Fx, Var, F, I};
use crate::flash::{Shape, KEYS, KEY_COLUMNS, QROWS};
use inkwell::IntPredicate;

/// A 16-bit tensor read by (token row of the sequence, column): rows `width` apart.
#[derive(Clone, Copy)]
struct Src {
    name: &'static str,
    width: u64,
}

/// What a warp's body shares: the shape, the lane's place in the fragments (its group `grp`
/// = lane / 4, `two_tig` = 2·(lane mod 4), `tig` = lane mod 4) and the sequence's first token row.
struct Warp<'c> {
    sh: Shape,
    grp: I<'c>,
    tig: I<'c>,
    two_tig: I<'c>,
    base: I<'c>,
}

type Tile<'c> = [F<'c>; 4];

impl<'c> Warp<'c> {
    fn new(fx: &Fx<'c, '_>, sh: &Shape, b: I<'c>) -> Self {
        let lane = fx.lane();
        let tig = fx.urem(lane, fx.i64c(4));
        Warp {
            sh: *sh,
            grp: fx.udiv(lane, fx.i64c(4)),
            tig,
            two_tig: fx.imul(tig, fx.i64c(2)),
            base: fx.imul(b, fx.i64c(sh.s as u64)),
        }
    }

    fn k(&self, fx: &Fx<'c, '_>, v: usize) -> I<'c> {
        fx.i64c(v as u64)
    }

    fn qkv(&self) -> Src {
        Src {
            name: "qkv",
            width: self.sh.width() as u64,
        }
    }

    fn dout(&self) -> Src {
        Src {
            name: "dout",
            width: (self.sh.heads * self.sh.d) as u64,
        }
    }

    /// `src`'s element (token `t` of the sequence, column `c`) read by `load` at its index; 0
    /// past the sequence (the load reads the last row instead, so no address leaves the tensor).
    fn read(
        &self,
        fx: &Fx<'c, '_>,
        (src, t, c): (Src, I<'c>, I<'c>),
        load: impl Fn(&str, I<'c>) -> I<'c>,
    ) -> I<'c> {
        let s = self.sh.s;
        let inside = fx.icmp(IntPredicate::ULT, t, self.k(fx, s));
        let row = fx.iadd(self.base, fx.umin(t, self.k(fx, s - 1)));
        let v = load(src.name, fx.iadd(fx.imul(row, fx.i64c(src.width)), c));
        fx.iselect(inside, v, fx.i32c(0))
    }

    /// Elements (t, c) and (t, c + 1) in one register: one 32-bit load (`c` is even, rows are
    /// an even number of elements wide, and the device code passes 4-byte-aligned tensors).
    fn row_pair(&self, fx: &Fx<'c, '_>, src: Src, t: I<'c>, c: I<'c>) -> I<'c> {
        self.read(fx, (src, t, c), |name, i| fx.load_pair16(name, i))
    }

    /// Elements (t, c) and (t + 1, c) in one register.
    fn col_pair(&self, fx: &Fx<'c, '_>, src: Src, t: I<'c>, c: I<'c>) -> I<'c> {
        let elem = |t| self.read(fx, (src, t, c), |name, i| fx.load_bits16(name, i));
        fx.pack16(elem(t), elem(fx.iadd(t, fx.i64c(1))))
    }

    /// The A fragment whose element (i, c) is `src(row0 + i, col0 + c)` (`flash::a_at`).
    fn a_rows(&self, fx: &Fx<'c, '_>, src: Src, row0: I<'c>, col0: I<'c>) -> [I<'c>; 4] {
        std::array::from_fn(|r| {
            let t = fx.iadd(fx.iadd(row0, self.grp), self.k(fx, 8 * (r & 1)));
            let c = fx.iadd(fx.iadd(col0, self.two_tig), self.k(fx, 8 * (r >> 1)));
            self.row_pair(fx, src, t, c)
        })
    }

    /// The A fragments of a whole head: rows `row0..row0 + 16` of `src` from column `col`, one
    /// per 16 columns.
    fn head(&self, fx: &Fx<'c, '_>, src: Src, row0: I<'c>, col: I<'c>) -> Vec<[I<'c>; 4]> {
        (0..self.sh.d / 16)
            .map(|kk| self.a_rows(fx, src, row0, fx.iadd(col, self.k(fx, 16 * kk))))
            .collect()
    }

    /// The B fragment whose element (k, n) is `src(n0 + n, col0 + k)`: pairs along a row.
    fn b_rows(&self, fx: &Fx<'c, '_>, src: Src, n0: I<'c>, col0: I<'c>) -> [I<'c>; 2] {
        let t = fx.iadd(n0, self.grp);
        std::array::from_fn(|r| {
            let c = fx.iadd(fx.iadd(col0, self.two_tig), self.k(fx, 8 * r));
            self.row_pair(fx, src, t, c)
        })
    }

    /// The B fragment whose element (k, n) is `src(k0 + k, col0 + n)`: pairs down a column.
    fn b_cols(&self, fx: &Fx<'c, '_>, src: Src, k0: I<'c>, col0: I<'c>) -> [I<'c>; 2] {
        let c = fx.iadd(col0, self.grp);
        std::array::from_fn(|r| {
            let t = fx.iadd(fx.iadd(k0, self.two_tig), self.k(fx, 8 * r));
            self.col_pair(fx, src, t, c)
        })
    }

    /// Two accumulator tiles side by side as the A fragment of the next product, in bf16.
    fn c_to_a(&self, fx: &Fx<'c, '_>, t: &[Tile<'c>; 2]) -> [I<'c>; 4] {
        std::array::from_fn(|r| {
            let (nt, h) = (r >> 1, r & 1);
            let hi = fx.bf16_bits(t[nt][2 * h + 1]);
            fx.pack16(fx.bf16_bits(t[nt][2 * h]), hi)
        })
    }

    /// A head's A fragments `a` times the B fragments of `src`'s rows `n0..n0 + 8` from
    /// column `col` (the same 16-column slices), summed: one S-like 16×8 tile.
    fn product(
        &self,
        fx: &Fx<'c, '_>,
        a: &[[I<'c>; 4]],
        (src, n0, col): (Src, I<'c>, I<'c>),
    ) -> Tile<'c> {
        let mut acc = [fx.f(0.0); 4];
        for (kk, frag) in a.iter().enumerate() {
            let b = self.b_rows(fx, src, n0, fx.iadd(col, self.k(fx, 16 * kk)));
            acc = fx.mma_bf16(*frag, b, acc);
        }
        acc
    }

    /// Row and column offsets of accumulator `c` within its tile (`flash::c_at`).
    fn c_row(&self, fx: &Fx<'c, '_>, c: usize) -> I<'c> {
        fx.iadd(self.grp, self.k(fx, 8 * (c >> 1)))
    }

    fn c_col(&self, fx: &Fx<'c, '_>, c: usize) -> I<'c> {
        fx.iadd(self.two_tig, self.k(fx, c & 1))
    }

    /// Whether a tile's element (query `query`, key `key`) is masked: above the diagonal, or
    /// `last` (the query or key the caller's walk may carry past the sequence) is past it.
    fn masked(&self, fx: &Fx<'c, '_>, query: I<'c>, key: I<'c>, last: I<'c>) -> I<'c> {
        let late = fx.icmp(IntPredicate::UGT, key, query);
        fx.or(
            late,
            fx.icmp(IntPredicate::UGE, last, self.k(fx, self.sh.s)),
        )
    }

    /// √d's reciprocal.
    fn scale(&self) -> f32 {
        1.0 / (self.sh.d as f32).sqrt()
    }
}

/// Accumulators of `tiles` 16×8 tiles, zeroed.
fn tiles<'c>(fx: &Fx<'c, '_>, tiles: usize) -> Vec<[Var<'c>; 4]> {
    (0..tiles)
        .map(|_| std::array::from_fn(|_| fx.var(fx.f(0.0))))
        .collect()
}

/// `tile += A·B` through its variables.
fn accumulate<'c>(fx: &Fx<'c, '_>, tile: &[Var<'c>; 4], a: [I<'c>; 4], b: [I<'c>; 2]) {
    let c = std::array::from_fn(|e| fx.get(&tile[e]));
    for (v, x) in tile.iter().zip(fx.mma_bf16(a, b, c)) {
        fx.set(v, x);
    }
}

/// `flash::place` of warp `w`: sequence, query head, kv group, first query row.
fn place<'c>(fx: &Fx<'c, '_>, sh: &Shape, w: I<'c>) -> (I<'c>, I<'c>, I<'c>, I<'c>) {
    let blocks = fx.i64c(sh.s.div_ceil(QROWS) as u64);
    let q0 = fx.imul(fx.urem(w, blocks), fx.i64c(QROWS as u64));
    let n = fx.urem(fx.udiv(w, blocks), fx.i64c(sh.heads as u64));
    let b = fx.udiv(fx.udiv(w, blocks), fx.i64c(sh.heads as u64));
    let g = fx.udiv(n, fx.i64c((sh.heads / sh.kv_heads) as u64));
    (b, n, g, q0)
}

/// Columns in qkv of query head `n` and of kv group `g`'s keys and values.
fn columns<'c>(fx: &Fx<'c, '_>, sh: &Shape, n: I<'c>, g: I<'c>) -> (I<'c>, I<'c>, I<'c>) {
    let (d, hidden) = (sh.d as u64, (sh.heads * sh.d) as u64);
    let gd = fx.imul(g, fx.i64c(d));
    (
        fx.imul(n, fx.i64c(d)),
        fx.iadd(fx.i64c(hidden), gd),
        fx.iadd(fx.i64c(hidden + sh.kv_heads as u64 * d), gd),
    )
}

/// Index of row `row` of head `n` of sequence `b` in the `[seq][head][row]` statistics.
fn stat<'c>(fx: &Fx<'c, '_>, sh: &Shape, b: I<'c>, n: I<'c>, row: I<'c>) -> I<'c> {
    let bn = fx.iadd(fx.imul(b, fx.i64c(sh.heads as u64)), n);
    fx.iadd(fx.imul(bn, fx.i64c(sh.s as u64)), row)
}

/// `flash::warp`: warp `w` of the forward.
pub fn forward<'c>(fx: &mut Fx<'c, '_>, sh: &Shape, w: I<'c>) {
    let (b, n, g, q0) = place(fx, sh, w);
    let x = Warp::new(fx, sh, b);
    let (qcol, kcol, vcol) = columns(fx, sh, n, g);
    let qkv = x.qkv();
    let qa = x.head(fx, qkv, q0, qcol);
    let m: [Var<'c>; 2] = std::array::from_fn(|_| fx.var(fx.f(f32::NEG_INFINITY)));
    let l: [Var<'c>; 2] = std::array::from_fn(|_| fx.var(fx.f(0.0)));
    let o = tiles(fx, sh.d / 8);
    let scale_log2 = sh.scale_log2();
    let last = fx.umin(fx.iadd(q0, x.k(fx, QROWS)), x.k(fx, sh.s));
    fx.strided_loop(x.k(fx, 0), last, x.k(fx, KEYS), |fx, j0| {
        // S for keys j0..j0 + 16, two n-tiles of 8 keys; scaled into base 2 and masked above
        // the diagonal and past the sequence.
        let xs: [Tile<'c>; 2] = std::array::from_fn(|nt| {
            let keys = fx.iadd(j0, x.k(fx, 8 * nt));
            let st = x.product(fx, &qa, (qkv, keys, kcol));
            std::array::from_fn(|c| {
                let row = fx.iadd(q0, x.c_row(fx, c));
                let key = fx.iadd(keys, x.c_col(fx, c));
                let v = fx.mul(st[c], fx.f(scale_log2));
                fx.fselect(x.masked(fx, row, key, key), fx.f(f32::NEG_INFINITY), v)
            })
        });
        let mut p = [[fx.f(0.0); 4]; 2];
        for h in 0..2 {
            // The row's max over the block, agreed by its four lanes.
            let mut bmax = fx.f(f32::NEG_INFINITY);
            for tile in &xs {
                for e in 0..2 {
                    bmax = fx.maxnum(bmax, tile[2 * h + e]);
                }
            }
            for bit in [1, 2] {
                bmax = fx.maxnum(bmax, fx.shfl_xor(bmax, bit));
            }
            let old = fx.get(&m[h]);
            let new = fx.maxnum(old, bmax);
            let corr = fx.exp2_approx(fx.sub(old, new));
            fx.set(&m[h], new);
            let mut sum = fx.f(0.0);
            for nt in 0..2 {
                for e in 0..2 {
                    let v = fx.exp2_approx(fx.sub(xs[nt][2 * h + e], new));
                    p[nt][2 * h + e] = v;
                    sum = fx.add(sum, v);
                }
            }
            fx.set(&l[h], fx.add(fx.mul(fx.get(&l[h]), corr), sum));
            for tile in &o {
                for e in 0..2 {
                    fx.set(&tile[2 * h + e], fx.mul(fx.get(&tile[2 * h + e]), corr));
                }
            }
        }
        let pa = x.c_to_a(fx, &p);
        for (nt, tile) in o.iter().enumerate() {
            let col = fx.iadd(vcol, x.k(fx, 8 * nt));
            accumulate(fx, tile, pa, x.b_cols(fx, qkv, j0, col));
        }
    });
    // Each row's sum over its four lanes, then O/l and the natural log-sum-exp.
    for lh in &l {
        for bit in [1, 2] {
            let v = fx.get(lh);
            fx.set(lh, fx.add(v, fx.shfl_xor(v, bit)));
        }
    }
    let hidden = (sh.heads * sh.d) as u64;
    for h in 0..2 {
        let row = fx.iadd(q0, x.c_row(fx, 2 * h));
        let inside = fx.icmp(IntPredicate::ULT, row, x.k(fx, sh.s));
        fx.when(inside, |fx| {
            let sum = fx.get(&l[h]);
            let at = fx.iadd(fx.imul(fx.iadd(x.base, row), fx.i64c(hidden)), qcol);
            for (nt, tile) in o.iter().enumerate() {
                for e in 0..2 {
                    let col = fx.iadd(x.c_col(fx, e), x.k(fx, 8 * nt));
                    let v = fx.div(fx.get(&tile[2 * h + e]), sum);
                    fx.store("out", fx.iadd(at, col), v);
                }
            }
            let first = fx.icmp(IntPredicate::EQ, x.tig, x.k(fx, 0));
            fx.when(first, |fx| {
                let lse = fx.add(fx.get(&m[h]), fx.log2_approx(sum));
                let lse = fx.mul(lse, fx.f(std::f32::consts::LN_2));
                fx.store("lse", stat(fx, sh, b, n, row), lse);
            });
        });
    }
}

/// Row `r` of [`crate::Op::FlashDot`]: `D = Σ_c dO·O` over head `r mod heads` of token
/// `r / heads`, its lanes striding the columns.
pub fn dot<'c>(fx: &mut Fx<'c, '_>, sh: &Shape, r: I<'c>) {
    let heads = fx.i64c(sh.heads as u64);
    let (t, n) = (fx.udiv(r, heads), fx.urem(r, heads));
    let s = fx.i64c(sh.s as u64);
    let (b, i) = (fx.udiv(t, s), fx.urem(t, s));
    let d = fx.i64c(sh.d as u64);
    let at = fx.iadd(fx.imul(t, fx.i64c((sh.heads * sh.d) as u64)), fx.imul(n, d));
    let sum = fx.row_sum(fx.i64c(0), d, |fx, c| {
        let j = fx.iadd(at, c);
        fx.mul(fx.load("dout", j), fx.load("out", j))
    });
    fx.first_lane(|fx| fx.store("dot", stat(fx, sh, b, n, i), sum));
}

/// The probability and score gradient of accumulator `c` of an S-like tile `st` with its dP
/// tile `dp`: masked (0) where `masked`, else P = exp2(S·scale·log₂e − lse·log₂e) and
/// dS = P·(dP − D).
fn p_and_ds<'c>(
    fx: &Fx<'c, '_>,
    sh: &Shape,
    (st, dp): (F<'c>, F<'c>),
    masked: I<'c>,
    (lse, dot): (F<'c>, F<'c>),
) -> (F<'c>, F<'c>) {
    let lse2 = fx.mul(lse, fx.f(std::f32::consts::LOG2_E));
    let e = fx.exp2_approx(fx.sub(fx.mul(st, fx.f(sh.scale_log2())), lse2));
    let p = fx.fselect(masked, fx.f(0.0), e);
    (p, fx.mul(p, fx.sub(dp, dot)))
}

/// `flash::warp_dq`: the backward's query-side warp `w`.
pub fn backward_query<'c>(fx: &mut Fx<'c, '_>, sh: &Shape, w: I<'c>) {
    let (b, n, g, q0) = place(fx, sh, w);
    let x = Warp::new(fx, sh, b);
    let (qcol, kcol, vcol) = columns(fx, sh, n, g);
    let (qkv, dout) = (x.qkv(), x.dout());
    let qa = x.head(fx, qkv, q0, qcol);
    let da = x.head(fx, dout, q0, qcol);
    // This lane's two rows' log-sum-exps and D (rows past the sequence read the last one's).
    let stats: [(F<'c>, F<'c>); 2] = std::array::from_fn(|h| {
        let row = fx.umin(fx.iadd(q0, x.c_row(fx, 2 * h)), x.k(fx, sh.s - 1));
        let at = stat(fx, sh, b, n, row);
        (fx.load("lse", at), fx.load("dot", at))
    });
    let dq = tiles(fx, sh.d / 8);
    let last = fx.umin(fx.iadd(q0, x.k(fx, QROWS)), x.k(fx, sh.s));
    fx.strided_loop(x.k(fx, 0), last, x.k(fx, KEYS), |fx, j0| {
        let ds: [Tile<'c>; 2] = std::array::from_fn(|nt| {
            let keys = fx.iadd(j0, x.k(fx, 8 * nt));
            let st = x.product(fx, &qa, (qkv, keys, kcol));
            let dp = x.product(fx, &da, (qkv, keys, vcol));
            std::array::from_fn(|c| {
                let row = fx.iadd(q0, x.c_row(fx, c));
                let key = fx.iadd(keys, x.c_col(fx, c));
                let masked = x.masked(fx, row, key, row);
                p_and_ds(fx, sh, (st[c], dp[c]), masked, stats[c >> 1]).1
            })
        });
        let dsa = x.c_to_a(fx, &ds);
        for (nt, tile) in dq.iter().enumerate() {
            let col = fx.iadd(kcol, x.k(fx, 8 * nt));
            accumulate(fx, tile, dsa, x.b_cols(fx, qkv, j0, col));
        }
    });
    let width = fx.i64c(sh.width() as u64);
    for c in 0..4 {
        let row = fx.iadd(q0, x.c_row(fx, c));
        let inside = fx.icmp(IntPredicate::ULT, row, x.k(fx, sh.s));
        fx.when(inside, |fx| {
            let at = fx.iadd(fx.imul(fx.iadd(x.base, row), width), qcol);
            for (nt, tile) in dq.iter().enumerate() {
                let col = fx.iadd(x.c_col(fx, c), x.k(fx, 8 * nt));
                let v = fx.mul(fx.get(&tile[c]), fx.f(x.scale()));
                fx.store("dqkv", fx.iadd(at, col), v);
            }
        });
    }
}

/// `flash::warp_dkv`: the backward's key-side warp `w` (16 keys of one kv head).
pub fn backward_keys<'c>(fx: &mut Fx<'c, '_>, sh: &Shape, w: I<'c>) {
    // flash::warp_dkv's numbering: the head's column part fastest.
    let parts = fx.i64c(sh.key_parts() as u64);
    let part_col = fx.imul(fx.urem(w, parts), fx.i64c(KEY_COLUMNS as u64));
    let w = fx.udiv(w, parts);
    let blocks = fx.i64c(sh.s.div_ceil(KEYS) as u64);
    let kv = fx.i64c(sh.kv_heads as u64);
    let k0 = fx.imul(fx.urem(w, blocks), fx.i64c(KEYS as u64));
    let g = fx.urem(fx.udiv(w, blocks), kv);
    let b = fx.udiv(fx.udiv(w, blocks), kv);
    let x = Warp::new(fx, sh, b);
    let (_, kcol, vcol) = columns(fx, sh, fx.i64c(0), g);
    let (qkv, dout) = (x.qkv(), x.dout());
    let ka = x.head(fx, qkv, k0, kcol);
    let va = x.head(fx, qkv, k0, vcol);
    let part_tiles = sh.d.min(KEY_COLUMNS) / 8;
    let (dk, dv) = (tiles(fx, part_tiles), tiles(fx, part_tiles));
    let group = (sh.heads / sh.kv_heads) as u64;
    let first_head = fx.imul(g, fx.i64c(group));
    let heads_end = fx.iadd(first_head, fx.i64c(group));
    fx.range(first_head, heads_end, |fx, n| {
        let qcol = fx.imul(n, fx.i64c(sh.d as u64));
        fx.strided_loop(k0, x.k(fx, sh.s), x.k(fx, QROWS), |fx, q0| {
            let mut p = [[fx.f(0.0); 4]; 2];
            let mut ds = [[fx.f(0.0); 4]; 2];
            for nt in 0..2 {
                let queries = fx.iadd(q0, x.k(fx, 8 * nt));
                let st = x.product(fx, &ka, (qkv, queries, qcol));
                let dp = x.product(fx, &va, (dout, queries, qcol));
                for c in 0..4 {
                    let key = fx.iadd(k0, x.c_row(fx, c));
                    let q = fx.iadd(queries, x.c_col(fx, c));
                    let at = stat(fx, sh, b, n, fx.umin(q, x.k(fx, sh.s - 1)));
                    let stats = (fx.load("lse", at), fx.load("dot", at));
                    let masked = x.masked(fx, q, key, q);
                    (p[nt][c], ds[nt][c]) = p_and_ds(fx, sh, (st[c], dp[c]), masked, stats);
                }
            }
            let (pa, dsa) = (x.c_to_a(fx, &p), x.c_to_a(fx, &ds));
            for t in 0..part_tiles {
                let col = fx.iadd(fx.iadd(qcol, part_col), x.k(fx, 8 * t));
                accumulate(fx, &dv[t], pa, x.b_cols(fx, dout, q0, col));
                accumulate(fx, &dk[t], dsa, x.b_cols(fx, qkv, q0, col));
            }
        });
    });
    let width = fx.i64c(sh.width() as u64);
    for c in 0..4 {
        let key = fx.iadd(k0, x.c_row(fx, c));
        let inside = fx.icmp(IntPredicate::ULT, key, x.k(fx, sh.s));
        fx.when(inside, |fx| {
            let row = fx.imul(fx.iadd(x.base, key), width);
            for t in 0..part_tiles {
                let col = fx.iadd(fx.iadd(x.c_col(fx, c), part_col), x.k(fx, 8 * t));
                let v = fx.mul(fx.get(&dk[t][c]), fx.f(x.scale()));
                fx.store("dqkv", fx.iadd(fx.iadd(row, kcol), col), v);
                let v = fx.get(&dv[t][c]);
                fx.store("dqkv", fx.iadd(fx.iadd(row, vcol), col), v);
            }
        });
    }
}
