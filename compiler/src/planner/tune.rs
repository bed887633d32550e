//! Knob tuning (step 4 of [`super::plan`]): coordinate descent over each ranked structure's
//! prefetch depths and bucket sizes, on screened times.
//!
//! Each structure descends on its own: every neighbour of its current knobs
//! ([`Knobs::neighbours`]) is screened and the fastest taken while it beats the current time
//! beyond rounding noise; the result is compiled and kept when its placed program fits and
//! simulates faster than the structure's compiled start. The structures only share the machine:
//! they descend in lockstep, each round screening the neighbours of every structure still
//! descending in one parallel batch, and the final compiles run as one batch too, so no core idles
//! while one structure compiles. A structure's screened times are remembered by knobs (a step
//! along one knob makes the other values of that knob neighbours again), and its start's screened
//! time is the one the search already measured: screening is a pure function of the job, so
//! neither changes any outcome, only how often the same program is lowered.

use super::space::{self, Knobs, Structure};
use super::{finalize, screen, tally, tally_final, Ranked, SearchStats};
use sched_ir::hash::FxHashMap;
use sched_ir::job::Job;

/// One structure's descent.
struct Descent {
    start: Ranked,
    structure: Structure,
    current: Job,
    current_s: f64,
    /// Screened times by knobs (`None`: not lowerable, or over the arena floor).
    seen: FxHashMap<Knobs, Option<f64>>,
    descending: bool,
}

/// Tunes every schedule of `ranked`, each given with its screened time; returns them in the same
/// order, each replaced by its tuned schedule where that fits and is faster.
pub(super) fn tune_all(
    ranked: Vec<(Ranked, f64)>,
    stats: &mut SearchStats,
    threads: usize,
) -> Vec<Ranked> {
    let mut descents: Vec<Descent> = ranked
        .into_iter()
        .map(|(start, screened_s)| {
            let structure = space::structure_of(&start.job.schedule);
            let current = start.job.clone();
            let seen = FxHashMap::from_iter([(Knobs::of(&current.schedule), Some(screened_s))]);
            Descent {
                start,
                structure,
                current,
                current_s: screened_s,
                seen,
                descending: true,
            }
        })
        .collect();
    loop {
        // This round's trials: (descent, knobs) in neighbour order, and the jobs never screened.
        let mut trials: Vec<(usize, Knobs)> = vec![];
        let mut fresh: Vec<(usize, Knobs, Job)> = vec![];
        for (d, descent) in descents.iter().enumerate().filter(|(_, d)| d.descending) {
            for k in Knobs::of(&descent.current.schedule).neighbours(&descent.structure) {
                trials.push((d, k));
                if !descent.seen.contains_key(&k) && !fresh.iter().any(|f| f.0 == d && f.1 == k) {
                    let job = space::apply(&descent.current, &descent.structure, &k);
                    fresh.push((d, k, job));
                }
            }
        }
        if trials.is_empty() {
            break;
        }
        let outcomes = sched_ir::par::map(&fresh, threads, |(_, _, job)| screen(job));
        for ((d, k, _), outcome) in fresh.iter().zip(outcomes) {
            descents[*d].seen.insert(*k, tally(outcome, stats));
        }
        let mut best: Vec<Option<(f64, Knobs)>> = vec![None; descents.len()];
        for &(d, k) in &trials {
            if let Some(t) = descents[d].seen[&k] {
                // Keep only changes that beat rounding noise.
                if t < best[d].map_or(descents[d].current_s, |b| b.0) * (1.0 - 1e-9) {
                    best[d] = Some((t, k));
                }
            }
        }
        for (descent, best) in descents.iter_mut().zip(best) {
            if !descent.descending {
                continue;
            }
            match best {
                Some((t, k)) => {
                    descent.current = space::apply(&descent.current, &descent.structure, &k);
                    descent.current_s = t;
                }
                None => descent.descending = false,
            }
        }
    }
    let moved: Vec<Job> = descents
        .iter()
        .filter(|d| d.current.schedule != d.start.job.schedule)
        .map(|d| d.current.clone())
        .collect();
    let mut compiled = sched_ir::par::map(&moved, threads, finalize).into_iter();
    descents
        .into_iter()
        .map(|d| {
            if d.current.schedule == d.start.job.schedule {
                return d.start;
            }
            let outcome = compiled.next().expect("one compile per moved descent");
            match tally_final(outcome, stats) {
                Some(r) if r.report.step_time_s < d.start.report.step_time_s => r,
                _ => d.start,
            }
        })
        .collect()
}
