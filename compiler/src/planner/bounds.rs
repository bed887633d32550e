//! Analytic floors that let `schedc plan` skip schedules without compiling them.
//!
//! Each figure is a lower bound of what the compiler and simulator would report, so a candidate
//! whose floor is already worse than the K-th best simulated schedule, or whose memory floor
//! exceeds the GPU, can be dropped without changing the answer:
//! - **memory**: the persistent shards exactly as lowering sizes them (lowering §2, with its
//!   padding), plus, without recompute, every layer's saved activations of one micro-step (all of
//!   them are alive at the loss), plus the compute stream's workspace at its least (the GEMM
//!   library's and the neediest layer's math, `lower::workspace`; it too is alive at the loss,
//!   which runs on that stream between layer ops); after lowering, [`arena_floor`] adds the most transient bytes
//!   alive at one position of the issue order (buffers alive at one issue position can never share
//!   bytes: sharing needs every access of one to happen before every access of the other, and
//!   happens-before implies issue order).
//! - **time**: every compute-stream op (forward, backward, recompute, loss) runs one after another
//!   on one stream, and every collective is chained behind the one issued before it (see
//!   `passes::events`), so the step is a flow shop on two machines, and three floors hold: the sum
//!   of the compute, the sum of the collectives, and the critical path through both (see
//!   [`step_time_floor`]). A collective's duration is floored by the bandwidth terms of the cost
//!   model's algorithm (`sim::cost`): a ring moves (p−1)/p of the payload per member, twice for
//!   all-reduce (its tree moves more), over the member's intra-node link and, for groups spanning
//!   nodes, through the node's network shared by the G/a groups of the call on it; MiCS's
//!   hierarchical all-gather moves (p−a)/p per group through the network, then (a−1)/a inside the
//!   node; links at the share of their bandwidth the cost model's rings sustain
//!   (`LINK_EFFICIENCY`). Each ring step's latency counts too, and the call's kernel start, except
//!   for collectives a bucket may coalesce (a coalesced call pays them once for all its members);
//!   contention only adds (to compute, and between collectives). A collective the cluster gives
//!   `measured` bandwidths for is floored at zero (a measurement may beat the link model).
//!
//! With tensor parallelism (t > 1), a rank holds its slice of every split layer
//! (`sched_ir::tensor::rank_params`: 1/t of the products' weights, the norms and row-parallel
//! biases whole) and the embedding and head whole; it saves 1/t of what the products and the
//! attention save and the norms' inputs and the residual stream whole (a floor of any slicing
//! of the saved activations; the lowering today keeps the whole layer's); its compute stream
//! runs each sublayer's phases, at the cost model's narrower products, with the tensor group's
//! all-reduce of the fp32 partial between them (floored by its bandwidth terms on the node's
//! links), and its workspace is the slice's (`lower::workspace::slice_floats`).
//!
//! With pipeline stages, each stage is floored as a job of its own ([`stage_jobs`]: its chunks'
//! layers on its data-parallel mesh, the pipeline's micro-batches): its memory floor, and its
//! compute and collective sums (a stage's compute stream runs its ops one after another, and its
//! collectives are chained), the largest over the stages. The flow-shop path is left out there:
//! it follows the unpipelined order of slots, not the stage's.

use crate::lower::workspace;
use crate::sim::cost::{COLLECTIVE_START_S, LINK_EFFICIENCY};
use cranelift_entity::EntityRef;
use sched_ir::abi::slice_saved_bytes;
use sched_ir::ir::{ComputeKind, Program};
use sched_ir::job::{
    Collective, GradSync, Job, Layer, LayerKind, Mesh, Recompute, Refresh, ReshardAfterForward,
};
use sched_ir::tensor::split_layers;

/// Parameters one rank holds of `layer`: its tensor slice's when the lowering splits it.
fn rank_params(job: &Job, layer: &Layer) -> u64 {
    sched_ir::tensor::rank_params(layer, job.schedule.tensor.size).unwrap_or(layer.params)
}

