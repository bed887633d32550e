//! Prefetch: the issue order of the step, decided at compile time (lowering spec §5).
//!
//! Reads the draft's slots; writes the final program with ops renumbered in issue order, and the
//! fences (waiter, waited) that the events pass must honour. Rules:
//! - A gather unit whose consumer is slot `c` is issued before slot `max(earliest, c − depth)`
//!   (depth = `prefetch.forward` or `prefetch.backward`), in consumer order: a unit that cannot be
//!   issued yet holds back the ones after it.
//! - **Flow control.** The host enqueues ahead of the device, so a stream that never waits could
//!   run arbitrarily far ahead and no buffer it writes could ever reuse memory. A gather unit
//!   issued before slot `s` therefore waits for the compute of slot `s − 1`, and each backward
//!   waits for the gradient reduction issued two reductions earlier (at most two in flight, as
//!   double-buffered reduce buckets do).
//! - **`max_live`.** Gathered bytes alive (issued and not yet past their last reader) plus bytes
//!   released but not yet fenced never exceed the cap: a unit that would exceed it waits (in issue
//!   order) until enough is released, and then fences on the compute that released it. A unit its
//!   own slot needs that still cannot fit makes the schedule infeasible: an error naming the slot.
//!
//! With pipeline stages, each stage's slots are consecutive and the rules apply to each stage on
//! its own: the live bytes, releases, reductions and fences never reach into another stage.

use crate::draft::{Draft, Slot, Unit};
use cranelift_entity::EntityRef;
use sched_ir::ir::*;
use std::collections::VecDeque;

/// A `prefetch.max_live` cap the schedule cannot meet: the slot and the bytes that do not fit.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "max_live = {cap} bytes cannot be met: before {kind} {layer} (micro-step {micro_step}), \
     {in_use} bytes of gathered parameters are still needed and {more} more must be gathered"
)]
pub struct MaxLiveError {
    pub cap: u64,
    /// The compute op of the slot that cannot start: its kind and layer.
    pub kind: &'static str,
    pub layer: String,
    pub micro_step: u32,
    /// Gathered bytes still needed when the slot's own parameters must be gathered.
    pub in_use: u64,
    /// The slot's own gathered bytes.
    pub more: u64,
}

/// Fixes the issue order and returns the renumbered program with its fences.
pub fn run(draft: Draft) -> Result<(Program, Vec<(OpId, OpId)>), MaxLiveError> {
    let Draft {
        program,
        slots,
        max_live,
        ..
    } = draft;
    let cap = max_live.unwrap_or(u64::MAX);
    let mut units: Vec<(usize, usize, &Unit)> = vec![]; // (issue slot wanted, seq, unit)
    for slot in &slots {
        for u in &slot.units {
            let wanted = u
                .consumer
                .saturating_sub(u.depth)
                .max(u.earliest)
                .min(u.consumer);
            units.push((wanted, units.len(), u));
        }
    }
    units.sort_by_key(|&(_, seq, u)| (u.consumer, seq));
    let mut queue: VecDeque<(usize, &Unit)> = units.iter().map(|&(w, _, u)| (w, u)).collect();

    let mut order: Vec<OpId> = Vec::with_capacity(program.ops.len());
    let mut fences: Vec<(OpId, OpId)> = vec![];
    let mut live: Vec<(usize, u64)> = vec![]; // (last consumer slot, bytes) of issued units
    let mut released: VecDeque<(OpId, u64)> = VecDeque::new(); // (releasing compute op, bytes)
    let mut reductions: Vec<OpId> = vec![];
    let last_compute = |s: usize| slots[s].compute.last().copied();

    for (pos, slot) in slots.iter().enumerate() {
        let same_stage_before = pos > 0 && slots[pos - 1].stage == slot.stage;
        if !same_stage_before {
            live.clear();
            released.clear();
            reductions.clear();
        }
        // Release units whose last reader ran in an earlier slot.
        live.retain(|&(last, bytes)| {
            if last < pos {
                if let Some(op) = last_compute(last) {
                    released.push_back((op, bytes));
                }
                false
            } else {
                true
            }
        });
        while let Some(&(wanted, u)) = queue.front() {
            if wanted > pos {
                break;
            }
            let in_use: u64 = live.iter().map(|l| l.1).sum();
            if in_use.saturating_add(u.gathered_bytes) > cap {
                if u.consumer == pos {
                    return Err(MaxLiveError {
                        cap,
                        kind: program.ops[slot.compute[0]].kind_name(),
                        layer: slot_layer_name(&program, slot),
                        micro_step: program.ops[slot.compute[0]].micro_step.unwrap_or(0),
                        in_use,
                        more: u.gathered_bytes,
                    });
                }
                break;
            }
            queue.pop_front();
            let first = u.ops[0];
            // Reuse released memory only after its reader finished: fence oldest first.
            let mut unfenced: u64 = released.iter().map(|r| r.1).sum();
            while cap != u64::MAX && in_use + unfenced + u.gathered_bytes > cap {
                let (op, bytes) = released.pop_front().expect("unfenced bytes exist");
                fences.push((first, op));
                unfenced -= bytes;
            }
            if let Some(prev) = pos
                .checked_sub(1)
                .filter(|_| same_stage_before)
                .and_then(last_compute)
            {
                fences.push((first, prev));
            }
            live.push((u.last_consumer, u.gathered_bytes));
            order.extend(&u.ops);
        }
        for &op in &slot.compute {
            let produces_grads = matches!(
                program.ops[op].kind,
                OpKind::Compute(ComputeKind::Backward | ComputeKind::BackwardWeight)
            );
            if produces_grads && reductions.len() >= 2 {
                fences.push((op, reductions[reductions.len() - 2]));
            }
            order.push(op);
        }
        for &op in &slot.after {
            if program.ops[op].role == OpRole::Reduce && !program.ops[op].collectives().is_empty() {
                reductions.push(op);
            }
            order.push(op);
        }
    }
    debug_assert!(
        queue.is_empty(),
        "every unit is issued by its consumer's slot"
    );
    Ok(renumber(program, order, fences))
}

fn slot_layer_name(p: &Program, slot: &Slot) -> String {
    p.ops[slot.compute[0]]
        .layer
        .map_or_else(|| "the loss".to_string(), |l| p.layers[l].name.clone())
}

/// Rebuilds the op table so that op ids follow the issue order.
fn renumber(
    mut program: Program,
    order: Vec<OpId>,
    fences: Vec<(OpId, OpId)>,
) -> (Program, Vec<(OpId, OpId)>) {
    assert_eq!(
        order.len(),
        program.ops.len(),
        "every op is issued exactly once"
    );
    let mut new_id: Vec<Option<OpId>> = vec![None; order.len()];
    for (k, &o) in order.iter().enumerate() {
        let first = new_id[o.index()].replace(OpId::new(k)).is_none();
        assert!(first, "{o} is issued once");
    }
    // Move each op to its place in the issue order, in place: along each cycle of the
    // permutation, every swap settles one op (no clones, no second table).
    let ops = program.ops.values_mut().into_slice();
    let mut settled = vec![false; ops.len()];
    for start in 0..ops.len() {
        let mut at = start;
        while !settled[at] {
            settled[at] = true;
            let from = order[at].index();
            if from == start {
                break;
            }
            ops.swap(at, from);
            at = from;
        }
    }
    let new = |o: OpId| new_id[o.index()].expect("every op is issued");
    let fences = fences.into_iter().map(|(a, b)| (new(a), new(b))).collect();
    (program, fences)
}
