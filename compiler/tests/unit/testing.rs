//! Unit tests of `testing` (a child module of it: they reach its private items).

use super::{required_in, skip_in};

#[test]
fn names_are_matched_whole() {
    assert!(required_in("ptxas", "ptxas"));
    assert!(required_in("gpu, ptxas", "ptxas"));
    assert!(required_in("ptxas,no-gpu", "no-gpu"));
    assert!(!required_in("ptxas,no-gpu", "gpu"));
    assert!(!required_in("", "ptxas"));
    assert!(!required_in("ptxas2", "ptxas"));
}

#[test]
fn a_skip_not_required_says_so() {
    let mut out = vec![];
    skip_in("no-gpu", "ptxas", "no ptxas here", &mut out);
    skip_in("", "gpu", "no GPU here", &mut out);
    assert_eq!(
        String::from_utf8(out).unwrap(),
        "SKIPPED testing::tests::a_skip_not_required_says_so: no ptxas here (needs `ptxas`)\n\
             SKIPPED testing::tests::a_skip_not_required_says_so: no GPU here (needs `gpu`)\n"
    );
}

#[test]
#[should_panic(expected = "SCHED_REQUIRE has `gpu`, but")]
fn a_required_skip_fails() {
    skip_in("ptxas,gpu", "gpu", "no GPU here", &mut vec![]);
}
