//! Unit tests of `lower::buckets` (a child module of it: they reach its private items).

use super::partition;

#[test]
fn runs_respect_the_bucket() {
    assert_eq!(partition(&[4, 4, 4], 0), vec![vec![0], vec![1], vec![2]]);
    assert_eq!(partition(&[4, 4, 4], 8), vec![vec![0, 1], vec![2]]);
    assert_eq!(partition(&[10, 4, 0, 4], 8), vec![vec![0], vec![1, 2, 3]]);
    assert_eq!(partition(&[], 8), Vec::<Vec<usize>>::new());
}
