//! The passes that turn a lowered draft into a placed program, one file each, run in this order by
//! [`crate::lower::lower`]:
//! 1. [`buckets`]: which consecutive layers' collectives are coalesced (used while lowering);
//! 2. [`prefetch`]: the issue order, gather hoisting under `max_live`, and flow-control fences;
//! 3. [`streams`]: roles to streams under the `streams` policy and `overlap` switches;
//! 4. [`events`]: the waits data dependencies and fences need, none redundant;
//! 5. [`memory`]: buffer lifetimes and arena offsets, reusing bytes only across happens-before.

pub mod buckets;
pub mod events;
pub mod hb;
pub mod memory;
pub mod prefetch;
pub mod streams;
