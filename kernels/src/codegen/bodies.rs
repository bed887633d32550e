//! Each op's body for one index, written once for both targets.
//!
//! Every body mirrors the CPU backend's Rust math (`schedrun::math`: `ops.rs`, `layers.rs`,
//! `gemm.rs`, `optim.rs`, `cross_entropy`) operation for operation and in the same order:
//! sums fold left from Rust's starting value (−0.0 for `Iterator::sum`, 0.0 for explicit
//! accumulators), the loss's `sum_exp` keeps its eight lanes, and no expression is reassociated.
//! Row and column bodies ([`Op::cooperative`]) are written for several lanes: each loop over a
//! row is a [`Fx::lane_range`], a column's walk down its rows a [`Fx::column_rows`]; a row's sums
//! end in a [`Fx::lane_sum`] and its scalars are stored by [`Fx::first_lane`]; a column's sum
//! runs from [`Fx::start_column`] to [`Fx::finish_column`]. With the host's one lane that is the
//! sequential code above (a column op's rows walked outside its columns, same order per column).

use super::fx::{Fx, F, I};
use super::rows::log_sum_exp;
use super::{attention, flash};
use crate::{Kernel, Op, ADAM_DECAY_BOUNDS, SUMSQ_CHUNK};
use inkwell::IntPredicate;
use sched_ir::job::Norm;

