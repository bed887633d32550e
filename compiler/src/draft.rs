//! The draft program: what lowering produces and the prefetch pass consumes.
//!
//! A draft is a [`Program`] whose ops exist (kinds, regions, roles, layers, micro-steps) but whose
//! issue order, streams, events and offsets are not yet decided, together with the step's compute
//! **slots** in the order they run (per micro-step: every layer's forward, the loss, every layer's
//! backward in reverse). Each slot carries the gather [`Unit`]s its compute needs, its compute ops,
//! and the ops pinned after it. Invariants the lowering keeps and prefetch relies on:
//! - every op of the program appears exactly once, in one unit, one slot's `compute` or one
//!   slot's `after`;
//! - a unit's `earliest <= consumer <= last_consumer`, all indices of `slots`;
//! - ops inside a unit, a `compute` list or an `after` list are already in their issue order.

use sched_ir::ir::{OpId, Program};
use sched_ir::job::{Overlap, Streams};

/// A group of ops issued together and moved as one by the prefetch pass.
#[derive(Clone, Debug, Default)]
pub struct Unit {
    pub ops: Vec<OpId>,
    /// The layers (indices into the model) whose parameters it makes available.
    pub layers: Vec<usize>,
    /// Gathered-parameter bytes the unit makes alive.
    pub gathered_bytes: u64,
    /// The slot whose compute first reads what the unit produces.
    pub consumer: usize,
    /// The slot whose compute last reads it (the gathered bytes are released after it).
    pub last_consumer: usize,
    /// The earliest slot it may be issued before.
    pub earliest: usize,
    /// How many slots ahead of its consumer it would like to be issued.
    pub depth: usize,
}

/// One compute slot: its gather units, its compute ops, and the ops pinned after it.
#[derive(Clone, Debug, Default)]
pub struct Slot {
    pub units: Vec<Unit>,
    pub compute: Vec<OpId>,
    pub after: Vec<OpId>,
    /// The pipeline stage whose ops it holds (0 without a pipeline). A stage's slots are
    /// consecutive, and a unit's `earliest`, `consumer` and `last_consumer` lie in its stage.
    pub stage: u32,
}

/// The program before its issue order, streams, events and offsets are final.
pub struct Draft {
    pub program: Program,
    pub slots: Vec<Slot>,
    /// The schedule's stream policy and overlap switches (read by the streams pass).
    pub job_streams: Streams,
    pub overlap: Overlap,
    /// The cap on gathered bytes alive (read by the prefetch pass).
    pub max_live: Option<u64>,
}
