//! `schedc plan`: search the sharding factors and knobs for the fastest schedule that fits.
//!
//! The search extends AMSP's planner (§V-B): instead of minimising a communication formula under a
//! memory formula, every candidate that could win is compiled and simulated, so overlap, prefetch,
//! buckets and contention count, and memory is the real memory plan's arena.
//!
//! 1. **Enumerate** every structure ([`space`]: tensor-parallel degree × pipeline split × meshes
//!    × resharding × gradient sync × all-gather algorithm) with the base schedule's knobs.
//! 2. **Floor** each one analytically ([`bounds`]), in chunks on the worker threads: a memory floor
//!    (its shards, the activations of one micro-step and the compute stream's workspace) above the
//!    GPU drops it; a step-time
//!    floor orders the rest.
//! 3. **Branch and bound**: take structures in order of their time floor, a batch of a few per
//!    worker thread at a time, and **screen** each: lower it without its memory plan; if its arena
//!    floor (shards plus the most transient bytes alive at one issue position) exceeds the GPU,
//!    drop it, else simulate it. Stop when the next floor is no better than the K-th best screened
//!    time. Then compile the K best for real (memory plan and all) and simulate them again; one
//!    whose placed arena does not fit leaves the list and the search resumes with the next.
//!    Screening keeps every flow-control fence the memory plan may later drop, so a screened time
//!    is, as far as the simulator's monotony goes, no better than the compiled one.
//! 4. **Tune knobs** of each structure in the top K by coordinate descent over prefetch depths and
//!    bucket sizes ([`space::Knobs::neighbours`]) on screened times (module `tune`: the structures
//!    descend in lockstep, sharing the worker threads); the result is compiled and
//!    kept when its placed program fits and simulates faster. The list holds one schedule per
//!    structure, with its best knobs. (Knobs are tuned only for the
//!    structures that rank with the base knobs: a structure just outside the top K might overtake
//!    one inside after tuning; the search does not chase that second-order effect.)
//! 5. **Verify** the final K's programs with every proof of lowering §7 ([`sched_verify`]), one
//!    per worker thread.
//!
//! Every parallel step collects its results in input order, so the outcome does not depend on the
//! number of threads or their timing.
//!
//! The floors are lower bounds of what the simulator reports (tested), so the pruning of step 3
//! never drops a structure that would have ranked in the top K with the base knobs.

pub mod bounds;
pub mod fragment;
pub mod output;
pub mod space;
mod tune;

use crate::sim::{self, cost::CostModel, SimReport};
use crate::{pipeline, CompileError};
use sched_ir::ir::Program;
use sched_ir::job::Job;
use space::{Knobs, Structure};

/// How the search runs.
#[derive(Clone, Debug)]
pub struct Options {
    /// How many schedules to return.
    pub top: usize,
    /// Worker threads (at least 1).
    pub threads: usize,
    /// Whether to tune prefetch depths and bucket sizes of the best schedules.
    pub tune_knobs: bool,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            top: 5,
            threads: std::thread::available_parallelism().map_or(1, |n| n.get()),
            tune_knobs: true,
        }
    }
}

/// One ranked schedule.
#[derive(Clone, Debug)]
pub struct Ranked {
    pub job: Job,
    /// The simulation of its compiled, placed and verified program.
    pub report: SimReport,
    /// That program.
    pub program: Program,
}

/// What the search did, for the summary line and the tests.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SearchStats {
    /// Structures enumerated.
    pub structures: usize,
    /// Dropped because their memory floor exceeds the GPU.
    pub over_memory_floor: usize,
    /// Lowered and dropped because their arena floor exceeds the GPU.
    pub over_arena_floor: usize,
    /// Left unexamined because their time floor could not beat the K-th best.
    pub pruned_by_time_floor: usize,
    /// Programs simulated (screening, compiled finalists and knob trials).
    pub simulated: usize,
    /// Programs compiled with their memory plan.
    pub compiled: usize,
    /// Compiled programs whose placed arena did not fit.
    pub over_gpu_after_placement: usize,
    /// Candidates the lowering refused (for example a `max_live` cap too small for them).
    pub not_lowerable: usize,
}

