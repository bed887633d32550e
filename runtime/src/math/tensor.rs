//! The numerics of Megatron tensor parallelism (`spec/parallel.md` §2): what rank k of a tensor
//! group of t ranks holds of a layer, the forward and backward of its slice, and the
//! vocabulary-parallel cross-entropy, on host slices, before any lowering uses them.
//!
//! **Slices** ([`SliceLayout`]). In a transformer, `attn.qkv` is column-parallel by heads: rank k
//! holds the rows of its heads/t query heads and of its kv_heads/t key and value heads (with
//! grouped-query attention, the kv heads its query heads read: kv_heads must divide by t, so a
//! kv head never straddles two ranks), in the packed order `[q | k | v]` the attention reads;
//! `attn.proj` is row-parallel (the columns of those heads). In an MLP the first product (`mlp.fc`,
//! or SwiGLU's `mlp.gate` and `mlp.up`) is column-parallel over `ffn` (rows k·ffn/t.., and their
//! biases), `mlp.proj` row-parallel (columns k·ffn/t..). Norms, row-parallel biases and learned
//! positions are replicated. The embedding's `wte` and an untied head's `weight` are split by
//! vocabulary padded to a multiple of t ([`VocabShard`]): rank k holds rows k·V'/t.. of the padded
//! table, the padding rows zeros. A slice is the tensors in the layer's order, each cut this way;
//! [`gather`] is the inverse (replicated tensors from rank 0), for checkpoints.
//!
//! **Forward and backward** ([`BlockSlice`], [`EmbeddingSlice`], [`HeadSlice`]). Each runs the
//! math primitives of [`crate::math`] on the slice's narrower operands, in the phases between
//! which Megatron all-reduces over the tensor group; the caller does the reduction. A transformer
//! has two sublayers (attention, MLP), an mlp layer one; sublayer j's forward is
//! [`BlockSlice::forward_open`] (norm, column-parallel products, local attention or activation,
//! and the row-parallel product, whose output `partial` is this rank's summand), the all-reduce of
//! `partial`, then [`BlockSlice::forward_close`] (residual + sum + bias). The backward mirrors it:
//! [`BlockSlice::backward_open`] returns this rank's summand of the gradient of the norm's output
//! (the column-parallel products' input gradient), [`BlockSlice::backward_close`] takes its
//! all-reduced sum through the norm into the residual stream's gradient. **Row-parallel biases
//! are added once, after the reduction** (Megatron's `RowParallelLinear`), by every rank alike; so
//! every rank computes the same replicated parameter gradients (norms, row-parallel biases,
//! positions), and without sequence parallelism they need no reduction over the group.
//! Partial sums are kept in fp32 and rounded to the model dtype only after the reduction, where
//! the single-rank layer rounds the same value. The embedding's forward is a lookup of the
//! tokens its shard holds (zeros for the others), all-reduced, then the positions added once; its
//! backward needs no reduction. The head's forward gives the rank's logits and needs none; its
//! backward all-reduces the norm output's gradient. Sequence parallelism is not here.
//!
//! Invariants: the phases overwrite their outputs (`partial`, `saved`, the logits) and the
//! backward's first phase zeroes the parameter gradient, which later phases accumulate into, as
//! [`LayerMath::backward`] overwrites; with t = 1 the slice is the layer and every result is
//! [`LayerMath`]'s to the bit (`tests/tensor_math.rs`). The math is the Rust math on host
//! slices (the primitives the host device calls, SwiGLU's and GELU's element-wise formulas as it
//! writes them); it does not go through `crate::device`, which depends on this module's parent.
//!
//! **Vocabulary-parallel cross-entropy** ([`vocab_max`], [`vocab_sums`], [`vocab_loss`], or
//! [`vocab_cross_entropy`] with the reductions as a closure): the logits never leave their rank;
//! the group all-reduces each row's maximum (MAX), then its sum of exponentials and the target's
//! logit (SUM). Padding columns are never read (they cannot win the softmax) and get zero
//! gradient; the loss is the sum over rows and the gradient (softmax − onehot)/rows, as
//! [`crate::math::cross_entropy`] computes them.

use super::attention::{self, Keep, Shape};
use super::gemm::{col_sums, linear, linear_backward, Product};
use super::ops::{self, norm_backward, norm_forward, NormRows, Rope};
use super::{
    norm_segments, BlockP, Dims, Kind, LayerMath, MathError, MlpP, NormP, Precision, Segment,
    Tensors,
};
use sched_ir::job::{Activation, Attention, Layer, LayerKind, Model};
pub use sched_ir::tensor::{
    gather, SliceError, SliceLayout, SliceTensor, Split, TensorRank, VocabShard,
};
use std::ops::Range;

/// Why a layer's slice numerics cannot be built.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum TensorError {
    /// The layer cannot be sliced ([`sched_ir::tensor`]'s rules).
    #[error(transparent)]
    Slice(#[from] SliceError),
    /// The full layer's math cannot be built.
    #[error(transparent)]
    Math(#[from] MathError),
}

/// Two disjoint ranges of `v`, both writable.
fn two_mut<'a>(
    v: &'a mut [f32],
    a: &Range<usize>,
    b: &Range<usize>,
) -> (&'a mut [f32], &'a mut [f32]) {
    if a.end <= b.start {
        let (x, y) = v.split_at_mut(b.start);
        (&mut x[a.clone()], &mut y[..b.len()])
    } else {
        assert!(b.end <= a.start, "two_mut: overlapping ranges");
        let (x, y) = v.split_at_mut(a.start);
        (&mut y[..a.len()], &mut x[b.clone()])
    }
}

/// The consecutive pieces of `buf` that `segs` size (writable).
fn pieces_mut<'a>(segs: &[Segment], buf: &'a mut [f32]) -> Vec<&'a mut [f32]> {
    let mut rest = buf;
    segs.iter()
        .map(|s| {
            let (head, tail) = std::mem::take(&mut rest).split_at_mut(s.elements);
            rest = tail;
            head
        })
        .collect()
}

