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
//!
//! With pipeline stages each process is one stage's rank (`stage S, rank R`), ordered by stage,
//! and holds only its stage's streams and ops (a rank runs nothing else). Above them an `actions`
//! thread draws the stage's work as the pipeline papers do: one slice per action ([`actions`]),
//! named by its letter, micro-batch and, with several chunks per stage, its local chunk (`F3`,
//! `B0.1`), so that Perfetto gives each micro-batch's actions one colour on every stage.

use crate::ir::{ComputeKind, OpId, OpKind, Program};
use crate::job::ActionKind;
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
    let pipelined = program.layout.stages > 1;
    for rt in &timeline.ranks {
        let pid = rt.rank;
        let stage = program.layout.stage(rt.rank);
        let here =
            |stream: crate::ir::StreamId| !pipelined || program.streams[stream].stage == stage;
        let mut name = match rt.ranks {
            1 => format!("rank {}", rt.rank),
            n => format!("rank {} ({n} ranks alike)", rt.rank),
        };
        if pipelined {
            name = format!("stage {stage}, {name}");
        }
        ev.push(json!({"ph": "M", "name": "process_name", "pid": pid, "args": {"name": name}}));
        if pipelined {
            ev.push(json!({"ph": "M", "name": "process_sort_index", "pid": pid,
                "args": {"sort_index": rt.rank}}));
            // The actions thread, first; its id follows the streams'.
            let tid = program.streams.len();
            ev.push(
                json!({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid,
                "args": {"name": "actions"}}),
            );
            ev.push(
                json!({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid,
                "args": {"sort_index": -1}}),
            );
            for a in actions(program, rt, stage) {
                let Some(label) = a.label() else { continue };
                ev.push(
                    json!({"ph": "X", "name": label, "cat": "action", "pid": pid, "tid": tid,
                    "ts": us(a.start), "dur": us(a.end - a.start),
                    "args": {"micro_batch": a.micro, "chunk": a.chunk, "ops": a.ops.len(),
                        "recompute_us": us(a.recompute.iter().map(|(s, e)| e - s).sum())}}),
                );
            }
        }
        for (id, s) in program.streams.iter() {
            if !here(id) {
                continue;
            }
            ev.push(
                json!({"ph": "M", "name": "thread_name", "pid": pid, "tid": id.index(),
                "args": {"name": s.role.name()}}),
            );
        }
        for (id, op) in program.ops.iter() {
            if !here(op.stream) {
                continue;
            }
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

/// What a stretch of a stage's compute does: a pipeline action (with a pipeline, what its order
/// names; without one, a micro-step's forward or backward), the optimizer's work (the update and
/// the gradient norm), or other work (gradient accumulation, copies).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Work {
    Action(ActionKind),
    Optimizer,
    Other,
}

impl Work {
    /// What `kind` is part of: a forward or the loss of the `F` action, a backward or its
    /// recomputed forward of the `B` action.
    pub fn of(kind: ComputeKind) -> Work {
        match kind {
            ComputeKind::Forward
            | ComputeKind::Loss
            | ComputeKind::ForwardOpen(_)
            | ComputeKind::ForwardClose(_) => Work::Action(ActionKind::F),
            ComputeKind::Backward
            | ComputeKind::Recompute
            | ComputeKind::BackwardOpen(_)
            | ComputeKind::BackwardClose(_) => Work::Action(ActionKind::B),
            ComputeKind::BackwardInput => Work::Action(ActionKind::I),
            ComputeKind::BackwardWeight => Work::Action(ActionKind::W),
            ComputeKind::Update | ComputeKind::GradNorm => Work::Optimizer,
            ComputeKind::Accumulate | ComputeKind::Copy => Work::Other,
        }
    }
}

/// One stretch of a stage's compute on one stream: consecutive compute ops of the stream (no
/// other op between them), each starting as the one before ends, of the same [`Work`],
/// micro-batch and local chunk. An action the stream waits in the middle of (its recomputed
/// forward ran before the gradient its backward needs arrived) is two spans with one label.
#[derive(Clone, Debug, PartialEq)]
pub struct ActionSpan {
    pub work: Work,
    pub micro: Option<u32>,
    /// The stage's local chunk (0 … v−1): the ops' layers' chunk over the stages.
    pub chunk: u32,
    /// Whether the stage has several chunks (the label then names the chunk).
    pub chunked: bool,
    pub start: f64,
    pub end: f64,
    /// When the span's recompute ops ran (`recompute = full`), inside the span.
    pub recompute: Vec<(f64, f64)>,
    pub stream: crate::ir::StreamId,
    pub ops: Vec<OpId>,
}

impl ActionSpan {
    /// `F3`, `B0.1` (micro-batch 0 of local chunk 1): the action's name in a pipeline order;
    /// `None` for work that is no action.
    pub fn label(&self) -> Option<String> {
        let Work::Action(kind) = self.work else {
            return None;
        };
        let micro = self.micro.map_or(String::new(), |m| m.to_string());
        Some(match self.chunked {
            true => format!("{}{micro}.{}", kind.letter(), self.chunk),
            false => format!("{}{micro}", kind.letter()),
        })
    }
}

/// The longest pause between two ops of one span, in seconds: the engine starts an op at the
/// instant the one before it ends, a measured timeline a launch or so later.
const GAP_S: f64 = 1e-5;

/// The compute of `stage` on `rank`'s timeline as [`ActionSpan`]s, stream by stream in stream
/// order, each stream's spans in time order. Chunks per stage are read from the program's
/// layers (chunk c is the stage's local chunk c / p with p stages, for every placement).
pub fn actions(program: &Program, rank: &RankTimeline, stage: u32) -> Vec<ActionSpan> {
    let stages = program.layout.stages.max(1);
    let chunked = program.layers.values().any(|l| l.chunk >= stages);
    let mut out: Vec<ActionSpan> = vec![];
    for (sid, st) in program.streams.iter() {
        if st.stage != stage {
            continue;
        }
        // Whether the last span of this stream may still grow (its last op was the stream's
        // previous op).
        let mut open = false;
        for (id, op) in program.ops.iter().filter(|(_, op)| op.stream == sid) {
            let OpKind::Compute(kind) = op.kind else {
                open = false;
                continue;
            };
            let (start, end) = (rank.start[id.index()], rank.end[id.index()]);
            if start.is_nan() || end.is_nan() {
                open = false;
                continue;
            }
            let work = Work::of(kind);
            let chunk = op
                .layer
                .and_then(|l| program.layers.get(l))
                .map(|l| l.chunk / stages);
            // A gap means the stream waited (a recomputed forward runs before the gradient its
            // backward needs has arrived): the span ends there, so spans are busy time only.
            let extends = |a: &ActionSpan| {
                open && a.work == work
                    && a.micro == op.micro_step
                    && chunk.is_none_or(|c| c == a.chunk)
                    && start <= a.end + GAP_S
            };
            let span = match out.last_mut() {
                Some(a) if extends(a) => a,
                _ => {
                    out.push(ActionSpan {
                        work,
                        micro: op.micro_step,
                        chunk: chunk.unwrap_or(0),
                        chunked,
                        start,
                        end,
                        recompute: vec![],
                        stream: sid,
                        ops: vec![],
                    });
                    out.last_mut().expect("just pushed")
                }
            };
            span.start = span.start.min(start);
            span.end = span.end.max(end);
            span.ops.push(id);
            if kind == ComputeKind::Recompute {
                span.recompute.push((start, end));
            }
            open = true;
        }
    }
    out
}
