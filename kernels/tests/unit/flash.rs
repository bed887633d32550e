//! Unit tests of `flash` (a child module of it: they reach its private items).

use super::*;

/// `n` bf16 values in [−2, 2) from a xorshift seeded with `seed` (also the warp tests').
pub(crate) fn values(n: usize, seed: &mut u64) -> Vec<u16> {
    (0..n)
        .map(|_| {
            *seed ^= *seed << 13;
            *seed ^= *seed >> 7;
            *seed ^= *seed << 17;
            bf16((*seed >> 40) as f32 / (1u64 << 24) as f32 * 4.0 - 2.0)
        })
        .collect()
}

/// The test shapes with their sequence counts: grouped-query and multi-head, heads of
/// `widths`, sequences of 48, 37 and 20 tokens (the last two end inside a 16-row block).
fn shapes(widths: [usize; 3]) -> [(Shape, usize); 3] {
    let sh = |heads, kv_heads, d, s| Shape {
        heads,
        kv_heads,
        d,
        s,
    };
    [
        (sh(2, 2, widths[0], 48), 2),
        (sh(4, 2, widths[1], 37), 1),
        (sh(2, 1, widths[2], 20), 2),
    ]
}

/// Causal attention in f64 on the bf16 inputs: the output and each row's log-sum-exp.
fn reference(sh: &Shape, b: usize, qkv: &[u16]) -> (Vec<f64>, Vec<f64>) {
    let (d, s, w, hidden) = (sh.d, sh.s, sh.width(), sh.heads * sh.d);
    let x = |t: usize, c: usize| f64::from(widen(qkv[t * w + c]));
    let mut out = vec![0f64; b * s * hidden];
    let mut lse = vec![0f64; b * sh.heads * s];
    for bi in 0..b {
        for n in 0..sh.heads {
            let g = n / (sh.heads / sh.kv_heads);
            let (qc, kc) = (n * d, hidden + g * d);
            let vc = hidden + sh.kv_heads * d + g * d;
            for i in 0..s {
                let scores: Vec<f64> = (0..=i)
                    .map(|j| {
                        let dot: f64 = (0..d)
                            .map(|c| x(bi * s + i, qc + c) * x(bi * s + j, kc + c))
                            .sum();
                        dot / (d as f64).sqrt()
                    })
                    .collect();
                let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let sum: f64 = scores.iter().map(|v| (v - max).exp()).sum();
                lse[(bi * sh.heads + n) * s + i] = max + sum.ln();
                for c in 0..d {
                    let v: f64 = (0..=i)
                        .map(|j| (scores[j] - max).exp() / sum * x(bi * s + j, vc + c))
                        .sum();
                    out[(bi * s + i) * hidden + qc + c] = v;
                }
            }
        }
    }
    (out, lse)
}

/// Every warp of the model against the f64 attention: outputs within 5e-3 (P goes to bf16
/// before P·V, as FlashAttention's does: errors up to 2.4e-3 here), log-sum-exps within
/// 1e-4. Shapes cover grouped-query heads, head widths of 32, 64 and 128, and sequences that
/// are not a multiple of the 16-row block (the last warp's padding rows are computed, never
/// stored).
#[test]
fn warps_compute_causal_attention() {
    for (sh, b) in shapes([64, 32, 128]) {
        let qkv = values(b * sh.s * sh.width(), &mut 0x2545_f491_4f6c_dd1d);
        let hidden = sh.heads * sh.d;
        let mut out = vec![f32::NAN; b * sh.s * hidden];
        let mut lse = vec![f32::NAN; b * sh.heads * sh.s];
        for w in 0..sh.warps(b) {
            warp(&sh, w, &qkv, &mut |i, v| out[i] = v, &mut lse);
        }
        let (want, want_lse) = reference(&sh, b, &qkv);
        for (i, (&got, &want)) in out.iter().zip(&want).enumerate() {
            let err = (f64::from(got) - want).abs();
            assert!(
                err <= 5e-3 * (1.0 + want.abs()),
                "{sh:?} out[{i}]: {got} vs {want}"
            );
        }
        for (i, (&got, &want)) in lse.iter().zip(&want_lse).enumerate() {
            let err = (f64::from(got) - want).abs();
            assert!(
                err <= 1e-4 * (1.0 + want.abs()),
                "{sh:?} lse[{i}]: {got} vs {want}"
            );
        }
    }
}

