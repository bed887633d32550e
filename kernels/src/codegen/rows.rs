//! Row reductions the row kernels share: the log-sum-exp of a row (the loss's over the logits,
//! attention's over a row of scores), on the host in the CPU math's max-then-sum order and on a
//! GPU's warp in one pass over the row.

use super::fx::{Fx, F, I};

/// `max + ln(ops::sum_exp(x, max))` of the `n` elements of `name` from element `row`, `max`
/// folded from −∞ with `f32::max`: the log-sum-exp of the loss and of attention's rows, on the
/// host; a GPU's warp reads the row once instead ([`online_log_sum_exp`]).
pub(super) fn log_sum_exp<'c>(fx: &mut Fx<'c, '_>, name: &str, row: I<'c>, n: I<'c>) -> F<'c> {
    if fx.lanes() > 1 {
        return online_log_sum_exp(fx, name, row, n);
    }
    let max = fx.var(fx.f(f32::NEG_INFINITY));
    fx.range(fx.i64c(0), n, |fx, j| {
        let x = fx.load(name, fx.iadd(row, j));
        fx.set(&max, fx.maxnum(fx.get(&max), x));
    });
    let max = fx.get(&max);
    let sum = sum_exp(fx, name, row, n, max);
    fx.add(max, fx.ln(sum))
}

/// The log-sum-exp of a row on a GPU's warp in one pass over the row (a row is read once, not
/// twice as in the host's max-then-sum order): each lane keeps a running max `m` and a sum `s`
/// of exp(x − m), rescaled as `m` grows; the lanes' sums are then rescaled to the row's max and
/// added. The same value as [`log_sum_exp`]'s to rounding (both sum the same exponentials).
fn online_log_sum_exp<'c>(fx: &mut Fx<'c, '_>, name: &str, row: I<'c>, n: I<'c>) -> F<'c> {
    let max = fx.var(fx.f(f32::NEG_INFINITY));
    let sum = fx.var(fx.f(0.0));
    fx.lane_range(fx.i64c(0), n, |fx, j| {
        let x = fx.load(name, fx.iadd(row, j));
        let m = fx.get(&max);
        let m_new = fx.maxnum(m, x);
        // exp(−∞ − x) = 0: a lane's first element rescales nothing.
        let kept = fx.mul(fx.get(&sum), fx.exp(fx.sub(m, m_new)));
        fx.set(&sum, fx.add(kept, fx.exp(fx.sub(x, m_new))));
        fx.set(&max, m_new);
    });
    let m = fx.get(&max);
    let row_max = fx.lane_max(m);
    // A lane with no elements has sum 0 and max −∞: it adds 0·exp(−∞) = 0.
    let total = fx.lane_sum(fx.mul(fx.get(&sum), fx.exp(fx.sub(m, row_max))));
    fx.add(row_max, fx.ln(total))
}

/// `ops::sum_exp`: eight accumulators over whole chunks of eight, then the tail, then the eight
/// summed in order and the tail added (the host's one lane; a GPU's warp takes
/// [`online_log_sum_exp`]).
fn sum_exp<'c>(fx: &mut Fx<'c, '_>, name: &str, row: I<'c>, n: I<'c>, shift: F<'c>) -> F<'c> {
    let at = |fx: &Fx<'c, '_>, j: I<'c>| fx.iadd(row, j);
    let lanes: Vec<_> = (0..8).map(|_| fx.var(fx.f(0.0))).collect();
    let whole = fx.imul(fx.udiv(n, fx.i64c(8)), fx.i64c(8));
    fx.strided_loop(fx.i64c(0), whole, fx.i64c(8), |fx, c| {
        for (k, lane) in lanes.iter().enumerate() {
            let x = fx.load(name, at(fx, fx.iadd(c, fx.i64c(k as u64))));
            let e = fx.exp(fx.sub(x, shift));
            fx.set(lane, fx.add(fx.get(lane), e));
        }
    });
    let tail = fx.var(fx.f(-0.0));
    fx.range(whole, n, |fx, j| {
        let e = fx.exp(fx.sub(fx.load(name, at(fx, j)), shift));
        fx.set(&tail, fx.add(fx.get(&tail), e));
    });
    let mut sum = fx.f(-0.0);
    for lane in &lanes {
        sum = fx.add(sum, fx.get(lane));
    }
    fx.add(sum, fx.get(&tail))
}
