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
        tensor: 1,
        sequence: false,
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

/// The layout's rank arithmetic as it was before tensor parallelism (t = 1), written out again:
/// with t = 1 every function must still give exactly this.
mod before {
    use super::*;

    pub fn dp_size(l: &Layout) -> u32 {
        l.ranks() / l.stages.max(1)
    }
    pub fn stage(l: &Layout, r: u32) -> u32 {
        r / dp_size(l)
    }
    pub fn dp_index(l: &Layout, r: u32) -> u32 {
        r % dp_size(l)
    }
    pub fn rank_of(l: &Layout, stage: u32, dp: u32) -> u32 {
        stage * dp_size(l) + dp
    }
    pub fn dp_gpus_per_node(l: &Layout) -> u32 {
        l.gpus_per_node.min(dp_size(l))
    }
    pub fn dp_node(l: &Layout, r: u32) -> u32 {
        dp_index(l, r) / dp_gpus_per_node(l)
    }
    pub fn dp_local(l: &Layout, r: u32) -> u32 {
        dp_index(l, r) % dp_gpus_per_node(l)
    }
    pub fn group(l: &Layout, m: Mesh, r: u32) -> Vec<u32> {
        let (n0, l0) = (
            dp_node(l, r) / m.inter * m.inter,
            dp_local(l, r) / m.intra * m.intra,
        );
        let stage = stage(l, r);
        (0..m.inter)
            .flat_map(|dn| (0..m.intra).map(move |dl| (dn, dl)))
            .map(|(dn, dl)| rank_of(l, stage, (n0 + dn) * dp_gpus_per_node(l) + l0 + dl))
            .collect()
    }
    /// Groups by (stage, key), each ordered by (order, rank), the groups by first member.
    pub fn groups_by(
        l: &Layout,
        key: impl Fn(u32) -> u64,
        order: impl Fn(u32) -> u64,
    ) -> Vec<Vec<u32>> {
        let mut keyed: Vec<((u32, u64), u64, u32)> = (0..l.ranks())
            .map(|r| ((stage(l, r), key(r)), order(r), r))
            .collect();
        keyed.sort_unstable();
        let mut groups: Vec<Vec<u32>> = vec![];
        for (i, &(k, _, r)) in keyed.iter().enumerate() {
            if i == 0 || keyed[i - 1].0 != k {
                groups.push(vec![]);
            }
            groups.last_mut().unwrap().push(r);
        }
        groups.sort_unstable_by_key(|g| g[0]);
        groups
    }
}

fn divisors(n: u32) -> impl Iterator<Item = u32> {
    (1..=n).filter(move |k| n.is_multiple_of(*k))
}

/// Layouts that sema can produce with t = 1: G GPUs per node, N nodes, p stages by rule 2 (d a
/// multiple or a divisor of G), and nested meshes over a stage's data-parallel mesh.
fn layouts_without_tensor() -> Vec<Layout> {
    let mut out = vec![];
    for g in [1, 2, 4, 8] {
        for n in [1, 2, 3, 4, 6] {
            for p in divisors(g * n) {
                let d = g * n / p;
                if !d.is_multiple_of(g) && !g.is_multiple_of(d) {
                    continue;
                }
                let (gv, nv) = (g.min(d), d / g.min(d));
                for (a, b) in divisors(gv).flat_map(|a| divisors(nv).map(move |b| (a, b))) {
                    let mut l = layout(g, n, (a, b), (a, nv), (gv, nv));
                    l.stages = p;
                    if a == gv && b == 1 {
                        l.secondary = Some(a);
                    }
                    out.push(l);
                }
            }
        }
    }
    out
}

/// With t = 1 (no tensor parallelism) every function of the layout gives what it gave before
/// tensor parallelism was added.
#[test]
fn without_tensor_parallelism_nothing_changes() {
    let layouts = layouts_without_tensor();
    assert!(layouts.len() > 200, "{} layouts", layouts.len());
    for l in &layouts {
        assert_eq!(l.tensor, 1);
        assert_eq!(l.dp_size(), before::dp_size(l), "{l:?}");
        assert_eq!(l.dp_gpus_per_node(), before::dp_gpus_per_node(l), "{l:?}");
        for r in 0..l.ranks() {
            assert_eq!(l.stage(r), before::stage(l, r), "{l:?} rank {r}");
            assert_eq!(l.dp_index(r), before::dp_index(l, r), "{l:?} rank {r}");
            assert_eq!(l.tp_index(r), 0);
            assert_eq!(l.tp_group(r), vec![r]);
            assert_eq!(l.dp_node(r), before::dp_node(l, r), "{l:?} rank {r}");
            assert_eq!(l.dp_local(r), before::dp_local(l, r), "{l:?} rank {r}");
            let (s, dp) = (l.stage(r), l.dp_index(r));
            assert_eq!(l.rank_of(s, dp, 0), before::rank_of(l, s, dp));
            for m in [l.shard.params, l.shard.grads, l.shard.optimizer] {
                assert_eq!(
                    l.group(m, r),
                    before::group(l, m, r),
                    "{l:?} {m:?} rank {r}"
                );
            }
        }
        for idx in ShardIndex::ALL {
            let table = l.index_table(idx);
            for r in 0..l.ranks() {
                assert_eq!(table[r as usize], l.index(idx, r), "{idx:?} rank {r}");
            }
        }
        for m in [l.shard.params, l.shard.optimizer] {
            let key = |r| l.group_key(m, r);
            let order = |r| u64::from(l.position(m, r));
            assert_eq!(l.groups_by(key, order), before::groups_by(l, key, order));
            let odd = |r: u32| u64::from(r % 3);
            assert_eq!(
                l.groups_by(odd, u64::from),
                before::groups_by(l, odd, u64::from)
            );
        }
        assert_eq!(l.tp_groups().len() as u32, l.ranks());
    }
}

