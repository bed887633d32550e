//! Happens-before on one rank, as vector clocks over streams.
//!
//! An op's clock holds, per stream, how many ops of that stream happen before or at it (stream
//! order, then waits on events, transitively). `a` happens-before-or-is `b` exactly when `b`'s
//! clock has reached `a`'s position on `a`'s stream. Clocks are monotone along each stream, so
//! the memory planner can ask "has every access of this buffer finished before that op starts"
//! in O(streams).

use cranelift_entity::{EntityRef, SecondaryMap};
use sched_ir::ir::*;

pub struct Clocks {
    streams: usize,
    /// 1-based position of each op on its stream.
    seq: SecondaryMap<OpId, u32>,
    /// ops × streams.
    vc: Vec<u32>,
}

impl Clocks {
    pub fn new(p: &Program) -> Self {
        let streams = p.streams.len();
        let mut c = Clocks {
            streams,
            seq: SecondaryMap::with_capacity(p.ops.len()),
            vc: vec![0; p.ops.len() * streams],
        };
        let mut last: Vec<Option<OpId>> = vec![None; streams];
        let mut count = vec![0u32; streams];
        for (id, op) in p.ops.iter() {
            let s = op.stream.index();
            let mut clock = last[s].map_or_else(|| vec![0; streams], |prev| c.clock(prev).to_vec());
            for &ev in &op.wait {
                let from = c.clock(p.events[ev].recorder).to_vec();
                clock
                    .iter_mut()
                    .zip(from)
                    .for_each(|(a, b)| *a = (*a).max(b));
            }
            count[s] += 1;
            clock[s] = count[s];
            c.seq[id] = count[s];
            c.vc[id.index() * streams..(id.index() + 1) * streams].copy_from_slice(&clock);
            last[s] = Some(id);
        }
        c
    }

    pub fn streams(&self) -> usize {
        self.streams
    }

    pub fn clock(&self, op: OpId) -> &[u32] {
        &self.vc[op.index() * self.streams..(op.index() + 1) * self.streams]
    }

    pub fn seq(&self, op: OpId) -> u32 {
        self.seq[op]
    }

    /// `a` happens before `b`, or is `b`.
    pub fn hb(&self, p: &Program, a: OpId, b: OpId) -> bool {
        self.clock(b)[p.ops[a].stream.index()] >= self.seq[a]
    }
}
