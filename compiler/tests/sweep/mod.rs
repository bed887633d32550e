//! The pipeline sweep's schedules (see `pipeline_sweep.rs`), shared with the runtime's parity
//! test (`runtime/tests/pipeline_parity.rs` includes this file).

/// The clusters and the 8-layer model every sweep schedule uses.
pub const SOURCE: &str = r#"
cluster c8 {
    nodes = 1
    gpus_per_node = 8
    gpu_memory = 4 GiB
    peak_flops = 100 GFLOPS
    gemm_workspace = 0 B
    intra_node { bandwidth = 10 GB/s  latency = 1 us }
    inter_node { bandwidth = 1 Gbps  latency = 50 us }
}

cluster c2x4 {
    nodes = 2
    gpus_per_node = 4
    gpu_memory = 4 GiB
    peak_flops = 100 GFLOPS
    gemm_workspace = 0 B
    intra_node { bandwidth = 10 GB/s  latency = 1 us }
    inter_node { bandwidth = 1 Gbps  latency = 50 us }
}

model deep {
    dtype       = fp32
    optimizer   = adamw
    seq_len     = 16
    micro_batch = 2
    layer embed    = embedding(vocab = 256, hidden = 32, positions = rope)
    layer block[6] = transformer(hidden = 32, heads = 4, kv_heads = 2, ffn = 64,
                                 norm = rmsnorm, act = swiglu, bias = false)
    layer head     = lm_head(hidden = 32, vocab = 256, norm = rmsnorm)
}

model deep_tied {
    dtype       = fp32
    optimizer   = adamw
    seq_len     = 16
    micro_batch = 2
    layer embed    = embedding(vocab = 256, hidden = 32, positions = learned)
    layer block[6] = transformer(hidden = 32, heads = 4, ffn = 64)
    layer head     = lm_head(hidden = 32, vocab = 256, tied = true)
}
"#;

/// One schedule block per combination, named `s{i}`.
pub fn schedules() -> Vec<String> {
    let pipelines = [
        // (stages, virtual, schedule, layers, micro-batches)
        (2, 1, "gpipe", "balanced", 1),
        (2, 1, "gpipe", "[3, 5]", 4),
        (4, 1, "gpipe", "balanced", 3),
        (2, 1, "\"1f1b\"", "[7, 1]", 2),
        (2, 1, "\"1f1b\"", "balanced", 5),
        (4, 1, "\"1f1b\"", "[1, 3, 2, 2]", 4),
        (8, 1, "\"1f1b\"", "balanced", 8),
        (2, 2, "interleaved_1f1b", "balanced", 2),
        (2, 2, "interleaved_1f1b", "[1, 2, 3, 2]", 6),
        (2, 4, "interleaved_1f1b", "balanced", 4),
        (4, 2, "interleaved_1f1b", "balanced", 4),
        (4, 2, "interleaved_1f1b", "balanced", 8),
        (2, 1, "zb_h1", "[3, 5]", 4),
        (4, 1, "zb_h1", "balanced", 6),
        (2, 2, "zbv", "balanced", 2),
        (2, 2, "zbv", "[2, 2, 1, 3]", 5),
        (4, 2, "zbv", "balanced", 8),
    ];
    let shards = [
        "preset = ddp",
        "preset = zero1",
        "preset = zero2",
        "preset = zero3",
    ];
    let extras = [
        "",
        "recompute = full",
        "streams = single",
        "streams = per_link",
        "overlap { gather = false  reduce = false }",
        "overlap { refresh = next_forward }",
        "buckets { gather = 64 KiB  reduce = 64 KiB }",
        "prefetch { forward = 3  backward = 2 }",
        "prefetch { max_live = 256 KiB }",
    ];
    let mut out = vec![];
    for (i, (p, v, schedule, layers, m)) in pipelines.iter().enumerate() {
        for (j, shard) in shards.iter().enumerate() {
            // Every extra with every pipeline would be 432 compiles; each pipeline takes the
            // extras in turn with each shard, so every pair of them meets.
            let extra = extras[(i + j) % extras.len()];
            let cluster = if (i + j) % 3 == 0 && 8 / p >= 4 {
                "c2x4"
            } else {
                "c8"
            };
            out.push(format!(
                "schedule s{} {{\n    model = deep;  cluster = {cluster};  micro_steps = {m}\n    {shard}\n    {extra}\n    pipeline {{ stages = {p}  virtual = {v}  schedule = {schedule}  layers = {layers} }}\n}}\n",
                out.len()
            ));
        }
    }
    // A head tied to the embedding (a replica on its stage, or ZB-V's on the embedding's ranks
    // with sharded gradients), each pipeline once, the presets in turn, every other one clipped.
    for (i, (p, v, schedule, layers, m)) in pipelines.iter().enumerate() {
        let shard = shards[i % shards.len()];
        let clip = if i % 2 == 0 {
            "train { clip = 1.0 }"
        } else {
            ""
        };
        out.push(format!(
            "schedule s{} {{\n    model = deep_tied;  cluster = c8;  micro_steps = {m}\n    {shard}\n    {clip}\n    pipeline {{ stages = {p}  virtual = {v}  schedule = {schedule}  layers = {layers} }}\n}}\n",
            out.len()
        ));
    }
    // Custom orders: a stage that runs all forwards first beside 1F1B neighbours, a drained
    // interleaving, and uneven micro-batch orders that still match across stages.
    for (order, v, layers, m) in [
        (["F0 F1 F2 B0 B1 B2", "F0 B0 F1 B1 F2 B2"], 1, "[4, 4]", 3),
        (["F0 F1 B0 F2 B1 B2", "F0 B0 F1 B1 F2 B2"], 1, "[2, 6]", 3),
        (
            [
                "F0.0 F1.0 F0.1 F1.1 B0.1 B1.1 B0.0 B1.0",
                "F0.0 F1.0 F0.1 B0.1 F1.1 B1.1 B0.0 B1.0",
            ],
            2,
            "[2, 2, 2, 2]",
            2,
        ),
        (
            ["F0 F1 F2 I0 I1 W0 I2 W1 W2", "F0 I0 F1 I1 W0 F2 I2 W1 W2"],
            1,
            "[4, 4]",
            3,
        ),
    ] {
        for shard in ["preset = zero1", "preset = zero3"] {
            out.push(format!(
                "schedule s{} {{\n    model = deep;  cluster = c8;  micro_steps = {m}\n    {shard}\n    pipeline {{\n        stages = 2;  virtual = {v};  schedule = custom;  layers = {layers}\n        order {{\n            stage 0 = \"{}\"\n            stage 1 = \"{}\"\n        }}\n    }}\n}}\n",
                out.len(),
                order[0],
                order[1]
            ));
        }
    }
    out
}

/// The sweep as one file's text.
pub fn text() -> String {
    format!("{SOURCE}\n{}", schedules().join("\n"))
}
