//! Static memory planning (lowering spec §6; ZeRO §VI-C, MiCS §4): one arena per rank, every buffer
//! at a fixed offset, no allocator at run time.
//!
//! Reads regions, streams and waits; writes `Buffer::offset` and `Program::arena_bytes`. Persistent
//! buffers (param, grad and optimizer shards) sit at the bottom, never shared. Transient buffers
//! above them, at 256-byte-aligned offsets where each overlaps no placed buffer that might be in
//! use at the same time: two buffers share bytes only when every access to one happens-before
//! every access to the other (vector clocks, see [`super::hb`]). Candidates are narrowed by each
//! buffer's span of issue positions, from its first access to where every stream has seen it
//! finish. A buffer no op touches gets no space.
//!
//! With pipeline stages, each stage's buffers live on other ranks than every other stage's, so
//! each stage is planned on its own (over the program cut down to its ops) from offset 0 (for a
//! large program on as many threads as there are cores), and the arena is the largest stage's.
//!
//! - `place`: one greedy placement of units (single buffers, or slots of equal-size buffers
//!   used in turn) in a given order and fit;
//! - `search`: which placements are tried and which is kept (deterministic);
//! - `bound`: the lower bound `plan_tightness` is measured against (bytes simultaneously alive).

mod bound;
mod place;
mod search;

pub use bound::lower_bound;

use super::hb::Clocks;
use cranelift_entity::{EntityRef, SecondaryMap};
use sched_ir::ir::*;

/// Alignment of every buffer's offset (what CUDA allocations and vector loads want).
pub const ALIGN: u64 = 256;

/// When each transient buffer is in use, as vector-clock facts. The per-stream rows of all
/// buffers lie in two flat tables (buffers × streams): placement asks [`Lifetimes::dead_before`]
/// for every pair of buffers it checks, so the rows are read without chasing a pointer each.
pub struct Lifetimes {
    /// First op (issue order) touching each buffer.
    pub first: SecondaryMap<BufferId, Option<OpId>>,
    streams: usize,
    /// Per buffer and stream, the position of the first op touching the buffer (0: none).
    first_seq: Vec<u32>,
    /// Per buffer and stream, the position of the last op touching the buffer (0: none).
    last: Vec<u32>,
    /// Per buffer and stream, the least over the ops touching the buffer of how many ops of that
    /// stream happen strictly before the op (`u32::MAX` for a buffer no op touches).
    min_clock: Vec<u32>,
    /// Issue position of the last op touching each buffer (by buffer index).
    pub last_index: Vec<usize>,
}

impl Lifetimes {
    pub fn new(p: &Program, clocks: &Clocks) -> Self {
        let s = clocks.streams();
        let mut l = Lifetimes {
            first: SecondaryMap::new(),
            streams: s,
            first_seq: vec![0; p.buffers.len() * s],
            last: vec![0; p.buffers.len() * s],
            min_clock: vec![u32::MAX; p.buffers.len() * s],
            last_index: vec![0; p.buffers.len()],
        };
        let mut before = vec![0; s];
        for (id, op) in p.ops.iter() {
            before.copy_from_slice(clocks.clock(id));
            before[op.stream.index()] -= 1;
            for r in op.reads.iter().chain(&op.writes) {
                let b = r.buffer;
                if l.first[b].is_none() {
                    l.first[b] = Some(id);
                }
                l.last_index[b.index()] = id.index();
                let rows = b.index() * s..(b.index() + 1) * s;
                let first = &mut l.first_seq[rows.clone()][op.stream.index()];
                if *first == 0 {
                    *first = clocks.seq(id);
                }
                let last = &mut l.last[rows.clone()][op.stream.index()];
                *last = (*last).max(clocks.seq(id));
                l.min_clock[rows]
                    .iter_mut()
                    .zip(&before)
                    .for_each(|(m, &c)| *m = (*m).min(c));
            }
        }
        l
    }

