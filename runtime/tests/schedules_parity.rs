//! The parity contract of `runtime.md`: every schedule of the tiny models, run on the CPU backend
//! with all its ranks, streams and collectives, gives the per-step losses and final weights of the
//! independent single-process reference trainer (`schedrun::reference`) on the same global batch,
//! within 1e-5 — and still does under the stress mode's random delays.

mod common;

use common::{assert_parity, reference, scheduled};
use schedc::{analyze, FsLoader, Job};
use schedrun::backend::RunOptions;
use std::time::Duration;

const STEPS: u64 = 20;

fn jobs(file: &str) -> Vec<Job> {
    let a = analyze(&common::schedules_dir().join(file), &FsLoader).unwrap();
    assert!(!a.has_errors(), "{}", a.render());
    a.jobs.clone()
}

#[test]
fn every_tiny_schedule_matches_the_single_process_reference() {
    let mut all = jobs("tiny_cpu.sched");
    all.extend(jobs("tiny_cpu_schedules.sched"));
    assert!(all.len() >= 10, "the tiny schedules went missing");
    for job in &all {
        let want = reference(job, STEPS);
        let got = scheduled(job, STEPS, RunOptions::default());
        assert_parity(job, &got, &want, "plain");
        assert!(
            want.0[STEPS as usize - 1] < want.0[0] * 0.9,
            "{}: the loss does not fall",
            job.schedule.name
        );
    }
}

/// A learning-rate schedule (warmup, then cosine or linear decay to a floor) is applied alike by
/// the backend's steps and the reference, and changes the run (the losses move away from the
/// constant rate's).
#[test]
fn a_learning_rate_schedule_matches_the_reference() {
    let base = jobs("tiny_cpu.sched").remove(0);
    let constant = reference(&base, STEPS);
    for decay in [sched_ir::job::Decay::Cosine, sched_ir::job::Decay::Linear] {
        let mut job = base.clone();
        let t = &mut job.schedule.train;
        t.warmup = 3;
        t.decay = decay;
        t.min_lr = t.lr / 10.0;
        t.steps = STEPS;
        let want = reference(&job, STEPS);
        let got = scheduled(&job, STEPS, RunOptions::default());
        assert_parity(&job, &got, &want, decay.name());
        let apart = want
            .0
            .iter()
            .zip(&constant.0)
            .any(|(a, b)| (a - b).abs() > 1e-3 * b);
        assert!(apart, "{}: the schedule changes nothing", decay.name());
    }
}

/// The optimizer's settings (`weight_decay`, `betas`, `eps`) reach the backend's update as the
/// reference's, and change the run.
#[test]
fn optimizer_settings_match_the_reference() {
    let base = jobs("tiny_cpu.sched").remove(0);
    assert_eq!(base.model.optimizer, sched_ir::job::Optimizer::AdamW);
    let defaults = reference(&base, STEPS);
    let mut job = base.clone();
    let t = &mut job.schedule.train;
    t.weight_decay = Some(0.3);
    t.betas = Some([0.8, 0.99]);
    t.eps = Some(1e-6);
    let want = reference(&job, STEPS);
    let got = scheduled(&job, STEPS, RunOptions::default());
    assert_parity(&job, &got, &want, "optimizer settings");
    let apart = want
        .0
        .iter()
        .zip(&defaults.0)
        .any(|(a, b)| (a - b).abs() > 1e-4 * b);
    assert!(apart, "the settings change nothing");
}

/// The model's `norm_eps` and `rope_base` reach the backend's norms and rotary tables as the
/// reference's, and change the run (tiny_llama has both RMS norms and rotary positions; tiny_gpt
/// layer norms).
#[test]
fn norm_epsilon_and_rotary_base_match_the_reference() {
    let all = jobs("tiny_cpu_schedules.sched");
    for name in ["tiny_zero2_single_stream", "tiny_mics2"] {
        let base = all
            .iter()
            .find(|j| j.schedule.name == name)
            .unwrap()
            .clone();
        let defaults = reference(&base, 4);
        let mut job = base.clone();
        let mut model = (*job.model).clone();
        model.norm_eps = Some(0.05);
        model.rope_base = Some(100.0);
        job.model = model.into();
        let want = reference(&job, 4);
        let got = scheduled(&job, 4, RunOptions::default());
        assert_parity(&job, &got, &want, "norm_eps and rope_base");
        let apart = want
            .0
            .iter()
            .zip(&defaults.0)
            .any(|(a, b)| (a - b).abs() > 1e-4 * b);
        assert!(apart, "{name}: the settings change nothing");
    }
}

#[test]
fn parity_holds_under_jitter() {
    let mut all = jobs("tiny_cpu.sched");
    all.extend(jobs("tiny_cpu_schedules.sched"));
    for job in &all {
        let want = reference(job, 3);
        let options = RunOptions {
            jitter: Some(Duration::from_micros(300)),
            jitter_seed: 7,
            ..RunOptions::default()
        };
        let got = scheduled(job, 3, options);
        assert_parity(job, &got, &want, "jitter");
    }
}
