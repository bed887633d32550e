//! Unit tests of `device::layers` (a child module of it): the split backward's halves on the
//! host device against the whole backward.

use super::{
    backward, backward_input, backward_weight, Grads, In, InputGrads, WeightGrads, Weights,
};
use crate::device::host::{Host, HostPtr, HostTokens};
use crate::math::{LayerMath, Precision, Rng};
use sched_ir::job::Model;

/// Every layer kind and option the layer math has: GELU with biases and layer norms, naive
/// and flash attention, SwiGLU with RMS norms, rotary positions, grouped queries, tied and
/// untied heads, the mlp layer, and 16-bit models.
pub(crate) const MODELS: &str = r#"
model gpt_naive {
    dtype = fp32  optimizer = adamw  seq_len = 16  micro_batch = 2
    layer embed    = embedding(vocab = 256, hidden = 32, positions = learned)
    layer block[1] = transformer(hidden = 32, heads = 4, ffn = 64, attention = naive)
    layer mlp      = mlp(hidden = 32, ffn = 48)
    layer head     = lm_head(hidden = 32, vocab = 256, tied = true)
}
model llama_gqa {
    dtype = fp32  optimizer = adamw  seq_len = 16  micro_batch = 2
    layer embed    = embedding(vocab = 256, hidden = 32, positions = rope)
    layer block[1] = transformer(hidden = 32, heads = 4, kv_heads = 2, ffn = 40, norm = rmsnorm, act = swiglu, bias = false)
    layer mlp      = mlp(hidden = 32, ffn = 40, norm = rmsnorm, act = swiglu, bias = false)
    layer head     = lm_head(hidden = 32, vocab = 259, norm = rmsnorm)
}
model gpt_bf16 {
    dtype = bf16  optimizer = adamw  seq_len = 16  micro_batch = 2
    layer embed    = embedding(vocab = 256, hidden = 32, positions = learned)
    layer block[1] = transformer(hidden = 32, heads = 2, ffn = 64)
    layer mlp      = mlp(hidden = 32, ffn = 48)
    layer head     = lm_head(hidden = 32, vocab = 256, tied = true)
}
model llama_bf16 {
    dtype = bf16  optimizer = adamw  seq_len = 16  micro_batch = 2
    layer embed    = embedding(vocab = 259, hidden = 32, positions = rope)
    layer block[2] = transformer(hidden = 32, heads = 4, kv_heads = 2, ffn = 44, norm = rmsnorm, act = swiglu, bias = false, attention = naive)
    layer head     = lm_head(hidden = 32, vocab = 259, norm = rmsnorm, tied = true)
}
model gpt_fp16 {
    dtype = fp16  optimizer = adam  seq_len = 16  micro_batch = 2
    layer embed    = embedding(vocab = 256, hidden = 32, positions = learned)
    layer block[1] = transformer(hidden = 32, heads = 2, ffn = 64, attention = naive)
    layer head     = lm_head(hidden = 32, vocab = 256)
}
"#;

pub(crate) fn models() -> Vec<Model> {
    let loader = schedc::MemLoader::default()
        .in_dir("/mem")
        .with("/mem/m.sched", MODELS);
    let a = schedc::analyze(std::path::Path::new("/mem/m.sched"), &loader).expect("readable");
    assert!(!a.has_errors(), "{}", a.render());
    a.models.iter().map(|m| (**m).clone()).collect()
}

/// One layer's random parameters, tied embedding, input and output gradient (rounded to the
/// model's activation precision) and the saved activations of its forward (not recomputed).
struct Case {
    p: Vec<f32>,
    tied: Option<Vec<f32>>,
    tokens: Vec<u32>,
    xin: Vec<f32>,
    dy: Vec<f32>,
    saved: Vec<f32>,
}

impl Case {
    fn new(m: &LayerMath, rng: &mut Rng) -> Self {
        let act = m.precisions().0;
        let rounded = |mut v: Vec<f32>| {
            act.round(&mut v);
            v
        };
        let p = rounded(rng.normals(m.params(), 0.1));
        let tied = m
            .is_tied()
            .then(|| rounded(rng.normals(m.tied_elements(), 0.1)));
        let t = m.dims().t;
        let tokens: Vec<u32> = (0..t).map(|i| ((i * 37 + 11) % 256) as u32).collect();
        let xin = rounded(rng.normals(m.input_elements(), 1.0));
        // NaN in the padding of the logits' rows: no half may read it.
        let mut dy = rounded(rng.normals(m.output_elements(), 0.1));
        let width = m.output_width();
        dy.chunks_mut(m.output_stride())
            .for_each(|row| row[width..].fill(f32::NAN));
        let mut c = Case {
            p,
            tied,
            tokens,
            xin,
            dy,
            saved: vec![0.0; m.saved_elements()],
        };
        let mut out = vec![0.0; m.output_elements()];
        let mut saved = vec![0.0; m.saved_elements()];
        Host::with_slices(|d| {
            let tied = c.tied.as_deref().map(HostPtr::read_only);
            let (p, x) = (HostPtr::read_only(&c.p), c.input(m));
            super::forward(
                d,
                m,
                p,
                tied,
                x,
                HostPtr::of(&mut out),
                HostPtr::of(&mut saved),
            )
        })
        .unwrap();
        c.saved = saved;
        c
    }

