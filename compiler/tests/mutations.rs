//! Mutation tests of the verifier (lowering spec §7): plans edited by hand in ways that break them
//! must be refused. For the example schedules: removing any single wait, moving any transient
//! buffer onto another one alive at the same time, dropping any collective, and reordering two
//! collectives on one stream.

use schedc::emit::plan::{emit_plan, read_plan, PlanFile};
use schedc::{analyze, compile, FsLoader};
use std::path::Path;

fn plans(files: &[&str]) -> Vec<(String, String)> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
    let mut out = vec![];
    for f in files {
        let a = analyze(&root.join("schedules").join(f), &FsLoader).unwrap();
        assert!(!a.has_errors(), "{}", a.render());
        for job in &a.jobs {
            let (program, _) =
                compile(job).unwrap_or_else(|e| panic!("{}: {e}", job.schedule.name));
            let plan = emit_plan(&program, job);
            out.push((
                job.schedule.name.clone(),
                serde_json::to_string(&plan).unwrap(),
            ));
        }
    }
    out
}

fn small_plans() -> Vec<(String, String)> {
    plans(&["tiny_cpu.sched", "tiny_cpu_schedules.sched"])
}

/// Read back and verified: true when the plan is accepted.
fn accepted(plan: &PlanFile) -> bool {
    let text = serde_json::to_string(plan).unwrap();
    match read_plan(&text) {
        Err(_) => false,
        Ok(p) => schedc::verify::verify(
            &p.program,
            schedc::verify::Ctx {
                shard: p.shard,
                secondary: p.secondary,
            },
        )
        .is_ok(),
    }
}

fn parse(text: &str) -> PlanFile {
    serde_json::from_str(text).unwrap()
}

#[test]
fn unmodified_plans_are_accepted() {
    for (name, text) in small_plans() {
        assert!(accepted(&parse(&text)), "{name}");
    }
}

#[test]
fn removing_any_wait_is_caught() {
    let mut tried = 0;
    for (name, text) in small_plans() {
        let plan = parse(&text);
        for s in 0..plan.streams.len() {
            for o in 0..plan.streams[s].ops.len() {
                for w in 0..plan.streams[s].ops[o].wait.len() {
                    let mut m = parse(&text);
                    let ev = m.streams[s].ops[o].wait.remove(w);
                    tried += 1;
                    assert!(
                        !accepted(&m),
                        "{name}: removing the wait on ev{ev} of op{} is not caught",
                        m.streams[s].ops[o].id
                    );
                }
            }
        }
    }
    assert!(tried > 100, "only {tried} waits tried");
}

/// Issue-order interval of each buffer's accesses.
fn intervals(plan: &PlanFile) -> Vec<Option<(u32, u32)>> {
    let mut iv: Vec<Option<(u32, u32)>> = vec![None; plan.buffers.len()];
    for s in &plan.streams {
        for o in &s.ops {
            let regions = o
                .reads
                .iter()
                .chain(&o.writes)
                .chain(o.ops.iter().flat_map(|c| [&c.input, &c.output]));
            for r in regions {
                let e = &mut iv[r.buffer as usize];
                *e = Some(e.map_or((o.id, o.id), |(a, b)| (a.min(o.id), b.max(o.id))));
            }
        }
    }
    iv
}

#[test]
fn moving_a_buffer_onto_a_live_one_is_caught() {
    let mut tried = 0;
    for (name, text) in small_plans() {
        let plan = parse(&text);
        let iv = intervals(&plan);
        for (a, ba) in plan.buffers.iter().enumerate() {
            let Some((a0, a1)) = iv[a].filter(|_| !ba.persistent) else {
                continue;
            };
            for (b, bb) in plan.buffers.iter().enumerate() {
                let Some((b0, b1)) = iv[b].filter(|_| b != a && bb.bytes > 0) else {
                    continue;
                };
                let alive_together = a0 <= b1 && b0 <= a1;
                let fits = bb.offset + ba.bytes <= plan.arena_bytes;
                if !alive_together || !fits || ba.bytes == 0 {
                    continue;
                }
                let mut m = parse(&text);
                m.buffers[a].offset = bb.offset;
                tried += 1;
                assert!(
                    !accepted(&m),
                    "{name}: moving buf{a} ({}) onto buf{b} ({}) is not caught",
                    ba.name,
                    bb.name
                );
            }
        }
    }
    assert!(tried > 100, "only {tried} moves tried");
}

