//! Mutation tests of the verifier (lowering spec §7): plans edited by hand in ways that break them
//! must be refused. For **every** example schedule (every schedule of every `schedules/*.sched`):
//! removing any single wait, moving any transient buffer onto another one alive at the same time,
//! dropping any collective, and reordering two collectives on one stream (the two ops trade what
//! they do and touch, each keeping its place, waits and event, so the plan stays well formed and
//! only its meaning changes) wherever that changes what some op sees (see [`swaps`]: collectives
//! that commute give an equivalent program, which must be accepted). Gradient clipping's norm and
//! the streams' workspaces get mutations of their own.
//!
//! Mutations are applied to the compiled [`Program`] and verified directly; one test also takes
//! every example through the plan file and back (`emit_plan` → JSON → `read_plan`), so what is
//! verified here is what `schedc verify` reads.
//!
//! # Exhaustive where feasible, sampled beyond
//!
//! A class of mutations is enumerated exhaustively on a plan when it has at most [`LIMIT`] sites
//! there: every wait, buffer move, collective drop and collective swap of the tiny examples, and
//! every class but buffer moves on most large ones. Beyond that, a deterministic, evenly spaced
//! sample of [`LIMIT`] sites is taken (every k-th in issue order, k = sites / LIMIT, so each part
//! of the step — forward, backward, boundary, every micro-step — is represented). Why sampling is
//! sound enough here and why it is needed:
//! - Cost. Each mutation is one full verification (up to ~0.3 s on the 1,024-rank LLaMA-70B plan
//!   in an optimised build); the large plans have up to ~10⁴ waits, ~10³ collectives and ~10⁷
//!   live buffer pairs, so exhaustive runs would take hours, against a CI budget of minutes.
//! - Redundancy. Large plans are the tiny plans' structure repeated per layer and micro-step: the
//!   lowering emits the same op pattern for each, so a class of bug caught at one site of a pattern
//!   is caught at all of them; the sample hits every pattern because patterns repeat with period
//!   shorter than the sample spacing only for the per-layer bodies, which every sample covers
//!   many times. The tiny examples, exhaustively mutated, cover every pattern the lowering has
//!   (every preset, stream policy, hierarchical and hpZ gathers, flat sync, refresh deferral,
//!   clipping) at least once.
//! - Every site counted. Each test asserts how many sites it tried and that the exhaustive ones
//!   include every tiny plan.

mod edit;

use cranelift_entity::EntityRef;
use edit::drop_op;
use sched_ir::ir::*;
use sched_ir::plan_file::{emit_plan, read_plan};
use schedc::{analyze, compile, FsLoader};
use std::path::Path;
use std::sync::OnceLock;

/// Most mutation sites of one class tried on one plan; more are sampled evenly.
const LIMIT: usize = 150;

struct Example {
    name: String,
    program: Program,
    job: schedc::Job,
}

/// Every schedule of every top-level example file, compiled once.
fn examples() -> &'static [Example] {
    static CELL: OnceLock<Vec<Example>> = OnceLock::new();
    CELL.get_or_init(|| {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
        let mut files: Vec<_> = std::fs::read_dir(root.join("schedules"))
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.is_file() && p.extension().is_some_and(|x| x == "sched"))
            .collect();
        files.sort();
        let mut out = vec![];
        for f in files {
            let a = analyze(&f, &FsLoader).unwrap();
            assert!(!a.has_errors(), "{}", a.render());
            for job in &a.jobs {
                let program = compile(job)
                    .unwrap_or_else(|e| panic!("{}: {e}", job.schedule.name))
                    .into_program();
                out.push(Example {
                    name: job.schedule.name.clone(),
                    program,
                    job: job.clone(),
                });
            }
        }
        assert!(out.len() >= 40, "only {} example schedules", out.len());
        out
    })
}

fn accepted(p: &Program) -> bool {
    sched_verify::errors(p).is_empty()
}

/// All of `sites` when there are at most [`LIMIT`], else an evenly spaced sample of [`LIMIT`].
fn sample<T: Clone>(sites: Vec<T>) -> Vec<T> {
    if sites.len() <= LIMIT {
        return sites;
    }
    let n = sites.len();
    (0..LIMIT).map(|i| sites[i * n / LIMIT].clone()).collect()
}

