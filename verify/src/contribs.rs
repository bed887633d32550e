//! Gradient contribution sets for the value proof ([`super::values`]): which (term, micro-step,
//! rank) backward passes a gradient range sums, interned so that contents compare by id.
//!
//! The value proof runs only the ranks of tensor index 0 (`Run::stage_ranks`): rank
//! `(stage·d + dp)·t`, one per (pipeline stage, data-parallel index). A set is kept as its
//! (term, micro-step, stage) keys, sorted, each with a bitset of the data-parallel indices that
//! contributed: d bits a key (one word for d ≤ 64), where a bitset over every rank of the cluster
//! took 64 words at 4,096 ranks. (stage, dp) is a bijection on the ranks of tensor index 0, and
//! [`Contribs::single`] refuses any other rank, so a set means exactly what the per-rank bitset
//! meant; the keys of one (term, micro-step) are adjacent and ordered by stage, so the lowest
//! key-then-bit is the lowest rank, and every error names the same rank as before. The bitsets
//! of a set lie in one flat list (no allocation per key), and unions merge two sorted sets in
//! one pass.

use sched_ir::hash::FxHashMap;
use sched_ir::ir::Layout;
use std::rc::Rc;

/// One contribution set: `keys[i]` = (term, micro-step, stage), sorted; its bitset of
/// data-parallel indices is `bits[i·w .. (i + 1)·w]` for the run's `w` words a key.
#[derive(Clone, Default, PartialEq, Eq, Hash)]
struct Set {
    keys: Vec<(u32, u32, u32)>,
    bits: Vec<u64>,
}

/// A (term, micro-step, rank) counted twice.
pub type Twice = (u32, u32, u32);

/// Interned contribution sets. Sets are only ever built by [`Contribs::single`] and by unions
/// of disjoint sets, so a union (two members or more) never equals a singleton: singletons are
/// interned by (term, micro-step, rank) alone, cheaply, and only union results by their whole
/// set.
pub struct Contribs {
    /// t: rank `(stage·d + dp)·t` runs.
    t: u32,
    /// d, the data-parallel ranks of a stage and tensor index.
    d: u32,
    /// Words of one key's bitset.
    words: usize,
    /// Each set once, shared with `index` (a set is read far more often than made).
    sets: Vec<Rc<Set>>,
    index: FxHashMap<Rc<Set>, u32>,
    singles: FxHashMap<(u32, u32, u32), u32>,
    /// Unions already taken, by the ids of their two sides.
    unions: FxHashMap<(u32, u32), u32>,
}

impl Contribs {
    /// Sets over the ranks of `layout`, of which only tensor index 0 contributes.
    pub fn new(layout: &Layout) -> Self {
        let (t, d) = (layout.tensor.max(1), layout.dp_size().max(1));
        Contribs {
            t,
            d,
            words: (d as usize).div_ceil(64),
            sets: vec![],
            index: FxHashMap::default(),
            singles: FxHashMap::default(),
            unions: FxHashMap::default(),
        }
    }

    fn intern(&mut self, set: Set) -> u32 {
        if let Some(&i) = self.index.get(&set) {
            return i;
        }
        let i = self.sets.len() as u32;
        let set = Rc::new(set);
        self.sets.push(Rc::clone(&set));
        self.index.insert(set, i);
        i
    }

    /// `{(term, m, rank)}`. `rank` must be of tensor index 0 (the only ranks the proof runs).
    pub fn single(&mut self, term: u32, m: u32, rank: u32) -> u32 {
        assert_eq!(
            rank % self.t,
            0,
            "the value proof runs only ranks of tensor index 0"
        );
        if let Some(&i) = self.singles.get(&(term, m, rank)) {
            return i;
        }
        let slot = rank / self.t;
        let (stage, dp) = ((slot / self.d), (slot % self.d) as usize);
        let mut bits = vec![0u64; self.words];
        bits[dp / 64] |= 1 << (dp % 64);
        let i = self.sets.len() as u32;
        self.sets.push(Rc::new(Set {
            keys: vec![(term, m, stage)],
            bits,
        }));
        self.singles.insert((term, m, rank), i);
        i
    }

    /// The union of two sets, or the (term, micro-step, rank) counted twice. Sets never change
    /// once interned, so a union is remembered by its sides' ids.
    pub fn union(&mut self, a: u32, b: u32) -> Result<u32, Twice> {
        if let Some(&u) = self.unions.get(&(a, b)) {
            return Ok(u);
        }
        let u = self.union_all(&[a, b])?;
        self.unions.insert((a, b), u);
        Ok(u)
    }

    /// The union of `ids` taken in order (each added to the union of those before it), or the
    /// first (term, micro-step, rank) counted twice (the lowest key of the set being added
    /// that meets the union so far, and its lowest rank there); only the result is interned.
    pub fn union_all(&mut self, ids: &[u32]) -> Result<u32, Twice> {
        let Some((&first, rest)) = ids.split_first() else {
            return Ok(self.intern(Set::default()));
        };
        if rest.is_empty() {
            return Ok(first);
        }
        let mut acc = Set::clone(&self.sets[first as usize]);
        let mut out = Set::default();
        for &b in rest {
            self.merge(&acc, &self.sets[b as usize], &mut out)?;
            std::mem::swap(&mut acc, &mut out);
        }
        Ok(self.intern(acc))
    }