/// The tensor-parallel sublayers `layer` is lowered as (`lower::tensor`): 2 for a split
/// transformer (attention, MLP), 1 for a split mlp, 0 for a layer that runs whole.
fn sublayers(job: &Job, layer: &Layer) -> u8 {
    match layer.kind {
        k @ LayerKind::Transformer(_) if split_layers(&k, job.schedule.tensor.size) => 2,
        k @ LayerKind::Mlp(_) if split_layers(&k, job.schedule.tensor.size) => 1,
        _ => 0,
    }
}

/// The bytes `layer` saves for backward in one micro-step on one rank: the whole layer's, or a
/// tensor slice's (`abi::slice_saved_bytes`: the norms' outputs and statistics and the residual
/// stream between sublayers whole, a t-th of the rest), as the lowering plans them.
fn saved_floor(job: &Job, layer: &Layer) -> u64 {
    slice_saved_bytes(&layer.kind, &job.model, job.schedule.tensor.size)
}

/// Seconds of `layer`'s compute of `kind` in one micro-step on one rank, from `compute` (the cost
/// model of `job`'s tensor degree): a split layer's forward and backward are its sublayers'
/// phases with a floor of the tensor group's all-reduce of each partial between them (with
/// recompute, every sublayer's open and the all-reduce and close of all but the last, as the
/// lowering reruns them).
fn layer_seconds(
    job: &Job,
    compute: &dyn Fn(&Layer, ComputeKind) -> f64,
    layer: &Layer,
    kind: ComputeKind,
) -> f64 {
    let n = sublayers(job, layer);
    if n == 0 {
        return compute(layer, kind);
    }
    let partial = sched_ir::abi::input_elements(&layer.kind, &job.model) * 4;
    let group = Mesh {
        intra: job.schedule.tensor.size,
        inter: 1,
    };
    let reduce = collective_floor(job, Collective::AllReduce, group, partial, false, false);
    let phases = |open: fn(u8) -> ComputeKind, close: fn(u8) -> ComputeKind, closed: u8| {
        (0..n)
            .map(|j| {
                let closing = if j < closed {
                    reduce + compute(layer, close(j))
                } else {
                    0.0
                };
                compute(layer, open(j)) + closing
            })
            .sum()
    };
    match kind {
        ComputeKind::Forward => phases(ComputeKind::ForwardOpen, ComputeKind::ForwardClose, n),
        ComputeKind::Recompute => {
            phases(ComputeKind::ForwardOpen, ComputeKind::ForwardClose, n - 1)
        }
        ComputeKind::Backward => phases(ComputeKind::BackwardOpen, ComputeKind::BackwardClose, n),
        _ => compute(layer, kind),
    }
}

/// Elements every layer's flat parameter vector is padded to a multiple of (lowering §1).
fn padding(job: &Job) -> u64 {
    let s = &job.schedule;
    let secondary = match s.reshard_after_forward {
        ReshardAfterForward::Node { secondary } => u64::from(secondary),
        _ => 1,
    };
    let os = s.shard.optimizer.size();
    os / gcd(os, secondary) * secondary
}

