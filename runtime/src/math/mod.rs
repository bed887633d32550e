//! The model math of the CPU runtime: every zoo layer's forward and backward, the loss, the
//! initialisation and the optimizers, all computed in f32 (`runtime.md`, "Model math").
//!
//! A [`LayerMath`] is built once per layer from the resolved [`Layer`] and its [`Model`]. It owns no
//! buffers: the executor hands it the layer's flat parameter vector (tensors in the order of
//! `layer.tensors`, matrices [out, in]), the input and output hidden states and the layer's
//! saved-activation buffer. Invariants it keeps:
//! - `forward` overwrites `output` and all of `saved`; `backward` overwrites `grad_input`,
//!   `grad_params` and `grad_tied`, never accumulating: the caller sums micro-batches.
//! - The saved buffer is [`LayerMath::saved_segments`] back to back, segment for segment the
//!   tensors that `sched_ir::abi` sizes the memory plan with, so a segment stored in
//!   the model dtype ([`Stored::Model`]) or in fp32 ([`Stored::F32`]) totals exactly
//!   `saved_bytes`. Backward reads only the saved buffer, the layer's input and its parameters.
//! - With a 16-bit model dtype every stored activation and the output are rounded to it where they
//!   are written (and later math uses the rounded values); gradients are rounded to `grad_dtype`.
//! - Results depend only on the inputs, never on which thread runs them: no global state but a
//!   per-thread scratch buffer reused between calls.
//!
//! Conventions: T = micro_batch · seq_len tokens, token t at position t mod seq_len. Rotary
//! positions (when the model's embedding says `positions = rope`) use HF LLaMA's rotate-half
//! pairing: in each head of width d, element i pairs with i + d/2 and turns by
//! position · 10000^(−2i/d). The `attn.qkv` activation is saved after the rotation.

pub(crate) mod attention;
pub(crate) mod gemm;
#[cfg(all(test, feature = "llvm"))]
#[path = "../../tests/unit/math_generated_parity.rs"]
mod generated_parity;
mod init;
pub(crate) mod ops;
pub(crate) mod optim;
mod precision;
pub(crate) mod saved;
pub mod tensor;

pub use init::{init_layer, Rng};
pub use optim::{grad_scale, optimizer_step, OptimizerConfig};
pub use precision::{bf16_bits_to_f32, f32_to_bf16_bits, round_bf16, round_f16};

pub(crate) use precision::Precision;
use sched_ir::abi::logits_stride;
use sched_ir::job::{Activation, Attention, Layer, LayerKind, Model, Norm, Positions};
use std::fmt;
use std::ops::Range;

/// Where a saved segment is stored: in the model dtype, or always in fp32.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stored {
    Model,
    F32,
}

/// One tensor of a layer's saved activations.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Segment {
    pub name: &'static str,
    pub elements: usize,
    pub stored: Stored,
}

/// A layer's input: token ids ([micro_batch·seq_len], the embedding) or hidden states.
#[derive(Clone, Copy, Debug)]
pub enum Input<'a> {
    Tokens(&'a [u32]),
    Hidden(&'a [f32]),
}

/// The gradients of a layer's backward on slices ([`LayerMath::backward`]): `output`, the
/// gradient of the layer's output (read); `input`, of its input (overwritten when given; never
/// for an embedding); `params`, of its flat parameter vector, and `tied`, of a tied lm_head's
/// embedding `wte` (both overwritten).
pub struct SliceGrads<'a> {
    pub output: &'a [f32],
    pub input: Option<&'a mut [f32]>,
    pub params: &'a mut [f32],
    pub tied: Option<&'a mut [f32]>,
}

/// Why a layer cannot be run.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum MathError {
    /// A `dense` layer: only a size for planning.
    Dense { layer: String },
    /// The layer's tensor list does not hold a tensor the math needs, with the shape it needs.
    Tensor {
        layer: String,
        tensor: String,
        problem: String,
    },
    /// The layer's shape cannot be computed (odd head width with rotary positions, …).
    Shape { layer: String, problem: String },
}