pub fn emit<'c>(fx: &mut Fx<'c, '_>, k: &Kernel, i: I<'c>) {
    match k.op {
        // The halves ops differ from a conversion only in how `src` or `dst` is addressed.
        Op::Convert | Op::LoadHalves | Op::StoreHalves => {
            let v = fx.load("src", i);
            fx.store("dst", i, v);
        }
        Op::Fill => fx.store("x", i, fx.scalar("value")),
        Op::Round { to } => {
            let v = fx.round_to(fx.load("x", i), to);
            fx.store("x", i, v);
        }
        Op::AddLoss => add_sum(fx, "loss", i),
        Op::AddPartials => add_sum(fx, "partial", i),
        Op::GradScale => {
            // The host device's `update`: norm = √sumsq / contributions, factor =
            // min(clip / (norm + 1e-6), 1), scale = (factor / contributions) as f32.
            let c = fx.scalar("contributions");
            let norm = fx.div(fx.sqrt(fx.to_f64(fx.load("sumsq", i))), c);
            let limit = fx.div(fx.scalar("clip"), fx.add(norm, fx.f64c(1e-6)));
            let factor = fx.minnum(limit, fx.f64c(1.0));
            fx.store("scale", i, fx.to_f32(fx.div(factor, c)));
        }
        Op::StoreDouble => {
            let v = fx.to_f32(fx.load_f64("acc", i));
            fx.store("dst", i, v);
        }
        Op::Embedding {
            vocab,
            width,
            seq_len,
            positions,
        } => embedding(fx, vocab, width, seq_len, positions, i),
        Op::EmbeddingBackward {
            vocab,
            width,
            seq_len,
            positions,
        } => embedding_backward(fx, vocab, width, seq_len, positions, i),
        Op::CausalSoftmax => attention::causal_softmax(fx, i),
        Op::SoftmaxBackward => attention::softmax_backward(fx, i),
        Op::FlashForward(sh) => flash::forward(fx, &sh, i),
        Op::FlashDot(sh) => flash::dot(fx, &sh, i),
        Op::FlashBackwardQuery(sh) => flash::backward_query(fx, &sh, i),
        Op::FlashBackwardKeys(sh) => flash::backward_keys(fx, &sh, i),
        Op::Accumulate => {
            let v = fx.add(fx.load("acc", i), fx.load("x", i));
            fx.store("acc", i, v);
        }
        Op::Gelu => {
            let v = fx.gelu(fx.load("pre", i));
            fx.store("post", i, v);
        }
        Op::GeluBackward => {
            let v = fx.mul(fx.load("d", i), fx.gelu_grad(fx.load("pre", i)));
            fx.store("d", i, v);
        }
        Op::SwiGlu => {
            let g = fx.load("gate", i);
            let v = fx.mul(fx.mul(g, fx.sigmoid(g)), fx.load("up", i));
            fx.store("prod", i, v);
        }
        Op::SwiGluBackward { cast } => {
            let (x, u) = (fx.load("gate", i), fx.load("up", i));
            let sg = fx.sigmoid(x);
            let dprod = fx.load("dgate", i);
            fx.store("dup", i, fx.mul(fx.mul(dprod, x), sg));
            let one = fx.f(1.0);
            let shape = fx.add(one, fx.mul(x, fx.sub(one, sg)));
            let dgate = fx.mul(fx.mul(fx.mul(dprod, u), sg), shape);
            fx.store(if cast { "cast" } else { "dgate" }, i, dgate);
        }
        Op::BiasAdd { width } => {
            let j = fx.urem(i, fx.i64c(width.into()));
            let v = fx.add(fx.load("y", i), fx.load("b", j));
            fx.store("y", i, v);
        }
        Op::BiasGrad { width, cast, gelu } => column_sums(fx, width, cast, gelu, i),
        Op::Norm {
            norm,
            width,
            bias,
            eps,
        } => norm_forward(fx, norm, width, bias, eps.value(), i),
        Op::NormBackwardInput { norm, width } => norm_backward_input(fx, norm, width, i),
        Op::NormBackwardParams { width, bias } => norm_backward_params(fx, width, bias, i),
        Op::CrossEntropy { vocab, stride } => cross_entropy(fx, vocab, stride, i),
        Op::Rotary {
            heads,
            kv_heads,
            head_dim,
            width,
            seq_len,
            inverse,
        } => {
            let row = fx.imul(i, fx.i64c(width.into()));
            let pos = fx.urem(i, fx.i64c(seq_len.into()));
            let sign = fx.f(if inverse { -1.0 } else { 1.0 });
            rotate(fx, row, pos, heads, head_dim, sign);
            let k_at = fx.iadd(row, fx.i64c(u64::from(heads * head_dim)));
            rotate(fx, k_at, pos, kv_heads, head_dim, sign);
        }
        Op::Adam { param } => adam(fx, param, i),
        Op::Sgd => {
            let g = fx.mul(fx.load("grad", i), fx.load("grad_scale", fx.i64c(0)));
            let p = fx.sub(fx.load("master", i), fx.mul(fx.scalar("lr"), g));
            fx.store("master", i, p);
        }
        Op::SumSquares => {
            let lo = fx.imul(i, fx.i64c(SUMSQ_CHUNK as u64));
            let hi = fx.umin(fx.iadd(lo, fx.i64c(SUMSQ_CHUNK as u64)), fx.int_param("n"));
            let acc = fx.var(fx.f64c(-0.0));
            fx.range(lo, hi, |fx, e| {
                let x = fx.to_f64(fx.load("x", e));
                let s = fx.add(fx.get(&acc), fx.mul(x, x));
                fx.set(&acc, s);
            });
            fx.store_f64("partial", i, fx.get(&acc));
        }
        Op::Gather2d => {
            let block = fx.int_param("block");
            let (b, o) = (fx.udiv(i, block), fx.urem(i, block));
            let s = fx.iadd(fx.imul(b, fx.int_param("src_stride")), o);
            let d = fx.iadd(fx.imul(b, fx.int_param("dst_stride")), o);
            fx.copy_bits("src", s, "dst", d);
        }
    }
}

/// `acc[i] += Σ_r name[i·n + r]` in f64, folded in order from −0.0 (Rust's `Iterator::sum`),
/// `name` f32 (widened) or f64.
fn add_sum<'c>(fx: &mut Fx<'c, '_>, name: &str, i: I<'c>) {
    let n = fx.int_param("n");
    let row = fx.imul(i, n);
    let total = fx.var(fx.f64c(-0.0));
    fx.range(fx.i64c(0), n, |fx, r| {
        let x = fx.load_wide(name, fx.iadd(row, r));
        fx.set(&total, fx.add(fx.get(&total), x));
    });
    let acc = fx.add(fx.load_f64("acc", i), fx.get(&total));
    fx.store_f64("acc", i, acc);
}

/// Token `r`'s id and whether it is inside the vocabulary; an id outside reads as token 0.
fn token<'c>(fx: &Fx<'c, '_>, vocab: u32, r: I<'c>) -> (I<'c>, I<'c>) {
    let id = fx.load_index("tokens", r);
    let valid = fx.icmp(IntPredicate::ULT, id, fx.i64c(vocab.into()));
    (fx.iselect(valid, id, fx.i64c(0)), valid)
}

