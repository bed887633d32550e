//! The ABI: every constant and size the compiler and the runtime must agree on.
//!
//! The compiler sizes buffers and workspaces with these figures; the runtime lays its tensors out
//! by the same ones and never recomputes what the plan decided. A change here changes both
//! sides at once, so a plan written by one `schedc` runs on the `schedrun` built beside it.
//!
//! - alignment: [`GEMM_ALIGN`] (a stream workspace's GEMM part), [`LOGITS_ROW_ALIGN`] and
//!   [`logits_stride`] (the rows of an lm_head's logits), [`PADDED_ROWS`] (the column blocks of
//!   a product over an unaligned width);
//! - chunking: [`attention_chunk`] (the fused attention's query rows per chunk), [`SUMSQ_CHUNK`]
//!   (the gradient norm's partial sums);
//! - tensor sizes: [`output_elements`], [`input_elements`] and the activations a layer saves for
//!   its backward ([`saved_elements`], [`saved_bytes`]).
//!
//! Activation sizes: with T = micro_batch × seq_len tokens, h hidden, f ffn, n heads, kv the
//! key/value width and d the model dtype's bytes, a transformer keeps: ln1's output (T·h·d) and
//! its per-token statistics (2·T fp32), the q/k/v projection (T·(h+2kv)·d), the attention output
//! before its projection (T·h·d) plus either each row's log-sum-exp (flash: n·T fp32) or the
//! probabilities (naive: n·T·s·d), the residual stream after attention (T·h·d), ln2's output and
//! statistics, and the MLP's pre- and post-activation tensors (gelu: 2·T·f·d; swiglu: gate, up
//! and their product, 3·T·f·d). The layer's input and output are hidden-state buffers of their
//! own, not counted here. These are the runtime's real saved tensors for zoo layers, so the
//! memory plan is exact for them; `dense` layers declare theirs per token.

use crate::job::{Activation, Attention, LayerKind, Model};

/// Elements per partial sum of the gradient norm's sum of squares (the kernel catalogue's
/// `Op::SumSquares`; the compiler sizes its workspace with it).
pub const SUMSQ_CHUNK: usize = 4096;

/// Tokens of one micro-batch.
pub fn tokens(model: &Model) -> u64 {
    model.micro_batch * model.seq_len
}

/// Alignment of the GEMM part's end (where the fp32 scratch starts): what cuBLAS wants of a
/// workspace pointer, and the memory plan's buffer alignment.
pub const GEMM_ALIGN: u64 = 256;

/// Elements a row of the logits starts after in any storage: 16 bytes of bf16.
pub const LOGITS_ROW_ALIGN: u64 = 8;

/// Elements between two rows of an lm_head's logits (and of their gradient): the vocabulary
/// rounded up to [`LOGITS_ROW_ALIGN`], so that every row starts 16 bytes aligned. The GPU's
/// tensor-core products read and write a matrix in place only at such a row stride; GPT-2's
/// 50,257 words would otherwise send the head's three products through workspace a column
/// block at a time. The columns past the vocabulary are never read or written.
pub fn logits_stride(vocab: u64) -> u64 {
    vocab.next_multiple_of(LOGITS_ROW_ALIGN)
}

/// Elements of the hidden state layer `kind` outputs (the logits for an lm_head, rows
/// [`logits_stride`] apart).
pub fn output_elements(kind: &LayerKind, model: &Model) -> u64 {
    let t = tokens(model);
    match *kind {
        LayerKind::LmHead { vocab, .. } => t * logits_stride(vocab),
        _ => kind.hidden().map_or(0, |h| t * h),
    }
}

/// Elements of layer `kind`'s input: token ids for the embedding, a hidden state otherwise.
pub fn input_elements(kind: &LayerKind, model: &Model) -> u64 {
    let t = tokens(model);
    match *kind {
        LayerKind::Embedding { .. } => t,
        _ => kind.hidden().map_or(0, |h| t * h),
    }
}

