//! Helpers shared by the runtime's tests: models from sched text or the repository's schedules,
//! seeded random buffers, and training runs (the single-process reference and a plan on the CPU
//! backend) that parity tests compare.
#![allow(dead_code)]

use sched_ir::job::{Job, Model};
use schedc::{analyze, FsLoader, MemLoader};
use schedrun::backend::cpu::CpuBackend;
use schedrun::backend::{Backend, RunOptions};
use schedrun::data::Corpus;
use schedrun::plan::Plan;
use schedrun::reference::Reference;
use schedrun::train::Trainer;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// The models of a sched source held in memory (every model it defines).
pub fn models(text: &str) -> Vec<Model> {
    let loader = MemLoader::default()
        .in_dir("/mem")
        .with("/mem/m.sched", text);
    let a = analyze(Path::new("/mem/m.sched"), &loader).expect("readable");
    assert!(!a.has_errors(), "{}", a.render());
    a.models.iter().map(|m| (**m).clone()).collect()
}

pub fn model(text: &str, name: &str) -> Model {
    models(text)
        .into_iter()
        .find(|m| m.name == name)
        .unwrap_or_else(|| panic!("no model {name}"))
}

pub fn schedules_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../schedules")
}

/// The job of `schedules/tiny_cpu.sched` (tiny_gpt under ZeRO-3 on 4 ranks).
pub fn tiny_job() -> Job {
    let a = analyze(&schedules_dir().join("tiny_cpu.sched"), &FsLoader).expect("readable");
    assert!(!a.has_errors(), "{}", a.render());
    a.select(None).expect("one schedule").clone()
}

/// `tiny_gpt` or `tiny_llama` from `schedules/models/tiny.sched`.
pub fn tiny(name: &str) -> Model {
    let a = analyze(&schedules_dir().join("models/tiny.sched"), &FsLoader).expect("readable");
    assert!(!a.has_errors(), "{}", a.render());
    a.models
        .iter()
        .find(|m| m.name == name)
        .map(|m| (**m).clone())
        .unwrap_or_else(|| panic!("no model {name}"))
}

/// Per-step losses and final weights (`LAYER.TENSOR` order) of the single-process reference
/// trainer on the job's global batch (a pipeline's: its data-parallel ranks × micro-batches).
pub fn reference(job: &Job, steps: u64) -> (Vec<f64>, Vec<f32>) {
    let corpus = Corpus::builtin();
    let model = &job.model;
    // A pipeline's (or a tensor group's) global batch is its data-parallel ranks' (its `ddp`
    // twin's).
    let d = sched_ir::Layout::of(job).dp_size() as usize;
    let sequences = d * job.schedule.micro_steps as usize * model.micro_batch as usize;
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

/// The job compiled and made a plan (not verified again: `compile` already proved it); a refused
/// program panics with the verifier's errors.
pub fn plan_of(job: &Job) -> Arc<Plan> {
    let program = schedc::compile(job).unwrap_or_else(|e| {
        let detail = match &e {
            schedc::pipeline::CompileError::Verify(r) => {
                let errors: Vec<String> = r.errors.iter().map(|e| e.to_string()).collect();
                errors.join("\n")
            }
            _ => String::new(),
        };
        panic!("{}: {e}\n{detail}", job.schedule.name)
    });
    Arc::new(Plan::new(program, job.clone()).unwrap())
}

/// `plan` on `backend` from the job's seeded initial state: per-step losses over `steps` steps at
/// the job's learning rate and clipping, the final weights, and the trainer.
pub fn train<B: Backend>(
    plan: Arc<Plan>,
    backend: B,
    steps: u64,
) -> (Vec<f64>, Vec<f32>, Trainer<B>) {
    let train = plan.job.schedule.train.clone();
    let mut t = Trainer::new(plan, backend, Corpus::builtin());
    let init = t.initial_state(train.seed);
    t.load(&init).unwrap();
    let losses = (0..steps)
        .map(|_| {
            let lr = train.lr_at(train.lr, t.steps_done());
            t.step(lr, train.clip).unwrap().loss
        })
        .collect();
    let weights = t.state().unwrap().into_params();
    (losses, weights, t)
}

/// [`reference`]'s figures with the job compiled and run on the CPU backend.
pub fn scheduled(job: &Job, steps: u64, options: RunOptions) -> (Vec<f64>, Vec<f32>) {
    let plan = plan_of(job);
    let (losses, weights, _) = train(plan.clone(), CpuBackend::new(plan, options), steps);
    (losses, weights)
}

/// `got` matches `want` (losses, weights) as runtime.md's parity contract asks: within 1e-5
/// relative per loss and absolute per weight in fp32, 1e-2 with a bf16/fp16 model.
pub fn assert_parity(
    job: &Job,
    got: &(Vec<f64>, Vec<f32>),
    want: &(Vec<f64>, Vec<f32>),
    what: &str,
) {
    let name = &job.schedule.name;
    let tolerance = if job.model.dtype == sched_ir::job::Dtype::Fp32 {
        1e-5
    } else {
        1e-2
    };
    for (i, (g, w)) in got.0.iter().zip(&want.0).enumerate() {
        assert!(
            ((g - w) / w).abs() <= tolerance,
            "{name} ({what}): step {} loss {g} vs the reference's {w}",
            i + 1
        );
    }
    assert_eq!(got.1.len(), want.1.len(), "{name} ({what}): weight count");
    let (worst, at) = got
        .1
        .iter()
        .zip(&want.1)
        .enumerate()
        .map(|(i, (g, w))| ((g - w).abs(), i))
        .fold((0.0f32, 0), |a, b| if b.0 > a.0 { b } else { a });
    assert!(
        worst <= tolerance as f32,
        "{name} ({what}): final weight {at} differs by {worst}"
    );
}
