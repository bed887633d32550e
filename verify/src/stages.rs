//! The pipeline proofs (parallel spec §3): stage structure, point-to-point matching, and no
//! deadlock with blocking sends and receives.
//!
//! 1. **Stage structure.** Every stream and buffer belongs to a stage that exists; an op touches
//!    only buffers of its stream's stage and waits only on events its stage records; a stream's
//!    workspace is of its stage. A collective other than a send or receive runs over groups that
//!    lie inside the issuing stage (its members all run the op). A send's or receive's
//!    communicator pairs every rank of one stage (member 0, the sender) with one rank of another
//!    stage (member 1, the receiver); only stage-0 members send on it, only member-1 ranks
//!    receive.
//! 2. **Matching.** On each transfer communicator, the k-th send is received by the k-th receive
//!    (NCCL matches a pair of ranks' sends and receives in issue order), with the same element
//!    count and dtype; every send has its receive and every receive its send.
//! 3. **No deadlock.** Within a stage, proof 4 orders every communication op of a rank by
//!    happens-before, so a rank runs its communication ops one after another, in issue order.
//!    Every send and receive then blocks until its peer has reached the matching op, except that
//!    the transfers of one group call are posted together; every other collective completes once
//!    all its members have reached it. Running this abstractly, stage by stage (every rank of a
//!    stage runs the same ops), must complete every op; otherwise the stages that wait on each
//!    other are named as a cycle, each with the op it is stuck in.
//!
//! Without a pipeline (one stage, no transfers) only the structure check has anything to do.

use super::VerifyError;

use sched_ir::hash::FxHashMap;
use sched_ir::ir::*;
use sched_ir::job::Collective;

pub fn check(p: &Program) -> Vec<VerifyError> {
    let mut errs = structure(p);
    if errs.is_empty() && p.layout.stages > 1 {
        errs.extend(matching(p));
        if errs.is_empty() {
            errs.extend(deadlock(p));
        }
    }
    errs
}

fn err(op: Option<OpId>, message: String) -> VerifyError {
    VerifyError { op, message }
}

/// The stage of an op (its stream's).
fn stage_of(p: &Program, op: &Op) -> u32 {
    p.streams[op.stream].stage
}