/// Score floats of one attention chunk at most (64 MiB of fp32): the fused path's workspace
/// is a few chunks, whatever the sequence length.
pub const ATTENTION_CHUNK_FLOATS: u64 = 1 << 24;

/// Query rows per chunk of the fused attention on a GPU with `heads` query heads and sequences
/// of `seq_len`: the whole sequence when its `heads × seq_len × seq_len` scores fit
/// [`ATTENTION_CHUNK_FLOATS`], else the most multiples of 64 rows that do (at least 64). A chunk
/// of rows `q0..q1` holds the scores of keys `0..q1` of every head.
pub fn attention_chunk(heads: u64, seq_len: u64) -> u64 {
    let rows = ATTENTION_CHUNK_FLOATS / (heads * seq_len).max(1);
    if rows >= seq_len {
        seq_len
    } else {
        (rows / 64 * 64).max(64).min(seq_len)
    }
}

/// The size of an unaligned product's workspace block, in padded rows (see [`padded_rows`]).
pub const PADDED_ROWS: usize = 1024;

/// Floats for a product whose output width among `widths` is not a multiple of 8 (an MLP's
/// odd width; never a head's, whose logits lie in aligned rows, [`logits_stride`]): no
/// tensor-core product reads or writes its rows in place (`aligned_ld`
/// in the CUDA device), so its output (forward) or output gradient (backward) goes through
/// workspace a block of columns at a time, as many elements as [`PADDED_ROWS`] rows of w₈ (the
/// width rounded up to 8) hold and at most min(T, rows)·w₈, in fp32 at most and, for a 16-bit
/// model's fp32 gradient, cast to the product dtype; the last block's weight rows, padded with
/// zero rows, take at most w₈·inputs: 1.5·min(T, rows)·w₈ + w₈·inputs, for the widest such
/// product.
pub fn padded_rows(tokens: u64, widths: &[u64], inputs: u64) -> u64 {
    let widest = widths.iter().filter(|&&w| w % 8 != 0).max();
    widest.map_or(0, |&w| {
        let w8 = w.next_multiple_of(8);
        3 * tokens.min(PADDED_ROWS as u64) * w8 / 2 + w8 * inputs
    })
}

/// Bytes layer `kind` keeps for backward in one micro-step.
pub fn saved_bytes(kind: &LayerKind, model: &Model) -> u64 {
    match *kind {
        LayerKind::Dense {
            activation_bytes_per_token,
            ..
        } => activation_bytes_per_token * tokens(model),
        _ => {
            let e = saved_elements(kind, model);
            e.model * model.dtype.bytes() + e.fp32 * 4
        }
    }
}

/// Bytes one rank's tensor-parallel slice of layer `kind` over `t` ranks keeps for backward in
/// one micro-step (what the device layer's sliced math saves): the norms' outputs and
/// statistics and the residual stream between sublayers whole, the products', the attention's
/// and the MLP's a t-th (Megatron splits them by heads and `ffn`). A layer the lowering runs
/// whole (or t = 1) keeps [`saved_bytes`].
pub fn slice_saved_bytes(kind: &LayerKind, model: &Model, t: u32) -> u64 {
    let whole = saved_elements(kind, model);
    let tokens = tokens(model);
    let (t, d) = (u64::from(t.max(1)), model.dtype.bytes());
    // The replicated parts, in the model dtype and fp32.
    let (model_part, fp32_part) = match *kind {
        _ if !crate::tensor::split_layers(kind, t as u32) => return saved_bytes(kind, model),
        LayerKind::Transformer(tr) => (3 * tokens * tr.hidden, 4 * tokens),
        LayerKind::Mlp(m) => (tokens * m.hidden, 2 * tokens),
        _ => return saved_bytes(kind, model),
    };
    (model_part + (whole.model - model_part) / t) * d
        + (fp32_part + (whole.fp32 - fp32_part) / t) * 4
}

