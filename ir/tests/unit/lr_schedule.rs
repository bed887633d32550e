//! The learning-rate schedule (`Train::lr_at`) against values worked out by hand from nanoGPT's
//! and Hugging Face's formulas: linear warmup to `lr`, then constant, linear or half-cosine decay
//! to `min_lr` at the last step.

use super::*;

fn train(steps: u64, warmup: u64, decay: Decay, min_lr: f64) -> Train {
    Train {
        steps,
        lr: 1.0,
        seed: 0,
        data: None,
        clip: None,
        checkpoints: None,
        save_every: None,
        keep: None,
        warmup,
        decay,
        min_lr,
        weight_decay: None,
        betas: None,
        eps: None,
        val: None,
        eval_every: None,
        eval_batches: None,
    }
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() < 1e-12
}

#[test]
fn constant_without_warmup_is_the_base_rate() {
    let t = train(10, 0, Decay::Constant, 0.0);
    assert!((0..20).all(|s| t.lr_at(0.5, s) == 0.5));
}

#[test]
fn warmup_rises_linearly_to_the_base_rate() {
    let t = train(100, 4, Decay::Constant, 0.0);
    let got: Vec<f64> = (0..6).map(|s| t.lr_at(2.0, s)).collect();
    assert_eq!(got, [0.5, 1.0, 1.5, 2.0, 2.0, 2.0]);
}

#[test]
fn cosine_decays_to_the_floor_through_the_midpoint() {
    // 4 warmup steps, 100 in all: the decay spans steps 4..100 (96 steps).
    let t = train(100, 4, Decay::Cosine, 0.1);
    assert!(close(t.lr_at(1.0, 4), 1.0));
    assert!(
        close(t.lr_at(1.0, 4 + 48), 0.55),
        "half way: (lr + min) / 2"
    );
    assert!(close(
        t.lr_at(1.0, 4 + 24),
        0.1 + 0.9 * 0.5 * (1.0 + (std::f64::consts::PI / 4.0).cos())
    ));
    assert!(close(t.lr_at(1.0, 100), 0.1), "at the end: the floor");
    assert!(
        close(t.lr_at(1.0, 500), 0.1),
        "past the end (a longer resumed run): the floor"
    );
}

#[test]
fn linear_decays_to_the_floor() {
    let t = train(10, 0, Decay::Linear, 0.0);
    let got: Vec<f64> = (0..=10).map(|s| t.lr_at(1.0, s)).collect();
    let want: Vec<f64> = (0..=10).map(|s| 1.0 - s as f64 / 10.0).collect();
    assert!(got.iter().zip(&want).all(|(a, b)| close(*a, *b)), "{got:?}");
}
