//! Proof 10: right values through the layers and the pipeline stages (parallel spec §3.3), by
//! abstract execution of what the hidden states and saved activations hold.
//!
//! Every hidden-state buffer holds, once written, one value: the input of layer `l` (the logits
//! for `l` = the layer count) of micro-step `m`, or its gradient; every saved-activation buffer
//! holds what layer `l`'s forward saved in micro-step `m`. Running each stage's ops in issue order
//! (races are excluded, so that is what every real run computes), a send takes what its region
//! holds and the matching receive (the same call number on the peer stage) writes it. Checked:
//! - layer `l`'s forward (and recompute) of micro-step `m` reads exactly the input of layer `l`
//!   of micro-step `m` (the first layer reads tokens);
//! - its backward reads the gradient of its output and, past the first layer, its input, both of
//!   micro-step `m`, and its saved activations of micro-step `m`; so do its input-gradient half
//!   (`I`), which stashes for its weight half (`W`), and its weight half, which also reads that
//!   stash of micro-step `m`;
//! - the loss of micro-step `m` reads the logits of micro-step `m`;
//! - what each op writes is what it computes: a forward the input of layer `l + 1`, a backward
//!   the gradient of its input, the loss the gradient of the logits, a recompute or forward the
//!   saved activations of its layer.
//!
//! So every chunk's forward of micro-batch i reads the previous chunk's output of micro-batch i
//! from its own data-parallel position (a transfer pairs equal data-parallel indices, checked by
//! the stage proofs), every backward reads the matching gradient, and nothing is read before it is
//! written or after it was overwritten by another micro-batch's value. Receives run only once
//! their send has: the deadlock proof showed a blocking run completes, so an eager one does.

use super::VerifyError;
use sched_ir::hash::FxHashMap;
use sched_ir::ir::*;

/// What a hidden-state or saved-activation buffer holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Value {
    /// The input of layer `layer` (the logits past the last layer) in micro-step `micro`, or its
    /// gradient.
    Hidden { layer: u32, micro: u32, grad: bool },
    /// What layer `layer`'s forward saved in micro-step `micro`.
    Saved { layer: u32, micro: u32 },
    /// What layer `layer`'s input-gradient backward stashed for its weight half.
    Stash { layer: u32, micro: u32 },
}

impl Value {
    fn describe(self, p: &Program) -> String {
        let name = |l: u32| {
            p.layers.get(LayerId::from_u32(l)).map_or_else(
                || "the logits".to_string(),
                |x| format!("the input of {}", x.name),
            )
        };
        match self {
            Value::Hidden { layer, micro, grad } => format!(
                "{}{} of micro-step {micro}",
                if grad { "the gradient of " } else { "" },
                name(layer)
            ),
            Value::Saved { layer, micro } => format!(
                "what {}'s forward saved in micro-step {micro}",
                p.layers
                    .get(LayerId::from_u32(layer))
                    .map_or("a layer", |x| x.name.as_str())
            ),
            Value::Stash { layer, micro } => format!(
                "what {}'s input-gradient backward stashed in micro-step {micro}",
                p.layers
                    .get(LayerId::from_u32(layer))
                    .map_or("a layer", |x| x.name.as_str())
            ),
        }
    }
}

fn tracked(b: &Buffer) -> bool {
    matches!(
        b.kind,
        BufferKind::Hidden | BufferKind::Activation | BufferKind::Stash
    )
}

