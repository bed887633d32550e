//! Each layer kind's forward and backward, once for every device: which primitives run in which
//! order, where values are rounded to the activation and gradient dtypes (`runtime.md`: bf16
//! storage, fp32 compute), and where the saved tensors go ([`crate::math::saved`]).
//!
//! Contracts (those of [`crate::math::LayerMath`]): `forward` overwrites `out` and all of
//! `saved`; `backward` overwrites the input gradient (when asked for), the parameter gradient and
//! a tied head's embedding gradient, never accumulating across calls. A pipeline's split
//! backward is `backward_input` (the input gradient and the fp32 stash, overwritten) then
//! `backward_weight` (the parameter and tied gradients, overwritten, from the stash): the same
//! operations in the same order as `backward`, so the same values.

use super::{plan_error, Device, DeviceError, Linear, Lookup, NormOperands, Ptr};
use crate::math::saved::{BlockSaved, BlockStash, MlpSaved, MlpStash, NormedSaved, NormedStash};
use crate::math::{BlockP, Kind, LayerMath, MlpP, NormP};
use std::ops::Range;

/// A layer's input: token ids (the embedding) or hidden states.
pub(crate) enum In<D: Device> {
    Tokens(D::Tokens),
    Hidden(D::Ptr),
}

impl<D: Device> Clone for In<D> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<D: Device> Copy for In<D> {}

fn hidden<D: Device>(input: In<D>, lm: &LayerMath) -> Result<D::Ptr, DeviceError> {
    match input {
        In::Hidden(x) => Ok(x),
        In::Tokens(_) => Err(plan_error(format!(
            "{} takes hidden states, not tokens",
            lm.name()
        ))),
    }
}

fn tokens<D: Device>(input: In<D>, lm: &LayerMath) -> Result<D::Tokens, DeviceError> {
    match input {
        In::Tokens(t) => Ok(t),
        In::Hidden(_) => Err(plan_error(format!(
            "{} takes tokens, not hidden states",
            lm.name()
        ))),
    }
}

/// A block's product of its normed input `x` [t, hidden] into q, k and v.
pub(super) fn qkv_product<P>(bp: &BlockP, t: usize, x: P, w: P) -> Linear<P> {
    let (inp, out) = (bp.hidden, bp.shape.width());
    Linear { x, w, t, inp, out }
}

/// A block's projection of attention's output `x` [t, hidden] back to the hidden width.
pub(super) fn proj_product<P>(bp: &BlockP, t: usize, x: P, w: P) -> Linear<P> {
    let (inp, out) = (bp.shape.hidden(), bp.hidden);
    Linear { x, w, t, inp, out }
}

/// An MLP's products of its normed input `x` [t, hidden] into the ffn width (the first, and
/// SwiGLU's up projection).
fn into_ffn<P>(mp: &MlpP, t: usize, x: P, w: P) -> Linear<P> {
    let (inp, out) = (mp.hidden, mp.ffn);
    Linear { x, w, t, inp, out }
}

/// An MLP's projection of `x` [t, ffn] back to the hidden width.
fn from_ffn<P>(mp: &MlpP, t: usize, x: P, w: P) -> Linear<P> {
    let (inp, out) = (mp.ffn, mp.hidden);
    Linear { x, w, t, inp, out }
}

/// The head's product of the normed hidden states `x` [t, hidden] into the vocabulary.
fn head_product<P>(t: usize, (inp, out): (usize, usize), x: P, w: P) -> Linear<P> {
    Linear { x, w, t, inp, out }
}

