//! The device layer's primitives on a GPU stream: kernel launches of `kernels.cu` and cuBLAS
//! products over typed device pointers ([`crate::device::Device`] for [`Gpu`], [`DevPtr`]).
//! Every region of the arena is computed on in place in its own dtype ([`Device::view`],
//! [`Device::view_saved`]): kernels read any storage and round once where they store, and a
//! 16-bit model's products take operands stored in its dtype in place and write C in its
//! storage. The stream's f32 workspace holds the layer math's fp32 intermediates, the
//! parameter gradient and product casts; `Device::load`/`store` (the `stage` kernels) remain
//! for what the device layer still stages (gradient parts, the optimizer's 16-bit parameter
//! copy). The layer math and each op's reads and writes are the device layer's, shared with
//! the CPU.
//! Built everywhere (it only enqueues through [`Exec`]), so the host emulation in the tests runs
//! it; on a GPU it runs inside [`super::CudaBackend`].
#![cfg_attr(not(feature = "cuda"), allow(dead_code))]

use super::enqueue::{
    elems, m, mt, prec_code, row_major, rows, ColMajor, DevAddr, Exec, Grid, A, M,
};
use super::typed::{DevPtr, Storage};
use crate::device::{plan_error, ArenaSpan, Device, DeviceError, Ptr, Update};
use crate::math::attention::Keep;
use crate::math::{BlockP, NormP, Precision, Segment};
use schedc::job::{Attention, Dtype, Norm, Optimizer};
use std::cell::Cell;

/// Device addresses of a rank's constants: the batch tokens, the loss and sum-of-squares
/// accumulators, rotary tables, decay ranges.
pub struct Consts {
    /// i32 tokens: [micro_step][inputs | targets] of T each.
    pub tokens: DevAddr,
    /// One f64: the step's loss sum on this rank.
    pub loss: DevAddr,
    /// One f64: the gradient norm's sum of squares.
    pub sumsq: DevAddr,
    /// cos then sin tables (fp32), seq_len × head_dim/2 each.
    pub rope: Option<DevAddr>,
    /// Per layer: (pointer to i64 [start, end) pairs, count).
    pub decay: Vec<(DevAddr, usize)>,
    /// Tokens per micro-batch.
    pub t: usize,
}

/// One stream of one rank: where to enqueue ([`Exec`]), its fp32 workspace (a bump pointer
/// reset after each op, over the scratch the plan carves for the stream out of the arena:
/// `memory::StreamMemory`), where the rank's arena starts, the rank's constants, and the dtype its
/// matrix products run in (the model's: a 16-bit model's products run on tensor cores).
pub struct Gpu<'a> {
    pub x: &'a dyn Exec,
    pub products: Dtype,
    pub ws_base: DevAddr,
    pub ws_len: usize,
    pub used: Cell<usize>,
    pub arena_base: DevAddr,
    pub consts: &'a Consts,
}

const F: u64 = 4;

/// The widest attention head the fused kernels accumulate in shared memory (`MAX_HEAD_DIM` of
/// `kernels.cu`).
const MAX_HEAD_DIM: usize = 256;

/// The elements a column-major operand of `rows` × `cols` (columns `ld` apart, `batch` of them
/// `stride` apart) spans.
fn span(rows: usize, cols: usize, ld: usize, stride: usize, batch: usize) -> usize {
    if rows == 0 || cols == 0 {
        return 0;
    }
    (batch - 1) * stride + (cols - 1) * ld + rows
}

/// One argument of a `kernels.cu` launch as this file writes it: a typed tensor is one
/// argument, [`Arg::T`], which the kernels take as two (its address, then its storage code);
/// the others are the raw kernel arguments of [`A`]. [`flatten`] turns a list into the
/// kernel's, in [`Gpu::launch`]. Launches read `&[T(x), T(y), Arg::L(n)]`.
#[derive(Clone, Copy, Debug)]
enum Arg {
    /// A typed tensor: `A::P(addr), A::I(code)` in the kernel's list.
    T(DevPtr),
    P(DevAddr),
    L(i64),
    I(i32),
    F(f32),
    D(f64),
}
// A tensor is written `T(x)` in the argument lists.
use Arg::T;

