//! Plan files from anywhere: arbitrary bytes through the plan reader (`read_plan`) and the
//! verifier, as `schedc verify` and `schedrun PLAN` take them. Any input must yield a clear
//! refusal, a list of verification errors or a verified plan (which is then listed, summarised,
//! given its stats and written back, and must read back to the same program); never a panic, an
//! overflow or a hang. `schedc::testing::exercise_plan` is the whole target, so the workspace
//! test `tests/tests/plan_fuzz.rs` replays exactly this on the stored reproducers and on
//! deterministic mutants of the example plans.
//!
//! Seeds: `fuzz/seed.sh` compiles every schedule of the small examples into `corpus/plan`.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = schedc::testing::exercise_plan(data);
});