pub fn check(p: &Program) -> Vec<VerifyError> {
    let stages = p.layout.stages.max(1) as usize;
    let mut ops: Vec<Vec<OpId>> = vec![vec![]; stages];
    for (id, op) in p.ops.iter() {
        if let Some(s) = p.streams.get(op.stream).map(|s| s.stage as usize) {
            if s < stages {
                ops[s].push(id);
            }
        }
    }
    let mut run = Run {
        p,
        held: FxHashMap::default(),
        letters: FxHashMap::default(),
        calls: p.call_numbers(),
        posted: Default::default(),
        errs: vec![],
    };
    // Each stage runs until a receive finds no letter; round after round until all are done.
    let mut next = vec![0usize; stages];
    loop {
        let mut progress = false;
        for s in 0..stages {
            while let Some(&id) = ops[s].get(next[s]) {
                if !run.op(id) {
                    break;
                }
                next[s] += 1;
                progress = true;
            }
        }
        if !progress || run.errs.len() >= 20 {
            break;
        }
    }
    run.errs
}

struct Run<'a> {
    p: &'a Program,
    /// What each tracked buffer holds (absent: nothing yet).
    held: FxHashMap<BufferId, Value>,
    /// Sent values not yet received, by (communicator, call number).
    letters: FxHashMap<(CommId, u32), Option<Value>>,
    /// Each op's collectives' call numbers ([`Program::call_numbers`]).
    calls: cranelift_entity::SecondaryMap<OpId, Vec<u32>>,
    /// Ops whose sends are posted.
    posted:
        std::collections::HashSet<OpId, std::hash::BuildHasherDefault<sched_ir::hash::FxHasher>>,
    errs: Vec<VerifyError>,
}