/// The search's result: the best schedules, fastest first.
#[derive(Clone, Debug)]
pub struct PlanResult {
    pub ranked: Vec<Ranked>,
    pub stats: SearchStats,
}

/// Where the search is, for a progress bar.
#[derive(Clone, Copy, Debug)]
pub struct Progress {
    /// Structures settled (dropped, pruned or evaluated) so far, of `total`.
    pub settled: usize,
    pub total: usize,
    /// The best step time found so far.
    pub best_s: Option<f64>,
}

/// Why a search failed.
#[derive(Debug)]
pub enum PlanError {
    /// A finalist failed verification: a compiler bug, reported with the schedule.
    Verify(String, CompileError),
}

impl std::fmt::Display for PlanError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PlanError::Verify(name, e) => write!(f, "planned schedule {name}: {e}"),
        }
    }
}

impl std::error::Error for PlanError {}

/// Structures floored per work item of the worker threads.
const FLOOR_CHUNK: usize = 512;

/// A structure with its floors.
struct Floored {
    structure: Structure,
    time_floor: f64,
}

/// The outcome of screening one candidate.
enum Screened {
    NotLowerable,
    OverArena,
    Simulated(f64),
}

/// A screened candidate: its unplanned program's simulated time.
struct Candidate {
    job: Job,
    screened_s: f64,
}

/// Searches for the fastest schedules of `base`'s model on `base`'s cluster, nodes and GPUs.
pub fn plan(
    base: &Job,
    options: &Options,
    progress: &(dyn Fn(Progress) + Sync),
) -> Result<PlanResult, PlanError> {
    let top = options.top.max(1);
    let threads = options.threads.max(1);
    let gpu = base.cluster.gpu_memory;
    let knobs = Knobs::of(&base.schedule);
    let structures = space::structures(base);
    let mut stats = SearchStats {
        structures: structures.len(),
        ..SearchStats::default()
    };
    // The floors of every structure, in chunks on the worker threads (in order: the sort below
    // is stable, so ties keep enumeration order).
    let chunks: Vec<&[Structure]> = structures.chunks(FLOOR_CHUNK).collect();
    let floors = sched_ir::par::map(&chunks, threads, |chunk| {
        chunk
            .iter()
            .map(|structure| {
                let job = space::apply(base, structure, &knobs);
                (bounds::memory_floor(&job) <= gpu).then(|| {
                    // The cost model of the candidate's tensor degree (its narrower products).
                    let cost = CostModel::new(&job);
                    bounds::step_time_floor(&job, |l, k| cost.compute_seconds(l, k)).seconds()
                })
            })
            .collect::<Vec<_>>()
    });
    let mut floored = vec![];
    for (structure, floor) in structures.into_iter().zip(floors.into_iter().flatten()) {
        match floor {
            Some(time_floor) => floored.push(Floored {
                structure,
                time_floor,
            }),
            None => stats.over_memory_floor += 1,
        }
    }
    floored.sort_by(|a, b| a.time_floor.total_cmp(&b.time_floor));
    let total = stats.structures;
    // Screened candidates, fastest first; the bar is the K-th of them.
    let mut screened: Vec<Candidate> = vec![];
    let bar = |screened: &[Candidate]| {
        screened
            .get(top - 1)
            .map_or(f64::INFINITY, |c| c.screened_s)
    };
    // Compiled finalists with their screened times.
    let mut ranked: Vec<(Ranked, f64)> = vec![];
    let mut next = 0;
    loop {
        // Branch and bound over the structures not yet screened.
        while next < floored.len() && floored[next].time_floor < bar(&screened) {
            let end = (next + 4 * threads).min(floored.len());
            let limit = bar(&screened);
            let batch: Vec<Job> = floored[next..end]
                .iter()
                .take_while(|f| f.time_floor < limit)
                .map(|f| space::apply(base, &f.structure, &knobs))
                .collect();
            next += batch.len();
            let outcomes = sched_ir::par::map(&batch, threads, screen);
            for (job, outcome) in batch.into_iter().zip(outcomes) {
                if let Some(screened_s) = tally(outcome, &mut stats) {
                    let at = screened.partition_point(|c| c.screened_s <= screened_s);
                    screened.insert(at, Candidate { job, screened_s });
                }
            }
            progress(Progress {
                settled: stats.over_memory_floor + next,
                total,
                best_s: screened.first().map(|c| c.screened_s),
            });
        }
        // Compile the best screened candidates; one whose placed arena does not fit leaves the
        // list, which may lower the bar's rank and reopen the search.
        let finalists: Vec<&Candidate> = screened.iter().take(top).collect();
        let outcomes = sched_ir::par::map(&finalists, threads, |c| finalize(&c.job));
        let mut misfits = vec![];
        for (c, outcome) in finalists.into_iter().zip(outcomes) {
            match tally_final(outcome, &mut stats) {
                Some(r) => ranked.push((r, c.screened_s)),
                None => misfits.push(c.job.schedule.clone()),
            }
        }
        if misfits.is_empty() {
            break;
        }
        // Rare: compile the new top K afresh.
        screened.retain(|c| !misfits.contains(&c.job.schedule));
        ranked.clear();
    }
    stats.pruned_by_time_floor = floored.len() - next;
    progress(Progress {
        settled: total,
        total,
        best_s: screened.first().map(|c| c.screened_s),
    });
    let mut ranked: Vec<Ranked> = if options.tune_knobs {
        tune::tune_all(ranked, &mut stats, threads)
    } else {
        ranked.into_iter().map(|(r, _)| r).collect()
    };
    ranked.sort_by(|a, b| a.report.step_time_s.total_cmp(&b.report.step_time_s));
    let proofs = sched_ir::par::map(&ranked, threads, |r| {
        Some(sched_verify::errors(&r.program)).filter(|e| !e.is_empty())
    });
    if let Some((r, errors)) = ranked
        .iter()
        .zip(proofs)
        .find_map(|(r, e)| e.map(|errors| (r, errors)))
    {
        return Err(PlanError::Verify(
            r.job.schedule.name.clone(),
            CompileError::Verify(sched_verify::Rejected {
                program: Box::new(r.program.clone()),
                errors,
            }),
        ));
    }
    Ok(PlanResult { ranked, stats })
}

