//! Pipeline stages (parallel spec §2): each stage's slots in the order its actions run, and the
//! point-to-point transfers between stages, inferred from the orders.
//!
//! Stage by stage (each stage's slots are consecutive; a stage's ranks run only its ops), every
//! action of the stage's order becomes slots:
//! - `F` of micro-batch `i` on chunk `c`: a forward slot per layer of the chunk, with the gather
//!   units the layer needs, and on the last chunk the loss;
//! - `B`: a backward slot per layer, in reverse, with the per-micro-batch gradient reductions;
//!   `I` and `W` split it: `I` the input-gradient halves (and their stashes), `W` the weight
//!   halves followed by the reductions. After the chunk's last `B` or `W` in the order come the
//!   boundary synchronisation, the update and the refresh of its layers (gradients accumulate
//!   over the stage's micro-batches as over micro-steps without a pipeline).
//!
//! Hidden states cross a chunk boundary between stages as point-to-point transfers: an `F` sends
//! its output to the stage of the next chunk, a `B` or `I` its input gradient to the stage of the
//! previous one, each from the sender's buffer into the receiver's own buffer of that boundary,
//! on one communicator per boundary and direction. Chunks that follow each other on one stage
//! (the V of `zbv`) share the boundary's buffer and need no transfer. [`transfer_plans`] decides
//! where each stage issues its transfers and which go together in one group call: in rounds
//! after each action (Megatron's pairing, which torch had to adopt to stop 1F1B from hanging),
//! or in the time order of a unit-time run of the whole pipeline (`zbv`, custom orders). The
//! verifier proves the result free of deadlock with every send and receive blocking.
//!
//! Gradient accumulation runs over a stage's micro-batches in its order's backward order, so the
//! update waits for the last of them.
//!
//! A tied head that keeps a replica of its embedding (`Job::tied_replica`: on another stage, or
//! in another chunk of the same stage with sharded parameters or gradients) has it as the layer
//! index past the model's, listed right before the head in its chunk's buckets, so the replica is
//! gathered, reduced and updated with the head. A stage that clips, or holds either copy, keeps
//! its updates to its end, after its last transfer ([`Builder::finish_stage`]): the two copies'
//! gradients are summed there (the embedding group), and clipping's norm is summed over every
//! stage. Consecutive actions of one chunk share the gather bucket at their boundary
//! (`super::step::Held`).