/// out += MLP(a), keeping the MLP's tensors in `kept`; the last product's bias only with
/// `last_bias` (a tensor group adds it on one rank).
#[allow(clippy::too_many_arguments)]
pub(super) fn mlp_forward<D: Device>(
    d: &D,
    lm: &LayerMath,
    mp: &MlpP,
    p: D::Ptr,
    a: D::Ptr,
    kept: MlpSaved<D::Ptr>,
    out: D::Ptr,
    last_bias: bool,
) -> Result<(), DeviceError> {
    let (t, f) = (lm.dims().t, mp.ffn);
    let act = lm.precisions().0;
    let (w1, b1) = (p.at(&mp.w1), mp.b1.as_ref().map(|r| p.at(r)));
    let into_ffn = |w| into_ffn(mp, t, a, w);
    let mid = match kept {
        MlpSaved::Gelu { pre, post } => {
            d.linear(into_ffn(w1), b1, pre, 0.0)?;
            d.round(act, pre, t * f)?;
            d.gelu(pre, post, t * f)?;
            d.round(act, post, t * f)?;
            post
        }
        MlpSaved::SwiGlu { gate, up, prod } => {
            let (wu, bu) = mp
                .up
                .as_ref()
                .ok_or_else(|| plan_error("swiglu without an up projection"))?;
            d.linear(into_ffn(w1), b1, gate, 0.0)?;
            d.linear(into_ffn(p.at(wu)), bu.as_ref().map(|r| p.at(r)), up, 0.0)?;
            d.round(act, gate, t * f)?;
            d.round(act, up, t * f)?;
            d.swiglu(gate, up, prod, t * f)?;
            d.round(act, prod, t * f)?;
            prod
        }
    };
    let proj_b = mp.proj_b.as_ref().filter(|_| last_bias).map(|r| p.at(r));
    d.linear(from_ffn(mp, t, mid, p.at(&mp.proj)), proj_b, out, 1.0)
}

/// A layer's weights: its flat parameter vector and, for a tied lm_head, the embedding's.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Weights<P> {
    pub params: P,
    pub tied: Option<P>,
}

/// A layer backward's gradients: `dy`, its output's (read); `gi`, its input's (overwritten, when
/// wanted); `gp`, its flat parameter gradient, and `gt`, a tied head's embedding gradient (both
/// overwritten).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Grads<P> {
    pub dy: P,
    pub gi: Option<P>,
    pub gp: P,
    pub gt: Option<P>,
}

/// The gradient through a sublayer: `dy`, its output's (read); `dx`, its input's (overwritten);
/// `gp`, the layer's flat parameter gradient (accumulated).
#[derive(Clone, Copy, Debug)]
pub(super) struct Through<P> {
    pub dy: P,
    pub dx: P,
    pub gp: P,
}

/// The MLP's backward: parameter gradients accumulate into `g.gp`; `g.dx` (the gradient of the
/// MLP's input) is overwritten.
pub(super) fn mlp_backward<D: Device>(
    d: &D,
    lm: &LayerMath,
    mp: &MlpP,
    p: D::Ptr,
    a: D::Ptr,
    kept: MlpSaved<D::Ptr>,
    g: Through<D::Ptr>,
) -> Result<(), DeviceError> {
    let Through { dy, dx: da, gp } = g;
    let (t, f) = (lm.dims().t, mp.ffn);
    let (s1, s2) = (d.alloc(t * f)?, d.alloc(t * f)?);
    let wp = p.at(&mp.proj);
    let (dwp, dbp) = (gp.at(&mp.proj), mp.proj_b.as_ref().map(|r| gp.at(r)));
    let (w1, dw1, db1) = (
        p.at(&mp.w1),
        gp.at(&mp.w1),
        mp.b1.as_ref().map(|r| gp.at(r)),
    );
    let into_ffn = |w| into_ffn(mp, t, a, w);
    let from_ffn = |x| from_ffn(mp, t, x, wp);
    match kept {
        MlpSaved::Gelu { pre, post } => {
            d.linear_backward(from_ffn(post), dy, dwp, dbp, Some((s1, 0.0)))?;
            d.gelu_linear_backward(pre, into_ffn(w1), s1, dw1, db1, Some((da, 0.0)))
        }
        MlpSaved::SwiGlu { gate, up, prod } => {
            d.linear_backward(from_ffn(prod), dy, dwp, dbp, Some((s1, 0.0)))?;
            let (wu, bu) = mp
                .up
                .as_ref()
                .ok_or_else(|| plan_error("swiglu without an up projection"))?;
            let dbu = bu.as_ref().map(|r| gp.at(r));
            // Gradients only the products read (no bias sums them) where the device has them
            // in the products' storage; else fp32, the gate's in place of dprod.
            let cast = match (db1, dbu) {
                (None, None) => d.swiglu_backward_cast(gate, up, s1, s2, t * f)?,
                _ => None,
            };
            let [dgate, dup] = match cast {
                Some(both) => both,
                None => {
                    d.swiglu_backward(gate, up, s1, s2, t * f)?;
                    [s1, s2]
                }
            };
            d.linear_backward(into_ffn(w1), dgate, dw1, db1, Some((da, 0.0)))?;
            d.linear_backward(into_ffn(p.at(wu)), dup, gp.at(wu), dbu, Some((da, 1.0)))
        }
    }
}

