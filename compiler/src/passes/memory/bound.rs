//! Lower bounds on the transient bytes any valid placement of a program needs (`plan_tightness`
//! in `--emit stats` divides the arena's transient part by them).
//!
//! Every figure here is *bytes simultaneously alive*: the bytes of a set of transient buffers
//! that are all in use at one instant of some execution the program allows (any timing that
//! respects stream order and waits), a buffer being in use from the start of its first access to
//! the end of its last. No valid placement lets two such buffers share bytes (sharing needs every
//! access of one to happen before every access of the other, and then they are never in use at
//! once), so each figure is a lower bound on the transient part of every valid arena. Each comes
//! with its execution: the issue order run serially (`verify`'s live bound), each op run right
//! after everything that happens before it, and the cut of a maximum-weight antichain below.

use super::{spans, transient_by_first_access, Lifetimes};
use crate::passes::hb::Clocks;
use cranelift_entity::EntityRef;
use sched_ir::ir::*;

/// A lower bound on the transient bytes any placement of this program needs: the most bytes
/// simultaneously alive (module doc) this finds a witness for. The heavier of:
/// - at each op `o`, run after everything that happens before it and before anything else, the
///   buffers with an access happening before or at `o` and an access not happening before `o`;
/// - a maximum-weight antichain of the order "every access of `a` happens before every access
///   of `b`", by Dilworth's theorem as `Σ bytes − max flow` in the network
///   `source → a⁺ (bytes) → b⁻ (a before b) → b⁺ (transit) … → b⁻ → sink (bytes)`, read off the
///   minimum cut. The order's edges are pruned (each buffer keeps at most [`SUCCESSORS`]
///   successors not already implied by its kept ones), which can only make the cut's set too
///   heavy, so the set is checked pairwise and used only when it is an antichain; then
///   `alive_together` keeps the part of it that one execution has in use at once.
pub fn lower_bound(p: &Program) -> u64 {
    let clocks = Clocks::new(p);
    let life = Lifetimes::new(p, &clocks);
    let transient = transient_by_first_access(p, &life);
    let span = spans(p, &clocks, &life, &transient);
    let antichain = antichain(p, &life, &transient);
    let together = alive_together(p, &clocks, &life, antichain);
    concurrency_bound(p, &clocks, &life, &transient, &span)
        .max(together.iter().map(|&b| p.buffers[b].bytes).sum())
}

/// The buffers of `set` in use at one instant of one execution: every op that happens strictly
/// before some member's first access (issue order) has finished, and those first accesses that
/// remain run together (they are pairwise unordered, so on distinct streams). A member is in use
/// then when some access of it has not finished. Members that are not are dropped, which only
/// shrinks the finished part, until all are.
fn alive_together(
    p: &Program,
    clocks: &Clocks,
    life: &Lifetimes,
    mut set: Vec<BufferId>,
) -> Vec<BufferId> {
    loop {
        // Per stream, how many of its ops have finished.
        let mut done = vec![0u32; clocks.streams()];
        for &b in &set {
            let first = life.first[b].expect("accessed");
            let own = p.ops[first].stream.index();
            for (s, (d, &c)) in done.iter_mut().zip(clocks.clock(first)).enumerate() {
                *d = (*d).max(if s == own { c - 1 } else { c });
            }
        }
        let before = set.len();
        set.retain(|&b| life.last(b).iter().zip(&done).any(|(&last, &d)| last > d));
        if set.len() == before {
            return set;
        }
    }
}

/// Successors each buffer keeps in [`antichain`]'s network.
const SUCCESSORS: usize = 64;

fn concurrency_bound(
    p: &Program,
    clocks: &Clocks,
    life: &Lifetimes,
    transient: &[BufferId],
    span: &[(usize, usize)],
) -> u64 {
    let mut best = 0u64;
    for_each_live_set(p, clocks, life, transient, span, |live| {
        best = best.max(live.iter().map(|&b| p.buffers[b].bytes).sum());
    });
    best
}

/// Calls `f`, for each op in issue order, with the transient buffers in use at it when it runs right
/// after everything that happens before it and before anything else: those with an access
/// happening before or at the op and an access not happening before it. `transient` is sorted by
/// first access.
///
/// Both tests read only the op's clock and the buffer's first and last positions on each stream
/// (an access on stream `s` happens before or at the op exactly when the op's clock has reached
/// its position on `s`; strictly before, when the op's clock less the op itself has).
pub(super) fn for_each_live_set(
    p: &Program,
    clocks: &Clocks,
    life: &Lifetimes,
    transient: &[BufferId],
    span: &[(usize, usize)],
    mut f: impl FnMut(&[BufferId]),
) {
    let (mut next, mut active, mut live) = (0, Vec::<BufferId>::new(), Vec::<BufferId>::new());
    // Per stream, how many of its ops happen strictly before the op.
    let mut before = vec![0u32; clocks.streams()];
    for (o, op) in p.ops.iter() {
        while next < transient.len() && span[transient[next].index()].0 <= o.index() {
            active.push(transient[next]);
            next += 1;
        }
        active.retain(|&b| span[b.index()].1 > o.index());
        let now = clocks.clock(o);
        before.copy_from_slice(now);
        before[op.stream.index()] -= 1;
        live.clear();
        for &b in &active {
            if in_use(life, b, now, &before) {
                live.push(b);
            }
        }
        f(&live);
    }
}

/// Whether `b` is in use at an op whose clock is `now` (`before`: the same less the op itself):
/// some access of `b` happens before or at the op, and some access does not happen before it.
#[inline]
fn in_use(life: &Lifetimes, b: BufferId, now: &[u32], before: &[u32]) -> bool {
    let started = life
        .first_seq(b)
        .iter()
        .zip(now)
        .any(|(&first, &c)| first != 0 && c >= first);
    started && life.last(b).iter().zip(before).any(|(&last, &c)| c < last)
}

/// A maximum-weight antichain (see [`lower_bound`]), or none when the pruned network's cut is not
/// one.
fn antichain(p: &Program, life: &Lifetimes, t: &[BufferId]) -> Vec<BufferId> {
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
        set.iter().map(|&i| t[i]).collect()
    } else {
        vec![]
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
