//! The `schedc` command line: results on stdout, diagnostics on stderr, exit status 0/1/2, and
//! `fmt` never leaving a half-written or wrongly rewritten file.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn schedc(args: &[&str], dir: &Path) -> Output {
    Command::new(env!("CARGO_BIN_EXE_schedc"))
        .args(args)
        .current_dir(dir)
        .output()
        .unwrap()
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// A fresh scratch directory under the target dir.
fn scratch(name: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(name);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

const CLUSTER: &str = "cluster c {\n    nodes = 2\n    gpus_per_node = 4\n    gpu_memory = 16 GiB\n    peak_flops = 100 TFLOPS\n    intra_node { bandwidth = 100 GB/s  latency = 2 us }\n    inter_node { bandwidth = 100 Gbps  latency = 10 us }\n}\n";
const MODEL: &str = "model m {\n    dtype = bf16\n    seq_len = 128\n    layer embed = embedding(vocab = 256, hidden = 64)\n    layer block[2] = transformer(hidden = 64, heads = 4, ffn = 256)\n    layer head = lm_head(hidden = 64, vocab = 256, tied = true)\n}\n";

#[test]
fn check_prints_one_line_per_schedule_and_exits_0() {
    let dir = scratch("check_ok");
    let src = format!("{CLUSTER}\n{MODEL}\nschedule a {{\n    model = m\n    cluster = c\n    preset = zero3\n}}\n\nschedule b {{\n    model = m\n    cluster = c\n    nodes = 1\n}}\n");
    std::fs::write(dir.join("ok.sched"), src).unwrap();
    let out = schedc(&["check", "ok.sched"], &dir);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let stdout = text(&out.stdout);
    assert_eq!(stdout.lines().count(), 2, "{stdout}");
    assert!(
        stdout.starts_with("a: 8 ranks (2 nodes x 4 GPUs), model m with "),
        "{stdout}"
    );
    assert!(stdout.contains("b: 4 ranks (1 node x 4 GPUs)"), "{stdout}");
    assert!(out.stderr.is_empty());
}

#[test]
fn errors_go_to_stderr_with_location_and_exit_1() {
    let dir = scratch("check_err");
    std::fs::write(
        dir.join("bad.sched"),
        format!("{CLUSTER}schedule s {{\n    model = m\n    clustr = c\n}}\n"),
    )
    .unwrap();
    let out = schedc(&["check", "bad.sched"], &dir);
    assert_eq!(out.status.code(), Some(1));
    assert!(out.stdout.is_empty());
    let err = text(&out.stderr);
    assert!(err.contains("bad.sched:11:5"), "{err}");
    assert!(
        !err.contains("missing `cluster`"),
        "a misspelt key is reported once: {err}"
    );
    assert!(err.contains("did you mean `cluster`?"), "{err}");
    assert!(err.contains("unknown model `m`"), "{err}");
}

/// A custom pipeline order whose stages wait on each other is the input's fault: exit 1, the
/// cycle named, no plan written.
#[test]
fn a_deadlocking_custom_order_exits_1_with_its_cycle() {
    let dir = scratch("crossed");
    let model = "model u {\n    dtype = bf16\n    seq_len = 128\n    layer embed = embedding(vocab = 256, hidden = 64)\n    layer block[2] = transformer(hidden = 64, heads = 4, ffn = 256)\n    layer head = lm_head(hidden = 64, vocab = 256)\n}\n";
    let src = format!(
        "{CLUSTER}\n{model}\nschedule crossed {{\n    model = u;  cluster = c;  nodes = 1;  gpus_per_node = 2;  micro_steps = 2\n    pipeline {{\n        stages = 2;  schedule = custom;  layers = [2, 2]\n        order {{\n            stage 0 = \"F0 B0 F1 B1\"\n            stage 1 = \"F0 F1 B0 B1\"\n        }}\n    }}\n}}\n"
    );
    std::fs::write(dir.join("crossed.sched"), src).unwrap();
    let out = schedc(
        &["compile", "crossed.sched", "-o", "crossed.plan.json"],
        &dir,
    );
    assert_eq!(out.status.code(), Some(1), "{}", text(&out.stderr));
    let stderr = text(&out.stderr);
    assert!(
        stderr.contains("the custom pipeline order of `crossed` cannot run")
            && stderr.contains("closes the cycle"),
        "{stderr}"
    );
    assert!(!dir.join("crossed.plan.json").exists());
}

/// A split backward with tensor parallelism checks but is not lowered yet: `check` (and `check
/// --resolved`) accept a schedule with `tensor { size = 2;  sequence = true }` and `zb_h1`, while
/// `compile`, `simulate` and `plan` refuse it at `size` with exit 1 and write nothing; the
/// compiler's own guard says the same to a caller holding only the job.
#[test]
fn split_backwards_with_tensor_parallelism_check_but_are_not_compiled_yet() {
    let dir = scratch("tensor");
    let src = format!(
        "{CLUSTER}\n{MODEL}\nschedule tp {{\n    model = m;  cluster = c\n    tensor {{ size = 2;  sequence = true }}\n    micro_steps = 2;  pipeline {{ stages = 2;  schedule = zb_h1 }}\n}}\n"
    );
    std::fs::write(dir.join("tp.sched"), src).unwrap();
    let out = schedc(&["check", "--resolved", "tp.sched"], &dir);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let stdout = text(&out.stdout);
    assert!(
        stdout.contains(
            "tensor                 t = 2, sequence parallel, data-parallel mesh 2 x 1 (d = 2)"
        ),
        "{stdout}"
    );
    for args in [
        &["compile", "tp.sched"][..],
        &["compile", "tp.sched", "-o", "tp.plan.json"],
        &["compile", "tp.sched", "--emit", "summary"],
        &["simulate", "tp.sched", "--json"],
        &["plan", "tp.sched"],
    ] {
        let out = schedc(args, &dir);
        assert_eq!(
            out.status.code(),
            Some(1),
            "{args:?}: {}",
            text(&out.stderr)
        );
        let stderr = text(&out.stderr);
        assert!(
            stderr.contains(
                "error: tensor parallelism (t = 2) with a split backward (`I`/`W` actions) is not lowered yet"
            ) && stderr.contains("tp.sched:20:21"),
            "{args:?}: {stderr}"
        );
        assert!(out.stdout.is_empty(), "{args:?}");
    }
    assert!(!dir.join("tp.plan.json").exists());
    assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 1, "only tp.sched");

    let analysis = schedc::analyze(&dir.join("tp.sched"), &schedc::FsLoader).unwrap();
    let job = analysis.select(None).unwrap();
    assert!(matches!(
        schedc::compile(job),
        Err(schedc::CompileError::TensorNotLowered(
            2,
            "a split backward (`I`/`W` actions)"
        ))
    ));
}

