//! Front-end throughput on a large, realistic, valid file: `cargo bench -p schedc --bench check`.
//!
//! The input is generated in memory: exactly [`LINES`] lines holding clusters with `measured`
//! tables, models written one layer per line (some calls spread over several lines) with comments,
//! and schedules using presets, explicit meshes and every nested block. It is checked once before
//! timing: any error diagnostic aborts the benchmark, so the numbers are always for the full
//! analysis of a clean file, not an early exit.
//!
//! Two benchmarks, both reported per line (`thrpt` is lines per second):
//! - `parse`: text to syntax tree (`sched_grammar::parse`).
//! - `analyze`: parse plus semantic analysis (names, presets, units, every rule, resolved jobs with
//!   exact per-layer parameter counts) through an in-memory loader.

use criterion::{black_box, criterion_group, criterion_main, Criterion, Throughput};
use sched_grammar::FileId;
use schedc::{analyze, MemLoader};
use std::fmt::Write;
use std::path::Path;

/// Lines in the generated file.
const LINES: usize = 10_000;
const CLUSTERS: usize = 8;
const MODELS: usize = 40;
/// Layer lines per model (before multi-line calls and comments).
const LAYERS_PER_MODEL: usize = 120;

fn cluster(out: &mut String, i: usize) {
    let bw = [100, 200, 400, 800][i % 4];
    let _ = writeln!(out, "# cluster {i}: 64 nodes of 8 GPUs, {bw} Gbps per node");
    let _ = writeln!(out, "cluster gpu_{i} {{");
    let _ = writeln!(out, "    nodes         = 64");
    let _ = writeln!(
        out,
        "    gpus_per_node = 8                   # one HGX baseboard"
    );
    let _ = writeln!(out, "    gpu_memory    = {} GiB", [40, 80][i % 2]);
    let _ = writeln!(out, "    peak_flops    = {} TFLOPS", [312, 989][i % 2]);
    let _ = writeln!(out, "    efficiency    = 0.{}", 60 + i);
    let _ = writeln!(
        out,
        "    intra_node {{ bandwidth = 300 GB/s   latency = 3 us }}"
    );
    let _ = writeln!(
        out,
        "    inter_node {{ bandwidth = {bw} Gbps   latency = 10 us }}"
    );
    for (collective, mesh) in [
        ("all_gather", "8 x 2"),
        ("reduce_scatter", "8 x 2"),
        ("all_reduce", "8 x 4"),
        ("broadcast", "8 x 1"),
    ] {
        let _ = writeln!(out, "    measured {collective} {mesh} {{ 1 MiB = 20 GB/s; 64 MiB = 95 GB/s; 512 MiB = 110 GB/s }}");
    }
    let _ = writeln!(out, "    measured all_gather 8 x 8 {{");
    let _ = writeln!(out, "        1 MiB   = 12 GB/s");
    let _ = writeln!(out, "        64 MiB  = 70 GB/s");
    let _ = writeln!(out, "        1 GiB   = 90 GB/s");
    let _ = writeln!(out, "    }}");
    let _ = writeln!(out, "}}");
    out.push('\n');
}

fn model(out: &mut String, i: usize) {
    let hidden = [512, 768, 1024, 2048][i % 4];
    let heads = hidden / 64;
    let ffn = hidden * 4;
    let (norm, act) = if i.is_multiple_of(2) {
        ("rmsnorm", "swiglu")
    } else {
        ("layernorm", "gelu")
    };
    let _ = writeln!(
        out,
        "# model {i}: {LAYERS_PER_MODEL} layers of width {hidden}, written out one per line"
    );
    let _ = writeln!(out, "model net_{i} {{");
    let _ = writeln!(out, "    dtype       = {}", ["bf16", "fp16"][i % 2]);
    let _ = writeln!(out, "    optimizer   = {}", ["adam", "adamw", "sgd"][i % 3]);
    let _ = writeln!(out, "    seq_len     = {}", [1024, 2048, 4096][i % 3]);
    let _ = writeln!(out, "    micro_batch = {}", 1 + i % 4);
    out.push('\n');
    let positions = ["rope", "learned", "none"][i % 3];
    let _ = writeln!(
        out,
        "    layer embed = embedding(vocab = 32000, hidden = {hidden}, positions = {positions})"
    );
    for l in 0..LAYERS_PER_MODEL - 2 {
        if l % 10 == 0 {
            let _ = writeln!(out, "    # stage {}", l / 10);
        }
        match l % 7 {
            // Grouped-query attention, spread over two lines.
            3 => {
                let _ = writeln!(out, "    layer b{l} = transformer(hidden = {hidden}, heads = {heads}, kv_heads = {},", heads / 4);
                let _ = writeln!(out, "                             ffn = {ffn}, norm = {norm}, act = {act}, bias = false)");
            }
            5 => {
                let _ = writeln!(out, "    layer m{l} = mlp(hidden = {hidden}, ffn = {ffn}, act = {act})   # an extra MLP");
            }
            6 => {
                let _ = writeln!(out, "    layer r{l}[2] = transformer(hidden = {hidden}, heads = {heads}, ffn = {ffn}, norm = {norm}, act = {act})");
            }
            _ => {
                let _ = writeln!(
                    out,
                    "    layer b{l} = transformer(hidden = {hidden}, heads = {heads}, ffn = {ffn}, norm = {norm}, act = {act}, attention = {})",
                    ["flash", "naive"][l % 2]
                );
            }
        }
    }
    let tied = if positions == "learned" {
        "true"
    } else {
        "false"
    };
    let _ = writeln!(
        out,
        "    layer head = lm_head(hidden = {hidden}, vocab = 32000, norm = {norm}, tied = {tied})"
    );
    let _ = writeln!(out, "}}");
    out.push('\n');
}

