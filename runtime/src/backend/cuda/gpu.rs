//! The device layer's primitives on a GPU stream: kernel launches of `kernels.cu` and cuBLAS
//! products over device addresses ([`crate::device::Device`] for [`Gpu`]). Regions of the arena
//! are loaded into the stream's f32 workspace and rounded back to their dtype by kernels; the
//! layer math and each op's reads and writes are the device layer's, shared with the CPU.
//! Built everywhere (it only enqueues through [`Exec`]), so the host emulation in the tests runs
//! it; on a GPU it runs inside [`super::CudaBackend`].
#![cfg_attr(not(feature = "cuda"), allow(dead_code))]

use super::enqueue::{
    dtype_code, elems, m, mt, prec_code, row_major, rows, ColMajor, DevAddr, Exec, A, M,
};
use crate::device::{plan_error, ArenaSpan, Device, DeviceError, Ptr, Update};
use crate::exec::Action;
use crate::math::attention::Keep;
use crate::math::saved::Piece;
use crate::math::{BlockP, NormP, Precision};
use crate::plan::Plan;
use cranelift_entity::EntityRef;
use schedc::ir::Region;
use schedc::job::{Attention, Dtype, LayerKind, Norm, Optimizer};
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
    /// cos then sin tables, seq_len × head_dim/2 each.
    pub rope: Option<DevAddr>,
    /// Per layer: (pointer to i64 [start, end) pairs, count).
    pub decay: Vec<(DevAddr, usize)>,
    /// Tokens per micro-batch.
    pub t: usize,
}

/// One stream of one rank: where to enqueue ([`Exec`]), its workspace (a bump pointer reset
/// after each op), where the rank's arena starts, the rank's constants, and the dtype its
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

/// A run of f32s on the device, by address.
impl Piece for DevAddr {
    fn split(self, n: usize) -> (Self, Self) {
        (self, self.offset(n))
    }
}

impl Ptr for DevAddr {
    fn offset(self, n: usize) -> Self {
        self.add_bytes(n as u64 * F)
    }
}

impl Gpu<'_> {
    fn run(&self, name: &str, n: usize, args: &[A]) -> Result<(), DeviceError> {
        self.x
            .launch(name, elems(n), args)
            .map_err(DeviceError::Gpu)
    }

    fn run_rows(&self, name: &str, r: usize, args: &[A]) -> Result<(), DeviceError> {
        self.x.launch(name, rows(r), args).map_err(DeviceError::Gpu)
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
        c: DevAddr,
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
        c: DevAddr,
        ldc: usize,
        stride_c: usize,
        batch: usize,
    ) -> Result<(), DeviceError> {
        if rows == 0 || cols == 0 || batch == 0 {
            return Ok(());
        }
        let call = row_major(
            rows, cols, k, alpha, a, stride_a, b, stride_b, beta, c, ldc, stride_c, batch,
        );
        if self.products == Dtype::Fp32 {
            return self.x.gemm(&call).map_err(DeviceError::Gpu);
        }
        // A 16-bit product: both operands rounded to the product dtype in workspace (released
        // once the product is enqueued: later work on this stream runs after it), fp32
        // accumulation and output.
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
        let a16 = self.rounded_operand(call.a, ma, ka, call.lda, call.stride_a, batch)?;
        let b16 = self.rounded_operand(call.b, kb, nb, call.ldb, call.stride_b, batch)?;
        let r = self.x.gemm(&ColMajor {
            operands: self.products,
            a: a16,
            b: b16,
            ..call
        });
        self.used.set(mark);
        r.map_err(DeviceError::Gpu)
    }

    /// A copy of a column-major fp32 operand (`rows` × `cols`, columns `ld` apart, `batch` of
    /// them `stride` apart) rounded to the product dtype, at the same element offsets.
    fn rounded_operand(
        &self,
        p: DevAddr,
        rows: usize,
        cols: usize,
        ld: usize,
        stride: usize,
        batch: usize,
    ) -> Result<DevAddr, DeviceError> {
        if rows == 0 || cols == 0 {
            return Ok(p);
        }
        let n = (batch - 1) * stride + (cols - 1) * ld + rows;
        let dst = self.alloc(n.div_ceil(2))?;
        let code = dtype_code(self.products);
        self.run(
            "store",
            n,
            &[A::P(p), A::P(dst), A::I(code), A::L(n as i64)],
        )?;
        Ok(dst)
    }

    fn copy_bytes(&self, dst: DevAddr, src: DevAddr, bytes: usize) -> Result<(), DeviceError> {
        if bytes == 0 {
            return Ok(());
        }
        self.x.copy_bytes(dst, src, bytes).map_err(DeviceError::Gpu)
    }
}

