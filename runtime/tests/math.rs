//! The math's contracts other than gradients: flash equals naive, the saved layout is the one the
//! compiler plans for, initialisation, bf16 rounding, optimizer steps and the batch rule.

mod common;

use sched_ir::abi::{output_bytes, saved_bytes};
use sched_ir::job::{Dtype, Model, Optimizer};
use schedrun::data::{BatchShape, Corpus, DataError};
use schedrun::math::{
    bf16_bits_to_f32, decay_ranges, f32_to_bf16_bits, grad_scale, init_layer, optimizer_step,
    round_bf16, round_f16, Input, LayerMath, OptimizerConfig, Rng, SliceGrads, Stored,
};

/// Pairs of models that differ only in `attention`, with 150-token sequences (three row blocks,
/// the last partial).
const ATTENTION: &str = r#"
model gpt_naive {
    dtype = fp32  optimizer = adamw  seq_len = 150  micro_batch = 2
    layer embed    = embedding(vocab = 256, hidden = 32, positions = learned)
    layer block[1] = transformer(hidden = 32, heads = 4, ffn = 64, attention = naive)
    layer head     = lm_head(hidden = 32, vocab = 256, tied = true)
}
model gpt_flash {
    dtype = fp32  optimizer = adamw  seq_len = 150  micro_batch = 2
    layer embed    = embedding(vocab = 256, hidden = 32, positions = learned)
    layer block[1] = transformer(hidden = 32, heads = 4, ffn = 64, attention = flash)
    layer head     = lm_head(hidden = 32, vocab = 256, tied = true)
}
model llama_naive {
    dtype = fp32  optimizer = adamw  seq_len = 150  micro_batch = 2
    layer embed    = embedding(vocab = 256, hidden = 32, positions = rope)
    layer block[1] = transformer(hidden = 32, heads = 4, kv_heads = 2, ffn = 48,
                                 norm = rmsnorm, act = swiglu, bias = false, attention = naive)
    layer head     = lm_head(hidden = 32, vocab = 256, norm = rmsnorm)
}
model llama_flash {
    dtype = fp32  optimizer = adamw  seq_len = 150  micro_batch = 2
    layer embed    = embedding(vocab = 256, hidden = 32, positions = rope)
    layer block[1] = transformer(hidden = 32, heads = 4, kv_heads = 2, ffn = 48,
                                 norm = rmsnorm, act = swiglu, bias = false, attention = flash)
    layer head     = lm_head(hidden = 32, vocab = 256, norm = rmsnorm)
}
model bf16_mix {
    dtype = bf16  optimizer = adamw  seq_len = 12  micro_batch = 3
    layer embed    = embedding(vocab = 256, hidden = 32, positions = learned)
    layer block[2] = transformer(hidden = 32, heads = 4, ffn = 64, attention = naive)
    layer m        = mlp(hidden = 32, ffn = 40, act = swiglu, norm = rmsnorm, bias = false)
    layer head     = lm_head(hidden = 32, vocab = 256)
}
"#;

fn max_rel_diff(a: &[f32], b: &[f32]) -> f32 {
    let scale = a.iter().fold(0f32, |m, &x| m.max(x.abs())).max(1e-30);
    a.iter()
        .zip(b)
        .fold(0f32, |m, (&x, &y)| m.max((x - y).abs()))
        / scale
}

fn flash_equals_naive(naive: &str, flash: &str) {
    let (mn, mf) = (
        common::model(ATTENTION, naive),
        common::model(ATTENTION, flash),
    );
    let (ln, lf) = (&mn.layers[1], &mf.layers[1]);
    let (a, b) = (
        LayerMath::new(ln, &mn).unwrap(),
        LayerMath::new(lf, &mf).unwrap(),
    );
    assert_eq!(a.params(), b.params());
    assert!(
        a.saved_elements() > b.saved_elements(),
        "naive keeps the probabilities"
    );
    let mut rng = Rng::new(3);
    // Larger than the real init so the attention is far from uniform.
    let params: Vec<f32> = rng.normals(a.params(), 0.3);
    let x = rng.normals(a.input_elements(), 1.0);
    let g = rng.normals(a.output_elements(), 1.0);
    let run = |m: &LayerMath| {
        let mut out = vec![0.0; m.output_elements()];
        let mut saved = vec![0.0; m.saved_elements()];
        m.forward(&params, None, Input::Hidden(&x), &mut out, &mut saved);
        let mut gi = vec![0.0; m.input_elements()];
        let mut gp = vec![0.0; m.params()];
        m.backward(
            &params,
            None,
            &saved,
            Input::Hidden(&x),
            SliceGrads {
                output: &g,
                input: Some(&mut gi),
                params: &mut gp,
                tied: None,
            },
        );
        (out, gi, gp)
    };
    let (oa, gia, gpa) = run(&a);
    let (ob, gib, gpb) = run(&b);
    assert!(
        max_rel_diff(&oa, &ob) <= 1e-5,
        "forward differs: {}",
        max_rel_diff(&oa, &ob)
    );
    assert!(max_rel_diff(&gia, &gib) <= 1e-5, "input gradient differs");
    assert!(
        max_rel_diff(&gpa, &gpb) <= 1e-5,
        "parameter gradient differs"
    );
    assert!(oa.iter().chain(&gia).chain(&gpa).all(|v| v.is_finite()));
}

