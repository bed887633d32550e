//! The discrete-event engine: runs a verified [`Program`] over one representative rank per class
//! ([`super::classes`]) and records when every op starts and ends.
//!
//! - A stream runs its ops in issue order, one at a time. An op becomes ready when it reaches the
//!   head of its stream and every event it waits on has been recorded (by this rank).
//! - A compute op then runs for its [`CostModel`] time, stretched while collectives of its rank
//!   move bytes: it progresses at speed `1 / (1 + contention × n)` with `n` such collectives
//!   (communication kernels take SMs and memory bandwidth; see [`super::cost::CONTENTION`]).
//!   Compute ops on different streams do not slow each other down.
//! - A collective (or coalesced group) that is ready has *arrived*; it starts when every member
//!   of its group has arrived, i.e. when the representatives of all classes in the group have.
//!   It then spends its latency term, and moves its bytes ([`Transfer`]) as a fluid over two
//!   resources of its rank: the GPU's intra-node link and the node's network. Calls that overlap
//!   share them by max-min fairness on their speed relative to running alone: every call moves at
//!   the same fraction of its stand-alone speed until a resource is full, calls held back by that
//!   resource keep their share, and the rest share what is left. A call alone therefore takes
//!   exactly its α–β time. Each representative's node is taken to be filled with ranks of its own
//!   class (true of every compiled schedule without a pipeline; with one, a node may hold several
//!   stages, whose traffic on the node's network is not shared between them), so the node-wide
//!   demands of [`Transfer`] already hold what its neighbours send.
//! - **Pipeline stages.** A representative runs only the streams of its stage (the others are
//!   empty for it). A point-to-point `send`/`recv`, or a coalesced group holding some, has no
//!   group-wide rendezvous: the k-th send of a stage on a two-member communicator matches the peer
//!   stage's k-th receive on it (counted per communicator and stage in issue order, as the
//!   verifier matches them), and the call starts once the peer of every send and receive it holds
//!   has arrived at (or already started) the call holding the match. The peers' calls then start
//!   on their own terms: a group waits for all its peers, so two neighbours' groups may start at
//!   different times (NCCL progresses each pair of a group call as soon as both ends are posted;
//!   the model charges a whole group from when its last peer arrives). A transfer costs one
//!   message over the link between the two ranks ([`CostModel::p2p_transfer`]).
//! - The step ends when every stream of every rank is empty (the host joins all streams).
//!
//! Work is proportional to ops × streams × classes, with a handful of calls in flight at a time.

use super::classes::RankClasses;
use super::cost::{CostModel, GroupShape, Transfer};
use cranelift_entity::EntityRef;
use sched_ir::hash::FxHashMap;
use sched_ir::ir::*;
use sched_ir::job::{Collective, Job, Layer, LayerKind};
pub use sched_ir::timeline::{RankTimeline, Timeline};

#[derive(Clone, Copy, Debug)]
enum Cost {
    Compute(f64),
    Comm(Transfer),
}

#[derive(Clone, Copy, Debug)]
enum Phase {
    /// Ends at a known time: a collective's latency.
    Until(f64),
    /// A compute op: seconds of work left at full speed.
    Computing(f64),
    /// A collective moving its bytes: the fraction left.
    Moving(f64),
}

#[derive(Clone, Copy, Debug, Default)]
struct StreamState {
    head: usize,
    arrived: bool,
    running: Option<(OpId, Phase)>,
}

struct Agent {
    streams: Vec<StreamState>,
    events: Vec<f64>,
    costs: Vec<Cost>,
    /// For each communicator, the classes in this representative's group.
    peers: Vec<Vec<u32>>,
    /// Speed of each stream's moving call relative to alone (see the module doc).
    speed: Vec<f64>,
    /// Speed of compute ops relative to running without collectives beside them.
    compute_speed: f64,
    start: Vec<f64>,
    end: Vec<f64>,
    /// For each op holding sends or receives, the (agent, op) of each one's matching call on the
    /// peer stage; empty for every other op.
    p2p: Vec<Vec<(u32, OpId)>>,
}