/// The consecutive pieces of `buf` that `segs` size.
fn pieces<'a>(segs: &[Segment], buf: &'a [f32]) -> Vec<&'a [f32]> {
    let mut rest = buf;
    segs.iter()
        .map(|s| {
            let (head, tail) = rest.split_at(s.elements);
            rest = tail;
            head
        })
        .collect()
}

/// The norm `np` (width `h`, of the parameters `p`) over the rows of `x`.
fn norm_fwd(np: &NormP, h: usize, p: &[f32], x: &[f32], out: &mut [f32], stats: &mut [f32]) {
    let b = np.b.as_ref().map(|r| &p[r.clone()]);
    norm_forward(np.kind, np.eps, h, x, &p[np.w.clone()], b, out, stats);
}

/// The norm's backward from the gradient of its output `dy`: its input gradient is added to
/// `dx`, its parameter gradients to `grads`.
#[allow(clippy::too_many_arguments)]
fn norm_bwd(
    np: &NormP,
    h: usize,
    p: &[f32],
    (x, stats): (&[f32], &[f32]),
    dy: &[f32],
    dx: &mut [f32],
    grads: &mut [f32],
) {
    let rows = NormRows {
        kind: np.kind,
        h,
        x,
        w: &p[np.w.clone()],
        stats,
    };
    match &np.b {
        Some(b) => {
            let (dw, db) = two_mut(grads, &np.w, b);
            norm_backward(rows, dy, Some((dx, None)), dw, Some(db));
        }
        None => norm_backward(rows, dy, Some((dx, None)), &mut grads[np.w.clone()], None),
    }
}

/// stream += sum + bias (each row), then rounded to `act`.
fn add_reduced(stream: &mut [f32], sum: &[f32], bias: Option<&[f32]>, h: usize, act: Precision) {
    for (v, &s) in stream.iter_mut().zip(sum) {
        *v += s;
    }
    if let Some(b) = bias {
        for row in stream.chunks_exact_mut(h) {
            for (v, &bb) in row.iter_mut().zip(b) {
                *v += bb;
            }
        }
    }
    act.round(stream);
}

/// Rotates the q and k heads of every row of `qkv` (`inverse` for gradients), as the host
/// device's `rope` does.
fn rotate(rope: &Rope, sh: &Shape, qkv: &mut [f32], inverse: bool) {
    let (q, kv) = (sh.hidden(), sh.kv_heads * sh.d);
    for (i, row) in qkv.chunks_exact_mut(sh.width()).enumerate() {
        let pos = i % sh.s;
        rope.apply(&mut row[..q], sh.heads, pos, inverse);
        rope.apply(&mut row[q..q + kv], sh.kv_heads, pos, inverse);
    }
}

/// The kind-specific part of a [`BlockSlice`].
enum BlockKind {
    Transformer(Box<BlockP>),
    Mlp { ln: NormP, mlp: MlpP },
}

/// Rank k's slice of a transformer or mlp layer: its forward and backward in the phases between
/// Megatron's all-reduces (module docs). The slice's parameters are [`SliceLayout::slice`] of the
/// layer's; its saved buffer is [`BlockSlice::saved_segments`].
pub struct BlockSlice {
    name: String,
    layout: SliceLayout,
    dims: Dims,
    hidden: usize,
    act: Precision,
    grad: Precision,
    kind: BlockKind,
    segments: Vec<Segment>,
}

