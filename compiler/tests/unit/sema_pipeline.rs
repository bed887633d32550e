//! Unit tests of `sema::pipeline` (a child module of it: they reach its private items).

use super::*;

#[test]
fn balanced_minimises_the_largest_chunk() {
    // Uniform layers split as evenly as they can, the front chunks taking the extra layer.
    assert_eq!(balanced(&[1.0; 10], 4), [3, 3, 2, 2]);
    assert_eq!(balanced(&[1.0; 8], 8), [1; 8]);
    // A light embedding and head join their neighbours; a heavy head stands alone.
    assert_eq!(balanced(&[0.1, 1.0, 1.0, 1.0, 1.0, 0.2], 2), [3, 3]);
    assert_eq!(balanced(&[0.1, 1.0, 1.0, 1.0, 3.0], 2), [4, 1]);
    // Every chunk gets a layer even when one layer outweighs the rest.
    assert_eq!(balanced(&[5.0, 1.0, 1.0, 1.0], 4), [1, 1, 1, 1]);
    assert_eq!(balanced(&[5.0, 1.0, 1.0, 1.0], 2), [1, 3]);
}

#[test]
fn balanced_is_optimal_on_small_inputs() {
    // Against every split, for a few cost lists.
    fn best(costs: &[f64], k: usize) -> f64 {
        if k == 1 {
            return costs.iter().sum();
        }
        (1..=costs.len() - (k - 1))
            .map(|first| {
                let head: f64 = costs[..first].iter().sum();
                head.max(best(&costs[first..], k - 1))
            })
            .fold(f64::INFINITY, f64::min)
    }
    let lists: [&[f64]; 4] = [
        &[3.0, 1.0, 4.0, 1.0, 5.0, 9.0, 2.0, 6.0],
        &[0.5, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0, 7.0],
        &[1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0],
        &[9.0, 0.1, 0.1, 0.1, 0.1, 9.0],
    ];
    for costs in lists {
        for k in 1..=costs.len() {
            let split = balanced(costs, k);
            assert_eq!(split.len(), k);
            assert!(split.iter().all(|&l| l >= 1));
            assert_eq!(split.iter().sum::<u32>() as usize, costs.len());
            let mut at = 0;
            let largest = split
                .iter()
                .map(|&l| {
                    let s: f64 = costs[at..at + l as usize].iter().sum();
                    at += l as usize;
                    s
                })
                .fold(0.0, f64::max);
            assert!(
                (largest - best(costs, k)).abs() < 1e-9,
                "{costs:?} k={k}: {split:?}"
            );
        }
    }
}
