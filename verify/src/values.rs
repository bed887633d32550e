//! Proof 7: right values (lowering spec §7.5), by abstract execution over every rank.
//!
//! Races are already excluded, and happens-before only runs forward in issue order, so running the
//! ops one at a time in issue order computes the values any real execution computes. The abstract
//! state tracks, per rank, what each byte range of a layer's parameter and gradient buffers holds:
//! - `Param { elem, version }`: that layer's parameters from element `elem` on, at a version
//!   (0 at the start of the step, 1 after this step's update);
//! - `Grad { elem, contrib }`: gradient elements from `elem` on, summed over a set of
//!   contributions, each a (term, micro-step, rank): the backward of layer `term` (a tied lm_head
//!   adds a second term to its embedding's gradient) on that rank in that micro-step.
//!
//! Collectives are evaluated once per group (chunk `j` to or from member `j`), copies move bytes,
//! accumulations and reductions take unions of contributions that must be disjoint. Checked:
//! - every forward, recompute and backward reads its parameters whole and at the current version;
//! - every update receives, for exactly its optimizer shard's elements, every term's dp × M
//!   contributions exactly once, and writes the new values where its param shard holds them;
//! - at the end of the step every param shard holds what it held at the start one version later
//!   (so a refresh, immediate or deferred to the next step's forward, is never missing).
//!
//! Each layer's buffers evolve independently, so layers are checked one at a time, and layers
//! whose op sequences are alike (the same shapes, communicators and regions) are checked once.
//! Workspaces hold scratch, never a value, and are no layer's: no check reads them.

use super::contribs::Contribs;
use super::joint::Item;
use super::{range, VerifyError};
use cranelift_entity::{EntityRef, SecondaryMap};
use sched_ir::hash::FxHashMap;
use sched_ir::ir::layout::Layout;
use sched_ir::ir::*;
use sched_ir::job::Collective;
use std::collections::{BTreeMap, HashMap};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Val {
    Param { elem: u64, version: u32 },
    Grad { elem: u64, contrib: u32 },
}

impl Val {
    /// The same content `n` elements further on.
    fn advanced(self, n: u64) -> Val {
        match self {
            Val::Param { elem, version } => Val::Param {
                elem: elem + n,
                version,
            },
            Val::Grad { elem, contrib } => Val::Grad {
                elem: elem + n,
                contrib,
            },
        }
    }
}

/// A byte range of a buffer and what it holds (element `elem` sits at byte `start`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Seg {
    start: u64,
    end: u64,
    val: Val,
}

/// The contents of one buffer on one rank: sorted, disjoint segments.
type Contents = Vec<Seg>;

/// A term flag (sequence parallelism): the contribution holds only the rows of the tokens its
/// rank's backward close handled, a t-th of the norm's gradient; the tensor group's all-reduce
/// of it clears the flag ([`Run::rows_summed`], `Contribs::cleared`).
const ROWS: u32 = 1 << 31;

/// Proof 7 for every layer with parameters, its runs spread over at most `threads` threads.
pub fn check(p: &Program, threads: usize) -> Vec<VerifyError> {
    let layout = p.layout;
    let mut ops_of: Vec<Vec<OpId>> = vec![vec![]; p.layers.len()];
    for (id, op) in p.ops.iter() {
        let mut touched: Vec<usize> = op
            .reads
            .iter()
            .chain(&op.writes)
            .filter_map(|r| p.buffers[r.buffer].layer.map(|l| l.index()))
            .collect();
        touched.sort_unstable();
        touched.dedup();
        for l in touched {
            ops_of[l].push(id);
        }
    }
    let meetings = super::joint::Meetings::of(p);
    // Communicators some group of which mixes tensor indices (see `Run::stage_ranks`).
    let mixed: Vec<bool> = p
        .comms
        .values()
        .map(|c| {
            c.groups.iter().any(|g| {
                g.iter()
                    .any(|&r| layout.tp_index(r) != layout.tp_index(g[0]))
            })
        })
        .collect();
    let mut seen: FxHashMap<Signature, usize> = FxHashMap::default();
    let mut runs: Vec<(LayerId, &[OpId])> = vec![];
    for (l, ops) in ops_of.iter().enumerate() {
        let layer = LayerId::new(l);
        if p.layers[layer].params == 0 {
            continue;
        }
        let sig = signature(p, layer, ops);
        if seen.insert(sig, l).is_some() {
            continue;
        }
        runs.push((layer, ops));
    }
    let run = |&(layer, ops): &(LayerId, &[OpId])| {
        let mut run = Run {
            p,
            layout: &layout,
            meetings: &meetings,
            mixed: &mixed,
            layer,
            coverage: vec![],
            contribs: Contribs::new(&layout),
            state: State::new(p.ranks(), layout.tensor),
            scratch: vec![],
            errs: vec![],
        };
        run.execute(ops);
        run.errs
    };
    // The runs share nothing: large programs spread them over threads; errors keep layer order.
    let work: usize = runs.iter().map(|(_, ops)| ops.len()).sum::<usize>() * p.ranks() as usize;
    let threads = threads.min(runs.len());
    let threads = if work < PARALLEL_WORK { 1 } else { threads };
    sched_ir::par::map(&runs, threads, run)
        .into_iter()
        .flatten()
        .collect()
}

/// Ops × ranks of the distinct layer runs above which they are spread over threads (the
/// 1,024-rank benchmark programs have about 300,000; the examples a few thousand).
const PARALLEL_WORK: usize = 100_000;

/// What a layer's op sequence looks like, with buffer ids renamed by first use: layers with equal
/// signatures evolve alike, so one run checks them all.
#[derive(PartialEq, Eq, Hash)]
struct Signature {
    padded: u64,
    /// The pipeline stage running the layer (its ranks are the run's).
    stage: u32,
    steps: Vec<Step>,
}