impl BlockSlice {
    pub fn new(layer: &Layer, model: &Model, rank: TensorRank) -> Result<Self, TensorError> {
        LayerMath::new(layer, model)?;
        let layout = SliceLayout::new(layer, rank)?;
        // The slice's shapes and saved layout are the device layer's (`LayerMath::sliced`).
        let math = LayerMath::sliced(layer, model, rank.size as u32)?;
        let dims = math.dims();
        let segments = math.saved_segments();
        let (hidden, kind) = match math.kind() {
            Kind::Transformer(bp) => (bp.hidden, BlockKind::Transformer(bp.clone())),
            Kind::Mlp { hidden, ln, mlp } => (
                *hidden,
                BlockKind::Mlp {
                    ln: ln.clone(),
                    mlp: mlp.clone(),
                },
            ),
            _ => {
                return Err(SliceError::Split {
                    layer: layer.name.clone(),
                    problem: "not a transformer or mlp layer (the embedding and the head are \
                              vocabulary-parallel: EmbeddingSlice, HeadSlice)"
                        .into(),
                }
                .into())
            }
        };
        Ok(BlockSlice {
            name: layer.name.clone(),
            layout,
            dims,
            hidden,
            act: Precision::of(model.dtype),
            grad: Precision::of(model.grad_dtype),
            kind,
            segments,
        })
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn layout(&self) -> &SliceLayout {
        &self.layout
    }

    /// Length of the slice's flat parameter vector.
    pub fn params(&self) -> usize {
        self.layout.elements()
    }

    /// The sublayers, each ending in one all-reduce of a row-parallel product (forward) and one
    /// of a column-parallel product's input gradient (backward): 2 for a transformer (attention,
    /// MLP), 1 for an mlp layer.
    pub fn sublayers(&self) -> usize {
        match self.kind {
            BlockKind::Transformer(_) => 2,
            BlockKind::Mlp { .. } => 1,
        }
    }

    /// T·hidden: the layer's input and output, every partial and every sum.
    pub fn stream_elements(&self) -> usize {
        self.dims.t * self.hidden
    }

    /// What the forward keeps, in buffer order: the full layer's segments
    /// ([`LayerMath::saved_segments`]) with this rank's widths (`attn.qkv`, `attn.out`, the
    /// attention's `lse` or `probs`, the MLP's).
    pub fn saved_segments(&self) -> Vec<Segment> {
        self.segments.clone()
    }

    pub fn saved_elements(&self) -> usize {
        self.segments.iter().map(|s| s.elements).sum()
    }

    fn check(&self, j: usize, params: &[f32], saved: usize) {
        let n = &self.name;
        assert!(j < self.sublayers(), "{n}: sublayer {j}");
        assert_eq!(params.len(), self.params(), "{n}: slice params length");
        assert_eq!(saved, self.saved_elements(), "{n}: saved length");
    }

    fn check_stream(&self, what: &str, len: usize) {
        assert_eq!(len, self.stream_elements(), "{}: {what} length", self.name);
    }

    /// Sublayer j's forward up to its row-parallel product: reads `stream`, the residual stream
    /// at the sublayer's input (the layer's input for j = 0; for j = 1 what
    /// [`BlockSlice::forward_close`] of sublayer 0 left, which it keeps as `resid`), writes the
    /// sublayer's saved tensors and overwrites `partial` [T, hidden] with this rank's summand of
    /// the row-parallel product (no bias), which the tensor group all-reduces.
    pub fn forward_open(
        &self,
        j: usize,
        params: &[f32],
        stream: &[f32],
        saved: &mut [f32],
        partial: &mut [f32],
    ) {
        self.check(j, params, saved.len());
        self.check_stream("stream", stream.len());
        self.check_stream("partial", partial.len());
        let mut sv = pieces_mut(&self.segments, saved);
        match (&self.kind, j) {
            (BlockKind::Transformer(bp), 0) => self.attention_open(bp, params, stream, sv, partial),
            (BlockKind::Transformer(bp), _) => {
                let [resid, a, st] = take3(&mut sv, 5);
                resid.copy_from_slice(stream);
                let kept = sv.split_off(8);
                self.mlp_open(&bp.mlp, &bp.ln2, params, stream, (a, st), kept, partial);
            }
            (BlockKind::Mlp { ln, mlp }, _) => {
                let kept = sv.split_off(2);
                let [a, st] = take2(&mut sv, 0);
                self.mlp_open(mlp, ln, params, stream, (a, st), kept, partial);
            }
        }
    }

    /// After the all-reduce of sublayer j's partials: `stream` += `sum` + the row-parallel
    /// product's bias (added here, once), rounded to the model dtype: the residual stream at the
    /// next sublayer's input, or the layer's output after the last.
    pub fn forward_close(&self, j: usize, params: &[f32], sum: &[f32], stream: &mut [f32]) {
        assert!(j < self.sublayers(), "{}: sublayer {j}", self.name);
        assert_eq!(params.len(), self.params(), "{}: params length", self.name);
        self.check_stream("sum", sum.len());
        self.check_stream("stream", stream.len());
        let bias = match (&self.kind, j) {
            (BlockKind::Transformer(bp), 0) => &bp.proj_b,
            (BlockKind::Transformer(bp), _) => &bp.mlp.proj_b,
            (BlockKind::Mlp { mlp, .. }, _) => &mlp.proj_b,
        };
        let bias = bias.as_ref().map(|r| &params[r.clone()]);
        add_reduced(stream, sum, bias, self.hidden, self.act);
    }

    /// Sublayer j's backward down to its column-parallel products: reads `stream_grad`, the
    /// gradient of the residual stream at the sublayer's output (the layer's output gradient for
    /// the last sublayer); accumulates the parameter gradients of the sublayer's products into
    /// `grads` (the last sublayer's, which the backward starts with, overwrites `grads` with
    /// zeros first) and overwrites `partial` [T, hidden] with this rank's summand of the gradient
    /// of the sublayer's norm output, which the tensor group all-reduces.
    pub fn backward_open(
        &self,
        j: usize,
        params: &[f32],
        saved: &[f32],
        stream_grad: &[f32],
        grads: &mut [f32],
        partial: &mut [f32],
    ) {
        self.check(j, params, saved.len());
        self.check_stream("stream_grad", stream_grad.len());
        self.check_stream("partial", partial.len());
        assert_eq!(grads.len(), self.params(), "{}: grads length", self.name);
        if j + 1 == self.sublayers() {
            grads.fill(0.0);
        }
        let sv = pieces(&self.segments, saved);
        match (&self.kind, j) {
            (BlockKind::Transformer(bp), 0) => {
                self.attention_backward_open(bp, params, &sv, stream_grad, grads, partial)
            }
            (BlockKind::Transformer(bp), _) => {
                let (a, kept) = (sv[6], &sv[8..]);
                self.mlp_backward_open(&bp.mlp, params, a, kept, stream_grad, grads, partial);
            }
            (BlockKind::Mlp { mlp, .. }, _) => {
                let (a, kept) = (sv[0], &sv[2..]);
                self.mlp_backward_open(mlp, params, a, kept, stream_grad, grads, partial);
            }
        }
    }

    /// After the all-reduce of sublayer j's partials: `sum` (the gradient of the norm's output)
    /// through the norm, added into `stream_grad`, which becomes the gradient of the residual
    /// stream at the sublayer's input; the norm's parameter gradients accumulate into `grads`.
    /// `input` is the layer's input (sublayer 0's norm reads it; later norms read `resid`). The
    /// last call (j = 0) rounds `stream_grad`, now the layer's input gradient, and `grads` to
    /// the gradient dtype, as [`LayerMath::backward`] does.
    #[allow(clippy::too_many_arguments)]
    pub fn backward_close(
        &self,
        j: usize,
        params: &[f32],
        input: &[f32],
        saved: &[f32],
        sum: &[f32],
        stream_grad: &mut [f32],
        grads: &mut [f32],
    ) {
        self.check(j, params, saved.len());
        self.check_stream("input", input.len());
        self.check_stream("sum", sum.len());
        self.check_stream("stream_grad", stream_grad.len());
        assert_eq!(grads.len(), self.params(), "{}: grads length", self.name);
        let sv = pieces(&self.segments, saved);
        let h = self.hidden;
        let (np, x, stats) = match (&self.kind, j) {
            (BlockKind::Transformer(bp), 0) => (&bp.ln1, input, sv[1]),
            (BlockKind::Transformer(bp), _) => (&bp.ln2, sv[5], sv[7]),
            (BlockKind::Mlp { ln, .. }, _) => (ln, input, sv[1]),
        };
        norm_bwd(np, h, params, (x, stats), sum, stream_grad, grads);
        if j == 0 {
            self.grad.round(stream_grad);
            self.grad.round(grads);
        }
    }

    /// The whole forward with the tensor group's all-reduce as `all_reduce` (summing a buffer
    /// in place over the group): overwrites `output` and `saved`.
    pub fn forward(
        &self,
        params: &[f32],
        input: &[f32],
        output: &mut [f32],
        saved: &mut [f32],
        all_reduce: &mut dyn FnMut(&mut [f32]),
    ) {
        self.check_stream("output", output.len());
        output.copy_from_slice(input);
        let mut partial = vec![0.0; self.stream_elements()];
        for j in 0..self.sublayers() {
            self.forward_open(j, params, output, saved, &mut partial);
            all_reduce(&mut partial);
            self.forward_close(j, params, &partial, output);
        }
    }

    /// The whole backward from `grad_output` with the group's all-reduce as `all_reduce`:
    /// overwrites `grad_input` and `grads`.
    #[allow(clippy::too_many_arguments)]
    pub fn backward(
        &self,
        params: &[f32],
        input: &[f32],
        saved: &[f32],
        grad_output: &[f32],
        grad_input: &mut [f32],
        grads: &mut [f32],
        all_reduce: &mut dyn FnMut(&mut [f32]),
    ) {
        self.check_stream("grad_input", grad_input.len());
        grad_input.copy_from_slice(grad_output);
        let mut partial = vec![0.0; self.stream_elements()];
        for j in (0..self.sublayers()).rev() {
            self.backward_open(j, params, saved, grad_input, grads, &mut partial);
            all_reduce(&mut partial);
            self.backward_close(j, params, input, saved, &partial, grad_input, grads);
        }
    }

    /// ln1, the rank's q/k/v heads, their attention and its share of the projection.
    fn attention_open(
        &self,
        bp: &BlockP,
        p: &[f32],
        x: &[f32],
        mut sv: Vec<&mut [f32]>,
        partial: &mut [f32],
    ) {
        let (t, h, act) = (self.dims.t, self.hidden, self.act);
        let sh = &bp.shape;
        let [a1, st1, qkv, att, keep] = take5(&mut sv, 0);
        norm_fwd(&bp.ln1, h, p, x, a1, st1);
        act.round(a1);
        let w = sh.width();
        let bias = bp.qkv_b.as_ref().map(|r| &p[r.clone()]);
        linear(product(a1, p, &bp.qkv, t, h, w), bias, (qkv, w), 0.0);
        if let Some(rope) = &bp.rope {
            rotate(rope, sh, qkv, false);
        }
        act.round(qkv);
        let keep = match bp.attention {
            Attention::Flash => Keep::Lse(keep),
            Attention::Naive => Keep::Probs(keep),
        };
        let mut scratch = vec![0.0; sh.scratch()];
        attention::forward(sh, qkv, att, keep, act, &mut scratch);
        act.round(att);
        let q = sh.hidden();
        linear(product(att, p, &bp.proj, t, q, h), None, (partial, h), 0.0);
    }

    /// The norm, the rank's columns of the first product(s), the activation and its share of
    /// the second product.
    #[allow(clippy::too_many_arguments)]
    fn mlp_open(
        &self,
        mp: &MlpP,
        np: &NormP,
        p: &[f32],
        x: &[f32],
        (a, st): (&mut [f32], &mut [f32]),
        mut kept: Vec<&mut [f32]>,
        partial: &mut [f32],
    ) {
        let (t, h, f, act) = (self.dims.t, self.hidden, mp.ffn, self.act);
        norm_fwd(np, h, p, x, a, st);
        act.round(a);
        let b1 = mp.b1.as_ref().map(|r| &p[r.clone()]);
        let mid: &[f32] = match mp.act {
            Activation::Gelu => {
                let [pre, post] = take2(&mut kept, 0);
                linear(product(a, p, &mp.w1, t, h, f), b1, (pre, f), 0.0);
                act.round(pre);
                for (y, &v) in post.iter_mut().zip(pre.iter()) {
                    *y = ops::gelu(v);
                }
                act.round(post);
                post
            }
            Activation::SwiGlu => {
                let [gate, up, prod] = take3(&mut kept, 0);
                let (wu, bu) = mp.up.as_ref().expect("swiglu has an up projection");
                let bu = bu.as_ref().map(|r| &p[r.clone()]);
                linear(product(a, p, &mp.w1, t, h, f), b1, (gate, f), 0.0);
                linear(product(a, p, wu, t, h, f), bu, (up, f), 0.0);
                act.round(gate);
                act.round(up);
                for ((y, &g), &u) in prod.iter_mut().zip(gate.iter()).zip(up.iter()) {
                    *y = g * ops::sigmoid(g) * u;
                }
                act.round(prod);
                prod
            }
        };
        linear(product(mid, p, &mp.proj, t, f, h), None, (partial, h), 0.0);
    }

    /// The MLP's backward from the gradient `dy` of its output: its products' parameter
    /// gradients into `grads`, the rank's summand of its input's gradient into `partial`.
    #[allow(clippy::too_many_arguments)]
    fn mlp_backward_open(
        &self,
        mp: &MlpP,
        p: &[f32],
        a: &[f32],
        kept: &[&[f32]],
        dy: &[f32],
        grads: &mut [f32],
        partial: &mut [f32],
    ) {
        let (t, h, f) = (self.dims.t, self.hidden, mp.ffn);
        let mut dmid = vec![0.0; t * f];
        let mid = match mp.act {
            Activation::Gelu => kept[1],
            Activation::SwiGlu => kept[2],
        };
        let from_ffn = product(mid, p, &mp.proj, t, f, h);
        linear_backward(from_ffn, (dy, h), &mut grads[mp.proj.clone()], None, None);
        gemm_dx(from_ffn, dy, &mut dmid, 0.0);
        if let Some(b) = &mp.proj_b {
            col_sums(dy, (h, h), &mut grads[b.clone()]);
        }
        let into_ffn = |w: &Range<usize>| product(a, p, w, t, h, f);
        match mp.act {
            Activation::Gelu => {
                for (d, &x) in dmid.iter_mut().zip(kept[0]) {
                    *d *= ops::gelu_grad(x);
                }
                product_backward(into_ffn(&mp.w1), &dmid, grads, (&mp.w1, &mp.b1));
                gemm_dx(into_ffn(&mp.w1), &dmid, partial, 0.0);
            }
            Activation::SwiGlu => {
                let (gate, up) = (kept[0], kept[1]);
                let mut dup = vec![0.0; t * f];
                for (((dg, du), &x), &u) in dmid.iter_mut().zip(&mut dup).zip(gate).zip(up) {
                    let sg = ops::sigmoid(x);
                    let dprod = *dg;
                    *du = dprod * x * sg;
                    *dg = dprod * u * sg * (1.0 + x * (1.0 - sg));
                }
                let (wu, bu) = mp.up.as_ref().expect("swiglu has an up projection");
                product_backward(into_ffn(&mp.w1), &dmid, grads, (&mp.w1, &mp.b1));
                product_backward(into_ffn(wu), &dup, grads, (wu, bu));
                gemm_dx(into_ffn(&mp.w1), &dmid, partial, 0.0);
                gemm_dx(into_ffn(wu), &dup, partial, 1.0);
            }
        }
    }

    /// The attention sublayer's backward from the residual stream's gradient `dr`: the
    /// projection's, the local attention's and the qkv product's parameter gradients, and the
    /// rank's summand of ln1's output gradient into `partial`.
    fn attention_backward_open(
        &self,
        bp: &BlockP,
        p: &[f32],
        sv: &[&[f32]],
        dr: &[f32],
        grads: &mut [f32],
        partial: &mut [f32],
    ) {
        let (t, h) = (self.dims.t, self.hidden);
        let sh = &bp.shape;
        let (q, w) = (sh.hidden(), sh.width());
        let (a1, qkv, att, keep) = (sv[0], sv[2], sv[3], sv[4]);
        let proj = product(att, p, &bp.proj, t, q, h);
        let mut datt = vec![0.0; t * q];
        product_backward(proj, dr, grads, (&bp.proj, &None));
        gemm_dx(proj, dr, &mut datt, 0.0);
        if let Some(b) = &bp.proj_b {
            col_sums(dr, (h, h), &mut grads[b.clone()]);
        }
        let keep = match bp.attention {
            Attention::Flash => Keep::Lse(keep),
            Attention::Naive => Keep::Probs(keep),
        };
        let mut dqkv = vec![0.0; t * w];
        let mut scratch = vec![0.0; 2 * sh.scratch()];
        attention::backward(sh, qkv, keep, &datt, &mut dqkv, &mut scratch);
        if let Some(rope) = &bp.rope {
            rotate(rope, sh, &mut dqkv, true);
        }
        let qkv_product = product(a1, p, &bp.qkv, t, h, w);
        product_backward(qkv_product, &dqkv, grads, (&bp.qkv, &bp.qkv_b));
        gemm_dx(qkv_product, &dqkv, partial, 0.0);
    }
}

/// The product of `x` [t, inp] with the weight at `w` ([out, inp]) of the parameters `p`.
fn product<'a>(
    x: &'a [f32],
    p: &'a [f32],
    w: &Range<usize>,
    t: usize,
    inp: usize,
    out: usize,
) -> Product<'a> {
    Product {
        x,
        w: &p[w.clone()],
        t,
        inp,
        out,
    }
}

