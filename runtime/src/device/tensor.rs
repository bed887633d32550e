//! A tensor-parallel layer's phases (`spec/parallel.md` §2, Megatron-LM's tensor parallelism),
//! once for every device: the forward and backward of one rank's slice of a transformer or mlp
//! layer, cut where the tensor group all-reduces.
//!
//! A transformer has two sublayers (0: attention, 1: the MLP), an mlp layer one. Sublayer j's
//! forward is [`forward_open`] (the norm, the column-parallel products, the local attention or
//! activation, the row-parallel product into the rank's fp32 **partial**), the all-reduce of the
//! partials over the tensor group, then [`forward_close`] (the sum stored as the residual
//! stream). The group's **lead** rank (tensor index 0) starts its partial from the residual
//! stream and adds the row-parallel product's bias, so the sum is the sublayer's output itself:
//! every rank holds the same residual stream after the close, and the row-parallel bias counts
//! once. The backward mirrors it: [`backward_open`] from the residual stream's gradient at the
//! sublayer's output gives the sliced products' parameter gradients and the rank's partial of
//! the gradient of the norm's output (the column-parallel products' input gradient); after the
//! all-reduce, [`backward_close`] takes the sum through the replicated norm, adds the residual
//! path, and leaves the gradient at the sublayer's input. Every rank computes the replicated
//! parameters' gradients (norms, row-parallel biases) from the same values, so they need no
//! reduction over the group.
//!
//! With sequence parallelism the open phases read the tensor group's gather of the stream (or
//! its gradient), so they are unchanged; the partials are reduce-scattered, and each close works
//! on the rank's rows of the tokens: the backward close's norm gradients are then its rows'
//! part, which the plan sums over the tensor group afterwards.
//!
//! The math is the whole layer's ([`super::layers`]) on the narrower operands of
//! [`LayerMath::sliced`]; the saved tensors are the slice's, in the whole layer's order
//! (sublayer 0's first). Parameter gradients accumulate into `gp`, the layer's flat slice
//! gradient, which the caller zeroes and writes part by part.

use super::layers::{
    attention_forward, mlp_backward, mlp_forward, norm_operands, proj_product, qkv_product, Through,
};
use super::{plan_error, Device, DeviceError, Ptr};
use crate::math::saved::{BlockSaved, MlpSaved, NormedSaved};
use crate::math::{Kind, LayerMath};

fn bias<P: Ptr>(p: P, r: &Option<std::ops::Range<usize>>) -> Option<P> {
    r.as_ref().map(|r| p.at(r))
}

fn not_split(lm: &LayerMath, j: u8) -> DeviceError {
    plan_error(format!(
        "{} has no tensor-parallel sublayer {j}: only transformer and mlp layers are split",
        lm.name()
    ))
}

/// Sublayer `j`'s forward up to its row-parallel product: reads `stream` (the residual stream
/// at the sublayer's input), writes its saved tensors into `saved` and overwrites `partial`
/// (fp32, tokens × hidden) with this rank's summand of the sublayer's output: the residual
/// stream and the bias included on the `lead` rank.
#[allow(clippy::too_many_arguments)]
pub(crate) fn forward_open<D: Device>(
    d: &D,
    lm: &LayerMath,
    j: u8,
    p: D::Ptr,
    stream: D::Ptr,
    saved: D::Ptr,
    partial: D::Ptr,
    lead: bool,
) -> Result<(), DeviceError> {
    let (t, s) = (lm.dims().t, lm.dims().s);
    let act = lm.precisions().0;
    let start = |h: usize| match lead {
        true => d.copy(partial, stream, t * h),
        false => d.fill(partial, t * h, 0.0),
    };
    match (lm.kind(), j) {
        (Kind::Transformer(bp), 0) => {
            let h = bp.hidden;
            let BlockSaved { att, .. } = BlockSaved::carve(bp, t, s, saved);
            attention_forward(d, lm, bp, p, stream, saved)?;
            start(h)?;
            let proj = proj_product(bp, t, att, p.at(&bp.proj));
            let b = bias(p, &bp.proj_b).filter(|_| lead);
            d.linear(proj, b, partial, 1.0)
        }
        (Kind::Transformer(bp), 1) => {
            let h = bp.hidden;
            let BlockSaved {
                resid,
                a2,
                st2,
                mut mlp,
                ..
            } = BlockSaved::carve(bp, t, s, saved);
            d.copy(resid, stream, t * h)?;
            d.norm_forward(&norm_operands(&bp.ln2, p, t, resid, st2), a2)?;
            d.round(act, a2, t * h)?;
            start(h)?;
            let kept = MlpSaved::carve(t, &bp.mlp, &mut mlp);
            mlp_forward(d, lm, &bp.mlp, p, a2, kept, partial, lead)
        }
        (Kind::Mlp { hidden: h, ln, mlp }, 0) => {
            let NormedSaved { a, st, mut rest } = NormedSaved::carve(t, *h, saved);
            d.norm_forward(&norm_operands(ln, p, t, stream, st), a)?;
            d.round(act, a, t * h)?;
            start(*h)?;
            mlp_forward(
                d,
                lm,
                mlp,
                p,
                a,
                MlpSaved::carve(t, mlp, &mut rest),
                partial,
                lead,
            )
        }
        _ => Err(not_split(lm, j)),
    }
}