impl fmt::Display for MathError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            MathError::Dense { layer } => write!(
                f,
                "layer {layer} is `dense`: it can be compiled and simulated but not run"
            ),
            MathError::Tensor {
                layer,
                tensor,
                problem,
            } => write!(f, "layer {layer}: tensor `{tensor}` {problem}"),
            MathError::Shape { layer, problem } => write!(f, "layer {layer}: {problem}"),
        }
    }
}

impl std::error::Error for MathError {}

/// Token layout of one micro-batch.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Dims {
    pub s: usize,
    pub t: usize,
}

/// A norm's parameters within the flat vector.
#[derive(Clone, Debug)]
pub(crate) struct NormP {
    pub kind: Norm,
    /// The model's ε (`norm_eps`).
    pub eps: f32,
    pub w: Range<usize>,
    pub b: Option<Range<usize>>,
}

/// An MLP's parameters: `w1` is `mlp.fc` (gelu) or `mlp.gate` (swiglu); `up` only for swiglu.
#[derive(Clone, Debug)]
pub(crate) struct MlpP {
    pub act: Activation,
    pub hidden: usize,
    pub ffn: usize,
    pub w1: Range<usize>,
    pub b1: Option<Range<usize>>,
    pub up: Option<(Range<usize>, Option<Range<usize>>)>,
    pub proj: Range<usize>,
    pub proj_b: Option<Range<usize>>,
}

#[derive(Clone)]
pub(crate) struct BlockP {
    pub hidden: usize,
    pub shape: attention::Shape,
    pub attention: Attention,
    pub ln1: NormP,
    pub qkv: Range<usize>,
    pub qkv_b: Option<Range<usize>>,
    pub proj: Range<usize>,
    pub proj_b: Option<Range<usize>>,
    pub ln2: NormP,
    pub mlp: MlpP,
    pub rope: Option<ops::Rope>,
}

pub(crate) enum Kind {
    Embedding {
        vocab: usize,
        hidden: usize,
        wte: Range<usize>,
        wpe: Option<Range<usize>>,
    },
    Transformer(Box<BlockP>),
    Mlp {
        hidden: usize,
        ln: NormP,
        mlp: MlpP,
    },
    LmHead {
        hidden: usize,
        vocab: usize,
        norm: NormP,
        weight: Option<Range<usize>>,
    },
}

/// The math of one layer for one model: shapes, where each tensor sits in the flat parameter
/// vector, and the saved-activation layout.
pub struct LayerMath {
    name: String,
    dims: Dims,
    params: usize,
    act: Precision,
    grad: Precision,
    kind: Kind,
    segments: Vec<Segment>,
}

/// Finds tensors by name in a layer's list and checks their shapes; `eps` is the model's norm ε
/// for the norms it finds.
struct Tensors<'a> {
    layer: &'a Layer,
    eps: f32,
}

