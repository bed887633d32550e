//! Forward and backward of each layer kind, over the buffers the executor hands in.

use super::attention;
use super::gemm::{linear, linear_backward};
use super::ops::{gelu, gelu_grad, norm_backward, norm_forward, sigmoid, Rope};
use super::saved::{BlockSaved, Carve, MlpSaved, NormedSaved};
use super::{BlockP, Input, Kind, LayerMath, MlpP, NormP};
use std::cell::RefCell;
use std::ops::Range;

thread_local! {
    static SCRATCH: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// Runs `f` on `n` floats of this thread's scratch buffer (contents unspecified), grown as needed
/// and kept for the next call so steady-state steps allocate nothing.
fn with_scratch<R>(n: usize, f: impl FnOnce(&mut [f32]) -> R) -> R {
    SCRATCH.with(|cell| match cell.try_borrow_mut() {
        Ok(mut buf) => {
            if buf.len() < n {
                buf.resize(n, 0.0);
            }
            f(&mut buf[..n])
        }
        Err(_) => f(&mut vec![0.0; n]),
    })
}

/// Two disjoint mutable ranges of one buffer (the second optional).
fn pair<'a>(
    buf: &'a mut [f32],
    a: &Range<usize>,
    b: &Option<Range<usize>>,
) -> (&'a mut [f32], Option<&'a mut [f32]>) {
    match b {
        None => (&mut buf[a.clone()], None),
        Some(b) if b.start >= a.end => {
            let (lo, hi) = buf.split_at_mut(b.start);
            (&mut lo[a.clone()], Some(&mut hi[..b.len()]))
        }
        Some(b) => {
            assert!(b.end <= a.start, "overlapping tensors");
            let (lo, hi) = buf.split_at_mut(a.start);
            (&mut hi[..a.len()], Some(&mut lo[b.clone()]))
        }
    }
}

fn norm_fwd(np: &NormP, p: &[f32], h: usize, x: &[f32], out: &mut [f32], st: &mut [f32]) {
    super::ops::wide(
        #[inline(always)]
        || {
            let b = np.b.clone().map(|r| &p[r]);
            norm_forward(np.kind, h, x, &p[np.w.clone()], b, out, st);
        },
    )
}

#[allow(clippy::too_many_arguments)]
fn norm_bwd(
    np: &NormP,
    p: &[f32],
    h: usize,
    x: &[f32],
    st: &[f32],
    dy: &[f32],
    dx: Option<&mut [f32]>,
    gp: &mut [f32],
) {
    super::ops::wide(
        #[inline(always)]
        || {
            let (dw, db) = pair(gp, &np.w, &np.b);
            norm_backward(np.kind, h, x, &p[np.w.clone()], st, dy, dx, dw, db);
        },
    )
}

fn bias<'a>(p: &'a [f32], r: &Option<Range<usize>>) -> Option<&'a [f32]> {
    r.clone().map(|r| &p[r])
}

fn hidden(input: Input<'_>) -> &[f32] {
    match input {
        Input::Hidden(x) => x,
        Input::Tokens(_) => unreachable!("checked by LayerMath::check"),
    }
}

fn rope_rows(rope: &Option<Rope>, p: &BlockP, s: usize, qkv: &mut [f32], inverse: bool) {
    let Some(rope) = rope else { return };
    let sh = &p.shape;
    let (h, kv) = (sh.hidden(), sh.kv_heads * sh.d);
    for (t, row) in qkv.chunks_exact_mut(sh.width()).enumerate() {
        let pos = t % s;
        rope.apply(&mut row[..h], sh.heads, pos, inverse);
        rope.apply(&mut row[h..h + kv], sh.kv_heads, pos, inverse);
    }
}

