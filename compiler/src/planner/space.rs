//! The search space of `schedc plan`: every schedule the planner may pick for a base job.
//!
//! A candidate keeps everything of the base schedule (model, cluster, nodes and GPUs used,
//! micro-steps, recompute, streams, overlap, training settings, `max_live`) and chooses:
//! - a **structure**, which decides what is stored where and what crosses which link: the three
//!   shard meshes (every `a x b` with a | G and b | N, nested s_p | s_g | s_os in each dimension:
//!   dsl rules 1 and 2, rule 3's warned meshes included), `reshard_after_forward`, `grad_sync` and
//!   `all_gather`;
//! - **knobs**, which only move work in time: prefetch depths and bucket sizes.
//!
//! - a **pipeline split**: the stages p (each stage whole nodes or a part of one), the chunks
//!   per stage v and the schedule (`gpipe`, `1f1b`, `interleaved_1f1b`, `zb_h1`, `zbv`), with the layers
//!   `balanced` by the cost model, and m micro-batches so that the global batch stays the base
//!   schedule's (d·m·micro_batch sequences, d = ranks/p); the shard meshes are then those of a
//!   stage's data-parallel mesh, and only the ZeRO presets over it are searched with a split (ddp,
//!   ZeRO-1, -2, -3: [`stage_presets`]). Splits the lowering cannot run are left out:
//!   interleaving where m is not a multiple of p or p·v exceeds the layers. A tied head keeps a
//!   replica of the embedding where it needs one, and clipping sums its norm over the stages, so
//!   neither limits the splits.
//!
//! - a **tensor-parallel degree** t (Megatron's split of transformer and mlp layers, each with
//!   and without sequence parallelism where `seq_len` divides by t): every divisor of the GPUs per node that the model's layers split by
//!   (heads, kv_heads and ffn divisible by t, no `dense` layer: [`tensor_degrees`]), composed
//!   with every pipeline split; d = ranks/(p·t) and m keep the global batch, and the shard meshes
//!   are read over the data-parallel mesh of one tensor index. Splits and structures the lowering
//!   refuses with t > 1 (`Job::tensor_not_lowered`: split backwards) are left out by asking
//!   it.
//!
//! Choices that cannot change the program are not enumerated twice: resharding, prefetch and the
//! gather algorithm only where parameters are sharded; hpZ's node-local secondary shard only where
//! the parameter group spans nodes (inside one node it saves nothing); the hierarchical all-gather
//! only where a gathering group spans nodes with more than one GPU per node; `flat` gradient
//! synchronisation only where gradients are not sharded over every rank (there a reduce-scatter
//! delivers the same shard for half the bytes of the all-reduce).

use sched_ir::job::{
    AllGatherAlgo, Buckets, GradSync, Job, Mesh, Pipeline, PipelineSchedule, Prefetch,
    ReshardAfterForward, Schedule, Shard, Tensor,
};

/// What is sharded where, how it moves and how the layers are staged: the choices that decide
/// memory and traffic.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Structure {
    pub split: Split,
    pub shard: Shard,
    pub reshard_after_forward: ReshardAfterForward,
    pub grad_sync: GradSync,
    pub all_gather: AllGatherAlgo,
}

/// A pipeline split: p stages of v chunks each, run in `schedule`'s order over `micro_steps`
/// micro-batches (p = 1: no pipeline), with tensor groups of `tensor` ranks (t; 1: none), with
/// sequence parallelism or not (`sequence`, only with t > 1).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Split {
    pub tensor: u32,
    pub sequence: bool,
    pub stages: u32,
    pub virtual_stages: u32,
    pub schedule: PipelineSchedule,
    pub micro_steps: u32,
}

/// The most pipeline stages the search tries.
pub const MAX_STAGES: u32 = 64;

/// Chunks per stage the search tries with `interleaved_1f1b`.
pub const INTERLEAVE: [u32; 2] = [2, 4];

/// The tensor-parallel degrees the search tries for `job`: every divisor t of the GPUs per node
/// used (rule 1) by which every layer can be sliced (rule 3: `sched_ir::tensor` refuses heads,
/// kv_heads or ffn not divisible by t and `dense` layers, the rule the language checks).
pub fn tensor_degrees(job: &Job) -> Vec<u32> {
    divisors(job.schedule.gpus_per_node)
        .into_iter()
        .filter(|&t| {
            job.model
                .layers
                .iter()
                .all(|l| sched_ir::tensor::rank_params(l, t).is_ok())
        })
        .collect()
}

