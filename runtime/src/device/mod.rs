//! The device layer: one interpreter of a plan's compute ops and one layer math for every
//! backend, over the primitives a machine provides.
//!
//! A [`Device`] is one stream of one rank. Its primitives are what a GPU library or a CPU kernel
//! does in one call: move a region of the rank's arena into f32 workspace and back (in the
//! region's dtype), matrix products with a bias epilogue, norms, activations, rotary positions,
//! causal attention, the embedding, the loss, the optimizer update over a flat shard, the gradient
//! norm's sum of squares, byte copies. Values are addressed by [`Device::Ptr`], a start that
//! pieces are cut off (the saved-tensor layout of [`crate::math::saved`] is defined over it).
//! Where a device computes on the arena in place ([`Device::view`], [`Device::view_saved`]),
//! `run_action` stages nothing: the host does so for fp32 regions (its pointers are f32), the
//! GPU for regions of every dtype (its pointers carry their storage, and each kernel reads and
//! writes that storage, rounding once where it stores). Workspace from [`Device::alloc`] is
//! always f32. A few primitives are two steps that a device may fuse into one pass, with a
//! provided default that takes them one after the other: GELU's backward with the next
//! product's bias gradient ([`Device::gelu_linear_backward`]), SwiGLU's backward straight into
//! the products' storage ([`Device::swiglu_backward_cast`]), the parameter stored by the
//! optimizer's pass ([`Device::update`]). A pipeline's split backward takes each half of a
//! product's or a norm's backward alone ([`Device::linear_backward_input_rows`],
//! [`Device::norm_backward_input`]; the parameter halves are the backwards without `dx`).
//! Everything above the primitives is written once and
//! generic:
//! [`layers`] is each layer kind's forward and backward (where rounding to the activation and
//! gradient dtypes happens, which tensors are kept), [`action`] is `run_action`, one plan op on
//! one rank (reading parameters, writing gradient parts, saved activations, the optimizer step).
//!
//! The CPU backend implements the primitives with [`host::Host`] on host memory, and every
//! result is the same bits as the math in [`crate::math`]; the CUDA backend implements them with
//! kernel launches and cuBLAS (`backend::cuda::gpu`). A primitive's outputs never overlap its
//! inputs unless its documentation says it works in place; workspace from [`Device::alloc`] lives
//! until [`Device::reset`], which the caller runs after every op.

pub mod action;
mod args;
pub mod host;
#[cfg(feature = "llvm")]
pub mod jit;
mod kernels;
pub(crate) mod layers;
mod slices;
mod tensor;

use crate::math::attention::Keep;
use crate::math::saved::Piece;
use crate::math::{BlockP, NormP, OptimizerConfig, Precision, Segment};
use sched_ir::job::Dtype;
use sched_kernels::ADAM_DECAY_RANGES;
use std::ops::Range;

/// A run of values on a device, by its first element: f32 on the host; on a GPU a typed
/// pointer (its storage: fp32, bf16, fp16) that primitives read and write in that storage.
pub(crate) trait Ptr: Piece + Copy + PartialEq {
    /// The element `n` elements further on.
    fn offset(self, n: usize) -> Self;

    /// The start of `r` within the run.
    fn at(self, r: &Range<usize>) -> Self {
        self.offset(r.start)
    }
}

/// The operands of a linear layer's product over `t` token rows (PyTorch's `Linear`): the input
/// x [t, inp] and the weight w [out, inp], each in contiguous rows.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Linear<P> {
    pub x: P,
    pub w: P,
    pub t: usize,
    pub inp: usize,
    pub out: usize,
}

impl<P: Ptr> Linear<P> {
    /// The product's output columns `c0..c0 + n` (W's rows from `c0`).
    pub fn columns(self, c0: usize, n: usize) -> Self {
        Linear {
            w: self.w.offset(c0 * self.inp),
            out: n,
            ..self
        }
    }
}

