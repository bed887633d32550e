//! The generated kernels: every non-GEMM kernel of a training step, written once and emitted for
//! the GPU (PTX) and for the CPU (JIT-compiled host code).
//!
//! This module is the catalogue, always built: a [`Kernel`] is one operation ([`Op`]) specialised
//! to the sizes the plan fixes (row widths, head shapes, the vocabulary) and to the storage dtype
//! of each of its tensors. [`Kernel::params`] is its ABI, the same on both targets: the op's
//! parameters in order, then `begin` and `end` (i64), the half-open range of indices it covers. An
//! index is an element, a row or a column, as [`Op::space`] says; the host splits the range across
//! threads, the GPU covers it with a grid-stride loop. [`for_job`] lists the kernels a job needs
//! on a GPU: every variant the CUDA backend's device code may launch for it, what
//! `schedc compile --emit ptx` writes beside the plan ([`ptx_path`]) and the backend loads.
//!
//! The code generator ([`codegen`], behind the `llvm` cargo feature, LLVM 19 through inkwell)
//! writes each kernel's body once as target-neutral LLVM IR in an `alwaysinline` function and
//! wraps it twice: in a `ptx_kernel` for `nvptx64-nvidia-cuda` (sm_80 and sm_90, PTX ISA 7.8) and
//! in a host function JIT-compiled for the processor running the CPU backend. Bodies follow the
//! CPU backend's Rust math (`schedrun::math`) operation for operation, with no fast-math flags and
//! no contraction, so element-wise and optimizer kernels give the same bits as that math.
//!
//! Storage: a pointer's dtype says how values are loaded (widened to f32) and stored (rounded to
//! nearest even, in integer IR, NaN kept quiet). Statistics, master weights and optimizer moments
//! are always fp32 (a 16-bit model's saved statistics possibly as 2-byte halves,
//! [`Kernel::with_halved_stats`]); the loss and gradient-norm sums are f64.
//!
//! Work on a GPU: element kernels are one thread per element. The row kernels (norms, softmax,
//! cross-entropy, rotary positions) give each row a warp: the lanes stride the row, each keeping
//! its own partial sums in the CPU's accumulation pattern, then combine them with a shuffle
//! butterfly (which leaves every lane with the same bits) and lane 0 stores the row's scalars.
//! The column kernels (bias and norm parameter gradients, the embedding's) give each column
//! [`COLUMN_LANES`] lanes that split its rows and add their sums into the column (the embedding:
//! each row into its token's row) atomically, a warp covering 32 neighbouring columns. The host
//! runs all these bodies as one lane ([`Op::cooperative`]), so its order, and with it the CPU
//! backend's bits, is the sequential one; a GPU sums in another order and agrees to rounding,
//! and for the column kernels its order, and so their last bits, may vary from run to run. The
//! loss and gradient-norm sums ([`Op::AddLoss`],
//! [`Op::AddPartials`]) one thread over a micro-batch's rows or a gradient's 4,096-element
//! chunks. Attention: a bf16 model's fused forward and backward are tensor-core kernels,
//! [`Op::FlashForward`], then [`Op::FlashDot`], [`Op::FlashBackwardQuery`] and
//! [`Op::FlashBackwardKeys`] (`mma.sync` fragments, a warp per 16 query rows or keys; GPU-only
//! but for the dot, written after [`flash`]'s lane-by-lane models, whose code the host emulation
//! runs as a warp of threads); everything else of attention (other dtypes and head widths, the
//! naive path) the GPU computes chunk by chunk of queries with cuBLAS products and
//! [`Op::CausalSoftmax`] / [`Op::SoftmaxBackward`] (`sched_ir::abi::attention_chunk`).

#[cfg(feature = "llvm")]
pub mod codegen;
pub mod flash;

use sched_ir::job::{
    ActionKind, Activation, Attention, Dtype, Job, LayerKind, MlpSpec, Model, Norm, Optimizer,
    Positions,
};
use std::fmt;
use std::path::{Path, PathBuf};

/// Threads of a warp: the lanes of a row op's index on the GPU ([`Op::cooperative`]).
pub const WARP: u64 = 32;

/// Indices of an [`Op::unrolled`] op each thread walks per loop iteration, loading all of them
/// before storing any: with a thread per element, a 16-bit element kernel keeps one 2-byte load
/// per thread in flight, too few for the GPU's memory latency. The launch gives such an op a
/// thread per `UNROLL` indices (PyTorch's element kernels take 4 per thread too).
pub const UNROLL: u64 = 4;

/// Indices per block of a [`Op::prefetched`] op's host loop: 8 KiB of fp32 per tensor (the Rust
/// math's `prefetched` takes its blocks from here too).
pub const PREFETCH_BLOCK: u64 = 2048;

/// Lanes of a column op's index on the GPU ([`Op::cooperative`]): each adds up every 64th row.
pub const COLUMN_LANES: u64 = 64;

pub use sched_ir::abi::SUMSQ_CHUNK;

/// Decayed ranges one [`Op::Adam`] launch takes: a transformer block's flat vector has four
/// (GPT-2's weight matrices between its biases and norm gains; LLaMA's merge into two), so a
/// block's whole update is one launch. A shard with more is updated in several.
pub const ADAM_DECAY_RANGES: usize = 4;

/// The names of [`Op::Adam`]'s decayed ranges' bounds, `[from, to)` in the launch's elements.
pub(crate) const ADAM_DECAY_BOUNDS: [[&str; 2]; ADAM_DECAY_RANGES] = [
    ["decay0_from", "decay0_to"],
    ["decay1_from", "decay1_to"],
    ["decay2_from", "decay2_to"],
    ["decay3_from", "decay3_to"],
];

/// How a kernel's index range is read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Space {
    /// One index per element.
    Elements,
    /// One index per row of the op's width.
    Rows,
    /// One index per column: the op walks the rows (`rows` parameter) in order.
    Columns,
    /// One index per chunk of [`SUMSQ_CHUNK`] elements.
    Chunks,
}