impl Tensors<'_> {
    fn find(&self, name: &str) -> Option<(Range<usize>, &[u64])> {
        let mut at = 0usize;
        for t in &self.layer.tensors {
            let n = t.elements() as usize;
            if t.name == name {
                return Some((at..at + n, &t.shape));
            }
            at += n;
        }
        None
    }

    fn get(&self, name: &str, shape: &[usize]) -> Result<Range<usize>, MathError> {
        let err = |problem: String| MathError::Tensor {
            layer: self.layer.name.clone(),
            tensor: name.to_string(),
            problem,
        };
        let (range, have) = self
            .find(name)
            .ok_or_else(|| err(format!("is missing (expected shape {shape:?})")))?;
        let have: Vec<usize> = have.iter().map(|&d| d as usize).collect();
        if have != shape {
            return Err(err(format!("has shape {have:?}, expected {shape:?}")));
        }
        Ok(range)
    }

    fn opt(
        &self,
        name: &str,
        shape: &[usize],
        present: bool,
    ) -> Result<Option<Range<usize>>, MathError> {
        present.then(|| self.get(name, shape)).transpose()
    }

    fn norm(&self, prefix: &str, kind: Norm, h: usize) -> Result<NormP, MathError> {
        Ok(NormP {
            kind,
            eps: self.eps,
            w: self.get(&format!("{prefix}.weight"), &[h])?,
            b: self.opt(&format!("{prefix}.bias"), &[h], kind == Norm::LayerNorm)?,
        })
    }

    fn mlp(&self, act: Activation, h: usize, f: usize, bias: bool) -> Result<MlpP, MathError> {
        let (w1, b1, up) = match act {
            Activation::Gelu => (
                self.get("mlp.fc.weight", &[f, h])?,
                self.opt("mlp.fc.bias", &[f], bias)?,
                None,
            ),
            Activation::SwiGlu => (
                self.get("mlp.gate.weight", &[f, h])?,
                self.opt("mlp.gate.bias", &[f], bias)?,
                Some((
                    self.get("mlp.up.weight", &[f, h])?,
                    self.opt("mlp.up.bias", &[f], bias)?,
                )),
            ),
        };
        Ok(MlpP {
            act,
            hidden: h,
            ffn: f,
            w1,
            b1,
            up,
            proj: self.get("mlp.proj.weight", &[h, f])?,
            proj_b: self.opt("mlp.proj.bias", &[h], bias)?,
        })
    }
}

fn seg(name: &'static str, elements: usize, stored: Stored) -> Segment {
    Segment {
        name,
        elements,
        stored,
    }
}

fn norm_segments(out: &'static str, stats: &'static str, d: Dims, h: usize) -> [Segment; 2] {
    [
        seg(out, d.t * h, Stored::Model),
        seg(stats, 2 * d.t, Stored::F32),
    ]
}

fn mlp_segments(d: Dims, m: &MlpP) -> Vec<Segment> {
    let n = d.t * m.ffn;
    match m.act {
        Activation::Gelu => vec![
            seg("mlp.pre", n, Stored::Model),
            seg("mlp.post", n, Stored::Model),
        ],
        Activation::SwiGlu => vec![
            seg("mlp.gate", n, Stored::Model),
            seg("mlp.up", n, Stored::Model),
            seg("mlp.prod", n, Stored::Model),
        ],
    }
}

/// Whether the model's embedding uses rotary positions (which its transformers then apply).
fn model_uses_rope(model: &Model) -> bool {
    model.layers.iter().any(|l| {
        matches!(
            l.kind,
            LayerKind::Embedding {
                positions: Positions::Rope,
                ..
            }
        )
    })
}

impl LayerMath {
    pub fn new(layer: &Layer, model: &Model) -> Result<Self, MathError> {
        Self::sliced(layer, model, 1)
    }

