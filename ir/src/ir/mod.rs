//! The stream program: what a compiled schedule is.
//!
//! # Execution model
//!
//! One [`Program`] serves every rank (SPMD). It describes **one optimizer step**: `micro_steps`
//! forward/backward passes, then the boundary synchronisation, the optimizer update and the
//! parameter refresh. The host runs the step by walking [`Program::ops`] in order, the **issue
//! order**, and enqueueing each op on its stream; the same order on every rank. At the end of a step
//! the host joins all streams before the next step starts (the step boundary).
//!
//! - **Streams** ([`StreamId`]) execute their ops in issue order, one at a time, like CUDA streams.
//! - **Events** ([`EventId`]): an op may `record` one event, signalled when the op completes, and
//!   `wait` on events recorded by ops earlier in the issue order; its stream does not start the op
//!   before those events are signalled (cuStreamWaitEvent). Waits are the only cross-stream
//!   ordering: **happens-before** is the transitive closure of stream order and waits, plus, across
//!   ranks, collective completion.
//! - **Collectives** name a communicator ([`CommId`]). A communicator partitions the ranks into
//!   groups, each with a member order; a rank uses the group it belongs to. A collective completes on
//!   every member once every member has reached it. Chunk `j` of an all-gather's output or a
//!   reduce-scatter's input belongs to member `j`. A `Group` op issues several collectives as one
//!   coalesced call (NCCL group semantics).
//! - **Buffers** ([`BufferId`]) are per-rank byte ranges at a fixed `offset` in the rank's arena,
//!   the same on every rank. Persistent buffers (parameter, gradient and optimizer shards) live
//!   across steps; transient ones live from the first op that writes them to the last op that reads
//!   or writes them (an asynchronous collective counts until it completes). Two buffers may share
//!   bytes only when every access to one happens-before every access to the other.
//! - **Workspaces.** Each stream whose compute ops need scratch has one transient
//!   [`BufferKind::Workspace`] buffer ([`Stream::workspace`]): the GEMM library's workspace on
//!   streams that run layer math, then the fp32 scratch a device takes for an op's intermediates
//!   and gives back after it (sized by `crate::lower::workspace` for the neediest op of the
//!   stream). Every op that uses it writes it (the last of its writes), so its lifetime is the
//!   stream's first such op to its last, and only that stream's ops, in stream order, touch it.
//!   The memory plan places it like any other buffer, so on the CUDA backend the arena is every
//!   byte of tensors and scratch a step uses: only the batch's tokens, the loss accumulators (the
//!   step's input and output) and a few read-only model constants lie outside it
//!   (`runtime/src/backend/cuda/memory.rs`).
//! - **Regions** ([`Region`]) are what ops read and write: a byte range of one buffer, whose offset
//!   may depend on the rank through its shard index (see [`Offset`]).
//!
//! # Pipeline stages
//!
//! With pipeline parallelism ([`Layout::stages`] > 1) the ranks are split into stages of
//! consecutive ranks, and every stream and buffer belongs to one stage ([`Stream::stage`],
//! [`Buffer::stage`]). A rank runs the ops of its stage's streams, in issue order, and holds its
//! stage's buffers; the program is SPMD within a stage. An op's regions, waits and records name
//! only buffers and events of its own stage, so happens-before never crosses a stage except
//! through communication. Activations and their gradients cross stages by point-to-point
//! `send`/`recv` collectives on a two-member communicator (member 0 sends, member 1 receives;
//! the k-th send of a rank to a peer is the peer's k-th receive from it), possibly grouped with
//! others into one coalesced call. Buffers of different stages may share arena bytes: they are
//! never on the same rank.
//!
//! # What makes an op ready
//!
//! An op starts on its stream when the op before it on that stream has completed and every event it
//! waits on has been recorded. A collective additionally completes only when all members of its group
//! have started it. Nothing else orders anything: a missing wait is a race.
//!
//! # Gradient clipping
//!
//! With `train.clip` set, one `grad_norm` op (role sync) follows every layer's boundary
//! synchronisation: it reads each layer's optimizer-shard gradient (the region that layer's update
//! reads first) and writes the sum of their squares into `clip.sumsq`, one fp32 element. An
//! `all_reduce` over the optimizer-shard (s_os) groups then sums it over every optimizer shard
//! (each element of the model once; skipped when s_os = 1), and every update reads the whole of
//! `clip.sumsq` as its third read: norm = sqrt(sumsq)/(dp·M), factor min(1, clip/(norm+1e-6)).
//! So no update runs before every boundary synchronisation has completed. With pipeline stages
//! or tensor parallelism the all-reduce spans the s_os groups of every stage and tensor index.
//! With t > 1 each rank's layer gradient is its slice: the tensors every rank of a tensor group
//! holds alike (norms, row-parallel biases, learned positions, and every tensor of a layer that
//! runs whole) count on tensor index 0 only, so the sum holds each element of the model once.
//!
//! # Shard layout
//!
//! Layer `l`'s parameters are one flat vector of `padded` elements (P_l rounded up to a multiple of
//! s_os). For a mesh `a x b` the **group** of a rank is the ranks whose node is in the same block of
//! `b` consecutive nodes and whose local index is in the same block of `a` consecutive local indices;
//! its **position** in the group is `(node mod b)·a + (local mod a)` (node by node). Shard indices
//! nest so that optimizer shard ⊂ grad shard ⊂ param shard (lowering spec §1):
//! `param = pos_p`, `grad = param·(s_g/s_p) + sub_g`, `optimizer = grad·(s_os/s_g) + sub_os`, where
//! `sub_g` is the index of the rank's s_p-subgroup inside its s_g group and `sub_os` that of its
//! s_g-subgroup inside its s_os group. [`layout`] computes them; collectives' member orders follow.