    /// Per stream, the position of the first op touching `b` (0: none).
    pub fn first_seq(&self, b: BufferId) -> &[u32] {
        &self.first_seq[b.index() * self.streams..(b.index() + 1) * self.streams]
    }

    /// Per stream, the position of the last op touching `b` (0: none).
    pub fn last(&self, b: BufferId) -> &[u32] {
        &self.last[b.index() * self.streams..(b.index() + 1) * self.streams]
    }

    fn min_clock(&self, b: BufferId) -> &[u32] {
        &self.min_clock[b.index() * self.streams..(b.index() + 1) * self.streams]
    }

    /// Every access to `a` happens before every access to `b`.
    pub fn dead_before(&self, a: BufferId, b: BufferId) -> bool {
        self.last(a)
            .iter()
            .zip(self.min_clock(b))
            .all(|(&last, &min)| last == 0 || min >= last)
    }
}

/// Places every buffer; returns the orderings the placement relies on (waiter, waited): each
/// buffer's first access on each stream after the last accesses, on each stream, of every buffer
/// placed before it on overlapping bytes.
pub fn run(p: &mut Program) -> Vec<(OpId, OpId)> {
    let placement = plan(p);
    apply(p, placement)
}

/// Where [`plan`] puts every buffer.
pub struct Placement {
    /// Offset of each buffer, by buffer id (persistent and transient).
    offsets: Vec<u64>,
    /// The transient buffers, in order of first access.
    transient: Vec<BufferId>,
    arena_bytes: u64,
}

/// Decides every buffer's offset without changing the program (so other work may read it
/// meanwhile); [`apply`] writes the offsets.
pub fn plan(p: &Program) -> Placement {
    if p.layout.stages <= 1 {
        return plan_stage(p, 0);
    }
    let mut all = Placement {
        offsets: vec![0; p.buffers.len()],
        transient: vec![],
        arena_bytes: 0,
    };
    for (stage, part) in (0..p.layout.stages).zip(plan_stages(p)) {
        for (id, b) in p.buffers.iter() {
            if b.stage == stage {
                all.offsets[id.index()] = part.offsets[id.index()];
            }
        }
        all.transient.extend(part.transient);
        all.arena_bytes = all.arena_bytes.max(part.arena_bytes);
    }
    // In order of first access over the whole program, as `apply` walks them.
    let first = first_access(p);
    all.transient.sort_by_key(|&b| (first[b.index()], b));
    all
}

/// Ops from which a pipeline's stages are planned on threads of their own (the 4,096-rank 3-D
/// benchmark program has 63,156; the examples and most of the planner's candidates, already
/// compiled several at once, far fewer).
const PARALLEL_OPS: usize = 20_000;

/// [`plan_stage`] of every stage, in stage order. The stages share nothing (each is planned on
/// its own program from offset 0), so for a large program on a machine with more than one core
/// they are planned on as many threads, each taking the next stage not yet taken; the result
/// does not depend on which thread planned which stage.
fn plan_stages(p: &Program) -> Vec<Placement> {
    let stages = p.layout.stages as usize;
    let one = |stage: usize| plan_stage(&stage_program(p, stage as u32), stage as u32);
    let threads = match p.ops.len() >= PARALLEL_OPS {
        true => std::thread::available_parallelism().map_or(1, |n| n.get()),
        false => 1,
    }
    .min(stages);
    let stages: Vec<usize> = (0..stages).collect();
    sched_ir::par::map(&stages, threads, |&k| one(k))
}

/// The first op touching each buffer, by buffer index (`usize::MAX`: none).
fn first_access(p: &Program) -> Vec<usize> {
    let mut first = vec![usize::MAX; p.buffers.len()];
    for (id, op) in p.ops.iter() {
        for r in op.reads.iter().chain(&op.writes) {
            let f = &mut first[r.buffer.index()];
            *f = (*f).min(id.index());
        }
    }
    first
}

