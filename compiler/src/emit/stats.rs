//! `--emit stats` (`cli.md`): exact per-rank memory, collectives and traffic of one step.
//!
//! - Memory: persistent shards by kind; `activations` (saved activations and hidden states),
//!   `buffers` (gathered parameters, secondary copies, full gradients, staging) and `workspace`
//!   (the streams' workspaces: GEMM library and compute scratch) are the most bytes of each kind
//!   whose issue-order lifetimes contain one op; `peak` is the arena size.
//! - Collectives: one entry per (kind, group size, scope); a coalesced group counts each of its
//!   collectives. Ring algorithms: a member sends (p−1)/p of the payload for all-gather,
//!   reduce-scatter and broadcast, 2·(p−1)/p for all-reduce (rounded down when an all-reduce's
//!   payload does not split evenly over its group).
//! - Traffic: each group's ring visits its members node by node (sorted by node, then local
//!   index); every step each member sends one chunk (payload / p) to the next, for p−1 steps
//!   (2·(p−1) for all-reduce). An edge between two GPUs of one node is intra-node traffic, any other
//!   edge leaves the node. Totals over all groups are divided by the number of GPUs (intra) and of
//!   nodes (inter).

use cranelift_entity::{EntityRef, SecondaryMap};
use sched_ir::ir::*;
use sched_ir::job::{Collective, Job};
use sched_verify::Verified;
use serde::Serialize;
use std::collections::BTreeMap;

#[derive(Serialize)]
pub struct Stats {
    pub schedule: String,
    pub model: String,
    pub cluster: String,
    pub ranks: u32,
    pub nodes: u32,
    pub gpus_per_node: u32,
    pub micro_steps: u32,
    pub parameters: u64,
    pub memory_per_rank: Memory,
    pub collectives_per_step: Vec<CollectiveStats>,
    pub traffic_per_step: Traffic,
    /// Transient bytes the plan places (`peak` minus persistent state) over a lower bound on what
    /// any placement needs: the larger of the most transient bytes whose issue-order lifetimes
    /// contain one op, and the bounds of `passes::memory::lower_bound` (buffers pairwise possibly
    /// in use together). 1.0 is a perfect plan.
    pub plan_tightness: f64,
}

#[derive(Serialize)]
pub struct Memory {
    pub params: u64,
    pub grads: u64,
    pub optimizer: u64,
    pub activations: u64,
    pub buffers: u64,
    pub workspace: u64,
    pub peak: u64,
}

#[derive(Serialize)]
pub struct CollectiveStats {
    pub kind: &'static str,
    pub group_size: u32,
    pub scope: &'static str,
    pub calls: u64,
    pub payload_bytes: u64,
    pub sent_bytes_per_rank: u64,
}

#[derive(Serialize)]
pub struct Traffic {
    pub intra_node_bytes_per_gpu: u64,
    pub inter_node_bytes_per_node: u64,
}

