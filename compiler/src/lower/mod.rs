//! Lowering: a resolved [`Job`] becomes a stream [`Program`] (lowering spec §1–6).
//!
//! The step is built as a sequence of compute **slots** (per micro-step: every layer's forward, the
//! loss, every layer's backward in reverse). Each slot carries:
//! - the **gather units** its compute needs: parameter all-gathers (flat, hierarchical or hpZ's
//!   intra-node one), and with `refresh = next_forward` the deferred refresh of micro-step 0. A unit
//!   covers one bucket of consecutive layers ([`crate::passes::buckets`]) and may be hoisted to an
//!   earlier slot by [`crate::passes::prefetch`];
//! - its compute ops;
//! - the ops that follow it and stay there: gradient reductions (bucketed), the boundary
//!   synchronisation of each layer after its last backward, the optimizer update and the refresh.
//!
//! Then the passes run in order: prefetch fixes the issue order and the flow-control fences,
//! [`crate::passes::streams`] maps roles to streams, [`crate::passes::events`] inserts the waits
//! that data dependencies and fences need, [`crate::passes::memory`] places every buffer, and the
//! events pass runs again with the placement's reuse orderings in place of the fences, so that
//! every wait left is needed by a data dependency, the collective order or a memory reuse.

pub mod activations;

use crate::ir::layout::Layout;
use crate::ir::*;
use crate::job::*;
use crate::passes;
use std::collections::HashMap;

/// A schedule that cannot be lowered as written.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LowerError(pub String);

impl std::fmt::Display for LowerError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for LowerError {}

/// A group of ops issued together and moved as one by the prefetch pass.
#[derive(Clone, Debug, Default)]
pub struct Unit {
    pub ops: Vec<OpId>,
    /// The layers (indices into the model) whose parameters it makes available.
    pub layers: Vec<usize>,
    /// Gathered-parameter bytes the unit makes alive.
    pub gathered_bytes: u64,
    /// The slot whose compute first reads what the unit produces.
    pub consumer: usize,
    /// The slot whose compute last reads it (the gathered bytes are released after it).
    pub last_consumer: usize,
    /// The earliest slot it may be issued before.
    pub earliest: usize,
    /// How many slots ahead of its consumer it would like to be issued.
    pub depth: usize,
}

/// One compute slot: its gather units, its compute ops, and the ops pinned after it.
#[derive(Clone, Debug, Default)]
pub struct Slot {
    pub units: Vec<Unit>,
    pub compute: Vec<OpId>,
    pub after: Vec<OpId>,
}

/// The program before its issue order, streams, events and offsets are final.
pub struct Draft {
    pub program: Program,
    pub slots: Vec<Slot>,
    pub job_streams: Streams,
    pub overlap: Overlap,
    pub max_live: Option<u64>,
}

/// Lowers and runs every pass: the complete, placed program (not yet verified).
pub fn lower(job: &Job) -> Result<Program, LowerError> {
    lower_timed(job, &mut PassTimes::default())
}