/// One item of a [`Signature`], in op order.
#[derive(PartialEq, Eq, Hash)]
enum Step {
    /// An op begins: its kind's name and micro-step.
    Op(&'static str, Option<u32>),
    /// One of its collectives begins: kind, communicator, element count (its input and output
    /// regions follow).
    Collective(&'static str, CommId, u64),
    /// A region: its buffer (renamed by first use), whether that buffer is another layer's, its
    /// offset and bytes.
    Region(usize, bool, Offset, u64),
}

fn signature(p: &Program, layer: LayerId, ops: &[OpId]) -> Signature {
    let mut names: FxHashMap<BufferId, usize> = FxHashMap::default();
    let mut steps = vec![];
    let mut region = |r: &Region, steps: &mut Vec<Step>| {
        let n = names.len();
        let id = *names.entry(r.buffer).or_insert(n);
        let theirs = p.buffers[r.buffer].layer != Some(layer);
        steps.push(Step::Region(id, theirs, r.offset, r.bytes));
    };
    for &o in ops {
        let op = &p.ops[o];
        steps.push(Step::Op(op.kind_name(), op.micro_step));
        for c in op.collectives() {
            steps.push(Step::Collective(c.kind.name(), c.comm, c.count));
            region(&c.input, &mut steps);
            region(&c.output, &mut steps);
        }
        if op.collectives().is_empty() {
            // The norm reads every layer; only this layer's part of it tells layers apart.
            let norm = op.kind == OpKind::Compute(ComputeKind::GradNorm);
            for r in op.reads.iter().chain(&op.writes) {
                if !norm || p.buffers[r.buffer].layer == Some(layer) {
                    region(r, &mut steps);
                }
            }
        }
    }
    Signature {
        padded: p.layers[layer].padded,
        stage: ops.first().map_or(0, |&o| {
            p.streams.get(p.ops[o].stream).map_or(0, |s| s.stage)
        }),
        steps,
    }
}

struct Run<'a> {
    p: &'a Program,
    layout: &'a Layout,
    /// The collectives spanning stages, which run as one across their stages' ops.
    meetings: &'a super::joint::Meetings,
    /// By communicator, whether a group of it mixes tensor indices.
    mixed: &'a [bool],
    layer: LayerId,
    /// Other layers' backward terms in this layer's gradient, with their elements
    /// ([`Run::other_terms`]).
    coverage: Vec<(u32, u64, u64)>,
    contribs: Contribs,
    /// (buffer, rank) → contents; empty means nothing written yet.
    state: State,
    /// A spare contents list, so writes build their result without allocating once warm.
    scratch: Contents,
    errs: Vec<VerifyError>,
}

/// The contents of every buffer on every rank the proof runs, indexed directly (no hashing on
/// the hot path). The proof runs only ranks of tensor index 0 ([`Run::stage_ranks`]), so a rank's
/// contents sit at its slot `rank / t` (a bijection on those ranks; any other rank is refused).
struct State {
    /// t.
    t: u32,
    /// Slots: ranks / t.
    slots: usize,
    /// Per buffer, per slot; an empty list until the buffer is first written.
    of: SecondaryMap<BufferId, Vec<Held>>,
}

impl State {
    fn new(ranks: u32, t: u32) -> Self {
        let t = t.max(1);
        State {
            t,
            slots: ranks.div_ceil(t) as usize,
            of: SecondaryMap::new(),
        }
    }

    fn slot(&self, rank: u32) -> usize {
        assert_eq!(
            rank % self.t,
            0,
            "the value proof runs only ranks of tensor index 0"
        );
        (rank / self.t) as usize
    }

    fn get(&self, b: BufferId, rank: u32) -> &[Seg] {
        let slot = self.slot(rank);
        self.of
            .get(b)
            .and_then(|per| per.get(slot))
            .map_or(&[], Held::as_slice)
    }

    fn get_mut(&mut self, b: BufferId, rank: u32) -> &mut Held {
        let slot = self.slot(rank);
        let per = &mut self.of[b];
        if per.is_empty() {
            per.resize(self.slots, Held::NOTHING);
        }
        &mut per[slot]
    }
}

/// What one buffer holds on one rank, as [`State`] keeps it. Nearly always nothing, one segment
/// (a whole gradient or parameter range) or two, so up to [`INLINE`] segments live inline: a run
/// over a thousand ranks would otherwise allocate a list for every buffer on every rank.
#[derive(Clone)]
enum Held {
    /// The first `len` of `segs`.
    Inline {
        len: u8,
        segs: [Seg; INLINE],
    },
    Many(Contents),
}

/// Segments [`Held`] keeps without allocating.
const INLINE: usize = 2;

impl Held {
    /// What an inline slot past `len` holds (never read).
    const UNUSED: Seg = Seg {
        start: 0,
        end: 0,
        val: Val::Param {
            elem: 0,
            version: 0,
        },
    };
    const NOTHING: Held = Held::Inline {
        len: 0,
        segs: [Held::UNUSED; INLINE],
    };

    fn as_slice(&self) -> &[Seg] {
        match self {
            Held::Inline { len, segs } => &segs[..usize::from(*len)],
            Held::Many(segs) => segs,
        }
    }

    /// Makes `segs` the contents, reusing the list already here when there is one.
    fn set(&mut self, segs: &[Seg]) {
        match self {
            Held::Many(held) if segs.len() > INLINE => {
                held.clear();
                held.extend_from_slice(segs);
            }
            _ if segs.len() > INLINE => *self = Held::Many(segs.to_vec()),
            _ => {
                let mut slots = [Held::UNUSED; INLINE];
                slots[..segs.len()].copy_from_slice(segs);
                *self = Held::Inline {
                    len: segs.len() as u8,
                    segs: slots,
                };
            }
        }
    }
}

impl Run<'_> {
    fn mine(&self, b: BufferId) -> bool {
        self.p.buffers[b].layer == Some(self.layer)
    }

    /// The ranks of pipeline stage `stage` (every rank without a pipeline) the proof runs:
    /// those of tensor index 0. The ranks of another tensor index run the same ops on the same
    /// shard indices (a rank's shard indices depend on its stage and data-parallel index only),
    /// and every collective this proof follows stays inside one tensor index (checked in
    /// [`Run::collective`]; the tensor groups' sums of partial activations are the flow proof's),
    /// so they hold the same values: one tensor index proves them all, and the proof costs d
    /// ranks' work per stage, not d·t.
    fn stage_ranks(&self, stage: u32) -> std::iter::StepBy<std::ops::Range<u32>> {
        let n = self.layout.stage_size();
        (stage * n..(stage + 1) * n).step_by(self.layout.tensor.max(1) as usize)
    }

    /// The ranks running op `o` the proof runs (see [`Run::stage_ranks`]).
    fn op_ranks(&self, o: OpId) -> std::iter::StepBy<std::ops::Range<u32>> {
        self.stage_ranks(self.p.streams[self.p.ops[o].stream].stage)
    }

    /// The name of the layer whose op `o` is (this run's layer for an op of none).
    fn op_layer_name(&self, o: OpId) -> String {
        let l = self.p.ops[o].layer.unwrap_or(self.layer);
        self.p.layers[l].name.clone()
    }

    fn elem_bytes(&self, b: BufferId) -> u64 {
        self.p.buffers[b].dtype.bytes()
    }

    fn error(&mut self, op: OpId, message: String) {
        if self.errs.len() < 8 {
            self.errs.push(VerifyError {
                op: Some(op),
                message,
            });
        }
    }

