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
    /// What a tensor-parallel layer's forward saved up to sublayer `sublayer` (the rest
    /// follows with the next sublayer's `forward_open`).
    SavedUpTo {
        layer: u32,
        micro: u32,
        sublayer: u8,
    },
    /// A tensor-parallel layer's residual stream after sublayer `sublayer` (forward), or its
    /// gradient at that sublayer's input (`grad`).
    Stream {
        layer: u32,
        micro: u32,
        sublayer: u8,
        grad: bool,
    },
    /// With sequence parallelism, the tensor group's gather of a hidden state (`sublayer`
    /// `None`: the input of `layer`, or its gradient) or of a residual stream between
    /// sublayers (as [`Value::Stream`]): every rank's rows of it, whole.
    Whole {
        layer: u32,
        micro: u32,
        sublayer: Option<u8>,
        grad: bool,
    },
    /// One rank's partial sum of sublayer `sublayer` of a tensor-parallel layer (its output, or
    /// with `grad` its norm output's gradient), `reduced` once summed over its tensor group
    /// (all-reduced, or with sequence parallelism reduce-scattered: the rank's rows of the sum).
    Partial {
        layer: u32,
        micro: u32,
        sublayer: u8,
        grad: bool,
        reduced: bool,
    },
}

impl Value {
    /// What the tensor group's gather of this value holds: a hidden state's or a stream's
    /// rows, assembled.
    fn gathered(self) -> Option<Value> {
        match self {
            Value::Hidden { layer, micro, grad } => Some(Value::Whole {
                layer,
                micro,
                sublayer: None,
                grad,
            }),
            Value::Stream {
                layer,
                micro,
                sublayer,
                grad,
            } => Some(Value::Whole {
                layer,
                micro,
                sublayer: Some(sublayer),
                grad,
            }),
            _ => None,
        }
    }

    /// With sequence parallelism (`sequence`), what a phase or a whole layer reads of this
    /// hidden state or stream: the tensor group's gather of it; else itself.
    fn seen(self, sequence: bool) -> Value {
        match sequence {
            true => self.gathered().unwrap_or(self),
            false => self,
        }
    }

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
                layer_name(p, layer)
            ),
            Value::SavedUpTo {
                layer,
                micro,
                sublayer,
            } => format!(
                "what {}'s forward saved up to sublayer {sublayer} in micro-step {micro}",
                layer_name(p, layer)
            ),
            Value::Stream {
                layer,
                micro,
                sublayer,
                grad,
            } => format!(
                "{} of {} in micro-step {micro}",
                if grad {
                    format!("the gradient at the input of sublayer {sublayer}")
                } else {
                    format!("the residual stream after sublayer {sublayer}")
                },
                layer_name(p, layer)
            ),
            Value::Whole {
                layer,
                micro,
                sublayer,
                grad,
            } => {
                let part = match sublayer {
                    None => Value::Hidden { layer, micro, grad },
                    Some(sublayer) => Value::Stream {
                        layer,
                        micro,
                        sublayer,
                        grad,
                    },
                };
                format!("the tensor group's gather of {}", part.describe(p))
            }
            Value::Partial {
                layer,
                micro,
                sublayer,
                grad,
                reduced,
            } => format!(
                "{} {} of sublayer {sublayer} of {} in micro-step {micro}",
                if reduced {
                    "the summed"
                } else {
                    "one rank's unsummed"
                },
                if grad {
                    "partial gradients"
                } else {
                    "partial outputs"
                },
                layer_name(p, layer)
            ),
        }
    }
}

fn layer_name(p: &Program, layer: u32) -> &str {
    p.layers
        .get(LayerId::from_u32(layer))
        .map_or("a layer", |x| x.name.as_str())
}

fn tracked(b: &Buffer) -> bool {
    matches!(
        b.kind,
        BufferKind::Hidden | BufferKind::Activation | BufferKind::Stash | BufferKind::Partial
    )
}

/// Whether communicator `c`'s groups are the tensor groups: each the t ranks of one stage and
/// data-parallel index, in tensor-index order (so a sum over it adds every part once).
/// Whether collective `c` reads the whole of its input buffer into the whole of another buffer
/// of kind `kind` (a gather of rows, a reduce-scatter of partials).
fn whole_into(p: &Program, c: &CollectiveOp, kind: BufferKind) -> bool {
    let (b, out) = (c.input.buffer, c.output.buffer);
    c.input.bytes == p.buffers[b].bytes
        && c.output.bytes == p.buffers[out].bytes
        && p.buffers[out].kind == kind
        && out != b
}

