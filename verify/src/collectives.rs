//! Proofs 2–4: collective shapes, chunk placement, and the deadlock argument.

use super::{range, Clocks, VerifyError};
use sched_ir::ir::layout::Layout;
use sched_ir::ir::*;
use sched_ir::job::Collective;

pub fn check(p: &Program, clocks: &Clocks) -> Vec<VerifyError> {
    let layout = p.layout;
    let mut errs = vec![];
    // Per pipeline stage: a stage's ranks run only its ops.
    let mut last_collective: Vec<Option<OpId>> = vec![None; p.layout.stages.max(1) as usize];
    // Placement depends only on these; layers and micro-steps repeat them.
    type Key = (
        CommId,
        &'static str,
        BufferKind,
        BufferKind,
        (bool, bool),
        Offset,
        u64,
        Offset,
        u64,
    );
    let mut placed: std::collections::HashMap<Key, Vec<String>> = std::collections::HashMap::new();
    let norms = super::values::norm_buffers(p);
    for (id, op) in p.ops.iter() {
        if op.collectives().is_empty() {
            continue;
        }
        let stage = p.streams[op.stream].stage as usize;
        let Some(last) = last_collective.get_mut(stage) else {
            continue; // (a stream of no stage: reported by the pipeline checks)
        };
        if let Some(prev) = *last {
            if !clocks.before(p, prev, id) {
                errs.push(VerifyError {
                    op: Some(id),
                    message: format!(
                        "may run concurrently with {prev}, an earlier collective: ranks could progress them in different orders and deadlock (no wait orders them)"
                    ),
                });
            }
        }
        *last = Some(id);
        for c in op.collectives() {
            let key = (
                c.comm,
                c.kind.name(),
                p.buffers[c.input.buffer].kind,
                p.buffers[c.output.buffer].kind,
                (
                    c.input.buffer == c.output.buffer,
                    norms.contains(&c.input.buffer),
                ),
                c.input.offset,
                c.input.bytes,
                c.output.offset,
                c.output.bytes,
            );
            let found = placed
                .entry(key)
                .or_insert_with(|| placement(p, &layout, c, norms.contains(&c.input.buffer)))
                .clone();
            for m in shape(p, c).into_iter().chain(found) {
                errs.push(VerifyError {
                    op: Some(id),
                    message: m,
                });
            }
        }
    }
    errs
}

/// Counts, sizes and dtypes agree with the collective's kind and group size.
fn shape(p: &Program, c: &CollectiveOp) -> Vec<String> {
    let mut errs = vec![];
    let gs = u64::from(p.comms[c.comm].group_size());
    let d = c.dtype.bytes();
    for r in [&c.input, &c.output] {
        if p.buffers[r.buffer].dtype != c.dtype {
            errs.push(format!(
                "{} holds {} but the {} moves {}",
                r.buffer,
                p.buffers[r.buffer].dtype.name(),
                c.kind.name(),
                c.dtype.name()
            ));
        }
    }
    // In u128: a plan file's counts and sizes may be anything.
    let payload = u128::from(c.count) * u128::from(d);
    // Gathers and scatters move one equal chunk per member; an all-reduce or broadcast needs none.
    let chunked = matches!(c.kind, Collective::AllGather | Collective::ReduceScatter);
    if chunked && !c.count.is_multiple_of(gs) {
        errs.push(format!(
            "{} of {} elements does not split over a group of {gs}",
            c.kind.name(),
            c.count
        ));
    }
    // (bytes of the full payload, bytes of one member's part) as the regions give them.
    let (i, o, g) = (
        u128::from(c.input.bytes),
        u128::from(c.output.bytes),
        u128::from(gs),
    );
    let (full, part) = match c.kind {
        Collective::AllGather => (o, i * g),
        Collective::ReduceScatter => (i, o * g),
        Collective::AllReduce | Collective::Broadcast | Collective::Send | Collective::Recv => {
            (i, o)
        }
    };
    if full != payload || part != payload {
        errs.push(format!(
            "{} of {} elements ({payload} B) over {gs} ranks does not match its regions ({} B in, {} B out)",
            c.kind.name(),
            c.count,
            c.input.bytes,
            c.output.bytes
        ));
    }
    errs
}