    /// [`Run::read`] without collecting: the segments of `b` on `rank` within `[start, end)`.
    fn view(&self, b: BufferId, rank: u32, start: u64, end: u64) -> impl Iterator<Item = Seg> + '_ {
        slice_iter(self.state.get(b, rank), start, end, self.elem_bytes(b))
    }

    /// The segments of `b` on `rank` within `[start, end)`, rebased to start at 0.
    fn read(&self, b: BufferId, rank: u32, start: u64, end: u64) -> Contents {
        slice(self.state.get(b, rank), start, end, self.elem_bytes(b))
    }

    /// [`Run::read`] into `out` (cleared first): no allocation once `out` has grown.
    fn read_into(&self, b: BufferId, rank: u32, start: u64, end: u64, out: &mut Contents) {
        out.clear();
        out.extend(self.view(b, rank, start, end));
    }

    /// Writes `segs` (rebased at 0) into `b` on `rank` at `at`, replacing what was there.
    fn write(&mut self, b: BufferId, rank: u32, at: u64, len: u64, segs: &[Seg]) {
        let d = self.elem_bytes(b);
        let mut out = std::mem::take(&mut self.scratch);
        out.clear();
        let cur = self.state.get_mut(b, rank);
        let old = cur.as_slice();
        // What was there before `at`, the new segments, what was there after `at + len`: already
        // in order, since the old segments are sorted and disjoint and the new ones lie between.
        let mut after: Option<Seg> = None;
        let mut rest = 0;
        for (k, s) in old.iter().enumerate() {
            if s.start >= at + len {
                rest = k;
                break;
            }
            rest = k + 1;
            if s.end <= at {
                push_merged(&mut out, *s, d);
                continue;
            }
            if s.start < at {
                push_merged(&mut out, Seg { end: at, ..*s }, d);
            }
            if s.end > at + len {
                let skip = (at + len - s.start) / d;
                after = Some(Seg {
                    start: at + len,
                    end: s.end,
                    val: s.val.advanced(skip),
                });
            }
        }
        for s in segs {
            let s = Seg {
                start: s.start + at,
                end: s.end + at,
                val: s.val,
            };
            push_merged(&mut out, s, d);
        }
        if let Some(s) = after {
            push_merged(&mut out, s, d);
        }
        for s in &old[rest..] {
            push_merged(&mut out, *s, d);
        }
        cur.set(&out);
        // The list serves the next write.
        self.scratch = out;
    }

    fn execute(&mut self, ops: &[OpId]) {
        self.coverage = self.other_terms(ops);
        let deferred = self.deferred_refresh(ops);
        let start = self.initial(deferred);
        for (&(b, r), segs) in &start {
            self.state.get_mut(b, r).set(segs);
        }
        let current = u32::from(deferred);
        let items = match self.meetings.order(self.p, ops) {
            Ok(items) => items,
            Err(o) => {
                self.error(
                    o,
                    format!(
                        "the stages running {} never all reach this collective together",
                        self.p.layers[self.layer].name
                    ),
                );
                return;
            }
        };
        for item in items {
            let o = match item {
                Item::One(o) => o,
                Item::Joint(members) => {
                    let cs: Vec<(OpId, CollectiveOp)> = members
                        .iter()
                        .flat_map(|&o| self.p.ops[o].collectives().iter().map(move |c| (o, *c)))
                        .filter(|(_, c)| !c.kind.is_point_to_point())
                        .collect();
                    self.collective(&cs);
                    continue;
                }
            };
            let op = &self.p.ops[o];
            match &op.kind {
                OpKind::Compute(k) => self.compute(o, *k, current),
                OpKind::Collective(c) => self.collective(&[(o, *c)]),
                OpKind::Group(cs) => {
                    for c in cs.clone() {
                        self.collective(&[(o, c)]);
                    }
                }
            }
        }
        // The end state is the start state one version later (checked in buffer, then rank, order:
        // the mismatch named is the same on every run).
        for ((b, r), segs) in start {
            let want: Contents = segs
                .iter()
                .map(|s| match s.val {
                    Val::Param { elem, version } => Seg {
                        val: Val::Param {
                            elem,
                            version: version + 1,
                        },
                        ..*s
                    },
                    v => Seg { val: v, ..*s },
                })
                .collect();
            let got = self.state.get(b, r).to_vec();
            if merge(got.clone(), self.elem_bytes(b)) != merge(want, self.elem_bytes(b)) {
                let last = ops.last().copied().unwrap_or(OpId::new(0));
                let name = &self.p.buffers[b].name;
                self.error(last, format!("at the end of the step {b} ({name}) on rank {r} is not the next version of what it held at the start: a refresh is missing or wrong"));
                break;
            }
        }
    }

    /// True when the step begins with refresh all-gathers on param shards (refresh = next_forward).
    fn deferred_refresh(&self, ops: &[OpId]) -> bool {
        let refresh = |o: &OpId| self.p.ops[*o].role == OpRole::Refresh;
        let update = ops
            .iter()
            .position(|o| self.p.ops[*o].kind == OpKind::Compute(ComputeKind::Update));
        let first_refresh = ops.iter().position(refresh);
        matches!((first_refresh, update), (Some(r), Some(u)) if r < u)
    }

    /// Param shards at the start of the step: this rank's slice of the parameters, at version 0;
    /// with a deferred refresh the rank's own optimizer slice already holds version 1.
    /// Ordered by buffer, then rank.
    fn initial(&self, deferred: bool) -> BTreeMap<(BufferId, u32), Contents> {
        let mut out = BTreeMap::new();
        for (b, buf) in self.p.buffers.iter() {
            if buf.kind != BufferKind::ParamShard || !self.mine(b) {
                continue;
            }
            let d = buf.dtype.bytes();
            let per = buf.bytes / d;
            let sh = self.layout.shard;
            let os = self.p.layers[self.layer].padded / sh.optimizer.size();
            for r in self.stage_ranks(buf.stage) {
                let base = self.layout.index(ShardIndex::Param, r) * per;
                let mut segs = vec![Seg {
                    start: 0,
                    end: buf.bytes,
                    val: Val::Param {
                        elem: base,
                        version: 0,
                    },
                }];
                if deferred {
                    let k = self.layout.index(ShardIndex::OptimizerInParam, r);
                    let new = vec![Seg {
                        start: 0,
                        end: os * d,
                        val: Val::Param {
                            elem: base + k * os,
                            version: 1,
                        },
                    }];
                    segs = splice(segs, k * os * d, os * d, &new, d);
                }
                out.insert((b, r), segs);
            }
        }
        out
    }

    fn compute(&mut self, o: OpId, kind: ComputeKind, current: u32) {
        let op = &self.p.ops[o];
        let (reads, writes) = (op.reads.clone(), op.writes.clone());
        let m = op.micro_step.unwrap_or(0);
        let mut term = op.layer.map_or(0, |l| l.as_u32());
        // With sequence parallelism a backward close computes the norms' gradients of its
        // rank's rows only.
        if self.p.layout.sequence && matches!(kind, ComputeKind::BackwardClose(_)) {
            term |= ROWS;
        }
        let padded = self.p.layers[self.layer].padded;
        match kind {
            ComputeKind::Forward
            | ComputeKind::Recompute
            | ComputeKind::Backward
            | ComputeKind::BackwardInput
            | ComputeKind::BackwardWeight
            | ComputeKind::ForwardOpen(_)
            | ComputeKind::ForwardClose(_)
            | ComputeKind::BackwardOpen(_)
            | ComputeKind::BackwardClose(_) => {
                for r in reads
                    .iter()
                    .filter(|r| self.mine(r.buffer) && is_param(self.p.buffers[r.buffer].kind))
                {
                    for rank in self.op_ranks(o) {
                        let (a, z) = range(r, self.layout, rank);
                        let d = self.elem_bytes(r.buffer);
                        let mut segs = self.view(r.buffer, rank, a, z);
                        let whole = matches!(
                            (segs.next(), segs.next()),
                            (Some(Seg { start: 0, end, val: Val::Param { elem: 0, version } }), None)
                                if end == padded * d && version == current
                        );
                        drop(segs);
                        if !whole {
                            let segs = self.read(r.buffer, rank, a, z);
                            let what = describe(&segs, d);
                            self.error(o, format!("{} of {} on rank {rank} reads {} holding {what}, not all {padded} parameters at version {current}", Op::compute_name(kind), self.p.layers[self.layer].name, r.buffer));
                            return;
                        }
                    }
                }
                // The whole backward, or its weight half, contributes the gradient.
                if matches!(
                    kind,
                    ComputeKind::Backward
                        | ComputeKind::BackwardWeight
                        | ComputeKind::BackwardOpen(_)
                        | ComputeKind::BackwardClose(_)
                ) {
                    let targets: Vec<Region> = writes
                        .iter()
                        .filter(|w| self.mine(w.buffer) && is_grad(self.p.buffers[w.buffer].kind))
                        .copied()
                        .collect();
                    // Lists reused from rank to rank.
                    let (mut held, mut sum) = (vec![], vec![]);
                    for w in &targets {
                        let acc = reads.contains(w);
                        for rank in self.op_ranks(o) {
                            let (a, z) = range(w, self.layout, rank);
                            let c = self.contribs.single(term, m, rank);
                            let elem = a / self.elem_bytes(w.buffer);
                            let new = [Seg {
                                start: 0,
                                end: z - a,
                                val: Val::Grad { elem, contrib: c },
                            }];
                            let segs: &[Seg] = if acc {
                                self.read_into(w.buffer, rank, a, z, &mut held);
                                if !self.add_into(o, &held, &new, w.buffer, &mut sum) {
                                    return;
                                }
                                &sum
                            } else {
                                &new
                            };
                            self.write(w.buffer, rank, a, z - a, segs);
                        }
                    }
                }
            }
            ComputeKind::Copy | ComputeKind::Accumulate => {
                let (srcs, dsts): (Vec<Region>, Vec<Region>) = match kind {
                    ComputeKind::Accumulate => (
                        reads
                            .iter()
                            .filter(|r| !writes.contains(r))
                            .copied()
                            .collect(),
                        writes.clone(),
                    ),
                    _ => (reads.clone(), writes.clone()),
                };
                if !srcs.iter().chain(&dsts).any(|r| self.mine(r.buffer)) {
                    return;
                }
                // Lists reused from rank to rank.
                let (mut pieces, mut data, mut held, mut sum) = (vec![], vec![], vec![], vec![]);
                for rank in self.op_ranks(o) {
                    // One source split evenly over several destinations, or pairwise.
                    pieces.clear();
                    if srcs.len() == 1 && dsts.len() > 1 {
                        let (a, _) = range(&srcs[0], self.layout, rank);
                        let each = srcs[0].bytes / dsts.len() as u64;
                        pieces.extend(
                            (0..dsts.len() as u64)
                                .map(|i| (srcs[0], a + i * each, a + (i + 1) * each)),
                        );
                    } else {
                        pieces.extend(srcs.iter().map(|s| {
                            let (a, z) = range(s, self.layout, rank);
                            (*s, a, z)
                        }));
                    }
                    for (&(src, a, z), dst) in pieces.iter().zip(&dsts) {
                        self.read_into(src.buffer, rank, a, z, &mut data);
                        let (da, dz) = range(dst, self.layout, rank);
                        let segs: &[Seg] = if kind == ComputeKind::Accumulate {
                            self.read_into(dst.buffer, rank, da, dz, &mut held);
                            if !self.add_into(o, &held, &data, dst.buffer, &mut sum) {
                                return;
                            }
                            &sum
                        } else {
                            &data
                        };
                        self.write(dst.buffer, rank, da, dz - da, segs);
                    }
                }
            }
            ComputeKind::Update => self.update(o, &reads, &writes, current),
            // Clipping's norm: this layer's optimizer-shard gradient must be complete when read
            // (the norm's own value is checked by `check_norm`).
            ComputeKind::GradNorm => {
                let mine: Vec<Region> = reads
                    .iter()
                    .filter(|r| self.mine(r.buffer) && is_grad(self.p.buffers[r.buffer].kind))
                    .copied()
                    .collect();
                if mine.len() != 1 {
                    self.error(
                        o,
                        format!(
                            "grad_norm reads {} gradient regions of {}, not one",
                            mine.len(),
                            self.p.layers[self.layer].name
                        ),
                    );
                    return;
                }
                self.optimizer_grad_complete(o, &mine[0], "grad_norm");
            }
            ComputeKind::Loss => {}
        }
    }

    /// The optimizer: complete contributions in, new parameters out, at the right elements.
    fn update(&mut self, o: OpId, reads: &[Region], writes: &[Region], current: u32) {
        let Some(g) = reads
            .iter()
            .find(|r| self.mine(r.buffer) && is_grad(self.p.buffers[r.buffer].kind))
            .copied()
        else {
            return;
        };
        let Some(w) = writes
            .iter()
            .find(|r| {
                self.p.buffers[r.buffer].kind == BufferKind::ParamShard && self.mine(r.buffer)
            })
            .copied()
        else {
            return;
        };
        if !self.optimizer_grad_complete(o, &g, "update") {
            return;
        }
        let sh = self.layout.shard;
        let os = self.p.layers[self.layer].padded / sh.optimizer.size();
        for rank in self.op_ranks(o) {
            let want_elem = self.layout.index(ShardIndex::Optimizer, rank) * os;
            let (wa, wz) = range(&w, self.layout, rank);
            let held = self.read(w.buffer, rank, wa, wz);
            let dp = self.elem_bytes(w.buffer);
            match held.as_slice() {
                [Seg {
                    val: Val::Param { elem, version },
                    start: 0,
                    end,
                }] if *elem == want_elem && *version == current && *end == os * dp => {}
                _ => {
                    let what = describe(&held, dp);
                    self.error(o, format!("update on rank {rank} writes {}[{wa}..{wz}] holding {what}, not its optimizer shard's {os} parameters from element {want_elem}", w.buffer));
                    return;
                }
            }
            let new = vec![Seg {
                start: 0,
                end: wz - wa,
                val: Val::Param {
                    elem: want_elem,
                    version: current + 1,
                },
            }];
            self.write(w.buffer, rank, wa, wz - wa, &new);
        }
    }

    /// Region `g` holds, on every rank, exactly the gradient elements of the rank's optimizer shard
    /// of this layer, each with all dp × M contributions; else an error for `what` (the op kind).
    fn optimizer_grad_complete(&mut self, o: OpId, g: &Region, what: &str) -> bool {
        let sh = self.layout.shard;
        let os = self.p.layers[self.layer].padded / sh.optimizer.size();
        let m_all = self.p.micro_steps;
        let name = self.op_layer_name(o);
        for rank in self.op_ranks(o) {
            let want_elem = self.layout.index(ShardIndex::Optimizer, rank) * os;
            let (a, z) = range(g, self.layout, rank);
            let segs = self.read(g.buffer, rank, a, z);
            let dg = self.elem_bytes(g.buffer);
            let contiguous = segs.first().is_some_and(|s| s.start == 0)
                && segs.last().is_some_and(|s| s.end == os * dg)
                && segs.windows(2).all(|w| w[0].end == w[1].start);
            let grads: Option<Vec<(u64, u32, u64)>> = segs
                .iter()
                .map(|s| match s.val {
                    Val::Grad { elem, contrib } => Some((elem, contrib, s.start / dg)),
                    Val::Param { .. } => None,
                })
                .collect();
            let Some(grads) =
                grads.filter(|g| contiguous && g.iter().all(|(e, _, at)| *e == g[0].0 + at))
            else {
                let held = describe(&segs, dg);
                self.error(o, format!("{what} of {name} on rank {rank} reads {} holding {held}, not the {os} gradient elements of its optimizer shard", g.buffer));
                return false;
            };
            let elem = grads[0].0;
            if elem != want_elem {
                self.error(o, format!("{what} on rank {rank} gets gradient elements from {elem}, but its optimizer shard starts at element {want_elem}"));
                return false;
            }
            for (&(elem, contrib, _), s) in grads.iter().zip(&segs) {
                let elems = (elem, elem + (s.end - s.start) / dg);
                if let Some(msg) = self.incomplete(contrib, m_all, elems) {
                    self.error(o, format!("{what} of {name} on rank {rank}: {msg}"));
                    return false;
                }
            }
        }
        true
    }

    /// The other layers whose backward writes this layer's gradient (a tied head's, into its
    /// embedding's): each with the elements it writes.
    fn other_terms(&self, ops: &[OpId]) -> Vec<(u32, u64, u64)> {
        let mut out = vec![];
        for &o in ops {
            let op = &self.p.ops[o];
            let backward = matches!(
                op.kind,
                OpKind::Compute(ComputeKind::Backward | ComputeKind::BackwardWeight)
            );
            let Some(t) = op.layer.filter(|&t| backward && t != self.layer) else {
                continue;
            };
            for w in &op.writes {
                let b = &self.p.buffers[w.buffer];
                if let (true, true, Offset::Fixed(at)) =
                    (self.mine(w.buffer), is_grad(b.kind), w.offset)
                {
                    let d = b.dtype.bytes();
                    let term = (t.as_u32(), at / d, (at + w.bytes) / d);
                    if !out.contains(&term) {
                        out.push(term);
                    }
                }
            }
        }
        out
    }

    /// What is missing from a complete set over elements `elems` (the layer's own term and every
    /// other term that writes these elements present, each with every rank in every
    /// micro-step).
    fn incomplete(&self, c: u32, micro_steps: u32, elems: (u64, u64)) -> Option<String> {
        let terms = self.contribs.terms(c);
        if terms.iter().any(|t| t & ROWS != 0) {
            return Some(
                "elements hold only this rank's rows' part of a norm's gradient (sequence \
                 parallelism): the tensor group's all-reduce of it never ran"
                    .into(),
            );
        }
        if !terms.contains(&self.layer.as_u32()) {
            return Some("the layer's own gradient never arrives".into());
        }
        if let Some(&(t, lo, hi)) = self
            .coverage
            .iter()
            .find(|&&(t, lo, hi)| !terms.contains(&t) && lo < elems.1 && elems.0 < hi)
        {
            let name = self
                .p
                .layers
                .get(LayerId::from_u32(t))
                .map_or_else(|| format!("layer{t}"), |l| l.name.clone());
            return Some(format!(
                "{name}'s backward (layer {t}) writes its gradient into elements {lo}..{hi}, but it never arrives"
            ));
        }
        for t in terms {
            for m in 0..micro_steps {
                let Some(ranks) = self.contribs.ranks(c, t, m) else {
                    return Some(format!(
                        "no contribution of micro-step {m} (from layer{t}'s backward) arrives"
                    ));
                };
                // Each term's backward runs on the d ranks of its stage holding one tensor
                // slice (every rank of the stage with t = 1).
                let have = ranks.count();
                let d = self.layout.dp_size();
                let first = ranks.first();
                let (stage, tp) = (self.layout.stage(first), self.layout.tp_index(first));
                let missing = (0..d)
                    .map(|dp| self.layout.rank_of(stage, dp, tp))
                    .find(|&r| !ranks.contains(r));
                if have != d || missing.is_some() {
                    let missing =
                        missing.map_or(String::new(), |r| format!(" (rank {r}'s is missing)"));
                    return Some(format!(
                        "{have} of {d} ranks' contributions of micro-step {m} arrive{missing}"
                    ));
                }
            }
        }
        None
    }

    /// Elementwise sum of two gradient contents over the same bytes and elements.
    fn add(&mut self, o: OpId, a: &[Seg], b: &[Seg], buf: BufferId) -> Option<Contents> {
        let mut sum = vec![];
        self.add_into(o, a, b, buf, &mut sum).then_some(sum)
    }

    /// [`Run::add`] into `out` (replacing what it held); false, with the error recorded, when
    /// the sum is refused.
    fn add_into(
        &mut self,
        o: OpId,
        a: &[Seg],
        b: &[Seg],
        buf: BufferId,
        out: &mut Contents,
    ) -> bool {
        // The usual case, one gradient range onto another of the same elements, needs no cuts.
        // Anything else, a failed union included, takes the general path below (which fails
        // the same way: a failed union leaves the interned sets as they were).
        if let (Some((ea, ca, la)), Some((eb, cb, lb))) = (single_grad(a), single_grad(b)) {
            if (ea, la) == (eb, lb) && la > 0 {
                if let Ok(c) = self.contribs.union(ca, cb) {
                    out.clear();
                    out.push(Seg {
                        start: 0,
                        end: la,
                        val: Val::Grad {
                            elem: ea,
                            contrib: c,
                        },
                    });
                    return true;
                }
            }
        }
        match self.add_cut(o, a, b, buf) {
            Some(sum) => {
                *out = sum;
                true
            }
            None => false,
        }
    }

    /// [`Run::add`] in general: both sides cut where either changes.
    fn add_cut(&mut self, o: OpId, a: &[Seg], b: &[Seg], buf: BufferId) -> Option<Contents> {
        let d = self.elem_bytes(buf);
        let len = |x: &[Seg]| x.last().map_or(0, |s| s.end);
        let covered = |x: &[Seg]| {
            x.first().is_some_and(|s| s.start == 0) && x.windows(2).all(|w| w[0].end == w[1].start)
        };
        if !covered(a) || !covered(b) || len(a) != len(b) {
            self.error(
                o,
                format!(
                    "adds {} onto {} in {buf}: both must be whole gradient ranges of one size",
                    describe(b, d),
                    describe(a, d)
                ),
            );
            return None;
        }
        let mut cuts: Vec<u64> = a.iter().chain(b).flat_map(|s| [s.start, s.end]).collect();
        cuts.sort_unstable();
        cuts.dedup();
        let mut out = vec![];
        for w in cuts.windows(2) {
            let (x, y) = (slice(a, w[0], w[1], d), slice(b, w[0], w[1], d));
            let (Some(x), Some(y)) = (single_grad(&x), single_grad(&y)) else {
                self.error(
                    o,
                    format!(
                        "adds into {buf} something that is not a gradient: {} + {}",
                        describe(a, d),
                        describe(b, d)
                    ),
                );
                return None;
            };
            if x.0 != y.0 {
                self.error(
                    o,
                    format!(
                        "adds gradient elements from {} onto elements from {} in {buf}",
                        y.0, x.0
                    ),
                );
                return None;
            }
            match self.contribs.union(x.1, y.1) {
                Ok(c) => out.push(Seg {
                    start: w[0],
                    end: w[1],
                    val: Val::Grad {
                        elem: x.0,
                        contrib: c,
                    },
                }),
                Err((t, m, r)) => {
                    self.error(o, format!("rank {r}'s gradient of micro-step {m} (from layer{t}'s backward) is added twice into {buf}"));
                    return None;
                }
            }
        }
        Some(merge(out, d))
    }

    /// One call of a collective, each member stage with its own op and regions (`members`: one
    /// for a collective inside a stage, one per stage for one spanning stages).
    fn collective(&mut self, members: &[(OpId, CollectiveOp)]) {
        let Some(&(o, c)) = members.first() else {
            return;
        };
        // Point-to-point transfers move hidden states, never a layer's parameters or gradients
        // (the pipeline proofs follow them); a tensor group's sums of partial activations are
        // the flow proof's.
        let partial = |c: &CollectiveOp| {
            matches!(
                self.p.buffers[c.output.buffer].kind,
                BufferKind::Partial | BufferKind::Hidden
            )
        };
        if c.kind.is_point_to_point()
            || members.iter().all(|(_, c)| partial(c))
            || !members
                .iter()
                .any(|(_, c)| self.mine(c.input.buffer) || self.mine(c.output.buffer))
        {
            return;
        }
        let p = self.p;
        let layout = self.layout;
        let comm = &p.comms[c.comm];
        if self.mixed[c.comm.index()] && self.rows_summed(o, &c) {
            return;
        }
        if self.mixed[c.comm.index()] {
            self.error(
                o,
                format!(
                    "{} over {} ({}) sums or moves a layer's parameters or gradients across tensor \
                     indices: each tensor index holds its own slices",
                    c.kind.name(),
                    c.comm,
                    comm.name
                ),
            );
            return;
        }
        let d_out = self.elem_bytes(c.output.buffer);
        let mut out: Contents = vec![];
        // Each member's regions are those of its stage's op.
        let of = |r: u32| -> &CollectiveOp {
            let s = layout.stage(r);
            members
                .iter()
                .find(|(m, _)| p.streams[p.ops[*m].stream].stage == s)
                .map_or(&members[0].1, |(_, c)| c)
        };
        // Only the groups of the members' stages run it.
        let stages: Vec<u32> = members
            .iter()
            .map(|(m, _)| p.streams[p.ops[*m].stream].stage)
            .collect();
        // The groups of tensor index 0 (see `Run::stage_ranks`).
        for g in comm
            .groups
            .iter()
            .filter(|g| stages.contains(&layout.stage(g[0])) && layout.tp_index(g[0]) == 0)
        {
            let gs = g.len() as u64;
            if c.kind == Collective::AllGather {
                // Member j's input lands as chunk j of every member's output.
                let chunk = c.output.bytes / gs;
                out.clear();
                for (j, &r) in g.iter().enumerate() {
                    let (a, z) = range(&of(r).input, self.layout, r);
                    for s in self.view(of(r).input.buffer, r, a, z) {
                        let s = Seg {
                            start: s.start + j as u64 * chunk,
                            end: s.end + j as u64 * chunk,
                            val: s.val,
                        };
                        push_merged(&mut out, s, d_out);
                    }
                }
                for &r in g {
                    let (a, z) = range(&of(r).output, self.layout, r);
                    self.write(of(r).output.buffer, r, a, z - a, &out);
                }
                continue;
            }
            let inputs: Vec<Contents> = g
                .iter()
                .map(|&r| {
                    let (a, z) = range(&of(r).input, self.layout, r);
                    self.read(of(r).input.buffer, r, a, z)
                })
                .collect();
            match c.kind {
                Collective::AllGather => unreachable!("handled above"),
                Collective::ReduceScatter | Collective::AllReduce => {
                    let parts = if c.kind == Collective::ReduceScatter {
                        gs
                    } else {
                        1
                    };
                    let chunk = c.input.bytes / parts;
                    let d = self.elem_bytes(c.input.buffer);
                    let mut memo: FxHashMap<Vec<u32>, u32> = FxHashMap::default();
                    let mut results = Vec::with_capacity(parts as usize);
                    // Every member holding one gradient range over the whole input: one fold serves
                    // every chunk.
                    let whole: Option<Vec<(u64, u32)>> = inputs
                        .iter()
                        .map(|i| {
                            single_grad(i)
                                .filter(|g| g.2 == c.input.bytes)
                                .map(|(e, c, _)| (e, c))
                        })
                        .collect();
                    if let Some(w) = whole.filter(|w| w.iter().all(|(e, _)| *e == w[0].0)) {
                        let full = [Seg {
                            start: 0,
                            end: c.input.bytes,
                            val: Val::Grad {
                                elem: w[0].0,
                                contrib: w[0].1,
                            },
                        }];
                        let Some(folded) = self.reduce_chunk(
                            o,
                            &w.iter()
                                .map(|&(e, c)| {
                                    vec![Seg {
                                        val: Val::Grad {
                                            elem: e,
                                            contrib: c,
                                        },
                                        ..full[0]
                                    }]
                                })
                                .collect::<Vec<_>>(),
                            (0, c.input.bytes),
                            d,
                            c.input.buffer,
                            &mut memo,
                        ) else {
                            return;
                        };
                        for j in 0..parts {
                            results.push(slice(&folded, j * chunk, (j + 1) * chunk, d));
                        }
                    }
                    for j in (results.len() as u64)..parts {
                        match self.reduce_chunk(
                            o,
                            &inputs,
                            (j * chunk, (j + 1) * chunk),
                            d,
                            c.input.buffer,
                            &mut memo,
                        ) {
                            Some(r) => results.push(r),
                            None => return,
                        }
                    }
                    for (j, &r) in g.iter().enumerate() {
                        let res = &results[if parts == 1 { 0 } else { j }];
                        let (a, z) = range(&of(r).output, self.layout, r);
                        self.write(of(r).output.buffer, r, a, z - a, res);
                    }
                }
                Collective::Broadcast | Collective::Send | Collective::Recv => {}
            }
        }
    }
}