/// Sublayer `j`'s backward down to its column-parallel products: from `stream_grad` (the
/// residual stream's gradient at the sublayer's output), the parameter gradients of the
/// sublayer's products accumulate into `gp` and `partial` (fp32, tokens × hidden) is
/// overwritten with this rank's summand of the gradient of the sublayer's norm output.
#[allow(clippy::too_many_arguments)]
pub(crate) fn backward_open<D: Device>(
    d: &D,
    lm: &LayerMath,
    j: u8,
    p: D::Ptr,
    saved: D::Ptr,
    stream_grad: D::Ptr,
    gp: D::Ptr,
    partial: D::Ptr,
) -> Result<(), DeviceError> {
    let (t, s) = (lm.dims().t, lm.dims().s);
    match (lm.kind(), j) {
        (Kind::Transformer(bp), 0) => {
            let BlockSaved {
                a1, qkv, att, keep, ..
            } = BlockSaved::carve(bp, t, s, saved);
            let datt = d.alloc(t * bp.shape.hidden())?;
            let dqkv = d.alloc(t * bp.shape.width())?;
            let proj = proj_product(bp, t, att, p.at(&bp.proj));
            let (dwp, dbp) = (gp.at(&bp.proj), bias(gp, &bp.proj_b));
            d.linear_backward(proj, stream_grad, dwp, dbp, Some((datt, 0.0)))?;
            d.attention_backward(bp, (qkv, att), keep, datt, dqkv)?;
            if bp.rope.is_some() {
                d.rope(bp, t, dqkv, dqkv, true)?;
            }
            let product = qkv_product(bp, t, a1, p.at(&bp.qkv));
            let (dwq, dbq) = (gp.at(&bp.qkv), bias(gp, &bp.qkv_b));
            d.linear_backward(product, dqkv, dwq, dbq, Some((partial, 0.0)))
        }
        (Kind::Transformer(bp), 1) => {
            let BlockSaved { a2, mut mlp, .. } = BlockSaved::carve(bp, t, s, saved);
            let kept = MlpSaved::carve(t, &bp.mlp, &mut mlp);
            let through = Through {
                dy: stream_grad,
                dx: partial,
                gp,
            };
            mlp_backward(d, lm, &bp.mlp, p, a2, kept, through)
        }
        (Kind::Mlp { hidden: h, mlp, .. }, 0) => {
            let NormedSaved { a, mut rest, .. } = NormedSaved::carve(t, *h, saved);
            let kept = MlpSaved::carve(t, mlp, &mut rest);
            let through = Through {
                dy: stream_grad,
                dx: partial,
                gp,
            };
            mlp_backward(d, lm, mlp, p, a, kept, through)
        }
        _ => Err(not_split(lm, j)),
    }
}

/// After the sum of sublayer `j`'s partials (`sum`, the gradient of its norm's output):
/// `gi` ← `base` + the norm's input gradient (`base` is the residual stream's gradient at the
/// sublayer's output, and may be `gi` itself), the norm's parameter gradients accumulated into
/// `gp`. `x` is the layer's input, which sublayer 0's norm reads. After sublayer 0, `gi` is the
/// layer's input gradient, rounded to the gradient dtype.
///
/// `rows` are the token rows `sum`, `x`, `base` and `gi` hold (first, count): all of them, or
/// with sequence parallelism the rank's part, whose norm gradients are then this part's alone
/// (the saved tensors hold every row: the rank's are read at their offset).
#[allow(clippy::too_many_arguments)]
pub(crate) fn backward_close<D: Device>(
    d: &D,
    lm: &LayerMath,
    j: u8,
    p: D::Ptr,
    saved: D::Ptr,
    x: Option<D::Ptr>,
    sum: D::Ptr,
    (gi, base): (D::Ptr, D::Ptr),
    gp: D::Ptr,
    (first, rows): (usize, usize),
) -> Result<(), DeviceError> {
    let (t, s) = (lm.dims().t, lm.dims().s);
    let input =
        || x.ok_or_else(|| plan_error(format!("{}: sublayer 0 needs its input", lm.name())));
    // The saved norm statistics are two floats a row.
    let stats_of = |st: D::Ptr| st.at(&(2 * first..2 * (first + rows)));
    let (np, x, stats, h) = match (lm.kind(), j) {
        (Kind::Transformer(bp), 0) => {
            let BlockSaved { st1, .. } = BlockSaved::carve(bp, t, s, saved);
            (&bp.ln1, input()?, stats_of(st1), bp.hidden)
        }
        (Kind::Transformer(bp), 1) => {
            let BlockSaved { resid, st2, .. } = BlockSaved::carve(bp, t, s, saved);
            let h = bp.hidden;
            let resid = resid.at(&(first * h..(first + rows) * h));
            (&bp.ln2, resid, stats_of(st2), h)
        }
        (Kind::Mlp { hidden: h, ln, .. }, 0) => {
            let NormedSaved { st, .. } = NormedSaved::carve(t, *h, saved);
            (ln, input()?, stats_of(st), *h)
        }
        _ => return Err(not_split(lm, j)),
    };
    d.norm_backward(
        &norm_operands(np, p, rows, x, stats),
        sum,
        Some((gi, base)),
        gp,
    )?;
    if j == 0 {
        d.round(lm.precisions().1, gi, rows * h)?;
    }
    Ok(())
}
