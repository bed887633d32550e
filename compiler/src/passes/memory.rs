//! Static memory planning (lowering spec §6; ZeRO §VI-C, MiCS §4): one arena per rank, every buffer
//! at a fixed offset, no allocator at run time.
//!
//! Reads regions, streams and waits; writes `Buffer::offset` and `Program::arena_bytes`. Persistent
//! buffers (param, grad and optimizer shards) sit at the bottom, never shared. Transient buffers are
//! placed greedily by size, largest first, each at the lowest 256-byte-aligned offset where it
//! overlaps no placed buffer that might be in use at the same time: two buffers share bytes only
//! when every access to one happens-before every access to the other (vector clocks, see
//! [`super::hb`]). Candidates are narrowed by each buffer's span of issue positions, from its first
//! access to where every stream has seen it finish. A buffer no op touches gets no space.

use super::hb::Clocks;
use crate::ir::*;
use cranelift_entity::{EntityRef, SecondaryMap};

/// Alignment of every buffer's offset (what CUDA allocations and vector loads want).
pub const ALIGN: u64 = 256;

/// When each transient buffer is in use, as vector-clock facts.
pub struct Lifetimes {
    /// First op (issue order) touching each buffer.
    pub first: SecondaryMap<BufferId, Option<OpId>>,
    /// Per stream, the position of the last op touching the buffer (0: none).
    pub last: SecondaryMap<BufferId, Vec<u32>>,
    /// Per stream, the least over the ops touching the buffer of how many ops of that stream
    /// happen strictly before the op.
    pub min_clock: SecondaryMap<BufferId, Vec<u32>>,
    /// Issue position of the last op touching each buffer (by buffer index).
    pub last_index: Vec<usize>,
}

impl Lifetimes {
    pub fn new(p: &Program, clocks: &Clocks) -> Self {
        let s = clocks.streams();
        let mut l = Lifetimes {
            first: SecondaryMap::new(),
            last: SecondaryMap::new(),
            min_clock: SecondaryMap::new(),
            last_index: vec![0; p.buffers.len()],
        };
        for (id, op) in p.ops.iter() {
            let mut before = clocks.clock(id).to_vec();
            before[op.stream.index()] -= 1;
            for r in op.reads.iter().chain(&op.writes) {
                let b = r.buffer;
                if l.first[b].is_none() {
                    l.first[b] = Some(id);
                    l.last[b] = vec![0; s];
                    l.min_clock[b] = before.clone();
                }
                l.last_index[b.index()] = id.index();
                let last = &mut l.last[b][op.stream.index()];
                *last = (*last).max(clocks.seq(id));
                l.min_clock[b]
                    .iter_mut()
                    .zip(&before)
                    .for_each(|(m, &c)| *m = (*m).min(c));
            }
        }
        l
    }

    /// Every access to `a` happens before every access to `b`.
    pub fn dead_before(&self, a: BufferId, b: BufferId) -> bool {
        self.last[a]
            .iter()
            .zip(&self.min_clock[b])
            .all(|(&last, &min)| last == 0 || min >= last)
    }
}

