//! `schedc plan`: search the sharding factors and knobs for the fastest schedule that fits.
//!
//! The search extends AMSP's planner (§V-B): instead of minimising a communication formula under a
//! memory formula, every candidate that could win is compiled and simulated, so overlap, prefetch,
//! buckets and contention count, and memory is the real memory plan's arena.
//!
//! 1. **Enumerate** every structure ([`space`]: meshes × resharding × gradient sync × all-gather
//!    algorithm) with the base schedule's knobs.
//! 2. **Floor** each one analytically ([`bounds`]): a memory floor (its shards, and the
//!    activations of one micro-step) above the GPU drops it; a step-time floor orders the rest.
//! 3. **Branch and bound**: take structures in order of their time floor, a batch per worker
//!    thread at a time; stop when the next floor is no better than the K-th best schedule found.
//!    Each taken structure is lowered without its memory plan; if its arena floor (shards plus the
//!    most transient bytes alive at one issue position) exceeds the GPU it is dropped, else it is
//!    simulated. One that would enter the top K is then compiled for real (memory plan and all)
//!    and simulated again: only a placed arena that fits the GPU and its simulated time rank it.
//! 4. **Tune knobs** of each structure in the top K by coordinate descent over prefetch depths and
//!    bucket sizes ([`space::Knobs::neighbours`]): neighbours are screened, the most promising
//!    compiled, and a change is kept when the placed program simulates faster and still fits. The
//!    list holds one schedule per structure, with its best knobs. (Knobs are tuned only for the
//!    structures that rank with the base knobs: a structure just outside the top K might overtake
//!    one inside after tuning; the search does not chase that second-order effect.)
//! 5. **Verify** the final K with every proof of lowering §7 ([`crate::compile`]).
//!
//! The floors are lower bounds of what the simulator reports (tested), so the pruning of step 3
//! never drops a structure that would have ranked in the top K with the base knobs.

pub mod bounds;
pub mod fragment;
pub mod output;
pub mod space;

use crate::job::Job;
use crate::sim::{self, cost::CostModel, SimReport};
use crate::{lower, CompileError};
use space::{Knobs, Structure};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

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

/// Searches for the fastest schedules of `base`'s model on `base`'s cluster, nodes and GPUs.
pub fn plan(
    base: &Job,
    options: &Options,
    progress: &(dyn Fn(Progress) + Sync),
) -> Result<PlanResult, PlanError> {
    let top = options.top.max(1);
    let gpu = base.cluster.gpu_memory;
    let knobs = Knobs::of(&base.schedule);
    let cost = CostModel::new(base);
    let structures = space::structures(&base.schedule);
    let mut stats = SearchStats {
        structures: structures.len(),
        ..SearchStats::default()
    };
    let mut floored = vec![];
    for structure in structures {
        let job = space::apply(base, &structure, &knobs);
        if bounds::memory_floor(&job) > gpu {
            stats.over_memory_floor += 1;
            continue;
        }
        let time_floor = bounds::step_time_floor(&job, |l, k| cost.compute_seconds(l, k)).seconds();
        floored.push(Floored {
            structure,
            time_floor,
        });
    }
    floored.sort_by(|a, b| a.time_floor.total_cmp(&b.time_floor));
    let total = stats.structures;
    let mut settled = stats.over_memory_floor;
    let mut best = Best::new(top);
    let mut next = 0;
    let threads = options.threads.max(1);
    while next < floored.len() && floored[next].time_floor < best.bar() {
        let end = (next + 2 * threads).min(floored.len());
        let batch: Vec<Job> = floored[next..end]
            .iter()
            .take_while(|f| f.time_floor < best.bar())
            .map(|f| space::apply(base, &f.structure, &knobs))
            .collect();
        next += batch.len();
        let screened = parallel_map(&batch, threads, screen);
        for (job, outcome) in batch.into_iter().zip(screened) {
            match outcome {
                Screened::NotLowerable => stats.not_lowerable += 1,
                Screened::OverArena => stats.over_arena_floor += 1,
                Screened::Simulated(t) => {
                    stats.simulated += 1;
                    if t < best.bar() {
                        if let Some(r) = finalize(job, &mut stats) {
                            best.offer(r);
                        }
                    }
                }
            }
        }
        settled = stats.over_memory_floor + next;
        progress(Progress {
            settled,
            total,
            best_s: best.best(),
        });
    }
    stats.pruned_by_time_floor = floored.len() - next;
    progress(Progress {
        settled: total.max(settled),
        total,
        best_s: best.best(),
    });
    if options.tune_knobs {
        tune(&mut best, &mut stats, threads);
    }
    let mut ranked = best.ranked;
    for r in &mut ranked {
        let (program, _) = crate::compile(&r.job)
            .map_err(|e| PlanError::Verify(r.job.schedule.name.clone(), e))?;
        r.report = sim::simulate(&program, &r.job);
    }
    Ok(PlanResult { ranked, stats })
}