/// How long each pass took, by name, in the order they ran (`schedc compile --time-passes`).
#[derive(Default, Debug)]
pub struct PassTimes(pub Vec<(&'static str, std::time::Duration)>);

impl PassTimes {
    /// Runs `f` as the pass `name`, recording its time.
    pub fn time<T>(&mut self, name: &'static str, f: impl FnOnce() -> T) -> T {
        let start = std::time::Instant::now();
        let out = f();
        self.0.push((name, start.elapsed()));
        out
    }
}

/// [`lower`], recording each pass's time in `times`.
pub fn lower_timed(job: &Job, times: &mut PassTimes) -> Result<Program, LowerError> {
    let mut program = lower_unplanned_timed(job, times)?;
    let reuse = times.time("memory", || passes::memory::run(&mut program));
    // Keep only the orderings something needs: flow-control fences the placement did not use go.
    times.time("events (final)", || {
        passes::events::run(&mut program, &reuse)
    });
    Ok(program)
}

/// The program before memory planning: issue order, streams and events final, every flow-control
/// fence still in place and every offset 0. What `schedc plan` screens candidates with: the
/// placed program's orderings are a subset of these (placement only reuses bytes between buffers
/// these already order, and drops the fences it does not use).
pub fn lower_unplanned(job: &Job) -> Result<Program, LowerError> {
    lower_unplanned_timed(job, &mut PassTimes::default())
}

fn lower_unplanned_timed(job: &Job, times: &mut PassTimes) -> Result<Program, LowerError> {
    let draft = times.time("build", || build(job))?;
    let (streams, overlap) = (draft.job_streams, draft.overlap);
    let (mut program, fences) = times.time("prefetch", || passes::prefetch::run(draft))?;
    times.time("streams", || {
        passes::streams::run(&mut program, streams, overlap)
    });
    times.time("events", || passes::events::run(&mut program, &fences));
    Ok(program)
}

/// Which group structure a communicator has.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum CommKind {
    /// The s_p groups, by param shard index.
    Params,
    /// The s_g groups, by grad shard index.
    Grads,
    /// Ranks of one s_os group holding the same grad shard, by optimizer index inside it.
    OptimizerInGrad,
    /// Ranks holding the same optimizer shard.
    Replicas,
    /// Ranks of one s_os group holding the same param shard, by optimizer index inside it.
    Refresh,
    /// Every rank.
    All,
    /// The s_os groups, by optimizer shard index (gradient clipping's norm).
    Optimizer,
    /// hpZ: the GPUs of a node sharing a secondary copy.
    Secondary,
    /// Hierarchical all-gather stage 1: the params group's ranks with the same local index.
    HierInter,
    /// Hierarchical all-gather stage 3: the params group's ranks on one node.
    HierIntra,
}

/// Per-layer buffers and facts.
struct LayerState {
    id: LayerId,
    padded: u64,
    param_shard: BufferId,
    grad_shard: BufferId,
    /// True when the layer has parameters to move at all.
    has_params: bool,
}

struct Builder<'a> {
    job: &'a Job,
    layout: Layout,
    p: Program,
    comms: HashMap<CommKind, CommId>,
    layers: Vec<LayerState>,
    dtype: Dtype,
    grad_dtype: Dtype,
    /// Hidden-state buffer h[l] (input of layer l) and its gradient g[l], per micro-step.
    hidden: HashMap<(u32, usize), BufferId>,
    grad_hidden: HashMap<(u32, usize), BufferId>,
    /// Saved activations per (layer, micro-step), hpZ secondary copies, optimizer shards per layer.
    acts: HashMap<(usize, u32), BufferId>,
    secondaries: HashMap<(usize, u32), BufferId>,
    optimizer_shards: Vec<BufferId>,
    /// Bytes of each gradient buffer already written in a micro-step (from its start).
    grads_written: HashMap<(BufferId, u32), u64>,
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

fn build(job: &Job) -> Result<Draft, LowerError> {
    let s = &job.schedule;
    let secondary = match s.reshard_after_forward {
        ReshardAfterForward::Node { secondary } => Some(secondary),
        _ => None,
    };
    let layout = Layout {
        gpus_per_node: s.gpus_per_node,
        nodes: s.nodes,
        shard: s.shard,
        secondary,
    };
    let mut b = Builder {
        job,
        layout,
        p: Program {
            schedule: s.name.clone(),
            ranks: layout.ranks(),
            nodes: s.nodes,
            gpus_per_node: s.gpus_per_node,
            micro_steps: s.micro_steps,
            ..Program::default()
        },
        comms: HashMap::new(),
        layers: vec![],
        dtype: job.model.dtype,
        grad_dtype: job.model.grad_dtype,
        hidden: HashMap::new(),
        grad_hidden: HashMap::new(),
        acts: HashMap::new(),
        secondaries: HashMap::new(),
        optimizer_shards: vec![],
        grads_written: Default::default(),
    };
    b.layers();
    let mut draft = Draft {
        program: Program::default(),
        slots: vec![],
        job_streams: s.streams,
        overlap: s.overlap,
        max_live: s.prefetch.max_live,
    };
    b.step(&mut draft);
    draft.program = b.p;
    Ok(draft)
}

impl Builder<'_> {
    fn shard(&self) -> Shard {
        self.job.schedule.shard
    }

    /// Layers and their persistent state (lowering spec §2).
    fn layers(&mut self) {
        let sh = self.shard();
        let pad = lcm(
            sh.optimizer.size(),
            u64::from(self.layout.secondary.unwrap_or(1)),
        );
        let opt_words = self.job.model.optimizer.state_bytes_per_param() / 4;
        for layer in &self.job.model.layers {
            let padded = layer.params.div_ceil(pad) * pad;
            let id = self.p.layers.push(LayerInfo {
                name: layer.name.clone(),
                params: layer.params,
                padded,
            });
            let name = &layer.name;
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
            self.optimizer_shards.push(opt);
            self.layers.push(LayerState {
                id,
                padded,
                param_shard,
                grad_shard,
                has_params: layer.params > 0,
            });
        }
    }

    fn buffer(
        &mut self,
        name: String,
        kind: BufferKind,
        dtype: Dtype,
        elems: u64,
        layer: Option<LayerId>,
    ) -> BufferId {
        self.p.buffers.push(Buffer {
            name,
            kind,
            dtype,
            bytes: elems * dtype.bytes(),
            layer,
            offset: 0,
        })
    }

    fn comm(&mut self, kind: CommKind) -> CommId {
        if let Some(&c) = self.comms.get(&kind) {
            return c;
        }
        let l = self.layout;
        let sh = self.shard();
        let (name, groups) = match kind {
            CommKind::Params => (
                format!("params {}", sh.params),
                l.groups_by(
                    |r| l.group_key(sh.params, r),
                    |r| l.index(ShardIndex::Param, r),
                ),
            ),
            CommKind::Grads => (
                format!("grads {}", sh.grads),
                l.groups_by(
                    |r| l.group_key(sh.grads, r),
                    |r| l.index(ShardIndex::Grad, r),
                ),
            ),
            CommKind::OptimizerInGrad => (
                "optimizer shards of one grad shard".to_string(),
                l.groups_by(
                    |r| l.group_key(sh.optimizer, r) ^ l.index(ShardIndex::Grad, r) << 48,
                    |r| l.index(ShardIndex::OptimizerInGrad, r),
                ),
            ),
            CommKind::Replicas => (
                "replicas of an optimizer shard".to_string(),
                l.groups_by(|r| l.index(ShardIndex::Optimizer, r), u64::from),
            ),
            CommKind::Refresh => (
                "optimizer shards of one param shard".to_string(),
                l.groups_by(
                    |r| l.group_key(sh.optimizer, r) ^ l.index(ShardIndex::Param, r) << 48,
                    |r| l.index(ShardIndex::OptimizerInParam, r),
                ),
            ),
            CommKind::Optimizer => (
                format!("optimizer {}", sh.optimizer),
                l.groups_by(
                    |r| l.group_key(sh.optimizer, r),
                    |r| l.index(ShardIndex::Optimizer, r),
                ),
            ),
            CommKind::All => ("all ranks".to_string(), l.groups_by(|_| 0, u64::from)),
            CommKind::Secondary => {
                let k = l.secondary.unwrap_or(1);
                (
                    format!("secondary shards over {k} GPUs"),
                    l.groups_by(|r| u64::from(r / k), |r| l.index(ShardIndex::Secondary, r)),
                )
            }
            CommKind::HierInter => (
                format!("params {} across nodes", sh.params),
                l.groups_by(
                    |r| l.group_key(sh.params, r) ^ u64::from(l.local(r)) << 48,
                    |r| u64::from(l.node(r)),
                ),
            ),
            CommKind::HierIntra => (
                format!("params {} within a node", sh.params),
                l.groups_by(
                    |r| u64::from(l.node(r)) << 32 | u64::from(l.local(r) / sh.params.intra),
                    |r| l.index(ShardIndex::ParamLocal, r),
                ),
            ),
        };
        // The norm's groups often equal a communicator the step already has: reuse it.
        if kind == CommKind::Optimizer {
            if let Some((id, _)) = self.p.comms.iter().find(|(_, c)| c.groups == groups) {
                self.comms.insert(kind, id);
                return id;
            }
        }
        let scope = l.scope(&groups);
        let id = self.p.comms.push(Communicator {
            name,
            groups,
            scope,
        });
        self.comms.insert(kind, id);
        id
    }

    fn op(&mut self, kind: OpKind, role: OpRole, layer: Option<LayerId>, m: Option<u32>) -> OpId {
        let (reads, writes) = match &kind {
            OpKind::Compute(_) => (vec![], vec![]),
            OpKind::Collective(c) => (vec![c.input], vec![c.output]),
            OpKind::Group(cs) => (
                cs.iter().map(|c| c.input).collect(),
                cs.iter().map(|c| c.output).collect(),
            ),
        };
        self.p.ops.push(Op {
            kind,
            role,
            stream: StreamId::from_u32(0),
            layer,
            micro_step: m,
            reads,
            writes,
            wait: vec![],
            record: None,
        })
    }

    fn compute(
        &mut self,
        kind: ComputeKind,
        layer: Option<LayerId>,
        m: Option<u32>,
        reads: Vec<Region>,
        writes: Vec<Region>,
    ) -> OpId {
        let id = self.op(OpKind::Compute(kind), OpRole::Compute, layer, m);
        self.p.ops[id].reads = reads;
        self.p.ops[id].writes = writes;
        id
    }

    fn collective(
        &mut self,
        kind: Collective,
        comm: CommKind,
        dtype: Dtype,
        input: Region,
        output: Region,
    ) -> CollectiveOp {
        let comm = self.comm(comm);
        let payload = match kind {
            Collective::AllGather => output.bytes,
            _ => input.bytes,
        };
        CollectiveOp {
            kind,
            comm,
            dtype,
            count: payload / dtype.bytes(),
            input,
            output,
        }
    }

    /// Issues collectives as one op, or as a coalesced group when there are several.
    fn issue(
        &mut self,
        mut cs: Vec<CollectiveOp>,
        role: OpRole,
        layer: Option<LayerId>,
        m: Option<u32>,
    ) -> Option<OpId> {
        let kind = match cs.len() {
            0 => return None,
            1 => OpKind::Collective(cs.pop().expect("one")),
            _ => OpKind::Group(cs),
        };
        Some(self.op(kind, role, layer, m))
    }

    fn hidden_buf(&mut self, grad: bool, m: u32, l: usize) -> BufferId {
        let map = if grad {
            &self.grad_hidden
        } else {
            &self.hidden
        };
        if let Some(&b) = map.get(&(m, l)) {
            return b;
        }
        let layers = &self.job.model.layers;
        // h[l] is produced by layer l-1; size it by its producer, else by its consumer.
        let bytes = (l > 0)
            .then(|| activations::output_bytes(&layers[l - 1].kind, &self.job.model))
            .filter(|&b| b > 0)
            .or_else(|| {
                layers
                    .get(l)
                    .map(|x| activations::output_bytes(&x.kind, &self.job.model))
            })
            .unwrap_or(0);
        let name = format!("{}.{}.m{m}", if grad { "grad_hidden" } else { "hidden" }, l);
        let id = self.buffer(
            name,
            BufferKind::Hidden,
            self.dtype,
            bytes / self.dtype.bytes(),
            None,
        );
        let map = if grad {
            &mut self.grad_hidden
        } else {
            &mut self.hidden
        };
        map.insert((m, l), id);
        id
    }

    /// Index of the embedding a tied lm_head shares, if layer `l` is one.
    fn tied_embedding(&self, l: usize) -> Option<usize> {
        match self.job.model.layers[l].kind {
            LayerKind::LmHead { tied: true, .. } => self
                .job
                .model
                .layers
                .iter()
                .position(|x| matches!(x.kind, LayerKind::Embedding { .. })),
            _ => None,
        }
    }

    /// The whole step: micro-steps, then boundary, update and refresh pinned after each layer's last backward.
    fn step(&mut self, draft: &mut Draft) {
        let n = self.layers.len();
        let s = self.job.schedule.clone();
        let sh = s.shard;
        let fwd_buckets = passes::buckets::partition(&self.gather_sizes(), s.buckets.gather);
        let bwd_order: Vec<usize> = (0..n).rev().collect();
        let bwd_sizes: Vec<u64> = bwd_order.iter().map(|&l| self.gather_sizes()[l]).collect();
        let bwd_buckets: Vec<Vec<usize>> = passes::buckets::partition(&bwd_sizes, s.buckets.gather)
            .into_iter()
            .map(|b| b.into_iter().map(|i| bwd_order[i]).collect())
            .collect();
        let red_sizes: Vec<u64> = bwd_order
            .iter()
            .map(|&l| {
                if self.layers[l].has_params {
                    self.layers[l].padded * self.grad_dtype.bytes()
                } else {
                    0
                }
            })
            .collect();
        let red_buckets: Vec<Vec<usize>> = passes::buckets::partition(&red_sizes, s.buckets.reduce)
            .into_iter()
            .map(|b| b.into_iter().map(|i| bwd_order[i]).collect())
            .collect();
        let gathers = sh.params.size() > 1;
        let reshard = s.reshard_after_forward;
        let mut slots: Vec<Slot> = vec![];
        for m in 0..s.micro_steps {
            let first_slot = slots.len();
            // Forward.
            let mut fwd_full: HashMap<usize, BufferId> = HashMap::new();
            let mut fwd_slot_of = vec![0; n];
            for (l, slot) in fwd_slot_of.iter_mut().enumerate() {
                *slot = first_slot + l;
            }
            slots.extend((0..n).map(|_| Slot::default()));
            for bucket in &fwd_buckets {
                let refresh = m == 0 && s.overlap.refresh == Refresh::NextForward;
                let unit = self.forward_unit(bucket, m, gathers, refresh, &mut fwd_full);
                if let Some(mut unit) = unit {
                    unit.consumer = fwd_slot_of[bucket[0]];
                    unit.earliest = if m == 0 {
                        0
                    } else {
                        first_slot.saturating_sub(1)
                    };
                    unit.depth = s.prefetch.forward as usize;
                    // Released after the last forward that reads it (or kept to backward).
                    unit.last_consumer = fwd_slot_of[*bucket.last().expect("non-empty")];
                    slots[unit.consumer].units.push(unit);
                }
            }
            for l in 0..n {
                let ops = self.forward(l, m, &fwd_full);
                slots[first_slot + l].compute.extend(ops);
            }
            // Loss.
            let loss_slot = slots.len();
            let last = self.hidden_buf(false, m, n);
            let dlast = self.hidden_buf(true, m, n);
            let (lb, db) = (self.p.buffers[last].bytes, self.p.buffers[dlast].bytes);
            let loss = self.compute(
                ComputeKind::Loss,
                None,
                Some(m),
                vec![Region::whole(last, lb)],
                vec![Region::whole(dlast, db)],
            );
            slots.push(Slot {
                compute: vec![loss],
                ..Slot::default()
            });
            // Backward.
            let mut bwd_slot_of = vec![0; n];
            for (i, &l) in bwd_order.iter().enumerate() {
                bwd_slot_of[l] = loss_slot + 1 + i;
            }
            slots.extend((0..n).map(|_| Slot::default()));
            let mut bwd_full: HashMap<usize, BufferId> = HashMap::new();
            for bucket in &bwd_buckets {
                let keep = gathers && reshard == ReshardAfterForward::False;
                if keep {
                    for &l in bucket {
                        if let Some(&b) = fwd_full.get(&l) {
                            bwd_full.insert(l, b);
                        }
                    }
                    continue;
                }
                if let Some(mut unit) = self.backward_unit(bucket, m, gathers, &mut bwd_full) {
                    unit.consumer = bwd_slot_of[bucket[0]];
                    unit.earliest = fwd_slot_of[bucket[0]] + 1;
                    unit.depth = s.prefetch.backward as usize;
                    unit.last_consumer = bwd_slot_of[*bucket.last().expect("non-empty")];
                    slots[unit.consumer].units.push(unit);
                }
            }
            // Forward buffers kept for backward (reshard = false, or a tied lm_head's embedding)
            // are released after their last backward reader.
            let tied = (0..n).find_map(|l| self.tied_embedding(l).map(|e| (l, e)));
            for slot in &mut slots[first_slot..first_slot + n] {
                for u in &mut slot.units {
                    if gathers && reshard == ReshardAfterForward::False {
                        let last_bwd = u
                            .layers
                            .iter()
                            .map(|&l| bwd_slot_of[l])
                            .max()
                            .unwrap_or(u.last_consumer);
                        u.last_consumer = u.last_consumer.max(last_bwd);
                    }
                    if let Some((head, _)) = tied.filter(|(_, e)| u.layers.contains(e)) {
                        u.last_consumer = u.last_consumer.max(bwd_slot_of[head]);
                    }
                }
            }
            let mut full_grads: HashMap<usize, BufferId> = HashMap::new();
            for &l in &bwd_order {
                let ops = self.backward(l, m, &bwd_full, &fwd_full, &mut full_grads);
                slots[bwd_slot_of[l]].compute.extend(ops);
            }
            // Gradient reductions, each bucket after its last backward.
            for bucket in &red_buckets {
                let ops = self.reduce(bucket, m, &full_grads);
                let last = bwd_slot_of[*bucket.last().expect("non-empty")];
                slots[last].after.extend(ops);
            }
            // Boundary, update and refresh after the last micro-step's reductions. With clipping,
            // every update waits for the norm, which follows every layer's boundary.
            if m + 1 == s.micro_steps {
                let mut pending = vec![];
                for bucket in &red_buckets {
                    let (mut ops, grads) = self.boundary(bucket);
                    let last = bwd_slot_of[*bucket.last().expect("non-empty")];
                    if s.train.clip.is_none() {
                        ops.extend(self.update_refresh(bucket, &grads, None));
                    } else {
                        pending.push((bucket, grads));
                    }
                    slots[last].after.extend(ops);
                }
                let all: Vec<(usize, Region)> = pending
                    .iter()
                    .flat_map(|(_, g)| g.iter().copied())
                    .collect();
                if !all.is_empty() {
                    let (mut ops, norm) = self.grad_norm(&all);
                    for (bucket, grads) in &pending {
                        ops.extend(self.update_refresh(bucket, grads, Some(norm)));
                    }
                    let last = bwd_slot_of[*bwd_order.last().expect("layers")];
                    slots[last].after.extend(ops);
                }
            }
        }
        draft.slots = slots;
    }

    /// The layers of `bucket` that have parameters to move.
    fn with_params(&self, bucket: &[usize]) -> Vec<usize> {
        bucket
            .iter()
            .copied()
            .filter(|&l| self.layers[l].has_params)
            .collect()
    }

    /// Gathered bytes of each layer's full parameters (0 when nothing is gathered).
    fn gather_sizes(&self) -> Vec<u64> {
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
    fn gather(
        &mut self,
        bucket: &[usize],
        m: u32,
        phase: &str,
        out: &mut HashMap<usize, BufferId>,
    ) -> Vec<OpId> {
        let sh = self.shard();
        let hier = self.job.schedule.all_gather == AllGatherAlgo::Hierarchical
            && sh.params.inter > 1
            && sh.params.intra > 1;
        let layers = self.with_params(bucket);
        let mut fulls = vec![];
        for &l in &layers {
            let (id, padded) = (self.layers[l].id, self.layers[l].padded);
            let name = format!("{}.params.full.m{m}.{phase}", self.p.layers[id].name);
            let full = self.buffer(name, BufferKind::Gathered, self.dtype, padded, Some(id));
            out.insert(l, full);
            fulls.push(full);
        }
        let layer = layers.first().map(|&l| self.layers[l].id);
        let d = self.dtype.bytes();
        if !hier {
            let cs = layers
                .iter()
                .zip(&fulls)
                .map(|(&l, &full)| {
                    let st = &self.layers[l];
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
            let st = &self.layers[l];
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

    fn forward_unit(
        &mut self,
        bucket: &[usize],
        m: u32,
        gathers: bool,
        refresh: bool,
        out: &mut HashMap<usize, BufferId>,
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
    fn unit(
        &self,
        ops: Vec<OpId>,
        bucket: &[usize],
        out: &HashMap<usize, BufferId>,
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

    fn backward_unit(
        &mut self,
        bucket: &[usize],
        m: u32,
        gathers: bool,
        out: &mut HashMap<usize, BufferId>,
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
    fn gather_secondary(
        &mut self,
        bucket: &[usize],
        m: u32,
        k: u32,
        out: &mut HashMap<usize, BufferId>,
    ) -> Vec<OpId> {
        let d = self.dtype.bytes();
        let mut cs = vec![];
        let mut layer = None;
        for l in self.with_params(bucket) {
            let (id, padded) = (self.layers[l].id, self.layers[l].padded);
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

    fn secondary_buf(&mut self, l: usize, m: u32) -> BufferId {
        if let Some(&b) = self.secondaries.get(&(l, m)) {
            return b;
        }
        let (id, padded) = (self.layers[l].id, self.layers[l].padded);
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
    fn params_region(&self, l: usize, full: &HashMap<usize, BufferId>) -> Option<Region> {
        let st = &self.layers[l];
        if !st.has_params {
            return None;
        }
        let bytes = st.padded * self.dtype.bytes();
        Some(Region::whole(
            full.get(&l).copied().unwrap_or(st.param_shard),
            bytes,
        ))
    }

    /// Layer `l`'s saved activations in micro-step `m` (created on first use).
    fn act_buf(&mut self, l: usize, m: u32) -> Option<BufferId> {
        if let Some(&b) = self.acts.get(&(l, m)) {
            return Some(b);
        }
        let bytes = activations::saved_bytes(&self.job.model.layers[l].kind, &self.job.model);
        (bytes > 0).then(|| {
            let id = self.layers[l].id;
            let name = format!("{}.act.m{m}", self.p.layers[id].name);
            let b = self.buffer(
                name,
                BufferKind::Activation,
                self.dtype,
                bytes / self.dtype.bytes(),
                Some(id),
            );
            self.acts.insert((l, m), b);
            b
        })
    }

    fn forward(&mut self, l: usize, m: u32, full: &HashMap<usize, BufferId>) -> Vec<OpId> {
        let id = self.layers[l].id;
        let recompute = self.job.schedule.recompute == Recompute::Full;
        let mut reads: Vec<Region> = self.params_region(l, full).into_iter().collect();
        if let Some(e) = self.tied_embedding(l) {
            reads.extend(self.params_region(e, full));
        }
        if l > 0 {
            let h = self.hidden_buf(false, m, l);
            reads.push(Region::whole(h, self.p.buffers[h].bytes));
        }
        let out = self.hidden_buf(false, m, l + 1);
        let mut writes = vec![Region::whole(out, self.p.buffers[out].bytes)];
        if !recompute {
            if let Some(a) = self.act_buf(l, m) {
                writes.push(Region::whole(a, self.p.buffers[a].bytes));
            }
        }
        let mut ops = vec![self.compute(ComputeKind::Forward, Some(id), Some(m), reads, writes)];
        // hpZ keeps this rank's slice of the gathered parameters for backward.
        if let (ReshardAfterForward::Node { secondary }, Some(&g)) =
            (self.job.schedule.reshard_after_forward, full.get(&l))
        {
            let padded = self.layers[l].padded;
            let chunk = padded / u64::from(secondary) * self.dtype.bytes();
            let sec = self.secondary_buf(l, m);
            let from = Region {
                buffer: g,
                offset: Offset::Shard {
                    index: ShardIndex::Secondary,
                    base: 0,
                    stride: chunk,
                },
                bytes: chunk,
            };
            ops.push(self.compute(
                ComputeKind::Copy,
                Some(id),
                Some(m),
                vec![from],
                vec![Region::whole(sec, chunk)],
            ));
        }
        ops
    }

    fn backward(
        &mut self,
        l: usize,
        m: u32,
        bwd_full: &HashMap<usize, BufferId>,
        fwd_full: &HashMap<usize, BufferId>,
        full_grads: &mut HashMap<usize, BufferId>,
    ) -> Vec<OpId> {
        let id = self.layers[l].id;
        let mut ops = vec![];
        let params = self.params_region(l, bwd_full);
        let act = self.act_buf(l, m);
        if self.job.schedule.recompute == Recompute::Full {
            let mut reads: Vec<Region> = params.into_iter().collect();
            if l > 0 {
                let h = self.hidden_buf(false, m, l);
                reads.push(Region::whole(h, self.p.buffers[h].bytes));
            }
            if let Some(a) = act {
                let w = vec![Region::whole(a, self.p.buffers[a].bytes)];
                ops.push(self.compute(ComputeKind::Recompute, Some(id), Some(m), reads, w));
            }
        }
        let mut reads: Vec<Region> = params.into_iter().collect();
        if let Some(a) = act {
            reads.push(Region::whole(a, self.p.buffers[a].bytes));
        }
        let g_out = self.hidden_buf(true, m, l + 1);
        reads.push(Region::whole(g_out, self.p.buffers[g_out].bytes));
        let mut writes = vec![];
        if l > 0 {
            let h = self.hidden_buf(false, m, l);
            reads.push(Region::whole(h, self.p.buffers[h].bytes));
            let g_in = self.hidden_buf(true, m, l);
            writes.push(Region::whole(g_in, self.p.buffers[g_in].bytes));
        }
        // Parameter gradients: into the accumulator directly when it is the full size, else a full buffer.
        if self.layers[l].has_params {
            let g = self.grad_target(l, m, full_grads);
            self.grad_write(m, g, &mut reads, &mut writes);
        }
        if let Some(e) = self.tied_embedding(l) {
            if let Some(p) = self.params_region(e, fwd_full) {
                reads.push(p);
            }
            let g = self.grad_target(e, m, full_grads);
            let LayerKind::Embedding { vocab, hidden, .. } = self.job.model.layers[e].kind else {
                unreachable!()
            };
            let wte = Region {
                bytes: vocab * hidden * self.grad_dtype.bytes(),
                ..g
            };
            self.grad_write(m, wte, &mut reads, &mut writes);
        }
        ops.push(self.compute(ComputeKind::Backward, Some(id), Some(m), reads, writes));
        ops
    }

    /// Where backward writes layer `l`'s parameter gradient in micro-step `m`.
    fn grad_target(
        &mut self,
        l: usize,
        m: u32,
        full_grads: &mut HashMap<usize, BufferId>,
    ) -> Region {
        let st = &self.layers[l];
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
            })
        });
        Region::whole(buf, bytes)
    }

    /// Backward adds into the accumulator itself: two-hop with unsharded gradients.
    fn direct_accumulation(&self) -> bool {
        self.job.schedule.grad_sync == GradSync::TwoHop && self.shard().grads.size() == 1
    }

    /// A backward's write of gradient region `g` (a prefix of its buffer): it adds onto the bytes
    /// already written in this micro-step (by a tied lm_head, or earlier micro-steps when backward
    /// accumulates directly) and plainly writes the rest.
    fn grad_write(&mut self, m: u32, g: Region, reads: &mut Vec<Region>, writes: &mut Vec<Region>) {
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
    fn reduce(
        &mut self,
        bucket: &[usize],
        m: u32,
        full_grads: &HashMap<usize, BufferId>,
    ) -> Vec<OpId> {
        let sh = self.shard();
        let gd = self.grad_dtype;
        let flat = self.job.schedule.grad_sync == GradSync::Flat;
        let layers = self.with_params(bucket);
        if layers.is_empty() || self.direct_accumulation() {
            return vec![];
        }
        let first = self.layers[layers[0]].id;
        let mut cs = vec![];
        let mut adds = vec![];
        for &l in &layers {
            let st = &self.layers[l];
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
    fn boundary(&mut self, bucket: &[usize]) -> (Vec<OpId>, Vec<(usize, Region)>) {
        let sh = self.shard();
        let gd = self.grad_dtype;
        let ranks = u64::from(self.layout.ranks());
        let layers = self.with_params(bucket);
        if layers.is_empty() {
            return (vec![], vec![]);
        }
        let first = self.layers[layers[0]].id;
        let two_hop = self.job.schedule.grad_sync == GradSync::TwoHop;
        let mut rs = vec![];
        let mut ar = vec![];
        let mut grads = vec![];
        for &l in &layers {
            let st = &self.layers[l];
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
    fn grad_norm(&mut self, grads: &[(usize, Region)]) -> (Vec<OpId>, Region) {
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
        if self.shard().optimizer.size() > 1 {
            let c = self.collective(
                Collective::AllReduce,
                CommKind::Optimizer,
                Dtype::Fp32,
                whole,
                whole,
            );
            ops.extend(self.issue(vec![c], OpRole::Sync, None, None));
        }
        (ops, whole)
    }

    /// Optimizer update of each layer of `grads` (reading its optimizer-shard gradient, then with
    /// clipping the norm) and, unless deferred to the next step, the refresh of `bucket`.
    fn update_refresh(
        &mut self,
        bucket: &[usize],
        grads: &[(usize, Region)],
        norm: Option<Region>,
    ) -> Vec<OpId> {
        let sh = self.shard();
        let mut ops: Vec<OpId> = vec![];
        for &(l, g) in grads {
            let st = &self.layers[l];
            let (id, padded, shard) = (st.id, st.padded, st.param_shard);
            let opt = self.optimizer_shards[l];
            let opt_region = Region::whole(opt, self.p.buffers[opt].bytes);
            let os_bytes = padded / sh.optimizer.size() * self.dtype.bytes();
            let mine = Region {
                buffer: shard,
                offset: Offset::Shard {
                    index: ShardIndex::OptimizerInParam,
                    base: 0,
                    stride: os_bytes,
                },
                bytes: os_bytes,
            };
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
        if self.job.schedule.overlap.refresh != Refresh::NextForward {
            let layers = self.with_params(bucket);
            ops.extend(self.refresh(&layers));
        }
        ops
    }

    /// All-gathers each layer's updated optimizer shards into its param shard (s_os > s_p).
    fn refresh(&mut self, bucket: &[usize]) -> Vec<OpId> {
        let sh = self.shard();
        if sh.optimizer.size() == sh.params.size() {
            return vec![];
        }
        let d = self.dtype.bytes();
        let mut cs = vec![];
        let mut layer = None;
        for l in self.with_params(bucket) {
            let st = &self.layers[l];
            let (id, padded, shard) = (st.id, st.padded, st.param_shard);
            layer.get_or_insert(id);
            let os_bytes = padded / sh.optimizer.size() * d;
            let mine = Region {
                buffer: shard,
                offset: Offset::Shard {
                    index: ShardIndex::OptimizerInParam,
                    base: 0,
                    stride: os_bytes,
                },
                bytes: os_bytes,
            };
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
