//! Rank classes: which ranks the simulator may stand for by one representative.
//!
//! The program is SPMD and every cost depends only on the shapes of the groups an op runs on and
//! on what the other GPUs of the node do at the same time. Two ranks therefore have the same
//! timeline when, for every communicator, their groups have the same shape, and the classes of
//! the ranks in their groups (and on their nodes) are the same multiset: then, by induction over
//! the issue order, each op becomes ready at the same moment on both. [`rank_classes`] finds the
//! coarsest such partition (colour refinement: start from group shapes, split by the classes seen
//! in each group and node, until nothing splits). Every compiled schedule is regular (all groups
//! of a communicator are blocks of one mesh), so it has a single class; a plan edited by hand may
//! have more, and the engine then simulates one representative per class, each collective starting
//! once the representatives of every class in its group have reached it, which is exactly when
//! all its members have.
//!
//! With pipeline stages, a rank runs only its stage's streams, so the stage is part of the first
//! colour: classes never mix stages, and a pipeline of p stages has at least p classes (one per
//! stage for every compiled schedule).
//!
//! Colours are interned rows of integers (a rank's signature, a group's or node's sorted colours)
//! kept in flat buffers and hashed with [`FxHashMap`]: the simulator runs this once per screened
//! candidate of `schedc plan`, so it allocates per communicator, never per rank or group.

use cranelift_entity::SecondaryMap;
use sched_ir::hash::FxHashMap;
use sched_ir::ir::{CommId, Program};

/// The partition of ranks into classes with identical timelines.
pub struct RankClasses {
    /// Class of each rank.
    pub class_of: Vec<u32>,
    /// The lowest rank of each class, its representative.
    pub representatives: Vec<u32>,
    /// Ranks in each class.
    pub sizes: Vec<u32>,
    /// For each communicator, the index of each rank's group.
    pub group_of: SecondaryMap<CommId, Vec<u32>>,
}

pub fn rank_classes(p: &Program) -> RankClasses {
    let ranks = p.ranks() as usize;
    let gpus_per_node = p.layout.gpus_per_node.max(1);
    let node = |r: u32| r / gpus_per_node;
    let in_range = |m: &&u32| (**m as usize) < ranks;
    let mut group_of: SecondaryMap<CommId, Vec<u32>> = SecondaryMap::new();
    for (id, comm) in p.comms.iter() {
        let mut g = vec![u32::MAX; ranks];
        for (i, members) in comm.groups.iter().enumerate() {
            for &r in members.iter().filter(in_range) {
                g[r as usize] = i as u32;
            }
        }
        group_of[id] = g;
    }
    let mut colour = interned(&initial_shapes(p, node));
    if p.layout.stages > 1 {
        // Ranks of different stages run different ops: they never share a class, however alike
        // their groups look (interleaved placements make every stage's groups look alike).
        let mut rows = Rows::default();
        for (r, c) in colour.iter().enumerate() {
            rows.values.extend([*c, p.layout.stage(r as u32)]);
            rows.ends.push(rows.values.len());
        }
        colour = interned(&rows);
    }
    let mut count = distinct(&colour);
    let nodes = ranks.div_ceil(gpus_per_node as usize);
    let width = 2 + p.comms.len();
    let mut sigs = Rows::default();
    loop {
        // Each group's and each node's multiset of colours, computed once per group.
        let group_sig: Vec<Vec<u32>> = p
            .comms
            .values()
            .map(|comm| {
                let mut multisets = Rows::default();
                for g in &comm.groups {
                    multisets.push_sorted(g.iter().filter(in_range).map(|&m| colour[m as usize]));
                }
                interned(&multisets)
            })
            .collect();
        let mut multisets = Rows::default();
        for n in 0..nodes {
            let lo = n * gpus_per_node as usize;
            let hi = (lo + gpus_per_node as usize).min(ranks);
            multisets.push_sorted(colour[lo..hi].iter().copied());
        }
        let node_sig = interned(&multisets);
        // Each rank's colour, its node's multiset and its group's multiset in every communicator.
        sigs.clear();
        for r in 0..ranks {
            sigs.values.push(colour[r]);
            sigs.values.push(node_sig[node(r as u32) as usize]);
            for (i, id) in p.comms.keys().enumerate() {
                let gi = group_of[id][r];
                sigs.values
                    .push(group_sig[i].get(gi as usize).copied().unwrap_or(u32::MAX));
            }
            sigs.ends.push(sigs.values.len());
        }
        debug_assert_eq!(sigs.values.len(), ranks * width);
        let next = interned(&sigs);
        let c = distinct(&next);
        colour = next;
        if c == count {
            break;
        }
        count = c;
    }
    // Renumber classes by their lowest rank.
    let mut renum = FxHashMap::default();
    let mut representatives = vec![];
    let mut sizes = vec![];
    let class_of = colour
        .iter()
        .enumerate()
        .map(|(r, c)| {
            let n = renum.len() as u32;
            let k = *renum.entry(*c).or_insert_with(|| {
                representatives.push(r as u32);
                sizes.push(0);
                n
            });
            sizes[k as usize] += 1;
            k
        })
        .collect();
    RankClasses {
        class_of,
        representatives,
        sizes,
        group_of,
    }
}

