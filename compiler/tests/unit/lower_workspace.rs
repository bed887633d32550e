//! Unit tests of `lower::workspace` (a child module of it: they reach its private items).

use super::*;
use crate::{analyze, compile, MemLoader};
use std::path::Path;

const CLUSTER: &str = "cluster c { nodes = 1  gpus_per_node = 4  gpu_memory = 4 GiB  \
        peak_flops = 1 TFLOPS  gemm_workspace = 1000 B  \
        intra_node { bandwidth = 10 GB/s  latency = 1 us }  inter_node { bandwidth = 1 Gbps  latency = 50 us } }";

fn job(model: &str, schedule: &str) -> Job {
    let text = format!("{CLUSTER}\n{model}\nschedule s {{ model = m  cluster = c  {schedule} }}");
    let loader = MemLoader::default().in_dir("/w").with("/w/s.sched", &text);
    let a = analyze(Path::new("/w/s.sched"), &loader).unwrap();
    assert!(!a.has_errors(), "{}", a.render());
    a.jobs[0].clone()
}

/// Whole sequences while their scores fit 2^24 floats, else multiples of 64 query rows.
#[test]
fn attention_chunks_bound_the_scores() {
    // GPT-2 small: 12 × 1024 × 1024 = 12.6M scores fit.
    assert_eq!(attention_chunk(12, 1024), 1024);
    // 64 heads of 4096: 2^24 / 2^18 = 64 rows.
    assert_eq!(attention_chunk(64, 4096), 64);
    // 32 heads of 2048: 256 rows; 40 heads of 2048: 204 rounded down to 192.
    assert_eq!(attention_chunk(32, 2048), 256);
    assert_eq!(attention_chunk(40, 2048), 192);
    // Never below 64 rows, nor above the sequence.
    assert_eq!(attention_chunk(128, 1 << 16), 64);
    assert_eq!(attention_chunk(4, 16), 16);
    for (n, s) in [(12, 1024), (64, 4096), (40, 2048), (7, 3000)] {
        let c = attention_chunk(n, s);
        assert!(
            c == s || (c.is_multiple_of(64) && n * c * s <= ATTENTION_CHUNK_FLOATS),
            "{n} {s}"
        );
    }
}

/// Only a product width that is not a multiple of 8 pads rows, the widest such one.
#[test]
fn only_odd_widths_pad_rows() {
    assert_eq!(padded_rows(8192, &[32000, 4096], 4096), 0);
    assert_eq!(padded_rows(2, &[50257], 768), 3 * 50264 + 50264 * 768);
    // GPT-2 small's head: 1,024 of 8,192 token rows at a time.
    assert_eq!(padded_rows(8192, &[50257], 768), 1536 * 50264 + 50264 * 768);
    assert_eq!(padded_rows(4, &[7, 64, 3], 10), 3 * 4 * 8 / 2 + 8 * 10);
    assert_eq!(padded_rows(4, &[129, 258, 32], 1), 3 * 4 * 264 / 2 + 264);
}

/// The transformer's terms written out for one shape: T = 2·16 tokens, h 32, f 64, w = 32 +
/// 2·16 (kv_heads 2 of 4), n 4, s 16.
#[test]
fn layer_floats_add_up_the_terms() {
    let model = "model m { dtype = bf16  grad_dtype = fp32  seq_len = 16  micro_batch = 2
            layer embed = embedding(vocab = 64, hidden = 32)
            layer block[1] = transformer(hidden = 32, heads = 4, kv_heads = 2, ffn = 64, attention = ATT)
            layer head = lm_head(hidden = 32, vocab = 64, tied = true) }";
    let (t, h, f, w, n, s) = (32u64, 32, 64, 64, 4, 16);
    let chunk = n * attention_chunk(n, s) * s;
    for (att, attention, probs) in [
        ("flash", 2 * chunk + n * s, 0),
        ("naive", n * s * s + n * s, n * s * s),
    ] {
        let j = job(&model.replace("ATT", att), "");
        let m = &j.model;
        let params = m.layers[1].params;
        // bf16 products cast the widest fp32 operand; fp32 gradients of a bf16 model cast
        // the output gradient.
        let casts = (t * f).max(t * w).max(probs) + t * h;
        assert_eq!(
            layer_floats(m, 1),
            params + 3 * t * h + t * w + 2 * t * f + attention + casts + 64 * 64,
            "{att}"
        );
        // The tied head: its gradient and the zeros standing in for the embedding.
        let head = m.layers[2].params + 2 * 64 * 32 + t * h + t * h + t * 64 + 64 * 64;
        assert_eq!(layer_floats(m, 2), head, "{att}");
    }
}

