//! `schedc plan`: its floors are lower bounds of what the compiler and simulator report, its
//! branch and bound finds what an exhaustive simulation finds, its fragments reproduce the
//! schedules they describe, and the command prints a table or JSON.

use schedc::planner::{self, bounds, fragment, space, Options};
use schedc::{analyze, Job, MemLoader};
use std::path::Path;

/// A small model on two nodes of four GPUs with a tight GPU memory, so that memory matters.
const SOURCE: &str = r#"
cluster c {
    nodes = 2
    gpus_per_node = 4
    gpu_memory = 160 MiB
    peak_flops = 100 TFLOPS
    intra_node { bandwidth = 100 GB/s  latency = 2 us }
    inter_node { bandwidth = 100 Gbps  latency = 10 us }
}

model m {
    dtype = bf16
    seq_len = 256
    micro_batch = 2
    layer embed = embedding(vocab = 8192, hidden = 512)
    layer block[2] = transformer(hidden = 512, heads = 8, ffn = 2048)
    layer head = lm_head(hidden = 512, vocab = 8192, tied = true)
}

schedule base {
    model = m
    cluster = c
    nodes = 2
    micro_steps = 2
    preset = zero3
    train { steps = 3  lr = 1e-3  seed = 7  clip = 1.0 }
}

# Untied, without clipping (p = 2 or 4 over its 4 layers).
model u {
    dtype = bf16
    seq_len = 256
    micro_batch = 2
    layer embed = embedding(vocab = 8192, hidden = 512)
    layer block[2] = transformer(hidden = 512, heads = 8, ffn = 2048)
    layer head = lm_head(hidden = 512, vocab = 8192)
}

schedule deferred {
    model = m
    cluster = c
    nodes = 2
    micro_steps = 3
    preset = zero1
    recompute = full
    overlap { refresh = next_forward }
    buckets { gather = 4 MiB  reduce = 4 MiB }
}

schedule staged {
    model = u
    cluster = c
    nodes = 2
    micro_steps = 2
    preset = zero1
}
"#;

/// A model whose transformer layers are too wide for a GPU without tensor parallelism: with
/// t = 1, the whole layer's fp32 gradient workspace and gathered parameters do not fit 640 MiB
/// under any sharding or pipeline split; each rank's slice with t = 2 or 4 does.
const WIDE: &str = r#"
cluster c {
    nodes = 1
    gpus_per_node = 4
    gpu_memory = 640 MiB
    peak_flops = 100 TFLOPS
    intra_node { bandwidth = 100 GB/s  latency = 2 us }
    inter_node { bandwidth = 100 Gbps  latency = 10 us }
}

model wide {
    dtype = bf16
    seq_len = 256
    micro_batch = 1
    layer embed = embedding(vocab = 1024, hidden = 1024)
    layer block[2] = transformer(hidden = 1024, heads = 8, ffn = 16384)
    layer head = lm_head(hidden = 1024, vocab = 1024)
}

schedule wide_base {
    model = wide
    cluster = c
    nodes = 1
    micro_steps = 4
    preset = zero3
}
"#;

fn job(name: &str) -> Job {
    if name == "wide_base" {
        return job_from(WIDE, name);
    }
    job_from(SOURCE, name)
}

fn job_from(source: &str, name: &str) -> Job {
    let loader = MemLoader::default().with("/p/plan.sched", source);
    let a = analyze(Path::new("/p/plan.sched"), &loader).unwrap();
    assert!(!a.has_errors(), "{}", a.render());
    a.select(Some(name)).unwrap().clone()
}

/// Every `step`-th structure of `base`, with its knobs.
fn sample(base: &Job, step: usize) -> Vec<Job> {
    let knobs = space::Knobs::of(&base.schedule);
    space::structures(base)
        .iter()
        .step_by(step)
        .map(|s| space::apply(base, s, &knobs))
        .collect()
}