use super::comms::CommKind;
use super::step::{Buckets, Half, Held, MicroStepSlots};
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
        let plans = transfer_plans(&pipeline);
        let mut slots: Vec<Slot> = vec![];
        for stage in 0..pipeline.stages {
            self.stage = stage;
            let start = slots.len();
            self.stage_slots(&pipeline, stage, &plans[stage as usize], &mut slots);
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

    /// Stage `stage`'s slots, in the order of its actions, with its transfers where `plan`
    /// issues them.
    fn stage_slots(
        &mut self,
        pipeline: &Pipeline,
        stage: u32,
        plan: &[TransferGroup],
        slots: &mut Vec<Slot>,
    ) {
        // Slots per layer index, the replica's included.
        let n = self.layers.len();
        let order = &pipeline.order[stage as usize];
        let last_chunk = pipeline.chunks.len() as u32 - 1;
        // Each local chunk's buckets, and the index of its last backward in the order.
        let buckets: Vec<Buckets> = (0..pipeline.virtual_stages)
            .map(|local| {
                let layers = pipeline.layers_of_chunk(pipeline.chunk_of(stage, local));
                self.buckets(&self.with_replica(layers))
            })
            .collect();
        let mut last_backward: FxHashMap<u32, usize> = FxHashMap::default();
        for (k, a) in order.iter().enumerate() {
            if matches!(a.kind, ActionKind::B | ActionKind::W) {
                last_backward.insert(a.chunk, k);
            }
        }
        let mut at: FxHashMap<(u32, u32), MicroStepSlots> = FxHashMap::default();
        let mut gathered: FxHashMap<(u32, u32), FxHashMap<usize, BufferId>> = FxHashMap::default();
        // Each action's first and last slot.
        let (mut firsts, mut ends) = (vec![], vec![]);
        self.held = Some(Held::default());
        for (k, a) in order.iter().enumerate() {
            let same_chunk = k > 0 && order[k - 1].chunk == a.chunk;
            if let Some(held) = self.held.as_mut() {
                held.next_action(same_chunk);
            }
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
                    let mut here = MicroStepSlots {
                        first,
                        forward,
                        loss: first + layers.len(),
                        backward: vec![0; n],
                    };
                    self.replica_slots(&layers, &mut here);
                    let b = &buckets[a.chunk as usize];
                    let full = self.forward_slots(m, b, &here, slots, layers);
                    if last {
                        let loss = self.loss(m);
                        slots[here.loss].compute.push(loss);
                    }
                    at.insert((a.chunk, m), here);
                    gathered.insert((a.chunk, m), full);
                }
                ActionKind::B | ActionKind::I | ActionKind::W => {
                    // I runs the layers that have an input half (not a first embedding); B and
                    // W all of them, in reverse.
                    let part: Range<usize> = match a.kind {
                        ActionKind::I => {
                            let start = (layers.start..layers.end)
                                .find(|&l| self.has_input_half(l))
                                .unwrap_or(layers.end);
                            start..layers.end
                        }
                        _ => layers.clone(),
                    };
                    slots.extend(part.clone().map(|_| Slot::default()));
                    let key = (a.chunk, m);
                    let mut here = match a.kind {
                        ActionKind::I => at.get(&key).map(MicroStepSlots::clone_slots),
                        _ => at.remove(&key),
                    }
                    .expect("the order is well formed: every B or I follows its F, every W its I");
                    for (i, l) in part.clone().rev().enumerate() {
                        here.backward[l] = first + i;
                    }
                    self.replica_slots(&part, &mut here);
                    let full = match a.kind {
                        ActionKind::I => gathered.get(&key).cloned().unwrap_or_default(),
                        _ => gathered.remove(&key).unwrap_or_default(),
                    };
                    let half = match a.kind {
                        ActionKind::B => Half::Whole,
                        ActionKind::I => Half::Input,
                        _ => Half::Weight,
                    };
                    let b = &buckets[a.chunk as usize];
                    self.backward_slots(m, b, &here, &full, slots, (part, half));
                    if half != Half::Input && last_backward.get(&a.chunk) == Some(&k) {
                        self.after_last_backward(b, &here, slots, layers);
                    }
                    if half == Half::Input {
                        at.insert(key, here);
                    }
                }
            }
            ends.push(slots.len() - 1);
            firsts.push(first);
        }
        // The transfers, each group before the action it precedes (after the one before it).
        for group in plan {
            let transfers: Vec<CollectiveOp> = group
                .transfers
                .iter()
                .filter_map(|&(k, send)| {
                    let a = &order[k];
                    match send {
                        true => self.transfer_out(pipeline, stage, a),
                        false => self.transfer_in(pipeline, stage, a),
                    }
                })
                .collect();
            let micro = group.transfers.first().map(|&(k, _)| order[k].micro);
            let Some(op) = self.issue(transfers, OpRole::P2p, None, micro) else {
                continue;
            };
            match group.before {
                0 => slots[firsts[0]].compute.insert(0, op),
                k => slots[ends[k - 1]].after.push(op),
            }
        }
        self.held = None;
        // After the stage's last transfer: what waits for other stages at the end of the step.
        let ops = self.finish_stage();
        if let Some(&end) = ends.last() {
            slots[end].after.extend(ops);
        }
    }

    /// A chunk's layer indices in order, with the embedding's replica right before the tied head
    /// when the head keeps one: the replica is gathered, reduced and updated with the head.
    fn with_replica(&self, layers: Range<usize>) -> Vec<usize> {
        let mut out = vec![];
        for l in layers {
            if self.replica.is_some_and(|(h, _)| h == l) {
                out.extend(self.replica_index());
            }
            out.push(l);
        }
        out
    }

    /// The replica's slots are its tied head's (when `layers` hold the head).
    fn replica_slots(&self, layers: &Range<usize>, at: &mut MicroStepSlots) {
        if let (Some((h, _)), Some(r)) = (self.replica, self.replica_index()) {
            if layers.contains(&h) {
                at.forward[r] = at.forward[h];
                at.backward[r] = at.backward[h];
            }
        }
    }

    /// The send of what action `a` of `stage` produces for another stage, if any: an `F`'s
    /// output to the next chunk's stage, a `B`'s input gradient to the previous chunk's.
    fn transfer_out(
        &mut self,
        pipeline: &Pipeline,
        stage: u32,
        a: &Action,
    ) -> Option<CollectiveOp> {
        let (to, grad, boundary) = send_of(pipeline, stage, a)?;
        Some(self.point_to_point(Collective::Send, stage, to, grad, a.micro, boundary))
    }

    /// The receive action `a` of `stage` needs from another stage before it runs, if any: an
    /// `F`'s input from the previous chunk's stage, a `B`'s output gradient from the next one's.
    fn transfer_in(&mut self, pipeline: &Pipeline, stage: u32, a: &Action) -> Option<CollectiveOp> {
        let (from, grad, boundary) = recv_of(pipeline, stage, a)?;
        Some(self.point_to_point(Collective::Recv, from, stage, grad, a.micro, boundary))
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
        let comm = CommKind::P2p {
            from,
            to,
            boundary: boundary as u32,
            grad,
        };
        self.collective(kind, comm, self.dtype, region, region)
    }
}