/// The kernel's argument list of `args`: each tensor as its address and storage code, in
/// place; every other argument as it is.
fn flatten(args: &[Arg]) -> Vec<A> {
    let mut out = Vec::with_capacity(2 * args.len());
    for &arg in args {
        match arg {
            Arg::T(x) => out.extend([A::P(x.addr), A::I(x.code())]),
            Arg::P(p) => out.push(A::P(p)),
            Arg::L(v) => out.push(A::L(v)),
            Arg::I(v) => out.push(A::I(v)),
            Arg::F(v) => out.push(A::F(v)),
            Arg::D(v) => out.push(A::D(v)),
        }
    }
    out
}

impl Gpu<'_> {
    /// Launches `name` as a grid-stride loop over `n` elements.
    fn run(&self, name: &str, n: usize, args: &[Arg]) -> Result<(), DeviceError> {
        self.launch(name, elems(n), args)
    }

    /// Launches `name` with one block per row, `r` rows.
    fn run_rows(&self, name: &str, r: usize, args: &[Arg]) -> Result<(), DeviceError> {
        self.launch(name, rows(r), args)
    }

    /// Launches `name` on `grid` with the kernel's arguments of `args` (see [`flatten`]).
    fn launch(&self, name: &str, grid: Grid, args: &[Arg]) -> Result<(), DeviceError> {
        self.x
            .launch(name, grid, &flatten(args))
            .map_err(DeviceError::Gpu)
    }

    /// The arena's bytes at `at` as elements of `dtype`, in place.
    fn arena(&self, at: u64, dtype: Dtype) -> Result<DevPtr, DeviceError> {
        let storage = Storage::at(dtype, at).ok_or_else(|| {
            DeviceError::Access(format!("{dtype:?} at arena byte {at} is misaligned"))
        })?;
        Ok(DevPtr::new(self.arena_base.add_bytes(at), storage))
    }

    /// Row-major C[rows × cols] ← α·op(A)·op(B) + β·C (see [`row_major`]).
    #[allow(clippy::too_many_arguments)]
    fn gemm(
        &self,
        rows: usize,
        cols: usize,
        k: usize,
        alpha: f32,
        a: M,
        b: M,
        beta: f32,
        c: DevPtr,
        ldc: usize,
    ) -> Result<(), DeviceError> {
        self.batched(rows, cols, k, alpha, a, 0, b, 0, beta, c, ldc, 0, 1)
    }

    #[allow(clippy::too_many_arguments)]
    fn batched(
        &self,
        rows: usize,
        cols: usize,
        k: usize,
        alpha: f32,
        a: M,
        stride_a: usize,
        b: M,
        stride_b: usize,
        beta: f32,
        c: DevPtr,
        ldc: usize,
        stride_c: usize,
        batch: usize,
    ) -> Result<(), DeviceError> {
        let call = row_major(
            rows, cols, k, alpha, a, stride_a, b, stride_b, beta, c.addr, ldc, stride_c, batch,
        );
        // Column-major A is the row-major B and the other way round.
        self.product(call, b.ptr.storage, a.ptr.storage, c.storage, None)
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
        r.map_err(DeviceError::Gpu)?;
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
        let to = Storage::of(self.products);
        let dst = self.alloc((n as u64 * to.bytes()).div_ceil(F) as usize)?;
        self.copy(DevPtr::new(dst.addr, to), DevPtr::new(p, storage), n)?;
        Ok(dst.addr)
    }

    /// y[r][c] += b[c] for `t` rows of `w`.
    fn bias_add(&self, y: DevPtr, b: DevPtr, t: usize, w: usize) -> Result<(), DeviceError> {
        self.run(
            "bias_add",
            t * w,
            &[T(y), T(b), Arg::L(t as i64), Arg::L(w as i64)],
        )
    }

    fn copy_bytes(&self, dst: DevAddr, src: DevAddr, bytes: usize) -> Result<(), DeviceError> {
        if bytes == 0 {
            return Ok(());
        }
        self.x.copy_bytes(dst, src, bytes).map_err(DeviceError::Gpu)
    }

    /// `n` elements from `src` to `dst`, each rounded once to `dst`'s storage (the layer
    /// math's copies between storages and the products' operand casts).
    fn convert(&self, dst: DevPtr, src: DevPtr, n: usize) -> Result<(), DeviceError> {
        if n == 0 {
            return Ok(());
        }
        self.run("convert", n, &[T(src), T(dst), Arg::L(n as i64)])
    }
}

