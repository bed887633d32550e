//! Synchronisation of the CPU backend: events, collective rendezvous, and the abort flag that
//! turns one rank's failure into every rank stopping with its name.
//!
//! Every blocking wait polls the abort flag and gives up after the run's timeout, so a rank that
//! fails or stops answering never leaves the others hanging.

use crate::backend::RunError;
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

const POLL: Duration = Duration::from_millis(20);

/// The first failure of a step; once set, every wait returns.
#[derive(Default)]
pub struct Abort {
    first: Mutex<Option<RunError>>,
}

impl Abort {
    pub fn set(&self, e: RunError) {
        let mut f = self.first.lock().expect("abort lock");
        if f.is_none() {
            *f = Some(e);
        }
    }

    pub fn is_set(&self) -> bool {
        self.first.lock().expect("abort lock").is_some()
    }

    pub fn take(&self) -> Option<RunError> {
        self.first.lock().expect("abort lock").take()
    }
}

/// Why a wait ended without its condition.
pub enum Stop {
    /// Another rank failed first.
    Aborted,
    /// The condition did not hold within the timeout.
    TimedOut,
}

/// Blocks on `cv` until `ready(state)`, the abort flag, or the timeout.
fn wait_until<'a, T>(
    m: &'a Mutex<T>,
    cv: &Condvar,
    abort: &Abort,
    timeout: Duration,
    mut ready: impl FnMut(&T) -> bool,
) -> Result<std::sync::MutexGuard<'a, T>, Stop> {
    let start = Instant::now();
    let mut g = m.lock().expect("sync lock");
    loop {
        if ready(&g) {
            return Ok(g);
        }
        if abort.is_set() {
            return Err(Stop::Aborted);
        }
        if start.elapsed() > timeout {
            return Err(Stop::TimedOut);
        }
        g = cv.wait_timeout(g, POLL).expect("sync lock").0;
    }
}

/// One rank's events: the step each was last recorded in.
pub struct Events {
    recorded: Mutex<Vec<u64>>,
    cv: Condvar,
}

impl Events {
    pub fn new(n: usize) -> Self {
        Events {
            recorded: Mutex::new(vec![0; n]),
            cv: Condvar::new(),
        }
    }

    pub fn record(&self, event: usize, step: u64) {
        self.recorded.lock().expect("events lock")[event] = step;
        self.cv.notify_all();
    }

    /// Blocks until `event` has been recorded in `step`.
    pub fn wait(
        &self,
        event: usize,
        step: u64,
        abort: &Abort,
        timeout: Duration,
    ) -> Result<(), Stop> {
        wait_until(&self.recorded, &self.cv, abort, timeout, |r| {
            r[event] >= step
        })
        .map(|_| ())
    }
}

struct Meeting {
    /// Calls of this group completed so far in the step.
    completed: u64,
    arrived: Vec<bool>,
    /// Each arrived member's (input, output) arena offsets: members on different pipeline
    /// stages meet with regions of their own buffers.
    places: Vec<(u64, u64)>,
}

/// Where the members of one communicator group meet for each collective, in call order.
pub struct Rendezvous {
    state: Mutex<Meeting>,
    cv: Condvar,
}

impl Rendezvous {
    pub fn new(members: usize) -> Self {
        Rendezvous {
            state: Mutex::new(Meeting {
                completed: 0,
                arrived: vec![false; members],
                places: vec![(0, 0); members],
            }),
            cv: Condvar::new(),
        }
    }

    /// Member `pos` arrives at call `call` with its input and output offsets (`place`); the
    /// last to arrive runs `complete` with every member's (moving every member's data) while the
    /// others wait, and all return once it is done. On a stop, the positions that have not
    /// arrived are returned.
    pub fn meet(
        &self,
        (pos, place): (usize, (u64, u64)),
        call: u64,
        abort: &Abort,
        timeout: Duration,
        complete: impl FnOnce(&[(u64, u64)]) -> Result<(), RunError>,
    ) -> Result<Result<(), RunError>, (Stop, Vec<usize>)> {
        let missing = |m: &Meeting| -> Vec<usize> {
            (0..m.arrived.len()).filter(|&i| !m.arrived[i]).collect()
        };
        // Wait for the previous call of the group to finish.
        let mut g = match wait_until(&self.state, &self.cv, abort, timeout, |m| {
            m.completed == call
        }) {
            Ok(g) => g,
            Err(stop) => {
                let g = self.state.lock().expect("rendezvous lock");
                return Err((stop, missing(&g)));
            }
        };
        g.arrived[pos] = true;
        g.places[pos] = place;
        if g.arrived.iter().all(|a| *a) {
            let r = complete(&g.places);
            g.arrived.iter_mut().for_each(|a| *a = false);
            g.completed += 1;
            drop(g);
            self.cv.notify_all();
            return Ok(r);
        }
        drop(g);
        match wait_until(&self.state, &self.cv, abort, timeout, |m| {
            m.completed > call
        }) {
            Ok(_) => Ok(Ok(())),
            Err(stop) => {
                let g = self.state.lock().expect("rendezvous lock");
                Err((stop, missing(&g)))
            }
        }
    }
}

/// The machine's cores, lent to one compute op at a time. A step runs more ranks than the
/// machine has cores; letting the operating system time-slice their products evicts each one's
/// operands from cache at every switch, while holding a core for a whole op keeps them warm.
/// Only compute ops take a core, and they never wait on anything while holding it, so the
/// semaphore adds no dependency between streams.
pub struct Cores {
    free: Mutex<usize>,
    cv: Condvar,
}

/// A core held until dropped.
pub struct Core<'a>(&'a Cores);

impl Cores {
    pub fn new(n: usize) -> Self {
        Cores {
            free: Mutex::new(n.max(1)),
            cv: Condvar::new(),
        }
    }

    /// Blocks until a core is free and takes it.
    pub fn take(&self) -> Core<'_> {
        let mut free = self.free.lock().expect("cores lock");
        while *free == 0 {
            free = self.cv.wait(free).expect("cores lock");
        }
        *free -= 1;
        Core(self)
    }
}

impl Drop for Core<'_> {
    fn drop(&mut self) {
        *self.0.free.lock().expect("cores lock") += 1;
        self.0.cv.notify_one();
    }
}

/// Point-to-point messages of one step: a send leaves its bytes under (communicator, group,
/// call) and goes on (an eager send); the matching receive, the same call number on the
/// receiving side, takes them, waiting until they are there. The verifier proves the plan free of
/// deadlock even with blocking sends, so the eager ones can only finish sooner.
#[derive(Default)]
pub struct Mailbox {
    letters: Mutex<sched_ir::hash::FxHashMap<(u32, usize, u64), Vec<u16>>>,
    cv: Condvar,
}

impl Mailbox {
    pub fn post(&self, key: (u32, usize, u64), bytes: Vec<u16>) {
        self.letters
            .lock()
            .expect("mailbox lock")
            .insert(key, bytes);
        self.cv.notify_all();
    }

    /// The bytes sent under `key`, once they are there.
    pub fn take(
        &self,
        key: (u32, usize, u64),
        abort: &Abort,
        timeout: Duration,
    ) -> Result<Vec<u16>, Stop> {
        let mut g = wait_until(&self.letters, &self.cv, abort, timeout, |l| {
            l.contains_key(&key)
        })?;
        Ok(g.remove(&key).expect("ready means present"))
    }
}
