//! The layer math on the GPU, function for function the twin of `crate::math::layers` (and of
//! `attention.rs`): the same saved-segment layout, the same rounding points, the same products
//! (cuBLAS instead of sgemm) on f32 device buffers. Compiled, never run on a GPU yet.

#![cfg_attr(not(feature = "cuda"), allow(dead_code))]

use super::enqueue::{elems, m, mt, prec_code, row_major, rows, Exec, A, M};
use crate::math::saved::{BlockSaved, MlpSaved, NormedSaved, Piece};
use crate::math::{BlockP, Kind, LayerMath, MlpP, NormP, Precision};
use schedc::job::{Attention, Norm};
use std::cell::Cell;
use std::ops::Range;

/// What one stream needs to enqueue work: the stream ([`Exec`]) and its workspace, handed out
/// by a bump pointer that the caller resets after each op.
pub struct G<'a> {
    pub x: &'a dyn Exec,
    pub ws_base: u64,
    pub ws_len: usize,
    pub used: Cell<usize>,
    /// Device rotary tables (cos then sin, seq_len × head_dim/2 each), when the model uses them.
    pub rope: Option<u64>,
}

/// A layer's input on the device: token ids (i32) or hidden states (f32).
#[derive(Clone, Copy)]
pub enum In {
    Tokens(u64),
    Hidden(u64),
}

const F: u64 = 4;

impl G<'_> {
    /// `n` floats of workspace (contents unspecified).
    pub fn alloc(&self, n: usize) -> Result<u64, String> {
        let at = self.used.get();
        // 64-float alignment keeps every piece 256-byte aligned for cuBLAS.
        let next = at + n.div_ceil(64) * 64;
        if next > self.ws_len {
            return Err(format!(
                "the stream workspace of {} floats is too small ({next} needed)",
                self.ws_len
            ));
        }
        self.used.set(next);
        Ok(self.ws_base + at as u64 * F)
    }

    pub fn zeros(&self, n: usize) -> Result<u64, String> {
        let p = self.alloc(n)?;
        self.fill(p, n, 0.0)?;
        Ok(p)
    }

    pub fn run(&self, name: &str, n: usize, args: &[A]) -> Result<(), String> {
        self.x.launch(name, elems(n), args)
    }

    pub fn run_rows(&self, name: &str, r: usize, args: &[A]) -> Result<(), String> {
        self.x.launch(name, rows(r), args)
    }

    /// Row-major C[rows × cols] ← α·op(A)·op(B) + β·C (see [`row_major`]).
    #[allow(clippy::too_many_arguments)]
    pub fn gemm(
        &self,
        rows: usize,
        cols: usize,
        k: usize,
        alpha: f32,
        a: M,
        b: M,
        beta: f32,
        c: u64,
        ldc: usize,
    ) -> Result<(), String> {
        self.batched(rows, cols, k, alpha, a, 0, b, 0, beta, c, ldc, 0, 1)
    }

    #[allow(clippy::too_many_arguments)]
    pub fn batched(
        &self,
        rows: usize,
        cols: usize,
        k: usize,
        alpha: f32,
        a: M,
        stride_a: usize,
        b: M,
        stride_b: usize,
        beta: f32,
        c: u64,
        ldc: usize,
        stride_c: usize,
        batch: usize,
    ) -> Result<(), String> {
        if rows == 0 || cols == 0 || batch == 0 {
            return Ok(());
        }
        self.x.gemm(&row_major(
            rows, cols, k, alpha, a, stride_a, b, stride_b, beta, c, ldc, stride_c, batch,
        ))
    }

    pub fn fill(&self, p: u64, n: usize, v: f32) -> Result<(), String> {
        self.run("fill", n, &[A::P(p), A::F(v), A::L(n as i64)])
    }

    pub fn round(&self, prec: Precision, p: u64, n: usize) -> Result<(), String> {
        if prec == Precision::F32 {
            return Ok(());
        }
        self.run(
            "round_in_place",
            n,
            &[A::P(p), A::I(prec_code(prec)), A::L(n as i64)],
        )
    }

    /// dst ← src (n floats), on the stream.
    pub fn copy(&self, dst: u64, src: u64, n: usize) -> Result<(), String> {
        self.copy_bytes(dst, src, n * 4)
    }

    pub fn copy_bytes(&self, dst: u64, src: u64, bytes: usize) -> Result<(), String> {
        if bytes == 0 {
            return Ok(());
        }
        self.x.copy_bytes(dst, src, bytes)
    }
}