/// Element `i` of the host's `embedding`: the token's `wte` row, plus its position's `wpe` row.
fn embedding<'c>(
    fx: &mut Fx<'c, '_>,
    vocab: u32,
    width: u32,
    seq_len: u32,
    positions: bool,
    i: I<'c>,
) {
    let w = fx.i64c(width.into());
    let (r, c) = (fx.udiv(i, w), fx.urem(i, w));
    let (tok, valid) = token(fx, vocab, r);
    let mut v = fx.load("wte", fx.iadd(fx.imul(tok, w), c));
    if positions {
        let pos = fx.urem(r, fx.i64c(seq_len.into()));
        v = fx.add(v, fx.load("wpe", fx.iadd(fx.imul(pos, w), c)));
    }
    fx.store("out", i, fx.fselect(valid, v, fx.f(f32::NAN)));
}

/// Column `c` of the host's `embedding_backward`: token rows in order, each adding its `dy`
/// element to its token's `dwte` row and its position's `dwpe` row. On a GPU the lanes split
/// the rows and add atomically (two rows of one token may meet).
fn embedding_backward<'c>(
    fx: &mut Fx<'c, '_>,
    vocab: u32,
    width: u32,
    seq_len: u32,
    positions: bool,
    c: I<'c>,
) {
    let w = fx.i64c(width.into());
    let rows = fx.int_param("rows");
    fx.column_rows(rows, |fx, r| {
        let g = fx.load("dy", fx.iadd(fx.imul(r, w), c));
        let (tok, valid) = token(fx, vocab, r);
        fx.when(valid, |fx| {
            let e = fx.iadd(fx.imul(tok, w), c);
            fx.add_into("dwte", e, g);
        });
        if positions {
            let pos = fx.urem(r, fx.i64c(seq_len.into()));
            let e = fx.iadd(fx.imul(pos, w), c);
            fx.add_into("dwpe", e, g);
        }
    });
}

/// `db[j] += dy[r, j]` for each row r in order (`gemm::col_sums`); with `gelu`, each element
/// first through GELU's backward (stored back unless cast); with `cast`, each element also
/// stored into `cast` (rounded to its dtype).
fn column_sums<'c>(fx: &mut Fx<'c, '_>, width: u32, cast: bool, gelu: bool, j: I<'c>) {
    let acc = fx.var(fx.start_column("db", j));
    let w = fx.i64c(width.into());
    let rows = fx.int_param("rows");
    fx.column_rows(rows, |fx, r| {
        let e = fx.iadd(fx.imul(r, w), j);
        let mut v = fx.load("dy", e);
        if gelu {
            // `Op::GeluBackward`'s value.
            v = fx.mul(v, fx.gelu_grad(fx.load("pre", e)));
            if !cast {
                fx.store("dy", e, v);
            }
        }
        if cast {
            fx.store("cast", e, v);
        }
        fx.set(&acc, fx.add(fx.get(&acc), v));
    });
    fx.finish_column("db", j, fx.get(&acc));
}

/// `ops::norm_forward` on row `r`, with ε `eps`.
fn norm_forward<'c>(fx: &mut Fx<'c, '_>, norm: Norm, width: u32, bias: bool, eps: f32, r: I<'c>) {
    let h = fx.i64c(width.into());
    let hf = fx.f(width as f32);
    let row = fx.imul(r, h);
    let at = |fx: &Fx<'c, '_>, j: I<'c>| fx.iadd(row, j);
    let zero = fx.i64c(0);
    let (mean, rstd) = match norm {
        Norm::LayerNorm => {
            let sum = fx.row_sum(zero, h, |fx, j| fx.load("x", at(fx, j)));
            let mean = fx.div(sum, hf);
            let squares = fx.row_sum(zero, h, |fx, j| {
                let d = fx.sub(fx.load("x", at(fx, j)), mean);
                fx.mul(d, d)
            });
            let var = fx.div(squares, hf);
            (mean, fx.div(fx.f(1.0), fx.sqrt(fx.add(var, fx.f(eps)))))
        }
        Norm::RmsNorm => {
            let squares = fx.row_sum(zero, h, |fx, j| {
                let v = fx.load("x", at(fx, j));
                fx.mul(v, v)
            });
            let ms = fx.div(squares, hf);
            (fx.f(0.0), fx.div(fx.f(1.0), fx.sqrt(fx.add(ms, fx.f(eps)))))
        }
    };
    let two_r = fx.imul(r, fx.i64c(2));
    fx.first_lane(|fx| {
        fx.store("stats", two_r, mean);
        fx.store("stats", fx.iadd(two_r, fx.i64c(1)), rstd);
    });
    fx.lane_range(zero, h, |fx, j| {
        let x = fx.load("x", at(fx, j));
        let y = fx.mul(fx.mul(fx.sub(x, mean), rstd), fx.load("w", j));
        let y = if bias { fx.add(y, fx.load("b", j)) } else { y };
        fx.store("out", at(fx, j), y);
    });
}