/// Seconds of a compute op on one rank.
pub fn compute_op_seconds(cost: &CostModel, program: &Program, job: &Job, op: &Op) -> f64 {
    let OpKind::Compute(kind) = op.kind else {
        return 0.0;
    };
    let region_bytes = || -> f64 {
        op.reads
            .iter()
            .chain(&op.writes)
            .filter(|r| !program.is_workspace(r))
            .map(|r| r.bytes as f64)
            .sum()
    };
    match kind {
        ComputeKind::Accumulate | ComputeKind::Copy | ComputeKind::GradNorm => {
            cost.memory_seconds(region_bytes())
        }
        ComputeKind::Loss => match job.model.layers.last() {
            Some(l) if matches!(l.kind, LayerKind::LmHead { .. }) => cost.compute_seconds(l, kind),
            _ => cost.memory_seconds(region_bytes()),
        },
        _ => match op.layer.and_then(|l| job_layer(program, job, l)) {
            Some(l) => cost.compute_seconds(l, kind),
            None => cost.memory_seconds(region_bytes()),
        },
    }
}

/// The job's layer behind a program layer (same order; matched by name to be safe).
fn job_layer<'a>(program: &Program, job: &'a Job, id: LayerId) -> Option<&'a Layer> {
    let name = &program.layers.get(id)?.name;
    match job.model.layers.get(id.index()) {
        Some(l) if &l.name == name => Some(l),
        _ => job.model.layers.iter().find(|l| &l.name == name),
    }
}

/// The shape of `rank`'s group in `comm`, and how many ring edges of the call leave its node.
pub fn group_shape(p: &Program, classes: &RankClasses, comm: CommId, rank: u32) -> GroupShape {
    let gpn = p.layout.gpus_per_node.max(1);
    let node = |r: u32| r / gpn;
    let c = &p.comms[comm];
    let Some(group) = c.groups.get(classes.group_of[comm][rank as usize] as usize) else {
        return GroupShape::mesh(1, 1, gpn);
    };
    let mut nodes: Vec<u32> = group.iter().map(|&m| node(m)).collect();
    nodes.sort_unstable();
    let mut a = 0;
    let mut run = 0;
    for (i, n) in nodes.iter().enumerate() {
        run = if i > 0 && nodes[i - 1] == *n {
            run + 1
        } else {
            1
        };
        a = a.max(run);
    }
    nodes.dedup();
    let here = node(rank);
    let mut out = 0;
    for g in &c.groups {
        if g.len() < 2 || !g.iter().any(|&m| node(m) == here) {
            continue;
        }
        let mut ring = g.clone();
        ring.sort_unstable();
        for (i, &r) in ring.iter().enumerate() {
            let next = ring[(i + 1) % ring.len()];
            if node(r) == here && node(next) != here {
                out += 1;
            }
        }
    }
    GroupShape {
        p: group.len() as u32,
        a,
        b: nodes.len() as u32,
        out_edges_per_node: out,
    }
}