impl Run<'_> {
    /// Sequence parallelism's all-reduce of norm gradients over the tensor groups: in place,
    /// over gradient elements holding only rows' parts ([`ROWS`]), which it completes. False
    /// (nothing done) when `c` is not such an all-reduce; an error when it sums anything else.
    fn rows_summed(&mut self, o: OpId, c: &CollectiveOp) -> bool {
        let p = self.p;
        let sums = c.kind == Collective::AllReduce
            && p.layout.sequence
            && c.input == c.output
            && is_grad(p.buffers[c.output.buffer].kind)
            && crate::flow::is_tensor_comm(p, c.comm);
        if !sums {
            return false;
        }
        let d = self.elem_bytes(c.output.buffer);
        // Each tensor group's lead stands for its group (see `Run::stage_ranks`).
        for rank in self.op_ranks(o) {
            let (a, z) = range(&c.output, self.layout, rank);
            let mut segs = self.read(c.output.buffer, rank, a, z);
            for s in &mut segs {
                let summed = match s.val {
                    Val::Grad { elem, contrib } => self
                        .contribs
                        .cleared(contrib, ROWS)
                        .map(|contrib| Val::Grad { elem, contrib }),
                    Val::Param { .. } => None,
                };
                let Some(v) = summed else {
                    let held = describe(std::slice::from_ref(s), d);
                    self.error(
                        o,
                        format!(
                            "all_reduce over the tensor group ({}) of {}'s gradient holds {held}: \
                             only a norm's rows' parts (sequence parallelism) are summed over \
                             the tensor group, once; every rank holds its own slices of the rest",
                            p.comms[c.comm].name, p.layers[self.layer].name
                        ),
                    );
                    return true;
                };
                s.val = v;
            }
            self.write(c.output.buffer, rank, a, z - a, &segs);
        }
        true
    }

    /// The sum over members of bytes `[a, z)` of their inputs. When every member holds one gradient
    /// range there with the same elements, only the contribution sets are combined, and a fold
    /// seen before (the same sets in the same order) is reused.
    fn reduce_chunk(
        &mut self,
        o: OpId,
        inputs: &[Contents],
        (a, z): (u64, u64),
        d: u64,
        buf: BufferId,
        memo: &mut FxHashMap<Vec<u32>, u32>,
    ) -> Option<Contents> {
        let pieces: Vec<Contents> = inputs.iter().map(|segs| slice(segs, a, z, d)).collect();
        let uniform: Option<Vec<(u64, u32)>> = pieces
            .iter()
            .map(|p| {
                single_grad(p)
                    .filter(|g| g.2 == z - a)
                    .map(|(e, c, _)| (e, c))
            })
            .collect();
        if let Some(u) = uniform.filter(|u| u.iter().all(|(e, _)| *e == u[0].0)) {
            let ids: Vec<u32> = u.iter().map(|(_, c)| *c).collect();
            let contrib = match memo.get(&ids) {
                Some(&c) => c,
                None => match self.contribs.union_all(&ids) {
                    Ok(acc) => {
                        memo.insert(ids, acc);
                        acc
                    }
                    Err((t, m, r)) => {
                        self.error(o, format!("rank {r}'s gradient of micro-step {m} (from layer{t}'s backward) is added twice into {buf}"));
                        return None;
                    }
                },
            };
            return Some(vec![Seg {
                start: 0,
                end: z - a,
                val: Val::Grad {
                    elem: u[0].0,
                    contrib,
                },
            }]);
        }
        let mut acc: Option<Contents> = None;
        for piece in pieces {
            acc = Some(match acc {
                None => piece,
                Some(prev) => self.add(o, &prev, &piece, buf)?,
            });
        }
        Some(acc.unwrap_or_default())
    }
}

