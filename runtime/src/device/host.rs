//! The host device: the primitives on this machine's memory, for the CPU backend (one per rank
//! and stream, over the rank's [`Arena`]) and for [`crate::math::LayerMath`]'s slice interface
//! (no arena). Each primitive is the function of [`crate::math`] that the CPU math has always
//! used, so the results are the same bits; element-wise bodies run through
//! [`crate::math::ops::wide`] (AVX2 where the processor has it, same results).
//!
//! Workspace comes from a pool of vectors kept between ops and steps: an allocation takes a
//! vector off the free list and parks it on the used list until [`Device::reset`], so its
//! address is stable while the op runs and steady-state steps allocate nothing.

use super::{
    plan_error, ArenaSpan, Device, DeviceError, Linear, Logits, Lookup, NormOperands, Ptr, Update,
};
use crate::arena::Arena;
use crate::math::attention::{self, Keep};
use crate::math::gemm::{linear, linear_backward, linear_backward_input, Product};
use crate::math::ops::{
    gelu, gelu_grad, norm_backward, norm_forward, prefetched, sigmoid, wide, NormRows,
};
use crate::math::saved::Piece;
use crate::math::{cross_entropy, optimizer_step, BlockP, Precision};
use crate::step::Batch;
use sched_ir::job::Dtype;
use std::cell::{Cell, RefCell};

use super::kernels::{Arg, Kernels};
use sched_ir::job::Optimizer;
use sched_kernels::{NormEps, Op};

/// f32 values in host memory, by address.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HostPtr(*mut f32);

impl Default for HostPtr {
    fn default() -> Self {
        HostPtr(std::ptr::NonNull::dangling().as_ptr())
    }
}

impl Piece for HostPtr {
    fn split(self, n: usize) -> (Self, Self) {
        (self, self.offset(n))
    }
}

impl Ptr for HostPtr {
    fn offset(self, n: usize) -> Self {
        HostPtr(self.0.wrapping_add(n))
    }
}

impl HostPtr {
    /// The start of a slice the device reads and writes.
    pub fn of(v: &mut [f32]) -> Self {
        HostPtr(v.as_mut_ptr())
    }

    /// The start of a slice the device only reads (the layer math never writes an input).
    pub fn read_only(v: &[f32]) -> Self {
        HostPtr(v.as_ptr().cast_mut())
    }

    fn arg(self) -> Arg {
        Arg::Ptr(self.0)
    }

    /// # Safety
    /// `n` values from here lie in one live allocation, and no `&mut` view overlaps them.
    unsafe fn r<'a>(self, n: usize) -> &'a [f32] {
        std::slice::from_raw_parts(self.0, n)
    }

    /// # Safety
    /// `n` values from here lie in one live allocation that nothing else views meanwhile.
    #[allow(clippy::mut_from_ref)]
    unsafe fn w<'a>(self, n: usize) -> &'a mut [f32] {
        std::slice::from_raw_parts_mut(self.0, n)
    }
}

/// Token ids in host memory.
#[derive(Clone, Copy, Debug)]
pub struct HostTokens(*const u32);

impl HostTokens {
    pub fn of(v: &[u32]) -> Self {
        HostTokens(v.as_ptr())
    }

    /// # Safety
    /// `n` ids from here lie in one live allocation.
    unsafe fn get<'a>(self, n: usize) -> &'a [u32] {
        std::slice::from_raw_parts(self.0, n)
    }
}

/// One stream of one rank on the host (or, without an arena, the slice interface).
pub struct Host<'a> {
    arena: Option<&'a Arena>,
    /// The rank's micro-batches of this step.
    batches: &'a [Batch],
    free: RefCell<Vec<Vec<f32>>>,
    used: RefCell<Vec<Vec<f32>>>,
    loss: Cell<f64>,
    /// The sums of squares `grad_norm` computed since the last [`Host::take_sumsq`].
    sumsq: Cell<Option<f64>>,
    /// The Rust math or the generated kernels, chosen when the device is made.
    kernels: Kernels,
}

thread_local! {
    static POOL: RefCell<Vec<Vec<f32>>> = const { RefCell::new(Vec::new()) };
}

