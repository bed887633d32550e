//! The one loader of "a plan file or a `.sched` file", shared by `schedc simulate` and `schedrun`.
//!
//! A file whose text starts with `{` is a plan file (JSON from `schedc compile`): it is read with
//! [`sched_verify::plan::read_verified`]: read and every proof run on it again, so a hand-edited plan cannot
//! reach a simulator or a backend unchecked. Anything else is a `.sched` file: analysed, the
//! schedule selected, and compiled (which verifies). Either way the result is a verified program
//! with its job and [`PlanInfo`]. Errors say whose fault they are ([`LoadError::is_input`]):
//! the user's input (exit 1) or the machine's or compiler's (exit 2).

use crate::pipeline::CompileError;
use crate::sema::{analyze, Analysis, FsLoader};
use sched_ir::job::Job;
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

/// Why a file did not load.
pub enum LoadError {
    /// The file cannot be read.
    Read {
        path: PathBuf,
        error: std::io::Error,
    },
    /// A `.sched` file with errors; render its diagnostics.
    Diagnostics(Box<Analysis>),
    /// Not a plan file, a schedule that does not exist or that the plan does not hold.
    Input { path: PathBuf, message: String },
    /// A plan file that fails verification.
    Unverified { path: PathBuf, rejected: Rejected },
    /// The schedule did not compile (an unmeetable `max_live` is the user's; the rest are bugs).
    Compile {
        path: PathBuf,
        schedule: String,
        error: CompileError,
    },
}

impl LoadError {
    /// The user's input is at fault (exit 1), rather than the machine or the compiler (exit 2).
    pub fn is_input(&self) -> bool {
        match self {
            LoadError::Read { .. } => false,
            LoadError::Diagnostics(_) | LoadError::Input { .. } | LoadError::Unverified { .. } => {
                true
            }
            LoadError::Compile { error, .. } => matches!(error, CompileError::Lower(_)),
        }
    }

    /// The message with verification errors shown in context: at most `errors` of them, each
    /// with `context` listing lines either side.
    pub fn render(&self, errors: usize, context: usize) -> String {
        match self {
            LoadError::Unverified {
                path,
                rejected:
                    Rejected {
                        program,
                        errors: errs,
                    },
            } => format!(
                "{} fails verification ({} errors):\n\n{}",
                path.display(),
                errs.len(),
                sched_verify::render_context(program, &errs[..errs.len().min(errors)], context)
            ),
            LoadError::Compile {
                error:
                    CompileError::Verify(Rejected {
                        program,
                        errors: errs,
                    }),
                schedule,
                ..
            } => format!(
                "the compiled program for `{schedule}` fails verification ({} errors):\n\n{}",
                errs.len(),
                sched_verify::render_context(program, &errs[..errs.len().min(errors)], context)
            ),
            other => other.to_string(),
        }
    }
}

impl std::fmt::Display for LoadError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            LoadError::Read { path, error } => write!(f, "cannot read {}: {error}", path.display()),
            LoadError::Diagnostics(a) => f.write_str(a.render().trim_end()),
            LoadError::Input { path, message } => write!(f, "{}: {message}", path.display()),
            LoadError::Unverified { path, rejected } => write!(
                f,
                "{} fails verification ({} errors)",
                path.display(),
                rejected.errors.len()
            ),
            LoadError::Compile {
                schedule,
                error: CompileError::Lower(e),
                ..
            } => write!(f, "schedule `{schedule}` cannot be lowered: {e}"),
            LoadError::Compile {
                schedule, error, ..
            } => write!(f, "schedule `{schedule}`: {error}"),
        }
    }
}

impl std::fmt::Debug for LoadError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Display::fmt(self, f)
    }
}

impl std::error::Error for LoadError {}

/// Loads `path` as a plan file or a `.sched` file, picking `schedule` when given (a plan file
/// must hold that schedule; a `.sched` file defining several needs one).
pub fn load(path: &Path, schedule: Option<&str>) -> Result<Loaded, LoadError> {
    let text = std::fs::read_to_string(path).map_err(|error| LoadError::Read {
        path: path.to_path_buf(),
        error,
    })?;
    let input = |message: String| LoadError::Input {
        path: path.to_path_buf(),
        message,
    };
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
            Err(e) => Err(input(e.to_string())),
        };
    }
    let analysis = analyze(path, &FsLoader).map_err(|e| LoadError::Read {
        path: e.path,
        error: e.error,
    })?;
    if analysis.has_errors() {
        return Err(LoadError::Diagnostics(Box::new(analysis)));
    }
    let job = analysis.select(schedule).map_err(input)?.clone();
    match crate::compile(&job) {
        Ok(program) => Ok(Loaded {
            program,
            job,
            analysis: Some(analysis),
        }),
        Err(error) => Err(LoadError::Compile {
            path: path.to_path_buf(),
            schedule: job.schedule.name.clone(),
            error,
        }),
    }
}
