//! The generated kernels (`sched_kernels`, JIT-compiled for this processor) against this
//! module's Rust math: the same bits for every element-wise, optimizer, norm, loss, rotary,
//! conversion, fill, embedding and naive-attention kernel, in every storage dtype the plans use,
//! on random values with the edge cases mixed in (zeros of both signs, infinities, NaN, huge and
//! subnormal values). (The GPU's fused attention, products around these softmax kernels, is
//! checked against `attention.rs` in the CUDA backend's emulation.)
//!
//! The GPU runs the same IR (only `ln`, `exp`, the lanes and the thread loop differ), so these tests are the CPU
//! half of the kernels' verification; `compiler/tests/kernels.rs` assembles the GPU half.

use super::attention::{self, Keep, Shape};
use super::gemm::{gemm, Mat, MatMut};
use super::ops::{gelu, gelu_grad, norm_backward, norm_forward, sigmoid, NormRows, Rope};
use super::{cross_entropy, optimizer_step, OptimizerConfig, Precision, Rng};
use crate::arena::Arena;
use crate::device::host::{Host, HostPtr, HostTokens};
use crate::device::jit::without;
use crate::device::{Device, Lookup, Update};
use crate::math::{bf16_bits_to_f32, f32_to_bf16_bits};
use sched_ir::job::{Dtype, Norm, Optimizer};
use sched_kernels::codegen::{slot_f32, slot_f64, slot_i64, slot_ptr, HostKernels};
use sched_kernels::{Kernel, NormEps, Op, SUMSQ_CHUNK};
use std::ops::Range;

/// A tensor in one storage dtype: its words and their f32 values.
#[derive(Clone)]
enum T {
    F32(Vec<f32>),
    Half(Vec<u16>, Dtype),
}

impl T {
    fn new(d: Dtype, v: &[f32]) -> T {
        match d {
            Dtype::Fp32 => T::F32(v.to_vec()),
            Dtype::Bf16 => T::Half(v.iter().map(|&x| f32_to_bf16_bits(x)).collect(), d),
            Dtype::Fp16 => T::Half(
                v.iter()
                    .map(|&x| half::f16::from_f32(x).to_bits())
                    .collect(),
                d,
            ),
        }
    }

    fn values(&self) -> Vec<f32> {
        match self {
            T::F32(v) => v.clone(),
            T::Half(v, Dtype::Bf16) => v.iter().map(|&b| bf16_bits_to_f32(b)).collect(),
            T::Half(v, _) => v
                .iter()
                .map(|&b| half::f16::from_bits(b).to_f32())
                .collect(),
        }
    }

    fn ptr(&mut self) -> u64 {
        self.ptr_at(0)
    }

    /// The address of element `i`.
    fn ptr_at(&mut self, i: usize) -> u64 {
        match self {
            T::F32(v) => slot_ptr(v[i..].as_mut_ptr()),
            T::Half(v, _) => slot_ptr(v[i..].as_mut_ptr()),
        }
    }

    /// The stored 2-byte words (an f32 as two, the low half first), as the arena holds them.
    fn words(&self) -> Vec<u16> {
        match self {
            T::F32(v) => v
                .iter()
                .flat_map(|x| [x.to_bits() as u16, (x.to_bits() >> 16) as u16])
                .collect(),
            T::Half(v, _) => v.clone(),
        }
    }
}

fn run(k: &Kernel, args: &[u64], n: usize) {
    let host = HostKernels::jit(std::slice::from_ref(k)).unwrap();
    // SAFETY: every test passes buffers sized for `n` indices of `k`.
    unsafe { host.run(k, args, 0, n).unwrap() }
}

/// `n` values: normals of scale `scale` with edge cases every few elements.
fn values(seed: u64, n: usize, scale: f64) -> Vec<f32> {
    let mut rng = Rng::new(seed);
    let edges = [
        0.0,
        -0.0,
        1e-40,
        -3e-39,
        65519.0,
        1e30,
        -88.5,
        88.0,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
    ];
    (0..n)
        .map(|i| {
            if i % 7 == 3 {
                edges[(i / 7) % edges.len()]
            } else {
                (rng.normal() * scale) as f32
            }
        })
        .collect()
}

fn finite(seed: u64, n: usize, scale: f64) -> Vec<f32> {
    let mut rng = Rng::new(seed);
    (0..n).map(|_| (rng.normal() * scale) as f32).collect()
}

/// The bits of two f32 vectors agree (NaN matches NaN of any payload).
fn same(what: &str, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            g.to_bits() == w.to_bits() || (g.is_nan() && w.is_nan()),
            "{what}[{i}]: generated {g:e} ({:#x}), Rust {w:e} ({:#x})",
            g.to_bits(),
            w.to_bits()
        );
    }
}

fn round(d: Dtype, v: &[f32]) -> Vec<f32> {
    T::new(d, v).values()
}

const DTYPES: [Dtype; 3] = [Dtype::Fp32, Dtype::Bf16, Dtype::Fp16];

#[test]
fn conversions_match_the_arena() {
    let v = values(1, 5000, 1e3);
    for from in DTYPES {
        for to in DTYPES {
            let mut src = T::new(from, &v);
            let mut dst = T::new(to, &vec![0.0; v.len()]);
            run(
                &Kernel::new(Op::Convert, &[from, to]),
                &[src.ptr(), dst.ptr()],
                v.len(),
            );
            same(
                &format!("{from:?}->{to:?}"),
                &dst.values(),
                &round(to, &src.values()),
            );
        }
    }
    // Every bf16 and f16 bit pattern through f32 and back.
    let all: Vec<u16> = (0..=u16::MAX).collect();
    for d in [Dtype::Bf16, Dtype::Fp16] {
        let mut src = T::Half(all.clone(), d);
        let mut mid = T::F32(vec![0.0; all.len()]);
        run(
            &Kernel::new(Op::Convert, &[d, Dtype::Fp32]),
            &[src.ptr(), mid.ptr()],
            all.len(),
        );
        same(&format!("{d:?} widened"), &mid.values(), &src.values());
    }
}

