//! Mutation tests of the tensor-parallel proofs (parallel spec §3.3): a tensor-parallel plan
//! edited so that a partial sum is never summed, is summed over the wrong ranks or is summed twice
//! must be refused, the message naming the layer, the sublayer and the op. With sequence
//! parallelism also: a gather of rows dropped, over the wrong ranks or of rows already
//! gathered, and the norms' gradient sum over the tensor group dropped or doubled.

mod edit;

use edit::{drop_op, renumber_events};
use sched_ir::ir::*;
use sched_ir::job::Collective;

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

/// The tensor group's ops (collectives or groups) of `kind` reading a buffer of kind `from`,
/// in issue order.
fn tensor_ops(p: &Program, kind: Collective, from: BufferKind) -> Vec<OpId> {
    p.ops
        .iter()
        .filter(|(_, o)| o.role == OpRole::Tensor)
        .filter(|(_, o)| {
            o.collectives()
                .iter()
                .any(|c| c.kind == kind && p.buffers[c.input.buffer].kind == from)
        })
        .map(|(id, _)| id)
        .collect()
}

/// The sums of partials over the tensor group (all-reduces, or with sequence parallelism
/// reduce-scatters), in issue order.
fn tensor_sums(p: &Program) -> Vec<OpId> {
    let kind = match p.layout.sequence {
        true => Collective::ReduceScatter,
        false => Collective::AllReduce,
    };
    tensor_ops(p, kind, BufferKind::Partial)
}

/// Another communicator of pairs inside a stage whose groups are not the tensor groups (a
/// data-parallel one), if the program has one.
fn other_pairs(p: &Program) -> Option<CommId> {
    p.comms
        .iter()
        .find(|&(id, c)| {
            c.groups.iter().all(|g| g.len() == 2)
                && !c.name.starts_with("tensor")
                && p.stages_spanned(id).is_none()
        })
        .map(|(id, _)| id)
}

/// The examples with sequence parallelism.
fn sequence_programs() -> Vec<(String, Program)> {
    let sp: Vec<_> = programs()
        .into_iter()
        .filter(|(_, p)| p.layout.sequence)
        .collect();
    assert!(sp.len() >= 2, "the sequence-parallel examples went missing");
    sp
}

/// The norms' gradient sums over the tensor group (sequence parallelism).
fn norm_sums(p: &Program) -> Vec<OpId> {
    let mut ops = tensor_ops(p, Collective::AllReduce, BufferKind::GradShard);
    ops.extend(tensor_ops(p, Collective::AllReduce, BufferKind::FullGrad));
    ops.sort();
    ops
}

/// `p` with a copy of op `s` issued right after it on its stream, the copy recording the
/// event `s` recorded (so what waited for the sum waits for both).
fn twice(p: &Program, s: OpId) -> Program {
    let mut q = p.clone();
    let mut again = q.ops[s].clone();
    q.ops[s].record = None;
    again.wait.clear();
    let old = std::mem::take(&mut q.ops);
    for (id, op) in old.into_iter() {
        q.ops.push(op);
        if id == s {
            q.ops.push(again.clone());
        }
    }
    renumber_events(&mut q);
    q
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
            assert_refused(&name, &q, "a dropped tensor sum", "summed partial");
        }
    }
}

