//! Proofs 5–6: race freedom and memory-plan soundness; and the live-bytes lower bound.

use super::{range, representative_ranks, Clocks, Ctx, VerifyError};
use crate::ir::*;
use cranelift_entity::{EntityRef, SecondaryMap};

#[derive(Clone)]
struct Access {
    op: OpId,
    region: Region,
    write: bool,
}

pub fn check(p: &Program, ctx: Ctx, clocks: &Clocks) -> (Vec<VerifyError>, u64) {
    let layout = ctx.layout(p);
    let reps = representative_ranks(&layout);
    let mut by_buffer: SecondaryMap<BufferId, Vec<Access>> = SecondaryMap::new();
    for (id, op) in p.ops.iter() {
        for r in &op.reads {
            by_buffer[r.buffer].push(Access { op: id, region: *r, write: false });
        }
        for w in &op.writes {
            by_buffer[w.buffer].push(Access { op: id, region: *w, write: true });
        }
    }
    let mut errs = vec![];
    // Race freedom.
    for (b, accesses) in by_buffer.iter() {
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
    // Memory-plan soundness: buffers sharing bytes have ordered lifetimes.
    let mut placed: Vec<BufferId> = p.buffers.keys().filter(|&b| !by_buffer[b].is_empty()).collect();
    placed.sort_by_key(|&b| (p.buffers[b].offset, b));
    let mut active: Vec<BufferId> = vec![];
    for &b in &placed {
        let buf = &p.buffers[b];
        active.retain(|&a| p.buffers[a].offset + p.buffers[a].bytes > buf.offset);
        for &a in &active {
            let other = &p.buffers[a];
            if buf.bytes == 0 || other.bytes == 0 {
                continue;
            }
            let persistent = buf.kind.is_persistent() || other.kind.is_persistent();
            if persistent || !(all_before(p, clocks, &by_buffer[a], &by_buffer[b]) || all_before(p, clocks, &by_buffer[b], &by_buffer[a])) {
                let op = by_buffer[b].first().map(|x| x.op);
                errs.push(VerifyError {
                    op,
                    message: format!(
                        "{b} ({}) shares arena bytes with {a} ({}) while both may be in use",
                        buf.name, other.name
                    ),
                });
            }
        }
        active.push(b);
    }
    (errs, live_bound(p, &by_buffer))
}

/// Every access in `xs` happens before every access in `ys`.
fn all_before(p: &Program, clocks: &Clocks, xs: &[Access], ys: &[Access]) -> bool {
    let streams = p.streams.len();
    let mut last: Vec<Option<OpId>> = vec![None; streams];
    for x in xs {
        let s = p.ops[x.op].stream.index();
        last[s] = last[s].max(Some(x.op));
    }
    let mut first: Vec<Option<OpId>> = vec![None; streams];
    for y in ys {
        let s = p.ops[y.op].stream.index();
        first[s] = Some(first[s].map_or(y.op, |f| f.min(y.op)));
    }
    last.iter().flatten().all(|&a| first.iter().flatten().all(|&b| clocks.before(p, a, b)))
}

/// The most transient bytes whose issue-order lifetimes contain one op. Two such buffers can never
/// share bytes (happens-before follows issue order), so no plan's transient part is smaller.
fn live_bound(p: &Program, by_buffer: &SecondaryMap<BufferId, Vec<Access>>) -> u64 {
    let mut delta = vec![0i128; p.ops.len() + 1];
    for (b, acc) in by_buffer.iter() {
        if acc.is_empty() || p.buffers[b].kind.is_persistent() {
            continue;
        }
        let first = acc.iter().map(|a| a.op.index()).min().expect("non-empty");
        let last = acc.iter().map(|a| a.op.index()).max().expect("non-empty");
        delta[first] += i128::from(p.buffers[b].bytes);
        delta[last + 1] -= i128::from(p.buffers[b].bytes);
    }
    let mut live = 0i128;
    let mut best = 0i128;
    for d in delta {
        live += d;
        best = best.max(live);
    }
    best as u64
}
