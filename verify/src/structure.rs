//! Proof 1: handles, bounds and communicator shapes, as far as the pipeline's [`Stage`] allows
//! (streams exist once assigned, workspaces once provisioned, buffers lie in the arena once
//! placed).
//!
//! Cheap by construction, so the pipeline can run it after every pass: a rank-dependent region is
//! checked at the largest value its shard index takes on any rank (its end grows with the index),
//! and only a region that fails is walked rank by rank to name one.

use super::{range, representative_ranks, Stage, VerifyError};
use cranelift_entity::{EntityRef, SecondaryMap};
use sched_ir::abi::GEMM_ALIGN;
use sched_ir::ir::layout::Layout;
use sched_ir::ir::*;

pub fn check(p: &Program, stage: Stage) -> Vec<VerifyError> {
    let mut errs = vec![];
    let mut err = |op: Option<OpId>, m: String| errs.push(VerifyError { op, message: m });
    let sh = p.layout.shard;
    if p.layout.nodes == 0 || p.layout.gpus_per_node == 0 {
        err(
            None,
            format!(
                "{} nodes x {} GPUs: a program runs on at least one rank",
                p.layout.nodes, p.layout.gpus_per_node
            ),
        );
        return errs;
    }
    let (stages, d, g) = (p.layout.stages, p.layout.dp_size(), p.layout.gpus_per_node);
    if stages == 0
        || !p.ranks().is_multiple_of(stages)
        || !(d.is_multiple_of(g) || g.is_multiple_of(d))
    {
        err(
            None,
            format!(
                "{stages} pipeline stages of {} ranks on nodes of {g} GPUs: a stage is whole nodes or a part of one node",
                p.ranks()
            ),
        );
        return errs;
    }
    // The shard meshes are read over each stage's data-parallel mesh.
    let (dp_g, dp_n) = (p.layout.dp_gpus_per_node(), d / p.layout.dp_gpus_per_node());
    for m in [sh.params, sh.grads, sh.optimizer] {
        if !dp_g.is_multiple_of(m.intra) || !dp_n.is_multiple_of(m.inter) {
            err(
                None,
                format!("shard mesh {m} does not divide the data-parallel mesh {dp_g} x {dp_n}"),
            );
            return errs;
        }
    }
    if let Some(k) = p
        .layout
        .secondary
        .filter(|&k| k == 0 || !p.layout.dp_gpus_per_node().is_multiple_of(k))
    {
        err(
            None,
            format!(
                "secondary shard size {k} does not divide the {} GPUs per node of a stage's data-parallel mesh",
                p.layout.dp_gpus_per_node()
            ),
        );
        return errs;
    }
    let layout = p.layout;
    let reps = representative_ranks(&layout);
    // Pipeline transfers' communicators pair two stages' ranks only (checked in `stages`).
    // Other communicators cover every rank of the stages issuing on them (every rank without a
    // pipeline; an embedding group only its two stages'), or every rank if unused.
    let mut point_to_point: SecondaryMap<CommId, bool> = SecondaryMap::new();
    let mut issuers: SecondaryMap<CommId, Vec<u32>> = SecondaryMap::new();
    for op in p.ops.values() {
        let stage = p.streams.get(op.stream).map_or(0, |s| s.stage);
        for c in op.collectives() {
            if c.comm.index() < p.comms.len() {
                point_to_point[c.comm] |= c.kind.is_point_to_point();
                if !issuers[c.comm].contains(&stage) {
                    issuers[c.comm].push(stage);
                }
            }
        }
    }
    let required = |id: CommId, r: u32| {
        let by = &issuers[id];
        !point_to_point[id] && (by.is_empty() || by.contains(&layout.stage(r)))
    };
    for (id, c) in p.comms.iter() {
        let mut seen = vec![false; p.ranks() as usize];
        let size = c.group_size();
        for g in &c.groups {
            if g.len() as u32 != size {
                err(
                    None,
                    format!("{id}: groups of different sizes ({} and {size})", g.len()),
                );
            }
            for &r in g {
                match seen.get_mut(r as usize) {
                    Some(s) if !*s => *s = true,
                    Some(_) => err(None, format!("{id}: rank {r} is in two groups")),
                    None => err(None, format!("{id}: rank {r} does not exist")),
                }
            }
        }
        if let Some(r) = (0..p.ranks()).find(|&r| !seen[r as usize] && required(id, r)) {
            err(None, format!("{id}: rank {r} is in no group"));
        }
    }
    for (id, b) in p.buffers.iter() {
        if stage >= Stage::Placed
            && b.offset
                .checked_add(b.bytes)
                .is_none_or(|end| end > p.arena_bytes)
        {
            err(
                None,
                format!(
                    "{id} ({}) at {} + {} B lies outside the {} B arena",
                    b.name, b.offset, b.bytes, p.arena_bytes
                ),
            );
        }
        if b.bytes % b.dtype.bytes() != 0 {
            err(
                None,
                format!(
                    "{id} ({}) is not a whole number of {} elements",
                    b.name,
                    b.dtype.name()
                ),
            );
        }
    }
    let top = Highest::new(&layout, &reps);
    for (id, op) in p.ops.iter() {
        if stage >= Stage::Streamed && op.stream.index() >= p.streams.len() {
            err(Some(id), format!("stream {} does not exist", op.stream));
            continue;
        }
        let regions = op
            .reads
            .iter()
            .chain(&op.writes)
            .chain(op.collectives().iter().flat_map(|c| [&c.input, &c.output]));
        for r in regions {
            let Some(b) = p.buffers.get(r.buffer) else {
                err(
                    Some(id),
                    format!("touches {}, which does not exist", r.buffer),
                );
                continue;
            };
            if top.end(r) <= b.bytes {
                continue;
            }
            if let Some(rank) = reps
                .iter()
                .copied()
                .find(|&rank| range(r, &layout, rank).1 > b.bytes)
            {
                let (s, e) = range(r, &layout, rank);
                err(
                    Some(id),
                    format!(
                        "touches {}[{s}..{e}] on rank {rank}, beyond its {} B",
                        r.buffer, b.bytes
                    ),
                );
            }
        }
        for c in op.collectives() {
            if c.comm.index() >= p.comms.len() {
                err(Some(id), format!("uses {}, which does not exist", c.comm));
            }
        }
    }
    if stage >= Stage::Provisioned {
        workspaces(p, &mut err);
    }
    errs
}

