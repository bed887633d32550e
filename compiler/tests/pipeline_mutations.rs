//! Mutation tests of the pipeline proofs (parallel spec §3): pipeline plans edited so that their
//! transfers no longer match, deadlock or deliver the wrong micro-batch must be refused with a
//! message naming the stage, the micro-batch and the action, and a custom order whose stages
//! wait on each other is refused with the cycle. (The general mutation classes of
//! `mutations.rs` — every wait, buffer move, collective drop and swap — run on the pipeline
//! examples too.)

mod edit;

use edit::{drop_op, renumber_events};
use sched_ir::ir::*;
use sched_ir::job::{Collective, Job};
use schedc::{analyze, compile, MemLoader};
use std::path::Path;

fn jobs() -> Vec<Job> {
    let out = edit::example_jobs(&["tiny_pipeline.sched", "tiny_pipeline_schedules.sched"]);
    assert!(out.len() >= 6, "the pipeline examples went missing");
    out
}

fn programs() -> Vec<(String, Program)> {
    edit::compiled(&jobs())
}

fn messages(p: &Program) -> Vec<String> {
    sched_verify::errors(p)
        .iter()
        .map(|e| e.to_string())
        .collect()
}

/// Whether `message` names an action with its micro-batch, as `F3's` or `B0's`.
fn names_an_action(message: &str) -> bool {
    let b = message.as_bytes();
    b.windows(4).any(|w| {
        matches!(w[0], b'F' | b'B' | b'I')
            && w[1].is_ascii_digit()
            && (&w[2..] == b"'s" || w[2].is_ascii_digit())
    })
}

/// Ops issuing at least one send or receive.
fn transfer_ops(p: &Program) -> Vec<OpId> {
    p.ops
        .iter()
        .filter(|(_, o)| o.collectives().iter().any(|c| c.kind.is_point_to_point()))
        .map(|(id, _)| id)
        .collect()
}

/// Splits every transfer group into one op per transfer, in the group's order, on the same
/// stream; the last carries the group's event, so what waited on the group still waits on all of
/// it and only the blocking semantics change.
fn ungroup_all(p: &mut Program) {
    let old = std::mem::take(&mut p.ops);
    for (_, op) in old.into_iter() {
        match &op.kind {
            OpKind::Group(cs) if cs.iter().all(|c| c.kind.is_point_to_point()) => {
                let n = cs.len();
                for (i, c) in cs.iter().enumerate() {
                    p.ops.push(Op {
                        kind: OpKind::Collective(*c),
                        reads: c.reads().collect(),
                        writes: c.writes().collect(),
                        wait: if i == 0 { op.wait.clone() } else { vec![] },
                        record: if i + 1 == n { op.record } else { None },
                        ..op.clone()
                    });
                }
            }
            _ => {
                p.ops.push(op);
            }
        }
    }
    renumber_events(p);
}

#[test]
fn unmodified_pipelines_are_accepted() {
    for (name, p) in programs() {
        assert!(messages(&p).is_empty(), "{name}: {:?}", messages(&p));
        assert!(p.layout.stages > 1, "{name} is not pipelined");
        assert!(!transfer_ops(&p).is_empty(), "{name} has no transfers");
    }
}

#[test]
fn ungrouping_the_paired_transfers_deadlocks() {
    let mut refused = 0;
    for (name, mut p) in programs() {
        let groups = p
            .ops
            .values()
            .filter(|o| matches!(&o.kind, OpKind::Group(cs) if cs.iter().all(|c| c.kind.is_point_to_point())))
            .count();
        if groups == 0 {
            continue;
        }
        ungroup_all(&mut p);
        let m = messages(&p);
        if name == "tiny_1f1b" {
            // 1F1B needs the pairing: each stage would send before receiving what its
            // neighbour sends first.
            let deadlock = m
                .iter()
                .find(|x| x.contains("deadlock"))
                .unwrap_or_else(|| panic!("{name}: no deadlock found: {m:?}"));
            for want in ["stage 0 waits", "stage 1", "closes the cycle", "chunk"] {
                assert!(
                    deadlock.contains(want),
                    "{name}: `{want}` missing from: {deadlock}"
                );
            }
            assert!(
                names_an_action(deadlock),
                "{name}: no action with its micro-batch in: {deadlock}"
            );
        }
        if m.iter().any(|x| x.contains("deadlock")) {
            refused += 1;
        }
    }
    assert!(
        refused >= 2,
        "only {refused} pipelines deadlock without their pairing"
    );
}

