//! The resolved job description: what semantic analysis hands to lowering.
//!
//! A [`Job`] is one schedule with its model and cluster, every default filled in, every preset
//! expanded, every unit converted (bytes as exact integers, bandwidth in bytes per second, time in
//! seconds, compute in FLOP/s) and every rule of `dsl.md` already checked. Later stages never see
//! syntax and never re-check the language's rules. Models carry exact per-layer parameter counts and
//! the tensor shapes the runtime names (`runtime.md`, "Tensor names").

use serde::{Deserialize, Serialize};
use std::fmt;
use std::path::PathBuf;
use std::sync::Arc;

#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Dtype {
    Bf16,
    Fp16,
    Fp32,
}

impl Dtype {
    pub const NAMES: [&'static str; 3] = ["bf16", "fp16", "fp32"];

    pub fn bytes(self) -> u64 {
        match self {
            Dtype::Bf16 | Dtype::Fp16 => 2,
            Dtype::Fp32 => 4,
        }
    }

    pub fn name(self) -> &'static str {
        Self::NAMES[self as usize]
    }
}

#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Optimizer {
    Adam,
    AdamW,
    Sgd,
}

impl Optimizer {
    pub const NAMES: [&'static str; 3] = ["adam", "adamw", "sgd"];

    /// fp32 optimizer-state bytes per parameter: master, m and v for Adam (ZeRO's K = 12).
    pub fn state_bytes_per_param(self) -> u64 {
        match self {
            Optimizer::Adam | Optimizer::AdamW => 12,
            Optimizer::Sgd => 4,
        }
    }

    pub fn name(self) -> &'static str {
        Self::NAMES[self as usize]
    }
}

/// A link class of the cluster: bandwidth in bytes per second, latency in seconds.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq)]
pub struct Link {
    pub bandwidth: f64,
    pub latency: f64,
}

#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Collective {
    AllGather,
    ReduceScatter,
    AllReduce,
    Broadcast,
    /// Point-to-point: member 0 of a two-member group sends its input to member 1
    /// (`ncclSend`); only member 0 issues it.
    Send,
    /// Point-to-point: member 1 of a two-member group receives member 0's send into its output
    /// (`ncclRecv`); only member 1 issues it.
    Recv,
}

impl Collective {
    pub const NAMES: [&'static str; 6] = [
        "all_gather",
        "reduce_scatter",
        "all_reduce",
        "broadcast",
        "send",
        "recv",
    ];

    /// The collectives a cluster's `measured` tables may give (a pipeline's sends and receives
    /// are one message over a link, which the link's bandwidth and latency already model).
    pub const MEASURED: [&'static str; 4] =
        ["all_gather", "reduce_scatter", "all_reduce", "broadcast"];

    /// A send or a receive rather than a collective of the whole group.
    pub fn is_point_to_point(self) -> bool {
        matches!(self, Collective::Send | Collective::Recv)
    }

    pub fn name(self) -> &'static str {
        Self::NAMES[self as usize]
    }
}

/// A sharding mesh `intra x inter`: `intra` GPUs within each node times `inter` nodes (AMSP's s⁰ × s¹).
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Mesh {
    pub intra: u32,
    pub inter: u32,
}

impl Mesh {
    pub const NONE: Mesh = Mesh { intra: 1, inter: 1 };

    /// Ranks the tensor is split over.
    pub fn size(self) -> u64 {
        u64::from(self.intra) * u64::from(self.inter)
    }

    /// True when `self` divides `other` in both dimensions (the nesting rule).
    pub fn divides(self, other: Mesh) -> bool {
        other.intra.is_multiple_of(self.intra) && other.inter.is_multiple_of(self.inter)
    }
}

impl fmt::Display for Mesh {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} x {}", self.intra, self.inter)
    }
}

