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
//! Choices that cannot change the program are not enumerated twice: resharding, prefetch and the
//! gather algorithm only where parameters are sharded; hpZ's node-local secondary shard only where
//! the parameter group spans nodes (inside one node it saves nothing); the hierarchical all-gather
//! only where a gathering group spans nodes with more than one GPU per node; `flat` gradient
//! synchronisation only where gradients are not sharded over every rank (there a reduce-scatter
//! delivers the same shard for half the bytes of the all-reduce).

use sched_ir::job::{
    AllGatherAlgo, Buckets, GradSync, Job, Mesh, Prefetch, ReshardAfterForward, Schedule, Shard,
};

/// What is sharded where and how it moves: the choices that decide memory and traffic.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Structure {
    pub shard: Shard,
    pub reshard_after_forward: ReshardAfterForward,
    pub grad_sync: GradSync,
    pub all_gather: AllGatherAlgo,
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

/// Every structure for a schedule's nodes and GPUs (see the module doc for what is left out).
pub fn structures(base: &Schedule) -> Vec<Structure> {
    let (gpus, nodes) = (base.gpus_per_node, base.nodes);
    let ranks = u64::from(gpus) * u64::from(nodes);
    let mut out = vec![];
    for shard in shard_meshes(gpus, nodes) {
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
        for &reshard_after_forward in &reshards {
            for &grad_sync in &syncs {
                for &all_gather in &gathers {
                    out.push(Structure {
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
/// factors are explicit now.
pub fn apply(base: &Job, structure: &Structure, knobs: &Knobs) -> Job {
    let mut job = base.clone();
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
        shard: s.shard,
        reshard_after_forward: s.reshard_after_forward,
        grad_sync: s.grad_sync,
        all_gather: s.all_gather,
    }
}

#[cfg(test)]
#[path = "../../tests/unit/planner_space.rs"]
mod tests;
