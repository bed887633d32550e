//! Gradient contribution sets for the value proof ([`super::values`]): which (term, micro-step,
//! rank) backward passes a gradient range sums, interned so that contents compare by id.
//!
//! A set is kept as its (term, micro-step) keys, sorted, each with a bitset of the ranks that
//! contributed. The value proof runs only the ranks of tensor index 0 (`Run::stage_ranks`), so a
//! rank's bit is its **slot** `rank / t`: one bit per rank the proof runs, `ranks / t` in all,
//! instead of one per rank of the cluster (64 words a key at 4,096 ranks and t = 8; 8 with
//! slots). Slots are a bijection on the ranks of tensor index 0, and [`Contribs::single`] refuses
//! any other rank, so a set means exactly what the per-rank bitset meant, and every error names
//! the same rank. The bitsets of a set lie in one flat list (no allocation per key), and unions
//! merge two sorted sets in one pass.

use sched_ir::hash::FxHashMap;
use std::rc::Rc;

/// One contribution set: `keys[i]` = (term, micro-step), sorted; its rank bitset is
/// `bits[i·w .. (i + 1)·w]` for the run's `w` words a key.
#[derive(Clone, Default, PartialEq, Eq, Hash)]
struct Set {
    keys: Vec<(u32, u32)>,
    bits: Vec<u64>,
}

/// A (term, micro-step, rank) counted twice.
pub type Twice = (u32, u32, u32);

/// Interned contribution sets. Sets are only ever built by [`Contribs::single`] and by unions
/// of disjoint sets, so a union (two members or more) never equals a singleton: singletons are
/// interned by (term, micro-step, rank) alone, cheaply, and only union results by their whole
/// set.
pub struct Contribs {
    /// t: a rank's slot is `rank / t`.
    t: u32,
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
    /// Sets over `ranks` ranks with `t` tensor indices, of which only index 0 contributes.
    pub fn new(ranks: u32, t: u32) -> Self {
        let t = t.max(1);
        Contribs {
            t,
            words: (ranks.div_ceil(t) as usize).div_ceil(64).max(1),
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
        let slot = (rank / self.t) as usize;
        let mut bits = vec![0u64; self.words];
        bits[slot / 64] |= 1 << (slot % 64);
        let i = self.sets.len() as u32;
        self.sets.push(Rc::new(Set {
            keys: vec![(term, m)],
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
                            let slot = (k * 64) as u32 + (p & q).trailing_zeros();
                            let (term, m) = b.keys[j];
                            return Err((term, m, slot * self.t));
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

    /// The terms of set `c`, in order, each once.
    pub fn terms(&self, c: u32) -> Vec<u32> {
        let mut terms: Vec<u32> = self.sets[c as usize].keys.iter().map(|k| k.0).collect();
        terms.dedup();
        terms
    }

    /// The ranks of set `c` that contributed (term, m), if any did.
    pub fn ranks(&self, c: u32, term: u32, m: u32) -> Option<Ranks<'_>> {
        let set = &self.sets[c as usize];
        let i = set.keys.binary_search(&(term, m)).ok()?;
        Some(Ranks {
            bits: &set.bits[i * self.words..][..self.words],
            t: self.t,
        })
    }
}

/// The ranks of one key of a set.
pub struct Ranks<'a> {
    bits: &'a [u64],
    t: u32,
}

impl Ranks<'_> {
    pub fn count(&self) -> u32 {
        self.bits.iter().map(|w| w.count_ones()).sum()
    }

    /// The lowest rank (rank 0 when there is none).
    pub fn first(&self) -> u32 {
        self.bits
            .iter()
            .enumerate()
            .find(|(_, w)| **w != 0)
            .map_or(0, |(k, w)| ((k * 64) as u32 + w.trailing_zeros()) * self.t)
    }

    pub fn contains(&self, rank: u32) -> bool {
        if rank % self.t != 0 {
            return false;
        }
        let slot = (rank / self.t) as usize;
        self.bits
            .get(slot / 64)
            .is_some_and(|w| w & (1 << (slot % 64)) != 0)
    }
}
