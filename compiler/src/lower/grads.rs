//! Gradients (lowering spec §3, "Gradients"): where each backward writes its parameter gradient
//! (a full buffer, or the accumulator itself), the per-micro-step reductions into grad shards, the
//! boundary synchronisation down to optimizer shards, gradient clipping's norm, and the optimizer
//! update.
//!
//! Each optimizer shard receives each of the dp × M contributions exactly once: what the
//! verifier's value proof checks.

use super::comms::CommKind;
use super::Builder;
use sched_ir::hash::FxHashMap;
use sched_ir::ir::*;
use sched_ir::job::*;

impl Builder<'_> {
    /// Where backward writes layer `l`'s parameter gradient in micro-step `m`.
    pub(super) fn grad_target(
        &mut self,
        l: usize,
        m: u32,
        full_grads: &mut FxHashMap<usize, BufferId>,
    ) -> Region {
        let st = self.state(l);
        let bytes = st.padded * self.grad_dtype.bytes();
        if self.direct_accumulation() {
            return Region::whole(st.grad_shard, bytes);
        }
        let (id, padded) = (st.id, st.padded);
        let buf = *full_grads.entry(l).or_insert_with(|| {
            let name = format!("{}.grads.full.m{m}", self.p.layers[id].name);
            self.p.buffers.push(Buffer {
                name,
                kind: BufferKind::FullGrad,
                dtype: self.grad_dtype,
                bytes: padded * self.grad_dtype.bytes(),
                layer: Some(id),
                offset: 0,
                stage: self.stage,
            })
        });
        Region::whole(buf, bytes)
    }

    /// Backward adds into the accumulator itself: two-hop with unsharded gradients.
    pub(super) fn direct_accumulation(&self) -> bool {
        self.job.schedule.grad_sync == GradSync::TwoHop && self.shard().grads.size() == 1
    }

    /// A backward's write of gradient region `g` (a prefix of its buffer): it adds onto the bytes
    /// already written in this micro-step (by a tied lm_head, or earlier micro-steps when backward
    /// accumulates directly) and plainly writes the rest.
    pub(super) fn grad_write(
        &mut self,
        m: u32,
        g: Region,
        reads: &mut Vec<Region>,
        writes: &mut Vec<Region>,
    ) {
        let whole_before = self.direct_accumulation() && m > 0;
        let written = self.grads_written.entry((g.buffer, m)).or_insert(0);
        let added = if whole_before {
            g.bytes
        } else {
            (*written).min(g.bytes)
        };
        *written = (*written).max(g.bytes);
        if added > 0 {
            let r = Region { bytes: added, ..g };
            reads.push(r);
            writes.push(r);
        }
        if g.bytes > added {
            writes.push(Region {
                offset: Offset::Fixed(added),
                bytes: g.bytes - added,
                ..g
            });
        }
    }

    /// Per-micro-step gradient reduction of a bucket (lowering spec §3, "Gradients").
    pub(super) fn reduce(
        &mut self,
        bucket: &[usize],
        m: u32,
        full_grads: &FxHashMap<usize, BufferId>,
    ) -> Vec<OpId> {
        let sh = self.shard();
        let gd = self.grad_dtype;
        let flat = self.job.schedule.grad_sync == GradSync::Flat;
        let layers = self.with_params(bucket);
        if layers.is_empty() || self.direct_accumulation() {
            return vec![];
        }
        let first = self.state(layers[0]).id;
        let mut cs = vec![];
        let mut adds = vec![];
        for &l in &layers {
            let st = self.state(l);
            let (id, padded, acc) = (st.id, st.padded, st.grad_shard);
            let full = Region::whole(full_grads[&l], padded * gd.bytes());
            let shard_bytes = padded / sh.grads.size() * gd.bytes();
            if flat {
                cs.push(self.collective(Collective::AllReduce, CommKind::All, gd, full, full));
                let mine = Region {
                    buffer: full.buffer,
                    offset: Offset::Shard {
                        index: ShardIndex::Grad,
                        base: 0,
                        stride: shard_bytes,
                    },
                    bytes: shard_bytes,
                };
                adds.push((id, mine, Region::whole(acc, shard_bytes)));
            } else if m == 0 {
                cs.push(self.collective(
                    Collective::ReduceScatter,
                    CommKind::Grads,
                    gd,
                    full,
                    Region::whole(acc, shard_bytes),
                ));
            } else {
                let name = format!("{}.grads.staging.m{m}", self.p.layers[id].name);
                let stage = self.buffer(
                    name,
                    BufferKind::Staging,
                    gd,
                    padded / sh.grads.size(),
                    Some(id),
                );
                let out = Region::whole(stage, shard_bytes);
                cs.push(self.collective(Collective::ReduceScatter, CommKind::Grads, gd, full, out));
                adds.push((id, out, Region::whole(acc, shard_bytes)));
            }
        }
        let mut ops: Vec<OpId> = self
            .issue(cs, OpRole::Reduce, Some(first), Some(m))
            .into_iter()
            .collect();
        for (id, from, acc) in adds {
            let (kind, reads) = if m == 0 {
                (ComputeKind::Copy, vec![from])
            } else {
                (ComputeKind::Accumulate, vec![from, acc])
            };
            let op = self.compute(kind, Some(id), Some(m), reads, vec![acc]);
            self.p.ops[op].role = OpRole::Reduce;
            ops.push(op);
        }
        ops
    }

    /// Boundary synchronisation of a bucket (lowering spec §3): its ops, and each layer's
    /// optimizer-shard gradient region (what the update reads).
    pub(super) fn boundary(&mut self, bucket: &[usize]) -> (Vec<OpId>, Vec<(usize, Region)>) {
        let sh = self.shard();
        let gd = self.grad_dtype;
        let ranks = u64::from(self.layout.dp_size());
        let layers = self.with_params(bucket);
        if layers.is_empty() {
            return (vec![], vec![]);
        }
        let first = self.state(layers[0]).id;
        let two_hop = self.job.schedule.grad_sync == GradSync::TwoHop;
        let mut rs = vec![];
        let mut ar = vec![];
        let mut grads = vec![];
        for &l in &layers {
            let st = self.state(l);
            let (id, padded, acc) = (st.id, st.padded, st.grad_shard);
            let g_bytes = padded / sh.grads.size() * gd.bytes();
            let os_bytes = padded / sh.optimizer.size() * gd.bytes();
            let mut g = Region::whole(acc, g_bytes);
            if two_hop && sh.optimizer.size() > sh.grads.size() {
                let name = format!("{}.grads.optimizer", self.p.layers[id].name);
                let os = self.buffer(
                    name,
                    BufferKind::Staging,
                    gd,
                    padded / sh.optimizer.size(),
                    Some(id),
                );
                let out = Region::whole(os, os_bytes);
                rs.push(self.collective(
                    Collective::ReduceScatter,
                    CommKind::OptimizerInGrad,
                    gd,
                    g,
                    out,
                ));
                g = out;
            } else if !two_hop && sh.optimizer.size() > sh.grads.size() {
                g = Region {
                    buffer: acc,
                    offset: Offset::Shard {
                        index: ShardIndex::OptimizerInGrad,
                        base: 0,
                        stride: os_bytes,
                    },
                    bytes: os_bytes,
                };
            }
            if two_hop && ranks / sh.optimizer.size() > 1 {
                ar.push(self.collective(Collective::AllReduce, CommKind::Replicas, gd, g, g));
            }
            grads.push((l, g));
        }
        let mut ops: Vec<OpId> = vec![];
        ops.extend(self.issue(rs, OpRole::Sync, Some(first), None));
        ops.extend(self.issue(ar, OpRole::Sync, Some(first), None));
        (ops, grads)
    }

    /// Gradient clipping: the sum of squares of every layer's optimizer-shard gradient `grads`,
    /// summed over the optimizer-shard group (see the IR module doc). Returns the ops and the
    /// `clip.sumsq` region every update reads.
    pub(super) fn grad_norm(&mut self, grads: &[(usize, Region)]) -> (Vec<OpId>, Region) {
        let sumsq = self.buffer(
            "clip.sumsq".to_string(),
            BufferKind::Staging,
            Dtype::Fp32,
            1,
            None,
        );
        let whole = Region::whole(sumsq, Dtype::Fp32.bytes());
        let reads = grads.iter().map(|&(_, g)| g).collect();
        let norm = self.compute(ComputeKind::GradNorm, None, None, reads, vec![whole]);
        self.p.ops[norm].role = OpRole::Sync;
        let mut ops = vec![norm];
        // Summed over the optimizer shards of the stage, and over the stages of a pipeline and
        // the tensor indices (each counting its slices; the replicated tensors count on tensor
        // index 0 alone: `grad_norm`'s convention, see the IR module doc).
        let over = match self.layout.stages > 1 || self.layout.tensor > 1 {
            true => Some(CommKind::NormAcrossStages),
            false => (self.shard().optimizer.size() > 1).then_some(CommKind::Optimizer),
        };
        if let Some(kind) = over {
            let c = self.collective(Collective::AllReduce, kind, Dtype::Fp32, whole, whole);
            ops.extend(self.issue(vec![c], OpRole::Sync, None, None));
        }
        (ops, whole)
    }

    /// Megatron's embedding group: makes the embedding's and its replica's optimizer-shard
    /// gradients (among `grads`, a stage's) both their sum, so that both copies update alike.
    /// Across stages, an all-reduce over pairs of ranks with the same data-parallel and tensor
    /// indices, issued by both stages; on one stage (ZB-V's V), the replica's gradient added into
    /// the embedding's and the sum copied back.
    pub(super) fn embedding_group(&mut self, grads: &[(usize, Region)]) -> Vec<OpId> {
        let (Some((h, e)), Some(r)) = (self.replica, self.replica_index()) else {
            return vec![];
        };
        let of = |x: usize| grads.iter().find(|&&(l, _)| l == x).map(|&(_, g)| g);
        let id = self.state(e).id;
        let (first, last) = (self.stage_of_layer(e), self.stage_of_layer(h));
        if first != last {
            let Some(g) = of(e).or_else(|| of(r)) else {
                return vec![];
            };
            let kind = CommKind::EmbeddingGroup { first, last };
            let c = self.collective(Collective::AllReduce, kind, self.grad_dtype, g, g);
            return self
                .issue(vec![c], OpRole::Sync, Some(id), None)
                .into_iter()
                .collect();
        }
        let (Some(ge), Some(gr)) = (of(e), of(r)) else {
            return vec![];
        };
        let add = self.compute(
            ComputeKind::Accumulate,
            Some(id),
            None,
            vec![gr, ge],
            vec![ge],
        );
        let copy = self.compute(ComputeKind::Copy, Some(id), None, vec![ge], vec![gr]);
        for &o in &[add, copy] {
            self.p.ops[o].role = OpRole::Sync;
        }
        vec![add, copy]
    }

    /// Optimizer update of each layer of `grads` (reading its optimizer-shard gradient, then with
    /// clipping the norm); the refresh after it is the step's to place (`super::step`).
    pub(super) fn update(&mut self, grads: &[(usize, Region)], norm: Option<Region>) -> Vec<OpId> {
        let mut ops: Vec<OpId> = vec![];
        for &(l, g) in grads {
            let st = self.state(l);
            let id = st.id;
            let opt = self.optimizer_shard(l);
            let opt_region = Region::whole(opt, self.p.buffers[opt].bytes);
            let mine = self.updated_slice(l);
            let mut reads = vec![g, opt_region];
            reads.extend(norm);
            let update = self.compute(
                ComputeKind::Update,
                Some(id),
                None,
                reads,
                vec![opt_region, mine],
            );
            // Off the compute stream: the optimizer runs beside the remaining backward.
            self.p.ops[update].role = OpRole::Sync;
            ops.push(update);
        }
        ops
    }
}