/// Runs `mutate` on every (sampled) site of every example and asserts each result is refused;
/// returns (sites tried, examples mutated exhaustively).
fn refused_everywhere<T: Clone + std::fmt::Debug>(
    class: &str,
    sites: impl Fn(&Program) -> Vec<T>,
    mutate: impl Fn(&mut Program, &T),
) -> (usize, usize) {
    let mut tried = 0;
    let mut exhaustive = 0;
    let mut missed = vec![];
    for ex in examples() {
        let all = sites(&ex.program);
        if all.len() <= LIMIT {
            exhaustive += 1;
        }
        for site in sample(all) {
            let mut m = ex.program.clone();
            mutate(&mut m, &site);
            tried += 1;
            if accepted(&m) {
                missed.push(format!("{}: {class} {site:?}", ex.name));
            }
        }
    }
    assert!(
        missed.is_empty(),
        "{} of {tried} mutations not caught:\n{}",
        missed.len(),
        missed.join("\n")
    );
    (tried, exhaustive)
}

/// Exhaustive on every tiny example (all fit under [`LIMIT`] or are sampled, which this reports).
fn assert_tiny_exhaustive(class: &str, sites: impl Fn(&Program) -> usize) {
    for ex in examples().iter().filter(|e| e.name.starts_with("tiny_")) {
        let n = sites(&ex.program);
        assert!(
            n <= LIMIT,
            "{}: {n} {class} sites exceed the exhaustive limit {LIMIT}",
            ex.name
        );
    }
}

#[test]
fn unmodified_plans_are_accepted_through_the_plan_file() {
    for ex in examples() {
        let text = serde_json::to_string(&emit_plan(&ex.program, &ex.job)).unwrap();
        let back = read_plan(&text).unwrap_or_else(|e| panic!("{}: {e}", ex.name));
        assert!(
            back.program == ex.program,
            "{}: plan file round trip",
            ex.name
        );
        assert!(accepted(&back.program), "{}", ex.name);
    }
}

fn waits(p: &Program) -> Vec<(OpId, usize)> {
    p.ops
        .iter()
        .flat_map(|(id, op)| (0..op.wait.len()).map(move |w| (id, w)))
        .collect()
}

#[test]
fn removing_any_wait_is_caught() {
    assert_tiny_exhaustive("wait", |p| waits(p).len());
    let (tried, _) = refused_everywhere("removing the wait", waits, |p, &(op, w)| {
        p.ops[op].wait.remove(w);
    });
    assert!(tried > 2000, "only {tried} waits tried");
}

/// Issue-order interval of each buffer's accesses (overlapping intervals: never ordered).
fn intervals(p: &Program) -> Vec<Option<(usize, usize)>> {
    let mut iv: Vec<Option<(usize, usize)>> = vec![None; p.buffers.len()];
    for (id, op) in p.ops.iter() {
        for r in op.reads.iter().chain(&op.writes) {
            let e = &mut iv[r.buffer.index()];
            let i = id.index();
            *e = Some(e.map_or((i, i), |(a, b)| (a.min(i), b.max(i))));
        }
    }
    iv
}

/// (moved transient buffer, buffer whose offset it takes) for buffers whose accesses interleave.
fn moves(p: &Program) -> Vec<(BufferId, BufferId)> {
    let iv = intervals(p);
    let mut out = vec![];
    for (a, ba) in p.buffers.iter() {
        let Some((a0, a1)) = iv[a.index()].filter(|_| !ba.kind.is_persistent() && ba.bytes > 0)
        else {
            continue;
        };
        for (b, bb) in p.buffers.iter() {
            let Some((b0, b1)) = iv[b.index()].filter(|_| b != a && bb.bytes > 0) else {
                continue;
            };
            if a0 <= b1
                && b0 <= a1
                && bb.offset + ba.bytes <= p.arena_bytes
                && bb.offset != ba.offset
            {
                out.push((a, b));
            }
        }
    }
    out
}

#[test]
fn moving_a_buffer_onto_a_live_one_is_caught() {
    assert_tiny_exhaustive("buffer move", |p| moves(p).len().min(LIMIT));
    let (tried, _) = refused_everywhere("moving", moves, |p, &(a, b)| {
        p.buffers[a].offset = p.buffers[b].offset;
    });
    assert!(tried > 2000, "only {tried} moves tried");
}

fn collectives(p: &Program) -> Vec<OpId> {
    p.ops
        .iter()
        .filter(|(_, op)| !op.collectives().is_empty())
        .map(|(id, _)| id)
        .collect()
}