    fn input<'h>(&self, m: &LayerMath) -> In<Host<'h>> {
        match m.takes_tokens() {
            true => In::Tokens(HostTokens::of(&self.tokens)),
            false => In::Hidden(HostPtr::read_only(&self.xin)),
        }
    }

    fn weights(&self) -> Weights<HostPtr> {
        Weights {
            params: HostPtr::read_only(&self.p),
            tied: self.tied.as_deref().map(HostPtr::read_only),
        }
    }
}

/// A backward's results: the input, parameter and tied gradients.
#[derive(Debug)]
struct Out {
    gi: Option<Vec<f32>>,
    gp: Vec<f32>,
    gt: Option<Vec<f32>>,
}

impl Out {
    /// NaN everywhere, for a backward to overwrite.
    fn unwritten(m: &LayerMath) -> Self {
        Out {
            gi: (!m.takes_tokens()).then(|| vec![f32::NAN; m.input_elements()]),
            gp: vec![f32::NAN; m.params()],
            gt: m.is_tied().then(|| vec![f32::NAN; m.tied_elements()]),
        }
    }
}

fn whole(m: &LayerMath, c: &Case, round_grads: bool) -> Out {
    let mut o = Out::unwritten(m);
    Host::with_slices(|d| {
        let g = Grads {
            dy: HostPtr::read_only(&c.dy),
            gi: o.gi.as_deref_mut().map(HostPtr::of),
            gp: HostPtr::of(&mut o.gp),
            gt: o.gt.as_deref_mut().map(HostPtr::of),
        };
        let saved = HostPtr::read_only(&c.saved);
        backward(d, m, c.weights(), saved, c.input(m), g, round_grads)
    })
    .unwrap();
    o
}

/// `backward_input` then `backward_weight`, each on a device of its own (as a pipeline's `I`
/// and `W` run as separate ops), the stash NaN before the input half writes it.
fn split(m: &LayerMath, c: &Case, round_grads: bool) -> Out {
    let mut o = Out::unwritten(m);
    let mut stash = vec![f32::NAN; m.stash_elements()];
    let saved = HostPtr::read_only(&c.saved);
    Host::with_slices(|d| {
        let g = InputGrads {
            dy: HostPtr::read_only(&c.dy),
            gi: o.gi.as_deref_mut().map(HostPtr::of),
            stash: HostPtr::of(&mut stash),
        };
        backward_input(d, m, c.weights(), saved, c.input(m), g)
    })
    .unwrap();
    assert!(
        stash.iter().all(|v| v.is_finite()),
        "{}: the input half leaves part of its stash unwritten",
        m.name()
    );
    Host::with_slices(|d| {
        let g = WeightGrads {
            dy: HostPtr::read_only(&c.dy),
            stash: HostPtr::read_only(&stash),
            gp: HostPtr::of(&mut o.gp),
            gt: o.gt.as_deref_mut().map(HostPtr::of),
        };
        backward_weight(d, m, c.weights(), saved, c.input(m), g, round_grads)
    })
    .unwrap();
    o
}

fn same_bits(what: &str, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (a, b)) in got.iter().zip(want).enumerate() {
        assert_eq!(
            a.to_bits(),
            b.to_bits(),
            "{what}[{i}]: split {a}, whole {b}"
        );
    }
}

/// On the host device (the Rust math, or with `llvm` the generated kernels), the input half
/// then the weight half give the bits of the whole backward for every layer kind (a tied head
/// included) of fp32, bf16 and fp16 models, with the gradients rounded by the layer or left to
/// their stores.
#[test]
fn split_backward_gives_the_whole_backwards_bits() {
    for model in models() {
        let mut rng = Rng::new(5);
        for layer in &model.layers {
            let m = LayerMath::new(layer, &model).unwrap();
            let c = Case::new(&m, &mut rng);
            for round_grads in [true, false] {
                let what = format!("{} {} (round {round_grads})", model.name, layer.name);
                let (a, b) = (split(&m, &c, round_grads), whole(&m, &c, round_grads));
                same_bits(&format!("{what} grad params"), &a.gp, &b.gp);
                if let (Some(x), Some(y)) = (&a.gi, &b.gi) {
                    same_bits(&format!("{what} grad input"), x, y);
                }
                assert_eq!(a.gt.is_some(), b.gt.is_some());
                if let (Some(x), Some(y)) = (&a.gt, &b.gt) {
                    same_bits(&format!("{what} grad tied"), x, y);
                }
                // Sanity: the rounding did round (a 16-bit model's gradients are 16-bit
                // values).
                if round_grads && m.precisions().1 != Precision::F32 {
                    let mut r = a.gp.clone();
                    m.precisions().1.round(&mut r);
                    same_bits(&format!("{what} rounded"), &r, &a.gp);
                }
            }
        }
    }
}

/// The layer math's stash is what the plan sizes it with (`sched_ir::abi::stash_elements`).
#[test]
fn stash_sizes_are_the_abis() {
    for model in models() {
        for layer in &model.layers {
            let m = LayerMath::new(layer, &model).unwrap();
            let abi = sched_ir::abi::stash_elements(&layer.kind, &model);
            assert_eq!(
                m.stash_elements() as u64,
                abi,
                "{} {}",
                model.name,
                layer.name
            );
        }
    }
}
