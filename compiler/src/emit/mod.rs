//! Outputs a person or a tool reads. One file per output; each is a pure function of its input,
//! stable across runs so it can be snapshot-tested.

pub mod diagram;
pub mod job;
pub mod stats;
pub mod summary;
