//! Rank arithmetic: stages, tensor groups, groups of a mesh, positions, nested shard indices,
//! communicator groups.
//!
//! Rank `r = node·G + local`. With `t`-way tensor parallelism and `p` pipeline stages the
//! `G·N = t·p·d` ranks decompose with t fastest, then d, then p (parallel spec §1):
//! `r = (stage·d + dp_index)·t + tp_index`, so `tp_index = r mod t`, `dp_index = (r / t) mod d`
//! and `stage = r / (d·t)`. A tensor group is t consecutive ranks (inside one node: t divides G);
//! stage `s` holds the d·t consecutive ranks `s·d·t … (s + 1)·d·t − 1`. Without tensor
//! parallelism (t = 1) this is `r = stage·d + dp_index`.
//!
//! The shard meshes are read over a stage's **data-parallel mesh**, the d ranks of one stage and
//! one tensor index: `G' × d/G'`, where a stage of whole nodes (d·t a multiple of G) has
//! `G' = G/t` data-parallel ranks in each of its nodes and a stage inside one node has `G' = d`
//! (spec rule 2; with t = 1, `G' = min(G, d)`). Its "node" and "local index" are
//! `dp_node = dp_index / G'` and `dp_local = dp_index mod G'`; with one stage and t = 1 they are
//! the rank's node and local index. For a mesh `a x b`, a rank's group is the block of `b`
//! consecutive dp-nodes and `a` consecutive dp-local indices of its stage and tensor index it
//! falls in, and its position is `(dp_node mod b)·a + (dp_local mod a)`. Shard indices are built
//! from positions so that they nest (optimizer shard ⊂ grad shard ⊂ param shard), and are the
//! same for every tensor index (each rank shards its own tensor slice alike); every
//! communicator's member order is derived from the same indices, so chunk `j` of a collective
//! always belongs to the member whose shard is chunk `j`.

use super::{Offset, Region, Scope, ShardIndex};
use crate::hash::FxHashMap;
use crate::job::{Job, Mesh, ReshardAfterForward, Shard};

/// The ranks of a schedule and its sharding factors.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Layout {
    pub gpus_per_node: u32,
    pub nodes: u32,
    pub shard: Shard,
    /// hpZ: GPUs of a node sharing one secondary copy of the parameters.
    pub secondary: Option<u32>,
    /// Pipeline stages (1 without a pipeline); each holds `ranks / stages` consecutive ranks.
    pub stages: u32,
    /// t, the ranks of a tensor group (1 without tensor parallelism): the fastest-varying part
    /// of a rank.
    pub tensor: u32,
    /// Sequence parallelism (`tensor { sequence = true }`): between a tensor-parallel layer's
    /// sublayers and between layers, each rank of a tensor group holds its own t-th of the
    /// tokens of the residual stream.
    pub sequence: bool,
}

impl Default for Layout {
    /// One rank, nothing sharded.
    fn default() -> Self {
        let one = Mesh { intra: 1, inter: 1 };
        Layout {
            gpus_per_node: 1,
            nodes: 1,
            shard: Shard {
                params: one,
                grads: one,
                optimizer: one,
            },
            secondary: None,
            stages: 1,
            tensor: 1,
            sequence: false,
        }
    }
}

impl Layout {
    /// The layout `job`'s schedule lowers to: its ranks, stages, tensor groups, shard meshes and
    /// hpZ secondary size.
    pub fn of(job: &Job) -> Layout {
        let s = &job.schedule;
        Layout {
            gpus_per_node: s.gpus_per_node,
            nodes: s.nodes,
            shard: s.shard,
            secondary: match s.reshard_after_forward {
                ReshardAfterForward::Node { secondary } => Some(secondary),
                _ => None,
            },
            stages: s.pipeline.stages,
            tensor: s.tensor.size,
            sequence: s.tensor.is_parallel() && s.tensor.sequence,
        }
    }