/// Every split of `job` the lowering can run (see the module doc), t = 1 and p = 1 first.
pub fn splits(job: &Job) -> Vec<Split> {
    let s = &job.schedule;
    let ranks = s.gpus_per_node * s.nodes;
    let base_dp = ranks / (s.pipeline.stages.max(1) * s.tensor.size.max(1));
    // Sequences of the global batch, in micro-batches: d·m for every split.
    let global = u64::from(base_dp) * u64::from(s.micro_steps);
    let mut out = vec![];
    for t in tensor_degrees(job) {
        // With t > 1, each split with and without sequence parallelism where the sequence
        // splits by t (rule 3).
        let sequence: &[bool] = match t > 1 && job.model.seq_len.is_multiple_of(u64::from(t)) {
            true => &[false, true],
            false => &[false],
        };
        out.extend(
            pipeline_splits(job, t, global)
                .into_iter()
                .flat_map(|split| {
                    sequence
                        .iter()
                        .map(move |&sequence| Split { sequence, ..split })
                })
                .filter(|split| !refused_with_tensor(job, split)),
        );
    }
    out
}

/// Whether the lowering refuses `split` for `job` (`Job::tensor_not_lowered`: what tensor
/// parallelism does not compose with yet), asked of the job the split makes.
fn refused_with_tensor(job: &Job, split: &Split) -> bool {
    split.tensor > 1 && probe(job, split).tensor_not_lowered().is_some()
}

/// `job` with `split`'s tensor groups and pipeline (its order generated), to ask
/// `Job::tensor_not_lowered` of.
fn probe(job: &Job, split: &Split) -> Job {
    let mut probe = job.clone();
    let s = &mut probe.schedule;
    s.tensor = Tensor {
        size: split.tensor,
        sequence: split.sequence,
    };
    s.pipeline = Pipeline::default();
    if split.stages > 1 {
        s.pipeline.stages = split.stages;
        s.pipeline.virtual_stages = split.virtual_stages;
        s.pipeline.schedule = split.schedule;
        s.pipeline.order = sched_ir::orders::generate(
            split.schedule,
            split.stages,
            split.virtual_stages,
            split.micro_steps,
        );
    }
    probe
}

/// The pipeline splits with tensor groups of `t`, p = 1 first, keeping `global` micro-batches.
fn pipeline_splits(job: &Job, t: u32, global: u64) -> Vec<Split> {
    let s = &job.schedule;
    let layers = job.model.layers.len() as u32;
    let ranks = s.gpus_per_node * s.nodes;
    let mut out = vec![];
    let dp = u64::from(ranks / t);
    if global.is_multiple_of(dp) {
        out.push(Split {
            tensor: t,
            sequence: false,
            stages: 1,
            virtual_stages: 1,
            schedule: PipelineSchedule::default(),
            micro_steps: (global / dp) as u32,
        });
    }
    let g = s.gpus_per_node;
    for p in divisors(ranks / t)
        .into_iter()
        .filter(|&p| p > 1 && p <= MAX_STAGES.min(layers))
    {
        // A stage's d·t ranks hold whole nodes or lie inside one (rule 2).
        let stage = ranks / p;
        let d = stage / t;
        if !(stage.is_multiple_of(g) || g.is_multiple_of(stage))
            || !global.is_multiple_of(u64::from(d))
        {
            continue;
        }
        let m = (global / u64::from(d)) as u32;
        let split = |schedule, v| Split {
            tensor: t,
            sequence: false,
            stages: p,
            virtual_stages: v,
            schedule,
            micro_steps: m,
        };
        out.push(split(PipelineSchedule::Gpipe, 1));
        if m >= p {
            out.push(split(PipelineSchedule::OneFOneB, 1));
            out.push(split(PipelineSchedule::ZbH1, 1));
            if 2 * p <= layers {
                out.push(split(PipelineSchedule::Zbv, 2));
            }
            for v in INTERLEAVE {
                if m.is_multiple_of(p) && p * v <= layers {
                    out.push(split(PipelineSchedule::Interleaved1F1B, v));
                }
            }
        }
    }
    out
}