/// A `measured` table: algorithm bandwidth (bytes/s) by payload size (bytes), sizes increasing.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct MeasuredTable {
    pub collective: Collective,
    pub mesh: Mesh,
    pub points: Vec<(u64, f64)>,
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct Cluster {
    pub name: String,
    pub nodes: u32,
    pub gpus_per_node: u32,
    pub gpu_memory: u64,
    /// Dense peak FLOP/s of one GPU at the model's dtype.
    pub peak_flops: f64,
    pub efficiency: f64,
    /// Sustained GPU memory bandwidth in bytes/s, when the cluster gives one; otherwise the cost
    /// model derives it from `peak_flops` ([`crate::sim::cost::FLOPS_PER_HBM_BYTE`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_bandwidth: Option<f64>,
    /// Bytes of the GEMM library's workspace (cuBLAS and cuBLASLt) each stream that runs layer
    /// math is given, inside its planned workspace buffer ([`crate::lower::workspace`]); default
    /// [`Cluster::DEFAULT_GEMM_WORKSPACE`].
    #[serde(default = "Cluster::default_gemm_workspace")]
    pub gemm_workspace: u64,
    pub intra_node: Link,
    pub inter_node: Link,
    pub measured: Vec<MeasuredTable>,
}

impl Cluster {
    /// The GEMM library workspace a stream gets unless the cluster says otherwise: 32 MiB,
    /// NVIDIA's recommendation for cuBLAS and cuBLASLt on Hopper (4 MiB suffices before it).
    pub const DEFAULT_GEMM_WORKSPACE: u64 = 32 << 20;

    fn default_gemm_workspace() -> u64 {
        Self::DEFAULT_GEMM_WORKSPACE
    }
}

#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Positions {
    Learned,
    Rope,
    None,
}

#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Norm {
    LayerNorm,
    RmsNorm,
}

impl Norm {
    /// Parameters of one norm over `hidden` features (gain, plus bias for layer norm).
    pub fn params(self, hidden: u64) -> u64 {
        match self {
            Norm::LayerNorm => 2 * hidden,
            Norm::RmsNorm => hidden,
        }
    }
}

#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Activation {
    Gelu,
    SwiGlu,
}

#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Attention {
    Flash,
    Naive,
}

/// The MLP half of a transformer (also the `mlp` layer kind).
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct MlpSpec {
    pub hidden: u64,
    pub ffn: u64,
    pub act: Activation,
    pub bias: bool,
    pub norm: Norm,
}

#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct TransformerSpec {
    pub hidden: u64,
    pub heads: u64,
    pub kv_heads: u64,
    pub ffn: u64,
    pub norm: Norm,
    pub act: Activation,
    pub bias: bool,
    pub attention: Attention,
}

impl TransformerSpec {
    pub fn head_dim(&self) -> u64 {
        self.hidden / self.heads
    }

    /// Width of the key (and of the value) projection: hidden · kv_heads / heads.
    pub fn kv_dim(&self) -> u64 {
        self.head_dim() * self.kv_heads
    }

    pub fn mlp(&self) -> MlpSpec {
        MlpSpec {
            hidden: self.hidden,
            ffn: self.ffn,
            act: self.act,
            bias: self.bias,
            norm: self.norm,
        }
    }
}

#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq)]
pub enum LayerKind {
    Embedding {
        vocab: u64,
        hidden: u64,
        positions: Positions,
    },
    Transformer(TransformerSpec),
    Mlp(MlpSpec),
    LmHead {
        hidden: u64,
        vocab: u64,
        norm: Norm,
        tied: bool,
    },
    /// An opaque layer for planning: parameters, forward FLOPs per token and activation bytes per token.
    Dense {
        params: u64,
        flops_per_token: f64,
        activation_bytes_per_token: u64,
    },
}

impl LayerKind {
    pub fn name(&self) -> &'static str {
        match self {
            LayerKind::Embedding { .. } => "embedding",
            LayerKind::Transformer(_) => "transformer",
            LayerKind::Mlp(_) => "mlp",
            LayerKind::LmHead { .. } => "lm_head",
            LayerKind::Dense { .. } => "dense",
        }
    }

    /// The hidden width this layer consumes and produces (`None` for opaque layers).
    pub fn hidden(&self) -> Option<u64> {
        match *self {
            LayerKind::Embedding { hidden, .. } | LayerKind::LmHead { hidden, .. } => Some(hidden),
            LayerKind::Transformer(t) => Some(t.hidden),
            LayerKind::Mlp(m) => Some(m.hidden),
            LayerKind::Dense { .. } => None,
        }
    }
}

/// One named weight tensor of a layer; matrices are [out, in] like a PyTorch `Linear`.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct TensorSpec {
    pub name: String,
    pub shape: Vec<u64>,
}