impl<'a> Host<'a> {
    /// A device over `arena` reading `batches`, with workspace vectors kept from earlier steps.
    pub fn new(arena: &'a Arena, batches: &'a [Batch], pool: Vec<Vec<f32>>) -> Self {
        Host {
            arena: Some(arena),
            batches,
            free: RefCell::new(pool),
            used: RefCell::new(vec![]),
            loss: Cell::new(0.0),
            sumsq: Cell::new(None),
            kernels: Kernels::chosen(),
        }
    }

    /// A device without an arena, over caller-owned slices, for `f`; its workspace is this
    /// thread's pool.
    pub(crate) fn with_slices<R>(f: impl FnOnce(&Host<'_>) -> R) -> R {
        let pool = POOL.with(|p| std::mem::take(&mut *p.borrow_mut()));
        let host = Host {
            arena: None,
            batches: &[],
            free: RefCell::new(pool),
            used: RefCell::new(vec![]),
            loss: Cell::new(0.0),
            sumsq: Cell::new(None),
            kernels: Kernels::chosen(),
        };
        let out = f(&host);
        host.reset();
        let pool = host.into_pool();
        POOL.with(|p| *p.borrow_mut() = pool);
        out
    }

    /// The loss added by cross-entropy since the last call.
    pub fn take_loss(&self) -> f64 {
        self.loss.replace(0.0)
    }

    /// The sum of squares `grad_norm` computed since the last call (f64, before it is stored
    /// in the plan's fp32 `clip.sumsq`), `None` when it did not run.
    pub fn take_sumsq(&self) -> Option<f64> {
        self.sumsq.take()
    }

    /// The workspace vectors, for the next step.
    pub fn into_pool(self) -> Vec<Vec<f32>> {
        let mut v = self.free.into_inner();
        v.extend(self.used.into_inner());
        v
    }

    fn arena(&self) -> Result<&Arena, DeviceError> {
        self.arena
            .ok_or_else(|| plan_error("the host device has no arena here"))
    }
}

fn check_token(tok: u32, vocab: usize) -> Result<usize, DeviceError> {
    let t = tok as usize;
    if t < vocab {
        Ok(t)
    } else {
        Err(DeviceError::Token { token: tok, vocab })
    }
}

// SAFETY (every `unsafe` block below): pointers come from `alloc` (live until `reset`, which
// runs after the op), from caller slices that outlive the call (`with_slices`), or from the
// rank's batches; the layer math passes disjoint runs as a primitive's inputs and outputs, except
// where a primitive is documented to work in place on one run.
impl Device for Host<'_> {
    type Ptr = HostPtr;
    type Tokens = HostTokens;

    fn alloc(&self, n: usize) -> Result<HostPtr, DeviceError> {
        // Best fit: the shortest free vector that holds `n`, else the longest, grown. Vectors
        // are never shrunk, so steady steps neither reallocate nor zero anything (the values
        // are stale: workspace contents are unspecified, and the layer math overwrites or fills
        // what it reads).
        let mut free = self.free.borrow_mut();
        let fit = (0..free.len())
            .filter(|&i| free[i].len() >= n)
            .min_by_key(|&i| free[i].len())
            .or_else(|| (0..free.len()).max_by_key(|&i| free[i].len()));
        let mut v = fit.map(|i| free.swap_remove(i)).unwrap_or_default();
        drop(free);
        if v.len() < n {
            // A fresh buffer rather than a grown one: the old values need not move, and the new
            // one can start on huge pages (`crate::pages`).
            v = crate::pages::zeroed(n);
        }
        let p = HostPtr::of(&mut v);
        // Moving the vector moves only its header: the values stay where `p` points.
        self.used.borrow_mut().push(v);
        Ok(p)
    }

    fn reset(&self) {
        let mut used = self.used.borrow_mut();
        self.free.borrow_mut().extend(used.drain(..));
    }

    fn tokens(&self, m: u32, targets: bool) -> Result<HostTokens, DeviceError> {
        let b = self
            .batches
            .get(m as usize)
            .ok_or_else(|| plan_error(format!("no batch for micro-step {m}")))?;
        Ok(HostTokens::of(if targets { &b.targets } else { &b.inputs }))
    }

