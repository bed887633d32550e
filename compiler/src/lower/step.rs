//! The step's shape: micro-steps of forward slots, the loss and backward slots; the buckets of
//! gathers and reductions ([`super::buckets`]); which slot each gather unit serves and how far
//! prefetch may hoist it; and the boundary, clipping, update and refresh after each layer's last
//! backward of the last micro-step (a refresh that does not overlap: after the step's last backward).

use super::buckets::partition;
use super::Builder;
use crate::draft::Slot;
use sched_ir::hash::FxHashMap;
use sched_ir::ir::*;
use sched_ir::job::*;
use std::ops::Range;

/// The bucket partitions of one step (or of one pipeline chunk), as layer indices (lowering
/// spec §5, "Buckets").
pub(super) struct Buckets {
    /// Forward gathers, in layer order.
    forward: Vec<Vec<usize>>,
    /// Backward gathers, in backward (reverse layer) order.
    backward: Vec<Vec<usize>>,
    /// Gradient reductions and the boundary, in backward order.
    reduce: Vec<Vec<usize>>,
}

/// Gathered parameters a pipeline action leaves to the next action of the same chunk on its
/// stage (parallel spec §2: a chunk whose parameters stay gathered across consecutive actions is
/// gathered once). An action's last gather bucket is the next action's first whenever the
/// consumption order turns around at the boundary (a forward ends with the chunk's last layers,
/// where the backward of the next micro-batch begins; a backward ends with its first layers,
/// where the next forward begins): those stay gathered across the boundary instead of being
/// released and gathered again, which saves the gather and never adds a live byte. Per layer:
/// the buffer and the unit (slot, index) that gathered it.
#[derive(Default)]
pub(super) struct Held {
    /// The previous action's last bucket (empty when it ran another chunk).
    previous: FxHashMap<usize, (BufferId, usize, usize)>,
    /// The current action's latest bucket.
    current: FxHashMap<usize, (BufferId, usize, usize)>,
    /// Whether the current action has placed its first bucket (only that one may take over).
    started: bool,
}

impl Held {
    /// The next action begins: the last one's last bucket stays held if it runs `same` chunk.
    pub(super) fn next_action(&mut self, same: bool) {
        self.previous = std::mem::take(&mut self.current);
        if !same {
            self.previous.clear();
        }
        self.started = false;
    }
}

/// Which part of a layer's backward a backward slot runs: all of it (`B`), its input-gradient
/// half (`I`) or its weight half (`W`, which the gradient reductions follow).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Half {
    Whole,
    Input,
    Weight,
}

/// Where one micro-step's slots are: each layer's forward and backward slot (by layer index;
/// in a pipeline only those of one chunk are meaningful), and the loss's. `first` is the first
/// slot of the micro-step's forward (of the chunk's forward action, in a pipeline).
pub(super) struct MicroStepSlots {
    pub(super) first: usize,
    pub(super) forward: Vec<usize>,
    pub(super) loss: usize,
    pub(super) backward: Vec<usize>,
}

impl MicroStepSlots {
    pub(super) fn clone_slots(&self) -> MicroStepSlots {
        MicroStepSlots {
            first: self.first,
            forward: self.forward.clone(),
            loss: self.loss,
            backward: self.backward.clone(),
        }
    }
}