/// out += MLP(a), keeping the MLP's tensors in `kept`.
fn mlp_forward(
    m: &LayerMath,
    mp: &MlpP,
    p: &[f32],
    a: &[f32],
    kept: MlpSaved<&mut [f32]>,
    out: &mut [f32],
) {
    super::ops::wide(
        #[inline(always)]
        || {
            let (t, h, f) = (m.dims.t, mp.hidden, mp.ffn);
            let w1 = &p[mp.w1.clone()];
            let b1 = bias(p, &mp.b1);
            let mid = match kept {
                MlpSaved::Gelu { pre, post } => {
                    linear(a, w1, b1, pre, t, h, f, 0.0);
                    m.act.round(pre);
                    for (y, &x) in post.iter_mut().zip(pre.iter()) {
                        *y = gelu(x);
                    }
                    m.act.round(post);
                    post
                }
                MlpSaved::SwiGlu { gate, up, prod } => {
                    let (wu, bu) = mp.up.as_ref().expect("swiglu has an up projection");
                    linear(a, w1, b1, gate, t, h, f, 0.0);
                    linear(a, &p[wu.clone()], bias(p, bu), up, t, h, f, 0.0);
                    m.act.round(gate);
                    m.act.round(up);
                    for ((y, &g), &u) in prod.iter_mut().zip(gate.iter()).zip(up.iter()) {
                        *y = g * sigmoid(g) * u;
                    }
                    m.act.round(prod);
                    prod
                }
            };
            linear(
                mid,
                &p[mp.proj.clone()],
                bias(p, &mp.proj_b),
                out,
                t,
                f,
                h,
                1.0,
            );
        },
    )
}

/// The MLP's backward: parameter gradients accumulate into `gp`; `da` (the gradient of the MLP's
/// input) is overwritten. `s1` and `s2` are T·ffn scratch.
#[allow(clippy::too_many_arguments)]
fn mlp_backward(
    m: &LayerMath,
    mp: &MlpP,
    p: &[f32],
    a: &[f32],
    kept: MlpSaved<&[f32]>,
    g: &[f32],
    da: &mut [f32],
    gp: &mut [f32],
    s1: &mut [f32],
    s2: &mut [f32],
) {
    super::ops::wide(
        #[inline(always)]
        || {
            let (t, h, f) = (m.dims.t, mp.hidden, mp.ffn);
            let wp = &p[mp.proj.clone()];
            match kept {
                MlpSaved::Gelu { pre, post } => {
                    let (dw, db) = pair(gp, &mp.proj, &mp.proj_b);
                    linear_backward(post, wp, g, dw, db, Some((s1, 0.0)), t, f, h);
                    for (d, &x) in s1.iter_mut().zip(pre) {
                        *d *= gelu_grad(x);
                    }
                    let (dw, db) = pair(gp, &mp.w1, &mp.b1);
                    linear_backward(a, &p[mp.w1.clone()], s1, dw, db, Some((da, 0.0)), t, h, f);
                }
                MlpSaved::SwiGlu { gate, up, prod } => {
                    let (dw, db) = pair(gp, &mp.proj, &mp.proj_b);
                    linear_backward(prod, wp, g, dw, db, Some((s1, 0.0)), t, f, h);
                    for (((dg, du), &x), &u) in s1.iter_mut().zip(s2.iter_mut()).zip(gate).zip(up) {
                        let sg = sigmoid(x);
                        let dprod = *dg;
                        *du = dprod * x * sg;
                        *dg = dprod * u * sg * (1.0 + x * (1.0 - sg));
                    }
                    let (wu, bu) = mp.up.as_ref().expect("swiglu has an up projection");
                    let (dw, db) = pair(gp, &mp.w1, &mp.b1);
                    linear_backward(
                        a,
                        &p[mp.w1.clone()],
                        s1,
                        dw,
                        db,
                        Some((&mut *da, 0.0)),
                        t,
                        h,
                        f,
                    );
                    let (dw, db) = pair(gp, wu, bu);
                    linear_backward(a, &p[wu.clone()], s2, dw, db, Some((da, 1.0)), t, h, f);
                }
            }
        },
    )
}