/// A kernel parameter's kind.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Param {
    /// A tensor stored in the given dtype (the `i`-th of the kernel's dtypes).
    Tensor(&'static str, Dtype),
    /// A tensor of f32 whatever the model dtype (statistics, master weights, moments, tables).
    F32s(&'static str),
    /// f64 partial sums.
    F64s(&'static str),
    /// u32 token ids.
    Tokens(&'static str),
    /// An f32 scalar.
    F32(&'static str),
    /// An f64 scalar.
    F64(&'static str),
    /// An i64 scalar.
    I64(&'static str),
    /// f32 values at 2-byte-aligned addresses (statistics saved in the arena), each as two u16
    /// halves, the low half first.
    Halves(&'static str),
}

impl Param {
    pub fn name(&self) -> &'static str {
        match *self {
            Param::Tensor(n, _)
            | Param::F32s(n)
            | Param::F64s(n)
            | Param::Tokens(n)
            | Param::F32(n)
            | Param::F64(n)
            | Param::I64(n)
            | Param::Halves(n) => n,
        }
    }

    pub fn is_pointer(&self) -> bool {
        !matches!(self, Param::F32(_) | Param::F64(_) | Param::I64(_))
    }
}

/// A norm's ε as the bits of the fp32 the norm adds, so that [`Op`] stays `Eq` and `Hash`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct NormEps(pub u32);

impl NormEps {
    /// The default ε, 1e-5 (`sched_ir::job::Model::DEFAULT_NORM_EPS`).
    pub const DEFAULT: NormEps = NormEps(0x3727_c5ac);

    /// The ε `model` sets.
    pub fn of(model: &Model) -> NormEps {
        NormEps::new(model.norm_eps())
    }

    pub fn new(eps: f32) -> NormEps {
        NormEps(eps.to_bits())
    }

    pub fn value(self) -> f32 {
        f32::from_bits(self.0)
    }

    /// What a kernel's name adds for it: nothing for the default, else `_eps` and the fp32 bits
    /// in hex (names must stay identifiers).
    fn suffix(self) -> String {
        if self == NormEps::DEFAULT {
            String::new()
        } else {
            format!("_eps{:08x}", self.0)
        }
    }
}

/// An operation before storage dtypes are chosen. Sizes that shape the code are constants.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Op {
    /// `dst[i] = src[i]` converted between dtypes.
    Convert,
    /// `acc[i] += x[i]` (gradient accumulation; `acc` rounded to its dtype).
    Accumulate,
    /// `post[i] = gelu(pre[i])`, tanh approximation.
    Gelu,
    /// `d[i] *= gelu'(pre[i])`.
    GeluBackward,
    /// `prod[i] = gate[i]·σ(gate[i])·up[i]`.
    SwiGlu,
    /// From `dprod` (in `dgate`): `dup = dprod·g·σ(g)`, `dgate = dprod·u·σ(g)·(1 + g(1 − σ(g)))`.
    /// With `cast`, `dgate` is only read and the gate's gradient goes to `cast` instead: a
    /// 16-bit model's two gradients written once in the product dtype, for products alone to
    /// read, rather than in fp32 and then cast (the runtime's `Device::swiglu_backward_cast`).
    SwiGluBackward { cast: bool },
    /// `y[i] += b[i mod width]`.
    BiasAdd { width: u32 },
    /// `db[j] += Σ_rows dy[r, j]`, rows in order; with `cast`, each `dy[r, j]` also stored into
    /// `cast` in its dtype: a 16-bit model's fp32 output gradient cast for the backward
    /// products in the same pass over it that sums it, not a second. With `gelu`, each
    /// `dy[r, j]` is first `dy[r, j]·gelu'(pre[r, j])` ([`Op::GeluBackward`], the same bits),
    /// stored back into `dy` unless cast: the MLP's GELU backward in the pass that sums and
    /// casts its result, instead of a pass of its own over the fp32 gradient.
    BiasGrad { width: u32, cast: bool, gelu: bool },
    /// Layer or RMS norm of each row into `out`, with (mean, 1/σ) per row in `stats`; `eps` is
    /// the model's ε as fp32 bits ([`NormEps`]), baked into the kernel (its name says it when it
    /// is not the default 1e-5).
    Norm {
        norm: Norm,
        width: u32,
        bias: bool,
        eps: NormEps,
    },
    /// A norm's input gradient added to `base` into `dx`, per row: the residual stream's
    /// gradient taken in the same pass (`base` may be `dx`, which then accumulates).
    NormBackwardInput { norm: Norm, width: u32 },
    /// A norm's parameter gradients, accumulated into `dw` (and `db`), per column over the rows.
    NormBackwardParams { width: u32, bias: bool },
    /// Softmax cross-entropy of each row of `vocab` logits, rows `stride` elements apart
    /// (`sched_ir::abi::logits_stride`): `grad = (softmax − onehot)·inv` in the same
    /// layout, `loss[r]` the row's loss.
    CrossEntropy { vocab: u32, stride: u32 },
    /// Rotary positions on the q and k heads of each token row of a fused qkv tensor
    /// (rotate-half pairing); `inverse` turns the other way (for gradients).
    Rotary {
        heads: u32,
        kv_heads: u32,
        head_dim: u32,
        width: u32,
        seq_len: u32,
        inverse: bool,
    },
    /// Adam or AdamW on a flat shard: fp32 master, m and v updated from the gradient times
    /// `grad_scale[0]` (one f32 in memory, [`Op::GradScale`]'s output or a fill, so that a GPU
    /// reads the clipped scale without the host waiting for it). The master is multiplied by
    /// `shrink` (AdamW's decoupled weight decay) inside the launch's [`ADAM_DECAY_RANGES`]
    /// ranges `[decayK_from, decayK_to)` and by 1 outside them (exact, as `optimizer_step`
    /// does), so one launch covers runs of decayed and undecayed elements; unused ranges are
    /// empty, and plain Adam passes none. With `param`, the new master is also stored into
    /// `param`, the model's parameter in its dtype (rounded once), in the same pass; without,
    /// `run_action` stores the state's master into the parameter afterwards, a pass of its own
    /// (where the device cannot write the parameter's region in place).
    Adam { param: bool },
    /// SGD on a flat shard: fp32 master updated from the gradient times `grad_scale[0]`.
    Sgd,
    /// `scale[i] = (min(clip / (√sumsq[i] / contributions + 1e-6), 1) / contributions) as f32`,
    /// in f64 (the host device's gradient scale under clipping, from the stored sum of squares).
    GradScale,
    /// `partial[c] = Σ x²` in f64 over chunk `c` of [`SUMSQ_CHUNK`] elements, in order.
    SumSquares,
    /// Strided block copy of raw elements (both tensors of one dtype): element `i` of block `i / block` moves from `src[b·src_stride + i mod
    /// block]` to `dst[b·dst_stride + i mod block]` (bucket pack/unpack, the hierarchical
    /// all-gather's rearrange).
    Gather2d,
    /// `x[i] = value`, rounded to `x`'s dtype.
    Fill,
    /// `x[i]` rounded to `to` and widened back, in place (`Precision::round`: an fp32 value
    /// given a 16-bit dtype's precision; NaN kept as it is).
    Round { to: Dtype },
    /// `acc[i] += Σ_r loss[i·n + r]` in f64, rows in order from −0.0 (the host device's loss
    /// sum of a micro-batch's per-row losses, added to the step's loss).
    AddLoss,
    /// `acc[i] += Σ_c partial[i·n + c]` in f64, in order from −0.0 (the gradient norm's sum of
    /// squares over [`Op::SumSquares`]' chunks).
    AddPartials,
    /// `dst[i] = acc[i]` from f64, rounded to f32 and then to `dst`'s dtype (the loss and the
    /// gradient norm's sum of squares, as the host's `total as f32` then the arena's write).
    StoreDouble,
    /// `dst[i] = src[i]` from an f32 stored as two 2-byte halves ([`Param::Halves`]).
    LoadHalves,
    /// `dst[i] = src[i]` into an f32 stored as two 2-byte halves ([`Param::Halves`]).
    StoreHalves,
    /// Element `i` of token row `r` (column `c`): `out[r, c] = wte[token_r, c]`, plus
    /// `wpe[r mod seq_len, c]` with learned `positions`. A token outside the vocabulary gives NaN.
    Embedding {
        vocab: u32,
        width: u32,
        seq_len: u32,
        positions: bool,
    },
    /// Column `c`: for each token row `r` in order, `dwte[token_r, c] += dy[r, c]` and (with
    /// `positions`) `dwpe[r mod seq_len, c] += dy[r, c]`: the host's order, with no atomics. A token
    /// outside the vocabulary adds nothing to `dwte`.
    EmbeddingBackward {
        vocab: u32,
        width: u32,
        seq_len: u32,
        positions: bool,
    },
    /// The causal softmax of score row `r` of a chunk of query rows (`per_head` rows of each
    /// head, head-major; row `r` is query `i = first + r mod per_head`, its `keys` scores
    /// `keys` apart): `probs[r, j] = exp(scores[r, j] − lse)` for `j ≤ i`, 0 after, rounded to
    /// `probs`' dtype, and `lse[r]` the row's log-sum-exp (the max, eight-lane `sum_exp` and
    /// `ln` of `attention::forward`). Attention's probabilities, whole (the naive path: one
    /// sequence's heads, `first` 0, `per_head` = `keys` = seq_len) or by chunk of queries (the
    /// fused path on a GPU, which keeps only `lse`).
    CausalSoftmax,
    /// The softmax backward of row `r` (`keys` wide): `ds = p·(dp − Σ_j p·dp)·scale`, rounded
    /// to `ds`' dtype. `ds` may be `dp` or `p` (each lane reads an element before it writes it,
    /// after the row's sum).
    SoftmaxBackward,
    /// The fused causal attention forward of a bf16 `qkv` (token rows of
    /// [`flash::Shape::width`]) on tensor cores, index `w` a warp taking [`flash::QROWS`] query
    /// rows of one head of one sequence ([`flash::place`]): `out` (token rows of
    /// `heads·head_dim`) and each row's natural log-sum-exp `lse` (`[seq][head][row]`). The GPU
    /// only ([`Op::gpu_only`]): [`flash::warp`] is what a warp computes, and what the host
    /// emulation runs instead.
    FlashForward(flash::Shape),
    /// Row `r` (token `r / heads`, head `r mod heads`) of the fused backward's
    /// `dot = Σ_c dO·O` over the head's columns, in column order, into `dot[seq][head][row]`
    /// (FlashAttention-2's D; a warp per row on the GPU).
    FlashDot(flash::Shape),
    /// The fused backward's query side ([`flash::warp_dq`], GPU only): each warp's 16 query
    /// rows' dQ, from bf16 `qkv` and `dout`, the rows' `lse` and `dot`, into fp32 `dqkv`.
    FlashBackwardQuery(flash::Shape),
    /// The fused backward's key side ([`flash::warp_dkv`], GPU only): each warp's 16 keys' dK
    /// and dV over the query heads of their group, into fp32 `dqkv`.
    FlashBackwardKeys(flash::Shape),
}

impl Op {
    pub fn space(&self) -> Space {
        match self {
            Op::Norm { .. }
            | Op::NormBackwardInput { .. }
            | Op::CrossEntropy { .. }
            | Op::Rotary { .. }
            | Op::CausalSoftmax
            | Op::SoftmaxBackward
            | Op::FlashForward(_)
            | Op::FlashDot(_)
            | Op::FlashBackwardQuery(_)
            | Op::FlashBackwardKeys(_) => Space::Rows,
            Op::BiasGrad { .. } | Op::NormBackwardParams { .. } | Op::EmbeddingBackward { .. } => {
                Space::Columns
            }
            Op::SumSquares => Space::Chunks,
            _ => Space::Elements,
        }
    }

    /// Whether several GPU threads (lanes) share each index: every row and column op. A row's
    /// lanes are a warp: they stride the row, reduce with shuffles and store the row's scalars
    /// from lane 0. A column's [`COLUMN_LANES`] lanes split its rows and add their partial sums
    /// into the column atomically; the 32 threads of a warp are 32 neighbouring columns at one
    /// lane, so that their loads are coalesced. The host runs such a body as one lane, in the
    /// CPU's order.
    pub fn cooperative(&self) -> bool {
        self.lanes_on_gpu() > 1
    }

    /// Whether each thread walks [`UNROLL`] indices at a time, loading all of them before
    /// storing any: the element ops whose index `i` reads and writes only element `i` of each
    /// tensor it writes (besides reading a shared bias row), so that the order changes no value
    /// (the plan gives distinct tensors disjoint or identical memory), and which load one or two
    /// values per index. The optimizer's kernels, which are also independent, already issue
    /// five loads per index; four indices' worth would take ~110 registers a thread (ptxas) and
    /// cut the threads resident per multiprocessor by more than the loads it adds.
    pub fn unrolled(&self) -> bool {
        matches!(
            self,
            Op::Convert
                | Op::Round { .. }
                | Op::Accumulate
                | Op::Gelu
                | Op::GeluBackward
                | Op::SwiGlu
                | Op::SwiGluBackward { .. }
                | Op::BiasAdd { .. }
        )
    }

    /// Whether the host walks the op in blocks of [`PREFETCH_BLOCK`] indices, hinting the next
    /// block's cache lines of every tensor first, as the Rust math's `math::ops::prefetched`
    /// runs the same kernel: GELU's backward, whose long dependency chain per vector keeps too
    /// few loads in flight for the hardware prefetcher (see that function for the measurements,
    /// and for the kernels it made slower). Only a hint: the same bits. The GPU's loops are
    /// unchanged.
    pub fn prefetched(&self) -> bool {
        matches!(self, Op::GeluBackward)
    }

    /// Threads per index on the GPU: [`WARP`] for a row op, [`COLUMN_LANES`] for a column op, 1
    /// otherwise.
    pub fn lanes_on_gpu(&self) -> u64 {
        match self.space() {
            Space::Rows => WARP,
            Space::Columns => COLUMN_LANES,
            Space::Elements | Space::Chunks => 1,
        }
    }

    /// Whether the op exists only as PTX: its body uses warp-wide matrix instructions, which a
    /// host module cannot run (the fused attention's forward and two backward sides; host
    /// modules leave them out, a warp build runs them).
    pub fn gpu_only(&self) -> bool {
        matches!(
            self,
            Op::FlashForward(_) | Op::FlashBackwardQuery(_) | Op::FlashBackwardKeys(_)
        )
    }

    /// The shape of a fused attention op.
    pub fn flash_shape(&self) -> Option<flash::Shape> {
        match *self {
            Op::FlashForward(s)
            | Op::FlashDot(s)
            | Op::FlashBackwardQuery(s)
            | Op::FlashBackwardKeys(s) => Some(s),
            _ => None,
        }
    }

    /// How many storage dtypes the op takes (its [`Param::Tensor`]s, in order).
    pub fn tensors(&self) -> usize {
        self.params_with(&[Dtype::Fp32; 8])
            .iter()
            .filter(|p| matches!(p, Param::Tensor(..)))
            .count()
    }

    /// The op's fp32 statistics parameter that a 16-bit model keeps inside a layer's saved
    /// region (norm statistics), where it may lie at a 2-byte offset: a
    /// kernel then takes it as [`Param::Halves`] ([`Kernel::with_halved_stats`]).
    pub fn saved_stats(&self) -> Option<&'static str> {
        match self {
            Op::Norm { .. } | Op::NormBackwardInput { .. } | Op::NormBackwardParams { .. } => {
                Some("stats")
            }
            _ => None,
        }
    }

    fn params_with(&self, d: &[Dtype]) -> Vec<Param> {
        use Param::*;
        match *self {
            Op::Convert => vec![Tensor("src", d[0]), Tensor("dst", d[1])],
            Op::Accumulate => vec![Tensor("x", d[0]), Tensor("acc", d[1])],
            Op::Gelu => vec![Tensor("pre", d[0]), Tensor("post", d[1])],
            Op::GeluBackward => vec![Tensor("d", d[0]), Tensor("pre", d[1])],
            Op::SwiGlu => vec![
                Tensor("gate", d[0]),
                Tensor("up", d[1]),
                Tensor("prod", d[2]),
            ],
            Op::SwiGluBackward { cast } => [
                Tensor("dgate", d[0]),
                Tensor("dup", d[1]),
                Tensor("gate", d[2]),
                Tensor("up", d[3]),
            ]
            .into_iter()
            .chain(cast.then(|| Tensor("cast", d[4])))
            .collect(),
            Op::BiasAdd { .. } => vec![Tensor("y", d[0]), Tensor("b", d[1])],
            Op::BiasGrad { cast, gelu, .. } => {
                let mut v = vec![Tensor("dy", d[0]), Tensor("db", d[1])];
                if cast {
                    v.push(Tensor("cast", d[2]));
                }
                if gelu {
                    v.push(Tensor("pre", d[v.len()]));
                }
                v.push(I64("rows"));
                v
            }
            Op::Norm { bias, .. } => {
                let mut v = vec![Tensor("x", d[0]), Tensor("w", d[1])];
                if bias {
                    v.push(Tensor("b", d[2]));
                }
                v.push(Tensor("out", d[if bias { 3 } else { 2 }]));
                v.push(F32s("stats"));
                v
            }
            Op::NormBackwardInput { .. } => vec![
                Tensor("x", d[0]),
                Tensor("w", d[1]),
                F32s("stats"),
                Tensor("dy", d[2]),
                Tensor("base", d[3]),
                Tensor("dx", d[4]),
            ],
            Op::NormBackwardParams { bias, .. } => {
                let mut v = vec![
                    Tensor("x", d[0]),
                    F32s("stats"),
                    Tensor("dy", d[1]),
                    Tensor("dw", d[2]),
                ];
                if bias {
                    v.push(Tensor("db", d[3]));
                }
                v.push(I64("rows"));
                v
            }
            Op::CrossEntropy { .. } => vec![
                Tensor("logits", d[0]),
                Tokens("targets"),
                Tensor("grad", d[1]),
                F32s("loss"),
                F32("inv"),
            ],
            Op::Rotary { .. } => vec![Tensor("qkv", d[0]), F32s("cos"), F32s("sin")],
            Op::Adam { param } => [F32s("master"), F32s("m"), F32s("v"), Tensor("grad", d[0])]
                .into_iter()
                .chain(param.then(|| Tensor("param", d[1])))
                .chain([
                    F32s("grad_scale"),
                    F32("beta1"),
                    F32("one_minus_beta1"),
                    F32("beta2"),
                    F32("one_minus_beta2"),
                    F32("eps"),
                    F32("step_size"),
                    F32("bc2_sqrt"),
                    F32("shrink"),
                ])
                .chain(ADAM_DECAY_BOUNDS.iter().flatten().map(|&b| I64(b)))
                .collect(),
            Op::Sgd => vec![
                F32s("master"),
                Tensor("grad", d[0]),
                F32s("grad_scale"),
                F32("lr"),
            ],
            Op::GradScale => vec![
                Tensor("sumsq", d[0]),
                F32s("scale"),
                F64("contributions"),
                F64("clip"),
            ],
            Op::SumSquares => vec![Tensor("x", d[0]), F64s("partial"), I64("n")],
            Op::Gather2d => vec![
                Tensor("src", d[0]),
                Tensor("dst", d[1]),
                I64("block"),
                I64("src_stride"),
                I64("dst_stride"),
            ],
            Op::Fill => vec![Tensor("x", d[0]), F32("value")],
            Op::Round { .. } => vec![Tensor("x", d[0])],
            Op::AddLoss => vec![F32s("loss"), F64s("acc"), I64("n")],
            Op::AddPartials => vec![F64s("partial"), F64s("acc"), I64("n")],
            Op::StoreDouble => vec![F64s("acc"), Tensor("dst", d[0])],
            Op::LoadHalves => vec![Halves("src"), F32s("dst")],
            Op::StoreHalves => vec![F32s("src"), Halves("dst")],
            Op::Embedding { positions, .. } => {
                let mut v = vec![Tokens("tokens"), Tensor("wte", d[0])];
                if positions {
                    v.push(Tensor("wpe", d[1]));
                }
                v.push(Tensor("out", d[if positions { 2 } else { 1 }]));
                v
            }
            Op::EmbeddingBackward { positions, .. } => {
                let mut v = vec![Tokens("tokens"), Tensor("dy", d[0]), Tensor("dwte", d[1])];
                if positions {
                    v.push(Tensor("dwpe", d[2]));
                }
                v.push(I64("rows"));
                v
            }
            Op::CausalSoftmax => vec![
                Tensor("scores", d[0]),
                Tensor("probs", d[1]),
                F32s("lse"),
                I64("keys"),
                I64("first"),
                I64("per_head"),
            ],
            Op::SoftmaxBackward => vec![
                Tensor("p", d[0]),
                Tensor("dp", d[1]),
                Tensor("ds", d[2]),
                F32("scale"),
                I64("keys"),
            ],
            Op::FlashForward(_) => vec![Tensor("qkv", d[0]), Tensor("out", d[1]), F32s("lse")],
            Op::FlashDot(_) => vec![Tensor("dout", d[0]), Tensor("out", d[1]), F32s("dot")],
            Op::FlashBackwardQuery(_) | Op::FlashBackwardKeys(_) => vec![
                Tensor("qkv", d[0]),
                Tensor("dout", d[1]),
                F32s("lse"),
                F32s("dot"),
                Tensor("dqkv", d[2]),
            ],
        }
    }

    fn stem(&self) -> String {
        let nb = |b: bool| if b { "_bias" } else { "" };
        let norm = |n: Norm| match n {
            Norm::LayerNorm => "layernorm",
            Norm::RmsNorm => "rmsnorm",
        };
        match *self {
            Op::Convert => "convert".into(),
            Op::Accumulate => "accumulate".into(),
            Op::Gelu => "gelu".into(),
            Op::GeluBackward => "gelu_backward".into(),
            Op::SwiGlu => "swiglu".into(),
            Op::SwiGluBackward { cast } => {
                format!("swiglu_backward{}", if cast { "_cast" } else { "" })
            }
            Op::BiasAdd { width } => format!("bias_add_w{width}"),
            Op::BiasGrad { width, cast, gelu } => {
                let gelu = if gelu { "_gelu" } else { "" };
                format!(
                    "bias_grad{gelu}{}_w{width}",
                    if cast { "_cast" } else { "" }
                )
            }
            Op::Norm {
                norm: n,
                width,
                bias,
                eps,
            } => format!("{}{}_w{width}{}", norm(n), nb(bias), eps.suffix()),
            Op::NormBackwardInput { norm: n, width } => {
                format!("{}_backward_input_w{width}", norm(n))
            }
            Op::NormBackwardParams { width, bias } => {
                format!("norm_backward_params{}_w{width}", nb(bias))
            }
            Op::CrossEntropy { vocab, stride } if stride == vocab => {
                format!("cross_entropy_v{vocab}")
            }
            Op::CrossEntropy { vocab, stride } => format!("cross_entropy_v{vocab}_ld{stride}"),
            Op::Rotary {
                heads,
                kv_heads,
                head_dim,
                width,
                seq_len,
                inverse,
            } => format!(
                "rotary{}_h{heads}_kv{kv_heads}_d{head_dim}_w{width}_s{seq_len}",
                if inverse { "_inverse" } else { "" }
            ),
            Op::Adam { param } => format!("adam{}", if param { "_param" } else { "" }),
            Op::Sgd => "sgd".into(),
            Op::GradScale => "grad_scale".into(),
            Op::Round { to } => format!("round_to_{}", to.name()),
            Op::AddLoss => "add_loss".into(),
            Op::AddPartials => "add_partials".into(),
            Op::SumSquares => "sum_squares".into(),
            Op::Gather2d => "gather2d".into(),
            Op::Fill => "fill".into(),
            Op::StoreDouble => "store_double".into(),
            Op::LoadHalves => "load_halves".into(),
            Op::StoreHalves => "store_halves".into(),
            Op::Embedding {
                vocab,
                width,
                seq_len,
                positions,
            } => format!(
                "embedding{}_v{vocab}_w{width}_s{seq_len}",
                if positions { "_positions" } else { "" }
            ),
            Op::EmbeddingBackward {
                vocab,
                width,
                seq_len,
                positions,
            } => format!(
                "embedding_backward{}_v{vocab}_w{width}_s{seq_len}",
                if positions { "_positions" } else { "" }
            ),
            Op::CausalSoftmax => "causal_softmax".into(),
            Op::SoftmaxBackward => "softmax_backward".into(),
            Op::FlashForward(s) => format!("flash_forward{}", s.suffix()),
            Op::FlashDot(s) => format!("flash_dot{}", s.suffix()),
            Op::FlashBackwardQuery(s) => format!("flash_backward_query{}", s.suffix()),
            Op::FlashBackwardKeys(s) => format!("flash_backward_keys{}", s.suffix()),
        }
    }
}

/// One generated kernel: an op with a storage dtype for each of its tensors and, for an op with
/// saved statistics ([`Op::saved_stats`]), whether they are stored as 2-byte halves.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Kernel {
    pub op: Op,
    pub dtypes: Vec<Dtype>,
    /// The saved statistics are [`Param::Halves`] rather than [`Param::F32s`].
    pub halves: bool,
}

impl Kernel {
    /// `op` with `dtypes` (one per tensor parameter).
    ///
    /// # Panics
    /// When the number of dtypes is not the op's number of tensors (a caller's bug).
    pub fn new(op: Op, dtypes: &[Dtype]) -> Self {
        assert_eq!(dtypes.len(), op.tensors(), "dtypes of {op:?}");
        Kernel {
            op,
            dtypes: dtypes.to_vec(),
            halves: false,
        }
    }

    /// The same kernel taking its saved statistics as fp32 in 2-byte halves (a 16-bit model's
    /// statistics at a 2-byte offset of its saved region).
    ///
    /// # Panics
    /// When the op has no saved statistics (a caller's bug).
    pub fn with_halved_stats(self) -> Self {
        assert!(
            self.op.saved_stats().is_some(),
            "{:?} saves no statistics",
            self.op
        );
        Kernel {
            halves: true,
            ..self
        }
    }

    /// The symbol both targets export: the op, its constants, its dtypes and `_halves` for
    /// halved statistics.
    pub fn name(&self) -> String {
        let mut s = self.op.stem();
        for d in &self.dtypes {
            s.push('_');
            s.push_str(d.name());
        }
        if self.halves {
            s.push_str("_halves");
        }
        s
    }

    /// The kernel's parameters, before the trailing `begin` and `end`.
    pub fn params(&self) -> Vec<Param> {
        let mut params = self.op.params_with(&self.dtypes);
        if self.halves {
            let stats = self.op.saved_stats();
            for p in &mut params {
                if let Param::F32s(n) = *p {
                    if Some(n) == stats {
                        *p = Param::Halves(n);
                    }
                }
            }
        }
        params
    }
}

impl fmt::Display for Kernel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.name())
    }
}