    pub fn ranks(&self) -> u32 {
        self.gpus_per_node * self.nodes
    }

    pub fn node(&self, r: u32) -> u32 {
        r / self.gpus_per_node
    }

    pub fn local(&self, r: u32) -> u32 {
        r % self.gpus_per_node
    }

    /// t, the ranks of a tensor group (at least 1).
    fn t(&self) -> u32 {
        self.tensor.max(1)
    }

    /// d, the data-parallel degree: the ranks of one stage with one tensor index,
    /// `ranks / (stages·t)`.
    pub fn dp_size(&self) -> u32 {
        self.ranks() / (self.stages.max(1) * self.t())
    }

    /// d·t, the consecutive ranks of one stage.
    pub fn stage_size(&self) -> u32 {
        self.dp_size() * self.t()
    }

    /// The pipeline stage `r` belongs to: `r / (d·t)`.
    pub fn stage(&self, r: u32) -> u32 {
        r / self.stage_size()
    }

    /// `r`'s index in its tensor group (0 … t−1): `r mod t`.
    pub fn tp_index(&self, r: u32) -> u32 {
        r % self.t()
    }

    /// `r`'s data-parallel index within its stage (0 … d−1): `(r / t) mod d`.
    pub fn dp_index(&self, r: u32) -> u32 {
        (r / self.t()) % self.dp_size()
    }

    /// The rank of stage `stage` with data-parallel index `dp` and tensor index `tp`:
    /// `(stage·d + dp)·t + tp`.
    pub fn rank_of(&self, stage: u32, dp: u32, tp: u32) -> u32 {
        (stage * self.dp_size() + dp) * self.t() + tp
    }

    /// The tensor group of `r`: the t consecutive ranks `r − tp_index(r) …`, in tensor-index
    /// order (`[r]` without tensor parallelism).
    pub fn tp_group(&self, r: u32) -> Vec<u32> {
        let first = r - self.tp_index(r);
        (first..first + self.t()).collect()
    }

    /// Every tensor group, in rank order.
    pub fn tp_groups(&self) -> Vec<Vec<u32>> {
        (0..self.ranks())
            .step_by(self.t() as usize)
            .map(|r| self.tp_group(r))
            .collect()
    }

    /// G', the "GPUs per node" of a stage's data-parallel mesh (spec rule 2): `G/t` when a stage
    /// holds whole nodes (d·t ≥ G, so a multiple of G), else `d` (a stage inside one node). With
    /// t = 1 this is `min(G, d)`.
    pub fn dp_gpus_per_node(&self) -> u32 {
        match self.stage_size() >= self.gpus_per_node {
            true => self.gpus_per_node / self.t(),
            false => self.dp_size(),
        }
    }

    /// The dp-node of `r`: which block of G' ranks of its stage it lies in.
    pub fn dp_node(&self, r: u32) -> u32 {
        self.dp_index(r) / self.dp_gpus_per_node()
    }

    /// The dp-local index of `r` in its dp-node (its local index with one stage).
    pub fn dp_local(&self, r: u32) -> u32 {
        self.dp_index(r) % self.dp_gpus_per_node()
    }

    /// The rank at (`stage`, `dp_node`, `dp_local`) with tensor index `tp`.
    fn rank(&self, stage: u32, dp_node: u32, dp_local: u32, tp: u32) -> u32 {
        self.rank_of(stage, dp_node * self.dp_gpus_per_node() + dp_local, tp)
    }

    /// Position of `r` in its group of `m`.
    pub fn position(&self, m: Mesh, r: u32) -> u32 {
        (self.dp_node(r) % m.inter) * m.intra + self.dp_local(r) % m.intra
    }

