//! Causal attention bodies: the fused (flash) forward and its two backward kernels, and the
//! naive path's row softmax and softmax backward (its score products are GEMMs).
//!
//! The fused kernels give one index one row: a query row walks its keys `0..=i` in order with an
//! online softmax (running max and sum, the output rescaled as the max grows), a key row walks
//! the queries `i ≥ j` of its group's heads. A row's `head_dim` output accumulators are separate
//! registers (the dimension is a constant of the kernel), so nothing is written before the row's
//! result is final and no index writes another's rows. Their sums run in another order than the
//! CPU's blocked GEMMs (`schedrun::math::attention`), so they agree with it to rounding, not to
//! the bit. The naive kernels follow `attention.rs`'s row code operation for operation.

use super::bodies::log_sum_exp;
use super::fx::{Fx, Var, F, I};
use crate::kernels::Heads;

/// Element offsets of one query row: (sequence b, query head n, query i).
struct QueryRow<'c> {
    /// The query's position in its sequence.
    i: I<'c>,
    /// The query in `qkv`.
    q: I<'c>,
    /// The key of the sequence's first token in `qkv` (token rows are `width` apart).
    k0: I<'c>,
    /// The value of the sequence's first token in `qkv`.
    v0: I<'c>,
    /// The row's head slice in the attention output (and its gradient).
    o: I<'c>,
}

/// Query row `row = (b·heads + n)·seq_len + i`, the CPU's `lse` order.
fn query_row<'c>(fx: &Fx<'c, '_>, h: Heads, row: I<'c>) -> QueryRow<'c> {
    let c = |v: u32| fx.i64c(v.into());
    let s = c(h.seq_len);
    let (i, bn) = (fx.urem(row, s), fx.udiv(row, s));
    let (b, n) = (fx.udiv(bn, c(h.heads)), fx.urem(bn, c(h.heads)));
    let group = fx.udiv(n, c(h.heads / h.kv_heads));
    let first = fx.imul(b, s);
    let tok = fx.iadd(first, i);
    let d = c(h.head_dim);
    let q = fx.iadd(fx.imul(tok, c(h.width())), fx.imul(n, d));
    let k0 = fx.iadd(
        fx.imul(first, c(h.width())),
        fx.iadd(c(h.hidden()), fx.imul(group, d)),
    );
    let v0 = fx.iadd(k0, c(h.kv_heads * h.head_dim));
    let o = fx.iadd(fx.imul(tok, c(h.hidden())), fx.imul(n, d));
    QueryRow { i, q, k0, v0, o }
}

/// Σ_c a[a0 + c]·b[b0 + c] over `d` elements, in order from 0.
fn dot<'c>(fx: &mut Fx<'c, '_>, a: (&str, I<'c>), b: (&str, I<'c>), d: u32) -> F<'c> {
    let acc = fx.var(fx.f(0.0));
    fx.range(fx.i64c(0), fx.i64c(d.into()), |fx, c| {
        let x = fx.mul(fx.load(a.0, fx.iadd(a.1, c)), fx.load(b.0, fx.iadd(b.1, c)));
        fx.set(&acc, fx.add(fx.get(&acc), x));
    });
    fx.get(&acc)
}

/// `d` accumulators, one per element of a head row, each set to 0.
fn head_accumulators<'c>(fx: &Fx<'c, '_>, d: u32) -> Vec<Var<'c>> {
    (0..d).map(|_| fx.var(fx.f(0.0))).collect()
}

/// `acc[c] = acc[c]·keep + w·name[at + c]` for every element (no rescaling when `keep` is None).
fn accumulate_row<'c>(
    fx: &Fx<'c, '_>,
    acc: &[Var<'c>],
    keep: Option<F<'c>>,
    w: F<'c>,
    name: &str,
    at: I<'c>,
) {
    for (c, a) in acc.iter().enumerate() {
        let x = fx.mul(w, fx.load(name, fx.iadd(at, fx.i64c(c as u64))));
        let old = match keep {
            Some(k) => fx.mul(fx.get(a), k),
            None => fx.get(a),
        };
        fx.set(a, fx.add(old, x));
    }
}

/// `name[at + c] = acc[c]·by` for every element (`by` None: the accumulator as it is).
fn write_row<'c>(fx: &Fx<'c, '_>, acc: &[Var<'c>], by: Option<F<'c>>, name: &str, at: I<'c>) {
    for (c, a) in acc.iter().enumerate() {
        let v = match by {
            Some(f) => fx.mul(fx.get(a), f),
            None => fx.get(a),
        };
        fx.store(name, fx.iadd(at, fx.i64c(c as u64)), v);
    }
}