/// Forward of one layer: overwrites `out` and `saved`.
pub(crate) fn forward<D: Device>(
    d: &D,
    lm: &LayerMath,
    p: D::Ptr,
    tied: Option<D::Ptr>,
    input: In<D>,
    out: D::Ptr,
    saved: D::Ptr,
) -> Result<(), DeviceError> {
    let t = lm.dims().t;
    let act = lm.precisions().0;
    match lm.kind() {
        Kind::Embedding {
            vocab,
            hidden: h,
            wte,
            wpe,
        } => {
            let toks = tokens(input, lm)?;
            let wpe = wpe.as_ref().map(|r| p.at(r));
            d.embedding(
                &Lookup {
                    tokens: toks,
                    vocab: *vocab,
                    h: *h,
                    s: lm.dims().s,
                    t,
                },
                p.at(wte),
                wpe,
                out,
            )?;
            d.round(act, out, t * h)
        }
        Kind::Transformer(bp) => transformer_forward(d, lm, bp, p, hidden(input, lm)?, out, saved),
        Kind::Mlp { hidden: h, ln, mlp } => {
            let x = hidden(input, lm)?;
            let NormedSaved { a, st, mut rest } = NormedSaved::carve(t, *h, saved);
            d.norm_forward(
                &NormOperands {
                    np: ln,
                    params: p,
                    t,
                    h: *h,
                    x,
                    stats: st,
                },
                a,
            )?;
            d.round(act, a, t * h)?;
            d.copy(out, x, t * h)?;
            mlp_forward(
                d,
                lm,
                mlp,
                p,
                a,
                MlpSaved::carve(t, mlp, &mut rest),
                out,
                true,
            )?;
            d.round(act, out, t * h)
        }
        Kind::LmHead {
            hidden: h,
            vocab,
            norm,
            weight,
        } => {
            let x = hidden(input, lm)?;
            let NormedSaved { a, st, .. } = NormedSaved::carve(t, *h, saved);
            d.norm_forward(
                &NormOperands {
                    np: norm,
                    params: p,
                    t,
                    h: *h,
                    x,
                    stats: st,
                },
                a,
            )?;
            d.round(act, a, t * h)?;
            let w = match weight {
                Some(r) => p.at(r),
                None => tied.ok_or_else(|| plan_error("a tied lm_head needs the embedding"))?,
            };
            let stride = lm.output_stride();
            let head = head_product(t, (*h, *vocab), a, w);
            d.linear_rows(head, None, (out, stride), 0.0)?;
            d.round(act, out, t * stride)
        }
    }
}

/// A block's attention up to its output projection, from the layer's input `x` into its part of
/// `saved` (ln1's output and statistics, the q/k/v product, the attention's output and what its
/// backward needs), each rounded to the activation dtype where the CPU rounds it.
pub(super) fn attention_forward<D: Device>(
    d: &D,
    lm: &LayerMath,
    bp: &BlockP,
    p: D::Ptr,
    x: D::Ptr,
    saved: D::Ptr,
) -> Result<(), DeviceError> {
    let (t, s, h) = (lm.dims().t, lm.dims().s, bp.hidden);
    let BlockSaved {
        a1,
        st1,
        qkv,
        att,
        keep,
        ..
    } = BlockSaved::carve(bp, t, s, saved);
    let act = lm.precisions().0;
    let w = bp.shape.width();
    let bias = |r: &Option<std::ops::Range<usize>>| r.as_ref().map(|r| p.at(r));
    d.norm_forward(&norm_operands(&bp.ln1, p, t, x, st1), a1)?;
    d.round(act, a1, t * h)?;
    // With rotary positions the product goes to f32 workspace and the rotation writes qkv, so
    // that qkv in 16-bit storage is rounded once, after the rotation, as the CPU rounds it.
    let projected = match bp.rope {
        Some(_) => d.alloc(t * w)?,
        None => qkv,
    };
    let product = qkv_product(bp, t, a1, p.at(&bp.qkv));
    d.linear(product, bias(&bp.qkv_b), projected, 0.0)?;
    if bp.rope.is_some() {
        d.rope(bp, t, projected, qkv, false)?;
    }
    d.round(act, qkv, t * w)?;
    d.attention(bp, act, qkv, att, keep)?;
    d.round(act, att, t * bp.shape.hidden())
}

