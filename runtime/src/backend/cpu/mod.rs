//! The CPU backend: every rank in this process, each (rank, stream) on its own thread.
//!
//! A step starts one thread per stream of every rank. Each thread executes its stream's ops in
//! issue order: it waits for the op's events (blocking until another thread records them), runs
//! the op, and records its event. Collectives meet in a [`sync::Rendezvous`] per communicator
//! group; the last member to arrive moves every member's bytes while the others wait, so a
//! collective completes on all members at once. Nothing else orders anything — a plan missing a
//! wait really races, and the stress mode's random delays (`RunOptions::jitter`) make that show.
//!
//! One rank's failure (or a wait longer than the timeout) sets the abort flag; every other
//! thread's next wait returns, and the step fails with the first error, which names its rank and
//! op.

mod collectives;
mod sync;

use super::{
    Backend, OpSpan, RankMemory, RunError, RunOptions, StepInput, StepOutcome, StreamWait,
};
use crate::arena::Arena;
use crate::device::action::{run_action, Rank};
use crate::device::host::Host;
use crate::exec::Action;
use crate::plan::Plan;
use sched_ir::ir::StreamId;
use sched_ir::job::Dtype;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use sync::{Abort, Cores, Events, Mailbox, Rendezvous, Stop};

/// All ranks of a plan in one process.
pub struct CpuBackend {
    plan: Arc<Plan>,
    arenas: Vec<Arena>,
    options: RunOptions,
    /// Scratch vectors of each (rank, stream) thread, kept from step to step.
    pools: Vec<Mutex<Vec<Vec<f32>>>>,
    /// Collective staging of each (rank, stream) thread, kept from step to step.
    staging: Vec<Mutex<collectives::Staging>>,
    /// One per core of the machine: a compute op holds one while it runs.
    cores: Cores,
}

impl CpuBackend {
    /// Allocates every rank's arena: exactly the plan's `arena_bytes` each.
    pub fn new(plan: Arc<Plan>, options: RunOptions) -> Self {
        let arenas: Vec<Arena> = (0..plan.ranks())
            .map(|_| Arena::new(plan.program.arena_bytes))
            .collect();
        // Plain copies, except in the stress mode, whose point is to let a racing plan show
        // (as wrong numbers through the atomic words, never undefined behaviour).
        for a in &arenas {
            a.set_bulk(options.jitter.is_none());
        }
        let pools = (0..plan.ranks() as usize * plan.program.streams.len())
            .map(|_| Mutex::new(vec![]))
            .collect();
        let staging = (0..plan.ranks() as usize * plan.program.streams.len())
            .map(|_| Mutex::default())
            .collect();
        CpuBackend {
            plan,
            arenas,
            options,
            pools,
            staging,
            cores: Cores::new(std::thread::available_parallelism().map_or(1, |n| n.get())),
        }
    }
}

/// What the threads of one step share.
struct StepShared<'a> {
    plan: &'a Plan,
    arenas: &'a [Arena],
    events: Vec<Events>,
    /// `[communicator][group]`.
    meetings: Vec<Vec<Rendezvous>>,
    /// Pipeline sends waiting for their receives.
    mailbox: Mailbox,
    abort: Abort,
    options: &'a RunOptions,
    input: &'a StepInput,
    pools: &'a [Mutex<Vec<Vec<f32>>>],
    /// Each (rank, stream)'s staging for the collectives it completes.
    staging: &'a [Mutex<collectives::Staging>],
    cores: &'a Cores,
    /// When the step began: op spans are measured from it.
    began: Instant,
}

/// One rank's view while it runs an op: its compute ops run on `device`.
pub struct RankCtx<'a> {
    pub rank: u32,
    pub device: Host<'a>,
}

/// Why a stream stopped at an op: the step was aborted elsewhere (the first failure is already
/// recorded), or this op failed.
pub enum Stopped {
    Aborted,
    Failed(Box<dyn std::error::Error + Send + Sync>),
}

struct ThreadResult {
    loss: f64,
    /// The sums of squares of this stream's `grad_norm` ops (`StepOutcome::grad_sumsq`).
    sumsq: Option<f64>,
    wait: StreamWait,
    spans: Vec<OpSpan>,
}