    /// The math of one rank's slice of `layer` under tensor-parallel degree `t`
    /// ([`sched_ir::tensor`]): a layer the lowering splits ([`sched_ir::tensor::split_layers`])
    /// computes heads/t query heads and kv_heads/t key and value heads of the full head width,
    /// and ffn/t of its MLP, from its slice's tensors; any other layer (and every layer at t = 1)
    /// is [`LayerMath::new`]'s whole layer. Every rank's slice has the same shapes, so one math
    /// serves the whole tensor group.
    pub fn sliced(layer: &Layer, model: &Model, t: u32) -> Result<Self, MathError> {
        let narrow;
        let (layer, tp) = if sched_ir::tensor::split_layers(&layer.kind, t) {
            let rank = sched_ir::tensor::TensorRank {
                size: t as usize,
                index: 0,
            };
            // Shapes only: the copy runs (a row-parallel matrix has one per row) are not needed.
            let cut = sched_ir::tensor::SliceLayout::shapes(layer, rank).map_err(|e| {
                MathError::Shape {
                    layer: layer.name.clone(),
                    problem: e.to_string(),
                }
            })?;
            narrow = cut.narrow(layer);
            (&narrow, t as usize)
        } else {
            (layer, 1)
        };
        let s = model.seq_len as usize;
        let b = model.micro_batch as usize;
        let dims = Dims { s, t: b * s };
        let ts = Tensors {
            layer,
            eps: model.norm_eps(),
        };
        let shape_err = |problem: String| MathError::Shape {
            layer: layer.name.clone(),
            problem,
        };
        let (kind, segments) = match layer.kind {
            LayerKind::Dense { .. } => {
                return Err(MathError::Dense {
                    layer: layer.name.clone(),
                })
            }
            LayerKind::Embedding {
                vocab,
                hidden,
                positions,
            } => {
                let (v, h) = (vocab as usize, hidden as usize);
                let kind = Kind::Embedding {
                    vocab: v,
                    hidden: h,
                    wte: ts.get("wte", &[v, h])?,
                    wpe: ts.opt("wpe", &[s, h], positions == Positions::Learned)?,
                };
                (kind, vec![])
            }
            LayerKind::Transformer(tr) => {
                let (h, heads, kvh, f) = (
                    tr.hidden as usize,
                    tr.heads as usize,
                    tr.kv_heads as usize,
                    tr.ffn as usize,
                );
                if heads == 0 || kvh == 0 || h % heads != 0 || heads % kvh != 0 {
                    return Err(shape_err(format!(
                        "hidden {h}, heads {heads} and kv_heads {kvh} do not split into whole heads"
                    )));
                }
                let shape = attention::Shape {
                    b,
                    s,
                    heads: heads / tp,
                    kv_heads: kvh / tp,
                    d: h / heads,
                };
                let rope = if model_uses_rope(model) {
                    if !shape.d.is_multiple_of(2) {
                        return Err(shape_err(format!(
                            "rotary positions need an even head width, not {}",
                            shape.d
                        )));
                    }
                    Some(ops::Rope::new(shape.d, s, model.rope_base()))
                } else {
                    None
                };
                let width = shape.width();
                let p = BlockP {
                    hidden: h,
                    shape,
                    attention: tr.attention,
                    ln1: ts.norm("ln1", tr.norm, h)?,
                    qkv: ts.get("attn.qkv.weight", &[width, h])?,
                    qkv_b: ts.opt("attn.qkv.bias", &[width], tr.bias)?,
                    proj: ts.get("attn.proj.weight", &[h, shape.hidden()])?,
                    proj_b: ts.opt("attn.proj.bias", &[h], tr.bias)?,
                    ln2: ts.norm("ln2", tr.norm, h)?,
                    mlp: ts.mlp(tr.act, h, f / tp, tr.bias)?,
                    rope,
                };
                let heads = shape.heads;
                let mut segs = norm_segments("ln1.out", "ln1.stats", dims, h).to_vec();
                segs.push(seg("attn.qkv", dims.t * width, Stored::Model));
                segs.push(seg("attn.out", dims.t * shape.hidden(), Stored::Model));
                segs.push(match tr.attention {
                    Attention::Flash => seg("attn.lse", heads * dims.t, Stored::F32),
                    Attention::Naive => seg("attn.probs", heads * dims.t * s, Stored::Model),
                });
                segs.push(seg("resid", dims.t * h, Stored::Model));
                segs.extend(norm_segments("ln2.out", "ln2.stats", dims, h));
                segs.extend(mlp_segments(dims, &p.mlp));
                (Kind::Transformer(Box::new(p)), segs)
            }
            LayerKind::Mlp(m) => {
                let (h, f) = (m.hidden as usize, m.ffn as usize / tp);
                let mlp = ts.mlp(m.act, h, f, m.bias)?;
                let mut segs = norm_segments("ln.out", "ln.stats", dims, h).to_vec();
                segs.extend(mlp_segments(dims, &mlp));
                let kind = Kind::Mlp {
                    hidden: h,
                    ln: ts.norm("ln", m.norm, h)?,
                    mlp,
                };
                (kind, segs)
            }
            LayerKind::LmHead {
                hidden,
                vocab,
                norm,
                tied,
            } => {
                let (h, v) = (hidden as usize, vocab as usize);
                let kind = Kind::LmHead {
                    hidden: h,
                    vocab: v,
                    norm: ts.norm("norm", norm, h)?,
                    weight: ts.opt("weight", &[v, h], !tied)?,
                };
                (
                    kind,
                    norm_segments("norm.out", "norm.stats", dims, h).to_vec(),
                )
            }
        };
        let params: usize = layer.tensors.iter().map(|t| t.elements() as usize).sum();
        if params as u64 != layer.params {
            return Err(shape_err(format!(
                "its tensors hold {params} parameters but the layer declares {}",
                layer.params
            )));
        }
        Ok(LayerMath {
            name: layer.name.clone(),
            dims,
            params,
            act: Precision::of(model.dtype),
            grad: Precision::of(model.grad_dtype),
            kind,
            segments,
        })
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// The layer's kind with its tensor ranges (for backends that run the math elsewhere).
    #[allow(dead_code)]
    pub(crate) fn kind(&self) -> &Kind {
        &self.kind
    }

    #[allow(dead_code)]
    pub(crate) fn dims(&self) -> Dims {
        self.dims
    }

    /// The rounding of stored activations and of gradients.
    #[allow(dead_code)]
    pub(crate) fn precisions(&self) -> (Precision, Precision) {
        (self.act, self.grad)
    }

    /// P_l, the length of the layer's flat parameter vector.
    pub fn params(&self) -> usize {
        self.params
    }

    /// What forward keeps for backward, in buffer order (T tokens, h hidden, f ffn, n heads, s
    /// seq_len, w = h + 2·kv the q/k/v width):
    /// - transformer: `ln1.out` T·h, `ln1.stats` 2·T fp32 ((mean, 1/σ) per token; mean 0 for RMS
    ///   norm), `attn.qkv` T·w (q and k after rotary positions), `attn.out` T·h (before the
    ///   projection), `attn.lse` n·T fp32 (`[seq][head][row]`, flash) or `attn.probs` n·T·s
    ///   (`[seq][head][row][col]`, naive), `resid` T·h (after attention), `ln2.out`, `ln2.stats`,
    ///   then the MLP's: gelu `mlp.pre`, `mlp.post` T·f each; swiglu `mlp.gate`, `mlp.up`,
    ///   `mlp.prod` (silu(gate)·up) T·f each;
    /// - mlp: `ln.out`, `ln.stats`, then the MLP's; lm_head: `norm.out`, `norm.stats`;
    /// - embedding: nothing.
    pub fn saved_segments(&self) -> Vec<Segment> {
        self.segments.clone()
    }

    pub fn saved_elements(&self) -> usize {
        self.segments.iter().map(|s| s.elements).sum()
    }

    /// T rows of [`LayerMath::output_stride`].
    pub fn output_elements(&self) -> usize {
        self.dims.t * self.output_stride()
    }

    /// Columns of the output: the hidden width, or an lm_head's vocabulary.
    pub fn output_width(&self) -> usize {
        match &self.kind {
            Kind::Embedding { hidden, .. } | Kind::Mlp { hidden, .. } => *hidden,
            Kind::Transformer(p) => p.hidden,
            Kind::LmHead { vocab, .. } => *vocab,
        }
    }

    /// Elements between two rows of the output: its width, except that an lm_head's logits
    /// start every `sched_ir::abi::logits_stride` elements (aligned rows; the
    /// columns past the vocabulary are never read or written).
    pub fn output_stride(&self) -> usize {
        match &self.kind {
            Kind::LmHead { vocab, .. } => logits_stride(*vocab as u64) as usize,
            _ => self.output_width(),
        }
    }

    /// T token ids for an embedding, T·hidden otherwise.
    pub fn input_elements(&self) -> usize {
        let t = self.dims.t;
        match &self.kind {
            Kind::Embedding { .. } => t,
            Kind::Mlp { hidden, .. } | Kind::LmHead { hidden, .. } => t * hidden,
            Kind::Transformer(p) => t * p.hidden,
        }
    }

    /// The model's lm_head, whose output the loss reads: the last layer's math when it is one.
    pub fn head(maths: &[LayerMath]) -> Option<&LayerMath> {
        maths
            .last()
            .filter(|m| matches!(m.kind, Kind::LmHead { .. }))
    }

    /// True for the embedding, whose input is token ids.
    pub fn takes_tokens(&self) -> bool {
        matches!(self.kind, Kind::Embedding { .. })
    }

    /// True for an lm_head that projects with the embedding's `wte`.
    pub fn is_tied(&self) -> bool {
        matches!(self.kind, Kind::LmHead { weight: None, .. })
    }

    /// The fp32 elements a split backward's input half (`I`) stashes for its weight half (`W`)
    /// (the layouts of `saved::BlockStash` and `saved::NormedStash`; what
    /// `sched_ir::abi::stash_elements` sizes the plan's stash with): none for an embedding.
    pub fn stash_elements(&self) -> usize {
        let t = self.dims.t;
        match &self.kind {
            Kind::Embedding { .. } => 0,
            Kind::Transformer(bp) => t * saved::block_stash_per_token(bp),
            Kind::Mlp { hidden, mlp, .. } => t * (hidden + saved::mlp_stash_per_token(mlp)),
            Kind::LmHead { hidden, .. } => t * hidden,
        }
    }

    /// Elements of the tied `wte` (vocab·hidden) for a tied lm_head, else 0.
    pub fn tied_elements(&self) -> usize {
        match self.kind {
            Kind::LmHead {
                weight: None,
                vocab,
                hidden,
                ..
            } => vocab * hidden,
            _ => 0,
        }
    }
}

/// Softmax cross-entropy of each row of `logits` ([n, vocab], rows `stride` apart) against
/// `targets` (n). Returns the SUM of the n token losses; `grad_logits` (the same layout) is
/// overwritten with (softmax − onehot) / n in each row's first `vocab` columns.
pub fn cross_entropy(
    logits: &[f32],
    targets: &[u32],
    vocab: usize,
    stride: usize,
    grad_logits: &mut [f32],
) -> f64 {
    ops::wide(
        #[inline(always)]
        || {
            let n = targets.len();
            assert!(
                vocab <= stride,
                "cross_entropy: rows narrower than the vocab"
            );
            assert_eq!(logits.len(), n * stride, "cross_entropy: logits length");
            assert_eq!(grad_logits.len(), n * stride, "cross_entropy: grad length");
            let inv = 1.0 / n as f32;
            let mut total = 0f64;
            for ((row, grad), &target) in logits
                .chunks_exact(stride)
                .zip(grad_logits.chunks_exact_mut(stride))
                .zip(targets)
            {
                let (row, grad) = (&row[..vocab], &mut grad[..vocab]);
                let target = target as usize;
                assert!(
                    target < vocab,
                    "cross_entropy: target {target} not below vocab {vocab}"
                );
                let max = row.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x));
                let sum = ops::sum_exp(row, max);
                let lse = max + sum.ln();
                total += f64::from(lse - row[target]);
                for (g, &x) in grad.iter_mut().zip(row) {
                    *g = ops::exp(x - lse) * inv;
                }
                grad[target] -= inv;
            }
            total
        },
    )
}

/// Flat-vector ranges of a layer's 2-D tensors, the ones AdamW decays (embeddings included).
pub fn decay_ranges(layer: &Layer) -> Vec<Range<usize>> {
    let mut at = 0usize;
    let mut out = vec![];
    for t in &layer.tensors {
        let n = t.elements() as usize;
        if t.shape.len() == 2 {
            out.push(at..at + n);
        }
        at += n;
    }
    out
}

/// Where `name`'s tensor sits in `layer`'s flat vector.
pub fn tensor_range(layer: &Layer, name: &str) -> Option<Range<usize>> {
    Tensors {
        layer,
        eps: Model::DEFAULT_NORM_EPS as f32,
    }
    .find(name)
    .map(|(r, _)| r)
}