impl TensorSpec {
    pub fn elements(&self) -> u64 {
        self.shape.iter().product()
    }
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct Layer {
    /// The name as written, with the index for repeated layers: `block[3]`.
    pub name: String,
    pub kind: LayerKind,
    /// The layer's weights in the order they are flattened into its parameter buffer (empty for `dense`).
    pub tensors: Vec<TensorSpec>,
    /// Exact parameter count P_l (the sum of the tensors, or the declared count for `dense`).
    pub params: u64,
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct Model {
    pub name: String,
    pub dtype: Dtype,
    pub grad_dtype: Dtype,
    pub optimizer: Optimizer,
    pub seq_len: u64,
    pub micro_batch: u64,
    pub layers: Vec<Layer>,
    /// The norms' ε, added to the variance (or mean square) under the square root (`None`:
    /// [`Model::DEFAULT_NORM_EPS`]). Absent from plan files when not set.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub norm_eps: Option<f64>,
    /// The rotary base θ: position p turns pair i of a head of width d by p·θ^(−2i/d) (`None`:
    /// [`Model::DEFAULT_ROPE_BASE`]). Absent from plan files when not set.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rope_base: Option<f64>,
}

impl Model {
    /// The norms' ε when the model does not set one (GPT-2's and LLaMA's).
    pub const DEFAULT_NORM_EPS: f64 = 1e-5;
    /// The rotary base when the model does not set one (the RoFormer paper's and LLaMA's).
    pub const DEFAULT_ROPE_BASE: f64 = 10_000.0;

    /// The norms' ε as the fp32 norms add it.
    pub fn norm_eps(&self) -> f32 {
        self.norm_eps.unwrap_or(Self::DEFAULT_NORM_EPS) as f32
    }

    /// The rotary base θ.
    pub fn rope_base(&self) -> f64 {
        self.rope_base.unwrap_or(Self::DEFAULT_ROPE_BASE)
    }

    /// Ψ, the total parameter count (saturating: semantic analysis bounds real models far below).
    pub fn parameters(&self) -> u64 {
        self.layers
            .iter()
            .fold(0u64, |acc, l| acc.saturating_add(l.params))
    }
}

#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ReshardAfterForward {
    /// Release gathered parameters after forward, gather again for backward.
    True,
    /// Keep them until the layer's backward.
    False,
    /// ZeRO++ hpZ: keep a secondary shard of 1/`secondary` within each node for backward.
    Node { secondary: u32 },
}

#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum GradSync {
    TwoHop,
    Flat,
}

impl GradSync {
    /// The keyword as written in `.sched` files.
    pub fn name(self) -> &'static str {
        ["two_hop", "flat"][self as usize]
    }
}

#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum AllGatherAlgo {
    Flat,
    Hierarchical,
}

impl AllGatherAlgo {
    /// The keyword as written in `.sched` files.
    pub fn name(self) -> &'static str {
        ["flat", "hierarchical"][self as usize]
    }
}

#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Recompute {
    None,
    Full,
}

impl Recompute {
    /// The keyword as written in `.sched` files.
    pub fn name(self) -> &'static str {
        ["none", "full"][self as usize]
    }
}

#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Streams {
    Single,
    PerRole,
    PerLink,
}

impl Streams {
    /// The keyword as written in `.sched` files.
    pub fn name(self) -> &'static str {
        ["single", "per_role", "per_link"][self as usize]
    }
}

#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Refresh {
    /// On the sync stream (`true`) or the compute stream (`false`), right after the update.
    Overlap(bool),
    /// Deferred to just before each layer's first forward of the next step.
    NextForward,
}

#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Shard {
    pub params: Mesh,
    pub grads: Mesh,
    pub optimizer: Mesh,
}

#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Prefetch {
    pub forward: u32,
    pub backward: u32,
    /// Cap on gathered parameter bytes alive at once; `None` is unlimited.
    pub max_live: Option<u64>,
}

/// Coalescing limits in bytes; 0 is off.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Buckets {
    pub gather: u64,
    pub reduce: u64,
}