/// `p` cut down to the ops of `stage`'s streams (in issue order, their events renumbered),
/// with every stream and buffer kept, so buffer ids stay; without its communicators, which
/// memory planning never reads (a 1,024-rank program's would be copied once per stage), and
/// without the names of other stages' buffers (no op of the stage touches them; naming them
/// cost one string copy per buffer and stage).
pub fn stage_program(p: &Program, stage: u32) -> Program {
    let buffers = p
        .buffers
        .values()
        .map(|b| match b.stage == stage {
            true => b.clone(),
            false => Buffer {
                name: String::new(),
                ..*b
            },
        })
        .collect();
    let mut q = Program {
        schedule: p.schedule.clone(),
        layout: p.layout,
        micro_steps: p.micro_steps,
        layers: p.layers.clone(),
        streams: p.streams.clone(),
        comms: Default::default(),
        buffers,
        events: Default::default(),
        ops: Default::default(),
        arena_bytes: p.arena_bytes,
    };
    let mut kept = 0;
    let mut event: SecondaryMap<EventId, Option<EventId>> = SecondaryMap::new();
    for op in p.ops.values() {
        if p.streams[op.stream].stage != stage {
            continue;
        }
        let mut op = op.clone();
        let new = OpId::new(kept);
        op.wait = op.wait.iter().filter_map(|&e| event[e]).collect();
        if let Some(e) = op.record {
            let mine = q.events.push(Event { recorder: new });
            event[e] = Some(mine);
            op.record = Some(mine);
        }
        q.ops.push(op);
        kept += 1;
    }
    q
}

/// [`plan`] for one stage's buffers (every buffer without a pipeline).
fn plan_stage(p: &Program, stage: u32) -> Placement {
    let clocks = Clocks::new(p);
    let life = Lifetimes::new(p, &clocks);
    let align = |x: u64| x.div_ceil(ALIGN) * ALIGN;
    let mut offsets = vec![0; p.buffers.len()];
    let mut top = 0;
    for (id, b) in p
        .buffers
        .iter()
        .filter(|(_, b)| b.kind.is_persistent() && b.stage == stage)
    {
        offsets[id.index()] = top;
        top = align(top + b.bytes);
    }
    let base = top;
    let transient = transient_by_first_access(p, &life);
    let span = spans(p, &clocks, &life, &transient);

    let best = search::plan(p, &clocks, &life, &span, &transient, base);
    for &b in &transient {
        offsets[b.index()] = best.0[b.index()];
    }
    Placement {
        offsets,
        transient,
        arena_bytes: best.1.max(top),
    }
}

/// Writes `placement`'s offsets and arena size; returns the orderings it relies on (see [`run`]).
pub fn apply(p: &mut Program, placement: Placement) -> Vec<(OpId, OpId)> {
    for (id, b) in p.buffers.iter_mut().filter(|(_, b)| b.kind.is_persistent()) {
        b.offset = placement.offsets[id.index()];
    }
    for &b in &placement.transient {
        p.buffers[b].offset = placement.offsets[b.index()];
    }
    p.arena_bytes = placement.arena_bytes;

    // Each buffer after the ones whose bytes it takes over, in order of first access.
    let (firsts, lasts) = access_ends(p);
    let mut reuse: Vec<(OpId, OpId)> = vec![];
    // One arena per stage: buffers of different stages never wait on each other.
    let mut occupants: Vec<sched_ir::intervals::Occupants<BufferId>> = vec![];
    for b in placement.transient {
        let (at, stage) = (p.buffers[b].offset, p.buffers[b].stage as usize);
        if occupants.len() <= stage {
            occupants.resize_with(stage + 1, Default::default);
        }
        for a in occupants[stage].replace(at, at + p.buffers[b].bytes, b) {
            for &waiter in firsts[b.index()].iter().flatten() {
                reuse.extend(
                    lasts[a.index()]
                        .iter()
                        .flatten()
                        .map(|&waited| (waiter, waited)),
                );
            }
        }
    }
    reuse
}

