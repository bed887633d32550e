//! The device layer's primitives on a GPU stream: launches of the generated kernels
//! (`sched_kernels`, loaded from the PTX `schedc compile --emit ptx` writes) and cuBLAS
//! products over typed device pointers ([`crate::device::Device`] for [`Gpu`], [`DevPtr`]).
//! Every region of the arena is computed on in place in its own dtype ([`Device::view`],
//! [`Device::view_saved`]): each launch runs the kernel variant typed for the storages of the
//! pointers it passes (fp32, bf16, fp16; a 16-bit model's fp32 statistics at a 2-byte offset of
//! its saved region as halves), which reads by widening and rounds once where it stores, and a
//! 16-bit model's products take operands stored in its dtype in place and write C in its
//! storage. The stream's f32 workspace holds the layer math's fp32 intermediates, the
//! parameter gradient, product casts and small per-op results (per-row losses, the gradient
//! norm's partial sums, the optimizer's gradient scale); `Device::load`/`store` remain for what
//! the device layer still stages (gradient parts, the optimizer's 16-bit parameter copy). The
//! layer math and each op's reads and writes are the device layer's, shared with the CPU.
//!
//! A launch ([`Gpu::run`]) names the op and passes one [`Arg`] per parameter in
//! [`Kernel::params`] order; the kernel's dtypes are read off the typed pointers, its arguments
//! checked against the parameters' kinds, and `begin`/`end` (the op's whole index space,
//! [`Op::space`]) appended. `sched_kernels::for_job` lists every variant this file may
//! request for a job: the emulation's tests check each launch against it, and the CUDA backend
//! checks that the loaded module holds them all before training.
//!
//! Built everywhere (it only enqueues through [`Exec`]), so the host emulation in the tests runs
//! it; on a GPU it runs inside [`super::CudaBackend`].
#![cfg_attr(not(feature = "cuda"), allow(dead_code))]

use super::enqueue::{
    grid, m, mt, row_major, ColMajor, DevAddr, Exec, Pitched, RowMajor, Staged, A,
};
use super::typed::{DevPtr, Storage};
use crate::device::{
    plan_error, ArenaSpan, Device, DeviceError, Linear, Logits, Lookup, NormOperands, Ptr, Update,
};
use crate::math::attention::{Keep, Shape};
use crate::math::{BlockP, Precision, Segment};
use sched_ir::abi::{attention_chunk, PADDED_ROWS};
use sched_ir::job::{Dtype, Optimizer};
use sched_kernels::{flash, Kernel, NormEps, Op, Param, SUMSQ_CHUNK};
use std::cell::Cell;

/// Device addresses of a rank's constants: the batch tokens, the loss and sum-of-squares
/// accumulators, rotary tables.
pub struct Consts {
    /// u32 tokens: [micro_step][inputs | targets] of T each.
    pub tokens: DevAddr,
    /// One f64: the step's loss sum on this rank.
    pub loss: DevAddr,
    /// One f64: the gradient norm's sum of squares.
    pub sumsq: DevAddr,
    /// cos then sin tables (fp32), seq_len × head_dim/2 each.
    pub rope: Option<DevAddr>,
    /// Tokens per micro-batch.
    pub t: usize,
}

/// One stream of one rank: where to enqueue ([`Exec`]), its fp32 workspace (a bump pointer
/// reset after each op, over the scratch the plan carves for the stream out of the arena:
/// `memory::StreamMemory`), where the rank's arena starts, the rank's constants, and the dtype its
/// matrix products run in (the model's: a 16-bit model's products run on tensor cores).
pub struct Gpu<'a> {
    x: &'a dyn Exec,
    products: Dtype,
    ws_base: DevAddr,
    ws_len: usize,
    used: Cell<usize>,
    arena_base: DevAddr,
    consts: &'a Consts,
    /// Whether flash attention may run as the tensor-core kernels (`RunOptions::attention_kernels`).
    attention_kernels: bool,
}

impl<'a> Gpu<'a> {
    /// A stream enqueuing through `x` whose products run in `products`, with the fp32 workspace
    /// of `ws_len` floats at `ws_base` (nothing of it used yet), the rank's arena at
    /// `arena_base` and its constants.
    pub fn new(
        x: &'a dyn Exec,
        products: Dtype,
        (ws_base, ws_len): (DevAddr, usize),
        arena_base: DevAddr,
        consts: &'a Consts,
    ) -> Self {
        Gpu {
            x,
            products,
            ws_base,
            ws_len,
            used: Cell::new(0),
            arena_base,
            consts,
            attention_kernels: true,
        }
    }

    /// The same stream with flash attention's tensor-core kernels on or off
    /// (`RunOptions::attention_kernels`).
    pub fn with_attention_kernels(self, on: bool) -> Self {
        Gpu {
            attention_kernels: on,
            ..self
        }
    }
}

const F: u64 = 4;

/// The elements a column-major operand of `rows` × `cols` (columns `ld` apart, `batch` of them
/// `stride` apart) spans.
fn span(rows: usize, cols: usize, ld: usize, stride: usize, batch: usize) -> usize {
    if rows == 0 || cols == 0 {
        return 0;
    }
    (batch - 1) * stride + (cols - 1) * ld + rows
}

/// The width a product dimension of `cols` elements of `storage` is padded to so that it is a
/// multiple of 16 bytes: what cuBLASLt's vectorised tensor-core kernels need of the contiguous
/// dimension of each operand and of the leading dimensions (otherwise it falls back to
/// `align1` kernels: on an H200, GPT-2's 50,257-word head spent 20 ms a step in its three
/// products, 8.8, 5.8 and 5.6 ms; padded, about 4.5 ms with the row batches).
fn aligned_ld(cols: usize, storage: Storage) -> usize {
    cols.next_multiple_of((16 / storage.bytes()) as usize)
}

/// The columns `c0..c0 + n` that a product over `out` output columns, in rows that start 16
/// bytes aligned, runs as products of their own: the most whole 16-byte vectors of `storage`,
/// then the rest (fewer than 8 columns: an lm_head's logits past the last whole vector), so
/// that the contiguous extent of each big product's output (forward) or output gradient
/// (backward) is aligned as its leading dimension is (`aligned_ld`), and only a product a few
/// columns wide runs cuBLASLt's unaligned kernels.
fn aligned_parts(out: usize, storage: Storage) -> impl Iterator<Item = (usize, usize)> {
    let body = out - out % aligned_ld(1, storage);
    [(0, body), (body, out - body)]
        .into_iter()
        .filter(|&(_, n)| n > 0)
}

/// One argument of a launch, for one parameter of the op ([`Kernel::params`] order).
#[derive(Clone, Copy, Debug)]
enum Arg {
    /// A typed pointer, for a tensor (its storage is the kernel's dtype for it) or f32 values
    /// (fp32 storage; fp32 halves for the op's saved statistics, [`Op::saved_stats`]).
    T(DevPtr),
    /// A raw device pointer: token ids, f64 values, or f32 constants.
    P(DevAddr),
    L(i64),
    F(f32),
    D(f64),
}
// A typed pointer is written `T(x)` in the argument lists.
use Arg::T;

/// A misuse of a kernel (arguments that do not fit its parameters): a bug of this file.
fn misuse(op: Op, what: impl std::fmt::Display) -> DeviceError {
    DeviceError::Kernel(format!("{op:?}: {what}"))
}