fn structure(p: &Program) -> Vec<VerifyError> {
    let mut errs = vec![];
    let stages = p.layout.stages.max(1);
    for (s, st) in p.streams.iter() {
        if st.stage >= stages {
            errs.push(err(
                None,
                format!("{s} runs on stage {}, but there are {stages}", st.stage),
            ));
        }
        if let Some(ws) = st.workspace {
            if p.buffers[ws.buffer].stage != st.stage {
                errs.push(err(
                    None,
                    format!("{s}'s workspace {} belongs to another stage", ws.buffer),
                ));
            }
        }
    }
    for (b, buf) in p.buffers.iter() {
        if buf.stage >= stages {
            errs.push(err(
                None,
                format!(
                    "{b} ({}) is held by stage {}, but there are {stages}",
                    buf.name, buf.stage
                ),
            ));
        }
    }
    if !errs.is_empty() {
        return errs;
    }
    let layout = p.layout;
    // The stages issuing collectives (not transfers) on each communicator.
    let mut issuers: FxHashMap<CommId, Vec<u32>> = FxHashMap::default();
    for op in p.ops.values() {
        for c in op
            .collectives()
            .iter()
            .filter(|c| !c.kind.is_point_to_point())
        {
            let by = issuers.entry(c.comm).or_default();
            if !by.contains(&stage_of(p, op)) {
                by.push(stage_of(p, op));
            }
        }
    }
    // What the groups of a communicator say depends only on the communicator, the issuing stage
    // and (for a transfer) its kind: computed once for each, not once per op (every rank of the
    // communicator is read, and the tensor all-reduces of every layer and micro-step share one).
    let mut inside_of: FxHashMap<(CommId, u32), bool> = FxHashMap::default();
    let mut pair_of: FxHashMap<(CommId, u32, bool), Option<String>> = FxHashMap::default();
    for (id, op) in p.ops.iter() {
        let stage = stage_of(p, op);
        for r in op.reads.iter().chain(&op.writes) {
            let b = &p.buffers[r.buffer];
            if b.stage != stage {
                errs.push(err(
                    Some(id),
                    format!(
                        "runs on stage {stage} but touches {} ({}), which stage {} holds",
                        r.buffer, b.name, b.stage
                    ),
                ));
            }
        }
        for &e in &op.wait {
            let recorder = p.events[e].recorder;
            let other = stage_of(p, &p.ops[recorder]);
            if other != stage {
                errs.push(err(
                    Some(id),
                    format!("runs on stage {stage} but waits on {e}, which {recorder} records on stage {other}"),
                ));
            }
        }
        for c in op.collectives() {
            let comm = &p.comms[c.comm];
            if c.kind.is_point_to_point() {
                let found = match c.input != c.output {
                    true => Some(format!(
                        "a {}'s input and output must be the one region it moves",
                        c.kind.name()
                    )),
                    false => pair_of
                        .entry((c.comm, stage, c.kind == Collective::Send))
                        .or_insert_with(|| pair_shape(p, c, stage))
                        .clone(),
                };
                errs.extend(found.map(|m| err(Some(id), m)));
                continue;
            }
            // A group either lies inside the stage, or spans stages that all issue on it
            // (an embedding group, clipping's norm across stages; `matching` pairs their calls).
            let inside = *inside_of.entry((c.comm, stage)).or_insert_with(|| {
                let issuing = &issuers[&c.comm];
                comm.groups.iter().all(|g| {
                    let here = g.iter().filter(|&&r| layout.stage(r) == stage).count();
                    here == 0
                        || here == g.len()
                        || g.iter().all(|&r| issuing.contains(&layout.stage(r)))
                })
            });
            if !inside {
                errs.push(err(
                    Some(id),
                    format!(
                        "{} on stage {stage} over {} ({}), whose groups reach ranks of other stages that never issue it",
                        c.kind.name(),
                        c.comm,
                        comm.name
                    ),
                ));
            }
        }
    }
    errs
}

/// What is wrong with a send's or receive's communicator, issued on `stage`, if anything (its
/// groups only: the caller checks that input and output are one region).
fn pair_shape(p: &Program, c: &CollectiveOp, stage: u32) -> Option<String> {
    let layout = p.layout;
    let comm = &p.comms[c.comm];
    let (mine, other) = match c.kind {
        Collective::Send => (0, 1),
        _ => (1, 0),
    };
    if comm.groups.iter().any(|g| g.len() != 2) {
        return Some(format!(
            "{} over {}: a transfer's groups are pairs",
            c.kind.name(),
            c.comm
        ));
    }
    let peer = layout.stage(comm.groups[0][other]);
    let pairs_ok = comm.groups.iter().all(|g| {
        layout.stage(g[mine]) == stage
            && layout.stage(g[other]) == peer
            && layout.dp_index(g[0]) == layout.dp_index(g[1])
            && layout.tp_index(g[0]) == layout.tp_index(g[1])
    });
    let covers = comm.groups.len() as u32 == layout.stage_size();
    if peer == stage || !pairs_ok || !covers {
        return Some(format!(
            "{} on stage {stage} over {} ({}): its groups must pair each rank of stage {stage} (as member {mine}) with the rank of one other stage at the same data-parallel and tensor index",
            c.kind.name(),
            c.comm,
            comm.name
        ));
    }
    None
}

