//! Workspace sizes: the scratch a compute op needs beside the regions it names, defined once here
//! for the memory plan (the runtime reads the planned sizes and never recomputes them).
//!
//! The figures are those of the CUDA backend's device layer (`runtime/src/backend/cuda/gpu.rs`,
//! `runtime/src/device`), which computes on the arena in place and takes everything else from
//! its stream's fp32 workspace, a bump allocator given back after every op. In floats, with T =
//! micro_batch × seq_len tokens, h hidden, f ffn, n heads, s seq_len and w = h + 2·kv_dim the
//! q/k/v width, a layer's forward or backward ([`layer_floats`]) needs at most:
//! - the gradients it accumulates: its parameters' (P_l), and a tied head's embedding gradient
//!   plus the zeros that stand in for the embedding where an op reads none (2·vocab·h);
//! - its fp32 intermediates (`runtime/src/device/layers.rs`): a transformer's backward holds dr,
//!   da, dattn (T·h each), dqkv (T·w) and the MLP's two T·f, plus attention's (naive: one
//!   sequence's n·s² scores forward or their gradient backward, and a log-sum-exp per row of a
//!   sequence, n·s; flash: two chunks of n·c·s, the scores and the probabilities (their
//!   gradients reuse both), c the [`attention_chunk`] rows, and n·s log-sum-exps); an mlp
//!   layer's backward da (T·h) and the two T·f; an lm_head's backward da (T·h) (its logits'
//!   rows start aligned, [`logits_stride`]); and a product over a width that is not a multiple
//!   of 8 its padded rows ([`padded_rows`]). A forward needs less (with rotary positions, the
//!   projected qkv, T·w);
//! - the casts of one product's operands at a time (operands stored in the product dtype are
//!   used in place): for a 16-bit model, two of the widest fp32 operand at two bytes an element,
//!   that is one widest in floats (max(T·f, T·w), and n·s² with naive attention, whose
//!   probabilities are a product operand; flash casts its score gradient into the
//!   probabilities' place); where the gradient dtype is not the model's, the output gradient
//!   (T·h, or T·vocab for a head);
//! - 64 floats of alignment for each of up to 64 allocations.
//!
//! A `dense` layer runs nowhere (the runtime refuses it); it is given its parameter gradient and
//! the alignment slack, the part every layer's backward needs.
//!
//! Beyond its layer math an op ([`op_floats`]) needs: a backward, one vector of its largest
//! parameter-gradient part that runs past the gradient into the padding (such parts are
//! assembled there; the others are written from the gradient directly); every layer op and the loss, room
//! for each output that shares bytes with another region of the op on some rank (the device then
//! computes it in workspace and stores it after); the loss, its per-row losses and 128 floats; the
//! gradient norm, two floats (an f64) per chunk of its largest gradient and 64; the update, 64 floats.
//! Accumulations and copies need none.
//!
//! Streams that run layer math also hold the GEMM library's workspace (cuBLAS's and cuBLASLt's,
//! shared: a stream runs one product at a time), `Cluster::gemm_workspace` bytes rounded up to
//! [`GEMM_ALIGN`]; see `crate::passes::workspace` for how the two parts make one buffer.

use cranelift_entity::{EntityRef, SecondaryMap};
use sched_ir::abi::*;
use sched_ir::ir::*;
use sched_ir::job::{Attention, Dtype, Job, LayerKind, Model};

/// Floats of fp32 alignment slack per layer op: 64 floats for each of up to 64 allocations.
const SLACK: u64 = 64 * 64;

/// Floats the loss, the optimizer update and the gradient norm are given.
const SMALL_OP: u64 = 64;

/// The GEMM library workspace of a stream that runs layer math under `job`, in bytes.
pub fn gemm_bytes(job: &Job) -> u64 {
    job.cluster.gemm_workspace.div_ceil(GEMM_ALIGN) * GEMM_ALIGN
}

/// Tokens of one micro-batch.
fn tokens(model: &Model) -> u64 {
    model.micro_batch * model.seq_len
}

/// Elements of the embedding a tied lm_head projects with (vocab × hidden), else 0.
fn tied_elements(kind: &LayerKind) -> u64 {
    match *kind {
        LayerKind::LmHead {
            tied: true,
            vocab,
            hidden,
            ..
        } => vocab * hidden,
        _ => 0,
    }
}