#[test]
fn flash_equals_naive_gpt() {
    flash_equals_naive("gpt_naive", "gpt_flash");
}

#[test]
fn flash_equals_naive_llama_gqa_rope() {
    flash_equals_naive("llama_naive", "llama_flash");
}

fn all_models() -> Vec<Model> {
    let mut ms = common::models(ATTENTION);
    ms.push(common::tiny("tiny_gpt"));
    ms.push(common::tiny("tiny_llama"));
    ms
}

#[test]
fn saved_layout_totals_the_compiler_activation_bytes() {
    let mut checked = 0;
    for model in all_models() {
        let d = model.dtype.bytes() as usize;
        for l in &model.layers {
            let m = LayerMath::new(l, &model).unwrap();
            let segs = m.saved_segments();
            let bytes: usize = segs
                .iter()
                .map(|s| s.elements * if s.stored == Stored::Model { d } else { 4 })
                .sum();
            assert_eq!(
                bytes as u64,
                saved_bytes(&l.kind, &model),
                "{} {}",
                model.name,
                l.name
            );
            assert_eq!(
                (m.output_elements() * d) as u64,
                output_bytes(&l.kind, &model)
            );
            assert_eq!(
                m.saved_elements(),
                segs.iter().map(|s| s.elements).sum::<usize>()
            );
            assert_eq!(m.params() as u64, l.params);
            checked += 1;
        }
    }
    assert!(checked >= 20);
}

#[test]
fn transformer_segments_follow_the_compiler_doc_order() {
    let model = common::tiny("tiny_gpt");
    let m = LayerMath::new(&model.layers[1], &model).unwrap();
    let names: Vec<&str> = m.saved_segments().iter().map(|s| s.name).collect();
    assert_eq!(
        names,
        [
            "ln1.out",
            "ln1.stats",
            "attn.qkv",
            "attn.out",
            "attn.lse",
            "resid",
            "ln2.out",
            "ln2.stats",
            "mlp.pre",
            "mlp.post"
        ]
    );
    let model = common::tiny("tiny_llama");
    let m = LayerMath::new(&model.layers[1], &model).unwrap();
    let tail: Vec<&str> = m.saved_segments().iter().skip(7).map(|s| s.name).collect();
    assert_eq!(tail, ["ln2.stats", "mlp.gate", "mlp.up", "mlp.prod"]);
}

#[test]
fn dense_layers_are_refused() {
    let model = common::model(
        "model d { dtype = fp32 optimizer = adamw seq_len = 8 micro_batch = 1\n\
         layer embed = embedding(vocab = 256, hidden = 8, positions = learned)\n\
         layer x = dense(params = 100, flops_per_token = 200, activation_bytes_per_token = 16)\n\
         layer head = lm_head(hidden = 8, vocab = 256)\n}\n",
        "d",
    );
    let err = LayerMath::new(&model.layers[1], &model)
        .err()
        .expect("refused");
    assert_eq!(
        err.to_string(),
        "layer x is `dense`: it can be compiled and simulated but not run"
    );
}