fn transformer_forward<D: Device>(
    d: &D,
    lm: &LayerMath,
    bp: &BlockP,
    p: D::Ptr,
    x: D::Ptr,
    out: D::Ptr,
    saved: D::Ptr,
) -> Result<(), DeviceError> {
    let (t, s, h) = (lm.dims().t, lm.dims().s, bp.hidden);
    let act = lm.precisions().0;
    let BlockSaved {
        att,
        resid,
        a2,
        st2,
        mut mlp,
        ..
    } = BlockSaved::carve(bp, t, s, saved);
    let bias = |r: &Option<std::ops::Range<usize>>| r.as_ref().map(|r| p.at(r));
    attention_forward(d, lm, bp, p, x, saved)?;
    d.copy(resid, x, t * h)?;
    let proj = proj_product(bp, t, att, p.at(&bp.proj));
    d.linear(proj, bias(&bp.proj_b), resid, 1.0)?;
    d.round(act, resid, t * h)?;
    d.norm_forward(
        &NormOperands {
            np: &bp.ln2,
            params: p,
            t,
            h,
            x: resid,
            stats: st2,
        },
        a2,
    )?;
    d.round(act, a2, t * h)?;
    d.copy(out, resid, t * h)?;
    let kept = MlpSaved::carve(t, &bp.mlp, &mut mlp);
    mlp_forward(d, lm, &bp.mlp, p, a2, kept, out, true)?;
    d.round(act, out, t * h)
}

/// Backward of one layer: overwrites `gi` (when given), `gp` and `gt` (a tied head's embedding
/// gradient), each rounded to the gradient precision; `gp` and `gt` only with `round_grads`
/// (the caller's stores round them the same way: `action::Rank::stores_round`).
pub(crate) fn backward<D: Device>(
    d: &D,
    lm: &LayerMath,
    w: Weights<D::Ptr>,
    saved: D::Ptr,
    input: In<D>,
    g: Grads<D::Ptr>,
    round_grads: bool,
) -> Result<(), DeviceError> {
    let Weights { params: p, tied } = w;
    let Grads { dy, gi, gp, gt } = g;
    let t = lm.dims().t;
    let grad = lm.precisions().1;
    d.fill(gp, lm.params(), 0.0)?;
    match lm.kind() {
        Kind::Embedding {
            vocab,
            hidden: h,
            wte,
            wpe,
        } => {
            let toks = tokens(input, lm)?;
            let dwpe = wpe.as_ref().map(|r| gp.at(r));
            d.embedding_backward(
                &Lookup {
                    tokens: toks,
                    vocab: *vocab,
                    h: *h,
                    s: lm.dims().s,
                    t,
                },
                dy,
                gp.at(wte),
                dwpe,
            )?;
        }
        Kind::Transformer(bp) => {
            transformer_backward(d, lm, bp, p, saved, hidden(input, lm)?, g)?;
        }
        Kind::Mlp { hidden: h, ln, mlp } => {
            let x = hidden(input, lm)?;
            let NormedSaved { a, st, mut rest } = NormedSaved::carve(t, *h, saved);
            let da = d.alloc(t * h)?;
            let kept = MlpSaved::carve(t, mlp, &mut rest);
            let through = Through { dy, dx: da, gp };
            mlp_backward(d, lm, mlp, p, a, kept, through)?;
            // The input gradient is the output gradient (the residual) plus the norm's.
            d.norm_backward(
                &NormOperands {
                    np: ln,
                    params: p,
                    t,
                    h: *h,
                    x,
                    stats: st,
                },
                da,
                gi.map(|gi| (gi, dy)),
                gp,
            )?;
        }
        Kind::LmHead {
            hidden: h,
            vocab,
            norm,
            weight,
        } => {
            let x = hidden(input, lm)?;
            let NormedSaved { a, st, .. } = NormedSaved::carve(t, *h, saved);
            let da = d.alloc(t * h)?;
            let (w, dw) = match weight {
                Some(r) => (p.at(r), gp.at(r)),
                None => {
                    let dw = gt.ok_or_else(|| {
                        plan_error("a tied lm_head needs the embedding's gradient")
                    })?;
                    d.fill(dw, vocab * h, 0.0)?;
                    let w = tied.ok_or_else(|| plan_error("a tied lm_head needs the embedding"))?;
                    (w, dw)
                }
            };
            let dy = (dy, lm.output_stride());
            let head = head_product(t, (*h, *vocab), a, w);
            d.linear_backward_rows(head, dy, dw, None, Some((da, 0.0)))?;
            if let Some(gi) = gi {
                d.fill(gi, t * h, 0.0)?;
            }
            d.norm_backward(
                &NormOperands {
                    np: norm,
                    params: p,
                    t,
                    h: *h,
                    x,
                    stats: st,
                },
                da,
                gi.map(|gi| (gi, gi)),
                gp,
            )?;
        }
    }
    if let Some(gi) = gi {
        d.round(grad, gi, lm.input_elements())?;
    }
    if round_grads {
        d.round(grad, gp, lm.params())?;
        if let Some(gt) = gt {
            d.round(grad, gt, lm.tied_elements())?;
        }
    }
    Ok(())
}

