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
    match *kind {
        LayerKind::Dense {
            activation_bytes_per_token,
            ..
        } => activation_bytes_per_token * model.micro_batch * model.seq_len,
        _ => {
            let e = saved_elements(kind, model);
            e.model * model.dtype.bytes() + e.fp32 * 4
        }
    }
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
    let t = model.micro_batch * model.seq_len;
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

/// Bytes of the hidden state a layer outputs in one micro-step (logits for an lm_head).
pub fn output_bytes(kind: &LayerKind, model: &Model) -> u64 {
    super::workspace::output_elements(kind, model) * model.dtype.bytes()
}