/// The kernel of `op` for `args`: a tensor's dtype is its pointer's storage, and the op's saved
/// statistics are halves when their pointer is.
fn kernel_for(op: Op, args: &[Arg]) -> Result<Kernel, DeviceError> {
    let shape = Kernel::new(op, &vec![Dtype::Fp32; op.tensors()]).params();
    if shape.len() != args.len() {
        return Err(misuse(
            op,
            format!("{} arguments for {} parameters", args.len(), shape.len()),
        ));
    }
    let mut dtypes = vec![];
    let mut halves = false;
    for (p, a) in shape.iter().zip(args) {
        match (p, a) {
            (Param::Tensor(n, _), T(x)) => dtypes.push(x.storage.dtype().ok_or_else(|| {
                misuse(
                    op,
                    format!("`{n}` is fp32 at a 2-byte offset (no kernel reads that)"),
                )
            })?),
            (Param::F32s(n), T(x)) if x.storage == Storage::F32Halves => {
                if op.saved_stats() != Some(*n) {
                    return Err(misuse(op, format!("`{n}` cannot be fp32 halves")));
                }
                halves = true;
            }
            _ => {}
        }
    }
    let k = Kernel::new(op, &dtypes);
    Ok(if halves { k.with_halved_stats() } else { k })
}

/// The launch arguments of `k` from `args`, each checked against its parameter, then `begin`
/// and `end`.
fn flatten(k: &Kernel, args: &[Arg], n: usize) -> Result<Vec<A>, DeviceError> {
    let mut out = Vec::with_capacity(args.len() + 2);
    for (p, &a) in k.params().iter().zip(args) {
        out.push(match (p, a) {
            (Param::Tensor(..) | Param::Halves(_), T(x)) if !x.mixed() => A::P(x.addr),
            (Param::F32s(_), T(x)) if !x.mixed() && x.storage == Storage::F32 => A::P(x.addr),
            (Param::F32s(_) | Param::F64s(_) | Param::Tokens(_), Arg::P(x)) => A::P(x),
            (Param::F32(_), Arg::F(v)) => A::F(v),
            (Param::F64(_), Arg::D(v)) => A::D(v),
            (Param::I64(_), Arg::L(v)) => A::L(v),
            (p, a) => return Err(misuse(k.op, format!("{a:?} passed for {p:?}"))),
        });
    }
    out.extend([A::L(0), A::L(n as i64)]);
    Ok(out)
}

/// The dtype whose precision `p` rounds to.
fn dtype_of(p: Precision) -> Dtype {
    match p {
        Precision::F32 => Dtype::Fp32,
        Precision::Bf16 => Dtype::Bf16,
        Precision::F16 => Dtype::Fp16,
    }
}

