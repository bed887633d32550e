//! The figures of a simulated step (`cli.md`, "`schedc simulate --json`").
//!
//! - `step_time_s`: from the first op to the last op's end on any stream of any rank.
//! - `compute_s`: time during which at least one compute op runs on the rank (the union of their
//!   intervals: compute ops sit mostly on the compute stream, the optimizer update and copies may
//!   sit on others).
//! - `exposed_comm_s`: `step_time_s − compute_s`, the time the rank computes nothing because it is
//!   waiting for, or running, communication that nothing overlaps.
//! - `streams[].busy_s`: the sum of its ops' durations; a collective counts from the moment its
//!   whole group has reached it (waiting for late members is idle time).
//! - `mfu`, `tflops_per_gpu`: model FLOPs only ([`super::cost::model_flops_per_step`]);
//!   `tokens_per_gpu_per_s`: tokens one rank processes per step over the step time.
//! - `peak_memory_bytes`: the memory plan's arena (`arena_bytes`), `fits` when it is at most
//!   `gpu_memory`.
//!
//! Per-rank figures are those of rank 0's class; every compiled schedule without a pipeline has
//! only one class.
//!
//! **Pipelines** (beyond cli.md, only when the schedule has p > 1 stages). Each stage's figures
//! are those of its first rank's class (one class per stage for compiled schedules):
//! - `stages[].busy_s`: the stage's compute time, the union of its compute ops' intervals (as
//!   `compute_s`: layer math, the loss, the update, whatever stream they run on; never its
//!   sends, receives or collectives);
//! - `stages[].bubble`: `1 − busy_s / step_time_s`, the idle share of the stage's compute over the
//!   step (its tensor groups' all-reduces, which run on the compute stream between a layer's
//!   phases, count as busy there, not as idle); `bubble`, their mean over stages. For uniform stages and free links it is the papers'
//!   (p−1)/(m+p−1) (`gpipe`, `1f1b`) or (p−1)/(v·m+p−1) (`interleaved_1f1b`), plus the share of
//!   the step the update and the loss take from no stage's busy time, which is small;
//! - `compute_s` is the mean of the stages' `busy_s` and `exposed_comm_s` the rest of the step,
//!   so it holds the bubble as well as communication nothing hides;
//! - `streams[]` lists every stage's streams, each with its `stage`, timed on that stage;
//! - MFU counts the model's FLOPs over the data-parallel ranks (a micro-batch passes through
//!   every stage once), and `tokens_per_gpu_per_s` is the step's tokens over all ranks: a
//!   pipeline's m micro-batches over its p ranks.
//!
//! Beyond cli.md, `ranges` ([`SimRanges`]) gives what the model is unsure of: the contention
//! factor's default and published range, and each figure's least and greatest value over the
//! simulations at both ends of that range (the figure at the default lies between them).

use super::cost::model_flops_per_step;
use super::engine::{RankTimeline, Timeline};
use cranelift_entity::EntityRef;
use sched_ir::ir::{OpKind, OpRole, Program};
use sched_ir::job::Job;
use serde::{Deserialize, Serialize};

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct SimReport {
    pub schedule: String,
    pub step_time_s: f64,
    pub compute_s: f64,
    pub exposed_comm_s: f64,
    pub mfu: f64,
    pub tflops_per_gpu: f64,
    pub tokens_per_gpu_per_s: f64,
    pub peak_memory_bytes: u64,
    pub fits: bool,
    pub streams: Vec<StreamBusy>,
    /// Beyond cli.md: the GPU memory `fits` compares against.
    pub gpu_memory_bytes: u64,
    /// Beyond cli.md: ranks of the schedule, and how many distinct timelines were simulated.
    pub ranks: u32,
    pub simulated_ranks: u32,
    /// Beyond cli.md: each figure's range under the model's uncertain contention factor (absent
    /// from screening simulations and from reports read back without it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ranges: Option<SimRanges>,
    /// Beyond cli.md, with pipeline stages only: the mean over stages of each stage's bubble.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bubble: Option<f64>,
    /// Beyond cli.md, with pipeline stages only: each stage's compute time and bubble.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub stages: Vec<StageBusy>,
}

/// One pipeline stage's compute over the step (see the module doc).
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct StageBusy {
    pub stage: u32,
    /// Time during which the stage runs some compute op.
    pub busy_s: f64,
    /// `1 − busy_s / step_time_s`.
    pub bubble: f64,
}

/// The figures of a step over the contention factor's range: each `[least, greatest]`.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct SimRanges {
    /// The compute slowdown per overlapping collective: the default the figures use, and the
    /// range simulated (`sim::cost::CONTENTION`, `CONTENTION_RANGE`).
    pub contention: f64,
    pub contention_range: [f64; 2],
    pub step_time_s: [f64; 2],
    pub compute_s: [f64; 2],
    pub exposed_comm_s: [f64; 2],
    pub mfu: [f64; 2],
    pub tflops_per_gpu: [f64; 2],
    pub tokens_per_gpu_per_s: [f64; 2],
}