fn at(p: u64, r: &Range<usize>) -> u64 {
    p + r.start as u64 * F
}

fn opt(p: u64, r: &Option<Range<usize>>) -> u64 {
    r.as_ref().map_or(0, |r| at(p, r))
}

/// y (β)= x·Wᵀ (+ bias): x [t, inp], w [out, inp], y [t, out] (gemm.rs `linear`).
#[allow(clippy::too_many_arguments)]
fn linear(
    g: &G,
    x: u64,
    w: u64,
    bias: u64,
    y: u64,
    t: usize,
    inp: usize,
    out: usize,
    beta: f32,
) -> Result<(), String> {
    g.gemm(t, out, inp, 1.0, m(x, inp), mt(w, inp), beta, y, out)?;
    if bias != 0 {
        g.run(
            "bias_add",
            t * out,
            &[A::P(y), A::P(bias), A::L(t as i64), A::L(out as i64)],
        )?;
    }
    Ok(())
}

/// dW += dyᵀ·x, dbias += Σ dy, dx (β)= dy·W (gemm.rs `linear_backward`); 0 means absent.
#[allow(clippy::too_many_arguments)]
fn linear_backward(
    g: &G,
    x: u64,
    w: u64,
    dy: u64,
    dw: u64,
    dbias: u64,
    dx: Option<(u64, f32)>,
    t: usize,
    inp: usize,
    out: usize,
) -> Result<(), String> {
    g.gemm(out, inp, t, 1.0, mt(dy, out), m(x, inp), 1.0, dw, inp)?;
    if dbias != 0 {
        g.run(
            "col_sums",
            out,
            &[A::P(dy), A::L(t as i64), A::L(out as i64), A::P(dbias)],
        )?;
    }
    if let Some((dx, beta)) = dx {
        g.gemm(t, inp, out, 1.0, m(dy, out), m(w, inp), beta, dx, inp)?;
    }
    Ok(())
}

fn norm_code(k: Norm) -> i32 {
    match k {
        Norm::LayerNorm => 0,
        Norm::RmsNorm => 1,
    }
}

#[allow(clippy::too_many_arguments)]
fn norm_fwd(
    g: &G,
    np: &NormP,
    p: u64,
    t: usize,
    h: usize,
    x: u64,
    out: u64,
    st: u64,
) -> Result<(), String> {
    g.run_rows(
        "norm_forward",
        t,
        &[
            A::I(norm_code(np.kind)),
            A::P(x),
            A::P(at(p, &np.w)),
            A::P(opt(p, &np.b)),
            A::P(out),
            A::P(st),
            A::L(h as i64),
        ],
    )
}

/// Accumulates into dx (when non-zero) and the norm's parameter gradients in `gp`.
#[allow(clippy::too_many_arguments)]
fn norm_bwd(
    g: &G,
    np: &NormP,
    p: u64,
    t: usize,
    h: usize,
    x: u64,
    st: u64,
    dy: u64,
    dx: u64,
    gp: u64,
) -> Result<(), String> {
    g.run(
        "norm_backward_params",
        h,
        &[
            A::P(x),
            A::P(st),
            A::P(dy),
            A::P(at(gp, &np.w)),
            A::P(opt(gp, &np.b)),
            A::L(t as i64),
            A::L(h as i64),
        ],
    )?;
    if dx != 0 {
        g.run_rows(
            "norm_backward_input",
            t,
            &[
                A::I(norm_code(np.kind)),
                A::P(x),
                A::P(at(p, &np.w)),
                A::P(st),
                A::P(dy),
                A::P(dx),
                A::L(h as i64),
            ],
        )?;
    }
    Ok(())
}