#[test]
fn dropping_a_send_is_refused_naming_stage_micro_batch_and_action() {
    for (name, p) in programs() {
        for id in transfer_ops(&p) {
            let cs = p.ops[id].collectives().to_vec();
            let Some(k) = cs.iter().position(|c| c.kind == Collective::Send) else {
                continue;
            };
            if cs.len() < 2 {
                continue; // (dropping a whole op is `mutations.rs`'s)
            }
            let mut m = p.clone();
            let mut rest = cs.clone();
            let dropped = rest.remove(k);
            m.ops[id].kind = if rest.len() == 1 {
                OpKind::Collective(rest[0])
            } else {
                OpKind::Group(rest.clone())
            };
            m.ops[id].reads = rest.iter().flat_map(|c| c.reads()).collect();
            m.ops[id].writes = rest.iter().flat_map(|c| c.writes()).collect();
            let msgs = messages(&m);
            let buf = &p.buffers[dropped.input.buffer].name;
            let hit = msgs.iter().find(|x| x.contains("never"));
            let hit = hit
                .unwrap_or_else(|| panic!("{name}: dropping the send of {buf} in {id}: {msgs:?}"));
            assert!(
                hit.contains("stage") && hit.contains("chunk") && names_an_action(hit),
                "{name}: {hit}"
            );
        }
    }
}

#[test]
fn swapping_two_receives_delivers_the_wrong_micro_batch() {
    let mut tried = 0;
    for (name, p) in programs() {
        // Two receives on one communicator trade the buffers they fill.
        let recvs: Vec<(OpId, usize)> = transfer_ops(&p)
            .into_iter()
            .flat_map(|id| {
                p.ops[id]
                    .collectives()
                    .iter()
                    .enumerate()
                    .filter(|(_, c)| c.kind == Collective::Recv)
                    .map(move |(i, _)| (id, i))
                    .collect::<Vec<_>>()
            })
            .collect();
        for w in recvs.windows(2) {
            let ((a, i), (b, j)) = (w[0], w[1]);
            let (ca, cb) = (p.ops[a].collectives()[i], p.ops[b].collectives()[j]);
            if ca.comm != cb.comm || ca.count != cb.count {
                continue;
            }
            let mut m = p.clone();
            let set = |m: &mut Program, id: OpId, k: usize, to: Region| {
                let mut cs = m.ops[id].collectives().to_vec();
                cs[k].input = to;
                cs[k].output = to;
                m.ops[id].kind = if cs.len() == 1 {
                    OpKind::Collective(cs[0])
                } else {
                    OpKind::Group(cs.clone())
                };
                m.ops[id].writes = cs.iter().flat_map(|c| c.writes()).collect();
            };
            set(&mut m, a, i, cb.output);
            set(&mut m, b, j, ca.output);
            tried += 1;
            let msgs = messages(&m);
            assert!(
                msgs.iter().any(|x| x.contains("micro-step")),
                "{name}: receives {a} and {b} swapped and accepted: {msgs:?}"
            );
        }
    }
    assert!(tried >= 10, "only {tried} swaps tried");
}

/// A weight half moved before its input half (the two ops trade what they do, each keeping its
/// place, stream, waits and event) reads a stash nothing wrote yet: refused, naming the layer
/// and the micro-step.
#[test]
fn moving_a_w_before_its_i_is_refused() {
    let mut tried = 0;
    for (name, p) in programs() {
        let halves = |kind: ComputeKind| -> Vec<OpId> {
            p.ops
                .iter()
                .filter(|(_, o)| o.kind == OpKind::Compute(kind))
                .map(|(id, _)| id)
                .collect()
        };
        for w in halves(ComputeKind::BackwardWeight) {
            let (layer, micro) = (p.ops[w].layer, p.ops[w].micro_step);
            let Some(i) = halves(ComputeKind::BackwardInput)
                .into_iter()
                .find(|&i| p.ops[i].layer == layer && p.ops[i].micro_step == micro)
            else {
                continue;
            };
            let mut m = p.clone();
            let (a, b) = (m.ops[i].clone(), m.ops[w].clone());
            for (at, from) in [(i, &b), (w, &a)] {
                let op = &mut m.ops[at];
                op.kind = from.kind.clone();
                op.reads = from.reads.clone();
                op.writes = from.writes.clone();
            }
            tried += 1;
            let msgs = messages(&m);
            let layer_name = &p.layers[layer.unwrap()].name;
            assert!(
                msgs.iter()
                    .any(|x| x.contains("stash") && x.contains(layer_name.as_str())),
                "{name}: W of {layer_name} m{micro:?} moved before its I and accepted: {msgs:?}"
            );
        }
    }
    assert!(tried >= 10, "only {tried} split backwards tried");
}