/// A product's weight gradient (and its bias's, when it has one) from its output gradient `dy`
/// [t, out], accumulated into `grads` at the weight's and bias's ranges.
fn product_backward(
    pr: Product<'_>,
    dy: &[f32],
    grads: &mut [f32],
    (w, b): (&Range<usize>, &Option<Range<usize>>),
) {
    linear_backward(pr, (dy, pr.out), &mut grads[w.clone()], None, None);
    if let Some(b) = b {
        col_sums(dy, (pr.out, pr.out), &mut grads[b.clone()]);
    }
}

/// dx (β)= dy·W, the product's input gradient.
fn gemm_dx(pr: Product<'_>, dy: &[f32], dx: &mut [f32], beta: f32) {
    super::gemm::linear_backward_input(pr, (dy, pr.out), (dx, beta));
}

fn take2<'a>(v: &mut [&'a mut [f32]], at: usize) -> [&'a mut [f32]; 2] {
    [0, 1].map(|i| std::mem::take(&mut v[at + i]))
}

fn take3<'a>(v: &mut [&'a mut [f32]], at: usize) -> [&'a mut [f32]; 3] {
    [0, 1, 2].map(|i| std::mem::take(&mut v[at + i]))
}

fn take5<'a>(v: &mut [&'a mut [f32]], at: usize) -> [&'a mut [f32]; 5] {
    [0, 1, 2, 3, 4].map(|i| std::mem::take(&mut v[at + i]))
}