/// The backward's two warps against f64 gradients of causal attention on the same bf16
/// inputs (given the f64 log-sum-exps and D, rounded to f32): dQ, dK and dV within 2e-2 of
/// 1 + |value|, the bf16 bound (P and dS go to bf16 before their products; observed
/// 6.3e-3 at heads of 16 and 32, 9.4e-3 at 128, where the key side runs in two parts), every
/// element written exactly once.
#[test]
fn backward_warps_compute_the_gradients() {
    for (sh, b) in shapes([32, 16, 128]) {
        let mut seed = 0x1234_5678_9abc_def1;
        let (w, hidden) = (sh.width(), sh.heads * sh.d);
        let qkv = values(b * sh.s * w, &mut seed);
        let dout = values(b * sh.s * hidden, &mut seed);
        let (want, lse, dot) = reference_grads(&sh, b, &qkv, &dout);
        let (lse, dot): (Vec<f32>, Vec<f32>) = (
            lse.iter().map(|&v| v as f32).collect(),
            dot.iter().map(|&v| v as f32).collect(),
        );
        let x = Grads {
            qkv: &qkv,
            dout: &dout,
            lse: &lse,
            dot: &dot,
        };
        let mut got = vec![f32::NAN; qkv.len()];
        let mut writes = vec![0u8; qkv.len()];
        let mut store = |i: usize, v: f32| {
            got[i] = v;
            writes[i] += 1;
        };
        for wi in 0..sh.warps(b) {
            warp_dq(&sh, wi, &x, &mut store);
        }
        for wi in 0..sh.key_warps(b) {
            warp_dkv(&sh, wi, &x, &mut store);
        }
        assert!(writes.iter().all(|&n| n == 1), "{sh:?}: every element once");
        for (i, (&g, &want)) in got.iter().zip(&want).enumerate() {
            let err = (f64::from(g) - want).abs() / (1.0 + want.abs());
            assert!(err <= 2e-2, "{sh:?} dqkv[{i}]: {g} vs {want}");
        }
    }
}

/// f64 gradients of causal attention: dqkv, and each row's log-sum-exp and D = Σ dO·O.
fn reference_grads(
    sh: &Shape,
    b: usize,
    qkv: &[u16],
    dout: &[u16],
) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    let (d, s, w, hidden) = (sh.d, sh.s, sh.width(), sh.heads * sh.d);
    let x = |t: usize, c: usize| f64::from(widen(qkv[t * w + c]));
    let dy = |t: usize, c: usize| f64::from(widen(dout[t * hidden + c]));
    let mut g = vec![0f64; qkv.len()];
    let mut lse = vec![0f64; b * sh.heads * s];
    let mut dot = vec![0f64; b * sh.heads * s];
    let scale = 1.0 / (d as f64).sqrt();
    for bi in 0..b {
        for n in 0..sh.heads {
            let gr = n / (sh.heads / sh.kv_heads);
            let (qc, kc) = (n * d, hidden + gr * d);
            let vc = hidden + sh.kv_heads * d + gr * d;
            let t = |i: usize| bi * s + i;
            for i in 0..s {
                let sc: Vec<f64> = (0..=i)
                    .map(|j| {
                        (0..d)
                            .map(|c| x(t(i), qc + c) * x(t(j), kc + c))
                            .sum::<f64>()
                            * scale
                    })
                    .collect();
                let max = sc.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let sum: f64 = sc.iter().map(|v| (v - max).exp()).sum();
                let l = max + sum.ln();
                let p: Vec<f64> = sc.iter().map(|v| (v - l).exp()).collect();
                let o: Vec<f64> = (0..d)
                    .map(|c| (0..=i).map(|j| p[j] * x(t(j), vc + c)).sum())
                    .collect();
                let dd: f64 = (0..d).map(|c| dy(t(i), qc + c) * o[c]).sum();
                lse[(bi * sh.heads + n) * s + i] = l;
                dot[(bi * sh.heads + n) * s + i] = dd;
                for j in 0..=i {
                    let dp: f64 = (0..d).map(|c| dy(t(i), qc + c) * x(t(j), vc + c)).sum();
                    let ds = p[j] * (dp - dd);
                    for c in 0..d {
                        g[t(i) * w + qc + c] += ds * x(t(j), kc + c) * scale;
                        g[t(j) * w + kc + c] += ds * x(t(i), qc + c) * scale;
                        g[t(j) * w + vc + c] += p[j] * dy(t(i), qc + c);
                    }
                }
            }
        }
    }
    (g, lse, dot)
}

/// The fragment layouts cover each tile exactly once (two elements per register).
#[test]
fn fragments_tile_their_matrices() {
    let mut a = [[0u8; 16]; 16];
    let mut b = [[0u8; 8]; 16];
    let mut c = [[0u8; 8]; 16];
    for lane in 0..LANES {
        for r in 0..4 {
            let (i, k) = a_at(lane, r);
            a[i][k] += 1;
            a[i][k + 1] += 1;
            let (i, j) = c_at(lane, r);
            c[i][j] += 1;
        }
        for r in 0..2 {
            let (k, n) = b_at(lane, r);
            b[k][n] += 1;
            b[k + 1][n] += 1;
        }
    }
    assert!(a
        .iter()
        .flatten()
        .chain(b.iter().flatten())
        .all(|&x| x == 1));
    assert!(c.iter().flatten().all(|&x| x == 1));
}
