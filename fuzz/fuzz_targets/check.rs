//! The whole front end on arbitrary text: parse, import resolution, semantic analysis, diagnostic
//! rendering (every span must land on a char boundary inside its file) and the resolved-job
//! listing. Nothing here may panic, overflow the stack or hang, whatever the input.
//!
//! The input is `main.sched`; `lib.sched` is a fixed valid cluster and model, so inputs that start
//! with `import "lib.sched"` reach schedule resolution with real items in scope.
#![no_main]

use libfuzzer_sys::fuzz_target;
use schedc::{analyze, MemLoader};
use std::path::Path;

const LIB: &str = r#"# fixed library for the fuzzer
cluster c {
    nodes         = 4
    gpus_per_node = 8
    gpu_memory    = 80 GiB
    peak_flops    = 312 TFLOPS
    intra_node { bandwidth = 300 GB/s   latency = 3 us }
    inter_node { bandwidth = 400 Gbps   latency = 10 us }
    measured all_gather 8 x 2 { 1 MiB = 20 GB/s; 64 MiB = 95 GB/s; 512 MiB = 110 GB/s }
}

model m {
    dtype       = bf16
    optimizer   = adam
    seq_len     = 1024
    micro_batch = 1
    layer embed    = embedding(vocab = 50257, hidden = 768, positions = learned)
    layer block[4] = transformer(hidden = 768, heads = 12, ffn = 3072)
    layer head     = lm_head(hidden = 768, vocab = 50257, tied = true)
}
"#;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };
    let loader = MemLoader::default().with("main.sched", text).with("lib.sched", LIB);
    let analysis = analyze(Path::new("main.sched"), &loader).expect("main.sched is in memory");
    let _ = analysis.render();
    for job in &analysis.jobs {
        let _ = schedc::emit::job::emit_job(job);
    }
});
