//! Causal attention's row kernels: the softmax of a row of scores and its backward. The score
//! products around them are GEMMs (`schedrun`'s CUDA device: the naive path on a whole
//! sequence's heads, the fused path chunk by chunk of queries), and the bodies follow
//! `attention.rs`'s row code operation for operation, one warp per row on a GPU.

use super::fx::{Fx, I};
use super::rows::log_sum_exp;

/// Score row `r` of [`crate::Op::CausalSoftmax`]: log-sum-exp over keys `0..=i`,
/// `probs = exp(score − lse)` there and 0 up to `keys`, rounded to `probs`' dtype, `lse[r]`.
pub fn causal_softmax<'c>(fx: &mut Fx<'c, '_>, r: I<'c>) {
    let keys = fx.int_param("keys");
    let query = fx.urem(r, fx.int_param("per_head"));
    let live = fx.iadd(fx.iadd(fx.int_param("first"), query), fx.i64c(1));
    let row = fx.imul(r, keys);
    let lse = log_sum_exp(fx, "scores", row, live);
    fx.first_lane(|fx| fx.store("lse", r, lse));
    fx.lane_range(fx.i64c(0), live, |fx, j| {
        let at = fx.iadd(row, j);
        let p = fx.exp(fx.sub(fx.load("scores", at), lse));
        fx.store("probs", at, p);
    });
    fx.lane_range(live, keys, |fx, j| {
        fx.store("probs", fx.iadd(row, j), fx.f(0.0))
    });
}

/// Row `r` of the backward's `dS = P ∘ (dP − rowsum(P ∘ dP))·scale` into `ds`.
pub fn softmax_backward<'c>(fx: &mut Fx<'c, '_>, r: I<'c>) {
    let keys = fx.int_param("keys");
    let row = fx.imul(r, keys);
    let dot = fx.row_sum(fx.i64c(0), keys, |fx, j| {
        let at = fx.iadd(row, j);
        fx.mul(fx.load("p", at), fx.load("dp", at))
    });
    let scale = fx.scalar("scale");
    fx.lane_range(fx.i64c(0), keys, |fx, j| {
        let at = fx.iadd(row, j);
        let p = fx.load("p", at);
        let ds = fx.mul(fx.mul(p, fx.sub(fx.load("dp", at), dot)), scale);
        fx.store("ds", at, ds);
    });
}