/// A run of f32s on the device, by address: the [`Piece`] the shared saved-tensor layout
/// ([`crate::math::saved`]) is cut into here.
impl Piece for u64 {
    fn split(self, n: usize) -> (Self, Self) {
        (self, self + n as u64 * F)
    }
}

/// out += MLP(a), keeping the MLP's tensors in `c` (layers.rs `mlp_forward`).
fn mlp_forward(
    g: &G,
    lm: &LayerMath,
    mp: &MlpP,
    p: u64,
    a: u64,
    kept: MlpSaved<u64>,
    out: u64,
) -> Result<(), String> {
    let (t, h, f) = (lm.dims().t, mp.hidden, mp.ffn);
    let act = lm.precisions().0;
    let w1 = at(p, &mp.w1);
    let b1 = opt(p, &mp.b1);
    let mid = match kept {
        MlpSaved::Gelu { pre, post } => {
            linear(g, a, w1, b1, pre, t, h, f, 0.0)?;
            g.round(act, pre, t * f)?;
            g.run(
                "gelu_forward",
                t * f,
                &[A::P(pre), A::P(post), A::L((t * f) as i64)],
            )?;
            g.round(act, post, t * f)?;
            post
        }
        MlpSaved::SwiGlu { gate, up, prod } => {
            let (wu, bu) = mp.up.as_ref().ok_or("swiglu without an up projection")?;
            linear(g, a, w1, b1, gate, t, h, f, 0.0)?;
            linear(g, a, at(p, wu), opt(p, bu), up, t, h, f, 0.0)?;
            g.round(act, gate, t * f)?;
            g.round(act, up, t * f)?;
            g.run(
                "swiglu_forward",
                t * f,
                &[A::P(gate), A::P(up), A::P(prod), A::L((t * f) as i64)],
            )?;
            g.round(act, prod, t * f)?;
            prod
        }
    };
    linear(
        g,
        mid,
        at(p, &mp.proj),
        opt(p, &mp.proj_b),
        out,
        t,
        f,
        h,
        1.0,
    )
}

/// layers.rs `mlp_backward`: parameter gradients accumulate into `gp`; `da` is overwritten.
#[allow(clippy::too_many_arguments)]
fn mlp_backward(
    g: &G,
    lm: &LayerMath,
    mp: &MlpP,
    p: u64,
    a: u64,
    kept: MlpSaved<u64>,
    dy: u64,
    da: u64,
    gp: u64,
) -> Result<(), String> {
    let (t, h, f) = (lm.dims().t, mp.hidden, mp.ffn);
    let (s1, s2) = (g.alloc(t * f)?, g.alloc(t * f)?);
    let wp = at(p, &mp.proj);
    let (dwp, dbp) = (at(gp, &mp.proj), opt(gp, &mp.proj_b));
    let (dw1, db1) = (at(gp, &mp.w1), opt(gp, &mp.b1));
    match kept {
        MlpSaved::Gelu { pre, post } => {
            linear_backward(g, post, wp, dy, dwp, dbp, Some((s1, 0.0)), t, f, h)?;
            g.run(
                "gelu_backward",
                t * f,
                &[A::P(pre), A::P(s1), A::L((t * f) as i64)],
            )?;
            linear_backward(g, a, at(p, &mp.w1), s1, dw1, db1, Some((da, 0.0)), t, h, f)
        }
        MlpSaved::SwiGlu { gate, up, prod } => {
            linear_backward(g, prod, wp, dy, dwp, dbp, Some((s1, 0.0)), t, f, h)?;
            g.run(
                "swiglu_backward",
                t * f,
                &[
                    A::P(gate),
                    A::P(up),
                    A::P(s1),
                    A::P(s2),
                    A::L((t * f) as i64),
                ],
            )?;
            let (wu, bu) = mp.up.as_ref().ok_or("swiglu without an up projection")?;
            linear_backward(g, a, at(p, &mp.w1), s1, dw1, db1, Some((da, 0.0)), t, h, f)?;
            linear_backward(
                g,
                a,
                at(p, wu),
                s2,
                at(gp, wu),
                opt(gp, bu),
                Some((da, 1.0)),
                t,
                h,
                f,
            )
        }
    }
}