#[test]
fn a_deadlocking_custom_order_is_refused_with_its_cycle() {
    // Stage 0 waits for B0's gradient before it sends F1's output; stage 1 needs F1's input
    // before it runs B0.
    let text = r#"
        import "models/tiny.sched"
        import "clusters/cpu.sched"
        schedule crossed {
            model = tiny_llama;  cluster = cpu4;  micro_steps = 2;  preset = ddp
            pipeline {
                stages = 2;  schedule = custom;  layers = [2, 2]
                order {
                    stage 0 = "F0 B0 F1 B1"
                    stage 1 = "F0 F1 B0 B1"
                }
            }
        }
    "#;
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../schedules");
    let read = |f: &str| std::fs::read_to_string(root.join(f)).unwrap();
    let loader = MemLoader::default()
        .in_dir("/mem")
        .with("/mem/crossed.sched", text)
        .with("/mem/models/tiny.sched", &read("models/tiny.sched"))
        .with("/mem/clusters/cpu.sched", &read("clusters/cpu.sched"));
    let a = analyze(Path::new("/mem/crossed.sched"), &loader).unwrap();
    assert!(!a.has_errors(), "{}", a.render());
    let err = match compile(&a.jobs[0]) {
        Err(schedc::pipeline::CompileError::Verify(r)) => r.errors,
        other => panic!("compiled: {:?}", other.map(|_| ())),
    };
    let m = err
        .iter()
        .map(|e| e.to_string())
        .find(|m| m.contains("deadlock"))
        .unwrap_or_else(|| panic!("no deadlock: {err:?}"));
    for want in [
        "stage 0 waits",
        "stage 1 waits",
        "closes the cycle",
        "B0",
        "F1",
    ] {
        assert!(m.contains(want), "`{want}` missing from: {m}");
    }
}

/// The example with a head tied across stages and clipping (`tiny_gpt_tied_clip`).
fn tied_clip() -> Program {
    let job = jobs()
        .into_iter()
        .find(|j| j.schedule.name == "tiny_gpt_tied_clip")
        .expect("the tied, clipped example");
    compile(&job).unwrap().into_program()
}

/// The ops holding an all-reduce over a communicator named `name`, by stage.
fn all_reduces_over(p: &Program, name: &str) -> Vec<(u32, OpId)> {
    p.ops
        .iter()
        .filter(|(_, op)| {
            op.collectives()
                .iter()
                .any(|c| c.kind == Collective::AllReduce && p.comms[c.comm].name.contains(name))
        })
        .map(|(id, op)| (p.streams[op.stream].stage, id))
        .collect()
}

/// A new communicator whose groups are the ranks one by one (a collective over it moves nothing).
fn each_rank_alone(p: &mut Program) -> CommId {
    let groups: Vec<Vec<u32>> = (0..p.ranks()).map(|r| vec![r]).collect();
    p.comms.push(Communicator {
        name: "each rank alone".into(),
        scope: p.layout.scope(&groups),
        groups,
    })
}

/// The embedding group's all-reduce is what brings the tied head's gradient to the embedding
/// and the embedding's to the replica: dropped on one stage, its partner waits for a call that
/// never comes; dropped on both, each copy is updated without the other's gradient.
#[test]
fn dropping_the_embedding_group_is_refused() {
    let p = tied_clip();
    let group = all_reduces_over(&p, "embedding group");
    assert_eq!(group.len(), 2, "one all-reduce per stage: {group:?}");
    assert!(messages(&p).is_empty(), "{:?}", messages(&p));
    let mut one = p.clone();
    drop_op(&mut one, group[1].1);
    let msgs = messages(&one);
    assert!(
        msgs.iter().any(|m| m.contains("embedding group")
            && m.contains("reach ranks of other stages that never issue it")),
        "{msgs:?}"
    );
    // Both over groups of one rank each: every copy keeps only its own stage's gradient.
    let mut alone = p.clone();
    let solo = each_rank_alone(&mut alone);
    for &(_, o) in &group {
        if let OpKind::Collective(c) = &mut alone.ops[o].kind {
            c.comm = solo;
        }
    }
    let msgs = messages(&alone);
    // The embedding's update misses the head's term; the replica's misses the embedding's own.
    assert!(
        msgs.iter().any(|m| m.contains("update of embed on rank 0")
            && m.contains("head's backward (layer 3)")
            && m.contains("never arrives")),
        "{msgs:?}"
    );
    assert!(
        msgs.iter().any(|m| m.contains("update of embed on rank 2")
            && m.contains("the layer's own gradient never arrives")),
        "{msgs:?}"
    );
}