impl Run<'_> {
    fn error(&mut self, op: OpId, message: String) {
        self.errs.push(VerifyError {
            op: Some(op),
            message,
        });
    }

    /// Runs `id`; false when it is a receive whose send has not run yet.
    fn op(&mut self, id: OpId) -> bool {
        let p = self.p;
        let op = &p.ops[id];
        match &op.kind {
            OpKind::Compute(kind) => {
                self.compute(id, *kind);
                true
            }
            OpKind::Collective(_) | OpKind::Group(_) => self.transfers(id),
        }
    }

    /// A group's or collective's sends and receives (other collectives move no tracked buffer).
    /// Its sends are posted at once (a group call posts all its transfers together); it
    /// completes once every receive's letter is there.
    fn transfers(&mut self, id: OpId) -> bool {
        let p = self.p;
        let cs = p.ops[id].collectives();
        // Each part's call number on its communicator.
        let numbers: Vec<(CommId, u32)> = cs
            .iter()
            .zip(&self.calls[id])
            .map(|(c, &n)| (c.comm, n))
            .collect();
        if self.posted.insert(id) {
            for (c, &(comm, n)) in cs.iter().zip(&numbers) {
                if c.kind == sched_ir::job::Collective::Send {
                    let v = self.held.get(&c.input.buffer).copied();
                    if v.is_none() && tracked(&p.buffers[c.input.buffer]) {
                        let name = &p.buffers[c.input.buffer].name;
                        self.error(id, format!("sends {name} before anything wrote it"));
                    }
                    self.letters.insert((comm, n), v);
                }
            }
        }
        let arrived = cs.iter().zip(&numbers).all(|(c, key)| {
            c.kind != sched_ir::job::Collective::Recv || self.letters.contains_key(key)
        });
        if !arrived {
            return false;
        }
        for (c, &(comm, n)) in cs.iter().zip(&numbers) {
            match c.kind {
                sched_ir::job::Collective::Send => {}
                sched_ir::job::Collective::Recv => {
                    let v = self.letters.remove(&(comm, n)).flatten();
                    match v {
                        Some(v) => {
                            self.held.insert(c.output.buffer, v);
                        }
                        None => {
                            self.held.remove(&c.output.buffer);
                        }
                    }
                }
                _ => {
                    for r in c.writes() {
                        self.held.remove(&r.buffer);
                    }
                }
            }
        }
        true
    }

    fn compute(&mut self, id: OpId, kind: ComputeKind) {
        let p = self.p;
        let op = &p.ops[id];
        let (Some(m), layer) = (op.micro_step, op.layer.map(|l| l.as_u32())) else {
            self.clobber(id);
            return;
        };
        let n = p.layers.len() as u32;
        let hidden = |layer, grad| Value::Hidden {
            layer,
            micro: m,
            grad,
        };
        // (what it must read, what it writes)
        let (reads, writes): (Vec<Value>, Vec<Value>) = match (kind, layer) {
            (ComputeKind::Forward, Some(l)) => (
                (l > 0).then(|| hidden(l, false)).into_iter().collect(),
                vec![hidden(l + 1, false), Value::Saved { layer: l, micro: m }],
            ),
            (ComputeKind::Recompute, Some(l)) => (
                (l > 0).then(|| hidden(l, false)).into_iter().collect(),
                vec![Value::Saved { layer: l, micro: m }],
            ),
            (ComputeKind::Backward, Some(l)) => {
                let mut reads = vec![hidden(l + 1, true), Value::Saved { layer: l, micro: m }];
                if l > 0 {
                    reads.push(hidden(l, false));
                }
                (
                    reads,
                    (l > 0).then(|| hidden(l, true)).into_iter().collect(),
                )
            }
            (ComputeKind::BackwardInput, Some(l)) => {
                let mut reads = vec![hidden(l + 1, true), Value::Saved { layer: l, micro: m }];
                let mut writes = vec![Value::Stash { layer: l, micro: m }];
                if l > 0 {
                    reads.push(hidden(l, false));
                    writes.push(hidden(l, true));
                }
                (reads, writes)
            }
            (ComputeKind::BackwardWeight, Some(l)) => {
                let mut reads = vec![
                    hidden(l + 1, true),
                    Value::Saved { layer: l, micro: m },
                    Value::Stash { layer: l, micro: m },
                ];
                if l > 0 {
                    reads.push(hidden(l, false));
                }
                (reads, vec![])
            }
            (ComputeKind::Loss, _) => (vec![hidden(n, false)], vec![hidden(n, true)]),
            _ => {
                self.clobber(id);
                return;
            }
        };
        let mut seen = vec![false; reads.len()];
        for r in &op.reads {
            let b = &p.buffers[r.buffer];
            if !tracked(b) {
                continue;
            }
            let held = self.held.get(&r.buffer).copied();
            match held.and_then(|v| reads.iter().position(|&w| w == v)) {
                Some(i) => seen[i] = true,
                None => {
                    let what = held.map_or_else(|| "nothing yet".to_string(), |v| v.describe(p));
                    let want: Vec<String> = reads.iter().map(|v| v.describe(p)).collect();
                    self.error(
                        id,
                        format!(
                            "{} reads {} ({}), which holds {what}; it needs {}",
                            Op::compute_name(kind),
                            r.buffer,
                            b.name,
                            want.join(" and ")
                        ),
                    );
                }
            }
        }
        // A saved activation is only read when the layer saves any; a hidden input always.
        for (i, v) in reads.iter().enumerate() {
            if !seen[i] && matches!(v, Value::Hidden { .. }) {
                self.error(
                    id,
                    format!("{} never reads {}", Op::compute_name(kind), v.describe(p)),
                );
            }
        }
        for w in &op.writes {
            let b = &p.buffers[w.buffer];
            if !tracked(b) {
                continue;
            }
            let value = writes.iter().copied().find(|v| {
                matches!(
                    (v, b.kind),
                    (Value::Hidden { .. }, BufferKind::Hidden)
                        | (Value::Saved { .. }, BufferKind::Activation)
                        | (Value::Stash { .. }, BufferKind::Stash)
                )
            });
            match value {
                Some(v) => {
                    self.held.insert(w.buffer, v);
                }
                None => {
                    self.held.remove(&w.buffer);
                }
            }
        }
    }

    /// An op this proof does not model: whatever tracked buffer it writes holds nothing known.
    fn clobber(&mut self, id: OpId) {
        for w in &self.p.ops[id].writes {
            self.held.remove(&w.buffer);
        }
    }
}