#[test]
fn a_sum_over_other_ranks_is_refused() {
    let mut tried = 0;
    for (name, p) in programs() {
        let Some(other) = other_pairs(&p) else {
            continue;
        };
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

/// An all-reduce in place summed twice counts each part t times. (A reduce-scatter repeated
/// reads the same unsummed partials and writes the same rows: harmless, so not a mutation.)
#[test]
fn a_sum_twice_is_refused() {
    for (name, p) in programs().into_iter().filter(|(_, p)| !p.layout.sequence) {
        let q = twice(&p, tensor_sums(&p)[0]);
        assert_refused(&name, &q, "a second sum", "again");
    }
}

/// With sequence parallelism the closes work on rows: an all-reduce of the whole partial in
/// place of its reduce-scatter is refused.
#[test]
fn an_all_reduce_in_place_of_a_reduce_scatter_is_refused() {
    for (name, p) in sequence_programs() {
        let mut q = p.clone();
        let s = tensor_sums(&q)[0];
        if let OpKind::Collective(c) = &mut q.ops[s].kind {
            c.kind = Collective::AllReduce;
            c.output = c.input;
        }
        assert_refused(&name, &q, "an all-reduce of a partial", "reduce-scattered");
    }
}

#[test]
fn every_gather_of_rows_is_needed() {
    for (name, p) in sequence_programs() {
        let gathers = tensor_ops(&p, Collective::AllGather, BufferKind::Hidden);
        assert!(!gathers.is_empty(), "{name}: no gather of rows");
        for &g in gathers.iter().step_by(5) {
            let mut q = p.clone();
            let layer = p.layers[p.ops[g].layer.expect("a layer's")].name.clone();
            drop_op(&mut q, g);
            let m = messages(&q);
            assert!(
                m.iter()
                    .any(|e| e.contains("the tensor group's gather of") && e.contains(&layer)),
                "{name}: the gather {g} of {layer} dropped, not refused: {m:#?}"
            );
        }
    }
}

#[test]
fn rows_gathered_twice_or_over_other_ranks_are_refused() {
    for (name, p) in sequence_programs() {
        let gathers = tensor_ops(&p, Collective::AllGather, BufferKind::Hidden);
        // The second gather reads (a shard's worth of) the first one's whole output.
        let mut q = p.clone();
        let first = match &p.ops[gathers[0]].kind {
            OpKind::Collective(c) => c.output.buffer,
            _ => unreachable!(),
        };
        if let OpKind::Collective(c) = &mut q.ops[gathers[1]].kind {
            c.input.buffer = first;
        }
        let m = messages(&q);
        assert!(
            m.iter()
                .any(|e| e.contains("gathers the tensor group's gather of")),
            "{name}: rows gathered twice not refused: {m:#?}"
        );
        // A gather over a data-parallel communicator.
        if let Some(other) = other_pairs(&p) {
            let mut q = p.clone();
            if let OpKind::Collective(c) = &mut q.ops[gathers[0]].kind {
                c.comm = other;
            }
            let m = messages(&q);
            assert!(
                m.iter()
                    .any(|e| e.contains("all_gather") && e.contains("not the tensor groups")),
                "{name}: a gather over other ranks not refused: {m:#?}"
            );
        }
    }
}

#[test]
fn the_norm_gradient_sum_is_needed_once() {
    for (name, p) in sequence_programs() {
        let sums = norm_sums(&p);
        assert!(!sums.is_empty(), "{name}: no sum of norm gradients");
        // Dropped, its event recorded by the op before it on its stream (the backward close),
        // so that what waited for the sum still waits for the close.
        let mut q = p.clone();
        let s = sums[0];
        let before = q
            .ops
            .iter()
            .rev()
            .find(|&(o, op)| o < s && op.stream == q.ops[s].stream)
            .map(|(o, _)| o)
            .expect("a close before the sum");
        assert!(q.ops[before].record.is_none(), "{name}: the close records");
        q.ops[before].record = q.ops[s].record.take();
        drop_op(&mut q, s);
        let m = messages(&q);
        assert!(
            m.iter()
                .any(|e| e.contains("rows' part of a norm's gradient") && e.contains("update")),
            "{name}: the norms' gradient sum dropped, not refused: {m:#?}"
        );
        let q = twice(&p, sums[0]);
        let m = messages(&q);
        assert!(
            m.iter()
                .any(|e| e.contains("summed over the tensor group, once")),
            "{name}: the norms' gradient summed twice, not refused: {m:#?}"
        );
    }
}