/// The GPU's loop of the unrolled kernels (`sched_kernels::UNROLL` indices an iteration, loads
/// before stores, then one at a time; `HostKernels::jit_gpu_loops`) writes every index of
/// `begin..end` as the Rust math does, and
/// nothing outside it: ranges of every length up to three iterations, from aligned and unaligned
/// starts, for an in-place op (GELU's backward) and one reading a shared row (the bias add).
#[test]
fn unrolled_kernels_cover_every_range() {
    let (w, n) = (5, 60);
    let pre = round(Dtype::Bf16, &finite(24, n, 2.0));
    let d0 = finite(25, n, 1.0);
    let b = finite(26, w, 1.0);
    let backward = Kernel::new(Op::GeluBackward, &[Dtype::Fp32, Dtype::Bf16]);
    let bias = Kernel::new(Op::BiasAdd { width: w as u32 }, &[Dtype::Fp32, Dtype::Fp32]);
    let host = HostKernels::jit_gpu_loops(&[backward.clone(), bias.clone()]).unwrap();
    for begin in [0, 1, 3] {
        for len in 0..=13 {
            let range = begin..begin + len;
            gelu_backward_over(&host, &backward, &pre, &d0, range.clone());

            let (mut ty, mut tb) = (T::F32(d0.clone()), T::F32(b.clone()));
            // SAFETY: y holds n elements, b one row of w.
            unsafe { host.run(&bias, &[ty.ptr(), tb.ptr()], begin, range.end) }.unwrap();
            let want = within(&range, &d0, |i| d0[i] + b[i % w]);
            same(&format!("bias add over {range:?}"), &ty.values(), &want);
        }
    }
}

/// The host's prefetching loop of GELU's backward (`Op::prefetched`: blocks of
/// `PREFETCH_BLOCK` indices, the next block hinted first) writes every index of `begin..end`
/// as the Rust math does, and nothing outside it: ranges ending inside, at and past block
/// boundaries, from aligned and unaligned starts.
#[test]
fn prefetched_kernels_cover_every_range() {
    use sched_kernels::PREFETCH_BLOCK;
    let block = PREFETCH_BLOCK as usize;
    let n = 3 * block + 40;
    let pre = round(Dtype::Bf16, &finite(29, n, 2.0));
    let d0 = finite(30, n, 1.0);
    let backward = Kernel::new(Op::GeluBackward, &[Dtype::Fp32, Dtype::Bf16]);
    let host = HostKernels::jit(std::slice::from_ref(&backward)).unwrap();
    for begin in [0, 1, 17] {
        for end in [
            begin,
            begin + 1,
            block - 1,
            block,
            block + 1,
            2 * block + 3,
            n,
        ] {
            gelu_backward_over(&host, &backward, &pre, &d0, begin..end.max(begin));
        }
    }
}

/// Runs `backward` (GELU's backward, fp32 `d` and bf16 `pre`) over `range` of `d0` and checks
/// every element: the Rust math's product inside the range, `d0` untouched outside it.
fn gelu_backward_over(
    host: &HostKernels,
    backward: &Kernel,
    pre: &[f32],
    d0: &[f32],
    range: Range<usize>,
) {
    let (mut tp, mut td) = (T::new(Dtype::Bf16, pre), T::F32(d0.to_vec()));
    // SAFETY: both buffers hold d0.len() ≥ range.end elements.
    unsafe { host.run(backward, &[td.ptr(), tp.ptr()], range.start, range.end) }.unwrap();
    let want = within(&range, d0, |i| d0[i] * gelu_grad(pre[i]));
    same(&format!("gelu' over {range:?}"), &td.values(), &want);
}

/// What a kernel run over `range` of a tensor that held `before` leaves: `inside(i)` at the
/// indices of the range, `before` elsewhere.
fn within(range: &Range<usize>, before: &[f32], inside: impl Fn(usize) -> f32) -> Vec<f32> {
    (0..before.len())
        .map(|i| {
            if range.contains(&i) {
                inside(i)
            } else {
                before[i]
            }
        })
        .collect()
}

/// Past 2³² indices the GPU's unrolled loops count in 64 bits (below, in 32): GELU's backward over
/// indices 2³² − 6 .. 2³² + 7, its tensors' addresses offset so that those indices land in small
/// buffers (the kernel only forms `base + i`), writes every index as the Rust math does.
#[test]
fn unrolled_kernels_count_past_32_bits() {
    let n = 13;
    let begin = (1usize << 32) - 6;
    let pre = round(Dtype::Bf16, &finite(27, n, 2.0));
    let d0 = finite(28, n, 1.0);
    let backward = Kernel::new(Op::GeluBackward, &[Dtype::Fp32, Dtype::Bf16]);
    let host = HostKernels::jit_gpu_loops(std::slice::from_ref(&backward)).unwrap();
    let (mut tp, mut td) = (T::new(Dtype::Bf16, &pre), T::F32(d0.clone()));
    let shift = |slot: u64, bytes: usize| slot.wrapping_sub((begin * bytes) as u64);
    let args = [shift(td.ptr(), 4), shift(tp.ptr(), 2)];
    // SAFETY: the kernel reads and writes `base + i` for i in begin..begin + n, which the
    // offsets place at the buffers' n elements.
    unsafe { host.run(&backward, &args, begin, begin + n) }.unwrap();
    let want: Vec<f32> = d0
        .iter()
        .zip(&pre)
        .map(|(&d, &x)| d * gelu_grad(x))
        .collect();
    same("gelu' past 2^32", &td.values(), &want);
}

#[test]
fn activations_match_ops() {
    for d in DTYPES {
        let pre = round(d, &values(2, 3001, 3.0));
        let mut tp = T::new(d, &pre);
        let mut post = T::new(d, &vec![0.0; pre.len()]);
        run(
            &Kernel::new(Op::Gelu, &[d, d]),
            &[tp.ptr(), post.ptr()],
            pre.len(),
        );
        let want: Vec<f32> = pre.iter().map(|&x| gelu(x)).collect();
        same(&format!("gelu {d:?}"), &post.values(), &round(d, &want));

        let g = values(3, pre.len(), 1.0);
        let mut dg = T::F32(g.clone());
        run(
            &Kernel::new(Op::GeluBackward, &[Dtype::Fp32, d]),
            &[dg.ptr(), tp.ptr()],
            pre.len(),
        );
        let want: Vec<f32> = g
            .iter()
            .zip(&pre)
            .map(|(&g, &x)| g * gelu_grad(x))
            .collect();
        same(&format!("gelu' {d:?}"), &dg.values(), &want);

        let up = round(d, &values(4, pre.len(), 2.0));
        let mut tu = T::new(d, &up);
        let mut prod = T::new(d, &vec![0.0; pre.len()]);
        let k = Kernel::new(Op::SwiGlu, &[d, d, d]);
        run(&k, &[tp.ptr(), tu.ptr(), prod.ptr()], pre.len());
        let want: Vec<f32> = pre
            .iter()
            .zip(&up)
            .map(|(&g, &u)| g * sigmoid(g) * u)
            .collect();
        same(&format!("swiglu {d:?}"), &prod.values(), &round(d, &want));

        let mut dgate = T::F32(g.clone());
        let mut dup = T::F32(vec![0.0; pre.len()]);
        let op = Op::SwiGluBackward { cast: false };
        let k = Kernel::new(op, &[Dtype::Fp32, Dtype::Fp32, d, d]);
        run(&k, &[dgate.ptr(), dup.ptr(), tp.ptr(), tu.ptr()], pre.len());
        let (mut wg, mut wu) = (g.clone(), vec![0.0; pre.len()]);
        for (((dg, du), &x), &u) in wg.iter_mut().zip(wu.iter_mut()).zip(&pre).zip(&up) {
            let sg = sigmoid(x);
            let dprod = *dg;
            *du = dprod * x * sg;
            *dg = dprod * u * sg * (1.0 + x * (1.0 - sg));
        }
        same(&format!("swiglu' gate {d:?}"), &dgate.values(), &wg);
        same(&format!("swiglu' up {d:?}"), &dup.values(), &wu);

        // Both written in `d` for the products (dprod only read): the same values rounded once.
        let mut dprod = T::F32(g.clone());
        let mut dup = T::new(d, &vec![f32::NAN; pre.len()]);
        let mut cast = T::new(d, &vec![f32::NAN; pre.len()]);
        let k = Kernel::new(
            Op::SwiGluBackward { cast: true },
            &[Dtype::Fp32, d, d, d, d],
        );
        let args = [dprod.ptr(), dup.ptr(), tp.ptr(), tu.ptr(), cast.ptr()];
        run(&k, &args, pre.len());
        same(
            &format!("swiglu' cast gate {d:?}"),
            &cast.values(),
            &round(d, &wg),
        );
        same(
            &format!("swiglu' cast up {d:?}"),
            &dup.values(),
            &round(d, &wu),
        );
        same(&format!("swiglu' cast dprod {d:?}"), &dprod.values(), &g);
    }
}