/// The transient buffers some op touches, in order of their first access.
fn transient_by_first_access(p: &Program, life: &Lifetimes) -> Vec<BufferId> {
    let mut transient: Vec<BufferId> = p
        .buffers
        .iter()
        .filter(|(id, b)| !b.kind.is_persistent() && life.first[*id].is_some())
        .map(|(id, _)| id)
        .collect();
    transient.sort_by_key(|&b| (life.first[b].map(|o| o.index()), b));
    transient
}

/// Per buffer (indexed by id), the issue positions `[first access, retired)`: from `retired` on,
/// every op on every stream happens after all its accesses. Buffers whose spans do not overlap
/// are never in use together. `transient` is sorted by first access.
fn spans(
    p: &Program,
    clocks: &Clocks,
    life: &Lifetimes,
    transient: &[BufferId],
) -> Vec<(usize, usize)> {
    let n = p.ops.len();
    let mut span = vec![(0, 0); p.buffers.len()];
    let mut by_last: Vec<(usize, BufferId)> = transient
        .iter()
        .map(|&b| (life.last_index[b.index()], b))
        .collect();
    by_last.sort_unstable();
    let mut frontier = Frontier::new(p);
    let mut pending: Vec<BufferId> = vec![];
    let mut next = 0;
    for pos in 0..=n {
        frontier.advance(pos);
        while next < by_last.len() && by_last[next].0 < pos {
            pending.push(by_last[next].1);
            next += 1;
        }
        pending.retain(|&b| {
            let done = frontier.covers(clocks, life.last(b));
            if done {
                span[b.index()].1 = pos;
            }
            !done
        });
    }
    for &b in transient {
        span[b.index()].0 = life.first[b].expect("accessed").index();
        if span[b.index()].1 == 0 {
            span[b.index()].1 = n + 1;
        }
    }
    span
}

/// Each stream's next op from some point of the issue order on.
struct Frontier {
    on_stream: Vec<Vec<OpId>>,
    cursor: Vec<usize>,
}

impl Frontier {
    fn new(p: &Program) -> Self {
        let mut on_stream = vec![vec![]; p.streams.len()];
        for (id, op) in p.ops.iter() {
            on_stream[op.stream.index()].push(id);
        }
        Frontier {
            cursor: vec![0; on_stream.len()],
            on_stream,
        }
    }

    /// Moves every stream's cursor to its first op at or after issue position `from`.
    fn advance(&mut self, from: usize) {
        for (ops, c) in self.on_stream.iter().zip(&mut self.cursor) {
            while *c < ops.len() && ops[*c].index() < from {
                *c += 1;
            }
        }
    }

    /// Every op from here on, on every stream, happens after the accesses `last` (per-stream
    /// positions): true when each stream's next op does, since clocks only grow along a stream.
    fn covers(&self, clocks: &Clocks, last: &[u32]) -> bool {
        self.on_stream
            .iter()
            .zip(&self.cursor)
            .enumerate()
            .all(|(s, (ops, &c))| {
                let Some(&op) = ops.get(c) else { return true };
                clocks.clock(op).iter().enumerate().all(|(t, &v)| {
                    let before = if t == s { v - 1 } else { v };
                    before >= last[t]
                })
            })
    }
}

/// Per buffer, its first and its last accessing op on each stream.
#[allow(clippy::type_complexity)]
fn access_ends(p: &Program) -> (Vec<Vec<Option<OpId>>>, Vec<Vec<Option<OpId>>>) {
    let s = p.streams.len();
    let mut firsts = vec![vec![None; s]; p.buffers.len()];
    let mut lasts = vec![vec![None; s]; p.buffers.len()];
    for (id, op) in p.ops.iter() {
        for r in op.reads.iter().chain(&op.writes) {
            let (b, st) = (r.buffer.index(), op.stream.index());
            firsts[b][st].get_or_insert(id);
            lasts[b][st] = Some(id);
        }
    }
    (firsts, lasts)
}
