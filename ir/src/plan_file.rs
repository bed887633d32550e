//! The plan file (`cli.md`, "The plan file"): JSON, versioned, the contract between `schedc`,
//! `schedrun` and other tools. [`emit_plan`] writes a program; [`read_plan`] reads one back into a
//! [`Program`] for `schedc verify`, refusing anything malformed with a message that says where.
//!
//! Beyond the required fields the file carries the shard meshes and hpZ's secondary size (so a
//! reader can evaluate rank-dependent offsets), each op's role, each region's shard index and
//! stride where its offset depends on the rank, and the resolved job (model, cluster, schedule and
//! training settings), so that `schedrun` and the simulator need nothing but the plan.
//!
//! Any bytes may arrive here (`fuzz/fuzz_targets/plan.rs`), so the reader also refuses what would
//! make the verifier's work unbounded or its arithmetic overflow, each with its reason: more than
//! [`MAX_RANKS`] ranks or [`MAX_MICRO_STEPS`] micro-steps, ranks that are not nodes × GPUs per
//! node, more events than ops, layers over [`MAX_LAYER_PARAMS`] parameters or not padded as the
//! lowering pads them (to a multiple of s_os and of hpZ's secondary size), regions that do not fit
//! their buffer at rank 0 (where every shard index is 0) or whose furthest end passes 2^64, and
//! collectives whose payload in bytes passes 2^64, and a model whose `norm_eps` or `rope_base` is
//! out of the language's range. What is left is the verifier's to judge. Fields added since
//! version 2 (the model's `norm_eps` and `rope_base`, the training settings) are optional: a plan
//! without them reads with the defaults.

use crate::ir::*;
use crate::job::{Collective, Dtype, Job, Mesh, Shard};
use cranelift_entity::{EntityRef, SecondaryMap};
use serde::{Deserialize, Serialize};