impl Gpu<'_> {
    /// Launches the kernel of `op` for `args` over its `n` indices ([`Op::space`]: elements,
    /// rows, columns or chunks), with a grid sized for its grid-stride loop; nothing when `n`
    /// is 0.
    fn run(&self, op: Op, n: usize, args: &[Arg]) -> Result<(), DeviceError> {
        if n == 0 {
            return Ok(());
        }
        let k = kernel_for(op, args)?;
        let flat = flatten(&k, args, n)?;
        self.x
            .launch(&k.name(), grid(op, n), &flat)
            .map_err(gpu_error)
    }

    /// The arena's bytes at `at` as elements of `dtype`, in place.
    fn arena(&self, at: u64, dtype: Dtype) -> Result<DevPtr, DeviceError> {
        let storage = Storage::at(dtype, at).ok_or_else(|| {
            DeviceError::Access(format!("{dtype:?} at arena byte {at} is misaligned"))
        })?;
        Ok(DevPtr::new(self.arena_base.add_bytes(at), storage))
    }

    /// Runs the row-major product `g` (see [`RowMajor`]).
    fn gemm(&self, g: RowMajor) -> Result<(), DeviceError> {
        // Column-major A is the row-major B and the other way round.
        self.product(
            row_major(&g),
            g.b.ptr.storage,
            g.a.ptr.storage,
            g.c.storage,
            None,
        )
    }

    /// Runs one column-major product whose A, B and C are stored in `sa`, `sb` and `sc`, then
    /// adds `bias` (a vector of `call.m`) to every column. An operand stored in the product
    /// dtype is used in place; any other is cast into workspace first (released once the
    /// product is enqueued: later work on this stream runs after it). C is written in its own
    /// storage, rounded once, where the product can write it (fp32, or the 16-bit product
    /// dtype with the bias in cuBLASLt's epilogue); else see [`Gpu::product_via_f32`].
    fn product(
        &self,
        call: ColMajor,
        sa: Storage,
        sb: Storage,
        sc: Storage,
        bias: Option<DevPtr>,
    ) -> Result<(), DeviceError> {
        if call.m == 0 || call.n == 0 || call.batch == 0 {
            return Ok(());
        }
        let dtype = self.products;
        let output = sc.dtype().filter(|&d| d == Dtype::Fp32 || d == dtype);
        let Some(output) = output else {
            return self.product_via_f32(call, sa, sb, sc, bias);
        };
        let mark = self.used.get();
        let (ma, ka) = if call.transa {
            (call.k, call.m)
        } else {
            (call.m, call.k)
        };
        let (kb, nb) = if call.transb {
            (call.n, call.k)
        } else {
            (call.k, call.n)
        };
        let a = self.operand(
            call.a,
            sa,
            span(ma, ka, call.lda, call.stride_a, call.batch),
        )?;
        let b = self.operand(
            call.b,
            sb,
            span(kb, nb, call.ldb, call.stride_b, call.batch),
        )?;
        let epilogue = bias.filter(|_| output != Dtype::Fp32);
        let epilogue = epilogue
            .map(|p| {
                let d = p
                    .storage
                    .dtype()
                    .ok_or_else(|| plan_error("a misaligned bias"))?;
                Ok::<_, DeviceError>((p.addr, d))
            })
            .transpose()?;
        let r = self.x.gemm(&ColMajor {
            operands: dtype,
            output,
            bias: epilogue,
            a,
            b,
            ..call
        });
        self.used.set(mark);
        r.map_err(gpu_error)?;
        match bias {
            Some(bias) if epilogue.is_none() => {
                let c = DevPtr::new(call.c, sc);
                self.bias_add(c, bias, call.n * call.batch, call.m)
            }
            _ => Ok(()),
        }
    }

    /// A product whose C the product cannot write in place (a 16-bit C of an fp32 product, fp32
    /// statistics as halves): computed into fp32 workspace (C widened first when β ≠ 0), the
    /// bias added there, then stored into C rounded once. Only contiguous C (ldc = m, one
    /// matrix or stride m·n) takes this path; the layer math has no other.
    fn product_via_f32(
        &self,
        call: ColMajor,
        sa: Storage,
        sb: Storage,
        sc: Storage,
        bias: Option<DevPtr>,
    ) -> Result<(), DeviceError> {
        let n = call.m * call.n * call.batch;
        let contiguous =
            call.ldc == call.m && (call.batch == 1 || call.stride_c == call.m * call.n);
        if !contiguous {
            return Err(plan_error(
                "a strided product output in a storage cuBLAS cannot write",
            ));
        }
        let c = DevPtr::new(call.c, sc);
        let wide = self.alloc(n)?;
        if call.beta != 0.0 {
            self.copy(wide, c, n)?;
        }
        let call = ColMajor {
            c: wide.addr,
            ..call
        };
        self.product(call, sa, sb, Storage::F32, bias)?;
        self.copy(c, wide, n)
    }

    /// A column-major operand of `n` elements at `p` in `storage`, in the product dtype: `p`
    /// itself when it is stored so, else a copy cast to it in workspace (a 16-bit product
    /// rounds an fp32 operand; an fp32 product widens a 16-bit one, exactly).
    fn operand(&self, p: DevAddr, storage: Storage, n: usize) -> Result<DevAddr, DeviceError> {
        if storage.dtype() == Some(self.products) || n == 0 {
            return Ok(p);
        }
        let dst = self.alloc_as(Storage::of(self.products), n)?;
        self.copy(dst, DevPtr::new(p, storage), n)?;
        Ok(dst.addr)
    }

    /// [`Gpu::operand`] of `n` elements at `p`, 4-byte aligned for the fused attention kernels,
    /// which read pairs of 16-bit values at once: a 16-bit tensor at a 2-byte offset of the
    /// arena is copied into workspace.
    fn aligned_operand(&self, p: DevPtr, n: usize) -> Result<DevPtr, DeviceError> {
        let storage = Storage::of(self.products);
        let q = DevPtr::new(self.operand(p.addr, p.storage, n)?, storage);
        if q.addr.0.is_multiple_of(4) {
            return Ok(q);
        }
        let dst = self.alloc_as(storage, n)?;
        self.copy(dst, q, n)?;
        Ok(dst)
    }

    /// y[r][c] += b[c] for `t` rows of `w`.
    fn bias_add(&self, y: DevPtr, b: DevPtr, t: usize, w: usize) -> Result<(), DeviceError> {
        let op = Op::BiasAdd { width: w as u32 };
        self.run(op, t * w, &[T(y), T(b)])
    }

    fn copy_bytes(&self, dst: DevAddr, src: DevAddr, bytes: usize) -> Result<(), DeviceError> {
        if bytes == 0 {
            return Ok(());
        }
        self.x.copy_bytes(dst, src, bytes).map_err(gpu_error)
    }

    /// `rows` rows of `cols` elements from `src` to `dst` (each a pointer and the elements
    /// between its rows), of one storage.
    fn copy_rows(
        &self,
        (dst, dst_ld): (DevPtr, usize),
        (src, src_ld): (DevPtr, usize),
        cols: usize,
        rows: usize,
    ) -> Result<(), DeviceError> {
        if dst.storage.bytes() != src.storage.bytes() {
            return Err(plan_error("a 2-D copy between storages of different sizes"));
        }
        let b = src.storage.bytes() as usize;
        let row = |p: DevPtr, ld: usize| Pitched {
            at: p.addr,
            pitch: ld * b,
        };
        if rows == 0 || cols == 0 {
            return Ok(());
        }
        self.x
            .copy_rows(row(dst, dst_ld), row(src, src_ld), cols * b, rows)
            .map_err(gpu_error)
    }

    /// Workspace for `n` elements of `storage`.
    fn alloc_as(&self, storage: Storage, n: usize) -> Result<DevPtr, DeviceError> {
        let floats = (n as u64 * storage.bytes()).div_ceil(F);
        Ok(DevPtr::new(self.alloc(floats as usize)?.addr, storage))
    }

    /// How a product over an output width `out` whose rows do not start 16 bytes aligned (an
    /// MLP's width that is not a multiple of 8: no product can read or write such rows in place;
    /// an lm_head's logits are planned in aligned rows instead, `logits_stride`) goes
    /// through workspace: `cols` of its columns at a time (a multiple of the alignment), over
    /// `rows` token rows at a time, as many as [`PADDED_ROWS`] padded rows of `ld` hold: every
    /// token row at once when they fit, so that each column block's weight rows meet all the
    /// tokens in one product. Returns (cols, rows).
    fn column_blocks(t: usize, ld: usize, storage: Storage) -> (usize, usize) {
        let align = aligned_ld(1, storage);
        let budget = PADDED_ROWS * ld;
        let cols = ((budget / t).min(ld) / align * align).max(align);
        (cols, (budget / cols).min(t))
    }

    /// W's rows `c0..c0 + width` [width × inp] as a product operand of a row count that is a
    /// multiple of the alignment: W in place when `width` is one, else (the last block) those
    /// rows copied into workspace with zero rows after them. Returns it and its row count.
    fn weight_rows(
        &self,
        w: DevPtr,
        c0: usize,
        width: usize,
        inp: usize,
        storage: Storage,
    ) -> Result<(DevPtr, usize), DeviceError> {
        let w = w.offset(c0 * inp);
        let wide = aligned_ld(width, storage);
        if wide == width {
            return Ok((w, width));
        }
        let wp = self.alloc_as(w.storage, wide * inp)?;
        self.copy(wp, w, width * inp)?;
        self.fill(wp.offset(width * inp), (wide - width) * inp, 0.0)?;
        Ok((wp, wide))
    }

    /// `Device::linear_backward_rows`, dy first through GELU's backward when `gelu` gives its
    /// input (`Device::gelu_linear_backward`; contiguous rows); without `dw`, the input
    /// gradient alone (`Device::linear_backward_input_rows`).
    fn linear_backward_after(
        &self,
        gelu: Option<DevPtr>,
        l: Linear<DevPtr>,
        (dy, ld): (DevPtr, usize),
        dw: Option<DevPtr>,
        dbias: Option<DevPtr>,
        dx: Option<(DevPtr, f32)>,
    ) -> Result<(), DeviceError> {
        let Linear { x, w, t, inp, out } = l;
        if (dbias.is_some() || gelu.is_some()) && ld != out {
            return Err(plan_error(
                "a bias gradient or GELU's backward over rows wider than the product",
            ));
        }
        let aligned = aligned_ld(ld, dy.storage) == ld;
        let (width, rows) = (out as u32, Arg::L(t as i64));
        let products = Storage::of(self.products);
        // Both products read dy in place: an fp32 gradient of a 16-bit model is cast once for
        // the two, not once per product (the cast lives in workspace until the op ends); with a
        // bias, by the bias gradient's pass over dy, which also takes GELU's backward.
        let shared = aligned && dx.is_some();
        let dy = match dbias {
            Some(db) => {
                let cast = shared && dy.storage == Storage::F32 && products != Storage::F32;
                let dy16 = cast.then(|| self.alloc_as(products, t * out)).transpose()?;
                let op = Op::BiasGrad {
                    width,
                    cast,
                    gelu: gelu.is_some(),
                };
                let tensors = [dy, db].into_iter().chain(dy16).chain(gelu);
                let args: Vec<Arg> = tensors.map(T).chain([rows]).collect();
                self.run(op, out, &args)?;
                dy16.unwrap_or(dy)
            }
            None => {
                if let Some(pre) = gelu {
                    self.gelu_backward(pre, dy, t * out)?;
                }
                dy
            }
        };
        // (`operand` is dy itself when dy is already in the product dtype.)
        let dy = if shared {
            DevPtr::new(self.operand(dy.addr, dy.storage, t * ld)?, products)
        } else {
            dy
        };
        // Blocks aligned for dy's storage and for the product dtype it is cast to.
        let narrow = if products.bytes() < dy.storage.bytes() {
            products
        } else {
            dy.storage
        };
        if aligned {
            for (c0, n) in aligned_parts(out, narrow) {
                let (dy, w) = (dy.offset(c0), w.offset(c0 * inp));
                if let Some(dw) = dw {
                    let dw = dw.offset(c0 * inp);
                    let dw_part = RowMajor::new((n, inp, t), mt(dy, ld), m(x, inp), (dw, inp));
                    self.gemm(dw_part.beta(1.0))?;
                }
                if let Some((dx, beta)) = dx {
                    let beta = if c0 == 0 { beta } else { 1.0 };
                    self.gemm(
                        RowMajor::new((t, inp, n), m(dy, ld), m(w, inp), (dx, inp)).beta(beta),
                    )?;
                }
            }
            return Ok(());
        }
        // dy's rows do not start 16 bytes aligned: its columns a block at a time
        // (`column_blocks`) are copied into rows of `cols` in workspace. Each block's dW rows
        // are one product over its token rows (all of them when they fit: a head's dW is then
        // written once, not re-read per row batch), and dx adds the blocks' products (β = 1
        // after the first). The last block's columns past dy's are zeros, against W's rows
        // padded with zeros (`weight_rows`), so that every product's k is aligned.
        let (cols, rows) = Self::column_blocks(t, aligned_ld(out, dy.storage), narrow);
        if let Some((dx, _)) = dx {
            if dx.storage != Storage::F32 && cols < out {
                return Err(plan_error(
                    "a 16-bit dx of a product over an unaligned output width",
                ));
            }
        }
        let block = self.alloc_as(dy.storage, rows * cols)?;
        for c0 in (0..out).step_by(cols) {
            let width = cols.min(out - c0);
            // dx's operand: W's rows of this block, and how many (padded) it sums over.
            let dx_of = dx
                .map(|(dx, beta)| {
                    let w = self.weight_rows(w, c0, width, inp, dy.storage)?;
                    Ok::<_, DeviceError>((dx, if c0 == 0 { beta } else { 1.0 }, w))
                })
                .transpose()?;
            if dx_of.is_some_and(|(_, _, (_, wide))| wide > width) {
                self.fill(block, rows * cols, 0.0)?;
            }
            let dw = dw.map(|dw| dw.offset(c0 * inp));
            for r0 in (0..t).step_by(rows) {
                let n = rows.min(t - r0);
                self.copy_rows((block, cols), (dy.offset(r0 * ld + c0), ld), width, n)?;
                // Both products read the block: cast once (an fp32 gradient of a 16-bit
                // model), not once per product; released after them.
                let mark = self.used.get();
                let dyb = DevPtr::new(self.operand(block.addr, block.storage, n * cols)?, products);
                if let Some(dw) = dw {
                    let x = x.offset(r0 * inp);
                    let dw_part =
                        RowMajor::new((width, inp, n), mt(dyb, cols), m(x, inp), (dw, inp));
                    self.gemm(dw_part.beta(1.0))?;
                }
                if let Some((dx, beta, (wb, wide))) = dx_of {
                    let dx = dx.offset(r0 * inp);
                    self.gemm(
                        RowMajor::new((n, inp, wide), m(dyb, cols), m(wb, inp), (dx, inp))
                            .beta(beta),
                    )?;
                }
                self.used.set(mark);
            }
        }
        Ok(())
    }

    /// y (β)= x·Wᵀ (+ bias) into rows of y `ld` elements apart, one product in place.
    fn linear_in_place(
        &self,
        l: Linear<DevPtr>,
        bias: Option<DevPtr>,
        (y, ld): (DevPtr, usize),
        beta: f32,
    ) -> Result<(), DeviceError> {
        let Linear { x, w, t, inp, out } = l;
        let call =
            row_major(&RowMajor::new((t, out, inp), m(x, inp), mt(w, inp), (y, ld)).beta(beta));
        self.product(call, w.storage, x.storage, y.storage, bias)
    }

    /// `n` elements from `src` to `dst`, each rounded once to `dst`'s storage (the layer
    /// math's copies between storages and the products' operand casts).
    fn convert(&self, dst: DevPtr, src: DevPtr, n: usize) -> Result<(), DeviceError> {
        self.run(Op::Convert, n, &[T(src), T(dst)])
    }

    /// A region staged between the arena and workspace (`Device::load`, `store`): a copy
    /// rounding once to `dst`'s storage, or with `accumulate` an f32 sum rounded once; told to
    /// [`Exec::staged`] with the arena bytes it moves.
    fn stage(
        &self,
        what: Staged,
        dst: DevPtr,
        src: DevPtr,
        n: usize,
        arena: Dtype,
    ) -> Result<(), DeviceError> {
        self.x.staged(what, n, n as u64 * arena.bytes());
        match what {
            Staged::AddStore => self.run(Op::Accumulate, n, &[T(src), T(dst)]),
            Staged::Load | Staged::Store => self.copy(dst, src, n),
        }
    }
}