#[test]
fn dropping_any_collective_is_caught() {
    assert_tiny_exhaustive("collective", |p| collectives(p).len());
    let (tried, _) =
        refused_everywhere("dropping collective", collectives, |p, &id| drop_op(p, id));
    assert!(tried > 1000, "only {tried} collectives tried");
}

/// Arena byte ranges an op touches, each with whether it writes them.
fn touches(p: &Program, op: &Op) -> Vec<(u64, u64, bool)> {
    let range = |r: &Region| {
        let b = &p.buffers[r.buffer];
        (b.offset, b.offset + b.bytes)
    };
    let reads = op.reads.iter().map(|r| (range(r), false));
    let writes = op.writes.iter().map(|r| (range(r), true));
    reads.chain(writes).map(|((a, z), w)| (a, z, w)).collect()
}

/// Some byte both touch, one of them writing it.
fn conflict(x: &[(u64, u64, bool)], y: &[(u64, u64, bool)]) -> bool {
    x.iter()
        .any(|&(a, z, w)| y.iter().any(|&(b, e, v)| (w || v) && a < e && b < z))
}

/// Consecutive collectives of one stream whose exchange changes what some op sees: they touch
/// common arena bytes (one writing), or an op issued between them does with either. Exchanging
/// two collectives that commute (no such bytes) yields an equivalent program, which the verifier
/// rightly accepts: every rank exchanges them alike, so no deadlock can arise either.
fn swaps(p: &Program) -> Vec<(OpId, OpId)> {
    let mut last: Vec<Option<OpId>> = vec![None; p.streams.len()];
    let mut out = vec![];
    for (id, op) in p.ops.iter() {
        if op.collectives().is_empty() {
            continue;
        }
        let s = op.stream.index();
        if let Some(prev) = last[s].replace(id) {
            let (a, b) = (touches(p, &p.ops[prev]), touches(p, op));
            let between = (prev.index() + 1..id.index()).any(|o| {
                let t = touches(p, &p.ops[OpId::new(o)]);
                conflict(&t, &a) || conflict(&t, &b)
            });
            if conflict(&a, &b) || between {
                out.push((prev, id));
            }
        }
    }
    out
}

/// The two ops trade what they do; each keeps its place, stream, waits and event.
fn swap_ops(p: &mut Program, a: OpId, b: OpId) {
    let (x, y) = (p.ops[a].clone(), p.ops[b].clone());
    for (at, from) in [(a, y), (b, x)] {
        let op = &mut p.ops[at];
        op.kind = from.kind;
        op.role = from.role;
        op.layer = from.layer;
        op.micro_step = from.micro_step;
        op.reads = from.reads;
        op.writes = from.writes;
    }
}

#[test]
fn reordering_two_collectives_on_a_stream_is_caught() {
    assert_tiny_exhaustive("collective swap", |p| swaps(p).len());
    let (tried, _) = refused_everywhere("swapping", swaps, |p, &(a, b)| swap_ops(p, a, b));
    assert!(tried > 500, "only {tried} swaps tried");
}

/// Gradient clipping: the norm, its all-reduce and its readers, on every plan that clips.
#[test]
fn breaking_the_gradient_norm_is_caught() {
    let norm = OpKind::Compute(ComputeKind::GradNorm);
    let mut plans = 0;
    for ex in examples() {
        let p = &ex.program;
        let Some(g) = p
            .ops
            .iter()
            .find(|(_, op)| op.kind == norm)
            .map(|(id, _)| id)
        else {
            continue;
        };
        plans += 1;
        let updates: Vec<OpId> = p
            .ops
            .iter()
            .filter(|(_, op)| op.kind == OpKind::Compute(ComputeKind::Update))
            .map(|(id, _)| id)
            .collect();
        let mut cases: Vec<(String, Program)> = vec![];
        // Any update no longer reading the norm.
        for &u in &updates {
            let mut m = p.clone();
            m.ops[u].reads.truncate(2);
            cases.push((format!("{u} without the norm"), m));
        }
        // The norm without one layer's gradient, or reading one twice.
        for k in 0..p.ops[g].reads.len() {
            let mut m = p.clone();
            m.ops[g].reads.remove(k);
            cases.push((format!("grad_norm without read {k}"), m));
            let mut m = p.clone();
            let r = m.ops[g].reads[k];
            m.ops[g].reads.push(r);
            cases.push((format!("grad_norm reading {k} twice"), m));
        }
        // The norm computed before the last boundary collective (their contents trade places).
        if let Some(prev) = (0..g.index())
            .rev()
            .map(OpId::new)
            .find(|&o| !p.ops[o].collectives().is_empty() && p.ops[o].stream == p.ops[g].stream)
        {
            let mut m = p.clone();
            swap_ops(&mut m, prev, g);
            cases.push((format!("grad_norm swapped with {prev}"), m));
        }
        // The norm's all-reduce over another communicator of the same group size.
        if let Some((a, c)) = p.ops.iter().find_map(|(id, op)| match &op.kind {
            OpKind::Collective(c) if op.reads.iter().any(|r| p.ops[g].writes.contains(r)) => {
                Some((id, *c))
            }
            _ => None,
        }) {
            for (other, comm) in p.comms.iter() {
                // A communicator with the same groups in the same order is the same reduction.
                if other != c.comm
                    && comm.group_size() == p.comms[c.comm].group_size()
                    && comm.groups != p.comms[c.comm].groups
                {
                    let mut m = p.clone();
                    if let OpKind::Collective(x) = &mut m.ops[a].kind {
                        x.comm = other;
                    }
                    cases.push((format!("norm all_reduce over {other}"), m));
                }
            }
        }
        for (what, m) in cases {
            assert!(!accepted(&m), "{}: {what} is not caught", ex.name);
        }
    }
    assert!(plans >= 4, "only {plans} plans clip");
}

