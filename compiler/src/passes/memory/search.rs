//! Which placement [`super::run`] keeps: several greedy placements ([`super::place`]), then a
//! budget of improvements; the lowest arena top wins (ties: the first found), so the result is
//! deterministic.
//!
//! Candidates:
//! - single buffers largest first and largest size × lifetime first, first fit; in programs of
//!   up to [`SMALL_PROGRAM`] transient buffers also in order of first access, and all three
//!   with best-fit gaps too;
//! - largest first with slots (see [`super::place::slots`]) for the largest size, for the
//!   families (sizes shared by buffers of [`FAMILY_LAYERS`] layers or more) of at least a quarter
//!   of it, and for every size, first fit. A family of equal-size gathered
//!   parameters or full gradients then keeps to about as many offsets as it has members in use
//!   at once (exactly that many for the largest family of the examples checked; one size's
//!   interference graph is a co-comparability graph, whose chromatic number is its clique
//!   number, while first fit by size alone spread it wider), and smaller buffers fill around;
//! - greedy by breadth (the "greedy by breadth" of Lee et al., *On-Device Neural Net Inference
//!   with Mobile GPUs*, 2019, as in TensorFlow Lite's planner), single buffers and with slots for
//!   the families, first fit: the buffers in use at the op with the most bytes in use go first,
//!   largest first, then the new ones of the next heaviest op, and so on. The heaviest op's
//!   buffers then lie packed from the base, which is where the lower bound is usually taken, and
//!   the rest fit around them. Where a long-lived buffer (a gradient waiting on its reduction)
//!   overlaps the whole working set of a few layers, largest-first leaves it no room below the
//!   families and it pushes the stack of hidden states up; this order places it with the heavy
//!   op's set, in room that set leaves (LLaMA-13B hpZ and HSDP-flat examples: 1.05–1.07 before,
//!   1.00–1.014 with it).
//!
//! Then, in programs of up to [`SMALL_PROGRAM`] transient buffers, within a budget of placements
//! that shrinks as the program grows (each costs about one greedy pass), a two-ended fit and a
//! repair loop.

use super::place::{place, place_below, slots, Conflicts, Fit, Units};
use super::{Lifetimes, ALIGN};
use crate::passes::hb::Clocks;
use cranelift_entity::EntityRef;
use sched_ir::ir::*;
use std::cmp::Reverse;

/// Buffer-placements the improvement steps may spend, divided by the number of transient buffers.
const IMPROVE_WORK: usize = 60_000;

/// Distinct layers a size class's buffers must belong to for it to be placed as slots: a family
/// repeated layer after layer (gathered parameters, full gradients, saved activations), not a few
/// unrelated buffers that happen to share a size (embedding and head).
const FAMILY_LAYERS: usize = 4;

/// Most transient buffers a program may have for the first-access order and the best-fit gaps to
/// be tried (in larger programs they never placed lowest, and each try costs a full pass).
const SMALL_PROGRAM: usize = 2_000;

/// Most improvement placements for any program.
const MAX_IMPROVE: usize = 128;

/// Bisection steps of the two-ended fit's target, per split and units.
const BISECTIONS: usize = 6;