/// A norm's operands over `t` rows of width `h`: its parameters (`np`'s ranges of the layer's
/// flat vector at `params`), the input rows `x` and the per-row statistics `stats` (two floats a
/// row: written by the forward, read by the backward).
#[derive(Clone, Copy, Debug)]
pub(crate) struct NormOperands<'a, P> {
    pub np: &'a NormP,
    pub params: P,
    pub t: usize,
    pub h: usize,
    pub x: P,
    pub stats: P,
}

/// An embedding lookup: `t` token ids below `vocab`, rows of width `h`, and positions = token
/// index mod `s` (the sequence length).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Lookup<T> {
    pub tokens: T,
    pub vocab: usize,
    pub h: usize,
    pub s: usize,
    pub t: usize,
}

/// The logits of `rows` tokens: `vocab` values a row, rows `stride` elements apart from `z`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Logits<P> {
    pub z: P,
    pub vocab: usize,
    pub stride: usize,
    pub rows: usize,
}

/// Why a primitive or an op failed on a device.
#[derive(Clone, Debug, thiserror::Error)]
pub enum DeviceError {
    /// An arena access outside the arena or misaligned for its dtype.
    #[error("{0}")]
    Access(String),
    /// An op reads or writes more values than its region holds.
    #[error("{verb} {values} values {prep} a region of {region}", verb = if *write { "writes" } else { "reads" }, prep = if *write { "into" } else { "from" })]
    RegionSize {
        values: usize,
        region: usize,
        write: bool,
    },
    /// The stream's workspace cannot hold what an op needs.
    #[error(
        "the op needs {needed} floats of its stream's workspace, but the plan gives the stream \
         {available} (the compiler sizes workspaces, `schedc::lower::workspace`: this op needs \
         more than it planned)"
    )]
    Workspace { needed: usize, available: usize },
    /// A token id (input or target) outside the vocabulary.
    #[error("token {token} not below vocab {vocab}")]
    Token { token: u32, vocab: usize },
    /// The plan asks for something the model or the step cannot give (a layer input of the
    /// wrong kind, a missing micro-batch, a tied head without its embedding, …).
    #[error("{0}")]
    Plan(String),
    /// A generated kernel could not be compiled or run (the host's, with the `llvm` feature), or
    /// a launch's arguments do not fit its parameters.
    #[error("generated kernel: {0}")]
    Kernel(String),
    /// A library below the device layer refused a launch, product or copy (the GPU's driver,
    /// cuBLAS, NCCL; the host's JIT-compiled kernels): its own error, opaque to the device layer,
    /// named by `backend` in the message.
    #[error("{backend}: {source}")]
    Backend {
        backend: &'static str,
        source: std::sync::Arc<dyn std::error::Error + Send + Sync>,
    },
}

impl DeviceError {
    /// `source`, an error of the backend named `backend` (for messages: `GPU`).
    pub fn backend(
        backend: &'static str,
        source: impl std::error::Error + Send + Sync + 'static,
    ) -> Self {
        DeviceError::Backend {
            backend,
            source: std::sync::Arc::new(source),
        }
    }
}

impl From<crate::arena::AccessError> for DeviceError {
    fn from(e: crate::arena::AccessError) -> Self {
        DeviceError::Access(e.0)
    }
}

/// A plan error from a message.
pub(crate) fn plan_error(m: impl Into<String>) -> DeviceError {
    DeviceError::Plan(m.into())
}

/// Where one gradient-norm input lies: `elements` values of `dtype` at byte `at` of the arena.
#[derive(Clone, Copy, Debug)]
pub struct ArenaSpan {
    pub at: u64,
    pub dtype: Dtype,
    pub elements: usize,
}