fn gcd(a: u64, b: u64) -> u64 {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

/// Bytes of one rank's persistent shards: param shard, gradient accumulator, optimizer state.
pub fn model_state_bytes(job: &Job) -> u64 {
    let s = &job.schedule;
    let m = &job.model;
    let pad = padding(job);
    let opt = m.optimizer.state_bytes_per_param();
    // (A head tied across pipeline stages keeps a replica of the embedding.)
    let replica = job.tied_replica().map(|(_, e)| &m.layers[e]);
    m.layers
        .iter()
        .chain(replica)
        .map(|l| {
            let padded = rank_params(job, l).div_ceil(pad) * pad;
            padded / s.shard.params.size() * m.dtype.bytes()
                + padded / s.shard.grads.size() * m.grad_dtype.bytes()
                + padded / s.shard.optimizer.size() * opt
        })
        .sum()
}

/// Each pipeline stage of `job` as a job of its own: the layers of its chunks in model order,
/// on its data-parallel mesh (G' = min(G, d) GPUs on d/G' nodes), without a pipeline. A head
/// tied to an embedding on another stage becomes an untied head there holding the replica of
/// the embedding its stage keeps (the embedding's parameters besides its own).
pub fn stage_jobs(job: &Job) -> Vec<Job> {
    let pipeline = &job.schedule.pipeline;
    let ranks = job.schedule.gpus_per_node * job.schedule.nodes;
    let d = ranks / pipeline.stages;
    let g = job.schedule.gpus_per_node.min(d);
    let chunks = pipeline.chunks.len() as u32;
    (0..pipeline.stages)
        .map(|stage| {
            let mut model = (*job.model).clone();
            model.layers = (0..chunks)
                .filter(|&c| pipeline.stage_of_chunk(c) == stage)
                .flat_map(|c| job.model.layers[pipeline.layers_of_chunk(c)].to_vec())
                .collect();
            if let Some((h, e)) = job.tied_replica() {
                if pipeline.stage_of_layer(h) == stage {
                    let at = model
                        .layers
                        .iter()
                        .position(|l| l.name == job.model.layers[h].name);
                    if let Some(head) = at.map(|i| &mut model.layers[i]) {
                        if let LayerKind::LmHead { tied, .. } = &mut head.kind {
                            *tied = false;
                        }
                        head.params += job.model.layers[e].params;
                    }
                }
            }
            let mut sub = job.clone();
            sub.model = std::sync::Arc::new(model);
            sub.schedule.gpus_per_node = g;
            sub.schedule.nodes = d / g;
            sub.schedule.pipeline = Default::default();
            sub
        })
        .collect()
}

/// Bytes every rank needs at least before lowering: its shards, the compute stream's workspace,
/// and without recompute the activations one micro-step saves for backward (with pipeline
/// stages, the largest stage's).
pub fn memory_floor(job: &Job) -> u64 {
    if job.schedule.pipeline.is_pipelined() {
        return stage_jobs(job).iter().map(memory_floor).max().unwrap_or(0);
    }
    let activations = match job.schedule.recompute {
        Recompute::None => job.model.layers.iter().map(|l| saved_floor(job, l)).sum(),
        Recompute::Full => 0,
    };
    let t = u64::from(job.schedule.tensor.size);
    let workspace = (0..job.model.layers.len())
        .map(|l| match sublayers(job, &job.model.layers[l]) {
            0 => workspace::layer_floats(&job.model, l) * 4,
            _ => workspace::slice_floats(&job.model, l, t) * 4,
        })
        .max()
        .map_or(0, |floats| floats + workspace::gemm_bytes(job));
    model_state_bytes(job) + activations + workspace
}

/// A lowered program's arena floor: persistent bytes plus the most transient bytes alive at one
/// issue position; with pipeline stages, the largest stage's (each stage plans its own arena).
pub fn arena_floor(p: &Program) -> u64 {
    let n = p.buffers.len();
    let (mut first, mut last) = (vec![usize::MAX; n], vec![0usize; n]);
    for (i, op) in p.ops.values().enumerate() {
        for r in op.reads.iter().chain(&op.writes) {
            let b = r.buffer.index();
            first[b] = first[b].min(i);
            last[b] = last[b].max(i);
        }
    }
    let stages = p.layout.stages.max(1) as usize;
    let mut delta = vec![vec![0i128; p.ops.len() + 1]; stages];
    let mut persistent = vec![0u64; stages];
    for (id, b) in p.buffers.iter() {
        let s = (b.stage as usize).min(stages - 1);
        if b.kind.is_persistent() {
            persistent[s] += b.bytes;
        } else if first[id.index()] != usize::MAX {
            delta[s][first[id.index()]] += i128::from(b.bytes);
            delta[s][last[id.index()] + 1] -= i128::from(b.bytes);
        }
    }
    let mut floor = 0;
    for (delta, persistent) in delta.into_iter().zip(persistent) {
        let (mut live, mut peak) = (0i128, 0i128);
        for d in delta {
            live += d;
            peak = peak.max(live);
        }
        floor = floor.max(persistent + peak as u64);
    }
    floor
}

/// The mesh of the ranks inside an `outer` group that share an `inner` group position: the group
/// shape of a collective between inner shards of one outer group.
fn quotient(outer: Mesh, inner: Mesh) -> Mesh {
    Mesh {
        intra: outer.intra / inner.intra,
        inter: outer.inter / inner.inter,
    }
}

/// The least time one collective of `payload` bytes on groups of shape `group` can take in the
/// cost model: the bandwidth terms of its algorithm, plus its latency terms when `latency` (when no
/// bucket may coalesce it with others into one call that pays latency once), without contention
/// (see the module doc). `hierarchical` is MiCS's three-stage all-gather: its inter-node stage,
/// then its intra-node stage.
fn collective_floor(
    job: &Job,
    kind: Collective,
    group: Mesh,
    payload: u64,
    hierarchical: bool,
    latency: bool,
) -> f64 {
    let c = &job.cluster;
    let p = group.size();
    if p <= 1 || c.measured.iter().any(|t| t.collective == kind) {
        return 0.0;
    }
    let (a, b) = (u64::from(group.intra), u64::from(group.inter));
    let m = payload as f64;
    let start = if latency { COLLECTIVE_START_S } else { 0.0 };
    let latency = |alpha: f64| if latency { alpha } else { 0.0 };
    let (intra_alpha, inter_alpha) = (latency(c.intra_node.latency), latency(c.inter_node.latency));
    // What the cost model's rings sustain of the links.
    let (intra_bw, inter_bw) = (
        c.intra_node.bandwidth * LINK_EFFICIENCY,
        c.inter_node.bandwidth * LINK_EFFICIENCY,
    );
    // Groups of one call on one node: they share its network.
    let per_node = f64::from(job.schedule.gpus_per_node) / a as f64;
    if hierarchical && kind == Collective::AllGather && a > 1 && b > 1 {
        let inter =
            (b - 1) as f64 * inter_alpha + per_node * (p - a) as f64 / p as f64 * m / inter_bw;
        let intra = (a - 1) as f64 * intra_alpha + (a - 1) as f64 / a as f64 * m / intra_bw;
        return start + inter + intra;
    }
    let alpha = if b > 1 {
        inter_alpha.max(if a > 1 { intra_alpha } else { 0.0 })
    } else {
        intra_alpha
    };
    // Seconds for a member sending `sent` bytes in `steps` latency steps.
    let time = |sent: f64, steps: f64| {
        let intra = if a > 1 { sent / intra_bw } else { 0.0 };
        let inter = if b > 1 {
            per_node * sent / inter_bw
        } else {
            0.0
        };
        start + steps * alpha + intra.max(inter)
    };
    let ring = (p - 1) as f64 / p as f64 * m;
    let steps = (p - 1) as f64;
    match kind {
        Collective::AllGather | Collective::ReduceScatter => time(ring, steps),
        // Ring, or the double-binary tree (2 payloads, 2⌈log₂ p⌉ steps), whichever is faster.
        Collective::AllReduce => {
            time(2.0 * ring, 2.0 * steps).min(time(2.0 * m, 2.0 * (p as f64).log2().ceil()))
        }
        // A pipelined ring.
        Collective::Broadcast => time(m, steps),
        // One message to one peer.
        Collective::Send | Collective::Recv => time(m, 1.0),
    }
}

/// The floors of a step's time.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TimeFloor {
    /// Every compute-stream op of the step, one after another.
    pub compute_s: f64,
    /// Every collective of the step, one after another (they are chained).
    pub comm_s: f64,
    /// The compute stream's ops with what must come before the first and after the last (see
    /// [`step_time_floor`]).
    pub critical_s: f64,
}