#[test]
fn norms_match_ops() {
    let (rows, h) = (13, 67);
    // The default ε for layer norm, another (as `norm_eps = 1e-6` sets) for RMS norm.
    for (norm, eps) in [(Norm::LayerNorm, 1e-5f32), (Norm::RmsNorm, 1e-6)] {
        for d in DTYPES {
            let bias = norm == Norm::LayerNorm;
            let x = round(d, &finite(5, rows * h, 2.0));
            let w = round(d, &finite(6, h, 1.0));
            let b = round(d, &finite(7, h, 0.5));
            let (mut tx, mut tw, mut tb) = (T::new(d, &x), T::new(d, &w), T::new(d, &b));
            let mut out = T::new(d, &vec![0.0; rows * h]);
            let mut stats = T::F32(vec![0.0; 2 * rows]);
            let op = Op::Norm {
                norm,
                width: h as u32,
                bias,
                eps: NormEps::new(eps),
            };
            let mut args = vec![tx.ptr(), tw.ptr()];
            if bias {
                args.push(tb.ptr());
            }
            args.extend([out.ptr(), stats.ptr()]);
            let ds = if bias { vec![d; 4] } else { vec![d; 3] };
            run(&Kernel::new(op, &ds), &args, rows);
            let (mut wo, mut ws) = (vec![0.0; rows * h], vec![0.0; 2 * rows]);
            let bb = bias.then_some(&b[..]);
            norm_forward(norm, eps, h, &x, &w, bb, &mut wo, &mut ws);
            same(&format!("{norm:?} {d:?} stats"), &stats.values(), &ws);
            same(
                &format!("{norm:?} {d:?} out"),
                &out.values(),
                &round(d, &wo),
            );

            // Backward: the input part per row, the parameter part per column.
            let dy = finite(8, rows * h, 1.0);
            let dx0 = finite(9, rows * h, 0.1);
            let dw0 = finite(10, h, 0.1);
            let db0 = finite(11, h, 0.1);
            let (mut wdx, mut wdw, mut wdb) = (dx0.clone(), dw0.clone(), db0.clone());
            let wdbr = bias.then_some(&mut wdb[..]);
            let dx = Some((&mut wdx[..], None));
            norm_backward(norm_rows(norm, h, &x, &w, &ws), &dy, dx, &mut wdw, wdbr);
            let f = Dtype::Fp32;
            let mut tdy = T::F32(dy.clone());
            let mut tdx = T::F32(dx0);
            let op = Op::NormBackwardInput {
                norm,
                width: h as u32,
            };
            // Added in place (base = dx).
            let (dxp, dyp) = (tdx.ptr(), tdy.ptr());
            let args = [tx.ptr(), tw.ptr(), stats.ptr(), dyp, dxp, dxp];
            run(&Kernel::new(op, &[d, d, f, f, f]), &args, rows);
            same(&format!("{norm:?} {d:?} dx"), &tdx.values(), &wdx);
            // From a base of the residual's gradient in `d` into an output in `d`, rounded once.
            let base = round(d, &finite(12, rows * h, 1.0));
            let mut from_base = vec![f32::NAN; rows * h];
            let dx = Some((&mut from_base[..], Some(&base[..])));
            norm_backward(
                norm_rows(norm, h, &x, &w, &ws),
                &dy,
                dx,
                &mut dw0.clone(),
                None,
            );
            let (mut tbase, mut tout) = (T::new(d, &base), T::new(d, &vec![f32::NAN; rows * h]));
            let args = [
                tx.ptr(),
                tw.ptr(),
                stats.ptr(),
                dyp,
                tbase.ptr(),
                tout.ptr(),
            ];
            run(&Kernel::new(op, &[d, d, f, d, d]), &args, rows);
            let what = format!("{norm:?} {d:?} dx from a base");
            same(&what, &tout.values(), &round(d, &from_base));
            let (mut tdw, mut tdb) = (T::F32(dw0), T::F32(db0));
            let op = Op::NormBackwardParams {
                width: h as u32,
                bias,
            };
            let mut args = vec![tx.ptr(), stats.ptr(), tdy.ptr(), tdw.ptr()];
            if bias {
                args.push(tdb.ptr());
            }
            args.push(slot_i64(rows as i64));
            let ds = if bias {
                vec![d, f, f, f]
            } else {
                vec![d, f, f]
            };
            run(&Kernel::new(op, &ds), &args, h);
            same(&format!("{norm:?} {d:?} dw"), &tdw.values(), &wdw);
            if bias {
                same(&format!("{norm:?} {d:?} db"), &tdb.values(), &wdb);
            }
        }
    }
}

/// fp32 as 2-byte words at a 2-byte (not 4-byte) aligned address: a leading pad word, then each
/// value low half first, as a 16-bit model's saved region holds its statistics.
fn halved(v: &[f32]) -> Vec<u16> {
    let mut w = vec![0xdead];
    w.extend(
        v.iter()
            .flat_map(|x| [x.to_bits() as u16, (x.to_bits() >> 16) as u16]),
    );
    w
}

fn unhalved(w: &[u16]) -> Vec<f32> {
    w[1..]
        .chunks_exact(2)
        .map(|p| f32::from_bits(u32::from(p[0]) | (u32::from(p[1]) << 16)))
        .collect()
}