    fn view(&self, at: u64, dtype: Dtype, n: usize) -> Result<Option<HostPtr>, DeviceError> {
        match (self.arena, dtype) {
            (Some(a), Dtype::Fp32) => Ok(a.view_f32(at, n)?.map(HostPtr)),
            _ => Ok(None),
        }
    }

    fn load(&self, at: u64, dtype: Dtype, dst: HostPtr, n: usize) -> Result<(), DeviceError> {
        let out = unsafe { dst.w(n) };
        self.arena()?
            .read_into(at, dtype, out)
            .map_err(DeviceError::from)
    }

    fn store(
        &self,
        src: HostPtr,
        at: u64,
        dtype: Dtype,
        n: usize,
        accumulate: bool,
    ) -> Result<(), DeviceError> {
        let v = unsafe { src.r(n) };
        let a = self.arena()?;
        if accumulate {
            a.add(at, dtype, v)
        } else {
            a.write(at, dtype, v)
        }
        .map_err(DeviceError::from)
    }

    fn load_f32(&self, at: u64, dst: HostPtr, n: usize) -> Result<(), DeviceError> {
        let h = self.arena()?.read_bytes(at, 4 * n as u64)?;
        let out = unsafe { dst.w(n) };
        for (x, p) in out.iter_mut().zip(h.chunks_exact(2)) {
            *x = f32::from_bits(u32::from(p[0]) | (u32::from(p[1]) << 16));
        }
        Ok(())
    }

    fn store_f32(&self, src: HostPtr, at: u64, n: usize) -> Result<(), DeviceError> {
        let halves: Vec<u16> = unsafe { src.r(n) }
            .iter()
            .flat_map(|x| {
                let b = x.to_bits();
                [b as u16, (b >> 16) as u16]
            })
            .collect();
        self.arena()?
            .write_bytes(at, &halves)
            .map_err(DeviceError::from)
    }

    fn copy_arena(&self, dst: u64, src: u64, bytes: u64) -> Result<(), DeviceError> {
        let a = self.arena()?;
        let h = a.read_bytes(src, bytes)?;
        a.write_bytes(dst, &h).map_err(DeviceError::from)
    }

    fn fill(&self, p: HostPtr, n: usize, v: f32) -> Result<(), DeviceError> {
        unsafe { p.w(n) }.fill(v);
        Ok(())
    }

    fn copy(&self, dst: HostPtr, src: HostPtr, n: usize) -> Result<(), DeviceError> {
        if n > 0 {
            unsafe { dst.w(n) }.copy_from_slice(unsafe { src.r(n) });
        }
        Ok(())
    }

    fn round(&self, prec: Precision, p: HostPtr, n: usize) -> Result<(), DeviceError> {
        prec.round(unsafe { p.w(n) });
        Ok(())
    }

    fn linear_rows(
        &self,
        l: Linear<HostPtr>,
        bias: Option<HostPtr>,
        (y, ld): (HostPtr, usize),
        beta: f32,
    ) -> Result<(), DeviceError> {
        let Linear { t, out, .. } = l;
        if self.kernels.generated() {
            if bias.is_some() && ld != out {
                return Err(plan_error("a bias added to rows wider than the product"));
            }
            unsafe { linear(product(&l), None, (y.w(t * ld), ld), beta) };
            let Some(b) = bias else { return Ok(()) };
            let op = Op::BiasAdd { width: out as u32 };
            return self
                .kernels
                .run(op, &[y.arg(), b.arg()], t * out)
                .unwrap_or(Ok(()));
        }
        wide(
            #[inline(always)]
            || unsafe {
                let b = bias.map(|b| b.r(out));
                linear(product(&l), b, (y.w(t * ld), ld), beta)
            },
        );
        Ok(())
    }

