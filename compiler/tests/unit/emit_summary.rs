//! Unit tests of `emit::summary` (a child module of it: they reach its private items).

use super::name_list;

#[test]
fn runs_of_layers_collapse() {
    assert_eq!(name_list(&["embed"]), "embed");
    assert_eq!(
        name_list(&["block[0]", "block[1]", "block[2]", "head"]),
        "block[0] … block[2] (3 layers), head"
    );
    assert_eq!(
        name_list(&["block[1]", "block[3]", "block[5]", "block[7]"]),
        "block[1] … block[7] (every 2, 4 layers)"
    );
    assert_eq!(name_list(&["block[0]", "block[1]"]), "block[0], block[1]");
    assert_eq!(
        name_list(&["a[0]", "b[1]", "b[2]", "b[3]"]),
        "a[0], b[1] … b[3] (3 layers)"
    );
}