/// One chunk of attention: query rows `q0..q0 + rows` of sequence `b`, every head, against keys
/// `0..q0 + rows` ([`Chunk::keys`]); the fused path's chunks of query rows, or a whole sequence
/// for the naive path ([`Chunk::whole`]). Its workspace matrices (scores,
/// probabilities, their gradients) are `[head][row][key]`. Its products run per query head `u`
/// within a kv group, batched over the groups `g` (query head `g·r + u` reads group `g`'s keys
/// and values), so each matrix below is (first matrix, leading dimension, stride between
/// groups).
struct Chunk<'s> {
    sh: &'s Shape,
    b: usize,
    q0: usize,
    rows: usize,
}

type Mat = (DevPtr, usize, usize);

/// The fused attention kernels' shape of `sh` (its sequences aside).
pub(super) fn flash_shape(sh: &Shape) -> flash::Shape {
    flash::Shape {
        heads: sh.heads,
        kv_heads: sh.kv_heads,
        d: sh.d,
        s: sh.s,
    }
}

/// Query rows per chunk of `sh`'s fused attention, as the plan's workspace was sized.
fn chunk_rows(sh: &Shape) -> usize {
    attention_chunk(sh.heads as u64, sh.s as u64) as usize
}

impl<'s> Chunk<'s> {
    /// Every row of sequence `b`, against every key.
    fn whole(sh: &'s Shape, b: usize) -> Self {
        Chunk {
            sh,
            b,
            q0: 0,
            rows: sh.s,
        }
    }

    /// The keys the chunk's last row sees, `q0 + rows`: every matrix of the chunk is that wide.
    fn keys(&self) -> usize {
        self.q0 + self.rows
    }

    /// Query heads per kv group.
    fn r(&self) -> usize {
        self.sh.heads / self.sh.kv_heads
    }

    /// Head `u`'s matrix of a `[head][row][key]` workspace buffer.
    fn scores(&self, p: DevPtr, u: usize) -> Mat {
        let m = self.rows * self.keys();
        (p.offset(u * m), self.keys(), self.r() * m)
    }

    /// Head `u`'s query rows of the chunk in a token-major tensor whose rows are `ld` apart and
    /// start with the query heads: qkv (or its gradient), the attention output (or its
    /// gradient).
    fn queries(&self, p: DevPtr, ld: usize, u: usize) -> Mat {
        let (s, d) = (self.sh.s, self.sh.d);
        (
            p.offset((self.b * s + self.q0) * ld + u * d),
            ld,
            self.r() * d,
        )
    }

    /// The sequence's keys (or, `values`, its values) in qkv or its gradient.
    fn kv(&self, p: DevPtr, values: bool) -> Mat {
        let sh = self.sh;
        let (w, d) = (sh.width(), sh.d);
        let at = self.b * sh.s * w + sh.hidden() + usize::from(values) * sh.kv_heads * d;
        (p.offset(at), w, d)
    }
}

