//! The example schedules users start from: every one checks cleanly, its resolved job is pinned by a
//! snapshot, and model parameter counts agree with independent references (the spec's published
//! figures and `tests/data/expected_params.tsv`, computed by a separate Python script).

use schedc::{analyze, FsLoader, MemLoader};
use std::path::{Path, PathBuf};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

/// Every `.sched` file under `schedules/`, as paths relative to the repository root.
fn example_files() -> Vec<PathBuf> {
    fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
        for e in std::fs::read_dir(dir).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                walk(&p, out);
            } else if p.extension().is_some_and(|x| x == "sched") {
                out.push(p);
            }
        }
    }
    let mut out = vec![];
    walk(&repo().join("schedules"), &mut out);
    out.sort();
    out.into_iter()
        .map(|p| p.strip_prefix(repo()).unwrap().to_path_buf())
        .collect()
}

#[test]
fn every_example_checks_and_its_jobs_are_pinned() {
    std::env::set_current_dir(repo()).unwrap();
    let files = example_files();
    assert!(
        files.len() >= 15,
        "expected the example schedules, found {files:?}"
    );
    for file in files {
        let a = analyze(&file, &FsLoader).unwrap();
        assert!(
            a.diagnostics.is_empty(),
            "{}:\n{}",
            file.display(),
            a.render()
        );
        if a.jobs.is_empty() {
            continue;
        }
        let listing: Vec<String> = a.jobs.iter().map(schedc::emit::job::emit_job).collect();
        let name = file.to_string_lossy().replace(['/', '.'], "_");
        insta::with_settings!({ snapshot_suffix => name, prepend_module_to_snapshot => false, omit_expression => true }, {
            insta::assert_snapshot!("resolved", listing.join("\n"));
        });
    }
}

#[test]
fn parameter_counts_match_the_independent_reference() {
    let tsv = std::fs::read_to_string(repo().join("tests/data/expected_params.tsv")).unwrap();
    let mut models = std::collections::HashMap::new();
    for file in example_files()
        .into_iter()
        .filter(|f| f.starts_with("schedules/models"))
    {
        let a = analyze(&repo().join(&file), &FsLoader).unwrap();
        assert!(!a.has_errors(), "{}", a.render());
        models.extend(a.models.iter().map(|m| (m.name.clone(), m.parameters())));
    }
    let mut checked = 0;
    for line in tsv.lines().skip(1).filter(|l| !l.trim().is_empty()) {
        let (name, count) = line.split_once('\t').unwrap();
        let count: u64 = count.trim().parse().unwrap();
        assert_eq!(models.get(name), Some(&count), "model {name}");
        checked += 1;
    }
    assert!(checked >= 6, "only {checked} models in the reference");
}

/// The complete example of `dsl.md`, verbatim, and its GPT-2 sentence.
#[test]
fn the_spec_examples_have_their_published_sizes() {
    let cluster = r#"
cluster a800 {
    nodes         = 128
    gpus_per_node = 8
    gpu_memory    = 80 GiB
    peak_flops    = 312 TFLOPS          # dense, at the model's dtype, per GPU
    intra_node { bandwidth = 200 GB/s   latency = 3 us }   # per GPU, one direction
    inter_node { bandwidth = 800 Gbps   latency = 10 us }  # per node, shared by its GPUs
}
"#;
    let main = r#"
# llama7b-mics.sched: LLaMA-7B with MiCS partition groups of one node
import "clusters/a800.sched"            # path relative to this file

model llama_7b {
    dtype       = bf16                  # parameters, activations, gradients
    optimizer   = adam                  # fp32 master + m + v = 12 bytes per parameter
    seq_len     = 4096
    micro_batch = 1                     # sequences per rank per micro-step

    layer embed     = embedding(vocab = 32000, hidden = 4096, positions = rope)
    layer block[32] = transformer(hidden = 4096, heads = 32, ffn = 11008,
                                  norm = rmsnorm, act = swiglu, bias = false)
    layer head      = lm_head(hidden = 4096, vocab = 32000, norm = rmsnorm)
}

model gpt2 {
    dtype = bf16
    seq_len = 1024
    layer embed = embedding(vocab = 50257, hidden = 768, positions = learned)
    layer block[12] = transformer(hidden = 768, heads = 12, ffn = 3072)
    layer head = lm_head(hidden = 768, vocab = 50257, tied = true)
}

schedule mics_8 {
    model       = llama_7b
    cluster     = a800
    nodes       = 4                     # use 4 of the cluster's nodes: 32 ranks
    micro_steps = 4                     # gradient accumulation steps per optimizer step

    shard {
        params    = 8 x 1               # GPUs within a node  x  nodes
        grads     = 8 x 1
        optimizer = 8 x 1
    }
    grad_sync   = two_hop
    all_gather  = hierarchical
    prefetch { forward = 1  backward = 1  max_live = 4 GiB }
    buckets  { gather = 256 MiB  reduce = 256 MiB }
    recompute   = none
}
"#;
    let loader = MemLoader::default()
        .with("spec/llama7b-mics.sched", main)
        .with("spec/clusters/a800.sched", cluster);
    let a = analyze(Path::new("spec/llama7b-mics.sched"), &loader).unwrap();
    assert!(a.diagnostics.is_empty(), "{}", a.render());
    let params = |n: &str| a.models.iter().find(|m| m.name == n).unwrap().parameters();
    assert_eq!(params("llama_7b"), 6_738_415_616);
    assert_eq!(params("gpt2"), 124_439_808);
    let job = a.select(None).unwrap();
    assert_eq!(job.ranks(), 32);
    assert_eq!(job.cluster.gpu_memory, 80 << 30);
    assert_eq!(job.cluster.inter_node.bandwidth, 100e9); // 800 Gbps = 100 GB/s
    assert_eq!(job.schedule.prefetch.max_live, Some(4 << 30));
}
