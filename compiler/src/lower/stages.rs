//! Pipeline stages (parallel spec §2): each stage's slots in the order its actions run, and the
//! point-to-point transfers between stages, inferred from the orders.
//!
//! Stage by stage (each stage's slots are consecutive; a stage's ranks run only its ops), every
//! action of the stage's order becomes slots:
//! - `F` of micro-batch `i` on chunk `c`: a forward slot per layer of the chunk, with the gather
//!   units the layer needs, and on the last chunk the loss;
//! - `B`: a backward slot per layer, in reverse, with the per-micro-batch gradient reductions;
//!   after the chunk's last `B` in the order, the boundary synchronisation, the update and the
//!   refresh of its layers (gradients accumulate over the stage's micro-batches as over
//!   micro-steps without a pipeline).
//!
//! Hidden states cross a chunk boundary between stages as point-to-point transfers: an `F` sends
//! its output to the stage of the next chunk, a `B` sends its input gradient to the stage of the
//! previous one, each from the sender's buffer into the receiver's own buffer of that boundary.
//! After each action, its send and the receive the stage's next action needs are issued as one
//! group call (Megatron's `send_forward_recv_backward` and its mirror; torch had to coalesce
//! exactly this pair to stop 1F1B from hanging), so that neighbouring stages that each send
//! before they receive do not wait on each other forever. The receive of a stage's first action
//! is issued on its own, before it. Chunks that follow each other on one stage (the V of `zbv`)
//! share the boundary's buffer and need no transfer. The verifier proves the result free of
//! deadlock with every send and receive blocking.
//!
//! Gradient accumulation runs over a stage's micro-batches in its order's `B` order, so the
//! update waits for the last of them.

use super::comms::CommKind;
use super::step::{Buckets, MicroStepSlots};
use super::Builder;
use crate::draft::Slot;
use sched_ir::hash::FxHashMap;
use sched_ir::ir::*;
use sched_ir::job::*;
use std::ops::Range;