    fn linear_backward_rows(
        &self,
        l: Linear<HostPtr>,
        (dy, ld): (HostPtr, usize),
        dw: HostPtr,
        dbias: Option<HostPtr>,
        dx: Option<(HostPtr, f32)>,
    ) -> Result<(), DeviceError> {
        let Linear { t, inp, out, .. } = l;
        if let (true, Some(db)) = (self.kernels.generated(), dbias) {
            if ld != out {
                return Err(plan_error("a bias gradient of rows wider than the product"));
            }
            self.generated_bias_grad(&l, dy, db, None)?;
            return self.linear_backward(l, dy, dw, None, dx);
        }
        wide(
            #[inline(always)]
            || unsafe {
                linear_backward(
                    product(&l),
                    (dy.r(t * ld), ld),
                    dw.w(out * inp),
                    dbias.map(|b| b.w(out)),
                    dx.map(|(p, beta)| (p.w(t * inp), beta)),
                )
            },
        );
        Ok(())
    }

    fn linear_backward_input_rows(
        &self,
        l: Linear<HostPtr>,
        (dy, ld): (HostPtr, usize),
        (dx, beta): (HostPtr, f32),
    ) -> Result<(), DeviceError> {
        let Linear { t, inp, .. } = l;
        wide(
            #[inline(always)]
            || unsafe {
                linear_backward_input(weight_only(&l), (dy.r(t * ld), ld), (dx.w(t * inp), beta))
            },
        );
        Ok(())
    }

    /// With the generated kernels, GELU's backward in the bias gradient's pass over dy, the
    /// kernel the CUDA device runs (`Op::BiasGrad` with `gelu`), then the products.
    fn gelu_linear_backward(
        &self,
        pre: HostPtr,
        l: Linear<HostPtr>,
        dy: HostPtr,
        dw: HostPtr,
        dbias: Option<HostPtr>,
        dx: Option<(HostPtr, f32)>,
    ) -> Result<(), DeviceError> {
        if let (true, Some(db)) = (self.kernels.generated(), dbias) {
            self.generated_bias_grad(&l, dy, db, Some(pre))?;
            return self.linear_backward(l, dy, dw, None, dx);
        }
        self.gelu_backward(pre, dy, l.t * l.out)?;
        self.linear_backward(l, dy, dw, dbias, dx)
    }

    fn norm_forward(&self, n: &NormOperands<'_, HostPtr>, out: HostPtr) -> Result<(), DeviceError> {
        let NormOperands {
            np,
            params,
            t,
            h,
            x,
            stats,
        } = *n;

        if self.kernels.generated() {
            let op = Op::Norm {
                norm: np.kind,
                width: h as u32,
                bias: np.b.is_some(),
                eps: NormEps::new(np.eps),
            };
            let mut args = vec![x.arg(), params.at(&np.w).arg()];
            args.extend(np.b.as_ref().map(|r| params.at(r).arg()));
            args.extend([out.arg(), stats.arg()]);
            if let Some(r) = self.kernels.run(op, &args, t) {
                return r;
            }
        }
        wide(
            #[inline(always)]
            || unsafe {
                let b = np.b.as_ref().map(|r| params.at(r).r(h));
                let w = params.at(&np.w).r(h);
                norm_forward(
                    np.kind,
                    np.eps,
                    h,
                    x.r(t * h),
                    w,
                    b,
                    out.w(t * h),
                    stats.w(2 * t),
                )
            },
        );
        Ok(())
    }

    fn norm_backward(
        &self,
        n: &NormOperands<'_, HostPtr>,
        dy: HostPtr,
        dx: Option<(HostPtr, HostPtr)>,
        grads: HostPtr,
    ) -> Result<(), DeviceError> {
        let NormOperands {
            np,
            params,
            t,
            h,
            x,
            stats,
        } = *n;

        if self.kernels.generated() {
            let width = h as u32;
            let op = Op::NormBackwardParams {
                width,
                bias: np.b.is_some(),
            };
            let mut args = vec![x.arg(), stats.arg(), dy.arg(), grads.at(&np.w).arg()];
            args.extend(np.b.as_ref().map(|r| grads.at(r).arg()));
            args.push(Arg::I64(t as i64));
            self.kernels.run(op, &args, h).unwrap_or(Ok(()))?;
            if let Some((dx, base)) = dx {
                let op = Op::NormBackwardInput {
                    norm: np.kind,
                    width,
                };
                let w = params.at(&np.w);
                let args = [
                    x.arg(),
                    w.arg(),
                    stats.arg(),
                    dy.arg(),
                    base.arg(),
                    dx.arg(),
                ];
                self.kernels.run(op, &args, t).unwrap_or(Ok(()))?;
            }
            return Ok(());
        }
        wide(
            #[inline(always)]
            || unsafe {
                let w = params.at(&np.w).r(h);
                let db = np.b.as_ref().map(|r| grads.at(r).w(h));
                let rows = NormRows {
                    kind: np.kind,
                    h,
                    x: x.r(t * h),
                    w,
                    stats: stats.r(2 * t),
                };
                norm_backward(
                    rows,
                    dy.r(t * h),
                    // The base read as its own slice only where it is not `out` (in place).
                    dx.map(|(out, base)| (out.w(t * h), (base != out).then(|| base.r(t * h)))),
                    grads.at(&np.w).w(h),
                    db,
                )
            },
        );
        Ok(())
    }

