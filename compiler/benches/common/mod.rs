//! The jobs the benchmarks share: an 80-layer LLaMA-70B-shaped model (GQA, SwiGLU) on a cluster of
//! 8-GPU H100-like nodes, with a chosen number of layers, micro-steps, nodes and sharding.

use schedc::{analyze, Job, MemLoader};
use std::path::Path;

pub const ZERO3: &str = "preset = zero3";
pub const MICS: &str = "preset = mics(partition = 8 x 2)\n    all_gather = hierarchical";
pub const AMSP: &str = "shard { params = 8 x 1  grads = 8 x 4  optimizer = 8 x 16 }";

/// The headline targets, by name: 80 layers, 16 micro-steps, 128 nodes (1,024 ranks), under
/// ZeRO-3, MiCS over 8 x 2 with the hierarchical all-gather, and an AMSP mesh.
pub fn target_jobs() -> impl Iterator<Item = (&'static str, Job)> {
    [
        ("zero3", ZERO3),
        ("mics 8x2 hierarchical", MICS),
        ("amsp 8x1/8x4/8x16", AMSP),
    ]
    .into_iter()
    .map(|(name, shard)| (name, job(80, 16, 128, shard)))
}

pub fn job(layers: u32, micro_steps: u32, nodes: u32, shard: &str) -> Job {
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