impl Backend for CpuBackend {
    fn name(&self) -> &'static str {
        "cpu"
    }

    fn ranks(&self) -> Vec<u32> {
        (0..self.plan.ranks()).collect()
    }

    fn upload(&self, rank: u32, offset: u64, dtype: Dtype, values: &[f32]) -> Result<(), RunError> {
        self.arenas[rank as usize]
            .write(offset, dtype, values)
            .map_err(|e| RunError::at(rank, None, e))
    }

    fn download(
        &self,
        rank: u32,
        offset: u64,
        n: usize,
        dtype: Dtype,
    ) -> Result<Vec<f32>, RunError> {
        self.arenas[rank as usize]
            .read(offset, n, dtype)
            .map_err(|e| RunError::at(rank, None, e))
    }

    fn run_step(&mut self, input: &StepInput) -> Result<StepOutcome, RunError> {
        let p = &*self.plan;
        let shared = StepShared {
            plan: p,
            arenas: &self.arenas,
            events: (0..p.ranks())
                .map(|_| Events::new(p.program.events.len()))
                .collect(),
            meetings: p
                .program
                .comms
                .values()
                .map(|c| c.groups.iter().map(|g| Rendezvous::new(g.len())).collect())
                .collect(),
            mailbox: Mailbox::default(),
            abort: Abort::default(),
            options: &self.options,
            input,
            pools: &self.pools,
            staging: &self.staging,
            cores: &self.cores,
            began: Instant::now(),
        };
        let results: Vec<Option<ThreadResult>> = std::thread::scope(|s| {
            // A rank runs the streams of its pipeline stage.
            let layout = p.program.layout;
            let handles: Vec<_> = (0..p.ranks())
                .flat_map(|rank| (0..p.program.streams.len()).map(move |stream| (rank, stream)))
                .filter(|&(rank, stream)| {
                    p.program.streams[StreamId::new(stream)].stage == layout.stage(rank)
                })
                .map(|(rank, stream)| {
                    let shared = &shared;
                    std::thread::Builder::new()
                        .name(format!(
                            "rank{rank}-{}",
                            p.stream_name(StreamId::new(stream))
                        ))
                        .spawn_scoped(s, move || run_stream(shared, rank, stream))
                        .expect("spawn a stream thread")
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().unwrap_or(None))
                .collect()
        });
        if let Some(e) = shared.abort.take() {
            return Err(e);
        }
        if results.iter().any(|r| r.is_none()) {
            return Err(RunError::of_run("a stream thread panicked"));
        }
        let results: Vec<ThreadResult> = results.into_iter().flatten().collect();
        let mut spans = vec![];
        let mut waits = vec![];
        let mut loss_sum = 0.0;
        let mut grad_sumsq = None;
        let layout = self.plan.program.layout;
        for r in results {
            // A tensor group's ranks compute the same loss: count it once.
            if layout.tp_index(r.wait.rank) == 0 {
                loss_sum += r.loss;
            }
            if let Some(s) = r.sumsq {
                grad_sumsq = Some(grad_sumsq.unwrap_or(0.0) + s);
            }
            waits.push(r.wait);
            spans.extend(r.spans);
        }
        Ok(StepOutcome {
            loss_sum,
            grad_sumsq: grad_sumsq.filter(|_| p.clips()),
            waits,
            spans,
            enqueue: None,
        })
    }

    fn memory(&self) -> Vec<RankMemory> {
        self.arenas
            .iter()
            .enumerate()
            .map(|(r, a)| RankMemory {
                rank: r as u32,
                allocated: a.bytes(),
                touched: a.high_water(),
            })
            .collect()
    }
}

use cranelift_entity::EntityRef;

/// Runs one stream of one rank through the step; `None` when the step was aborted.
fn run_stream(sh: &StepShared<'_>, rank: u32, stream: usize) -> Option<ThreadResult> {
    let p = sh.plan;
    let pool = &sh.pools[rank as usize * p.program.streams.len() + stream];
    let ctx = RankCtx {
        rank,
        device: Host::new(
            &sh.arenas[rank as usize],
            &sh.input.batches[rank as usize],
            std::mem::take(&mut *pool.lock().expect("pool lock")),
        ),
    };
    let result = run_ops(sh, &ctx, stream);
    *pool.lock().expect("pool lock") = ctx.device.into_pool();
    result
}