fn is_param(k: BufferKind) -> bool {
    matches!(k, BufferKind::ParamShard | BufferKind::Gathered)
}

fn is_grad(k: BufferKind) -> bool {
    matches!(
        k,
        BufferKind::GradShard | BufferKind::FullGrad | BufferKind::Staging
    )
}

/// A content that is one gradient range: (first element, contributions, bytes).
fn single_grad(s: &[Seg]) -> Option<(u64, u32, u64)> {
    match s {
        [Seg {
            start: 0,
            end,
            val: Val::Grad { elem, contrib },
        }] => Some((*elem, *contrib, *end)),
        _ => None,
    }
}

/// Bytes `[a, z)` of a content, rebased at 0, as they come.
fn slice_iter(segs: &[Seg], a: u64, z: u64, d: u64) -> impl Iterator<Item = Seg> + '_ {
    segs.iter()
        .filter(move |s| s.end > a && s.start < z)
        .map(move |s| {
            let (lo, hi) = (s.start.max(a), s.end.min(z));
            Seg {
                start: lo - a,
                end: hi - a,
                val: s.val.advanced((lo - s.start) / d),
            }
        })
}

/// Bytes `[a, z)` of a content, rebased at 0.
fn slice(segs: &[Seg], a: u64, z: u64, d: u64) -> Contents {
    segs.iter()
        .filter(|s| s.end > a && s.start < z)
        .map(|s| {
            let (lo, hi) = (s.start.max(a), s.end.min(z));
            let skip = (lo - s.start) / d;
            let val = s.val.advanced(skip);
            Seg {
                start: lo - a,
                end: hi - a,
                val,
            }
        })
        .collect()
}