/// Where `schedc compile --emit ptx` writes the `sm_{sm}` module of the plan file `plan`, and
/// where the CUDA backend looks for it: beside the plan, named after it (`x.plan.json` gives
/// `x.sm_90.ptx`; a `.json` suffix is dropped likewise, any other name kept whole).
pub fn ptx_path(plan: &Path, sm: u32) -> PathBuf {
    let name = plan
        .file_name()
        .map(|n| n.to_string_lossy().to_string())
        .unwrap_or_default();
    let stem = name
        .strip_suffix(".plan.json")
        .or_else(|| name.strip_suffix(".json"))
        .unwrap_or(&name);
    plan.with_file_name(format!("{stem}.sm_{sm}.ptx"))
}

/// Every kernel a job's step needs on a GPU, without duplicates, in a fixed order: each typed
/// variant the CUDA backend's device code (`schedrun`'s `backend/cuda/gpu.rs`, under the
/// device layer's `run_action` and layer math) may launch for the job, which is what
/// `schedc compile --emit ptx` writes and what the backend checks the module for. Per layer
/// its embedding, norm, activation, rotary, attention and bias kernels, then the loss, the
/// optimizer, the gradient norm, the conversions and roundings, and the fills.
pub fn for_job(job: &Job) -> Vec<Kernel> {
    let split = (job.schedule.pipeline.order.iter().flatten()).any(|a| a.kind == ActionKind::W);
    for_model_with(&job.model, split, job.schedule.tensor.size)
}