fn transformer_backward<D: Device>(
    d: &D,
    lm: &LayerMath,
    bp: &BlockP,
    p: D::Ptr,
    saved: D::Ptr,
    x: D::Ptr,
    g: Grads<D::Ptr>,
) -> Result<(), DeviceError> {
    let Grads { dy, gi, gp, .. } = g;
    let (t, s, h) = (lm.dims().t, lm.dims().s, bp.hidden);
    let w = bp.shape.width();
    let BlockSaved {
        a1,
        st1,
        qkv,
        att,
        keep,
        resid,
        a2,
        st2,
        mut mlp,
    } = BlockSaved::carve(bp, t, s, saved);
    let (dr, da, datt) = (d.alloc(t * h)?, d.alloc(t * h)?, d.alloc(t * h)?);
    let dqkv = d.alloc(t * w)?;
    let bias = |r: &Option<std::ops::Range<usize>>| r.as_ref().map(|r| gp.at(r));

    let mlp_kept = MlpSaved::carve(t, &bp.mlp, &mut mlp);
    let through = Through { dy, dx: da, gp };
    mlp_backward(d, lm, &bp.mlp, p, a2, mlp_kept, through)?;
    // The residual stream's gradient, dr = dy + ln2's, in f32 workspace.
    d.norm_backward(
        &NormOperands {
            np: &bp.ln2,
            params: p,
            t,
            h,
            x: resid,
            stats: st2,
        },
        da,
        Some((dr, dy)),
        gp,
    )?;
    let (wp, dwp) = (p.at(&bp.proj), gp.at(&bp.proj));
    let proj = proj_product(bp, t, att, wp);
    d.linear_backward(proj, dr, dwp, bias(&bp.proj_b), Some((datt, 0.0)))?;
    d.attention_backward(bp, (qkv, att), keep, datt, dqkv)?;
    if bp.rope.is_some() {
        d.rope(bp, t, dqkv, dqkv, true)?;
    }
    let (wq, dwq) = (p.at(&bp.qkv), gp.at(&bp.qkv));
    let product = qkv_product(bp, t, a1, wq);
    d.linear_backward(product, dqkv, dwq, bias(&bp.qkv_b), Some((da, 0.0)))?;
    // The input gradient is dr + ln1's, summed in f32 and stored (rounded once, as the CPU
    // rounds it) in the pass that computes ln1's.
    d.norm_backward(
        &NormOperands {
            np: &bp.ln1,
            params: p,
            t,
            h,
            x,
            stats: st1,
        },
        da,
        gi.map(|gi| (gi, dr)),
        gp,
    )
}

/// A split backward's input half's gradients (a pipeline's `I`): `dy`, the output's (read);
/// `gi`, the input's (overwritten, when wanted); `stash`, what the weight half reads
/// (overwritten whole, fp32: [`BlockStash`], [`NormedStash`]; empty for an embedding).
#[derive(Clone, Copy, Debug)]
pub(crate) struct InputGrads<P> {
    pub dy: P,
    pub gi: Option<P>,
    pub stash: P,
}

/// A split backward's weight half's gradients (a pipeline's `W`, after its `I`): `dy`, the
/// output's, and `stash`, as the input half left it (both read); `gp` and `gt` as in
/// [`Grads`] (overwritten).
#[derive(Clone, Copy, Debug)]
pub(crate) struct WeightGrads<P> {
    pub dy: P,
    pub stash: P,
    pub gp: P,
    pub gt: Option<P>,
}

/// The operands of the norm `np` (of the layer's parameters `params`) over `t` rows of `x`.
pub(super) fn norm_operands<P: Ptr>(
    np: &NormP,
    params: P,
    t: usize,
    x: P,
    stats: P,
) -> NormOperands<'_, P> {
    NormOperands {
        np,
        params,
        t,
        h: np.w.len(),
        x,
        stats,
    }
}