pub mod layout;

use crate::hash::FxHashMap;
use crate::job::{Collective as CollectiveKind, Dtype};
use cranelift_entity::{entity_impl, PrimaryMap, SecondaryMap};
pub use layout::Layout;

/// An op, in issue order.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct OpId(u32);
entity_impl!(OpId, "op");

#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BufferId(u32);
entity_impl!(BufferId, "buf");

#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct StreamId(u32);
entity_impl!(StreamId, "stream");

#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct EventId(u32);
entity_impl!(EventId, "ev");

#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct CommId(u32);
entity_impl!(CommId, "comm");

#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct LayerId(u32);
entity_impl!(LayerId, "layer");

/// A compiled step.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Program {
    pub schedule: String,
    /// The ranks and how parameters, gradients and optimizer states are sharded over them: what
    /// every rank-dependent offset and communicator group of the program is evaluated with.
    pub layout: Layout,
    pub micro_steps: u32,
    pub layers: PrimaryMap<LayerId, LayerInfo>,
    pub streams: PrimaryMap<StreamId, Stream>,
    pub comms: PrimaryMap<CommId, Communicator>,
    pub buffers: PrimaryMap<BufferId, Buffer>,
    pub events: PrimaryMap<EventId, Event>,
    /// Every op, in issue order.
    pub ops: PrimaryMap<OpId, Op>,
    /// Bytes of each rank's arena (the memory plan's peak).
    pub arena_bytes: u64,
}

impl Program {
    /// Ranks the program runs on (nodes × GPUs per node).
    pub fn ranks(&self) -> u32 {
        self.layout.ranks()
    }

    /// The pipeline stages communicator `c`'s groups reach, sorted, when some group spans more
    /// than one stage (a transfer's pair, an embedding group, clipping's norm across stages);
    /// `None` when every group lies inside one stage.
    pub fn stages_spanned(&self, c: CommId) -> Option<Vec<u32>> {
        let layout = self.layout;
        let groups = &self.comms[c].groups;
        let spans = groups
            .iter()
            .any(|g| g.iter().any(|&r| layout.stage(r) != layout.stage(g[0])));
        spans.then(|| {
            let mut s: Vec<u32> = groups.iter().flatten().map(|&r| layout.stage(r)).collect();
            s.sort_unstable();
            s.dedup();
            s
        })
    }

    /// Each collective's call number on its communicator, by op (one per collective of the op,
    /// in its order): the k-th call (from 0) the op's pipeline stage makes on that communicator,
    /// in issue order. Every member of a group makes its k-th call together, and a send and its
    /// receive have one number (the verifier's matching proof).
    pub fn call_numbers(&self) -> SecondaryMap<OpId, Vec<u32>> {
        let mut calls: FxHashMap<(CommId, u32), u32> = FxHashMap::default();
        let mut out: SecondaryMap<OpId, Vec<u32>> = SecondaryMap::new();
        for (id, op) in self.ops.iter() {
            let stage = self.streams.get(op.stream).map_or(0, |s| s.stage);
            out[id] = op
                .collectives()
                .iter()
                .map(|c| {
                    let n = calls.entry((c.comm, stage)).or_insert(0);
                    *n += 1;
                    *n - 1
                })
                .collect();
        }
        out
    }