/// Elements a zoo layer keeps for backward in one micro-step: those stored in the model dtype
/// and the fp32 statistics (norms' per-token pairs, flash attention's log-sum-exps). Zero for
/// `dense` layers, which declare bytes only.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SavedElements {
    pub model: u64,
    pub fp32: u64,
}

impl SavedElements {
    pub fn total(self) -> u64 {
        self.model + self.fp32
    }
}

/// The saved elements of layer `kind` (see the module doc for the list).
pub fn saved_elements(kind: &LayerKind, model: &Model) -> SavedElements {
    let t = tokens(model);
    let norm = |h: u64| SavedElements {
        model: t * h,
        fp32: 2 * t,
    };
    let mlp = |f: u64, act: Activation| match act {
        Activation::Gelu => 2 * t * f,
        Activation::SwiGlu => 3 * t * f,
    };
    let with = |e: SavedElements, model: u64, fp32: u64| SavedElements {
        model: e.model + model,
        fp32: e.fp32 + fp32,
    };
    match *kind {
        LayerKind::Embedding { .. } | LayerKind::Dense { .. } => SavedElements::default(),
        LayerKind::Transformer(tr) => {
            let (probs, lse) = match tr.attention {
                Attention::Flash => (0, tr.heads * t),
                Attention::Naive => (tr.heads * t * model.seq_len, 0),
            };
            let ln1 = norm(tr.hidden);
            let ln2 = norm(tr.hidden);
            let qkv_out_resid = t * (tr.hidden + 2 * tr.kv_dim()) + 2 * t * tr.hidden;
            with(
                with(ln1, ln2.model, ln2.fp32),
                qkv_out_resid + probs + mlp(tr.ffn, tr.act),
                lse,
            )
        }
        LayerKind::Mlp(m) => with(norm(m.hidden), mlp(m.ffn, m.act), 0),
        LayerKind::LmHead { hidden, .. } => norm(hidden),
    }
}

/// fp32 elements a layer's input-gradient backward (`I`) stashes for its weight-gradient
/// backward (`W`) in one micro-step: the gradients of the outputs of the products and norms
/// whose parameter gradients `W` computes and `I` does not keep anywhere else, t = the
/// micro-batch's tokens:
/// - transformer: the gradient of ln1's output, of the qkv product's output (after the rotary
///   backward), of the projection's output (the residual stream's), of ln2's output, and of
///   the MLP's first product (its pre-activation; SwiGLU: the gate's and the up product's);
/// - mlp: its norm's output gradient and its first product's, as above;
/// - lm_head: its norm's output gradient (the head product's output gradient is the logits'
///   gradient, which `W` reads where the loss wrote it);
/// - embedding and dense: nothing (an embedding's `W` reads its output gradient).
///
/// The MLP's last product's output gradient is the layer's output gradient, which `W` reads
/// where it is.
pub fn stash_elements(kind: &LayerKind, model: &Model) -> u64 {
    tokens(model) * stash_per_token(kind)
}

/// [`stash_elements`] per token of the micro-batch.
pub fn stash_per_token(kind: &LayerKind) -> u64 {
    let mlp = |f: u64, act: Activation| match act {
        Activation::Gelu => f,
        Activation::SwiGlu => 2 * f,
    };
    match *kind {
        LayerKind::Embedding { .. } | LayerKind::Dense { .. } => 0,
        LayerKind::Transformer(tr) => {
            let width = tr.hidden + 2 * tr.kv_dim();
            3 * tr.hidden + width + mlp(tr.ffn, tr.act)
        }
        LayerKind::Mlp(m) => m.hidden + mlp(m.ffn, m.act),
        LayerKind::LmHead { hidden, .. } => hidden,
    }
}

/// Bytes of the hidden state a layer outputs in one micro-step (logits for an lm_head).
pub fn output_bytes(kind: &LayerKind, model: &Model) -> u64 {
    output_elements(kind, model) * model.dtype.bytes()
}