fn swiglu_up(mp: &MlpP) -> Result<&(Range<usize>, Option<Range<usize>>), DeviceError> {
    mp.up
        .as_ref()
        .ok_or_else(|| plan_error("swiglu without an up projection"))
}

fn stash_mismatch() -> DeviceError {
    plan_error("an MLP's stash of another activation")
}

/// The MLP's input half: `g` = (dy, dx), the gradient of its output (read) and of its input
/// `a` (overwritten); its products' operands are `pa` = (the layer's parameters, `a`). The
/// gradient of the first product's output goes into the stash `st`: [`mlp_backward`]'s values,
/// but for the parameter gradients.
fn mlp_backward_input<D: Device>(
    d: &D,
    lm: &LayerMath,
    mp: &MlpP,
    (p, a): (D::Ptr, D::Ptr),
    kept: MlpSaved<D::Ptr>,
    st: MlpStash<D::Ptr>,
    (dy, da): (D::Ptr, D::Ptr),
) -> Result<(), DeviceError> {
    let (t, f) = (lm.dims().t, mp.ffn);
    let wp = p.at(&mp.proj);
    let into_ffn = |w| into_ffn(mp, t, a, w);
    let from_ffn = |x| from_ffn(mp, t, x, wp);
    match (kept, st) {
        (MlpSaved::Gelu { pre, post }, MlpStash::Gelu { dpre }) => {
            d.linear_backward_input(from_ffn(post), dy, (dpre, 0.0))?;
            d.gelu_backward(pre, dpre, t * f)?;
            d.linear_backward_input(into_ffn(p.at(&mp.w1)), dpre, (da, 0.0))
        }
        (MlpSaved::SwiGlu { gate, up, prod }, MlpStash::SwiGlu { dgate, dup }) => {
            d.linear_backward_input(from_ffn(prod), dy, (dgate, 0.0))?;
            d.swiglu_backward(gate, up, dgate, dup, t * f)?;
            let (wu, _) = swiglu_up(mp)?;
            d.linear_backward_input(into_ffn(p.at(&mp.w1)), dgate, (da, 0.0))?;
            d.linear_backward_input(into_ffn(p.at(wu)), dup, (da, 1.0))
        }
        _ => Err(stash_mismatch()),
    }
}

/// The MLP's weight half: its parameter gradients accumulate into `gp` from the output
/// gradient `dy` and the stash `st` ([`mlp_backward_input`]'s), against its saved tensors and
/// its input `a` (`pa` = (the layer's parameters, `a`)).
fn mlp_backward_weight<D: Device>(
    d: &D,
    lm: &LayerMath,
    mp: &MlpP,
    (p, a): (D::Ptr, D::Ptr),
    kept: MlpSaved<D::Ptr>,
    st: MlpStash<D::Ptr>,
    (dy, gp): (D::Ptr, D::Ptr),
) -> Result<(), DeviceError> {
    let t = lm.dims().t;
    let wp = p.at(&mp.proj);
    let (dwp, dbp) = (gp.at(&mp.proj), mp.proj_b.as_ref().map(|r| gp.at(r)));
    let (dw1, db1) = (gp.at(&mp.w1), mp.b1.as_ref().map(|r| gp.at(r)));
    let into_ffn = |w| into_ffn(mp, t, a, w);
    let from_ffn = |x| from_ffn(mp, t, x, wp);
    match (kept, st) {
        (MlpSaved::Gelu { post, .. }, MlpStash::Gelu { dpre }) => {
            d.linear_backward(from_ffn(post), dy, dwp, dbp, None)?;
            d.linear_backward(into_ffn(p.at(&mp.w1)), dpre, dw1, db1, None)
        }
        (MlpSaved::SwiGlu { prod, .. }, MlpStash::SwiGlu { dgate, dup }) => {
            d.linear_backward(from_ffn(prod), dy, dwp, dbp, None)?;
            let (wu, bu) = swiglu_up(mp)?;
            let dbu = bu.as_ref().map(|r| gp.at(r));
            d.linear_backward(into_ffn(p.at(&mp.w1)), dgate, dw1, db1, None)?;
            d.linear_backward(into_ffn(p.at(wu)), dup, gp.at(wu), dbu, None)
        }
        _ => Err(stash_mismatch()),
    }
}

