//! Lowering: a resolved [`Job`] becomes a [`Draft`] (lowering spec §1–5): every op of the step
//! with its regions, roles, layer and micro-step, grouped into compute slots and gather units, with
//! the issue order, streams, events and offsets left to the passes ([`crate::pipeline`] runs them).
//!
//! The step is built as a sequence of compute **slots** (per micro-step: every layer's forward, the
//! loss, every layer's backward in reverse). Each slot carries:
//! - the **gather units** its compute needs: parameter all-gathers (flat, hierarchical or hpZ's
//!   intra-node one), and with `refresh = next_forward` the deferred refresh of micro-step 0. A unit
//!   covers one bucket of consecutive layers ([`buckets`]) and may be hoisted to an earlier slot by
//!   the prefetch pass;
//! - its compute ops;
//! - the ops that follow it and stay there: gradient reductions (bucketed), the boundary
//!   synchronisation of each layer after its last backward, the optimizer update and the refresh.
//!
//! The [`Builder`] that makes the ops is split by concern, one file each:
//! - [`comms`]: the communicators, built on first use from the shard layout;
//! - [`params`]: persistent shards, parameter gathers (flat, hierarchical, hpZ) and the refresh;
//! - [`compute`]: forward, recompute and backward ops, hidden states and saved activations;
//! - [`grads`]: where gradients are written, their reductions, the boundary synchronisation,
//!   gradient clipping's norm and the optimizer update;
//! - [`step`]: the order of it all: micro-steps, buckets, slots and units.
//!
//! [`activations`] and [`workspace`] size what the runtime keeps for backward and the scratch
//! its compute ops take; the workspace buffers themselves are made once streams are known
//! (`crate::passes::workspace`).
//!
//! Invariants kept: every op is placed exactly once in the draft's slots (see [`crate::draft`]);
//! buffers are created once per (layer, micro-step, purpose) and never resized; persistent shards
//! are sized to the layer padded to a multiple of s_os (and of hpZ's secondary size).

pub mod buckets;
mod comms;
mod compute;
mod grads;
mod params;
mod stages;
mod step;
mod tensor;
pub mod workspace;

use crate::draft::Draft;
use comms::CommKind;
use sched_ir::hash::FxHashMap;
use sched_ir::ir::layout::Layout;
use sched_ir::ir::*;
use sched_ir::job::*;

/// Lowers `job` to its draft: every op of one step, in slots, before any pass has run.
pub fn draft(job: &Job) -> Draft {
    let s = &job.schedule;
    let layout = Layout::of(job);
    let mut b = Builder {
        job,
        layout,
        p: Program {
            schedule: s.name.clone(),
            layout,
            micro_steps: s.micro_steps,
            ..Program::default()
        },
        comms: FxHashMap::default(),
        layers: vec![],
        dtype: job.model.dtype,
        grad_dtype: job.model.grad_dtype,
        hidden: FxHashMap::default(),
        grad_hidden: FxHashMap::default(),
        acts: FxHashMap::default(),
        stashes: FxHashMap::default(),
        secondaries: FxHashMap::default(),
        optimizer_shards: vec![],
        grads_written: Default::default(),
        backwards_done: Default::default(),
        replica: None,
        deferred: vec![],
        held: None,
        stage: 0,
        stage_streams: vec![],
    };
    // One placeholder stream per stage: an op's stream says which stage runs it until the
    // streams pass assigns the real ones.
    b.stage_streams = (0..layout.stages.max(1))
        .map(|s| b.p.streams.push(Stream::on_stage(StreamRole::Compute, s)))
        .collect();
    b.layers();
    let slots = if s.pipeline.is_pipelined() {
        b.pipeline_step()
    } else {
        b.step()
    };
    Draft {
        program: b.p,
        slots,
        job_streams: s.streams,
        overlap: s.overlap,
        max_live: s.prefetch.max_live,
    }
}

/// Per-layer buffers and facts.
#[derive(Clone, Copy)]
struct LayerState {
    id: LayerId,
    padded: u64,
    param_shard: BufferId,
    grad_shard: BufferId,
    /// True when the layer has parameters to move at all.
    has_params: bool,
}

/// A reduction bucket after its boundary synchronisation: its layers, and each one's
/// optimizer-shard gradient region (what its update reads).
type Boundary = (Vec<usize>, Vec<(usize, Region)>);

/// Makes the ops and buffers of one step; its methods live in the files named in the module doc.
struct Builder<'a> {
    job: &'a Job,
    layout: Layout,
    p: Program,
    comms: FxHashMap<CommKind, CommId>,
    layers: Vec<LayerState>,
    dtype: Dtype,
    grad_dtype: Dtype,
    /// Hidden-state buffer h[l] (input of layer l) and its gradient g[l], per micro-step and
    /// stage.
    hidden: FxHashMap<(u32, usize, u32), BufferId>,
    grad_hidden: FxHashMap<(u32, usize, u32), BufferId>,
    /// Saved activations per (layer, micro-step), hpZ secondary copies, optimizer shards per layer.
    acts: FxHashMap<(usize, u32), BufferId>,
    /// What each (layer, micro-step)'s `I` stashes for its `W`.
    stashes: FxHashMap<(usize, u32), BufferId>,
    secondaries: FxHashMap<(usize, u32), BufferId>,
    optimizer_shards: Vec<BufferId>,
    /// Bytes of each gradient buffer already written in a micro-step (from its start).
    grads_written: FxHashMap<(BufferId, u32), u64>,
    /// With sequence parallelism, how many micro-steps' backwards of each tensor-parallel
    /// layer are lowered (the last one's norm gradients are summed over the tensor group).
    backwards_done: FxHashMap<usize, u32>,
    /// A tied head keeping a replica of its embedding's state ([`Job::tied_replica`]):
    /// (head, embedding). The replica is layer index [`Builder::replica_index`].
    replica: Option<(usize, usize)>,
    /// A pipeline stage's updates held back to its end (see `super::stages`).
    deferred: Vec<Boundary>,
    /// In a pipeline, what the previous action gathered (`None` without a pipeline).
    held: Option<step::Held>,
    /// The pipeline stage whose buffers and ops are being made (0 without a pipeline).
    stage: u32,
    /// Each stage's placeholder stream (see [`draft`]).
    stage_streams: Vec<StreamId>,
}

