//! Unit tests of `ir` (a child module of it: they reach its private items).

use super::ShardIndex;

#[test]
fn slot_is_the_position_in_all() {
    for (i, idx) in ShardIndex::ALL.into_iter().enumerate() {
        assert_eq!(idx.slot(), i, "{idx:?}");
    }
}
