//! Unit tests of `contribs` (a child module of it: they reach its private items).

use super::Contribs;
use sched_ir::ir::Layout;

/// 8 stages of t = 8 and d = 70 (more than one word of data-parallel bits): 4,480 ranks.
fn layout() -> Layout {
    Layout {
        gpus_per_node: 8,
        nodes: 560,
        stages: 8,
        tensor: 8,
        ..Layout::default()
    }
}

#[test]
fn unions_count_each_rank_once_and_name_the_lowest_rank_counted_twice() {
    let l = layout();
    assert_eq!(l.dp_size(), 70);
    let mut c = Contribs::new(&l);
    let r = |stage, dp| l.rank_of(stage, dp, 0);
    let a = c.single(3, 0, r(1, 65));
    let b = c.single(3, 0, r(2, 0));
    let x = c.single(3, 1, r(1, 2));
    let ab = c.union(a, b).unwrap();
    assert_eq!(c.union(a, b), Ok(ab), "a union is remembered");
    let abx = c.union_all(&[ab, x]).unwrap();
    // The same set built in another order is the same id.
    let xba = c.union_all(&[x, b, a]).unwrap();
    assert_eq!(abx, xba);
    assert_eq!(c.terms(abx), vec![3]);
    let m0 = c.ranks(abx, 3, 0).unwrap();
    assert_eq!(m0.count(), 2);
    assert_eq!(m0.first(), r(1, 65));
    assert!(m0.contains(r(1, 65)) && m0.contains(r(2, 0)));
    assert!(!m0.contains(r(1, 2)) && !m0.contains(r(1, 65) + 1));
    assert_eq!(c.ranks(abx, 3, 1).unwrap().first(), r(1, 2));
    assert!(c.ranks(abx, 3, 2).is_none() && c.ranks(abx, 4, 0).is_none());
    // Adding rank r(2, 0)'s micro-step 0 again is refused, naming it.
    let again = c.single(3, 0, r(2, 0));
    assert_eq!(c.union(abx, again), Err((3, 0, r(2, 0))));
    // The lowest (term, micro-step, rank) counted twice is named.
    let y = c.single(3, 1, r(1, 2));
    let both = c.union(ab, y).unwrap();
    assert_eq!(c.union(abx, both), Err((3, 0, r(1, 65))));
}

#[test]
#[should_panic(expected = "tensor index 0")]
fn a_rank_of_another_tensor_index_is_refused() {
    let l = layout();
    Contribs::new(&l).single(0, 0, l.rank_of(0, 1, 3));
}