impl SimRanges {
    /// The ranges of `at_default`'s figures over it and the simulations at the range's `ends`.
    pub fn new(
        at_default: &SimReport,
        ends: &[SimReport],
        contention: f64,
        (low, high): (f64, f64),
    ) -> Self {
        let span = |f: fn(&SimReport) -> f64| {
            let mut r = [f(at_default); 2];
            for e in ends {
                r[0] = r[0].min(f(e));
                r[1] = r[1].max(f(e));
            }
            r
        };
        SimRanges {
            contention,
            contention_range: [low, high],
            step_time_s: span(|r| r.step_time_s),
            compute_s: span(|r| r.compute_s),
            exposed_comm_s: span(|r| r.exposed_comm_s),
            mfu: span(|r| r.mfu),
            tflops_per_gpu: span(|r| r.tflops_per_gpu),
            tokens_per_gpu_per_s: span(|r| r.tokens_per_gpu_per_s),
        }
    }
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct StreamBusy {
    pub name: String,
    pub busy_s: f64,
    /// The pipeline stage that runs the stream; absent without a pipeline.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stage: Option<u32>,
}

/// The timeline of `stage`'s first rank (its class's representative): rank 0's without a pipeline.
pub fn stage_timeline<'a>(
    program: &Program,
    timeline: &'a Timeline,
    stage: u32,
) -> &'a RankTimeline {
    let first = program.layout.rank_of(stage, 0, 0);
    timeline
        .ranks
        .iter()
        .find(|r| r.rank == first)
        .unwrap_or(&timeline.ranks[0])
}

/// The union of the intervals of `rank`'s compute ops on `stage`'s streams, in seconds; with
/// `tensor`, also of its tensor groups' all-reduces (they run on the compute stream, which is
/// busy with them, not idle).
fn compute_seconds(program: &Program, rank: &RankTimeline, stage: u32, tensor: bool) -> f64 {
    let mut compute: Vec<(f64, f64)> = vec![];
    for (id, op) in program.ops.iter() {
        let (s, e) = (rank.start[id.index()], rank.end[id.index()]);
        let here = program.streams[op.stream].stage == stage;
        let counts = matches!(op.kind, OpKind::Compute(_)) || (tensor && op.role == OpRole::Tensor);
        if here && counts && e > s {
            compute.push((s, e));
        }
    }
    compute.sort_by(|a, b| a.0.total_cmp(&b.0));
    let (mut compute_s, mut reach) = (0.0, f64::NEG_INFINITY);
    for (s, e) in compute {
        let s = s.max(reach);
        if e > s {
            compute_s += e - s;
            reach = e;
        }
    }
    compute_s
}

pub fn report(program: &Program, job: &Job, timeline: &Timeline) -> SimReport {
    let step = timeline.step_time_s;
    let stages = program.layout.stages.max(1);
    let pipelined = stages > 1;
    let mut busy = vec![0.0; program.streams.len()];
    let mut per_stage = vec![];
    for stage in 0..stages {
        let rank = stage_timeline(program, timeline, stage);
        for (id, op) in program.ops.iter() {
            if program.streams[op.stream].stage == stage {
                busy[op.stream.index()] += rank.end[id.index()] - rank.start[id.index()];
            }
        }
        let busy_s = compute_seconds(program, rank, stage, false);
        // The bubble: the compute stream idle, neither computing nor summing a tensor group's
        // partials.
        let stream_busy = compute_seconds(program, rank, stage, true);
        let bubble = if step > 0.0 {
            1.0 - stream_busy / step
        } else {
            0.0
        };
        per_stage.push(StageBusy {
            stage,
            busy_s,
            bubble,
        });
    }
    let compute_s = if pipelined {
        per_stage.iter().map(|s| s.busy_s).sum::<f64>() / f64::from(stages)
    } else {
        per_stage[0].busy_s
    };
    let ranks = f64::from(program.ranks().max(1));
    let flops = model_flops_per_step(job);
    let per_gpu = if step > 0.0 {
        flops / (step * ranks)
    } else {
        0.0
    };
    let m = &job.model;
    // One rank's share of its micro-batches: a micro-batch passes through p stages and is
    // shared by the t ranks of a tensor group.
    let mut tokens = (m.micro_batch * m.seq_len) as f64 * f64::from(program.micro_steps);
    if pipelined {
        tokens /= f64::from(stages);
    }
    tokens /= f64::from(program.layout.tensor.max(1));
    let bubble =
        pipelined.then(|| per_stage.iter().map(|s| s.bubble).sum::<f64>() / f64::from(stages));
    SimReport {
        schedule: program.schedule.clone(),
        step_time_s: step,
        compute_s,
        exposed_comm_s: (step - compute_s).max(0.0),
        mfu: per_gpu / job.cluster.peak_flops,
        tflops_per_gpu: per_gpu / 1e12,
        tokens_per_gpu_per_s: if step > 0.0 { tokens / step } else { 0.0 },
        peak_memory_bytes: program.arena_bytes,
        fits: program.arena_bytes <= job.cluster.gpu_memory,
        streams: program
            .streams
            .iter()
            .map(|(id, s)| StreamBusy {
                name: s.role.name().to_string(),
                busy_s: busy[id.index()],
                stage: pipelined.then_some(s.stage),
            })
            .collect(),
        gpu_memory_bytes: job.cluster.gpu_memory,
        ranks: program.ranks(),
        simulated_ranks: timeline.ranks.len() as u32,
        ranges: None,
        bubble,
        stages: if pipelined { per_stage } else { vec![] },
    }
}