/// The probability `exp(scale·q·k − lse)` of a (query, key) pair.
fn probability<'c>(fx: &mut Fx<'c, '_>, h: Heads, q: I<'c>, k: I<'c>, lse: F<'c>) -> F<'c> {
    let score = dot(fx, ("qkv", q), ("qkv", k), h.head_dim);
    let x = fx.mul(score, fx.f(h.scale()));
    fx.exp(fx.sub(x, lse))
}

/// One query row of the fused forward: online softmax over keys `0..=i`, then `out` and `lse`.
pub fn flash_forward<'c>(fx: &mut Fx<'c, '_>, h: Heads, row: I<'c>) {
    let r = query_row(fx, h, row);
    let width = fx.i64c(h.width().into());
    let max = fx.var(fx.f(f32::NEG_INFINITY));
    let sum = fx.var(fx.f(0.0));
    let acc = head_accumulators(fx, h.head_dim);
    let keys = fx.iadd(r.i, fx.i64c(1));
    fx.range(fx.i64c(0), keys, |fx, j| {
        let step = fx.imul(j, width);
        let score = dot(fx, ("qkv", r.q), ("qkv", fx.iadd(r.k0, step)), h.head_dim);
        let x = fx.mul(score, fx.f(h.scale()));
        let m = fx.get(&max);
        let m_new = fx.maxnum(m, x);
        // exp(−∞ − finite) is 0: the first key rescales nothing.
        let alpha = fx.exp(fx.sub(m, m_new));
        let p = fx.exp(fx.sub(x, m_new));
        fx.set(&sum, fx.add(fx.mul(fx.get(&sum), alpha), p));
        accumulate_row(fx, &acc, Some(alpha), p, "qkv", fx.iadd(r.v0, step));
        fx.set(&max, m_new);
    });
    let l = fx.get(&sum);
    write_row(fx, &acc, Some(fx.div(fx.f(1.0), l)), "out", r.o);
    let lse = fx.add(fx.get(&max), fx.ln(l));
    fx.store("lse", row, lse);
}

/// One query row of the backward: D = Σ_j P_ij·dP_ij into `dsum`, then
/// dQ = Σ_j P_ij·(dP_ij − D)·scale·K_j written at the row's q place in `dqkv`.
pub fn flash_backward_query<'c>(fx: &mut Fx<'c, '_>, h: Heads, row: I<'c>) {
    let r = query_row(fx, h, row);
    let width = fx.i64c(h.width().into());
    let lse = fx.load("lse", row);
    let keys = fx.iadd(r.i, fx.i64c(1));
    // P_ij and dP_ij = dO_i·V_j of key j.
    let pair = |fx: &mut Fx<'c, '_>, j: I<'c>| {
        let step = fx.imul(j, width);
        let k = fx.iadd(r.k0, step);
        let p = probability(fx, h, r.q, k, lse);
        let dp = dot(fx, ("dout", r.o), ("qkv", fx.iadd(r.v0, step)), h.head_dim);
        (p, dp, k)
    };
    let total = fx.var(fx.f(0.0));
    fx.range(fx.i64c(0), keys, |fx, j| {
        let (p, dp, _) = pair(fx, j);
        fx.set(&total, fx.add(fx.get(&total), fx.mul(p, dp)));
    });
    let dd = fx.get(&total);
    fx.store("dsum", row, dd);
    let acc = head_accumulators(fx, h.head_dim);
    fx.range(fx.i64c(0), keys, |fx, j| {
        let (p, dp, k) = pair(fx, j);
        let ds = fx.mul(fx.mul(p, fx.sub(dp, dd)), fx.f(h.scale()));
        accumulate_row(fx, &acc, None, ds, "qkv", k);
    });
    write_row(fx, &acc, None, "dqkv", r.q);
}

/// A query seen from a key row: its q and output-gradient offsets and its `lse`/`dsum` index.
#[derive(Clone, Copy)]
struct Query<'c> {
    q: I<'c>,
    o: I<'c>,
    at: I<'c>,
}