#[test]
fn floors_never_exceed_what_the_compiler_and_simulator_report() {
    for name in ["base", "deferred", "staged", "wide_base"] {
        let base = job(name);
        let mut checked = 0;
        for job in sample(&base, 2) {
            let Ok(program) = schedc::compile(&job) else {
                continue;
            };
            // The cost model of the candidate's tensor degree.
            let cost = schedc::sim::cost::CostModel::new(&job);
            let label = format!("{name}: {:?}", space::structure_of(&job.schedule));
            let report = schedc::sim::simulate(&program, &job);
            let floor = bounds::step_time_floor(&job, |l, k| cost.compute_seconds(l, k));
            assert!(
                floor.seconds() <= report.step_time_s * (1.0 + 1e-9),
                "{label}: floor {floor:?} above the simulated {} s",
                report.step_time_s
            );
            let unplanned = schedc::pipeline::lower_unplanned(&job).unwrap();
            let screened = schedc::sim::step_time(&unplanned, &job);
            assert!(floor.seconds() <= screened * (1.0 + 1e-9), "{label}");
            // Memory: the floors are below the placed arena; the shards are exact.
            assert!(bounds::memory_floor(&job) <= program.arena_bytes, "{label}");
            assert!(
                bounds::arena_floor(&unplanned) <= program.arena_bytes,
                "{label}"
            );
            let persistent: u64 = program
                .buffers
                .values()
                .filter(|b| b.kind.is_persistent())
                .map(|b| b.bytes)
                .sum();
            assert_eq!(bounds::model_state_bytes(&job), persistent, "{label}");
            checked += 1;
        }
        assert!(checked > 20, "{name}: only {checked} structures lowered");
        if name == "wide_base" || name == "staged" {
            assert!(
                sample(&base, 2).iter().any(|j| j.schedule.tensor.size > 1),
                "{name}: no tensor-parallel structure was floored"
            );
        }
    }
}

#[test]
fn branch_and_bound_finds_the_exhaustive_top_k() {
    for name in ["base", "staged"] {
        exhaustive_top_k(name);
    }
}

/// Without knob tuning the search ranks structures with the base knobs. Exhaustively: screen
/// every structure (its program before memory planning, simulated, unless its arena floor is
/// over the GPU), then compile in screened order until K fit. Branch and bound must pick the
/// same K, with the same compiled times.
fn exhaustive_top_k(name: &str) {
    let base = job(name);
    let k = 4;
    let options = Options {
        top: k,
        threads: 2,
        tune_knobs: false,
    };
    let result = planner::plan(&base, &options, &|_| {}).unwrap();
    let mut screened: Vec<(f64, Job)> = sample(&base, 1)
        .into_iter()
        .filter_map(|job| {
            let program = schedc::pipeline::lower_unplanned(&job).ok()?;
            (bounds::arena_floor(&program) <= base.cluster.gpu_memory)
                .then(|| (schedc::sim::step_time(&program, &job), job))
        })
        .collect();
    screened.sort_by(|a, b| a.0.total_cmp(&b.0));
    let mut expected = vec![];
    for (_, job) in &screened {
        let program = schedc::compile(job).unwrap();
        let r = schedc::sim::simulate(&program, job);
        if r.fits {
            expected.push(r.step_time_s);
        }
        if expected.len() == k {
            break;
        }
    }
    expected.sort_by(f64::total_cmp);
    let found: Vec<f64> = result.ranked.iter().map(|r| r.report.step_time_s).collect();
    assert_eq!(found, expected, "search {:?}", result.stats);
    assert!(
        result.stats.pruned_by_time_floor + result.stats.over_memory_floor > 0,
        "nothing was pruned: {:?}",
        result.stats
    );
    for r in &result.ranked {
        assert!(r.report.fits && r.report.peak_memory_bytes <= base.cluster.gpu_memory);
    }
}

#[test]
fn tuning_knobs_never_makes_a_schedule_slower() {
    let base = job("base");
    let plain = Options {
        top: 2,
        threads: 2,
        tune_knobs: false,
    };
    let tuned = Options {
        tune_knobs: true,
        ..plain.clone()
    };
    let a = planner::plan(&base, &plain, &|_| {}).unwrap();
    let b = planner::plan(&base, &tuned, &|_| {}).unwrap();
    assert!(b.ranked[0].report.step_time_s <= a.ranked[0].report.step_time_s);
}

#[test]
fn fragments_reproduce_the_planned_schedules() {
    for name in ["base", "deferred", "staged"] {
        let base = job(name);
        let mut jobs = sample(&base, 7);
        // Knob variations too.
        let s = space::structure_of(&jobs[1].schedule);
        for k in space::Knobs::of(&base.schedule).neighbours(&s) {
            jobs.push(space::apply(&base, &s, &k));
        }
        for (i, job) in jobs.iter().enumerate() {
            let text = fragment::fragment(job, &format!("planned_{i}"));
            let back = job_from(&format!("{SOURCE}\n{text}"), &format!("planned_{i}"));
            let (mut want, mut got) = (job.schedule.clone(), back.schedule.clone());
            want.name = got.name.clone();
            (want.preset, got.preset) = (None, None);
            assert_eq!(got, want, "{text}");
        }
    }
}

