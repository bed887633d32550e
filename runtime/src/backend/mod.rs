//! The backend interface: what the trainer needs from a machine to run a plan.
//!
//! A backend owns, for each rank it drives, the rank's arena (one allocation of the plan's
//! `arena_bytes`; every tensor at its planned offset), its streams and events, its communicators,
//! and kernels for every [`crate::exec::Action`]. The trainer talks to it only through
//! [`Backend`]: move whole values between host and arena ([`Backend::upload`],
//! [`Backend::download`]) and run one optimizer step ([`Backend::run_step`]): enqueue every op of
//! the plan on its stream in issue order, each preceded by its event waits and followed by its
//! record, then join all streams. Backends never reorder, add or drop an op.
//!
//! [`cpu`] runs every rank in this process; [`cuda`] runs one rank per process and GPU (its device
//! code behind the `cuda` cargo feature) and implements the same trait.

pub mod cpu;
pub mod cuda;

use sched_ir::ir::OpId;
use sched_ir::job::Dtype;
use std::time::Duration;

pub use crate::step::{Batch, StepInput};

/// Time one stream of one rank spent blocked (event waits and collective rendezvous).
#[derive(Clone, Debug)]
pub struct StreamWait {
    pub rank: u32,
    pub stream: &'static str,
    pub waiting: Duration,
    pub busy: Duration,
}

/// When one op of one rank ran, measured from the start of the step: a compute op from the
/// moment it holds a core to its end, a collective from this rank's arrival at it (waiting for
/// the other members included) to its completion. Event waits before an op are not in it.
#[derive(Clone, Copy, Debug)]
pub struct OpSpan {
    pub rank: u32,
    pub op: OpId,
    pub start: Duration,
    pub end: Duration,
}

/// What a step produced.
#[derive(Clone, Debug)]
pub struct StepOutcome {
    /// Sum of every token's cross-entropy over **all** ranks of the plan (a backend that drives
    /// only some ranks, one process per GPU, sums it across processes).
    pub loss_sum: f64,
    /// With clipping (the plan's `grad_norm` op): the sum over **all** ranks of each rank's sum
    /// of squares of its optimizer-shard gradients, as its `grad_norm` op computed it in f64
    /// before the all-reduce. Not the global norm (a shard held by several replicas counts once
    /// per replica) but non-finite exactly when some rank's part is, that is when a gradient
    /// element is (`schedrun` stops a run on it: `runtime.md`, "Long runs"). `None` without
    /// clipping.
    pub grad_sumsq: Option<f64>,
    pub waits: Vec<StreamWait>,
    /// With [`RunOptions::time_ops`], every op of every rank this backend drives; else empty.
    pub spans: Vec<OpSpan>,
    /// How long the host took to enqueue the step's ops, where a backend enqueues them for a
    /// device to run (the CUDA backend): near the step time, the step is bound by launches
    /// rather than by the GPU. `None` where ops run as they are issued.
    pub enqueue: Option<Duration>,
}

/// Memory of one rank: the arena allocated and the highest byte any op touched.
#[derive(Clone, Copy, Debug)]
pub struct RankMemory {
    pub rank: u32,
    pub allocated: u64,
    pub touched: u64,
}

/// A failure while running, naming the rank and op when there is one. Its cause is the typed
/// error that stopped the step (a device error, an arena access, a library's refusal, a
/// timeout's description), kept as the error's `source`.
#[derive(Clone, Debug, thiserror::Error)]
#[error("{}{cause}", place(*rank, op.as_deref()))]
pub struct RunError {
    pub rank: Option<u32>,
    pub op: Option<String>,
    #[source]
    pub cause: RunCause,
}

/// What stopped a step: any error, shared (a run error is reported by every stream that sees it).
pub type RunCause = std::sync::Arc<dyn std::error::Error + Send + Sync>;

/// `rank 2, op17 (…): ` before a cause.
fn place(rank: Option<u32>, op: Option<&str>) -> String {
    match (rank, op) {
        (Some(r), Some(op)) => format!("rank {r}, {op}: "),
        (Some(r), None) => format!("rank {r}: "),
        _ => String::new(),
    }
}

impl RunError {
    /// A failure of `rank` (at `op`, when known) caused by `cause`: an error, or words.
    pub fn at(
        rank: u32,
        op: Option<String>,
        cause: impl Into<Box<dyn std::error::Error + Send + Sync>>,
    ) -> Self {
        RunError {
            rank: Some(rank),
            op,
            cause: cause.into().into(),
        }
    }

    /// A failure of the run as a whole (no rank of its own).
    pub fn of_run(cause: impl Into<Box<dyn std::error::Error + Send + Sync>>) -> Self {
        RunError {
            rank: None,
            op: None,
            cause: cause.into().into(),
        }
    }
}

/// Test and stress knobs of a run.
#[derive(Clone, Debug)]
pub struct RunOptions {
    /// Sleep a random time up to this long before every op (the stress mode).
    pub jitter: Option<Duration>,
    /// Seed of the jitter's random delays.
    pub jitter_seed: u64,
    /// How long an event wait or a collective may block before the run is aborted.
    pub timeout: Duration,
    /// Make one rank fail or stop answering at one op (tests of fault handling).
    pub fault: Option<Fault>,
    /// The CUDA backend: whether a bf16 model's flash attention runs as the tensor-core kernels
    /// (`sched_kernels::flash`; the default) or chunk by chunk on cuBLAS products, the path
    /// they replace (kept for same-run comparisons, as the GPT-2 benchmark makes).
    pub attention_kernels: bool,
    /// Time every op of every step into [`StepOutcome::spans`] (`schedrun --trace`): the CPU
    /// backend with the clock around each op, the CUDA backend with a timing event on the op's
    /// stream before and after it.
    pub time_ops: bool,
}

/// An injected fault: `rank` fails, or hangs, when it reaches `op`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Fault {
    pub rank: u32,
    pub op: OpId,
    /// Hang (stop answering) instead of failing.
    pub hang: bool,
}

impl Default for RunOptions {
    fn default() -> Self {
        RunOptions {
            jitter: None,
            jitter_seed: 0,
            timeout: Duration::from_secs(60),
            fault: None,
            attention_kernels: true,
            time_ops: false,
        }
    }
}

/// A machine that runs plans.
pub trait Backend {
    fn name(&self) -> &'static str;
    /// The ranks this backend drives (all of them on the CPU backend).
    fn ranks(&self) -> Vec<u32>;
    /// Writes `values` as `dtype` at byte `offset` of `rank`'s arena.
    fn upload(&self, rank: u32, offset: u64, dtype: Dtype, values: &[f32]) -> Result<(), RunError>;
    /// Reads `n` values of `dtype` at byte `offset` of `rank`'s arena.
    fn download(
        &self,
        rank: u32,
        offset: u64,
        n: usize,
        dtype: Dtype,
    ) -> Result<Vec<f32>, RunError>;
    /// Runs one optimizer step of the plan on every rank and stream, and joins them.
    fn run_step(&mut self, input: &StepInput) -> Result<StepOutcome, RunError>;
    fn memory(&self) -> Vec<RankMemory>;
    /// Whether every process of the run passes `ok`: a point each process reaches in the same
    /// order between steps (a sharded checkpoint's phases, `checkpoint::shards`). A backend that
    /// drives every rank in this process returns `ok`; the CUDA backend with several processes
    /// sums a flag over them.
    fn all_agree(&self, ok: bool) -> Result<bool, RunError> {
        Ok(ok)
    }
}