#[test]
fn bf16_models_store_bf16_values() {
    let model = common::model(ATTENTION, "bf16_mix");
    assert_eq!(model.dtype, Dtype::Bf16);
    let mut rng = Rng::new(9);
    for l in &model.layers[1..model.layers.len() - 1] {
        let m = LayerMath::new(l, &model).unwrap();
        let mut params = init_layer(l, &model, 1);
        params.iter_mut().for_each(|p| *p = round_bf16(*p));
        let x: Vec<f32> = rng
            .normals(m.input_elements(), 1.0)
            .into_iter()
            .map(round_bf16)
            .collect();
        let mut out = vec![0.0; m.output_elements()];
        let mut saved = vec![0.0; m.saved_elements()];
        m.forward(&params, None, Input::Hidden(&x), &mut out, &mut saved);
        let is_bf16 = |v: &f32| round_bf16(*v) == *v;
        assert!(out.iter().all(is_bf16), "{}: output", l.name);
        let mut at = 0;
        for s in m.saved_segments() {
            let seg = &saved[at..at + s.elements];
            if s.stored == Stored::Model {
                assert!(seg.iter().all(is_bf16), "{}: {}", l.name, s.name);
            }
            at += s.elements;
        }
    }
}

/// Ranks run layers on threads of their own: the math is shareable and gives the same bits on
/// any thread, while other threads use it at the same time.
#[test]
fn layer_math_is_shared_across_threads_with_identical_results() {
    fn shareable<T: Send + Sync>() {}
    shareable::<LayerMath>();
    let model = common::tiny("tiny_llama");
    let l = &model.layers[1];
    let m = LayerMath::new(l, &model).unwrap();
    let p = init_layer(l, &model, 4);
    let mut rng = Rng::new(11);
    let x = rng.normals(m.input_elements(), 1.0);
    let g = rng.normals(m.output_elements(), 1.0);
    let run = || {
        let mut out = vec![0.0; m.output_elements()];
        let mut saved = vec![0.0; m.saved_elements()];
        let mut gi = vec![0.0; m.input_elements()];
        let mut gp = vec![0.0; m.params()];
        for _ in 0..3 {
            m.forward(&p, None, Input::Hidden(&x), &mut out, &mut saved);
            m.backward(
                &p,
                None,
                &saved,
                Input::Hidden(&x),
                SliceGrads {
                    output: &g,
                    input: Some(&mut gi),
                    params: &mut gp,
                    tied: None,
                },
            );
        }
        (out, saved, gi, gp)
    };
    let alone = run();
    let together: Vec<_> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..4).map(|_| s.spawn(run)).collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for r in together {
        assert!(r == alone, "a thread computed different bits");
    }
}

// ---- initialisation ----

fn stats(v: &[f32]) -> (f64, f64) {
    let n = v.len() as f64;
    let mean = v.iter().map(|&x| f64::from(x)).sum::<f64>() / n;
    let var = v
        .iter()
        .map(|&x| (f64::from(x) - mean).powi(2))
        .sum::<f64>()
        / n;
    (mean, var.sqrt())
}

#[test]
fn init_statistics_follow_the_spec() {
    for model in [common::tiny("tiny_gpt"), common::tiny("tiny_llama")] {
        let blocks = 2.0f64;
        for l in &model.layers {
            let p = init_layer(l, &model, 0);
            assert_eq!(p.len() as u64, l.params);
            let mut at = 0;
            for t in &l.tensors {
                let n = t.elements() as usize;
                let v = &p[at..at + n];
                at += n;
                let what = format!("{} {}.{}", model.name, l.name, t.name);
                if t.shape.len() == 2 {
                    let want = if t.name == "attn.proj.weight" || t.name == "mlp.proj.weight" {
                        0.02 / (2.0 * blocks).sqrt()
                    } else {
                        0.02
                    };
                    let (mean, std) = stats(v);
                    assert!(
                        (std / want - 1.0).abs() < 0.05,
                        "{what}: std {std}, want {want}"
                    );
                    assert!(
                        mean.abs() < 4.0 * want / (n as f64).sqrt(),
                        "{what}: mean {mean}"
                    );
                } else if t.name.ends_with("bias") {
                    assert!(v.iter().all(|&x| x == 0.0), "{what}");
                } else {
                    assert!(v.iter().all(|&x| x == 1.0), "{what}");
                }
            }
        }
    }
}