impl TimeFloor {
    /// The step takes at least this long.
    pub fn seconds(&self) -> f64 {
        self.compute_s.max(self.comm_s).max(self.critical_s)
    }
}

/// One layer's share of the floors.
#[derive(Clone, Copy, Default)]
struct LayerFloor {
    /// Forward of one micro-step.
    forward: f64,
    /// Backward (and recompute) of one micro-step.
    backward: f64,
    /// Parameter gathers of one micro-step: before forward, before backward.
    gather_forward: f64,
    gather_backward: f64,
    /// The gradient reduction of one micro-step.
    reduce: f64,
    /// The boundary synchronisation, the refresh, the optimizer update.
    boundary: f64,
    refresh: f64,
    update: f64,
}

/// The floors of a job's step time; `compute` is the cost model's time of one layer's compute op
/// for one micro-step (forward, backward, recompute, loss, update, and a tensor-parallel layer's
/// phases), the cost model of `job` (of its tensor degree).
///
/// Beyond the two sums, a critical-path floor: the first forward cannot start before the first
/// layer's gather (and, with `refresh = next_forward`, its refresh) completes; the last micro-step's
/// backward of layer l cannot complete before everything the compute stream runs before it, and
/// every collective issued after it (the last micro-step's reductions of layers l … 0, their
/// boundary synchronisations, and without deferral their refreshes) starts after it, one after
/// another; the first layer's update follows the last of those, and its refresh follows the update.
/// This is a flow-shop bound in the two machines "compute stream" and "collective chain".
pub fn step_time_floor(job: &Job, compute: impl Fn(&Layer, ComputeKind) -> f64) -> TimeFloor {
    floor(job, &compute, false)
}

