//! Proofs 5–6: race freedom and memory-plan soundness; and the live-bytes lower bound.

use super::{range, representative_ranks, Clocks, VerifyError};
use cranelift_entity::{EntityRef, SecondaryMap};
use sched_ir::ir::*;

#[derive(Clone)]
struct Access {
    op: OpId,
    region: Region,
    write: bool,
}

pub fn check(p: &Program, clocks: &Clocks) -> (Vec<VerifyError>, u64) {
    let layout = p.layout;
    let reps = representative_ranks(&layout);
    let mut by_buffer: SecondaryMap<BufferId, Vec<Access>> = SecondaryMap::new();
    for (id, op) in p.ops.iter() {
        for r in &op.reads {
            by_buffer[r.buffer].push(Access {
                op: id,
                region: *r,
                write: false,
            });
        }
        for w in &op.writes {
            by_buffer[w.buffer].push(Access {
                op: id,
                region: *w,
                write: true,
            });
        }
    }
    let mut errs = vec![];
    // Race freedom. Accesses from one stream are ordered by stream order, so a buffer that only
    // one stream touches (every workspace, most hidden states) needs no pairwise check.
    for (b, accesses) in by_buffer.iter() {
        let one_stream = accesses
            .windows(2)
            .all(|w| p.ops[w[0].op].stream == p.ops[w[1].op].stream);
        if one_stream {
            continue;
        }
        for (i, x) in accesses.iter().enumerate() {
            for y in &accesses[..i] {
                if !(x.write || y.write) || clocks.ordered(p, x.op, y.op) {
                    continue;
                }
                let clash = reps.iter().find(|&&r| {
                    let (a, b) = (range(&x.region, &layout, r), range(&y.region, &layout, r));
                    a.0 < b.1 && b.0 < a.1
                });
                if let Some(r) = clash {
                    errs.push(VerifyError {
                        op: Some(x.op),
                        message: format!(
                            "race on {b} ({}) with {}: {} and {} are not ordered by any wait (rank {r})",
                            p.buffers[b].name,
                            y.op,
                            if x.write { "this write" } else { "this read" },
                            if y.write { "its write" } else { "its read" }
                        ),
                    });
                }
            }
        }
    }
    // Memory-plan soundness: buffers sharing bytes have ordered lifetimes. Taken in order of first
    // access, each buffer is checked against the ones whose bytes it takes over; the others follow
    // by transitivity (and happens-before implies issue order, so this order is the only one).
    // Buffers of different pipeline stages live on different ranks: each stage is its own arena.
    let mut placed: Vec<BufferId> = p
        .buffers
        .keys()
        .filter(|&b| !by_buffer[b].is_empty() && p.buffers[b].bytes > 0)
        .collect();
    // Each buffer's accesses are listed in issue order, so its first is its first access.
    placed.sort_unstable_by_key(|&b| (by_buffer[b][0].op, b));
    let mut ends: SecondaryMap<BufferId, Ends> = SecondaryMap::new();
    for &b in &placed {
        ends[b] = Ends::new(p, &by_buffer[b]);
    }
    let mut occupants: Vec<sched_ir::intervals::Occupants<BufferId>> = vec![];
    for &b in &placed {
        let buf = &p.buffers[b];
        let stage = buf.stage as usize;
        if occupants.len() <= stage {
            occupants.resize_with(stage + 1, Default::default);
        }
        for a in occupants[stage].replace(buf.offset, buf.offset + buf.bytes, b) {
            let other = &p.buffers[a];
            if buf.kind.is_persistent()
                || other.kind.is_persistent()
                || !ends[a].before(p, clocks, &ends[b])
            {
                errs.push(VerifyError {
                    op: by_buffer[b].iter().map(|x| x.op).min(),
                    message: format!(
                        "{b} ({}) shares arena bytes with {a} ({}) while both may be in use",
                        buf.name, other.name
                    ),
                });
            }
        }
    }
    (errs, live_bound(p, &by_buffer))
}

/// A buffer's first and last accessing op on each stream.
#[derive(Clone, Default)]
struct Ends {
    first: Vec<OpId>,
    last: Vec<OpId>,
}

impl Ends {
    fn new(p: &Program, xs: &[Access]) -> Self {
        let mut first: Vec<Option<OpId>> = vec![None; p.streams.len()];
        let mut last: Vec<Option<OpId>> = vec![None; p.streams.len()];
        for x in xs {
            let s = p.ops[x.op].stream.index();
            first[s] = Some(first[s].map_or(x.op, |f| f.min(x.op)));
            last[s] = last[s].max(Some(x.op));
        }
        Ends {
            first: first.into_iter().flatten().collect(),
            last: last.into_iter().flatten().collect(),
        }
    }

    /// Every access here happens before every access of `later` (stream order carries the rest).
    fn before(&self, p: &Program, clocks: &Clocks, later: &Ends) -> bool {
        self.last
            .iter()
            .all(|&a| later.first.iter().all(|&b| clocks.before(p, a, b)))
    }
}

/// The most transient bytes whose issue-order lifetimes contain one op. Two such buffers can never
/// share bytes (happens-before follows issue order), so no plan's transient part is smaller.
/// With pipeline stages, the most over the stages of each stage's own bound.
fn live_bound(p: &Program, by_buffer: &SecondaryMap<BufferId, Vec<Access>>) -> u64 {
    let stages = p.layout.stages.max(1) as usize;
    let mut delta = vec![vec![0i128; p.ops.len() + 1]; stages];
    for (b, acc) in by_buffer.iter() {
        if acc.is_empty() || p.buffers[b].kind.is_persistent() {
            continue;
        }
        let Some(delta) = delta.get_mut(p.buffers[b].stage as usize) else {
            continue;
        };
        let first = acc.iter().map(|a| a.op.index()).min().expect("non-empty");
        let last = acc.iter().map(|a| a.op.index()).max().expect("non-empty");
        delta[first] += i128::from(p.buffers[b].bytes);
        delta[last + 1] -= i128::from(p.buffers[b].bytes);
    }
    let mut best = 0i128;
    for delta in delta {
        let mut live = 0i128;
        for d in delta {
            live += d;
            best = best.max(live);
        }
    }
    best as u64
}
