//! Simulating one step of an 80-layer LLaMA-70B-shaped model, 16 micro-steps, 1,024 ranks: the
//! planner simulates many candidates, so this must take well under a second. The program is
//! compiled once, outside the measurement.
//!
//! `cargo bench -p schedc --bench simulate`

mod common;

use common::target_jobs;
use criterion::{criterion_group, criterion_main, Criterion};
use schedc::{compile, sim};

fn simulate(c: &mut Criterion) {
    let mut g = c.benchmark_group("simulate 80 layers, 16 micro-steps, 1024 ranks");
    g.sample_size(10);
    for (name, j) in target_jobs() {
        let program = compile(&j).unwrap();
        g.bench_function(name, |b| b.iter(|| sim::simulate(&program, &j)));
    }
    g.finish();
}

criterion_group!(benches, simulate);
criterion_main!(benches);
