//! Greedy placement of transient buffers, one unit at a time, in a given order.
//!
//! A unit is one buffer, or a *slot*: a chain of equal-size buffers, each dead before the next
//! (every access of one happens before every access of the next), which take the same offset in
//! turn. Slots come from [`slots`]: the buffers of one size in order of first access, each joining
//! the slot whose last buffer is dead before it and was retired latest. The placer then puts a
//! unit in a gap clear of every placed buffer that any of its members may be in use with, so a
//! placement of units is as sound as one of single buffers; slots keep a family of large buffers
//! (gathered parameters, full gradients) from spreading over more offsets than it has members in
//! use at once, which first fit by size alone does.

use super::{Lifetimes, ALIGN};
use cranelift_entity::EntityRef;
use sched_ir::ir::*;

/// Which gap a unit takes among those clear of the buffers it may be in use with.
#[derive(Clone, Copy, Debug)]
pub(super) enum Fit {
    /// The lowest.
    First,
    /// The smallest that holds it.
    Best,
    /// Units of `split` bytes or more the lowest; smaller ones the highest below `target`
    /// (the lowest above all others when none is).
    TwoEnded { split: u64, target: u64 },
}

/// Units to place: each a list of equal-size buffers that share one offset.
pub(super) type Units = Vec<Vec<BufferId>>;

/// The buffers of `class` (all of one size, in order of first access) as slots: each buffer joins
/// the slot whose last buffer is dead before it and leaves latest (its span ends last), else opens
/// a slot. Past [`MAX_SLOTS`] slots the class is left as single buffers (`None`).
pub(super) fn slots(
    life: &Lifetimes,
    span: &[(usize, usize)],
    class: &[BufferId],
) -> Option<Units> {
    let mut slots: Units = vec![];
    for &b in class {
        let free = (0..slots.len())
            .filter(|&s| life.dead_before(*slots[s].last().expect("never empty"), b))
            .max_by_key(|&s| {
                let a = *slots[s].last().expect("never empty");
                (span[a.index()].1, life.last_index[a.index()])
            });
        match free {
            Some(s) => slots[s].push(b),
            None if slots.len() < MAX_SLOTS => slots.push(vec![b]),
            None => return None,
        }
    }
    Some(slots)
}

/// Most slots one size class may use (bounds [`slots`]'s work at `MAX_SLOTS` checks a buffer).
const MAX_SLOTS: usize = 256;

/// Which transient buffers may be in use together, so may never share bytes: the pairs whose spans
/// overlap and neither of which is dead before the other. Found once, by one sweep over the spans,
/// and read by every placement tried (each of which would otherwise test the same pairs again).
pub(super) struct Conflicts {
    /// Per buffer index, where its list starts in `with`; the entry after the last buffer's ends
    /// it.
    start: Vec<usize>,
    /// Every buffer's conflicting buffers, list after list.
    with: Vec<BufferId>,
}

impl Conflicts {
    /// The conflicts among `transient` (sorted by first access, so by the start of their spans).
    pub(super) fn new(
        p: &Program,
        life: &Lifetimes,
        span: &[(usize, usize)],
        transient: &[BufferId],
    ) -> Self {
        // Each pair is found once, when its later-starting buffer starts: every buffer still
        // active then overlaps it, since spans are never empty.
        let mut pairs: Vec<(BufferId, BufferId)> = vec![];
        let mut active: Vec<BufferId> = vec![];
        for &b in transient {
            let b0 = span[b.index()].0;
            active.retain(|&a| span[a.index()].1 > b0);
            pairs.extend(
                active
                    .iter()
                    .filter(|&&a| !life.dead_before(a, b) && !life.dead_before(b, a))
                    .map(|&a| (a, b)),
            );
            active.push(b);
        }
        let mut start = vec![0; p.buffers.len() + 1];
        for &(a, b) in &pairs {
            start[a.index() + 1] += 1;
            start[b.index() + 1] += 1;
        }
        for i in 1..start.len() {
            start[i] += start[i - 1];
        }
        let mut fill = start.clone();
        let mut with = vec![BufferId::new(0); pairs.len() * 2];
        for &(a, b) in &pairs {
            with[fill[a.index()]] = b;
            fill[a.index()] += 1;
            with[fill[b.index()]] = a;
            fill[b.index()] += 1;
        }
        Conflicts { start, with }
    }

    /// The buffers `b` may be in use together with.
    fn of(&self, b: BufferId) -> &[BufferId] {
        &self.with[self.start[b.index()]..self.start[b.index() + 1]]
    }
}

