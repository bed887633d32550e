//! `schedc`: the sched schedule compiler.
//!
//! The pipeline, one module per stage (naga's front → IR → passes → verifier → back layout):
//! - [`sema`]: parse (through `sched-grammar`), resolve imports, names and presets, check every rule
//!   of the language, and produce resolved [`job::Job`]s. All errors of a file are collected.
//! - [`job`]: the resolved job description every later stage consumes: model with exact per-layer
//!   parameter counts and tensor shapes, cluster with units converted, schedule with every factor
//!   explicit.
//! - [`lower`] and [`passes`]: the job becomes a stream program ([`ir`]) with a fixed issue order,
//!   streams, events and a static memory plan.
//! - [`verify`]: proves the program race-free, deadlock-free and its memory plan sound before
//!   anything is written; success yields the [`verify::PlanInfo`] emitters need.
//! - [`sim`]: the cost model and discrete-event simulator: step time, MFU, a Chrome trace.
//! - [`emit`]: the resolved-job listing, the plan file, the program listing, summary and stats.
//! - [`planner`]: `schedc plan`, the search for the fastest schedule that fits, over compiled and
//!   simulated candidates pruned by analytic floors.
//!
//! [`compile`] runs lowering and verification together, so an unverified program never escapes.

pub mod emit;
pub mod files;
pub mod intervals;
pub mod ir;
pub mod job;
pub mod kernels;
pub mod lower;
pub mod passes;
pub mod planner;
pub mod sema;
pub mod sim;
#[doc(hidden)]
pub mod testing;
pub mod verify;

pub use job::Job;

/// Why a job did not compile.
#[derive(Debug)]
pub enum CompileError {
    /// The schedule cannot be lowered as written (for example an unmeetable `max_live`).
    Lower(lower::LowerError),
    /// The lowered program failed verification: a compiler bug, reported with the program.
    Verify(Box<ir::Program>, Vec<verify::VerifyError>),
}

impl std::fmt::Display for CompileError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CompileError::Lower(e) => write!(f, "{e}"),
            CompileError::Verify(_, errs) => write!(
                f,
                "the compiled program fails verification ({} errors)",
                errs.len()
            ),
        }
    }
}

impl std::error::Error for CompileError {}

/// The verification context of a job (its shard meshes and hpZ secondary size).
pub fn verify_ctx(job: &Job) -> verify::Ctx {
    let secondary = match job.schedule.reshard_after_forward {
        job::ReshardAfterForward::Node { secondary } => Some(secondary),
        _ => None,
    };
    verify::Ctx {
        shard: job.schedule.shard,
        secondary,
    }
}

/// Lowers, plans and verifies one job.
pub fn compile(job: &Job) -> Result<(ir::Program, verify::PlanInfo), CompileError> {
    compile_timed(job, &mut lower::PassTimes::default())
}

/// [`compile`], recording each pass's time (verification included) in `times`.
pub fn compile_timed(
    job: &Job,
    times: &mut lower::PassTimes,
) -> Result<(ir::Program, verify::PlanInfo), CompileError> {
    let program = lower::lower_timed(job, times).map_err(CompileError::Lower)?;
    match times.time("verify", || verify::verify(&program, verify_ctx(job))) {
        Ok(info) => Ok((program, info)),
        Err(errs) => Err(CompileError::Verify(Box::new(program), errs)),
    }
}
pub use sema::{analyze, Analysis, FsLoader, Loader, MemLoader};