pub(super) fn forward(
    m: &LayerMath,
    p: &[f32],
    tied: Option<&[f32]>,
    input: Input<'_>,
    out: &mut [f32],
    saved: &mut [f32],
) {
    let (t, s) = (m.dims.t, m.dims.s);
    match &m.kind {
        Kind::Embedding {
            vocab,
            hidden: h,
            wte,
            wpe,
        } => {
            let Input::Tokens(tokens) = input else {
                unreachable!("checked by LayerMath::check")
            };
            let wte = &p[wte.clone()];
            for (i, (&tok, row)) in tokens.iter().zip(out.chunks_exact_mut(*h)).enumerate() {
                let tok = tok as usize;
                assert!(
                    tok < *vocab,
                    "{}: token {tok} not below vocab {vocab}",
                    m.name
                );
                row.copy_from_slice(&wte[tok * h..(tok + 1) * h]);
                if let Some(wpe) = wpe {
                    let pos = &p[wpe.start + (i % s) * h..][..*h];
                    row.iter_mut().zip(pos).for_each(|(y, &v)| *y += v);
                }
            }
            m.act.round(out);
        }
        Kind::Transformer(bp) => transformer_forward(m, bp, p, hidden(input), out, saved),
        Kind::Mlp { hidden: h, ln, mlp } => {
            let x = hidden(input);
            let NormedSaved { a, st, mut rest } = NormedSaved::carve(t, *h, saved);
            norm_fwd(ln, p, *h, x, a, st);
            m.act.round(a);
            out.copy_from_slice(x);
            mlp_forward(m, mlp, p, a, MlpSaved::carve(t, mlp, &mut rest), out);
            m.act.round(out);
        }
        Kind::LmHead {
            hidden: h,
            vocab,
            norm,
            weight,
        } => {
            let NormedSaved { a, st, .. } = NormedSaved::carve(t, *h, saved);
            norm_fwd(norm, p, *h, hidden(input), a, st);
            m.act.round(a);
            let w = match weight {
                Some(r) => &p[r.clone()],
                None => tied.expect("checked by LayerMath::check"),
            };
            linear(a, w, None, out, t, *h, *vocab, 0.0);
            m.act.round(out);
        }
    }
}

fn transformer_forward(
    m: &LayerMath,
    bp: &BlockP,
    p: &[f32],
    x: &[f32],
    out: &mut [f32],
    saved: &mut [f32],
) {
    let (t, s, h) = (m.dims.t, m.dims.s, bp.hidden);
    let sh = &bp.shape;
    let w = sh.width();
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
    } = BlockSaved::carve(bp, m.dims.t, m.dims.s, saved);

    norm_fwd(&bp.ln1, p, h, x, a1, st1);
    m.act.round(a1);
    linear(
        a1,
        &p[bp.qkv.clone()],
        bias(p, &bp.qkv_b),
        qkv,
        t,
        h,
        w,
        0.0,
    );
    rope_rows(&bp.rope, bp, s, qkv, false);
    m.act.round(qkv);
    with_scratch(sh.scratch(), |scratch| {
        attention::forward(sh, qkv, att, keep, m.act, scratch)
    });
    m.act.round(att);
    resid.copy_from_slice(x);
    linear(
        att,
        &p[bp.proj.clone()],
        bias(p, &bp.proj_b),
        resid,
        t,
        h,
        h,
        1.0,
    );
    m.act.round(resid);
    norm_fwd(&bp.ln2, p, h, resid, a2, st2);
    m.act.round(a2);
    out.copy_from_slice(resid);
    mlp_forward(
        m,
        &bp.mlp,
        p,
        a2,
        MlpSaved::carve(t, &bp.mlp, &mut mlp),
        out,
    );
    m.act.round(out);
}