/// The input half of one layer's backward (a pipeline's `I`): overwrites `g.gi` (when given,
/// rounded to the gradient precision, as [`backward`] rounds it) and the whole stash `g.stash`
/// (fp32) with the gradients of the outputs of the products and norms whose parameter
/// gradients [`backward_weight`] computes; computes no parameter gradient. An embedding's does
/// nothing (it has no input gradient and stashes nothing).
pub(crate) fn backward_input<D: Device>(
    d: &D,
    lm: &LayerMath,
    w: Weights<D::Ptr>,
    saved: D::Ptr,
    input: In<D>,
    g: InputGrads<D::Ptr>,
) -> Result<(), DeviceError> {
    let Weights { params: p, tied } = w;
    let InputGrads { dy, gi, stash } = g;
    let t = lm.dims().t;
    let grad = lm.precisions().1;
    match lm.kind() {
        Kind::Embedding { .. } => {}
        Kind::Transformer(bp) => {
            let x = hidden(input, lm)?;
            let (h, s) = (bp.hidden, lm.dims().s);
            let BlockSaved {
                a1,
                st1,
                qkv,
                att,
                keep,
                resid,
                a2,
                st2,
                mut mlp,
            } = BlockSaved::carve(bp, t, s, saved);
            let BlockStash {
                d1,
                dqkv,
                dr,
                d2,
                mlp: mlp_stash,
            } = BlockStash::carve(bp, t, stash);
            let datt = d.alloc(t * h)?;
            let mlp_kept = MlpSaved::carve(t, &bp.mlp, &mut mlp);
            mlp_backward_input(d, lm, &bp.mlp, (p, a2), mlp_kept, mlp_stash, (dy, d2))?;
            // The residual stream's gradient, dr = dy + ln2's.
            d.norm_backward_input(&norm_operands(&bp.ln2, p, t, resid, st2), d2, (dr, dy))?;
            let proj = proj_product(bp, t, att, p.at(&bp.proj));
            d.linear_backward_input(proj, dr, (datt, 0.0))?;
            d.attention_backward(bp, (qkv, att), keep, datt, dqkv)?;
            if bp.rope.is_some() {
                d.rope(bp, t, dqkv, dqkv, true)?;
            }
            let product = qkv_product(bp, t, a1, p.at(&bp.qkv));
            d.linear_backward_input(product, dqkv, (d1, 0.0))?;
            if let Some(gi) = gi {
                d.norm_backward_input(&norm_operands(&bp.ln1, p, t, x, st1), d1, (gi, dr))?;
            }
        }
        Kind::Mlp { hidden: h, ln, mlp } => {
            let x = hidden(input, lm)?;
            let NormedSaved { a, st, mut rest } = NormedSaved::carve(t, *h, saved);
            let kept = MlpSaved::carve(t, mlp, &mut rest);
            let NormedStash { dn, mut rest } = NormedStash::carve(t, *h, stash);
            let mlp_stash = MlpStash::carve(t, mlp, &mut rest);
            mlp_backward_input(d, lm, mlp, (p, a), kept, mlp_stash, (dy, dn))?;
            if let Some(gi) = gi {
                // The output gradient (the residual) plus the norm's.
                d.norm_backward_input(&norm_operands(ln, p, t, x, st), dn, (gi, dy))?;
            }
        }
        Kind::LmHead {
            hidden: h,
            vocab,
            norm,
            weight,
        } => {
            let x = hidden(input, lm)?;
            let NormedSaved { a, st, .. } = NormedSaved::carve(t, *h, saved);
            let NormedStash { dn, .. } = NormedStash::carve(t, *h, stash);
            let w = match weight {
                Some(r) => p.at(r),
                None => tied.ok_or_else(|| plan_error("a tied lm_head needs the embedding"))?,
            };
            let head = head_product(t, (*h, *vocab), a, w);
            d.linear_backward_input_rows(head, (dy, lm.output_stride()), (dn, 0.0))?;
            if let Some(gi) = gi {
                d.fill(gi, t * h, 0.0)?;
                d.norm_backward_input(&norm_operands(norm, p, t, x, st), dn, (gi, gi))?;
            }
        }
    }
    if let Some(gi) = gi {
        d.round(grad, gi, lm.input_elements())?;
    }
    Ok(())
}

