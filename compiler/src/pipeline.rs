//! The compilation pipeline: the one place that knows the pass order (cranelift's `Context`).
//!
//! ```text
//! lower::draft → prefetch → streams → workspace → events → memory → events (final) → verify
//! ```
//!
//! - [`crate::lower::draft`] makes every op of the step, grouped into slots and gather units;
//! - [`passes::prefetch`] fixes the issue order and the flow-control fences (and refuses an
//!   unmeetable `max_live`);
//! - [`passes::streams`] maps roles to streams;
//! - [`passes::workspace`] gives each stream that runs compute its workspace buffer, written by
//!   the ops that use it;
//! - [`passes::events`] inserts the waits data dependencies, the collective chain and the fences
//!   need;
//! - [`passes::memory`] places every buffer, reusing bytes only across happens-before, and returns
//!   the orderings its reuse relies on;
//! - [`passes::events`] runs again with those orderings in place of the fences, so every wait left
//!   is needed;
//! - [`verify::verify`] runs every proof of lowering spec §7 on the result (on large programs the
//!   value proof, which reads nothing memory planning or the final events pass change, runs on a
//!   second thread beside memory planning; the final verification checks that and uses it).
//!   [`compile_emitting`] also builds the caller's output (`schedc compile`'s plan file) on a
//!   second thread beside the final verification, and hands it back only with the verified
//!   program.
//!
//! Each pass is timed by name ([`PassTimes`], `schedc compile --time-passes`). With
//! [`Options::verify_each_pass`] (on in debug and test builds, like cranelift's `verify_if`), the
//! structural check the program can already meet runs after every pass
//! ([`verify::verify_structure`]), so a pass that breaks the program's shape is named at once
//! instead of surfacing as a confusing proof failure at the end. The full proofs always run last:
//! nothing this module returns as compiled is unverified.

use crate::draft::Draft;
use crate::passes;
use crate::passes::prefetch::MaxLiveError;
use sched_ir::ir::Program;
use sched_ir::job::Job;
use sched_verify::{self as verify, Rejected, Stage, ValuesProof, Verified, VerifyError};