/// Runs one step of `program`.
pub fn run(program: &Program, job: &Job, classes: &RankClasses, cost: &CostModel) -> Timeline {
    let n_ops = program.ops.len();
    let stream_ops: Vec<Vec<OpId>> = {
        let mut v = vec![vec![]; program.streams.len()];
        for (id, op) in program.ops.iter() {
            v[op.stream.index()].push(id);
        }
        v
    };
    let compute: Vec<f64> = program
        .ops
        .values()
        .map(|op| compute_op_seconds(cost, program, job, op))
        .collect();
    let calls = P2pCalls::new(program);
    let mut agents: Vec<Agent> = classes
        .representatives
        .iter()
        .map(|&rank| {
            let shapes: Vec<GroupShape> = program
                .comms
                .keys()
                .map(|c| group_shape(program, classes, c, rank))
                .collect();
            let costs = program
                .ops
                .values()
                .enumerate()
                .map(|(i, op)| match &op.kind {
                    OpKind::Compute(_) => Cost::Compute(compute[i]),
                    _ if is_p2p(op) => {
                        let parts: Vec<_> = op
                            .collectives()
                            .iter()
                            .map(|c| (c.kind, c.count * c.dtype.bytes(), shapes[c.comm.index()]))
                            .collect();
                        Cost::Comm(cost.p2p_transfer(&parts))
                    }
                    _ => {
                        let cs = op.collectives();
                        let parts: Vec<_> = cs
                            .iter()
                            .map(|c| (c.kind, c.count * c.dtype.bytes()))
                            .collect();
                        // A group's members share one communicator shape in every compiled plan;
                        // otherwise the widest member's shape stands for the call.
                        let shape = cs
                            .iter()
                            .map(|c| shapes[c.comm.index()])
                            .max_by_key(|s| (s.b, s.p))
                            .unwrap_or(GroupShape::mesh(1, 1, 1));
                        Cost::Comm(cost.transfer(&parts, shape))
                    }
                })
                .collect();
            let peers = program
                .comms
                .iter()
                .map(|(id, c)| {
                    let g = classes.group_of[id][rank as usize] as usize;
                    let mut cls: Vec<u32> = c
                        .groups
                        .get(g)
                        .map(|g| g.iter().map(|&m| classes.class_of[m as usize]).collect())
                        .unwrap_or_default();
                    cls.sort_unstable();
                    cls.dedup();
                    cls
                })
                .collect();
            // Streams of other stages are empty for this rank.
            let stage = program.layout.stage(rank);
            let streams = program
                .streams
                .iter()
                .map(|(id, st)| StreamState {
                    head: if st.stage == stage {
                        0
                    } else {
                        stream_ops[id.index()].len()
                    },
                    ..StreamState::default()
                })
                .collect();
            Agent {
                p2p: calls.peers(program, classes, rank),
                streams,
                events: vec![f64::INFINITY; program.events.len()],
                costs,
                peers,
                speed: vec![0.0; program.streams.len()],
                compute_speed: 1.0,
                start: vec![f64::NAN; n_ops],
                end: vec![f64::NAN; n_ops],
            }
        })
        .collect();
    let (intra_bw, inter_bw) = cost.link_bandwidths();
    let contention = cost.contention();
    let mut now = 0.0f64;
    loop {
        start_ready(program, &stream_ops, &mut agents, now);
        for a in agents.iter_mut() {
            share_links(a, intra_bw, inter_bw);
            let moving = a
                .streams
                .iter()
                .filter(|st| matches!(st.running, Some((_, Phase::Moving(_)))))
                .count();
            a.compute_speed = 1.0 / (1.0 + contention * moving as f64);
        }
        // The next moment something ends.
        let mut next = f64::INFINITY;
        for a in &agents {
            for (s, st) in a.streams.iter().enumerate() {
                match st.running {
                    Some((_, Phase::Until(t))) => next = next.min(t),
                    Some((_, Phase::Computing(left))) => {
                        next = next.min(now + left / a.compute_speed)
                    }
                    Some((op, Phase::Moving(left))) => {
                        if let Cost::Comm(t) = a.costs[op.index()] {
                            next = next.min(now + left * t.transfer_s / a.speed[s]);
                        }
                    }
                    None => {}
                }
            }
        }
        if !next.is_finite() {
            break;
        }
        let (before, dt) = (now, next - now);
        now = next;
        for a in agents.iter_mut() {
            for s in 0..a.streams.len() {
                let Some((op, phase)) = a.streams[s].running else {
                    continue;
                };
                if let Phase::Computing(left) = phase {
                    // As for moving calls: finish by the time computed above.
                    let speed = a.compute_speed;
                    let done = before + left / speed <= now;
                    let left = left - dt * speed;
                    if done || left <= 1e-15 {
                        finish(a, program, &stream_ops, s, op, now);
                    } else {
                        a.streams[s].running = Some((op, Phase::Computing(left)));
                    }
                    continue;
                }
                let Cost::Comm(t) = a.costs[op.index()] else {
                    continue;
                };
                match phase {
                    Phase::Until(e) if e <= now => {
                        if t.transfer_s > 0.0 {
                            a.streams[s].running = Some((op, Phase::Moving(1.0)));
                        } else {
                            finish(a, program, &stream_ops, s, op, now);
                        }
                    }
                    Phase::Moving(left) => {
                        // Finish by the time computed above, not by what is left: `now` may not
                        // move at all when the last step is below its float resolution.
                        let done =
                            a.speed[s] > 0.0 && before + left * t.transfer_s / a.speed[s] <= now;
                        let left = left - dt * a.speed[s] / t.transfer_s;
                        if done || left <= 1e-12 {
                            finish(a, program, &stream_ops, s, op, now);
                        } else {
                            a.streams[s].running = Some((op, Phase::Moving(left)));
                        }
                    }
                    Phase::Until(_) | Phase::Computing(_) => {}
                }
            }
        }
    }
    for a in &agents {
        for (s, st) in a.streams.iter().enumerate() {
            assert!(
                st.head == stream_ops[s].len(),
                "the simulated program deadlocks on stream{s} (was it verified?)"
            );
        }
    }
    let step_time_s = agents
        .iter()
        .flat_map(|a| a.end.iter().copied())
        .fold(0.0, f64::max);
    Timeline {
        ranks: agents
            .into_iter()
            .zip(&classes.representatives)
            .zip(&classes.sizes)
            .map(|((a, &rank), &ranks)| RankTimeline {
                rank,
                ranks,
                start: a.start,
                end: a.end,
            })
            .collect(),
        step_time_s,
    }
}

