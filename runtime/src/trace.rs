//! Measured traces: a step as a backend timed it ([`crate::backend::OpSpan`]), written as
//! `schedc simulate --trace` writes a simulated one (each rank a process, each stream a thread,
//! each op a slice, each event wait a flow arrow), so the two open side by side in Perfetto.

use crate::backend::OpSpan;
use crate::plan::Plan;
use cranelift_entity::EntityRef;
use sched_ir::timeline::{emit_trace, Trace};
use sched_ir::timeline::{RankTimeline, Timeline};
use std::time::Duration;

/// A step whose spans lack an op of some rank (an op of the rank's pipeline stage), or name no
/// rank: there is no trace to write.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("the backend did not time every op of the step")]
pub struct Untimed;

/// The trace of one step that took `time`, from the spans of every op of each rank in `spans`
/// (the ranks this process drove); an error when a rank lacks an op.
pub fn measured(plan: &Plan, time: Duration, spans: &[OpSpan]) -> Result<Trace, Untimed> {
    let ops = plan.program.ops.len();
    let mut present: Vec<u32> = spans.iter().map(|s| s.rank).collect();
    present.sort_unstable();
    present.dedup();
    let mut ranks: Vec<RankTimeline> = present
        .iter()
        .map(|&rank| RankTimeline {
            rank,
            ranks: 1,
            start: vec![f64::NAN; ops],
            end: vec![f64::NAN; ops],
        })
        .collect();
    for s in spans {
        let rt = &mut ranks[present.binary_search(&s.rank).expect("present")];
        rt.start[s.op.index()] = s.start.as_secs_f64();
        rt.end[s.op.index()] = s.end.as_secs_f64();
    }
    // A rank runs its pipeline stage's ops only; the others stay untimed (NaN) in its timeline.
    let p = &plan.program;
    let mine = |rank: u32, op: usize| {
        let o = &p.ops[sched_ir::ir::OpId::new(op)];
        p.streams[o.stream].stage == p.layout.stage(rank)
    };
    let missing = |r: &RankTimeline| {
        r.start
            .iter()
            .enumerate()
            .any(|(op, t)| t.is_nan() && mine(r.rank, op))
    };
    if ranks.is_empty() || ranks.iter().any(missing) {
        return Err(Untimed);
    }
    let timeline = Timeline {
        ranks,
        step_time_s: time.as_secs_f64(),
    };
    Ok(emit_trace(&plan.program, &timeline))
}
