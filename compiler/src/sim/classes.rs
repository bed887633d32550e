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

use crate::ir::{CommId, Program};
use cranelift_entity::SecondaryMap;
use std::collections::HashMap;

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
    let ranks = p.ranks as usize;
    let node = |r: u32| r / p.gpus_per_node.max(1);
    let mut group_of: SecondaryMap<CommId, Vec<u32>> = SecondaryMap::new();
    for (id, comm) in p.comms.iter() {
        let mut g = vec![u32::MAX; ranks];
        for (i, members) in comm.groups.iter().enumerate() {
            for &r in members {
                if (r as usize) < ranks {
                    g[r as usize] = i as u32;
                }
            }
        }
        group_of[id] = g;
    }
    // Initial colours: the shape of each group a rank is in (size, members on its node, nodes),
    // computed group by group so that the work is proportional to the ranks.
    let mut shape: Vec<Vec<u64>> = vec![vec![]; ranks];
    for (_, comm) in p.comms.iter() {
        let mut seen = vec![false; ranks];
        for g in &comm.groups {
            let mut per_node: HashMap<u32, u64> = HashMap::new();
            for &m in g {
                *per_node.entry(node(m)).or_default() += 1;
            }
            for &m in g.iter().filter(|&&m| (m as usize) < ranks) {
                seen[m as usize] = true;
                shape[m as usize].extend([
                    g.len() as u64,
                    per_node[&node(m)],
                    per_node.len() as u64,
                ]);
            }
        }
        for (r, s) in shape.iter_mut().enumerate() {
            if !seen[r] {
                s.extend([0, 0, 0]);
            }
        }
    }
    let mut ids: HashMap<Vec<u64>, u32> = HashMap::new();
    let mut colour: Vec<u32> = shape
        .into_iter()
        .map(|sig| {
            let n = ids.len() as u32;
            *ids.entry(sig).or_insert(n)
        })
        .collect();
    let mut count = distinct(&colour);
    loop {
        // Each group's and each node's multiset of colours, computed once per group.
        let mut group_sig: Vec<Vec<u32>> = vec![];
        for (_, comm) in p.comms.iter() {
            let mut per_group = vec![];
            for g in &comm.groups {
                let mut cs: Vec<u32> = g
                    .iter()
                    .filter(|&&m| (m as usize) < ranks)
                    .map(|&m| colour[m as usize])
                    .collect();
                cs.sort_unstable();
                per_group.push(intern_u32(cs, &mut ids));
            }
            group_sig.push(per_group);
        }
        let nodes = ranks.div_ceil(p.gpus_per_node.max(1) as usize);
        let node_sig: Vec<u32> = (0..nodes)
            .map(|n| {
                let lo = n * p.gpus_per_node as usize;
                let hi = (lo + p.gpus_per_node as usize).min(ranks);
                let mut cs = colour[lo..hi].to_vec();
                cs.sort_unstable();
                intern_u32(cs, &mut ids)
            })
            .collect();
        let mut refined = HashMap::new();
        let next: Vec<u32> = (0..ranks)
            .map(|r| {
                let mut sig = vec![colour[r], node_sig[node(r as u32) as usize]];
                for (i, (id, _)) in p.comms.iter().enumerate() {
                    let gi = group_of[id][r];
                    sig.push(group_sig[i].get(gi as usize).copied().unwrap_or(u32::MAX));
                }
                let n = refined.len() as u32;
                *refined.entry(sig).or_insert(n)
            })
            .collect();
        let c = distinct(&next);
        colour = next;
        if c == count {
            break;
        }
        count = c;
    }
    // Renumber classes by their lowest rank.
    let mut renum = HashMap::new();
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

fn intern_u32(cs: Vec<u32>, ids: &mut HashMap<Vec<u64>, u32>) -> u32 {
    let key: Vec<u64> = std::iter::once(u64::MAX)
        .chain(cs.into_iter().map(u64::from))
        .collect();
    let n = ids.len() as u32;
    *ids.entry(key).or_insert(n)
}

fn distinct(c: &[u32]) -> usize {
    let mut v = c.to_vec();
    v.sort_unstable();
    v.dedup();
    v.len()
}