impl Gpu<'_> {
    /// C = α·op(A)·op(B) + β·C for every kv group of a chunk (see [`Chunk`]): `rows` × `cols`,
    /// inner dimension `k`, A and B transposed where said.
    #[allow(clippy::too_many_arguments)]
    fn per_group(
        &self,
        c: &Chunk<'_>,
        (rows, cols, k): (usize, usize, usize),
        alpha: f32,
        (a, ta): (Mat, bool),
        (b, tb): (Mat, bool),
        beta: f32,
        out: Mat,
    ) -> Result<(), DeviceError> {
        let op = |x: Mat, t: bool| if t { mt(x.0, x.1) } else { m(x.0, x.1) };
        let g = RowMajor::new((rows, cols, k), op(a, ta), op(b, tb), (out.0, out.1));
        self.gemm(
            g.alpha(alpha)
                .beta(beta)
                .batched((a.2, b.2, out.2), c.sh.kv_heads),
        )
    }

    /// A chunk's scores `scale·Q·Kᵀ` into `scores` (fp32), then their causal softmax: the
    /// probabilities into `probs` (the product dtype) and each row's log-sum-exp into `lse`.
    fn chunk_probs(
        &self,
        c: &Chunk<'_>,
        qkv: DevPtr,
        scores: DevPtr,
        probs: DevPtr,
        lse: DevPtr,
    ) -> Result<(), DeviceError> {
        let (sh, w) = (c.sh, c.sh.width());
        for u in 0..c.r() {
            let q = (c.queries(qkv, w, u), false);
            let k = (c.kv(qkv, false), true);
            let dims = (c.rows, c.keys(), sh.d);
            self.per_group(c, dims, sh.scale(), q, k, 0.0, c.scores(scores, u))?;
        }
        let [keys, first, per_head] = [c.keys(), c.q0, c.rows].map(|v| Arg::L(v as i64));
        let args = [T(scores), T(probs), T(lse), keys, first, per_head];
        self.run(Op::CausalSoftmax, sh.heads * c.rows, &args)
    }

    /// The chunks of the fused attention, sequence by sequence, `per` query rows each (the plan's
    /// `sched_ir::abi::attention_chunk`), with workspace for their scores (fp32),
    /// probabilities (the product dtype) and log-sum-exps.
    fn chunks<'s>(
        &self,
        sh: &'s Shape,
        per: usize,
    ) -> Result<(Vec<Chunk<'s>>, DevPtr, DevPtr, DevPtr), DeviceError> {
        let floats = sh.heads * per * sh.s;
        let scores = self.alloc(floats)?;
        let probs = self.alloc_as(Storage::of(self.products), floats)?;
        let lse = self.alloc(sh.heads * per)?;
        let chunks = (0..sh.b)
            .flat_map(|b| {
                (0..sh.s).step_by(per).map(move |q0| {
                    let rows = per.min(sh.s - q0);
                    Chunk { sh, b, q0, rows }
                })
            })
            .collect();
        Ok((chunks, scores, probs, lse))
    }

    /// A chunk's output rows `P·V` from its probabilities `probs`.
    fn chunk_values(
        &self,
        c: &Chunk<'_>,
        qkv: DevPtr,
        out: DevPtr,
        probs: DevPtr,
    ) -> Result<(), DeviceError> {
        for u in 0..c.r() {
            let p = (c.scores(probs, u), false);
            let v = (c.kv(qkv, true), false);
            let o = c.queries(out, c.sh.hidden(), u);
            self.per_group(c, (c.rows, c.sh.d, c.keys()), 1.0, p, v, 0.0, o)?;
        }
        Ok(())
    }

    /// A chunk's backward from its probabilities `probs`: dP = dO·Vᵀ into `dp` (fp32),
    /// dV += Pᵀ·dO, dS = P ∘ (dP − rowsum(P ∘ dP))·scale into `ds` (`dp` itself, or `probs`
    /// when they may be overwritten: dS in the product dtype), dQ = dS·K and dK += dSᵀ·Q.
    #[allow(clippy::too_many_arguments)]
    fn chunk_backward(
        &self,
        c: &Chunk<'_>,
        qkv: DevPtr,
        dout: DevPtr,
        dqkv: DevPtr,
        probs: DevPtr,
        dp: DevPtr,
        ds: DevPtr,
    ) -> Result<(), DeviceError> {
        let sh = c.sh;
        let (w, h) = (sh.width(), sh.hidden());
        let (rows, keys, d) = (c.rows, c.keys(), sh.d);
        for u in 0..c.r() {
            let o = (c.queries(dout, h, u), false);
            let v = (c.kv(qkv, true), true);
            self.per_group(c, (rows, keys, d), 1.0, o, v, 0.0, c.scores(dp, u))?;
            let p = (c.scores(probs, u), true);
            let dv = c.kv(dqkv, true);
            self.per_group(c, (keys, d, rows), 1.0, p, o, 1.0, dv)?;
        }
        let (scale, keys_arg) = (Arg::F(sh.scale()), Arg::L(keys as i64));
        let args = [T(probs), T(dp), T(ds), scale, keys_arg];
        self.run(Op::SoftmaxBackward, sh.heads * rows, &args)?;
        for u in 0..c.r() {
            let s_u = c.scores(ds, u);
            let k = c.kv(qkv, false);
            let dq = c.queries(dqkv, w, u);
            self.per_group(c, (rows, d, keys), 1.0, (s_u, false), (k, false), 0.0, dq)?;
            let q = (c.queries(qkv, w, u), false);
            let dk = c.kv(dqkv, false);
            self.per_group(c, (keys, d, rows), 1.0, (s_u, true), q, 1.0, dk)?;
        }
        Ok(())
    }

    /// The fused attention's forward: one tensor-core kernel where it applies
    /// ([`Gpu::flash_forward`]), else per chunk the probabilities (as [`Gpu::chunk_probs`]), the
    /// output rows `P·V`, and the rows' log-sum-exps into `lse` (what backward keeps; the s×s
    /// matrix is never kept, only a chunk of it lives in workspace during the op).
    pub(super) fn fused_attention(
        &self,
        (sh, per): (&Shape, usize),
        qkv: DevPtr,
        out: DevPtr,
        lse: DevPtr,
    ) -> Result<(), DeviceError> {
        if self.attention_kernels && flash::supports(self.products, sh.d) {
            return self.flash_forward(sh, qkv, out, lse);
        }
        self.chunked_forward((sh, per), qkv, out, lse)
    }

    /// [`Gpu::fused_attention`] chunk by chunk of `per` query rows.
    fn chunked_forward(
        &self,
        (sh, per): (&Shape, usize),
        qkv: DevPtr,
        out: DevPtr,
        lse: DevPtr,
    ) -> Result<(), DeviceError> {
        let (chunks, scores, probs, rows_lse) = self.chunks(sh, per)?;
        for c in &chunks {
            self.chunk_probs(c, qkv, scores, probs, rows_lse)?;
            self.chunk_values(c, qkv, out, probs)?;
            // The rows' log-sum-exps, head by head (one run when the chunk is whole sequences).
            let runs = if c.rows == sh.s { 1 } else { sh.heads };
            let len = sh.heads * c.rows / runs;
            for n in 0..runs {
                let at = (c.b * sh.heads + n) * sh.s + c.q0;
                self.copy(lse.offset(at), rows_lse.offset(n * c.rows), len)?;
            }
        }
        Ok(())
    }

    /// The fused forward as one kernel on tensor cores ([`Op::FlashForward`]; the s×s matrix
    /// stays in registers): `qkv` in bf16 (cast when it is in fp32 workspace), a warp per 16
    /// query rows of a head, the rows' log-sum-exps through workspace into `lse` (which may be
    /// a 16-bit model's saved region at a 2-byte offset); `qkv` 4-byte aligned
    /// ([`Gpu::aligned_operand`]).
    fn flash_forward(
        &self,
        sh: &Shape,
        qkv: DevPtr,
        out: DevPtr,
        lse: DevPtr,
    ) -> Result<(), DeviceError> {
        let qkv = self.aligned_operand(qkv, sh.b * sh.s * sh.width())?;
        let rows = sh.b * sh.heads * sh.s;
        let rows_lse = self.alloc(rows)?;
        let shape = flash_shape(sh);
        let args = [T(qkv), T(out), T(rows_lse)];
        self.run(Op::FlashForward(shape), shape.warps(sh.b), &args)?;
        self.copy(lse, rows_lse, rows)
    }

    /// The fused attention both ways on `qkv` (bf16) and the output gradient `dout` (fp32):
    /// the tensor-core kernels into `out[0]`, `lse[0]` and `dqkv[0]`, the chunked path (cuBLAS
    /// products and the softmax kernels) into `out[1]`, `lse[1]` and `dqkv[1]`. What a GPU
    /// checks the kernels against (`step::check_flash_attention`).
    #[cfg(feature = "cuda")]
    pub(super) fn flash_and_chunks(
        &self,
        sh: &Shape,
        (qkv, dout): (DevPtr, DevPtr),
        out: [DevPtr; 2],
        lse: [DevPtr; 2],
        dqkv: [DevPtr; 2],
    ) -> Result<(), DeviceError> {
        let per = chunk_rows(sh);
        self.flash_forward(sh, qkv, out[0], lse[0])?;
        self.reset();
        self.flash_backward(sh, (qkv, out[0], lse[0]), dout, dqkv[0])?;
        self.reset();
        self.chunked_forward((sh, per), qkv, out[1], lse[1])?;
        self.reset();
        self.chunked_backward((sh, per), qkv, dout, dqkv[1])?;
        self.reset();
        Ok(())
    }

    /// The fused attention's backward from the forward's `out` and `lse` (what it kept): the
    /// tensor-core kernels where they apply ([`Gpu::flash_backward`]), else chunk by chunk on
    /// the recomputed probabilities (the forward's bits: the same products and softmax),
    /// [`Gpu::chunk_backward`] with dP in the scores' place and dS in the product dtype over the
    /// probabilities. `dqkv` is overwritten.
    pub(super) fn fused_attention_backward(
        &self,
        (sh, per): (&Shape, usize),
        (qkv, out, lse): (DevPtr, DevPtr, DevPtr),
        dout: DevPtr,
        dqkv: DevPtr,
    ) -> Result<(), DeviceError> {
        let kernels = self.attention_kernels && flash::supports_backward(self.products, sh.d);
        if kernels && dqkv.storage == Storage::F32 {
            return self.flash_backward(sh, (qkv, out, lse), dout, dqkv);
        }
        self.chunked_backward((sh, per), qkv, dout, dqkv)
    }

    /// The fused backward on tensor cores (FlashAttention-2's): each row's `D = Σ dO·O`
    /// ([`Op::FlashDot`]), then dQ by 16 query rows ([`Op::FlashBackwardQuery`]) and dK, dV by
    /// 16 keys ([`Op::FlashBackwardKeys`]), each recomputing P from the kept log-sum-exps; the
    /// operands in bf16 (cast when in fp32 workspace), every element of the fp32 `dqkv` written
    /// once.
    fn flash_backward(
        &self,
        sh: &Shape,
        (qkv, out, lse): (DevPtr, DevPtr, DevPtr),
        dout: DevPtr,
        dqkv: DevPtr,
    ) -> Result<(), DeviceError> {
        let shape = flash_shape(sh);
        let (tokens, rows) = (sh.b * sh.s, sh.b * sh.heads * sh.s);
        let q = self.aligned_operand(qkv, tokens * sh.width())?;
        let d_o = self.aligned_operand(dout, tokens * sh.hidden())?;
        let (rows_lse, dot) = (self.alloc(rows)?, self.alloc(rows)?);
        self.copy(rows_lse, lse, rows)?;
        self.run(Op::FlashDot(shape), rows, &[T(dout), T(out), T(dot)])?;
        let args = [T(q), T(d_o), T(rows_lse), T(dot), T(dqkv)];
        self.run(Op::FlashBackwardQuery(shape), shape.warps(sh.b), &args)?;
        self.run(Op::FlashBackwardKeys(shape), shape.key_warps(sh.b), &args)
    }

    /// [`Gpu::fused_attention_backward`] chunk by chunk of `per` query rows.
    fn chunked_backward(
        &self,
        (sh, per): (&Shape, usize),
        qkv: DevPtr,
        dout: DevPtr,
        dqkv: DevPtr,
    ) -> Result<(), DeviceError> {
        self.fill(dqkv, sh.b * sh.s * sh.width(), 0.0)?;
        let (chunks, scores, probs, rows_lse) = self.chunks(sh, per)?;
        for c in &chunks {
            self.chunk_probs(c, qkv, scores, probs, rows_lse)?;
            self.chunk_backward(c, qkv, dout, dqkv, probs, scores, probs)?;
        }
        Ok(())
    }
}

