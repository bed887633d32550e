//! The plan fuzz target (`fuzz/fuzz_targets/plan.rs`) as a plain test: arbitrary bytes through
//! `read_plan` and the verifier must give a clear refusal, verification errors or a verified plan,
//! never a panic or a hang. It runs `schedc::testing::exercise_plan`, which is the whole target, on
//!
//! - the seeds: every schedule of the small examples (`tiny_cpu.sched`, `tiny_cpu_schedules.sched`,
//!   `gpt2_ddp.sched`), compiled and written as plan files, each of which must verify;
//! - the stored reproducers under `tests/inputs/fuzz_plan/` (inputs that once panicked, kept so
//!   they never do again);
//! - [`MUTANTS`] deterministic mutants of the seeds (`SCHED_PLAN_MUTANTS` overrides the count),
//!   half of them byte-level (flips, insertions, deletions, duplications, truncations) and half
//!   JSON-aware (one to three values anywhere in the tree replaced by edge cases: 0, 1, −1,
//!   2³², u64::MAX, another id, the empty string, another enum name, null; array elements dropped,
//!   duplicated or swapped; object keys dropped), which reach the verifier far more often than bytes do.
//!
//! A failing case is written to the temporary directory, with the command to add it to the
//! reproducers; `cargo fuzz run plan` (see `fuzz/`) searches further with coverage guidance.

use schedc::testing::{exercise_plan, PlanOutcome};
use schedc::{analyze, FsLoader};
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

/// Mutants run by default: a few seconds here.
const MUTANTS: usize = 4_000;
/// The longest any one case may take before it counts as a hang.
const CASE_LIMIT: Duration = Duration::from_secs(20);

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

/// The compiled plan of every schedule of the small examples, as (name, JSON).
fn seeds() -> Vec<(String, String)> {
    let mut out = vec![];
    for file in [
        "tiny_cpu.sched",
        "tiny_cpu_schedules.sched",
        "gpt2_ddp.sched",
    ] {
        let a = analyze(&repo().join("schedules").join(file), &FsLoader).unwrap();
        assert!(!a.has_errors(), "{file}:\n{}", a.render());
        for job in &a.jobs {
            let program = schedc::compile(job)
                .unwrap_or_else(|e| panic!("{file} `{}`: {e}", job.schedule.name));
            let plan = sched_ir::plan_file::emit_plan(&program, job);
            out.push((
                format!("{file}:{}", job.schedule.name),
                serde_json::to_string(&plan).unwrap(),
            ));
        }
    }
    out
}

fn reproducers() -> Vec<(String, Vec<u8>)> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("inputs/fuzz_plan");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .map(|d| {
            d.map(|e| e.unwrap().path())
                .filter(|p| p.is_file())
                .collect()
        })
        .unwrap_or_default();
    files.sort();
    files
        .into_iter()
        .map(|p| {
            (
                p.file_name().unwrap().to_string_lossy().into_owned(),
                std::fs::read(&p).unwrap(),
            )
        })
        .collect()
}

/// splitmix64: a small deterministic generator, so every run tries the same mutants.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (n > 0).
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

/// Byte-level: one to four edits anywhere.
fn mutate_bytes(rng: &mut Rng, seed: &[u8]) -> Vec<u8> {
    let mut b = seed.to_vec();
    for _ in 0..1 + rng.below(4) {
        if b.is_empty() {
            b.push(b'{');
        }
        let at = rng.below(b.len());
        match rng.below(6) {
            0 => b[at] ^= 1 << rng.below(7),
            1 => b[at] = b"0123456789-.,:[]{}\"e "[rng.below(20)],
            2 => {
                let n = 1 + rng.below(16.min(b.len() - at));
                b.drain(at..at + n);
            }
            3 => {
                let n = 1 + rng.below(64.min(b.len() - at));
                let chunk: Vec<u8> = b[at..at + n].to_vec();
                let to = rng.below(b.len());
                b.splice(to..to, chunk);
            }
            4 => b.truncate(at),
            _ => {
                let to = rng.below(b.len());
                b.insert(to, rng.next() as u8);
            }
        }
    }
    b
}

/// Every value in the tree, by path (array index or object key at each step).
fn paths(v: &Value, here: &mut Vec<Step>, out: &mut Vec<Vec<Step>>) {
    out.push(here.clone());
    match v {
        Value::Array(a) => {
            for (i, x) in a.iter().enumerate() {
                here.push(Step::Index(i));
                paths(x, here, out);
                here.pop();
            }
        }
        Value::Object(o) => {
            for (k, x) in o {
                here.push(Step::Key(k.clone()));
                paths(x, here, out);
                here.pop();
            }
        }
        _ => {}
    }
}

#[derive(Clone)]
enum Step {
    Index(usize),
    Key(String),
}

fn at<'a>(v: &'a mut Value, path: &[Step]) -> &'a mut Value {
    path.iter().fold(v, |v, s| match s {
        Step::Index(i) => &mut v[*i],
        Step::Key(k) => &mut v[k.as_str()],
    })
}

