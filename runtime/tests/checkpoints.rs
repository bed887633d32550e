//! Checkpoints across schedules (`cli.md`, "schedrun"): a checkpoint written under ZeRO-3 resumes
//! under MiCS (hierarchical, across two nodes) and under DDP and continues the very trajectory of
//! an uninterrupted ZeRO-3 run; weights files round-trip exactly; files that do not fit the model
//! are refused with the tensor named.

mod common;

use schedc::{analyze, FsLoader, Job};
use schedrun::backend::cpu::CpuBackend;
use schedrun::backend::RunOptions;
use schedrun::checkpoint::{self, Contents};
use schedrun::data::Corpus;
use schedrun::train::{State, Trainer};
use std::path::{Path, PathBuf};

fn jobs() -> Vec<Job> {
    jobs_of("resume.sched")
}

fn jobs_of(file: &str) -> Vec<Job> {
    let p = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/inputs")
        .join(file);
    let a = analyze(&p, &FsLoader).unwrap();
    assert!(!a.has_errors(), "{}", a.render());
    a.jobs.clone()
}

fn trainer(job: &Job, state: &State) -> Trainer<CpuBackend> {
    let plan = common::plan_of(job);
    let backend = CpuBackend::new(plan.clone(), RunOptions::default());
    let mut t = Trainer::new(plan, backend, Corpus::builtin());
    t.load(state).unwrap();
    t
}

fn run(t: &mut Trainer<CpuBackend>, steps: u64) -> Vec<f64> {
    (0..steps)
        .map(|_| t.step(1e-3, None).unwrap().loss)
        .collect()
}

fn temp(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("schedrun-ckpt-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(name)
}

fn close(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

#[test]
fn a_zero3_checkpoint_continues_the_same_trajectory_under_mics_and_ddp() {
    let jobs = jobs();
    let zero3 = &jobs[0];
    let init = trainer(zero3, &State::default()).initial_state(0);
    let mut straight = trainer(zero3, &init);
    let want = run(&mut straight, 6);
    let want_state = straight.state().unwrap();

    let mut first = trainer(zero3, &init);
    assert_eq!(run(&mut first, 3), want[..3]);
    let path = temp("zero3.safetensors");
    let model = &zero3.model;
    checkpoint::save(&path, model, &first.state().unwrap(), Contents::Checkpoint).unwrap();

    for other in &jobs[1..] {
        let resumed = checkpoint::load(&path, model, Contents::Checkpoint).unwrap();
        assert_eq!(resumed.step, 3);
        let mut t = trainer(other, &resumed);
        let got = run(&mut t, 3);
        for (g, w) in got.iter().zip(&want[3..]) {
            assert!(
                ((g - w) / w).abs() <= 1e-5,
                "{}: resumed loss {g}, uninterrupted {w}",
                other.schedule.name
            );
        }
        let end = t.state().unwrap();
        assert_eq!(end.step, 6);
        for (a, b) in end.layers.iter().zip(&want_state.layers) {
            assert!(
                close(&a.params, &b.params) <= 1e-5,
                "{}",
                other.schedule.name
            );
            assert!(close(&a.m, &b.m) <= 1e-5, "{}", other.schedule.name);
            assert!(close(&a.v, &b.v) <= 1e-6, "{}", other.schedule.name);
        }
    }
}

/// A pipeline's ranks hold only their stage's layers; its checkpoint is the whole model all the
/// same: one written by 4 data-parallel ranks resumes on 2 stages of 2, and back, on the
/// trajectory of an uninterrupted run.
#[test]
fn a_checkpoint_moves_between_a_pipeline_and_data_parallel_ranks() {
    let jobs = jobs_of("resume_pipeline.sched");
    for (from, to) in [(&jobs[0], &jobs[1]), (&jobs[1], &jobs[0])] {
        let init = trainer(from, &State::default()).initial_state(0);
        let mut straight = trainer(from, &init);
        let want = run(&mut straight, 6);
        let mut first = trainer(from, &init);
        assert_eq!(run(&mut first, 3), want[..3]);
        let path = temp(&format!("{}.safetensors", from.schedule.name));
        checkpoint::save(
            &path,
            &from.model,
            &first.state().unwrap(),
            Contents::Checkpoint,
        )
        .unwrap();
        let resumed = checkpoint::load(&path, &to.model, Contents::Checkpoint).unwrap();
        let got = run(&mut trainer(to, &resumed), 3);
        for (g, w) in got.iter().zip(&want[3..]) {
            assert!(
                ((g - w) / w).abs() <= 1e-5,
                "{} -> {}: resumed loss {g}, uninterrupted {w}",
                from.schedule.name,
                to.schedule.name
            );
        }
    }
}

#[test]
fn weights_files_round_trip_and_misfits_are_refused() {
    let jobs = jobs();
    let job = &jobs[0];
    let t = trainer(job, &State::default());
    let init = t.initial_state(5);
    let path = temp("init.safetensors");
    checkpoint::save(&path, &job.model, &init, Contents::Weights).unwrap();
    let back = checkpoint::load(&path, &job.model, Contents::Weights).unwrap();
    for (a, b) in back.layers.iter().zip(&init.layers) {
        assert_eq!(a.params, b.params);
    }
    let e = checkpoint::load(&path, &job.model, Contents::Checkpoint).unwrap_err();
    assert!(
        matches!(e, checkpoint::CheckpointError::NotACheckpoint { .. }),
        "{e}"
    );
    assert!(e.to_string().contains("not a checkpoint"), "{e}");

    // tiny_llama's weights do not fit tiny_gpt.
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
    let llama = analyze(&root.join("schedules/tiny_cpu_schedules.sched"), &FsLoader)
        .unwrap()
        .jobs
        .into_iter()
        .find(|j| j.model.name == "tiny_llama")
        .unwrap();
    let other = temp("llama.safetensors");
    let t = trainer(&llama, &State::default());
    checkpoint::save(&other, &llama.model, &t.initial_state(0), Contents::Weights).unwrap();
    let e = checkpoint::load(&other, &job.model, Contents::Weights).unwrap_err();
    assert!(
        matches!(
            e,
            checkpoint::CheckpointError::Missing { .. } | checkpoint::CheckpointError::Shape { .. }
        ),
        "{e}"
    );

    std::fs::write(&other, b"not safetensors").unwrap();
    let e = checkpoint::load(&other, &job.model, Contents::Weights).unwrap_err();
    assert!(
        matches!(e, checkpoint::CheckpointError::Format { .. }),
        "{e}"
    );
    assert!(e.to_string().contains("not a safetensors file"), "{e}");
}
