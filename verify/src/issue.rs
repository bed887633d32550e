//! Proof 1b: the issue order can be enqueued by one host thread, as every backend does.
//!
//! A backend walks the ops in issue order and enqueues each on its stream: its waits, the op, its
//! record (`cuStreamWaitEvent`, the op, `cuEventRecord` on CUDA; the CPU backend's threads block
//! on the same events). `cuStreamWaitEvent` waits for the latest record already enqueued and for
//! nothing when there is none, so the plan must be such that:
//! - every event is recorded by exactly one op, the one the event names (an event recorded twice
//!   would make a wait mean whichever record came last; an op recording an event that names
//!   another op would make the verifier's happens-before differ from the backend's);
//! - every wait names an event that exists and whose recorder is issued before the waiter (a
//!   wait on a later record would wait for nothing on CUDA and forever on a blocking host).
//!
//! With these, the events the verifier's clocks follow are exactly the ones a backend signals.

use super::VerifyError;
use cranelift_entity::EntityRef;
use sched_ir::ir::*;

pub fn check(p: &Program) -> Vec<VerifyError> {
    let mut errs = vec![];
    let mut err = |op: Option<OpId>, m: String| errs.push(VerifyError { op, message: m });
    for (e, ev) in p.events.iter() {
        if p.ops.get(ev.recorder).and_then(|o| o.record) != Some(e) {
            err(None, format!("{e} is not recorded by the op it names"));
        }
    }
    for (id, op) in p.ops.iter() {
        if let Some(e) = op.record {
            match p.events.get(e) {
                None => err(Some(id), format!("records {e}, which does not exist")),
                Some(ev) if ev.recorder != id => err(
                    Some(id),
                    format!(
                        "records {e}, which {} records: an event may be recorded only once, by the op it names",
                        ev.recorder
                    ),
                ),
                Some(_) => {}
            }
        }
        for &w in &op.wait {
            match p.events.get(w) {
                None => err(Some(id), format!("waits on {w}, which does not exist")),
                Some(ev) if ev.recorder >= id => err(
                    Some(id),
                    format!(
                        "waits on {w}, recorded by {} which is issued later: the host would wait forever",
                        ev.recorder
                    ),
                ),
                Some(_) => {}
            }
        }
    }
    debug_assert!(errs
        .iter()
        .all(|e| e.op.is_none_or(|o| o.index() < p.ops.len())));
    errs
}
