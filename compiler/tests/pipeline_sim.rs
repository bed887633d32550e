//! The simulator on pipelines (parallel spec §4): a uniform model on near-free links reproduces
//! the papers' bubbles ((p−1)/(m+p−1) for GPipe and 1F1B, (p−1)/(v·m+p−1) for Megatron's
//! interleaved 1F1B), every action waits for the one it receives from, a point-to-point transfer
//! costs one message over its pair's link, the trace has a track per stage, and the diagram is
//! pinned. Print the measured bubbles with
//! `cargo test -p schedc --test pipeline_sim bubbles -- --nocapture`.

use cranelift_entity::EntityRef;
use sched_ir::ir::*;
use sched_ir::job::{ActionKind, Collective};
use sched_ir::timeline::{actions, ActionSpan, Work};
use schedc::sim::cost::{COLLECTIVE_START_S, LINK_EFFICIENCY};
use schedc::sim::{self, SimReport};
use schedc::{analyze, FsLoader, Job, MemLoader};
use std::path::{Path, PathBuf};
use std::process::Command;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

const UNIFORM: &str = "tests/inputs/sim/pipeline_uniform.sched";

/// The job `name` of the uniform pipeline file, compiled.
fn uniform(name: &str) -> (Job, sched_verify::Verified) {
    let a = analyze(&repo().join(UNIFORM), &FsLoader).unwrap();
    assert!(!a.has_errors(), "{}", a.render());
    let job = a
        .jobs
        .into_iter()
        .find(|j| j.schedule.name == name)
        .unwrap_or_else(|| panic!("no schedule {name}"));
    let program = schedc::compile(&job).unwrap_or_else(|e| panic!("{name}: {e}"));
    (job, program)
}

/// The only job of an inline source, compiled.
fn inline(src: &str) -> (Job, sched_verify::Verified) {
    let a = analyze(
        Path::new("p.sched"),
        &MemLoader::default().with("p.sched", src),
    )
    .unwrap();
    assert!(!a.has_errors(), "{}\n---\n{src}", a.render());
    let job = a.jobs.into_iter().next().unwrap();
    let program = schedc::compile(&job).unwrap_or_else(|e| panic!("{e}"));
    (job, program)
}

fn within(got: f64, want: f64, rel: f64) -> bool {
    (got - want).abs() <= rel * want.abs()
}

