//! Faults (`runtime.md`, "Faults"): a rank that fails or stops answering makes every other rank
//! stop within a bounded time with an error naming it; a plan that is truncated, of another
//! version or for another rank count is refused; and a plan with a wait removed (bypassing the
//! verifier) is caught by the stress mode instead of passing by luck.

use sched_ir::ir::{ComputeKind, OpId, OpKind};
use sched_ir::plan_file::emit_plan;
use schedc::{analyze, FsLoader, Job};
use schedrun::backend::cpu::CpuBackend;
use schedrun::backend::{Fault, RunError, RunOptions};
use schedrun::data::Corpus;
use schedrun::plan::Plan;
use schedrun::reference::Reference;
use schedrun::train::Trainer;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

fn job(name: &str) -> Job {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
    let mut jobs = analyze(&root.join("schedules/tiny_cpu.sched"), &FsLoader)
        .unwrap()
        .jobs;
    jobs.extend(
        analyze(&root.join("schedules/tiny_cpu_schedules.sched"), &FsLoader)
            .unwrap()
            .jobs,
    );
    jobs.into_iter().find(|j| j.schedule.name == name).unwrap()
}

fn trainer(plan: Plan, options: RunOptions) -> Trainer<CpuBackend> {
    let plan = Arc::new(plan);
    let backend = CpuBackend::new(plan.clone(), options);
    let mut t = Trainer::new(plan, backend, Corpus::builtin());
    let init = t.initial_state(0);
    t.load(&init).unwrap();
    t
}

fn compiled(job: &Job) -> Plan {
    let program = schedc::compile(job).unwrap();
    Plan::new(program, job.clone()).unwrap()
}

/// The first all-gather of a mid layer in the plan.
fn a_gather(plan: &Plan) -> OpId {
    plan.program
        .ops
        .iter()
        .find(|(_, o)| {
            matches!(o.kind, OpKind::Collective(_)) && o.layer.is_some_and(|l| l.as_u32() == 1)
        })
        .map(|(id, _)| id)
        .unwrap()
}

#[test]
fn a_failing_rank_stops_every_rank_and_is_named() {
    let job = job("tiny_zero3");
    let plan = compiled(&job);
    let op = a_gather(&plan);
    let what = plan.describe(op);
    let options = RunOptions {
        fault: Some(Fault {
            rank: 2,
            op,
            hang: false,
        }),
        timeout: Duration::from_secs(30),
        ..RunOptions::default()
    };
    let mut t = trainer(plan, options);
    let start = Instant::now();
    let e: RunError = t.step(1e-3, None).unwrap_err();
    assert!(
        start.elapsed() < Duration::from_secs(10),
        "took {:?}",
        start.elapsed()
    );
    assert_eq!(e.rank, Some(2));
    assert_eq!(e.op.as_deref(), Some(what.as_str()));
    assert!(e.to_string().contains("injected fault"), "{e}");
}

#[test]
fn a_rank_that_stops_answering_times_out_the_collective_naming_it() {
    let job = job("tiny_zero3");
    let plan = compiled(&job);
    let op = a_gather(&plan);
    let options = RunOptions {
        fault: Some(Fault {
            rank: 1,
            op,
            hang: true,
        }),
        timeout: Duration::from_millis(500),
        ..RunOptions::default()
    };
    let mut t = trainer(plan, options);
    let start = Instant::now();
    let e = t.step(1e-3, None).unwrap_err().to_string();
    assert!(
        start.elapsed() < Duration::from_secs(10),
        "took {:?}",
        start.elapsed()
    );
    assert!(e.contains("rank(s) 1 of group [0, 1, 2, 3]"), "{e}");
    assert!(
        e.contains("all_gather block[0]") || e.contains("all_gather"),
        "{e}"
    );
}

fn write_temp(name: &str, text: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("schedrun-faults-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p
}

fn refusal(path: &Path) -> String {
    match Plan::load(path, None) {
        Err(e) if e.is_input() => e.render(),
        Err(e) => panic!("a fault, not a refusal: {e}"),
        Ok(_) => panic!("{} was accepted", path.display()),
    }
}

#[test]
fn bad_plan_files_are_refused_with_the_reason() {
    let job = job("tiny_zero3");
    let program = schedc::compile(&job).unwrap();
    let plan = serde_json::to_value(emit_plan(&program, &job)).unwrap();
    let text = plan.to_string();

    let ok = write_temp("ok.plan.json", &text);
    assert!(Plan::load(&ok, None).is_ok());

    let truncated = write_temp("truncated.plan.json", &text[..text.len() / 2]);
    let m = refusal(&truncated);
    assert!(m.contains("not a plan file") && m.contains("EOF"), "{m}");

    // Version 1, before workspaces were planned, and a future one.
    for v in [1, 3] {
        let mut other = plan.clone();
        other["version"] = v.into();
        let m = refusal(&write_temp(&format!("v{v}.plan.json"), &other.to_string()));
        assert!(m.contains(&format!("version {v} is not supported")), "{m}");
    }

    let mut ranks = plan.clone();
    ranks["ranks"] = 8.into();
    let m = refusal(&write_temp("ranks.plan.json", &ranks.to_string()));
    assert!(m.contains("4 ranks"), "{m}");

    // A wait removed by hand: the verifier refuses to run it.
    let mut racy = plan.clone();
    let ops = racy["streams"][0]["ops"].as_array_mut().unwrap();
    let waiting = ops
        .iter_mut()
        .find(|o| o["kind"] == "forward" && !o["wait"].as_array().unwrap().is_empty())
        .unwrap();
    waiting["wait"] = serde_json::json!([]);
    let m = refusal(&write_temp("racy.plan.json", &racy.to_string()));
    assert!(m.contains("fails verification"), "{m}");
}

#[test]
fn the_stress_mode_catches_a_plan_with_a_wait_removed() {
    let job = job("tiny_zero3");
    let mut program = schedc::compile(&job).unwrap().into_program();
    // Every forward stops waiting for the all-gather of its parameters.
    let mut removed = 0;
    for op in program.ops.values_mut() {
        if op.kind == OpKind::Compute(ComputeKind::Forward) && !op.wait.is_empty() {
            op.wait.clear();
            removed += 1;
        }
    }
    assert!(removed >= 2);
    assert!(
        !sched_verify::errors(&program).is_empty(),
        "the verifier must refuse the broken plan"
    );
    // Run it all the same (`Verified::assume`, a tests-only feature): the stress mode must catch
    // what the verifier refused.
    let plan = Plan::new(sched_verify::Verified::assume(program), job.clone()).unwrap();
    let options = RunOptions {
        jitter: Some(Duration::from_millis(2)),
        jitter_seed: 1,
        ..RunOptions::default()
    };
    let mut t = trainer(plan, options);
    let corpus = Corpus::builtin();
    let mut reference = Reference::new(&job.model, &job.schedule.train).unwrap();
    let sequences = 4 * job.model.micro_batch as usize;
    let mut caught = false;
    for step in 0..4 {
        let batch = corpus
            .global_batch(step, sequences, job.model.seq_len as usize)
            .unwrap();
        let want = reference.step(step, &batch);
        match t.step(job.schedule.train.lr, None) {
            Err(_) => caught = true,
            Ok(r) => caught |= ((r.loss - want) / want).abs() > 1e-5,
        }
        if caught {
            break;
        }
    }
    assert!(caught, "the broken plan passed the stress mode");
}