/// Values that break arithmetic and lookups: zero, one, off-by-one ids, overflow edges.
fn edge_number(rng: &mut Rng, old: Option<u64>) -> Value {
    let old = old.unwrap_or(1);
    // Mostly values near the old one, which the reader accepts and the verifier must judge.
    let n: i128 = match rng.below(16) {
        0 => 0,
        1 => 1,
        2 => -1,
        3 | 4 => i128::from(old) + 1,
        5 | 6 => i128::from(old).max(1) - 1,
        7 => i128::from(old) * 2,
        8 => i128::from(old) / 2,
        9 => i128::from(rng.next() % 64),
        10 => i128::from(rng.next() % (old.saturating_add(1))),
        11 => i128::from(u32::MAX),
        12 => i128::from(u32::MAX) + 1,
        13 => i128::from(u64::MAX),
        14 => i128::from(old) << 20,
        _ => i128::from(rng.next()),
    };
    if n < 0 {
        Value::from(n as i64)
    } else {
        u64::try_from(n).map_or(Value::from(u64::MAX), Value::from)
    }
}

const WORDS: [&str; 24] = [
    "",
    "x",
    "bf16",
    "fp16",
    "fp32",
    "param",
    "grad",
    "optimizer",
    "secondary",
    "param_local",
    "all_gather",
    "reduce_scatter",
    "all_reduce",
    "broadcast",
    "group",
    "forward",
    "backward",
    "update",
    "grad_norm",
    "compute",
    "intra",
    "inter",
    "mixed",
    "gathered",
];

/// JSON-aware: one to three values of the tree replaced, dropped, duplicated or swapped.
fn mutate_json(rng: &mut Rng, seed: &Value) -> Vec<u8> {
    let mut v = seed.clone();
    for _ in 0..1 + rng.below(3) {
        let mut all = vec![];
        paths(&v, &mut vec![], &mut all);
        // Mostly the program (ops, buffers, communicators, sizes), less often the job it carries.
        let program: Vec<&Vec<Step>> = all
            .iter()
            .filter(|p| !matches!(p.first(), Some(Step::Key(k)) if k == "job"))
            .collect();
        let path = if rng.below(8) > 0 {
            program[rng.below(program.len())].clone()
        } else {
            all[rng.below(all.len())].clone()
        };
        let mut node = at(&mut v, &path);
        // An object stands for its fields: mostly mutate one of them, now and then drop one.
        while let Value::Object(o) = node {
            if o.is_empty() || rng.below(8) == 0 {
                break;
            }
            let k = o.keys().nth(rng.below(o.len())).unwrap().clone();
            node = &mut node[k.as_str()];
        }
        match node {
            Value::Number(n) => *node = edge_number(rng, n.as_u64()),
            Value::String(_) => *node = Value::from(WORDS[rng.below(WORDS.len())]),
            Value::Null if rng.below(2) == 0 => {
                *node = Value::from(WORDS[5 + rng.below(4)]) // a shard index: param, grad, …
            }
            Value::Bool(b) => *b = !*b,
            Value::Null => *node = edge_number(rng, None),
            Value::Array(a) if !a.is_empty() => {
                let i = rng.below(a.len());
                match rng.below(4) {
                    0 => {
                        a.remove(i);
                    }
                    1 => {
                        let x = a[i].clone();
                        a.insert(rng.below(a.len() + 1), x);
                    }
                    2 => {
                        let j = rng.below(a.len());
                        a.swap(i, j);
                    }
                    _ => a.clear(),
                }
            }
            Value::Object(o) if !o.is_empty() => {
                let k = o.keys().nth(rng.below(o.len())).unwrap().clone();
                o.remove(&k);
            }
            _ => *node = Value::Null,
        }
    }
    serde_json::to_vec(&v).unwrap()
}

thread_local! {
    /// Where the last panic on this thread happened (set by [`quiet_hook`]).
    static WHERE: std::cell::RefCell<String> = const { std::cell::RefCell::new(String::new()) };
}

/// A panic hook that, on the fuzz worker, only records where a panic happened (each failure is
/// reported once at the end); other threads keep the default report.
fn quiet_hook() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let default = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if std::thread::current().name() == Some("plan-fuzz") {
                let at = info.location().map(|l| l.to_string()).unwrap_or_default();
                WHERE.with(|w| *w.borrow_mut() = at);
            } else {
                default(info);
            }
        }));
    });
}