/// The row part of `ops::norm_backward`: `dx = base + rstd·(d − mean(d) − x̂·mean(d·x̂))`.
fn norm_backward_input<'c>(fx: &mut Fx<'c, '_>, norm: Norm, width: u32, r: I<'c>) {
    let h = fx.i64c(width.into());
    let hf = fx.f(width as f32);
    let row = fx.imul(r, h);
    let zero = fx.i64c(0);
    let two_r = fx.imul(r, fx.i64c(2));
    let mean = fx.load("stats", two_r);
    let rstd = fx.load("stats", fx.iadd(two_r, fx.i64c(1)));
    let terms = |fx: &Fx<'c, '_>, j: I<'c>| {
        let e = fx.iadd(row, j);
        let xhat = fx.mul(fx.sub(fx.load("x", e), mean), rstd);
        let d = fx.mul(fx.load("dy", e), fx.load("w", j));
        (e, xhat, d)
    };
    let sum_d = fx.var(fx.f(0.0));
    let sum_dx = fx.var(fx.f(0.0));
    fx.lane_range(zero, h, |fx, j| {
        let (_, xhat, d) = terms(fx, j);
        fx.set(&sum_d, fx.add(fx.get(&sum_d), d));
        fx.set(&sum_dx, fx.add(fx.get(&sum_dx), fx.mul(d, xhat)));
    });
    let mean_d = match norm {
        Norm::LayerNorm => fx.div(fx.lane_sum(fx.get(&sum_d)), hf),
        Norm::RmsNorm => fx.f(0.0),
    };
    let mean_dx = fx.div(fx.lane_sum(fx.get(&sum_dx)), hf);
    fx.lane_range(zero, h, |fx, j| {
        let (e, xhat, d) = terms(fx, j);
        let g = fx.sub(fx.sub(d, mean_d), fx.mul(xhat, mean_dx));
        let v = fx.add(fx.load("base", e), fx.mul(rstd, g));
        fx.store("dx", e, v);
    });
}

/// The column part of `ops::norm_backward`: `dw[j] += Σ_r dy·x̂`, `db[j] += Σ_r dy`.
fn norm_backward_params<'c>(fx: &mut Fx<'c, '_>, width: u32, bias: bool, j: I<'c>) {
    let h = fx.i64c(width.into());
    let dw = fx.var(fx.start_column("dw", j));
    let db = bias.then(|| fx.var(fx.start_column("db", j)));
    let rows = fx.int_param("rows");
    fx.column_rows(rows, |fx, r| {
        let two_r = fx.imul(r, fx.i64c(2));
        let mean = fx.load("stats", two_r);
        let rstd = fx.load("stats", fx.iadd(two_r, fx.i64c(1)));
        let e = fx.iadd(fx.imul(r, h), j);
        let xhat = fx.mul(fx.sub(fx.load("x", e), mean), rstd);
        let dy = fx.load("dy", e);
        fx.set(&dw, fx.add(fx.get(&dw), fx.mul(dy, xhat)));
        if let Some(db) = &db {
            fx.set(db, fx.add(fx.get(db), dy));
        }
    });
    fx.finish_column("dw", j, fx.get(&dw));
    if let Some(db) = &db {
        fx.finish_column("db", j, fx.get(db));
    }
}