/// Replaces bytes `[at, at+len)` of a content with `new` (rebased at 0).
fn splice(segs: Contents, at: u64, len: u64, new: &[Seg], d: u64) -> Contents {
    let mut out = slice(&segs, 0, at, d);
    out.extend(new.iter().map(|s| Seg {
        start: s.start + at,
        end: s.end + at,
        val: s.val,
    }));
    let total = segs.last().map_or(0, |s| s.end);
    out.extend(slice(&segs, at + len, total, d).into_iter().map(|s| Seg {
        start: s.start + at + len,
        end: s.end + at + len,
        val: s.val,
    }));
    merge(out, d)
}

/// Joins neighbouring segments that continue each other.
fn merge(segs: Contents, d: u64) -> Contents {
    let mut out: Contents = Vec::with_capacity(segs.len());
    for s in segs {
        push_merged(&mut out, s, d);
    }
    out
}

/// Appends `s` to `out`, extending the last segment when `s` continues it.
fn push_merged(out: &mut Contents, s: Seg, d: u64) {
    if let Some(last) = out.last_mut() {
        let continues = last.end == s.start
            && match (last.val, s.val) {
                (
                    Val::Param {
                        elem: e1,
                        version: v1,
                    },
                    Val::Param {
                        elem: e2,
                        version: v2,
                    },
                ) => v1 == v2 && e1 + (last.end - last.start) / d == e2,
                (
                    Val::Grad {
                        elem: e1,
                        contrib: c1,
                    },
                    Val::Grad {
                        elem: e2,
                        contrib: c2,
                    },
                ) => c1 == c2 && e1 + (last.end - last.start) / d == e2,
                _ => false,
            };
        if continues {
            last.end = s.end;
            return;
        }
    }
    out.push(s);
}

