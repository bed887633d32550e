//! Each layer kind's forward and backward, once for every device: which primitives run in which
//! order, where values are rounded to the activation and gradient dtypes (`runtime.md`: bf16
//! storage, fp32 compute), and where the saved tensors go ([`crate::math::saved`]).
//!
//! Contracts (those of [`crate::math::LayerMath`]): `forward` overwrites `out` and all of
//! `saved`; `backward` overwrites the input gradient (when asked for), the parameter gradient and
//! a tied head's embedding gradient, never accumulating across calls.

use super::{plan_error, Device, DeviceError, Linear, Lookup, NormOperands, Ptr};
use crate::math::saved::{BlockSaved, MlpSaved, NormedSaved};
use crate::math::{BlockP, Kind, LayerMath, MlpP};

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
fn qkv_product<P>(bp: &BlockP, t: usize, x: P, w: P) -> Linear<P> {
    let (inp, out) = (bp.hidden, bp.shape.width());
    Linear { x, w, t, inp, out }
}

/// A block's projection of attention's output `x` [t, hidden] back to the hidden width.
fn proj_product<P>(bp: &BlockP, t: usize, x: P, w: P) -> Linear<P> {
    let (inp, out) = (bp.hidden, bp.hidden);
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

/// out += MLP(a), keeping the MLP's tensors in `kept`.
fn mlp_forward<D: Device>(
    d: &D,
    lm: &LayerMath,
    mp: &MlpP,
    p: D::Ptr,
    a: D::Ptr,
    kept: MlpSaved<D::Ptr>,
    out: D::Ptr,
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
    let proj_b = mp.proj_b.as_ref().map(|r| p.at(r));
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
struct Through<P> {
    dy: P,
    dx: P,
    gp: P,
}

/// The MLP's backward: parameter gradients accumulate into `g.gp`; `g.dx` (the gradient of the
/// MLP's input) is overwritten.
fn mlp_backward<D: Device>(
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
            mlp_forward(d, lm, mlp, p, a, MlpSaved::carve(t, mlp, &mut rest), out)?;
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
    let bias = |r: &Option<std::ops::Range<usize>>| r.as_ref().map(|r| p.at(r));

    d.norm_forward(
        &NormOperands {
            np: &bp.ln1,
            params: p,
            t,
            h,
            x,
            stats: st1,
        },
        a1,
    )?;
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
    d.round(act, att, t * h)?;
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
    mlp_forward(d, lm, &bp.mlp, p, a2, kept, out)?;
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