/// (schedule, p, v, m, the closed form of its bubble) of the uniform file's schedules.
fn closed_forms() -> [(&'static str, u32, u32, u32, f64); 3] {
    let gpipe = |p: u32, m: u32| f64::from(p - 1) / f64::from(m + p - 1);
    let interleaved = |p: u32, v: u32, m: u32| f64::from(p - 1) / f64::from(v * m + p - 1);
    [
        ("pp_gpipe", 4, 1, 8, gpipe(4, 8)),
        ("pp_1f1b", 4, 1, 8, gpipe(4, 8)),
        ("pp_interleaved", 4, 2, 8, interleaved(4, 2, 8)),
    ]
}

#[test]
fn bubbles_of_uniform_stages_match_the_closed_forms() {
    for (name, p, v, m, want) in closed_forms() {
        let (job, program) = uniform(name);
        let r: SimReport = sim::simulate(&program, &job);
        let bubble = r.bubble.expect("a pipeline reports its bubble");
        println!(
            "{name}: p = {p}, v = {v}, m = {m}: simulated bubble {:.4}, closed form {want:.4} ({:+.2}%)",
            bubble,
            100.0 * (bubble - want) / want
        );
        assert!(
            within(bubble, want, 0.15),
            "{name}: bubble {bubble} against {want}"
        );
        assert_eq!(r.stages.len(), p as usize, "{name}");
        for s in &r.stages {
            assert!(
                within(s.bubble, want, 0.15),
                "{name}: stage {} bubble {} against {want}",
                s.stage,
                s.bubble
            );
            assert!(within(1.0 - s.busy_s / r.step_time_s, s.bubble, 1e-12));
        }
        // One class per stage; every stream is timed on its own stage and says which.
        assert_eq!(r.simulated_ranks, p, "{name}");
        assert!(r.streams.iter().all(|s| s.stage.is_some()), "{name}");
        assert!(within(
            r.compute_s,
            r.stages.iter().map(|s| s.busy_s).sum::<f64>() / f64::from(p),
            1e-12
        ));
    }
}

#[test]
fn interleaving_shortens_the_step_and_1f1b_matches_gpipe() {
    let step = |name: &str| {
        let (job, program) = uniform(name);
        sim::simulate(&program, &job).step_time_s
    };
    let (gpipe, one_f_one_b, interleaved) =
        (step("pp_gpipe"), step("pp_1f1b"), step("pp_interleaved"));
    assert!(within(one_f_one_b, gpipe, 0.01), "{one_f_one_b} {gpipe}");
    // (v·m + p − 1)/v against m + p − 1 action pairs: 9.5 against 11.
    assert!(
        within(interleaved / one_f_one_b, 9.5 / 11.0, 0.02),
        "{interleaved} {one_f_one_b}"
    );
}

/// The zero-bubble schedules fill what their neighbours leave idle: ZB-H1's bubble is below
/// 1F1B's (about a third of it, Qi et al.), ZB-V's below interleaved 1F1B's, on the same model.
#[test]
fn zero_bubble_schedules_shorten_the_bubble() {
    let bubble = |name: &str| {
        let (job, program) = uniform(name);
        let r = sim::simulate(&program, &job);
        (r.bubble.expect("a pipeline"), r.step_time_s)
    };
    let (one_f_one_b, zb_h1) = (bubble("pp_1f1b"), bubble("pp_zb_h1"));
    let (interleaved, zbv) = (bubble("pp_interleaved"), bubble("pp_zbv"));
    println!(
        "bubbles: 1f1b {:.4}, zb_h1 {:.4}; interleaved {:.4}, zbv {:.4}",
        one_f_one_b.0, zb_h1.0, interleaved.0, zbv.0
    );
    assert!(
        zb_h1.0 < 0.6 * one_f_one_b.0,
        "{zb_h1:?} against {one_f_one_b:?}"
    );
    assert!(zb_h1.1 < one_f_one_b.1, "the step shortens too");
    assert!(zbv.0 < interleaved.0, "{zbv:?} against {interleaved:?}");
}

/// Each stage's spans of `work`, by (micro-batch, local chunk).
fn spans_of(
    program: &Program,
    t: &sim::engine::Timeline,
    stage: u32,
    kind: ActionKind,
) -> Vec<ActionSpan> {
    let rank = sim::report::stage_timeline(program, t, stage);
    actions(program, rank, stage)
        .into_iter()
        .filter(|a| a.work == Work::Action(kind))
        .collect()
}

#[test]
fn every_action_waits_for_what_it_receives() {
    for (name, p, v, m, _) in closed_forms() {
        let (job, program) = uniform(name);
        let t = sim::run(&program, &job);
        let pipeline = &job.schedule.pipeline;
        // Where (chunk, micro-batch, kind) ran: its span's start and end.
        let mut at = std::collections::HashMap::new();
        for stage in 0..p {
            for kind in [ActionKind::F, ActionKind::B] {
                let spans = spans_of(&program, &t, stage, kind);
                assert_eq!(spans.len() as u32, v * m, "{name}: stage {stage} {kind:?}");
                for a in spans {
                    let chunk = pipeline.chunk_of(stage, a.chunk);
                    at.insert((chunk, a.micro.unwrap(), kind), (a.start, a.end));
                }
            }
        }
        let chunks = p * v;
        for ((chunk, micro, kind), (start, _)) in &at {
            let before = match kind {
                ActionKind::F if *chunk > 0 => Some((chunk - 1, *micro, ActionKind::F)),
                ActionKind::B if chunk + 1 < chunks => Some((chunk + 1, *micro, ActionKind::B)),
                ActionKind::B => Some((*chunk, *micro, ActionKind::F)),
                _ => None,
            };
            if let Some(b) = before {
                let (_, end) = at[&b];
                assert!(
                    *start >= end - 1e-12,
                    "{name}: {kind:?}{micro} of chunk {chunk} starts at {start} before {b:?} ends at {end}"
                );
            }
        }
    }
}

#[test]
fn a_transfer_costs_one_message_over_its_link() {
    // Two stages of one GPU each, on one node (NVLink) or on two (the network).
    let src = |nodes: u32, gpus: u32| {
        format!(
            "cluster c {{\n nodes = {nodes}\n gpus_per_node = {gpus}\n gpu_memory = 80 GiB\n peak_flops = 312 TFLOPS\n \
             intra_node {{ bandwidth = 100 GB/s  latency = 5 us }}\n inter_node {{ bandwidth = 80 Gbps  latency = 20 us }}\n}}\n\
             model m {{\n dtype = bf16\n seq_len = 1024\n layer l[4] = mlp(hidden = 1024, ffn = 4096)\n}}\n\
             schedule s {{\n model = m\n cluster = c\n micro_steps = 2\n pipeline {{ stages = 2  schedule = gpipe  layers = [2, 2] }}\n}}\n"
        )
    };
    let bytes = 1024.0 * 1024.0 * 2.0; // a micro-batch's hidden states in bf16
    for (nodes, gpus, bandwidth, latency) in [(1, 2, 100e9, 5e-6), (2, 1, 10e9, 20e-6)] {
        let (job, program) = inline(&src(nodes, gpus));
        let t = sim::run(&program, &job);
        let want = COLLECTIVE_START_S + latency + bytes / (bandwidth * LINK_EFFICIENCY);
        // Every lone send or receive (not grouped with another) takes exactly that.
        let mut checked = 0;
        for (id, op) in program.ops.iter() {
            let OpKind::Collective(c) = &op.kind else {
                continue;
            };
            if !matches!(c.kind, Collective::Send | Collective::Recv) {
                continue;
            }
            let rank = program
                .layout
                .rank_of(program.streams[op.stream].stage, 0, 0);
            let rt = t.ranks.iter().find(|r| r.rank == rank).unwrap();
            let took = rt.end[id.index()] - rt.start[id.index()];
            assert!(
                within(took, want, 1e-9),
                "{nodes} nodes: {id} {:?} took {took}, one message takes {want}",
                c.kind
            );
            checked += 1;
        }
        assert!(checked >= 2, "{nodes} nodes: only {checked} lone transfers");
    }
}

#[test]
fn a_group_of_a_send_and_a_receive_moves_at_the_busier_direction() {
    let cm = schedc::sim::CostModel::new(&uniform("pp_1f1b").0);
    let shape = schedc::sim::cost::GroupShape::mesh(2, 1, 4);
    let one = cm.p2p_transfer(&[(Collective::Send, 1 << 20, shape)]);
    let both = cm.p2p_transfer(&[
        (Collective::Send, 1 << 20, shape),
        (Collective::Recv, 1 << 20, shape),
    ]);
    assert_eq!(one, both);
    let two = cm.p2p_transfer(&[
        (Collective::Send, 1 << 20, shape),
        (Collective::Send, 1 << 20, shape),
    ]);
    assert!(within(two.transfer_s, 2.0 * one.transfer_s, 1e-12));
    assert_eq!(two.latency_s, one.latency_s);
}

#[test]
fn the_trace_has_a_track_per_stage() {
    let (job, program) = uniform("pp_1f1b");
    let (_, trace) = sim::simulate_traced(&program, &job);
    let v: serde_json::Value =
        serde_json::from_str(&serde_json::to_string(&trace).unwrap()).unwrap();
    let events = v["traceEvents"].as_array().unwrap();
    let processes: Vec<&str> = events
        .iter()
        .filter(|e| e["name"] == "process_name")
        .map(|e| e["args"]["name"].as_str().unwrap())
        .collect();
    assert_eq!(
        processes,
        [
            "stage 0, rank 0",
            "stage 1, rank 1",
            "stage 2, rank 2",
            "stage 3, rank 3"
        ]
    );
    for stage in 0..4u32 {
        let pid = u64::from(stage);
        let threads: Vec<&str> = events
            .iter()
            .filter(|e| e["name"] == "thread_name" && e["pid"] == pid)
            .map(|e| e["args"]["name"].as_str().unwrap())
            .collect();
        assert_eq!(threads[0], "actions");
        assert_eq!(
            threads.len() - 1,
            program
                .streams
                .values()
                .filter(|s| s.stage == stage)
                .count()
        );
        // m forwards and m backwards, named as the order names them, in the order's order.
        let names: Vec<&str> = events
            .iter()
            .filter(|e| e["cat"] == "action" && e["pid"] == pid)
            .map(|e| e["name"].as_str().unwrap())
            .collect();
        let order: Vec<String> = job.schedule.pipeline.order[stage as usize]
            .iter()
            .map(|a| format!("{}{}", a.kind.letter(), a.micro))
            .collect();
        assert_eq!(names, order, "stage {stage}");
        // Only the stage's own ops, each with a time.
        let ops = events
            .iter()
            .filter(|e| e["ph"] == "X" && e["pid"] == pid && e["cat"] != "action")
            .inspect(|e| assert!(e["ts"].is_number() && e["dur"].is_number(), "{e}"))
            .count();
        let own = program
            .ops
            .values()
            .filter(|o| program.streams[o.stream].stage == stage)
            .count();
        assert_eq!(ops, own, "stage {stage}");
    }
}

#[test]
fn the_diagram_is_pinned() {
    let (job, program) = uniform("pp_1f1b");
    let svg = schedc::emit::diagram::emit_diagram(&program, &job);
    assert!(svg.starts_with("<svg ") && svg.ends_with("</svg>\n"));
    // Four rows, 8 F and 8 B per stage, each with its micro-batch written in it.
    assert_eq!(svg.matches(">stage ").count(), 4);
    insta::assert_snapshot!("diagram_pp_1f1b", svg);
}

#[test]
fn a_schedule_without_a_pipeline_is_drawn_as_one_row() {
    let path = repo().join("schedules/tiny_cpu.sched");
    let a = analyze(&path, &FsLoader).unwrap();
    let job = &a.jobs[0];
    let program = schedc::compile(job).unwrap();
    let svg = schedc::emit::diagram::emit_diagram(&program, job);
    assert_eq!(svg.matches(">stage ").count(), 0);
    assert_eq!(svg.matches(">step</text>").count(), 1);
    assert!(svg.contains("no pipeline"));
}

#[test]
fn schedc_reports_the_bubble_and_draws_the_diagram() {
    let out = Command::new(env!("CARGO_BIN_EXE_schedc"))
        .args(["simulate", UNIFORM, "--schedule", "pp_1f1b", "--json"])
        .current_dir(repo())
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(v["bubble"].as_f64().unwrap() > 0.2);
    assert_eq!(v["stages"].as_array().unwrap().len(), 4);
    assert_eq!(v["streams"][0]["stage"], 0);
    let table = Command::new(env!("CARGO_BIN_EXE_schedc"))
        .args(["simulate", UNIFORM, "--schedule", "pp_1f1b"])
        .current_dir(repo())
        .output()
        .unwrap();
    let text = String::from_utf8(table.stdout).unwrap();
    assert!(text.contains("pipeline bubble 27.3%"), "{text}");
    assert!(text.contains("stage 3 compute"), "{text}");
    let svg = Command::new(env!("CARGO_BIN_EXE_schedc"))
        .args([
            "compile",
            UNIFORM,
            "--schedule",
            "pp_1f1b",
            "--emit",
            "diagram",
        ])
        .current_dir(repo())
        .output()
        .unwrap();
    assert!(svg.status.success(), "{svg:?}");
    assert!(String::from_utf8(svg.stdout).unwrap().starts_with("<svg "));
}