/// The send action `a` of `stage` makes, if any: (to stage, gradient?, boundary layer). An
/// `F`'s output goes to the next chunk's stage, a `B`'s or `I`'s input gradient to the previous
/// chunk's.
fn send_of(pipeline: &Pipeline, stage: u32, a: &Action) -> Option<(u32, bool, usize)> {
    let chunk = pipeline.chunk_of(stage, a.chunk);
    let layers = pipeline.layers_of_chunk(chunk);
    let (peer, grad, boundary) = match a.kind {
        ActionKind::F => (chunk + 1, false, layers.end),
        ActionKind::B | ActionKind::I => (chunk.checked_sub(1)?, true, layers.start),
        ActionKind::W => return None,
    };
    Some((peer_stage(pipeline, stage, peer)?, grad, boundary))
}

/// The receive action `a` of `stage` needs before it runs, if any: (from stage, gradient?,
/// boundary layer).
fn recv_of(pipeline: &Pipeline, stage: u32, a: &Action) -> Option<(u32, bool, usize)> {
    let chunk = pipeline.chunk_of(stage, a.chunk);
    let layers: Range<usize> = pipeline.layers_of_chunk(chunk);
    let (peer, grad, boundary) = match a.kind {
        ActionKind::F => (chunk.checked_sub(1)?, false, layers.start),
        ActionKind::B | ActionKind::I => (chunk + 1, true, layers.end),
        ActionKind::W => return None,
    };
    Some((peer_stage(pipeline, stage, peer)?, grad, boundary))
}

/// The stage of chunk `peer`, when it exists and is not `stage` itself.
fn peer_stage(pipeline: &Pipeline, stage: u32, peer: u32) -> Option<u32> {
    if peer as usize >= pipeline.chunks.len() {
        return None;
    }
    let to = pipeline.stage_of_chunk(peer);
    (to != stage).then_some(to)
}

/// One group call of a stage's transfers, issued before action `before` of its order (after
/// the action before it): each (action index, whether it is that action's send, else the
/// receive it needs).
pub(super) struct TransferGroup {
    before: usize,
    transfers: Vec<(usize, bool)>,
}

/// Where every stage issues its transfers. Built-in schedules but `zbv` pair them in rounds
/// ([`rounds`]); `zbv` and custom orders issue them in the time order of a unit-time run of the
/// whole pipeline ([`timed_plans`]), or, when the orders cannot run even then (a custom order
/// whose stages wait on each other), in rounds, for the verifier to name the cycle.
fn transfer_plans(pipeline: &Pipeline) -> Vec<Vec<TransferGroup>> {
    let timed = matches!(
        pipeline.schedule,
        PipelineSchedule::Zbv | PipelineSchedule::Custom
    );
    if timed {
        if let Some(plans) = timed_plans(pipeline) {
            return plans;
        }
    }
    (0..pipeline.stages)
        .map(|stage| round_plan(pipeline, stage))
        .collect()
}