/// [`for_job`] of any job of `model` whose pipeline order has no split backward (the kernels
/// depend on the model alone, and on whether it runs a pipeline's `I` and `W`:
/// [`for_split_model`]).
pub fn for_model(model: &Model) -> Vec<Kernel> {
    for_model_with(model, false, 1)
}

/// [`for_job`] of any job of `model` whose pipeline order splits backwards into `I` and `W`:
/// [`for_model`]'s and the weight halves' bias gradients of fp32 stashed gradients (a GELU
/// product's, whose whole backward takes GELU's backward in that pass).
pub fn for_split_model(model: &Model) -> Vec<Kernel> {
    for_model_with(model, true, 1)
}

/// The attention heads one rank computes of a transformer: all of them, or its tensor slice's.
#[derive(Clone, Copy, Debug)]
struct Heads {
    heads: u32,
    kv_heads: u32,
    head_dim: u32,
}

impl Heads {
    /// The packed q/k/v width.
    fn width(self) -> u32 {
        (self.heads + 2 * self.kv_heads) * self.head_dim
    }
}

/// [`for_job`] of `model`, with `split` the kernels of a pipeline's split backward.
///
/// The dtypes follow where the device code keeps each tensor: parameters, layer inputs and
/// outputs, saved activations and activation gradients in the arena in the model dtype `a`;
/// parameter gradients in the arena in the gradient dtype `g`; the layer math's intermediates,
/// a layer's parameter gradient before it is written into its parts, and small per-op results
/// in fp32 workspace. A layer's output, saved activations or input gradient, or the loss's
/// gradient, is computed in workspace instead where it shares bytes with another region of its
/// op (the memory plan decides), so their kernels come in both places. A 16-bit model's fp32
/// statistics inside its saved region may lie at a 2-byte offset: its norm and fused attention
/// kernels also come with halved statistics ([`Kernel::with_halved_stats`]). With tensor
/// parallelism of degree `tensor`, a split layer's attention and MLP kernels are those of its
/// slice (heads/t and kv_heads/t heads of the full head width, ffn/t; `sched_ir::tensor`).
fn for_model_with(model: &Model, split: bool, tensor: u32) -> Vec<Kernel> {
    let (a, g, f) = (model.dtype, model.grad_dtype, Dtype::Fp32);
    let mut k = Catalogue {
        a,
        f,
        split,
        out: if a == f { vec![f] } else { vec![a, f] },
        list: vec![],
        eps: NormEps::of(model),
    };
    let rope = model.layers.iter().any(|l| {
        matches!(
            l.kind,
            LayerKind::Embedding {
                positions: Positions::Rope,
                ..
            }
        )
    });
    for layer in &model.layers {
        // The layer's tensor-parallel degree: its slice's shapes when the lowering splits it.
        let tp = match sched_ir::tensor::split_layers(&layer.kind, tensor) {
            true => u64::from(tensor),
            false => 1,
        };
        match layer.kind {
            LayerKind::Transformer(t) => {
                let h = t.hidden as u32;
                // ln1 reads the layer input; ln2 the saved residual, where its output goes.
                k.norm(t.norm, h, false);
                k.norm(t.norm, h, true);
                // ln2's input gradient added to the layer's output gradient into fp32
                // workspace; ln1's added to that into the layer's input gradient.
                let out = k.out.clone();
                let pairs: Vec<(Dtype, Dtype)> = (out.iter().map(|&o| (o, f)))
                    .chain(out.iter().map(|&o| (f, o)))
                    .collect();
                k.norm_input_grad(t.norm, h, &pairs);
                k.mlp(MlpSpec {
                    ffn: t.ffn / tp,
                    ..t.mlp()
                });
                let heads = Heads {
                    heads: (t.heads / tp) as u32,
                    kv_heads: (t.kv_heads / tp) as u32,
                    head_dim: t.head_dim() as u32,
                };
                let width = heads.width();
                if t.bias {
                    k.add(Kernel::new(Op::BiasAdd { width }, &[f, a]));
                    k.bias_grad(width, f);
                    k.add(Kernel::new(Op::BiasAdd { width: h }, &[f, a]));
                    k.bias_grad(h, f);
                }
                if rope {
                    for inverse in [false, true] {
                        let op = Op::Rotary {
                            heads: heads.heads,
                            kv_heads: heads.kv_heads,
                            head_dim: heads.head_dim,
                            width,
                            seq_len: model.seq_len as u32,
                            inverse,
                        };
                        k.add(Kernel::new(op, &[f]));
                    }
                }
                k.attention(t.attention, heads, model.seq_len as u32);
            }
            LayerKind::Mlp(m) => {
                k.norm(m.norm, m.hidden as u32, false);
                // From the layer's output gradient into its input gradient.
                let out = k.out.clone();
                let pairs: Vec<(Dtype, Dtype)> = out
                    .iter()
                    .flat_map(|&dy| out.iter().map(move |&dx| (dy, dx)))
                    .collect();
                k.norm_input_grad(m.norm, m.hidden as u32, &pairs);
                k.mlp(MlpSpec {
                    ffn: m.ffn / tp,
                    ..m
                });
            }
            LayerKind::LmHead {
                vocab,
                hidden,
                norm,
                ..
            } => {
                k.norm(norm, hidden as u32, false);
                // Added in place to the zeroed input gradient.
                let pairs: Vec<(Dtype, Dtype)> = k.out.iter().map(|&dx| (dx, dx)).collect();
                k.norm_input_grad(norm, hidden as u32, &pairs);
                let stride = sched_ir::abi::logits_stride(vocab) as u32;
                let vocab = vocab as u32;
                for o in k.out.clone() {
                    // The input gradient starts as zeros, then the norm's backward adds to it.
                    k.add(Kernel::new(Op::Fill, &[o]));
                    k.add(Kernel::new(Op::CrossEntropy { vocab, stride }, &[a, o]));
                }
            }
            LayerKind::Embedding {
                vocab,
                hidden,
                positions,
            } => {
                let (vocab, width) = (vocab as u32, hidden as u32);
                let (seq_len, positions) = (model.seq_len as u32, positions == Positions::Learned);
                let tables = if positions { 2 } else { 1 };
                let op = Op::Embedding {
                    vocab,
                    width,
                    seq_len,
                    positions,
                };
                for o in k.out.clone() {
                    let mut d = vec![a; tables];
                    d.push(o);
                    k.add(Kernel::new(op, &d));
                }
                let op = Op::EmbeddingBackward {
                    vocab,
                    width,
                    seq_len,
                    positions,
                };
                let mut d = vec![a];
                d.extend(vec![f; tables]);
                k.add(Kernel::new(op, &d));
            }
            LayerKind::Dense { .. } => {}
        }
    }
    // The loss: per-row losses summed into the step's.
    k.add(Kernel::new(Op::AddLoss, &[]));
    // The optimizer: the gradient scale (clipped, or a fill), then the update of the shard.
    k.add(Kernel::new(Op::GradScale, &[f]));
    // Adam's with the parameter written in the same pass where the device can write its
    // region in place, and without.
    match model.optimizer {
        Optimizer::Adam | Optimizer::AdamW => {
            k.add(Kernel::new(Op::Adam { param: false }, &[g]));
            k.add(Kernel::new(Op::Adam { param: true }, &[g, a]));
        }
        Optimizer::Sgd => k.add(Kernel::new(Op::Sgd, &[g])),
    }
    // The gradient norm: chunked sums of squares of the gradients in place, summed, stored.
    k.add(Kernel::new(Op::SumSquares, &[g]));
    k.add(Kernel::new(Op::AddPartials, &[]));
    k.add(Kernel::new(Op::StoreDouble, &[f]));
    // Gradient parts written (added, across micro-steps) from workspace, gradients summed
    // across micro-steps in the arena.
    k.add(Kernel::new(Op::Accumulate, &[f, g]));
    k.add(Kernel::new(Op::Accumulate, &[g, g]));
    // Conversions (fp32 to and from the model dtype: copies between storages, product operand
    // casts, the optimizer's parameter; fp32 into the gradient dtype: gradient parts) and
    // roundings of fp32 workspace to the activation and gradient precisions.
    for (from, to) in [(a, f), (f, a), (f, g)] {
        if from != to {
            k.add(Kernel::new(Op::Convert, &[from, to]));
        }
    }
    for to in [a, g] {
        if to != f {
            k.add(Kernel::new(Op::Round { to }, &[f]));
        }
    }
    // Fills of fp32 workspace, and of padded product operands in the model dtype.
    k.add(Kernel::new(Op::Fill, &[f]));
    k.add(Kernel::new(Op::Fill, &[a]));
    k.list
}