/// Chunk `j` belongs to member `j`, for every group: checked from what the buffers hold.
/// `norm`: the collective moves gradient clipping's norm (a buffer `grad_norm` writes).
fn placement(p: &Program, l: &Layout, c: &CollectiveOp, norm: bool) -> Vec<String> {
    let comm = &p.comms[c.comm];
    let (ink, outk) = (
        p.buffers[c.input.buffer].kind,
        p.buffers[c.output.buffer].kind,
    );
    let mut errs = vec![];
    let mut require = |ok: bool, what: String| {
        if !ok && errs.is_empty() {
            errs.push(what);
        }
    };
    let in_place = c.input.buffer == c.output.buffer;
    if c.kind.is_point_to_point() {
        // Which member sends and which receives is the pipeline proof's (`p2p`).
        return errs;
    }
    for g in &comm.groups {
        let gs = g.len() as u64;
        for (j, &r) in g.iter().enumerate() {
            let j = j as u64;
            let idx = |i| l.index(i, r);
            match c.kind {
                Collective::AllGather if in_place => {
                    let chunk = c.output.bytes / gs;
                    let (out_start, _) = range(&c.output, l, r);
                    let (in_start, in_end) = range(&c.input, l, r);
                    require(
                        in_start == out_start + j * chunk && in_end - in_start == chunk,
                        format!(
                            "in-place all_gather: rank {r} is member {j} but its input {}[{in_start}..{in_end}] is not chunk {j} of the output",
                            c.input.buffer
                        ),
                    );
                    if outk == BufferKind::ParamShard {
                        require(
                            idx(ShardIndex::OptimizerInParam) == j,
                            format!("refresh: member {j} (rank {r}) updates optimizer shard {} of its param shard, not {j}", idx(ShardIndex::OptimizerInParam)),
                        );
                    }
                }
                Collective::AllGather => match (ink, outk) {
                    (BufferKind::ParamShard, BufferKind::Gathered) => require(
                        idx(ShardIndex::Param) == j,
                        format!("all_gather of params: member {j} (rank {r}) holds param shard {}", idx(ShardIndex::Param)),
                    ),
                    (BufferKind::Secondary, BufferKind::Gathered) => require(
                        idx(ShardIndex::Secondary) == j,
                        format!("hpZ all_gather: member {j} (rank {r}) holds secondary shard {}", idx(ShardIndex::Secondary)),
                    ),
                    (BufferKind::ParamShard, BufferKind::Staging) => {
                        let a = u64::from(l.shard.params.intra);
                        require(
                            idx(ShardIndex::Param) == j * a + idx(ShardIndex::ParamLocal),
                            format!("hierarchical stage 1: member {j} (rank {r}) holds param shard {}", idx(ShardIndex::Param)),
                        );
                    }
                    // Sequence parallelism: member j's rows land as chunk j (the flow proof
                    // checks the group is the tensor group and what the rows hold).
                    (BufferKind::Hidden, BufferKind::Hidden) => require(
                        l.tp_index(r) == j as u32,
                        format!("all_gather of rows: member {j} (rank {r}) holds the rows of tensor index {}", l.tp_index(r)),
                    ),
                    (i, o) => require(false, format!("all_gather from {i:?} into {o:?} has no known meaning")),
                },
                Collective::ReduceScatter => match (ink, outk) {
                    (BufferKind::FullGrad, BufferKind::GradShard | BufferKind::Staging) => require(
                        idx(ShardIndex::Grad) == j,
                        format!("reduce_scatter of gradients: member {j} (rank {r}) owns grad shard {}", idx(ShardIndex::Grad)),
                    ),
                    (BufferKind::GradShard, BufferKind::Staging) => require(
                        idx(ShardIndex::OptimizerInGrad) == j && idx(ShardIndex::Grad) == l.index(ShardIndex::Grad, g[0]),
                        format!(
                            "boundary reduce_scatter: member {j} (rank {r}) owns optimizer shard {} of grad shard {}",
                            idx(ShardIndex::OptimizerInGrad),
                            idx(ShardIndex::Grad)
                        ),
                    ),
                    (BufferKind::Partial, BufferKind::Partial) => require(
                        l.tp_index(r) == j as u32,
                        format!("reduce_scatter of partial sums: member {j} (rank {r}) keeps the rows of tensor index {}", l.tp_index(r)),
                    ),
                    (i, o) => require(false, format!("reduce_scatter from {i:?} into {o:?} has no known meaning")),
                },
                Collective::AllReduce if norm => {
                    require(c.input == c.output, "all_reduce must be in place".to_string());
                    // Across pipeline stages: the s_os members of each stage, stage after stage
                    // (which stages it sums over is the norm proof's: `values::check_norm`).
                    let s_os = l.shard.optimizer.size();
                    require(
                        idx(ShardIndex::Optimizer) == j % s_os,
                        format!("all_reduce of the gradient norm: member {j} (rank {r}) holds optimizer shard {}", idx(ShardIndex::Optimizer)),
                    );
                }
                Collective::AllReduce => {
                    require(c.input == c.output, "all_reduce must be in place".to_string());
                    if matches!(ink, BufferKind::GradShard | BufferKind::Staging) && comm.groups.len() > 1 {
                        let (lead_g, lead_o) = (l.index(ShardIndex::Grad, g[0]), l.index(ShardIndex::Optimizer, g[0]));
                        let same = if ink == BufferKind::Staging || c.input.bytes < p.buffers[c.input.buffer].bytes {
                            idx(ShardIndex::Optimizer) == lead_o
                        } else {
                            idx(ShardIndex::Grad) == lead_g
                        };
                        require(same, format!("all_reduce over replicas: rank {r} holds a different shard than rank {}", g[0]));
                    }
                }
                Collective::Broadcast | Collective::Send | Collective::Recv => {}
            }
        }
    }
    errs
}
