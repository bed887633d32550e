//! Compile + verify of an 80-layer LLaMA-70B-shaped model, 16 micro-steps, 1,024 ranks (lowering
//! spec §7: "well under a second"), for ZeRO-3, MiCS over 8 x 2 with the hierarchical all-gather,
//! and an AMSP mesh; the same model as a pipeline (8 stages, interleaved 1F1B with 2 chunks, 64
//! micro-batches, 512 ranks, ZeRO-1 in each stage: issue 26's target, under a second); then how
//! the cost grows with layers, micro-steps and ranks (ZeRO-3).
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