/// The list [`for_model`] builds, with the dtypes its helpers choose from: the model dtype `a`,
/// fp32 `f`, and where outputs may live (`out`: the arena, `a`, and workspace, `f`); `split`
/// for a pipeline's split backward.
struct Catalogue {
    a: Dtype,
    f: Dtype,
    split: bool,
    out: Vec<Dtype>,
    list: Vec<Kernel>,
    eps: NormEps,
}

impl Catalogue {
    fn add(&mut self, k: Kernel) {
        if !self.list.contains(&k) {
            self.list.push(k);
        }
    }

    /// A bias gradient from `dy` stored in `dy`'s dtype; from fp32 gradients of a 16-bit model,
    /// also the kernel that casts them for the products as it sums them.
    fn bias_grad(&mut self, width: u32, dy: Dtype) {
        self.bias_grad_through(width, dy, false);
    }

    /// [`Catalogue::bias_grad`], with `gelu` of fp32 gradients through GELU's backward first
    /// (its input read from the arena).
    fn bias_grad_through(&mut self, width: u32, dy: Dtype, gelu: bool) {
        let (a, f) = (self.a, self.f);
        let pre = if gelu { vec![a] } else { vec![] };
        let op = Op::BiasGrad {
            width,
            cast: false,
            gelu,
        };
        self.add(Kernel::new(op, &[&[dy, f][..], &pre].concat()));
        if dy == f && a != f {
            let op = Op::BiasGrad {
                width,
                cast: true,
                gelu,
            };
            self.add(Kernel::new(op, &[&[f, f, a][..], &pre].concat()));
        }
    }