/// Clipping's norm is summed over both stages: an all-reduce that stays inside each stage
/// leaves every update with half the norm, and a norm that also counts the replica counts the
/// embedding twice.
#[test]
fn a_norm_of_one_stage_or_counting_the_replica_twice_is_refused() {
    let p = tied_clip();
    let norm = all_reduces_over(&p, "of every stage");
    assert_eq!(norm.len(), 2, "one norm all-reduce per stage: {norm:?}");
    // Within each stage: the stage's own grad-shard communicator has the same group size.
    let mut inside = p.clone();
    let within = inside
        .comms
        .iter()
        .find(|(_, c)| c.name.starts_with("optimizer") && !c.name.contains("every stage"))
        .map(|(id, _)| id);
    let within = within.unwrap_or_else(|| each_rank_alone(&mut inside));
    for &(_, o) in &norm {
        if let OpKind::Collective(c) = &mut inside.ops[o].kind {
            c.comm = within;
        }
    }
    let msgs = messages(&inside);
    assert!(
        msgs.iter().any(|m| m.contains("gradient norm summed over")),
        "{msgs:?}"
    );
    // The replica's stage also reading the replica's gradient into its part of the norm.
    let mut twice = p.clone();
    let norm_op = |p: &Program, stage: u32| {
        p.ops
            .iter()
            .find(|(_, op)| {
                op.kind == OpKind::Compute(ComputeKind::GradNorm)
                    && p.streams[op.stream].stage == stage
            })
            .map(|(id, _)| id)
            .expect("a norm per stage")
    };
    let replica_norm = norm_op(&twice, 1);
    // What the replica's update reads first: its optimizer-shard gradient.
    let replica_grad = twice
        .ops
        .values()
        .find(|op| {
            op.kind == OpKind::Compute(ComputeKind::Update)
                && twice.streams[op.stream].stage == 1
                && op.layer.is_some_and(|l| twice.layers[l].name == "embed")
        })
        .map(|op| op.reads[0])
        .expect("the replica's update");
    twice.ops[replica_norm].reads.push(replica_grad);
    let msgs = messages(&twice);
    assert!(msgs.iter().any(|m| m.contains("replica")), "{msgs:?}");
}

/// ZB-V keeps a tied head's replica on the embedding's own ranks when gradients are sharded:
/// the embedding group is an add of the replica's gradient into the embedding's and a copy
/// back. Either made a copy of its destination onto itself (its waits kept): without the add,
/// the embedding's update misses the head's term; without the copy, the replica's misses the
/// embedding's.
#[test]
fn dropping_the_local_embedding_sum_of_zbv_is_refused() {
    let text = r#"
        import "models/tiny.sched"
        import "clusters/cpu.sched"
        schedule v {
            model = tiny_gpt;  cluster = cpu4;  micro_steps = 4;  preset = zero3
            pipeline { stages = 2  virtual = 2  schedule = zbv  layers = [1, 1, 1, 1] }
        }
    "#;
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../schedules");
    let read = |f: &str| std::fs::read_to_string(root.join(f)).unwrap();
    let loader = MemLoader::default()
        .in_dir("/mem")
        .with("/mem/v.sched", text)
        .with("/mem/models/tiny.sched", &read("models/tiny.sched"))
        .with("/mem/clusters/cpu.sched", &read("clusters/cpu.sched"));
    let a = analyze(Path::new("/mem/v.sched"), &loader).unwrap();
    assert!(!a.has_errors(), "{}", a.render());
    let p = compile(&a.jobs[0]).unwrap().into_program();
    // The add and the copy: the embedding's compute ops outside any micro-step.
    let sum: Vec<OpId> = p
        .ops
        .iter()
        .filter(|(_, op)| {
            op.micro_step.is_none()
                && matches!(
                    op.kind,
                    OpKind::Compute(ComputeKind::Accumulate | ComputeKind::Copy)
                )
                && op.layer.is_some_and(|l| p.layers[l].name == "embed")
        })
        .map(|(id, _)| id)
        .collect();
    assert_eq!(sum.len(), 2, "an add and a copy: {sum:?}");
    for (k, want) in [
        (0, "head's backward (layer 3)"),
        (1, "the layer's own gradient never arrives"),
    ] {
        let mut q = p.clone();
        let op = &mut q.ops[sum[k]];
        let dst = op.writes[0];
        op.kind = OpKind::Compute(ComputeKind::Copy);
        op.reads = vec![dst];
        op.writes = vec![dst];
        let msgs = messages(&q);
        assert!(
            msgs.iter()
                .any(|m| m.contains("update of embed") && m.contains(want)),
            "neutralising {}: {msgs:?}",
            sum[k]
        );
    }
}