/// The norm kernels with halved statistics (`Kernel::with_halved_stats`)
/// give the bits of their fp32-statistics twins: statistics written as halves, and read back.
#[test]
fn halved_statistics_are_the_same_bits() {
    let (d, f) = (Dtype::Bf16, Dtype::Fp32);
    let (rows, h) = (7, 45);
    let x = round(d, &finite(50, rows * h, 2.0));
    let w = round(d, &finite(51, h, 1.0));
    let b = round(d, &finite(52, h, 0.5));
    let dy = finite(53, rows * h, 1.0);
    let op = Op::Norm {
        norm: Norm::LayerNorm,
        width: h as u32,
        bias: true,
        eps: NormEps::DEFAULT,
    };
    let k = Kernel::new(op, &[d; 4]);
    let (mut tx, mut tw, mut tb) = (T::new(d, &x), T::new(d, &w), T::new(d, &b));
    let mut outs = [
        T::new(d, &vec![0.0; rows * h]),
        T::new(d, &vec![0.0; rows * h]),
    ];
    let mut stats = vec![0f32; 2 * rows];
    let mut words = halved(&vec![0.0; 2 * rows]);
    let mut run_norm = |o: &mut T, s: u64, k: &Kernel| {
        run(k, &[tx.ptr(), tw.ptr(), tb.ptr(), o.ptr(), s], rows);
    };
    let [o1, o2] = &mut outs;
    run_norm(o1, slot_ptr(stats.as_mut_ptr()), &k);
    run_norm(
        o2,
        slot_ptr(words[1..].as_mut_ptr()),
        &k.clone().with_halved_stats(),
    );
    assert_eq!(o1.words(), o2.words(), "norm out");
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&unhalved(&words)), bits(&stats), "norm stats");

    let op = Op::NormBackwardInput {
        norm: Norm::LayerNorm,
        width: h as u32,
    };
    let k = Kernel::new(op, &[d, d, f, f, f]);
    let mut dxs = [T::F32(vec![0.5; rows * h]), T::F32(vec![0.5; rows * h])];
    let mut tdy = T::F32(dy.clone());
    for (dx, (k, s)) in dxs.iter_mut().zip([
        (k.clone(), slot_ptr(stats.as_mut_ptr())),
        (k.with_halved_stats(), slot_ptr(words[1..].as_mut_ptr())),
    ]) {
        let p = dx.ptr();
        run(&k, &[tx.ptr(), tw.ptr(), s, tdy.ptr(), p, p], rows);
    }
    assert_eq!(dxs[0].words(), dxs[1].words(), "norm dx");
    let op = Op::NormBackwardParams {
        width: h as u32,
        bias: true,
    };
    let k = Kernel::new(op, &[d, f, f, f]);
    let mut dws = [T::F32(vec![0.0; 2 * h]), T::F32(vec![0.0; 2 * h])];
    for (dw, (k, s)) in dws.iter_mut().zip([
        (k.clone(), slot_ptr(stats.as_mut_ptr())),
        (k.with_halved_stats(), slot_ptr(words[1..].as_mut_ptr())),
    ]) {
        let p = dw.ptr();
        let db = p + 4 * h as u64;
        let args = [tx.ptr(), s, tdy.ptr(), p, db, slot_i64(rows as i64)];
        run(&k, &args, h);
    }
    assert_eq!(dws[0].words(), dws[1].words(), "norm dw, db");
}

#[test]
fn cross_entropy_matches() {
    // A vocabulary that is not a multiple of the eight lanes, in rows padded to 208 (the
    // logits' layout): the padding holds NaN, which neither reads, and neither writes there.
    let (rows, vocab, stride) = (9, 203, 208);
    for d in [Dtype::Fp32, Dtype::Bf16] {
        let mut z = round(d, &finite(12, rows * stride, 4.0));
        z.chunks_exact_mut(stride)
            .for_each(|row| row[vocab..].fill(f32::NAN));
        let targets: Vec<u32> = (0..rows as u32)
            .map(|r| (r * 37 + 5) % vocab as u32)
            .collect();
        let mut wg = vec![-1.0; rows * stride];
        let total = cross_entropy(&z, &targets, vocab, stride, &mut wg);
        let mut tz = T::new(d, &z);
        let mut tt = targets.clone();
        let mut grad = T::F32(vec![-1.0; rows * stride]);
        let mut loss = T::F32(vec![0.0; rows]);
        let inv = 1.0 / rows as f32;
        let k = Kernel::new(
            Op::CrossEntropy {
                vocab: vocab as u32,
                stride: stride as u32,
            },
            &[d, Dtype::Fp32],
        );
        let args = [
            tz.ptr(),
            slot_ptr(tt.as_mut_ptr()),
            grad.ptr(),
            loss.ptr(),
            slot_f32(inv),
        ];
        run(&k, &args, rows);
        same(&format!("cross-entropy {d:?} grad"), &grad.values(), &wg);
        let padding = wg.chunks_exact(stride).flat_map(|row| &row[vocab..]);
        assert!(
            padding.into_iter().all(|&g| g == -1.0),
            "written past the vocab"
        );
        let sum: f64 = loss.values().iter().map(|&l| f64::from(l)).sum();
        assert_eq!(sum.to_bits(), total.to_bits(), "loss {sum} vs {total}");
    }
}

#[test]
fn rotary_matches_rope() {
    let (heads, kv, d, s, tokens) = (4usize, 2usize, 16usize, 8usize, 20usize);
    let width = heads * d + 2 * kv * d;
    let rope = Rope::new(d, s, 10_000.0);
    for inverse in [false, true] {
        let qkv = finite(13, tokens * width, 1.0);
        let mut want = qkv.clone();
        for (t, row) in want.chunks_exact_mut(width).enumerate() {
            rope.apply(&mut row[..heads * d], heads, t % s, inverse);
            rope.apply(&mut row[heads * d..heads * d + kv * d], kv, t % s, inverse);
        }
        let op = Op::Rotary {
            heads: heads as u32,
            kv_heads: kv as u32,
            head_dim: d as u32,
            width: width as u32,
            seq_len: s as u32,
            inverse,
        };
        let mut t = T::F32(qkv);
        let (mut cos, mut sin) = (rope.cos.clone(), rope.sin.clone());
        let args = [
            t.ptr(),
            slot_ptr(cos.as_mut_ptr()),
            slot_ptr(sin.as_mut_ptr()),
        ];
        run(&Kernel::new(op, &[Dtype::Fp32]), &args, tokens);
        same(&format!("rotary inverse={inverse}"), &t.values(), &want);
    }
}

