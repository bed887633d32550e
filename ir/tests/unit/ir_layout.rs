//! Unit tests of `ir::layout` (a child module of it: they reach its private items).

use super::*;

fn layout(g: u32, n: u32, p: (u32, u32), gr: (u32, u32), o: (u32, u32)) -> Layout {
    let m = |(a, b)| Mesh { intra: a, inter: b };
    Layout {
        gpus_per_node: g,
        nodes: n,
        shard: Shard {
            params: m(p),
            grads: m(gr),
            optimizer: m(o),
        },
        secondary: None,
        stages: 1,
    }
}

/// Every rank's optimizer shard lies inside its grad shard, which lies inside its param shard,
/// and within each group the indices are a permutation.
#[test]
fn shard_indices_nest_and_cover() {
    for l in [
        layout(8, 4, (1, 1), (1, 1), (8, 4)),
        layout(8, 4, (2, 1), (4, 2), (8, 4)),
        layout(4, 4, (2, 1), (2, 2), (4, 4)),
        layout(8, 2, (8, 1), (8, 2), (8, 2)),
        layout(4, 8, (1, 2), (2, 2), (4, 8)),
    ] {
        let Shard {
            params: p,
            grads: g,
            optimizer: o,
        } = l.shard;
        for r in 0..l.ranks() {
            let (ip, ig, io) = (
                l.index(ShardIndex::Param, r),
                l.index(ShardIndex::Grad, r),
                l.index(ShardIndex::Optimizer, r),
            );
            assert_eq!(
                ig / (g.size() / p.size()),
                ip,
                "grad shard inside param shard"
            );
            assert_eq!(
                io / (o.size() / g.size()),
                ig,
                "optimizer shard inside grad shard"
            );
            assert_eq!(
                io % (o.size() / p.size()),
                l.index(ShardIndex::OptimizerInParam, r)
            );
        }
        for (m, idx) in [
            (p, ShardIndex::Param),
            (g, ShardIndex::Grad),
            (o, ShardIndex::Optimizer),
        ] {
            for r in 0..l.ranks() {
                let mut seen: Vec<u64> = l.group(m, r).iter().map(|&q| l.index(idx, q)).collect();
                seen.sort_unstable();
                assert_eq!(seen, (0..m.size()).collect::<Vec<_>>());
            }
        }
    }
}

#[test]
fn tables_tabulate_index_and_group_key() {
    for l in [
        layout(8, 4, (2, 1), (4, 2), (8, 4)),
        layout(4, 8, (1, 2), (2, 2), (4, 8)),
        layout(8, 16, (2, 2), (4, 4), (8, 16)),
        Layout {
            secondary: Some(4),
            ..layout(8, 4, (8, 2), (8, 2), (8, 4))
        },
    ] {
        for idx in ShardIndex::ALL {
            let table = l.index_table(idx);
            assert_eq!(table.len(), l.ranks() as usize);
            for r in 0..l.ranks() {
                assert_eq!(table[r as usize], l.index(idx, r), "{idx:?} rank {r}");
            }
        }
        for m in [l.shard.params, l.shard.grads, l.shard.optimizer] {
            let table = l.group_key_table(m);
            for r in 0..l.ranks() {
                assert_eq!(table[r as usize], l.group_key(m, r), "{m:?} rank {r}");
            }
        }
    }
}

/// `groups_by` is its definition: sort the ranks by (key, order, rank), cut where the key
/// changes, order the groups by first member.
#[test]
fn groups_by_matches_its_definition() {
    for l in [
        layout(8, 4, (2, 1), (4, 2), (8, 4)),
        layout(4, 8, (1, 2), (2, 2), (4, 8)),
        layout(8, 16, (8, 2), (8, 4), (8, 16)),
    ] {
        let sh = l.shard;
        let keys: [&dyn Fn(u32) -> u64; 4] = [
            &|r| l.group_key(sh.params, r),
            &|r| l.group_key(sh.optimizer, r) ^ l.index(ShardIndex::Grad, r) << 48,
            &|r| l.index(ShardIndex::Optimizer, r),
            &|r| u64::from(r % 3 == 0),
        ];
        let orders: [&dyn Fn(u32) -> u64; 3] = [
            &|r| l.index(ShardIndex::OptimizerInGrad, r),
            &|r| u64::from(l.node(r)),
            &|r| u64::from(r % 2),
        ];
        for key in keys {
            for order in orders {
                let mut keyed: Vec<(u64, u64, u32)> =
                    (0..l.ranks()).map(|r| (key(r), order(r), r)).collect();
                keyed.sort_unstable();
                let mut expected: Vec<Vec<u32>> = vec![];
                for (i, &(k, _, r)) in keyed.iter().enumerate() {
                    if i == 0 || keyed[i - 1].0 != k {
                        expected.push(vec![]);
                    }
                    expected.last_mut().unwrap().push(r);
                }
                expected.sort_unstable_by_key(|g| g[0]);
                assert_eq!(l.groups_by(key, order), expected);
            }
        }
    }
}

#[test]
fn groups_and_scopes() {
    let l = layout(4, 2, (2, 2), (2, 2), (2, 2));
    assert_eq!(l.group(l.shard.params, 5), vec![0, 1, 4, 5]);
    let groups = l.groups_by(
        |r| l.group_key(l.shard.params, r),
        |r| u64::from(l.position(l.shard.params, r)),
    );
    assert_eq!(groups, vec![vec![0, 1, 4, 5], vec![2, 3, 6, 7]]);
    assert_eq!(l.scope(&groups), Scope::Mixed);
    let by_node = l.groups_by(|r| u64::from(l.node(r)), u64::from);
    assert_eq!(l.scope(&by_node), Scope::Intra);
    let by_local = l.groups_by(|r| u64::from(l.local(r)), u64::from);
    assert_eq!(l.scope(&by_local), Scope::Inter);
}