/// Initial colours' rows: for each communicator in turn, the shape of each group a rank is in
/// (size, members on its node, nodes), or zeros where it is in none; computed group by group so
/// that the work is proportional to the ranks.
fn initial_shapes(p: &Program, node: impl Fn(u32) -> u32) -> Rows<u64> {
    let ranks = p.ranks() as usize;
    let in_range = |m: &&u32| (**m as usize) < ranks;
    // A rank's row has three entries per group it is in, and three zeros per communicator it is
    // in no group of: count them first, so every row's place in one buffer is known.
    let mut len = vec![0usize; ranks];
    let mut seen = vec![false; ranks];
    for comm in p.comms.values() {
        seen.fill(false);
        for &m in comm.groups.iter().flatten().filter(in_range) {
            seen[m as usize] = true;
            len[m as usize] += 3;
        }
        for (l, _) in len.iter_mut().zip(&seen).filter(|(_, &s)| !s) {
            *l += 3;
        }
    }
    let mut ends = Vec::with_capacity(ranks);
    let mut total = 0;
    for l in &len {
        total += l;
        ends.push(total);
    }
    let mut next: Vec<usize> = ends.iter().zip(&len).map(|(e, l)| e - l).collect();
    let mut values = vec![0u64; total];
    let mut on_nodes: Vec<u32> = vec![];
    for comm in p.comms.values() {
        seen.fill(false);
        for g in &comm.groups {
            on_nodes.clear();
            on_nodes.extend(g.iter().map(|&m| node(m)));
            on_nodes.sort_unstable();
            let nodes = 1 + on_nodes.windows(2).filter(|w| w[0] != w[1]).count();
            for &m in g.iter().filter(in_range) {
                let n = node(m);
                let on_node =
                    on_nodes.partition_point(|&x| x <= n) - on_nodes.partition_point(|&x| x < n);
                let at = next[m as usize];
                values[at..at + 3].copy_from_slice(&[g.len() as u64, on_node as u64, nodes as u64]);
                next[m as usize] += 3;
                seen[m as usize] = true;
            }
        }
        for (at, _) in next.iter_mut().zip(&seen).filter(|(_, &s)| !s) {
            *at += 3; // zeros already
        }
    }
    Rows { values, ends }
}

/// Rows of integers of any lengths, end to end in one buffer.
struct Rows<T> {
    values: Vec<T>,
    /// Where each row ends in `values`.
    ends: Vec<usize>,
}

impl<T> Default for Rows<T> {
    fn default() -> Self {
        Rows {
            values: vec![],
            ends: vec![],
        }
    }
}

impl<T: Ord + Copy> Rows<T> {
    /// Appends `row` sorted (a multiset's canonical form).
    fn push_sorted(&mut self, row: impl Iterator<Item = T>) {
        let start = self.values.len();
        self.values.extend(row);
        self.values[start..].sort_unstable();
        self.ends.push(self.values.len());
    }

    fn clear(&mut self) {
        self.values.clear();
        self.ends.clear();
    }

    fn iter(&self) -> impl Iterator<Item = &[T]> {
        let starts = std::iter::once(0).chain(self.ends.iter().copied());
        starts.zip(&self.ends).map(|(s, &e)| &self.values[s..e])
    }
}

/// A colour per row: equal rows share one, numbered in order of first occurrence.
fn interned<T: Ord + Copy + std::hash::Hash>(rows: &Rows<T>) -> Vec<u32> {
    let mut ids: FxHashMap<&[T], u32> = FxHashMap::default();
    rows.iter()
        .map(|row| {
            let n = ids.len() as u32;
            *ids.entry(row).or_insert(n)
        })
        .collect()
}

fn distinct(c: &[u32]) -> usize {
    let mut v = c.to_vec();
    v.sort_unstable();
    v.dedup();
    v.len()
}
