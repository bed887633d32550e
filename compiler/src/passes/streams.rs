//! Stream assignment (lowering spec §5, "Streams" and "Overlap switches").
//!
//! Reads each op's role and, for collectives, its communicator's scope; writes `Op::stream` and
//! creates only the streams used. `single`: everything on `compute`. `per_role`: gathers on
//! `gather`, per-micro-step reductions on `reduce`, boundary and refresh on `sync`. `per_link`:
//! collectives on `intra` or `inter` by scope (mixed groups count as inter). A role whose overlap
//! switch is off runs on `compute`. Compute-kind helpers of a communication role (the hierarchical
//! all-gather's rearrangement, gradient accumulation, the optimizer update after the boundary)
//! follow the stream of the role's previous op. Pipeline sends and receives run on `p2p`
//! (on `compute` under `single`). A tensor-parallel layer's tensor-group all-reduces stay on
//! `compute`, between the phases that write and read them (the critical path).
//!
//! With pipeline stages, every stage gets its own streams: lowering leaves each op on a
//! placeholder stream of its stage, which says where the op belongs; the streams made here
//! replace them, stage by stage in order of first use.

use sched_ir::hash::FxHashMap;
use sched_ir::ir::*;
use sched_ir::job::{Overlap, Refresh, Streams};

pub fn run(p: &mut Program, policy: Streams, overlap: Overlap) {
    let placeholders = std::mem::take(&mut p.streams);
    let stage_of = |op: &Op| placeholders.get(op.stream).map_or(0, |s| s.stage);
    let mut streams: FxHashMap<(u32, StreamRole), StreamId> = FxHashMap::default();
    let mut stream = |p: &mut Program, stage: u32, role: StreamRole| {
        *streams
            .entry((stage, role))
            .or_insert_with(|| p.streams.push(Stream::on_stage(role, stage)))
    };
    let first = p.ops.values().next().map_or(0, stage_of);
    stream(p, first, StreamRole::Compute);
    let mut last_of_role: FxHashMap<(u32, OpRole), StreamRole> = FxHashMap::default();
    for id in p.ops.keys().collect::<Vec<_>>() {
        let op = &p.ops[id];
        let stage = stage_of(op);
        let on = match op.role {
            OpRole::Gather => overlap.gather,
            OpRole::Reduce => overlap.reduce,
            OpRole::Sync => overlap.sync,
            OpRole::Refresh => overlap.refresh != Refresh::Overlap(false),
            OpRole::P2p => true,
            // On the critical path: a layer's next phase waits for it.
            OpRole::Compute | OpRole::Tensor => false,
        };
        let role = if !on || policy == Streams::Single {
            StreamRole::Compute
        } else if op.role == OpRole::P2p {
            StreamRole::P2p
        } else if let Some(c) = op.collectives().first() {
            match policy {
                Streams::PerLink if p.comms[c.comm].scope == Scope::Intra => StreamRole::Intra,
                Streams::PerLink => StreamRole::Inter,
                _ => per_role(op.role),
            }
        } else {
            last_of_role
                .get(&(stage, op.role))
                .copied()
                .unwrap_or_else(|| per_role(op.role))
        };
        let role = if policy == Streams::PerLink
            && role != StreamRole::Compute
            && role != StreamRole::P2p
            && op.collectives().is_empty()
        {
            last_of_role
                .get(&(stage, op.role))
                .copied()
                .unwrap_or(StreamRole::Intra)
        } else {
            role
        };
        last_of_role.insert((stage, op.role), role);
        p.ops[id].stream = stream(p, stage, role);
    }
}

fn per_role(role: OpRole) -> StreamRole {
    match role {
        OpRole::Compute | OpRole::Tensor => StreamRole::Compute,
        OpRole::Gather => StreamRole::Gather,
        OpRole::Reduce => StreamRole::Reduce,
        OpRole::Sync | OpRole::Refresh => StreamRole::Sync,
        OpRole::P2p => StreamRole::P2p,
    }
}