/// Starts every op that is ready at `now`, until nothing more can start.
fn start_ready(program: &Program, stream_ops: &[Vec<OpId>], agents: &mut [Agent], now: f64) {
    let mut changed = true;
    while changed {
        changed = false;
        for k in 0..agents.len() {
            for (s, ops) in stream_ops.iter().enumerate() {
                let st = agents[k].streams[s];
                if st.running.is_some() || st.head >= ops.len() {
                    continue;
                }
                let id = ops[st.head];
                let op = &program.ops[id];
                if !st.arrived {
                    if op.wait.iter().any(|e| agents[k].events[e.index()] > now) {
                        continue;
                    }
                    if let Cost::Compute(d) = agents[k].costs[id.index()] {
                        let a = &mut agents[k];
                        a.start[id.index()] = now;
                        a.streams[s].running = Some((id, Phase::Computing(d)));
                        changed = true;
                        continue;
                    }
                    agents[k].streams[s].arrived = true;
                    changed = true;
                }
                if !agents[k].p2p[id.index()].is_empty() {
                    // A point-to-point call: start it once every peer has reached its match.
                    let all = agents[k].p2p[id.index()].iter().all(|&(l, peer_op)| {
                        let a = &agents[l as usize];
                        let ps = program.ops[peer_op].stream.index();
                        let st = &a.streams[ps];
                        let at = stream_ops[ps].get(st.head) == Some(&peer_op) && st.arrived;
                        at || !a.start[peer_op.index()].is_nan()
                    });
                    if !all {
                        continue;
                    }
                    let a = &mut agents[k];
                    if let Cost::Comm(t) = a.costs[id.index()] {
                        a.start[id.index()] = now;
                        a.streams[s].running = Some((id, Phase::Until(now + t.latency_s)));
                        changed = true;
                    }
                    continue;
                }
                // A collective that has arrived: start it once every class in its group has.
                let mut peers: Vec<u32> = op
                    .collectives()
                    .iter()
                    .flat_map(|c| agents[k].peers[c.comm.index()].iter().copied())
                    .collect();
                peers.sort_unstable();
                peers.dedup();
                let all = peers.iter().all(|&l| {
                    let ps = &agents[l as usize].streams[s];
                    ps.arrived && ps.running.is_none() && stream_ops[s].get(ps.head) == Some(&id)
                });
                if !all {
                    continue;
                }
                for &l in peers.iter().chain(std::iter::once(&(k as u32))) {
                    let a = &mut agents[l as usize];
                    if a.streams[s].running.is_some() {
                        continue;
                    }
                    let Cost::Comm(t) = a.costs[id.index()] else {
                        continue;
                    };
                    a.start[id.index()] = now;
                    a.streams[s].running = Some((id, Phase::Until(now + t.latency_s)));
                }
                changed = true;
            }
        }
    }
}

/// Whether `op` is a point-to-point call: a send or receive, or a group holding some.
fn is_p2p(op: &Op) -> bool {
    op.collectives()
        .iter()
        .any(|c| matches!(c.kind, Collective::Send | Collective::Recv))
}

/// Every send and receive of the program, and every call of a collective spanning stages (an
/// embedding group's, clipping's norm across stages), by (stage, communicator, call number): the
/// k-th call a stage issues on a communicator, counted in issue order. Such a collective starts,
/// as a transfer does, once every member has reached (or started) its matching call.
struct P2pCalls {
    /// (stage, communicator, k) of each call, in issue order, with its op.
    by_call: FxHashMap<(u32, CommId, u32), OpId>,
    /// The (communicator, k) of each op's sends and receives, in the op's order.
    of_op: Vec<Vec<(CommId, u32)>>,
}