/// Decayed ranges of a layer's flat vector (elements `FIRST..FIRST + n` are the shard): none,
/// all, a GPT-2 block's four weight matrices between biases and norm gains, six runs (two
/// launches), and ranges that begin before the shard and end past it.
const FIRST: usize = 100;
fn decay_patterns(n: usize) -> Vec<Vec<Range<usize>>> {
    let at = |a: usize, b: usize| FIRST + a..FIRST + b;
    vec![
        vec![],
        vec![0..FIRST + n + 5],
        vec![at(7, 300), at(301, 500), at(530, 700), at(760, 1000)],
        (0..6).map(|k| at(150 * k + 20, 150 * k + 90)).collect(),
        vec![0..FIRST + 10, at(1000, n + 40)],
    ]
}

#[test]
fn optimizers_match_optimizer_step() {
    let n = 1037;
    let step = 7;
    let scale = 0.25f32;
    for kind in [Optimizer::Adam, Optimizer::AdamW, Optimizer::Sgd] {
        let cfg = OptimizerConfig::new(kind, 3e-3);
        for d in [Dtype::Fp32, Dtype::Bf16] {
            let grad = round(d, &finite(14, n, 1.0));
            let mut state = finite(15, n, 1.0);
            if kind != Optimizer::Sgd {
                state.extend(finite(16, n, 0.01));
                state.extend(finite(17, n, 0.01).iter().map(|x| x * x));
            }
            let mut tg = T::new(d, &grad);
            // The scale is read from memory (a GPU's comes from `GradScale`).
            let mut cell = [scale];
            if kind == Optimizer::Sgd {
                let mut want = state.clone();
                optimizer_step(&cfg, &mut want, &grad, scale, step, 0, &[]);
                let mut st = state.clone();
                let args = vec![
                    slot_ptr(st.as_mut_ptr()),
                    tg.ptr(),
                    slot_ptr(cell.as_mut_ptr()),
                    slot_f32(cfg.lr),
                ];
                run(&Kernel::new(Op::Sgd, &[d]), &args, n);
                same(&format!("{kind:?} {d:?}"), &st, &want);
                continue;
            }
            for decay in decay_patterns(n) {
                let update = Update {
                    cfg: &cfg,
                    step,
                    n,
                    first: FIRST,
                    decay: &decay,
                    clip: None,
                    contributions: 1.0,
                };
                let launches = update.adam_launches();
                let mut want = state.clone();
                optimizer_step(&cfg, &mut want, &grad, scale, step, FIRST, &decay);
                // Without and with the parameter (in the gradient's dtype here) stored in the
                // same pass: the same state, and the new master rounded once.
                for param in [false, true] {
                    let mut st = state.clone();
                    let mut tp = T::new(d, &vec![f32::NAN; n]);
                    let k = match param {
                        false => Kernel::new(Op::Adam { param }, &[d]),
                        true => Kernel::new(Op::Adam { param }, &[d, d]),
                    };
                    for l in &launches {
                        let i = l.elements.start;
                        let at =
                            |t: &mut [f32], part: usize| slot_ptr(t[part * n + i..].as_mut_ptr());
                        let mut args = vec![at(&mut st, 0), at(&mut st, 1), at(&mut st, 2)];
                        args.push(tg.ptr_at(i));
                        if param {
                            args.push(tp.ptr_at(i));
                        }
                        args.push(slot_ptr(cell.as_mut_ptr()));
                        let scalars = crate::math::optim::adam_scalars(&cfg, step);
                        args.extend(scalars.map(slot_f32));
                        args.extend(l.bounds().map(slot_i64));
                        run(&k, &args, l.elements.len());
                    }
                    let what = format!("{kind:?} {d:?} decay {decay:?} param={param}");
                    same(&what, &st, &want);
                    if param {
                        same(&what, &tp.values(), &round(d, &want[..n]));
                    }
                }
            }
        }
    }
}

/// A shard's Adam launches: one for a layer's shard with up to four decayed runs, another
/// for each four more; each run exactly where `decay_runs` puts it; none for an empty shard.
#[test]
fn adam_launches_cover_the_shard_once() {
    let cfg = OptimizerConfig::new(Optimizer::AdamW, 1e-3);
    let n = 1037;
    for (decay, count) in decay_patterns(n).iter().zip([1, 1, 1, 2, 1]) {
        let update = Update {
            cfg: &cfg,
            step: 1,
            n,
            first: FIRST,
            decay,
            clip: None,
            contributions: 1.0,
        };
        let launches = update.adam_launches();
        assert_eq!(launches.len(), count, "{decay:?}");
        let mut decayed = vec![false; n];
        let mut next = 0;
        for l in &launches {
            assert_eq!(
                l.elements.start, next,
                "{decay:?}: launches in order, no gap"
            );
            next = l.elements.end;
            for &(a, b) in &l.decayed {
                let (a, b) = (a as usize + l.elements.start, b as usize + l.elements.start);
                assert!(a <= b && b <= l.elements.end, "{decay:?}: {l:?}");
                decayed[a..b].iter_mut().for_each(|x| *x = true);
            }
        }
        assert_eq!(next, n, "{decay:?}: launches cover the shard");
        let want: Vec<bool> = (0..n)
            .map(|i| decay.iter().any(|r| r.contains(&(FIRST + i))))
            .collect();
        assert_eq!(decayed, want, "{decay:?}");
    }
    let empty = Update {
        cfg: &cfg,
        step: 1,
        n: 0,
        first: FIRST,
        decay: &[],
        clip: None,
        contributions: 1.0,
    };
    assert!(empty.adam_launches().is_empty());
}

/// The gradient scale under clipping (`GradScale`) is the host device's `update`'s, from a sum
/// of squares stored in each dtype: below, at and above the limit, zero, huge, NaN and inf.
#[test]
fn grad_scale_matches_the_host_devices() {
    let sums = [
        0.0f32,
        1e-12,
        0.2,
        0.25,
        3.7,
        1e6,
        3e38,
        f32::INFINITY,
        f32::NAN,
    ];
    for d in DTYPES {
        for &(contributions, clip) in &[(1.0f64, 0.5f64), (8.0, 0.1), (3.0, 1.0)] {
            let stored = round(d, &sums);
            let mut tsq = T::new(d, &stored);
            let mut scale = vec![0f32; sums.len()];
            let args = [
                tsq.ptr(),
                slot_ptr(scale.as_mut_ptr()),
                slot_f64(contributions),
                slot_f64(clip),
            ];
            run(&Kernel::new(Op::GradScale, &[d]), &args, sums.len());
            let want: Vec<f32> = stored
                .iter()
                .map(|&s| {
                    let norm = f64::from(s).sqrt() / contributions;
                    ((clip / (norm + 1e-6)).min(1.0) / contributions) as f32
                })
                .collect();
            same(
                &format!("grad scale {d:?} {contributions} {clip}"),
                &scale,
                &want,
            );
        }
    }
}