    /// The generated kernels' input-gradient kernel (`Op::NormBackwardInput`, the second of
    /// `norm_backward`'s); the Rust math's `norm_backward` with its parameter gradients summed
    /// into scratch (its input gradient is computed from the same values in the same order).
    fn norm_backward_input(
        &self,
        n: &NormOperands<'_, HostPtr>,
        dy: HostPtr,
        (dx, base): (HostPtr, HostPtr),
    ) -> Result<(), DeviceError> {
        let NormOperands {
            np,
            params,
            t,
            h,
            x,
            stats,
        } = *n;

        if self.kernels.generated() {
            let op = Op::NormBackwardInput {
                norm: np.kind,
                width: h as u32,
            };
            let w = params.at(&np.w);
            let args = [
                x.arg(),
                w.arg(),
                stats.arg(),
                dy.arg(),
                base.arg(),
                dx.arg(),
            ];
            return self.kernels.run(op, &args, t).unwrap_or(Ok(()));
        }
        let scratch = self.alloc(h)?;
        wide(
            #[inline(always)]
            || unsafe {
                let rows = NormRows {
                    kind: np.kind,
                    h,
                    x: x.r(t * h),
                    w: params.at(&np.w).r(h),
                    stats: stats.r(2 * t),
                };
                let base = (base != dx).then(|| base.r(t * h));
                norm_backward(
                    rows,
                    dy.r(t * h),
                    Some((dx.w(t * h), base)),
                    scratch.w(h),
                    None,
                )
            },
        );
        Ok(())
    }

    fn gelu(&self, pre: HostPtr, post: HostPtr, n: usize) -> Result<(), DeviceError> {
        if let Some(r) = self.kernels.run(Op::Gelu, &[pre.arg(), post.arg()], n) {
            return r;
        }
        wide(
            #[inline(always)]
            || unsafe {
                for (y, &x) in post.w(n).iter_mut().zip(pre.r(n)) {
                    *y = gelu(x);
                }
            },
        );
        Ok(())
    }

    fn gelu_backward(&self, pre: HostPtr, d: HostPtr, n: usize) -> Result<(), DeviceError> {
        if let Some(r) = self.kernels.run(Op::GeluBackward, &[d.arg(), pre.arg()], n) {
            return r;
        }
        wide(
            #[inline(always)]
            || unsafe {
                let (d, pre) = (d.w(n), pre.r(n));
                prefetched(
                    n,
                    [d.as_ptr(), pre.as_ptr()],
                    // Inlined, so that it is compiled for `wide`'s vectors.
                    #[inline(always)]
                    |lo, hi| {
                        for (d, &x) in d[lo..hi].iter_mut().zip(&pre[lo..hi]) {
                            *d *= gelu_grad(x);
                        }
                    },
                );
            },
        );
        Ok(())
    }

    fn swiglu(
        &self,
        gate: HostPtr,
        up: HostPtr,
        prod: HostPtr,
        n: usize,
    ) -> Result<(), DeviceError> {
        if let Some(r) = self
            .kernels
            .run(Op::SwiGlu, &[gate.arg(), up.arg(), prod.arg()], n)
        {
            return r;
        }
        wide(
            #[inline(always)]
            || unsafe {
                for ((y, &g), &u) in prod.w(n).iter_mut().zip(gate.r(n)).zip(up.r(n)) {
                    *y = g * sigmoid(g) * u;
                }
            },
        );
        Ok(())
    }