/// Floats of workspace layer `l`'s forward or backward math needs (see the module doc).
pub fn layer_floats(model: &Model, l: usize) -> u64 {
    let layer = &model.layers[l];
    let t = tokens(model);
    let (scratch, widest) = match layer.kind {
        LayerKind::Transformer(tr) => {
            let (h, f, s, n) = (tr.hidden, tr.ffn, model.seq_len, tr.heads);
            let w = h + 2 * tr.kv_dim();
            let (attention, probs) = match tr.attention {
                // One sequence's scores (forward) or their gradient (backward), and, forward,
                // each row's log-sum-exp.
                Attention::Naive => (n * s * s + n * s, n * s * s),
                // A chunk's scores and probabilities (their gradients reuse both) and its
                // rows' log-sum-exps.
                Attention::Flash => (2 * n * attention_chunk(n, s) * s + n * s, 0),
            };
            (
                3 * t * h
                    + t * w
                    + 2 * t * f
                    + attention
                    + padded_rows(t, &[w, h, f, 2 * f], h.max(f)),
                (t * f).max(t * w).max(probs),
            )
        }
        LayerKind::Mlp(m) => {
            let (h, f) = (m.hidden, m.ffn);
            (
                t * h + 2 * t * f + padded_rows(t, &[h, f, 2 * f], h.max(f)),
                t * f,
            )
        }
        // The logits' rows are aligned ([`logits_stride`]): the products run in place.
        LayerKind::LmHead { hidden, .. } => (t * hidden, t * hidden),
        LayerKind::Embedding { .. } | LayerKind::Dense { .. } => (0, 0),
    };
    let mut casts = 0;
    if model.dtype != Dtype::Fp32 {
        casts += widest;
    }
    if model.grad_dtype != model.dtype {
        casts += output_elements(&layer.kind, model);
    }
    layer.params + 2 * tied_elements(&layer.kind) + scratch + casts + SLACK
}

/// Rank-dependent offsets, evaluated lazily: only a pair of regions of one buffer with a shard
/// offset needs them.
pub struct Ranks<'a> {
    job: &'a Job,
    program: &'a Program,
    /// The distinct shard-index tuples over the ranks, computed on first use.
    reps: Option<Vec<u32>>,
}

impl<'a> Ranks<'a> {
    pub fn new(job: &'a Job, program: &'a Program) -> Self {
        Ranks {
            job,
            program,
            reps: None,
        }
    }

    /// Whether `a` and `b` (regions of one op) share a byte on some rank. Regions of different
    /// buffers never do in a sound memory plan (an op uses both at once).
    fn overlap(&mut self, a: &Region, b: &Region) -> bool {
        if a.buffer != b.buffer {
            return false;
        }
        let layout = self.program.layout;
        let fixed = |r: &Region| matches!(r.offset, Offset::Fixed(_));
        let ranks: &[u32] = if fixed(a) && fixed(b) {
            &[0]
        } else {
            self.reps
                .get_or_insert_with(|| sched_ir::ir::layout::representative_ranks(&layout))
        };
        ranks.iter().any(|&rank| {
            let (x, y) = (
                sched_ir::ir::layout::range(a, &layout, rank),
                sched_ir::ir::layout::range(b, &layout, rank),
            );
            x.0 < y.1 && y.0 < x.1 && a.bytes > 0 && b.bytes > 0
        })
    }

    /// Whether write `i` of `op` shares a byte with another of its regions on some rank.
    fn aliased(&mut self, op: &Op, i: usize) -> bool {
        let w = op.writes[i];
        let others = op.reads.iter().chain(
            op.writes
                .iter()
                .enumerate()
                .filter(|(j, _)| *j != i)
                .map(|(_, r)| r),
        );
        others.into_iter().any(|r| self.overlap(&w, r))
    }
}

