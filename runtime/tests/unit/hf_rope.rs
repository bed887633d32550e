//! The rotary convention of `transformers`' LLaMA against the project's rope: the attention
//! scores agree, so Hugging Face q and k rows load unpermuted.

use super::{f16_bits_to_f32, transpose};
use crate::math::ops::Rope;

/// `transformers`' `apply_rotary_pos_emb` for one head at position `pos`, written from its
/// source: inv_freq = 1 / base^(2i/d) (i < d/2), emb = cat(freqs, freqs),
/// q·cos(emb) + rotate_half(q)·sin(emb) with rotate_half(x) = cat(−x[d/2..], x[..d/2]).
fn hf_rotate(q: &[f32], pos: usize, base: f64) -> Vec<f32> {
    let d = q.len();
    let half = d / 2;
    let emb: Vec<f64> = (0..d)
        .map(|j| {
            let i = j % half;
            pos as f64 / base.powf(2.0 * i as f64 / d as f64)
        })
        .collect();
    let rotated: Vec<f32> = (0..d)
        .map(|j| if j < half { -q[j + half] } else { q[j - half] })
        .collect();
    (0..d)
        .map(|j| q[j] * emb[j].cos() as f32 + rotated[j] * emb[j].sin() as f32)
        .collect()
}

/// Meta's original pairing (2i with 2i + 1), which the Hugging Face conversion permutes away.
fn interleaved_rotate(q: &[f32], pos: usize, base: f64) -> Vec<f32> {
    let d = q.len();
    let mut out = q.to_vec();
    for i in 0..d / 2 {
        let a = pos as f64 / base.powf(2.0 * i as f64 / d as f64);
        let (c, s) = (a.cos() as f32, a.sin() as f32);
        out[2 * i] = q[2 * i] * c - q[2 * i + 1] * s;
        out[2 * i + 1] = q[2 * i + 1] * c + q[2 * i] * s;
    }
    out
}

fn values(seed: u32, n: usize) -> Vec<f32> {
    let mut x = seed.wrapping_mul(2_654_435_761).wrapping_add(1);
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            (x as f32 / u32::MAX as f32) * 2.0 - 1.0
        })
        .collect()
}

fn dot(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

#[test]
fn attention_scores_match_transformers_rotate_half() {
    let (d, seq) = (16usize, 12usize);
    for base in [10_000.0, 500_000.0] {
        let rope = Rope::new(d, seq, base);
        let mut worst = 0f32;
        let mut apart = 0f32;
        for (pq, pk) in [(3usize, 1usize), (7, 7), (11, 0), (5, 9)] {
            let (q, k) = (values(pq as u32 + 1, d), values(pk as u32 + 40, d));
            let (mut ours_q, mut ours_k) = (q.clone(), k.clone());
            rope.apply(&mut ours_q, 1, pq, false);
            rope.apply(&mut ours_k, 1, pk, false);
            let ours = dot(&ours_q, &ours_k) / (d as f32).sqrt();
            let theirs =
                dot(&hf_rotate(&q, pq, base), &hf_rotate(&k, pk, base)) / (d as f32).sqrt();
            worst = worst.max((ours - theirs).abs());
            let meta = dot(
                &interleaved_rotate(&q, pq, base),
                &interleaved_rotate(&k, pk, base),
            ) / (d as f32).sqrt();
            apart = apart.max((ours - meta).abs());
        }
        assert!(worst < 1e-5, "base {base}: scores differ by {worst}");
        // The check can tell conventions apart: the interleaved pairing scores differently.
        assert!(
            apart > 1e-3,
            "base {base}: interleaved pairing agrees too ({apart})"
        );
    }
}

#[test]
fn halves_and_transposes() {
    assert_eq!(f16_bits_to_f32(0x3c00), 1.0);
    assert_eq!(f16_bits_to_f32(0xc000), -2.0);
    assert_eq!(f16_bits_to_f32(0x0001), 2f32.powi(-24));
    assert_eq!(f16_bits_to_f32(0x7bff), 65504.0);
    assert!(f16_bits_to_f32(0x7c00).is_infinite());
    assert_eq!(
        transpose(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0], 2, 3),
        [1.0, 4.0, 2.0, 5.0, 3.0, 6.0]
    );
}