/// Rank k's slice of the embedding, split by vocabulary: its forward is a lookup of the tokens
/// in its rows (zeros for the others'), all-reduced, then the positions added once.
pub struct EmbeddingSlice {
    name: String,
    layout: SliceLayout,
    shard: VocabShard,
    dims: Dims,
    hidden: usize,
    act: Precision,
    grad: Precision,
    wte: Range<usize>,
    wpe: Option<Range<usize>>,
}

impl EmbeddingSlice {
    pub fn new(layer: &Layer, model: &Model, rank: TensorRank) -> Result<Self, TensorError> {
        LayerMath::new(layer, model)?;
        let LayerKind::Embedding { hidden, vocab, .. } = layer.kind else {
            return Err(SliceError::Split {
                layer: layer.name.clone(),
                problem: "not an embedding".into(),
            }
            .into());
        };
        let layout = SliceLayout::new(layer, rank)?;
        let narrow = layout.narrow(layer);
        let ts = Tensors {
            layer: &narrow,
            eps: model.norm_eps(),
        };
        let (h, s) = (hidden as usize, model.seq_len as usize);
        let shard = VocabShard::new(vocab as usize, rank);
        Ok(EmbeddingSlice {
            name: layer.name.clone(),
            wte: ts.get("wte", &[shard.width, h])?,
            wpe: ts.find("wpe").map(|(r, _)| r),
            layout,
            shard,
            dims: Dims {
                s,
                t: model.micro_batch as usize * s,
            },
            hidden: h,
            act: Precision::of(model.dtype),
            grad: Precision::of(model.grad_dtype),
        })
    }