#[test]
fn init_is_deterministic_and_per_tensor() {
    let gpt = common::tiny("tiny_gpt");
    let embed = &gpt.layers[0];
    let a = init_layer(embed, &gpt, 0);
    assert_eq!(a, init_layer(embed, &gpt, 0));
    assert_ne!(a, init_layer(embed, &gpt, 1));
    // Pinned values (wte[0..3], the last of wte, the first of wpe), reproduced by an independent
    // Python transcription of the documented generator: they never change.
    let pinned = [a[0], a[1], a[2], a[16383], a[16384]];
    let expected = [
        f32::from_bits(0x3c2f_e4b6),
        f32::from_bits(0xbc57_14d7),
        f32::from_bits(0x3c6b_9e20),
        f32::from_bits(0x3c00_fbf9),
        f32::from_bits(0xbc82_90f9),
    ];
    assert_eq!(
        pinned.map(f32::to_bits),
        expected.map(f32::to_bits),
        "{pinned:?} vs {expected:?}"
    );
    // A tensor depends on (seed, layer name, tensor name) only: `wte` is the same with rope
    // positions (no `wpe` after it) and in another model.
    let llama = common::tiny("tiny_llama");
    let b = init_layer(&llama.layers[0], &llama, 0);
    assert_eq!(a[..256 * 64], b[..]);
    // Different tensors and layers draw different values.
    let b0 = init_layer(&gpt.layers[1], &gpt, 0);
    let b1 = init_layer(&gpt.layers[2], &gpt, 0);
    assert_ne!(b0, b1);
}

// ---- bf16 ----

#[test]
fn bf16_rounds_to_nearest_even() {
    assert_eq!(f32_to_bf16_bits(1.0), 0x3f80);
    assert_eq!(f32_to_bf16_bits(-2.0), 0xc000);
    let one = 1.0f32;
    let ulp = 2f32.powi(-7);
    // Exactly halfway between 1 and 1 + ulp: ties to the even 1.0.
    assert_eq!(round_bf16(one + ulp / 2.0), one);
    // Halfway between 1 + ulp (odd) and 1 + 2ulp (even): up.
    assert_eq!(round_bf16(one + 1.5 * ulp), one + 2.0 * ulp);
    // Just past halfway: up; just before: down.
    assert_eq!(round_bf16(f32::from_bits(0x3f80_8001)), one + ulp);
    assert_eq!(round_bf16(f32::from_bits(0x3f80_7fff)), one);
    assert_eq!(round_bf16(-(one + ulp / 2.0)), -one);
    // Signed zero, subnormals, overflow, infinities, NaN.
    assert_eq!(f32_to_bf16_bits(-0.0), 0x8000);
    assert_eq!(f32_to_bf16_bits(f32::from_bits(1)), 0x0000);
    assert_eq!(f32_to_bf16_bits(f32::MAX), 0x7f80);
    assert_eq!(f32_to_bf16_bits(f32::from_bits(0x7f7f_7fff)), 0x7f7f);
    assert_eq!(f32_to_bf16_bits(f32::INFINITY), 0x7f80);
    assert_eq!(f32_to_bf16_bits(f32::NEG_INFINITY), 0xff80);
    assert!(round_bf16(f32::NAN).is_nan());
    assert!(bf16_bits_to_f32(f32_to_bf16_bits(f32::from_bits(0x7f80_0001))).is_nan());
    assert!(round_bf16(-f32::NAN).is_sign_negative());
    // Every bf16 value converts back to itself.
    for b in 0..=u16::MAX {
        let x = bf16_bits_to_f32(b);
        if !x.is_nan() {
            assert_eq!(f32_to_bf16_bits(x), b, "{b:#06x}");
        }
    }
}

#[test]
fn f16_rounds_to_nearest_even() {
    let ulp = 2f32.powi(-10);
    assert_eq!(round_f16(1.0 + ulp / 2.0), 1.0);
    assert_eq!(round_f16(1.0 + 1.5 * ulp), 1.0 + 2.0 * ulp);
    assert_eq!(round_f16(65504.0), 65504.0);
    assert_eq!(round_f16(65519.0), 65504.0);
    assert_eq!(round_f16(65520.0), f32::INFINITY);
    assert_eq!(round_f16(2f32.powi(-25)), 0.0);
    assert_eq!(round_f16(3.0 * 2f32.powi(-25)), 2f32.powi(-23));
    assert_eq!(round_f16(0.1), 0.099_975_586);
    assert!(round_f16(f32::NAN).is_nan());
}

// ---- optimizers ----