fn rope_rows(
    g: &G,
    bp: &BlockP,
    t: usize,
    s: usize,
    qkv: u64,
    inverse: bool,
) -> Result<(), String> {
    let (Some(r), Some(tables)) = (&bp.rope, g.rope) else {
        return Ok(());
    };
    let sh = &bp.shape;
    let half = r.half;
    let n = t * (sh.heads + sh.kv_heads) * half;
    g.run(
        "rope",
        n,
        &[
            A::P(qkv),
            A::P(tables),
            A::P(tables + (s * half) as u64 * F),
            A::L(t as i64),
            A::L(s as i64),
            A::L(sh.width() as i64),
            A::I(sh.heads as i32),
            A::I(sh.kv_heads as i32),
            A::I(half as i32),
            A::I(i32::from(inverse)),
        ],
    )
}

/// Offsets (in floats) in `qkv` of sequence `b`'s q for head `n`, and k and v of its kv group.
fn offsets(bp: &BlockP, b: usize, n: usize) -> (usize, usize, usize) {
    let sh = &bp.shape;
    let row = b * sh.s * sh.width();
    let grp = n / (sh.heads / sh.kv_heads);
    let k = sh.heads * sh.d + grp * sh.d;
    (row + n * sh.d, row + k, row + k + sh.kv_heads * sh.d)
}

/// attention.rs `forward`: probabilities for every (sequence, head) as [heads][s][s] blocks of
/// one sequence at a time; the query heads of one kv group share K and V (stride 0 in a
/// strided-batched product).
fn attention_forward(
    g: &G,
    bp: &BlockP,
    act: Precision,
    qkv: u64,
    out: u64,
    keep: u64,
) -> Result<(), String> {
    let sh = &bp.shape;
    let (s, w, h, d) = (sh.s, sh.width(), sh.heads * sh.d, sh.d);
    let r = sh.heads / sh.kv_heads;
    let scale = 1.0 / (d as f32).sqrt();
    let probs = g.alloc(sh.heads * s * s)?;
    let at_f = |base: u64, off: usize| base + off as u64 * F;
    for b in 0..sh.b {
        for grp in 0..sh.kv_heads {
            let n0 = grp * r;
            let (q, k, _) = offsets(bp, b, n0);
            g.batched(
                s,
                s,
                d,
                scale,
                m(at_f(qkv, q), w),
                d,
                mt(at_f(qkv, k), w),
                0,
                0.0,
                at_f(probs, n0 * s * s),
                s,
                s * s,
                r,
            )?;
        }
        let lse_ptr = match bp.attention {
            Attention::Flash => at_f(keep, b * sh.heads * s),
            Attention::Naive => 0,
        };
        let prec = match bp.attention {
            Attention::Flash => 0,
            Attention::Naive => prec_code(act),
        };
        g.run_rows(
            "causal_softmax",
            sh.heads * s,
            &[A::P(probs), A::P(lse_ptr), A::L(s as i64), A::I(prec)],
        )?;
        if bp.attention == Attention::Naive {
            g.copy(at_f(keep, b * sh.heads * s * s), probs, sh.heads * s * s)?;
        }
        for grp in 0..sh.kv_heads {
            let n0 = grp * r;
            let (_, _, v) = offsets(bp, b, n0);
            g.batched(
                s,
                d,
                s,
                1.0,
                m(at_f(probs, n0 * s * s), s),
                s * s,
                m(at_f(qkv, v), w),
                0,
                0.0,
                at_f(out, b * s * h + n0 * d),
                h,
                d,
                r,
            )?;
        }
    }
    Ok(())
}