fn describe(segs: &[Seg], d: u64) -> String {
    if segs.is_empty() {
        return "nothing written".into();
    }
    let parts: Vec<String> = segs
        .iter()
        .take(3)
        .map(|s| {
            let n = (s.end - s.start) / d;
            match s.val {
                Val::Param { elem, version } => format!("params {elem}..{} v{version}", elem + n),
                Val::Grad { elem, .. } => format!("grads {elem}..{}", elem + n),
            }
        })
        .collect();
    let more = if segs.len() > 3 { ", …" } else { "" };
    format!("[{}{more}]", parts.join(", "))
}

/// Gradient clipping (see the IR module doc): the buffers `grad_norm` ops write.
pub(crate) fn norm_buffers(p: &Program) -> Vec<BufferId> {
    let mut out: Vec<BufferId> = p
        .ops
        .values()
        .filter(|op| op.kind == OpKind::Compute(ComputeKind::GradNorm))
        .flat_map(|op| op.writes.iter().filter(|w| !p.is_workspace(w)))
        .map(|w| w.buffer)
        .collect();
    out.sort_unstable();
    out.dedup();
    out
}

/// Gradient clipping's norm, by abstract execution over every rank: at most one `grad_norm` per
/// pipeline stage, reading one optimizer-shard gradient region of every layer of its stage with
/// parameters (whose completeness the per-layer run checks; a replica head's copy, whose
/// gradient equals its embedding's, is not read) and writing one fp32 element; only it and
/// in-place all-reduces write that element, each summing disjoint sets of (stage, optimizer
/// shard); and, when there is a norm, every update reads it whole (its third read) holding the
/// sum over all s_os optimizer shards of every stage. Stages meet in all-reduces spanning them
/// as [`super::joint`] orders them.
pub fn check_norm(p: &Program) -> Vec<VerifyError> {
    let layout = p.layout;
    let mut errs = vec![];
    let mut err = |op: OpId, message: String| {
        if errs.len() < 8 {
            errs.push(VerifyError {
                op: Some(op),
                message,
            })
        }
    };
    let norms = norm_buffers(p);
    let stage_of = |o: OpId| p.streams[p.ops[o].stream].stage;
    let stages = layout.stages.max(1);
    let mut norm_of_stage: Vec<Option<OpId>> = vec![None; stages as usize];
    for (id, op) in p.ops.iter() {
        if op.kind != OpKind::Compute(ComputeKind::GradNorm) {
            continue;
        }
        if norm_of_stage[stage_of(id) as usize].replace(id).is_some() {
            err(
                id,
                match stages {
                    1 => "a second grad_norm: the step computes its gradient norm once".into(),
                    _ => format!("a second grad_norm on stage {}: each stage computes its part of the norm once", stage_of(id)),
                },
            );
            return errs;
        }
    }
    if norm_of_stage.iter().all(Option::is_none) {
        return errs;
    }
    // Each layer's stage: that of its forward (a replica on another stage is not counted).
    let mut home: Vec<Option<u32>> = vec![None; p.layers.len()];
    for (id, op) in p.ops.iter() {
        if let (OpKind::Compute(ComputeKind::Forward | ComputeKind::ForwardOpen(0)), Some(l)) =
            (&op.kind, op.layer)
        {
            home[l.index()] = Some(stage_of(id));
        }
    }
    let s_os = p.layout.shard.optimizer.size();
    // A slot per (stage, tensor index, optimizer shard): with t > 1 each tensor index's norm
    // holds its slices' squares (the replicated tensors' on tensor index 0 alone: `grad_norm`'s
    // convention, IR module doc).
    let t = u64::from(layout.tensor.max(1));
    let slots = s_os * u64::from(stages) * t;
    let words = (slots as usize).div_ceil(64);
    let meetings = super::joint::Meetings::of(p);
    let ops: Vec<OpId> = p.ops.keys().collect();
    let items = match meetings.order(p, &ops) {
        Ok(items) => items,
        Err(o) => {
            err(
                o,
                "the stages never all reach this collective together".into(),
            );
            return errs;
        }
    };
    // Per rank, the (stage, optimizer shard)s whose squares the norm holds (absent: never
    // written).
    let mut held: HashMap<(BufferId, u32), Vec<u64>> = HashMap::new();
    for item in items {
        let (id, members): (OpId, Vec<(OpId, CollectiveOp)>) = match item {
            super::joint::Item::One(id) => (id, vec![]),
            super::joint::Item::Joint(ids) => (
                ids[0],
                ids.iter()
                    .flat_map(|&o| p.ops[o].collectives().iter().map(move |c| (o, *c)))
                    .filter(|(_, c)| !c.kind.is_point_to_point())
                    .collect(),
            ),
        };
        let op = &p.ops[id];
        let writes_norm = op.writes.iter().any(|w| norms.contains(&w.buffer));
        let stage = stage_of(id);
        let n = layout.stage_size();
        let ranks = stage * n..(stage + 1) * n;
        match &op.kind {
            OpKind::Compute(ComputeKind::GradNorm) => {
                // Its workspace is scratch, not a value (see the IR module doc).
                let data: Vec<&Region> = op.writes.iter().filter(|w| !p.is_workspace(w)).collect();
                let [w] = data.as_slice() else {
                    err(id, "grad_norm must write exactly one region".into());
                    continue;
                };
                let b = &p.buffers[w.buffer];
                if b.dtype != sched_ir::job::Dtype::Fp32
                    || b.bytes != 4
                    || w.offset != Offset::Fixed(0)
                    || w.bytes != 4
                    || b.layer.is_some()
                {
                    err(id, format!("grad_norm writes {}, not the whole of a one-element fp32 buffer of no layer", w.buffer));
                    continue;
                }
                let mut read = vec![0u32; p.layers.len()];
                for r in &op.reads {
                    match p.buffers[r.buffer].layer {
                        Some(l) if is_grad(p.buffers[r.buffer].kind) => read[l.index()] += 1,
                        _ => err(
                            id,
                            format!("grad_norm reads {}, which is no layer's gradient", r.buffer),
                        ),
                    }
                }
                for (l, info) in p.layers.iter() {
                    let here = home[l.index()].unwrap_or(0) == stage;
                    let want = u32::from(info.params > 0 && here);
                    if read[l.index()] != want {
                        let why = match here {
                            false => format!(
                                ": stage {} runs it, and a replica's gradient equals the layer's",
                                home[l.index()].unwrap_or(0)
                            ),
                            true => String::new(),
                        };
                        err(
                            id,
                            format!(
                                "grad_norm{} reads {} gradient regions of {}, not {want}{why}",
                                match stages {
                                    1 => String::new(),
                                    _ => format!(" on stage {stage}"),
                                },
                                read[l.index()],
                                info.name
                            ),
                        );
                    }
                }
                for rank in ranks {
                    let mut bits = vec![0u64; words];
                    let k = ((u64::from(stage) * t + u64::from(layout.tp_index(rank))) * s_os
                        + layout.index(ShardIndex::Optimizer, rank))
                        as usize;
                    bits[k / 64] |= 1 << (k % 64);
                    held.insert((w.buffer, rank), bits);
                }
            }
            OpKind::Collective(_) | OpKind::Group(_) if writes_norm => {
                let members = match members.is_empty() {
                    true => op.collectives().iter().map(|c| (id, *c)).collect(),
                    false => members,
                };
                let c = members[0].1;
                let of = |r: u32| -> CollectiveOp {
                    members
                        .iter()
                        .find(|(m, _)| stage_of(*m) == layout.stage(r))
                        .map_or(c, |(_, c)| *c)
                };
                if members
                    .iter()
                    .any(|(_, c)| c.kind != Collective::AllReduce || c.input != c.output)
                {
                    err(id, format!("{} writes the gradient norm {}: only grad_norm and an in-place all_reduce may", c.kind.name(), c.output.buffer));
                    continue;
                }
                let in_members: Vec<u32> = members.iter().map(|(m, _)| stage_of(*m)).collect();
                for g in p.comms[c.comm]
                    .groups
                    .iter()
                    .filter(|g| in_members.contains(&layout.stage(g[0])))
                {
                    let mut sum = vec![0u64; words];
                    for &r in g {
                        let b = of(r).output.buffer;
                        let Some(bits) = held.get(&(b, r)) else {
                            err(id, format!("all_reduce of the gradient norm reads {b} on rank {r} before grad_norm writes it"));
                            return errs;
                        };
                        if sum.iter().zip(bits).any(|(s, x)| s & x != 0) {
                            err(id, format!("all_reduce of the gradient norm counts an optimizer shard twice (rank {r} of a group starting at rank {})", g[0]));
                            return errs;
                        }
                        sum.iter_mut().zip(bits).for_each(|(s, x)| *s |= x);
                    }
                    for &r in g {
                        held.insert((of(r).output.buffer, r), sum.clone());
                    }
                }
            }
            _ if writes_norm => {
                err(id, format!("{} writes the gradient norm: only grad_norm and an in-place all_reduce may", op.kind_name()));
            }
            OpKind::Compute(ComputeKind::Update) => {
                let Some(r) = op.reads.get(2).filter(|r| {
                    norms.contains(&r.buffer)
                        && r.offset == Offset::Fixed(0)
                        && r.bytes == p.buffers[r.buffer].bytes
                }) else {
                    err(id, "update does not read the gradient norm whole as its third read, though the step clips gradients".into());
                    continue;
                };
                for rank in ranks {
                    let have = held
                        .get(&(r.buffer, rank))
                        .map_or(0, |bits| bits.iter().map(|w| w.count_ones()).sum::<u32>());
                    if u64::from(have) != slots {
                        let over = match (stages, t) {
                            (1, 1) => format!("the {s_os} optimizer shards"),
                            (_, 1) => format!("the {slots} optimizer shards of {stages} stages"),
                            _ => format!(
                                "the {slots} optimizer shards of {stages} stages and {t} tensor indices"
                            ),
                        };
                        err(id, format!("update on rank {rank} reads a gradient norm summed over {have} of {over}"));
                        break;
                    }
                }
            }
            _ => {}
        }
    }
    errs
}