/// Lowers without a memory plan, checks the arena floor, simulates.
fn screen(job: &Job) -> Screened {
    let Ok(program) = lower::lower_unplanned(job) else {
        return Screened::NotLowerable;
    };
    if bounds::arena_floor(&program) > job.cluster.gpu_memory {
        return Screened::OverArena;
    }
    Screened::Simulated(sim::simulate(&program, job).step_time_s)
}

/// Compiles with the memory plan and simulates; `None` when it does not lower or fit.
fn finalize(job: Job, stats: &mut SearchStats) -> Option<Ranked> {
    let Ok(program) = lower::lower(&job) else {
        stats.not_lowerable += 1;
        return None;
    };
    stats.compiled += 1;
    stats.simulated += 1;
    let report = sim::simulate(&program, &job);
    if !report.fits {
        stats.over_gpu_after_placement += 1;
        return None;
    }
    Some(Ranked { job, report })
}

/// Coordinate descent over the knobs of each structure in the top K: every neighbour of the current
/// knobs is screened; the fastest that beats the current compiled time is compiled, and kept when
/// its placed program fits and is still faster.
fn tune(best: &mut Best, stats: &mut SearchStats, threads: usize) {
    let seeds: Vec<Ranked> = best.ranked.clone();
    for seed in seeds {
        let structure = space::structure_of(&seed.job.schedule);
        let mut current = seed;
        loop {
            let knobs = Knobs::of(&current.job.schedule);
            let trials: Vec<Job> = knobs
                .neighbours(&structure)
                .iter()
                .map(|k| space::apply(&current.job, &structure, k))
                .collect();
            let screened = parallel_map(&trials, threads, screen);
            let mut order: Vec<(f64, Job)> = vec![];
            for (job, outcome) in trials.into_iter().zip(screened) {
                match outcome {
                    Screened::NotLowerable => stats.not_lowerable += 1,
                    Screened::OverArena => stats.over_arena_floor += 1,
                    Screened::Simulated(t) => {
                        stats.simulated += 1;
                        order.push((t, job));
                    }
                }
            }
            order.sort_by(|a, b| a.0.total_cmp(&b.0));
            let mut improved = None;
            // Screened times are close to, not exactly, the placed program's: try the best few.
            for (t, job) in order.into_iter().take(3) {
                if t >= current.report.step_time_s * (1.0 + SCREEN_SLACK) {
                    break;
                }
                if let Some(r) = finalize(job, stats) {
                    // Keep only changes that beat rounding noise.
                    if r.report.step_time_s < current.report.step_time_s * (1.0 - 1e-9) {
                        improved = Some(r);
                        break;
                    }
                }
            }
            match improved {
                Some(r) => {
                    best.offer(r.clone());
                    current = r;
                }
                None => break,
            }
        }
    }
}

/// How much slower than the current schedule a screened knob trial may look and still be compiled:
/// placing memory removes unused fences, which can only help.
const SCREEN_SLACK: f64 = 0.002;

/// The K best schedules so far, fastest first, one per structure (with its best knobs).
struct Best {
    top: usize,
    ranked: Vec<Ranked>,
}

impl Best {
    fn new(top: usize) -> Self {
        Best {
            top,
            ranked: vec![],
        }
    }

    /// A candidate must beat this to enter.
    fn bar(&self) -> f64 {
        if self.ranked.len() < self.top {
            f64::INFINITY
        } else {
            self.ranked[self.top - 1].report.step_time_s
        }
    }

    fn best(&self) -> Option<f64> {
        self.ranked.first().map(|r| r.report.step_time_s)
    }

    fn offer(&mut self, r: Ranked) {
        let structure = space::structure_of(&r.job.schedule);
        if let Some(i) = self
            .ranked
            .iter()
            .position(|x| space::structure_of(&x.job.schedule) == structure)
        {
            if self.ranked[i].report.step_time_s <= r.report.step_time_s {
                return;
            }
            self.ranked.remove(i);
        }
        let at = self
            .ranked
            .partition_point(|x| x.report.step_time_s <= r.report.step_time_s);
        self.ranked.insert(at, r);
        self.ranked.truncate(self.top);
    }
}

/// `f` over `items` on up to `threads` scoped threads, results in order.
fn parallel_map<T: Sync, R: Send>(
    items: &[T],
    threads: usize,
    f: impl Fn(&T) -> R + Sync,
) -> Vec<R> {
    if threads <= 1 || items.len() <= 1 {
        return items.iter().map(f).collect();
    }
    let next = AtomicUsize::new(0);
    let out: Mutex<Vec<Option<R>>> = Mutex::new((0..items.len()).map(|_| None).collect());
    std::thread::scope(|s| {
        for _ in 0..threads.min(items.len()) {
            s.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some(item) = items.get(i) else { break };
                let r = f(item);
                out.lock().unwrap_or_else(|e| e.into_inner())[i] = Some(r);
            });
        }
    });
    out.into_inner()
        .unwrap_or_else(|e| e.into_inner())
        .into_iter()
        .map(|r| r.expect("every item was mapped"))
        .collect()
}