/// One optimizer update of a layer's flat shard (`runtime.md`, "Optimizer"): `state` is
/// `[master | m | v]` (Adam/AdamW) or `[master]` (SGD) over `n` elements starting at element
/// `first` of the layer's flat vector; the gradient is the sum of `contributions` micro-batch
/// gradients, clipped by the global norm when `clip` gives the sum of squares and the limit.
pub struct Update<'a> {
    pub cfg: &'a OptimizerConfig,
    /// 1-based step (Adam's bias correction).
    pub step: u64,
    pub n: usize,
    pub first: usize,
    /// The flat-vector ranges weight decay applies to.
    pub decay: &'a [Range<usize>],
    /// The global sum of squares (one value at this arena span) and the norm limit.
    pub clip: Option<(ArenaSpan, f64)>,
    pub contributions: f64,
}

impl Update<'_> {
    /// Adam's scalars for this step ([`crate::math::optim::adam_scalars`]); an error at step 0.
    pub fn adam_scalars(&self) -> Result<[f32; 8], DeviceError> {
        if self.step == 0 {
            return Err(plan_error("optimizer steps count from 1"));
        }
        Ok(crate::math::optim::adam_scalars(self.cfg, self.step))
    }

    /// The generated Adam kernel's launches over the shard: each covers a range of its elements
    /// and takes the decayed runs (as `optimizer_step` walks them) that lie in it, as ranges of
    /// the launch's elements, at most [`ADAM_DECAY_RANGES`] (the rest empty). One launch covers
    /// the shard unless it holds more decayed runs; none for an empty shard.
    pub fn adam_launches(&self) -> Vec<AdamLaunch> {
        let decayed: Vec<Range<usize>> = match self.cfg.decays() {
            true => crate::math::optim::decay_runs(self.n, self.first, self.decay)
                .filter_map(|(run, inside)| inside.then_some(run))
                .collect(),
            false => vec![],
        };
        if decayed.is_empty() {
            let whole = (self.n > 0).then(|| AdamLaunch::new(0..self.n, &[]));
            return whole.into_iter().collect();
        }
        // A launch from the shard's start or its first decayed run to the next launch's.
        let groups: Vec<&[Range<usize>]> = decayed.chunks(ADAM_DECAY_RANGES).collect();
        let mut lo = 0;
        let mut launches = vec![];
        for (g, runs) in groups.iter().enumerate() {
            let hi = groups.get(g + 1).map_or(self.n, |next| next[0].start);
            launches.push(AdamLaunch::new(lo..hi, runs));
            lo = hi;
        }
        launches
    }
}

/// One launch of the generated Adam kernel ([`Update::adam_launches`]): `elements` of the
/// shard, with `decayed` ranges counted from its first element.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AdamLaunch {
    pub elements: Range<usize>,
    pub decayed: [(u64, u64); ADAM_DECAY_RANGES],
}

impl AdamLaunch {
    /// `elements` of the shard with the decayed `runs` (shard elements, at most
    /// [`ADAM_DECAY_RANGES`]) that lie in them.
    fn new(elements: Range<usize>, runs: &[Range<usize>]) -> Self {
        let mut decayed = [(0u64, 0u64); ADAM_DECAY_RANGES];
        for (b, r) in decayed.iter_mut().zip(runs) {
            *b = (
                (r.start - elements.start) as u64,
                (r.end - elements.start) as u64,
            );
        }
        AdamLaunch { elements, decayed }
    }

    /// The decayed ranges' bounds as the kernel takes them, after its scalars.
    pub fn bounds(&self) -> impl Iterator<Item = i64> + '_ {
        self.decayed.iter().flat_map(|&(a, b)| [a as i64, b as i64])
    }
}

/// The primitives of one stream of one rank; see the module documentation.
pub(crate) trait Device {
    /// f32 values in workspace (or any f32 buffer of the device).
    type Ptr: Ptr;
    /// One micro-batch's token ids.
    type Tokens: Copy;

    /// `n` floats of workspace, contents unspecified, valid until [`Device::reset`].
    fn alloc(&self, n: usize) -> Result<Self::Ptr, DeviceError>;
    /// Gives back every workspace allocation (the end of an op).
    fn reset(&self);
    /// The inputs (or, with `targets`, the targets) of micro-step `m`.
    fn tokens(&self, m: u32, targets: bool) -> Result<Self::Tokens, DeviceError>;