/// Removes op `id` and every wait on the event it records, renumbering ops and events so the plan
/// stays well formed: only its meaning is broken.
fn drop_op(plan: &mut PlanFile, id: u32) {
    let mut dropped_event = None;
    for s in &mut plan.streams {
        if let Some(i) = s.ops.iter().position(|o| o.id == id) {
            dropped_event = s.ops.remove(i).record;
        }
    }
    for s in &mut plan.streams {
        for o in &mut s.ops {
            if o.id > id {
                o.id -= 1;
            }
            if let Some(ev) = dropped_event {
                o.wait.retain(|&w| w != ev);
                o.wait.iter_mut().filter(|w| **w > ev).for_each(|w| *w -= 1);
                if let Some(r) = o.record.as_mut().filter(|r| **r > ev) {
                    *r -= 1;
                }
            }
        }
    }
    if dropped_event.is_some() {
        plan.events -= 1;
    }
}

#[test]
fn dropping_any_collective_is_caught() {
    let mut tried = 0;
    for (name, text) in small_plans() {
        let plan = parse(&text);
        let collectives: Vec<u32> = plan
            .streams
            .iter()
            .flat_map(|s| s.ops.iter().filter(|o| !o.ops.is_empty()).map(|o| o.id))
            .collect();
        for id in collectives {
            let mut m = parse(&text);
            drop_op(&mut m, id);
            tried += 1;
            assert!(
                !accepted(&m),
                "{name}: dropping collective op{id} is not caught"
            );
        }
    }
    assert!(tried > 50, "only {tried} collectives tried");
}

#[test]
fn reordering_two_collectives_on_a_stream_is_caught() {
    let mut tried = 0;
    for (name, text) in small_plans() {
        let plan = parse(&text);
        for (s, stream) in plan.streams.iter().enumerate() {
            let idx: Vec<usize> = stream
                .ops
                .iter()
                .enumerate()
                .filter(|(_, o)| !o.ops.is_empty())
                .map(|(i, _)| i)
                .collect();
            for w in idx.windows(2) {
                let mut m = parse(&text);
                m.streams[s].ops.swap(w[0], w[1]);
                tried += 1;
                assert!(
                    !accepted(&m),
                    "{name}: swapping two collectives on {} is not caught",
                    stream.name
                );
            }
        }
    }
    assert!(tried > 20, "only {tried} swaps tried");
}

/// The larger examples, with a deterministic sample of each mutation (every one would take long
/// in a debug build): every tenth wait, buffer move and collective drop, and every collective swap.
#[test]
fn sampled_mutations_of_the_larger_examples_are_caught() {
    let files = [
        "gpt2_ddp.sched",
        "llama7b_zero1.sched",
        "llama7b_mics.sched",
        "llama13b_hpz.sched",
        "llama30b_amsp.sched",
    ];
    let mut tried = 0;
    for (name, text) in plans(&files) {
        let plan = parse(&text);
        let mut n = 0;
        for s in 0..plan.streams.len() {
            for o in 0..plan.streams[s].ops.len() {
                for w in 0..plan.streams[s].ops[o].wait.len() {
                    n += 1;
                    if n % 10 != 0 {
                        continue;
                    }
                    let mut m = parse(&text);
                    m.streams[s].ops[o].wait.remove(w);
                    tried += 1;
                    assert!(
                        !accepted(&m),
                        "{name}: removing a wait of op{} is not caught",
                        m.streams[s].ops[o].id
                    );
                }
            }
        }
        let iv = intervals(&plan);
        let moves: Vec<(usize, usize)> = (0..plan.buffers.len())
            .flat_map(|a| (0..plan.buffers.len()).map(move |b| (a, b)))
            .filter(|&(a, b)| {
                let (Some((a0, a1)), Some((b0, b1))) = (iv[a], iv[b]) else {
                    return false;
                };
                a != b
                    && !plan.buffers[a].persistent
                    && a0 <= b1
                    && b0 <= a1
                    && plan.buffers[a].bytes > 0
                    && plan.buffers[b].offset + plan.buffers[a].bytes <= plan.arena_bytes
            })
            .collect();
        for &(a, b) in moves.iter().step_by(moves.len().div_ceil(20).max(1)) {
            let mut m = parse(&text);
            m.buffers[a].offset = plan.buffers[b].offset;
            tried += 1;
            assert!(
                !accepted(&m),
                "{name}: moving buf{a} onto buf{b} is not caught"
            );
        }
        let collectives: Vec<u32> = plan
            .streams
            .iter()
            .flat_map(|s| s.ops.iter().filter(|o| !o.ops.is_empty()).map(|o| o.id))
            .collect();
        for &id in collectives
            .iter()
            .step_by(collectives.len().div_ceil(20).max(1))
        {
            let mut m = parse(&text);
            drop_op(&mut m, id);
            tried += 1;
            assert!(
                !accepted(&m),
                "{name}: dropping collective op{id} is not caught"
            );
        }
    }
    assert!(tried > 100, "only {tried} mutations tried");
}