#[allow(clippy::too_many_arguments)]
pub(super) fn backward(
    m: &LayerMath,
    p: &[f32],
    tied: Option<&[f32]>,
    saved: &[f32],
    input: Input<'_>,
    g: &[f32],
    mut gi: Option<&mut [f32]>,
    gp: &mut [f32],
    mut gt: Option<&mut [f32]>,
) {
    let (t, s) = (m.dims.t, m.dims.s);
    gp.fill(0.0);
    match &m.kind {
        Kind::Embedding {
            vocab,
            hidden: h,
            wte,
            wpe,
        } => {
            let Input::Tokens(tokens) = input else {
                unreachable!("checked by LayerMath::check")
            };
            for (i, (&tok, row)) in tokens.iter().zip(g.chunks_exact(*h)).enumerate() {
                assert!(
                    (tok as usize) < *vocab,
                    "{}: token {tok} not below vocab {vocab}",
                    m.name
                );
                let d = &mut gp[wte.start + tok as usize * h..][..*h];
                d.iter_mut().zip(row).for_each(|(a, &v)| *a += v);
                if let Some(wpe) = wpe {
                    let d = &mut gp[wpe.start + (i % s) * h..][..*h];
                    d.iter_mut().zip(row).for_each(|(a, &v)| *a += v);
                }
            }
        }
        Kind::Transformer(bp) => {
            transformer_backward(m, bp, p, saved, hidden(input), g, gi.as_deref_mut(), gp)
        }
        Kind::Mlp { hidden: h, ln, mlp } => {
            let x = hidden(input);
            let NormedSaved { a, st, mut rest } = NormedSaved::carve(t, *h, saved);
            let f = mlp.ffn;
            with_scratch(t * h + 2 * t * f, |scratch| {
                let mut sc = Carve(scratch);
                let da = sc.take(t * h);
                let (s1, s2) = (sc.take(t * f), sc.take(t * f));
                let kept = MlpSaved::carve(t, mlp, &mut rest);
                mlp_backward(m, mlp, p, a, kept, g, da, gp, s1, s2);
                if let Some(gi) = gi.as_deref_mut() {
                    gi.copy_from_slice(g);
                }
                norm_bwd(ln, p, *h, x, st, da, gi.as_deref_mut(), gp);
            });
        }
        Kind::LmHead {
            hidden: h,
            vocab,
            norm,
            weight,
        } => {
            let NormedSaved { a, st, .. } = NormedSaved::carve(t, *h, saved);
            with_scratch(t * h, |da| {
                match weight {
                    Some(r) => linear_backward(
                        a,
                        &p[r.clone()],
                        g,
                        &mut gp[r.clone()],
                        None,
                        Some((&mut *da, 0.0)),
                        t,
                        *h,
                        *vocab,
                    ),
                    None => {
                        let dw = gt.as_deref_mut().expect("checked by LayerMath::backward");
                        dw.fill(0.0);
                        let w = tied.expect("checked by LayerMath::check");
                        linear_backward(a, w, g, dw, None, Some((&mut *da, 0.0)), t, *h, *vocab)
                    }
                }
                if let Some(gi) = gi.as_deref_mut() {
                    gi.fill(0.0);
                }
                norm_bwd(norm, p, *h, hidden(input), st, da, gi.as_deref_mut(), gp);
            });
        }
    }
    m.grad.round(gp);
    if let Some(gi) = gi {
        m.grad.round(gi);
    }
    if let Some(gt) = gt {
        m.grad.round(gt);
    }
}

#[allow(clippy::too_many_arguments)]
fn transformer_backward(
    m: &LayerMath,
    bp: &BlockP,
    p: &[f32],
    saved: &[f32],
    x: &[f32],
    g: &[f32],
    gi: Option<&mut [f32]>,
    gp: &mut [f32],
) {
    let (t, s, h, f) = (m.dims.t, m.dims.s, bp.hidden, bp.mlp.ffn);
    let sh = &bp.shape;
    let w = sh.width();
    let BlockSaved {
        a1,
        st1,
        qkv,
        att,
        keep: kept,
        resid,
        a2,
        st2,
        mut mlp,
    } = BlockSaved::carve(bp, m.dims.t, m.dims.s, saved);

    let need = 3 * t * h + 2 * t * f + t * w + 2 * sh.scratch();
    with_scratch(need, |scratch| {
        let mut sc = Carve(scratch);
        let dr = sc.take(t * h);
        let da = sc.take(t * h);
        let datt = sc.take(t * h);
        let (s1, s2) = (sc.take(t * f), sc.take(t * f));
        let dqkv = sc.take(t * w);
        let attn_scratch = sc.take(2 * sh.scratch());

        let mlp_kept = MlpSaved::carve(t, &bp.mlp, &mut mlp);
        mlp_backward(m, &bp.mlp, p, a2, mlp_kept, g, da, gp, s1, s2);
        dr.copy_from_slice(g);
        norm_bwd(&bp.ln2, p, h, resid, st2, da, Some(&mut *dr), gp);

        let (dw, db) = pair(gp, &bp.proj, &bp.proj_b);
        linear_backward(
            att,
            &p[bp.proj.clone()],
            dr,
            dw,
            db,
            Some((&mut *datt, 0.0)),
            t,
            h,
            h,
        );
        attention::backward(sh, qkv, kept, datt, dqkv, attn_scratch);
        rope_rows(&bp.rope, bp, s, dqkv, true);
        let (dw, db) = pair(gp, &bp.qkv, &bp.qkv_b);
        linear_backward(
            a1,
            &p[bp.qkv.clone()],
            dqkv,
            dw,
            db,
            Some((&mut *da, 0.0)),
            t,
            h,
            w,
        );

        let mut gi = gi;
        if let Some(gi) = gi.as_deref_mut() {
            gi.copy_from_slice(dr);
        }
        norm_bwd(&bp.ln1, p, h, x, st1, da, gi, gp);
    });
}