    /// `out` ← `a ∪ b` (both sorted, so one merge), or the first key of `b` whose ranks meet
    /// `a`'s there, with the lowest such rank.
    fn merge(&self, a: &Set, b: &Set, out: &mut Set) -> Result<(), Twice> {
        let w = self.words;
        out.keys.clear();
        out.bits.clear();
        out.keys.reserve(a.keys.len() + b.keys.len());
        out.bits.reserve((a.keys.len() + b.keys.len()) * w);
        let (mut i, mut j) = (0, 0);
        while i < a.keys.len() || j < b.keys.len() {
            let next = match (a.keys.get(i), b.keys.get(j)) {
                (Some(x), Some(y)) => x.cmp(y),
                (Some(_), None) => std::cmp::Ordering::Less,
                _ => std::cmp::Ordering::Greater,
            };
            match next {
                std::cmp::Ordering::Less => {
                    out.keys.push(a.keys[i]);
                    out.bits.extend_from_slice(&a.bits[i * w..][..w]);
                    i += 1;
                }
                std::cmp::Ordering::Greater => {
                    out.keys.push(b.keys[j]);
                    out.bits.extend_from_slice(&b.bits[j * w..][..w]);
                    j += 1;
                }
                std::cmp::Ordering::Equal => {
                    let (x, y) = (&a.bits[i * w..][..w], &b.bits[j * w..][..w]);
                    for (k, (p, q)) in x.iter().zip(y).enumerate() {
                        if p & q != 0 {
                            let dp = (k * 64) as u32 + (p & q).trailing_zeros();
                            let (term, m, stage) = b.keys[j];
                            return Err((term, m, self.rank(stage, dp)));
                        }
                    }
                    out.keys.push(a.keys[i]);
                    out.bits.extend(x.iter().zip(y).map(|(p, q)| p | q));
                    i += 1;
                    j += 1;
                }
            }
        }
        Ok(())
    }

    /// Set `c` with `flag` cleared from every term, when every term carries it (sequence
    /// parallelism's rows' parts, summed over the tensor group); `None` for the empty set or when
    /// some term does not carry it. A singleton comes back interned as one.
    pub fn cleared(&mut self, c: u32, flag: u32) -> Option<u32> {
        let set = &self.sets[c as usize];
        if set.keys.is_empty() || set.keys.iter().any(|k| k.0 & flag == 0) {
            return None;
        }
        let w = self.words;
        let keys: Vec<(u32, u32, u32)> = set.keys.iter().map(|k| (k.0 & !flag, k.1, k.2)).collect();
        let mut order: Vec<usize> = (0..keys.len()).collect();
        order.sort_by_key(|&i| keys[i]);
        let mut out = Set::default();
        for i in order {
            out.keys.push(keys[i]);
            out.bits.extend_from_slice(&set.bits[i * w..][..w]);
        }
        if let [(term, m, stage)] = *out.keys.as_slice() {
            if out.bits.iter().map(|x| x.count_ones()).sum::<u32>() == 1 {
                let (k, word) = out
                    .bits
                    .iter()
                    .enumerate()
                    .find(|(_, x)| **x != 0)
                    .expect("one bit");
                let rank = self.rank(stage, (k * 64) as u32 + word.trailing_zeros());
                // A singleton is interned by (term, micro-step, rank) alone.
                return Some(self.single(term, m, rank));
            }
        }
        Some(self.intern(out))
    }

    /// The terms of set `c`, in order, each once.
    pub fn terms(&self, c: u32) -> Vec<u32> {
        let mut terms: Vec<u32> = self.sets[c as usize].keys.iter().map(|k| k.0).collect();
        terms.dedup();
        terms
    }

    /// The rank of tensor index 0 at (`stage`, `dp`).
    fn rank(&self, stage: u32, dp: u32) -> u32 {
        (stage * self.d + dp) * self.t
    }

    /// The ranks of set `c` that contributed (term, m), if any did.
    pub fn ranks(&self, c: u32, term: u32, m: u32) -> Option<Ranks<'_>> {
        let set = &self.sets[c as usize];
        let lo = set.keys.partition_point(|k| (k.0, k.1) < (term, m));
        let hi = lo + set.keys[lo..].partition_point(|k| (k.0, k.1) == (term, m));
        (lo < hi).then(|| Ranks {
            of: self,
            stages: &set.keys[lo..hi],
            bits: &set.bits[lo * self.words..hi * self.words],
        })
    }
}

/// The ranks of one (term, micro-step) of a set: a bitset of data-parallel indices per stage.
pub struct Ranks<'a> {
    of: &'a Contribs,
    /// The keys, one per stage, in stage order.
    stages: &'a [(u32, u32, u32)],
    bits: &'a [u64],
}

impl Ranks<'_> {
    pub fn count(&self) -> u32 {
        self.bits.iter().map(|w| w.count_ones()).sum()
    }

    /// The lowest rank (rank 0 when there is none).
    pub fn first(&self) -> u32 {
        let w = self.of.words;
        self.stages
            .iter()
            .enumerate()
            .find_map(|(i, key)| {
                let bits = &self.bits[i * w..][..w];
                let (k, word) = bits.iter().enumerate().find(|(_, x)| **x != 0)?;
                Some(self.of.rank(key.2, (k * 64) as u32 + word.trailing_zeros()))
            })
            .unwrap_or(0)
    }

    pub fn contains(&self, rank: u32) -> bool {
        let Contribs { t, d, words, .. } = *self.of;
        if !rank.is_multiple_of(t) {
            return false;
        }
        let (stage, dp) = (rank / t / d, (rank / t % d) as usize);
        self.stages
            .iter()
            .position(|key| key.2 == stage)
            .is_some_and(|i| self.bits[i * words + dp / 64] & (1 << (dp % 64)) != 0)
    }
}

#[cfg(test)]
#[path = "../tests/unit/contribs.rs"]
mod tests;
