//! Unit tests of `device::jit` (a child module of it: they reach its private items): the host
//! device with the generated kernels against the same device on the Rust math, every layer
//! kind's forward and backward and every optimizer, bit for bit.

use super::without;
use crate::arena::Arena;
use crate::device::host::{Host, HostPtr};
use crate::device::{ArenaSpan, Device, Update};
use crate::math::{Input, LayerMath, OptimizerConfig, Rng, SliceGrads};
use sched_ir::job::{Dtype, Optimizer};

const MODELS: &str = r#"
model gpt {
    dtype = fp32  optimizer = adamw  seq_len = 16  micro_batch = 2
    layer embed    = embedding(vocab = 96, hidden = 32, positions = learned)
    layer block[1] = transformer(hidden = 32, heads = 4, ffn = 64, attention = naive)
    layer mlp      = mlp(hidden = 32, ffn = 48)
    layer head     = lm_head(hidden = 32, vocab = 96, tied = true)
}
model llama {
    dtype = bf16  optimizer = adamw  seq_len = 16  micro_batch = 2
    layer embed    = embedding(vocab = 96, hidden = 32, positions = rope)
    layer block[1] = transformer(hidden = 32, heads = 4, kv_heads = 2, ffn = 40, norm = rmsnorm, act = swiglu, bias = false)
    layer head     = lm_head(hidden = 32, vocab = 96, norm = rmsnorm)
}
"#;

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Forward then backward of `m`: output, saved, input, parameter and tied gradients.
fn run_layer(
    m: &LayerMath,
    p: &[f32],
    tied: Option<&[f32]>,
    x: &[f32],
    dy: &[f32],
) -> Vec<Vec<u32>> {
    let tokens: Vec<u32> = (0..m.input_elements() as u32)
        .map(|i| (i * 37 + 11) % 96)
        .collect();
    let input = if m.takes_tokens() {
        Input::Tokens(&tokens)
    } else {
        Input::Hidden(x)
    };
    let mut out = vec![0.0; m.output_elements()];
    let mut saved = vec![0.0; m.saved_elements()];
    m.forward(p, tied, input, &mut out, &mut saved);
    let mut gi = (!m.takes_tokens()).then(|| vec![0.0; m.input_elements()]);
    let mut gp = vec![0.0; m.params()];
    let mut gt = tied.map(|t| vec![0.0; t.len()]);
    m.backward(
        p,
        tied,
        &saved,
        input,
        SliceGrads {
            output: dy,
            input: gi.as_deref_mut(),
            params: &mut gp,
            tied: gt.as_deref_mut(),
        },
    );
    let mut all = vec![bits(&out), bits(&saved), bits(&gp)];
    all.extend(gi.as_deref().map(bits));
    all.extend(gt.as_deref().map(bits));
    all
}

#[test]
fn layers_on_generated_kernels_are_the_rust_math_bit_for_bit() {
    let loader = schedc::MemLoader::default()
        .in_dir("/mem")
        .with("/mem/m.sched", MODELS);
    let a = schedc::analyze(std::path::Path::new("/mem/m.sched"), &loader).expect("readable");
    assert!(!a.has_errors(), "{}", a.render());
    for model in a.models.iter() {
        let mut rng = Rng::new(3);
        for layer in &model.layers {
            let m = LayerMath::new(layer, model).unwrap();
            let p = rng.normals(m.params(), 0.2);
            let tied = m.is_tied().then(|| rng.normals(m.tied_elements(), 0.2));
            let x = rng.normals(m.input_elements(), 1.0);
            let dy = rng.normals(m.output_elements(), 0.1);
            let generated = run_layer(&m, &p, tied.as_deref(), &x, &dy);
            let rust = without(|| run_layer(&m, &p, tied.as_deref(), &x, &dy));
            for (i, (g, r)) in generated.iter().zip(&rust).enumerate() {
                assert!(g == r, "{} {}: tensor {i} differs", model.name, layer.name);
            }
        }
    }
}

/// One update of a shard that straddles a decayed range, clipped by a stored sum of squares.
fn update(kind: Optimizer, arena: &Arena, state: &[f32], grad: &[f32]) -> Vec<u32> {
    let mut st = state.to_vec();
    let mut g = grad.to_vec();
    let cfg = OptimizerConfig::new(kind, 3e-3);
    let n = g.len();
    let decay = [0..5, 17..40, 50..90];
    let host = Host::new(arena, &[], vec![]);
    let u = Update {
        cfg: &cfg,
        step: 3,
        n,
        first: 10,
        decay: &decay,
        clip: Some((
            ArenaSpan {
                at: 0,
                dtype: Dtype::Fp32,
                elements: 1,
            },
            0.5,
        )),
        contributions: 4.0,
    };
    host.update(&u, HostPtr::of(&mut st), HostPtr::of(&mut g), None)
        .unwrap();
    bits(&st)
}

#[test]
fn optimizers_on_generated_kernels_are_the_rust_math_bit_for_bit() {
    let arena = Arena::new(8);
    arena.write(0, Dtype::Fp32, &[2.5]).unwrap();
    let mut rng = Rng::new(9);
    let n = 64;
    for kind in [Optimizer::Adam, Optimizer::AdamW, Optimizer::Sgd] {
        let per = OptimizerConfig::new(kind, 1.0).state_per_param();
        let mut state = rng.normals(per * n, 0.5);
        if per == 3 {
            // The second moment is never negative.
            state[2 * n..].iter_mut().for_each(|v| *v = v.abs());
        }
        let grad = rng.normals(n, 1.0);
        let generated = update(kind, &arena, &state, &grad);
        let rust = without(|| update(kind, &arena, &state, &grad));
        assert!(generated == rust, "{kind:?} differs");
        assert_ne!(generated, bits(&state), "{kind:?} changed nothing");
    }
}

/// A host device made on a thread that has not turned them off runs the generated kernels (the
/// comparisons above would otherwise compare the Rust math with itself); inside `without`, the
/// Rust math.
#[test]
fn the_host_device_chooses_the_generated_kernels_unless_told_not_to() {
    use crate::device::kernels::Kernels;
    assert_eq!(Kernels::chosen(), Kernels::Generated);
    assert_eq!(without(Kernels::chosen), Kernels::Rust);
    assert_eq!(
        Kernels::chosen(),
        Kernels::Generated,
        "the switch is restored"
    );
}