/// The ops every concern makes: buffers, ops, collectives and their coalescing.
impl Builder<'_> {
    fn shard(&self) -> Shard {
        self.job.schedule.shard
    }

    /// The slice of layer `l`'s param shard that this rank's optimizer shard updates and the
    /// refresh gathers from: one optimizer shard's bytes at the rank's `OptimizerInParam` index.
    fn updated_slice(&self, l: usize) -> Region {
        let st = self.state(l);
        let bytes = st.padded / self.shard().optimizer.size() * self.dtype.bytes();
        Region {
            buffer: st.param_shard,
            offset: Offset::Shard {
                index: ShardIndex::OptimizerInParam,
                base: 0,
                stride: bytes,
            },
            bytes,
        }
    }

    fn buffer(
        &mut self,
        name: String,
        kind: BufferKind,
        dtype: Dtype,
        elems: u64,
        layer: Option<LayerId>,
    ) -> BufferId {
        self.p.buffers.push(Buffer {
            name,
            kind,
            dtype,
            bytes: elems * dtype.bytes(),
            layer,
            offset: 0,
            stage: self.stage,
        })
    }

    fn op(&mut self, kind: OpKind, role: OpRole, layer: Option<LayerId>, m: Option<u32>) -> OpId {
        let (reads, writes) = match &kind {
            OpKind::Compute(_) => (vec![], vec![]),
            OpKind::Collective(c) => (c.reads().collect(), c.writes().collect()),
            OpKind::Group(cs) => (
                cs.iter().flat_map(CollectiveOp::reads).collect(),
                cs.iter().flat_map(CollectiveOp::writes).collect(),
            ),
        };
        self.p.ops.push(Op {
            kind,
            role,
            stream: self.stage_streams[self.stage as usize],
            layer,
            micro_step: m,
            reads,
            writes,
            wait: vec![],
            record: None,
        })
    }

    fn compute(
        &mut self,
        kind: ComputeKind,
        layer: Option<LayerId>,
        m: Option<u32>,
        reads: Vec<Region>,
        writes: Vec<Region>,
    ) -> OpId {
        let id = self.op(OpKind::Compute(kind), OpRole::Compute, layer, m);
        self.p.ops[id].reads = reads;
        self.p.ops[id].writes = writes;
        id
    }

    fn collective(
        &mut self,
        kind: Collective,
        comm: CommKind,
        dtype: Dtype,
        input: Region,
        output: Region,
    ) -> CollectiveOp {
        let comm = self.comm(comm);
        let payload = match kind {
            Collective::AllGather => output.bytes,
            _ => input.bytes,
        };
        CollectiveOp {
            kind,
            comm,
            dtype,
            count: payload / dtype.bytes(),
            input,
            output,
        }
    }

    /// Issues collectives as one op, or as a coalesced group when there are several.
    fn issue(
        &mut self,
        mut cs: Vec<CollectiveOp>,
        role: OpRole,
        layer: Option<LayerId>,
        m: Option<u32>,
    ) -> Option<OpId> {
        let kind = match cs.len() {
            0 => return None,
            1 => OpKind::Collective(cs.pop().expect("one")),
            _ => OpKind::Group(cs),
        };
        Some(self.op(kind, role, layer, m))
    }

    /// The layers of `bucket` that have parameters to move.
    fn with_params(&self, bucket: &[usize]) -> Vec<usize> {
        bucket
            .iter()
            .copied()
            .filter(|&l| self.state(l).has_params)
            .collect()
    }

    /// The pipeline chunk holding layer `l` (0 without a pipeline).
    fn chunk_of_layer(&self, l: usize) -> u32 {
        self.job.schedule.pipeline.chunk_of_layer(l)
    }

    /// The pipeline stage running layer `l`'s compute.
    fn stage_of_layer(&self, l: usize) -> u32 {
        self.job.schedule.pipeline.stage_of_layer(l)
    }

    /// The persistent state of layer index `l` (a model layer's, or at [`Builder::replica_index`]
    /// the tied head's replica of its embedding).
    fn state(&self, l: usize) -> LayerState {
        self.layers[l]
    }

    /// The optimizer shard of layer index `l` (see [`Builder::state`]).
    fn optimizer_shard(&self, l: usize) -> BufferId {
        self.optimizer_shards[l]
    }

    /// The layer index of the tied head's replica of its embedding, when there is one: past the
    /// model's layers. It has the embedding's layer id (its buffers are the embedding's, on the
    /// head's stage), no compute of its own, and goes with the head's gathers, reductions,
    /// boundary and update.
    fn replica_index(&self) -> Option<usize> {
        self.replica.map(|_| self.job.model.layers.len())
    }

    /// Whether layer index `l` is the replica.
    fn is_replica(&self, l: usize) -> bool {
        self.replica_index() == Some(l)
    }

    /// The layer index of the embedding state a tied lm_head reads, if layer `l` is one: its
    /// replica when it keeps one, else the embedding.
    fn tied_embedding(&self, l: usize) -> Option<usize> {
        let (_, e) = self.job.tied_head().filter(|&(h, _)| h == l)?;
        Some(self.replica_index().unwrap_or(e))
    }
}