/// Counts a screening outcome; the screened time when there is one.
fn tally(outcome: Screened, stats: &mut SearchStats) -> Option<f64> {
    match outcome {
        Screened::NotLowerable => stats.not_lowerable += 1,
        Screened::OverArena => stats.over_arena_floor += 1,
        Screened::Simulated(t) => {
            stats.simulated += 1;
            return Some(t);
        }
    }
    None
}

/// Lowers without a memory plan, checks the arena floor, simulates.
fn screen(job: &Job) -> Screened {
    let Ok(program) = pipeline::lower_unplanned(job) else {
        return Screened::NotLowerable;
    };
    if bounds::arena_floor(&program) > job.cluster.gpu_memory {
        return Screened::OverArena;
    }
    Screened::Simulated(sim::step_time(&program, job))
}

/// The outcome of compiling one candidate with its memory plan.
enum Finalized {
    NotLowerable,
    OverGpu,
    Fits(Box<Ranked>),
}

/// Compiles with the memory plan and simulates.
fn finalize(job: &Job) -> Finalized {
    let Ok(program) = pipeline::lower(job) else {
        return Finalized::NotLowerable;
    };
    let report = sim::simulate_candidate(&program, job);
    if !report.fits {
        return Finalized::OverGpu;
    }
    Finalized::Fits(Box::new(Ranked {
        job: job.clone(),
        report,
        program,
    }))
}

/// Counts a compile outcome; the ranked schedule when it fits.
fn tally_final(outcome: Finalized, stats: &mut SearchStats) -> Option<Ranked> {
    match outcome {
        Finalized::NotLowerable => stats.not_lowerable += 1,
        Finalized::OverGpu => {
            stats.compiled += 1;
            stats.simulated += 1;
            stats.over_gpu_after_placement += 1;
        }
        Finalized::Fits(r) => {
            stats.compiled += 1;
            stats.simulated += 1;
            return Some(*r);
        }
    }
    None
}