    /// The `n` values of `dtype` at byte `at` of the arena as a pointer the primitives may
    /// read and write in place, when the device can compute on the arena itself (the host: an
    /// fp32 region; a GPU: a region of any dtype); `None` when they must be loaded into
    /// workspace.
    fn view(&self, at: u64, dtype: Dtype, n: usize) -> Result<Option<Self::Ptr>, DeviceError> {
        let _ = (at, dtype, n);
        Ok(None)
    }

    /// A layer's saved region at byte `at` (laid out as `segments`, model-dtype segments in
    /// `model`) in place, a pointer that [`Piece::split`] cuts into the segments, when the
    /// device can compute on it; by default an fp32 model's region (one fp32 run) as
    /// [`Device::view`] gives it, and `None` for a 16-bit model's.
    fn view_saved(
        &self,
        at: u64,
        model: Dtype,
        segments: &[Segment],
    ) -> Result<Option<Self::Ptr>, DeviceError> {
        if model != Dtype::Fp32 {
            return Ok(None);
        }
        let n = segments.iter().map(|s| s.elements).sum();
        self.view(at, Dtype::Fp32, n)
    }

    /// dst ← the `n` values of `dtype` at byte `at` of the arena.
    fn load(&self, at: u64, dtype: Dtype, dst: Self::Ptr, n: usize) -> Result<(), DeviceError>;
    /// The `n` values at `src`, rounded to `dtype`, written (or, with `accumulate`, added in
    /// f32 and rounded once) at byte `at` of the arena.
    fn store(
        &self,
        src: Self::Ptr,
        at: u64,
        dtype: Dtype,
        n: usize,
        accumulate: bool,
    ) -> Result<(), DeviceError>;
    /// dst ← `n` fp32 values at byte `at` of the arena (2-byte aligned: saved statistics).
    fn load_f32(&self, at: u64, dst: Self::Ptr, n: usize) -> Result<(), DeviceError>;
    /// `n` fp32 values written at byte `at` of the arena (2-byte aligned).
    fn store_f32(&self, src: Self::Ptr, at: u64, n: usize) -> Result<(), DeviceError>;
    /// Copies `bytes` within the arena.
    fn copy_arena(&self, dst: u64, src: u64, bytes: u64) -> Result<(), DeviceError>;

    fn fill(&self, p: Self::Ptr, n: usize, v: f32) -> Result<(), DeviceError>;
    /// dst ← src, `n` floats.
    fn copy(&self, dst: Self::Ptr, src: Self::Ptr, n: usize) -> Result<(), DeviceError>;
    /// Rounds `n` values in place to `prec`.
    fn round(&self, prec: Precision, p: Self::Ptr, n: usize) -> Result<(), DeviceError>;