impl Builder<'_> {
    /// Every stage's slots, stage after stage.
    pub(super) fn pipeline_step(&mut self) -> Vec<Slot> {
        let pipeline = self.job.schedule.pipeline.clone();
        let mut slots: Vec<Slot> = vec![];
        for stage in 0..pipeline.stages {
            self.stage = stage;
            let start = slots.len();
            self.stage_slots(&pipeline, stage, &mut slots);
            for slot in &mut slots[start..] {
                slot.stage = stage;
                // Prefetch never hoists a gather out of its stage.
                for u in &mut slot.units {
                    u.earliest = u.earliest.max(start);
                }
            }
        }
        self.stage = 0;
        slots
    }

    /// Stage `stage`'s slots, in the order of its actions.
    fn stage_slots(&mut self, pipeline: &Pipeline, stage: u32, slots: &mut Vec<Slot>) {
        let n = self.layers.len();
        let order = &pipeline.order[stage as usize];
        let last_chunk = pipeline.chunks.len() as u32 - 1;
        // Each local chunk's buckets, and the index of its last backward in the order.
        let buckets: Vec<Buckets> = (0..pipeline.virtual_stages)
            .map(|local| self.buckets(pipeline.layers_of_chunk(pipeline.chunk_of(stage, local))))
            .collect();
        let mut last_backward: FxHashMap<u32, usize> = FxHashMap::default();
        for (k, a) in order.iter().enumerate() {
            if a.kind == ActionKind::B {
                last_backward.insert(a.chunk, k);
            }
        }
        let mut at: FxHashMap<(u32, u32), MicroStepSlots> = FxHashMap::default();
        let mut gathered: FxHashMap<(u32, u32), FxHashMap<usize, BufferId>> = FxHashMap::default();
        let rounds = Self::rounds(pipeline, stage, order);
        for (k, a) in order.iter().enumerate() {
            let chunk = pipeline.chunk_of(stage, a.chunk);
            let layers = pipeline.layers_of_chunk(chunk);
            let first = slots.len();
            let m = a.micro;
            match a.kind {
                ActionKind::F => {
                    let last = chunk == last_chunk;
                    let count = layers.len() + usize::from(last);
                    slots.extend((0..count).map(|_| Slot::default()));
                    let mut forward = vec![0; n];
                    for (i, l) in layers.clone().enumerate() {
                        forward[l] = first + i;
                    }
                    let here = MicroStepSlots {
                        first,
                        forward,
                        loss: first + layers.len(),
                        backward: vec![0; n],
                    };
                    let b = &buckets[a.chunk as usize];
                    let full = self.forward_slots(m, b, &here, slots, layers);
                    if last {
                        let loss = self.loss(m);
                        slots[here.loss].compute.push(loss);
                    }
                    at.insert((a.chunk, m), here);
                    gathered.insert((a.chunk, m), full);
                }
                ActionKind::B => {
                    slots.extend(layers.clone().map(|_| Slot::default()));
                    let mut here = at
                        .remove(&(a.chunk, m))
                        .expect("the order is well formed: every B follows its F");
                    for (i, l) in layers.clone().rev().enumerate() {
                        here.backward[l] = first + i;
                    }
                    let full = gathered.remove(&(a.chunk, m)).unwrap_or_default();
                    let b = &buckets[a.chunk as usize];
                    self.backward_slots(m, b, &here, &full, slots, layers.clone());
                    if last_backward.get(&a.chunk) == Some(&k) {
                        self.after_last_backward(b, &here, slots, layers);
                    }
                }
                ActionKind::I | ActionKind::W => {
                    unreachable!("sema refuses split backward actions until they are lowered")
                }
            }
            let round = rounds
                .iter()
                .position(|r| r.contains(&k))
                .expect("rounds cover the order");
            if k == 0 {
                let first_round = rounds[0].clone();
                let recvs: Vec<CollectiveOp> = order[first_round]
                    .iter()
                    .filter_map(|b| self.transfer_in(pipeline, stage, b))
                    .collect();
                if let Some(op) = self.issue(recvs, OpRole::P2p, None, Some(m)) {
                    slots[first].compute.insert(0, op);
                }
            }
            if rounds[round].end != k + 1 {
                continue;
            }
            // The round's sends, with the receives of the next round, in one group call.
            let mut transfers: Vec<CollectiveOp> = order[rounds[round].clone()]
                .iter()
                .filter_map(|b| self.transfer_out(pipeline, stage, b))
                .collect();
            if let Some(next) = rounds.get(round + 1) {
                for b in &order[next.clone()] {
                    transfers.extend(self.transfer_in(pipeline, stage, b));
                }
            }
            if let Some(op) = self.issue(transfers, OpRole::P2p, None, Some(m)) {
                slots
                    .last_mut()
                    .expect("an action has slots")
                    .after
                    .push(op);
            }
        }
    }

    /// The stage's actions in rounds, each followed by one group call of its sends and the next
    /// round's receives. Every action is a round of its own (Megatron's 1F1B pairing: each
    /// action's send goes with the next action's receive), except in the steady state of
    /// `interleaved_1f1b` (after its warm-up forwards), where a forward and the backward after
    /// it are one round, as Megatron's interleaved schedule exchanges both directions of a
    /// steady-state step in one batched call (paired action by action, neighbouring stages could
    /// each be sending a gradient the other receives only later).
    fn rounds(pipeline: &Pipeline, stage: u32, order: &[Action]) -> Vec<Range<usize>> {
        let (p, v) = (pipeline.stages as usize, pipeline.virtual_stages as usize);
        let forwards = order.iter().filter(|a| a.kind == ActionKind::F).count();
        let warmup = if pipeline.schedule != PipelineSchedule::Interleaved1F1B {
            usize::MAX
        } else if forwards == p * v {
            forwards // m = p: every forward warms up
        } else {
            ((p - stage as usize - 1) * 2 + (v - 1) * p).min(forwards)
        };
        let mut rounds = vec![];
        let mut k = 0;
        while k < order.len() {
            let pair = k >= warmup
                && order[k].kind == ActionKind::F
                && order.get(k + 1).is_some_and(|b| b.kind == ActionKind::B);
            let len = if pair { 2 } else { 1 };
            rounds.push(k..k + len);
            k += len;
        }
        rounds
    }

    /// The send of what action `a` of `stage` produces for another stage, if any: an `F`'s
    /// output to the next chunk's stage, a `B`'s input gradient to the previous chunk's.
    fn transfer_out(
        &mut self,
        pipeline: &Pipeline,
        stage: u32,
        a: &Action,
    ) -> Option<CollectiveOp> {
        let chunk = pipeline.chunk_of(stage, a.chunk);
        let layers = pipeline.layers_of_chunk(chunk);
        let (peer_chunk, grad, boundary) = match a.kind {
            ActionKind::F => (chunk + 1, false, layers.end),
            ActionKind::B | ActionKind::I => (chunk.checked_sub(1)?, true, layers.start),
            ActionKind::W => return None,
        };
        let to = self.peer_stage(pipeline, stage, peer_chunk)?;
        Some(self.point_to_point(Collective::Send, stage, to, grad, a.micro, boundary))
    }

    /// The receive action `a` of `stage` needs from another stage before it runs, if any: an
    /// `F`'s input from the previous chunk's stage, a `B`'s output gradient from the next one's.
    fn transfer_in(&mut self, pipeline: &Pipeline, stage: u32, a: &Action) -> Option<CollectiveOp> {
        let chunk = pipeline.chunk_of(stage, a.chunk);
        let layers: Range<usize> = pipeline.layers_of_chunk(chunk);
        let (peer_chunk, grad, boundary) = match a.kind {
            ActionKind::F => (chunk.checked_sub(1)?, false, layers.start),
            ActionKind::B | ActionKind::I => (chunk + 1, true, layers.end),
            ActionKind::W => return None,
        };
        let from = self.peer_stage(pipeline, stage, peer_chunk)?;
        Some(self.point_to_point(Collective::Recv, from, stage, grad, a.micro, boundary))
    }

    /// The stage of chunk `peer`, when it exists and is not `stage` itself.
    fn peer_stage(&self, pipeline: &Pipeline, stage: u32, peer: u32) -> Option<u32> {
        let exists = (peer as usize) < pipeline.chunks.len();
        let to = pipeline.stage_of_chunk(peer);
        (exists && to != stage).then_some(to)
    }

    /// A send (issued by `from`) or receive (issued by `to`) of the hidden state entering layer
    /// `boundary` in micro-batch `m` (its gradient with `grad`), in the issuing stage's buffer.
    fn point_to_point(
        &mut self,
        kind: Collective,
        from: u32,
        to: u32,
        grad: bool,
        m: u32,
        boundary: usize,
    ) -> CollectiveOp {
        let h = self.hidden_buf(grad, m, boundary);
        let region = Region::whole(h, self.p.buffers[h].bytes);
        self.collective(kind, CommKind::P2p { from, to }, self.dtype, region, region)
    }
}
