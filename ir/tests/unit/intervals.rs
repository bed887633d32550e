//! Unit tests of `intervals` (a child module of it: they reach its private items).

use super::Occupants;

#[test]
fn displaces_only_overlaps() {
    let mut o = Occupants::default();
    assert!(o.replace(0, 100, 'a').is_empty());
    assert_eq!(o.replace(50, 150, 'b'), vec!['a']);
    assert_eq!(o.replace(0, 200, 'c'), vec!['b', 'a']);
    assert!(o.replace(200, 300, 'd').is_empty());
    assert_eq!(o.replace(10, 20, 'e'), vec!['c']);
    assert_eq!(o.replace(0, 300, 'f'), vec!['d', 'c', 'e']);
}
