//! The verifier: proves a program safe to run before anything is written (lowering spec §7).
//!
//! It stands apart from the passes that built the program: it recomputes happens-before itself and
//! trusts nothing but the program. What it proves, in order (handle and range checks first, so
//! the rest can index freely):
//! 1. **Structure.** Every handle exists; every region lies inside its buffer for every rank; every
//!    buffer lies inside the arena; each communicator's groups partition the ranks into equal
//!    groups; every compute op but accumulations and copies writes its stream's workspace (layer
//!    math from byte 0, so the GEMM library's part too), and no other op touches a workspace
//!    ([`verify_structure`] runs the part a half-built program can meet after each pass).
//!    **Issue order** ([`issue`]): every event is recorded once, by the op it names, and waited on
//!    only by ops issued after that op, so one host thread can enqueue the ops in issue order.
//! 2. **Collective matching.** Every collective's count divides by its group size and agrees with
//!    its regions and dtype for its kind. One program serves every rank, so every member of a group
//!    issues the same sequence on every communicator.
//! 3. **Chunk placement.** Chunk `j` of an all-gather's output or a reduce-scatter's input belongs
//!    to member `j`: an in-place all-gather's input is exactly the member's chunk of its output, for
//!    every rank; gathers of a param shard have member `j` holding param shard `j`; reductions of a
//!    full gradient into a grad shard have member `j` owning grad shard `j`; boundary and refresh
//!    collectives respect the nesting of optimizer, grad and param shards.
//! 4. **No deadlock.** Waits only name events of earlier ops, so issue order is a valid schedule
//!    of every stream; and each rank's collectives are totally ordered by happens-before in issue
//!    order, so no two communicators ever need to progress at once (NCCL's assumption).
//! 5. **Race freedom.** Any two accesses to overlapping bytes of a buffer, one a write, are ordered
//!    by happens-before (at once for a buffer only one stream touches, such as a workspace).
//! 6. **Memory-plan soundness.** Buffers sharing arena bytes have lifetimes ordered by
//!    happens-before; persistent buffers share bytes with nothing.
//! 7. **Right values.** Abstractly executed over all ranks, every forward and backward reads its
//!    parameters whole and current, every optimizer shard receives each of the dp × M gradient
//!    contributions exactly once, and every param shard is refreshed for the next step
//!    ([`values`]). With gradient clipping, the norm reads each layer's optimizer-shard gradient
//!    only once complete, is summed over every optimizer shard (of every stage) once, and every
//!    update reads it. Across stages both run the stages together, a collective spanning stages
//!    meeting all of them ([`joint`]).
//! 8. **NCCL buffer rules** ([`nccl`]). On every rank, every collective's input and output are
//!    disjoint in the arena or in place exactly as NCCL defines it.
//! 9. **Pipeline stages** ([`stages`]). Every op keeps to its stage's buffers and events; a
//!    collective spanning stages (an embedding group, clipping's norm) is issued by every stage
//!    its groups reach, with matching calls; each send has exactly one receive on its peer, with
//!    the same count and dtype, matched in issue order; and the stages run to the end with every send and receive blocking until its peer
//!    reaches it (group calls posting their transfers together), or the cycle of waiting stages
//!    is named. Proofs 4–6 hold per stage: a stage's ranks run only its ops, and buffers of
//!    different stages may share arena bytes.
//! 10. **Activations flow right** ([`flow`]). Abstractly executed through every stage and
//!     transfer, every forward reads its layer's input of its own micro-step, every backward
//!     the matching gradient and saved activations, and the loss the logits of its micro-step.
//!
//! Proofs 1, 1b and 8 are what the backends rely on to enqueue and call NCCL without checks of
//! their own.
//!
//! Errors are collected, each naming its op or buffer; [`render`] prints the listing with every
//! error written under the op it concerns.
//!
//! Success returns the program as [`Verified`], which nothing outside this crate can construct:
//! simulators, emitters and backends take a `Verified`, so an unproved program cannot reach them.
//! The proofs read only the program (its [`Layout`] included), never the job it came from.