fn norm_code(k: Norm) -> i32 {
    match k {
        Norm::LayerNorm => 0,
        Norm::RmsNorm => 1,
    }
}

/// The fused attention kernels' launch: query rows, key rows, then their scalar arguments
/// (sequence length, qkv row width, heads, kv heads, head width, scale). The kernels accumulate
/// a row in shared memory, so the head width is at most [`MAX_HEAD_DIM`].
#[allow(clippy::type_complexity)]
fn flash_shape(bp: &BlockP) -> Result<(usize, usize, i64, i64, i32, i32, i32, f32), DeviceError> {
    let sh = &bp.shape;
    if sh.d > MAX_HEAD_DIM {
        return Err(plan_error(format!(
            "fused attention takes heads of at most {MAX_HEAD_DIM} (this one: {})",
            sh.d
        )));
    }
    Ok((
        sh.b * sh.heads * sh.s,
        sh.b * sh.kv_heads * sh.s,
        sh.s as i64,
        sh.width() as i64,
        sh.heads as i32,
        sh.kv_heads as i32,
        sh.d as i32,
        sh.scale(),
    ))
}

fn or_null(p: Option<DevPtr>) -> DevPtr {
    p.unwrap_or(DevPtr::NULL)
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
        self.run("stage", n, &[T(src), T(dst), Arg::L(n as i64)])
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
        if accumulate {
            return self.run("stage_add", n, &[T(src), T(dst), Arg::L(n as i64)]);
        }
        self.run("stage", n, &[T(src), T(dst), Arg::L(n as i64)])
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
        self.run("fill", n, &[T(p), Arg::F(v), Arg::L(n as i64)])
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
        self.run(
            "round_in_place",
            n,
            &[T(p), Arg::I(prec_code(prec)), Arg::L(n as i64)],
        )
    }

    fn linear(
        &self,
        x: DevPtr,
        w: DevPtr,
        bias: Option<DevPtr>,
        y: DevPtr,
        t: usize,
        inp: usize,
        out: usize,
        beta: f32,
    ) -> Result<(), DeviceError> {
        let call = row_major(
            t,
            out,
            inp,
            1.0,
            m(x, inp),
            0,
            mt(w, inp),
            0,
            beta,
            y.addr,
            out,
            0,
            1,
        );
        self.product(call, w.storage, x.storage, y.storage, bias)
    }

    fn linear_backward(
        &self,
        x: DevPtr,
        w: DevPtr,
        dy: DevPtr,
        dw: DevPtr,
        dbias: Option<DevPtr>,
        dx: Option<(DevPtr, f32)>,
        t: usize,
        inp: usize,
        out: usize,
    ) -> Result<(), DeviceError> {
        self.gemm(out, inp, t, 1.0, mt(dy, out), m(x, inp), 1.0, dw, inp)?;
        if let Some(db) = dbias {
            self.run(
                "col_sums",
                out,
                &[T(dy), Arg::L(t as i64), Arg::L(out as i64), T(db)],
            )?;
        }
        if let Some((dx, beta)) = dx {
            self.gemm(t, inp, out, 1.0, m(dy, out), m(w, inp), beta, dx, inp)?;
        }
        Ok(())
    }

    fn norm_forward(
        &self,
        np: &NormP,
        params: DevPtr,
        t: usize,
        h: usize,
        x: DevPtr,
        out: DevPtr,
        stats: DevPtr,
    ) -> Result<(), DeviceError> {
        let b = or_null(np.b.as_ref().map(|r| params.at(r)));
        let w = params.at(&np.w);
        self.run_rows(
            "norm_forward",
            t,
            &[
                Arg::I(norm_code(np.kind)),
                T(x),
                T(w),
                T(b),
                T(out),
                T(stats),
                Arg::L(h as i64),
            ],
        )
    }

    fn norm_backward(
        &self,
        np: &NormP,
        params: DevPtr,
        t: usize,
        h: usize,
        x: DevPtr,
        stats: DevPtr,
        dy: DevPtr,
        dx: Option<DevPtr>,
        grads: DevPtr,
    ) -> Result<(), DeviceError> {
        let db = or_null(np.b.as_ref().map(|r| grads.at(r)));
        let dw = grads.at(&np.w);
        self.run(
            "norm_backward_params",
            h,
            &[
                T(x),
                T(stats),
                T(dy),
                T(dw),
                T(db),
                Arg::L(t as i64),
                Arg::L(h as i64),
            ],
        )?;
        if let Some(dx) = dx {
            let w = params.at(&np.w);
            self.run_rows(
                "norm_backward_input",
                t,
                &[
                    Arg::I(norm_code(np.kind)),
                    T(x),
                    T(w),
                    T(stats),
                    T(dy),
                    T(dx),
                    Arg::L(h as i64),
                ],
            )?;
        }
        Ok(())
    }

    fn gelu(&self, pre: DevPtr, post: DevPtr, n: usize) -> Result<(), DeviceError> {
        self.run("gelu_forward", n, &[T(pre), T(post), Arg::L(n as i64)])
    }

    fn gelu_backward(&self, pre: DevPtr, d: DevPtr, n: usize) -> Result<(), DeviceError> {
        self.run("gelu_backward", n, &[T(pre), T(d), Arg::L(n as i64)])
    }

    fn swiglu(&self, gate: DevPtr, up: DevPtr, prod: DevPtr, n: usize) -> Result<(), DeviceError> {
        self.run(
            "swiglu_forward",
            n,
            &[T(gate), T(up), T(prod), Arg::L(n as i64)],
        )
    }

    fn swiglu_backward(
        &self,
        gate: DevPtr,
        up: DevPtr,
        dgate: DevPtr,
        dup: DevPtr,
        n: usize,
    ) -> Result<(), DeviceError> {
        self.run(
            "swiglu_backward",
            n,
            &[T(gate), T(up), T(dgate), T(dup), Arg::L(n as i64)],
        )
    }

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
        let (s, half) = (sh.s, r.half);
        let copied = if src.addr == qkv.addr {
            0
        } else {
            sh.kv_heads * 2 * half
        };
        let n = t * ((sh.heads + sh.kv_heads) * half + copied);
        self.run(
            "rope",
            n,
            &[
                T(src),
                T(qkv),
                Arg::P(tables),
                Arg::P(tables.add_bytes((s * half) as u64 * F)),
                Arg::L(t as i64),
                Arg::L(s as i64),
                Arg::L(sh.width() as i64),
                Arg::I(sh.heads as i32),
                Arg::I(sh.kv_heads as i32),
                Arg::I(half as i32),
                Arg::I(i32::from(inverse)),
            ],
        )
    }

    /// `flash`: the fused kernel, one block per query row, never storing the s×s matrix.
    /// `naive` (which keeps the probabilities): for every (sequence, head), [heads][s][s]
    /// blocks of one sequence at a time; the query heads of one kv group share K and V (stride 0
    /// in a strided-batched product).
    fn attention(
        &self,
        bp: &BlockP,
        act: Precision,
        qkv: DevPtr,
        out: DevPtr,
        keep: Keep<DevPtr>,
    ) -> Result<(), DeviceError> {
        if let Keep::Lse(lse) = keep {
            let (rows, _, s, w, h, kv, d, scale) = flash_shape(bp)?;
            return self.run_rows(
                "flash_forward",
                rows,
                &[
                    T(qkv),
                    T(out),
                    T(lse),
                    Arg::L(s),
                    Arg::L(w),
                    Arg::I(h),
                    Arg::I(kv),
                    Arg::I(d),
                    Arg::F(scale),
                ],
            );
        }
        let keep = keep.into_inner();
        let sh = &bp.shape;
        let (s, w, h, d) = (sh.s, sh.width(), sh.heads * sh.d, sh.d);
        let r = sh.heads / sh.kv_heads;
        let scale = sh.scale();
        let probs = self.alloc(sh.heads * s * s)?;
        for b in 0..sh.b {
            for grp in 0..sh.kv_heads {
                let n0 = grp * r;
                let (q, k, _) = sh.offsets(b, n0);
                let (q, k) = (m(qkv.offset(q), w), mt(qkv.offset(k), w));
                let c = probs.offset(n0 * s * s);
                self.batched(s, s, d, scale, q, d, k, 0, 0.0, c, s, s * s, r)?;
            }
            let (lse_ptr, prec) = match bp.attention {
                Attention::Flash => (keep.offset(b * sh.heads * s), 0),
                Attention::Naive => (DevPtr::NULL, prec_code(act)),
            };
            self.run_rows(
                "causal_softmax",
                sh.heads * s,
                &[T(probs), T(lse_ptr), Arg::L(s as i64), Arg::I(prec)],
            )?;
            if bp.attention == Attention::Naive {
                let n = sh.heads * s * s;
                self.copy(keep.offset(b * n), probs, n)?;
            }
            for grp in 0..sh.kv_heads {
                let n0 = grp * r;
                let (_, _, v) = sh.offsets(b, n0);
                let p = m(probs.offset(n0 * s * s), s);
                let c = out.offset(b * s * h + n0 * d);
                self.batched(
                    s,
                    d,
                    s,
                    1.0,
                    p,
                    s * s,
                    m(qkv.offset(v), w),
                    0,
                    0.0,
                    c,
                    h,
                    d,
                    r,
                )?;
            }
        }
        Ok(())
    }

    /// `flash`: two fused kernels, the query side (dQ and each row's rowsum(P∘dP)) then the key
    /// side (dK, dV over the group's heads), each block owning the rows it writes. `naive`: dK
    /// and dV of a kv group sum over its query heads, so those products run head by head (β = 1)
    /// rather than batched.
    fn attention_backward(
        &self,
        bp: &BlockP,
        qkv: DevPtr,
        keep: Keep<DevPtr>,
        dout: DevPtr,
        dqkv: DevPtr,
    ) -> Result<(), DeviceError> {
        if let Keep::Lse(lse) = keep {
            let (rows, key_rows, s, w, h, kv, d, scale) = flash_shape(bp)?;
            let dsum = self.alloc(rows)?;
            self.run_rows(
                "flash_backward_dq",
                rows,
                &[
                    T(qkv),
                    T(dout),
                    T(lse),
                    T(dsum),
                    T(dqkv),
                    Arg::L(s),
                    Arg::L(w),
                    Arg::I(h),
                    Arg::I(kv),
                    Arg::I(d),
                    Arg::F(scale),
                ],
            )?;
            return self.run_rows(
                "flash_backward_dkv",
                key_rows,
                &[
                    T(qkv),
                    T(dout),
                    T(lse),
                    T(dsum),
                    T(dqkv),
                    Arg::L(s),
                    Arg::L(w),
                    Arg::I(h),
                    Arg::I(kv),
                    Arg::I(d),
                    Arg::F(scale),
                ],
            );
        }
        let kept = keep.into_inner();
        let sh = &bp.shape;
        let (s, w, h, d) = (sh.s, sh.width(), sh.heads * sh.d, sh.d);
        let scale = sh.scale();
        self.fill(dqkv, sh.b * s * w, 0.0)?;
        let p = self.alloc(s * s)?;
        let dp = self.alloc(s * s)?;
        for b in 0..sh.b {
            for n in 0..sh.heads {
                let (q, k, v) = sh.offsets(b, n);
                let (q_m, k_m, v_m) = (qkv.offset(q), qkv.offset(k), qkv.offset(v));
                let bh = b * sh.heads + n;
                match bp.attention {
                    Attention::Naive => self.copy(p, kept.offset(bh * s * s), s * s)?,
                    Attention::Flash => {
                        self.gemm(s, s, d, scale, m(q_m, w), mt(k_m, w), 0.0, p, s)?;
                        let lse = kept.offset(bh * s);
                        self.run(
                            "probs_from_lse",
                            s * s,
                            &[T(p), T(lse), Arg::L(s as i64), Arg::L(s as i64)],
                        )?;
                    }
                }
                let d_o = dout.offset(b * s * h + n * d);
                // dV += Pᵀ·dO
                self.gemm(s, d, s, 1.0, mt(p, s), m(d_o, h), 1.0, dqkv.offset(v), w)?;
                // dP = dO·Vᵀ; dS = P ∘ (dP − rowsum(P ∘ dP)) · scale
                self.gemm(s, s, d, 1.0, m(d_o, h), mt(v_m, w), 0.0, dp, s)?;
                self.run_rows(
                    "softmax_backward",
                    s,
                    &[T(p), T(dp), Arg::L(s as i64), Arg::F(scale)],
                )?;
                // dQ = dS·K; dK += dSᵀ·Q
                self.gemm(s, d, s, 1.0, m(dp, s), m(k_m, w), 0.0, dqkv.offset(q), w)?;
                self.gemm(s, d, s, 1.0, mt(dp, s), m(q_m, w), 1.0, dqkv.offset(k), w)?;
            }
        }
        Ok(())
    }

    fn embedding(
        &self,
        tokens: DevAddr,
        _vocab: usize,
        h: usize,
        s: usize,
        wte: DevPtr,
        wpe: Option<DevPtr>,
        out: DevPtr,
        t: usize,
    ) -> Result<(), DeviceError> {
        let wpe = or_null(wpe);
        self.run(
            "embedding_forward",
            t * h,
            &[
                Arg::P(tokens),
                T(wte),
                T(wpe),
                T(out),
                Arg::L(t as i64),
                Arg::L(h as i64),
                Arg::L(s as i64),
            ],
        )
    }

    fn embedding_backward(
        &self,
        tokens: DevAddr,
        _vocab: usize,
        h: usize,
        s: usize,
        dy: DevPtr,
        dwte: DevPtr,
        dwpe: Option<DevPtr>,
        t: usize,
    ) -> Result<(), DeviceError> {
        let dwpe = or_null(dwpe);
        self.run(
            "embedding_backward",
            h,
            &[
                Arg::P(tokens),
                T(dy),
                T(dwte),
                T(dwpe),
                Arg::L(t as i64),
                Arg::L(h as i64),
                Arg::L(s as i64),
            ],
        )
    }

    fn cross_entropy(
        &self,
        logits: DevPtr,
        targets: DevAddr,
        vocab: usize,
        n: usize,
        grad: DevPtr,
    ) -> Result<(), DeviceError> {
        self.run_rows(
            "cross_entropy",
            n,
            &[
                T(logits),
                Arg::P(targets),
                Arg::L(vocab as i64),
                Arg::L(n as i64),
                T(grad),
                Arg::P(self.consts.loss),
            ],
        )
    }

    fn update(&self, u: &Update<'_>, state: DevPtr, grad: DevPtr) -> Result<(), DeviceError> {
        let cfg = u.cfg;
        let (sq, clip) = match u.clip {
            Some((s, clip)) => (self.arena(s.at, s.dtype)?, clip),
            None => (DevPtr::NULL, 0.0),
        };
        let n = u.n as i64;
        if cfg.kind == Optimizer::Sgd {
            return self.run(
                "sgd",
                u.n,
                &[
                    T(state),
                    T(grad),
                    Arg::L(n),
                    T(sq),
                    Arg::D(u.contributions),
                    Arg::D(clip),
                    Arg::F(cfg.lr),
                ],
            );
        }
        let bc1 = 1.0 - f64::from(cfg.beta1).powf(u.step as f64);
        let bc2 = 1.0 - f64::from(cfg.beta2).powf(u.step as f64);
        let (decay, ranges) = self.consts.decay[u.layer];
        let decays = cfg.kind == Optimizer::AdamW && cfg.weight_decay != 0.0;
        self.run(
            "adam",
            u.n,
            &[
                T(state),
                T(grad),
                Arg::L(n),
                Arg::L(u.first as i64),
                Arg::P(decay),
                Arg::I(ranges as i32),
                Arg::I(i32::from(decays)),
                T(sq),
                Arg::D(u.contributions),
                Arg::D(clip),
                Arg::F(cfg.beta1),
                Arg::F(cfg.beta2),
                Arg::F(cfg.eps),
                Arg::F((f64::from(cfg.lr) / bc1) as f32),
                Arg::F(bc2.sqrt() as f32),
                Arg::F(1.0 - cfg.lr * cfg.weight_decay),
            ],
        )
    }

    /// The sums of squares read every gradient in place, in its dtype.
    fn grad_norm(&self, grads: &[ArenaSpan], out: ArenaSpan) -> Result<(), DeviceError> {
        let acc = self.consts.sumsq;
        // Zeroed on this stream before the sums (a step may hold several grad_norm ops only on
        // one stream, in order).
        self.fill(DevPtr::f32(acc), 2, 0.0)?;
        for g in grads {
            let v = self.arena(g.at, g.dtype)?;
            let n = g.elements as i64;
            self.run("sum_squares", g.elements, &[T(v), Arg::L(n), Arg::P(acc)])?;
        }
        let dst = self.arena(out.at, out.dtype)?;
        self.run("store_double", 1, &[Arg::P(acc), T(dst)])
    }
}
