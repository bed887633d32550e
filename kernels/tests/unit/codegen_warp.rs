//! Unit tests of `codegen::warp` (a child module of it: they reach its private items).

use super::super::{slot_f32, slot_i64, slot_ptr, HostKernels};
use crate::flash::tests::values;
use crate::flash::{self, Grads, Shape};
use crate::{Kernel, NormEps, Op, Param};
use sched_ir::job::{Dtype, Norm};

/// The fused attention's generated code (the PTX kernels' IR, built for the host with the
/// warp's instructions as calls), run as a warp of 32 threads, computes exactly what its
/// lane-by-lane model computes: the same bits for the forward's output and log-sum-exps
/// and for the backward's dqkv, over sequences that end inside a 16-row block, GQA and
/// MHA, heads of 16, 32 and 128 (whose key side runs in two 64-column parts). Both take
/// their products from `flash::mma` and exp2/log2 from the host, so any difference is the
/// code's: an index, a mask, a fragment, a rounding point.
#[test]
fn the_generated_fused_attention_is_its_model() {
    let (h, f) = (Dtype::Bf16, Dtype::Fp32);
    let shapes = [
        (
            Shape {
                heads: 2,
                kv_heads: 1,
                d: 32,
                s: 37,
            },
            2,
        ),
        (
            Shape {
                heads: 2,
                kv_heads: 2,
                d: 16,
                s: 20,
            },
            1,
        ),
        (
            Shape {
                heads: 2,
                kv_heads: 1,
                d: 128,
                s: 20,
            },
            1,
        ),
    ];
    for (sh, b) in shapes {
        let kernels = [
            Kernel::new(Op::FlashForward(sh), &[h, f]),
            Kernel::new(Op::FlashBackwardQuery(sh), &[h, h, f]),
            Kernel::new(Op::FlashBackwardKeys(sh), &[h, h, f]),
        ];
        let jit = HostKernels::jit_warp(&kernels).unwrap();
        let mut seed = 0x5eed_0123_4567_89abu64;
        let (w, hidden, rows) = (sh.width(), sh.heads * sh.d, b * sh.heads * sh.s);
        let qkv = values(b * sh.s * w, &mut seed);
        let dout = values(b * sh.s * hidden, &mut seed);

        let mut want = vec![f32::NAN; b * sh.s * hidden];
        let mut want_lse = vec![f32::NAN; rows];
        for wi in 0..sh.warps(b) {
            flash::warp(&sh, wi, &qkv, &mut |i, v| want[i] = v, &mut want_lse);
        }
        let mut out = vec![f32::NAN; want.len()];
        let mut lse = vec![f32::NAN; rows];
        let args = [
            slot_ptr(qkv.as_ptr()),
            slot_ptr(out.as_mut_ptr()),
            slot_ptr(lse.as_mut_ptr()),
        ];
        // SAFETY: the buffers hold every element the kernel's warps touch.
        unsafe { jit.run_warp(&kernels[0], &args, 0, sh.warps(b)) }.unwrap();
        let same = |a: &[f32], b: &[f32]| a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
        assert!(same(&out, &want), "{sh:?}: forward output");
        assert!(same(&lse, &want_lse), "{sh:?}: log-sum-exps");

        // The backward from those log-sum-exps and some D.
        let dot: Vec<f32> = values(rows, &mut seed)
            .iter()
            .map(|&v| flash::widen(v))
            .collect();
        let x = Grads {
            qkv: &qkv,
            dout: &dout,
            lse: &want_lse,
            dot: &dot,
        };
        let mut want = vec![f32::NAN; qkv.len()];
        for wi in 0..sh.warps(b) {
            flash::warp_dq(&sh, wi, &x, &mut |i, v| want[i] = v);
        }
        for wi in 0..sh.key_warps(b) {
            flash::warp_dkv(&sh, wi, &x, &mut |i, v| want[i] = v);
        }
        let mut dqkv = vec![f32::NAN; qkv.len()];
        let args = [
            slot_ptr(qkv.as_ptr()),
            slot_ptr(dout.as_ptr()),
            slot_ptr(want_lse.as_ptr()),
            slot_ptr(dot.as_ptr()),
            slot_ptr(dqkv.as_mut_ptr()),
        ];
        // SAFETY: as above.
        unsafe {
            jit.run_warp(&kernels[1], &args, 0, sh.warps(b)).unwrap();
            jit.run_warp(&kernels[2], &args, 0, sh.key_warps(b))
                .unwrap();
        }
        assert!(same(&dqkv, &want), "{sh:?}: dqkv");
    }
}

/// A kernel's buffer: 32-bit words (fp32, u32 tokens) or bf16.
#[derive(Clone)]
enum Buf {
    W32(Vec<u32>),
    W16(Vec<u16>),
}

impl Buf {
    fn ptr(&mut self) -> u64 {
        match self {
            Buf::W32(v) => slot_ptr(v.as_mut_ptr()),
            Buf::W16(v) => slot_ptr(v.as_mut_ptr()),
        }
    }

    fn values(&self) -> Vec<f32> {
        match self {
            Buf::W32(v) => v.iter().map(|&w| f32::from_bits(w)).collect(),
            Buf::W16(v) => v.iter().map(|&w| flash::widen(w)).collect(),
        }
    }
}

