//! The fused causal attention forward ([`crate::kernels::Op::FlashForward`]) on tensor cores:
//! `crate::kernels::flash::warp` step for step, each lane its own slot of that model's arrays.
//! Loops over a head's columns and over the 16×8 tiles are unrolled here (the head width is a
//! constant of the kernel); the walk over key blocks is the one loop of the code, with the
//! running maxima, sums and output accumulators in registers.

use super::fx::{Fx, Var, F, I};
use crate::kernels::flash::{KEYS, QROWS};
use inkwell::IntPredicate;

/// Warp `w` of the kernel for `heads` query heads of `d` columns reading `kv_heads` key/value
/// heads, sequences of `s` tokens.
pub fn forward<'c>(fx: &mut Fx<'c, '_>, [heads, kv_heads, d, s]: [u64; 4], w: I<'c>) {
    let (hidden, width) = (heads * d, (heads + 2 * kv_heads) * d);
    let blocks = s.div_ceil(QROWS as u64);
    let lane = fx.lane();
    let (grp, tig) = (fx.udiv(lane, fx.i64c(4)), fx.urem(lane, fx.i64c(4)));
    // flash::place: sequence b, head n, kv group g, first query row q0.
    let q0 = fx.imul(fx.urem(w, fx.i64c(blocks)), fx.i64c(QROWS as u64));
    let n = fx.urem(fx.udiv(w, fx.i64c(blocks)), fx.i64c(heads));
    let b = fx.udiv(fx.udiv(w, fx.i64c(blocks)), fx.i64c(heads));
    let g = fx.udiv(n, fx.i64c(heads / kv_heads));
    let base = fx.imul(b, fx.i64c(s));
    let qcol = fx.imul(n, fx.i64c(d));
    let kcol = fx.iadd(fx.i64c(hidden), fx.imul(g, fx.i64c(d)));
    let vcol = fx.iadd(fx.i64c(hidden + kv_heads * d), fx.imul(g, fx.i64c(d)));

    // The bits of qkv's element (token t of the sequence, column c); 0 past the sequence (the
    // load reads its last row instead, so that no address leaves the tensor).
    let elem = |fx: &Fx<'c, '_>, t: I<'c>, c: I<'c>| -> I<'c> {
        let inside = fx.icmp(IntPredicate::ULT, t, fx.i64c(s));
        let row = fx.iadd(base, fx.umin(t, fx.i64c(s - 1)));
        let v = fx.load_bits16("qkv", fx.iadd(fx.imul(row, fx.i64c(width)), c));
        fx.iselect(inside, v, fx.i32c(0))
    };
    let pair = |fx: &Fx<'c, '_>, t: I<'c>, c: I<'c>| -> I<'c> {
        let hi = elem(fx, t, fx.iadd(c, fx.i64c(1)));
        fx.pack16(elem(fx, t, c), hi)
    };
    // flash::a_at / b_at / c_at, as offsets from (grp, 2·tig).
    let two_tig = fx.imul(tig, fx.i64c(2));
    let a_at = |fx: &Fx<'c, '_>, r: u64| {
        (
            fx.iadd(grp, fx.i64c(8 * (r & 1))),
            fx.iadd(two_tig, fx.i64c(8 * (r >> 1))),
        )
    };

    // Q's A fragments, per 16 columns of the head.
    let qa: Vec<[I<'c>; 4]> = (0..d / 16)
        .map(|kk| {
            std::array::from_fn(|r| {
                let (i, c) = a_at(fx, r as u64);
                let col = fx.iadd(fx.iadd(qcol, fx.i64c(16 * kk)), c);
                pair(fx, fx.iadd(q0, i), col)
            })
        })
        .collect();
    let m: [Var<'c>; 2] = std::array::from_fn(|_| fx.var(fx.f(f32::NEG_INFINITY)));
    let l: [Var<'c>; 2] = std::array::from_fn(|_| fx.var(fx.f(0.0)));
    let o: Vec<[Var<'c>; 4]> = (0..d / 8)
        .map(|_| std::array::from_fn(|_| fx.var(fx.f(0.0))))
        .collect();
    let scale_log2 = (1.0 / (d as f32).sqrt()) * std::f32::consts::LOG2_E;
    let last = fx.umin(fx.iadd(q0, fx.i64c(QROWS as u64)), fx.i64c(s));
    fx.strided_loop(fx.i64c(0), last, fx.i64c(KEYS as u64), |fx, j0| {
        // S for keys j0..j0 + 16: two n-tiles of 8 keys.
        let st: [[F<'c>; 4]; 2] = std::array::from_fn(|nt| {
            let key = fx.iadd(fx.iadd(j0, fx.i64c(8 * nt as u64)), grp);
            let mut acc = [fx.f(0.0); 4];
            for (kk, a) in qa.iter().enumerate() {
                let kb = std::array::from_fn(|r| {
                    let col = fx.iadd(
                        fx.iadd(kcol, fx.i64c(16 * kk as u64 + 8 * r as u64)),
                        two_tig,
                    );
                    pair(fx, key, col)
                });
                acc = fx.mma_bf16(*a, kb, acc);
            }
            acc
        });
        // Scaled into base 2, masked above the diagonal and past the sequence.
        let x: [[F<'c>; 4]; 2] = std::array::from_fn(|nt| {
            std::array::from_fn(|c| {
                let row = fx.iadd(fx.iadd(q0, grp), fx.i64c(8 * (c as u64 >> 1)));
                let key = fx.iadd(
                    fx.iadd(j0, fx.i64c(8 * nt as u64 + (c as u64 & 1))),
                    two_tig,
                );
                let late = fx.icmp(IntPredicate::UGT, key, row);
                let past = fx.icmp(IntPredicate::UGE, key, fx.i64c(s));
                let masked = fx.or(late, past);
                let v = fx.mul(st[nt][c], fx.f(scale_log2));
                fx.fselect(masked, fx.f(f32::NEG_INFINITY), v)
            })
        });
        let mut p = [[fx.f(0.0); 4]; 2];
        for h in 0..2 {
            let mut bmax = fx.f(f32::NEG_INFINITY);
            for row in &x {
                for e in 0..2 {
                    bmax = fx.maxnum(bmax, row[2 * h + e]);
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
                    let v = fx.exp2_approx(fx.sub(x[nt][2 * h + e], new));
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
        // P's accumulators as the A fragment of P·V: registers 0/1 from n-tile 0, 2/3 from 1.
        let pa: [I<'c>; 4] = std::array::from_fn(|r| {
            let (nt, h) = (r >> 1, r & 1);
            let hi = fx.bf16_bits(p[nt][2 * h + 1]);
            fx.pack16(fx.bf16_bits(p[nt][2 * h]), hi)
        });
        // O += P·V, 8 columns of the head at a time.
        for (nt, tile) in o.iter().enumerate() {
            let col = fx.iadd(fx.iadd(vcol, fx.i64c(8 * nt as u64)), grp);
            let vb = std::array::from_fn(|r| {
                let key = fx.iadd(fx.iadd(j0, fx.i64c(8 * r as u64)), two_tig);
                let hi = elem(fx, fx.iadd(key, fx.i64c(1)), col);
                fx.pack16(elem(fx, key, col), hi)
            });
            let c = std::array::from_fn(|e| fx.get(&tile[e]));
            let d = fx.mma_bf16(pa, vb, c);
            for (v, x) in tile.iter().zip(d) {
                fx.set(v, x);
            }
        }
    });
    // Each row's sum over its four lanes, then O/l and the natural log-sum-exp.
    for lh in &l {
        for bit in [1, 2] {
            let v = fx.get(lh);
            fx.set(lh, fx.add(v, fx.shfl_xor(v, bit)));
        }
    }
    for h in 0..2u64 {
        let row = fx.iadd(fx.iadd(q0, grp), fx.i64c(8 * h));
        let inside = fx.icmp(IntPredicate::ULT, row, fx.i64c(s));
        fx.when(inside, |fx| {
            let sum = fx.get(&l[h as usize]);
            let at = fx.iadd(fx.imul(fx.iadd(base, row), fx.i64c(hidden)), qcol);
            for (nt, tile) in o.iter().enumerate() {
                for e in 0..2 {
                    let col = fx.iadd(two_tig, fx.i64c(8 * nt as u64 + e as u64));
                    let v = fx.div(fx.get(&tile[2 * h as usize + e]), sum);
                    fx.store("out", fx.iadd(at, col), v);
                }
            }
            let first = fx.icmp(IntPredicate::EQ, tig, fx.i64c(0));
            fx.when(first, |fx| {
                let lse = fx.add(fx.get(&m[h as usize]), fx.log2_approx(sum));
                let lse = fx.mul(lse, fx.f(std::f32::consts::LN_2));
                let head_row = fx.iadd(
                    fx.imul(fx.iadd(fx.imul(b, fx.i64c(heads)), n), fx.i64c(s)),
                    row,
                );
                fx.store("lse", head_row, lse);
            });
        });
    }
}