#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Overlap {
    pub gather: bool,
    pub reduce: bool,
    pub sync: bool,
    pub refresh: Refresh,
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct Train {
    pub steps: u64,
    pub lr: f64,
    pub seed: u64,
    /// The corpus, resolved relative to the schedule's file; `None` is the built-in corpus.
    pub data: Option<PathBuf>,
    /// Global gradient-norm limit; `None` is off.
    pub clip: Option<f64>,
    /// Folder of periodic checkpoints (`schedrun --checkpoints`), resolved relative to the
    /// schedule's file; `None` is off. Absent from plan files when not set.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checkpoints: Option<PathBuf>,
    /// A checkpoint every this many steps (`--save-every`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub save_every: Option<u64>,
    /// Checkpoint entries kept (`--keep`; `None`: schedrun's default, 3).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub keep: Option<u64>,
    /// Steps of linear warmup to `lr` (0: none). Absent from plan files when 0.
    #[serde(default, skip_serializing_if = "is_zero_u64")]
    pub warmup: u64,
    /// How the learning rate decays from `lr` to `min_lr` over the steps after the warmup.
    #[serde(default, skip_serializing_if = "Decay::is_constant")]
    pub decay: Decay,
    /// The learning rate the decay ends at (0 by default).
    #[serde(default, skip_serializing_if = "is_zero_f64")]
    pub min_lr: f64,
    /// AdamW's decoupled weight decay (`None`: 0.1). Absent from plan files when not set.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weight_decay: Option<f64>,
    /// Adam's β1 and β2 (`None`: 0.9 and 0.95).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub betas: Option<[f64; 2]>,
    /// Adam's ε (`None`: 1e-8).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eps: Option<f64>,
}

fn is_zero_u64(x: &u64) -> bool {
    *x == 0
}

fn is_zero_f64(x: &f64) -> bool {
    *x == 0.0
}

/// The learning-rate decay after the warmup (`train.decay`).
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[serde(rename_all = "snake_case")]
pub enum Decay {
    /// `lr` throughout.
    #[default]
    Constant,
    /// Linearly from `lr` to `min_lr` at the last step.
    Linear,
    /// Half a cosine from `lr` to `min_lr` at the last step.
    Cosine,
}

impl Decay {
    pub fn is_constant(&self) -> bool {
        *self == Decay::Constant
    }

    pub fn name(self) -> &'static str {
        match self {
            Decay::Constant => "constant",
            Decay::Linear => "linear",
            Decay::Cosine => "cosine",
        }
    }
}

impl Train {
    /// The learning rate of step `t` (0-based, counted over the whole run, resumes included) with
    /// base rate `lr` (the schedule's, or a command line's): `lr·(t+1)/W` during a warmup of W
    /// steps, then, with progress `q = (t − W) / (steps − W)` clamped to [0, 1], `lr` (constant),
    /// `min + (lr − min)·(1 − q)` (linear) or `min + (lr − min)·(1 + cos πq)/2` (cosine), as
    /// nanoGPT and Hugging Face's schedulers with a floor compute them.
    pub fn lr_at(&self, lr: f64, t: u64) -> f64 {
        if t < self.warmup {
            return lr * (t + 1) as f64 / self.warmup as f64;
        }
        let span = self.steps.saturating_sub(self.warmup).max(1) as f64;
        let q = ((t - self.warmup) as f64 / span).clamp(0.0, 1.0);
        let min = self.min_lr;
        match self.decay {
            Decay::Constant => lr,
            Decay::Linear => min + (lr - min) * (1.0 - q),
            Decay::Cosine => min + (lr - min) * 0.5 * (1.0 + (std::f64::consts::PI * q).cos()),
        }
    }
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct Schedule {
    pub name: String,
    /// The preset as written (`mics(partition = 8)`), for display; its effects are already applied.
    pub preset: Option<String>,
    pub nodes: u32,
    pub gpus_per_node: u32,
    pub micro_steps: u32,
    pub shard: Shard,
    pub reshard_after_forward: ReshardAfterForward,
    pub grad_sync: GradSync,
    pub all_gather: AllGatherAlgo,
    pub prefetch: Prefetch,
    pub buckets: Buckets,
    pub recompute: Recompute,
    pub streams: Streams,
    pub overlap: Overlap,
    pub train: Train,
    /// Tensor parallelism (t = 1, none, by default; left out of a plan file's job and of every
    /// JSON output then, so schedules without it serialise as before).
    #[serde(default, skip_serializing_if = "Tensor::is_default")]
    pub tensor: Tensor,
    /// Pipeline stages and their order of actions (one stage, no pipeline, by default; left
    /// out of a plan file's job then, so plans without a pipeline read as before).
    #[serde(default, skip_serializing_if = "Pipeline::is_default")]
    pub pipeline: Pipeline,
}

/// Tensor parallelism, resolved (parallel spec §1): each layer split over a tensor group of t
/// consecutive ranks of one node, Megatron-LM style.
///
/// Ranks are `t × p × d`, decomposed with t fastest: rank `r = (stage·d + dp_index)·t +
/// tp_index` ([`crate::Layout`]). `sequence` is only ever true with t > 1 (semantic analysis
/// resolves `sequence = true` over one rank to the default).
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Tensor {
    /// t, the ranks of a tensor group.
    pub size: u32,
    /// Sequence parallelism: the residual stream and the norms split by sequence.
    pub sequence: bool,
}

impl Default for Tensor {
    /// A tensor group of one rank: no tensor parallelism.
    fn default() -> Self {
        Tensor {
            size: 1,
            sequence: false,
        }
    }
}

impl Tensor {
    /// t = 1 and nothing else set.
    pub fn is_default(&self) -> bool {
        *self == Tensor::default()
    }