    pub fn layout(&self) -> &SliceLayout {
        &self.layout
    }

    pub fn shard(&self) -> VocabShard {
        self.shard
    }

    pub fn params(&self) -> usize {
        self.layout.elements()
    }

    /// Where the rank's `wte` rows sit in the slice (a tied head's weight).
    pub fn wte(&self) -> Range<usize> {
        self.wte.clone()
    }

    /// T·hidden: the output, the partial and the sum.
    pub fn output_elements(&self) -> usize {
        self.dims.t * self.hidden
    }

    fn check(&self, params: &[f32], tokens: &[u32], out: usize) {
        let n = &self.name;
        assert_eq!(params.len(), self.params(), "{n}: slice params length");
        assert_eq!(tokens.len(), self.dims.t, "{n}: token count");
        assert_eq!(out, self.output_elements(), "{n}: output length");
    }

    /// Overwrites `partial` [T, hidden] with the rows of the tokens this rank's shard holds and
    /// zeros for the others; the group all-reduces it. Panics on a token past the vocabulary.
    pub fn forward_open(&self, params: &[f32], tokens: &[u32], partial: &mut [f32]) {
        self.check(params, tokens, partial.len());
        let (h, words) = (self.hidden, self.shard.words());
        let wte = &params[self.wte.clone()];
        for (&tok, row) in tokens.iter().zip(partial.chunks_exact_mut(h)) {
            let tok = tok as usize;
            assert!(tok < self.shard.vocab, "{}: token {tok}", self.name);
            if words.contains(&tok) {
                let r = tok - self.shard.start;
                row.copy_from_slice(&wte[r * h..(r + 1) * h]);
            } else {
                row.fill(0.0);
            }
        }
    }

    /// `output` = `sum` + the learned positions (replicated, added once after the reduction),
    /// rounded to the model dtype.
    pub fn forward_close(&self, params: &[f32], sum: &[f32], output: &mut [f32]) {
        assert_eq!(params.len(), self.params(), "{}: params length", self.name);
        assert_eq!(
            sum.len(),
            self.output_elements(),
            "{}: sum length",
            self.name
        );
        output.copy_from_slice(sum);
        if let Some(wpe) = &self.wpe {
            let (h, s) = (self.hidden, self.dims.s);
            let wpe = &params[wpe.clone()];
            for (i, row) in output.chunks_exact_mut(h).enumerate() {
                let pos = &wpe[(i % s) * h..(i % s + 1) * h];
                row.iter_mut().zip(pos).for_each(|(y, &v)| *y += v);
            }
        }
        self.act.round(output);
    }

    /// The slice's parameter gradient from the output gradient `dy` (the same on every rank):
    /// overwrites `grads` with the gradients of the rank's `wte` rows (padding rows zero) and of
    /// the whole `wpe` (the same on every rank). No reduction.
    pub fn backward(&self, tokens: &[u32], dy: &[f32], grads: &mut [f32]) {
        assert_eq!(tokens.len(), self.dims.t, "{}: token count", self.name);
        assert_eq!(dy.len(), self.output_elements(), "{}: dy length", self.name);
        assert_eq!(grads.len(), self.params(), "{}: grads length", self.name);
        grads.fill(0.0);
        let (h, s, words) = (self.hidden, self.dims.s, self.shard.words());
        for (i, (&tok, row)) in tokens.iter().zip(dy.chunks_exact(h)).enumerate() {
            let tok = tok as usize;
            if words.contains(&tok) {
                let at = self.wte.start + (tok - self.shard.start) * h;
                let d = &mut grads[at..at + h];
                d.iter_mut().zip(row).for_each(|(a, &v)| *a += v);
            }
            if let Some(wpe) = &self.wpe {
                let at = wpe.start + (i % s) * h;
                let d = &mut grads[at..at + h];
                d.iter_mut().zip(row).for_each(|(a, &v)| *a += v);
            }
        }
        self.grad.round(grads);
    }
}

/// Rank k's slice of the lm_head, split by vocabulary: the norm (replicated), then the rank's
/// rows of the head's weight (or of the embedding's `wte` for a tied head: its
/// [`EmbeddingSlice::wte`]), giving the rank's logits [T, width] that the vocabulary-parallel
/// cross-entropy reads; the backward all-reduces the norm output's gradient.
pub struct HeadSlice {
    name: String,
    layout: SliceLayout,
    shard: VocabShard,
    dims: Dims,
    hidden: usize,
    act: Precision,
    grad: Precision,
    norm: NormP,
    weight: Option<Range<usize>>,
    segments: Vec<Segment>,
}

impl HeadSlice {
    pub fn new(layer: &Layer, model: &Model, rank: TensorRank) -> Result<Self, TensorError> {
        LayerMath::new(layer, model)?;
        let LayerKind::LmHead {
            hidden,
            vocab,
            norm,
            tied,
        } = layer.kind
        else {
            return Err(SliceError::Split {
                layer: layer.name.clone(),
                problem: "not an lm_head".into(),
            }
            .into());
        };
        let layout = SliceLayout::new(layer, rank)?;
        let narrow = layout.narrow(layer);
        let ts = Tensors {
            layer: &narrow,
            eps: model.norm_eps(),
        };
        let h = hidden as usize;
        let shard = VocabShard::new(vocab as usize, rank);
        let s = model.seq_len as usize;
        let dims = Dims {
            s,
            t: model.micro_batch as usize * s,
        };
        Ok(HeadSlice {
            name: layer.name.clone(),
            norm: ts.norm("norm", norm, h)?,
            weight: ts.opt("weight", &[shard.width, h], !tied)?,
            layout,
            shard,
            dims,
            hidden: h,
            act: Precision::of(model.dtype),
            grad: Precision::of(model.grad_dtype),
            segments: norm_segments("norm.out", "norm.stats", dims, h).to_vec(),
        })
    }

