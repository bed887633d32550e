//! Which item last occupied each byte of an address range: disjoint intervals in a B-tree.
//!
//! The memory planner uses it to order each buffer after the ones whose bytes it takes over; the
//! verifier uses it to check exactly those pairs (the rest follow by transitivity). A plain data
//! structure, with no knowledge of programs.

use std::collections::BTreeMap;

pub struct Occupants<T> {
    /// start → (end, item)
    map: BTreeMap<u64, (u64, T)>,
}

impl<T> Default for Occupants<T> {
    fn default() -> Self {
        Occupants {
            map: BTreeMap::new(),
        }
    }
}

impl<T: Copy + PartialEq> Occupants<T> {
    /// Makes `item` the occupant of `[start, end)`; returns the items it displaces there, each once.
    pub fn replace(&mut self, start: u64, end: u64, item: T) -> Vec<T> {
        let mut displaced = vec![];
        let overlapping: Vec<u64> = self
            .map
            .range(..end)
            .rev()
            .take_while(|(_, (e, _))| *e > start)
            .map(|(s, _)| *s)
            .collect();
        for s in overlapping {
            let (e, a) = self.map.remove(&s).expect("listed above");
            if !displaced.contains(&a) {
                displaced.push(a);
            }
            if s < start {
                self.map.insert(s, (start, a));
            }
            if e > end {
                self.map.insert(end, (e, a));
            }
        }
        if start < end {
            self.map.insert(start, (end, item));
        }
        displaced
    }
}

#[cfg(test)]
#[path = "../tests/unit/intervals.rs"]
mod tests;