/// [`step_time_floor`] with the compute time as a trait object (a pipeline floors its stages
/// with the same one). `stage`: `job` is a pipeline stage's, whose chunks' parameters are
/// gathered at least once per step (consecutive actions of a chunk share one gather), so only
/// the first micro-step's forward counts a gather.
fn floor(job: &Job, compute: &dyn Fn(&Layer, ComputeKind) -> f64, stage: bool) -> TimeFloor {
    if job.schedule.pipeline.is_pipelined() {
        let stages: Vec<TimeFloor> = stage_jobs(job)
            .iter()
            .map(|sub| floor(sub, compute, true))
            .collect();
        let most = |f: fn(&TimeFloor) -> f64| stages.iter().map(f).fold(0.0, f64::max);
        return TimeFloor {
            compute_s: most(|t| t.compute_s),
            comm_s: most(|t| t.comm_s),
            critical_s: pipeline_chain(job, compute, &stages),
        };
    }
    let s = &job.schedule;
    let m = &job.model;
    let compute = |l: &Layer, k: ComputeKind| layer_seconds(job, compute, l, k);
    let ranks = Mesh {
        intra: s.gpus_per_node / s.tensor.size.max(1),
        inter: s.nodes,
    };
    let sh = s.shard;
    let pad = padding(job);
    let (d, gd) = (m.dtype.bytes(), m.grad_dtype.bytes());
    let hierarchical = s.all_gather == sched_ir::job::AllGatherAlgo::Hierarchical;
    // Latency counts only for collectives no bucket can coalesce.
    let (gather_alone, reduce_alone) = (s.buckets.gather == 0, s.buckets.reduce == 0);
    let gather = |group, payload| {
        collective_floor(
            job,
            Collective::AllGather,
            group,
            payload,
            false,
            gather_alone,
        )
    };
    let reduce =
        |kind, group, payload| collective_floor(job, kind, group, payload, false, reduce_alone);
    // Repeated blocks cost the same: the compute of a layer like the one before is reused.
    let mut last: Option<(&Layer, [f64; 3])> = None;
    let layers: Vec<LayerFloor> = m
        .layers
        .iter()
        .map(|layer| {
            let [forward, backward, update] = match last {
                Some((prev, c)) if prev.kind == layer.kind && prev.params == layer.params => c,
                _ => {
                    let mut backward = compute(layer, ComputeKind::Backward);
                    if s.recompute == Recompute::Full {
                        backward += compute(layer, ComputeKind::Recompute);
                    }
                    let update = if layer.params == 0 {
                        0.0
                    } else {
                        compute(layer, ComputeKind::Update)
                    };
                    [compute(layer, ComputeKind::Forward), backward, update]
                }
            };
            last = Some((layer, [forward, backward, update]));
            let mut f = LayerFloor {
                forward,
                backward,
                ..LayerFloor::default()
            };
            if layer.params == 0 {
                return f;
            }
            f.update = update;
            let padded = rank_params(job, layer).div_ceil(pad) * pad;
            let full = padded * d;
            // Parameters, every micro-step: forward gather, then backward's (lowering §3).
            f.gather_forward = collective_floor(
                job,
                Collective::AllGather,
                sh.params,
                full,
                hierarchical,
                gather_alone,
            );
            f.gather_backward = match s.reshard_after_forward {
                ReshardAfterForward::True => f.gather_forward,
                ReshardAfterForward::False => 0.0,
                ReshardAfterForward::Node { secondary } => gather(
                    Mesh {
                        intra: secondary,
                        inter: 1,
                    },
                    full,
                ),
            };
            f.reduce = match s.grad_sync {
                GradSync::TwoHop => reduce(Collective::ReduceScatter, sh.grads, padded * gd),
                GradSync::Flat => reduce(Collective::AllReduce, ranks, padded * gd),
            };
            if s.grad_sync == GradSync::TwoHop {
                f.boundary = reduce(
                    Collective::ReduceScatter,
                    quotient(sh.optimizer, sh.grads),
                    padded / sh.grads.size() * gd,
                ) + reduce(
                    Collective::AllReduce,
                    quotient(ranks, sh.optimizer),
                    padded / sh.optimizer.size() * gd,
                );
            }
            f.refresh = gather(
                quotient(sh.optimizer, sh.params),
                padded / sh.params.size() * d,
            );
            f
        })
        .collect();
    let loss = match m.layers.last() {
        Some(l) if matches!(l.kind, sched_ir::job::LayerKind::LmHead { .. }) => {
            compute(l, ComputeKind::Loss)
        }
        _ => 0.0,
    };
    let deferred = s.overlap.refresh == Refresh::NextForward;
    let slots = slots(&layers, (s.micro_steps, stage), loss, deferred);
    let compute_s = slots.iter().map(|x| x.compute).sum();
    let comm_s = slots.iter().map(|x| x.needs + x.produces).sum();
    let (first_update, first_refresh) =
        layers.first().map_or((0.0, 0.0), |f| (f.update, f.refresh));
    // The step as a flow shop: for slots j ≤ k, the gathers of slots ≤ j finish (one after another)
    // before slot j starts, slots j … k compute one after another, and what slots ≥ k produce starts
    // after slot k ends, one after another; or, through the first layer's update, the same without
    // refreshes, then that update, then its refresh.
    let n = slots.len();
    let mut after = vec![0.0; n + 1];
    let mut after_no_refresh = vec![0.0; n + 1];
    for k in (0..n).rev() {
        after[k] = after[k + 1] + slots[k].produces;
        after_no_refresh[k] = after_no_refresh[k + 1] + slots[k].produces - slots[k].refresh;
    }
    let through_update = first_update + if deferred { 0.0 } else { first_refresh };
    let (mut needs, mut computed, mut best_start, mut critical_s) =
        (0.0, 0.0, f64::NEG_INFINITY, 0.0f64);
    for (k, slot) in slots.iter().enumerate() {
        needs += slot.needs;
        // best_start: the latest slot j ≤ k can start, less the compute of slots before j.
        best_start = f64::max(best_start, needs - computed);
        computed += slot.compute;
        let end = best_start + computed;
        critical_s = critical_s
            .max(end + after[k])
            .max(end + after_no_refresh[k] + through_update);
    }
    TimeFloor {
        compute_s,
        comm_s,
        critical_s,
    }
}

