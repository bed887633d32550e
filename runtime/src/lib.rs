//! `schedrun`: executes compiled sched plans.
//!
//! Not built yet. It will read a plan written by `schedc compile`, never re-deciding what the plan
//! decided, and run every rank's streams through one backend interface: the CPU backend (all ranks in
//! one process, real math and real collectives) and the CUDA backend (one process per GPU, cudarc
//! streams and events, cuBLAS and NCCL). See `shared/spec/runtime.md`.

pub mod data;
pub mod math;
pub mod reference;