/// A transfer in words, with the action it serves when the buffer's name says which (lowering
/// names hidden states `hidden.L.mM…` and their gradients `grad_hidden.L.mM…`, entering layer L
/// in micro-step M): `send of F2's output on chunk 0 (hidden.2.m2.s0) from stage 0 to stage 1`.
fn describe(p: &Program, id: OpId, c: &CollectiveOp) -> String {
    let stage = stage_of(p, &p.ops[id]);
    let comm = &p.comms[c.comm];
    let buf = &p.buffers[c.input.buffer];
    let (from, to) = (
        p.layout.stage(comm.groups[0][0]),
        p.layout.stage(comm.groups[0][1]),
    );
    let route = match c.kind {
        Collective::Send | Collective::Recv => format!("from stage {from} to stage {to}"),
        _ => format!("on stage {stage}"),
    };
    let what = boundary(p, &buf.name).map(|(grad, micro, before, after)| {
        let send = c.kind == Collective::Send;
        match (grad, send) {
            (false, true) => format!("F{micro}'s output on chunk {before}"),
            (false, false) => format!("F{micro}'s input on chunk {after}"),
            (true, true) => format!("B{micro}'s input gradient on chunk {after}"),
            (true, false) => format!("B{micro}'s output gradient on chunk {before}"),
        }
    });
    match what {
        Some(what) => format!("{} of {what} ({}) {route}", c.kind.name(), buf.name),
        None => format!("{} of {} {route}", c.kind.name(), buf.name),
    }
}

/// What a hidden state's buffer name says: (gradient?, micro-step, the chunk before the
/// boundary, the chunk after it).
fn boundary(p: &Program, name: &str) -> Option<(bool, u32, u32, u32)> {
    let (grad, rest) = match name.strip_prefix("grad_hidden.") {
        Some(rest) => (true, rest),
        None => (false, name.strip_prefix("hidden.")?),
    };
    let mut parts = rest.split('.');
    let l: usize = parts.next()?.parse().ok()?;
    let micro: u32 = parts.next()?.strip_prefix('m')?.parse().ok()?;
    let chunk = |l: usize| p.layers.get(LayerId::from_u32(l as u32)).map(|x| x.chunk);
    Some((grad, micro, chunk(l.checked_sub(1)?)?, chunk(l)?))
}

/// A communicator's sends and receives, each with its op, in issue order.
type Transfers = (Vec<(OpId, CollectiveOp)>, Vec<(OpId, CollectiveOp)>);

/// Each transfer communicator's sends and receives.
fn transfers(p: &Program) -> FxHashMap<CommId, Transfers> {
    let mut by_comm: FxHashMap<CommId, (Vec<_>, Vec<_>)> = FxHashMap::default();
    for (id, op) in p.ops.iter() {
        for c in op.collectives() {
            let entry = by_comm.entry(c.comm).or_default();
            match c.kind {
                Collective::Send => entry.0.push((id, *c)),
                Collective::Recv => entry.1.push((id, *c)),
                _ => {}
            }
        }
    }
    by_comm
}