#[test]
fn warnings_alone_exit_0() {
    let dir = scratch("check_warn");
    let src = format!("{CLUSTER}{MODEL}schedule s {{\n    model = m\n    cluster = c\n    shard {{ params = 2 x 2  grads = 2 x 2  optimizer = 2 x 2 }}\n}}\n");
    std::fs::write(dir.join("w.sched"), src).unwrap();
    let out = schedc(&["check", "w.sched"], &dir);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert!(text(&out.stderr).contains("warning: rule 3"));
}

#[test]
fn an_unreadable_file_exits_2() {
    let dir = scratch("check_missing");
    let out = schedc(&["check", "nope.sched"], &dir);
    assert_eq!(out.status.code(), Some(2));
    assert!(text(&out.stderr).contains("cannot read nope.sched"));
}

#[test]
fn fmt_rewrites_and_check_reports() {
    let dir = scratch("fmt");
    let messy = "model m{dtype=bf16;seq_len=128 # len\nlayer x=mlp(hidden=8,ffn=16)}\n";
    std::fs::write(dir.join("m.sched"), messy).unwrap();
    let out = schedc(&["fmt", "--check", "m.sched"], &dir);
    assert_eq!(out.status.code(), Some(1));
    assert!(text(&out.stdout).contains("m.sched: not formatted"));
    assert_eq!(
        std::fs::read_to_string(dir.join("m.sched")).unwrap(),
        messy,
        "--check must not write"
    );

    let out = schedc(&["fmt", "m.sched"], &dir);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let formatted = std::fs::read_to_string(dir.join("m.sched")).unwrap();
    assert_ne!(formatted, messy);
    assert!(formatted.contains("# len"));
    assert_eq!(
        schedc(&["fmt", "--check", "m.sched"], &dir).status.code(),
        Some(0)
    );
    let leftovers: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(
        leftovers.len(),
        1,
        "temporary files left behind: {leftovers:?}"
    );
}

