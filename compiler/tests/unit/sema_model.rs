//! Unit tests of `sema::model` (a child module of it: they reach its private items).

use super::*;

/// The closed formulas of dsl.md's layer table, written independently of the tensor lists.
fn formula(kind: &LayerKind, seq_len: u64) -> u64 {
    let mlp = |m: &MlpSpec| {
        let (w, b) = match m.act {
            Activation::Gelu => (2 * m.hidden * m.ffn, m.ffn + m.hidden),
            Activation::SwiGlu => (3 * m.hidden * m.ffn, 2 * m.ffn + m.hidden),
        };
        w + if m.bias { b } else { 0 }
    };
    match *kind {
        LayerKind::Embedding {
            vocab,
            hidden,
            positions,
        } => {
            vocab * hidden
                + if positions == Positions::Learned {
                    seq_len * hidden
                } else {
                    0
                }
        }
        LayerKind::Transformer(t) => {
            let kv = t.kv_dim();
            let attn = t.hidden * (t.hidden + 2 * kv) + t.hidden * t.hidden;
            let attn_bias = if t.bias {
                t.hidden + 2 * kv + t.hidden
            } else {
                0
            };
            attn + attn_bias + mlp(&t.mlp()) + 2 * t.norm.params(t.hidden)
        }
        LayerKind::Mlp(m) => mlp(&m) + m.norm.params(m.hidden),
        LayerKind::LmHead {
            hidden,
            vocab,
            norm,
            tied,
        } => norm.params(hidden) + if tied { 0 } else { vocab * hidden },
        LayerKind::Dense { params, .. } => params,
    }
}

#[test]
fn tensors_sum_to_the_spec_formulas() {
    let mut cases = vec![
        LayerKind::Embedding {
            vocab: 50257,
            hidden: 768,
            positions: Positions::Learned,
        },
        LayerKind::Embedding {
            vocab: 32000,
            hidden: 4096,
            positions: Positions::Rope,
        },
        LayerKind::LmHead {
            hidden: 768,
            vocab: 50257,
            norm: Norm::LayerNorm,
            tied: true,
        },
        LayerKind::LmHead {
            hidden: 4096,
            vocab: 32000,
            norm: Norm::RmsNorm,
            tied: false,
        },
    ];
    for norm in [Norm::LayerNorm, Norm::RmsNorm] {
        for act in [Activation::Gelu, Activation::SwiGlu] {
            for bias in [false, true] {
                for kv_heads in [8, 2, 1] {
                    cases.push(LayerKind::Transformer(TransformerSpec {
                        hidden: 512,
                        heads: 8,
                        kv_heads,
                        ffn: 1376,
                        norm,
                        act,
                        bias,
                        attention: Attention::Flash,
                    }));
                }
                cases.push(LayerKind::Mlp(MlpSpec {
                    hidden: 96,
                    ffn: 384,
                    act,
                    bias,
                    norm,
                }));
            }
        }
    }
    for k in &cases {
        assert_eq!(tensors(k, 1024).unwrap().1, formula(k, 1024), "{k:?}");
    }
}

#[test]
fn overflow_is_caught() {
    let k = LayerKind::Embedding {
        vocab: MAX_DIM,
        hidden: MAX_DIM,
        positions: Positions::None,
    };
    assert!(tensors(&k, 1).is_none());
}
