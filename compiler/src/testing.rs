//! Test support shared by the tests of every crate: how a test skips for want of a tool, and
//! what the plan fuzz target does to its input ([`exercise_plan`]).
//!
//! A test that cannot run on this machine (no GPU, no `ptxas`) calls
//! [`skip`] with the name of what it lacks and returns. That writes `SKIPPED <test>: <reason>` to
//! stderr (straight to the stream, past the test harness's capture, so a plain `cargo test` shows
//! it), unless `SCHED_REQUIRE`, a comma-separated list of names, has that name: then the test
//! panics instead. CI sets `SCHED_REQUIRE` to what its machine has, so a test that CI expects to
//! run fails rather than passing silently when its tool went missing.
//!
//! The names:
//! - `gpu`: a CUDA GPU with its libraries, and `schedrun` built with `--features cuda`;
//! - `no-gpu`: no usable CUDA backend (the tests of the message given without one);
//! - `ptxas`: the PTX assembler (`$PTXAS` or the `nvidia-cuda-nvcc-cu12` wheel's).
//! - `torch`: `python3` importing PyTorch and Hugging Face `transformers` (the parity of
//!   `schedrun`'s Hugging Face checkpoints with `transformers`, `runtime/tests/hf.rs`).

use std::io::Write;

/// What a plan file came to in [`exercise_plan`].
#[derive(Debug, PartialEq, Eq)]
pub enum PlanOutcome {
    /// Not UTF-8 (a plan file is JSON).
    NotText,
    /// `read_plan` refused it, saying why.
    Refused(String),
    /// Read, but the verifier found errors (how many).
    Rejected(usize),
    /// Read and verified.
    Verified,
}

/// What `schedc verify` and `schedrun PLAN` do with a plan file's bytes, and more: read it, verify
/// it, render the errors in context; a verified plan is also listed, summarised and given its
/// stats, and written back as a plan file that must read back to the same program and verify.
/// The plan fuzz target (`fuzz/fuzz_targets/plan.rs`) and the workspace's replaying test
/// (`tests/tests/plan_fuzz.rs`) both run this; whatever the bytes, it must return.
pub fn exercise_plan(data: &[u8]) -> PlanOutcome {
    use sched_ir::plan_file::{emit_plan, read_plan};
    let Ok(text) = std::str::from_utf8(data) else {
        return PlanOutcome::NotText;
    };
    let plan = match read_plan(text) {
        Ok(plan) => plan,
        Err(e) => {
            let why = e.to_string();
            assert!(!why.trim().is_empty(), "a refusal says why");
            return PlanOutcome::Refused(why);
        }
    };
    match sched_verify::verify(plan.program) {
        Err(rejected) => {
            assert!(
                !rejected.errors.is_empty(),
                "a failed verification names an error"
            );
            let _ = rejected.render(20, 3);
            PlanOutcome::Rejected(rejected.errors.len())
        }
        Ok(p) => {
            let _ = sched_ir::listing::emit_listing(&p);
            let _ = crate::emit::summary::emit_summary(&p);
            let _ = crate::emit::stats::emit_stats(&plan.job, &p);
            let again = serde_json::to_string(&emit_plan(&p, &plan.job)).expect("plans serialise");
            let back = read_plan(&again)
                .unwrap_or_else(|e| panic!("a verified plan, written again, is refused: {e}"));
            assert!(
                back.program == *p,
                "a verified plan reads back to another program"
            );
            PlanOutcome::Verified
        }
    }
}

/// The variable listing the names whose absence fails a test.
pub const REQUIRE_VAR: &str = "SCHED_REQUIRE";

/// Whether `SCHED_REQUIRE` names `what`.
pub fn required(what: &str) -> bool {
    std::env::var(REQUIRE_VAR).is_ok_and(|v| required_in(&v, what))
}

/// Whether the comma-separated `list` names `what` (blanks around names ignored).
pub fn required_in(list: &str, what: &str) -> bool {
    list.split(',').any(|w| w.trim() == what)
}

/// Says that the running test skipped because `what` is missing (`reason` says how), or panics
/// if `SCHED_REQUIRE` names `what`. The test is named by its thread (the harness names each
/// test's thread after it), else by the caller's location.
#[track_caller]
pub fn skip(what: &str, reason: &str) {
    let require = std::env::var(REQUIRE_VAR).unwrap_or_default();
    // Not `eprintln!`: the harness captures that for passing tests.
    skip_in(&require, what, reason, &mut std::io::stderr());
}

/// [`skip`] against the list `require` instead of the environment's, writing to `out`.
#[track_caller]
fn skip_in(require: &str, what: &str, reason: &str, out: &mut dyn Write) {
    let thread = std::thread::current();
    let test = match thread.name() {
        Some(name) if name != "main" => name.to_string(),
        _ => std::panic::Location::caller().to_string(),
    };
    if required_in(require, what) {
        panic!("{REQUIRE_VAR} has `{what}`, but {test} cannot run: {reason}");
    }
    let _ = writeln!(out, "SKIPPED {test}: {reason} (needs `{what}`)");
}

#[cfg(test)]
#[path = "../tests/unit/testing.rs"]
mod tests;