#[test]
fn fmt_leaves_a_file_with_syntax_errors_untouched() {
    let dir = scratch("fmt_bad");
    let bad = "model m {\n    dtype = = bf16\n}\n";
    std::fs::write(dir.join("b.sched"), bad).unwrap();
    let out = schedc(&["fmt", "b.sched"], &dir);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        text(&out.stderr).contains("b.sched:2:13"),
        "{}",
        text(&out.stderr)
    );
    assert_eq!(std::fs::read_to_string(dir.join("b.sched")).unwrap(), bad);
}

fn tiny(dir: &Path) {
    let src = format!(
        "{CLUSTER}{MODEL}schedule z {{\n    model = m\n    cluster = c\n    preset = zero3\n}}\n"
    );
    std::fs::write(dir.join("z.sched"), src).unwrap();
}

#[test]
fn compile_writes_a_plan_that_verify_accepts() {
    let dir = scratch("compile_ok");
    tiny(&dir);
    let out = schedc(&["compile", "z.sched"], &dir);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let plan = std::fs::read_to_string(dir.join("z.plan.json")).unwrap();
    assert!(
        plan.starts_with(r#"{"format":"sched-plan","version":2,"schedule":"z","ranks":8"#),
        "{}",
        &plan[..80]
    );
    let out = schedc(&["verify", "z.plan.json"], &dir);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert!(text(&out.stdout).contains("verified"));
    for emit in ["listing", "stats"] {
        let out = schedc(&["compile", "z.sched", "--emit", emit], &dir);
        assert_eq!(out.status.code(), Some(0));
        assert!(!out.stdout.is_empty());
    }
    let out = schedc(&["compile", "z.sched", "--emit", "summary"], &dir);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let summary = text(&out.stdout);
    for part in [
        "schedule z: 8 ranks",
        "program hash ",
        "memory plan hash ",
        "\nlayers (",
    ] {
        assert!(summary.contains(part), "no `{part}` in:\n{summary}");
    }
    assert!(!summary.contains(" @ "), "offsets appear only as a hash");
}

/// `--emit ptx` writes the plan and one PTX module per architecture beside it, each kernel of
/// the job an entry; a build without LLVM says what it needs and writes nothing.
#[test]
fn compile_emits_ptx_beside_the_plan() {
    let dir = scratch("compile_ptx");
    tiny(&dir);
    std::fs::create_dir_all(dir.join("out")).unwrap();
    let out = schedc(
        &[
            "compile",
            "z.sched",
            "--emit",
            "ptx",
            "-o",
            "out/z.plan.json",
        ],
        &dir,
    );
    let written: Vec<_> = ["z.plan.json", "z.sm_80.ptx", "z.sm_90.ptx"]
        .iter()
        .filter(|f| dir.join("out").join(f).exists())
        .collect();
    if cfg!(feature = "llvm") {
        assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
        assert_eq!(written.len(), 3, "{written:?}");
        let ptx = std::fs::read_to_string(dir.join("out/z.sm_90.ptx")).unwrap();
        assert!(ptx.contains(".target sm_90"));
        assert!(
            ptx.contains(".entry gelu_bf16_bf16("),
            "the model's GELU in bf16"
        );
        assert!(ptx.contains(".entry cross_entropy_v256_bf16_fp32("));
    } else {
        assert_eq!(out.status.code(), Some(2));
        assert!(
            text(&out.stderr).contains("--features llvm"),
            "{}",
            text(&out.stderr)
        );
        assert!(written.is_empty(), "{written:?}");
    }
}

#[test]
fn verify_refuses_edited_truncated_and_foreign_plans() {
    let dir = scratch("verify_bad");
    tiny(&dir);
    assert_eq!(
        schedc(&["compile", "z.sched", "-o", "z.json"], &dir)
            .status
            .code(),
        Some(0)
    );
    let plan = std::fs::read_to_string(dir.join("z.json")).unwrap();
    let mut json: serde_json::Value = serde_json::from_str(&plan).unwrap();
    // Remove the first wait of the compute stream.
    let ops = json["streams"][0]["ops"].as_array_mut().unwrap();
    let op = ops
        .iter_mut()
        .find(|o| !o["wait"].as_array().unwrap().is_empty())
        .unwrap();
    op["wait"].as_array_mut().unwrap().remove(0);
    std::fs::write(dir.join("edited.json"), json.to_string()).unwrap();
    let out = schedc(&["verify", "edited.json"], &dir);
    assert_eq!(out.status.code(), Some(1));
    let err = text(&out.stderr);
    assert!(
        err.contains("fails verification") && err.contains("-->"),
        "{err}"
    );

    std::fs::write(dir.join("cut.json"), &plan[..plan.len() / 2]).unwrap();
    let out = schedc(&["verify", "cut.json"], &dir);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        text(&out.stderr).contains("not a plan file"),
        "{}",
        text(&out.stderr)
    );

    std::fs::write(
        dir.join("v9.json"),
        plan.replacen(r#""version":2"#, r#""version":9"#, 1),
    )
    .unwrap();
    let out = schedc(&["verify", "v9.json"], &dir);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        text(&out.stderr).contains("version 9 is not supported"),
        "{}",
        text(&out.stderr)
    );
}

