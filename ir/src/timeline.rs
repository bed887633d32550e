//! A step's timeline ([`Timeline`]) and its Chrome trace-event JSON (`schedc simulate --trace`,
//! `schedrun --trace`; opens in Perfetto and chrome://tracing): one format for a simulated step and
//! a measured one, so the two open side by side.
//!
//! One process per simulated rank (named `rank R`, with how many ranks it stands for when more
//! than one; `schedrun --trace` writes a measured step this way too, every rank), one thread
//! per stream (named by the stream's role), one complete slice (`ph: "X"`) per op, named by its
//! kind and layer, with `op`, `layer`, `micro_step` and `bytes` (a collective's payload, a compute
//! op's bytes read and written, its workspace not counted) in `args`. Every event wait is a flow arrow from the op that records
//! the event (`ph: "s"`, stamped at that op's start so that it binds to that slice and not to the
//! one that follows it on the stream) to the op that waits (`ph: "f"`, `bp: "e"`, at its start).
//! Times are microseconds.

use crate::ir::{OpKind, Program};
use cranelift_entity::EntityRef;
use serde::Serialize;
use serde_json::{json, Value};

/// When each op ran on one representative rank.
#[derive(Clone, Debug)]
pub struct RankTimeline {
    /// The representative rank.
    pub rank: u32,
    /// Ranks whose timeline this one stands for.
    pub ranks: u32,
    /// Start and end of every op, in seconds from the start of the step, indexed by op.
    pub start: Vec<f64>,
    pub end: Vec<f64>,
}

/// A step's timeline: every op's start and end on each rank it covers (the simulator's
/// prediction, or a backend's measurement).
#[derive(Clone, Debug)]
pub struct Timeline {
    pub ranks: Vec<RankTimeline>,
    pub step_time_s: f64,
}

/// A Chrome trace: serialise it to get the file.
#[derive(Serialize, Clone, Debug)]
pub struct Trace {
    #[serde(rename = "traceEvents")]
    pub trace_events: Vec<Value>,
    #[serde(rename = "displayTimeUnit")]
    pub display_time_unit: &'static str,
}

pub fn emit_trace(program: &Program, timeline: &Timeline) -> Trace {
    let us = |s: f64| s * 1e6;
    let mut ev = vec![];
    let mut flow = 0u64;
    for rt in &timeline.ranks {
        let pid = rt.rank;
        let name = match rt.ranks {
            1 => format!("rank {}", rt.rank),
            n => format!("rank {} ({n} ranks alike)", rt.rank),
        };
        ev.push(json!({"ph": "M", "name": "process_name", "pid": pid, "args": {"name": name}}));
        for (id, s) in program.streams.iter() {
            ev.push(
                json!({"ph": "M", "name": "thread_name", "pid": pid, "tid": id.index(),
                "args": {"name": s.role.name()}}),
            );
        }
        for (id, op) in program.ops.iter() {
            let (start, end) = (rt.start[id.index()], rt.end[id.index()]);
            let layer = op
                .layer
                .and_then(|l| program.layers.get(l))
                .map(|l| l.name.clone());
            let bytes: u64 = match &op.kind {
                OpKind::Compute(_) => op
                    .reads
                    .iter()
                    .chain(&op.writes)
                    .filter(|r| !program.is_workspace(r))
                    .map(|r| r.bytes)
                    .sum(),
                _ => op
                    .collectives()
                    .iter()
                    .map(|c| c.count * c.dtype.bytes())
                    .sum(),
            };
            let name = match &layer {
                Some(l) => format!("{} {l}", op.kind_name()),
                None => op.kind_name().to_string(),
            };
            let tid = op.stream.index();
            ev.push(json!({"ph": "X", "name": name, "cat": op.kind_name(), "pid": pid, "tid": tid,
                "ts": us(start), "dur": us(end - start),
                "args": {"op": id.to_string(), "layer": layer, "micro_step": op.micro_step, "bytes": bytes}}));
            for e in &op.wait {
                let rec = program.events[*e].recorder;
                let rec_op = &program.ops[rec];
                ev.push(
                    json!({"ph": "s", "name": e.to_string(), "cat": "wait", "id": flow,
                    "pid": pid, "tid": rec_op.stream.index(), "ts": us(rt.start[rec.index()])}),
                );
                ev.push(
                    json!({"ph": "f", "bp": "e", "name": e.to_string(), "cat": "wait", "id": flow,
                    "pid": pid, "tid": tid, "ts": us(start)}),
                );
                flow += 1;
            }
        }
    }
    Trace {
        trace_events: ev,
        display_time_unit: "ms",
    }
}
