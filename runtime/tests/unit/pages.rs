//! Unit tests of `pages` (a child module of it: they reach its private items).

use super::*;
use std::sync::atomic::Ordering::Relaxed;

#[test]
fn buffers_are_zeroed_and_usable_at_every_size() {
    for n in [0, 1, 1000, (5 << 20) / 4 + 3] {
        let mut v: Vec<f32> = zeroed(n);
        assert_eq!(v.len(), n);
        assert!(v.iter().all(|&x| x.to_bits() == 0));
        v.iter_mut().enumerate().for_each(|(i, x)| *x = i as f32);
        assert!(v.iter().enumerate().all(|(i, &x)| x == i as f32));
        let w: Vec<AtomicU32> = zeroed(n);
        assert!(w.iter().all(|x| x.load(Relaxed) == 0));
        let b = w.into_boxed_slice();
        assert_eq!(b.len(), n);
    }
}
