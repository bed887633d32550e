//! Happens-before for the verifier, computed from the program alone (stream order and waits).
//!
//! Deliberately separate from the passes' own clocks: a bug there must not hide here.

use cranelift_entity::EntityRef;
use sched_ir::ir::*;

pub struct Clocks {
    streams: usize,
    seq: Vec<u32>,
    vc: Vec<u32>,
}

impl Clocks {
    pub fn new(p: &Program) -> Self {
        let streams = p.streams.len();
        let n = p.ops.len();
        let mut c = Clocks {
            streams,
            seq: vec![0; n],
            vc: vec![0; n * streams],
        };
        let mut last = vec![usize::MAX; streams];
        let mut count = vec![0u32; streams];
        for (id, op) in p.ops.iter() {
            let (i, s) = (id.index(), op.stream.index());
            let mut clock = if last[s] == usize::MAX {
                vec![0; streams]
            } else {
                c.vc[last[s] * streams..][..streams].to_vec()
            };
            for ev in &op.wait {
                let from = p.events[*ev].recorder.index();
                for (k, v) in clock.iter_mut().enumerate() {
                    *v = (*v).max(c.vc[from * streams + k]);
                }
            }
            count[s] += 1;
            clock[s] = count[s];
            c.seq[i] = count[s];
            c.vc[i * streams..][..streams].copy_from_slice(&clock);
            last[s] = i;
        }
        c
    }

    /// `a` happens strictly before `b`.
    pub fn before(&self, p: &Program, a: OpId, b: OpId) -> bool {
        a != b && self.vc[b.index() * self.streams + p.ops[a].stream.index()] >= self.seq[a.index()]
    }

    /// Ordered one way or the other (or the same op).
    pub fn ordered(&self, p: &Program, a: OpId, b: OpId) -> bool {
        a == b || self.before(p, a, b) || self.before(p, b, a)
    }
}