#[test]
fn the_search_stages_untied_models_and_keeps_the_global_batch() {
    let base = job("staged");
    let splits = space::splits(&base);
    let global = 8 * 2; // ranks x micro-steps of the base
    let staged: Vec<_> = splits.iter().filter(|s| s.stages > 1).collect();
    assert!(
        staged.iter().any(|s| s.stages == 2) && staged.iter().any(|s| s.stages == 4),
        "{splits:?}"
    );
    assert!(staged
        .iter()
        .any(|s| s.schedule == sched_ir::job::PipelineSchedule::Interleaved1F1B));
    // d = 8 / (p·t) data-parallel ranks of m micro-batches each, tensor groups included.
    assert!(
        splits.iter().any(|s| s.tensor == 4 && s.stages == 2),
        "{splits:?}"
    );
    for s in &splits {
        assert_eq!(8 / (s.stages * s.tensor) * s.micro_steps, global, "{s:?}");
    }
    // A tied head (keeping a replica of the embedding where it needs one) and clipping (its norm
    // summed over the stages) stage as well, with every ZeRO preset, ZB-V included.
    let tied = job("base");
    let splits = space::splits(&tied);
    assert!(
        splits
            .iter()
            .any(|s| s.stages == 2 && s.schedule == sched_ir::job::PipelineSchedule::OneFOneB),
        "{splits:?}"
    );
    assert!(space::structures(&tied).iter().any(|s| {
        s.split.schedule == sched_ir::job::PipelineSchedule::Zbv && s.shard.params.size() > 1
    }));
    let planned = planner::plan(
        &base,
        &Options {
            top: 3,
            threads: 2,
            tune_knobs: false,
        },
        &|_| {},
    )
    .unwrap();
    assert_eq!(planned.ranked.len(), 3);
    assert_eq!(planned.stats.structures, space::structures(&base).len());
}

/// hpZ's secondary shard with tensor parallelism (each secondary group is k data-parallel ranks
/// of one node and tensor index): the search enumerates it with t > 1 as with t = 1, and such a
/// job compiles and verifies.
#[test]
fn the_search_tries_hpz_with_tensor_parallelism() {
    let base = job("deferred");
    let structures = space::structures(&base);
    let node = |s: &space::Structure| {
        matches!(
            s.reshard_after_forward,
            sched_ir::job::ReshardAfterForward::Node { .. }
        )
    };
    assert!(structures.iter().any(|s| s.split.tensor == 1 && node(s)));
    assert!(structures.iter().any(|s| s.split.tensor > 1 && node(s)));
    let mut hpz = base.clone();
    hpz.schedule.tensor = sched_ir::job::Tensor {
        size: 2,
        sequence: false,
    };
    let mesh = sched_ir::job::Mesh { intra: 2, inter: 2 };
    hpz.schedule.shard = sched_ir::job::Shard {
        params: mesh,
        grads: mesh,
        optimizer: mesh,
    };
    hpz.schedule.reshard_after_forward = sched_ir::job::ReshardAfterForward::Node { secondary: 2 };
    assert_eq!(hpz.tensor_not_lowered(), None);
    if let Err(e) = schedc::compile(&hpz) {
        panic!("hpZ with t = 2: {e}");
    }
}

#[test]
fn fragment_sizes_use_exact_units() {
    assert_eq!(fragment::bytes(256 << 20), "256 MiB");
    assert_eq!(fragment::bytes(3 << 30), "3 GiB");
    assert_eq!(fragment::bytes(1536), "1536 B");
    assert_eq!(fragment::bytes(3072), "3 KiB");
    assert_eq!(fragment::bytes(1000), "1000 B");
    assert_eq!(fragment::bytes(0), "0 B");
}

