//! The `schedrun` command line: per-step JSON lines and the summary, exit codes, refusals, and
//! checkpoints written and resumed through the flags.

use serde_json::Value;
use std::path::PathBuf;
use std::process::Command;

#[path = "common/cli.rs"]
mod cli;

use cli::{json_lines, root, schedrun};

fn temp(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("schedrun-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(name)
}

#[test]
fn json_lines_per_step_and_a_summary_with_memory() {
    let out = schedrun(&["schedules/tiny_cpu.sched", "--steps", "3", "--json"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let lines = json_lines(&out);
    assert_eq!(lines.len(), 4);
    for (i, l) in lines[..3].iter().enumerate() {
        assert_eq!(l["step"], i as u64 + 1);
        assert!(l["loss"].as_f64().unwrap() > 1.0);
        assert!(l["step_time_s"].as_f64().unwrap() > 0.0);
        assert!(l["tokens_per_s"].as_f64().unwrap() > 0.0);
    }
    let s = &lines[3]["summary"];
    assert_eq!(s["steps"], 3);
    let mem = s["memory_per_rank"].as_array().unwrap();
    assert_eq!(mem.len(), 4);
    for m in mem {
        assert_eq!(m["planned_bytes"], m["allocated_bytes"]);
        assert!(m["peak_touched_bytes"].as_u64() <= m["planned_bytes"].as_u64());
    }
    let streams: Vec<&str> = s["streams"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x["name"].as_str().unwrap())
        .collect();
    assert_eq!(streams, ["compute", "gather", "reduce", "sync"]);
}

#[test]
fn a_plan_file_runs_like_its_source_and_checkpoints_resume() {
    let plan = temp("tiny.plan.json");
    let schedc = cli::schedc_binary();
    let st = Command::new(&schedc)
        .args(["compile", "schedules/tiny_cpu.sched", "-o"])
        .arg(&plan)
        .current_dir(root())
        .status()
        .unwrap();
    assert!(st.success());
    let from_source = json_lines(&schedrun(&[
        "schedules/tiny_cpu.sched",
        "--steps",
        "4",
        "--json",
    ]));
    let ckpt = temp("two.safetensors");
    let first = schedrun(&[
        plan.to_str().unwrap(),
        "--steps",
        "2",
        "--json",
        "--save",
        ckpt.to_str().unwrap(),
    ]);
    assert!(
        first.status.success(),
        "{}",
        String::from_utf8_lossy(&first.stderr)
    );
    let second = schedrun(&[
        "schedules/tiny_cpu_schedules.sched",
        "--schedule",
        "tiny_mics2",
        "--lr",
        "1e-3",
        "--steps",
        "2",
        "--json",
        "--resume",
        ckpt.to_str().unwrap(),
    ]);
    assert!(
        second.status.success(),
        "{}",
        String::from_utf8_lossy(&second.stderr)
    );
    let (a, b) = (json_lines(&first), json_lines(&second));
    let losses: Vec<f64> = a[..2]
        .iter()
        .chain(&b[..2])
        .map(|l| l["loss"].as_f64().unwrap())
        .collect();
    assert_eq!(b[0]["step"], 3, "a resumed run continues the step count");
    for (got, want) in losses.iter().zip(&from_source[..4]) {
        let want = want["loss"].as_f64().unwrap();
        assert!(((got - want) / want).abs() < 1e-5, "{got} vs {want}");
    }
}

#[test]
fn refusals_have_exit_codes_and_one_clear_line() {
    let bad = temp("bad.plan.json");
    std::fs::write(&bad, "{\"format\": \"sched-plan\", \"version\": 1, \"sched").unwrap();
    let out = schedrun(&[bad.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("not a plan file"));

    let out = schedrun(&["schedules/tiny_cpu.sched", "--steps", "1", "--clip", "1.0"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("compiled without it"));

    let out = schedrun(&["schedules/tiny_cpu_schedules.sched"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--schedule"));

    let out = schedrun(&[
        "schedules/tiny_cpu.sched",
        "--init",
        "/nonexistent.safetensors",
    ]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("cannot read"));
    assert!(out.stdout.is_empty(), "nothing runs after a refusal");
}

/// `--trace`: the last step as measured, in `schedc simulate --trace`'s format. Every op of every
/// rank is one slice on its stream's thread, the stream's slices in the plan's issue order and
/// apart, within the step's time; every event wait is a flow arrow; a run that fails after its
/// steps writes no trace.
/// Two steps of `schedule` (a path under the repository) with `--json --trace`: the run's
/// output, its plan and the trace written.
fn measured_trace(
    schedule: &str,
    name: &str,
) -> (std::process::Output, schedrun::plan::Plan, Value) {
    let path = temp(name);
    let out = schedrun(&[
        schedule,
        "--steps",
        "2",
        "--json",
        "--trace",
        path.to_str().unwrap(),
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let plan = schedrun::plan::Plan::load(&root().join(schedule), None).unwrap();
    let trace: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    (out, plan, trace)
}

#[test]
fn a_measured_trace_has_every_op_of_every_rank_in_issue_order() {
    let (out, plan, trace) = measured_trace("schedules/tiny_cpu.sched", "tiny.trace.json");
    let step_us = json_lines(&out)[1]["step_time_s"].as_f64().unwrap() * 1e6;
    let events = trace["traceEvents"].as_array().unwrap();
    let of = |ph: &'static str| events.iter().filter(move |e| e["ph"] == ph);
    let names: Vec<&str> = of("M")
        .filter(|e| e["name"] == "process_name")
        .map(|e| e["args"]["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["rank 0", "rank 1", "rank 2", "rank 3"]);
    for rank in 0..4u64 {
        for (stream, ops) in plan.stream_ops.iter() {
            let mut slices: Vec<&Value> = of("X")
                .filter(|e| e["pid"] == rank && e["tid"] == u64::from(stream.as_u32()))
                .collect();
            slices.sort_by(|a, b| a["ts"].as_f64().partial_cmp(&b["ts"].as_f64()).unwrap());
            let order: Vec<String> = slices
                .iter()
                .map(|e| e["args"]["op"].as_str().unwrap().to_string())
                .collect();
            let want: Vec<String> = ops.iter().map(|o| o.to_string()).collect();
            assert_eq!(order, want, "rank {rank}, stream {stream}");
            let mut end = 0.0;
            for e in slices {
                let (ts, dur) = (e["ts"].as_f64().unwrap(), e["dur"].as_f64().unwrap());
                assert!(dur >= 0.0 && ts >= end - 1e-3, "{e}: starts before {end}");
                end = ts + dur;
            }
            assert!(
                end <= step_us,
                "rank {rank}, stream {stream} ends after the step"
            );
        }
    }
    let waits: usize = plan.program.ops.values().map(|o| o.wait.len()).sum();
    assert_eq!(of("s").count(), 4 * waits);
    assert_eq!(of("f").count(), 4 * waits);
    assert!(plan.program.ops.len() > 1 && plan.program.streams.len() > 1);
    assert_eq!(of("X").count(), 4 * plan.program.ops.len());

    // A run with an output that cannot be written is refused before its first step and writes
    // nothing, the trace included (long_runs.rs tests every output flag).
    let refused = temp("refused.trace.json");
    let save = temp("no such folder").join("state.safetensors");
    let out = schedrun(&[
        "schedules/tiny_cpu.sched",
        "--steps",
        "2",
        "--save",
        save.to_str().unwrap(),
        "--trace",
        refused.to_str().unwrap(),
    ]);
    assert_eq!(out.status.code(), Some(2));
    assert!(out.stdout.is_empty(), "no step runs");
    assert!(!refused.exists());
}

/// A pipeline's measured trace: each rank's slices are the ops of its own stage's streams, in
/// issue order; no rank shows another stage's op.
#[test]
fn a_measured_pipeline_trace_shows_each_rank_its_stage() {
    let (_, plan, trace) = measured_trace("schedules/tiny_pipeline.sched", "pipeline.trace.json");
    let p = &plan.program;
    let slices: Vec<&Value> = trace["traceEvents"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["ph"] == "X")
        .collect();
    let mut per_rank = vec![0usize; 4];
    for (stream, ops) in plan.stream_ops.iter() {
        let stage = p.streams[stream].stage;
        for rank in 0..4u32 {
            let on: Vec<&Value> = slices
                .iter()
                .copied()
                .filter(|e| e["pid"] == u64::from(rank) && e["tid"] == u64::from(stream.as_u32()))
                .collect();
            let want = if p.layout.stage(rank) == stage {
                ops.len()
            } else {
                0
            };
            assert_eq!(on.len(), want, "rank {rank}, {stream} of stage {stage}");
            per_rank[rank as usize] += on.len();
        }
    }
    assert!(
        per_rank.iter().all(|&n| n > 0) && per_rank[0] != per_rank[2],
        "{per_rank:?}"
    );
}

/// Whether this machine can run the CUDA backend (then the tests of its absence do not apply).
fn cuda_here() -> bool {
    schedrun::backend::cuda::probe().is_ok()
}

#[test]
fn the_cuda_backend_without_cuda_fails_in_one_clear_line() {
    if cuda_here() {
        return schedc::testing::skip("no-gpu", "the CUDA backend can run on this machine");
    }
    let out = schedrun(&["schedules/tiny_cpu.sched", "--backend", "cuda"]);
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    let lines: Vec<&str> = err.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(lines.len(), 1, "{err}");
    let built = schedrun::backend::cuda::BUILT;
    let want = if built {
        "not found"
    } else {
        "built without CUDA"
    };
    assert!(
        lines[0].starts_with("error: ") && lines[0].contains(want),
        "{err}"
    );
    if built {
        assert!(lines[0].contains("libcuda"), "names the driver: {err}");
    }
    assert!(out.stdout.is_empty());
    // The same under an external launcher's variables.
    let out = Command::new(env!("CARGO_BIN_EXE_schedrun"))
        .args(["schedules/tiny_cpu.sched", "--backend", "cuda"])
        .current_dir(root())
        .envs([
            ("RANK", "0"),
            ("WORLD_SIZE", "4"),
            ("MASTER_ADDR", "127.0.0.1"),
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains(want));
}

#[test]
fn cuda_launch_settings_are_checked_before_anything_starts() {
    let out = schedrun(&[
        "schedules/tiny_cpu.sched",
        "--backend",
        "cuda",
        "--nproc-per-node",
        "3",
    ]);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("the plan has 4 ranks") && err.contains("--nproc-per-node 3"),
        "{err}"
    );
    let out = Command::new(env!("CARGO_BIN_EXE_schedrun"))
        .args(["schedules/tiny_cpu.sched", "--backend", "cuda"])
        .current_dir(root())
        .envs([("RANK", "zero"), ("WORLD_SIZE", "4")])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("RANK=\"zero\""));
    let out = Command::new(env!("CARGO_BIN_EXE_schedrun"))
        .args(["schedules/tiny_cpu.sched", "--backend", "cuda"])
        .current_dir(root())
        .envs([
            ("RANK", "1"),
            ("WORLD_SIZE", "2"),
            ("MASTER_ADDR", "127.0.0.1"),
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("the plan has 4 ranks but WORLD_SIZE is 2 (rank 1)"),
        "{err}"
    );
}

/// The learning-rate schedule and optimizer flags: `--json` reports each step's rate (warmup
/// from lr/2 with `--warmup 2`), the optimizer flags change the run, and bad values exit 1
/// before any step.
#[test]
fn learning_rate_and_optimizer_flags() {
    let base = [
        "schedules/tiny_cpu.sched",
        "--steps",
        "3",
        "--json",
        "--lr",
        "1e-3",
    ];
    let run = |extra: &[&str]| {
        let args: Vec<&str> = base.iter().chain(extra).copied().collect();
        let out = schedrun(&args);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        json_lines(&out)
    };
    let warm = run(&["--warmup", "2"]);
    let rates: Vec<f64> = warm.iter().filter_map(|l| l["lr"].as_f64()).collect();
    assert_eq!(rates, [5e-4, 1e-3, 1e-3]);
    let loss =
        |lines: &[Value]| -> Vec<f64> { lines.iter().filter_map(|l| l["loss"].as_f64()).collect() };
    let plain = loss(&run(&[]));
    let tuned = loss(&run(&[
        "--betas",
        "0.8,0.99",
        "--eps",
        "1e-6",
        "--weight-decay",
        "0.3",
    ]));
    assert_eq!(
        plain[0], tuned[0],
        "the first step's loss comes before any update"
    );
    assert_ne!(plain[2], tuned[2], "the optimizer flags change the run");
    for bad in [
        &["--betas", "0.9"][..],
        &["--betas", "0.9,1.0"],
        &["--eps", "0"],
        &["--weight-decay=-1"],
        &["--min-lr", "1"],
    ] {
        let args: Vec<&str> = base.iter().chain(bad).copied().collect();
        let out = schedrun(&args);
        assert_eq!(out.status.code(), Some(1), "{bad:?}");
        assert!(out.stdout.is_empty(), "{bad:?}: no step ran");
    }
}