    /// y (β)= x·Wᵀ (+ bias) of `l`, y [t, out] in rows `y.1` ≥ out elements apart (columns past
    /// `out` untouched); y is read when β ≠ 0.
    fn linear_rows(
        &self,
        l: Linear<Self::Ptr>,
        bias: Option<Self::Ptr>,
        y: (Self::Ptr, usize),
        beta: f32,
    ) -> Result<(), DeviceError>;
    /// [`Device::linear_rows`] into contiguous rows.
    fn linear(
        &self,
        l: Linear<Self::Ptr>,
        bias: Option<Self::Ptr>,
        y: Self::Ptr,
        beta: f32,
    ) -> Result<(), DeviceError> {
        self.linear_rows(l, bias, (y, l.out), beta)
    }
    /// The backward of `l`: dW += dyᵀ·x, dbias += Σ_rows dy, dx (β)= dy·W, dy's rows `dy.1` ≥
    /// out elements apart (columns past `out` not read). A bias gradient needs contiguous rows.
    fn linear_backward_rows(
        &self,
        l: Linear<Self::Ptr>,
        dy: (Self::Ptr, usize),
        dw: Self::Ptr,
        dbias: Option<Self::Ptr>,
        dx: Option<(Self::Ptr, f32)>,
    ) -> Result<(), DeviceError>;
    /// [`Device::linear_backward_rows`] of contiguous rows.
    fn linear_backward(
        &self,
        l: Linear<Self::Ptr>,
        dy: Self::Ptr,
        dw: Self::Ptr,
        dbias: Option<Self::Ptr>,
        dx: Option<(Self::Ptr, f32)>,
    ) -> Result<(), DeviceError> {
        self.linear_backward_rows(l, (dy, l.out), dw, dbias, dx)
    }
    /// The input gradient of `l` alone, dx (β)= dy·W, dy's rows `dy.1` ≥ out elements apart:
    /// [`Device::linear_backward_rows`] without the weight gradient (a split backward's `I`,
    /// whose `W` takes `linear_backward_rows` without `dx`); `l.x` is not read.
    fn linear_backward_input_rows(
        &self,
        l: Linear<Self::Ptr>,
        dy: (Self::Ptr, usize),
        dx: (Self::Ptr, f32),
    ) -> Result<(), DeviceError>;
    /// [`Device::linear_backward_input_rows`] of contiguous rows.
    fn linear_backward_input(
        &self,
        l: Linear<Self::Ptr>,
        dy: Self::Ptr,
        dx: (Self::Ptr, f32),
    ) -> Result<(), DeviceError> {
        self.linear_backward_input_rows(l, (dy, l.out), dx)
    }
    /// [`Device::gelu_backward`] of `dy` (in place, `pre` GELU's input) then
    /// [`Device::linear_backward`] over it: the MLP's first product. A device may take GELU's
    /// backward in the pass that sums the bias gradient (the same values).
    fn gelu_linear_backward(
        &self,
        pre: Self::Ptr,
        l: Linear<Self::Ptr>,
        dy: Self::Ptr,
        dw: Self::Ptr,
        dbias: Option<Self::Ptr>,
        dx: Option<(Self::Ptr, f32)>,
    ) -> Result<(), DeviceError> {
        self.gelu_backward(pre, dy, l.t * l.out)?;
        self.linear_backward(l, dy, dw, dbias, dx)
    }

    /// Layer or RMS norm of `t` rows of `h`: out and the statistics (2 per row).
    fn norm_forward(
        &self,
        n: &NormOperands<'_, Self::Ptr>,
        out: Self::Ptr,
    ) -> Result<(), DeviceError>;
    /// The norm's backward: parameter gradients accumulate into `grads` (the layer's flat
    /// gradient) and, when `dx` = (out, base) is given, out ← base + the input gradient, in the
    /// same pass (base is the residual stream's gradient, or `out` itself to accumulate).
    fn norm_backward(
        &self,
        n: &NormOperands<'_, Self::Ptr>,
        dy: Self::Ptr,
        dx: Option<(Self::Ptr, Self::Ptr)>,
        grads: Self::Ptr,
    ) -> Result<(), DeviceError>;
    /// The norm's input gradient alone, `dx` = (out, base) as [`Device::norm_backward`] takes
    /// it (the same values), without the parameter gradients: a split backward's `I`, whose `W`
    /// takes `norm_backward` without `dx`.
    fn norm_backward_input(
        &self,
        n: &NormOperands<'_, Self::Ptr>,
        dy: Self::Ptr,
        dx: (Self::Ptr, Self::Ptr),
    ) -> Result<(), DeviceError>;