/// After each round, its sends and the next round's receives; the first round's receives
/// before it.
fn round_plan(pipeline: &Pipeline, stage: u32) -> Vec<TransferGroup> {
    let order = &pipeline.order[stage as usize];
    let rounds = rounds(pipeline, stage, order);
    let mut out = vec![];
    if let Some(first) = rounds.first() {
        out.push(TransferGroup {
            before: 0,
            transfers: first.clone().map(|k| (k, false)).collect(),
        });
    }
    for (r, round) in rounds.iter().enumerate() {
        let mut transfers: Vec<(usize, bool)> = round.clone().map(|k| (k, true)).collect();
        if let Some(next) = rounds.get(r + 1) {
            transfers.extend(next.clone().map(|k| (k, false)));
        }
        out.push(TransferGroup {
            before: round.end,
            transfers,
        });
    }
    out
}

/// The transfers of every stage in the time order of one run of the whole pipeline with unit
/// times (F, I, W one tick, B two): a transfer happens when its producing action ends, on both
/// ends at once, and each stage issues its transfers of one time as one group call, after the
/// actions that started before that time. Both ends of every transfer then reach it at the same
/// point of one global order, so no two stages can wait on each other (the verifier proves it
/// of the program). `None` when the orders cannot all run (a dependency cycle).
fn timed_plans(pipeline: &Pipeline) -> Option<Vec<Vec<TransferGroup>>> {
    let p = pipeline.stages as usize;
    let orders = &pipeline.order;
    let last = pipeline.chunks.len() as u32 - 1;
    // End time of each (kind class, chunk, micro-batch): F, or the backward (B or I).
    let mut ends: FxHashMap<(bool, u32, u32), u32> = FxHashMap::default();
    let mut start: Vec<Vec<u32>> = orders.iter().map(|o| vec![0; o.len()]).collect();
    let mut end: Vec<Vec<u32>> = start.clone();
    let (mut next, mut free) = (vec![0usize; p], vec![0u32; p]);
    loop {
        let mut progress = false;
        for s in 0..p {
            while let Some(a) = orders[s].get(next[s]) {
                let chunk = pipeline.chunk_of(s as u32, a.chunk);
                let dep = match a.kind {
                    ActionKind::F if chunk > 0 => Some((false, chunk - 1)),
                    ActionKind::B | ActionKind::I if chunk < last => Some((true, chunk + 1)),
                    ActionKind::B | ActionKind::I => Some((false, chunk)),
                    _ => None,
                };
                let ready = match dep {
                    None => 0,
                    Some((backward, c)) => match ends.get(&(backward, c, a.micro)) {
                        Some(&t) => t,
                        None => break,
                    },
                };
                let k = next[s];
                let t0 = free[s].max(ready);
                let t1 = t0 + if a.kind == ActionKind::B { 2 } else { 1 };
                (start[s][k], end[s][k]) = (t0, t1);
                free[s] = t1;
                match a.kind {
                    ActionKind::F => {
                        ends.insert((false, chunk, a.micro), t1);
                    }
                    ActionKind::B | ActionKind::I => {
                        ends.insert((true, chunk, a.micro), t1);
                    }
                    ActionKind::W => {}
                }
                next[s] += 1;
                progress = true;
            }
        }
        if !progress {
            break;
        }
    }
    if (0..p).any(|s| next[s] < orders[s].len()) {
        return None;
    }
    // Each stage's transfers by time: a send when its action ends, a receive when the action
    // producing it (on the peer) ends.
    let mut at: Vec<std::collections::BTreeMap<u32, Vec<(usize, bool)>>> =
        vec![Default::default(); p];
    for s in 0..p {
        for (k, a) in orders[s].iter().enumerate() {
            if send_of(pipeline, s as u32, a).is_some() {
                at[s].entry(end[s][k]).or_default().push((k, true));
            }
            if recv_of(pipeline, s as u32, a).is_some() {
                let chunk = pipeline.chunk_of(s as u32, a.chunk);
                let producer = match a.kind {
                    ActionKind::F => (false, chunk - 1),
                    _ => (true, chunk + 1),
                };
                let t = *ends.get(&(producer.0, producer.1, a.micro))?;
                at[s].entry(t).or_default().push((k, false));
            }
        }
    }
    Some(
        (0..p)
            .map(|s| {
                at[s]
                    .iter()
                    .map(|(&t, transfers)| {
                        let mut transfers = transfers.clone();
                        transfers.sort_unstable();
                        TransferGroup {
                            before: start[s].iter().filter(|&&t0| t0 < t).count(),
                            transfers,
                        }
                    })
                    .collect()
            })
            .collect(),
    )
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
