//! Edits of compiled programs shared by the mutation tests: each keeps the program well formed
//! (ops and events numbered densely, every event recorded once) and breaks only its meaning; and
//! the example schedules they start from, compiled.

// Each test crate that includes this module uses some of its helpers.
#![allow(dead_code)]

use cranelift_entity::{EntityRef, PrimaryMap};
use sched_ir::ir::*;
use sched_ir::job::Job;
use std::path::Path;

/// Every job of the example files `files` (under `schedules/`), which must check.
pub fn example_jobs(files: &[&str]) -> Vec<Job> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../schedules");
    let mut out = vec![];
    for f in files {
        let a = schedc::analyze(&root.join(f), &schedc::FsLoader).unwrap();
        assert!(!a.has_errors(), "{}", a.render());
        out.extend(a.jobs.iter().cloned());
    }
    out
}

/// Each job compiled (and so proved), with its schedule's name.
pub fn compiled(jobs: &[Job]) -> Vec<(String, Program)> {
    jobs.iter()
        .map(|j| {
            let p = schedc::compile(j)
                .unwrap_or_else(|e| panic!("{}: {e}", j.schedule.name))
                .into_program();
            (j.schedule.name.clone(), p)
        })
        .collect()
}

/// Removes op `id` and every wait on the event it records, renumbering ops and events so the
/// program stays well formed: only its meaning is broken.
pub fn drop_op(p: &mut Program, id: OpId) {
    let dropped = p.ops[id].record;
    let mut ops = PrimaryMap::with_capacity(p.ops.len() - 1);
    let old_ops = std::mem::take(&mut p.ops);
    for (o, mut op) in old_ops.into_iter() {
        if o == id {
            continue;
        }
        if let Some(ev) = dropped {
            op.wait.retain(|&w| w != ev);
            for w in &mut op.wait {
                if w.index() > ev.index() {
                    *w = EventId::new(w.index() - 1);
                }
            }
            if let Some(r) = op.record.as_mut().filter(|r| r.index() > ev.index()) {
                *r = EventId::new(r.index() - 1);
            }
        }
        ops.push(op);
    }
    p.ops = ops;
    renumber_events(p);
}

/// Rebuilds the event table from the ops' records (after ops moved or went).
pub fn renumber_events(p: &mut Program) {
    p.events.clear();
    let mut recorded: Vec<(EventId, OpId)> = p
        .ops
        .iter()
        .filter_map(|(o, op)| op.record.map(|e| (e, o)))
        .collect();
    recorded.sort();
    for (_, o) in recorded {
        p.events.push(Event { recorder: o });
    }
}
