//! Pipeline parity (parallel spec §5): a pipelined tiny model, compiled, proved and run on the
//! CPU backend with real transfers between its stages' threads, trains to the losses and
//! weights of the single-process reference on the global batch of its `ddp` twin (the same
//! model, seed and data on d ranks with `micro_steps` = m: micro-batch i of data-parallel rank
//! j is the twin's micro-step i on rank j), within 1e-5, also under the stress mode's delays.
//!
//! Two sets: the examples users start from (`schedules/tiny_pipeline*.sched`, through the
//! language), and jobs built here from the tiny ZeRO-3 job with the pipeline set directly, which
//! pin the lowering, the proofs and the runtime independently of the language.

mod common;

use common::{assert_parity, plan_of, reference, train};
use sched_ir::job::{Job, Mesh, Pipeline, PipelineSchedule, Shard};
use schedrun::backend::cpu::CpuBackend;
use schedrun::backend::RunOptions;
use std::time::Duration;

const STEPS: u64 = 20;

/// tiny_llama on 4 CPU ranks in `stages` stages of `chunks` (layers per chunk, 4 layers in
/// all), `m` micro-batches, each stage's data-parallel ranks sharded `a x 1` for params, grads
/// and optimizer as given.
fn job(schedule: PipelineSchedule, stages: u32, chunks: &[u32], m: u32, shard: [u32; 3]) -> Job {
    let mut job = common::tiny_job();
    job.model = std::sync::Arc::new(common::tiny("tiny_llama"));
    let s = &mut job.schedule;
    s.name = format!(
        "tiny_{}_p{stages}_v{}_m{m}_{}{}{}",
        schedule.name(),
        chunks.len() as u32 / stages,
        shard[0],
        shard[1],
        shard[2]
    );
    s.micro_steps = m;
    let mesh = |a| Mesh { intra: a, inter: 1 };
    s.shard = Shard {
        params: mesh(shard[0]),
        grads: mesh(shard[1]),
        optimizer: mesh(shard[2]),
    };
    let v = chunks.len() as u32 / stages;
    s.pipeline = Pipeline {
        stages,
        virtual_stages: v,
        schedule,
        chunks: chunks.to_vec(),
        order: sched_ir::orders::generate(schedule, stages, v, m),
    };
    job
}

/// 3 steps under the stress mode's delays (300 µs, seeded), against the reference.
fn check_jittered(job: &Job, seed: u64) {
    let options = RunOptions {
        jitter: Some(Duration::from_micros(300)),
        jitter_seed: seed,
        ..RunOptions::default()
    };
    check(job, options, 3, "jitter");
}

fn check(job: &Job, options: RunOptions, steps: u64, what: &str) {
    let want = reference(job, steps);
    let plan = plan_of(job);
    let (losses, weights, _) = train(plan.clone(), CpuBackend::new(plan, options), steps);
    assert_parity(job, &(losses, weights), &want, what);
}

/// Every schedule of the pipeline examples (`schedules/tiny_pipeline*.sched`).
fn examples() -> Vec<Job> {
    let mut out = vec![];
    for f in ["tiny_pipeline.sched", "tiny_pipeline_schedules.sched"] {
        let path = common::schedules_dir().join(f);
        let a = schedc::analyze(&path, &schedc::FsLoader).unwrap();
        assert!(!a.has_errors(), "{}", a.render());
        out.extend(a.jobs.iter().cloned());
    }
    assert!(out.len() >= 6, "the pipeline examples went missing");
    out
}

#[test]
fn the_pipeline_examples_match_the_reference() {
    for job in examples() {
        check(&job, RunOptions::default(), STEPS, "plain");
        check_jittered(&job, 5);
    }
}

#[path = "../../compiler/tests/sweep/mod.rs"]
mod sweep;

/// Every fourth schedule of the compiler's pipeline sweep (8-layer model, 8 and 2 x 4 ranks,
/// every schedule, preset and switch), 6 steps each.
#[test]
fn a_sample_of_the_sweep_matches_the_reference() {
    let loader = schedc::MemLoader::default().with("/sweep/s.sched", &sweep::text());
    let a = schedc::analyze(std::path::Path::new("/sweep/s.sched"), &loader).unwrap();
    assert!(!a.has_errors(), "{}", a.render());
    let sample: Vec<&Job> = a.jobs.iter().step_by(4).collect();
    assert!(sample.len() >= 12);
    for job in sample {
        check(job, RunOptions::default(), 6, "sweep");
    }
}