#[test]
fn the_command_prints_a_table_and_json_with_fragments() {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("plan_cli");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("p.sched"), SOURCE).unwrap();
    let run = |args: &[&str]| {
        std::process::Command::new(env!("CARGO_BIN_EXE_schedc"))
            .args(args)
            .current_dir(&dir)
            .output()
            .unwrap()
    };
    let out = run(&["plan", "p.sched", "--schedule", "base", "--top", "3"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains("step") && stdout.contains("MFU"),
        "{stdout}"
    );
    assert!(stdout.contains("searched "), "{stdout}");
    // Header, column titles, three rows, what the model's uncertainty says of them, the summary.
    assert_eq!(stdout.lines().count(), 7, "{stdout}");
    assert!(
        stdout.contains("within the model's uncertainty of #1")
            || stdout.contains("overlaps no other schedule's"),
        "{stdout}"
    );
    let out = run(&[
        "plan",
        "p.sched",
        "--schedule",
        "base",
        "--top",
        "3",
        "--json",
    ]);
    assert_eq!(out.status.code(), Some(0));
    let list: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let list = list.as_array().unwrap();
    assert_eq!(list.len(), 3);
    let times: Vec<f64> = list
        .iter()
        .map(|x| x["step_time_s"].as_f64().unwrap())
        .collect();
    assert!(times.windows(2).all(|w| w[0] <= w[1]), "{times:?}");
    // Each step time lies in its range; a schedule is within the best's range when the two overlap.
    let range = |x: &serde_json::Value| {
        let r = x["step_time_range_s"].as_array().unwrap();
        (r[0].as_f64().unwrap(), r[1].as_f64().unwrap())
    };
    let best_high = range(&list[0]).1;
    for x in list {
        let (lo, hi) = range(x);
        let t = x["step_time_s"].as_f64().unwrap();
        assert!(lo <= t && t <= hi, "{lo} {t} {hi}");
        assert_eq!(
            x["within_range_of_best"].as_bool().unwrap(),
            lo <= best_high,
            "{x}"
        );
    }
    for x in list {
        let frag = x["fragment"].as_str().unwrap();
        assert!(frag.starts_with("schedule base_plan"), "{frag}");
        assert!(x["fits"].as_bool().unwrap());
    }
    // The fragment compiles next to its source.
    let frag = list[0]["fragment"].as_str().unwrap();
    std::fs::write(dir.join("q.sched"), format!("{SOURCE}\n{frag}")).unwrap();
    let out = run(&[
        "compile",
        "q.sched",
        "--schedule",
        "base_plan1",
        "--emit",
        "stats",
    ]);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // Bad input: an unknown schedule is exit 1 with the choices listed; no stdout.
    let out = run(&["plan", "p.sched", "--schedule", "nope"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("base, deferred"));
    assert!(out.stdout.is_empty());
}

#[test]
fn the_search_splits_layers_that_do_not_fit_whole() {
    let base = job("wide_base");
    let gpu = base.cluster.gpu_memory;
    // t: the divisors of the 4 GPUs per node that heads 8 and ffn 16384 divide, composed with
    // pipelines (4 layers: p = 2 with t = 2) and keeping the global batch (16 sequences).
    let splits = space::splits(&base);
    let degrees: Vec<u32> = space::tensor_degrees(&base);
    assert_eq!(degrees, [1, 2, 4]);
    assert!(
        splits.iter().any(|s| s.tensor == 2 && s.stages == 2),
        "{splits:?}"
    );
    for s in &splits {
        assert_eq!(4 / (s.tensor * s.stages) * s.micro_steps, 16, "{s:?}");
        // Split backwards are not lowered with t > 1: never proposed.
        let split_backward = matches!(
            s.schedule,
            sched_ir::job::PipelineSchedule::ZbH1 | sched_ir::job::PipelineSchedule::Zbv
        );
        assert!(s.tensor == 1 || !(s.stages > 1 && split_backward), "{s:?}");
    }
    // No whole-layer schedule fits: every t = 1 structure is over the GPU, by its floor or
    // once compiled.
    for job in sample(&base, 1)
        .into_iter()
        .filter(|j| j.schedule.tensor.size == 1)
    {
        let over = bounds::memory_floor(&job) > gpu
            || schedc::compile(&job).map_or(true, |p| p.arena_bytes > gpu);
        assert!(
            over,
            "{:?} fits without tensor parallelism",
            space::structure_of(&job.schedule)
        );
    }
    let result = planner::plan(
        &base,
        &Options {
            top: 3,
            threads: 2,
            tune_knobs: true,
        },
        &|_| {},
    )
    .unwrap();
    assert!(!result.ranked.is_empty(), "{:?}", result.stats);
    for r in &result.ranked {
        assert!(
            r.job.schedule.tensor.size > 1,
            "{:?}",
            r.job.schedule.tensor
        );
        assert!(r.report.fits && r.report.peak_memory_bytes <= gpu);
    }
    // The pick, written as a fragment beside its source, compiles, verifies and simulates to the
    // step time the planner predicted for it.
    let best = &result.ranked[0];
    let text = fragment::fragment(&best.job, "picked");
    assert!(text.contains("tensor { size = "), "{text}");
    let back = job_from(&format!("{WIDE}\n{text}"), "picked");
    let program = schedc::compile(&back).unwrap();
    let report = schedc::sim::simulate(&program, &back);
    assert_eq!(report.step_time_s, best.report.step_time_s, "{text}");
    assert_eq!(report.peak_memory_bytes, best.report.peak_memory_bytes);
    assert!(report.fits);
}