fn run_ops(sh: &StepShared<'_>, ctx: &RankCtx<'_>, stream: usize) -> Option<ThreadResult> {
    let (p, rank) = (sh.plan, ctx.rank);
    let mut jitter = Jitter::new(sh.options, rank, stream as u64, sh.input.step);
    let (mut loss, mut waiting) = (0.0, Duration::ZERO);
    let mut sumsq: Option<f64> = None;
    let mut spans = vec![];
    let started = Instant::now();
    for &op in &p.stream_ops[StreamId::new(stream)] {
        if sh.abort.is_set() {
            return None;
        }
        jitter.sleep();
        let o = &p.program.ops[op];
        let fail = |cause: Box<dyn std::error::Error + Send + Sync>| {
            sh.abort
                .set(RunError::at(rank, Some(p.describe(op)), cause));
        };
        let t = Instant::now();
        for e in &o.wait {
            // Twice the collectives' timeout: when a rank stops answering, the collective
            // waiting for it times out first and names it.
            let limit = 2 * sh.options.timeout;
            match sh.events[rank as usize].wait(e.index(), sh.input.step, &sh.abort, limit) {
                Ok(()) => {}
                Err(Stop::Aborted) => return None,
                Err(Stop::TimedOut) => {
                    fail(
                        format!(
                            "waited {limit:?} for {e}, which {} never recorded",
                            p.describe(p.program.events[*e].recorder)
                        )
                        .into(),
                    );
                    return None;
                }
            }
        }
        waiting += t.elapsed();
        if let Some(f) = sh.options.fault.filter(|f| f.rank == rank && f.op == op) {
            if f.hang {
                // Stop answering: the others must notice through their timeouts.
                while !sh.abort.is_set() {
                    std::thread::sleep(Duration::from_millis(10));
                }
            } else {
                fail("injected fault".into());
            }
            return None;
        }
        // The op's span: timed where it holds what it runs on (a compute op's core is released
        // when the arm ends, and the thread may wait to be scheduled again after that).
        let begun = Instant::now();
        let (result, start, end) = match &p.actions[op.index()] {
            Action::Collectives(cs) => {
                let r = collectives::run(sh, ctx, op, cs);
                waiting += begun.elapsed();
                (r.map(|()| (0.0, None)), begun, Instant::now())
            }
            a => {
                let _core = sh.cores.take();
                let start = Instant::now();
                let r = Rank {
                    plan: p,
                    rank,
                    device: &ctx.device,
                };
                let r = run_action(&r, a, o.micro_step, sh.input)
                    .map(|()| (ctx.device.take_loss(), ctx.device.take_sumsq()))
                    .map_err(|e| Stopped::Failed(e.into()));
                (r, start, Instant::now())
            }
        };
        match result {
            Ok((l, s)) => {
                loss += l;
                if let Some(s) = s {
                    sumsq = Some(sumsq.unwrap_or(0.0) + s);
                }
            }
            Err(Stopped::Failed(e)) => {
                fail(e);
                return None;
            }
            Err(Stopped::Aborted) => return None,
        }
        if sh.options.time_ops {
            spans.push(OpSpan {
                rank,
                op,
                start: start.duration_since(sh.began),
                end: end.duration_since(sh.began),
            });
        }
        if let Some(e) = o.record {
            sh.events[rank as usize].record(e.index(), sh.input.step);
        }
    }
    Some(ThreadResult {
        loss,
        sumsq,
        wait: StreamWait {
            rank,
            stream: p.stream_name(StreamId::new(stream)),
            waiting,
            busy: started.elapsed().saturating_sub(waiting),
        },
        spans,
    })
}

/// The stress mode's random delays: a small xorshift generator per (rank, stream, step).
struct Jitter {
    max: Option<Duration>,
    state: u64,
}

impl Jitter {
    fn new(o: &RunOptions, rank: u32, stream: u64, step: u64) -> Self {
        let mut state = o.jitter_seed ^ 0x9E37_79B9_7F4A_7C15;
        for x in [u64::from(rank), stream, step] {
            state = (state ^ x)
                .wrapping_mul(0xBF58_476D_1CE4_E5B9)
                .rotate_left(31);
        }
        Jitter {
            max: o.jitter,
            state: state | 1,
        }
    }

    fn sleep(&mut self) {
        let Some(max) = self.max else { return };
        self.state ^= self.state << 13;
        self.state ^= self.state >> 7;
        self.state ^= self.state << 17;
        let nanos = max.as_nanos() as u64;
        if nanos > 0 {
            std::thread::sleep(Duration::from_nanos(self.state % nanos));
        }
    }
}
