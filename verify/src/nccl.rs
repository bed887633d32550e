//! Proof 8: every collective's buffers are ones NCCL defines, on every rank.
//!
//! NCCL (and so every backend that runs collectives on it, and the CPU backend, which promises the
//! same results) defines a collective only when its input and output are disjoint, or in place as
//! NCCL specifies: an all-gather's input is the member's own chunk of its output
//! (`sendbuff == recvbuff + rank · sendcount`), a reduce-scatter's output is the member's own chunk
//! of its input (`recvbuff == sendbuff + rank · recvcount`), and an all-reduce or broadcast reads
//! and writes the same bytes. Checked on arena addresses (buffer offset plus the region's place on
//! the rank), so it covers two buffers the memory plan lets overlap as well as regions of one
//! buffer, for every member `j` of every group.
//!
//! Collectives whose buffers lie apart in the arena are disjoint on every rank (regions lie inside
//! their buffers, proof 1); the others are evaluated once per shape, since the outcome depends only
//! on the communicator, the kind, the count, the regions and the distance between the buffers.

use super::{range, VerifyError};
use sched_ir::ir::layout::Layout;
use sched_ir::ir::*;
use sched_ir::job::Collective;
use std::collections::HashMap;

pub fn check(p: &Program) -> Vec<VerifyError> {
    let layout = p.layout;
    let mut errs = vec![];
    type Key = (
        CommId,
        &'static str,
        u64,
        u64,
        Offset,
        u64,
        Offset,
        u64,
        i128,
    );
    let mut seen: HashMap<Key, Option<String>> = HashMap::new();
    for (id, op) in p.ops.iter() {
        for c in op.collectives() {
            let (ib, ob) = (&p.buffers[c.input.buffer], &p.buffers[c.output.buffer]);
            if ib.offset + ib.bytes <= ob.offset || ob.offset + ob.bytes <= ib.offset {
                continue;
            }
            let key = (
                c.comm,
                c.kind.name(),
                c.count,
                c.dtype.bytes(),
                c.input.offset,
                c.input.bytes,
                c.output.offset,
                c.output.bytes,
                i128::from(ib.offset) - i128::from(ob.offset),
            );
            let found = seen
                .entry(key)
                .or_insert_with(|| undefined(p, &layout, c))
                .clone();
            if let Some(m) = found {
                errs.push(VerifyError {
                    op: Some(id),
                    message: m,
                });
            }
        }
    }
    errs
}

/// The first rank on which `c`'s input and output overlap in a way NCCL does not define.
fn undefined(p: &Program, layout: &Layout, c: &CollectiveOp) -> Option<String> {
    let comm = &p.comms[c.comm];
    let (ib, ob) = (&p.buffers[c.input.buffer], &p.buffers[c.output.buffer]);
    let all = c.count * c.dtype.bytes();
    for g in &comm.groups {
        let chunk = all / g.len().max(1) as u64;
        let (send, recv) = match c.kind {
            Collective::AllGather => (chunk, all),
            Collective::ReduceScatter => (all, chunk),
            Collective::AllReduce | Collective::Broadcast | Collective::Send | Collective::Recv => {
                (all, all)
            }
        };
        for (j, &r) in g.iter().enumerate() {
            let i = ib.offset + range(&c.input, layout, r).0;
            let o = ob.offset + range(&c.output, layout, r).0;
            let disjoint = i + send <= o || o + recv <= i;
            let mine = j as u64 * chunk;
            let in_place = match c.kind {
                Collective::AllGather => i == o + mine,
                Collective::ReduceScatter => o == i + mine,
                Collective::AllReduce
                | Collective::Broadcast
                | Collective::Send
                | Collective::Recv => i == o,
            };
            if !disjoint && !in_place {
                let rule = match c.kind {
                    Collective::AllGather => {
                        format!("in place, the input must be member {j}'s chunk of the output")
                    }
                    Collective::ReduceScatter => {
                        format!("in place, the output must be member {j}'s chunk of the input")
                    }
                    _ => "in place, input and output must be the same bytes".to_string(),
                };
                return Some(format!(
                    "{} on rank {r}: its input (arena bytes {i}..{}) and output ({o}..{}) overlap in a way NCCL does not define ({rule})",
                    c.kind.name(),
                    i + send,
                    o + recv
                ));
            }
        }
    }
    None
}