fn tensor_layout(g: u32, n: u32, t: u32, p: u32, mesh: (u32, u32)) -> Layout {
    let mut l = layout(g, n, mesh, mesh, mesh);
    l.tensor = t;
    l.stages = p;
    l
}

/// 2 nodes of 8, t = 4, p = 2: d = 2, each stage one node, its data-parallel mesh 2 x 1.
#[test]
fn tensor_four_with_two_stages_on_two_nodes() {
    let l = tensor_layout(8, 2, 4, 2, (2, 1));
    assert_eq!(
        (l.dp_size(), l.stage_size(), l.dp_gpus_per_node()),
        (2, 8, 2)
    );
    // Rank 13 = (stage 1 · 2 + dp 1) · 4 + tp 1.
    assert_eq!((l.stage(13), l.dp_index(13), l.tp_index(13)), (1, 1, 1));
    assert_eq!(l.rank_of(1, 1, 1), 13);
    assert_eq!((l.dp_node(13), l.dp_local(13)), (0, 1));
    assert_eq!(l.tp_group(13), vec![12, 13, 14, 15]);
    assert_eq!(l.group(l.shard.params, 13), vec![9, 13]);
    assert_eq!(l.group(l.shard.params, 2), vec![2, 6]);
    let groups = l.groups_by(
        |r| l.group_key(l.shard.params, r),
        |r| u64::from(l.position(l.shard.params, r)),
    );
    assert_eq!(
        groups,
        vec![
            vec![0, 4],
            vec![1, 5],
            vec![2, 6],
            vec![3, 7],
            vec![8, 12],
            vec![9, 13],
            vec![10, 14],
            vec![11, 15]
        ]
    );
    assert_eq!(l.scope(&groups), Scope::Intra);
    assert_eq!(l.scope(&l.tp_groups()), Scope::Intra);
    assert_eq!(l.index(ShardIndex::Param, 13), 1);
    assert_eq!(l.index(ShardIndex::Param, 9), 0);
}

/// 2 nodes of 4, t = 2, no pipeline: d = 4 over a 2 x 2 data-parallel mesh (2 per node).
#[test]
fn tensor_two_across_nodes() {
    let l = tensor_layout(4, 2, 2, 1, (2, 2));
    assert_eq!((l.dp_size(), l.dp_gpus_per_node()), (4, 2));
    assert_eq!((l.stage(5), l.dp_index(5), l.tp_index(5)), (0, 2, 1));
    assert_eq!((l.dp_node(5), l.dp_local(5)), (1, 0));
    assert_eq!(l.group(l.shard.params, 5), vec![1, 3, 5, 7]);
    assert_eq!(l.group(Mesh { intra: 2, inter: 1 }, 5), vec![5, 7]);
    assert_eq!(l.group(Mesh { intra: 1, inter: 2 }, 6), vec![2, 6]);
    assert_eq!(
        l.tp_groups(),
        vec![vec![0, 1], vec![2, 3], vec![4, 5], vec![6, 7]]
    );
    // Each data-parallel rank's node is its rank's node.
    for r in 0..l.ranks() {
        assert_eq!(l.dp_node(r), l.node(r));
    }
}

/// Stages inside one node: 8 GPUs, t = 2, p = 4 gives d = 1 (mesh 1 x 1); p = 2 gives d = 2
/// (mesh 2 x 1, a stage of 4 consecutive ranks).
#[test]
fn tensor_with_stages_inside_a_node() {
    let l = tensor_layout(8, 1, 2, 4, (1, 1));
    assert_eq!((l.dp_size(), l.dp_gpus_per_node()), (1, 1));
    assert_eq!((l.stage(5), l.dp_index(5), l.tp_index(5)), (2, 0, 1));
    assert_eq!(l.group(l.shard.params, 5), vec![5]);
    let l = tensor_layout(8, 1, 2, 2, (2, 1));
    assert_eq!(
        (l.dp_size(), l.stage_size(), l.dp_gpus_per_node()),
        (2, 4, 2)
    );
    assert_eq!((l.stage(6), l.dp_index(6), l.tp_index(6)), (1, 1, 0));
    assert_eq!(l.group(l.shard.params, 6), vec![4, 6]);
    assert_eq!(l.tp_group(6), vec![6, 7]);
}

