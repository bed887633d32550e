//! Unit tests of `hash` (a child module of it: they reach its private items).

use super::FxHashMap;

#[test]
fn a_map_finds_what_it_holds() {
    let mut m: FxHashMap<Vec<u64>, u32> = FxHashMap::default();
    for i in 0..1000u64 {
        m.insert(vec![i, i * 7, 3], i as u32);
    }
    assert_eq!(m.len(), 1000);
    assert!((0..1000u64).all(|i| m[&vec![i, i * 7, 3]] == i as u32));
}