/// Floats of workspace compute op `op` needs (see the module doc), from its kind, layer and the
/// regions the lowering gave it (`runtime/src/exec.rs` decodes the same order: a forward writes
/// its output, then its saved activations; a backward of a layer past the first writes its input
/// gradient first, then its gradient parts; the loss writes the logits' gradient).
pub fn op_floats(ranks: &mut Ranks<'_>, op: &Op) -> u64 {
    let job: &Job = ranks.job;
    let model = &job.model;
    let elems = |p: &Program, r: &Region| r.bytes / p.buffers[r.buffer].dtype.bytes();
    // The op's own regions: a workspace access (this module's doing) is not one of them.
    let p = ranks.program;
    let data: Vec<Region> = op
        .writes
        .iter()
        .filter(|r| p.buffers[r.buffer].kind != BufferKind::Workspace)
        .copied()
        .collect();
    let kind = match op.kind {
        OpKind::Compute(k) => k,
        _ => return 0,
    };
    let layer = op.layer.map(|l| l.index());
    match (kind, layer) {
        (ComputeKind::Forward | ComputeKind::Recompute, Some(l)) => {
            let lk = &model.layers[l].kind;
            let mut aliased = 0;
            if kind == ComputeKind::Forward && !data.is_empty() && ranks.aliased(op, 0) {
                aliased += output_elements(lk, model);
            }
            let saved = if kind == ComputeKind::Forward { 1 } else { 0 };
            if data.len() > saved && ranks.aliased(op, saved) {
                aliased += saved_elements(lk, model).total();
            }
            layer_floats(model, l) + aliased
        }
        (ComputeKind::Backward, Some(l)) => {
            let lk = &model.layers[l].kind;
            let grad_input = usize::from(l > 0);
            // A part that runs past the gradient it takes values from (the padding up to a
            // multiple of the optimizer shards) is assembled in one vector of the largest such
            // part; the others are written from the gradient directly.
            let padded = |r: &Region| {
                let len = match p.buffers[r.buffer].layer {
                    Some(x) if x.index() == l => model.layers[l].params,
                    _ => tied_elements(lk),
                };
                match r.offset {
                    Offset::Fixed(o) => o / p.buffers[r.buffer].dtype.bytes() + elems(p, r) > len,
                    Offset::Shard { .. } => true,
                }
            };
            let parts = data[grad_input.min(data.len())..]
                .iter()
                .filter(|r| padded(r))
                .map(|r| elems(p, r))
                .max()
                .unwrap_or(0);
            let aliased = if l > 0 && !data.is_empty() && ranks.aliased(op, 0) {
                input_elements(lk, model)
            } else {
                0
            };
            layer_floats(model, l) + parts + aliased
        }
        (ComputeKind::Loss, _) => {
            let aliased = if !data.is_empty() && ranks.aliased(op, 0) {
                elems(p, &data[0])
            } else {
                0
            };
            // The per-row losses the generated kernel writes before they are summed.
            aliased + tokens(model) + 2 * SMALL_OP
        }
        (ComputeKind::GradNorm, _) => {
            // f64 partial sums of the largest gradient, one per chunk.
            let chunks = op
                .reads
                .iter()
                .filter(|r| p.buffers[r.buffer].kind != BufferKind::Workspace)
                .map(|r| elems(p, r).div_ceil(SUMSQ_CHUNK as u64))
                .max()
                .unwrap_or(0);
            2 * chunks + SMALL_OP
        }
        (ComputeKind::Update, _) => SMALL_OP,
        _ => 0,
    }
}

/// Whether `op` runs layer math (and so matrix products through the GEMM library).
pub fn runs_layer_math(op: &Op) -> bool {
    matches!(
        op.kind,
        OpKind::Compute(ComputeKind::Forward | ComputeKind::Recompute | ComputeKind::Backward)
    )
}

/// What one stream needs of its workspace.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StreamNeed {
    /// The most fp32 scratch floats any of its compute ops needs.
    pub floats: u64,
    /// Whether it runs layer math (and so products through the GEMM library).
    pub layer_math: bool,
}

/// Every stream's need, and every op's own floats (0 for collectives and for ops that need
/// none), by op index.
pub fn needs(job: &Job, p: &Program) -> (SecondaryMap<StreamId, StreamNeed>, Vec<u64>) {
    let mut ranks = Ranks::new(job, p);
    let mut streams: SecondaryMap<StreamId, StreamNeed> = SecondaryMap::new();
    let mut per_op = Vec::with_capacity(p.ops.len());
    for op in p.ops.values() {
        let n = op_floats(&mut ranks, op);
        per_op.push(n);
        let e = &mut streams[op.stream];
        e.floats = e.floats.max(n);
        e.layer_math |= runs_layer_math(op);
    }
    (streams, per_op)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{analyze, compile, MemLoader};
    use std::path::Path;

    const CLUSTER: &str = "cluster c { nodes = 1  gpus_per_node = 4  gpu_memory = 4 GiB  \
        peak_flops = 1 TFLOPS  gemm_workspace = 1000 B  \
        intra_node { bandwidth = 10 GB/s  latency = 1 us }  inter_node { bandwidth = 1 Gbps  latency = 50 us } }";

    fn job(model: &str, schedule: &str) -> Job {
        let text =
            format!("{CLUSTER}\n{model}\nschedule s {{ model = m  cluster = c  {schedule} }}");
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
                o.kind == OpKind::Compute(ComputeKind::Forward)
                    && o.layer.map(|l| l.index()) == Some(1)
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
}