#[test]
fn compile_needs_a_schedule_name_when_there_are_several() {
    let dir = scratch("compile_several");
    let src = format!("{CLUSTER}{MODEL}schedule a {{\n    model = m\n    cluster = c\n}}\n\nschedule b {{\n    model = m\n    cluster = c\n}}\n");
    std::fs::write(dir.join("two.sched"), src).unwrap();
    let out = schedc(&["compile", "two.sched"], &dir);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        text(&out.stderr).contains("--schedule NAME: a, b"),
        "{}",
        text(&out.stderr)
    );
    assert!(!dir.join("a.plan.json").exists());
    let out = schedc(&["compile", "two.sched", "--schedule", "b"], &dir);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert!(dir.join("b.plan.json").exists());
}

#[test]
fn time_passes_names_every_pass() {
    let dir = scratch("time_passes");
    tiny(&dir);
    let out = schedc(
        &["compile", "z.sched", "--time-passes", "--emit", "stats"],
        &dir,
    );
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let err = text(&out.stderr);
    for pass in [
        "build",
        "prefetch",
        "streams",
        "events",
        "memory",
        "events (final)",
        "verify",
        // Each proof of the final verification, under `verify`.
        "· structure",
        "· stages",
        "· flow",
        "· collectives",
        "· memory",
        "· values",
    ] {
        assert!(
            err.lines()
                .any(|l| l.trim_start().starts_with(pass) && l.ends_with(" ms")),
            "{pass} missing:\n{err}"
        );
    }
}

