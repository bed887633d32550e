//! The generated kernels (`schedc::kernels`, JIT-compiled for this processor) against this
//! module's Rust math: the same bits for every element-wise, optimizer, norm, loss, rotary and
//! conversion kernel, in every storage dtype the plans use, on random values with the edge
//! cases mixed in (zeros of both signs, infinities, NaN, huge and subnormal values).
//!
//! The GPU runs the same IR (only `ln` and the thread loop differ), so these tests are the CPU
//! half of the kernels' verification; `compiler/tests/kernels.rs` assembles the GPU half.

use super::ops::{gelu, gelu_grad, norm_backward, norm_forward, sigmoid, Rope};
use super::{cross_entropy, optimizer_step, OptimizerConfig, Rng};
use crate::math::{bf16_bits_to_f32, f32_to_bf16_bits};
use schedc::job::{Dtype, Norm, Optimizer};
use schedc::kernels::codegen::{slot_f32, slot_i64, slot_ptr, HostKernels};
use schedc::kernels::{Kernel, Op, SUMSQ_CHUNK};

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
        match self {
            T::F32(v) => slot_ptr(v.as_mut_ptr()),
            T::Half(v, _) => slot_ptr(v.as_mut_ptr()),
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
        let k = Kernel::new(Op::SwiGluBackward, &[Dtype::Fp32, Dtype::Fp32, d, d]);
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
    }
}

#[test]
fn norms_match_ops() {
    let (rows, h) = (13, 67);
    for norm in [Norm::LayerNorm, Norm::RmsNorm] {
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
            norm_forward(norm, h, &x, &w, bb, &mut wo, &mut ws);
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
            norm_backward(norm, h, &x, &w, &ws, &dy, Some(&mut wdx), &mut wdw, wdbr);
            let f = Dtype::Fp32;
            let mut tdy = T::F32(dy.clone());
            let mut tdx = T::F32(dx0);
            let op = Op::NormBackwardInput {
                norm,
                width: h as u32,
            };
            let args = [tx.ptr(), tw.ptr(), stats.ptr(), tdy.ptr(), tdx.ptr()];
            run(&Kernel::new(op, &[d, d, f, f]), &args, rows);
            same(&format!("{norm:?} {d:?} dx"), &tdx.values(), &wdx);
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

#[test]
fn cross_entropy_matches() {
    // A vocabulary that is not a multiple of the eight lanes.
    let (rows, vocab) = (9, 203);
    for d in [Dtype::Fp32, Dtype::Bf16] {
        let z = round(d, &finite(12, rows * vocab, 4.0));
        let targets: Vec<u32> = (0..rows as u32)
            .map(|r| (r * 37 + 5) % vocab as u32)
            .collect();
        let mut wg = vec![0.0; rows * vocab];
        let total = cross_entropy(&z, &targets, vocab, &mut wg);
        let mut tz = T::new(d, &z);
        let mut tt = targets.clone();
        let mut grad = T::F32(vec![0.0; rows * vocab]);
        let mut loss = T::F32(vec![0.0; rows]);
        let inv = 1.0 / rows as f32;
        let k = Kernel::new(
            Op::CrossEntropy {
                vocab: vocab as u32,
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
        let sum: f64 = loss.values().iter().map(|&l| f64::from(l)).sum();
        assert_eq!(sum.to_bits(), total.to_bits(), "loss {sum} vs {total}");
    }
}

#[test]
fn rotary_matches_rope() {
    let (heads, kv, d, s, tokens) = (4usize, 2usize, 16usize, 8usize, 20usize);
    let width = heads * d + 2 * kv * d;
    let rope = Rope::new(d, s);
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

#[test]
fn optimizers_match_optimizer_step() {
    let n = 1037;
    for kind in [Optimizer::Adam, Optimizer::AdamW, Optimizer::Sgd] {
        for d in [Dtype::Fp32, Dtype::Bf16] {
            let cfg = OptimizerConfig::new(kind, 3e-3);
            let step = 7;
            let grad = round(d, &finite(14, n, 1.0));
            let mut state = finite(15, n, 1.0);
            if kind != Optimizer::Sgd {
                state.extend(finite(16, n, 0.01));
                state.extend(finite(17, n, 0.01).iter().map(|x| x * x));
            }
            let scale = 0.25f32;
            // The whole shard decayed (AdamW's 2-D tensors), or not.
            for decayed in [false, true] {
                if decayed && kind != Optimizer::AdamW {
                    continue;
                }
                let decay: Vec<std::ops::Range<usize>> = if decayed {
                    std::iter::once(0..n).collect()
                } else {
                    vec![]
                };
                let mut want = state.clone();
                optimizer_step(&cfg, &mut want, &grad, scale, step, 0, &decay);
                let mut st = state.clone();
                let (master, rest) = st.split_at_mut(n);
                let mut tg = T::new(d, &grad);
                let mut param = T::new(d, &vec![0.0; n]);
                let (k, args) = if kind == Optimizer::Sgd {
                    let k = Kernel::new(Op::Sgd, &[d, d]);
                    let args = vec![
                        slot_ptr(master.as_mut_ptr()),
                        tg.ptr(),
                        param.ptr(),
                        slot_f32(scale),
                        slot_f32(cfg.lr),
                    ];
                    (k, args)
                } else {
                    let (m, v) = rest.split_at_mut(n);
                    let bc1 = 1.0 - f64::from(cfg.beta1).powf(step as f64);
                    let bc2 = 1.0 - f64::from(cfg.beta2).powf(step as f64);
                    let k = Kernel::new(Op::Adam { decayed }, &[d, d]);
                    let args = vec![
                        slot_ptr(master.as_mut_ptr()),
                        slot_ptr(m.as_mut_ptr()),
                        slot_ptr(v.as_mut_ptr()),
                        tg.ptr(),
                        param.ptr(),
                        slot_f32(scale),
                        slot_f32(cfg.beta1),
                        slot_f32(1.0 - cfg.beta1),
                        slot_f32(cfg.beta2),
                        slot_f32(1.0 - cfg.beta2),
                        slot_f32(cfg.eps),
                        slot_f32((f64::from(cfg.lr) / bc1) as f32),
                        slot_f32(bc2.sqrt() as f32),
                        slot_f32(1.0 - cfg.lr * cfg.weight_decay),
                    ];
                    (k, args)
                };
                run(&k, &args, n);
                same(
                    &format!("{kind:?} {d:?} decayed={decayed} state"),
                    &st,
                    &want,
                );
                same(
                    &format!("{kind:?} {d:?} param"),
                    &param.values(),
                    &round(d, &want[..n]),
                );
            }
        }
    }
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
        super::gemm::col_sums(&y, w, &mut wdb);
        let (mut tdy, mut tdb) = (T::F32(y.clone()), T::F32(db0));
        let k = Kernel::new(
            Op::BiasGrad { width: w as u32 },
            &[Dtype::Fp32, Dtype::Fp32],
        );
        run(&k, &[tdy.ptr(), tdb.ptr(), slot_i64(rows as i64)], w);
        same("bias grad", &tdb.values(), &wdb);

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