/// The messages of every error `verify` reports (none when it accepts).
fn messages(p: &Program) -> Vec<String> {
    sched_verify::errors(p)
        .into_iter()
        .map(|e| e.message)
        .collect()
}

/// Runs `mutate` on up to `limit` evenly spaced sites of every example and asserts that the
/// verifier refuses each result with an error containing `says` (so that proof, not another,
/// is shown to catch it); returns the sites tried.
fn caught_by(
    says: &str,
    limit: usize,
    sites: impl Fn(&Program) -> Vec<usize>,
    mutate: impl Fn(&mut Program, usize) -> bool,
) -> usize {
    let mut tried = 0;
    let mut missed = vec![];
    for ex in examples() {
        let all = sites(&ex.program);
        let n = all.len();
        let picked: Vec<usize> = if n <= limit {
            all
        } else {
            (0..limit).map(|i| all[i * n / limit]).collect()
        };
        for site in picked {
            let mut m = ex.program.clone();
            if !mutate(&mut m, site) {
                continue;
            }
            tried += 1;
            let found = messages(&m);
            if !found.iter().any(|msg| msg.contains(says)) {
                missed.push(format!("{}: site {site}: {found:?}", ex.name));
            }
        }
    }
    assert!(
        missed.is_empty(),
        "{} of {tried} mutations not caught by `{says}`:\n{}",
        missed.len(),
        missed.join("\n")
    );
    tried
}

/// Issue order (proof 1b): a second op recording an event (one host thread enqueueing in issue
/// order would make every later wait on it wait for the second record, which the verifier's
/// happens-before does not see), and a wait moved to an op issued before the event's record
/// (on CUDA it would wait for nothing).
#[test]
fn breaking_the_issue_order_is_caught() {
    let events = |p: &Program| (0..p.events.len()).collect::<Vec<_>>();
    let recorded_twice = caught_by("may be recorded only once", 40, events, |p, e| {
        let e = EventId::new(e);
        let recorder = p.events[e].recorder;
        // The next op without an event of its own records this one too.
        let Some(second) = (recorder.index() + 1..p.ops.len())
            .map(OpId::new)
            .find(|&o| p.ops[o].record.is_none())
        else {
            return false;
        };
        p.ops[second].record = Some(e);
        true
    });
    assert!(recorded_twice > 500, "only {recorded_twice} double records");
    let flat_waits = |p: &Program| (0..waits(p).len()).collect::<Vec<_>>();
    let early = caught_by("issued later", 40, flat_waits, |p, k| {
        let (op, w) = waits(p)[k];
        let e = p.ops[op].wait[w];
        let recorder = p.events[e].recorder;
        // The wait moves to the op issued just before its event's recorder.
        let Some(before) = recorder.index().checked_sub(1).map(OpId::new) else {
            return false;
        };
        p.ops[op].wait.remove(w);
        p.ops[before].wait.push(e);
        p.ops[before].wait.sort_unstable();
        true
    });
    assert!(early > 500, "only {early} early waits");
}