/// Collectives whose groups span stages (an embedding group, clipping's norm across stages):
/// every stage a group reaches makes the same calls on the communicator, call k of each the
/// same kind, element count and dtype, so that the members meet in each.
fn joint_matching(p: &Program) -> Vec<VerifyError> {
    let mut errs = vec![];
    let mut calls: FxHashMap<CommId, FxHashMap<u32, Vec<(OpId, CollectiveOp)>>> =
        FxHashMap::default();
    let spans: Vec<bool> = p
        .comms
        .keys()
        .map(|c| p.stages_spanned(c).is_some())
        .collect();
    for (id, op) in p.ops.iter() {
        for c in op
            .collectives()
            .iter()
            .filter(|c| !c.kind.is_point_to_point())
        {
            if spans[c.comm.as_u32() as usize] {
                let by_stage = calls.entry(c.comm).or_default();
                by_stage.entry(stage_of(p, op)).or_default().push((id, *c));
            }
        }
    }
    let mut comms: Vec<_> = calls.into_iter().collect();
    comms.sort_unstable_by_key(|(c, _)| *c);
    for (comm, by_stage) in comms {
        let mut stages: Vec<u32> = by_stage.keys().copied().collect();
        stages.sort_unstable();
        let first = &by_stage[&stages[0]];
        for s in &stages[1..] {
            let theirs = &by_stage[s];
            for k in 0..first.len().max(theirs.len()) {
                match (first.get(k), theirs.get(k)) {
                    (Some((_, a)), Some((o, b)))
                        if (a.kind, a.count, a.dtype) != (b.kind, b.count, b.dtype) =>
                    {
                        errs.push(err(
                            Some(*o),
                            format!(
                                "call {k} on {comm} ({}) is a {} of {} {} elements on stage {s} but a {} of {} {} on stage {}",
                                p.comms[comm].name,
                                b.kind.name(),
                                b.count,
                                b.dtype.name(),
                                a.kind.name(),
                                a.count,
                                a.dtype.name(),
                                stages[0]
                            ),
                        ))
                    }
                    (Some(_), Some(_)) => {}
                    (Some((o, _)), None) | (None, Some((o, _))) => {
                        let (have, lack) = match first.get(k) {
                            Some(_) => (stages[0], *s),
                            None => (*s, stages[0]),
                        };
                        errs.push(err(
                            Some(*o),
                            format!(
                                "call {k} on {comm} ({}) is made on stage {have} but never on stage {lack}, whose ranks are members",
                                p.comms[comm].name
                            ),
                        ));
                    }
                    (None, None) => unreachable!("k < the longer list"),
                }
            }
        }
    }
    errs
}

fn matching(p: &Program) -> Vec<VerifyError> {
    let mut errs = joint_matching(p);
    let mut comms: Vec<_> = transfers(p).into_iter().collect();
    comms.sort_unstable_by_key(|(c, _)| *c);
    for (_, (sends, recvs)) in comms {
        for k in 0..sends.len().max(recvs.len()) {
            match (sends.get(k), recvs.get(k)) {
                (Some(&(s, sc)), Some(&(r, rc))) => {
                    if sc.count != rc.count || sc.dtype != rc.dtype {
                        errs.push(err(
                            Some(r),
                            format!(
                                "{} receives {} elements of {} where its matching {} ({s}) sends {} of {}",
                                describe(p, r, &rc),
                                rc.count,
                                rc.dtype.name(),
                                describe(p, s, &sc),
                                sc.count,
                                sc.dtype.name()
                            ),
                        ));
                    }
                }
                (Some(&(s, sc)), None) => errs.push(err(
                    Some(s),
                    format!("{} is never received: its peer posts {} receives on this link and this is send {}", describe(p, s, &sc), recvs.len(), k + 1),
                )),
                (None, Some(&(r, rc))) => errs.push(err(
                    Some(r),
                    format!("{} is never sent: its peer posts {} sends on this link and this is receive {}", describe(p, r, &rc), sends.len(), k + 1),
                )),
                (None, None) => unreachable!("k < the longer list"),
            }
        }
    }
    errs
}

/// One collective of a stage's sequence: which call on its communicator it is (counted per
/// stage, so a stage's k-th call meets the other stages' k-th), and the stages that must reach it.
#[derive(Clone)]
struct Part {
    key: (CommId, u32),
    stages: Vec<u32>,
}

