//! The CUDA backend: one process per GPU, each driving one rank of the plan.
//!
//! Design (issue 6; `docs/runtime.md`, `docs/cuda.md`):
//! - **Memory** (`memory.rs`). One device allocation per rank of exactly the plan's
//!   `arena_bytes`; every tensor lives at its planned offset inside it, in the same byte layout
//!   as the CPU backend's arena (fp32 as its bits, bf16/fp16 as 16-bit words). Kernels compute on
//!   the arena in place, in each region's dtype (`typed.rs`: the device pointer carries its
//!   storage; a 16-bit model's saved region hands out its segments each in its own storage),
//!   rounding once where they store, exactly where the CPU backend rounds. Each stream's
//!   workspace is a planned buffer of the arena too: its GEMM part is cuBLAS's and cuBLASLt's
//!   workspace, its fp32 scratch (the device twin of the CPU backend's scratch pools) holds only
//!   the layer math's fp32 intermediates, the parameter gradient before it is written into its
//!   gradient parts, and product casts. Beside the arena there is only one small allocation of
//!   constants: the batch's tokens, the loss accumulators, rotary tables and decay ranges.
//!   Nothing is allocated while a step runs. cudarc's automatic event tracking is turned off:
//!   the plan's events are the only synchronisation.
//! - **Streams and events.** One CUDA stream per plan stream and one CUDA event per plan event.
//!   The host enqueues every op of the plan in its single issue order (each op on its stream:
//!   `cuStreamWaitEvent` for its waits, the op, `cuEventRecord` for its record), then waits for
//!   the streams. Enqueueing never blocks on the device, so one host thread issues all streams.
//! - **Compute.** Matrix multiplies through cuBLAS for fp32 models (sgemm; attention's per-head
//!   products as strided-batched sgemm) and on tensor cores through cuBLASLt for bf16 and fp16
//!   models (operands in the model dtype used in place, fp32 ones rounded to it first; fp32
//!   accumulation; C and D fp32 or the model dtype with the bias in the epilogue; `blas.rs`),
//!   every other kernel a generated one (`sched_kernels`, typed for the storages of the
//!   pointers each launch passes) from the plan's PTX module for the GPU's architecture, which
//!   `schedc compile --emit ptx` wrote beside the plan ([`ptx`]: found and checked before
//!   anything runs; `kernels.rs`: loaded by the driver, no NVRTC). The layer math and each op's
//!   reads and writes are the device layer's (`crate::device`), the same code the CPU backend
//!   runs.
//! - **Collectives.** NCCL through cudarc, one communicator per (communicator group, stream) the
//!   plan uses ([`rendezvous::CommKey`]), each from its own unique id; a coalesced op is one
//!   `ncclGroupStart`/`ncclGroupEnd`. A watchdog aborts the communicators and names the rank and
//!   op when a collective takes longer than the run's timeout.
//! - **Processes.** [`launch`] reads torchrun/Slurm variables or starts one process per local GPU;
//!   [`rendezvous`] (plain TCP on the master) checks that every rank holds the same plan and hands
//!   out the NCCL ids.
//!
//! Feature checks live here only. Always built (and tested without a GPU): [`launch`],
//! [`rendezvous`], the plan checks ([`comm_keys`], [`plan_hash`]; the issue order and NCCL's
//! in-place rules are the verifier's proofs 1b and 8, which every loaded plan passed), the PTX
//! module's checks ([`ptx`]), and the device code that only enqueues work through the `Exec`
//! interface (`enqueue.rs`: launch shapes, the row-major to column-major product mapping, NCCL
//! call descriptions; `gpu.rs`: the device layer's primitives as launches and products, under
//! the layer math and op interpreter the CPU backend shares, `crate::device`), which the tests
//! run on the host with the same kernels JIT-compiled (`emulate.rs`, `llvm` feature). Behind the
//! `cuda` cargo feature: the cudarc side (`device.rs`, `kernels.rs`, `blas.rs`, `nccl.rs`,
//! `step.rs`); without it [`CudaBackend::new`] and [`probe`] say "built without CUDA". With it,
//! [`probe`] finds out at run time which of the driver, cuBLAS, cuBLASLt and NCCL libraries are
//! missing before cudarc touches them (cudarc panics on a missing library).

mod enqueue;
pub use enqueue::{CudaError, Library};
mod gpu;
pub mod launch;
mod memory;
pub mod ptx;
pub mod rendezvous;
mod typed;