/// The choices that only move work in time.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Knobs {
    pub prefetch_forward: u32,
    pub prefetch_backward: u32,
    pub gather_bucket: u64,
    pub reduce_bucket: u64,
}

/// Prefetch depths the knob search tries.
pub const PREFETCH_DEPTHS: [u32; 3] = [1, 2, 3];

/// Bucket sizes the knob search tries (0 is off).
pub const BUCKET_SIZES: [u64; 4] = [0, 16 << 20, 64 << 20, 256 << 20];

impl Knobs {
    /// The knobs of a schedule as written.
    pub fn of(s: &Schedule) -> Self {
        Knobs {
            prefetch_forward: s.prefetch.forward,
            prefetch_backward: s.prefetch.backward,
            gather_bucket: s.buckets.gather,
            reduce_bucket: s.buckets.reduce,
        }
    }

    /// The knob settings one step away from `self`: one knob changed to another value it may take.
    /// Prefetch depths only where `structure` gathers parameters.
    pub fn neighbours(self, structure: &Structure) -> Vec<Knobs> {
        let mut out = vec![];
        if structure.shard.params.size() > 1 {
            for d in PREFETCH_DEPTHS {
                out.push(Knobs {
                    prefetch_forward: d,
                    ..self
                });
                out.push(Knobs {
                    prefetch_backward: d,
                    ..self
                });
            }
        }
        for b in BUCKET_SIZES {
            out.push(Knobs {
                gather_bucket: b,
                ..self
            });
            out.push(Knobs {
                reduce_bucket: b,
                ..self
            });
        }
        out.retain(|k| *k != self);
        out.dedup();
        out
    }
}

/// The divisors of `n`, increasing.
fn divisors(n: u32) -> Vec<u32> {
    (1..=n).filter(|d| n.is_multiple_of(*d)).collect()
}

/// Every nested triple of meshes s_p | s_g | s_os on `gpus` GPUs per node and `nodes` nodes.
pub fn shard_meshes(gpus: u32, nodes: u32) -> Vec<Shard> {
    let meshes: Vec<Mesh> = divisors(nodes)
        .into_iter()
        .flat_map(|inter| {
            divisors(gpus)
                .into_iter()
                .map(move |intra| Mesh { intra, inter })
        })
        .collect();
    let mut out = vec![];
    for &params in &meshes {
        for &grads in meshes.iter().filter(|g| params.divides(**g)) {
            for &optimizer in meshes.iter().filter(|o| grads.divides(**o)) {
                out.push(Shard {
                    params,
                    grads,
                    optimizer,
                });
            }
        }
    }
    out
}

/// The shardings a pipeline split is searched with: the ZeRO presets over a stage's
/// data-parallel mesh of `gpus` x `nodes` (ddp, ZeRO-1, ZeRO-2, ZeRO-3). Every mesh triple per
/// split would multiply the search by the splits (some 30 of them on 1,024 GPUs) for meshes
/// that pipelines, which already cut each rank's state by p, rarely need.
fn stage_presets(gpus: u32, nodes: u32) -> Vec<Shard> {
    let one = Mesh { intra: 1, inter: 1 };
    let full = Mesh {
        intra: gpus,
        inter: nodes,
    };
    let mut out = vec![
        Shard {
            params: one,
            grads: one,
            optimizer: one,
        },
        Shard {
            params: one,
            grads: one,
            optimizer: full,
        },
        Shard {
            params: one,
            grads: full,
            optimizer: full,
        },
        Shard {
            params: full,
            grads: full,
            optimizer: full,
        },
    ];
    out.dedup();
    out
}

/// Every structure for a job's nodes and GPUs (see the module doc for what is left out).
pub fn structures(base: &Job) -> Vec<Structure> {
    splits(base)
        .into_iter()
        .flat_map(|split| split_structures(base, split))
        .collect()
}