/// attention.rs `backward`: `dqkv` is overwritten. dK and dV of a kv group sum over its query
/// heads, so those products run head by head (β = 1) rather than batched.
fn attention_backward(
    g: &G,
    bp: &BlockP,
    qkv: u64,
    kept: u64,
    dout: u64,
    dqkv: u64,
) -> Result<(), String> {
    let sh = &bp.shape;
    let (s, w, h, d) = (sh.s, sh.width(), sh.heads * sh.d, sh.d);
    let scale = 1.0 / (d as f32).sqrt();
    let at_f = |base: u64, off: usize| base + off as u64 * F;
    g.fill(dqkv, sh.b * s * w, 0.0)?;
    let p = g.alloc(s * s)?;
    let dp = g.alloc(s * s)?;
    for b in 0..sh.b {
        for n in 0..sh.heads {
            let (q, k, v) = offsets(bp, b, n);
            let bh = b * sh.heads + n;
            match bp.attention {
                Attention::Naive => g.copy(p, at_f(kept, bh * s * s), s * s)?,
                Attention::Flash => {
                    g.gemm(
                        s,
                        s,
                        d,
                        scale,
                        m(at_f(qkv, q), w),
                        mt(at_f(qkv, k), w),
                        0.0,
                        p,
                        s,
                    )?;
                    g.run(
                        "probs_from_lse",
                        s * s,
                        &[
                            A::P(p),
                            A::P(at_f(kept, bh * s)),
                            A::L(s as i64),
                            A::L(s as i64),
                        ],
                    )?;
                }
            }
            let d_o = at_f(dout, b * s * h + n * d);
            // dV += Pᵀ·dO
            g.gemm(s, d, s, 1.0, mt(p, s), m(d_o, h), 1.0, at_f(dqkv, v), w)?;
            // dP = dO·Vᵀ; dS = P ∘ (dP − rowsum(P ∘ dP)) · scale
            g.gemm(s, s, d, 1.0, m(d_o, h), mt(at_f(qkv, v), w), 0.0, dp, s)?;
            g.run_rows(
                "softmax_backward",
                s,
                &[A::P(p), A::P(dp), A::L(s as i64), A::F(scale)],
            )?;
            // dQ = dS·K; dK += dSᵀ·Q
            g.gemm(
                s,
                d,
                s,
                1.0,
                m(dp, s),
                m(at_f(qkv, k), w),
                0.0,
                at_f(dqkv, q),
                w,
            )?;
            g.gemm(
                s,
                d,
                s,
                1.0,
                mt(dp, s),
                m(at_f(qkv, q), w),
                1.0,
                at_f(dqkv, k),
                w,
            )?;
        }
    }
    Ok(())
}

/// layers.rs `forward` on the device: overwrites `out` and `saved` (f32 buffers).
pub fn forward(
    g: &G,
    lm: &LayerMath,
    p: u64,
    tied: Option<u64>,
    input: In,
    out: u64,
    saved: u64,
) -> Result<(), String> {
    let d = lm.dims();
    let (t, s) = (d.t, d.s);
    let act = lm.precisions().0;
    match lm.kind() {
        Kind::Embedding {
            hidden, wte, wpe, ..
        } => {
            let In::Tokens(tokens) = input else {
                return Err("an embedding takes tokens".into());
            };
            g.run(
                "embedding_forward",
                t * hidden,
                &[
                    A::P(tokens),
                    A::P(at(p, wte)),
                    A::P(opt(p, wpe)),
                    A::P(out),
                    A::L(t as i64),
                    A::L(*hidden as i64),
                    A::L(s as i64),
                ],
            )?;
            g.round(act, out, t * hidden)
        }
        Kind::Transformer(bp) => {
            let In::Hidden(x) = input else {
                return Err("a transformer takes hidden states".into());
            };
            transformer_forward(g, lm, bp, p, x, out, saved)
        }
        Kind::Mlp { hidden: h, ln, mlp } => {
            let In::Hidden(x) = input else {
                return Err("an mlp takes hidden states".into());
            };
            let NormedSaved { a, st, mut rest } = NormedSaved::carve(t, *h, saved);
            norm_fwd(g, ln, p, t, *h, x, a, st)?;
            g.round(act, a, t * h)?;
            g.copy(out, x, t * h)?;
            mlp_forward(g, lm, mlp, p, a, MlpSaved::carve(t, mlp, &mut rest), out)?;
            g.round(act, out, t * h)
        }
        Kind::LmHead {
            hidden: h,
            vocab,
            norm,
            weight,
        } => {
            let In::Hidden(x) = input else {
                return Err("an lm_head takes hidden states".into());
            };
            let NormedSaved { a, st, .. } = NormedSaved::carve(t, *h, saved);
            norm_fwd(g, norm, p, t, *h, x, a, st)?;
            g.round(act, a, t * h)?;
            let w = match weight {
                Some(r) => at(p, r),
                None => tied.ok_or("a tied lm_head needs the embedding")?,
            };
            linear(g, a, w, 0, out, t, *h, *vocab, 0.0)?;
            g.round(act, out, t * vocab)
        }
    }
}

