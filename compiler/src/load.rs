//! The one loader of "a plan file or a `.sched` file", shared by `schedc simulate` and `schedrun`.
//!
//! A file whose text starts with `{` is a plan file (JSON from `schedc compile`): it is read with
//! [`sched_verify::plan::read_verified`]: read and every proof run on it again, so a hand-edited plan cannot
//! reach a simulator or a backend unchecked. Anything else is a `.sched` file: analysed, the
//! schedule selected, refused if it asks for what is not lowered yet
//! ([`crate::Analysis::not_lowered`]), and compiled (which verifies). Either way the result is a verified program
//! with its job and [`PlanInfo`]. Errors say whose fault they are ([`LoadError::is_input`]):
//! the user's input (exit 1) or the machine's or compiler's (exit 2).

use crate::pipeline::CompileError;
use crate::sema::{analyze, Analysis, FsLoader, SelectError};
use sched_ir::job::{Job, PipelineSchedule};
pub use sched_verify::plan::is_plan_text;
use sched_verify::plan::{read_verified, PlanError};
use sched_verify::{Rejected, Verified};
use std::path::{Path, PathBuf};

/// A verified program and the job it runs.
pub struct Loaded {
    pub program: Verified,
    pub job: Job,
    /// The analysis of a `.sched` file (its warnings are the caller's to show); none for a plan.
    pub analysis: Option<Analysis>,
}

/// Why a file did not load. Each message is complete on its own (it names the file and
/// includes its cause's words); the cause is also the error's `source`.
#[derive(thiserror::Error)]
pub enum LoadError {
    /// The file cannot be read.
    #[error("cannot read {}: {error}", path.display())]
    Read {
        path: PathBuf,
        #[source]
        error: std::io::Error,
    },
    /// A `.sched` file with errors; render its diagnostics.
    #[error("{}", .0.render().trim_end())]
    Diagnostics(Box<Analysis>),
    /// A `.sched` file without the schedule asked for (or without a single one).
    #[error("{}: {error}", path.display())]
    Select {
        path: PathBuf,
        #[source]
        error: SelectError,
    },
    /// Not a plan file this version reads, or not the schedule asked for.
    #[error("{}: {error}", path.display())]
    Plan {
        path: PathBuf,
        #[source]
        error: PlanError,
    },
    /// A plan file that fails verification.
    #[error("{} fails verification ({} errors)", path.display(), rejected.errors.len())]
    Unverified {
        path: PathBuf,
        #[source]
        rejected: Rejected,
    },
    /// The schedule did not compile (an unmeetable `max_live` is the user's, and so are tensor
    /// parallelism, not lowered yet, and a custom pipeline order the verifier refuses; the rest
    /// are bugs).
    #[error("{}", compile_message(schedule, error))]
    Compile {
        path: PathBuf,
        schedule: String,
        /// The schedule's pipeline runs the user's own order (`schedule = custom`), lowered as
        /// written: a refused program is that order's fault.
        custom_order: bool,
        #[source]
        error: CompileError,
    },
}

/// What a refused compiled program says: a custom pipeline order that cannot run is the user's;
/// any other refused program is the compiler's fault.
pub fn refused(schedule: &str, custom_order: bool) -> String {
    if custom_order {
        format!("the custom pipeline order of `{schedule}` cannot run: the program it lowers to is refused")
    } else {
        format!("the compiled program for `{schedule}` fails verification")
    }
}

fn compile_message(schedule: &str, error: &CompileError) -> String {
    match error {
        CompileError::Lower(e) => format!("schedule `{schedule}` cannot be lowered: {e}"),
        e => format!("schedule `{schedule}`: {e}"),
    }
}

impl LoadError {
    /// The user's input is at fault (exit 1), rather than the machine or the compiler (exit 2).
    pub fn is_input(&self) -> bool {
        match self {
            LoadError::Read { .. } => false,
            LoadError::Diagnostics(_)
            | LoadError::Select { .. }
            | LoadError::Plan { .. }
            | LoadError::Unverified { .. } => true,
            LoadError::Compile {
                error,
                custom_order,
                ..
            } => {
                matches!(
                    error,
                    CompileError::Lower(_) | CompileError::TensorNotLowered(..)
                ) || (*custom_order && matches!(error, CompileError::Verify(_)))
            }
        }
    }

    /// The message with verification errors shown in context: at most `errors` of them, each
    /// with `context` listing lines either side.
    pub fn render(&self, errors: usize, context: usize) -> String {
        match self {
            LoadError::Unverified { path, rejected } => format!(
                "{} fails verification ({} errors):\n\n{}",
                path.display(),
                rejected.errors.len(),
                rejected.render(errors, context)
            ),
            LoadError::Compile {
                error: CompileError::Verify(rejected),
                schedule,
                custom_order,
                ..
            } => format!(
                "{} ({} errors):\n\n{}",
                refused(schedule, *custom_order),
                rejected.errors.len(),
                rejected.render(errors, context)
            ),
            other => other.to_string(),
        }
    }
}

impl std::fmt::Debug for LoadError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Display::fmt(self, f)
    }
}

/// Loads `path` as a plan file or a `.sched` file, picking `schedule` when given (a plan file
/// must hold that schedule; a `.sched` file defining several needs one).
pub fn load(path: &Path, schedule: Option<&str>) -> Result<Loaded, LoadError> {
    let text = std::fs::read_to_string(path).map_err(|error| LoadError::Read {
        path: path.to_path_buf(),
        error,
    })?;
    if is_plan_text(&text) {
        return match read_verified(&text, schedule) {
            Ok((program, job)) => Ok(Loaded {
                program,
                job,
                analysis: None,
            }),
            Err(PlanError::Unverified(rejected)) => Err(LoadError::Unverified {
                path: path.to_path_buf(),
                rejected,
            }),
            Err(error) => Err(LoadError::Plan {
                path: path.to_path_buf(),
                error,
            }),
        };
    }
    let mut analysis = analyze(path, &FsLoader).map_err(|e| LoadError::Read {
        path: e.path,
        error: e.error,
    })?;
    if analysis.has_errors() {
        return Err(LoadError::Diagnostics(Box::new(analysis)));
    }
    let job = analysis
        .select(schedule)
        .map_err(|error| LoadError::Select {
            path: path.to_path_buf(),
            error,
        })?
        .clone();
    // A schedule that checks but asks for what is not lowered yet: its error, with the rest.
    if let Some(d) = analysis.not_lowered(&job).cloned() {
        analysis.diagnostics.push(d);
        return Err(LoadError::Diagnostics(Box::new(analysis)));
    }
    match crate::compile(&job) {
        Ok(program) => Ok(Loaded {
            program,
            job,
            analysis: Some(analysis),
        }),
        Err(error) => Err(LoadError::Compile {
            path: path.to_path_buf(),
            schedule: job.schedule.name.clone(),
            custom_order: job.schedule.pipeline.schedule == PipelineSchedule::Custom,
            error,
        }),
    }
}