#[cfg(feature = "cuda")]
mod blas;
#[cfg(feature = "cuda")]
mod device;
#[cfg(all(test, feature = "llvm", feature = "compile"))]
#[path = "../../../tests/unit/backend_cuda_emulate.rs"]
mod emulate;
#[cfg(feature = "cuda")]
mod kernels;
#[cfg(feature = "cuda")]
mod nccl;
#[cfg(feature = "cuda")]
mod step;

#[cfg(feature = "cuda")]
pub use nccl::check_one_rank_collectives;
pub use ptx::PtxFiles;
#[cfg(not(feature = "cuda"))]
pub use stand_in::CudaBackend;
#[cfg(feature = "cuda")]
pub use step::{check_flash_attention, CudaBackend, FlashCheck};

use crate::plan::Plan;
use cranelift_entity::EntityRef;
use rendezvous::CommKey;
use std::collections::BTreeSet;

/// Whether this build contains the CUDA backend.
pub const BUILT: bool = cfg!(feature = "cuda");

/// Every NCCL communicator the plan needs, over all ranks: for each collective's communicator and
/// stream, one per group of that communicator. Sorted, so every rank computes the same list.
pub fn comm_keys(plan: &Plan) -> Vec<CommKey> {
    let mut keys = BTreeSet::new();
    for op in plan.program.ops.values() {
        for c in op.collectives() {
            let comm = &plan.program.comms[c.comm];
            for g in 0..comm.groups.len() {
                keys.insert(CommKey {
                    comm: c.comm.index() as u32,
                    group: g as u32,
                    stream: comm_stream(plan, op.stream),
                });
            }
        }
    }
    keys.into_iter().collect()
}

/// The stream part of the communicator key of a collective issued on `stream`: its role (see
/// [`CommKey`]).
pub fn comm_stream(plan: &Plan, stream: sched_ir::ir::StreamId) -> u32 {
    plan.program.streams[stream].role as u32
}

/// The communicators `rank` is a member of (its group of each).
pub fn rank_keys(plan: &Plan, rank: u32) -> Vec<CommKey> {
    comm_keys(plan)
        .into_iter()
        .filter(|k| {
            plan.members[sched_ir::ir::CommId::from_u32(k.comm)][rank as usize].0
                == k.group as usize
        })
        .collect()
}

/// A hash of the whole plan (its plan-file JSON), compared across ranks before anything runs.
pub fn plan_hash(plan: &Plan) -> u64 {
    let file = sched_ir::plan_file::emit_plan(&plan.program, &plan.job);
    let text = serde_json::to_string(&file).unwrap_or_default();
    rendezvous::fnv1a(text.as_bytes())
}

/// Checks that the libraries the CUDA backend loads are present; the error is one line naming
/// what is missing.
pub fn probe() -> Result<(), CudaError> {
    #[cfg(feature = "cuda")]
    {
        device::probe_libraries()
    }
    #[cfg(not(feature = "cuda"))]
    {
        Err(CudaError::backend(stand_in::MESSAGE))
    }
}

#[cfg(not(feature = "cuda"))]
mod stand_in {
    //! The CUDA backend of a build without the `cuda` feature: it only says so.

    use super::launch::DistEnv;
    use super::PtxFiles;
    use crate::backend::{Backend, RankMemory, RunError, RunOptions, StepInput, StepOutcome};
    use crate::plan::Plan;
    use sched_ir::job::Dtype;
    use std::sync::Arc;

    pub const MESSAGE: &str =
        "this schedrun was built without CUDA; rebuild with `cargo build --features cuda`";

    /// Never constructed: [`CudaBackend::new`] always fails.
    pub struct CudaBackend(());

    fn unavailable() -> RunError {
        RunError::of_run(MESSAGE)
    }

    impl CudaBackend {
        pub fn new(
            _: Arc<Plan>,
            _: RunOptions,
            _: &DistEnv,
            _: &PtxFiles,
        ) -> Result<Self, RunError> {
            Err(unavailable())
        }
    }

    impl Backend for CudaBackend {
        fn name(&self) -> &'static str {
            "cuda"
        }
        fn ranks(&self) -> Vec<u32> {
            vec![]
        }
        fn upload(&self, _: u32, _: u64, _: Dtype, _: &[f32]) -> Result<(), RunError> {
            Err(unavailable())
        }
        fn download(&self, _: u32, _: u64, _: usize, _: Dtype) -> Result<Vec<f32>, RunError> {
            Err(unavailable())
        }
        fn run_step(&mut self, _: &StepInput) -> Result<StepOutcome, RunError> {
            Err(unavailable())
        }
        fn memory(&self) -> Vec<RankMemory> {
            vec![]
        }
    }
}