fn transformer_forward(
    g: &G,
    lm: &LayerMath,
    bp: &BlockP,
    p: u64,
    x: u64,
    out: u64,
    saved: u64,
) -> Result<(), String> {
    let d = lm.dims();
    let (t, s, h) = (d.t, d.s, bp.hidden);
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
        mlp: mut c,
    } = BlockSaved::carve(bp, t, s, saved);

    norm_fwd(g, &bp.ln1, p, t, h, x, a1, st1)?;
    g.round(act, a1, t * h)?;
    linear(g, a1, at(p, &bp.qkv), opt(p, &bp.qkv_b), qkv, t, h, w, 0.0)?;
    rope_rows(g, bp, t, s, qkv, false)?;
    g.round(act, qkv, t * w)?;
    attention_forward(g, bp, act, qkv, att, keep.into_inner())?;
    g.round(act, att, t * h)?;
    g.copy(resid, x, t * h)?;
    linear(
        g,
        att,
        at(p, &bp.proj),
        opt(p, &bp.proj_b),
        resid,
        t,
        h,
        h,
        1.0,
    )?;
    g.round(act, resid, t * h)?;
    norm_fwd(g, &bp.ln2, p, t, h, resid, a2, st2)?;
    g.round(act, a2, t * h)?;
    g.copy(out, resid, t * h)?;
    mlp_forward(
        g,
        lm,
        &bp.mlp,
        p,
        a2,
        MlpSaved::carve(t, &bp.mlp, &mut c),
        out,
    )?;
    g.round(act, out, t * h)
}