/// `Round` is `Precision::round` in place, NaN payloads included; the sums of the loss and of
/// the gradient norm's partials fold in order from −0.0 onto the accumulator, as the host does.
#[test]
fn rounding_and_f64_sums_match() {
    let mut v = values(40, 1001, 1.0);
    v[5] = f32::from_bits(0x7f80_0001);
    v[12] = f32::from_bits(0xffc1_2345);
    for to in DTYPES {
        let mut t = v.clone();
        run(
            &Kernel::new(Op::Round { to }, &[Dtype::Fp32]),
            &[slot_ptr(t.as_mut_ptr())],
            t.len(),
        );
        let mut want = v.clone();
        Precision::of(to).round(&mut want);
        let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&t), bits(&want), "round to {to:?}");
    }
    // Two accumulators, rows of 333 each.
    let rows = finite(41, 666, 3.0);
    let mut acc = [1.5f64, -0.0];
    let k = Kernel::new(Op::AddLoss, &[]);
    let args = [
        slot_ptr(rows.as_ptr()),
        slot_ptr(acc.as_mut_ptr()),
        slot_i64(333),
    ];
    run(&k, &args, 2);
    for (i, a) in acc.iter().enumerate() {
        let sum: f64 = rows[i * 333..(i + 1) * 333]
            .iter()
            .map(|&l| f64::from(l))
            .sum();
        let want = [1.5f64, -0.0][i] + sum;
        assert_eq!(a.to_bits(), want.to_bits(), "loss sum {i}");
    }
    let partial: Vec<f64> = finite(42, 77, 1e3)
        .iter()
        .map(|&x| f64::from(x) / 7.0)
        .collect();
    let mut acc = [2.25f64];
    let k = Kernel::new(Op::AddPartials, &[]);
    let args = [
        slot_ptr(partial.as_ptr()),
        slot_ptr(acc.as_mut_ptr()),
        slot_i64(77),
    ];
    run(&k, &args, 1);
    let want = 2.25 + partial.iter().sum::<f64>();
    assert_eq!(acc[0].to_bits(), want.to_bits(), "partials");
}

#[test]
fn small_kernels_match() {
    let (rows, w) = (11, 37);
    for d in DTYPES {
        // Accumulation rounds the sum to the accumulator's dtype (the arena's `add`).
        let x = round(d, &values(18, rows * w, 1.0));
        let acc = round(d, &values(19, rows * w, 1.0));
        let (mut tx, mut ta) = (T::new(d, &x), T::new(d, &acc));
        run(
            &Kernel::new(Op::Accumulate, &[d, d]),
            &[tx.ptr(), ta.ptr()],
            x.len(),
        );
        let want: Vec<f32> = acc.iter().zip(&x).map(|(a, b)| a + b).collect();
        same(&format!("accumulate {d:?}"), &ta.values(), &round(d, &want));

        // Bias add (linear's epilogue) and bias gradient (gemm::col_sums).
        let b = round(d, &finite(20, w, 1.0));
        let y = finite(21, rows * w, 1.0);
        let (mut ty, mut tb) = (T::F32(y.clone()), T::new(d, &b));
        let k = Kernel::new(Op::BiasAdd { width: w as u32 }, &[Dtype::Fp32, d]);
        run(&k, &[ty.ptr(), tb.ptr()], y.len());
        let want: Vec<f32> = y.iter().enumerate().map(|(i, v)| v + b[i % w]).collect();
        same(&format!("bias add {d:?}"), &ty.values(), &want);
        let db0 = finite(22, w, 1.0);
        let mut wdb = db0.clone();
        super::gemm::col_sums(&y, (w, w), &mut wdb);
        let (mut tdy, mut tdb) = (T::F32(y.clone()), T::F32(db0.clone()));
        let k = Kernel::new(
            Op::BiasGrad {
                width: w as u32,
                cast: false,
                gelu: false,
            },
            &[Dtype::Fp32, Dtype::Fp32],
        );
        run(&k, &[tdy.ptr(), tdb.ptr(), slot_i64(rows as i64)], w);
        same("bias grad", &tdb.values(), &wdb);
        // The same sums, dy also stored in `d` as they are taken (a 16-bit model's products).
        let mut tdb = T::F32(db0);
        let mut tcast = T::new(d, &vec![f32::NAN; rows * w]);
        let k = Kernel::new(
            Op::BiasGrad {
                width: w as u32,
                cast: true,
                gelu: false,
            },
            &[Dtype::Fp32, Dtype::Fp32, d],
        );
        let args = [tdy.ptr(), tdb.ptr(), tcast.ptr(), slot_i64(rows as i64)];
        run(&k, &args, w);
        same(&format!("bias grad casting to {d:?}"), &tdb.values(), &wdb);
        same(&format!("cast to {d:?}"), &tcast.values(), &round(d, &y));

        // Through GELU's backward first (the MLP's first product): the Rust math's two
        // passes, `d ∘ gelu'(pre)` then its column sums, and the cast of the first's values;
        // without the cast, those values in place of dy.
        let pre = round(d, &finite(24, rows * w, 2.0));
        let g: Vec<f32> = y
            .iter()
            .zip(&pre)
            .map(|(&v, &x)| v * gelu_grad(x))
            .collect();
        let db0 = finite(25, w, 1.0);
        let mut wdb = db0.clone();
        super::gemm::col_sums(&g, (w, w), &mut wdb);
        for cast in [false, true] {
            let (mut tdy, mut tdb, mut tpre) =
                (T::F32(y.clone()), T::F32(db0.clone()), T::new(d, &pre));
            let mut tcast = T::new(d, &vec![f32::NAN; rows * w]);
            let mut dtypes = vec![Dtype::Fp32, Dtype::Fp32];
            let mut args = vec![tdy.ptr(), tdb.ptr()];
            if cast {
                dtypes.push(d);
                args.push(tcast.ptr());
            }
            dtypes.push(d);
            args.extend([tpre.ptr(), slot_i64(rows as i64)]);
            let op = Op::BiasGrad {
                width: w as u32,
                cast,
                gelu: true,
            };
            run(&Kernel::new(op, &dtypes), &args, w);
            let what = format!("bias grad through gelu' (cast {cast}) {d:?}");
            same(&what, &tdb.values(), &wdb);
            if cast {
                same(&what, &tcast.values(), &round(d, &g));
                same(&what, &tdy.values(), &y);
            } else {
                same(&what, &tdy.values(), &g);
            }
        }

        // Sum of squares in f64 partials of SUMSQ_CHUNK elements.
        let n = 2 * SUMSQ_CHUNK + 77;
        let g = round(d, &finite(23, n, 1.0));
        let mut tg = T::new(d, &g);
        let chunks = n.div_ceil(SUMSQ_CHUNK);
        let mut partial = vec![0f64; chunks];
        let k = Kernel::new(Op::SumSquares, &[d]);
        let args = [tg.ptr(), slot_ptr(partial.as_mut_ptr()), slot_i64(n as i64)];
        run(&k, &args, chunks);
        for (c, p) in partial.iter().enumerate() {
            let chunk = &g[c * SUMSQ_CHUNK..((c + 1) * SUMSQ_CHUNK).min(n)];
            let want: f64 = chunk.iter().map(|&x| f64::from(x) * f64::from(x)).sum();
            assert_eq!(p.to_bits(), want.to_bits(), "sum of squares chunk {c}");
        }

        // Strided copy: 3 blocks of 5 from stride 9 to stride 6, raw bits (NaN payloads kept).
        let src = values(24, 27, 1.0);
        let mut ts = T::new(d, &src);
        let mut td = T::new(d, &[0.0; 18]);
        let k = Kernel::new(Op::Gather2d, &[d, d]);
        let args = [ts.ptr(), td.ptr(), slot_i64(5), slot_i64(9), slot_i64(6)];
        run(&k, &args, 15);
        let (sv, dv) = (ts.values(), td.values());
        for i in 0..15 {
            let (b, o) = (i / 5, i % 5);
            let (a, z) = (sv[b * 9 + o], dv[b * 6 + o]);
            assert!(a.to_bits() == z.to_bits(), "gather {d:?} element {i}");
        }
    }
    // The exp the kernels use is the Rust math's, bit for bit, over its whole range.
    let xs: Vec<f32> = (-20000..20000).map(|i| i as f32 * 0.0047).collect();
    let mut t = T::F32(xs.clone());
    let mut out = T::F32(vec![0.0; xs.len()]);
    run(
        &Kernel::new(Op::Gelu, &[Dtype::Fp32, Dtype::Fp32]),
        &[t.ptr(), out.ptr()],
        xs.len(),
    );
    let want: Vec<f32> = xs.iter().map(|&x| gelu(x)).collect();
    same("gelu over its range", &out.values(), &want);
}