impl Builder<'_> {
    /// The whole step: every micro-step's slots, then boundary, update and refresh pinned after
    /// each layer's last backward of the last micro-step.
    pub(super) fn step(&mut self) -> Vec<Slot> {
        let all = 0..self.job.model.layers.len();
        let buckets = self.buckets(&all.clone().collect::<Vec<_>>());
        let mut slots: Vec<Slot> = vec![];
        for m in 0..self.job.schedule.micro_steps {
            let at = self.micro_step(m, &buckets, &mut slots);
            if m + 1 == self.job.schedule.micro_steps {
                self.after_last_backward(&buckets, &at, &mut slots, all.clone());
            }
        }
        slots
    }

    /// Partitions `layers` (in layer order) into gather and reduction buckets by payload.
    pub(super) fn buckets(&self, layers: &[usize]) -> Buckets {
        let s = &self.job.schedule;
        let gather_sizes = self.gather_sizes();
        let red_sizes: Vec<u64> = self
            .layers
            .iter()
            .map(|l| {
                if l.has_params {
                    l.padded * self.grad_dtype.bytes()
                } else {
                    0
                }
            })
            .collect();
        let in_order = |order: &[usize], sizes: &[u64], bucket: u64| -> Vec<Vec<usize>> {
            let sizes: Vec<u64> = order.iter().map(|&l| sizes[l]).collect();
            partition(&sizes, bucket)
                .into_iter()
                .map(|b| b.into_iter().map(|i| order[i]).collect())
                .collect()
        };
        let bwd_order: Vec<usize> = layers.iter().rev().copied().collect();
        Buckets {
            forward: in_order(layers, &gather_sizes, s.buckets.gather),
            backward: in_order(&bwd_order, &gather_sizes, s.buckets.gather),
            reduce: in_order(&bwd_order, &red_sizes, s.buckets.reduce),
        }
    }

    /// Micro-step `m`: forward slots with their gather units, the loss, backward slots with
    /// theirs, and each reduction bucket after its last backward.
    fn micro_step(&mut self, m: u32, buckets: &Buckets, slots: &mut Vec<Slot>) -> MicroStepSlots {
        let n = self.job.model.layers.len();
        let first = slots.len();
        let forward: Vec<usize> = (0..n).map(|l| first + l).collect();
        let loss = first + n;
        let mut backward = vec![0; n];
        for (i, l) in (0..n).rev().enumerate() {
            backward[l] = loss + 1 + i;
        }
        let at = MicroStepSlots {
            first,
            forward,
            loss,
            backward,
        };
        slots.extend((0..2 * n + 1).map(|_| Slot::default()));
        let fwd_full = self.forward_slots(m, buckets, &at, slots, 0..n);
        let loss = self.loss(m);
        slots[at.loss].compute.push(loss);
        self.backward_slots(m, buckets, &at, &fwd_full, slots, (0..n, Half::Whole));
        at
    }

    /// The loss of micro-step `m`: softmax cross-entropy of the last layer's output.
    pub(super) fn loss(&mut self, m: u32) -> OpId {
        let n = self.job.model.layers.len();
        let last = self.hidden_buf(false, m, n);
        let dlast = self.hidden_buf(true, m, n);
        let (lb, db) = (self.p.buffers[last].bytes, self.p.buffers[dlast].bytes);
        self.compute(
            ComputeKind::Loss,
            None,
            Some(m),
            vec![Region::whole(last, lb)],
            vec![Region::whole(dlast, db)],
        )
    }

    /// The forward gather units and forward compute of `layers` in micro-step `m`; the gathered
    /// buffers.
    pub(super) fn forward_slots(
        &mut self,
        m: u32,
        buckets: &Buckets,
        at: &MicroStepSlots,
        slots: &mut [Slot],
        layers: Range<usize>,
    ) -> FxHashMap<usize, BufferId> {
        let job = self.job;
        let s = &job.schedule;
        let gathers = s.shard.params.size() > 1;
        let refresh = m == 0 && s.overlap.refresh == Refresh::NextForward;
        let depth = s.prefetch.forward as usize;
        let mut fwd_full: FxHashMap<usize, BufferId> = FxHashMap::default();
        for bucket in &buckets.forward {
            let last = at.forward[*bucket.last().expect("non-empty")];
            // (The first forward's refresh is never taken over.)
            if self.reuse_gather(bucket, &mut fwd_full, slots, (last, !refresh)) {
                continue;
            }
            if let Some(mut unit) = self.forward_unit(bucket, m, gathers, refresh, &mut fwd_full) {
                unit.consumer = at.forward[bucket[0]];
                unit.earliest = if m == 0 {
                    0
                } else {
                    at.first.saturating_sub(1)
                };
                unit.depth = depth;
                // Released after the last forward that reads it (or kept to backward).
                unit.last_consumer = last;
                self.hold_gather(
                    bucket,
                    &fwd_full,
                    (unit.consumer, slots[unit.consumer].units.len()),
                );
                slots[unit.consumer].units.push(unit);
            }
        }
        for l in layers {
            let ops = self.forward(l, m, &fwd_full);
            slots[at.forward[l]].compute.extend(ops);
        }
        fwd_full
    }

    /// The backward gather units, backward compute (its `half`) and, after whole or weight
    /// halves, the per-micro-step reductions of `layers` in micro-step `m`.
    pub(super) fn backward_slots(
        &mut self,
        m: u32,
        buckets: &Buckets,
        at: &MicroStepSlots,
        fwd_full: &FxHashMap<usize, BufferId>,
        slots: &mut [Slot],
        (layers, half): (Range<usize>, Half),
    ) {
        let n = self.layers.len();
        let job = self.job;
        let s = &job.schedule;
        let gathers = s.shard.params.size() > 1;
        let keep = gathers && s.reshard_after_forward == ReshardAfterForward::False;
        let depth = s.prefetch.backward as usize;
        let mut bwd_full: FxHashMap<usize, BufferId> = FxHashMap::default();
        for bucket in &buckets.backward {
            // (An embedding's replica is not gathered for backward: its tied head reads the
            // forward's gather, kept for it, as on the embedding's own stage.)
            let bucket: Vec<usize> = bucket
                .iter()
                .copied()
                .filter(|l| layers.contains(l))
                .collect();
            if bucket.is_empty() {
                continue;
            }
            let bucket = &bucket;
            if keep {
                for &l in bucket {
                    if let Some(&b) = fwd_full.get(&l) {
                        bwd_full.insert(l, b);
                    }
                }
                continue;
            }
            let last = at.backward[*bucket.last().expect("non-empty")];
            if self.reuse_gather(bucket, &mut bwd_full, slots, (last, true)) {
                continue;
            }
            if let Some(mut unit) = self.backward_unit(bucket, m, gathers, &mut bwd_full) {
                unit.consumer = at.backward[bucket[0]];
                unit.earliest = at.forward[bucket[0]] + 1;
                unit.depth = depth;
                unit.last_consumer = last;
                self.hold_gather(
                    bucket,
                    &bwd_full,
                    (unit.consumer, slots[unit.consumer].units.len()),
                );
                slots[unit.consumer].units.push(unit);
            }
        }
        // Forward buffers kept for backward (reshard = false, or a tied lm_head's embedding)
        // are released after their last backward reader.
        let tied = (0..n).find_map(|l| self.tied_embedding(l).map(|e| (l, e)));
        let mut forward_slots: Vec<usize> = layers.clone().map(|l| at.forward[l]).collect();
        forward_slots.dedup();
        for &f in &forward_slots {
            for u in &mut slots[f].units {
                if keep {
                    let last_bwd = u
                        .layers
                        .iter()
                        .map(|&l| at.backward[l])
                        .max()
                        .unwrap_or(u.last_consumer);
                    u.last_consumer = u.last_consumer.max(last_bwd);
                }
                if let Some((head, _)) = tied.filter(|(_, e)| u.layers.contains(e)) {
                    u.last_consumer = u.last_consumer.max(at.backward[head]);
                }
            }
        }
        let mut full_grads: FxHashMap<usize, BufferId> = FxHashMap::default();
        for l in layers.rev() {
            let ops = match half {
                Half::Whole => self.backward(l, m, &bwd_full, fwd_full, &mut full_grads),
                Half::Input => self.backward_input(l, m, &bwd_full, fwd_full),
                Half::Weight => self.backward_weight(l, m, &bwd_full, fwd_full, &mut full_grads),
            };
            slots[at.backward[l]].compute.extend(ops);
        }
        if half == Half::Input {
            return;
        }
        // Gradient reductions, each bucket after its last backward.
        for bucket in &buckets.reduce {
            let ops = self.reduce(bucket, m, &full_grads);
            let last = at.backward[*bucket.last().expect("non-empty")];
            slots[last].after.extend(ops);
        }
    }

    /// Boundary, update and refresh after the last micro-step's reductions. With clipping, every
    /// update waits for the norm, which follows every layer's boundary.
    ///
    /// A refresh that overlaps runs on the sync stream right after its update. One that does not
    /// (`refresh = false`) runs on the compute stream after the step's last backward (lowering §3:
    /// after the last micro-step), as a framework without that overlap does after its optimizer
    /// step; placed after each update instead, it would also stall the compute stream on every
    /// layer's boundary synchronisation, which the `sync` switch ablates, not this one.
    ///
    /// `layers` are those the buckets cover (a pipeline chunk's, or all); their first layer's
    /// backward is the last backward slot.
    pub(super) fn after_last_backward(
        &mut self,
        buckets: &Buckets,
        at: &MicroStepSlots,
        slots: &mut [Slot],
        layers: Range<usize>,
    ) {
        let last_backward = at.backward[layers.start];
        let clip = self.job.schedule.train.clip.is_some();
        let defer = self.finishes_at_stage_end();
        let mut pending = vec![];
        for bucket in &buckets.reduce {
            let (mut ops, grads) = self.boundary(bucket);
            let last = at.backward[*bucket.last().expect("non-empty")];
            if defer {
                self.deferred.push((bucket.clone(), grads));
            } else if clip {
                pending.push((bucket, grads));
            } else {
                ops.extend(self.update_then_refresh(bucket, &grads, None));
            }
            slots[last].after.extend(ops);
        }
        if defer {
            return;
        }
        let all: Vec<(usize, Region)> = pending
            .iter()
            .flat_map(|(_, g)| g.iter().copied())
            .collect();
        if !all.is_empty() {
            let (mut ops, norm) = self.grad_norm(&all);
            for (bucket, grads) in &pending {
                ops.extend(self.update_then_refresh(bucket, grads, Some(norm)));
            }
            slots[last_backward].after.extend(ops);
        }
        if self.job.schedule.overlap.refresh == Refresh::Overlap(false) {
            for bucket in &buckets.reduce {
                let ops = self.refresh(bucket);
                slots[last_backward].after.extend(ops);
            }
        }
    }

    /// Serves a pipeline action's first gather bucket from the previous action of the same chunk
    /// when that one's last bucket holds every layer of it ([`Held`]): the buffers go into `full`,
    /// and the unit that gathered them lives on to slot `last` (unless not `allowed`). Only with
    /// `reshard_after_forward = true` (otherwise forward buffers are kept for backward, or
    /// backward gathers hpZ's secondary copy), and not for a tied embedding (kept to its head's
    /// backward).
    fn reuse_gather(
        &mut self,
        bucket: &[usize],
        full: &mut FxHashMap<usize, BufferId>,
        slots: &mut [Slot],
        (last, allowed): (usize, bool),
    ) -> bool {
        // (What a tied head reads, the embedding or its replica, is kept to its backward.)
        let tied = self.job.tied_head().map(|(h, _)| h);
        let eligible = allowed
            && self.job.schedule.reshard_after_forward == ReshardAfterForward::True
            && !tied
                .and_then(|h| self.tied_embedding(h))
                .is_some_and(|e| bucket.contains(&e));
        let layers = self.with_params(bucket);
        let Some(held) = self.held.as_mut() else {
            return false;
        };
        // Whatever happens, this bucket becomes the latest.
        held.current.clear();
        let first = !std::mem::replace(&mut held.started, true);
        let all_held = !layers.is_empty() && layers.iter().all(|l| held.previous.contains_key(l));
        if !(eligible && first && all_held) {
            return false;
        }
        for l in layers {
            let (b, slot, unit) = held.previous[&l];
            full.insert(l, b);
            let u = &mut slots[slot].units[unit];
            u.last_consumer = u.last_consumer.max(last);
            held.current.insert(l, (b, slot, unit));
        }
        true
    }

    /// Records that unit `at` (slot, index) gathered `bucket` into `full`, for the next action
    /// of the same chunk ([`Builder::reuse_gather`]).
    fn hold_gather(
        &mut self,
        bucket: &[usize],
        full: &FxHashMap<usize, BufferId>,
        (slot, unit): (usize, usize),
    ) {
        let Some(held) = self.held.as_mut() else {
            return;
        };
        for &l in bucket {
            if let Some(&b) = full.get(&l) {
                held.current.insert(l, (b, slot, unit));
            }
        }
    }

    /// Whether the current pipeline stage holds its updates back to its end, after its last
    /// transfer: they wait for collectives with other stages (clipping's norm, the embedding
    /// group), which a stage may only enter once it owes its neighbours nothing.
    fn finishes_at_stage_end(&self) -> bool {
        let pipeline = &self.job.schedule.pipeline;
        if !pipeline.is_pipelined() {
            return false;
        }
        self.job.schedule.train.clip.is_some()
            || self.replica.is_some_and(|(h, e)| {
                self.stage_of_layer(h) == self.stage || self.stage_of_layer(e) == self.stage
            })
    }

    /// The end of a pipeline stage that [`Builder::finishes_at_stage_end`]: the embedding
    /// group's all-reduces, clipping's norm over every stage, then the held-back updates and
    /// refreshes. Every stage computes the norm (over no layer if it has no parameters), since
    /// every stage takes part in its all-reduce.
    pub(super) fn finish_stage(&mut self) -> Vec<OpId> {
        if !self.finishes_at_stage_end() {
            return vec![];
        }
        let pending = std::mem::take(&mut self.deferred);
        let grads: Vec<(usize, Region)> = pending
            .iter()
            .flat_map(|(_, g)| g.iter().copied())
            .collect();
        let mut ops = self.embedding_group(&grads);
        let norm = if self.job.schedule.train.clip.is_some() {
            // A replica's gradient equals its embedding's: counted once, on the embedding's stage.
            let all: Vec<(usize, Region)> = grads
                .iter()
                .copied()
                .filter(|&(l, _)| !self.is_replica(l))
                .collect();
            let (norm_ops, norm) = self.grad_norm(&all);
            ops.extend(norm_ops);
            Some(norm)
        } else {
            None
        };
        for (bucket, grads) in &pending {
            ops.extend(self.update_then_refresh(bucket, grads, norm));
        }
        if self.job.schedule.overlap.refresh == Refresh::Overlap(false) {
            for (bucket, _) in &pending {
                ops.extend(self.refresh(bucket));
            }
        }
        ops
    }

    /// The updates of `bucket`'s layers, followed by its refresh when that overlaps (on the sync
    /// stream, right after them).
    fn update_then_refresh(
        &mut self,
        bucket: &[usize],
        grads: &[(usize, Region)],
        norm: Option<Region>,
    ) -> Vec<OpId> {
        let mut ops = self.update(grads, norm);
        if self.job.schedule.overlap.refresh == Refresh::Overlap(true) {
            ops.extend(self.refresh(bucket));
        }
        ops
    }
}