/// The pipeline's fill and drain: stage s's first action is a forward of its first chunk (chunk
/// s), which needs micro-batch 0's forward through every chunk before it, and its last action is
/// a backward of chunk s (every schedule the planner searches runs a stage's chunks' backward in
/// reverse), after which the gradient still goes back through every chunk before it. Between,
/// the stage's compute stream runs its whole compute sum. So the step takes at least
/// Σ_{c<s} F_c + busy_s + Σ_{c<s} B_c for every stage: (m+p−1)(F+B) for uniform stages of one
/// chunk, the table's GPipe and 1F1B time.
fn pipeline_chain(
    job: &Job,
    compute: &dyn Fn(&Layer, ComputeKind) -> f64,
    stages: &[TimeFloor],
) -> f64 {
    let pipeline = &job.schedule.pipeline;
    let full = job.schedule.recompute == Recompute::Full;
    let compute = |l: &Layer, k: ComputeKind| layer_seconds(job, compute, l, k);
    let chunk = |c: u32| -> (f64, f64) {
        job.model.layers[pipeline.layers_of_chunk(c)]
            .iter()
            .map(|l| {
                let forward = compute(l, ComputeKind::Forward);
                let mut backward = compute(l, ComputeKind::Backward);
                if full {
                    backward += compute(l, ComputeKind::Recompute);
                }
                (forward, backward)
            })
            .fold((0.0, 0.0), |(f, b), (x, y)| (f + x, b + y))
    };
    // A split backward's stage may end in deferred weight halves while the gradient is already
    // on its way back: only the fill counts then.
    let split = matches!(
        pipeline.schedule,
        sched_ir::job::PipelineSchedule::ZbH1 | sched_ir::job::PipelineSchedule::Zbv
    );
    let mut before = (0.0, 0.0); // Σ F and Σ B of the chunks before chunk s
    let mut most = 0.0f64;
    for (s, floor) in stages.iter().enumerate() {
        let drain = if split { 0.0 } else { before.1 };
        most = most.max(before.0 + floor.compute_s + drain);
        let (f, b) = chunk(s as u32);
        before = (before.0 + f, before.1 + b);
    }
    most
}