/// The words the arena stores for `v` written in dtype `d` (the host device's stores).
fn arena_words(d: Dtype, v: &[f32]) -> Vec<u16> {
    let bytes = (v.len() * d.bytes() as usize) as u64;
    let arena = Arena::new(bytes);
    arena.write(0, d, v).unwrap();
    arena.read_bytes(0, bytes).unwrap()
}

#[test]
fn fill_and_store_double_write_what_the_arena_writes() {
    let fills = [
        1.3f32,
        -0.0,
        1e-40,
        65520.0,
        1e30,
        f32::NEG_INFINITY,
        f32::NAN,
    ];
    // Sums that round on the way to f32 (ties, overflow, underflow) and to the 16-bit dtypes.
    let sums = [
        0.1f64,
        -0.0,
        1.0 + 2f64.powi(-24),
        1.0 + 3.0 * 2f64.powi(-25),
        7e38,
        -1e-310,
        -7.25e-9,
        f64::NAN,
        1_234.567_890_123_4,
    ];
    for d in DTYPES {
        for v in fills {
            let mut x = T::new(d, &[0.5; 37]);
            run(&Kernel::new(Op::Fill, &[d]), &[x.ptr(), slot_f32(v)], 37);
            assert_eq!(x.words(), arena_words(d, &[v; 37]), "fill {v} {d:?}");
        }
        let mut acc = sums.to_vec();
        let mut dst = T::new(d, &vec![0.0; sums.len()]);
        let k = Kernel::new(Op::StoreDouble, &[d]);
        run(&k, &[slot_ptr(acc.as_mut_ptr()), dst.ptr()], sums.len());
        // The host device's grad_norm: `total as f32`, then the arena's write.
        let want: Vec<f32> = sums.iter().map(|&x| x as f32).collect();
        assert_eq!(dst.words(), arena_words(d, &want), "store_double {d:?}");
    }
}

#[test]
fn halves_match_the_host_devices_statistics() {
    let n = 29;
    let mut v = values(35, n, 1.0);
    // NaN payloads (a signalling one included) move as bits.
    v[4] = f32::from_bits(0x7f80_0001);
    v[9] = f32::from_bits(0xffc1_2345);
    // Byte 2 of the arena: 2-byte aligned, not 4.
    let arena = Arena::new(4 * n as u64 + 4);
    let host = Host::new(&arena, &[], vec![]);
    let mut src = v.clone();
    host.store_f32(HostPtr::of(&mut src), 2, n).unwrap();
    let want = arena.read_bytes(2, 4 * n as u64).unwrap();
    let mut words = vec![0u16; 2 * n + 1];
    let stored = slot_ptr(words[1..].as_mut_ptr());
    run(
        &Kernel::new(Op::StoreHalves, &[]),
        &[slot_ptr(src.as_mut_ptr()), stored],
        n,
    );
    assert_eq!(words[1..], want[..], "store_halves");
    let mut back = vec![0f32; n];
    let k = Kernel::new(Op::LoadHalves, &[]);
    run(&k, &[stored, slot_ptr(back.as_mut_ptr())], n);
    let mut host_back = vec![0f32; n];
    host.load_f32(2, HostPtr::of(&mut host_back), n).unwrap();
    let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&back), bits(&host_back), "load_halves");
    assert_eq!(bits(&back), bits(&v), "round trip");
}