    /// `k`, and with halved statistics when `saved` (its statistics) is a 16-bit model's saved
    /// region in the arena.
    fn add_stats(&mut self, k: Kernel, saved: Dtype) {
        if saved != self.f {
            self.add(k.clone().with_halved_stats());
        }
        self.add(k);
    }

    /// A norm of `width`: its forward, whose output and statistics are saved (in the arena or
    /// workspace) and whose input is the layer's (in the arena) or, `saved_input`, a saved tensor
    /// beside its output; and its parameter gradient (in workspace, from the saved tensors in
    /// the arena and the fp32 output gradient).
    fn norm(&mut self, norm: Norm, width: u32, saved_input: bool) {
        let (a, f) = (self.a, self.f);
        let bias = norm == Norm::LayerNorm;
        for s in self.out.clone() {
            let mut d = vec![if saved_input { s } else { a }, a];
            if bias {
                d.push(a);
            }
            d.push(s);
            let eps = self.eps;
            let op = Op::Norm {
                norm,
                width,
                bias,
                eps,
            };
            self.add_stats(Kernel::new(op, &d), s);
        }
        let d = if bias {
            vec![a, f, f, f]
        } else {
            vec![a, f, f]
        };
        self.add_stats(Kernel::new(Op::NormBackwardParams { width, bias }, &d), a);
    }

