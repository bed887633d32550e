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
    slice_floats(model, l, 1)
}

/// [`layer_floats`] of one rank's slice of layer `l` under tensor-parallel degree `tp` (heads,
/// kv heads and ffn divided by it, the residual stream's width not; 1: the whole layer).
pub fn slice_floats(model: &Model, l: usize, tp: u64) -> u64 {
    let layer = &model.layers[l];
    let t = tokens(model);
    let params = match tp {
        1 => layer.params,
        _ => sched_ir::tensor::rank_params(layer, tp as u32).unwrap_or(layer.params),
    };
    let (scratch, widest) = match layer.kind {
        LayerKind::Transformer(tr) => {
            let (h, f, s, n) = (tr.hidden, tr.ffn / tp, model.seq_len, tr.heads / tp);
            let w = (tr.heads + 2 * tr.kv_heads) / tp * tr.head_dim();
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
            let (h, f) = (m.hidden, m.ffn / tp);
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
    params + 2 * tied_elements(&layer.kind) + scratch + casts + SLACK
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
        // The halves of a split backward take at most what the whole one takes: the layer's
        // scratch, and the weight half the padded gradient part as the whole one does.
        (
            ComputeKind::Backward | ComputeKind::BackwardInput | ComputeKind::BackwardWeight,
            Some(l),
        ) => {
            let lk = &model.layers[l].kind;
            let grad_input = usize::from(l > 0 && kind != ComputeKind::BackwardWeight);
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
                .filter(|r| p.buffers[r.buffer].kind != BufferKind::Stash && padded(r))
                .map(|r| elems(p, r))
                .max()
                .unwrap_or(0);
            let aliased = if grad_input == 1 && !data.is_empty() && ranks.aliased(op, 0) {
                input_elements(lk, model)
            } else {
                0
            };
            layer_floats(model, l) + parts + aliased
        }
        // A tensor-parallel phase: at most the whole layer's math, its parameter gradient
        // (every phase computes the slice's, whose largest padded part it may assemble), the
        // input gradient a close computes, and an output computed in workspace.
        (
            ComputeKind::ForwardOpen(_)
            | ComputeKind::ForwardClose(_)
            | ComputeKind::BackwardOpen(_)
            | ComputeKind::BackwardClose(_),
            Some(l),
        ) => {
            let stream = input_elements(&model.layers[l].kind, model);
            let parts = data.iter().map(|r| elems(p, r)).max().unwrap_or(0);
            let tp = u64::from(job.schedule.tensor.size.max(1));
            slice_floats(model, l, tp) + parts + 2 * stream
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
    matches!(op.kind, OpKind::Compute(k) if k.runs_layer_math())
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
#[path = "../../tests/unit/lower_workspace.rs"]
mod tests;