    /// The ranks of `r`'s group of `m` (of its stage and tensor index), in position order.
    pub fn group(&self, m: Mesh, r: u32) -> Vec<u32> {
        let (n0, l0) = (
            self.dp_node(r) / m.inter * m.inter,
            self.dp_local(r) / m.intra * m.intra,
        );
        let (stage, tp) = (self.stage(r), self.tp_index(r));
        (0..m.inter)
            .flat_map(|dn| (0..m.intra).map(move |dl| (dn, dl)))
            .map(|(dn, dl)| self.rank(stage, n0 + dn, l0 + dl, tp))
            .collect()
    }

    /// Index of `r`'s `inner` subgroup within its `outer` group (inner divides outer), node by node.
    pub fn subgroup(&self, inner: Mesh, outer: Mesh, r: u32) -> u32 {
        let dn = (self.dp_node(r) % outer.inter) / inner.inter;
        let dl = (self.dp_local(r) % outer.intra) / inner.intra;
        dn * (outer.intra / inner.intra) + dl
    }

    /// The shard index `idx` of rank `r` (see the IR module doc); only the terms `idx` needs are
    /// computed (communicator construction asks this for every rank).
    pub fn index(&self, idx: ShardIndex, r: u32) -> u64 {
        let Shard {
            params: p,
            grads: g,
            optimizer: o,
        } = self.shard;
        let param = || u64::from(self.position(p, r));
        let sub_g = || u64::from(self.subgroup(p, g, r));
        let sub_os = || u64::from(self.subgroup(g, o, r));
        let grad = || param() * (g.size() / p.size()) + sub_g();
        match idx {
            ShardIndex::Param => param(),
            ShardIndex::Grad => grad(),
            ShardIndex::Optimizer => grad() * (o.size() / g.size()) + sub_os(),
            ShardIndex::OptimizerInParam => sub_g() * (o.size() / g.size()) + sub_os(),
            ShardIndex::OptimizerInGrad => sub_os(),
            ShardIndex::ParamLocal => u64::from(self.dp_local(r) % p.intra),
            ShardIndex::Secondary => u64::from(self.dp_local(r) % self.secondary.unwrap_or(1)),
        }
    }

    /// Shard index `idx` of every rank, by rank (see [`Layout::tabulate`]: every index is a
    /// linear combination of positions and subgroups, each a node term plus a local term).
    pub fn index_table(&self, idx: ShardIndex) -> Vec<u64> {
        self.tabulate(|r| self.index(idx, r))
    }

    /// [`Layout::group_key`] of every rank for mesh `m`, by rank (its dp-node's block in the high
    /// half plus its dp-local block in the low half: a dp-node term plus a dp-local term).
    pub fn group_key_table(&self, m: Mesh) -> Vec<u64> {
        self.tabulate(|r| self.group_key(m, r))
    }

    /// `f` of every rank, by rank, for an `f` that is the sum of a term of the rank's stage, one
    /// of its dp-node and one of its dp-local index, each zero at zero, and the same for every
    /// tensor index: one evaluation per stage, dp-node and dp-local index instead of one per
    /// rank. Communicator construction reads these tables for every rank of every communicator,
    /// where computing them rank by rank cost a dozen divisions by mesh sizes each.
    fn tabulate(&self, f: impl Fn(u32) -> u64) -> Vec<u64> {
        let gv = self.dp_gpus_per_node();
        let t = self.t() as usize;
        let by_local: Vec<u64> = (0..gv).map(|l| f(self.rank(0, 0, l, 0))).collect();
        let by_node: Vec<u64> = (0..self.dp_size() / gv)
            .map(|n| f(self.rank(0, n, 0, 0)))
            .collect();
        (0..self.stages.max(1))
            .flat_map(|stage| {
                let by_stage = f(self.rank_of(stage, 0, 0));
                let by_local = &by_local;
                by_node.iter().flat_map(move |&n| {
                    by_local
                        .iter()
                        .flat_map(move |&l| std::iter::repeat_n(by_stage + n + l, t))
                })
            })
            .collect()
    }