mod clocks;
mod collectives;
mod contribs;
mod flow;
mod issue;
mod joint;
mod memory;
mod nccl;
pub mod plan;
mod stages;
mod structure;
mod values;

use sched_ir::ir::layout::{range, representative_ranks};
use sched_ir::ir::*;
use std::collections::HashMap;

pub use clocks::Clocks;

/// One violated invariant.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{}{message}", op.map(|o| format!("{o}: ")).unwrap_or_default())]
pub struct VerifyError {
    pub op: Option<OpId>,
    pub message: String,
}

/// What a verified program is known to satisfy, for emitters and the runtime.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PlanInfo {
    /// The most transient bytes whose issue-order lifetimes contain one op (a lower bound on any
    /// plan's transient bytes).
    pub live_bound: u64,
}

/// A program every proof holds for, with what the proofs found ([`PlanInfo`]). Only [`verify`]
/// and [`verify_with`] make one, and it gives no mutable access to its program: whatever holds
/// a `Verified` runs exactly what was proved.
#[derive(Clone, Debug)]
pub struct Verified {
    program: Program,
    info: PlanInfo,
    times: ProofTimes,
}

/// How long each proof of the final verification took, by name, in the order they ran
/// (`schedc compile --time-passes` prints them under `verify`). A value proof taken from a
/// [`ValuesProof`] run earlier costs nothing here; its time is the caller's to report.
#[derive(Clone, Debug, Default)]
pub struct ProofTimes(pub Vec<(&'static str, std::time::Duration)>);

impl ProofTimes {
    /// Runs `f` as the proof `name`, recording its time.
    fn time<T>(&mut self, name: &'static str, f: impl FnOnce() -> T) -> T {
        let start = std::time::Instant::now();
        let out = f();
        self.0.push((name, start.elapsed()));
        out
    }
}

impl Verified {
    pub fn program(&self) -> &Program {
        &self.program
    }

    pub fn info(&self) -> &PlanInfo {
        &self.info
    }

    /// How long each proof took ([`ProofTimes`]).
    pub fn proof_times(&self) -> &ProofTimes {
        &self.times
    }

    /// The program, no longer vouched for (to change it and verify it again).
    pub fn into_program(self) -> Program {
        self.program
    }

    /// Tests only (the `assume` feature, which only dev-dependencies enable): `program` as if it
    /// were proved, to watch a backend's stress mode catch what the verifier would refuse.
    #[cfg(feature = "assume")]
    pub fn assume(program: Program) -> Verified {
        Verified {
            program,
            info: PlanInfo { live_bound: 0 },
            times: ProofTimes::default(),
        }
    }
}

impl std::ops::Deref for Verified {
    type Target = Program;

    fn deref(&self) -> &Program {
        &self.program
    }
}

/// A program some proof fails for: every error found, and the program back, to render them in
/// its listing ([`render`], [`render_context`]).
#[derive(Debug, thiserror::Error)]
#[error(
    "the program fails verification ({} errors{})",
    errors.len(),
    errors.first().map(|e| format!("; first: {e}")).unwrap_or_default()
)]
pub struct Rejected {
    pub program: Box<Program>,
    pub errors: Vec<VerifyError>,
}

impl Rejected {
    /// The first `most` errors, each with `context` listing lines either side of its op.
    pub fn render(&self, most: usize, context: usize) -> String {
        render_context(
            &self.program,
            &self.errors[..self.errors.len().min(most)],
            context,
        )
    }
}

/// How far through the pipeline a program is: which structural facts it can already meet.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Stage {
    /// Issue order fixed (after prefetch): handles, regions and communicators are checkable.
    Ordered,
    /// Every op on a stream that exists.
    Streamed,
    /// Every stream's workspace in place: what uses one writes it, nothing else touches it.
    Provisioned,
    /// Waits and events in place: the issue-order proof holds.
    Synchronised,
    /// Every buffer placed inside the arena: the whole of proof 1.
    Placed,
}