/// One schedule, of one of several shapes (all valid on a 64 x 8 cluster).
fn schedule(out: &mut String, i: usize) {
    let model = i % MODELS;
    let cluster = i % CLUSTERS;
    let nodes = [4, 8, 16][i % 3];
    let _ = writeln!(out, "# schedule {i}");
    let _ = writeln!(out, "schedule plan_{i} {{");
    let _ = writeln!(out, "    model       = net_{model}");
    let _ = writeln!(out, "    cluster     = gpu_{cluster}");
    let _ = writeln!(
        out,
        "    nodes       = {nodes}                   # {} ranks",
        nodes * 8
    );
    let _ = writeln!(out, "    micro_steps = {}", 1 + i % 8);
    match i % 6 {
        0 => {
            let _ = writeln!(out, "    preset      = zero3");
        }
        1 => {
            let _ = writeln!(out, "    preset      = mics(partition = 16)   # 8 x 2");
            let _ = writeln!(out, "    all_gather  = flat");
        }
        2 => {
            let _ = writeln!(out, "    shard {{");
            let _ = writeln!(out, "        params    = 8 x 1");
            let _ = writeln!(out, "        grads     = 8 x 2");
            let _ = writeln!(out, "        optimizer = 8 x 4");
            let _ = writeln!(out, "    }}");
            let _ = writeln!(out, "    grad_sync   = two_hop");
        }
        3 => {
            let _ = writeln!(out, "    preset      = hpz(secondary = 8)");
        }
        4 => {
            let _ = writeln!(out, "    preset      = zero1");
            let _ = writeln!(out, "    grad_sync   = flat");
        }
        _ => {
            let _ = writeln!(out, "    preset      = hsdp(partition = 8)");
            let _ = writeln!(out, "    reshard_after_forward = false");
        }
    }
    let _ = writeln!(
        out,
        "    prefetch {{ forward = {}  backward = 1  max_live = 8 GiB }}",
        1 + i % 3
    );
    let _ = writeln!(out, "    buckets  {{ gather = 256 MiB  reduce = 128 MiB }}");
    let _ = writeln!(
        out,
        "    overlap  {{ gather = true  reduce = true  sync = {}  refresh = next_forward }}",
        i.is_multiple_of(2)
    );
    let _ = writeln!(
        out,
        "    streams     = {}",
        ["per_role", "per_link", "single"][i % 3]
    );
    let _ = writeln!(out, "    recompute   = {}", ["none", "full"][i % 2]);
    let _ = writeln!(out, "    train {{");
    let _ = writeln!(out, "        steps = 100  lr = 3e-4  seed = {i}");
    let _ = writeln!(out, "        clip  = 1.0");
    let _ = writeln!(out, "    }}");
    let _ = writeln!(out, "}}");
    out.push('\n');
}

/// The benchmark input: exactly [`LINES`] lines.
fn generate() -> String {
    let mut out =
        String::from("# Generated benchmark input: clusters, models and schedules, all valid.\n\n");
    (0..CLUSTERS).for_each(|i| cluster(&mut out, i));
    (0..MODELS).for_each(|i| model(&mut out, i));
    let mut i = 0;
    // Schedules until the next one would not fit, then comment lines up to the exact count.
    loop {
        let mut one = String::new();
        schedule(&mut one, i);
        if out.lines().count() + one.lines().count() > LINES {
            break;
        }
        out.push_str(&one);
        i += 1;
    }
    while out.lines().count() < LINES {
        out.push_str("# padding\n");
    }
    assert_eq!(out.lines().count(), LINES);
    out
}

fn bench(c: &mut Criterion) {
    let text = generate();
    let loader = MemLoader::default().with("bench.sched", &text);
    let root = Path::new("bench.sched");
    let analysis = analyze(root, &loader).expect("in memory");
    if analysis.has_errors() || !analysis.diagnostics.is_empty() {
        panic!(
            "the generated benchmark input does not check cleanly:\n{}",
            analysis.render()
        );
    }
    let layers: usize = analysis.models.iter().map(|m| m.layers.len()).sum();
    eprintln!(
        "input: {} lines, {} bytes; {} clusters, {} models ({layers} layers), {} jobs",
        LINES,
        text.len(),
        analysis.clusters.len(),
        analysis.models.len(),
        analysis.jobs.len()
    );

    let mut group = c.benchmark_group("check");
    group.throughput(Throughput::Elements(LINES as u64));
    group.bench_function("parse", |b| {
        b.iter(|| sched_grammar::parse(FileId(0), black_box(&text)))
    });
    group.bench_function("analyze", |b| {
        b.iter(|| analyze(black_box(root), &loader).expect("in memory"))
    });
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
