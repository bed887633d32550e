//! A model's norm ε reaches its norm kernels: the default keeps the names kernels had before
//! `norm_eps` existed; another ε is in the name (so a plan's PTX file holds one kernel per ε).

use crate::{for_model, NormEps, Op};
use sched_ir::job::{Activation, Dtype, Layer, LayerKind, MlpSpec, Model, Norm, Optimizer};

fn model(norm_eps: Option<f64>) -> Model {
    let mlp = MlpSpec {
        hidden: 8,
        ffn: 16,
        act: Activation::Gelu,
        bias: true,
        norm: Norm::LayerNorm,
    };
    Model {
        name: "m".into(),
        dtype: Dtype::Fp32,
        grad_dtype: Dtype::Fp32,
        optimizer: Optimizer::Adam,
        seq_len: 8,
        micro_batch: 1,
        layers: vec![Layer {
            name: "mlp".into(),
            kind: LayerKind::Mlp(mlp),
            tensors: vec![],
            params: 0,
        }],
        norm_eps,
        rope_base: None,
    }
}

fn norm_names(m: &Model) -> Vec<(NormEps, String)> {
    for_model(m)
        .into_iter()
        .filter_map(|k| match k.op {
            Op::Norm { eps, .. } => Some((eps, k.name())),
            _ => None,
        })
        .collect()
}

#[test]
fn the_default_epsilon_keeps_the_names_and_another_is_named() {
    assert_eq!(NormEps::DEFAULT, NormEps::new(1e-5));
    assert_eq!(NormEps::DEFAULT, NormEps::of(&model(None)));
    assert_eq!(NormEps::DEFAULT.value(), 1e-5);
    let default = norm_names(&model(None));
    assert!(!default.is_empty());
    for (eps, name) in &default {
        assert_eq!(*eps, NormEps::DEFAULT);
        assert!(
            name.starts_with("layernorm_bias_w8") && !name.contains("eps"),
            "{name}"
        );
    }
    let other = norm_names(&model(Some(1e-6)));
    assert_eq!(other.len(), default.len());
    for (eps, name) in &other {
        assert_eq!(eps.value(), 1e-6);
        assert!(name.contains("_eps358637bd"), "{name}");
    }
}