/// The structural checks a program at `stage` must pass (proof 1 and, from
/// [`Stage::Synchronised`], the issue-order proof): cheap, run by the pipeline after each pass.
pub fn verify_structure(p: &Program, stage: Stage) -> Result<(), Vec<VerifyError>> {
    let mut errors = structure::check(p, stage);
    if stage >= Stage::Synchronised {
        errors.extend(issue::check(p));
    }
    if errors.is_empty() {
        Ok(())
    } else {
        Err(errors)
    }
}

/// The value proof (7) run ahead of the others, for a caller that can run it beside other work
/// (the pipeline runs it beside memory planning). It reads only what the later passes never
/// change (ops' kinds, roles, layers, micro-steps and regions; buffers' kinds, dtypes, sizes and
/// layers; communicators; layers; the shape of the cluster), and [`verify_with`] uses it only for
/// a program whose fingerprint of exactly those fields is the same; otherwise it proves again.
pub struct ValuesProof {
    fingerprint: u64,
    errors: Vec<VerifyError>,
}

/// Runs proof 7 (with clipping's norm) on `p` now; see [`ValuesProof`]. Meant to run beside other
/// work (memory planning, itself spread over the cores stage by stage), its runs spread over
/// every core too: the system shares the cores while both run, and whichever finishes first
/// leaves the other all of them.
pub fn prove_values(p: &Program) -> ValuesProof {
    prove_values_on(p, cores())
}

/// Proof 7 with its runs spread over at most `threads` threads.
fn prove_values_on(p: &Program, threads: usize) -> ValuesProof {
    let mut errors = values::check(p, threads);
    errors.extend(values::check_norm(p));
    ValuesProof {
        fingerprint: values_fingerprint(p),
        errors,
    }
}

/// The cores this process may use.
fn cores() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// A hash of every field of `p` the value proof reads.
fn values_fingerprint(p: &Program) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = sched_ir::hash::FxHasher::default();
    (p.layout, p.micro_steps).hash(&mut h);
    for op in p.ops.values() {
        (
            &op.kind,
            op.role,
            op.layer,
            op.micro_step,
            &op.reads,
            &op.writes,
        )
            .hash(&mut h);
    }
    for b in p.buffers.values() {
        (b.kind, b.dtype, b.bytes, b.layer, &b.name).hash(&mut h);
    }
    for c in p.comms.values() {
        c.groups.hash(&mut h);
    }
    for l in p.layers.values() {
        (l.params, l.padded, &l.name).hash(&mut h);
    }
    h.finish()
}

/// Runs every proof on `p`: the verified program, or every error found.
pub fn verify(p: Program) -> Result<Verified, Rejected> {
    verify_with(p, None)
}

/// [`verify`], taking proof 7's outcome from `values` when it was run on a program equal to `p`
/// in everything that proof reads.
pub fn verify_with(p: Program, values: Option<ValuesProof>) -> Result<Verified, Rejected> {
    let checked = check(&p, values);
    verdict(p, checked)
}

/// `p` as proved, or rejected with its errors: the one place a [`Verified`] is made.
fn verdict(
    p: Program,
    checked: Result<(PlanInfo, ProofTimes), Vec<VerifyError>>,
) -> Result<Verified, Rejected> {
    match checked {
        Ok((info, times)) => Ok(Verified {
            program: p,
            info,
            times,
        }),
        Err(errors) => Err(Rejected {
            program: Box::new(p),
            errors,
        }),
    }
}