/// `train { clip = … }`: the plan carries one `grad_norm` op and the norm's one-element all-reduce,
/// `verify` accepts it, and a plan whose updates no longer read the norm is refused.
#[test]
fn clip_compiles_to_a_verified_norm_and_edited_updates_are_refused() {
    let dir = scratch("compile_clip");
    let src = format!(
        "{CLUSTER}{MODEL}schedule z {{\n    model = m\n    cluster = c\n    preset = zero3\n    train {{ clip = 1.0 }}\n}}\n"
    );
    std::fs::write(dir.join("z.sched"), src).unwrap();
    let out = schedc(&["compile", "z.sched", "--emit", "listing"], &dir);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let listing = text(&out.stdout);
    assert_eq!(listing.matches(" grad_norm ").count(), 1, "{listing}");
    assert!(listing.contains("clip.sumsq"), "{listing}");
    let out = schedc(&["compile", "z.sched"], &dir);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let plan = std::fs::read_to_string(dir.join("z.plan.json")).unwrap();
    let out = schedc(&["verify", "z.plan.json"], &dir);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));

    let mut json: serde_json::Value = serde_json::from_str(&plan).unwrap();
    let norm_ops: Vec<(usize, usize)> = (0..json["streams"].as_array().unwrap().len())
        .flat_map(|s| {
            let ops = json["streams"][s]["ops"].as_array().unwrap();
            (0..ops.len())
                .filter(|&o| ops[o]["kind"] == "grad_norm" || ops[o]["kind"] == "all_reduce")
                .map(move |o| (s, o))
                .collect::<Vec<_>>()
        })
        .collect();
    assert_eq!(norm_ops.len(), 2, "grad_norm and its all_reduce");
    // Every update's third read is the norm; drop it from the first update.
    let update = json["streams"]
        .as_array_mut()
        .unwrap()
        .iter_mut()
        .flat_map(|s| s["ops"].as_array_mut().unwrap().iter_mut())
        .find(|o| o["kind"] == "update")
        .unwrap();
    assert_eq!(update["reads"].as_array().unwrap().len(), 3);
    update["reads"].as_array_mut().unwrap().pop();
    std::fs::write(dir.join("edited.json"), json.to_string()).unwrap();
    let out = schedc(&["verify", "edited.json"], &dir);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        text(&out.stderr).contains("does not read the gradient norm"),
        "{}",
        text(&out.stderr)
    );
}

/// `schedc import hf`: a config's block on stdout or into `-o`, which `schedc check` accepts with
/// the checkpoint's parameter count; a refused config exits 1 naming the file and field and
/// writes nothing; an unreadable one exits 2.
#[test]
fn import_hf_writes_a_checked_block_or_nothing() {
    let dir = scratch("import_hf");
    let hf = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/hf");
    let config = |f: &str| hf.join(f).display().to_string();
    let out = schedc(
        &["import", "hf", &config("gpt2.json"), "--name", "gpt2"],
        &dir,
    );
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert!(text(&out.stdout).contains("model gpt2 {"));
    std::fs::write(dir.join("m.sched"), &out.stdout).unwrap();
    let out = schedc(&["check", "m.sched"], &dir);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let out = schedc(
        &[
            "import",
            "hf",
            &config("bad-rope-theta.json"),
            "-o",
            "x.sched",
        ],
        &dir,
    );
    assert_eq!(out.status.code(), Some(1));
    let err = text(&out.stderr);
    assert!(
        err.contains("bad-rope-theta.json") && err.contains("`rope_theta`"),
        "{err}"
    );
    assert!(!dir.join("x.sched").exists());
    let out = schedc(&["import", "hf", "missing.json", "-o", "x.sched"], &dir);
    assert_eq!(out.status.code(), Some(2));
    assert!(!dir.join("x.sched").exists());
    let out = schedc(
        &["import", "hf", &config("gpt2.json"), "--name", "2x"],
        &dir,
    );
    assert_eq!(out.status.code(), Some(1), "a name that is no identifier");
}