/// One compute slot of the step, for the flow-shop floor.
#[derive(Clone, Copy, Default)]
struct Slot {
    /// Collectives that must complete before it starts (its parameter gathers).
    needs: f64,
    compute: f64,
    /// Collectives that depend on it (its gradient reduction; after the last micro-step also the
    /// boundary synchronisation and the refresh).
    produces: f64,
    /// The refresh part of `produces`.
    refresh: f64,
}

/// The compute slots of a step in order: per micro-step every forward, the loss, every backward in
/// reverse. With `gather_once` (a pipeline stage) only the first forward of each layer needs its
/// gather.
fn slots(
    layers: &[LayerFloor],
    (micro_steps, gather_once): (u32, bool),
    loss: f64,
    deferred: bool,
) -> Vec<Slot> {
    let mut out = vec![];
    let gathers = |m: u32, g: f64| if gather_once && m > 0 { 0.0 } else { g };
    for m in 0..micro_steps {
        for f in layers {
            let refresh = if deferred && m == 0 { f.refresh } else { 0.0 };
            out.push(Slot {
                needs: gathers(m, f.gather_forward) + refresh,
                compute: f.forward,
                ..Slot::default()
            });
        }
        out.push(Slot {
            compute: loss,
            ..Slot::default()
        });
        let last = m + 1 == micro_steps;
        for f in layers.iter().rev() {
            let refresh = if last && !deferred { f.refresh } else { 0.0 };
            let boundary = if last { f.boundary } else { 0.0 };
            out.push(Slot {
                needs: if gather_once { 0.0 } else { f.gather_backward },
                compute: f.backward,
                produces: f.reduce + boundary + refresh,
                refresh,
            });
        }
    }
    out
}