impl P2pCalls {
    fn new(program: &Program) -> Self {
        let calls = program.call_numbers();
        let spans: Vec<bool> = program
            .comms
            .keys()
            .map(|c| program.stages_spanned(c).is_some())
            .collect();
        let mut by_call = FxHashMap::default();
        let mut of_op = vec![vec![]; program.ops.len()];
        for (id, op) in program.ops.iter() {
            let stage = program.streams[op.stream].stage;
            for (c, &k) in op.collectives().iter().zip(&calls[id]) {
                if matches!(c.kind, Collective::Send | Collective::Recv) || spans[c.comm.index()] {
                    by_call.insert((stage, c.comm, k), id);
                    of_op[id.index()].push((c.comm, k));
                }
            }
        }
        P2pCalls { by_call, of_op }
    }

    /// For each op of `rank`'s stage, the (agent, op) holding the match of each of its sends and
    /// receives on the peer's stage (agents are numbered by class).
    fn peers(&self, program: &Program, classes: &RankClasses, rank: u32) -> Vec<Vec<(u32, OpId)>> {
        let stage = program.layout.stage(rank);
        self.of_op
            .iter()
            .enumerate()
            .map(|(i, calls)| {
                let op = &program.ops[OpId::new(i)];
                if calls.is_empty() || program.streams[op.stream].stage != stage {
                    return vec![];
                }
                let mut peers: Vec<(u32, OpId)> = calls
                    .iter()
                    .flat_map(|&(comm, k)| {
                        let g = classes.group_of[comm][rank as usize] as usize;
                        let group = program.comms[comm].groups.get(g).map_or(&[][..], |g| g);
                        group
                            .iter()
                            .filter(move |&&m| m != rank)
                            .filter_map(move |&peer| {
                                let peer_op =
                                    self.by_call.get(&(program.layout.stage(peer), comm, k))?;
                                Some((classes.class_of[peer as usize], *peer_op))
                            })
                    })
                    .collect();
                peers.sort_unstable();
                peers.dedup();
                peers
            })
            .collect()
    }
}

fn finish(
    a: &mut Agent,
    program: &Program,
    stream_ops: &[Vec<OpId>],
    s: usize,
    op: OpId,
    now: f64,
) {
    debug_assert_eq!(stream_ops[s][a.streams[s].head], op);
    a.end[op.index()] = now;
    if let Some(e) = program.ops[op].record {
        a.events[e.index()] = now;
    }
    a.streams[s] = StreamState {
        head: a.streams[s].head + 1,
        arrived: false,
        running: None,
    };
    a.speed[s] = 0.0;
}

/// Max-min fair speeds (relative to alone) of the calls moving bytes on one rank.
fn share_links(a: &mut Agent, intra_bw: f64, inter_bw: f64) {
    // (stream, load on intra, load on inter) at full speed, in bytes/s.
    let mut flows: Vec<(usize, f64, f64)> = vec![];
    for (s, st) in a.streams.iter().enumerate() {
        a.speed[s] = 0.0;
        if let Some((op, Phase::Moving(_))) = st.running {
            if let Cost::Comm(t) = a.costs[op.index()] {
                flows.push((
                    s,
                    t.intra_bytes / t.transfer_s,
                    t.inter_bytes / t.transfer_s,
                ));
            }
        }
    }
    let mut free = [intra_bw, inter_bw];
    let mut open: Vec<(usize, f64, f64)> = flows;
    while !open.is_empty() {
        // The highest common speed the open flows can reach, and which resource stops them.
        let load = [
            open.iter().map(|f| f.1).sum::<f64>(),
            open.iter().map(|f| f.2).sum::<f64>(),
        ];
        let mut level = 1.0f64;
        let mut limit = None;
        for r in 0..2 {
            if load[r] > 0.0 && free[r] / load[r] < level {
                level = free[r] / load[r];
                limit = Some(r);
            }
        }
        let (done, rest): (Vec<_>, Vec<_>) = open.into_iter().partition(|f| match limit {
            None => true,
            Some(0) => f.1 > 0.0,
            Some(_) => f.2 > 0.0,
        });
        for f in &done {
            a.speed[f.0] = level;
            free[0] = (free[0] - level * f.1).max(0.0);
            free[1] = (free[1] - level * f.2).max(0.0);
        }
        open = rest;
    }
}