/// Calls `visit` for every query that sees key `j` of sequence `b` and kv head `g`: the group's
/// query heads in order, each with its queries `i = j..seq_len` in order.
fn queries_of_key<'c>(
    fx: &mut Fx<'c, '_>,
    h: Heads,
    (b, g, j): (I<'c>, I<'c>, I<'c>),
    visit: impl Fn(&mut Fx<'c, '_>, Query<'c>),
) {
    let [s, d, width, hidden, heads, group] = [
        h.seq_len,
        h.head_dim,
        h.width(),
        h.hidden(),
        h.heads,
        h.heads / h.kv_heads,
    ]
    .map(|v| fx.i64c(v.into()));
    let first = fx.imul(b, s);
    let n0 = fx.imul(g, group);
    fx.range(n0, fx.iadd(n0, group), |fx, n| {
        let base = fx.imul(fx.iadd(fx.imul(b, heads), n), s);
        fx.range(j, s, |fx, i| {
            let tok = fx.iadd(first, i);
            let query = Query {
                q: fx.iadd(fx.imul(tok, width), fx.imul(n, d)),
                o: fx.iadd(fx.imul(tok, hidden), fx.imul(n, d)),
                at: fx.iadd(base, i),
            };
            visit(fx, query);
        });
    });
}

/// One key row `(b·kv_heads + g)·seq_len + j` of the backward: over the group's query heads and
/// the queries `i ≥ j`, dK_j = Σ dS_ij·Q_i, then dV_j = Σ P_ij·dO_i, written at the row's k and
/// v places in `dqkv`. Two passes (P recomputed in the second) hold one head row of
/// accumulators at a time, not two: a 128-wide head fits the GPU's registers.
pub fn flash_backward_keys<'c>(fx: &mut Fx<'c, '_>, h: Heads, row: I<'c>) {
    let [s, d, width, hidden, kv_heads] =
        [h.seq_len, h.head_dim, h.width(), h.hidden(), h.kv_heads].map(|v| fx.i64c(v.into()));
    let (j, bg) = (fx.urem(row, s), fx.udiv(row, s));
    let (b, g) = (fx.udiv(bg, kv_heads), fx.urem(bg, kv_heads));
    let k = fx.iadd(
        fx.imul(fx.iadd(fx.imul(b, s), j), width),
        fx.iadd(hidden, fx.imul(g, d)),
    );
    let v = fx.iadd(k, fx.imul(kv_heads, d));
    let dk = head_accumulators(fx, h.head_dim);
    queries_of_key(fx, h, (b, g, j), |fx, x| {
        let p = probability(fx, h, x.q, k, fx.load("lse", x.at));
        let dp = dot(fx, ("dout", x.o), ("qkv", v), h.head_dim);
        let ds = fx.mul(
            fx.mul(p, fx.sub(dp, fx.load("dsum", x.at))),
            fx.f(h.scale()),
        );
        accumulate_row(fx, &dk, None, ds, "qkv", x.q);
    });
    write_row(fx, &dk, None, "dqkv", k);
    let dv = head_accumulators(fx, h.head_dim);
    queries_of_key(fx, h, (b, g, j), |fx, x| {
        let p = probability(fx, h, x.q, k, fx.load("lse", x.at));
        accumulate_row(fx, &dv, None, p, "dout", x.o);
    });
    write_row(fx, &dv, None, "dqkv", v);
}

/// Score row `r` of the naive forward (`attention::forward`'s row loop): log-sum-exp over keys
/// `0..=i`, `probs = exp(score − lse)` there and 0 after, rounded to `probs`' dtype.
pub fn causal_softmax<'c>(fx: &mut Fx<'c, '_>, seq_len: u32, r: I<'c>) {
    let s = fx.i64c(seq_len.into());
    let row = fx.imul(r, s);
    let live = fx.iadd(fx.urem(r, s), fx.i64c(1));
    let lse = log_sum_exp(fx, "scores", row, live);
    fx.range(fx.i64c(0), live, |fx, j| {
        let at = fx.iadd(row, j);
        let p = fx.exp(fx.sub(fx.load("scores", at), lse));
        fx.store("probs", at, p);
    });
    fx.range(live, s, |fx, j| {
        fx.store("probs", fx.iadd(row, j), fx.f(0.0))
    });
}

/// Row `r` of the naive backward's `dS = P ∘ (dP − rowsum(P ∘ dP))·scale`, in place in `dp`.
pub fn softmax_backward<'c>(fx: &mut Fx<'c, '_>, seq_len: u32, r: I<'c>) {
    let s = fx.i64c(seq_len.into());
    let row = fx.imul(r, s);
    let total = fx.var(fx.f(-0.0));
    fx.range(fx.i64c(0), s, |fx, j| {
        let at = fx.iadd(row, j);
        let x = fx.mul(fx.load("p", at), fx.load("dp", at));
        fx.set(&total, fx.add(fx.get(&total), x));
    });
    let dot = fx.get(&total);
    let scale = fx.scalar("scale");
    fx.range(fx.i64c(0), s, |fx, j| {
        let at = fx.iadd(row, j);
        let p = fx.load("p", at);
        let ds = fx.mul(fx.mul(p, fx.sub(fx.load("dp", at), dot)), scale);
        fx.store("dp", at, ds);
    });
}