/// Every stream that runs compute has a workspace sized by its neediest op, the GEMM part
/// (the cluster's 1,000 B rounded up to 1,024) only where layer math runs, and every op that
/// needs scratch writes it; a gradient part padded past its layer's gradient (the mlp's 8,481
/// parameters over 4 optimizer shards) is counted, an unpadded one is not.
#[test]
fn the_pass_gives_every_compute_stream_its_workspace() {
    let model = "model m { dtype = fp32  seq_len = 16  micro_batch = 2
            layer embed = embedding(vocab = 256, hidden = 32)
            layer mlp = mlp(hidden = 32, ffn = 129)
            layer head = lm_head(hidden = 32, vocab = 256, tied = true) }";
    let j = job(model, "preset = zero3  train { clip = 1.0 }");
    let p = compile(&j).unwrap();
    let (needs, per_op) = needs(&j, &p);
    let mut with_workspace = 0;
    for (s, st) in p.streams.iter() {
        let need = needs[s];
        let Some(ws) = st.workspace else {
            assert_eq!(need, StreamNeed::default(), "{s}");
            continue;
        };
        with_workspace += 1;
        assert_eq!(ws.gemm_bytes, if need.layer_math { 1024 } else { 0 }, "{s}");
        assert_eq!(p.buffers[ws.buffer].bytes, ws.gemm_bytes + 4 * need.floats);
    }
    assert_eq!(
        with_workspace, 2,
        "compute (layers, loss) and sync (norm, updates)"
    );
    for ((id, op), n) in p.ops.iter().zip(&per_op) {
        let ws = p.streams[op.stream].workspace;
        let writes = op.writes.iter().filter(|r| p.is_workspace(r)).count();
        assert_eq!(writes, usize::from(*n > 0), "{id}");
        if *n > 0 {
            assert_eq!(op.writes.last().unwrap().buffer, ws.unwrap().buffer);
        }
    }
    // The backward op of layer `l`, by its place in the program.
    let backward = |l: usize| {
        p.ops
            .iter()
            .position(|(_, o)| {
                o.kind == OpKind::Compute(ComputeKind::Backward)
                    && o.layer.map(|x| x.index()) == Some(l)
            })
            .unwrap()
    };
    // The mlp's backward: its layer math, and its gradient part padded from 8,481 to 8,484.
    assert_eq!(j.model.layers[1].params, 8481);
    assert_eq!(per_op[backward(1)], layer_floats(&j.model, 1) + 8484);
    // The embedding's 8,192 parameters split evenly: no padded part, no vector for one.
    assert_eq!(per_op[backward(0)], layer_floats(&j.model, 0));
}

/// An output that shares bytes with another region of its op is computed in workspace:
/// a forward whose output is its own input gets room for it.
#[test]
fn an_aliased_output_takes_workspace() {
    let model = "model m { dtype = fp32  seq_len = 16  micro_batch = 2
            layer embed = embedding(vocab = 256, hidden = 32)
            layer mlp = mlp(hidden = 32, ffn = 64)
            layer head = lm_head(hidden = 32, vocab = 256) }";
    let j = job(model, "");
    let mut p = compile(&j).unwrap().into_program();
    let (id, _) = p
        .ops
        .iter()
        .find(|(_, o)| {
            o.kind == OpKind::Compute(ComputeKind::Forward) && o.layer.map(|l| l.index()) == Some(1)
        })
        .unwrap();
    let mut ranks = Ranks::new(&j, &p);
    let before = op_floats(&mut ranks, &p.ops[id]);
    assert_eq!(before, layer_floats(&j.model, 1));
    let input = *p.ops[id].reads.last().unwrap();
    p.ops[id].writes[0] = input;
    let mut ranks = Ranks::new(&j, &p);
    assert_eq!(op_floats(&mut ranks, &p.ops[id]), before + 32 * 32);
}
