//! The simulator: predicts how long one optimizer step of a compiled program takes, and why.
//!
//! # Design
//!
//! [`cost`] prices every op alone: compute from exact per-layer FLOPs and memory traffic at the
//! cluster's sustained rates, collectives by the α–β model of ring (and tree) algorithms over the
//! two link classes of the cluster, or by `measured` tables where given. [`engine`] then executes
//! the [`ir::Program`](crate::ir::Program) as the hardware would: streams in issue order, event
//! waits, collectives that start only when their whole group has arrived, and overlapping
//! collectives sharing the GPU's intra-node link and the node's network. Nothing else orders or
//! overlaps ops, so the simulated overlap is exactly what the compiler's streams and events allow.
//!
//! The program is SPMD: [`classes`] partitions the ranks into classes whose timelines are provably
//! identical, and the engine runs one representative per class (one, for every compiled schedule),
//! so the cost is that of one rank's ops however many ranks there are. [`report`] turns the
//! timeline into cli.md's figures and [`trace`] into a Chrome trace.
//!
//! The program must be verified (it is, coming from [`crate::compile`] or `schedc verify`): the
//! engine assumes it cannot deadlock.

pub mod classes;
pub mod cost;
pub mod engine;
pub mod report;
pub mod trace;

pub use cost::{model_flops_per_step, CostModel};
pub use report::{SimReport, StreamBusy};
pub use trace::Trace;

use crate::ir::Program;
use crate::job::Job;

/// Simulates one step of `program` (compiled from `job`).
pub fn simulate(program: &Program, job: &Job) -> SimReport {
    let timeline = run(program, job);
    report::report(program, job, &timeline)
}

/// [`simulate`], with the Chrome trace of the step.
pub fn simulate_traced(program: &Program, job: &Job) -> (SimReport, Trace) {
    let timeline = run(program, job);
    (
        report::report(program, job, &timeline),
        trace::emit_trace(program, &timeline),
    )
}

/// The engine's timeline of one step (per representative rank, every op's start and end).
pub fn run(program: &Program, job: &Job) -> engine::Timeline {
    let classes = classes::rank_classes(program);
    engine::run(program, job, &classes, &CostModel::new(job))
}
