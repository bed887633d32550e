//! `schedrun`: executes compiled sched plans (`docs/runtime.md`).
//!
//! It reads a plan written by `schedc compile` (or compiles a `.sched` file on the spot), verifies
//! it again, and runs it without re-deciding anything the plan decided: every rank's ops on their
//! streams in the plan's issue order, the plan's events as the only cross-stream ordering, real
//! collectives over the plan's communicator groups, every tensor at its planned arena offset.
//!
//! - [`plan`]: a loaded, verified plan with each op decoded ([`exec`]) and the layer math bound.
//! - [`backend`]: the interface a machine implements (arenas, streams, events, collectives,
//!   kernels) and the CPU backend, which runs all ranks in this process on real threads.
//! - `device`: the device layer: one interpreter of compute ops (`run_action`) and one layer
//!   math over the primitives each backend implements (the CPU's on host memory).
//! - [`math`]: the model math in f32 (zoo layers forward and backward, loss, optimizers, bf16).
//! - [`train`]: the host side: initial state, batches by `runtime.md`'s rule, steps, whole-tensor
//!   state in and out; [`checkpoint`] stores that state in safetensors files and folders of
//!   periodic checkpoints; [`preempt`] turns SIGTERM/SIGINT into a stop after the current step.
//! - [`data`]: the corpus (bytes, token files, text through a tokenizer) and the batch rule;
//!   [`reference`]: an independent single-process trainer that parity tests compare every
//!   schedule against, and [`eval`] computes the validation loss with; [`trace`]: a measured step
//!   as a Perfetto trace; [`plot`]: the loss curve as an SVG.

pub mod arena;
pub mod backend;
pub mod checkpoint;
pub mod data;
pub(crate) mod device;
pub mod eval;
pub mod exec;
pub mod hf;
pub mod math;
mod pages;
pub mod plan;
pub mod plot;
pub mod preempt;
pub mod reference;
pub mod step;
pub mod trace;
pub mod train;