/// Workspaces (see the IR module doc): each stream's is a workspace buffer of its own whose GEMM
/// part is whole [`GEMM_ALIGN`]-byte units inside it; every compute op but accumulations and copies writes
/// its stream's (layer math from byte 0, over the GEMM part; the others only past it); no op
/// reads a workspace (it carries nothing from one op to the next), and no other stream's op or
/// collective touches one.
fn workspaces(p: &Program, err: &mut impl FnMut(Option<OpId>, String)) {
    let mut owner: SecondaryMap<BufferId, Option<StreamId>> = SecondaryMap::new();
    for (s, st) in p.streams.iter() {
        let Some(ws) = st.workspace else { continue };
        let Some(b) = p.buffers.get(ws.buffer) else {
            err(
                None,
                format!("{s}'s workspace {} does not exist", ws.buffer),
            );
            continue;
        };
        if b.kind != BufferKind::Workspace {
            err(
                None,
                format!(
                    "{s}'s workspace {} ({}) is a {:?} buffer",
                    ws.buffer, b.name, b.kind
                ),
            );
        }
        if ws.gemm_bytes > b.bytes || ws.gemm_bytes % GEMM_ALIGN != 0 {
            err(
                None,
                format!(
                    "{s}'s workspace {} ({} B) cannot hold a GEMM part of {} B (whole {GEMM_ALIGN}-byte units inside it)",
                    ws.buffer, b.bytes, ws.gemm_bytes
                ),
            );
        }
        if let Some(other) = owner[ws.buffer].replace(s) {
            err(
                None,
                format!("{other} and {s} share the workspace {}", ws.buffer),
            );
        }
    }
    for (b, buf) in p.buffers.iter() {
        if buf.kind == BufferKind::Workspace && owner[b].is_none() {
            err(
                None,
                format!("{b} ({}) is a workspace of no stream", buf.name),
            );
        }
    }
    let is_ws = |r: &Region| owner.get(r.buffer).copied().flatten();
    for (id, op) in p.ops.iter() {
        let Some(stream) = p.streams.get(op.stream) else {
            continue;
        };
        let collective_regions = op.collectives().iter().flat_map(|c| [c.input, c.output]);
        for r in op.reads.iter().copied().chain(collective_regions) {
            if is_ws(&r).is_some() {
                err(
                    Some(id),
                    format!(
                        "reads the workspace {}, which holds nothing between ops",
                        r.buffer
                    ),
                );
            }
        }
        let mut mine = 0;
        for r in &op.writes {
            match is_ws(r) {
                Some(s) if s != op.stream || !op.collectives().is_empty() => err(
                    Some(id),
                    format!(
                        "writes the workspace of {s}, which only that stream's compute ops use"
                    ),
                ),
                Some(_) => mine += 1,
                None => {}
            }
        }
        let OpKind::Compute(kind) = op.kind else {
            continue;
        };
        if matches!(kind, ComputeKind::Accumulate | ComputeKind::Copy) {
            continue;
        }
        let Some(ws) = stream.workspace else {
            err(
                Some(id),
                format!("runs on {}, which has no workspace", op.stream),
            );
            continue;
        };
        let layer_math = kind.runs_layer_math();
        let write = op.writes.iter().find(|r| r.buffer == ws.buffer);
        let right = write.is_some_and(|r| match r.offset {
            Offset::Fixed(o) if layer_math => o == 0 && r.bytes >= ws.gemm_bytes,
            Offset::Fixed(o) => o >= ws.gemm_bytes,
            Offset::Shard { .. } => false,
        });
        if mine != 1 || !right {
            let what = if layer_math {
                "once, from byte 0 over its GEMM part"
            } else {
                "once, past its GEMM part"
            };
            err(
                Some(id),
                format!(
                    "a {} must write its stream's workspace {} {what}",
                    Op::compute_name(kind),
                    ws.buffer
                ),
            );
        }
    }
}

/// The largest value each shard index takes over the ranks, for bounding regions at once.
struct Highest([u64; ShardIndex::ALL.len()]);

impl Highest {
    fn new(layout: &Layout, reps: &[u32]) -> Self {
        let mut top = [0; ShardIndex::ALL.len()];
        for &r in reps {
            for (t, i) in top.iter_mut().zip(ShardIndex::ALL) {
                *t = (*t).max(layout.index(i, r));
            }
        }
        Highest(top)
    }

    /// The end of `r` on the rank where it ends highest (saturating: an overflow is out of bounds).
    fn end(&self, r: &Region) -> u64 {
        let start = match r.offset {
            Offset::Fixed(o) => o,
            Offset::Shard {
                index,
                base,
                stride,
            } => base.saturating_add(self.0[index.slot()].saturating_mul(stride)),
        };
        start.saturating_add(r.bytes)
    }
}