    /// Whether `r` lies in a workspace: scratch an op takes, not data it reads or writes (cost
    /// models count the bytes an op moves without it).
    pub fn is_workspace(&self, r: &Region) -> bool {
        self.buffers
            .get(r.buffer)
            .is_some_and(|b| b.kind == BufferKind::Workspace)
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LayerInfo {
    pub name: String,
    /// P_l, the parameter count.
    pub params: u64,
    /// P_l rounded up to a multiple of s_os.
    pub padded: u64,
    /// The pipeline chunk the layer belongs to (0 without a pipeline); its stage is that of the
    /// streams its ops run on.
    pub chunk: u32,
}

/// What a stream is for; decides which ops the lowering puts on it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum StreamRole {
    Compute,
    Gather,
    Reduce,
    Sync,
    Intra,
    Inter,
    /// Pipeline sends and receives.
    P2p,
}

impl StreamRole {
    pub fn name(self) -> &'static str {
        match self {
            StreamRole::Compute => "compute",
            StreamRole::Gather => "gather",
            StreamRole::Reduce => "reduce",
            StreamRole::Sync => "sync",
            StreamRole::Intra => "intra",
            StreamRole::Inter => "inter",
            StreamRole::P2p => "p2p",
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Stream {
    pub role: StreamRole,
    /// The stream's workspace, when its compute ops need scratch (see "Workspaces" above).
    pub workspace: Option<StreamWorkspace>,
    /// The pipeline stage whose ranks run it (see "Pipeline stages" above); 0 without a pipeline.
    pub stage: u32,
}

impl Stream {
    /// A stream of `role` on stage 0 without a workspace (the workspace pass adds one where
    /// needed).
    pub fn new(role: StreamRole) -> Self {
        Self::on_stage(role, 0)
    }

    /// A stream of `role` run by the ranks of `stage`.
    pub fn on_stage(role: StreamRole, stage: u32) -> Self {
        Stream {
            role,
            workspace: None,
            stage,
        }
    }
}

/// A stream's workspace: a [`BufferKind::Workspace`] buffer holding the GEMM library's workspace
/// (its first `gemm_bytes`, a multiple of 256; 0 on streams without layer math), then the fp32
/// scratch of the stream's compute ops.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StreamWorkspace {
    pub buffer: BufferId,
    pub gemm_bytes: u64,
}

/// Where a communicator's groups lie (lowering spec §1).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Scope {
    Intra,
    Inter,
    Mixed,
}

impl Scope {
    pub fn name(self) -> &'static str {
        match self {
            Scope::Intra => "intra",
            Scope::Inter => "inter",
            Scope::Mixed => "mixed",
        }
    }
}

/// A set of disjoint groups covering every rank, each listed in member order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Communicator {
    /// What the groups are, for listings: `params 8 x 2`, `replicas of optimizer shard`.
    pub name: String,
    pub groups: Vec<Vec<u32>>,
    pub scope: Scope,
}

impl Communicator {
    pub fn group_size(&self) -> u32 {
        self.groups.first().map_or(0, |g| g.len() as u32)
    }
}

/// What a buffer holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BufferKind {
    /// The rank's param shard (persistent).
    ParamShard,
    /// The rank's gradient accumulator (persistent).
    GradShard,
    /// The rank's fp32 optimizer state: master, then m and v for Adam (persistent).
    OptimizerShard,
    /// Gathered full parameters of a layer.
    Gathered,
    /// hpZ's secondary shard, kept from forward to backward.
    Secondary,
    /// A staging buffer of a hierarchical all-gather or a reduction.
    Staging,
    /// A layer's full gradient, as backward produces it.
    FullGrad,
    /// What a layer keeps from forward for backward, per micro-step.
    Activation,
    /// Hidden states passed between layers and their gradients.
    Hidden,
    /// A stream's workspace: the GEMM library's, then its compute ops' fp32 scratch (transient,
    /// touched only by that stream's ops).
    Workspace,
    /// What a layer's input-gradient backward (`I`) leaves for its weight-gradient backward
    /// (`W`) in one micro-step: the gradients of its products' outputs, fp32
    /// (`crate::abi::stash_elements`).
    Stash,
    /// A tensor-parallel layer's partial sum in one micro-step (fp32, tokens × hidden): one
    /// rank's summand of a sublayer's output or of its norm output's gradient, summed in place by
    /// an all-reduce over the tensor group.
    Partial,
}