#[test]
fn adamw_first_and_second_step_by_hand() {
    let cfg = OptimizerConfig::new(Optimizer::AdamW, 0.01);
    assert_eq!(
        (cfg.beta1, cfg.beta2, cfg.eps, cfg.weight_decay),
        (0.9, 0.95, 1e-8, 0.1)
    );
    // Two elements: the first decayed (a matrix), the second not (a bias).
    let mut state = vec![1.0, 1.0, 0.0, 0.0, 0.0, 0.0];
    let decay = [std::ops::Range { start: 0, end: 1 }];
    // grad is a sum; scaled by 0.5 to g = 0.2.
    optimizer_step(&cfg, &mut state, &[0.4, 0.4], 0.5, 1, 0, &decay);
    // m = 0.02, v = 0.002, m̂ = 0.2, v̂ = 0.04: the step is lr · 0.2 / (0.2 + 1e-8).
    let step1 = 0.01 * 0.2 / (0.2 + 1e-8);
    let want = [(1.0 - 0.001) - step1, 1.0 - step1];
    for (got, want) in state[..2].iter().zip(want) {
        assert!((f64::from(*got) - want).abs() < 1e-7, "{got} vs {want}");
    }
    assert!((state[2] - 0.02).abs() < 1e-8 && (state[4] - 0.002).abs() < 1e-9);
    // Second step, g = -0.1: m = 0.008, v = 0.0024, m̂ = 0.008/0.19, v̂ = 0.0024/0.0975.
    let p = [f64::from(state[0]), f64::from(state[1])];
    optimizer_step(&cfg, &mut state, &[-0.2, -0.2], 0.5, 2, 0, &decay);
    let step2 = 0.01 * (0.008 / 0.19) / ((0.0024f64 / 0.0975).sqrt() + 1e-8);
    let want = [p[0] * (1.0 - 0.001) - step2, p[1] - step2];
    for (got, want) in state[..2].iter().zip(want) {
        assert!((f64::from(*got) - want).abs() < 1e-7, "{got} vs {want}");
    }
}

#[test]
fn grad_scale_averages_and_clips() {
    // Summed gradient of norm 20 over 4 contributions: the average has norm 5.
    assert_eq!(grad_scale(400.0, 4, None), 0.25);
    assert_eq!(grad_scale(400.0, 4, Some(10.0)), 0.25);
    let clipped = f64::from(grad_scale(400.0, 4, Some(1.0)));
    assert!((clipped - 0.25 / (5.0 + 1e-6)).abs() < 1e-9, "{clipped}");
}

#[test]
fn adam_never_decays_and_sgd_is_plain() {
    let cfg = OptimizerConfig::new(Optimizer::Adam, 0.01);
    let mut state = vec![1.0, 0.0, 0.0];
    optimizer_step(
        &cfg,
        &mut state,
        &[0.2],
        1.0,
        1,
        0,
        &[std::ops::Range { start: 0, end: 1 }],
    );
    assert!((f64::from(state[0]) - (1.0 - 0.01 * 0.2 / (0.2 + 1e-8))).abs() < 1e-7);
    let cfg = OptimizerConfig::new(Optimizer::Sgd, 0.1);
    let mut state = vec![1.0, 2.0];
    optimizer_step(
        &cfg,
        &mut state,
        &[1.0, -2.0],
        0.25,
        7,
        0,
        &[std::ops::Range { start: 0, end: 2 }],
    );
    assert_eq!(state, [0.975, 2.05]);
}

#[test]
fn optimizer_on_shards_equals_whole_vector() {
    let model = common::tiny("tiny_gpt");
    let layer = &model.layers[1];
    let decay = decay_ranges(layer);
    assert_eq!(decay.len(), 4, "qkv, proj, fc and mlp proj");
    let n = layer.params as usize;
    let cfg = OptimizerConfig::new(Optimizer::AdamW, 1e-3);
    let mut rng = Rng::new(5);
    let master = init_layer(layer, &model, 0);
    let grads: Vec<Vec<f32>> = (0..3).map(|_| rng.normals(n, 1.0)).collect();
    let mut whole = master.clone();
    whole.resize(3 * n, 0.0);
    for (s, g) in grads.iter().enumerate() {
        optimizer_step(&cfg, &mut whole, g, 0.25, s as u64 + 1, 0, &decay);
    }
    // Four uneven shards whose borders cut through tensors.
    let cuts = [0, 100, 4_321, 30_000, n];
    for w in cuts.windows(2) {
        let (a, b) = (w[0], w[1]);
        let k = b - a;
        let mut st = master[a..b].to_vec();
        st.resize(3 * k, 0.0);
        for (s, g) in grads.iter().enumerate() {
            optimizer_step(&cfg, &mut st, &g[a..b], 0.25, s as u64 + 1, a, &decay);
        }
        assert_eq!(st[..k], whole[a..b]);
        assert_eq!(st[k..2 * k], whole[n + a..n + b]);
        assert_eq!(st[2 * k..], whole[2 * n + a..2 * n + b]);
    }
    // Biases and gains moved without decay, matrices with it: compare one of each with a run
    // without decay.
    let mut plain = master.clone();
    plain.resize(3 * n, 0.0);
    for (s, g) in grads.iter().enumerate() {
        optimizer_step(&cfg, &mut plain, g, 0.25, s as u64 + 1, 0, &[]);
    }
    assert_eq!(whole[0], plain[0], "ln1.weight is not decayed");
    let q = decay[0].start + 5;
    assert_ne!(whole[q], plain[q], "attn.qkv.weight is decayed");
}

