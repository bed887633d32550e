//! `sched-ir`: what every other crate of sched must agree on, and nothing about how it is made or
//! run.
//!
//! - [`job`]: the resolved job: the model with exact per-layer parameter counts and shapes, the
//!   cluster with units converted, the schedule with every factor explicit, the training settings.
//! - [`ir`]: the stream program (ops on streams, events, buffers at planned offsets,
//!   communicators), the design document of the whole project; [`ir::Layout`] is the rank
//!   arithmetic every program carries (groups, positions, shard indices).
//! - [`abi`]: the constants and sizes the compiler plans with and the runtime lays tensors out by.
//! - [`plan_file`]: the versioned JSON plan file, written and read back strictly.
//! - [`listing`]: the program's text listing (the verifier writes its errors into it).
//! - [`timeline`]: a step's timeline and its Chrome trace, simulated or measured.
//! - [`hash`], [`intervals`], [`files`]: small helpers the crates above share (a fast hasher, the
//!   occupants of an address range, writing a file without leaving a partial one).
//!
//! A program built here is not yet known to be right: `sched-verify` proves it and hands out the
//! `Verified` form that simulators, emitters and backends take.

pub mod abi;
pub mod files;
pub mod hash;
pub mod intervals;
pub mod ir;
pub mod job;
pub mod listing;
pub mod orders;
pub mod par;
pub mod plan_file;
pub mod tensor;
pub mod timeline;

pub use ir::{Layout, Program};
pub use job::Job;