/// One row of `math::cross_entropy` (rows `stride` apart): log-sum-exp with `ops::sum_exp`'s
/// eight lanes, the row's loss, and the gradient `(softmax − onehot)·inv`. A target outside the
/// vocabulary gives a NaN loss rather than a read out of bounds.
fn cross_entropy<'c>(fx: &mut Fx<'c, '_>, vocab: u32, stride: u32, r: I<'c>) {
    let v = u64::from(vocab);
    let row = fx.imul(r, fx.i64c(stride.into()));
    let at = |fx: &Fx<'c, '_>, j: I<'c>| fx.iadd(row, j);
    let zero = fx.i64c(0);
    let vv = fx.i64c(v);
    let lse = log_sum_exp(fx, "logits", row, vv);
    let target = fx.load_index("targets", r);
    let valid = fx.icmp(IntPredicate::ULT, target, vv);
    let safe = fx.iselect(valid, target, zero);
    let loss = fx.sub(lse, fx.load("logits", at(fx, safe)));
    let loss = fx.fselect(valid, loss, fx.f(f32::NAN));
    fx.first_lane(|fx| fx.store("loss", r, loss));
    let inv = fx.scalar("inv");
    fx.lane_range(zero, vv, |fx, j| {
        let g = fx.mul(fx.exp(fx.sub(fx.load("logits", at(fx, j)), lse)), inv);
        let hit = fx.icmp(IntPredicate::EQ, j, target);
        let g = fx.fselect(hit, fx.sub(g, inv), g);
        fx.store("grad", at(fx, j), g);
    });
}

/// `ops::Rope::apply` on `heads` heads of `qkv` starting at element `at`.
fn rotate<'c>(fx: &mut Fx<'c, '_>, at: I<'c>, pos: I<'c>, heads: u32, d: u32, sign: F<'c>) {
    let half = u64::from(d / 2);
    let table = fx.imul(pos, fx.i64c(half));
    let n = fx.i64c(u64::from(heads) * half);
    fx.lane_range(fx.i64c(0), n, |fx, hi| {
        let head = fx.udiv(hi, fx.i64c(half));
        let i = fx.urem(hi, fx.i64c(half));
        let a = fx.iadd(at, fx.iadd(fx.imul(head, fx.i64c(u64::from(d))), i));
        let b = fx.iadd(a, fx.i64c(half));
        let (x1, x2) = (fx.load("qkv", a), fx.load("qkv", b));
        let t = fx.iadd(table, i);
        let (c, s) = (fx.load("cos", t), fx.mul(sign, fx.load("sin", t)));
        fx.store("qkv", a, fx.sub(fx.mul(x1, c), fx.mul(x2, s)));
        fx.store("qkv", b, fx.add(fx.mul(x2, c), fx.mul(x1, s)));
    });
}

/// One element of `optim::optimizer_step` for Adam/AdamW (PyTorch's single-tensor AdamW): the
/// master shrunk inside the launch's decayed ranges and multiplied by 1 outside them, as the
/// Rust loop multiplies its undecayed runs.
fn adam<'c>(fx: &mut Fx<'c, '_>, param: bool, i: I<'c>) {
    let g = fx.mul(fx.load("grad", i), fx.load("grad_scale", fx.i64c(0)));
    let m = fx.add(
        fx.mul(fx.scalar("beta1"), fx.load("m", i)),
        fx.mul(fx.scalar("one_minus_beta1"), g),
    );
    let v = fx.add(
        fx.mul(fx.scalar("beta2"), fx.load("v", i)),
        fx.mul(fx.mul(fx.scalar("one_minus_beta2"), g), g),
    );
    fx.store("m", i, m);
    fx.store("v", i, v);
    let i64 = fx.widened(i);
    let decayed = ADAM_DECAY_BOUNDS
        .iter()
        .map(|[from, to]| {
            let after = fx.icmp(IntPredicate::UGE, i64, fx.int_param(from));
            fx.and(after, fx.icmp(IntPredicate::ULT, i64, fx.int_param(to)))
        })
        .reduce(|a, b| fx.or(a, b))
        .expect("Adam takes decayed ranges");
    let shrink = fx.fselect(decayed, fx.scalar("shrink"), fx.f(1.0));
    let p = fx.mul(fx.load("master", i), shrink);
    let denom = fx.add(fx.div(fx.sqrt(v), fx.scalar("bc2_sqrt")), fx.scalar("eps"));
    let p = fx.sub(p, fx.div(fx.mul(fx.scalar("step_size"), m), denom));
    fx.store("master", i, p);
    if param {
        fx.store("param", i, p);
    }
}