/// Places every buffer; returns the orderings the placement relies on (waiter, waited): each
/// buffer's first access on each stream after the last accesses, on each stream, of every buffer
/// placed before it on overlapping bytes.
pub fn run(p: &mut Program) -> Vec<(OpId, OpId)> {
    let clocks = Clocks::new(p);
    let life = Lifetimes::new(p, &clocks);
    let align = |x: u64| x.div_ceil(ALIGN) * ALIGN;
    let mut top = 0;
    for b in p.buffers.values_mut().filter(|b| b.kind.is_persistent()) {
        b.offset = top;
        top = align(top + b.bytes);
    }
    let base = top;
    let transient = transient_by_first_access(p, &life);
    let span = spans(p, &clocks, &life, &transient);

    // Greedy placement in three classic orders (largest first; largest size x lifetime first;
    // first access first), each with first-fit and best-fit gaps; the smallest arena wins.
    let by_size = |b: &BufferId| {
        (
            std::cmp::Reverse(p.buffers[*b].bytes),
            span[b.index()].0,
            *b,
        )
    };
    let area = |b: &BufferId| {
        let (s0, s1) = span[b.index()];
        (
            std::cmp::Reverse(u128::from(p.buffers[*b].bytes) * (s1 - s0) as u128),
            *b,
        )
    };
    let mut orders = [transient.clone(), transient.clone(), transient.clone()];
    orders[0].sort_by_key(by_size);
    orders[1].sort_by_key(area);
    let place = |order: &[BufferId], fit: Fit| place(p, &life, &span, order, base, fit);
    let mut best = orders
        .iter()
        .flat_map(|order| [Fit::First, Fit::Best].map(|fit| (place(order, fit), order, fit)))
        .min_by_key(|((_, top), _, _)| *top)
        .map(|(placed, order, fit)| (placed, order.clone(), fit))
        .expect("six placements");
    // Improvement, within a budget of placements that shrinks as the program grows (each costs
    // about one greedy pass; the 80-layer, 16-micro-step bench gets a handful).
    let mut budget = (IMPROVE_WORK / transient.len().max(1)).min(64);
    // 1. Two-ended: the largest buffers as above, every smaller one in the highest gap below a
    //    target top, so that long-lived stacks of small buffers (hidden states, activations) sit
    //    on one side and the large working set on the other; the target is found by bisection,
    //    for each of the three largest sizes as the split.
    let mut sizes: Vec<u64> = transient.iter().map(|b| p.buffers[*b].bytes).collect();
    sizes.sort_unstable_by(|a, b| b.cmp(a));
    sizes.dedup();
    for &split in sizes.iter().take(3) {
        let (mut lo, mut hi) = (base, best.0 .1);
        for _ in 0..8 {
            if budget == 0 || hi - lo <= ALIGN {
                break;
            }
            budget -= 1;
            let target = lo + (hi - lo) / 2;
            let r = place(&orders[0], Fit::TwoEnded { split, target });
            if r.1 <= target {
                hi = target;
            } else {
                lo = target;
            }
            if r.1 < best.0 .1 {
                best = (r, orders[0].clone(), Fit::TwoEnded { split, target });
            }
        }
    }
    // 2. Repair ("squeaky wheel"): the buffers that reach the top of the best placement go first
    //    in its order, and it is placed again; kept when lower.
    let (mut order, mut placed) = (best.1.clone(), best.0.clone());
    while budget > 0 {
        budget -= 1;
        let top = placed.1;
        let (mut front, rest): (Vec<BufferId>, Vec<BufferId>) = order
            .iter()
            .partition(|b| align(placed.0[b.index()] + p.buffers[**b].bytes) >= top);
        if rest.is_empty() {
            break;
        }
        front.extend(rest);
        order = front;
        placed = place(&order, best.2);
        if placed.1 < best.0 .1 {
            best = (placed.clone(), order.clone(), best.2);
        }
    }
    let best = best.0;
    for &b in &transient {
        p.buffers[b].offset = best.0[b.index()];
    }
    p.arena_bytes = best.1.max(top);

    // Each buffer after the ones whose bytes it takes over, in order of first access.
    let (firsts, lasts) = access_ends(p);
    let mut reuse: Vec<(OpId, OpId)> = vec![];
    let mut occupants = crate::intervals::Occupants::default();
    for b in transient {
        let at = p.buffers[b].offset;
        for a in occupants.replace(at, at + p.buffers[b].bytes, b) {
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

/// Buffer-placements the improvement steps of [`run`] may spend, divided by the number of
/// transient buffers.
const IMPROVE_WORK: usize = 60_000;

/// Which gap a buffer takes among those clear of the buffers it may be in use with.
#[derive(Clone, Copy, Debug)]
enum Fit {
    /// The lowest.
    First,
    /// The smallest that holds it.
    Best,
    /// Buffers of `split` bytes or more the lowest; smaller ones the highest below `target`
    /// (the lowest above all others when none is).
    TwoEnded { split: u64, target: u64 },
}

/// Places `order`'s buffers one by one in the gap `fit` chooses, clear of the placed buffers each
/// may be in use together with; returns every buffer's offset (indexed by id) and the arena top.
fn place(
    p: &Program,
    life: &Lifetimes,
    span: &[(usize, usize)],
    order: &[BufferId],
    base: u64,
    fit: Fit,
) -> (Vec<u64>, u64) {
    const BLOCK: usize = 64;
    let align = |x: u64| x.div_ceil(ALIGN) * ALIGN;
    let mut offset = vec![0u64; p.buffers.len()];
    // Placed buffers by the blocks of issue positions their spans cover.
    let mut blocks: Vec<Vec<BufferId>> = vec![vec![]; (p.ops.len() + 1) / BLOCK + 2];
    let mut seen = vec![usize::MAX; p.buffers.len()];
    let mut top = base;
    for (step, &b) in order.iter().enumerate() {
        let bytes = p.buffers[b].bytes;
        let (b0, b1) = span[b.index()];
        let cover = b0 / BLOCK..=(b1.max(b0 + 1) - 1) / BLOCK;
        let mut busy: Vec<(u64, u64)> = vec![];
        for blk in cover.clone() {
            for &a in &blocks[blk] {
                if std::mem::replace(&mut seen[a.index()], step) == step {
                    continue;
                }
                let (a0, a1) = span[a.index()];
                if a0 < b1 && b0 < a1 && !life.dead_before(a, b) && !life.dead_before(b, a) {
                    busy.push((offset[a.index()], offset[a.index()] + p.buffers[a].bytes));
                }
            }
        }
        busy.sort_unstable();
        if let Fit::TwoEnded { split, target } = fit {
            if bytes < split {
                if let Some(o) = highest_below(&busy, base, bytes, target) {
                    offset[b.index()] = o;
                    top = top.max(align(o + bytes));
                    for blk in cover {
                        blocks[blk].push(b);
                    }
                    continue;
                }
            }
        }
        let best_fit = matches!(fit, Fit::Best);
        // The lowest gap that holds the buffer, or (best fit) the smallest; above all if none does.
        let mut at = base;
        let mut chosen: Option<(u64, u64)> = None; // (gap size, offset)
        for (start, end) in busy {
            if start >= at + bytes && chosen.is_none_or(|(g, _)| best_fit && start - at < g) {
                chosen = Some((start - at, at));
            }
            at = at.max(align(end));
        }
        let at = chosen.map_or(at, |(_, o)| o);
        offset[b.index()] = at;
        top = top.max(align(at + bytes));
        for blk in cover {
            blocks[blk].push(b);
        }
    }
    (offset, top)
}

/// The highest aligned offset below `target` where `bytes` fit between the `busy` ranges (sorted).
fn highest_below(busy: &[(u64, u64)], base: u64, bytes: u64, target: u64) -> Option<u64> {
    let align = |x: u64| x.div_ceil(ALIGN) * ALIGN;
    let mut gaps: Vec<(u64, u64)> = Vec::with_capacity(busy.len() + 1);
    let mut at = base;
    for &(start, end) in busy {
        if start > at {
            gaps.push((at, start));
        }
        at = at.max(align(end));
    }
    gaps.push((at, u64::MAX));
    gaps.iter().rev().find_map(|&(start, end)| {
        let o = end.min(target).checked_sub(bytes)? / ALIGN * ALIGN;
        (o >= start).then_some(o)
    })
}

/// A lower bound on the transient bytes any placement of this program needs: the weight of a set
/// of buffers that pairwise may be in use together (an antichain of the order "every access of `a`
/// happens before every access of `b`"), so that none of their bytes can be shared. The heavier of:
/// - at each op `o`, the buffers with an access happening before or at `o` and an access not
///   happening before `o`;
/// - a maximum-weight antichain, by Dilworth's theorem as `Σ bytes − max flow` in the network
///   `source → a⁺ (bytes) → b⁻ (a before b) → b⁺ (transit) … → b⁻ → sink (bytes)`, read off the
///   minimum cut. The order's edges are pruned (each buffer keeps at most [`SUCCESSORS`]
///   successors not already implied by its kept ones), which can only make the cut's set too
///   heavy, so the set is checked pairwise and used only when it is an antichain.
pub fn lower_bound(p: &Program) -> u64 {
    let clocks = Clocks::new(p);
    let life = Lifetimes::new(p, &clocks);
    let transient = transient_by_first_access(p, &life);
    let span = spans(p, &clocks, &life, &transient);
    concurrency_bound(p, &clocks, &transient, &span).max(antichain_bound(p, &life, &transient))
}

/// Successors each buffer keeps in [`antichain_bound`]'s network.
const SUCCESSORS: usize = 64;

fn concurrency_bound(
    p: &Program,
    clocks: &Clocks,
    transient: &[BufferId],
    span: &[(usize, usize)],
) -> u64 {
    let (firsts, lasts) = access_ends(p);
    let (mut next, mut active, mut best) = (0, Vec::<BufferId>::new(), 0u64);
    for (o, _) in p.ops.iter() {
        while next < transient.len() && span[transient[next].index()].0 <= o.index() {
            active.push(transient[next]);
            next += 1;
        }
        active.retain(|&b| span[b.index()].1 > o.index());
        let started = |x: OpId| x == o || clocks.hb(p, x, o);
        let live: u64 = active
            .iter()
            .filter(|&&b| {
                firsts[b.index()].iter().flatten().any(|&x| started(x))
                    && lasts[b.index()]
                        .iter()
                        .flatten()
                        .any(|&y| y == o || !clocks.hb(p, y, o))
            })
            .map(|&b| p.buffers[b].bytes)
            .sum();
        best = best.max(live);
    }
    best
}

fn antichain_bound(p: &Program, life: &Lifetimes, t: &[BufferId]) -> u64 {
    let t: Vec<BufferId> = t
        .iter()
        .copied()
        .filter(|&b| p.buffers[b].bytes > 0)
        .collect();
    let n = t.len();
    let weight: Vec<u64> = t.iter().map(|&b| p.buffers[b].bytes).collect();
    const INF: u64 = u64::MAX / 4;
    // Nodes: a⁺ = i, b⁻ = n + j, source 2n, sink 2n + 1. `t` is in a topological order.
    let mut net = Network::new(2 * n + 2);
    let (source, sink) = (2 * n, 2 * n + 1);
    for i in 0..n {
        let mut kept: Vec<usize> = vec![];
        for j in i + 1..n {
            if life.dead_before(t[i], t[j]) && !kept.iter().any(|&k| life.dead_before(t[k], t[j])) {
                kept.push(j);
                if kept.len() == SUCCESSORS {
                    break;
                }
            }
        }
        for j in kept {
            net.edge(i, n + j, INF);
        }
        net.edge(source, i, weight[i]);
        net.edge(n + i, sink, weight[i]);
        net.edge(n + i, i, INF);
    }
    net.max_flow(source, sink);
    // Minimum cut: a buffer is in the antichain when its a⁺ is reachable and its b⁻ is not.
    let reach = net.reachable(source);
    let set: Vec<usize> = (0..n).filter(|&i| reach[i] && !reach[n + i]).collect();
    let antichain = set.iter().enumerate().all(|(k, &i)| {
        set[k + 1..]
            .iter()
            .all(|&j| !life.dead_before(t[i], t[j]) && !life.dead_before(t[j], t[i]))
    });
    if antichain {
        set.iter().map(|&i| weight[i]).sum()
    } else {
        0
    }
}

/// A flow network (Dinic's algorithm, iterative).
struct Network {
    out: Vec<Vec<usize>>,
    to: Vec<usize>,
    cap: Vec<u64>,
}

impl Network {
    fn new(nodes: usize) -> Self {
        Network {
            out: vec![vec![]; nodes],
            to: vec![],
            cap: vec![],
        }
    }

    fn edge(&mut self, a: usize, b: usize, cap: u64) {
        self.out[a].push(self.to.len());
        self.to.push(b);
        self.cap.push(cap);
        self.out[b].push(self.to.len());
        self.to.push(a);
        self.cap.push(0);
    }

    fn levels(&self, s: usize) -> Vec<u32> {
        let mut level = vec![u32::MAX; self.out.len()];
        level[s] = 0;
        let mut queue = std::collections::VecDeque::from([s]);
        while let Some(v) = queue.pop_front() {
            for &e in &self.out[v] {
                let u = self.to[e];
                if self.cap[e] > 0 && level[u] == u32::MAX {
                    level[u] = level[v] + 1;
                    queue.push_back(u);
                }
            }
        }
        level
    }

    fn reachable(&self, s: usize) -> Vec<bool> {
        self.levels(s).iter().map(|&l| l != u32::MAX).collect()
    }

    fn max_flow(&mut self, s: usize, t: usize) -> u64 {
        let mut total = 0u64;
        loop {
            let level = self.levels(s);
            if level[t] == u32::MAX {
                return total;
            }
            let mut next = vec![0usize; self.out.len()];
            // Augmenting paths along increasing levels, as a stack of edges.
            let mut path: Vec<usize> = vec![];
            let mut v = s;
            loop {
                if v == t {
                    let f = path.iter().map(|&e| self.cap[e]).min().unwrap_or(0);
                    for &e in &path {
                        self.cap[e] -= f;
                        self.cap[e ^ 1] += f;
                    }
                    total += f;
                    // Back to the tail of the first saturated edge.
                    let k = path.iter().position(|&e| self.cap[e] == 0).unwrap_or(0);
                    path.truncate(k);
                    v = path.last().map_or(s, |&e| self.to[e]);
                    continue;
                }
                let mut advanced = false;
                while next[v] < self.out[v].len() {
                    let e = self.out[v][next[v]];
                    let u = self.to[e];
                    if self.cap[e] > 0 && level[u] == level[v] + 1 {
                        path.push(e);
                        v = u;
                        advanced = true;
                        break;
                    }
                    next[v] += 1;
                }
                if advanced {
                    continue;
                }
                // Dead end: retreat.
                match path.pop() {
                    None => break,
                    Some(e) => {
                        v = self.to[e ^ 1];
                        next[v] += 1;
                    }
                }
            }
        }
    }
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
            let done = frontier.covers(clocks, &life.last[b]);
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
