//! Unit tests of `math::ops` (a child module of it: they reach its private items).

use super::*;

/// `prefetched` hands its body every index of `0..n` once, in order, in blocks of at most
/// `BLOCK`, whatever n's remainder.
#[test]
fn prefetched_blocks_cover_every_index_once() {
    for n in [0, 1, BLOCK - 1, BLOCK, BLOCK + 1, 3 * BLOCK + 77] {
        let data = vec![0f32; n];
        let mut seen = vec![];
        prefetched(n, [data.as_ptr()], |lo, hi| {
            assert!(lo < hi && hi - lo <= BLOCK, "block {lo}..{hi} of {n}");
            seen.extend(lo..hi);
        });
        assert_eq!(seen, (0..n).collect::<Vec<_>>(), "n = {n}");
    }
}

/// `exp` reads n's integer value from the bits of its rounding sum; the saturating cast it
/// replaced gives the same bits everywhere (NaN included), on a sweep of every 4,099th f32.
#[test]
fn exp_reads_the_exponent_as_the_cast_did() {
    fn by_cast(x: f32) -> f32 {
        let xc = x.clamp(-87.33, 88.37);
        let n = (xc * std::f32::consts::LOG2_E + 12_582_912.0) - 12_582_912.0;
        let r = (xc - n * 0.693_359_4) - n * -2.121_944_4e-4;
        let mut p = 1.987_569_1e-4f32;
        for c in [
            1.398_199_9e-3,
            8.333_452e-3,
            4.166_579_6e-2,
            1.666_666_5e-1,
            0.5,
        ] {
            p = p * r + c;
        }
        let v = (p * r * r + r + 1.0) * f32::from_bits(((n as i32 + 127) as u32) << 23);
        let v = if x < -87.33 { 0.0 } else { v };
        if x > 88.37 {
            f32::INFINITY
        } else {
            v
        }
    }
    for i in (0..=u32::MAX / 4099)
        .map(|i| i * 4099)
        .chain([0x7fc0_0001, 0xffc0_0000])
    {
        let x = f32::from_bits(i);
        assert_eq!(exp(x).to_bits(), by_cast(x).to_bits(), "{x:e} ({i:#010x})");
    }
}

#[test]
fn exp_is_within_two_ulp() {
    let mut worst = 0f64;
    let mut x = -87.33f32;
    while x <= 88.37 {
        let want = f64::from(x).exp();
        let got = f64::from(exp(x));
        let ulp = f64::from(f32::EPSILON) * want;
        worst = worst.max((got - want).abs() / ulp);
        x += 0.001_37;
    }
    assert!(worst <= 2.0, "worst error {worst} ulp");
    assert_eq!(exp(0.0), 1.0);
    assert_eq!(exp(-100.0), 0.0);
    assert_eq!(exp(f32::NEG_INFINITY), 0.0);
    assert_eq!(exp(89.0), f32::INFINITY);
    assert!(exp(88.37).is_finite() && exp(-87.33) > 0.0);
    assert!(exp(f32::NAN).is_nan());
}

#[test]
fn tanh_matches_libm() {
    for i in -2000..2000 {
        let u = i as f32 * 0.005;
        assert!((tanh(u) - u.tanh()).abs() <= 4.0 * f32::EPSILON, "{u}");
    }
}