pub const FORMAT: &str = "sched-plan";
/// Version 2 added workspaces: the `workspace` buffer kind and each stream's `workspace`.
pub const VERSION: u32 = 2;
/// The most ranks a plan file may have (the verifier's work grows with them; the language allows
/// no more micro-steps than this either).
pub const MAX_RANKS: u32 = 1 << 20;
/// The most micro-steps a plan file may have (as in the language).
pub const MAX_MICRO_STEPS: u32 = 1 << 20;
/// The most parameters a plan's layer may have (far beyond any model; keeps the verifier's byte
/// arithmetic far from overflow).
pub const MAX_LAYER_PARAMS: u64 = 1 << 48;

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PlanFile {
    pub format: String,
    pub version: u32,
    pub schedule: String,
    pub ranks: u32,
    pub nodes: u32,
    pub gpus_per_node: u32,
    pub micro_steps: u32,
    pub arena_bytes: u64,
    pub shard: ShardFile,
    pub secondary: Option<u32>,
    /// Pipeline stages (absent: one).
    #[serde(default = "one", skip_serializing_if = "is_one")]
    pub stages: u32,
    /// The tensor-parallel degree t (absent: one).
    #[serde(default = "one", skip_serializing_if = "is_one")]
    pub tensor: u32,
    /// Sequence parallelism over the tensor groups (absent: none).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub sequence: bool,
    pub layers: Vec<LayerFile>,
    pub communicators: Vec<CommFile>,
    pub buffers: Vec<BufferFile>,
    pub events: u32,
    pub streams: Vec<StreamFile>,
    /// The resolved job the plan was compiled from.
    pub job: Job,
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ShardFile {
    pub params: [u32; 2],
    pub grads: [u32; 2],
    pub optimizer: [u32; 2],
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LayerFile {
    pub name: String,
    pub params: u64,
    pub padded: u64,
    /// The pipeline chunk holding it (absent: 0).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub chunk: u32,
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CommFile {
    pub id: u32,
    pub name: String,
    pub scope: String,
    pub groups: Vec<Vec<u32>>,
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BufferFile {
    pub id: u32,
    pub name: String,
    pub kind: String,
    pub bytes: u64,
    pub dtype: String,
    pub offset: u64,
    pub persistent: bool,
    pub layer: Option<u32>,
    /// The pipeline stage holding it (absent: 0).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub stage: u32,
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StreamFile {
    pub name: String,
    /// The stream's workspace, when it has one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub workspace: Option<WorkspaceFile>,
    /// The pipeline stage running it (absent: 0).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub stage: u32,
    pub ops: Vec<OpFile>,
}

fn one() -> u32 {
    1
}

fn is_one(n: &u32) -> bool {
    *n == 1
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

/// A stream's workspace: its buffer (of kind `workspace`) and the bytes of its GEMM part.
#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WorkspaceFile {
    pub buffer: u32,
    pub gemm_bytes: u64,
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RegionFile {
    pub buffer: u32,
    pub offset: u64,
    pub bytes: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub index: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stride: Option<u64>,
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CollectiveFile {
    pub kind: String,
    pub communicator: u32,
    pub dtype: String,
    pub count: u64,
    pub input: RegionFile,
    pub output: RegionFile,
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OpFile {
    pub id: u32,
    pub kind: String,
    pub role: String,
    pub layer: Option<String>,
    pub micro_step: Option<u32>,
    pub reads: Vec<RegionFile>,
    pub writes: Vec<RegionFile>,
    pub wait: Vec<u32>,
    pub record: Option<u32>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ops: Vec<CollectiveFile>,
    /// A tensor-parallel phase's sublayer (`forward_open` … `backward_close`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sublayer: Option<u8>,
}

const KINDS: [(BufferKind, &str); 12] = [
    (BufferKind::ParamShard, "param_shard"),
    (BufferKind::GradShard, "grad_shard"),
    (BufferKind::OptimizerShard, "optimizer_shard"),
    (BufferKind::Gathered, "gathered"),
    (BufferKind::Secondary, "secondary"),
    (BufferKind::Staging, "staging"),
    (BufferKind::FullGrad, "full_grad"),
    (BufferKind::Activation, "activation"),
    (BufferKind::Hidden, "hidden"),
    (BufferKind::Workspace, "workspace"),
    (BufferKind::Stash, "stash"),
    (BufferKind::Partial, "partial"),
];
const ROLES: [(OpRole, &str); 7] = [
    (OpRole::Compute, "compute"),
    (OpRole::Gather, "gather"),
    (OpRole::Reduce, "reduce"),
    (OpRole::Sync, "sync"),
    (OpRole::Refresh, "refresh"),
    (OpRole::P2p, "p2p"),
    (OpRole::Tensor, "tensor"),
];
const STREAM_ROLES: [StreamRole; 7] = [
    StreamRole::Compute,
    StreamRole::Gather,
    StreamRole::Reduce,
    StreamRole::Sync,
    StreamRole::Intra,
    StreamRole::Inter,
    StreamRole::P2p,
];
const SCOPES: [Scope; 3] = [Scope::Intra, Scope::Inter, Scope::Mixed];
const COMPUTE: [ComputeKind; 14] = [
    ComputeKind::Forward,
    ComputeKind::Recompute,
    ComputeKind::Backward,
    ComputeKind::Loss,
    ComputeKind::Update,
    ComputeKind::Accumulate,
    ComputeKind::Copy,
    ComputeKind::GradNorm,
    ComputeKind::BackwardInput,
    ComputeKind::BackwardWeight,
    ComputeKind::ForwardOpen(0),
    ComputeKind::ForwardClose(0),
    ComputeKind::BackwardOpen(0),
    ComputeKind::BackwardClose(0),
];

/// A buffer kind's name in plan files.
fn kind_name(k: BufferKind) -> &'static str {
    KINDS
        .iter()
        .find(|x| x.0 == k)
        .map(|x| x.1)
        .unwrap_or_default()
}

/// Writes the program compiled from `job` as a plan file.
pub fn emit_plan(p: &Program, job: &Job) -> PlanFile {
    let mesh = |m: Mesh| [m.intra, m.inter];
    let Layout {
        shard, secondary, ..
    } = p.layout;
    PlanFile {
        format: FORMAT.to_string(),
        version: VERSION,
        schedule: p.schedule.clone(),
        ranks: p.ranks(),
        nodes: p.layout.nodes,
        gpus_per_node: p.layout.gpus_per_node,
        micro_steps: p.micro_steps,
        arena_bytes: p.arena_bytes,
        shard: ShardFile {
            params: mesh(shard.params),
            grads: mesh(shard.grads),
            optimizer: mesh(shard.optimizer),
        },
        secondary,
        stages: p.layout.stages,
        tensor: p.layout.tensor,
        sequence: p.layout.sequence,
        layers: p
            .layers
            .values()
            .map(|l| LayerFile {
                name: l.name.clone(),
                params: l.params,
                padded: l.padded,
                chunk: l.chunk,
            })
            .collect(),
        communicators: p
            .comms
            .iter()
            .map(|(id, c)| CommFile {
                id: id.as_u32(),
                name: c.name.clone(),
                scope: c.scope.name().into(),
                groups: c.groups.clone(),
            })
            .collect(),
        buffers: p
            .buffers
            .iter()
            .map(|(id, b)| BufferFile {
                id: id.as_u32(),
                name: b.name.clone(),
                kind: kind_name(b.kind).into(),
                bytes: b.bytes,
                dtype: b.dtype.name().into(),
                offset: b.offset,
                persistent: b.kind.is_persistent(),
                layer: b.layer.map(|l| l.as_u32()),
                stage: b.stage,
            })
            .collect(),
        events: p.events.len() as u32,
        streams: p
            .streams
            .iter()
            .map(|(sid, s)| StreamFile {
                name: s.role.name().into(),
                workspace: s.workspace.map(|w| WorkspaceFile {
                    buffer: w.buffer.as_u32(),
                    gemm_bytes: w.gemm_bytes,
                }),
                stage: s.stage,
                ops: p
                    .ops
                    .iter()
                    .filter(|(_, o)| o.stream == sid)
                    .map(|(id, o)| op_file(p, id, o))
                    .collect(),
            })
            .collect(),
        job: job.clone(),
    }
}

fn region_file(r: &Region) -> RegionFile {
    match r.offset {
        Offset::Fixed(o) => RegionFile {
            buffer: r.buffer.as_u32(),
            offset: o,
            bytes: r.bytes,
            index: None,
            stride: None,
        },
        Offset::Shard {
            index,
            base,
            stride,
        } => RegionFile {
            buffer: r.buffer.as_u32(),
            offset: base,
            bytes: r.bytes,
            index: Some(crate::listing::index_name(index).into()),
            stride: Some(stride),
        },
    }
}

fn op_file(p: &Program, id: OpId, o: &Op) -> OpFile {
    let coll = |c: &CollectiveOp| CollectiveFile {
        kind: c.kind.name().into(),
        communicator: c.comm.as_u32(),
        dtype: c.dtype.name().into(),
        count: c.count,
        input: region_file(&c.input),
        output: region_file(&c.output),
    };
    OpFile {
        id: id.as_u32(),
        kind: o.kind_name().into(),
        role: ROLES
            .iter()
            .find(|r| r.0 == o.role)
            .map(|r| r.1)
            .unwrap_or_default()
            .into(),
        layer: o.layer.map(|l| p.layers[l].name.clone()),
        micro_step: o.micro_step,
        reads: o.reads.iter().map(region_file).collect(),
        writes: o.writes.iter().map(region_file).collect(),
        wait: o.wait.iter().map(|e| e.as_u32()).collect(),
        record: o.record.map(|e| e.as_u32()),
        ops: o.collectives().iter().map(coll).collect(),
        sublayer: match o.kind {
            OpKind::Compute(k) => k.sublayer(),
            _ => None,
        },
    }
}

/// A plan as read back: the program (its layout included) and the job it was compiled from.
pub struct ReadPlan {
    pub program: Program,
    pub job: Job,
}

/// Why a text is not a plan file this version reads; every refusal says what and where.
#[derive(Clone, Debug, thiserror::Error)]
pub enum ReadError {
    /// Not JSON (the JSON reader's words, with the line and column).
    #[error("not a plan file: {0}")]
    NotJson(#[source] std::sync::Arc<serde_json::Error>),
    /// JSON that is not a sched plan (its `format` or `version` is missing or wrong).
    #[error("not a plan file: {0}")]
    NotAPlan(String),
    /// A plan of another format version.
    #[error("plan format version {found} is not supported (this schedc reads version {VERSION})")]
    Version { found: u64 },
    /// JSON without the plan file's shape: a missing or unknown field, a value of the wrong type
    /// (the JSON reader's words, with the line and column).
    #[error("malformed plan: {0}")]
    Malformed(#[source] std::sync::Arc<serde_json::Error>),
    /// A value the plan file refuses: the entity or field, and what is wrong with it.
    #[error("{0}")]
    Invalid(String),
}

/// [`ReadError::Invalid`] with a `format!` message.
macro_rules! invalid {
    ($($arg:tt)*) => {
        ReadError::Invalid(format!($($arg)*))
    };
}

/// Parses plan JSON; every refusal says what and where.
pub fn read_plan(text: &str) -> Result<ReadPlan, ReadError> {
    let head: serde_json::Value =
        serde_json::from_str(text).map_err(|e| ReadError::NotJson(e.into()))?;
    if head.get("format").and_then(|f| f.as_str()) != Some(FORMAT) {
        return Err(ReadError::NotAPlan(format!(
            "`format` must be \"{FORMAT}\""
        )));
    }
    match head.get("version").and_then(|v| v.as_u64()) {
        Some(v) if v == u64::from(VERSION) => {}
        Some(found) => return Err(ReadError::Version { found }),
        None => return Err(ReadError::NotAPlan("`version` is missing".into())),
    }
    let f: PlanFile = serde_json::from_value(head).map_err(|e| ReadError::Malformed(e.into()))?;
    from_file(f)
}

fn from_file(f: PlanFile) -> Result<ReadPlan, ReadError> {
    let mesh = |m: [u32; 2], what: &str| {
        if m[0] == 0 || m[1] == 0 {
            Err(invalid!("shard.{what} has a zero factor"))
        } else {
            Ok(Mesh {
                intra: m[0],
                inter: m[1],
            })
        }
    };
    let shard = Shard {
        params: mesh(f.shard.params, "params")?,
        grads: mesh(f.shard.grads, "grads")?,
        optimizer: mesh(f.shard.optimizer, "optimizer")?,
    };
    check_job(&f, shard)?;
    // Sizes: the verifier's work grows with ranks and micro-steps.
    if f.ranks == 0 || f.nodes.checked_mul(f.gpus_per_node) != Some(f.ranks) {
        return Err(invalid!(
            "{} ranks is not {} nodes x {} GPUs per node",
            f.ranks,
            f.nodes,
            f.gpus_per_node
        ));
    }
    if f.ranks > MAX_RANKS {
        return Err(invalid!(
            "{} ranks: plan files of more than {MAX_RANKS} ranks are refused",
            f.ranks
        ));
    }
    if f.stages == 0 || !f.ranks.is_multiple_of(f.stages) {
        return Err(invalid!(
            "{} stages do not divide {} ranks into equal stages",
            f.stages,
            f.ranks
        ));
    }
    if f.tensor == 0 || !(f.ranks / f.stages).is_multiple_of(f.tensor) {
        return Err(invalid!(
            "tensor groups of {} ranks do not divide a stage's {} ranks",
            f.tensor,
            f.ranks / f.stages
        ));
    }
    let stages = f.stages;
    let stage = |s: u32, what: &str| {
        if s < stages {
            Ok(s)
        } else {
            Err(invalid!(
                "{what}: stage {s}, but the plan has {stages} stages"
            ))
        }
    };
    if f.micro_steps == 0 || f.micro_steps > MAX_MICRO_STEPS {
        return Err(invalid!(
            "{} micro-steps: a plan has 1 to {MAX_MICRO_STEPS}",
            f.micro_steps
        ));
    }
    // Layers are padded to a multiple of s_os and of hpZ's secondary size (the lowering's rule,
    // on which the verifier's value proof builds).
    // (Meshes that do not divide the cluster are the verifier's to report.)
    let divides = [shard.params, shard.grads, shard.optimizer]
        .iter()
        .all(|m| f.gpus_per_node.is_multiple_of(m.intra) && f.nodes.is_multiple_of(m.inter));
    let pad = match f.secondary {
        Some(0) => return Err(invalid!("`secondary` must be at least 1")),
        k => lcm(shard.optimizer.size(), u64::from(k.unwrap_or(1))),
    };
    for l in f.layers.iter().filter(|_| divides) {
        if l.params > MAX_LAYER_PARAMS {
            return Err(invalid!(
                "layer {}: {} parameters (at most {MAX_LAYER_PARAMS})",
                l.name,
                l.params
            ));
        }
        if l.params.div_ceil(pad).checked_mul(pad) != Some(l.padded) {
            return Err(invalid!(
                "layer {}: `padded` is {}, but {} parameters rounded up to a multiple of {pad} \
                 are {}",
                l.name,
                l.padded,
                l.params,
                l.params.div_ceil(pad) * pad
            ));
        }
    }
    let mut p = Program {
        schedule: f.schedule,
        layout: Layout {
            gpus_per_node: f.gpus_per_node,
            nodes: f.nodes,
            shard,
            secondary: f.secondary,
            stages: f.stages,
            tensor: f.tensor,
            sequence: f.sequence,
        },
        micro_steps: f.micro_steps,
        arena_bytes: f.arena_bytes,
        ..Program::default()
    };
    for l in f.layers {
        p.layers.push(LayerInfo {
            name: l.name,
            params: l.params,
            padded: l.padded,
            chunk: l.chunk,
        });
    }
    for (i, c) in f.communicators.into_iter().enumerate() {
        if c.id as usize != i {
            return Err(invalid!(
                "communicator {i} has id {}: ids must be 0, 1, 2, … in order",
                c.id
            ));
        }
        let scope = *SCOPES
            .iter()
            .find(|s| s.name() == c.scope)
            .ok_or_else(|| invalid!("comm{i}: unknown scope `{}`", c.scope))?;
        if c.groups.is_empty() || c.groups.iter().any(|g| g.is_empty()) {
            return Err(invalid!("comm{i}: a communicator needs non-empty groups"));
        }
        p.comms.push(Communicator {
            name: c.name,
            groups: c.groups,
            scope,
        });
    }
    for (i, b) in f.buffers.into_iter().enumerate() {
        if b.id as usize != i {
            return Err(invalid!(
                "buffer {i} has id {}: ids must be 0, 1, 2, … in order",
                b.id
            ));
        }
        let kind = KINDS
            .iter()
            .find(|k| k.1 == b.kind)
            .ok_or_else(|| invalid!("buf{i}: unknown kind `{}`", b.kind))?
            .0;
        let layer = match b.layer {
            Some(l) if l as usize >= p.layers.len() => {
                return Err(invalid!("buf{i}: layer {l} does not exist"))
            }
            l => l.map(LayerId::from_u32),
        };
        p.buffers.push(Buffer {
            name: b.name,
            kind,
            dtype: dtype(&b.dtype, &format!("buf{i}"))?,
            bytes: b.bytes,
            layer,
            offset: b.offset,
            stage: stage(b.stage, &format!("buf{i}"))?,
        });
    }
    // Ops come grouped by stream; their ids give the issue order.
    let total: usize = f.streams.iter().map(|s| s.ops.len()).sum();
    // Each event is recorded by one op: more events than ops cannot all be.
    if f.events as usize > total {
        return Err(invalid!(
            "{} events but {total} ops: each event is recorded by one op",
            f.events
        ));
    }
    for _ in 0..f.events {
        p.events.push(Event {
            recorder: OpId::new(0),
        });
    }
    let mut slots: Vec<Option<Op>> = vec![None; total];
    for (si, s) in f.streams.into_iter().enumerate() {
        let role = *STREAM_ROLES
            .iter()
            .find(|r| r.name() == s.name)
            .ok_or_else(|| invalid!("stream {si}: unknown name `{}`", s.name))?;
        let workspace = match s.workspace {
            None => None,
            Some(w) => {
                // (Checked before making an id: making one of u32::MAX panics.)
                if w.buffer as usize >= p.buffers.len() {
                    return Err(invalid!(
                        "stream {}: workspace buffer {} does not exist",
                        s.name,
                        w.buffer
                    ));
                }
                let b = &p.buffers[BufferId::from_u32(w.buffer)];
                if b.kind != BufferKind::Workspace {
                    return Err(invalid!(
                        "stream {}: its workspace buf{} is a `{}` buffer, not a `workspace` one",
                        s.name,
                        w.buffer,
                        kind_name(b.kind)
                    ));
                }
                if w.gemm_bytes > b.bytes {
                    return Err(invalid!(
                        "stream {}: a GEMM part of {} B does not fit its {} B workspace buf{}",
                        s.name,
                        w.gemm_bytes,
                        b.bytes,
                        w.buffer
                    ));
                }
                Some(StreamWorkspace {
                    buffer: BufferId::from_u32(w.buffer),
                    gemm_bytes: w.gemm_bytes,
                })
            }
        };
        let stage = stage(s.stage, &format!("stream {}", s.name))?;
        let sid = p.streams.push(Stream {
            role,
            workspace,
            stage,
        });
        if let Some(w) = s.ops.windows(2).find(|w| w[0].id >= w[1].id) {
            return Err(invalid!(
                "stream {} lists op{} before op{}: a stream runs its ops in issue order (ascending ids)",
                s.name, w[0].id, w[1].id
            ));
        }
        for o in s.ops {
            let id = o.id as usize;
            if id >= total || slots[id].is_some() {
                return Err(invalid!(
                    "op{id} on stream {}: op ids must be 0 … {} and each used once",
                    s.name,
                    total - 1
                ));
            }
            slots[id] = Some(op_from(&p, sid, o)?);
        }
    }
    for (i, o) in slots.into_iter().enumerate() {
        let o = o.ok_or_else(|| invalid!("op{i} is missing"))?;
        if let Some(e) = o.record {
            p.events[e].recorder = OpId::new(i);
        }
        p.ops.push(o);
    }
    let mut recorded: SecondaryMap<EventId, bool> = SecondaryMap::new();
    for o in p.ops.values() {
        if let Some(e) = o.record {
            if std::mem::replace(&mut recorded[e], true) {
                return Err(invalid!("{e} is recorded by two ops"));
            }
        }
    }
    if let Some(e) = p.events.keys().find(|&e| !recorded[e]) {
        return Err(invalid!("{e} is never recorded"));
    }
    Ok(ReadPlan {
        program: p,
        job: f.job,
    })
}

/// The job a plan carries must be the one its program was compiled for.
fn check_job(f: &PlanFile, shard: Shard) -> Result<(), ReadError> {
    let (job, layout) = (&f.job, Layout::of(&f.job));
    let layers: Vec<&str> = job.model.layers.iter().map(|l| l.name.as_str()).collect();
    let mismatch = if job.ranks() != u64::from(f.ranks) {
        Some(format!("{} ranks", job.ranks()))
    } else if job.schedule.micro_steps != f.micro_steps {
        Some(format!("{} micro-steps", job.schedule.micro_steps))
    } else if layout.tensor != f.tensor {
        Some(format!("tensor groups of {} ranks", layout.tensor))
    } else if layout.sequence != f.sequence {
        Some(format!(
            "sequence parallelism {}",
            if layout.sequence { "on" } else { "off" }
        ))
    } else if layout.shard != shard || layout.secondary != f.secondary {
        Some("other shard meshes".to_string())
    } else if layers != f.layers.iter().map(|l| l.name.as_str()).collect::<Vec<_>>() {
        Some("other layers".to_string())
    } else if job.schedule.name != f.schedule {
        Some(format!("schedule `{}`", job.schedule.name))
    } else {
        None
    };
    if let Some(m) = mismatch {
        return Err(invalid!(
            "the plan's `job` does not match its program: it has {m}"
        ));
    }
    // The language's ranges for the model's numbers (absent: the defaults).
    let m = &job.model;
    if let Some(e) = m
        .norm_eps
        .filter(|&e| !(e > 0.0 && e <= 1.0 && (e as f32) > 0.0))
    {
        return Err(invalid!(
            "model `{}`: norm_eps {e} is not in (0, 1]",
            m.name
        ));
    }
    if let Some(b) = m.rope_base.filter(|&b| !(b > 1.0 && b.is_finite())) {
        return Err(invalid!("model `{}`: rope_base {b} is not above 1", m.name));
    }
    Ok(())
}

/// Least common multiple of two positive numbers, saturating (a saturated pad refuses every
/// layer, as no layer can be padded to it).
fn lcm(a: u64, b: u64) -> u64 {
    let (mut x, mut y) = (a, b);
    while y != 0 {
        (x, y) = (y, x % y);
    }
    (a / x).saturating_mul(b)
}

fn dtype(name: &str, what: &str) -> Result<Dtype, ReadError> {
    match name {
        "bf16" => Ok(Dtype::Bf16),
        "fp16" => Ok(Dtype::Fp16),
        "fp32" => Ok(Dtype::Fp32),
        _ => Err(invalid!("{what}: unknown dtype `{name}`")),
    }
}

fn region_from(p: &Program, r: RegionFile, what: &str) -> Result<Region, ReadError> {
    // (Checked before making an id: making one of u32::MAX panics.)
    if r.buffer as usize >= p.buffers.len() {
        return Err(invalid!("{what}: buffer {} does not exist", r.buffer));
    }
    let buf = &p.buffers[BufferId::from_u32(r.buffer)];
    // Rank 0 has every shard index 0, so every region must fit its buffer at `offset`; and no
    // rank's index reaches `ranks`, so `offset + bytes + stride·(ranks − 1)` bounds every end.
    let end = r.offset.checked_add(r.bytes);
    let reach = r
        .stride
        .unwrap_or(0)
        .checked_mul(u64::from(p.ranks().saturating_sub(1)));
    if end.zip(reach).and_then(|(e, x)| e.checked_add(x)).is_none() {
        return Err(invalid!(
            "{what}: a region of buf{} (offset {}, {} B, stride {}) reaches past 2^64 bytes",
            r.buffer,
            r.offset,
            r.bytes,
            r.stride.unwrap_or(0)
        ));
    }
    if end.is_some_and(|e| e > buf.bytes) {
        return Err(invalid!(
            "{what}: the region of buf{} at {} + {} B lies outside its {} B",
            r.buffer,
            r.offset,
            r.bytes,
            buf.bytes
        ));
    }
    let offset = match (r.index, r.stride) {
        (None, None) => Offset::Fixed(r.offset),
        (Some(i), Some(stride)) => {
            let index = *ShardIndex::ALL
                .iter()
                .find(|x| crate::listing::index_name(**x) == i)
                .ok_or_else(|| invalid!("{what}: unknown shard index `{i}`"))?;
            Offset::Shard {
                index,
                base: r.offset,
                stride,
            }
        }
        _ => {
            return Err(invalid!(
                "{what}: a rank-dependent region needs both `index` and `stride`"
            ))
        }
    };
    Ok(Region {
        buffer: BufferId::from_u32(r.buffer),
        offset,
        bytes: r.bytes,
    })
}

fn op_from(p: &Program, stream: StreamId, o: OpFile) -> Result<Op, ReadError> {
    let what = format!("op{}", o.id);
    let role = ROLES
        .iter()
        .find(|r| r.1 == o.role)
        .ok_or_else(|| invalid!("{what}: unknown role `{}`", o.role))?
        .0;
    let layer = match &o.layer {
        None => None,
        Some(name) => Some(
            p.layers
                .iter()
                .find(|(_, l)| &l.name == name)
                .map(|(id, _)| id)
                .ok_or_else(|| invalid!("{what}: unknown layer `{name}`"))?,
        ),
    };
    let mut collectives = vec![];
    for c in o.ops {
        let kind = Collective::NAMES
            .iter()
            .position(|n| *n == c.kind)
            .map(|i| {
                [
                    Collective::AllGather,
                    Collective::ReduceScatter,
                    Collective::AllReduce,
                    Collective::Broadcast,
                    Collective::Send,
                    Collective::Recv,
                ][i]
            })
            .ok_or_else(|| invalid!("{what}: unknown collective `{}`", c.kind))?;
        if c.count
            .checked_mul(dtype(&c.dtype, &what)?.bytes())
            .is_none()
        {
            return Err(invalid!(
                "{what}: {} elements of {} overflow a byte count",
                c.count,
                c.dtype
            ));
        }
        if c.communicator as usize >= p.comms.len() {
            return Err(invalid!(
                "{what}: communicator {} does not exist",
                c.communicator
            ));
        }
        collectives.push(CollectiveOp {
            kind,
            comm: CommId::from_u32(c.communicator),
            dtype: dtype(&c.dtype, &what)?,
            count: c.count,
            input: region_from(p, c.input, &what)?,
            output: region_from(p, c.output, &what)?,
        });
    }
    let kind = match o.kind.as_str() {
        "group" if collectives.len() > 1 => OpKind::Group(collectives),
        k if Collective::NAMES.contains(&k)
            && collectives.len() == 1
            && collectives[0].kind.name() == k =>
        {
            OpKind::Collective(collectives.pop().expect("one"))
        }
        k => {
            let c = COMPUTE
                .iter()
                .find(|c| Op::compute_name(**c) == k)
                .ok_or_else(|| invalid!("{what}: unknown or malformed kind `{k}`"))?;
            if !collectives.is_empty() {
                return Err(invalid!("{what}: a `{k}` op holds no collectives"));
            }
            let j = match (c.sublayer(), o.sublayer) {
                (Some(_), Some(j)) if j < 2 => j,
                (None, None) => 0,
                (Some(_), _) => {
                    return Err(invalid!("{what}: a `{k}` op names sublayer 0 or 1"));
                }
                (None, Some(_)) => {
                    return Err(invalid!("{what}: a `{k}` op has no sublayer"));
                }
            };
            OpKind::Compute(match *c {
                ComputeKind::ForwardOpen(_) => ComputeKind::ForwardOpen(j),
                ComputeKind::ForwardClose(_) => ComputeKind::ForwardClose(j),
                ComputeKind::BackwardOpen(_) => ComputeKind::BackwardOpen(j),
                ComputeKind::BackwardClose(_) => ComputeKind::BackwardClose(j),
                other => other,
            })
        }
    };
    let ev = |e: u32| {
        if (e as usize) < p.events.len() {
            Ok(EventId::from_u32(e))
        } else {
            Err(invalid!("{what}: event {e} does not exist"))
        }
    };
    Ok(Op {
        kind,
        role,
        stream,
        layer,
        micro_step: o.micro_step,
        reads: o
            .reads
            .into_iter()
            .map(|r| region_from(p, r, &what))
            .collect::<Result<_, _>>()?,
        writes: o
            .writes
            .into_iter()
            .map(|r| region_from(p, r, &what))
            .collect::<Result<_, _>>()?,
        wait: o.wait.into_iter().map(ev).collect::<Result<_, _>>()?,
        record: o.record.map(ev).transpose()?,
    })
}