/// [`verify_with`], also running `beside(&p)` on a second thread while the proofs run (when
/// there is a second core; otherwise after them, and only if they hold). What `beside` makes
/// comes back only with the [`Verified`] program: nothing made from a program leaves before every
/// proof holds for it.
pub fn verify_beside<T: Send>(
    p: Program,
    values: Option<ValuesProof>,
    beside: impl FnOnce(&Program) -> T + Send,
) -> Result<(Verified, T), Rejected> {
    if cores() <= 1 {
        let verified = verify_with(p, values)?;
        let made = beside(verified.program());
        return Ok((verified, made));
    }
    let (checked, made) = std::thread::scope(|s| {
        let made = s.spawn(|| beside(&p));
        let checked = check(&p, values);
        let made = made
            .join()
            .unwrap_or_else(|panic| std::panic::resume_unwind(panic));
        (checked, made)
    });
    Ok((verdict(p, checked)?, made))
}

/// Every error of `p`, without taking it: for callers that only want the verdict (the planner's
/// candidates, mutation tests). Empty when every proof holds.
pub fn errors(p: &Program) -> Vec<VerifyError> {
    check(p, None).err().unwrap_or_default()
}

fn check(
    p: &Program,
    values: Option<ValuesProof>,
) -> Result<(PlanInfo, ProofTimes), Vec<VerifyError>> {
    let mut t = ProofTimes::default();
    let mut errors = t.time("structure", || structure::check(p, Stage::Placed));
    errors.extend(t.time("issue", || issue::check(p)));
    if !errors.is_empty() {
        return Err(errors);
    }
    errors.extend(t.time("stages", || stages::check(p)));
    if !errors.is_empty() {
        return Err(errors);
    }
    errors.extend(t.time("flow", || flow::check(p)));
    let clocks = t.time("clocks", || Clocks::new(p));
    errors.extend(t.time("collectives", || collectives::check(p, &clocks)));
    let (mem_errors, live_bound) = t.time("memory", || memory::check(p, &clocks));
    errors.extend(mem_errors);
    errors.extend(t.time("nccl", || nccl::check(p)));
    if errors.is_empty() {
        let earlier = t.time("values (fingerprint)", || {
            values.filter(|v| v.fingerprint == values_fingerprint(p))
        });
        match earlier {
            Some(v) => errors.extend(v.errors),
            None => errors.extend(t.time("values", || prove_values_on(p, cores()).errors)),
        }
    }
    if errors.is_empty() {
        Ok((PlanInfo { live_bound }, t))
    } else {
        Err(errors)
    }
}

/// Each error with the listing lines around its op (`context` ops either side), for terminals.
pub fn render_context(p: &Program, errors: &[VerifyError], context: usize) -> String {
    let mut out = String::new();
    for e in errors {
        out.push_str(&format!("error: {}\n", e.message));
        let Some(op) = e.op.filter(|o| o.as_u32() < p.ops.len() as u32) else {
            continue;
        };
        let i = op.as_u32() as usize;
        let lo = i.saturating_sub(context);
        let hi = (i + context + 1).min(p.ops.len());
        for (id, o) in p.ops.iter().skip(lo).take(hi - lo) {
            let mark = if id == op { "-->" } else { "   " };
            out.push_str(&format!(
                "  {mark} {}\n",
                sched_ir::listing::op_line(p, id, o)
            ));
        }
        out.push('\n');
    }
    out
}

/// The listing with each error under its op, and errors without an op at the end.
pub fn render(p: &Program, errors: &[VerifyError]) -> String {
    let mut notes: HashMap<OpId, Vec<String>> = HashMap::new();
    let mut loose = vec![];
    for e in errors {
        match e.op {
            Some(op) if op.as_u32() < p.ops.len() as u32 => {
                notes.entry(op).or_default().push(e.message.clone())
            }
            _ => loose.push(e.message.clone()),
        }
    }
    let mut out = sched_ir::listing::emit_listing_with_notes(p, &notes);
    for m in loose {
        out.push_str(&format!("error: {m}\n"));
    }
    out
}