/// Why a job did not compile.
#[derive(Debug, thiserror::Error)]
pub enum CompileError {
    /// The schedule cannot be lowered as written (an unmeetable `max_live`).
    #[error(transparent)]
    Lower(#[from] MaxLiveError),
    /// The job asks for tensor parallelism (t > 1) with what lowering does not do for it yet
    /// ([`sched_ir::Job::tensor_not_lowered`]). Semantic analysis reports this at its span
    /// before anything compiles ([`crate::Analysis::not_lowered`]); this is the guard for
    /// callers that hold only a job.
    #[error("tensor parallelism (t = {0}) with {1} is not lowered yet")]
    TensorNotLowered(u32, &'static str),
    /// The lowered program failed verification: a compiler bug, reported with the program.
    #[error("the compiled program fails verification ({} errors)", .0.errors.len())]
    Verify(#[source] Rejected),
    /// A pass left the program structurally broken (found by the check after each pass): a
    /// compiler bug, reported with the pass and the program as it left it.
    #[error(
        "the program is malformed after the {pass} pass ({} errors; first: {})",
        errors.len(),
        errors.first().map_or("", |e| e.message.as_str())
    )]
    Pass {
        pass: &'static str,
        program: Box<Program>,
        errors: Vec<VerifyError>,
    },
}

/// How long each pass took, by name, in the order they ran (`schedc compile --time-passes`).
#[derive(Default, Debug)]
pub struct PassTimes(pub Vec<(&'static str, std::time::Duration)>);

impl PassTimes {
    /// Runs `f` as the pass `name`, recording its time.
    pub fn time<T>(&mut self, name: &'static str, f: impl FnOnce() -> T) -> T {
        let start = std::time::Instant::now();
        let out = f();
        self.0.push((name, start.elapsed()));
        out
    }

    /// Each proof of `verified`'s final verification, as `  structure`, `  flow`, … (indented
    /// under the `verify` line, whose time they make up).
    fn proofs(&mut self, verified: &Verified) {
        for &(name, spent) in &verified.proof_times().0 {
            self.0.push((proof_label(name), spent));
        }
    }

    /// Runs `f` as part of `name`, adding its time to that entry (one line however often it runs).
    pub fn accumulate<T>(&mut self, name: &'static str, f: impl FnOnce() -> T) -> T {
        let start = std::time::Instant::now();
        let out = f();
        let spent = start.elapsed();
        match self.0.iter_mut().find(|(n, _)| *n == name) {
            Some((_, total)) => *total += spent,
            None => self.0.push((name, spent)),
        }
        out
    }
}

/// `name` indented, as `--time-passes` prints a proof under `verify`.
fn proof_label(name: &'static str) -> &'static str {
    match name {
        "structure" => "· structure",
        "issue" => "· issue",
        "stages" => "· stages",
        "flow" => "· flow",
        "clocks" => "· clocks",
        "collectives" => "· collectives",
        "memory" => "· memory",
        "nccl" => "· nccl",
        "values" => "· values",
        "values (fingerprint)" => "· values (reused)",
        other => other,
    }
}

/// What the pipeline checks besides the final proofs.
#[derive(Clone, Copy, Debug)]
pub struct Options {
    /// Run the structural check after every pass (timed as `verify structure`).
    pub verify_each_pass: bool,
}

impl Default for Options {
    /// Checks after every pass in debug and test builds, not in release builds.
    fn default() -> Self {
        Options {
            verify_each_pass: cfg!(debug_assertions),
        }
    }
}

/// Lowers, plans and verifies one job.
pub fn compile(job: &Job) -> Result<Verified, CompileError> {
    compile_timed(job, &mut PassTimes::default())
}

/// [`compile`], recording each pass's time (verification included) in `times`.
pub fn compile_timed(job: &Job, times: &mut PassTimes) -> Result<Verified, CompileError> {
    compile_with(job, Options::default(), times)
}

/// [`compile`] with explicit [`Options`], recording each pass's time in `times`.
pub fn compile_with(
    job: &Job,
    options: Options,
    times: &mut PassTimes,
) -> Result<Verified, CompileError> {
    let (program, values) = Pipeline {
        job,
        options,
        times,
    }
    .placed(true)?;
    let verified = times
        .time("verify", || verify::verify_with(program, values))
        .map_err(CompileError::Verify)?;
    times.proofs(&verified);
    Ok(verified)
}

/// [`compile_timed`], also making `emit(&program)` from the placed program on a second thread
/// beside the final verification (timed as `emit`; see [`verify::verify_beside`]): what
/// `schedc compile` writes is built while the proofs run, and comes back only with the
/// [`Verified`] program.
pub fn compile_emitting<T: Send>(
    job: &Job,
    times: &mut PassTimes,
    emit: impl FnOnce(&Program) -> T + Send,
) -> Result<(Verified, T), CompileError> {
    let (program, values) = Pipeline {
        job,
        options: Options::default(),
        times,
    }
    .placed(true)?;
    let timed_emit = |p: &Program| {
        let start = std::time::Instant::now();
        (emit(p), start.elapsed())
    };
    let (verified, (made, spent)) = times
        .time("verify", || {
            verify::verify_beside(program, values, timed_emit)
        })
        .map_err(CompileError::Verify)?;
    times.proofs(&verified);
    times.0.push(("emit", spent));
    Ok((verified, made))
}

/// Lowers and runs every pass: the complete, placed program, not yet through the final proofs.
pub fn lower(job: &Job) -> Result<Program, CompileError> {
    Pipeline {
        job,
        options: Options::default(),
        times: &mut PassTimes::default(),
    }
    .placed(false)
    .map(|(program, _)| program)
}

/// The program before memory planning: issue order, streams and events final, every flow-control
/// fence still in place and every offset 0. What `schedc plan` screens candidates with: the
/// placed program's orderings are a subset of these (placement only reuses bytes between buffers
/// these already order, and drops the fences it does not use).
pub fn lower_unplanned(job: &Job) -> Result<Program, CompileError> {
    Pipeline {
        job,
        options: Options::default(),
        times: &mut PassTimes::default(),
    }
    .unplanned()
}

/// Ops × ranks from which the value proof runs beside memory planning (the 1,024-rank benchmark
/// programs have tens of millions; the examples up to about a million), when there is a second
/// core.
const BESIDE_WORK: usize = 4_000_000;

fn worth_a_thread(p: &Program) -> bool {
    p.ops.len().saturating_mul(p.ranks() as usize) >= BESIDE_WORK
        && std::thread::available_parallelism().is_ok_and(|n| n.get() > 1)
}

/// One run of the passes over one job.
struct Pipeline<'a> {
    job: &'a Job,
    options: Options,
    times: &'a mut PassTimes,
}

impl Pipeline<'_> {
    /// Every pass up to and including the final events pass. With `prove_values` on a large
    /// program, the value proof runs on another thread while memory planning decides the offsets:
    /// it reads nothing the memory and final events passes change, and the final verification
    /// takes its outcome only after checking that (see [`verify::ValuesProof`]).
    fn placed(
        mut self,
        prove_values: bool,
    ) -> Result<(Program, Option<ValuesProof>), CompileError> {
        let mut program = self.unplanned_program()?;
        let beside = prove_values && worth_a_thread(&program);
        let mut values_time = None;
        let (placement, values) = self.times.time("memory", || {
            if !beside {
                return (passes::memory::plan(&program), None);
            }
            std::thread::scope(|s| {
                let values = s.spawn(|| {
                    let start = std::time::Instant::now();
                    (verify::prove_values(&program), start.elapsed())
                });
                let placement = passes::memory::plan(&program);
                let (values, spent) = values.join().expect("the value proof does not panic");
                values_time = Some(spent);
                (placement, Some(values))
            })
        });
        let reuse = passes::memory::apply(&mut program, placement);
        if let Some(spent) = values_time {
            self.times.0.push(("verify values", spent));
        }
        self.check("memory", &program, Stage::Placed)?;
        // Keep only the orderings something needs: flow-control fences the placement did not use go.
        self.times.time("events (final)", || {
            passes::events::run(&mut program, &reuse)
        });
        self.check("events (final)", &program, Stage::Placed)?;
        Ok((program, values))
    }

    fn unplanned(mut self) -> Result<Program, CompileError> {
        self.unplanned_program()
    }

    fn unplanned_program(&mut self) -> Result<Program, CompileError> {
        let job = self.job;
        if let Some(what) = job.tensor_not_lowered() {
            return Err(CompileError::TensorNotLowered(
                job.schedule.tensor.size,
                what,
            ));
        }
        let draft: Draft = self.times.time("build", || crate::lower::draft(job));
        let (streams, overlap) = (draft.job_streams, draft.overlap);
        let (mut program, fences) = self
            .times
            .time("prefetch", || passes::prefetch::run(draft))
            .map_err(CompileError::Lower)?;
        self.check("prefetch", &program, Stage::Ordered)?;
        self.times.time("streams", || {
            passes::streams::run(&mut program, streams, overlap)
        });
        self.check("streams", &program, Stage::Streamed)?;
        self.times
            .time("workspace", || passes::workspace::run(&mut program, job));
        self.check("workspace", &program, Stage::Provisioned)?;
        self.times
            .time("events", || passes::events::run(&mut program, &fences));
        self.check("events", &program, Stage::Synchronised)?;
        Ok(program)
    }

    /// The structural check `stage` allows, after `pass`, when [`Options::verify_each_pass`].
    fn check(
        &mut self,
        pass: &'static str,
        program: &Program,
        stage: Stage,
    ) -> Result<(), CompileError> {
        if !self.options.verify_each_pass {
            return Ok(());
        }
        self.times
            .accumulate("verify structure", || {
                verify::verify_structure(program, stage)
            })
            .map_err(|errors| CompileError::Pass {
                pass,
                program: Box::new(program.clone()),
                errors,
            })
    }
}
