//! Mutation tests of the tensor-parallel proofs (parallel spec §3.3): a tensor-parallel plan
//! edited so that a partial sum is never summed, is summed over the wrong ranks or is summed twice
//! must be refused, the message naming the layer, the sublayer and the op.

mod edit;

use edit::{drop_op, renumber_events};
use sched_ir::ir::*;

/// `schedules/tiny_tensor.sched`'s programs (tensor groups of 2, alone and in pipeline stages).
fn programs() -> Vec<(String, Program)> {
    let jobs = edit::example_jobs(&["tiny_tensor.sched"]);
    assert!(jobs.len() >= 2, "the tensor examples went missing");
    edit::compiled(&jobs)
}

fn messages(p: &Program) -> Vec<String> {
    sched_verify::errors(p)
        .iter()
        .map(|e| e.to_string())
        .collect()
}

/// The tensor all-reduces, in issue order.
fn tensor_sums(p: &Program) -> Vec<OpId> {
    p.ops
        .iter()
        .filter(|(_, o)| o.role == OpRole::Tensor)
        .map(|(id, _)| id)
        .collect()
}

fn assert_refused(name: &str, p: &Program, what: &str, needle: &str) {
    let m = messages(p);
    assert!(
        m.iter()
            .any(|e| e.contains(needle) && e.contains("block[") && e.contains("sublayer")),
        "{name}: {what} not refused with `{needle}` naming layer and sublayer: {m:#?}"
    );
}

#[test]
fn the_examples_prove_and_every_tensor_sum_is_needed() {
    for (name, p) in programs() {
        assert!(messages(&p).is_empty(), "{name}: {:#?}", messages(&p));
        let sums = tensor_sums(&p);
        assert!(!sums.is_empty(), "{name}: no tensor all-reduce");
        // Dropping any one of them leaves a close reading an unsummed partial.
        for &s in sums.iter().step_by(3) {
            let mut q = p.clone();
            drop_op(&mut q, s);
            assert_refused(&name, &q, "a dropped tensor all-reduce", "unsummed");
        }
    }
}

#[test]
fn a_sum_over_other_ranks_is_refused() {
    let mut tried = 0;
    for (name, p) in programs() {
        // Another communicator of pairs inside a stage whose groups are not the tensor groups
        // (a data-parallel one).
        let other = p
            .comms
            .iter()
            .find(|&(id, c)| {
                c.groups.iter().all(|g| g.len() == 2)
                    && !c.name.starts_with("tensor")
                    && p.stages_spanned(id).is_none()
            })
            .map(|(id, _)| id);
        let Some(other) = other else { continue };
        tried += 1;
        let mut q = p.clone();
        let s = tensor_sums(&q)[0];
        if let OpKind::Collective(c) = &mut q.ops[s].kind {
            c.comm = other;
        }
        assert_refused(&name, &q, "a sum over other ranks", "not the tensor groups");
    }
    assert!(
        tried > 0,
        "no example has a data-parallel communicator of pairs"
    );
}

#[test]
fn a_sum_twice_is_refused() {
    for (name, p) in programs() {
        let mut q = p.clone();
        let s = tensor_sums(&q)[0];
        let mut again = q.ops[s].clone();
        again.record = None;
        again.wait.clear();
        // The second sum right after the first, on its stream.
        let old = std::mem::take(&mut q.ops);
        for (id, op) in old.into_iter() {
            q.ops.push(op);
            if id == s {
                q.ops.push(again.clone());
            }
        }
        renumber_events(&mut q);
        assert_refused(&name, &q, "a second sum", "again");
    }
}