/// Every row kernel's GPU lane code (the lanes striding a row, shuffle reductions, the
/// one-pass log-sum-exp, lane 0's stores) run as a warp on the host agrees with its
/// one-lane host code on random inputs: layer and RMS norms and the norm's input gradient,
/// cross-entropy over 259 classes, rotary positions, the causal softmax (bf16
/// probabilities) and its backward, and the fused backward's row sums. fp32 results within
/// 1e-5 of 1 + |value| (the lanes sum in another order), 16-bit ones within 1e-2 (a rounding
/// may fall the other way); what the kernel does not write stays as it was.
#[test]
fn row_kernels_on_a_warp_agree_with_one_lane() {
    let (f, h) = (Dtype::Fp32, Dtype::Bf16);
    let rows = 5usize;
    let sh = Shape {
        heads: 2,
        kv_heads: 1,
        d: 32,
        s: 8,
    };
    let norm = |norm, bias| Op::Norm {
        norm,
        width: 67,
        bias,
        eps: NormEps::DEFAULT,
    };
    let rotary = Op::Rotary {
        heads: 4,
        kv_heads: 2,
        head_dim: 16,
        width: 128,
        seq_len: 8,
        inverse: false,
    };
    let cases: Vec<(Kernel, usize)> = vec![
        (
            Kernel::new(norm(Norm::LayerNorm, true), &[h, h, h, f]),
            rows,
        ),
        (Kernel::new(norm(Norm::RmsNorm, false), &[f, f, f]), rows),
        (
            Kernel::new(
                Op::NormBackwardInput {
                    norm: Norm::LayerNorm,
                    width: 67,
                },
                &[f, f, f, f, f],
            ),
            rows,
        ),
        (
            Kernel::new(
                Op::CrossEntropy {
                    vocab: 259,
                    stride: 264,
                },
                &[f, f],
            ),
            rows,
        ),
        (Kernel::new(rotary, &[f]), rows),
        (Kernel::new(Op::CausalSoftmax, &[f, h]), rows),
        (Kernel::new(Op::SoftmaxBackward, &[f, f, f]), rows),
        (Kernel::new(Op::FlashDot(sh), &[f, f]), sh.s * sh.heads),
    ];
    let kernels: Vec<Kernel> = cases.iter().map(|(k, _)| k.clone()).collect();
    let (host, warp) = (
        HostKernels::jit(&kernels).unwrap(),
        HostKernels::jit_warp(&kernels).unwrap(),
    );
    let mut seed = 0xfeed_beef_1234_5678u64;
    for (k, n) in &cases {
        // Every buffer generously sized; scalars fixed (a softmax chunk of 70 keys from
        // query 3 on, so each row has live keys and zeros after them).
        let mut bufs: Vec<Option<Buf>> = vec![];
        let mut scalars: Vec<u64> = vec![];
        for p in k.params() {
            let len = 4096;
            match p {
                Param::Tensor(_, Dtype::Bf16) => {
                    bufs.push(Some(Buf::W16(values(len, &mut seed))));
                    scalars.push(0);
                }
                Param::Tensor(..) | Param::F32s(_) => {
                    let v = values(len, &mut seed);
                    let words = v.iter().map(|&w| flash::widen(w).to_bits()).collect();
                    bufs.push(Some(Buf::W32(words)));
                    scalars.push(0);
                }
                Param::Tokens(_) => {
                    let t = values(len, &mut seed);
                    let t = t.iter().map(|&w| u32::from(w) % 259).collect();
                    bufs.push(Some(Buf::W32(t)));
                    scalars.push(0);
                }
                Param::F32(name) => {
                    bufs.push(None);
                    scalars.push(slot_f32(if name == "inv" { 0.25 } else { 0.125 }));
                }
                Param::I64(name) => {
                    bufs.push(None);
                    let v = match name {
                        "keys" => 70,
                        "first" => 3,
                        _ => rows as i64,
                    };
                    scalars.push(slot_i64(v));
                }
                other => panic!("{k}: no test buffer for {other:?}"),
            }
        }
        let run = |jit: &HostKernels, on_warp: bool| -> Vec<Option<Buf>> {
            let mut b = bufs.clone();
            let args: Vec<u64> = b
                .iter_mut()
                .zip(&scalars)
                .map(|(b, &s)| b.as_mut().map_or(s, Buf::ptr))
                .collect();
            // SAFETY: every buffer holds more than the kernel's `n` indices touch.
            unsafe {
                if on_warp {
                    jit.run_warp(k, &args, 0, *n).unwrap();
                } else {
                    jit.run(k, &args, 0, *n).unwrap();
                }
            }
            b
        };
        let (one, many) = (run(&host, false), run(&warp, true));
        for (i, (a, b)) in one.iter().zip(&many).enumerate() {
            let (Some(a), Some(b)) = (a, b) else {
                continue;
            };
            let tol = match a {
                Buf::W32(_) => 1e-5,
                Buf::W16(_) => 1e-2,
            };
            for (j, (x, y)) in a.values().iter().zip(b.values()).enumerate() {
                let close = (x - y).abs() <= tol * (1.0 + x.abs()) || (x.is_nan() && y.is_nan());
                assert!(
                    close,
                    "{k} parameter {i} element {j}: one lane {x}, a warp {y}"
                );
            }
        }
    }
}
