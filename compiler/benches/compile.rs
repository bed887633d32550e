//! Compile + verify of an 80-layer LLaMA-70B-shaped model, 16 micro-steps, 1,024 ranks (lowering
//! spec §7: "well under a second"), for ZeRO-3, MiCS over 8 x 2 with the hierarchical all-gather,
//! and an AMSP mesh; the same model as a pipeline (8 stages, interleaved 1F1B with 2 chunks, 64
//! micro-batches, 512 ranks, ZeRO-1 in each stage: issue 26's target, under a second); then how
//! the cost grows with layers, micro-steps and ranks (ZeRO-3).
//!
//! Then issue 30's 3-D target: LLaMA-70B with t = 8, 8 stages of interleaved 1F1B (2 chunks), 64
//! micro-batches and ZeRO-1 over d = 64, on 4,096 ranks (under a second on 2 cores), compiled and
//! verified whole, and its placed program verified alone (every proof; each proof's share is
//! what `schedc compile --time-passes` prints, and `bench/phases.py` compares builds by phase).
//!
//! `cargo bench -p schedc --bench compile`

mod common;

use common::{job, target_jobs, ZERO3};
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use schedc::compile;

/// Megatron-style: interleaved 1F1B over 8 stages of 2 chunks, ZeRO-1 in each stage.
pub const INTERLEAVED: &str =
    "preset = zero1\n    pipeline { stages = 8  virtual = 2  schedule = interleaved_1f1b }";

fn targets(c: &mut Criterion) {
    let mut g = c.benchmark_group("compile+verify 80 layers, 16 micro-steps, 1024 ranks");
    g.sample_size(10);
    for (name, j) in target_jobs() {
        g.bench_function(name, |b| b.iter(|| compile(&j).unwrap()));
    }
    g.finish();
    let mut g =
        c.benchmark_group("compile+verify 80 layers, pipeline 8 x 2, 64 micro-batches, 512 ranks");
    g.sample_size(10);
    let j = job(80, 64, 64, INTERLEAVED);
    g.bench_function("interleaved 1f1b + zero1", |b| {
        b.iter(|| compile(&j).unwrap())
    });
    g.finish();
}

/// Issue 30's 3-D composition: Megatron tensor parallelism over each node's 8 GPUs, an interleaved
/// pipeline of 8 stages across nodes, ZeRO-1 over the 64 data-parallel ranks of each stage and
/// tensor index (`bench/inputs/llama70b_3d_4096.sched`).
pub const THREE_D: &str = "tensor { size = 8 }
    pipeline { stages = 8  virtual = 2  schedule = interleaved_1f1b  layers = balanced }
    shard { params = none  grads = none  optimizer = full }";

fn three_d(c: &mut Criterion) {
    let mut g = c.benchmark_group(
        "LLaMA-70B 3-D: t 8 x p 8 (interleaved, 2 chunks) x d 64, 64 micro-batches, 4096 ranks",
    );
    g.sample_size(10);
    let j = job(80, 64, 512, THREE_D);
    g.bench_function("compile+verify", |b| b.iter(|| compile(&j).unwrap()));
    let placed = schedc::pipeline::lower(&j).unwrap();
    g.bench_function("verify (every proof)", |b| {
        b.iter(|| assert!(sched_verify::errors(&placed).is_empty()))
    });
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

criterion_group!(benches, targets, three_d, scaling);
criterion_main!(benches);
