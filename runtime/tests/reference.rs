//! The parity reference trains the tiny models and keeps the averaging rule of sharded runs.

mod common;

use sched_ir::job::Train;
use schedrun::data::Corpus;
use schedrun::math::{Input, LayerMath, SliceGrads};
use schedrun::reference::Reference;
use std::time::Instant;

fn train(lr: f64, clip: Option<f64>) -> Train {
    Train {
        steps: 30,
        lr,
        seed: 0,
        data: None,
        clip,
        checkpoints: None,
        save_every: None,
        keep: None,
        warmup: 0,
        decay: sched_ir::job::Decay::Constant,
        min_lr: 0.0,
        weight_decay: None,
        betas: None,
        eps: None,
        val: None,
        eval_every: None,
        eval_batches: None,
    }
}

/// Trains `model` for 30 steps of the tiny_cpu schedule's global batch (8 sequences) on the
/// built-in corpus; returns the losses.
fn losses(name: &str, clip: Option<f64>) -> Vec<f64> {
    let model = common::tiny(name);
    let corpus = Corpus::builtin();
    let mut r = Reference::new(&model, &train(1e-3, clip)).unwrap();
    let s = model.seq_len as usize;
    (0..30)
        .map(|step| r.step(step, &corpus.global_batch(step, 8, s).unwrap()))
        .collect()
}

fn mean(v: &[f64]) -> f64 {
    v.iter().sum::<f64>() / v.len() as f64
}

#[test]
fn tiny_gpt_loss_falls() {
    let l = losses("tiny_gpt", None);
    // A uniform byte model starts at ln 256 ≈ 5.55.
    assert!((l[0] - 256f64.ln()).abs() < 0.1, "first loss {}", l[0]);
    let (first, last) = (mean(&l[..3]), mean(&l[27..]));
    assert!(
        last < 0.8 * first,
        "loss fell only from {first} to {last}: {l:?}"
    );
}

#[test]
fn tiny_llama_loss_falls() {
    let l = losses("tiny_llama", Some(1.0));
    let (first, last) = (mean(&l[..3]), mean(&l[27..]));
    assert!(
        last < 0.8 * first,
        "loss fell only from {first} to {last}: {l:?}"
    );
}

#[test]
fn the_job_schedule_builds_a_reference() {
    let job = common::tiny_job();
    let mut r = Reference::new(&job.model, &job.schedule.train).unwrap();
    let b = (job.ranks() * u64::from(job.schedule.micro_steps) * job.model.micro_batch) as usize;
    let batch = Corpus::builtin()
        .global_batch(0, b, job.model.seq_len as usize)
        .unwrap();
    let before = r.evaluate(&batch);
    let loss = r.step(0, &batch);
    assert_eq!(
        before, loss,
        "the step's loss uses the weights it started from"
    );
    let names: Vec<String> = r.weights().into_iter().map(|(n, _)| n).collect();
    assert_eq!(names[0], "embed.wte");
    assert_eq!(names[1], "embed.wpe");
    assert!(names.contains(&"block[1].mlp.proj.bias".to_string()));
    assert_eq!(names.last().unwrap(), "head.norm.bias");
    let total: usize = r.weights().iter().map(|(_, w)| w.len()).sum();
    assert_eq!(total as u64, job.model.parameters());
}

/// One step on 8 sequences in micro-batches of 2 equals one step on the same 8 in micro-batches
/// of 4 (same global batch, different M): gradients are averaged over micro-batches, each a mean
/// over its tokens.
#[test]
fn averaging_does_not_depend_on_the_micro_batch_split() {
    let m2 = common::tiny("tiny_gpt");
    let mut m4 = m2.clone();
    m4.micro_batch = 4;
    let batch = Corpus::builtin().global_batch(3, 8, 64).unwrap();
    let mut a = Reference::new(&m2, &train(1e-3, Some(0.5))).unwrap();
    let mut b = Reference::new(&m4, &train(1e-3, Some(0.5))).unwrap();
    let (la, lb) = (a.step(0, &batch), b.step(0, &batch));
    assert!((la - lb).abs() < 1e-6 * la, "{la} vs {lb}");
    for ((n, wa), (_, wb)) in a.weights().iter().zip(b.weights()) {
        let diff = wa
            .iter()
            .zip(&wb)
            .fold(0f32, |m, (x, y)| m.max((x - y).abs()));
        // Adam divides by √v, so elements with near-zero gradients amplify rounding: the bound is
        // the parity contract's 1e-5 (a step moves weights by about lr = 1e-3).
        assert!(diff < 1e-5, "{n}: {diff}");
    }
    // The summed gradients: with 4 micro-batches of 2 they are twice those of 2 micro-batches of 4.
    let (ga, gb) = (&a.grads()[1], &b.grads()[1]);
    let rel = ga
        .iter()
        .zip(gb)
        .fold(0f32, |m, (x, y)| m.max((x - 2.0 * y).abs()))
        / gb.iter().fold(0f32, |m, y| m.max(y.abs()));
    assert!(rel < 1e-4, "{rel}");
}