    /// A norm's input gradient, added to `base` into `dx`, for each (base, dx) storage pair.
    fn norm_input_grad(&mut self, norm: Norm, width: u32, pairs: &[(Dtype, Dtype)]) {
        let (a, f) = (self.a, self.f);
        for &(base, dx) in pairs {
            let op = Op::NormBackwardInput { norm, width };
            self.add_stats(Kernel::new(op, &[a, a, f, base, dx]), a);
        }
    }

    /// An MLP's activation forward (on its saved tensors, in the arena or workspace) and
    /// backward (fp32 gradients from the saved tensors in the arena), and its bias kernels: a
    /// bias added to an fp32 product output, a bias gradient from fp32 gradients or, for the
    /// output projection, from the layer's output gradient in the arena.
    fn mlp(&mut self, m: MlpSpec) {
        let (a, f) = (self.a, self.f);
        for s in self.out.clone() {
            match m.act {
                Activation::Gelu => self.add(Kernel::new(Op::Gelu, &[s, s])),
                Activation::SwiGlu => self.add(Kernel::new(Op::SwiGlu, &[s, s, s])),
            }
        }
        match m.act {
            Activation::Gelu => self.add(Kernel::new(Op::GeluBackward, &[f, a])),
            Activation::SwiGlu => {
                self.add(Kernel::new(
                    Op::SwiGluBackward { cast: false },
                    &[f, f, a, a],
                ));
                // Without biases (whose gradients sum the fp32 values), a 16-bit model's
                // gradients for its products alone.
                if !m.bias && a != f {
                    let op = Op::SwiGluBackward { cast: true };
                    self.add(Kernel::new(op, &[f, a, a, a, a]));
                }
            }
        }
        if m.bias {
            for width in [m.ffn as u32, m.hidden as u32] {
                self.add(Kernel::new(Op::BiasAdd { width }, &[f, a]));
            }
            // The first product's bias gradient: of SwiGLU's fp32 gradients, or GELU's taken
            // in the same pass (the runtime's `Device::gelu_linear_backward`).
            self.bias_grad_through(m.ffn as u32, f, m.act == Activation::Gelu);
            if self.split && m.act == Activation::Gelu {
                // A split backward's weight half: of the gradient its input half stashed,
                // through GELU's backward already (fp32, read by the products as it is).
                let op = Op::BiasGrad {
                    width: m.ffn as u32,
                    cast: false,
                    gelu: false,
                };
                self.add(Kernel::new(op, &[f, f]));
            }
            // The output projection's, from fp32 or the arena's output gradient.
            self.bias_grad(m.hidden as u32, f);
            self.bias_grad(m.hidden as u32, a);
        }
    }