/// Offsets (indexed by buffer id) and the arena top of the best placement found for `transient`
/// (sorted by first access) above `base`.
pub(super) fn plan(
    p: &Program,
    clocks: &Clocks,
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
        by_size.sort_by_cached_key(|&b| Reverse(bytes(b))); // stable: first access within a size
        for b in by_size {
            match classes.last_mut() {
                Some((s, members)) if *s == bytes(b) => members.push(b),
                _ => classes.push((bytes(b), vec![b])),
            }
        }
    }
    let mut class_units: Vec<Option<std::ops::Range<usize>>> = vec![];
    let mut family: Vec<bool> = vec![];
    for (_, members) in &classes {
        let mut layers: Vec<LayerId> = members.iter().filter_map(|&b| p.buffers[b].layer).collect();
        layers.sort_unstable();
        layers.dedup();
        family.push(layers.len() >= FAMILY_LAYERS);
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
    let first_span = |u: usize| span[units[u][0].index()].0;
    let unit_bytes = |u: usize| bytes(units[u][0]);
    // Each buffer's unit (indexed by buffer id) with the classes whose index satisfies `slotted`
    // as slots and the rest as single buffers.
    let unit_of = |slotted: &dyn Fn(usize) -> bool| -> Vec<usize> {
        let mut of = vec![usize::MAX; p.buffers.len()];
        for (i, &b) in transient.iter().enumerate() {
            of[b.index()] = i;
        }
        for (c, r) in class_units.iter().enumerate() {
            for u in r.clone().filter(|_| slotted(c)).into_iter().flatten() {
                for &b in &units[u] {
                    of[b.index()] = u;
                }
            }
        }
        of
    };
    // Each unit's place in a largest-first order: (bytes reversed, first access, first member),
    // distinct for the units of one order (they partition the transient buffers).
    let size_key: Vec<(Reverse<u64>, usize, BufferId)> = (0..units.len())
        .map(|u| (Reverse(unit_bytes(u)), first_span(u), units[u][0]))
        .collect();
    // An order of those units, largest first then by first access.
    let by_size = |slotted: &dyn Fn(usize) -> bool| -> Vec<usize> {
        let of = unit_of(slotted);
        let mut listed = vec![false; units.len()];
        let mut order: Vec<usize> = transient
            .iter()
            .map(|b| of[b.index()])
            .filter(|&u| !std::mem::replace(&mut listed[u], true))
            .collect();
        order.sort_unstable_by_key(|&u| size_key[u]);
        order
    };
    let singles = by_size(&|_| false);
    let mut area: Vec<usize> = (0..transient.len()).collect();
    area.sort_by_cached_key(|&u| {
        let (s0, s1) = span[units[u][0].index()];
        (
            Reverse(u128::from(unit_bytes(u)) * (s1 - s0) as u128),
            units[u][0],
        )
    });
    let mut orders = vec![singles, area];
    let small = transient.len() <= SMALL_PROGRAM;
    if small {
        orders.push((0..transient.len()).collect());
    }
    let single_orders = orders.len();
    let largest = classes.first().map_or(0, |c| c.0);
    for slotted in [
        &(|c: usize| c == 0) as &dyn Fn(usize) -> bool,
        &|c: usize| family[c] && classes[c].0 >= largest / 4,
        &|_| true,
    ] {
        if (0..classes.len()).any(|c| slotted(c) && class_units[c].is_some()) {
            let order = by_size(slotted);
            if !orders.contains(&order) {
                orders.push(order);
            }
        }
    }
    // Greedy by breadth, with single buffers and with slots for the families.
    let heaviest_first = live_sets_by_weight(p, clocks, life, transient, span);
    for slotted in [
        &(|_: usize| false) as &dyn Fn(usize) -> bool,
        &|c: usize| family[c],
    ] {
        let order = breadth_order(
            p,
            &heaviest_first,
            transient,
            &unit_of(slotted),
            units.len(),
        );
        if !orders.contains(&order) {
            orders.push(order);
        }
    }
    let conflicts = Conflicts::new(p, life, span, transient);
    let place = |order: &[usize], fit: Fit| place(p, &conflicts, &units, order, base, fit);
    // The lowest top wins, ties to the lowest index in `orders`. The first order with slots (the
    // largest size as slots) goes first: it was the lowest, or tied lowest, on every benchmark
    // program, so its top lets the others be abandoned early; each of the others is abandoned as
    // soon as its top shows it cannot win (reaches the best top, or passes it for a candidate
    // listed before the best). Which placement wins does not depend on this order.
    let candidates: Vec<(usize, Fit)> = orders
        .iter()
        .enumerate()
        .flat_map(|(i, _)| {
            // Best fit rarely differs from first fit for slots; the single buffers try both.
            let fits: &[Fit] = if i < single_orders && small {
                &[Fit::First, Fit::Best]
            } else {
                &[Fit::First]
            };
            fits.iter().map(move |&fit| (i, fit))
        })
        .collect();
    let lead = candidates
        .iter()
        .position(|&(i, _)| i == single_orders)
        .unwrap_or(0);
    // (placement, position in `candidates`, index in `orders`, fit) of the best so far.
    type Best = ((Vec<u64>, u64), usize, usize, Fit);
    let mut best: Option<Best> = None;
    for k in std::iter::once(lead).chain((0..candidates.len()).filter(|&k| k != lead)) {
        let (i, fit) = candidates[k];
        let limit = match &best {
            None => u64::MAX,
            Some((placed, rank, _, _)) if k < *rank => placed.1.saturating_add(1),
            Some((placed, _, _, _)) => placed.1,
        };
        if let Some(placed) = place_below(p, &conflicts, &units, &orders[i], base, fit, limit) {
            best = Some((placed, k, i, fit));
        }
    }
    let mut best = best
        .map(|(placed, _, i, fit)| (placed, orders[i].clone(), fit))
        .expect("at least two placements");
    // Programs past SMALL_PROGRAM skip the improvements: none lowered any example's or benchmark
    // program's arena there, and each costs a full pass.
    let mut budget = if small {
        (IMPROVE_WORK / transient.len().max(1)).min(MAX_IMPROVE)
    } else {
        0
    };
    // 1. Two-ended: the largest units first fit, every smaller one in the highest gap below a
    //    target top, so that long-lived stacks of small buffers (hidden states kept for
    //    backward) grow down from the top while the large working set stays low; the target is
    //    found by bisection between the arena's base and the best top. Units: single
    //    buffers, and slots for the sizes placed low. Splits: just above the two size classes
    //    whose buffers live longest on average (the stacks), then the three largest sizes.
    let mut by_life: Vec<usize> = (1..classes.len())
        .filter(|&c| classes[c].1.len() > 1)
        .collect();
    by_life.sort_by_key(|&c| {
        let members = &classes[c].1;
        let life: usize = members
            .iter()
            .map(|b| span[b.index()].1 - span[b.index()].0)
            .sum();
        (Reverse(life / members.len()), c)
    });
    // (split, units): the stack splits with the best candidate's units, with slots for the
    // families placed low, and with single buffers; then the largest sizes.
    let mut best_order = best.1.clone();
    best_order.sort_unstable_by_key(|&u| size_key[u]);
    let mut tries: Vec<(u64, Vec<usize>)> = vec![];
    for (split, units) in by_life
        .iter()
        .take(2)
        .flat_map(|&c| {
            let split = classes[c - 1].0;
            [
                (split, Some(&best_order)),
                (split, None),
                (split, Some(&orders[0])),
            ]
        })
        .chain(
            classes
                .iter()
                .take(3)
                .flat_map(|c| [(c.0, Some(&best_order)), (c.0, Some(&orders[0]))]),
        )
    {
        let order = units
            .cloned()
            .unwrap_or_else(|| by_size(&|c| family[c] && classes[c].0 >= split));
        if !tries.iter().any(|t| t.0 == split && t.1 == order) {
            tries.push((split, order));
        }
    }
    for (split, two_ended) in &tries {
        let (mut lo, mut hi) = (base, best.0 .1);
        for _ in 0..BISECTIONS {
            if budget == 0 || hi - lo <= ALIGN {
                break;
            }
            budget -= 1;
            let target = lo + (hi - lo) / 2;
            let fit = Fit::TwoEnded {
                split: *split,
                target,
            };
            // A placement reaching both the target and the best top moves `lo` and nothing
            // else, whatever its final top: it is abandoned there.
            let cap = best.0 .1.max(target + 1);
            let Some(r) = place_below(p, &conflicts, &units, two_ended, base, fit, cap) else {
                lo = target;
                continue;
            };
            if r.1 <= target {
                hi = target;
            } else {
                lo = target;
            }
            if r.1 < best.0 .1 {
                best = (r, two_ended.clone(), fit);
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

/// Every op's live set (see [`super::bound::for_each_live_set`]) that is not empty, the heaviest
/// first (issue order among equals).
fn live_sets_by_weight(
    p: &Program,
    clocks: &Clocks,
    life: &Lifetimes,
    transient: &[BufferId],
    span: &[(usize, usize)],
) -> LiveSets {
    let mut buffers: Vec<BufferId> = vec![];
    let mut sets: Vec<(u64, std::ops::Range<usize>)> = vec![];
    super::bound::for_each_live_set(p, clocks, life, transient, span, |live| {
        if live.is_empty() {
            return;
        }
        let weight = live.iter().map(|&b| p.buffers[b].bytes).sum();
        sets.push((weight, buffers.len()..buffers.len() + live.len()));
        buffers.extend_from_slice(live);
    });
    // Sets start in issue order, so (weight, start) orders them as a stable sort by weight would.
    sets.sort_unstable_by_key(|(weight, r)| (Reverse(*weight), r.start));
    LiveSets {
        buffers,
        sets: sets.into_iter().map(|(_, r)| r).collect(),
    }
}

/// Live sets in one flat list: each set a range of `buffers`, in the order of `sets`.
struct LiveSets {
    buffers: Vec<BufferId>,
    sets: Vec<std::ops::Range<usize>>,
}

impl LiveSets {
    fn iter(&self) -> impl Iterator<Item = &[BufferId]> {
        self.sets.iter().map(|r| &self.buffers[r.clone()])
    }
}

/// Greedy by breadth: the units (`unit_of`, by buffer id) of the buffers in use at the heaviest
/// op, largest first, then those of the next heaviest op not placed yet, and so on.
fn breadth_order(
    p: &Program,
    heaviest_first: &LiveSets,
    transient: &[BufferId],
    unit_of: &[usize],
    units: usize,
) -> Vec<usize> {
    let mut placed = vec![false; units];
    let mut order = vec![];
    let mut fresh: Vec<BufferId> = vec![];
    // Every buffer is in use at its first access, so `transient` only restates the set.
    for live in heaviest_first.iter().chain([transient]) {
        fresh.clear();
        fresh.extend(live.iter().filter(|b| !placed[unit_of[b.index()]]));
        fresh.sort_unstable_by_key(|&b| (Reverse(p.buffers[b].bytes), b));
        for b in &fresh {
            let u = unit_of[b.index()];
            if !std::mem::replace(&mut placed[u], true) {
                order.push(u);
            }
        }
    }
    order
}