    pub fn layout(&self) -> &SliceLayout {
        &self.layout
    }

    pub fn shard(&self) -> VocabShard {
        self.shard
    }

    pub fn params(&self) -> usize {
        self.layout.elements()
    }

    pub fn is_tied(&self) -> bool {
        self.weight.is_none()
    }

    /// Elements of the rank's rows of the tied `wte` (width·hidden) for a tied head, else 0.
    pub fn tied_elements(&self) -> usize {
        if self.is_tied() {
            self.shard.width * self.hidden
        } else {
            0
        }
    }

    /// T·width: the rank's logits, rows `width` apart.
    pub fn logits_elements(&self) -> usize {
        self.dims.t * self.shard.width
    }

    /// T·hidden: the input, its gradient, the partial and the sum.
    pub fn input_elements(&self) -> usize {
        self.dims.t * self.hidden
    }

    pub fn saved_segments(&self) -> Vec<Segment> {
        self.segments.clone()
    }

    pub fn saved_elements(&self) -> usize {
        2 * self.dims.t + self.input_elements()
    }

    fn weight<'a>(&self, params: &'a [f32], tied: Option<&'a [f32]>) -> &'a [f32] {
        match &self.weight {
            Some(r) => {
                assert!(
                    tied.is_none(),
                    "{}: untied head given a tied wte",
                    self.name
                );
                &params[r.clone()]
            }
            None => {
                let w = tied.unwrap_or_else(|| panic!("{}: a tied head needs wte", self.name));
                assert_eq!(w.len(), self.tied_elements(), "{}: tied length", self.name);
                w
            }
        }
    }

    /// The norm of `input` (kept in `saved`), then the rank's logits [T, width] (overwritten;
    /// the padding columns hold the zero padding rows' products, which the cross-entropy never
    /// reads), rounded to the model dtype. No reduction.
    pub fn forward(
        &self,
        params: &[f32],
        tied: Option<&[f32]>,
        input: &[f32],
        saved: &mut [f32],
        logits: &mut [f32],
    ) {
        let n = &self.name;
        assert_eq!(params.len(), self.params(), "{n}: params length");
        assert_eq!(input.len(), self.input_elements(), "{n}: input length");
        assert_eq!(saved.len(), self.saved_elements(), "{n}: saved length");
        assert_eq!(logits.len(), self.logits_elements(), "{n}: logits length");
        let (t, h, v) = (self.dims.t, self.hidden, self.shard.width);
        let w = self.weight(params, tied);
        let (a, st) = saved.split_at_mut(t * h);
        norm_fwd(&self.norm, h, params, input, a, st);
        self.act.round(a);
        let pr = Product {
            x: a,
            w,
            t,
            inp: h,
            out: v,
        };
        linear(pr, None, (logits, v), 0.0);
        self.act.round(logits);
    }

    /// From the gradient of the rank's logits `dlogits` [T, width] (the vocabulary-parallel
    /// cross-entropy's): overwrites `grads` (zeros but for the weight's) and, for a tied head,
    /// `grad_tied` (the rank's `wte` rows) with the product's weight gradient, and `partial`
    /// [T, hidden] with the rank's summand of the norm output's gradient, which the group
    /// all-reduces.
    #[allow(clippy::too_many_arguments)]
    pub fn backward_open(
        &self,
        params: &[f32],
        tied: Option<&[f32]>,
        saved: &[f32],
        dlogits: &[f32],
        grads: &mut [f32],
        grad_tied: Option<&mut [f32]>,
        partial: &mut [f32],
    ) {
        let n = &self.name;
        assert_eq!(saved.len(), self.saved_elements(), "{n}: saved length");
        assert_eq!(dlogits.len(), self.logits_elements(), "{n}: dlogits length");
        assert_eq!(grads.len(), self.params(), "{n}: grads length");
        assert_eq!(partial.len(), self.input_elements(), "{n}: partial length");
        let (t, h, v) = (self.dims.t, self.hidden, self.shard.width);
        let w = self.weight(params, tied);
        let pr = Product {
            x: &saved[..t * h],
            w,
            t,
            inp: h,
            out: v,
        };
        grads.fill(0.0);
        let dw = match (&self.weight, grad_tied) {
            (Some(r), None) => &mut grads[r.clone()],
            (None, Some(g)) => {
                assert_eq!(g.len(), self.tied_elements(), "{n}: grad_tied length");
                g.fill(0.0);
                g
            }
            _ => panic!("{n}: grad_tied must be given exactly for a tied head"),
        };
        linear_backward(pr, (dlogits, v), dw, None, None);
        self.grad.round(dw);
        gemm_dx(pr, dlogits, partial, 0.0);
    }

    /// After the all-reduce: `sum` (the norm output's gradient) through the norm into
    /// `grad_input` (overwritten) and the norm's parameter gradients into `grads`, both rounded
    /// to the gradient dtype.
    pub fn backward_close(
        &self,
        params: &[f32],
        input: &[f32],
        saved: &[f32],
        sum: &[f32],
        grads: &mut [f32],
        grad_input: &mut [f32],
    ) {
        let n = &self.name;
        assert_eq!(params.len(), self.params(), "{n}: params length");
        assert_eq!(saved.len(), self.saved_elements(), "{n}: saved length");
        assert_eq!(grads.len(), self.params(), "{n}: grads length");
        assert_eq!(input.len(), self.input_elements(), "{n}: input length");
        assert_eq!(sum.len(), self.input_elements(), "{n}: sum length");
        assert_eq!(
            grad_input.len(),
            self.input_elements(),
            "{n}: grad_input length"
        );
        let t = self.dims.t;
        let stats = &saved[t * self.hidden..];
        grad_input.fill(0.0);
        norm_bwd(
            &self.norm,
            self.hidden,
            params,
            (input, stats),
            sum,
            grad_input,
            grads,
        );
        self.grad.round(grad_input);
        self.grad.round(grads);
    }
}

/// The reduction an all-reduce over the tensor group applies.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reduce {
    Max,
    Sum,
}