impl BufferKind {
    pub fn is_persistent(self) -> bool {
        matches!(
            self,
            BufferKind::ParamShard | BufferKind::GradShard | BufferKind::OptimizerShard
        )
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Buffer {
    /// `block[3].params.full`, `block[3].act.m2`.
    pub name: String,
    pub kind: BufferKind,
    pub dtype: Dtype,
    pub bytes: u64,
    pub layer: Option<LayerId>,
    /// Offset in the rank's arena, set by the memory plan.
    pub offset: u64,
    /// The pipeline stage whose ranks hold it; 0 without a pipeline. Only that stage's ops
    /// touch it, so buffers of different stages may share arena bytes.
    pub stage: u32,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Event {
    /// The op that records it.
    pub recorder: OpId,
}

/// Which shard index of a rank selects a chunk (see the module doc's shard layout).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ShardIndex {
    /// Position in the params group (0 … s_p−1).
    Param,
    /// Position in the grads group (0 … s_g−1).
    Grad,
    /// Position in the optimizer group (0 … s_os−1).
    Optimizer,
    /// Local position in the params group (`local mod a`), for the hierarchical all-gather.
    ParamLocal,
    /// The optimizer shard's index inside the rank's param shard (0 … s_os/s_p−1).
    OptimizerInParam,
    /// The optimizer shard's index inside the rank's grad shard (0 … s_os/s_g−1).
    OptimizerInGrad,
    /// hpZ: position among the `secondary` GPUs of the node that share a secondary copy.
    Secondary,
}

impl ShardIndex {
    pub const ALL: [ShardIndex; 7] = [
        ShardIndex::Param,
        ShardIndex::Grad,
        ShardIndex::Optimizer,
        ShardIndex::ParamLocal,
        ShardIndex::OptimizerInParam,
        ShardIndex::OptimizerInGrad,
        ShardIndex::Secondary,
    ];

    /// This index's position in [`ShardIndex::ALL`] (tables of a rank's indices use it).
    pub const fn slot(self) -> usize {
        self as usize
    }
}

/// A region's byte offset within its buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Offset {
    Fixed(u64),
    /// `base + index(rank) × stride`.
    Shard {
        index: ShardIndex,
        base: u64,
        stride: u64,
    },
}

/// A byte range of one buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Region {
    pub buffer: BufferId,
    pub offset: Offset,
    pub bytes: u64,
}

impl Region {
    /// The whole buffer.
    pub fn whole(buffer: BufferId, bytes: u64) -> Self {
        Region {
            buffer,
            offset: Offset::Fixed(0),
            bytes,
        }
    }
}

/// One collective call.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct CollectiveOp {
    pub kind: CollectiveKind,
    pub comm: CommId,
    pub dtype: Dtype,
    /// Elements of the full payload: an all-gather's output, a reduce-scatter's input, an
    /// all-reduce's or broadcast's buffer, what a send or receive moves. Each member's chunk of
    /// an all-gather or reduce-scatter is `count / group size`. A send's or receive's input and
    /// output are the same region: what is sent, or where it is received.
    pub count: u64,
    pub input: Region,
    pub output: Region,
}

impl CollectiveOp {
    /// What the call reads on the rank issuing it: its input (nothing for a receive).
    pub fn reads(&self) -> impl Iterator<Item = Region> {
        (self.kind != CollectiveKind::Recv)
            .then_some(self.input)
            .into_iter()
    }

    /// What the call writes on the rank issuing it: its output (nothing for a send).
    pub fn writes(&self) -> impl Iterator<Item = Region> {
        (self.kind != CollectiveKind::Send)
            .then_some(self.output)
            .into_iter()
    }
}

/// The compute ops of a layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ComputeKind {
    Forward,
    /// The forward again, during backward, from the saved input (`recompute = full`).
    Recompute,
    Backward,
    /// Softmax cross-entropy of the last layer's output and the gradient of its input.
    Loss,
    /// The optimizer on the rank's optimizer shard; writes its part of the param shard.
    Update,
    /// `output += input` (gradient accumulation).
    Accumulate,
    /// Byte copies: the hierarchical all-gather's rearrangement, hpZ's secondary shard, slices.
    Copy,
    /// Gradient clipping (`train.clip`): the sum of squares of every layer's optimizer-shard
    /// gradient on this rank, into a one-element fp32 buffer (see "Gradient clipping" above).
    GradNorm,
    /// The backward for the input gradient only (a pipeline's `I`): the gradient of the layer's
    /// input, and its stash for the weight gradients.
    BackwardInput,
    /// The backward for the parameter gradients only (a pipeline's `W`), after its
    /// `BackwardInput`, from the saved activations and the stash.
    BackwardWeight,
    /// A tensor-parallel layer's forward of sublayer j (0: attention, 1: the MLP; an mlp layer
    /// has only 0) up to its row-parallel product: reads the layer's parameter slice and the
    /// residual stream at the sublayer's input; writes the sublayer's saved activations and its
    /// **partial** (fp32, tokens × hidden), this rank's summand of the sublayer's output, which
    /// a tensor-group all-reduce sums (see "Tensor parallelism" above).
    ForwardOpen(u8),
    /// After the all-reduce of sublayer j's partials: the residual stream at the next
    /// sublayer's input (the layer's output after the last) ← the sum, in the model dtype.
    ForwardClose(u8),
    /// A tensor-parallel layer's backward of sublayer j (from the last) down to its
    /// column-parallel products: the gradients of the sublayer's sliced parameters (into the
    /// layer's fp32 gradient scratch) and the partial gradient of the sublayer's norm output,
    /// which a tensor-group all-reduce sums.
    BackwardOpen(u8),
    /// After that all-reduce: the sum through the (replicated) norm into the gradient of the
    /// residual stream at the sublayer's input; for j = 0 the layer's input gradient, and the
    /// layer's gradient written from the scratch as `Backward` writes it.
    BackwardClose(u8),
}