/// layers.rs `backward` on the device: overwrites `gi` (when given), `gp` and `gt` (a tied
/// head's embedding gradient).
#[allow(clippy::too_many_arguments)]
pub fn backward(
    g: &G,
    lm: &LayerMath,
    p: u64,
    tied: Option<u64>,
    saved: u64,
    input: In,
    dy: u64,
    gi: Option<u64>,
    gp: u64,
    gt: Option<u64>,
) -> Result<(), String> {
    let d = lm.dims();
    let (t, s) = (d.t, d.s);
    let grad = lm.precisions().1;
    g.fill(gp, lm.params(), 0.0)?;
    match lm.kind() {
        Kind::Embedding {
            hidden, wte, wpe, ..
        } => {
            let In::Tokens(tokens) = input else {
                return Err("an embedding takes tokens".into());
            };
            g.run(
                "embedding_backward",
                *hidden,
                &[
                    A::P(tokens),
                    A::P(dy),
                    A::P(at(gp, wte)),
                    A::P(opt(gp, wpe)),
                    A::L(t as i64),
                    A::L(*hidden as i64),
                    A::L(s as i64),
                ],
            )?;
        }
        Kind::Transformer(bp) => {
            let In::Hidden(x) = input else {
                return Err("a transformer takes hidden states".into());
            };
            transformer_backward(g, lm, bp, p, saved, x, dy, gi, gp)?;
        }
        Kind::Mlp { hidden: h, ln, mlp } => {
            let In::Hidden(x) = input else {
                return Err("an mlp takes hidden states".into());
            };
            let NormedSaved { a, st, mut rest } = NormedSaved::carve(t, *h, saved);
            let da = g.alloc(t * h)?;
            let kept = MlpSaved::carve(t, mlp, &mut rest);
            mlp_backward(g, lm, mlp, p, a, kept, dy, da, gp)?;
            if let Some(gi) = gi {
                g.copy(gi, dy, t * h)?;
            }
            norm_bwd(g, ln, p, t, *h, x, st, da, gi.unwrap_or(0), gp)?;
        }
        Kind::LmHead {
            hidden: h,
            vocab,
            norm,
            weight,
        } => {
            let In::Hidden(x) = input else {
                return Err("an lm_head takes hidden states".into());
            };
            let NormedSaved { a, st, .. } = NormedSaved::carve(t, *h, saved);
            let da = g.alloc(t * h)?;
            match weight {
                Some(r) => linear_backward(
                    g,
                    a,
                    at(p, r),
                    dy,
                    at(gp, r),
                    0,
                    Some((da, 0.0)),
                    t,
                    *h,
                    *vocab,
                )?,
                None => {
                    let dw = gt.ok_or("a tied lm_head needs the embedding's gradient")?;
                    g.fill(dw, vocab * h, 0.0)?;
                    let w = tied.ok_or("a tied lm_head needs the embedding")?;
                    linear_backward(g, a, w, dy, dw, 0, Some((da, 0.0)), t, *h, *vocab)?;
                }
            }
            if let Some(gi) = gi {
                g.fill(gi, t * h, 0.0)?;
            }
            norm_bwd(g, norm, p, t, *h, x, st, da, gi.unwrap_or(0), gp)?;
        }
    }
    g.round(grad, gp, lm.params())?;
    if let Some(gi) = gi {
        g.round(grad, gi, lm.input_elements())?;
    }
    if let Some(gt) = gt {
        g.round(grad, gt, lm.tied_elements())?;
    }
    Ok(())
}

#[allow(clippy::too_many_arguments)]
fn transformer_backward(
    g: &G,
    lm: &LayerMath,
    bp: &BlockP,
    p: u64,
    saved: u64,
    x: u64,
    dy: u64,
    gi: Option<u64>,
    gp: u64,
) -> Result<(), String> {
    let d = lm.dims();
    let (t, s, h) = (d.t, d.s, bp.hidden);
    let w = bp.shape.width();
    let BlockSaved {
        a1,
        st1,
        qkv,
        att,
        keep: kept,
        resid,
        a2,
        st2,
        mlp: mut c,
    } = BlockSaved::carve(bp, t, s, saved);

    let dr = g.alloc(t * h)?;
    let da = g.alloc(t * h)?;
    let datt = g.alloc(t * h)?;
    let dqkv = g.alloc(t * w)?;

    let mlp_kept = MlpSaved::carve(t, &bp.mlp, &mut c);
    mlp_backward(g, lm, &bp.mlp, p, a2, mlp_kept, dy, da, gp)?;
    g.copy(dr, dy, t * h)?;
    norm_bwd(g, &bp.ln2, p, t, h, resid, st2, da, dr, gp)?;
    linear_backward(
        g,
        att,
        at(p, &bp.proj),
        dr,
        at(gp, &bp.proj),
        opt(gp, &bp.proj_b),
        Some((datt, 0.0)),
        t,
        h,
        h,
    )?;
    attention_backward(g, bp, qkv, kept.into_inner(), datt, dqkv)?;
    rope_rows(g, bp, t, s, dqkv, true)?;
    linear_backward(
        g,
        a1,
        at(p, &bp.qkv),
        dqkv,
        at(gp, &bp.qkv),
        opt(gp, &bp.qkv_b),
        Some((da, 0.0)),
        t,
        h,
        w,
    )?;
    if let Some(gi) = gi {
        g.copy(gi, dr, t * h)?;
    }
    norm_bwd(g, &bp.ln1, p, t, h, x, st1, da, gi.unwrap_or(0), gp)?;
    Ok(())
}
