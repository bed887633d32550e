//! `schedc plan` on 1,024 GPUs: LLaMA-7B, 13B and 30B (`schedules/plan/llama_1024.sched`, 128 nodes
//! of 8 A100s at 400 Gbps, 4 micro-steps), top 5 with knob tuning, as the command runs it.
//!
//!     cargo bench -p schedc --bench plan
//!
//! A whole search takes seconds, so this is a plain timing binary rather than a criterion
//! benchmark: each search runs `ROUNDS` times (default 3) and the median wall time is printed with
//! what the search did. It also times the same searches on one thread, to show the parallel gain.

use schedc::planner::{plan, Options};
use schedc::{analyze, FsLoader};
use std::path::Path;
use std::time::Instant;

fn main() {
    let rounds: usize = std::env::var("ROUNDS")
        .ok()
        .and_then(|r| r.parse().ok())
        .unwrap_or(3);
    let file = Path::new(env!("CARGO_MANIFEST_DIR")).join("../schedules/plan/llama_1024.sched");
    let analysis = analyze(&file, &FsLoader).expect("the benchmark's schedules are readable");
    assert!(!analysis.has_errors(), "{}", analysis.render());
    for threads in [Options::default().threads, 1] {
        for name in [
            "llama7b_1024",
            "llama13b_1024",
            "llama30b_1024",
            "llama70b_1024",
        ] {
            let base = analysis.select(Some(name)).expect("the schedule exists");
            let options = Options {
                top: 5,
                threads,
                tune_knobs: true,
            };
            let mut times = vec![];
            let mut last = None;
            for _ in 0..rounds.max(1) {
                let start = Instant::now();
                let result = plan(base, &options, &|_| {}).expect("the search succeeds");
                times.push(start.elapsed().as_secs_f64());
                last = Some(result);
            }
            times.sort_by(f64::total_cmp);
            let result = last.expect("at least one round");
            let best = &result.ranked[0].report;
            println!(
                "{name:<14} {threads} thread(s): median {:6.2} s over {} rounds (min {:.2}, max {:.2}); best {:.3} s/step, MFU {:.1}%; {:?}",
                times[times.len() / 2],
                times.len(),
                times[0],
                times[times.len() - 1],
                best.step_time_s,
                100.0 * best.mfu,
                result.stats
            );
        }
    }
}