fn deadlock(p: &Program) -> Vec<VerifyError> {
    let layout = p.layout;
    let stages = layout.stages as usize;
    // Which stages each stage meets in a collective on each communicator.
    let mut involved: FxHashMap<(CommId, u32), Vec<u32>> = FxHashMap::default();
    let mut involved_of = |comm: CommId, stage: u32| -> Vec<u32> {
        involved
            .entry((comm, stage))
            .or_insert_with(|| {
                let mut s: Vec<u32> = p.comms[comm]
                    .groups
                    .iter()
                    .filter(|g| g.iter().any(|&r| layout.stage(r) == stage))
                    .flat_map(|g| g.iter().map(|&r| layout.stage(r)))
                    .collect();
                s.sort_unstable();
                s.dedup();
                s
            })
            .clone()
    };
    // Each stage's communication ops in issue order, with their parts.
    let mut seq: Vec<Vec<(OpId, Vec<Part>)>> = vec![vec![]; stages];
    let calls = p.call_numbers();
    for (id, op) in p.ops.iter() {
        if op.collectives().is_empty() {
            continue;
        }
        let stage = stage_of(p, op);
        let parts = op
            .collectives()
            .iter()
            .zip(&calls[id])
            .map(|(c, &k)| Part {
                key: (c.comm, k),
                stages: involved_of(c.comm, stage),
            })
            .collect();
        seq[stage as usize].push((id, parts));
    }
    // Run: a part completes once every stage it involves has posted it (reached the op holding
    // it); an op completes once all its parts have; a stage then posts its next op.
    let mut pos = vec![0usize; stages];
    let mut posted: FxHashMap<(CommId, u32), Vec<u32>> = FxHashMap::default();
    let complete = |posted: &FxHashMap<(CommId, u32), Vec<u32>>, part: &Part| {
        posted
            .get(&part.key)
            .is_some_and(|by| part.stages.iter().all(|s| by.contains(s)))
    };
    for (s, ops) in seq.iter().enumerate() {
        if let Some((_, parts)) = ops.first() {
            for part in parts {
                posted.entry(part.key).or_default().push(s as u32);
            }
        }
    }
    loop {
        let mut progress = false;
        for s in 0..stages {
            while let Some((_, parts)) = seq[s].get(pos[s]) {
                if !parts.iter().all(|part| complete(&posted, part)) {
                    break;
                }
                pos[s] += 1;
                progress = true;
                if let Some((_, next)) = seq[s].get(pos[s]) {
                    for part in next {
                        posted.entry(part.key).or_default().push(s as u32);
                    }
                }
            }
        }
        if !progress {
            break;
        }
    }
    let stuck: Vec<usize> = (0..stages).filter(|&s| pos[s] < seq[s].len()).collect();
    let Some(&start) = stuck.first() else {
        return vec![];
    };
    // Follow, from the first stuck stage, the stage each one waits for, until one repeats.
    let waits_for = |s: usize| -> (OpId, String, Option<usize>) {
        let (id, parts) = &seq[s][pos[s]];
        let part = parts
            .iter()
            .find(|part| !complete(&posted, part))
            .expect("a stuck op has an incomplete part");
        let by = posted.get(&part.key).cloned().unwrap_or_default();
        let missing = part
            .stages
            .iter()
            .find(|t| !by.contains(t))
            .map(|&t| t as usize);
        let c = p.ops[*id]
            .collectives()
            .iter()
            .zip(parts)
            .find(|(_, q)| q.key == part.key)
            .map(|(c, _)| *c)
            .expect("the part is one of the op's collectives");
        (*id, describe(p, *id, &c), missing)
    };
    let mut path: Vec<usize> = vec![];
    let mut at = start;
    let mut lines: Vec<String> = vec![];
    loop {
        if let Some(i) = path.iter().position(|&s| s == at) {
            let cycle: Vec<String> = lines[i..].to_vec();
            let (op, _, _) = waits_for(path[i]);
            return vec![err(
                Some(op),
                format!(
                    "deadlock with blocking sends and receives: {}, which closes the cycle",
                    cycle.join("; ")
                ),
            )];
        }
        let (op, what, missing) = waits_for(at);
        path.push(at);
        match missing {
            Some(t) if pos[t] < seq[t].len() => {
                let (their, _) = &seq[t][pos[t]];
                lines.push(format!(
                    "stage {at} waits in {op} ({what}) for stage {t}, stuck in {their}"
                ));
                at = t;
            }
            Some(t) => {
                return vec![err(
                    Some(op),
                    format!("stage {at} waits in {op} ({what}) for stage {t}, which has run all its communication and never reaches it"),
                )];
            }
            None => unreachable!("an incomplete part misses some stage"),
        }
    }
}