    /// Whether layers are split over more than one rank.
    pub fn is_parallel(&self) -> bool {
        self.size > 1
    }
}

/// A built-in pipeline schedule, or the user's own order (parallel spec §1, "Schedules").
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum PipelineSchedule {
    Gpipe,
    #[default]
    OneFOneB,
    Interleaved1F1B,
    ZbH1,
    Zbv,
    Custom,
}

impl PipelineSchedule {
    pub const ALL: [PipelineSchedule; 6] = [
        PipelineSchedule::Gpipe,
        PipelineSchedule::OneFOneB,
        PipelineSchedule::Interleaved1F1B,
        PipelineSchedule::ZbH1,
        PipelineSchedule::Zbv,
        PipelineSchedule::Custom,
    ];

    /// The name as the language spells it (`"1f1b"` is written as a string).
    pub fn name(self) -> &'static str {
        match self {
            PipelineSchedule::Gpipe => "gpipe",
            PipelineSchedule::OneFOneB => "1f1b",
            PipelineSchedule::Interleaved1F1B => "interleaved_1f1b",
            PipelineSchedule::ZbH1 => "zb_h1",
            PipelineSchedule::Zbv => "zbv",
            PipelineSchedule::Custom => "custom",
        }
    }
}

/// What one action of a stage does to one (micro-batch, chunk).
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ActionKind {
    /// Forward.
    F,
    /// The whole backward (input and weight gradients).
    B,
    /// Backward for the input gradient only.
    I,
    /// Backward for the weight gradients only (after its `I`).
    W,
}

impl ActionKind {
    pub fn letter(self) -> char {
        match self {
            ActionKind::F => 'F',
            ActionKind::B => 'B',
            ActionKind::I => 'I',
            ActionKind::W => 'W',
        }
    }
}

/// One action of a stage's order: `F3`, `B0.1` (micro-batch 0 of the stage's local chunk 1).
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Action {
    pub kind: ActionKind,
    /// The micro-batch, 0 … m−1.
    pub micro: u32,
    /// The stage's local chunk index, 0 … v−1 (see [`Pipeline::chunk`]).
    pub chunk: u32,
}

impl std::fmt::Display for Action {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}{}", self.kind.letter(), self.micro)?;
        if self.chunk > 0 {
            write!(f, ".{}", self.chunk)?;
        }
        Ok(())
    }
}

/// Pipeline parallelism, resolved: stages, chunks and every stage's order of actions.
///
/// Ranks are `stages × d` without tensor parallelism: rank `r = stage·d + dp_index` (with it,
/// `stages × d × t`, see [`Tensor`]). The model's layers are split into `stages × virtual`
/// contiguous chunks; chunk `c` runs on stage [`Pipeline::stage_of_chunk`], as its local chunk
/// [`Pipeline::local_chunk`].
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct Pipeline {
    /// p, the number of stages.
    pub stages: u32,
    /// v, model chunks per stage.
    pub virtual_stages: u32,
    pub schedule: PipelineSchedule,
    /// Layers of each chunk in model order (p·v entries summing to the model's layer count).
    pub chunks: Vec<u32>,
    /// Each stage's actions in the order it runs them (generated for the built-in schedules).
    pub order: Vec<Vec<Action>>,
}

impl Default for Pipeline {
    /// One stage holding the whole model: no pipeline.
    fn default() -> Self {
        Pipeline {
            stages: 1,
            virtual_stages: 1,
            schedule: PipelineSchedule::default(),
            chunks: vec![],
            order: vec![],
        }
    }
}

impl Pipeline {
    /// One stage and nothing else set.
    pub fn is_default(&self) -> bool {
        *self == Pipeline::default()
    }