/// The structures of one split: the shard choices over a stage's data-parallel mesh (of one
/// tensor index: `G/t x` the stage's nodes when a stage holds whole nodes, `d x 1` inside one).
fn split_structures(job: &Job, split: Split) -> Vec<Structure> {
    let base = &job.schedule;
    let stage = base.gpus_per_node * base.nodes / split.stages;
    let per_node = base.gpus_per_node.min(stage);
    let nodes = stage / per_node;
    let gpus = per_node / split.tensor;
    let ranks = u64::from(gpus * nodes);
    let mut out = vec![];
    let mut asked = (split.tensor > 1).then(|| probe(job, &split));
    let shards = if split.stages == 1 {
        shard_meshes(gpus, nodes)
    } else {
        stage_presets(gpus, nodes)
    };
    for shard in shards {
        let params_sharded = shard.params.size() > 1;
        let mut reshards = vec![ReshardAfterForward::True];
        if params_sharded {
            reshards.push(ReshardAfterForward::False);
        }
        if shard.params.inter > 1 {
            reshards.extend(
                divisors(gpus)
                    .into_iter()
                    .filter(|&k| k > 1)
                    .map(|secondary| ReshardAfterForward::Node { secondary }),
            );
        }
        let mut syncs = vec![GradSync::TwoHop];
        if shard.grads.size() < ranks {
            syncs.push(GradSync::Flat);
        }
        let mut gathers = vec![AllGatherAlgo::Flat];
        if shard.params.inter > 1 && shard.params.intra > 1 {
            gathers.push(AllGatherAlgo::Hierarchical);
        }
        // What tensor parallelism does not lower yet is asked of the job.
        if let Some(asked) = asked.as_mut() {
            reshards.retain(|&r| {
                asked.schedule.reshard_after_forward = r;
                asked.tensor_not_lowered().is_none()
            });
        }
        for &reshard_after_forward in &reshards {
            for &grad_sync in &syncs {
                for &all_gather in &gathers {
                    out.push(Structure {
                        split,
                        shard,
                        reshard_after_forward,
                        grad_sync,
                        all_gather,
                    });
                }
            }
        }
    }
    out
}

/// The base job with a structure and knobs chosen. The preset name is dropped: the schedule's
/// factors are explicit now. A pipeline's layers are `balanced` as the language balances them.
pub fn apply(base: &Job, structure: &Structure, knobs: &Knobs) -> Job {
    let mut job = base.clone();
    let split = structure.split;
    job.schedule.micro_steps = split.micro_steps;
    // (Set before the chunks are balanced: a split layer weighs its slice's phases.)
    job.schedule.tensor = Tensor {
        size: split.tensor,
        sequence: split.sequence,
    };
    job.schedule.pipeline = if split.stages == 1 {
        Pipeline::default()
    } else {
        let chunks =
            crate::sema::pipeline::balanced_chunks(&job, split.stages * split.virtual_stages);
        Pipeline {
            stages: split.stages,
            virtual_stages: split.virtual_stages,
            schedule: split.schedule,
            chunks,
            order: sched_ir::orders::generate(
                split.schedule,
                split.stages,
                split.virtual_stages,
                split.micro_steps,
            ),
        }
    };
    let s = &mut job.schedule;
    s.preset = None;
    s.shard = structure.shard;
    s.reshard_after_forward = structure.reshard_after_forward;
    s.grad_sync = structure.grad_sync;
    s.all_gather = structure.all_gather;
    s.prefetch = Prefetch {
        forward: knobs.prefetch_forward,
        backward: knobs.prefetch_backward,
        max_live: base.schedule.prefetch.max_live,
    };
    s.buckets = Buckets {
        gather: knobs.gather_bucket,
        reduce: knobs.reduce_bucket,
    };
    job
}

/// The structure a job has.
pub fn structure_of(s: &Schedule) -> Structure {
    Structure {
        split: Split {
            tensor: s.tensor.size.max(1),
            sequence: s.tensor.is_parallel() && s.tensor.sequence,
            stages: s.pipeline.stages.max(1),
            virtual_stages: s.pipeline.virtual_stages.max(1),
            schedule: s.pipeline.schedule,
            micro_steps: s.micro_steps,
        },
        shard: s.shard,
        reshard_after_forward: s.reshard_after_forward,
        grad_sync: s.grad_sync,
        all_gather: s.all_gather,
    }
}

#[cfg(test)]
#[path = "../../tests/unit/planner_space.rs"]
mod tests;