pub fn emit_stats(job: &Job, p: &Verified) -> Stats {
    let info = p.info();
    let persistent = |k: BufferKind| {
        p.buffers
            .values()
            .filter(|b| b.kind == k)
            .map(|b| b.bytes)
            .sum::<u64>()
    };
    let (params, grads, optimizer) = (
        persistent(BufferKind::ParamShard),
        persistent(BufferKind::GradShard),
        persistent(BufferKind::OptimizerShard),
    );
    let activations = max_live(p, |k| {
        matches!(k, BufferKind::Activation | BufferKind::Hidden)
    });
    let buffers = max_live(p, |k| {
        matches!(
            k,
            BufferKind::Gathered
                | BufferKind::Secondary
                | BufferKind::Staging
                | BufferKind::FullGrad
        )
    });
    let workspace = max_live(p, |k| k == BufferKind::Workspace);
    let transient_placed = p.arena_bytes.saturating_sub(params + grads + optimizer);
    let mut entries: BTreeMap<(&'static str, u32, Scope), CollectiveStats> = BTreeMap::new();
    let (mut intra, mut inter) = (0u128, 0u128);
    for op in p.ops.values() {
        for c in op.collectives() {
            let comm = &p.comms[c.comm];
            let gs = comm.group_size();
            let payload = c.count * c.dtype.bytes();
            let steps = steps(c.kind, gs);
            let e = entries
                .entry((c.kind.name(), gs, comm.scope))
                .or_insert(CollectiveStats {
                    kind: c.kind.name(),
                    group_size: gs,
                    scope: comm.scope.name(),
                    calls: 0,
                    payload_bytes: 0,
                    sent_bytes_per_rank: 0,
                });
            e.calls += 1;
            e.payload_bytes += payload;
            // Multiply before dividing: an all-reduce's payload need not split evenly.
            let sent = u128::from(payload) * u128::from(steps);
            e.sent_bytes_per_rank += (sent / u128::from(gs)) as u64;
            let (i, o) = ring_edges(p, comm);
            intra += sent * i / u128::from(gs);
            inter += sent * o / u128::from(gs);
        }
    }
    let s = &job.schedule;
    Stats {
        schedule: s.name.clone(),
        model: job.model.name.clone(),
        cluster: job.cluster.name.clone(),
        ranks: p.ranks(),
        nodes: p.layout.nodes,
        gpus_per_node: p.layout.gpus_per_node,
        micro_steps: p.micro_steps,
        parameters: job.model.parameters(),
        memory_per_rank: Memory {
            params,
            grads,
            optimizer,
            activations,
            buffers,
            workspace,
            peak: p.arena_bytes,
        },
        collectives_per_step: entries.into_values().collect(),
        traffic_per_step: Traffic {
            intra_node_bytes_per_gpu: (intra / u128::from(p.ranks())) as u64,
            inter_node_bytes_per_node: (inter / u128::from(p.layout.nodes)) as u64,
        },
        plan_tightness: if p.layout.stages > 1 {
            stage_tightness(p)
        } else {
            let bound = info.live_bound.max(crate::passes::memory::lower_bound(p));
            if bound == 0 {
                1.0
            } else {
                transient_placed as f64 / bound as f64
            }
        },
    }
}

/// With pipeline stages, the worst stage's tightness: each stage plans its own arena, so its
/// transient bytes placed (above its persistent ones) over its own lower bound.
fn stage_tightness(p: &Program) -> f64 {
    (0..p.layout.stages)
        .map(|stage| {
            let mine = || p.buffers.values().filter(move |b| b.stage == stage);
            let persistent: u64 = mine()
                .filter(|b| b.kind.is_persistent())
                .map(|b| b.bytes)
                .sum();
            let top = mine().map(|b| b.offset + b.bytes).max().unwrap_or(0);
            let sub = crate::passes::memory::stage_program(p, stage);
            match crate::passes::memory::lower_bound(&sub) {
                0 => 1.0,
                bound => top.saturating_sub(persistent) as f64 / bound as f64,
            }
        })
        .fold(0.0, f64::max)
}

/// Ring steps a member sends a chunk in.
fn steps(kind: Collective, group: u32) -> u64 {
    let p = u64::from(group);
    match kind {
        Collective::AllReduce => 2 * (p - 1),
        _ => p - 1,
    }
}

/// Intra-node and inter-node edges of all of a communicator's rings, laid out node by node.
fn ring_edges(p: &Program, comm: &Communicator) -> (u128, u128) {
    let node = |r: u32| r / p.layout.gpus_per_node;
    let (mut intra, mut inter) = (0, 0);
    for g in &comm.groups {
        if g.len() < 2 {
            continue;
        }
        let mut ring = g.clone();
        ring.sort_unstable();
        for (i, &r) in ring.iter().enumerate() {
            let next = ring[(i + 1) % ring.len()];
            if node(r) == node(next) {
                intra += 1;
            } else {
                inter += 1;
            }
        }
    }
    (intra, inter)
}

/// The most bytes of buffers of the selected kinds whose issue-order lifetimes contain one op.
fn max_live(p: &Program, kind: impl Fn(BufferKind) -> bool) -> u64 {
    let mut first: SecondaryMap<BufferId, usize> = SecondaryMap::with_default(usize::MAX);
    let mut last: SecondaryMap<BufferId, usize> = SecondaryMap::new();
    for (id, op) in p.ops.iter() {
        for r in op.reads.iter().chain(&op.writes) {
            let b = r.buffer;
            first[b] = first[b].min(id.index());
            last[b] = last[b].max(id.index());
        }
    }
    let mut delta = vec![0i128; p.ops.len() + 1];
    for (id, b) in p.buffers.iter() {
        if kind(b.kind) && first[id] != usize::MAX {
            delta[first[id]] += i128::from(b.bytes);
            delta[last[id] + 1] -= i128::from(b.bytes);
        }
    }
    let (mut live, mut best) = (0i128, 0i128);
    for d in delta {
        live += d;
        best = best.max(live);
    }
    best as u64
}
