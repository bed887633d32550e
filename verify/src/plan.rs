//! Plan files made runnable: read back ([`sched_ir::plan_file`]) and every proof run again, so a
//! hand-edited or foreign plan reaches a simulator or a backend only as a [`Verified`] program.

use crate::{verify, Rejected, Verified};
use sched_ir::job::Job;
use sched_ir::plan_file::{read_plan, ReadError};

/// Why a plan file's text cannot run.
#[derive(Debug, thiserror::Error)]
pub enum PlanError {
    /// Not a plan file this version reads, or malformed: what and where.
    #[error(transparent)]
    Read(#[from] ReadError),
    /// The file holds another schedule than the one asked for.
    #[error("holds schedule `{holds}`, not `{wanted}`")]
    OtherSchedule { holds: String, wanted: String },
    /// Read, but some proof fails.
    #[error(transparent)]
    Unverified(#[from] Rejected),
}

/// Whether a file's text is a plan file (JSON) rather than a `.sched` source.
pub fn is_plan_text(text: &str) -> bool {
    text.trim_start().starts_with('{')
}

/// Reads plan-file `text` and verifies its program; with `schedule`, the plan must hold that one.
pub fn read_verified(text: &str, schedule: Option<&str>) -> Result<(Verified, Job), PlanError> {
    let plan = read_plan(text)?;
    if let Some(wanted) = schedule.filter(|&w| w != plan.job.schedule.name) {
        return Err(PlanError::OtherSchedule {
            holds: plan.job.schedule.name,
            wanted: wanted.to_string(),
        });
    }
    let verified = verify(plan.program)?;
    Ok((verified, plan.job))
}
