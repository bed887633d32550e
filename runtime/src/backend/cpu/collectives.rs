//! Collectives of the CPU backend: real bytes between ranks' arenas.
//!
//! Chunk `j` of an all-gather's output or a reduce-scatter's input belongs to member `j` of the
//! group, in the plan's member order. Reductions sum in f32 in member order (so every rank gets
//! bit-identical results) and round once to the dtype. Every input is read before any output is
//! written, so in-place collectives (an all-reduce on its own buffer, the hierarchical
//! all-gather's intra-node stage writing around each member's chunk) are exact.

use super::sync::Stop;
use super::{RankCtx, StepShared, Stopped};
use crate::backend::RunError;
use sched_ir::ir::{CollectiveOp, OpId};
use sched_ir::job::Collective;

/// Runs the collectives of op `op` on `ctx`'s rank, one after another (a coalesced group's
/// members are issued together and every member runs them in the same order).
pub fn run(
    sh: &StepShared<'_>,
    ctx: &RankCtx<'_>,
    op: OpId,
    cs: &[CollectiveOp],
) -> Result<(), Stopped> {
    let p = sh.plan;
    for (i, c) in cs.iter().enumerate() {
        let comm = &p.program.comms[c.comm];
        let (g, pos) = p.members[c.comm][ctx.rank as usize];
        let group = &comm.groups[g];
        let call = p.call_numbers[op][i];
        if c.kind.is_point_to_point() {
            point_to_point(sh, ctx, op, c, (g, call))?;
            continue;
        }
        let meeting = &sh.meetings[c.comm.as_u32() as usize][g];
        let stream = p.program.ops[op].stream.as_u32() as usize;
        let staging = &sh.staging[ctx.rank as usize * p.program.streams.len() + stream];
        let place = (p.at(ctx.rank, &c.input), p.at(ctx.rank, &c.output));
        match meeting.meet(
            (pos, place),
            call,
            &sh.abort,
            sh.options.timeout,
            |places| {
                let mut staging = staging.lock().expect("staging lock");
                move_bytes(sh, (group, places), c, &mut staging)
                    .map_err(|m| RunError::at(ctx.rank, Some(p.describe(op)), m))
            },
        ) {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                sh.abort.set(e);
                return Err(Stopped::Aborted);
            }
            Err((Stop::Aborted, _)) => return Err(Stopped::Aborted),
            Err((Stop::TimedOut, missing)) => {
                let who: Vec<String> = missing.iter().map(|&m| group[m].to_string()).collect();
                return Err(Stopped::Failed(Box::from(format!(
                    "collective on {} waited {:?} for rank(s) {} of group {:?}, which never arrived",
                    c.comm,
                    sh.options.timeout,
                    who.join(", "),
                    group
                ))));
            }
        }
    }
    Ok(())
}

/// A send leaves a copy of its bytes in the step's mailbox and goes on; a receive waits for the
/// send with its call number and writes its bytes (see [`super::sync::Mailbox`]).
fn point_to_point(
    sh: &StepShared<'_>,
    ctx: &RankCtx<'_>,
    op: OpId,
    c: &CollectiveOp,
    (group, call): (usize, u64),
) -> Result<(), Stopped> {
    let p = sh.plan;
    let arena = &sh.arenas[ctx.rank as usize];
    let at = p.at(ctx.rank, &c.input);
    let bytes = c.count * c.dtype.bytes();
    let key = (c.comm.as_u32(), group, call);
    let failed = |e: crate::arena::AccessError| {
        sh.abort
            .set(RunError::at(ctx.rank, Some(p.describe(op)), e));
        Stopped::Aborted
    };
    if c.kind == Collective::Send {
        let mut letter = Vec::with_capacity(bytes as usize / 2);
        arena.append_bytes(at, bytes, &mut letter).map_err(failed)?;
        sh.mailbox.post(key, letter);
        return Ok(());
    }
    match sh.mailbox.take(key, &sh.abort, sh.options.timeout) {
        Ok(letter) => arena.write_bytes(at, &letter).map_err(failed),
        Err(Stop::Aborted) => Err(Stopped::Aborted),
        Err(Stop::TimedOut) => Err(Stopped::Failed(Box::from(format!(
            "receive on {} waited {:?} for its send, which never came",
            c.comm, sh.options.timeout
        )))),
    }
}

/// What the thread moving a collective's bytes stages them in: every member's input is read
/// before any output is written. Kept per (rank, stream) from step to step (the backend's stream
/// threads are started anew each step), so steady steps allocate and fault in nothing.
#[derive(Default)]
pub struct Staging {
    /// Raw 2-byte words: an all-gather's whole output, a broadcast's payload.
    words: Vec<u16>,
    /// A reduction's running sum and the member values being added.
    sum: Vec<f32>,
    values: Vec<f32>,
}

/// Moves every member's data for one collective (called by the last member to arrive), each
/// member at its own (input, output) offsets (`places`, by member).
fn move_bytes(
    sh: &StepShared<'_>,
    (group, places): (&[u32], &[(u64, u64)]),
    c: &CollectiveOp,
    staging: &mut Staging,
) -> Result<(), crate::arena::AccessError> {
    let n = group.len() as u64;
    let d = c.dtype;
    let chunk = c.count / n;
    let input_at = |j: usize| places[j].0;
    let output_at = |j: usize| places[j].1;
    let arena = |r: u32| &sh.arenas[r as usize];
    match c.kind {
        Collective::AllGather => {
            let whole = &mut staging.words;
            whole.clear();
            for (j, &r) in group.iter().enumerate() {
                arena(r).append_bytes(input_at(j), chunk * d.bytes(), whole)?;
            }
            for (j, &r) in group.iter().enumerate() {
                arena(r).write_bytes(output_at(j), whole)?;
            }
        }
        Collective::ReduceScatter | Collective::AllReduce => {
            let Staging { sum, values, .. } = staging;
            let count = c.count as usize;
            sum.clear();
            sum.resize(count, 0.0);
            values.resize(count, 0.0);
            for (j, &r) in group.iter().enumerate() {
                arena(r).read_into(input_at(j), d, values)?;
                sum.iter_mut().zip(values.iter()).for_each(|(s, x)| *s += x);
            }
            for (j, &r) in group.iter().enumerate() {
                let part = if c.kind == Collective::AllReduce {
                    &sum[..]
                } else {
                    &sum[j * chunk as usize..(j + 1) * chunk as usize]
                };
                arena(r).write(output_at(j), d, part)?;
            }
        }
        Collective::Send | Collective::Recv => {
            unreachable!("point-to-point transfers go through the mailbox")
        }
        Collective::Broadcast => {
            let root = group[0];
            let payload = &mut staging.words;
            payload.clear();
            arena(root).append_bytes(input_at(0), c.count * d.bytes(), payload)?;
            for (j, &r) in group.iter().enumerate() {
                arena(r).write_bytes(output_at(j), payload)?;
            }
        }
    }
    Ok(())
}
