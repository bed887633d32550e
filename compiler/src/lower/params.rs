//! Parameters: each layer's persistent shards (param, grad, optimizer; lowering spec §2), the
//! all-gathers that make full parameters available to compute (flat, MiCS's hierarchical one, hpZ's
//! intra-node gather of the secondary copy), the gather units prefetch moves, and the refresh that
//! all-gathers updated optimizer shards back into param shards.
//!
//! Every gathered buffer is fresh per (layer, micro-step, phase), so the memory plan alone decides
//! what shares bytes.

use super::comms::CommKind;
use super::{Builder, LayerState};
use crate::draft::Unit;
use sched_ir::hash::FxHashMap;
use sched_ir::ir::*;
use sched_ir::job::*;

impl Builder<'_> {
    /// Layers and their persistent state (lowering spec §2).
    pub(super) fn layers(&mut self) {
        let sh = self.shard();
        let pad = lcm(
            sh.optimizer.size(),
            u64::from(self.layout.secondary.unwrap_or(1)),
        );
        self.replica = self.job.tied_replica();
        let t = self.job.schedule.tensor.size;
        for (l, layer) in self.job.model.layers.iter().enumerate() {
            // A tensor-parallel layer's state is the rank's slice of it.
            let params = sched_ir::tensor::rank_params(layer, t)
                .expect("the analysis checked the tensor-parallel rules");
            let padded = params.div_ceil(pad) * pad;
            let chunk = self.chunk_of_layer(l);
            self.stage = self.job.schedule.pipeline.stage_of_chunk(chunk);
            let id = self.p.layers.push(LayerInfo {
                name: layer.name.clone(),
                params,
                padded,
                chunk,
            });
            let (state, opt) = self.persistent_shards(l, id, padded, "");
            self.optimizer_shards.push(opt);
            self.layers.push(state);
        }
        // The tied head's stage keeps a replica of the embedding's state, at the layer index
        // past the model's.
        if let Some((h, e)) = self.replica {
            self.stage = self.stage_of_layer(h);
            let (id, padded) = (self.layers[e].id, self.layers[e].padded);
            let (state, opt) = self.persistent_shards(e, id, padded, ".replica");
            self.optimizer_shards.push(opt);
            self.layers.push(state);
        }
        self.stage = 0;
    }

    /// Layer `l`'s persistent param, grad and optimizer shards on the current stage (`suffix`
    /// names a replica's), and its optimizer shard.
    fn persistent_shards(
        &mut self,
        l: usize,
        id: LayerId,
        padded: u64,
        suffix: &str,
    ) -> (LayerState, BufferId) {
        let sh = self.shard();
        let opt_words = self.job.model.optimizer.state_bytes_per_param() / 4;
        let layer = &self.job.model.layers[l];
        let name = format!("{}{suffix}", layer.name);
        let has_params = layer.params > 0;
        let param_shard = self.buffer(
            format!("{name}.params.shard"),
            BufferKind::ParamShard,
            self.dtype,
            padded / sh.params.size(),
            Some(id),
        );
        let grad_shard = self.buffer(
            format!("{name}.grads.shard"),
            BufferKind::GradShard,
            self.grad_dtype,
            padded / sh.grads.size(),
            Some(id),
        );
        let opt = self.buffer(
            format!("{name}.optimizer.shard"),
            BufferKind::OptimizerShard,
            Dtype::Fp32,
            padded / sh.optimizer.size() * opt_words,
            Some(id),
        );
        let state = LayerState {
            id,
            padded,
            param_shard,
            grad_shard,
            has_params,
        };
        (state, opt)
    }

    /// Gathered bytes of each layer's full parameters (0 when nothing is gathered).
    pub(super) fn gather_sizes(&self) -> Vec<u64> {
        self.layers
            .iter()
            .map(|l| {
                if l.has_params {
                    l.padded * self.dtype.bytes()
                } else {
                    0
                }
            })
            .collect()
    }

    /// All-gathers a bucket of layers' param shards into fresh full buffers (flat or hierarchical).
    pub(super) fn gather(
        &mut self,
        bucket: &[usize],
        m: u32,
        phase: &str,
        out: &mut FxHashMap<usize, BufferId>,
    ) -> Vec<OpId> {
        let sh = self.shard();
        let hier = self.job.schedule.all_gather == AllGatherAlgo::Hierarchical
            && sh.params.inter > 1
            && sh.params.intra > 1;
        let layers = self.with_params(bucket);
        let mut fulls = vec![];
        for &l in &layers {
            let (id, padded) = (self.state(l).id, self.state(l).padded);
            let name = format!("{}.params.full.m{m}.{phase}", self.p.layers[id].name);
            let full = self.buffer(name, BufferKind::Gathered, self.dtype, padded, Some(id));
            out.insert(l, full);
            fulls.push(full);
        }
        let layer = layers.first().map(|&l| self.state(l).id);
        let d = self.dtype.bytes();
        if !hier {
            let cs = layers
                .iter()
                .zip(&fulls)
                .map(|(&l, &full)| {
                    let st = self.state(l);
                    let (shard, padded) = (st.param_shard, st.padded);
                    let shard_bytes = padded / sh.params.size() * d;
                    self.collective(
                        Collective::AllGather,
                        CommKind::Params,
                        self.dtype,
                        Region::whole(shard, shard_bytes),
                        Region::whole(full, padded * d),
                    )
                })
                .collect();
            return self
                .issue(cs, OpRole::Gather, layer, Some(m))
                .into_iter()
                .collect();
        }
        // MiCS §3.3: inter-node all-gather, rearrangement, coalesced intra-node all-gathers.
        let (a, b) = (u64::from(sh.params.intra), u64::from(sh.params.inter));
        let mut stage1 = vec![];
        let mut copies = (vec![], vec![]);
        let mut stage3 = vec![];
        for (&l, &full) in layers.iter().zip(&fulls) {
            let st = self.state(l);
            let (id, shard, padded) = (st.id, st.param_shard, st.padded);
            let chunk = padded / (a * b) * d;
            let name = format!("{}.params.staging.m{m}.{phase}", self.p.layers[id].name);
            let staging = self.buffer(name, BufferKind::Staging, self.dtype, padded / a, Some(id));
            stage1.push(self.collective(
                Collective::AllGather,
                CommKind::HierInter,
                self.dtype,
                Region::whole(shard, chunk),
                Region::whole(staging, b * chunk),
            ));
            copies.0.push(Region::whole(staging, b * chunk));
            for j in 0..b {
                let mine = Region {
                    buffer: full,
                    offset: Offset::Shard {
                        index: ShardIndex::ParamLocal,
                        base: j * a * chunk,
                        stride: chunk,
                    },
                    bytes: chunk,
                };
                copies.1.push(mine);
                let block = Region {
                    buffer: full,
                    offset: Offset::Fixed(j * a * chunk),
                    bytes: a * chunk,
                };
                stage3.push(self.collective(
                    Collective::AllGather,
                    CommKind::HierIntra,
                    self.dtype,
                    mine,
                    block,
                ));
            }
        }
        let mut ops: Vec<OpId> = self
            .issue(stage1, OpRole::Gather, layer, Some(m))
            .into_iter()
            .collect();
        let copy = self.compute(ComputeKind::Copy, layer, Some(m), copies.0, copies.1);
        self.p.ops[copy].role = OpRole::Gather;
        ops.push(copy);
        ops.extend(self.issue(stage3, OpRole::Gather, layer, Some(m)));
        ops
    }

    pub(super) fn forward_unit(
        &mut self,
        bucket: &[usize],
        m: u32,
        gathers: bool,
        refresh: bool,
        out: &mut FxHashMap<usize, BufferId>,
    ) -> Option<Unit> {
        let mut ops = vec![];
        if refresh {
            ops.extend(self.refresh(bucket));
        }
        if gathers {
            ops.extend(self.gather(bucket, m, "fwd", out));
        }
        self.unit(ops, bucket, out)
    }

    /// A gather unit for `bucket` made of `ops`, counting the gathered buffers it makes alive.
    pub(super) fn unit(
        &self,
        ops: Vec<OpId>,
        bucket: &[usize],
        out: &FxHashMap<usize, BufferId>,
    ) -> Option<Unit> {
        let gathered_bytes = bucket
            .iter()
            .filter_map(|l| out.get(l))
            .map(|&b| self.p.buffers[b].bytes)
            .sum();
        (!ops.is_empty()).then_some(Unit {
            ops,
            layers: bucket.to_vec(),
            gathered_bytes,
            ..Unit::default()
        })
    }

    pub(super) fn backward_unit(
        &mut self,
        bucket: &[usize],
        m: u32,
        gathers: bool,
        out: &mut FxHashMap<usize, BufferId>,
    ) -> Option<Unit> {
        if !gathers {
            return None;
        }
        let ops = match self.job.schedule.reshard_after_forward {
            ReshardAfterForward::Node { secondary } => {
                self.gather_secondary(bucket, m, secondary, out)
            }
            _ => self.gather(bucket, m, "bwd", out),
        };
        self.unit(ops, bucket, out)
    }

    /// hpZ: backward gathers the secondary copy within the node.
    pub(super) fn gather_secondary(
        &mut self,
        bucket: &[usize],
        m: u32,
        k: u32,
        out: &mut FxHashMap<usize, BufferId>,
    ) -> Vec<OpId> {
        let d = self.dtype.bytes();
        let mut cs = vec![];
        let mut layer = None;
        for l in self.with_params(bucket) {
            let (id, padded) = (self.state(l).id, self.state(l).padded);
            layer.get_or_insert(id);
            let secondary = self.secondary_buf(l, m);
            let name = format!("{}.params.full.m{m}.bwd", self.p.layers[id].name);
            let full = self.buffer(name, BufferKind::Gathered, self.dtype, padded, Some(id));
            out.insert(l, full);
            cs.push(self.collective(
                Collective::AllGather,
                CommKind::Secondary,
                self.dtype,
                Region::whole(secondary, padded / u64::from(k) * d),
                Region::whole(full, padded * d),
            ));
        }
        self.issue(cs, OpRole::Gather, layer, Some(m))
            .into_iter()
            .collect()
    }

    pub(super) fn secondary_buf(&mut self, l: usize, m: u32) -> BufferId {
        if let Some(&b) = self.secondaries.get(&(l, m)) {
            return b;
        }
        let (id, padded) = (self.state(l).id, self.state(l).padded);
        let k = u64::from(self.layout.secondary.unwrap_or(1));
        let name = format!("{}.params.secondary.m{m}", self.p.layers[id].name);
        let b = self.buffer(
            name,
            BufferKind::Secondary,
            self.dtype,
            padded / k,
            Some(id),
        );
        self.secondaries.insert((l, m), b);
        b
    }

    /// The region holding layer `l`'s full parameters for compute: gathered, or the shard itself.
    pub(super) fn params_region(
        &self,
        l: usize,
        full: &FxHashMap<usize, BufferId>,
    ) -> Option<Region> {
        let st = self.state(l);
        if !st.has_params {
            return None;
        }
        let bytes = st.padded * self.dtype.bytes();
        Some(Region::whole(
            full.get(&l).copied().unwrap_or(st.param_shard),
            bytes,
        ))
    }

    /// All-gathers each layer's updated optimizer shards into its param shard (s_os > s_p).
    pub(super) fn refresh(&mut self, bucket: &[usize]) -> Vec<OpId> {
        let sh = self.shard();
        if sh.optimizer.size() == sh.params.size() {
            return vec![];
        }
        let d = self.dtype.bytes();
        let mut cs = vec![];
        let mut layer = None;
        for l in self.with_params(bucket) {
            let st = self.state(l);
            let (id, padded, shard) = (st.id, st.padded, st.param_shard);
            layer.get_or_insert(id);
            let mine = self.updated_slice(l);
            let whole = Region::whole(shard, padded / sh.params.size() * d);
            cs.push(self.collective(
                Collective::AllGather,
                CommKind::Refresh,
                self.dtype,
                mine,
                whole,
            ));
        }
        self.issue(cs, OpRole::Refresh, layer, None)
            .into_iter()
            .collect()
    }
}

fn lcm(a: u64, b: u64) -> u64 {
    fn gcd(a: u64, b: u64) -> u64 {
        if b == 0 {
            a
        } else {
            gcd(b, a % b)
        }
    }
    a / gcd(a, b) * b
}
