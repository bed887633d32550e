//! A plan ready to run: the verified program, the job it was compiled from, each op's decoded
//! [`Action`], the layer math, and the rank arithmetic to place rank-dependent regions.
//!
//! A [`Plan`] is made only from a [`Verified`] program ([`Plan::new`]), so nothing unproved
//! reaches a backend. [`Plan::load`] takes a plan file written by `schedc compile`, read back
//! and verified again, or, with the `compile` feature (on by default), a `.sched` file compiled
//! on the spot through schedc's shared loader.

use crate::exec::{decode, Action};
use crate::math::{decay_ranges, LayerMath};
use cranelift_entity::SecondaryMap;
use sched_ir::ir::{BufferId, BufferKind, CommId, LayerId, OpId, Region, ShardIndex, StreamId};
use sched_ir::job::Job;
use sched_ir::tensor::{SliceLayout, Split, TensorRank};
use sched_verify::Verified;
use std::path::Path;

/// Why a plan cannot run. Each message is complete on its own; the cause is also its `source`.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// Through schedc's loader (a plan file or a `.sched` file).
    #[cfg(feature = "compile")]
    #[error(transparent)]
    Load(Box<schedc::load::LoadError>),
    /// The file cannot be read.
    #[cfg(not(feature = "compile"))]
    #[error("cannot read {}: {error}", path.display())]
    Read {
        path: std::path::PathBuf,
        #[source]
        error: std::io::Error,
    },
    /// A `.sched` file given to a schedrun built without the compiler.
    #[cfg(not(feature = "compile"))]
    #[error(
        "{}: not a plan file, and this schedrun was built without the `compile` feature: \
         compile it with `schedc compile` and run the plan file",
        path.display()
    )]
    NotAPlan { path: std::path::PathBuf },
    /// A plan file this version cannot read, that holds another schedule, or that fails
    /// verification.
    #[cfg(not(feature = "compile"))]
    #[error("{}: {error}", path.display())]
    Plan {
        path: std::path::PathBuf,
        #[source]
        error: sched_verify::plan::PlanError,
    },
    /// A layer this runtime's math cannot compute.
    #[error(transparent)]
    Layer(#[from] crate::math::MathError),
    /// An op whose regions do not fit the layer math.
    #[error(transparent)]
    Decode(#[from] crate::exec::DecodeError),
}

/// Boxed: schedc's error is large, and a `Result` carries its error inline.
#[cfg(feature = "compile")]
impl From<schedc::load::LoadError> for LoadError {
    fn from(e: schedc::load::LoadError) -> Self {
        LoadError::Load(Box::new(e))
    }
}

impl LoadError {
    /// The user's input is at fault (exit 1), rather than the machine or the compiler (exit 2).
    pub fn is_input(&self) -> bool {
        match self {
            #[cfg(feature = "compile")]
            LoadError::Load(e) => e.is_input(),
            #[cfg(not(feature = "compile"))]
            LoadError::Read { .. } => false,
            _ => true,
        }
    }

    /// Whether [`LoadError::render`] is already a full report (a `.sched` file's diagnostics,
    /// each with its own `error:` and source lines).
    pub fn is_diagnostics(&self) -> bool {
        #[cfg(feature = "compile")]
        if let LoadError::Load(e) = self {
            return matches!(**e, schedc::load::LoadError::Diagnostics(_));
        }
        false
    }

    /// The message, with a plan's verification errors shown in their listing's context (the
    /// first ten, two ops either side).
    pub fn render(&self) -> String {
        match self {
            #[cfg(feature = "compile")]
            LoadError::Load(e) => e.render(10, 2),
            #[cfg(not(feature = "compile"))]
            LoadError::Plan {
                error: sched_verify::plan::PlanError::Unverified(r),
                ..
            } => format!("{self}:\n\n{}", r.render(10, 2)),
            other => other.to_string(),
        }
    }
}

/// A loaded, verified, decoded plan.
pub struct Plan {
    pub program: Verified,
    pub job: Job,
    pub actions: Vec<Action>,
    pub maths: Vec<LayerMath>,
    /// Per layer, the flat-vector ranges weight decay applies to.
    pub decay: Vec<Vec<std::ops::Range<usize>>>,
    /// Per layer with t > 1, the ranges of a rank's flat vector every rank of its tensor group
    /// holds alike (a replicated tensor of a slice; all of a layer that runs whole): gradient
    /// clipping's norm counts them on tensor index 0 alone.
    pub replicated: Vec<Vec<std::ops::Range<usize>>>,
    /// Each stream's ops, in issue order.
    pub stream_ops: SecondaryMap<StreamId, Vec<OpId>>,
    /// For every op, each of its collectives' call number on its communicator within a step,
    /// counted per pipeline stage (the same on every rank of a stage: one program, one issue
    /// order; a send's and its receive's numbers agree, as the verifier's matching proves).
    pub call_numbers: SecondaryMap<OpId, Vec<u64>>,
    /// Per rank, its value of every shard index (in [`ShardIndex::ALL`] order).
    indices: Vec<[u64; 7]>,
    /// `members[communicator][rank]`: the rank's group and its position in it.
    pub members: SecondaryMap<CommId, Vec<(usize, usize)>>,
    /// Tests: round every layer gradient before it is stored even where the store rounds it
    /// the same way (`device::action`'s `stores_round`), to check that both give the same bits.
    #[cfg(test)]
    pub(crate) round_grads_first: bool,
}

impl Plan {
    /// Loads `path`: a plan file (JSON, starts with `{`), verified again before anything runs,
    /// or a `.sched` file compiled here (the `compile` feature), picking `schedule` when the file
    /// defines several.
    pub fn load(path: &Path, schedule: Option<&str>) -> Result<Plan, LoadError> {
        let (program, job) = load_verified(path, schedule)?;
        Plan::new(program, job)
    }

    /// Prepares a verified program compiled from `job` for running: decodes every op and binds
    /// the layer math (a program whose layers this runtime cannot compute is refused here).
    pub fn new(program: Verified, job: Job) -> Result<Plan, LoadError> {
        let maths = job
            .model
            .layers
            .iter()
            .map(|l| LayerMath::sliced(l, &job.model, job.schedule.tensor.size))
            .collect::<Result<Vec<_>, _>>()?;
        let actions = decode(&program, &job.model, &maths)?;
        let layout = program.layout;
        let mut stream_ops: SecondaryMap<StreamId, Vec<OpId>> = SecondaryMap::new();
        for (id, op) in program.ops.iter() {
            stream_ops[op.stream].push(id);
        }
        let mut call_numbers: SecondaryMap<OpId, Vec<u64>> = SecondaryMap::new();
        for (id, calls) in program.call_numbers().iter() {
            call_numbers[id] = calls.iter().map(|&n| u64::from(n)).collect();
        }
        let indices = (0..program.ranks())
            .map(|r| ShardIndex::ALL.map(|i| layout.index(i, r)))
            .collect();
        // A tensor-parallel layer's ranges are its slice's (every slice has the same layout).
        let t = job.schedule.tensor.size;
        let slices: Vec<Option<SliceLayout>> = job
            .model
            .layers
            .iter()
            .map(|l| {
                let rank = TensorRank {
                    size: t as usize,
                    index: 0,
                };
                sched_ir::tensor::split_layers(&l.kind, t)
                    .then(|| SliceLayout::shapes(l, rank))
                    .transpose()
                    .map_err(|e| {
                        LoadError::from(crate::math::MathError::Shape {
                            layer: l.name.clone(),
                            problem: e.to_string(),
                        })
                    })
            })
            .collect::<Result<_, _>>()?;
        let layers = job.model.layers.iter().zip(&slices);
        let decay = layers
            .clone()
            .map(|(l, s)| match s {
                Some(s) => decay_ranges(&s.narrow(l)),
                None => decay_ranges(l),
            })
            .collect();
        let replicated = layers
            .map(|(l, s)| match (t > 1, s) {
                (false, _) => vec![],
                (true, Some(s)) => s
                    .tensors()
                    .iter()
                    .filter(|x| x.split == Split::Replicated)
                    .map(|x| x.range.clone())
                    .collect(),
                (true, None) => std::iter::once(0..l.params as usize).collect(),
            })
            .collect();
        let mut members: SecondaryMap<CommId, Vec<(usize, usize)>> = SecondaryMap::new();
        for (c, comm) in program.comms.iter() {
            // (usize::MAX, usize::MAX): not a member (a pipeline transfer pairs two stages only).
            members[c] = vec![(usize::MAX, usize::MAX); program.ranks() as usize];
            for (g, group) in comm.groups.iter().enumerate() {
                for (pos, &r) in group.iter().enumerate() {
                    if let Some(m) = members[c].get_mut(r as usize) {
                        *m = (g, pos);
                    }
                }
            }
        }
        Ok(Plan {
            program,
            job,
            actions,
            maths,
            decay,
            replicated,
            stream_ops,
            call_numbers,
            indices,
            members,
            #[cfg(test)]
            round_grads_first: false,
        })
    }

    /// Whether the plan computes the global gradient norm (its updates read it).
    pub fn clips(&self) -> bool {
        self.actions
            .iter()
            .any(|a| matches!(a, Action::Update { sumsq: Some(_), .. }))
    }

    pub fn ranks(&self) -> u32 {
        self.program.ranks()
    }

    /// d, the data-parallel degree: the ranks of one pipeline stage (every rank without one).
    pub fn dp_size(&self) -> u32 {
        self.program.layout.dp_size()
    }

    /// The ranks holding `buffer`: those of its pipeline stage (d·t of them).
    pub fn holders(&self, buffer: BufferId) -> std::ops::Range<u32> {
        let n = self.program.layout.stage_size();
        let stage = self.program.buffers[buffer].stage;
        stage * n..(stage + 1) * n
    }

    /// The arena byte offset of `r` on `rank`.
    pub fn at(&self, rank: u32, r: &Region) -> u64 {
        let base = self.program.buffers[r.buffer].offset;
        base + match r.offset {
            sched_ir::ir::Offset::Fixed(o) => o,
            sched_ir::ir::Offset::Shard {
                index,
                base,
                stride,
            } => base + self.index(rank, index) * stride,
        }
    }

    /// The value of shard index `idx` on `rank`.
    pub fn index(&self, rank: u32, idx: ShardIndex) -> u64 {
        self.indices[rank as usize][idx.slot()]
    }

    /// The persistent buffer of `kind` holding layer `layer`'s state.
    /// Layer `layer`'s persistent buffers of `kind`, one per pipeline stage holding the layer:
    /// its own stage's first, then a replica's (the embedding of a head tied to it from another
    /// stage).
    pub fn state_buffers(&self, layer: usize, kind: BufferKind) -> Vec<BufferId> {
        self.program
            .buffers
            .iter()
            .filter(|(_, b)| b.kind == kind && b.layer == Some(LayerId::new(layer)))
            .map(|(id, _)| id)
            .collect()
    }

    pub fn stream_name(&self, s: StreamId) -> &'static str {
        self.program.streams[s].role.name()
    }

    /// Tokens in one step's global batch.
    pub fn tokens_per_step(&self) -> u64 {
        u64::from(self.dp_size())
            * u64::from(self.program.micro_steps)
            * self.job.model.micro_batch
            * self.job.model.seq_len
    }

    /// Describes an op for messages: `op17 (all_gather block[1] m0)`.
    pub fn describe(&self, op: OpId) -> String {
        let o = &self.program.ops[op];
        let mut s = format!("{op} ({}", o.kind_name());
        if let Some(l) = o.layer {
            s += &format!(" {}", self.program.layers[l].name);
        }
        if let Some(m) = o.micro_step {
            s += &format!(" m{m}");
        }
        if let Some(c) = o.collectives().first() {
            s += &format!(" on {}", c.comm);
        }
        s + ")"
    }
}

use cranelift_entity::EntityRef;

/// The verified program and job of `path`, through schedc's shared loader (plan file or `.sched`).
#[cfg(feature = "compile")]
fn load_verified(path: &Path, schedule: Option<&str>) -> Result<(Verified, Job), LoadError> {
    let loaded = schedc::load::load(path, schedule)?;
    Ok((loaded.program, loaded.job))
}

/// The verified program and job of the plan file `path` (this schedrun was built without the
/// compiler: a `.sched` file is refused with what to do instead).
#[cfg(not(feature = "compile"))]
fn load_verified(path: &Path, schedule: Option<&str>) -> Result<(Verified, Job), LoadError> {
    use sched_verify::plan::{is_plan_text, read_verified};
    let text = std::fs::read_to_string(path).map_err(|error| LoadError::Read {
        path: path.to_path_buf(),
        error,
    })?;
    if !is_plan_text(&text) {
        return Err(LoadError::NotAPlan {
            path: path.to_path_buf(),
        });
    }
    read_verified(&text, schedule).map_err(|error| LoadError::Plan {
        path: path.to_path_buf(),
        error,
    })
}