    fn swiglu_backward(
        &self,
        gate: HostPtr,
        up: HostPtr,
        dgate: HostPtr,
        dup: HostPtr,
        n: usize,
    ) -> Result<(), DeviceError> {
        if self.kernels.generated() {
            let args = [dgate.arg(), dup.arg(), gate.arg(), up.arg()];
            if let Some(r) = self
                .kernels
                .run(Op::SwiGluBackward { cast: false }, &args, n)
            {
                return r;
            }
        }
        wide(
            #[inline(always)]
            || unsafe {
                let rows = dgate.w(n).iter_mut().zip(dup.w(n));
                for (((dg, du), &x), &u) in rows.zip(gate.r(n)).zip(up.r(n)) {
                    let sg = sigmoid(x);
                    let dprod = *dg;
                    *du = dprod * x * sg;
                    *dg = dprod * u * sg * (1.0 + x * (1.0 - sg));
                }
            },
        );
        Ok(())
    }

    fn rope(
        &self,
        bp: &BlockP,
        t: usize,
        src: HostPtr,
        qkv: HostPtr,
        inverse: bool,
    ) -> Result<(), DeviceError> {
        let Some(rope) = &bp.rope else { return Ok(()) };
        let sh = &bp.shape;
        if src != qkv {
            self.copy(qkv, src, t * sh.width())?;
        }
        if self.kernels.generated() {
            let op = sh.rotary_op(inverse);
            let (cos, sin) = (Arg::Ptr(rope.cos.as_ptr()), Arg::Ptr(rope.sin.as_ptr()));
            if let Some(r) = self.kernels.run(op, &[qkv.arg(), cos, sin], t) {
                return r;
            }
        }
        let (h, kv) = (sh.hidden(), sh.kv_heads * sh.d);
        let rows = unsafe { qkv.w(t * sh.width()) };
        for (i, row) in rows.chunks_exact_mut(sh.width()).enumerate() {
            let pos = i % sh.s;
            rope.apply(&mut row[..h], sh.heads, pos, inverse);
            rope.apply(&mut row[h..h + kv], sh.kv_heads, pos, inverse);
        }
        Ok(())
    }

    fn attention(
        &self,
        bp: &BlockP,
        act: Precision,
        qkv: HostPtr,
        out: HostPtr,
        keep: Keep<HostPtr>,
    ) -> Result<(), DeviceError> {
        let sh = &bp.shape;
        let t = sh.b * sh.s;
        let scratch = self.alloc(sh.scratch())?;
        unsafe {
            let keep = match keep {
                Keep::Probs(p) => Keep::Probs(p.w(sh.heads * t * sh.s)),
                Keep::Lse(p) => Keep::Lse(p.w(sh.heads * t)),
            };
            let (x, o) = (qkv.r(t * sh.width()), out.w(t * sh.hidden()));
            attention::forward(sh, x, o, keep, act, scratch.w(sh.scratch()));
        }
        Ok(())
    }

    fn attention_backward(
        &self,
        bp: &BlockP,
        (qkv, _): (HostPtr, HostPtr),
        keep: Keep<HostPtr>,
        dout: HostPtr,
        dqkv: HostPtr,
    ) -> Result<(), DeviceError> {
        let sh = &bp.shape;
        let t = sh.b * sh.s;
        let scratch = self.alloc(2 * sh.scratch())?;
        unsafe {
            let keep = match keep {
                Keep::Probs(p) => Keep::Probs(p.r(sh.heads * t * sh.s)),
                Keep::Lse(p) => Keep::Lse(p.r(sh.heads * t)),
            };
            attention::backward(
                sh,
                qkv.r(t * sh.width()),
                keep,
                dout.r(t * sh.hidden()),
                dqkv.w(t * sh.width()),
                scratch.w(2 * sh.scratch()),
            );
        }
        Ok(())
    }