fn norm_code(k: Norm) -> i32 {
    match k {
        Norm::LayerNorm => 0,
        Norm::RmsNorm => 1,
    }
}

/// The fused attention kernels' launch: query rows, key rows, then their scalar arguments
/// (sequence length, qkv row width, heads, kv heads, head width, scale).
#[allow(clippy::type_complexity)]
fn flash_shape(bp: &BlockP) -> (usize, usize, i64, i64, i32, i32, i32, f32) {
    let sh = &bp.shape;
    (
        sh.b * sh.heads * sh.s,
        sh.b * sh.kv_heads * sh.s,
        sh.s as i64,
        sh.width() as i64,
        sh.heads as i32,
        sh.kv_heads as i32,
        sh.d as i32,
        sh.scale(),
    )
}

fn or_null(p: Option<DevAddr>) -> DevAddr {
    p.unwrap_or(DevAddr::NULL)
}

impl Device for Gpu<'_> {
    type Ptr = DevAddr;
    type Tokens = DevAddr;

    fn alloc(&self, n: usize) -> Result<DevAddr, DeviceError> {
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
        Ok(self.ws_base.add_bytes(at as u64 * F))
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

    /// An fp32 region is computed on in place: its address in the arena (no staging copy).
    fn view(&self, at: u64, dtype: Dtype, _n: usize) -> Result<Option<DevAddr>, DeviceError> {
        Ok((dtype == Dtype::Fp32 && at.is_multiple_of(4)).then(|| self.arena_base.add_bytes(at)))
    }

    fn load(&self, at: u64, dtype: Dtype, dst: DevAddr, n: usize) -> Result<(), DeviceError> {
        let src = self.arena_base.add_bytes(at);
        self.run(
            "load",
            n,
            &[
                A::P(src),
                A::I(dtype_code(dtype)),
                A::P(dst),
                A::L(n as i64),
            ],
        )
    }

    fn store(
        &self,
        src: DevAddr,
        at: u64,
        dtype: Dtype,
        n: usize,
        accumulate: bool,
    ) -> Result<(), DeviceError> {
        let dst = self.arena_base.add_bytes(at);
        let d = dtype_code(dtype);
        if accumulate {
            self.run(
                "add_store",
                n,
                &[A::P(src), A::P(dst), A::I(d), A::L(n as i64)],
            )
        } else {
            self.run("store", n, &[A::P(src), A::P(dst), A::I(d), A::L(n as i64)])
        }
    }

    fn load_f32(&self, at: u64, dst: DevAddr, n: usize) -> Result<(), DeviceError> {
        let src = self.arena_base.add_bytes(at);
        self.run("load_halves", n, &[A::P(src), A::P(dst), A::L(n as i64)])
    }

    fn store_f32(&self, src: DevAddr, at: u64, n: usize) -> Result<(), DeviceError> {
        let dst = self.arena_base.add_bytes(at);
        self.run("store_halves", n, &[A::P(src), A::P(dst), A::L(n as i64)])
    }

    fn copy_arena(&self, dst: u64, src: u64, bytes: u64) -> Result<(), DeviceError> {
        let b = self.arena_base;
        self.copy_bytes(b.add_bytes(dst), b.add_bytes(src), bytes as usize)
    }

    fn fill(&self, p: DevAddr, n: usize, v: f32) -> Result<(), DeviceError> {
        self.run("fill", n, &[A::P(p), A::F(v), A::L(n as i64)])
    }

    fn copy(&self, dst: DevAddr, src: DevAddr, n: usize) -> Result<(), DeviceError> {
        self.copy_bytes(dst, src, n * 4)
    }

    fn round(&self, prec: Precision, p: DevAddr, n: usize) -> Result<(), DeviceError> {
        if prec == Precision::F32 {
            return Ok(());
        }
        self.run(
            "round_in_place",
            n,
            &[A::P(p), A::I(prec_code(prec)), A::L(n as i64)],
        )
    }

    fn linear(
        &self,
        x: DevAddr,
        w: DevAddr,
        bias: Option<DevAddr>,
        y: DevAddr,
        t: usize,
        inp: usize,
        out: usize,
        beta: f32,
    ) -> Result<(), DeviceError> {
        self.gemm(t, out, inp, 1.0, m(x, inp), mt(w, inp), beta, y, out)?;
        if let Some(b) = bias {
            self.run(
                "bias_add",
                t * out,
                &[A::P(y), A::P(b), A::L(t as i64), A::L(out as i64)],
            )?;
        }
        Ok(())
    }

    fn linear_backward(
        &self,
        x: DevAddr,
        w: DevAddr,
        dy: DevAddr,
        dw: DevAddr,
        dbias: Option<DevAddr>,
        dx: Option<(DevAddr, f32)>,
        t: usize,
        inp: usize,
        out: usize,
    ) -> Result<(), DeviceError> {
        self.gemm(out, inp, t, 1.0, mt(dy, out), m(x, inp), 1.0, dw, inp)?;
        if let Some(db) = dbias {
            self.run(
                "col_sums",
                out,
                &[A::P(dy), A::L(t as i64), A::L(out as i64), A::P(db)],
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
        params: DevAddr,
        t: usize,
        h: usize,
        x: DevAddr,
        out: DevAddr,
        stats: DevAddr,
    ) -> Result<(), DeviceError> {
        let b = or_null(np.b.as_ref().map(|r| params.at(r)));
        self.run_rows(
            "norm_forward",
            t,
            &[
                A::I(norm_code(np.kind)),
                A::P(x),
                A::P(params.at(&np.w)),
                A::P(b),
                A::P(out),
                A::P(stats),
                A::L(h as i64),
            ],
        )
    }

    fn norm_backward(
        &self,
        np: &NormP,
        params: DevAddr,
        t: usize,
        h: usize,
        x: DevAddr,
        stats: DevAddr,
        dy: DevAddr,
        dx: Option<DevAddr>,
        grads: DevAddr,
    ) -> Result<(), DeviceError> {
        let db = or_null(np.b.as_ref().map(|r| grads.at(r)));
        self.run(
            "norm_backward_params",
            h,
            &[
                A::P(x),
                A::P(stats),
                A::P(dy),
                A::P(grads.at(&np.w)),
                A::P(db),
                A::L(t as i64),
                A::L(h as i64),
            ],
        )?;
        if let Some(dx) = dx {
            self.run_rows(
                "norm_backward_input",
                t,
                &[
                    A::I(norm_code(np.kind)),
                    A::P(x),
                    A::P(params.at(&np.w)),
                    A::P(stats),
                    A::P(dy),
                    A::P(dx),
                    A::L(h as i64),
                ],
            )?;
        }
        Ok(())
    }

    fn gelu(&self, pre: DevAddr, post: DevAddr, n: usize) -> Result<(), DeviceError> {
        self.run("gelu_forward", n, &[A::P(pre), A::P(post), A::L(n as i64)])
    }

    fn gelu_backward(&self, pre: DevAddr, d: DevAddr, n: usize) -> Result<(), DeviceError> {
        self.run("gelu_backward", n, &[A::P(pre), A::P(d), A::L(n as i64)])
    }

    fn swiglu(
        &self,
        gate: DevAddr,
        up: DevAddr,
        prod: DevAddr,
        n: usize,
    ) -> Result<(), DeviceError> {
        self.run(
            "swiglu_forward",
            n,
            &[A::P(gate), A::P(up), A::P(prod), A::L(n as i64)],
        )
    }

    fn swiglu_backward(
        &self,
        gate: DevAddr,
        up: DevAddr,
        dgate: DevAddr,
        dup: DevAddr,
        n: usize,
    ) -> Result<(), DeviceError> {
        self.run(
            "swiglu_backward",
            n,
            &[A::P(gate), A::P(up), A::P(dgate), A::P(dup), A::L(n as i64)],
        )
    }

    fn rope(&self, bp: &BlockP, t: usize, qkv: DevAddr, inverse: bool) -> Result<(), DeviceError> {
        let Some(r) = &bp.rope else { return Ok(()) };
        let tables = self
            .consts
            .rope
            .ok_or_else(|| plan_error("no rotary tables on the device"))?;
        let sh = &bp.shape;
        let (s, half) = (sh.s, r.half);
        let n = t * (sh.heads + sh.kv_heads) * half;
        self.run(
            "rope",
            n,
            &[
                A::P(qkv),
                A::P(tables),
                A::P(tables.offset(s * half)),
                A::L(t as i64),
                A::L(s as i64),
                A::L(sh.width() as i64),
                A::I(sh.heads as i32),
                A::I(sh.kv_heads as i32),
                A::I(half as i32),
                A::I(i32::from(inverse)),
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
        qkv: DevAddr,
        out: DevAddr,
        keep: Keep<DevAddr>,
    ) -> Result<(), DeviceError> {
        if let Keep::Lse(lse) = keep {
            let (rows, _, s, w, h, kv, d, scale) = flash_shape(bp);
            return self.run_rows(
                "flash_forward",
                rows,
                &[
                    A::P(qkv),
                    A::P(out),
                    A::P(lse),
                    A::L(s),
                    A::L(w),
                    A::I(h),
                    A::I(kv),
                    A::I(d),
                    A::F(scale),
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
                Attention::Naive => (DevAddr::NULL, prec_code(act)),
            };
            self.run_rows(
                "causal_softmax",
                sh.heads * s,
                &[A::P(probs), A::P(lse_ptr), A::L(s as i64), A::I(prec)],
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
        qkv: DevAddr,
        keep: Keep<DevAddr>,
        dout: DevAddr,
        dqkv: DevAddr,
    ) -> Result<(), DeviceError> {
        if let Keep::Lse(lse) = keep {
            let (rows, key_rows, s, w, h, kv, d, scale) = flash_shape(bp);
            let dsum = self.alloc(rows)?;
            self.run_rows(
                "flash_backward_dq",
                rows,
                &[
                    A::P(qkv),
                    A::P(dout),
                    A::P(lse),
                    A::P(dsum),
                    A::P(dqkv),
                    A::L(s),
                    A::L(w),
                    A::I(h),
                    A::I(kv),
                    A::I(d),
                    A::F(scale),
                ],
            )?;
            return self.run_rows(
                "flash_backward_dkv",
                key_rows,
                &[
                    A::P(qkv),
                    A::P(dout),
                    A::P(lse),
                    A::P(dsum),
                    A::P(dqkv),
                    A::L(s),
                    A::L(w),
                    A::I(h),
                    A::I(kv),
                    A::I(d),
                    A::F(scale),
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
                        self.run(
                            "probs_from_lse",
                            s * s,
                            &[
                                A::P(p),
                                A::P(kept.offset(bh * s)),
                                A::L(s as i64),
                                A::L(s as i64),
                            ],
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
                    &[A::P(p), A::P(dp), A::L(s as i64), A::F(scale)],
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
        wte: DevAddr,
        wpe: Option<DevAddr>,
        out: DevAddr,
        t: usize,
    ) -> Result<(), DeviceError> {
        self.run(
            "embedding_forward",
            t * h,
            &[
                A::P(tokens),
                A::P(wte),
                A::P(or_null(wpe)),
                A::P(out),
                A::L(t as i64),
                A::L(h as i64),
                A::L(s as i64),
            ],
        )
    }

    fn embedding_backward(
        &self,
        tokens: DevAddr,
        _vocab: usize,
        h: usize,
        s: usize,
        dy: DevAddr,
        dwte: DevAddr,
        dwpe: Option<DevAddr>,
        t: usize,
    ) -> Result<(), DeviceError> {
        self.run(
            "embedding_backward",
            h,
            &[
                A::P(tokens),
                A::P(dy),
                A::P(dwte),
                A::P(or_null(dwpe)),
                A::L(t as i64),
                A::L(h as i64),
                A::L(s as i64),
            ],
        )
    }

    fn cross_entropy(
        &self,
        logits: DevAddr,
        targets: DevAddr,
        vocab: usize,
        n: usize,
        grad: DevAddr,
    ) -> Result<(), DeviceError> {
        self.run_rows(
            "cross_entropy",
            n,
            &[
                A::P(logits),
                A::P(targets),
                A::L(vocab as i64),
                A::L(n as i64),
                A::P(grad),
                A::P(self.consts.loss),
            ],
        )
    }

    fn update(&self, u: &Update<'_>, state: DevAddr, grad: DevAddr) -> Result<(), DeviceError> {
        let cfg = u.cfg;
        let (sq, sq_dtype, clip) = match u.clip {
            Some((s, clip)) => (self.arena_base.add_bytes(s.at), dtype_code(s.dtype), clip),
            None => (DevAddr::NULL, 0, 0.0),
        };
        let n = u.n as i64;
        if cfg.kind == Optimizer::Sgd {
            return self.run(
                "sgd",
                u.n,
                &[
                    A::P(state),
                    A::P(grad),
                    A::L(n),
                    A::P(sq),
                    A::I(sq_dtype),
                    A::D(u.contributions),
                    A::D(clip),
                    A::F(cfg.lr),
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
                A::P(state),
                A::P(grad),
                A::L(n),
                A::L(u.first as i64),
                A::P(decay),
                A::I(ranges as i32),
                A::I(i32::from(decays)),
                A::P(sq),
                A::I(sq_dtype),
                A::D(u.contributions),
                A::D(clip),
                A::F(cfg.beta1),
                A::F(cfg.beta2),
                A::F(cfg.eps),
                A::F((f64::from(cfg.lr) / bc1) as f32),
                A::F(bc2.sqrt() as f32),
                A::F(1.0 - cfg.lr * cfg.weight_decay),
            ],
        )
    }

    fn grad_norm(&self, grads: &[ArenaSpan], out: ArenaSpan) -> Result<(), DeviceError> {
        let acc = self.consts.sumsq;
        // Zeroed on this stream before the sums (a step may hold several grad_norm ops only on
        // one stream, in order).
        self.run("fill", 2, &[A::P(acc), A::F(0.0), A::L(2)])?;
        for g in grads {
            let v = self.alloc(g.elements)?;
            self.load(g.at, g.dtype, v, g.elements)?;
            let n = g.elements as i64;
            self.run("sum_squares", g.elements, &[A::P(v), A::L(n), A::P(acc)])?;
            self.reset();
        }
        self.x
            .launch(
                "store_double",
                elems(1),
                &[
                    A::P(acc),
                    A::P(self.arena_base.add_bytes(out.at)),
                    A::I(dtype_code(out.dtype)),
                ],
            )
            .map_err(DeviceError::Gpu)
    }
}

/// Floats of f32 workspace one op of `layer` can need (an over-estimate: every input and output
/// converted, plus the math's scratch).
pub fn layer_workspace(plan: &Plan, layer: usize) -> usize {
    let m = &plan.maths[layer];
    let model = &plan.job.model;
    let t = (model.micro_batch * model.seq_len) as usize;
    let s = model.seq_len as usize;
    let big = match &model.layers[layer].kind {
        LayerKind::Transformer(tr) => {
            let (h, f, n) = (tr.hidden as usize, tr.ffn as usize, tr.heads as usize);
            6 * t * h + 3 * t * f + 2 * t * (h + 2 * h) + n * s * s + 2 * s * s
        }
        LayerKind::Mlp(mm) => 2 * t * mm.hidden as usize + 3 * t * mm.ffn as usize,
        LayerKind::LmHead { hidden, .. } => 2 * t * *hidden as usize,
        _ => 0,
    };
    let padded = plan.program.layers[schedc::ir::LayerId::new(layer)].padded as usize;
    // A 16-bit model's products first round both operands into workspace (`Gpu::batched`): a
    // weight (or the tied embedding) and one activation operand, two bytes an element.
    let casts = if model.dtype == Dtype::Fp32 {
        0
    } else {
        let activation = [
            m.saved_elements(),
            m.input_elements(),
            m.output_elements(),
            big,
        ];
        (m.params() + m.tied_elements() + activation.into_iter().max().unwrap_or(0)).div_ceil(2)
            + 2 * 64
    };
    casts
        + 2 * m.params()
        + 2 * m.tied_elements()
        + 2 * m.input_elements()
        + 2 * m.output_elements()
        + 2 * m.saved_elements()
        + 4 * padded
        + big
        + 64 * 64
}

/// Workspace floats of one compute action.
pub fn action_workspace(p: &Plan, a: &Action) -> usize {
    let elems = |r: &Region| (r.bytes / p.program.buffers[r.buffer].dtype.bytes()) as usize;
    match a {
        Action::Forward { layer, .. } | Action::Backward { layer, .. } => {
            layer_workspace(p, *layer)
        }
        Action::Loss { logits, .. } => 2 * elems(logits) + 64,
        Action::Update { grad, state, .. } => elems(grad) + elems(state) + 128,
        Action::GradNorm { grads, .. } => grads.iter().map(elems).max().unwrap_or(0) + 64,
        Action::Accumulate { from, .. } => elems(from) + 64,
        Action::Copy { .. } | Action::Collectives(_) => 0,
    }
}