#[test]
fn embedding_matches_the_host_device() {
    // Few token ids (so rows repeat and their gradients pile up in order) and a token count
    // that is not a multiple of the sequence length.
    let (vocab, h, s, t) = (11usize, 24usize, 7usize, 23usize);
    let tokens: Vec<u32> = (0..t as u32).map(|i| (i * 7 + 3) % vocab as u32).collect();
    let arena = Arena::new(8);
    let host = Host::new(&arena, &[], vec![]);
    let f = Dtype::Fp32;
    for positions in [false, true] {
        let tables = if positions { 2 } else { 1 };
        let (v, w, sq) = (vocab as u32, h as u32, s as u32);
        for d in DTYPES {
            let (mut wte, mut wpe) = (
                round(d, &values(30, vocab * h, 1.0)),
                round(d, &values(31, s * h, 1.0)),
            );
            let mut want = vec![0.0; t * h];
            without(|| {
                let wpe = positions.then(|| HostPtr::of(&mut wpe));
                let (tk, out) = (HostTokens::of(&tokens), HostPtr::of(&mut want));
                host.embedding(
                    &Lookup {
                        tokens: tk,
                        vocab,
                        h,
                        s,
                        t,
                    },
                    HostPtr::of(&mut wte),
                    wpe,
                    out,
                )
            })
            .unwrap();
            let (mut twte, mut twpe) = (T::new(d, &wte), T::new(d, &wpe));
            let mut out = T::new(d, &vec![0.0; t * h]);
            let mut args = vec![slot_ptr(tokens.as_ptr()), twte.ptr()];
            if positions {
                args.push(twpe.ptr());
            }
            args.push(out.ptr());
            let op = Op::Embedding {
                vocab: v,
                width: w,
                seq_len: sq,
                positions,
            };
            run(&Kernel::new(op, &vec![d; tables + 1]), &args, t * h);
            assert_eq!(
                out.words(),
                arena_words(d, &want),
                "embedding {d:?} positions={positions}"
            );
        }

        // Backward into fp32 tables with a guard row past the vocabulary that nothing may touch.
        let dy = values(32, t * h, 1.0);
        let (mut dwte, mut dwpe) = (finite(33, (vocab + 1) * h, 0.1), finite(34, s * h, 0.1));
        let (mut twte, mut twpe) = (T::F32(dwte.clone()), T::F32(dwpe.clone()));
        without(|| {
            let dwpe = positions.then(|| HostPtr::of(&mut dwpe));
            let (tk, g) = (HostTokens::of(&tokens), HostPtr::read_only(&dy));
            host.embedding_backward(
                &Lookup {
                    tokens: tk,
                    vocab,
                    h,
                    s,
                    t,
                },
                g,
                HostPtr::of(&mut dwte),
                dwpe,
            )
        })
        .unwrap();
        let mut bad = tokens.clone();
        bad[5] = vocab as u32;
        for (ids, what) in [(&tokens, "in range"), (&bad, "token outside")] {
            let mut tdy = T::F32(dy.clone());
            let mut args = vec![slot_ptr(ids.as_ptr()), tdy.ptr(), twte.ptr()];
            if positions {
                args.push(twpe.ptr());
            }
            args.push(slot_i64(t as i64));
            let op = Op::EmbeddingBackward {
                vocab: v,
                width: w,
                seq_len: sq,
                positions,
            };
            let (before, before_pe) = (twte.values(), twpe.values());
            run(&Kernel::new(op, &vec![f; tables + 1]), &args, h);
            if what == "in range" {
                same(
                    &format!("dwte positions={positions}"),
                    &twte.values(),
                    &dwte,
                );
                if positions {
                    same("dwpe", &twpe.values(), &dwpe);
                }
                // Undo, for the second run from the same start.
                twte = T::F32(before);
                twpe = T::F32(before_pe);
            } else {
                let got = twte.values();
                same("guard row", &got[vocab * h..], &before[vocab * h..]);
            }
        }
        // A token outside the vocabulary reads as a NaN row rather than out of bounds.
        let mut out = T::F32(vec![0.0; t * h]);
        let mut twte = T::F32(values(30, vocab * h, 1.0));
        let mut twpe = T::F32(values(31, s * h, 1.0));
        let mut args = vec![slot_ptr(bad.as_ptr()), twte.ptr()];
        if positions {
            args.push(twpe.ptr());
        }
        args.push(out.ptr());
        let op = Op::Embedding {
            vocab: v,
            width: w,
            seq_len: sq,
            positions,
        };
        run(&Kernel::new(op, &vec![f; tables + 1]), &args, t * h);
        assert!(out.values()[5 * h..6 * h].iter().all(|x| x.is_nan()));
    }
}

#[test]
fn naive_attention_rows_match_attention_rs() {
    // One block of the CPU's rows (s ≤ 64), so its score block is the whole s×s matrix the
    // same product gives here; grouped-query heads.
    let sh = Shape {
        b: 1,
        s: 45,
        heads: 4,
        kv_heads: 2,
        d: 16,
    };
    let (s, w) = (sh.s, sh.width());
    let qkv = finite(42, s * w, 1.0);
    let mut scores = vec![0.0; sh.heads * s * s];
    for (n, block) in scores.chunks_exact_mut(s * s).enumerate() {
        let (q, k, _) = sh.offsets(0, n);
        let (qm, km) = (
            Mat::rows(&qkv[q..], s, sh.d, w),
            Mat::rows(&qkv[k..], s, sh.d, w),
        );
        gemm(sh.scale(), qm, km.t(), 0.0, MatMut::dense(block, s, s));
    }
    let rows = sh.heads * s;
    let f = Dtype::Fp32;
    for d in DTYPES {
        let mut want = vec![0.0; rows * s];
        let mut out = vec![0.0; s * sh.hidden()];
        let mut scratch = vec![0.0; sh.scratch()];
        let keep = Keep::Probs(&mut want[..]);
        attention::forward(&sh, &qkv, &mut out, keep, Precision::of(d), &mut scratch);
        let mut tsc = T::F32(scores.clone());
        let mut probs = T::new(d, &vec![f32::NAN; rows * s]);
        let mut lse = vec![f32::NAN; rows];
        let k = Kernel::new(Op::CausalSoftmax, &[f, d]);
        let whole = [s, 0, s].map(|v| slot_i64(v as i64));
        let args = [
            tsc.ptr(),
            probs.ptr(),
            slot_ptr(lse.as_mut_ptr()),
            whole[0],
            whole[1],
            whole[2],
        ];
        run(&k, &args, rows);
        same(&format!("causal softmax {d:?}"), &probs.values(), &want);
        // Each row's log-sum-exp: exp(score − lse) is the kept probability before rounding.
        for (r, &l) in lse.iter().enumerate() {
            let i = r % s;
            let live = &scores[r * s..r * s + i + 1];
            let max = live.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x));
            let sum: f32 = live.iter().map(|&x| (x - max).exp()).sum();
            let want_l = max + sum.ln();
            assert!(
                (l - want_l).abs() <= 1e-5 * want_l.abs().max(1.0),
                "lse[{r}]"
            );
        }

        // attention.rs's dS = P ∘ (dP − rowsum(P ∘ dP))·scale over the block's columns.
        let dp = values(43, rows * s, 1.0);
        let mut want_ds = dp.clone();
        for (prow, drow) in want.chunks_exact(s).zip(want_ds.chunks_exact_mut(s)) {
            let dot: f32 = prow.iter().zip(drow.iter()).map(|(a, b)| a * b).sum();
            for (x, &p) in drow.iter_mut().zip(prow) {
                *x = p * (*x - dot) * sh.scale();
            }
        }
        let mut tdp = T::F32(dp);
        let k = Kernel::new(Op::SoftmaxBackward, &[d, f, f]);
        let args = [
            probs.ptr(),
            tdp.ptr(),
            tdp.ptr(),
            slot_f32(sh.scale()),
            slot_i64(s as i64),
        ];
        run(&k, &args, rows);
        same(&format!("softmax backward {d:?}"), &tdp.values(), &want_ds);
    }
}

/// The rows a norm's backward reads.
fn norm_rows<'a>(
    kind: Norm,
    h: usize,
    x: &'a [f32],
    w: &'a [f32],
    stats: &'a [f32],
) -> NormRows<'a> {
    NormRows {
        kind,
        h,
        x,
        w,
        stats,
    }
}