/// For layouts with t = 2 and 4 (pipelines and meshes of every shape rule 2 allows): the rank
/// decomposes and recomposes, a stage is d·t consecutive ranks, a tensor group t consecutive
/// ranks of one node, every mesh group lies in one stage and one tensor index and its shard
/// indices are a permutation, the tables match rank by rank, and `groups_by` is its
/// definition with (stage, tensor index) in the key.
#[test]
fn tensor_layouts_keep_groups_apart() {
    let mut layouts = vec![];
    for (g, n) in [(8u32, 2u32), (8, 1), (4, 4), (8, 3)] {
        for t in [2, 4] {
            if !g.is_multiple_of(t) {
                continue;
            }
            for p in divisors(g * n / t) {
                let dt = g * n / p;
                if !dt.is_multiple_of(g) && !g.is_multiple_of(dt) {
                    continue;
                }
                let d = dt / t;
                let (gv, nv) = if dt >= g { (g / t, dt / g) } else { (d, 1) };
                assert_eq!(gv * nv, d);
                for (a, b) in divisors(gv).flat_map(|a| divisors(nv).map(move |b| (a, b))) {
                    let mut l = layout(g, n, (a, b), (a, nv), (gv, nv));
                    l.tensor = t;
                    l.stages = p;
                    layouts.push(l);
                }
            }
        }
    }
    assert!(layouts.len() > 30, "{} layouts", layouts.len());
    for l in &layouts {
        let (t, d) = (l.tensor, l.dp_size());
        assert_eq!(l.ranks(), t * l.stages * d, "{l:?}");
        for r in 0..l.ranks() {
            let (s, dp, tp) = (l.stage(r), l.dp_index(r), l.tp_index(r));
            assert_eq!(l.rank_of(s, dp, tp), r, "{l:?}");
            assert_eq!(s, r / (d * t));
            assert_eq!(dp, l.dp_node(r) * l.dp_gpus_per_node() + l.dp_local(r));
            let tg = l.tp_group(r);
            assert_eq!(tg.len() as u32, t);
            assert!(tg.contains(&r));
            assert!(tg.iter().all(|&q| l.node(q) == l.node(r)), "{l:?}");
            for (m, idx) in [
                (l.shard.params, ShardIndex::Param),
                (l.shard.grads, ShardIndex::Grad),
                (l.shard.optimizer, ShardIndex::Optimizer),
            ] {
                let group = l.group(m, r);
                assert!(group.contains(&r));
                assert!(group
                    .iter()
                    .all(|&q| l.stage(q) == s && l.tp_index(q) == tp));
                let mut seen: Vec<u64> = group.iter().map(|&q| l.index(idx, q)).collect();
                seen.sort_unstable();
                assert_eq!(seen, (0..m.size()).collect::<Vec<_>>(), "{l:?} rank {r}");
            }
        }
        for idx in ShardIndex::ALL {
            let table = l.index_table(idx);
            assert_eq!(table.len(), l.ranks() as usize);
            for r in 0..l.ranks() {
                assert_eq!(table[r as usize], l.index(idx, r), "{l:?} {idx:?} rank {r}");
            }
        }
        for m in [l.shard.params, l.shard.optimizer] {
            let table = l.group_key_table(m);
            let key = |r: u32| l.group_key(m, r);
            for r in 0..l.ranks() {
                assert_eq!(table[r as usize], key(r));
            }
            let order = |r: u32| u64::from(l.position(m, r));
            let mut keyed: Vec<((u32, u32, u64), u64, u32)> = (0..l.ranks())
                .map(|r| ((l.stage(r), l.tp_index(r), key(r)), order(r), r))
                .collect();
            keyed.sort_unstable();
            let mut expected: Vec<Vec<u32>> = vec![];
            for (i, &(k, _, r)) in keyed.iter().enumerate() {
                if i == 0 || keyed[i - 1].0 != k {
                    expected.push(vec![]);
                }
                expected.last_mut().unwrap().push(r);
            }
            expected.sort_unstable_by_key(|g| g[0]);
            let groups = l.groups_by(key, order);
            assert_eq!(groups, expected, "{l:?}");
            // The groups of a mesh are its groups rank by rank.
            for g in &groups {
                assert_eq!(&l.group(m, g[0]), g, "{l:?}");
            }
        }
    }
}
