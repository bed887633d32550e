//! Activation sizes: the tensors each layer keeps from forward for backward, per micro-step.
//!
//! These are the runtime's real saved tensors for zoo layers (`runtime.md`, model math), so the
//! memory plan is exact for them; `dense` layers declare theirs per token. With T = micro_batch ×
//! seq_len tokens, h hidden, f ffn, n heads, kv the key/value width and d the model dtype's bytes,
//! a transformer keeps: ln1's output (T·h·d) and its per-token statistics (2·T fp32), the q/k/v
//! projection (T·(h+2kv)·d), the attention output before its projection (T·h·d) plus either each
//! row's log-sum-exp (flash: n·T fp32) or the probabilities (naive: n·T·s·d), the residual stream
//! after attention (T·h·d), ln2's output and statistics, and the MLP's pre- and post-activation
//! tensors (gelu: 2·T·f·d; swiglu: gate, up and their product, 3·T·f·d). The layer's input and
//! output are hidden-state buffers of their own, not counted here.

use crate::job::{Activation, Attention, LayerKind, Model};

/// Bytes layer `kind` keeps for backward in one micro-step.
pub fn saved_bytes(kind: &LayerKind, model: &Model) -> u64 {
    let t = model.micro_batch * model.seq_len;
    let d = model.dtype.bytes();
    let norm = |h: u64| t * h * d + 2 * t * 4;
    let mlp = |f: u64, act: Activation| match act {
        Activation::Gelu => 2 * t * f * d,
        Activation::SwiGlu => 3 * t * f * d,
    };
    match *kind {
        LayerKind::Embedding { .. } => 0,
        LayerKind::Transformer(tr) => {
            let attention = match tr.attention {
                Attention::Flash => tr.heads * t * 4,
                Attention::Naive => tr.heads * t * model.seq_len * d,
            };
            norm(tr.hidden)
                + t * (tr.hidden + 2 * tr.kv_dim()) * d
                + t * tr.hidden * d
                + attention
                + t * tr.hidden * d
                + norm(tr.hidden)
                + mlp(tr.ffn, tr.act)
        }
        LayerKind::Mlp(m) => norm(m.hidden) + mlp(m.ffn, m.act),
        LayerKind::LmHead { hidden, .. } => norm(hidden),
        LayerKind::Dense {
            activation_bytes_per_token,
            ..
        } => activation_bytes_per_token * t,
    }
}

/// Bytes of the hidden state a layer outputs in one micro-step (logits for an lm_head).
pub fn output_bytes(kind: &LayerKind, model: &Model) -> u64 {
    let t = model.micro_batch * model.seq_len;
    let d = model.dtype.bytes();
    match *kind {
        LayerKind::LmHead { vocab, .. } => t * vocab * d,
        _ => kind.hidden().map_or(0, |h| t * h * d),
    }
}