impl ComputeKind {
    /// Whether ops of this kind run layer math with matrix products (through the GEMM library,
    /// whose workspace is the first part of their stream's workspace).
    pub fn runs_layer_math(self) -> bool {
        matches!(
            self,
            ComputeKind::Forward
                | ComputeKind::Recompute
                | ComputeKind::Backward
                | ComputeKind::BackwardInput
                | ComputeKind::BackwardWeight
                | ComputeKind::ForwardOpen(_)
                | ComputeKind::BackwardOpen(_)
        )
    }

    /// The tensor-parallel sublayer a phase op runs (`None` for the other kinds).
    pub fn sublayer(self) -> Option<u8> {
        match self {
            ComputeKind::ForwardOpen(j)
            | ComputeKind::ForwardClose(j)
            | ComputeKind::BackwardOpen(j)
            | ComputeKind::BackwardClose(j) => Some(j),
            _ => None,
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum OpKind {
    Compute(ComputeKind),
    Collective(CollectiveOp),
    /// Several collectives issued as one coalesced call.
    Group(Vec<CollectiveOp>),
}

/// Why an op exists; decides its stream under the schedule's stream policy.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum OpRole {
    /// Layer math, the loss, the optimizer, copies.
    Compute,
    /// Parameter all-gathers for forward and backward.
    Gather,
    /// Per-micro-step gradient reductions.
    Reduce,
    /// Boundary synchronisation.
    Sync,
    /// The post-update parameter refresh.
    Refresh,
    /// Pipeline sends and receives of activations and their gradients.
    P2p,
    /// Tensor-group all-reduces of a tensor-parallel layer's partial sums (activations and
    /// their gradients): on the critical path, so on the compute stream.
    Tensor,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Op {
    pub kind: OpKind,
    pub role: OpRole,
    pub stream: StreamId,
    pub layer: Option<LayerId>,
    pub micro_step: Option<u32>,
    /// What the op reads and writes. For collectives these are their inputs and outputs.
    pub reads: Vec<Region>,
    pub writes: Vec<Region>,
    pub wait: Vec<EventId>,
    pub record: Option<EventId>,
}

impl Op {
    /// The collectives this op issues (none for compute ops).
    pub fn collectives(&self) -> &[CollectiveOp] {
        match &self.kind {
            OpKind::Compute(_) => &[],
            OpKind::Collective(c) => std::slice::from_ref(c),
            OpKind::Group(cs) => cs,
        }
    }

    pub fn compute_name(k: ComputeKind) -> &'static str {
        match k {
            ComputeKind::Forward => "forward",
            ComputeKind::Recompute => "recompute",
            ComputeKind::Backward => "backward",
            ComputeKind::Loss => "loss",
            ComputeKind::Update => "update",
            ComputeKind::Accumulate => "accumulate",
            ComputeKind::Copy => "copy",
            ComputeKind::GradNorm => "grad_norm",
            ComputeKind::BackwardInput => "backward_input",
            ComputeKind::BackwardWeight => "backward_weight",
            ComputeKind::ForwardOpen(_) => "forward_open",
            ComputeKind::ForwardClose(_) => "forward_close",
            ComputeKind::BackwardOpen(_) => "backward_open",
            ComputeKind::BackwardClose(_) => "backward_close",
        }
    }

    pub fn kind_name(&self) -> &'static str {
        match &self.kind {
            OpKind::Compute(k) => Self::compute_name(*k),
            OpKind::Collective(c) => c.kind.name(),
            OpKind::Group(_) => "group",
        }
    }
}

#[cfg(test)]
#[path = "../../tests/unit/ir_shard_index_tests.rs"]
mod shard_index_tests;