fn check_logits(logits: &[f32], stride: usize, shard: &VocabShard, rows: usize) {
    assert!(
        shard.width <= stride,
        "vocab-parallel cross-entropy: rows narrower than the shard"
    );
    assert_eq!(
        logits.len(),
        rows * stride,
        "vocab-parallel cross-entropy: logits length"
    );
}

/// The rank's real columns of row `i` (padding left out).
fn words_of<'a>(logits: &'a [f32], stride: usize, shard: &VocabShard, i: usize) -> &'a [f32] {
    &logits[i * stride..i * stride + shard.columns()]
}

/// Phase 1 of the vocabulary-parallel cross-entropy: `max` (one per row) is overwritten with
/// each row's maximum over the shard's real columns (−∞ for a shard of padding only); the group
/// all-reduces it with [`Reduce::Max`]. `logits` are the rank's [rows, width] in rows `stride`
/// apart.
pub fn vocab_max(logits: &[f32], stride: usize, shard: &VocabShard, max: &mut [f32]) {
    check_logits(logits, stride, shard, max.len());
    for (i, m) in max.iter_mut().enumerate() {
        let row = words_of(logits, stride, shard, i);
        *m = row.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x));
    }
}

/// Phase 2, from the group's row maxima `max`: `sums` (2·rows) is overwritten with each row's
/// Σ exp(x − max) over the shard's real columns (first rows values), then each row's target
/// logit where the shard holds the target and 0 elsewhere (next rows); the group all-reduces it
/// with [`Reduce::Sum`]. Panics on a target past the vocabulary.
pub fn vocab_sums(
    logits: &[f32],
    stride: usize,
    shard: &VocabShard,
    targets: &[u32],
    max: &[f32],
    sums: &mut [f32],
) {
    let n = targets.len();
    check_logits(logits, stride, shard, n);
    assert_eq!(max.len(), n, "vocab-parallel cross-entropy: max length");
    assert_eq!(
        sums.len(),
        2 * n,
        "vocab-parallel cross-entropy: sums length"
    );
    let words = shard.words();
    let (exp_sums, target_logits) = sums.split_at_mut(n);
    for (i, &target) in targets.iter().enumerate() {
        let target = target as usize;
        assert!(
            target < shard.vocab,
            "vocab-parallel cross-entropy: target {target} not below vocab {}",
            shard.vocab
        );
        let row = words_of(logits, stride, shard, i);
        exp_sums[i] = ops::wide(|| ops::sum_exp(row, max[i]));
        target_logits[i] = if words.contains(&target) {
            row[target - shard.start]
        } else {
            0.0
        };
    }
}

/// Phase 3, from the group's maxima and sums: returns the SUM over rows of log Σ exp − the
/// target logit (the same on every rank, as [`crate::math::cross_entropy`] returns it), and
/// overwrites `grad` (the logits' layout) with (softmax − onehot)/rows in the shard's real
/// columns and zeros in its padding columns (columns past `width` are left alone).
pub fn vocab_loss(
    logits: &[f32],
    stride: usize,
    shard: &VocabShard,
    targets: &[u32],
    max: &[f32],
    sums: &[f32],
    grad: &mut [f32],
) -> f64 {
    let n = targets.len();
    check_logits(logits, stride, shard, n);
    assert_eq!(
        grad.len(),
        logits.len(),
        "vocab-parallel cross-entropy: grad"
    );
    assert_eq!(max.len(), n, "vocab-parallel cross-entropy: max length");
    assert_eq!(
        sums.len(),
        2 * n,
        "vocab-parallel cross-entropy: sums length"
    );
    let inv = 1.0 / n as f32;
    let (cols, words) = (shard.columns(), shard.words());
    let mut total = 0f64;
    for (i, &target) in targets.iter().enumerate() {
        let lse = max[i] + sums[i].ln();
        total += f64::from(lse - sums[n + i]);
        let row = words_of(logits, stride, shard, i);
        let g = &mut grad[i * stride..i * stride + shard.width];
        for (g, &x) in g.iter_mut().zip(row) {
            *g = ops::exp(x - lse) * inv;
        }
        g[cols..].fill(0.0);
        let target = target as usize;
        if words.contains(&target) {
            g[target - shard.start] -= inv;
        }
    }
    total
}

/// The three phases of the vocabulary-parallel cross-entropy on rank `shard`'s logits with
/// the tensor group's all-reduce as `all_reduce` (in place): the loss sum and the gradient of
/// [`vocab_loss`].
pub fn vocab_cross_entropy(
    logits: &[f32],
    stride: usize,
    shard: &VocabShard,
    targets: &[u32],
    grad: &mut [f32],
    all_reduce: &mut dyn FnMut(Reduce, &mut [f32]),
) -> f64 {
    let n = targets.len();
    let mut max = vec![0.0; n];
    vocab_max(logits, stride, shard, &mut max);
    all_reduce(Reduce::Max, &mut max);
    let mut sums = vec![0.0; 2 * n];
    vocab_sums(logits, stride, shard, targets, &max, &mut sums);
    all_reduce(Reduce::Sum, &mut sums);
    vocab_loss(logits, stride, shard, targets, &max, &sums, grad)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shards_pad_the_vocabulary() {
        let s = |v, size, index| VocabShard::new(v, TensorRank { size, index });
        assert_eq!((s(259, 2, 1).width, s(259, 2, 1).start), (130, 130));
        assert_eq!(s(259, 2, 1).columns(), 129);
        assert_eq!(s(259, 4, 3).words(), 195..259);
        assert_eq!(s(259, 4, 3).padded(), 260);
        assert_eq!(s(3, 4, 3).columns(), 0);
        assert_eq!(s(3, 4, 0).padded(), 4);
        assert_eq!(s(256, 1, 0).columns(), 256);
    }

    #[test]
    fn two_mut_either_order() {
        let mut v: Vec<f32> = (0..6).map(|i| i as f32).collect();
        let (a, b) = two_mut(&mut v, &(4..6), &(0..2));
        assert_eq!((a[0], b[1]), (4.0, 1.0));
    }
}
