//! `schedc`: the sched schedule compiler.
//!
//! The pipeline, one module per stage (naga's front → IR → passes → verifier → back layout):
//! - [`sema`]: parse (through `sched-grammar`), resolve imports, names and presets, check every rule
//!   of the language, and produce resolved [`job::Job`]s. All errors of a file are collected.
//! - [`job`]: the resolved job description every later stage consumes: model with exact per-layer
//!   parameter counts and tensor shapes, cluster with units converted, schedule with every factor
//!   explicit.
//! - [`lower`] and [`passes`]: the job becomes a [`draft`] and then a stream program ([`ir`]) with
//!   a fixed issue order, streams, events and a static memory plan; [`pipeline`] owns the pass
//!   order, times each pass and checks the program's structure after each in debug builds.
//! - [`verify`]: proves the program race-free, deadlock-free and its memory plan sound before
//!   anything is written; success yields the [`verify::PlanInfo`] emitters need.
//! - [`sim`]: the cost model and discrete-event simulator: step time, MFU, a Chrome trace.
//! - [`emit`]: the resolved-job listing, the plan file, the program listing, summary and stats.
//! - [`planner`]: `schedc plan`, the search for the fastest schedule that fits, over compiled and
//!   simulated candidates pruned by analytic floors.
//!
//! [`hf`] turns a Hugging Face `config.json` into a `model` block (`schedc import hf`).
//!
//! [`compile`] runs lowering and verification together, so an unverified program never escapes;
//! [`load`] is the one "plan file or `.sched`" loader both binaries use.

pub mod draft;
pub mod emit;
pub mod hf;
pub mod load;
pub mod lower;
pub mod passes;
pub mod pipeline;
pub mod planner;
pub mod sema;
pub mod sim;
#[doc(hidden)]
pub mod testing;

pub use pipeline::{compile, compile_emitting, compile_timed, CompileError};
pub use sched_ir::Job;

pub use sema::{analyze, Analysis, FsLoader, Loader, MemLoader};
