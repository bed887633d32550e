//! Edits of compiled programs shared by the mutation tests: each keeps the program well formed
//! (ops and events numbered densely, every event recorded once) and breaks only its meaning.

use cranelift_entity::{EntityRef, PrimaryMap};
use sched_ir::ir::*;

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