/// Runs every case on one worker thread and fails, after all have run, if any panicked (each
/// distinct panic reported once, with its first input kept in a file), or at once if a case is
/// still running after [`CASE_LIMIT`]. Returns the outcomes.
fn run_all(cases: Vec<(String, Vec<u8>)>) -> Vec<PlanOutcome> {
    quiet_hook();
    let current = Arc::new(AtomicUsize::new(0));
    let names: Vec<String> = cases.iter().map(|c| c.0.clone()).collect();
    let (tx, rx) = mpsc::channel();
    let seen = current.clone();
    let worker = std::thread::Builder::new()
        .name("plan-fuzz".into())
        .spawn(move || {
            let mut outcomes = vec![];
            let mut failures: Vec<(String, String)> = vec![];
            for (i, (name, bytes)) in cases.iter().enumerate() {
                seen.store(i, Ordering::SeqCst);
                let _ = tx.send(());
                match std::panic::catch_unwind(|| exercise_plan(bytes)) {
                    Ok(o) => outcomes.push(o),
                    Err(e) => {
                        let msg = e
                            .downcast_ref::<String>()
                            .cloned()
                            .or_else(|| e.downcast_ref::<&str>().map(|s| s.to_string()))
                            .unwrap_or_default();
                        let at = WHERE.with(|w| w.borrow().clone());
                        let key = format!("{at}: {msg}");
                        if failures.iter().any(|f| f.0 == key) {
                            continue;
                        }
                        let file = std::env::temp_dir().join(format!(
                            "plan-fuzz-{}.json",
                            name.replace(|c: char| !c.is_ascii_alphanumeric(), "_")
                        ));
                        std::fs::write(&file, bytes).unwrap();
                        failures.push((key, format!("{name}: input kept in {}", file.display())));
                    }
                }
            }
            (outcomes, failures)
        })
        .unwrap();
    let mut last = (usize::MAX, Instant::now());
    // Until the worker hangs up (done or panicked), watch that the current case moves on.
    while let Ok(()) | Err(mpsc::RecvTimeoutError::Timeout) =
        rx.recv_timeout(Duration::from_millis(200))
    {
        let i = current.load(Ordering::SeqCst);
        if i != last.0 {
            last = (i, Instant::now());
        } else if last.1.elapsed() > CASE_LIMIT {
            panic!("{}: still running after {CASE_LIMIT:?} (a hang)", names[i]);
        }
    }
    let (outcomes, failures) = match worker.join() {
        Ok(r) => r,
        Err(e) => std::panic::resume_unwind(e),
    };
    assert!(
        failures.is_empty(),
        "{} distinct panics (copy each input into tests/inputs/fuzz_plan/ once fixed):\n{}",
        failures.len(),
        failures
            .iter()
            .map(|(k, f)| format!("- {k}\n  first: {f}"))
            .collect::<Vec<_>>()
            .join("\n")
    );
    outcomes
}

#[test]
fn every_seed_plan_verifies() {
    let seeds = seeds();
    assert!(seeds.len() >= 20, "{} seeds", seeds.len());
    let cases: Vec<_> = seeds
        .into_iter()
        .map(|(n, t)| (n, t.into_bytes()))
        .collect();
    let names: Vec<String> = cases.iter().map(|c| c.0.clone()).collect();
    for (name, o) in names.iter().zip(run_all(cases)) {
        assert_eq!(o, PlanOutcome::Verified, "{name}");
    }
}

#[test]
fn stored_plan_reproducers_do_not_crash() {
    let cases = reproducers();
    assert!(
        !cases.is_empty(),
        "no reproducers under tests/inputs/fuzz_plan"
    );
    run_all(cases);
}

#[test]
fn mutated_plans_never_panic() {
    let n: usize = std::env::var("SCHED_PLAN_MUTANTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(MUTANTS);
    let seeds = seeds();
    let trees: Vec<Value> = seeds
        .iter()
        .map(|(_, t)| serde_json::from_str(t).unwrap())
        .collect();
    let mut rng = Rng(0x005e_ed0f_91a7);
    let cases: Vec<(String, Vec<u8>)> = (0..n)
        .map(|i| {
            let s = rng.below(seeds.len());
            let (how, bytes) = if i % 2 == 0 {
                ("bytes", mutate_bytes(&mut rng, seeds[s].1.as_bytes()))
            } else {
                ("json", mutate_json(&mut rng, &trees[s]))
            };
            (format!("mutant {i} ({how}) of {}", seeds[s].0), bytes)
        })
        .collect();
    let start = Instant::now();
    let outcomes = run_all(cases);
    let count = |f: fn(&PlanOutcome) -> bool| outcomes.iter().filter(|o| f(o)).count();
    eprintln!(
        "{n} mutants in {:.1} s: {} refused by read_plan, {} rejected by the verifier, {} verified, {} not UTF-8",
        start.elapsed().as_secs_f64(),
        count(|o| matches!(o, PlanOutcome::Refused(_))),
        count(|o| matches!(o, PlanOutcome::Rejected(_))),
        count(|o| matches!(o, PlanOutcome::Verified)),
        count(|o| matches!(o, PlanOutcome::NotText)),
    );
    // The mutants must reach the verifier, or this tests only the JSON parser.
    // (Half the mutants are byte-level and nearly all of those fail as JSON; of 40,000 mutants,
    // 12% reach the verifier and 5% fail there.)
    assert!(
        count(|o| matches!(o, PlanOutcome::Rejected(_) | PlanOutcome::Verified)) * 100 >= 8 * n,
        "fewer than 8% of the mutants reached the verifier"
    );
    assert!(
        count(|o| matches!(o, PlanOutcome::Rejected(_))) * 100 >= 3 * n,
        "fewer than 3% of the mutants were rejected by the verifier"
    );
}