    fn embedding(
        &self,
        at: &Lookup<HostTokens>,
        wte: HostPtr,
        wpe: Option<HostPtr>,
        out: HostPtr,
    ) -> Result<(), DeviceError> {
        let Lookup {
            tokens,
            vocab,
            h,
            s,
            t,
        } = *at;

        let (tokens, out) = unsafe { (tokens.get(t), out.w(t * h)) };
        for (i, (&tok, row)) in tokens.iter().zip(out.chunks_exact_mut(h)).enumerate() {
            let tok = check_token(tok, vocab)?;
            row.copy_from_slice(unsafe { wte.offset(tok * h).r(h) });
            if let Some(wpe) = wpe {
                let pos = unsafe { wpe.offset((i % s) * h).r(h) };
                row.iter_mut().zip(pos).for_each(|(y, &v)| *y += v);
            }
        }
        Ok(())
    }

    fn embedding_backward(
        &self,
        at: &Lookup<HostTokens>,
        dy: HostPtr,
        dwte: HostPtr,
        dwpe: Option<HostPtr>,
    ) -> Result<(), DeviceError> {
        let Lookup {
            tokens,
            vocab,
            h,
            s,
            t,
        } = *at;

        let (tokens, dy) = unsafe { (tokens.get(t), dy.r(t * h)) };
        for (i, (&tok, row)) in tokens.iter().zip(dy.chunks_exact(h)).enumerate() {
            let tok = check_token(tok, vocab)?;
            let d = unsafe { dwte.offset(tok * h).w(h) };
            d.iter_mut().zip(row).for_each(|(a, &v)| *a += v);
            if let Some(dwpe) = dwpe {
                let d = unsafe { dwpe.offset((i % s) * h).w(h) };
                d.iter_mut().zip(row).for_each(|(a, &v)| *a += v);
            }
        }
        Ok(())
    }

    fn cross_entropy(
        &self,
        logits: &Logits<HostPtr>,
        targets: HostTokens,
        grad: HostPtr,
    ) -> Result<(), DeviceError> {
        let Logits {
            z: logits,
            vocab,
            stride,
            rows: n,
        } = *logits;

        let targets = unsafe { targets.get(n) };
        if let Some(&bad) = targets.iter().find(|&&t| t as usize >= vocab) {
            return Err(DeviceError::Token { token: bad, vocab });
        }
        if self.kernels.generated() {
            let rows = self.alloc(n)?;
            let op = Op::CrossEntropy {
                vocab: vocab as u32,
                stride: stride as u32,
            };
            let args = [
                logits.arg(),
                Arg::Tokens(targets.as_ptr()),
                grad.arg(),
                rows.arg(),
                Arg::F32(1.0 / n as f32),
            ];
            self.kernels.run(op, &args, n).unwrap_or(Ok(()))?;
            let loss: f64 = unsafe { rows.r(n) }.iter().map(|&l| f64::from(l)).sum();
            self.loss.set(self.loss.get() + loss);
            return Ok(());
        }
        let (z, dz) = unsafe { (logits.r(n * stride), grad.w(n * stride)) };
        let loss = cross_entropy(z, targets, vocab, stride, dz);
        self.loss.set(self.loss.get() + loss);
        Ok(())
    }

    fn update(
        &self,
        u: &Update<'_>,
        state: HostPtr,
        grad: HostPtr,
        param: Option<HostPtr>,
    ) -> Result<(), DeviceError> {
        let factor = match u.clip {
            Some((s, clip)) => {
                let mut v = [0f32];
                self.arena()?.read_into(s.at, s.dtype, &mut v)?;
                let norm = f64::from(v[0]).sqrt() / u.contributions;
                (clip / (norm + 1e-6)).min(1.0)
            }
            None => 1.0,
        };
        let scale = (factor / u.contributions) as f32;
        self.step_shard(u, scale, state, grad)?;
        param.map_or(Ok(()), |p| self.copy(p, state, u.n))
    }

    fn grad_norm(&self, grads: &[ArenaSpan], out: ArenaSpan) -> Result<(), DeviceError> {
        let a = self.arena()?;
        let mut total = 0.0f64;
        for g in grads {
            let v = self.alloc(g.elements)?;
            let v = unsafe { v.w(g.elements) };
            a.read_into(g.at, g.dtype, v)?;
            total += v.iter().map(|x| f64::from(*x) * f64::from(*x)).sum::<f64>();
        }
        self.sumsq
            .set(Some(self.sumsq.get().unwrap_or(0.0) + total));
        a.write(out.at, out.dtype, &[total as f32])
            .map_err(DeviceError::from)
    }
}