/// Collectives whose input and output are different buffers over a group of several ranks, as
/// (op, index of the collective in the op) flattened to one number per site.
fn separate_collectives(p: &Program) -> Vec<(OpId, usize)> {
    p.ops
        .iter()
        .flat_map(|(id, op)| {
            op.collectives()
                .iter()
                .enumerate()
                .filter(|(_, c)| {
                    let (i, o) = (&p.buffers[c.input.buffer], &p.buffers[c.output.buffer]);
                    c.input.buffer != c.output.buffer
                        && p.comms[c.comm].group_size() > 1
                        && i.offset + o.bytes <= p.arena_bytes
                })
                .map(move |(k, _)| (id, k))
                .collect::<Vec<_>>()
        })
        .collect()
}

/// NCCL buffer rules (proof 8): a collective's output buffer moved to start where its input
/// buffer starts. Member 0 then runs in place, every other member with input and output
/// overlapping in a way NCCL leaves undefined, on every kind of collective the examples have.
#[test]
fn overlapping_a_collectives_input_and_output_is_caught() {
    let sites = |p: &Program| (0..separate_collectives(p).len()).collect::<Vec<_>>();
    let tried = caught_by("NCCL does not define", 40, sites, |p, k| {
        let (op, i) = separate_collectives(p)[k];
        let c = p.ops[op].collectives()[i];
        p.buffers[c.output.buffer].offset = p.buffers[c.input.buffer].offset;
        true
    });
    assert!(tried > 500, "only {tried} overlapping collectives");
}

/// Ops that write their stream's workspace, by index.
fn workspace_writers(p: &Program) -> Vec<usize> {
    p.ops
        .iter()
        .filter(|(_, op)| op.writes.iter().any(|r| p.is_workspace(r)))
        .map(|(id, _)| id.index())
        .collect()
}

/// Workspaces (the IR module doc): every op that uses scratch must declare its write of its
/// stream's workspace, or the race and memory-plan proofs could not see it; so dropping that
/// write, pointing it at another stream's workspace, letting a collective touch one, or placing
/// a workspace on bytes another buffer uses at the same time is refused, each by the check that
/// should catch it. (A few dozen sites per example: each class is one pattern per op kind.)
#[test]
fn breaking_a_workspace_is_caught() {
    const SITES: usize = 30;
    let writers = caught_by(
        "must write its stream's workspace",
        SITES,
        workspace_writers,
        |p, i| {
            let op = &mut p.ops[OpId::new(i)];
            let n = op.writes.len();
            op.writes.truncate(n - 1);
            true
        },
    );
    assert!(writers > 1000, "only {writers} workspace writes dropped");
    // An op writing another stream's workspace (an update on `sync` the compute stream's, a
    // layer op the sync stream's).
    let foreign = caught_by(
        "which only that stream's compute ops use",
        SITES,
        workspace_writers,
        |p, i| {
            let stream = p.ops[OpId::new(i)].stream;
            let Some(other) = p
                .streams
                .iter()
                .find(|(s, st)| *s != stream && st.workspace.is_some())
                .and_then(|(_, st)| st.workspace)
            else {
                return false;
            };
            let w = p.ops[OpId::new(i)].writes.last_mut().unwrap();
            w.buffer = other.buffer;
            w.offset = Offset::Fixed(other.gemm_bytes);
            w.bytes = 0;
            true
        },
    );
    assert!(foreign > 500, "only {foreign} foreign workspace writes");
    // A collective whose output is a workspace.
    let collective = caught_by(
        "which only that stream's compute ops use",
        SITES,
        |p| collectives(p).iter().map(|id| id.index()).collect(),
        |p, i| {
            let Some(ws) = p.streams.values().find_map(|s| s.workspace) else {
                return false;
            };
            p.ops[OpId::new(i)].writes.push(Region::whole(ws.buffer, 0));
            true
        },
    );
    assert!(
        collective > 500,
        "only {collective} collectives writing a workspace"
    );
    // A workspace moved onto a buffer in use at the same time, or such a buffer onto it (the
    // pair packed into one site).
    let moved = caught_by(
        "shares arena bytes",
        SITES,
        |p| {
            moves(p)
                .into_iter()
                .filter(|(a, b)| {
                    p.buffers[*a].kind == BufferKind::Workspace
                        || p.buffers[*b].kind == BufferKind::Workspace
                })
                .map(|(a, b)| a.index() << 32 | b.index())
                .collect()
        },
        |p, i| {
            let (a, b) = (BufferId::new(i >> 32), BufferId::new(i & 0xffff_ffff));
            p.buffers[a].offset = p.buffers[b].offset;
            true
        },
    );
    assert!(moved > 500, "only {moved} workspace moves");
}