fn jobs() -> Vec<Job> {
    use PipelineSchedule::*;
    vec![
        job(Gpipe, 2, &[2, 2], 4, [1, 1, 1]),
        job(OneFOneB, 2, &[2, 2], 4, [1, 1, 1]),
        job(OneFOneB, 4, &[1, 1, 1, 1], 4, [1, 1, 1]),
        job(Interleaved1F1B, 2, &[1, 1, 1, 1], 4, [1, 1, 1]),
        job(OneFOneB, 2, &[1, 3], 2, [1, 1, 2]),
        job(OneFOneB, 2, &[2, 2], 4, [1, 2, 2]),
        job(Gpipe, 2, &[3, 1], 2, [2, 2, 2]),
        job(Interleaved1F1B, 2, &[1, 1, 1, 1], 2, [2, 2, 2]),
        job(ZbH1, 2, &[2, 2], 4, [1, 1, 1]),
        job(ZbH1, 4, &[1, 1, 1, 1], 4, [1, 1, 1]),
        job(Zbv, 2, &[1, 1, 1, 1], 4, [1, 1, 1]),
        job(Zbv, 2, &[1, 1, 1, 1], 2, [2, 2, 2]),
    ]
}

/// ZB-V's V puts the first and the last chunk on stage 0, so a head tied to the embedding stays
/// on one stage: tiny_gpt (tied) as ZB-V, with ddp and ZeRO-1 (the head reads the embedding
/// itself) and ZeRO-2 and -3 (the head keeps a replica on the same ranks, summed with the
/// embedding's gradient by a local add and copy).
#[test]
fn a_tied_head_pipelines_as_zbv() {
    for shard in [[1, 1, 1], [1, 1, 2], [1, 2, 2], [2, 2, 2]] {
        let mut j = job(PipelineSchedule::Zbv, 2, &[1, 1, 1, 1], 4, shard);
        j.model = std::sync::Arc::new(common::tiny("tiny_gpt"));
        j.schedule.name = format!("tiny_gpt_zbv_{}{}{}", shard[0], shard[1], shard[2]);
        check(&j, RunOptions::default(), STEPS, "plain");
    }
}

/// A head tied to an embedding on another stage keeps a replica of it, whose gradient the
/// embedding group all-reduces with the embedding's (Megatron's), and gradient clipping sums its
/// norm over every stage: tiny_gpt (tied) across 2 and 4 stages, with every ZeRO stage, with
/// and without clipping (a limit low enough to clip every step, with SGD, whose steps scale with
/// the clipped gradient: AdamW's barely do, so a wrong norm would hide in its epsilon), also
/// under jitter.
fn tied_and_clipped() -> Vec<Job> {
    use PipelineSchedule::*;
    let mut out = vec![];
    let cases = [
        (job(OneFOneB, 2, &[2, 2], 4, [1, 1, 1]), None),
        (job(OneFOneB, 2, &[2, 2], 4, [1, 1, 2]), Some(0.05)),
        (job(Gpipe, 2, &[3, 1], 2, [1, 2, 2]), None),
        (job(ZbH1, 2, &[2, 2], 4, [2, 2, 2]), Some(0.05)),
        (job(Interleaved1F1B, 2, &[1, 1, 1, 1], 4, [2, 2, 2]), None),
        (job(OneFOneB, 4, &[1, 1, 1, 1], 4, [1, 1, 1]), Some(0.05)),
        (job(Zbv, 2, &[1, 1, 1, 1], 4, [1, 1, 2]), Some(0.05)),
        (job(Zbv, 2, &[1, 1, 1, 1], 4, [2, 2, 2]), Some(0.05)),
    ];
    for (mut j, clip) in cases {
        let mut model = common::tiny("tiny_gpt");
        if clip.is_some() {
            model.optimizer = sched_ir::job::Optimizer::Sgd;
            j.schedule.train.lr = 0.5;
        }
        j.model = std::sync::Arc::new(model);
        j.schedule.train.clip = clip;
        j.schedule.name = format!(
            "tiny_gpt_{}{}",
            j.schedule.name.trim_start_matches("tiny_"),
            if clip.is_some() { "_clip" } else { "" }
        );
        out.push(j);
    }
    out
}

#[test]
fn tied_heads_and_clipping_across_stages_match_the_reference() {
    for job in tied_and_clipped() {
        if job.schedule.train.clip.is_some() {
            // The limit clips: the reference's losses move away from the unclipped run's.
            let mut unclipped = job.clone();
            unclipped.schedule.train.clip = None;
            let (a, b) = (reference(&job, 4).0, reference(&unclipped, 4).0);
            let apart = a
                .iter()
                .zip(&b)
                .any(|(x, y)| (x - y).abs() > 1e-3 * y.abs());
            assert!(
                apart,
                "{}: clipping changes nothing: {a:?} {b:?}",
                job.schedule.name
            );
        }
        check(&job, RunOptions::default(), STEPS, "plain");
        check_jittered(&job, 7);
    }
}

#[test]
fn pipelines_match_the_reference() {
    for job in jobs() {
        check(&job, RunOptions::default(), STEPS, "plain");
    }
}

#[test]
fn pipelines_match_the_reference_under_jitter() {
    for job in jobs() {
        check_jittered(&job, 11);
    }
}
