//! Unit tests of `planner::space` (a child module of it: they reach its private items).

use super::*;

#[test]
fn nested_triples_count_chains_of_divisors() {
    // Chains x | y | z among the divisors of 8 (1, 2, 4, 8): C(4 + 2, 3) = 20 per dimension;
    // of 6 (1, 2, 3, 6): 1 + 3·... counted by brute force below.
    assert_eq!(shard_meshes(8, 1).len(), 20);
    let chains = |n: u32| {
        let d = divisors(n);
        let mut c = 0;
        for &x in &d {
            for &y in d.iter().filter(|y| *y % x == 0) {
                c += d.iter().filter(|z| *z % y == 0).count();
            }
        }
        c
    };
    assert_eq!(shard_meshes(8, 6).len(), chains(8) * chains(6));
    assert_eq!(shard_meshes(8, 128).len(), 20 * 120);
    for s in shard_meshes(4, 12) {
        assert!(s.params.divides(s.grads) && s.grads.divides(s.optimizer));
        assert!(4 % s.optimizer.intra == 0 && 12 % s.optimizer.inter == 0);
    }
}