impl Host<'_> {
    /// The optimizer step on the shard's state with the gradient scaled by `scale`: the
    /// generated kernels where they run, else the Rust math.
    fn step_shard(
        &self,
        u: &Update<'_>,
        scale: f32,
        state: HostPtr,
        grad: HostPtr,
    ) -> Result<(), DeviceError> {
        if self.kernels.generated() {
            return self.generated_update(u, scale, state, grad);
        }
        let (st, g) = unsafe { (state.w(u.cfg.state_per_param() * u.n), grad.r(u.n)) };
        optimizer_step(u.cfg, st, g, scale, u.step, u.first, u.decay);
        Ok(())
    }
}

impl Host<'_> {
    /// db += the column sums of dy's `l.out` columns over its `l.t` rows with the generated
    /// kernel (`Op::BiasGrad`), dy first through GELU's backward in the same pass (in place)
    /// when `gelu` gives GELU's input: the kernels the CUDA device runs.
    fn generated_bias_grad(
        &self,
        l: &Linear<HostPtr>,
        dy: HostPtr,
        db: HostPtr,
        gelu: Option<HostPtr>,
    ) -> Result<(), DeviceError> {
        let op = Op::BiasGrad {
            width: l.out as u32,
            cast: false,
            gelu: gelu.is_some(),
        };
        let tensors = [dy, db].into_iter().chain(gelu).map(HostPtr::arg);
        let args: Vec<Arg> = tensors.chain([Arg::I64(l.t as i64)]).collect();
        self.kernels.run(op, &args, l.out).unwrap_or(Ok(()))
    }

    /// The optimizer step with the generated Adam or SGD kernel, Adam's in the launches the
    /// GPU makes ([`Update::adam_launches`]), reading the gradient scale from memory as the GPU
    /// does.
    fn generated_update(
        &self,
        u: &Update<'_>,
        scale: f32,
        state: HostPtr,
        grad: HostPtr,
    ) -> Result<(), DeviceError> {
        let (cfg, n) = (u.cfg, u.n);
        let cell = [scale];
        let scale = Arg::Ptr(cell.as_ptr());
        if cfg.kind == Optimizer::Sgd {
            let args = [state.arg(), grad.arg(), scale, Arg::F32(cfg.lr)];
            return self.kernels.run(Op::Sgd, &args, n).unwrap_or(Ok(()));
        }
        let (m, v) = (state.offset(n), state.offset(2 * n));
        let scalars = u.adam_scalars()?;
        for launch in u.adam_launches() {
            let i = launch.elements.start;
            let tensors = [state, m, v, grad].map(|t| t.offset(i).arg());
            let args: Vec<Arg> = tensors
                .into_iter()
                .chain([scale])
                .chain(scalars.map(Arg::F32))
                .chain(launch.bounds().map(Arg::I64))
                .collect();
            let op = Op::Adam { param: false };
            self.kernels
                .run(op, &args, launch.elements.len())
                .unwrap_or(Ok(()))?;
        }
        Ok(())
    }
}

/// The product `l` over host slices without its input (`x` empty): for its input gradient
/// alone.
///
/// # Safety
/// `l.w` must hold `out·inp` floats, not written while the slice lives.
unsafe fn weight_only(l: &Linear<HostPtr>) -> Product<'static> {
    let Linear { w, t, inp, out, .. } = *l;
    Product {
        x: &[],
        w: w.r(out * inp),
        t,
        inp,
        out,
    }
}

/// The product `l` over host slices (its operands read through their pointers).
///
/// # Safety
/// `l`'s pointers must hold `t·inp` and `out·inp` floats, not written while the slices live.
unsafe fn product(l: &Linear<HostPtr>) -> Product<'static> {
    let Linear { x, w, t, inp, out } = *l;
    Product {
        x: x.r(t * inp),
        w: w.r(out * inp),
        t,
        inp,
        out,
    }
}
