//! An order in which to run the ops of several pipeline stages abstractly, for the proofs that
//! follow values through collectives spanning stages (an embedding group's all-reduce, clipping's
//! norm summed over every stage).
//!
//! Each stage runs its ops in issue order; an op holding a collective whose groups span stages
//! waits until every stage of those groups has reached its call with the same number on that
//! communicator, and the calls then run together as one [`Item::Joint`], each member with its own
//! regions. Collectives inside one stage and transfers (which these proofs do not follow) are
//! ordinary ops. The stage proofs showed that every stage makes the same calls on such a
//! communicator and that the program runs to its end; a run that still gets stuck here is reported
//! with the op it is stuck in.

use sched_ir::hash::FxHashMap;
use sched_ir::ir::*;
use std::collections::VecDeque;

/// One step of the run.
pub(crate) enum Item {
    /// An op of one stage, alone.
    One(OpId),
    /// The ops of the stages meeting in one call of a collective spanning stages, by stage.
    Joint(Vec<OpId>),
}

/// Which ops hold a collective spanning stages, and the (communicator, call number) each meets
/// in; the stages each such communicator's groups reach.
pub(crate) struct Meetings {
    key: FxHashMap<OpId, (CommId, u32)>,
    stages: FxHashMap<CommId, Vec<u32>>,
}

impl Meetings {
    pub(crate) fn of(p: &Program) -> Meetings {
        let stages: FxHashMap<CommId, Vec<u32>> = p
            .comms
            .keys()
            .filter_map(|id| p.stages_spanned(id).map(|s| (id, s)))
            .collect();
        let mut key = FxHashMap::default();
        if !stages.is_empty() {
            let calls = p.call_numbers();
            for (id, op) in p.ops.iter() {
                let spanning = op
                    .collectives()
                    .iter()
                    .zip(&calls[id])
                    .find(|(c, _)| !c.kind.is_point_to_point() && stages.contains_key(&c.comm));
                if let Some((c, &n)) = spanning {
                    key.insert(id, (c.comm, n));
                }
            }
        }
        Meetings { key, stages }
    }

    /// Whether the program has any collective spanning stages.
    pub(crate) fn any(&self) -> bool {
        !self.key.is_empty()
    }

    /// `ops` (in issue order) as a run: each stage's ops in order, the meetings joined. `Err`
    /// holds the first op of a stage that can never go on.
    pub(crate) fn order(&self, p: &Program, ops: &[OpId]) -> Result<Vec<Item>, OpId> {
        if !self.ops_meet(ops) {
            return Ok(ops.iter().map(|&o| Item::One(o)).collect());
        }
        let mut queues: Vec<(u32, VecDeque<OpId>)> = vec![];
        for &o in ops {
            let s = p.streams[p.ops[o].stream].stage;
            match queues.iter_mut().find(|(t, _)| *t == s) {
                Some((_, q)) => q.push_back(o),
                None => queues.push((s, VecDeque::from([o]))),
            }
        }
        queues.sort_unstable_by_key(|(s, _)| *s);
        let mut out = Vec::with_capacity(ops.len());
        loop {
            for (_, q) in queues.iter_mut() {
                while let Some(&o) = q.front().filter(|o| !self.key.contains_key(o)) {
                    out.push(Item::One(o));
                    q.pop_front();
                }
            }
            let fronts: Vec<(u32, OpId)> = queues
                .iter()
                .filter_map(|(s, q)| q.front().map(|&o| (*s, o)))
                .collect();
            let Some(&(_, first)) = fronts.first() else {
                return Ok(out);
            };
            // The first meeting every stage of its groups has reached (a stage running nothing of
            // `ops` is not waited for).
            let ready = fronts.iter().map(|&(_, o)| self.key[&o]).find(|key| {
                self.stages[&key.0].iter().all(|s| {
                    fronts.iter().any(|&(t, o)| t == *s && self.key[&o] == *key)
                        || !queues.iter().any(|(t, _)| t == s)
                })
            });
            let Some(key) = ready else {
                return Err(first);
            };
            let mut members = vec![];
            for (_, q) in queues.iter_mut() {
                if q.front().is_some_and(|o| self.key.get(o) == Some(&key)) {
                    members.push(q.pop_front().expect("front"));
                }
            }
            out.push(Item::Joint(members));
        }
    }

    fn ops_meet(&self, ops: &[OpId]) -> bool {
        self.any() && ops.iter().any(|o| self.key.contains_key(o))
    }
}