/// Places `order`'s units one by one in the gap `fit` chooses, clear of the placed buffers any of
/// their members may be in use together with; returns every buffer's offset (indexed by id) and
/// the arena top.
pub(super) fn place(
    p: &Program,
    conflicts: &Conflicts,
    units: &Units,
    order: &[usize],
    base: u64,
    fit: Fit,
) -> (Vec<u64>, u64) {
    place_below(p, conflicts, units, order, base, fit, u64::MAX)
        .expect("no placement reaches u64::MAX")
}

/// [`place`], given up (`None`) as soon as the arena top reaches `cap`: a candidate that cannot
/// come out strictly lower than the best so far needs no finishing.
pub(super) fn place_below(
    p: &Program,
    conflicts: &Conflicts,
    units: &Units,
    order: &[usize],
    base: u64,
    fit: Fit,
    cap: u64,
) -> Option<(Vec<u64>, u64)> {
    let align = |x: u64| x.div_ceil(ALIGN) * ALIGN;
    // Each buffer's unit in `order` (`units.len()`, never placed, for a buffer in none).
    let mut owner = vec![units.len(); p.buffers.len()];
    for &u in order {
        for &b in &units[u] {
            owner[b.index()] = u;
        }
    }
    // Per unit, its bytes once placed and the last step it was found busy at.
    let mut state = vec![UnitState::UNPLACED; units.len() + 1];
    let mut top = base;
    let mut busy: Vec<(u64, u64)> = vec![];
    for (step, &u) in order.iter().enumerate() {
        let unit = &units[u];
        let bytes = p.buffers[unit[0]].bytes;
        // Members of one unit share their bytes, so each busy unit is listed once.
        busy.clear();
        for &b in unit {
            for &a in conflicts.of(b) {
                let other = &mut state[owner[a.index()]];
                if other.start != UNPLACED && other.seen != step {
                    other.seen = step;
                    busy.push((other.start, other.end));
                }
            }
        }
        // By start only: among ranges that start together the scans below take the same gaps
        // whatever their order (the first of them already sees the gap below; the later ones
        // start below the end of the first), and the top is the largest end either way.
        busy.sort_unstable_by_key(|r| r.0);
        let high = match fit {
            Fit::TwoEnded { split, target } if bytes < split => {
                highest_below(&busy, base, bytes, target)
            }
            _ => None,
        };
        let at = high.unwrap_or_else(|| {
            let best_fit = matches!(fit, Fit::Best);
            // The lowest gap that holds the unit, or (best fit) the smallest; above all if none does.
            let mut at = base;
            let mut chosen: Option<(u64, u64)> = None; // (gap size, offset)
            for &(start, end) in &busy {
                if start >= at + bytes && chosen.is_none_or(|(g, _)| best_fit && start - at < g) {
                    chosen = Some((start - at, at));
                    if !best_fit {
                        break; // the lowest gap: nothing after it can change the choice
                    }
                }
                at = at.max(align(end));
            }
            chosen.map_or(at, |(_, o)| o)
        });
        top = top.max(align(at + bytes));
        if top >= cap {
            return None;
        }
        state[u] = UnitState {
            start: at,
            end: at + bytes,
            seen: step,
        };
    }
    let mut offset = vec![0u64; p.buffers.len()];
    for &u in order {
        for &b in &units[u] {
            offset[b.index()] = state[u].start;
        }
    }
    Some((offset, top))
}

/// Where [`place_below`] has put a unit, and the last step it was found busy at.
#[derive(Clone, Copy)]
struct UnitState {
    /// [`UNPLACED`] until placed.
    start: u64,
    end: u64,
    seen: usize,
}

/// The start of a unit not placed yet (no placed unit starts there: its end would pass 2^64).
const UNPLACED: u64 = u64::MAX;

impl UnitState {
    const UNPLACED: UnitState = UnitState {
        start: UNPLACED,
        end: 0,
        seen: usize::MAX,
    };
}

/// The highest aligned offset below `target` where `bytes` fit between the `busy` ranges (sorted).
fn highest_below(busy: &[(u64, u64)], base: u64, bytes: u64, target: u64) -> Option<u64> {
    let align = |x: u64| x.div_ceil(ALIGN) * ALIGN;
    let mut gaps: Vec<(u64, u64)> = Vec::with_capacity(busy.len() + 1);
    let mut at = base;
    for &(start, end) in busy {
        if start > at {
            gaps.push((at, start));
        }
        at = at.max(align(end));
    }
    gaps.push((at, u64::MAX));
    gaps.iter().rev().find_map(|&(start, end)| {
        let o = end.min(target).checked_sub(bytes)? / ALIGN * ALIGN;
        (o >= start).then_some(o)
    })
}