    /// post ← gelu(pre).
    fn gelu(&self, pre: Self::Ptr, post: Self::Ptr, n: usize) -> Result<(), DeviceError>;
    /// d ← d ∘ gelu′(pre), in place.
    fn gelu_backward(&self, pre: Self::Ptr, d: Self::Ptr, n: usize) -> Result<(), DeviceError>;
    /// prod ← silu(gate) ∘ up.
    fn swiglu(
        &self,
        gate: Self::Ptr,
        up: Self::Ptr,
        prod: Self::Ptr,
        n: usize,
    ) -> Result<(), DeviceError>;
    /// From dprod in `dgate`: dgate and dup, in place.
    fn swiglu_backward(
        &self,
        gate: Self::Ptr,
        up: Self::Ptr,
        dgate: Self::Ptr,
        dup: Self::Ptr,
        n: usize,
    ) -> Result<(), DeviceError>;
    /// SwiGLU's backward for gradients that only matrix products read (a layer without biases):
    /// from `dprod`, which it leaves as it is, the gate's and the up projection's gradients in
    /// the storage the device's products take, inside `spare` (`n` floats of workspace), where
    /// that saves their casts; `None` where the device has no such form (then
    /// [`Device::swiglu_backward`] in fp32).
    fn swiglu_backward_cast(
        &self,
        _gate: Self::Ptr,
        _up: Self::Ptr,
        _dprod: Self::Ptr,
        _spare: Self::Ptr,
        _n: usize,
    ) -> Result<Option<[Self::Ptr; 2]>, DeviceError> {
        Ok(None)
    }
    /// `qkv` ← `src` (`t` rows) with rotary positions on the q and k heads (`inverse` for
    /// gradients); `src` may be `qkv` (in place), else it is workspace the device may overwrite.
    /// Only called for blocks with rotary positions.
    fn rope(
        &self,
        bp: &BlockP,
        t: usize,
        src: Self::Ptr,
        qkv: Self::Ptr,
        inverse: bool,
    ) -> Result<(), DeviceError>;
    /// Causal attention of the packed `qkv`: `out` and what backward needs in `keep`.
    fn attention(
        &self,
        bp: &BlockP,
        act: Precision,
        qkv: Self::Ptr,
        out: Self::Ptr,
        keep: Keep<Self::Ptr>,
    ) -> Result<(), DeviceError>;
    /// Attention's backward from the forward's input `qkv` and output `out` (whose row sums
    /// with `dout` a fused backward needs): `dqkv` is overwritten.
    fn attention_backward(
        &self,
        bp: &BlockP,
        qkv_out: (Self::Ptr, Self::Ptr),
        keep: Keep<Self::Ptr>,
        dout: Self::Ptr,
        dqkv: Self::Ptr,
    ) -> Result<(), DeviceError>;

    /// out ← wte[token] (+ wpe[position]) for `t` tokens of width `h`, position = token index
    /// mod `s` (the sequence length).
    fn embedding(
        &self,
        at: &Lookup<Self::Tokens>,
        wte: Self::Ptr,
        wpe: Option<Self::Ptr>,
        out: Self::Ptr,
    ) -> Result<(), DeviceError>;
    /// dwte[token] += dy row, dwpe[position] += dy row.
    fn embedding_backward(
        &self,
        at: &Lookup<Self::Tokens>,
        dy: Self::Ptr,
        dwte: Self::Ptr,
        dwpe: Option<Self::Ptr>,
    ) -> Result<(), DeviceError>;
    /// Softmax cross-entropy of `n` rows of `vocab` logits, `stride` elements apart, against
    /// `targets`: `grad` (the same layout) ← (softmax − onehot)/n, and the rows' loss sum added
    /// to the device's loss accumulator.
    fn cross_entropy(
        &self,
        logits: &Logits<Self::Ptr>,
        targets: Self::Tokens,
        grad: Self::Ptr,
    ) -> Result<(), DeviceError>;
    /// One optimizer step on `state` from the summed gradient `grad`; with `param`, the new
    /// master (the state's first `u.n` values) also stored there, in its storage.
    fn update(
        &self,
        u: &Update<'_>,
        state: Self::Ptr,
        grad: Self::Ptr,
        param: Option<Self::Ptr>,
    ) -> Result<(), DeviceError>;
    /// The sum of squares of every value of `grads`, stored as one value at `out`.
    fn grad_norm(&self, grads: &[ArenaSpan], out: ArenaSpan) -> Result<(), DeviceError>;
}