/// The weight half of one layer's backward (a pipeline's `W`, after [`backward_input`] wrote
/// `g.stash`): overwrites `g.gp` and `g.gt` as [`backward`] does (zeros first, every parameter
/// gradient summed from the saved activations, the layer's input, the output gradient and the
/// stash, rounded with `round_grads`); reads no input gradient. With the input half, the
/// values of [`backward`].
pub(crate) fn backward_weight<D: Device>(
    d: &D,
    lm: &LayerMath,
    w: Weights<D::Ptr>,
    saved: D::Ptr,
    input: In<D>,
    g: WeightGrads<D::Ptr>,
    round_grads: bool,
) -> Result<(), DeviceError> {
    let Weights { params: p, tied } = w;
    let WeightGrads { dy, stash, gp, gt } = g;
    let t = lm.dims().t;
    let grad = lm.precisions().1;
    d.fill(gp, lm.params(), 0.0)?;
    match lm.kind() {
        Kind::Embedding {
            vocab,
            hidden: h,
            wte,
            wpe,
        } => {
            let dwpe = wpe.as_ref().map(|r| gp.at(r));
            let at = Lookup {
                tokens: tokens(input, lm)?,
                vocab: *vocab,
                h: *h,
                s: lm.dims().s,
                t,
            };
            d.embedding_backward(&at, dy, gp.at(wte), dwpe)?;
        }
        Kind::Transformer(bp) => {
            let x = hidden(input, lm)?;
            let s = lm.dims().s;
            let BlockSaved {
                a1,
                st1,
                att,
                resid,
                a2,
                st2,
                mut mlp,
                ..
            } = BlockSaved::carve(bp, t, s, saved);
            let BlockStash {
                d1,
                dqkv,
                dr,
                d2,
                mlp: mlp_stash,
            } = BlockStash::carve(bp, t, stash);
            let bias = |r: &Option<Range<usize>>| r.as_ref().map(|r| gp.at(r));
            let mlp_kept = MlpSaved::carve(t, &bp.mlp, &mut mlp);
            mlp_backward_weight(d, lm, &bp.mlp, (p, a2), mlp_kept, mlp_stash, (dy, gp))?;
            d.norm_backward(&norm_operands(&bp.ln2, p, t, resid, st2), d2, None, gp)?;
            let proj = proj_product(bp, t, att, p.at(&bp.proj));
            d.linear_backward(proj, dr, gp.at(&bp.proj), bias(&bp.proj_b), None)?;
            let product = qkv_product(bp, t, a1, p.at(&bp.qkv));
            d.linear_backward(product, dqkv, gp.at(&bp.qkv), bias(&bp.qkv_b), None)?;
            d.norm_backward(&norm_operands(&bp.ln1, p, t, x, st1), d1, None, gp)?;
        }
        Kind::Mlp { hidden: h, ln, mlp } => {
            let x = hidden(input, lm)?;
            let NormedSaved { a, st, mut rest } = NormedSaved::carve(t, *h, saved);
            let kept = MlpSaved::carve(t, mlp, &mut rest);
            let NormedStash { dn, mut rest } = NormedStash::carve(t, *h, stash);
            let mlp_stash = MlpStash::carve(t, mlp, &mut rest);
            mlp_backward_weight(d, lm, mlp, (p, a), kept, mlp_stash, (dy, gp))?;
            d.norm_backward(&norm_operands(ln, p, t, x, st), dn, None, gp)?;
        }
        Kind::LmHead {
            hidden: h,
            vocab,
            norm,
            weight,
        } => {
            let x = hidden(input, lm)?;
            let NormedSaved { a, st, .. } = NormedSaved::carve(t, *h, saved);
            let NormedStash { dn, .. } = NormedStash::carve(t, *h, stash);
            let (w, dw) = match weight {
                Some(r) => (p.at(r), gp.at(r)),
                None => {
                    let dw = gt.ok_or_else(|| {
                        plan_error("a tied lm_head needs the embedding's gradient")
                    })?;
                    d.fill(dw, vocab * h, 0.0)?;
                    let w = tied.ok_or_else(|| plan_error("a tied lm_head needs the embedding"))?;
                    (w, dw)
                }
            };
            let head = head_product(t, (*h, *vocab), a, w);
            d.linear_backward_rows(head, (dy, lm.output_stride()), dw, None, None)?;
            d.norm_backward(&norm_operands(norm, p, t, x, st), dn, None, gp)?;
        }
    }
    if round_grads {
        d.round(grad, gp, lm.params())?;
        if let Some(gt) = gt {
            d.round(grad, gt, lm.tied_elements())?;
        }
    }
    Ok(())
}

#[cfg(all(test, feature = "compile"))]
#[path = "../../tests/unit/device_layers.rs"]
mod tests;
