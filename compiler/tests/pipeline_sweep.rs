//! A sweep over pipeline schedules: stages, chunks, built-in (zero-bubble ones included) and
//! custom orders (one with I/W), micro-batches,
//! every ZeRO preset and the other switches (recompute, stream policies, overlap, buckets,
//! prefetch, `max_live`, deferred refresh) on CPU-sized clusters of 8 and 2 x 4 ranks, and a
//! model with a tied head (replicas, the embedding group, clipping across stages). Every combination the language accepts must compile: the verifier's proofs run
//! on each, so a lowering that breaks on a rare combination (a schedule nobody wrote an example
//! for) fails here rather than in a user's hands.

use schedc::{analyze, compile, MemLoader};
use std::path::Path;

mod sweep;

use sweep::{schedules, text};

#[test]
fn every_pipeline_combination_compiles_and_verifies() {
    let blocks = schedules();
    let text = text();
    let loader = MemLoader::default().with("/sweep/s.sched", &text);
    let a = analyze(Path::new("/sweep/s.sched"), &loader).unwrap();
    assert!(!a.has_errors(), "{}", a.render());
    assert_eq!(a.jobs.len(), blocks.len());
    let mut failed = vec![];
    for job in &a.jobs {
        if let Err(e) = compile(job) {
            let detail = match &e {
                schedc::pipeline::CompileError::Verify(r) => r
                    .errors
                    .iter()
                    .take(3)
                    .map(|e| e.to_string())
                    .collect::<Vec<_>>()
                    .join("; "),
                other => other.to_string(),
            };
            let i: usize = job.schedule.name[1..].parse().unwrap();
            failed.push(format!("{}: {detail}\n{}", job.schedule.name, blocks[i]));
        }
    }
    assert!(
        failed.is_empty(),
        "{} of {} pipelines do not compile:\n{}",
        failed.len(),
        a.jobs.len(),
        failed.join("\n")
    );
}