#[test]
fn clipping_changes_the_step_only_when_it_binds() {
    let model = common::tiny("tiny_gpt");
    let batch = Corpus::builtin().global_batch(0, 4, 64).unwrap();
    let weights = |clip| {
        let mut r = Reference::new(&model, &train(1e-2, clip)).unwrap();
        r.step(0, &batch);
        r.step(1, &batch);
        r.weights()
    };
    let free = weights(None);
    assert_eq!(
        free,
        weights(Some(1e6)),
        "a clip far above the norm changes nothing"
    );
    assert_ne!(
        free,
        weights(Some(1e-3)),
        "a clip far below the norm scales the step"
    );
}

/// Not a test of correctness: prints the time of one tiny_gpt forward+backward (one micro-batch,
/// 2 × 64 tokens) on one thread. `cargo test -p schedrun --release --test reference -- --ignored
/// --nocapture --test-threads=1 timing`.
#[test]
#[ignore]
fn timing_tiny_gpt_forward_backward() {
    for name in ["tiny_gpt", "tiny_llama"] {
        let model = common::tiny(name);
        let batch = Corpus::builtin().global_batch(0, 2, 64).unwrap();
        let mut r = Reference::new(&model, &train(1e-3, None)).unwrap();
        for i in 0..20 {
            r.step(i, &batch);
        }
        // The best of 10 rounds of 20: the least disturbed by other processes.
        let best = |f: &mut dyn FnMut()| {
            (0..10)
                .map(|_| {
                    let t = Instant::now();
                    (0..20).for_each(|_| f());
                    t.elapsed().as_secs_f64() / 20.0
                })
                .fold(f64::INFINITY, f64::min)
        };
        let mut i = 20;
        let per = best(&mut || {
            r.step(i, &batch);
            i += 1;
        });
        // Layer math only (no optimizer): the transformer block.
        let m = LayerMath::new(&model.layers[1], &model).unwrap();
        let p = schedrun::math::init_layer(&model.layers[1], &model, 0);
        let x = vec![0.1f32; m.input_elements()];
        let mut out = vec![0.0; m.output_elements()];
        let mut saved = vec![0.0; m.saved_elements()];
        let mut gi = vec![0.0; m.input_elements()];
        let mut gp = vec![0.0; m.params()];
        let block = best(&mut || {
            m.forward(&p, None, Input::Hidden(&x), &mut out, &mut saved);
            m.backward(
                &p,
                None,
                &saved,
                Input::Hidden(&x),
                SliceGrads {
                    output: &x,
                    input: Some(&mut gi),
                    params: &mut gp,
                    tied: None,
                },
            );
        });
        println!(
            "{name}: full step (fwd+bwd+adamw, 128 tokens) {:.3} ms; one block fwd+bwd {:.3} ms",
            per * 1e3,
            block * 1e3
        );
    }
}

/// Not a test of correctness: GFLOP/s of one GPT-2-small block (768 wide, 12 heads, 256 tokens)
/// forward+backward on one thread, to spot a slow path. `cargo test -p schedrun --release --test
/// reference -- --ignored --nocapture --test-threads=1 timing`.
#[test]
#[ignore]
fn timing_gpt2_block() {
    let model = common::model(
        "model g { dtype = fp32 optimizer = adamw seq_len = 256 micro_batch = 1\n\
         layer embed = embedding(vocab = 256, hidden = 768, positions = learned)\n\
         layer block[1] = transformer(hidden = 768, heads = 12, ffn = 3072)\n\
         layer head = lm_head(hidden = 768, vocab = 256, tied = true)\n}\n",
        "g",
    );
    let l = &model.layers[1];
    let m = LayerMath::new(l, &model).unwrap();
    let p = schedrun::math::init_layer(l, &model, 0);
    let x = vec![0.1f32; m.input_elements()];
    let mut out = vec![0.0; m.output_elements()];
    let mut saved = vec![0.0; m.saved_elements()];
    let mut gi = vec![0.0; m.input_elements()];
    let mut gp = vec![0.0; m.params()];
    let mut best = (f64::INFINITY, f64::INFINITY);
    for _ in 0..5 {
        let t = Instant::now();
        m.forward(&p, None, Input::Hidden(&x), &mut out, &mut saved);
        let f = t.elapsed().as_secs_f64();
        m.backward(
            &p,
            None,
            &saved,
            Input::Hidden(&x),
            SliceGrads {
                output: &x,
                input: Some(&mut gi),
                params: &mut gp,
                tied: None,
            },
        );
        best = (best.0.min(f), best.1.min(t.elapsed().as_secs_f64() - f));
    }
    let (t, s, h) = (256.0, 256.0, 768.0);
    let dense = 2.0 * t * (m.params() as f64);
    let attn = 2.0 * 2.0 * t * s / 2.0 * h; // QKᵀ and PV, causal half
    let gflops = |flop: f64, secs: f64| flop / secs / 1e9;
    println!(
        "gpt2 block, 256 tokens: forward {:.1} ms ({:.1} GFLOP/s), backward {:.1} ms ({:.1} GFLOP/s)",
        best.0 * 1e3,
        gflops(dense + attn, best.0),
        best.1 * 1e3,
        gflops(2.0 * dense + 2.5 * attn, best.1)
    );
}