// ---- data ----

#[test]
fn sequences_follow_the_offset_rule() {
    let corpus = Corpus::from_bytes((0..100u8).collect());
    // (g·8) mod (100 − 8 − 1 = 91)
    let (x, y) = corpus.sequence(12, 8).unwrap();
    assert_eq!(x, (5..13).collect::<Vec<u32>>());
    assert_eq!(y, (6..14).collect::<Vec<u32>>());
    assert_eq!(corpus.offset(11, 8).unwrap(), 88);
    assert_eq!(corpus.offset(91, 8).unwrap(), 0);
}

#[test]
fn a_rank_takes_its_micro_batch_of_the_global_batch() {
    let corpus = Corpus::from_bytes((0..100u8).collect());
    let shape = BatchShape {
        ranks: 2,
        micro_steps: 3,
        micro_batch: 2,
        seq_len: 8,
    };
    // B = 2 ranks × 3 micro-steps × 2 = 12; step 2, micro-step 1, rank 1: k = (1·2 + 1)·2 + j =
    // 6, 7, so g = 30, 31 at offsets 240 mod 91 = 58 and 248 mod 91 = 66.
    let (x, y) = corpus.batch(&shape, (2, 1, 1)).unwrap();
    let want_x: Vec<u32> = (58..66).chain(66..74).collect();
    let want_y: Vec<u32> = (59..67).chain(67..75).collect();
    assert_eq!((x, y), (want_x, want_y));
    // The global batch is every (micro-step, rank) micro-batch in order.
    let global = corpus.global_batch(2, 12, 8).unwrap();
    let mut xs = vec![];
    let mut ys = vec![];
    for m in 0..3 {
        for r in 0..2 {
            let (x, y) = corpus.batch(&shape, (2, m, r)).unwrap();
            xs.extend(x);
            ys.extend(y);
        }
    }
    assert_eq!((global.inputs, global.targets), (xs, ys));
}

#[test]
fn a_short_corpus_is_refused_clearly() {
    let short = Corpus::from_bytes(vec![b'a'; 9]);
    let err = short.sequence(0, 8).unwrap_err();
    assert!(matches!(err, DataError::TooShort { len: 9, seq_len: 8 }));
    assert_eq!(
        err.to_string(),
        "the corpus has 9 bytes, too short for seq_len 8: it needs at least 10 (seq_len + 2)"
    );
    let just = Corpus::from_bytes((0..10u8).collect());
    assert_eq!(just.sequence(7, 8).unwrap().0, (0..8).collect::<Vec<u32>>());
    let missing = Corpus::load(Some(std::path::Path::new("/nonexistent/corpus.txt"))).unwrap_err();
    assert!(missing
        .to_string()
        .starts_with("cannot read the corpus /nonexistent/corpus.txt"));
}

#[test]
fn the_builtin_corpus_is_fixed_text() {
    let a = Corpus::builtin();
    assert_eq!(a.len(), 64 * 1024);
    assert_eq!(a, Corpus::load(None).unwrap());
    let text = std::str::from_utf8(a.bytes()).expect("ascii text");
    assert!(text
        .bytes()
        .all(|b| b == b'\n' || (b' '..=b'~').contains(&b)));
    assert!(text.matches(". ").count() > 500, "sentences");
    assert!(text.contains(" the "));
    // Varied, not one sentence repeated.
    let distinct: std::collections::HashSet<&str> = text.split('.').collect();
    assert!(distinct.len() > 500);
}
