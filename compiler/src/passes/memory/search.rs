//! Which placement [`super::run`] keeps: several greedy placements ([`super::place`]), then a
//! budget of improvements; the lowest arena top wins (ties: the first found), so the result is
//! deterministic.
//!
//! Candidates, each with first-fit and best-fit gaps:
//! - single buffers largest first, largest size × lifetime first, and in order of first access;
//! - slots (see [`super::place::slots`]) for the buffers of the largest size, of every size at
//!   least a quarter of it, and of every size, largest first: the families of equal-size gathered
//!   parameters and full gradients then take as many offsets as they have members in use at once
//!   (their interference is a co-comparability graph, where this greedy is near optimal), and the
//!   smaller buffers fill around them.
//!
//! Then, within a budget of placements that shrinks as the program grows (each costs about one
//! greedy pass), a two-ended fit and a repair loop on the best candidate's units.

use super::place::{place, slots, Fit, Units};
use super::{Lifetimes, ALIGN};
use crate::ir::*;
use cranelift_entity::EntityRef;
use std::cmp::Reverse;

/// Buffer-placements the improvement steps may spend, divided by the number of transient buffers.
const IMPROVE_WORK: usize = 60_000;

/// Offsets (indexed by buffer id) and the arena top of the best placement found for `transient`
/// (sorted by first access) above `base`.
pub(super) fn plan(
    p: &Program,
    life: &Lifetimes,
    span: &[(usize, usize)],
    transient: &[BufferId],
    base: u64,
) -> (Vec<u64>, u64) {
    let align = |x: u64| x.div_ceil(ALIGN) * ALIGN;
    let bytes = |b: BufferId| p.buffers[b].bytes;
    // Units: every buffer alone (index = position in `transient`), then the slots of each size
    // class (classes listed largest first).
    let mut units: Units = transient.iter().map(|&b| vec![b]).collect();
    let mut classes: Vec<(u64, Vec<BufferId>)> = vec![];
    {
        let mut by_size: Vec<BufferId> = transient.to_vec();
        by_size.sort_by_key(|&b| Reverse(bytes(b))); // stable: first access within a size
        for b in by_size {
            match classes.last_mut() {
                Some((s, members)) if *s == bytes(b) => members.push(b),
                _ => classes.push((bytes(b), vec![b])),
            }
        }
    }
    let mut class_units: Vec<Option<std::ops::Range<usize>>> = vec![];
    for (_, members) in &classes {
        class_units.push(
            (members.len() > 1)
                .then(|| slots(life, span, members))
                .flatten()
                .map(|s| {
                    let from = units.len();
                    units.extend(s);
                    from..units.len()
                }),
        );
    }
    let position: std::collections::HashMap<BufferId, usize> =
        transient.iter().enumerate().map(|(i, &b)| (b, i)).collect();
    let first_span = |u: usize| span[units[u][0].index()].0;
    let unit_bytes = |u: usize| bytes(units[u][0]);
    // An order of units, largest first then by first access, with the classes whose index
    // satisfies `slotted` as slots and the rest as single buffers.
    let by_size = |slotted: &dyn Fn(usize) -> bool| -> Vec<usize> {
        let mut order: Vec<usize> = vec![];
        for (c, (_, members)) in classes.iter().enumerate() {
            match &class_units[c] {
                Some(r) if slotted(c) => order.extend(r.clone()),
                _ => order.extend(members.iter().map(|b| position[b])),
            }
        }
        order.sort_by_key(|&u| (Reverse(unit_bytes(u)), first_span(u), units[u][0]));
        order
    };
    let singles = by_size(&|_| false);
    let mut area: Vec<usize> = (0..transient.len()).collect();
    area.sort_by_key(|&u| {
        let (s0, s1) = span[units[u][0].index()];
        (
            Reverse(u128::from(unit_bytes(u)) * (s1 - s0) as u128),
            units[u][0],
        )
    });
    let first_access: Vec<usize> = (0..transient.len()).collect();
    let largest = classes.first().map_or(0, |c| c.0);
    let mut orders = vec![singles, area, first_access];
    for slotted in [
        &(|c: usize| c == 0) as &dyn Fn(usize) -> bool,
        &|c: usize| classes[c].0 >= largest / 4,
        &|_| true,
    ] {
        if (0..classes.len()).any(|c| slotted(c) && class_units[c].is_some()) {
            let order = by_size(slotted);
            if !orders.contains(&order) {
                orders.push(order);
            }
        }
    }
    let place = |order: &[usize], fit: Fit| place(p, life, span, &units, order, base, fit);
    let mut best = orders
        .iter()
        .flat_map(|order| [Fit::First, Fit::Best].map(|fit| (place(order, fit), order, fit)))
        .min_by_key(|((_, top), _, _)| *top)
        .map(|(placed, order, fit)| (placed, order.clone(), fit))
        .expect("at least six placements");
    let mut budget = (IMPROVE_WORK / transient.len().max(1)).min(64);
    // 1. Two-ended: the best order's largest units as they come, every smaller one in the highest
    //    gap below a target top, so that long-lived stacks of small buffers (hidden states,
    //    activations) sit on one side and the large working set on the other; the target is found
    //    by bisection, for each of the three largest sizes as the split.
    let mut two_ended = best.1.clone();
    two_ended.sort_by_key(|&u| (Reverse(unit_bytes(u)), first_span(u), units[u][0]));
    for &(split, _) in classes.iter().take(3) {
        let (mut lo, mut hi) = (base, best.0 .1);
        for _ in 0..8 {
            if budget == 0 || hi - lo <= ALIGN {
                break;
            }
            budget -= 1;
            let target = lo + (hi - lo) / 2;
            let r = place(&two_ended, Fit::TwoEnded { split, target });
            if r.1 <= target {
                hi = target;
            } else {
                lo = target;
            }
            if r.1 < best.0 .1 {
                best = (r, two_ended.clone(), Fit::TwoEnded { split, target });
            }
        }
    }
    // 2. Repair ("squeaky wheel"): the units that reach the top of the best placement go first
    //    in its order, and it is placed again; kept when lower.
    let (mut order, mut placed) = (best.1.clone(), best.0.clone());
    while budget > 0 {
        budget -= 1;
        let top = placed.1;
        let (mut front, rest): (Vec<usize>, Vec<usize>) = order
            .iter()
            .partition(|&&u| align(placed.0[units[u][0].index()] + unit_bytes(u)) >= top);
        if rest.is_empty() {
            break;
        }
        front.extend(rest);
        order = front;
        placed = place(&order, best.2);
        if placed.1 < best.0 .1 {
            best = (placed.clone(), order.clone(), best.2);
        }
    }
    best.0
}