    /// Whether the schedule has more than one stage.
    pub fn is_pipelined(&self) -> bool {
        self.stages > 1
    }

    /// The stage that runs chunk `c`: `c mod p` (Megatron's interleaved placement), or for `zbv`
    /// the V: chunk `c` on stage `c` for `c < p`, on stage `2p−1−c` after.
    pub fn stage_of_chunk(&self, c: u32) -> u32 {
        let p = self.stages;
        if self.schedule == PipelineSchedule::Zbv && c >= p {
            2 * p - 1 - c
        } else {
            c % p
        }
    }

    /// Chunk `c`'s index among its stage's chunks (0 … v−1).
    pub fn local_chunk(&self, c: u32) -> u32 {
        c / self.stages
    }

    /// The chunk that stage `s` runs as its local chunk `local`.
    pub fn chunk_of(&self, s: u32, local: u32) -> u32 {
        let p = self.stages;
        if self.schedule == PipelineSchedule::Zbv && local % 2 == 1 {
            local * p + (p - 1 - s)
        } else {
            local * p + s
        }
    }

    /// The model layers of chunk `c` (indices into the model's layers).
    pub fn layers_of_chunk(&self, c: u32) -> std::ops::Range<usize> {
        let start: u32 = self.chunks[..c as usize].iter().sum();
        start as usize..(start + self.chunks[c as usize]) as usize
    }

    /// The chunk holding model layer `l` (0 without a pipeline, or past the chunks).
    pub fn chunk_of_layer(&self, l: usize) -> u32 {
        let mut end = 0;
        for (c, &n) in self.chunks.iter().enumerate() {
            end += n as usize;
            if l < end {
                return c as u32;
            }
        }
        0
    }

    /// The stage running model layer `l`.
    pub fn stage_of_layer(&self, l: usize) -> u32 {
        self.stage_of_chunk(self.chunk_of_layer(l))
    }
}

/// One training job: a schedule with the model and cluster it names.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct Job {
    pub schedule: Schedule,
    pub model: Arc<Model>,
    pub cluster: Arc<Cluster>,
}

impl Job {
    /// dp = G × N, the ranks used.
    pub fn ranks(&self) -> u64 {
        u64::from(self.schedule.gpus_per_node) * u64::from(self.schedule.nodes)
    }

    /// The tied lm_head and the embedding it shares, as (head, embedding) layer indices.
    pub fn tied_head(&self) -> Option<(usize, usize)> {
        let layers = &self.model.layers;
        let h = layers
            .iter()
            .position(|l| matches!(l.kind, LayerKind::LmHead { tied: true, .. }))?;
        let e = layers
            .iter()
            .position(|l| matches!(l.kind, LayerKind::Embedding { .. }))?;
        Some((h, e))
    }

    /// What tensor parallelism cannot lower yet in this job, when t > 1: a split backward
    /// (`I`/`W` actions) of tensor-parallel layers.
    /// `None` when it lowers.
    pub fn tensor_not_lowered(&self) -> Option<&'static str> {
        if !self.schedule.tensor.is_parallel() {
            return None;
        }
        let split = self
            .schedule
            .pipeline
            .order
            .iter()
            .flatten()
            .any(|a| matches!(a.kind, ActionKind::I | ActionKind::W));
        split.then_some("a split backward (`I`/`W` actions)")
    }

    /// The tied head and its embedding when the head keeps a replica of the embedding's state
    /// (Megatron's embedding group): when they run on different pipeline stages, or in different
    /// chunks of one stage (ZB-V's V) with parameters or gradients sharded, where the head's
    /// actions would otherwise need the embedding's chunk's gathers and reductions. The replica's
    /// gradient is summed with the embedding's before both update, so the two stay equal.
    pub fn tied_replica(&self) -> Option<(usize, usize)> {
        let pipeline = &self.schedule.pipeline;
        let sh = self.schedule.shard;
        let sharded = sh.params.size() > 1 || sh.grads.size() > 1;
        self.tied_head().filter(|&(h, e)| {
            pipeline.stage_of_layer(h) != pipeline.stage_of_layer(e)
                || (sharded && pipeline.chunk_of_layer(h) != pipeline.chunk_of_layer(e))
        })
    }
}

#[cfg(test)]
#[path = "../tests/unit/lr_schedule.rs"]
mod lr_schedule;
