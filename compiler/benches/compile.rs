//! Compile + verify of an 80-layer LLaMA-70B-shaped model, 16 micro-steps, 1,024 ranks (lowering
//! spec §7: "well under a second"), for ZeRO-3, MiCS over 8 x 2 with the hierarchical all-gather,
//! and an AMSP mesh; then how the cost grows with layers, micro-steps and ranks (ZeRO-3).
//!
//! `cargo bench -p schedc --bench compile`

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use schedc::{analyze, compile, Job, MemLoader};
use std::path::Path;

fn job(layers: u32, micro_steps: u32, nodes: u32, shard: &str) -> Job {
    let src = format!(
        r#"
cluster c {{
    nodes = {nodes}
    gpus_per_node = 8
    gpu_memory = 80 GiB
    peak_flops = 989 TFLOPS
    intra_node {{ bandwidth = 450 GB/s  latency = 3 us }}
    inter_node {{ bandwidth = 3200 Gbps  latency = 10 us }}
}}
model llama70b {{
    dtype = bf16
    seq_len = 4096
    layer embed = embedding(vocab = 32000, hidden = 8192, positions = rope)
    layer block[{layers}] = transformer(hidden = 8192, heads = 64, kv_heads = 8, ffn = 28672,
                                      norm = rmsnorm, act = swiglu, bias = false)
    layer head = lm_head(hidden = 8192, vocab = 32000, norm = rmsnorm)
}}
schedule s {{
    model = llama70b
    cluster = c
    micro_steps = {micro_steps}
    {shard}
}}
"#
    );
    let a = analyze(
        Path::new("bench.sched"),
        &MemLoader::default().with("bench.sched", &src),
    )
    .unwrap();
    assert!(!a.has_errors(), "{}", a.render());
    a.jobs[0].clone()
}

const ZERO3: &str = "preset = zero3";
const MICS: &str = "preset = mics(partition = 8 x 2)\n    all_gather = hierarchical";
const AMSP: &str = "shard { params = 8 x 1  grads = 8 x 4  optimizer = 8 x 16 }";

fn targets(c: &mut Criterion) {
    let mut g = c.benchmark_group("compile+verify 80 layers, 16 micro-steps, 1024 ranks");
    g.sample_size(10);
    for (name, shard) in [
        ("zero3", ZERO3),
        ("mics 8x2 hierarchical", MICS),
        ("amsp 8x1/8x4/8x16", AMSP),
    ] {
        let j = job(80, 16, 128, shard);
        g.bench_function(name, |b| b.iter(|| compile(&j).unwrap()));
    }
    g.finish();
}

fn scaling(c: &mut Criterion) {
    let mut g = c.benchmark_group("scaling (zero3)");
    g.sample_size(10);
    for layers in [20, 40, 80] {
        let j = job(layers, 16, 128, ZERO3);
        g.bench_with_input(BenchmarkId::new("layers", layers), &j, |b, j| {
            b.iter(|| compile(j).unwrap())
        });
    }
    for m in [4, 8, 16] {
        let j = job(80, m, 128, ZERO3);
        g.bench_with_input(BenchmarkId::new("micro_steps", m), &j, |b, j| {
            b.iter(|| compile(j).unwrap())
        });
    }
    for nodes in [32, 64, 128] {
        let j = job(80, 16, nodes, ZERO3);
        g.bench_with_input(BenchmarkId::new("ranks", nodes * 8), &j, |b, j| {
            b.iter(|| compile(j).unwrap())
        });
    }
    g.finish();
}

criterion_group!(benches, targets, scaling);
criterion_main!(benches);