pub(crate) fn is_tensor_comm(p: &Program, c: CommId) -> bool {
    let l = p.layout;
    let t = l.tensor.max(1);
    p.comms[c].groups.iter().all(|g| {
        g.len() == t as usize
            && g.iter().enumerate().all(|(i, &r)| {
                l.tp_index(r) == i as u32
                    && l.stage(r) == l.stage(g[0])
                    && l.dp_index(r) == l.dp_index(g[0])
            })
    })
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
    // A tensor-parallel layer's sublayers: one more than the highest its phases name.
    let mut sublayers: FxHashMap<u32, u8> = FxHashMap::default();
    for op in p.ops.values() {
        if let (OpKind::Compute(k), Some(l)) = (&op.kind, op.layer) {
            if let Some(j) = k.sublayer() {
                let n = sublayers.entry(l.as_u32()).or_insert(0);
                *n = (*n).max(j + 1);
            }
        }
    }
    let mut run = Run {
        p,
        sublayers,
        tensor_comms: FxHashMap::default(),
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
    /// Each tensor-parallel layer's sublayer count.
    sublayers: FxHashMap<u32, u8>,
    /// Whether each communicator an all-reduce of partials used is the tensor groups.
    tensor_comms: FxHashMap<CommId, bool>,
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
                sched_ir::job::Collective::AllReduce
                    if p.buffers[c.output.buffer].kind == BufferKind::Partial =>
                {
                    self.sum_partials(id, c);
                }
                sched_ir::job::Collective::ReduceScatter
                    if p.buffers[c.input.buffer].kind == BufferKind::Partial =>
                {
                    self.sum_partials(id, c);
                }
                sched_ir::job::Collective::AllGather if tracked(&p.buffers[c.output.buffer]) => {
                    self.gather_rows(id, c);
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

    /// The sum of a partial-sum buffer over the tensor group: it must sum one rank's parts
    /// once, whole; an all-reduce in place without sequence parallelism, a reduce-scatter into
    /// the rank's rows (another buffer, whole) with it.
    fn sum_partials(&mut self, id: OpId, c: &CollectiveOp) {
        let p = self.p;
        let (b, out) = (c.input.buffer, c.output.buffer);
        let scatter = c.kind == sched_ir::job::Collective::ReduceScatter;
        let name = &p.buffers[b].name;
        let kind = c.kind.name();
        if scatter != p.layout.sequence {
            let how = match p.layout.sequence {
                true => "with sequence parallelism the partials are reduce-scattered into each rank's rows",
                false => "without sequence parallelism the partials are all-reduced in place",
            };
            let what = self
                .held
                .get(&b)
                .map_or_else(|| "nothing yet".into(), |v| v.describe(p));
            self.held.remove(&out);
            self.error(id, format!("{kind} of {name} ({what}): {how}"));
            return;
        }
        let whole = match scatter {
            true => whole_into(p, c, BufferKind::Partial),
            false => c.input == c.output && c.output.bytes == p.buffers[b].bytes,
        };
        // In place, the input's value goes with the output's.
        let held = self.held.get(&b).copied();
        self.held.remove(&out);
        match held {
            Some(Value::Partial {
                layer,
                micro,
                sublayer,
                grad,
                reduced: false,
            }) if whole && self.tensor_comm(c.comm) => {
                let v = Value::Partial {
                    layer,
                    micro,
                    sublayer,
                    grad,
                    reduced: true,
                };
                self.held.insert(out, v);
            }
            Some(v @ Value::Partial { reduced: false, .. }) if whole => self.error(
                id,
                format!(
                    "{kind} of {name} ({}) runs over {} ({}), not the tensor groups: \
                     the sum does not cover each of the t parts once",
                    v.describe(p),
                    c.comm,
                    p.comms[c.comm].name
                ),
            ),
            Some(v) if whole => self.error(
                id,
                format!(
                    "{kind} of {name} sums {} again: the tensor group's parts would count t times",
                    v.describe(p)
                ),
            ),
            Some(v) => self.error(
                id,
                format!(
                    "{kind} of {name} ({}) covers part of it, or not in place",
                    v.describe(p)
                ),
            ),
            None => self.error(
                id,
                format!("{kind} of {name} sums a partial buffer nothing wrote"),
            ),
        }
    }

    /// Sequence parallelism's all-gather of a hidden state or stream over the tensor group:
    /// each rank's rows of one value, whole, into another buffer holding them all.
    fn gather_rows(&mut self, id: OpId, c: &CollectiveOp) {
        let p = self.p;
        let (b, out) = (c.input.buffer, c.output.buffer);
        let held = self.held.get(&b).copied();
        self.held.remove(&out);
        let name = &p.buffers[b].name;
        let gathered = held.and_then(Value::gathered);
        let whole = whole_into(p, c, BufferKind::Hidden);
        let what = held.map_or_else(|| "nothing yet".to_string(), |v| v.describe(p));
        match gathered {
            _ if !p.layout.sequence => self.error(
                id,
                format!("all_gather of {name} ({what}): only sequence parallelism gathers hidden states"),
            ),
            None => self.error(
                id,
                format!("all_gather of {name} gathers {what}, not one rank's rows of a hidden state or stream"),
            ),
            Some(_) if !whole => self.error(
                id,
                format!("all_gather of {name} ({what}) covers part of it, or gathers in place"),
            ),
            Some(_) if !self.tensor_comm(c.comm) => self.error(
                id,
                format!(
                    "all_gather of {name} ({what}) runs over {} ({}), not the tensor groups: \
                     the rows gathered are not the t parts of one sequence",
                    c.comm, p.comms[c.comm].name
                ),
            ),
            Some(v) => {
                self.held.insert(out, v);
            }
        }
    }

    fn compute(&mut self, id: OpId, kind: ComputeKind) {
        let p = self.p;
        let op = &p.ops[id];
        let (Some(m), layer) = (op.micro_step, op.layer.map(|l| l.as_u32())) else {
            self.clobber(id);
            return;
        };
        let n = p.layers.len() as u32;
        let sp = p.layout.sequence;
        let hidden = |layer, grad| Value::Hidden {
            layer,
            micro: m,
            grad,
        };
        // What a whole layer or a phase reads of a stream between layers (all but the logits):
        // with sequence parallelism, the tensor group's gather of it.
        let seen = |layer: u32, grad| hidden(layer, grad).seen(sp && layer < n);
        let stream = |layer, sublayer, grad| Value::Stream {
            layer,
            micro: m,
            sublayer,
            grad,
        };
        let partial = |layer, sublayer, grad, reduced| Value::Partial {
            layer,
            micro: m,
            sublayer,
            grad,
            reduced,
        };
        let saved_up_to = |layer, sublayer| Value::SavedUpTo {
            layer,
            micro: m,
            sublayer,
        };
        // (what it must read, what it writes)
        let (reads, writes): (Vec<Value>, Vec<Value>) = match (kind, layer) {
            (ComputeKind::Forward, Some(l)) => (
                (l > 0).then(|| seen(l, false)).into_iter().collect(),
                vec![hidden(l + 1, false), Value::Saved { layer: l, micro: m }],
            ),
            (ComputeKind::Recompute, Some(l)) => (
                (l > 0).then(|| seen(l, false)).into_iter().collect(),
                vec![Value::Saved { layer: l, micro: m }],
            ),
            (ComputeKind::Backward, Some(l)) => {
                let mut reads = vec![seen(l + 1, true), Value::Saved { layer: l, micro: m }];
                if l > 0 {
                    reads.push(seen(l, false));
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
            (ComputeKind::ForwardOpen(j), Some(l)) => {
                let sublayers = self.sublayers(l);
                let mut reads = vec![];
                if j == 0 {
                    reads.push(hidden(l, false).seen(sp));
                } else {
                    reads.push(stream(l, j - 1, false).seen(sp));
                    reads.push(saved_up_to(l, j - 1));
                }
                let saved = match j + 1 == sublayers {
                    true => Value::Saved { layer: l, micro: m },
                    false => saved_up_to(l, j),
                };
                (reads, vec![partial(l, j, false, false), saved])
            }
            (ComputeKind::ForwardClose(j), Some(l)) => {
                let out = match j + 1 == self.sublayers(l) {
                    true => hidden(l + 1, false),
                    false => stream(l, j, false),
                };
                (vec![partial(l, j, false, true)], vec![out])
            }
            (ComputeKind::BackwardOpen(j), Some(l)) => {
                let dy = match j + 1 == self.sublayers(l) {
                    true => hidden(l + 1, true),
                    false => stream(l, j + 1, true),
                };
                let reads = vec![Value::Saved { layer: l, micro: m }, dy.seen(sp)];
                (reads, vec![partial(l, j, true, false)])
            }
            (ComputeKind::BackwardClose(j), Some(l)) => {
                let dy = match j + 1 == self.sublayers(l) {
                    true => hidden(l + 1, true),
                    false => stream(l, j + 1, true),
                };
                let mut reads = vec![
                    Value::Saved { layer: l, micro: m },
                    partial(l, j, true, true),
                    dy,
                ];
                let gi = match j {
                    0 => {
                        reads.push(hidden(l, false));
                        hidden(l, true)
                    }
                    _ => stream(l, j, true),
                };
                (reads, vec![gi])
            }
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
        // A saved activation is only read when the layer saves any; a hidden input, a stream
        // between sublayers and a partial sum always.
        for (i, v) in reads.iter().enumerate() {
            let needed = matches!(
                v,
                Value::Hidden { .. }
                    | Value::Stream { .. }
                    | Value::Whole { .. }
                    | Value::Partial { .. }
            );
            if !seen[i] && needed {
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
                    (
                        Value::Hidden { .. } | Value::Stream { .. },
                        BufferKind::Hidden
                    ) | (
                        Value::Saved { .. } | Value::SavedUpTo { .. },
                        BufferKind::Activation
                    ) | (Value::Stash { .. }, BufferKind::Stash)
                        | (Value::Partial { .. }, BufferKind::Partial)
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

    /// [`is_tensor_comm`] of `c`, computed once per communicator.
    fn tensor_comm(&mut self, c: CommId) -> bool {
        let p = self.p;
        *self
            .tensor_comms
            .entry(c)
            .or_insert_with(|| is_tensor_comm(p, c))
    }

    /// How many tensor-parallel sublayers layer `l`'s phases run.
    fn sublayers(&self, l: u32) -> u8 {
        self.sublayers.get(&l).copied().unwrap_or(0)
    }

    /// An op this proof does not model: whatever tracked buffer it writes holds nothing known.
    fn clobber(&mut self, id: OpId) {
        for w in &self.p.ops[id].writes {
            self.held.remove(&w.buffer);
        }
    }
}
