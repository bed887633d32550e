//! The parity contract of `runtime.md`: every schedule of the tiny models, run on the CPU backend
//! with all its ranks, streams and collectives, gives the per-step losses and final weights of the
//! independent single-process reference trainer (`schedrun::reference`) on the same global batch,
//! within 1e-5 — and still does under the stress mode's random delays.

use schedc::{analyze, FsLoader, Job};
use schedrun::backend::cpu::CpuBackend;
use schedrun::backend::RunOptions;
use schedrun::data::Corpus;
use schedrun::plan::Plan;
use schedrun::reference::Reference;
use schedrun::train::Trainer;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

const STEPS: u64 = 20;

fn jobs(file: &str) -> Vec<Job> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
    let a = analyze(&root.join("schedules").join(file), &FsLoader).unwrap();
    assert!(!a.has_errors(), "{}", a.render());
    a.jobs.clone()
}

/// Per-step losses and final weights (`LAYER.TENSOR` order) of the reference trainer.
fn reference(job: &Job, steps: u64) -> (Vec<f64>, Vec<f32>) {
    let corpus = Corpus::builtin();
    let model = &job.model;
    let sequences =
        job.ranks() as usize * job.schedule.micro_steps as usize * model.micro_batch as usize;
    let mut r = Reference::new(model, &job.schedule.train).unwrap();
    let losses = (0..steps)
        .map(|t| {
            let batch = corpus
                .global_batch(t, sequences, model.seq_len as usize)
                .unwrap();
            r.step(t, &batch)
        })
        .collect();
    let weights = r.weights().into_iter().flat_map(|(_, w)| w).collect();
    (losses, weights)
}

/// The same with the plan on the CPU backend.
fn scheduled(job: &Job, steps: u64, options: RunOptions) -> (Vec<f64>, Vec<f32>) {
    let (program, _) = schedc::compile(job).unwrap();
    let plan = Arc::new(Plan::unverified(program, job.clone()).unwrap());
    let backend = CpuBackend::new(plan.clone(), options);
    let mut t = Trainer::new(plan, backend, Corpus::builtin());
    let init = t.initial_state(job.schedule.train.seed);
    t.load(&init).unwrap();
    let train = &job.schedule.train;
    let losses = (0..steps)
        .map(|_| t.step(train.lr, train.clip).unwrap().loss)
        .collect();
    let weights = t
        .state()
        .unwrap()
        .layers
        .into_iter()
        .flat_map(|l| l.params)
        .collect();
    (losses, weights)
}

fn assert_parity(job: &Job, got: &(Vec<f64>, Vec<f32>), want: &(Vec<f64>, Vec<f32>), what: &str) {
    let name = &job.schedule.name;
    for (i, (g, w)) in got.0.iter().zip(&want.0).enumerate() {
        assert!(
            ((g - w) / w).abs() <= 1e-5,
            "{name} ({what}): step {} loss {g} vs the reference's {w}",
            i + 1
        );
    }
    assert_eq!(got.1.len(), want.1.len());
    let (worst, at) = got
        .1
        .iter()
        .zip(&want.1)
        .enumerate()
        .map(|(i, (g, w))| ((g - w).abs(), i))
        .fold((0.0f32, 0), |a, b| if b.0 > a.0 { b } else { a });
    assert!(
        worst <= 1e-5,
        "{name} ({what}): final weight {at} differs by {worst}"
    );
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