    /// Partitions all ranks into groups by `key` within each pipeline stage and tensor index (a
    /// group never spans stages: a stage's ranks run only its ops; nor tensor indices: the
    /// members of a data-parallel group hold the same tensor slice), each group ordered by
    /// `order` (then rank), the groups by their first member. Ranks are numbered by group in one
    /// pass and laid out group by group in one buffer (a counting sort), and only each group is
    /// sorted: lowering builds every communicator this way, once per candidate `schedc plan`
    /// screens, so nothing is allocated per rank or per group beyond the group itself.
    pub fn groups_by(&self, key: impl Fn(u32) -> u64, order: impl Fn(u32) -> u64) -> Vec<Vec<u32>> {
        let ranks = self.ranks() as usize;
        let mut group_of_key: FxHashMap<(u32, u32, u64), usize> =
            FxHashMap::with_capacity_and_hasher(ranks, Default::default());
        let mut group_of_rank: Vec<usize> = Vec::with_capacity(ranks);
        let mut sizes: Vec<usize> = vec![];
        for r in 0..self.ranks() {
            let fresh = sizes.len();
            let at = (self.stage(r), self.tp_index(r), key(r));
            let g = *group_of_key.entry(at).or_insert(fresh);
            if g == fresh {
                sizes.push(0);
            }
            sizes[g] += 1;
            group_of_rank.push(g);
        }
        // Group g's members, as (order, rank), are members[starts[g]..starts[g + 1]].
        let mut starts: Vec<usize> = Vec::with_capacity(sizes.len() + 1);
        starts.push(0);
        for size in &sizes {
            starts.push(starts.last().expect("pushed above") + size);
        }
        let mut next = starts.clone();
        let mut members: Vec<(u64, u32)> = vec![(0, 0); ranks];
        for (r, &g) in (0..self.ranks()).zip(&group_of_rank) {
            members[next[g]] = (order(r), r);
            next[g] += 1;
        }
        let mut groups: Vec<Vec<u32>> = starts
            .windows(2)
            .map(|w| {
                let group = &mut members[w[0]..w[1]];
                group.sort_unstable();
                group.iter().map(|&(_, r)| r).collect()
            })
            .collect();
        groups.sort_unstable_by_key(|g| g[0]);
        groups
    }

    /// A key identifying `r`'s group of mesh `m` within its stage and tensor index
    /// ([`Layout::groups_by`] keeps those apart).
    pub fn group_key(&self, m: Mesh, r: u32) -> u64 {
        u64::from(self.dp_node(r) / m.inter) << 32 | u64::from(self.dp_local(r) / m.intra)
    }

    /// Where the groups lie: all members on one node, every member on its own node, or mixed.
    pub fn scope(&self, groups: &[Vec<u32>]) -> Scope {
        let g = &groups[0];
        let mut nodes: Vec<u32> = g.iter().map(|&r| self.node(r)).collect();
        nodes.sort_unstable();
        nodes.dedup();
        if nodes.len() == 1 {
            Scope::Intra
        } else if nodes.len() == g.len() {
            Scope::Inter
        } else {
            Scope::Mixed
        }
    }
}

/// A region's byte range in its buffer for a rank with shard indices `idx`.
pub fn range(r: &Region, layout: &Layout, rank: u32) -> (u64, u64) {
    let start = match r.offset {
        Offset::Fixed(o) => o,
        Offset::Shard {
            index,
            base,
            stride,
        } => base + layout.index(index, rank) * stride,
    };
    (start, start + r.bytes)
}

/// The ranks whose shard indices differ: evaluating a region for these covers every rank.
pub fn representative_ranks(layout: &Layout) -> Vec<u32> {
    let mut seen = std::collections::HashSet::new();
    (0..layout.ranks())
        .filter(|&r| seen.insert(ShardIndex::ALL.map(|i| layout.index(i, r))))
        .collect()
}

#[cfg(test)]
#[path = "../../tests/unit/ir_layout.rs"]
mod tests;
