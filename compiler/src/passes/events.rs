//! Event insertion (lowering spec §5, "Events").
//!
//! Reads the ops' regions in issue order and the prefetch pass's fences; writes `wait` lists and
//! `record` events. Every read depends on the buffer's last write, every write on its last write
//! and every read since (read-after-write, write-after-read, write-after-write; per buffer, so a
//! region of a buffer conflicts with any other region of it). A dependency on another stream
//! becomes a wait unless stream order and earlier waits already imply it: dependencies are taken
//! latest first and the op's vector clock grows with each wait, so no wait is redundant.
//!
//! Collectives are also chained: each depends on the collective issued before it. NCCL promises no
//! concurrent progress across communicators, so two collectives a rank could run in either order
//! could deadlock against another rank running them in the other; chaining makes every rank run
//! them in the one issue order (lowering spec §7.4). Communication still overlaps computation.
//! With pipeline stages the chain is per stage (pipeline sends and receives included): a rank
//! runs only its stage's ops.

use cranelift_entity::{EntityRef, SecondaryMap};
use sched_ir::ir::*;

/// Inserts waits for data dependencies, the collective chain and `fences`; replaces any waits and
/// events from an earlier run.
pub fn run(p: &mut Program, fences: &[(OpId, OpId)]) {
    p.events.clear();
    for op in p.ops.values_mut() {
        op.wait.clear();
        op.record = None;
    }
    // Fences by waiter (their order is irrelevant: dependencies are sorted below).
    let mut extra: Vec<Vec<OpId>> = vec![vec![]; p.ops.len()];
    for &(waiter, waited) in fences {
        extra[waiter.index()].push(waited);
    }
    let streams = p.streams.len();
    let mut last_writer: SecondaryMap<BufferId, Option<OpId>> = SecondaryMap::new();
    let mut readers: SecondaryMap<BufferId, Vec<OpId>> = SecondaryMap::new();
    let mut clocks: Vec<u32> = vec![0; p.ops.len() * streams];
    let mut seq: SecondaryMap<OpId, u32> = SecondaryMap::new();
    let mut last_on: Vec<Option<OpId>> = vec![None; streams];
    let mut count = vec![0u32; streams];
    let mut event_of: SecondaryMap<OpId, Option<EventId>> = SecondaryMap::new();
    // The chain is per pipeline stage: a stage's ranks run only its ops.
    let mut last_collective: Vec<Option<OpId>> = vec![None; p.layout.stages.max(1) as usize];
    let mut clock: Vec<u32> = vec![0; streams];
    let mut deps: Vec<OpId> = vec![];

    for id in p.ops.keys().collect::<Vec<_>>() {
        let op = &p.ops[id];
        deps.clear();
        deps.append(&mut extra[id.index()]);
        for r in &op.reads {
            deps.extend(last_writer[r.buffer]);
        }
        for w in &op.writes {
            deps.extend(last_writer[w.buffer]);
            deps.extend(readers[w.buffer].iter().copied());
        }
        for r in &op.reads {
            if !op.writes.iter().any(|w| w.buffer == r.buffer) {
                readers[r.buffer].push(id);
            }
        }
        for w in &op.writes {
            last_writer[w.buffer] = Some(id);
            readers[w.buffer].clear();
        }
        if !op.collectives().is_empty() {
            let stage = p.streams[op.stream].stage as usize;
            deps.extend(last_collective[stage].replace(id));
        }
        deps.retain(|&d| d != id);
        deps.sort_unstable_by(|a, b| b.cmp(a));
        deps.dedup();

        let s = op.stream.index();
        match last_on[s] {
            Some(prev) => {
                clock.copy_from_slice(&clocks[prev.index() * streams..(prev.index() + 1) * streams])
            }
            None => clock.fill(0),
        }
        let mut waits = vec![];
        for &d in &deps {
            let ds = p.ops[d].stream.index();
            if ds == s || clock[ds] >= seq[d] {
                continue;
            }
            let ev = *event_of[d].get_or_insert_with(|| p.events.push(Event { recorder: d }));
            waits.push(ev);
            let from = &clocks[d.index() * streams..(d.index() + 1) * streams];
            clock
                .iter_mut()
                .zip(from)
                .for_each(|(a, &b)| *a = (*a).max(b));
        }
        count[s] += 1;
        clock[s] = count[s];
        seq[id] = count[s];
        clocks[id.index() * streams..(id.index() + 1) * streams].copy_from_slice(&clock);
        last_on[s] = Some(id);
        waits.sort_unstable();
        p.ops[id].wait = waits;
    }
    for (ev, e) in p.events.iter() {
        p.ops[e.recorder].record = Some(ev);
    }
}