impl Device for Gpu<'_> {
    type Ptr = DevPtr;
    type Tokens = DevAddr;

    fn alloc(&self, n: usize) -> Result<DevPtr, DeviceError> {
        let at = self.used.get();
        // 64-float alignment keeps every piece 256-byte aligned for cuBLAS.
        let next = at + n.div_ceil(64) * 64;
        if next > self.ws_len {
            return Err(DeviceError::Workspace {
                needed: next,
                available: self.ws_len,
            });
        }
        self.used.set(next);
        Ok(DevPtr::f32(self.ws_base.add_bytes(at as u64 * F)))
    }

    fn reset(&self) {
        self.used.set(0);
    }

    fn tokens(&self, m: u32, targets: bool) -> Result<DevAddr, DeviceError> {
        let t = self.consts.t as u64;
        Ok(self
            .consts
            .tokens
            .add_bytes((2 * u64::from(m) + u64::from(targets)) * t * 4))
    }

    /// Every region is computed on in place, in its own dtype (fp32 at a 2-byte boundary as
    /// halves); `None` only for one misaligned for its dtype.
    fn view(&self, at: u64, dtype: Dtype, _n: usize) -> Result<Option<DevPtr>, DeviceError> {
        Ok(Storage::at(dtype, at).map(|s| DevPtr::new(self.arena_base.add_bytes(at), s)))
    }

    /// A saved region in place: each segment in its own storage ([`DevPtr::saved`]).
    fn view_saved(
        &self,
        at: u64,
        model: Dtype,
        segments: &[Segment],
    ) -> Result<Option<DevPtr>, DeviceError> {
        Ok(DevPtr::saved(
            self.arena_base.add_bytes(at),
            at,
            model,
            segments,
        ))
    }

    fn load(&self, at: u64, dtype: Dtype, dst: DevPtr, n: usize) -> Result<(), DeviceError> {
        let src = self.arena(at, dtype)?;
        self.stage(Staged::Load, dst, src, n, dtype)
    }

    fn store(
        &self,
        src: DevPtr,
        at: u64,
        dtype: Dtype,
        n: usize,
        accumulate: bool,
    ) -> Result<(), DeviceError> {
        let dst = self.arena(at, dtype)?;
        let what = if accumulate {
            Staged::AddStore
        } else {
            Staged::Store
        };
        self.stage(what, dst, src, n, dtype)
    }

    fn load_f32(&self, at: u64, dst: DevPtr, n: usize) -> Result<(), DeviceError> {
        self.load(at, Dtype::Fp32, dst, n)
    }

    fn store_f32(&self, src: DevPtr, at: u64, n: usize) -> Result<(), DeviceError> {
        self.store(src, at, Dtype::Fp32, n, false)
    }

    fn copy_arena(&self, dst: u64, src: u64, bytes: u64) -> Result<(), DeviceError> {
        let b = self.arena_base;
        self.copy_bytes(b.add_bytes(dst), b.add_bytes(src), bytes as usize)
    }

    fn fill(&self, p: DevPtr, n: usize, v: f32) -> Result<(), DeviceError> {
        self.run(Op::Fill, n, &[T(p), Arg::F(v)])
    }

    /// A byte copy between the same representation (fp32 and fp32 halves are the same bytes),
    /// else a conversion rounding once to `dst`'s storage.
    fn copy(&self, dst: DevPtr, src: DevPtr, n: usize) -> Result<(), DeviceError> {
        let (d, s) = (dst.storage, src.storage);
        if d == s || (d.bytes() == 4 && s.bytes() == 4) {
            return self.copy_bytes(dst.addr, src.addr, n * d.bytes() as usize);
        }
        self.convert(dst, src, n)
    }

    /// A no-op where `p`'s storage already rounds to `prec` (its values were rounded when
    /// written).
    fn round(&self, prec: Precision, p: DevPtr, n: usize) -> Result<(), DeviceError> {
        if p.storage.rounds_to(prec) {
            return Ok(());
        }
        let to = dtype_of(prec);
        self.run(Op::Round { to }, n, &[T(p)])
    }

    fn linear_rows(
        &self,
        l: Linear<DevPtr>,
        bias: Option<DevPtr>,
        (y, ld): (DevPtr, usize),
        beta: f32,
    ) -> Result<(), DeviceError> {
        if aligned_ld(ld, y.storage) == ld {
            for (c0, n) in aligned_parts(l.out, y.storage) {
                let bias = bias.map(|b| b.offset(c0));
                self.linear_in_place(l.columns(c0, n), bias, (y.offset(c0), ld), beta)?;
            }
            return Ok(());
        }
        if bias.is_some() {
            return self.linear_in_place(l, bias, (y, ld), beta);
        }
        let Linear { x, w, t, inp, out } = l;
        // Rows that do not start 16 bytes aligned: y's columns a block at a time
        // (`column_blocks`) are computed into rows of `cols` in workspace and copied into y.
        let (cols, rows) = Self::column_blocks(t, aligned_ld(out, y.storage), y.storage);
        let block = self.alloc_as(y.storage, rows * cols)?;
        for c0 in (0..out).step_by(cols) {
            let width = cols.min(out - c0);
            let (wb, wide) = self.weight_rows(w, c0, width, inp, y.storage)?;
            for r0 in (0..t).step_by(rows) {
                let n = rows.min(t - r0);
                let y = y.offset(r0 * ld + c0);
                if beta != 0.0 {
                    self.copy_rows((block, cols), (y, ld), width, n)?;
                }
                let part = Linear {
                    x: x.offset(r0 * inp),
                    w: wb,
                    t: n,
                    inp,
                    out: wide,
                };
                self.linear_in_place(part, None, (block, cols), beta)?;
                self.copy_rows((y, ld), (block, cols), width, n)?;
            }
        }
        Ok(())
    }

    fn linear_backward_rows(
        &self,
        l: Linear<DevPtr>,
        dy: (DevPtr, usize),
        dw: DevPtr,
        dbias: Option<DevPtr>,
        dx: Option<(DevPtr, f32)>,
    ) -> Result<(), DeviceError> {
        self.linear_backward_after(None, l, dy, Some(dw), dbias, dx)
    }

    fn linear_backward_input_rows(
        &self,
        l: Linear<DevPtr>,
        dy: (DevPtr, usize),
        dx: (DevPtr, f32),
    ) -> Result<(), DeviceError> {
        self.linear_backward_after(None, l, dy, None, None, Some(dx))
    }

    /// GELU's backward in the bias gradient's pass over dy where there is one (`Op::BiasGrad`
    /// with `gelu`: the fp32 gradient read once, not written and read again).
    fn gelu_linear_backward(
        &self,
        pre: DevPtr,
        l: Linear<DevPtr>,
        dy: DevPtr,
        dw: DevPtr,
        dbias: Option<DevPtr>,
        dx: Option<(DevPtr, f32)>,
    ) -> Result<(), DeviceError> {
        self.linear_backward_after(Some(pre), l, (dy, l.out), Some(dw), dbias, dx)
    }

    fn norm_forward(&self, n: &NormOperands<'_, DevPtr>, out: DevPtr) -> Result<(), DeviceError> {
        let NormOperands {
            np,
            params,
            t,
            h,
            x,
            stats,
        } = *n;

        let op = Op::Norm {
            norm: np.kind,
            width: h as u32,
            bias: np.b.is_some(),
            eps: NormEps::new(np.eps),
        };
        let mut args = vec![T(x), T(params.at(&np.w))];
        args.extend(np.b.as_ref().map(|r| T(params.at(r))));
        args.extend([T(out), T(stats)]);
        self.run(op, t, &args)
    }

    fn norm_backward(
        &self,
        n: &NormOperands<'_, DevPtr>,
        dy: DevPtr,
        dx: Option<(DevPtr, DevPtr)>,
        grads: DevPtr,
    ) -> Result<(), DeviceError> {
        let NormOperands {
            np, t, h, x, stats, ..
        } = *n;

        let op = Op::NormBackwardParams {
            width: h as u32,
            bias: np.b.is_some(),
        };
        let mut args = vec![T(x), T(stats), T(dy), T(grads.at(&np.w))];
        args.extend(np.b.as_ref().map(|r| T(grads.at(r))));
        args.push(Arg::L(t as i64));
        self.run(op, h, &args)?;
        match dx {
            Some(dx) => self.norm_backward_input(n, dy, dx),
            None => Ok(()),
        }
    }

    /// `norm_backward`'s second kernel alone (`Op::NormBackwardInput`).
    fn norm_backward_input(
        &self,
        n: &NormOperands<'_, DevPtr>,
        dy: DevPtr,
        (dx, base): (DevPtr, DevPtr),
    ) -> Result<(), DeviceError> {
        let NormOperands {
            np,
            params,
            t,
            h,
            x,
            stats,
        } = *n;
        let op = Op::NormBackwardInput {
            norm: np.kind,
            width: h as u32,
        };
        let w = params.at(&np.w);
        self.run(op, t, &[T(x), T(w), T(stats), T(dy), T(base), T(dx)])
    }

    fn gelu(&self, pre: DevPtr, post: DevPtr, n: usize) -> Result<(), DeviceError> {
        self.run(Op::Gelu, n, &[T(pre), T(post)])
    }

    fn gelu_backward(&self, pre: DevPtr, d: DevPtr, n: usize) -> Result<(), DeviceError> {
        self.run(Op::GeluBackward, n, &[T(d), T(pre)])
    }

    fn swiglu(&self, gate: DevPtr, up: DevPtr, prod: DevPtr, n: usize) -> Result<(), DeviceError> {
        self.run(Op::SwiGlu, n, &[T(gate), T(up), T(prod)])
    }

    fn swiglu_backward(
        &self,
        gate: DevPtr,
        up: DevPtr,
        dgate: DevPtr,
        dup: DevPtr,
        n: usize,
    ) -> Result<(), DeviceError> {
        let op = Op::SwiGluBackward { cast: false };
        self.run(op, n, &[T(dgate), T(dup), T(gate), T(up)])
    }

    /// A 16-bit model's two gradients written once in the product dtype (`Op::SwiGluBackward`
    /// with `cast`), the two halves of `spare`, where the products would otherwise cast each
    /// fp32 one in a pass of its own.
    fn swiglu_backward_cast(
        &self,
        gate: DevPtr,
        up: DevPtr,
        dprod: DevPtr,
        spare: DevPtr,
        n: usize,
    ) -> Result<Option<[DevPtr; 2]>, DeviceError> {
        let products = Storage::of(self.products);
        if products == Storage::F32 {
            return Ok(None);
        }
        let dgate = DevPtr::new(spare.addr, products);
        let dup = dgate.offset(n);
        let op = Op::SwiGluBackward { cast: true };
        self.run(op, n, &[T(dprod), T(dup), T(gate), T(up), T(dgate)])?;
        Ok(Some([dgate, dup]))
    }

    /// Rotates `src` in place where it is fp32 (the layer math's workspace: the projected qkv,
    /// or the gradient), then, when `src` is not `qkv`, copies it into `qkv` rounded once.
    fn rope(
        &self,
        bp: &BlockP,
        t: usize,
        src: DevPtr,
        qkv: DevPtr,
        inverse: bool,
    ) -> Result<(), DeviceError> {
        let Some(r) = &bp.rope else { return Ok(()) };
        let tables = self
            .consts
            .rope
            .ok_or_else(|| plan_error("no rotary tables on the device"))?;
        let sh = &bp.shape;
        let op = sh.rotary_op(inverse);
        let sin = tables.add_bytes((sh.s * r.half) as u64 * F);
        self.run(op, t, &[T(src), Arg::P(tables), Arg::P(sin)])?;
        if src.addr != qkv.addr {
            self.copy(qkv, src, t * sh.width())?;
        }
        Ok(())
    }

    /// `flash`: by chunks of query rows ([`Gpu::fused_attention`]), keeping each row's
    /// log-sum-exp. `naive` (which keeps the probabilities): each sequence one chunk, its
    /// softmax written straight into the kept probabilities.
    fn attention(
        &self,
        bp: &BlockP,
        act: Precision,
        qkv: DevPtr,
        out: DevPtr,
        keep: Keep<DevPtr>,
    ) -> Result<(), DeviceError> {
        let sh = &bp.shape;
        let probs = match keep {
            Keep::Lse(lse) => return self.fused_attention((sh, chunk_rows(sh)), qkv, out, lse),
            Keep::Probs(p) => p,
        };
        // Each sequence a chunk of all its rows, its probabilities kept (rounded to the
        // activation precision, as the CPU keeps them) and read in place by P·V.
        let s = sh.s;
        let scores = self.alloc(sh.heads * s * s)?;
        let lse = self.alloc(sh.heads * s)?;
        for b in 0..sh.b {
            let c = Chunk::whole(sh, b);
            let kept = probs.offset(b * sh.heads * s * s);
            self.chunk_probs(&c, qkv, scores, kept, lse)?;
            self.round(act, kept, sh.heads * s * s)?;
            self.chunk_values(&c, qkv, out, kept)?;
        }
        Ok(())
    }

    /// `flash`: [`Gpu::fused_attention_backward`]. `naive`: each sequence one chunk, on the
    /// kept probabilities in place.
    fn attention_backward(
        &self,
        bp: &BlockP,
        (qkv, out): (DevPtr, DevPtr),
        keep: Keep<DevPtr>,
        dout: DevPtr,
        dqkv: DevPtr,
    ) -> Result<(), DeviceError> {
        let sh = &bp.shape;
        let kept = match keep {
            Keep::Lse(lse) => {
                let chunked = (sh, chunk_rows(sh));
                return self.fused_attention_backward(chunked, (qkv, out, lse), dout, dqkv);
            }
            Keep::Probs(p) => p,
        };
        // Each sequence a chunk of all its rows, on the kept probabilities in place (dS in fp32
        // beside them: they stay as the forward kept them).
        let s = sh.s;
        self.fill(dqkv, sh.b * s * sh.width(), 0.0)?;
        let dp = self.alloc(sh.heads * s * s)?;
        for b in 0..sh.b {
            let c = Chunk::whole(sh, b);
            let kept = kept.offset(b * sh.heads * s * s);
            self.chunk_backward(&c, qkv, dout, dqkv, kept, dp, dp)?;
        }
        Ok(())
    }

    fn embedding(
        &self,
        at: &Lookup<DevAddr>,
        wte: DevPtr,
        wpe: Option<DevPtr>,
        out: DevPtr,
    ) -> Result<(), DeviceError> {
        let Lookup {
            tokens,
            vocab,
            h,
            s,
            t,
        } = *at;

        let op = Op::Embedding {
            vocab: vocab as u32,
            width: h as u32,
            seq_len: s as u32,
            positions: wpe.is_some(),
        };
        let mut args = vec![Arg::P(tokens), T(wte)];
        args.extend(wpe.map(T));
        args.push(T(out));
        self.run(op, t * h, &args)
    }

    fn embedding_backward(
        &self,
        at: &Lookup<DevAddr>,
        dy: DevPtr,
        dwte: DevPtr,
        dwpe: Option<DevPtr>,
    ) -> Result<(), DeviceError> {
        let Lookup {
            tokens,
            vocab,
            h,
            s,
            t,
        } = *at;

        let op = Op::EmbeddingBackward {
            vocab: vocab as u32,
            width: h as u32,
            seq_len: s as u32,
            positions: dwpe.is_some(),
        };
        let mut args = vec![Arg::P(tokens), T(dy), T(dwte)];
        args.extend(dwpe.map(T));
        args.push(Arg::L(t as i64));
        self.run(op, h, &args)
    }

    /// Each row's loss into workspace, then their sum (in order, in f64) added to the rank's
    /// loss accumulator, as the host device sums them.
    fn cross_entropy(
        &self,
        logits: &Logits<DevPtr>,
        targets: DevAddr,
        grad: DevPtr,
    ) -> Result<(), DeviceError> {
        let Logits {
            z: logits,
            vocab,
            stride,
            rows: n,
        } = *logits;

        let rows = self.alloc(n)?;
        let op = Op::CrossEntropy {
            vocab: vocab as u32,
            stride: stride as u32,
        };
        let inv = Arg::F(1.0 / n as f32);
        self.run(op, n, &[T(logits), Arg::P(targets), T(grad), T(rows), inv])?;
        let acc = Arg::P(self.consts.loss);
        self.run(Op::AddLoss, 1, &[T(rows), acc, Arg::L(n as i64)])
    }

    /// The gradient scale into workspace (from the stored sum of squares on the device when
    /// clipping, so the host never waits for it), then the optimizer kernel: Adam in one launch
    /// per [`Update::adam_launches`] (one for a layer's shard), as the host device runs it.
    /// Adam stores the parameter in the pass that updates the master (`Op::Adam` with
    /// `param`); SGD's is converted after.
    fn update(
        &self,
        u: &Update<'_>,
        state: DevPtr,
        grad: DevPtr,
        param: Option<DevPtr>,
    ) -> Result<(), DeviceError> {
        let (cfg, n) = (u.cfg, u.n);
        let scale = self.alloc(1)?;
        match u.clip {
            Some((s, clip)) => {
                let sq = self.arena(s.at, s.dtype)?;
                let args = [T(sq), T(scale), Arg::D(u.contributions), Arg::D(clip)];
                self.run(Op::GradScale, 1, &args)?;
            }
            None => self.fill(scale, 1, (1.0 / u.contributions) as f32)?,
        }
        if cfg.kind == Optimizer::Sgd {
            let args = [T(state), T(grad), T(scale), Arg::F(cfg.lr)];
            self.run(Op::Sgd, n, &args)?;
            return param.map_or(Ok(()), |p| self.copy(p, state, n));
        }
        let (m, v) = (state.offset(n), state.offset(2 * n));
        let scalars = u.adam_scalars()?;
        let op = Op::Adam {
            param: param.is_some(),
        };
        for launch in u.adam_launches() {
            let i = launch.elements.start;
            let tensors = [state, m, v, grad].map(|t| T(t.offset(i)));
            let args: Vec<Arg> = tensors
                .into_iter()
                .chain(param.map(|p| T(p.offset(i))))
                .chain([T(scale)])
                .chain(scalars.map(Arg::F))
                .chain(launch.bounds().map(Arg::L))
                .collect();
            self.run(op, launch.elements.len(), &args)?;
        }
        Ok(())
    }

    /// Each gradient's sums of squares per [`SUMSQ_CHUNK`] elements (in f64, read in place in
    /// its dtype) into workspace, added in order to the rank's accumulator, which is then
    /// stored as one value.
    fn grad_norm(&self, grads: &[ArenaSpan], out: ArenaSpan) -> Result<(), DeviceError> {
        let acc = self.consts.sumsq;
        // Zeroed on this stream before the sums (a step may hold several grad_norm ops only on
        // one stream, in order).
        self.fill(DevPtr::f32(acc), 2, 0.0)?;
        let most = grads.iter().map(|g| g.elements.div_ceil(SUMSQ_CHUNK)).max();
        let partial = self.alloc(2 * most.unwrap_or(0))?.addr;
        for g in grads {
            let v = self.arena(g.at, g.dtype)?;
            let chunks = g.elements.div_ceil(SUMSQ_CHUNK);
            let n = Arg::L(g.elements as i64);
            self.run(Op::SumSquares, chunks, &[T(v), Arg::P(partial), n])?;
            let args = [Arg::P(partial), Arg::P(acc), Arg::L(chunks as i64)];
            self.run(Op::AddPartials, 1, &args)?;
        }
        let dst = self.arena(out.at, out.dtype)?;
        self.run(Op::StoreDouble, 1, &[Arg::P(acc), T(dst)])
    }
}

/// A CUDA error as the device layer carries it (opaque, named `GPU`).
fn gpu_error(e: super::enqueue::CudaError) -> DeviceError {
    DeviceError::backend("GPU", e)
}
