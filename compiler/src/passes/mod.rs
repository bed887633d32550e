//! The passes that turn a lowered [`crate::draft::Draft`] into a placed program, one file each, run
//! in this order by [`crate::pipeline`]:
//! 1. [`prefetch`]: the issue order, gather hoisting under `max_live`, and flow-control fences;
//! 2. [`streams`]: roles to streams under the `streams` policy and `overlap` switches;
//! 3. [`workspace`]: each stream's workspace buffer, written by the ops that use it;
//! 4. [`events`]: the waits data dependencies and fences need, none redundant;
//! 5. [`memory`]: buffer lifetimes and arena offsets, reusing bytes only across happens-before;
//! 6. [`events`] again, with the placement's reuse orderings in place of the fences.
//!
//! [`hb`] is the passes' own happens-before (vector clocks), kept apart from the verifier's.

pub mod events;
pub mod hb;
pub mod memory;
pub mod prefetch;
pub mod streams;
pub mod workspace;
