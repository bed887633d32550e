//! Unit tests of `emit::job` (a child module of it: they reach its private items).

#[test]
fn thousands_separators() {
    assert_eq!(super::thousands(6_738_415_616), "6,738,415,616");
    assert_eq!(super::thousands(999), "999");
    assert_eq!(super::thousands(1000), "1,000");
}
