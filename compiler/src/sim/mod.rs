//! The simulator: predicts how long one optimizer step of a compiled program takes, and why.
//!
//! # Design
//!
//! [`cost`] prices every op alone: compute from exact per-layer FLOPs and memory traffic at the
//! cluster's sustained rates, collectives by the α–β model of ring (and tree) algorithms over the
//! two link classes of the cluster, or by `measured` tables where given. [`engine`] then executes
//! the [`ir::Program`](sched_ir::ir::Program) as the hardware would: streams in issue order, event
//! waits, collectives that start only when their whole group has arrived, and overlapping
//! collectives sharing the GPU's intra-node link and the node's network. Nothing else orders or
//! overlaps ops, so the simulated overlap is exactly what the compiler's streams and events allow.
//!
//! The program is SPMD: [`classes`] partitions the ranks into classes whose timelines are provably
//! identical, and the engine runs one representative per class (one for every compiled schedule
//! without a pipeline, one per stage with one), so the cost is that of one rank's ops per stage
//! however many ranks there are. [`report`] turns the timeline into cli.md's figures (with a
//! pipeline, each stage's busy time and the bubble) and [`sched_ir::timeline`] into a Chrome trace.
//!
//! **Pipelines.** A representative runs only its stage's streams; sends and receives rendezvous
//! with their match on the peer stage, by (communicator, per-stage call number), and cost one
//! message over the pair's link ([`engine`], [`CostModel::p2p_transfer`]). A stage's bubble is
//! the idle share of its compute over the step ([`report`]); `--emit diagram` draws the timeline
//! ([`crate::emit::diagram`]).
//!
//! The model's least certain constant is how much collectives slow the compute beside them
//! ([`cost::CONTENTION`]); [`simulate`] runs the step at both ends of its published range too and
//! reports every figure's range ([`SimRanges`]), so a reader (and `schedc plan`) can tell a real
//! difference from one inside the model's uncertainty.
//!
//! [`simulate`] takes only a [`Verified`] program (from [`crate::compile`] or a plan file read
//! back): the engine assumes it cannot deadlock.

pub mod classes;
pub mod cost;
pub mod engine;
pub mod report;

pub use cost::{model_flops_per_step, CostModel};
pub use report::{SimRanges, SimReport, StageBusy, StreamBusy};
pub use sched_ir::timeline::Trace;

use sched_ir::ir::Program;
use sched_ir::job::Job;
use sched_verify::Verified;

/// Simulates one step of `program` (compiled from `job`), with the figures' trust ranges: the step
/// is simulated again at both ends of [`cost::CONTENTION_RANGE`].
pub fn simulate(program: &Verified, job: &Job) -> SimReport {
    simulate_traced_inner(program, job, false).0
}

/// [`simulate`] on a placed program the planner has not verified yet: it verifies every schedule
/// it ranks before showing any, so no report of an unproved program leaves this crate.
pub(crate) fn simulate_candidate(program: &Program, job: &Job) -> SimReport {
    simulate_traced_inner(program, job, false).0
}

/// [`simulate`], with the Chrome trace of the step (at the default contention).
pub fn simulate_traced(program: &Verified, job: &Job) -> (SimReport, Trace) {
    let (report, trace) = simulate_traced_inner(program, job, true);
    (report, trace.expect("asked for"))
}

/// [`simulate`], with the step's timeline (at the default contention): what `--emit diagram`
/// draws.
pub fn simulate_timeline(program: &Verified, job: &Job) -> (SimReport, engine::Timeline) {
    let classes = classes::rank_classes(program);
    let timeline = engine::run(program, job, &classes, &CostModel::new(job));
    let report = report_with_ranges(program, job, &classes, &timeline);
    (report, timeline)
}

fn simulate_traced_inner(program: &Program, job: &Job, traced: bool) -> (SimReport, Option<Trace>) {
    let classes = classes::rank_classes(program);
    let timeline = engine::run(program, job, &classes, &CostModel::new(job));
    let report = report_with_ranges(program, job, &classes, &timeline);
    let trace = traced.then(|| sched_ir::timeline::emit_trace(program, &timeline));
    (report, trace)
}

/// The report of `timeline`, with its figures' ranges from simulations at both ends of
/// [`cost::CONTENTION_RANGE`].
fn report_with_ranges(
    program: &Program,
    job: &Job,
    classes: &classes::RankClasses,
    timeline: &engine::Timeline,
) -> SimReport {
    let cost = CostModel::new(job);
    let mut report = report::report(program, job, timeline);
    let (low, high) = cost::CONTENTION_RANGE;
    let ends = [low, high].map(|c| {
        let t = engine::run(program, job, classes, &cost.clone().with_contention(c));
        report::report(program, job, &t)
    });
    report.ranges = Some(SimRanges::new(
        &report,
        &ends,
        cost.contention(),
        (low, high),
    ));
    report
}

/// Only the step time at the default contention: what `schedc plan` screens candidates by. It
/// takes a program not yet verified (the planner screens programs before memory planning, and
/// the cost model's tests build programs by hand), so it is an estimate, never a report: only a
/// [`Verified`] program gets one ([`simulate`]).
pub fn step_time(program: &Program, job: &Job) -> f64 {
    run(program, job).step_time_s
}

/// The engine's timeline of one step (per representative rank, every op's start and end).
pub fn run(program: &Program, job: &Job) -> engine::Timeline {
    let classes = classes::rank_classes(program);
    engine::run(program, job, &classes, &CostModel::new(job))
}