    /// A transformer block's attention kernels: the causal softmax of fp32 scores into
    /// probabilities and its backward (on probabilities in the arena or workspace, into fp32
    /// gradients); the score products are GEMMs. The naive path keeps its probabilities (in the
    /// arena or workspace, `out`); the fused path recomputes them chunk by chunk in workspace in
    /// the product dtype, which is the model's. A bf16 model's fused forward with a head width
    /// the tensor cores take ([`flash::supports`]) is one kernel instead, writing the output
    /// where the layer's goes (`out`).
    fn attention(&mut self, attention: Attention, heads: Heads, seq_len: u32) {
        let (a, f) = (self.a, self.f);
        let probs = match attention {
            Attention::Flash => vec![a],
            Attention::Naive => self.out.clone(),
        };
        for p in probs {
            self.add(Kernel::new(Op::CausalSoftmax, &[f, p]));
        }
        // The naive path's score gradient in place (fp32), the fused one's into the
        // probabilities' place in the product dtype.
        self.add(Kernel::new(Op::SoftmaxBackward, &[a, f, f]));
        if attention == Attention::Flash {
            self.add(Kernel::new(Op::SoftmaxBackward, &[a, f, a]));
            if flash::supports(a, heads.head_dim as usize) {
                let sh = flash::Shape {
                    heads: heads.heads as usize,
                    kv_heads: heads.kv_heads as usize,
                    d: heads.head_dim as usize,
                    s: seq_len as usize,
                };
                for o in self.out.clone() {
                    self.add(Kernel::new(Op::FlashForward(sh), &[a, o]));
                }
                if flash::supports_backward(a, sh.d) {
                    // The backward's D from the output gradient (fp32 workspace) and the saved
                    // output, then its two sides into fp32 workspace.
                    for o in self.out.clone() {
                        self.add(Kernel::new(Op::FlashDot(sh), &[f, o]));
                    }
                    self.add(Kernel::new(Op::FlashBackwardQuery(sh), &[a, a, f]));
                    self.add(Kernel::new(Op::FlashBackwardKeys(sh), &[a, a, f]));
                }
            }
        }
    }
}

#[cfg(test)]
#[path = "../tests/unit/norm_eps.rs"]
mod norm_eps_tests;
