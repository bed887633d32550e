//! Plan files made runnable: read back ([`sched_ir::plan_file`]) and every proof run again, so a
//! hand-edited or foreign plan reaches a simulator or a backend only as a [`Verified`] program.

use crate::{verify, Rejected, Verified};
use sched_ir::job::Job;
use sched_ir::plan_file::read_plan;

/// Why a plan file's text cannot run.
#[derive(Debug)]
pub enum PlanError {
    /// Not a plan file this version reads, or malformed: what and where, in words.
    Malformed(String),
    /// The file holds another schedule than the one asked for.
    OtherSchedule { holds: String, wanted: String },
    /// Read, but some proof fails.
    Unverified(Rejected),
}

impl std::fmt::Display for PlanError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PlanError::Malformed(m) => f.write_str(m),
            PlanError::OtherSchedule { holds, wanted } => {
                write!(f, "holds schedule `{holds}`, not `{wanted}`")
            }
            PlanError::Unverified(r) => r.fmt(f),
        }
    }
}

impl std::error::Error for PlanError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            PlanError::Unverified(r) => Some(r),
            _ => None,
        }
    }
}

/// Whether a file's text is a plan file (JSON) rather than a `.sched` source.
pub fn is_plan_text(text: &str) -> bool {
    text.trim_start().starts_with('{')
}

/// Reads plan-file `text` and verifies its program; with `schedule`, the plan must hold that one.
pub fn read_verified(text: &str, schedule: Option<&str>) -> Result<(Verified, Job), PlanError> {
    let plan = read_plan(text).map_err(PlanError::Malformed)?;
    if let Some(wanted) = schedule.filter(|&w| w != plan.job.schedule.name) {
        return Err(PlanError::OtherSchedule {
            holds: plan.job.schedule.name,
            wanted: wanted.to_string(),
        });
    }
    let verified = verify(plan.program).map_err(PlanError::Unverified)?;
    Ok((verified, plan.job))
}
