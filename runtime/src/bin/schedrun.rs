//! `schedrun`: runs a compiled schedule for real (`docs/cli.md`).
//!
//! Exit status: 0 success, 1 bad input (a schedule with errors, a plan that is malformed, of
//! another version or fails verification, a weights file that does not fit the model, an
//! incomplete checkpoint) or a run that diverged (a non-finite loss or gradient norm, or non-finite
//! state about to be checkpointed), 2 any other failure (a rank
//! that fails or stops answering, an output that cannot be written, checked before the first
//! step), 128 + the signal (143 SIGTERM, 130 SIGINT) a run stopped by a signal after its current
//! step and its checkpoint.
//! Per-step results go to stdout (one JSON object per line with `--json`), progress and errors to
//! stderr, the progress bar only when stderr is a terminal.

use clap::Parser;
use indicatif::{ProgressBar, ProgressStyle};
use sched_ir::job::{Decay, Model, Optimizer, Train};
use schedrun::backend::cpu::CpuBackend;
use schedrun::backend::cuda::launch::{self, DistEnv};
use schedrun::backend::cuda::{self, CudaBackend, PtxFiles};
use schedrun::backend::{Backend, RunOptions, StreamWait};
use schedrun::checkpoint::{self, Contents};
use schedrun::data::{self, Corpus, TextTokenizer, Windows};
use schedrun::eval::Validation;
use schedrun::plan::{LoadError, Plan};
use schedrun::plot::LossCurve;
use schedrun::preempt;
use schedrun::train::{StepReport, Trainer};
use serde_json::json;
use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

#[derive(Parser)]
#[command(
    name = "schedrun",
    version,
    about = "Train with a compiled schedule: every rank, stream, event and collective for real"
)]
struct Cli {
    /// A `.sched` file (compiled on the spot) or a plan file written by `schedc compile`.
    file: PathBuf,
    /// Which schedule, when the file defines several.
    #[arg(long)]
    schedule: Option<String>,
    /// Where to run.
    #[arg(long, value_enum, default_value = "cpu")]
    backend: BackendKind,
    /// Optimizer steps to run (default: the schedule's `train.steps`).
    #[arg(long)]
    steps: Option<u64>,
    /// Run until the step count reaches N, counting a resumed checkpoint's steps (for a job
    /// requeued with the same command line); not with `--steps`.
    #[arg(long, value_name = "N", conflicts_with = "steps")]
    until_step: Option<u64>,
    /// Learning rate (default: the schedule's `train.lr`).
    #[arg(long)]
    lr: Option<f64>,
    /// Steps of linear warmup to the learning rate (default: the schedule's `train.warmup`).
    #[arg(long, value_name = "N")]
    warmup: Option<u64>,
    /// Decay after the warmup to `--min-lr` at the last step (default: the schedule's
    /// `train.decay`).
    #[arg(long, value_parser = ["constant", "linear", "cosine"])]
    decay: Option<String>,
    /// The rate the decay ends at (default: the schedule's `train.min_lr`, else 0).
    #[arg(long, value_name = "LR")]
    min_lr: Option<f64>,
    /// AdamW's decoupled weight decay (default: the schedule's `train.weight_decay`, else 0.1).
    #[arg(long, value_name = "X")]
    weight_decay: Option<f64>,
    /// Adam's β1 and β2 (default: the schedule's `train.betas`, else 0.9,0.95).
    #[arg(long, value_name = "B1,B2", value_delimiter = ',')]
    betas: Option<Vec<f64>>,
    /// Adam's ε (default: the schedule's `train.eps`, else 1e-8).
    #[arg(long, value_name = "X")]
    eps: Option<f64>,
    /// Initialisation seed (default: the schedule's `train.seed`).
    #[arg(long)]
    seed: Option<u64>,
    /// Training data (default: the schedule's `train.data`, else the built-in corpus): a text
    /// file read as bytes, tokens in a `.bin` (llm.c's shard or nanoGPT's raw uint16) or a `.npy`,
    /// or text tokenized by `--tokenizer`.
    #[arg(long)]
    data: Option<PathBuf>,
    /// Where each training sequence's window starts: `strided` (the batch rule, the same on
    /// every run) or `seeded` (drawn from the seed, `--seed` or the schedule's `train.seed`:
    /// the same for the same seed, under any schedule). Validation windows are always strided.
    #[arg(long, value_parser = ["strided", "seeded"], default_value = "strided")]
    windows: String,
    /// A Hugging Face `tokenizer.json`: the data (and `--val`) files are UTF-8 text it encodes.
    #[arg(long, value_name = "tokenizer.json")]
    tokenizer: Option<PathBuf>,
    /// A validation corpus (any format `--data` reads; default: the schedule's `train.val`):
    /// its loss is printed after every `--eval-every` steps and after the last step.
    #[arg(long, value_name = "F")]
    val: Option<PathBuf>,
    /// With a validation file: compute the validation loss after every N steps (counted from
    /// step 0; default: the schedule's `train.eval_every`, else after the last step only).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    eval_every: Option<u64>,
    /// With a validation file: the validation loss is the mean over K global batches of it
    /// (default: the schedule's `train.eval_batches`, else 4).
    #[arg(long, value_name = "K", value_parser = clap::value_parser!(u64).range(1..))]
    eval_batches: Option<u64>,
    /// Write the training (and validation) loss over the steps as an SVG plot after the run.
    #[arg(long, value_name = "OUT.svg")]
    plot: Option<PathBuf>,
    /// Global gradient-norm limit (default: the schedule's `train.clip`).
    #[arg(long)]
    clip: Option<f64>,
    /// One JSON object per step on stdout, and a summary object at the end.
    #[arg(long)]
    json: bool,
    /// Write the initial weights (safetensors) before the first step.
    #[arg(long, value_name = "F")]
    save_init: Option<PathBuf>,
    /// Start from these weights instead of the seed's: a file written by `--save-init`, or a
    /// Hugging Face GPT-2 or LLaMA checkpoint (a `.safetensors` file, a sharded
    /// `model.safetensors.index.json`, or a folder holding either).
    #[arg(long, value_name = "F|DIR", conflicts_with = "resume")]
    init: Option<PathBuf>,
    /// Write a checkpoint (weights, optimizer state, step) after the last step.
    #[arg(long, value_name = "F")]
    save: Option<PathBuf>,
    /// Write the weights after the last step in Hugging Face layout (GPT-2 or LLaMA names;
    /// bf16 for a bf16 model, else fp32) with the family's `config.json`, for `transformers`'
    /// `from_pretrained`; no optimizer state. F ending in `.safetensors` is the weights file
    /// (config.json beside it); any other F is a folder receiving `model.safetensors` and
    /// `config.json`.
    #[arg(long, value_name = "F|DIR")]
    save_hf: Option<PathBuf>,
    /// Continue from a checkpoint, under this or any other schedule: a file written by `--save`,
    /// a folder of `--checkpoints` (its newest complete entry) or one entry of it.
    #[arg(long, value_name = "F|DIR")]
    resume: Option<PathBuf>,
    /// Write checkpoints into this folder, each step's as its own entry (`step-00000120/`):
    /// every `--save-every` steps, when stopped by SIGTERM or SIGINT, and after the last step
    /// (default: the schedule's `train.checkpoints`).
    #[arg(long, value_name = "DIR")]
    checkpoints: Option<PathBuf>,
    /// With checkpoints: write one every N steps, counted from step 0 so that a resumed run keeps
    /// the cadence (default: the schedule's `train.save_every`, else only at the end and on a
    /// signal).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    save_every: Option<u64>,
    /// With checkpoints: how many entries to keep, the newest (default: the schedule's
    /// `train.keep`, else 3).
    #[arg(long, value_name = "K", value_parser = clap::value_parser!(u64).range(1..))]
    keep: Option<u64>,
    /// Test hook: make one weight NaN just before this step (1-based), to exercise the
    /// divergence stop; with `STEP:grad`, one layer's gradient during the step instead, leaving
    /// the step's loss finite.
    #[arg(long, value_name = "STEP[:grad]", hide = true, value_parser = parse_injection)]
    inject_nan: Option<Injection>,
    /// Test hook: write `--checkpoints` entries as per-rank shards and a manifest, as several
    /// CUDA processes do (`checkpoint::shards`), though this process holds every rank.
    #[arg(long, hide = true)]
    shard_checkpoints: bool,
    /// Stress mode: sleep a random time up to this many microseconds before every op, so that a
    /// missing wait shows up as wrong numbers instead of passing by luck.
    #[arg(long, value_name = "MICROSECONDS")]
    jitter: Option<u64>,
    /// Seconds a rank may wait for an event or a collective before the run is aborted.
    #[arg(long, default_value_t = 60)]
    timeout: u64,
    /// With `--backend cuda` and no RANK/WORLD_SIZE in the environment: how many processes (one
    /// per GPU) to start on this machine (default: the plan's ranks).
    #[arg(long, value_name = "N")]
    nproc_per_node: Option<u32>,
    /// With `--backend cuda`: the PTX module of the plan's kernels for this GPU (default: the one
    /// `schedc compile --emit ptx` wrote beside the plan file, `NAME.sm_80.ptx` or
    /// `NAME.sm_90.ptx` by the GPU's compute capability).
    #[arg(long, value_name = "FILE")]
    ptx: Option<PathBuf>,
    /// Write the last step as measured, every op, as a Chrome/Perfetto trace (the format of
    /// `schedc simulate --trace`, to compare with it): every rank on the CPU backend, rank 0's
    /// process on the CUDA backend (timed with CUDA events around each op).
    #[arg(long, value_name = "OUT.json")]
    trace: Option<PathBuf>,
}

/// `--inject-nan STEP[:grad]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Injection {
    step: u64,
    /// Poison a gradient during the step, not a weight before it.
    grad: bool,
}

fn parse_injection(s: &str) -> Result<Injection, String> {
    let (step, grad) = match s.split_once(':') {
        Some((step, "grad")) => (step, true),
        Some((_, what)) => return Err(format!("`{what}`: only `grad` follows the step")),
        None => (s, false),
    };
    let step = step
        .parse()
        .map_err(|_| format!("`{step}` is not a step number"))?;
    Ok(Injection { step, grad })
}

#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum BackendKind {
    Cpu,
    Cuda,
}

/// Why a run failed: the input's fault (exit 1) or the machine's (exit 2), with the error that
/// says what. [`main`] is the one place that turns it into an exit status and prints it, with
/// every cause its message does not already give.
enum Failure {
    Input(Cause),
    Fault(Cause),
    /// A report already written out in full (a `.sched` file's diagnostics): printed as it is.
    Reported(String),
    /// Stopped by a signal after a step, the checkpoint written and the reason already printed:
    /// exit with this status.
    Stopped(u8),
}

type Cause = Box<dyn std::error::Error + Send + Sync>;

impl Failure {
    fn input(e: impl Into<Cause>) -> Self {
        Failure::Input(e.into())
    }

    fn fault(e: impl Into<Cause>) -> Self {
        Failure::Fault(e.into())
    }
}

impl From<LoadError> for Failure {
    fn from(e: LoadError) -> Self {
        let shown = e.render();
        if e.is_diagnostics() {
            Failure::Reported(shown)
        } else if e.is_input() {
            Failure::input(shown)
        } else {
            Failure::fault(shown)
        }
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let (status, e) = match run(&cli) {
        Ok(()) => return ExitCode::SUCCESS,
        Err(Failure::Input(e)) => (1, e),
        Err(Failure::Fault(e)) => (2, e),
        Err(Failure::Reported(report)) => {
            eprintln!("{}", report.trim_end());
            return ExitCode::from(1);
        }
        Err(Failure::Stopped(status)) => return ExitCode::from(status),
    };
    let message = e.to_string();
    eprintln!("error: {message}");
    let mut cause = e.source();
    while let Some(c) = cause {
        let text = c.to_string();
        if !message.contains(&text) {
            eprintln!("  caused by: {text}");
        }
        cause = c.source();
    }
    ExitCode::from(status)
}

fn run(cli: &Cli) -> Result<(), Failure> {
    let dist = match cli.backend {
        BackendKind::Cpu => None,
        BackendKind::Cuda => match DistEnv::from_env().map_err(Failure::input)? {
            Some(env) => Some(env),
            None => return launch(cli),
        },
    };
    let mut plan = Plan::load(&cli.file, cli.schedule.as_deref())?;
    // The command line's learning-rate schedule and optimizer settings over the schedule's:
    // the backends read them from the plan's job.
    plan.job.schedule.train = learning_rate_schedule(cli, &plan.job.schedule.train)?;
    if plan.job.schedule.train.weight_decay.is_some()
        && plan.job.model.optimizer != Optimizer::AdamW
    {
        return Err(Failure::input(format!(
            "`train.weight_decay` is AdamW's decoupled decay, but model `{}` uses {}",
            plan.job.model.name,
            plan.job.model.optimizer.name()
        )));
    }
    let plan = Arc::new(plan);
    if cli.save_hf.is_some() {
        // Refused before training, not after.
        schedrun::hf::family_of_model(&plan.job.model).map_err(Failure::input)?;
    }
    check_outputs(cli, &Saving::of(cli, &plan)?)?;
    let (corpus, validation) = load_data(cli, &plan)?;
    let options = RunOptions {
        jitter: cli.jitter.map(Duration::from_micros),
        jitter_seed: cli.seed.unwrap_or(plan.job.schedule.train.seed),
        timeout: Duration::from_secs(cli.timeout),
        time_ops: cli.trace.is_some(),
        ..RunOptions::default()
    };
    match dist {
        None => {
            preempt::install().map_err(Failure::fault)?;
            let backend = CpuBackend::new(plan.clone(), options);
            run_steps(
                cli,
                &plan,
                Trainer::new(plan.clone(), backend, corpus),
                validation,
                true,
            )
        }
        Some(env) => {
            if env.world != plan.ranks() {
                return Err(Failure::input(format!(
                    "the plan has {} ranks but WORLD_SIZE is {} (rank {})",
                    plan.ranks(),
                    env.world,
                    env.rank
                )));
            }
            // Missing libraries (or a build without CUDA): one line, before any device work.
            cuda::probe().map_err(Failure::fault)?;
            let ptx = ptx_files(cli)?;
            if env.world > 1 && (cli.save.is_some() || validation.is_some()) {
                return Err(Failure::input(
                    "--save and --val need the whole state in one process, which none of \
                     several cuda processes holds (each holds its own shards): use \
                     --checkpoints DIR, whose entries each rank writes its shards into",
                ));
            }
            // Several processes agree on the step to stop after (`agreed_stop`).
            preempt::install().map_err(Failure::fault)?;
            let backend =
                CudaBackend::new(plan.clone(), options, &env, &ptx).map_err(Failure::fault)?;
            run_steps(
                cli,
                &plan,
                Trainer::new(plan.clone(), backend, corpus),
                validation,
                env.rank == 0,
            )
        }
    }
}

/// The training corpus and the validation set, read and checked against the model (length,
/// vocabulary) before anything runs or is written: a bad file is exit 1 naming it.
fn load_data(cli: &Cli, plan: &Plan) -> Result<(Corpus, Option<Validation>), Failure> {
    let model = &plan.job.model;
    let seq_len = model.seq_len as usize;
    let tokenizer = match &cli.tokenizer {
        Some(t) => Some(TextTokenizer::load(t).map_err(Failure::input)?),
        None => None,
    };
    let data = cli.data.clone().or(plan.job.schedule.train.data.clone());
    let open = |f: &Path| -> Result<Corpus, Failure> {
        let corpus = Corpus::open(f, tokenizer.as_ref()).map_err(Failure::input)?;
        corpus.check(seq_len).map_err(Failure::input)?;
        if let Some(v) = data::vocabulary(model) {
            corpus.check_vocabulary(v).map_err(Failure::input)?;
        }
        Ok(corpus)
    };
    let corpus = match (&data, &tokenizer) {
        (Some(f), _) => open(f)?,
        (None, Some(t)) => {
            return Err(Failure::input(format!(
                "--tokenizer {} encodes a text file, but there is none: give --data (or the \
                 schedule's `train.data`)",
                t.path().display()
            )))
        }
        (None, None) => {
            let c = Corpus::builtin();
            c.check(seq_len).map_err(Failure::input)?;
            if let Some(v) = data::vocabulary(model) {
                c.check_vocabulary(v).map_err(Failure::input)?;
            }
            c
        }
    };
    let corpus = match cli.windows.as_str() {
        "seeded" => corpus.with_windows(Windows::Seeded(
            cli.seed.unwrap_or(plan.job.schedule.train.seed),
        )),
        _ => corpus,
    };
    // The flags over the schedule's `train { val, eval_every, eval_batches }`.
    let train = &plan.job.schedule.train;
    let val = cli.val.clone().or(train.val.clone());
    let validation = match &val {
        None => {
            if cli.eval_every.is_some() || cli.eval_batches.is_some() {
                return Err(Failure::input(
                    "--eval-every and --eval-batches set the validation loss, but there is no \
                     validation file: give --val (or the schedule's `train.val`)",
                ));
            }
            None
        }
        Some(f) => {
            let batches = cli.eval_batches.or(train.eval_batches).unwrap_or(4) as usize;
            let every = cli.eval_every.or(train.eval_every);
            Some(Validation::new(plan, open(f)?, every, batches).map_err(Failure::input)?)
        }
    };
    for (what, c) in std::iter::once(("data", &corpus))
        .chain(validation.as_ref().map(|v| ("validation", v.corpus())))
    {
        if let Some(f) = c.path().filter(|_| !c.format().is_bytes()) {
            eprintln!(
                "schedrun: {what} {} ({}): {} tokens",
                f.display(),
                c.format(),
                c.len()
            );
        }
    }
    Ok((corpus, validation))
}

/// `--backend cuda` without RANK/WORLD_SIZE: this process starts one copy of itself per rank.
fn launch(cli: &Cli) -> Result<(), Failure> {
    let plan = Plan::load(&cli.file, cli.schedule.as_deref())?;
    let n = cli.nproc_per_node.unwrap_or(plan.ranks());
    if n != plan.ranks() {
        return Err(Failure::input(format!(
            "the plan has {} ranks; --nproc-per-node {n} on one machine cannot run it (use an \
             external launcher that sets RANK and WORLD_SIZE across machines)",
            plan.ranks()
        )));
    }
    cuda::probe().map_err(Failure::fault)?;
    ptx_files(cli)?;
    let exe = std::env::current_exe().map_err(Failure::fault)?;
    let port = launch::free_port().map_err(Failure::fault)?;
    let args: Vec<std::ffi::OsString> = std::env::args_os().skip(1).collect();
    let commands = launch::local_envs(n, port)
        .into_iter()
        .map(|env| {
            let mut c = std::process::Command::new(&exe);
            c.args(&args).envs(env.vars());
            c
        })
        .collect();
    launch::run_ranks(commands).map_err(Failure::fault)
}

/// Where the CUDA backend finds the plan's kernels (`PtxFiles::for_input`).
fn ptx_files(cli: &Cli) -> Result<PtxFiles, Failure> {
    PtxFiles::for_input(&cli.file, cli.ptx.as_deref(), cli.schedule.as_deref())
        .map_err(Failure::input)
}

/// Periodic checkpoints: the flags, else the schedule's `train` keys.
struct Saving {
    dir: Option<PathBuf>,
    every: Option<u64>,
    keep: usize,
}

impl Saving {
    fn of(cli: &Cli, plan: &Plan) -> Result<Saving, Failure> {
        let train = &plan.job.schedule.train;
        let dir = cli.checkpoints.clone().or(train.checkpoints.clone());
        if dir.is_none() && (cli.save_every.is_some() || cli.keep.is_some()) {
            return Err(Failure::input(
                "--save-every and --keep need a checkpoint folder: --checkpoints DIR or the \
                 schedule's `train.checkpoints`",
            ));
        }
        Ok(Saving {
            dir,
            every: cli.save_every.or(train.save_every),
            keep: cli.keep.or(train.keep).unwrap_or(3) as usize,
        })
    }
}

/// Every file the run will write, checked creatable before anything runs (exit 2 naming the
/// first that is not): a probe file is created and removed beside each, so nothing is left.
fn check_outputs(cli: &Cli, saving: &Saving) -> Result<(), Failure> {
    let files = [
        ("--save-init", &cli.save_init),
        ("--save", &cli.save),
        ("--trace", &cli.trace),
        ("--plot", &cli.plot),
    ];
    for (flag, f) in files {
        let Some(f) = f else { continue };
        check_file(f, flag, |dir| dir)?;
    }
    if let Some(f) = &cli.save_hf {
        // The weights and their config.json; a folder named by `--save-hf` is made at the end.
        let (weights, config) = schedrun::hf::save_paths(f);
        for f in [&weights, &config] {
            check_file(f, "--save-hf", nearest_existing)?;
        }
    }
    if let Some(d) = &saving.dir {
        // The folder is made at the first checkpoint: its nearest existing ancestor must be a
        // folder this process can write in.
        let at = nearest_existing(d);
        writable_folder(at).map_err(|why| {
            Failure::fault(format!(
                "cannot write checkpoints into {} (--checkpoints): {why}",
                d.display()
            ))
        })?;
    }
    Ok(())
}

/// `d` or its nearest ancestor that exists (`.` for a relative path none of whose ancestors do).
/// File `f` (`flag`'s) can be written: it is no folder, and `folder` of its parent folder (the
/// parent itself, or the nearest existing ancestor where the run makes the rest) is writable.
fn check_file(f: &Path, flag: &str, folder: fn(&Path) -> &Path) -> Result<(), Failure> {
    let dir = f
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let why = match f.is_dir() {
        true => Err("it is a folder".to_string()),
        false => writable_folder(folder(dir)),
    };
    why.map_err(|why| Failure::fault(format!("cannot write {} ({flag}): {why}", f.display())))
}

fn nearest_existing(d: &Path) -> &Path {
    let mut at = d;
    while !at.exists() {
        match at.parent().filter(|p| !p.as_os_str().is_empty()) {
            Some(p) => at = p,
            None => return Path::new("."),
        }
    }
    at
}

/// Whether a file can be created in `dir`: it is a folder and a probe file can be created there.
fn writable_folder(dir: &Path) -> Result<(), String> {
    if !dir.exists() {
        return Err(format!("folder {} does not exist", dir.display()));
    }
    if !dir.is_dir() {
        return Err(format!("{} is not a folder", dir.display()));
    }
    let probe = dir.join(format!(".schedrun-probe.{}", std::process::id()));
    std::fs::File::create(&probe).map_err(|e| format!("{}: {e}", dir.display()))?;
    let _ = std::fs::remove_file(&probe);
    Ok(())
}

/// Loads the initial state and runs the steps; only `print` ranks write results.
/// The signal this run stops on after the step just done, agreed by every process of the run:
/// the one this process received, or SIGTERM when only another process received one (Slurm and
/// torchrun signal every process; a signal to one of several CUDA processes still stops all of
/// them after the same step, each writing its shards of the checkpoint). One process holding
/// every rank agrees with itself.
fn agreed_stop<B: Backend>(trainer: &Trainer<B>) -> Result<Option<i32>, Failure> {
    let local = preempt::requested();
    let none_stops = trainer
        .backend
        .all_agree(local.is_none())
        .map_err(Failure::fault)?;
    Ok(match (local, none_stops) {
        (Some(signal), _) => Some(signal),
        (None, false) => Some(libc::SIGTERM),
        (None, true) => None,
    })
}

fn run_steps<B: Backend>(
    cli: &Cli,
    plan: &Arc<Plan>,
    mut trainer: Trainer<B>,
    mut validation: Option<Validation>,
    print: bool,
) -> Result<(), Failure> {
    let plan = plan.clone();
    // (The command line's settings are already in the plan's job.)
    let train = &plan.job.schedule.train;
    let lr = cli.lr.unwrap_or(train.lr);
    let seed = cli.seed.unwrap_or(train.seed);
    let clip = cli.clip.or(train.clip);
    let model = plan.job.model.clone();
    let state = match (&cli.init, &cli.resume) {
        (Some(f), _) if schedrun::hf::is_hf_checkpoint(f) => {
            schedrun::hf::load(f, &model).map_err(Failure::input)?
        }
        (Some(f), _) => checkpoint::load(f, &model, Contents::Weights).map_err(Failure::input)?,
        (_, Some(f)) => {
            let found = checkpoint::folder::resolve(f).map_err(Failure::input)?;
            if print {
                for s in &found.skipped {
                    eprintln!(
                        "schedrun: skipping {}: no {} (its write was cut short)",
                        s.display(),
                        checkpoint::folder::MANIFEST
                    );
                }
                if found.file != *f {
                    eprintln!("schedrun: resuming from {}", found.file.display());
                }
            }
            checkpoint::folder::load(&found.file, &model).map_err(Failure::input)?
        }
        _ => trainer.initial_state(seed),
    };
    trainer.load(&state).map_err(Failure::fault)?;
    let steps = match cli.until_step {
        Some(n) => n.saturating_sub(state.step),
        None => cli.steps.unwrap_or(train.steps),
    };
    let saving = Saving::of(cli, &plan)?;
    // Every process writes its ranks' shards where this one does not hold every rank.
    let sharded = cli.shard_checkpoints || trainer.backend.ranks().len() != plan.ranks() as usize;
    if sharded && saving.dir.is_some() && plan.program.layout.tensor > 1 {
        return Err(Failure::input(
            "sharded checkpoint entries of a tensor-parallel plan are not written yet (each \
             rank's shard is of its tensor slice): run it in one process, or without \
             --checkpoints",
        ));
    }
    let saver = Saver {
        model: &model,
        dir: saving.dir.as_deref(),
        keep: saving.keep,
        sharded,
        lead: print,
        world: plan.ranks(),
    };
    let poison = match cli.inject_nan {
        Some(Injection { grad: true, .. }) => {
            Some(trainer.poison_target().map_err(Failure::fault)?)
        }
        _ => None,
    };
    if !print {
        // Another process of a CUDA run: the same steps and checkpoints, in lockstep with the
        // first (which prints), every divergence seen alike (loss and norm are summed over all).
        let mut last = None;
        for _ in 0..steps {
            let next = trainer.steps_done() + 1;
            let rate = train.lr_at(lr, trainer.steps_done());
            let injected = poison.filter(|_| cli.inject_nan.map(|i| i.step) == Some(next));
            let r = trainer
                .step_poisoned(rate, clip, injected)
                .map_err(Failure::fault)?;
            if let Some(why) = Divergence::of(&r) {
                return Err(diverged(&r, why, &trainer, None));
            }
            if saving.every.is_some_and(|n| r.step % n == 0) {
                saver.write(&trainer, r.step, None)?;
                last = Some(r.step);
            }
        }
        if saving.dir.is_some() && steps > 0 && last != Some(trainer.steps_done()) {
            saver.write(&trainer, trainer.steps_done(), None)?;
        }
        return Ok(());
    }
    if let Some(f) = &cli.save_init {
        checkpoint::save(f, &model, &state, Contents::Weights).map_err(Failure::fault)?;
    }
    let bytes = trainer.corpus().format().is_bytes();
    // A pipeline's batch is its data-parallel ranks' (each stage's).
    let ranks = match plan.program.layout.stages {
        1 => format!("{} ranks", plan.ranks()),
        p => format!(
            "{} ranks in {p} stages: {} data-parallel",
            plan.ranks(),
            plan.dp_size()
        ),
    };
    eprintln!(
        "schedrun: {} ({} on {}): {ranks} x {} micro-steps x {} sequences of {} {} = {} tokens per step, {} backend",
        plan.job.schedule.name,
        model.name,
        plan.job.cluster.name,
        plan.program.micro_steps,
        model.micro_batch,
        model.seq_len,
        if bytes { "bytes" } else { "tokens" },
        plan.tokens_per_step(),
        trainer.backend.name()
    );
    let bar = progress(steps);
    let mut reports: Vec<StepReport> = vec![];
    let mut last = None;
    // The newest checkpoint entry this run wrote.
    let mut entry: Option<(u64, PathBuf)> = None;
    if let Some(signal) = agreed_stop(&trainer)? {
        // Stopped while starting: nothing has changed since the state was loaded.
        eprintln!(
            "schedrun: {} received while starting: stopped before the first step",
            preempt::name(signal)
        );
        return Err(Failure::Stopped((128 + signal) as u8));
    }
    let mut curve = LossCurve::default();
    for i in 0..steps {
        let next = trainer.steps_done() + 1;
        let injected = cli.inject_nan.filter(|i| i.step == next);
        if injected.is_some_and(|i| !i.grad) {
            trainer.poison().map_err(Failure::fault)?;
        }
        let rate = train.lr_at(lr, trainer.steps_done());
        let mut r = trainer
            .step_poisoned(rate, clip, poison.filter(|_| injected.is_some()))
            .map_err(Failure::fault)?;
        // The last good checkpoint: this run's newest entry, else what it resumed from.
        let good = entry
            .as_ref()
            .map(|e| e.1.clone())
            .or_else(|| cli.resume.clone());
        if let Some(why) = Divergence::of(&r) {
            if let Some(b) = &bar {
                b.abandon();
            }
            return Err(diverged(&r, why, &trainer, good.as_deref()));
        }
        last = Some((r.time, std::mem::take(&mut r.outcome.spans)));
        curve.train.push((r.step, r.loss));
        let val_loss = match &mut validation {
            Some(v) if v.due(r.step, i + 1 == steps) => {
                let state = trainer.state().map_err(Failure::fault)?;
                let weights: Vec<Vec<f32>> = state.layers.into_iter().map(|l| l.params).collect();
                let loss = v.loss(&weights).map_err(Failure::fault)?;
                curve.val.push((r.step, loss));
                Some(loss)
            }
            _ => None,
        };
        let line = if cli.json {
            let mut o = json!({"step": r.step, "loss": r.loss, "lr": rate,
                   "step_time_s": r.time.as_secs_f64(), "tokens_per_s": r.tokens_per_s});
            if let Some(v) = val_loss {
                o["val_loss"] = json!(v);
            }
            o.to_string()
        } else {
            format!(
                "step {:>5}  loss {:.4}  {:>8.3} s  {:>10.0} tokens/s{}",
                r.step,
                r.loss,
                r.time.as_secs_f64(),
                r.tokens_per_s,
                val_loss
                    .map(|v| format!("  val loss {v:.4}"))
                    .unwrap_or_default()
            )
        };
        match &bar {
            Some(b) => {
                b.suspend(|| println!("{line}"));
                b.set_message(format!("loss {:.4}", r.loss));
                b.inc(1);
            }
            None => println!("{line}"),
        }
        let stop = agreed_stop(&trainer)?;
        let due = saving.every.is_some_and(|n| r.step % n == 0) || stop.is_some();
        if saving.dir.is_some() && due {
            let written = saver.write(&trainer, r.step, good.as_deref());
            if written.is_err() {
                if let Some(b) = &bar {
                    b.abandon();
                }
            }
            let at = written?;
            note(&bar, format!("schedrun: checkpoint {}", at.display()));
            entry = Some((r.step, at));
        }
        reports.push(r);
        if let Some(signal) = stop {
            if let Some(b) = &bar {
                b.abandon();
            }
            write_plot(cli, &plan, &curve)?;
            if let Some(f) = &cli.save {
                let state = checked_state(&trainer, good_of(&entry, cli))?;
                checkpoint::save(f, &model, &state, Contents::Checkpoint)
                    .map_err(Failure::fault)?;
            }
            let written: Vec<String> = entry
                .iter()
                .filter(|e| e.0 == trainer.steps_done())
                .map(|e| e.1.display().to_string())
                .chain(cli.save.iter().map(|f| f.display().to_string()))
                .collect();
            eprintln!(
                "schedrun: {} received: stopped after step {}; {}",
                preempt::name(signal),
                trainer.steps_done(),
                if written.is_empty() {
                    "no checkpoint written (saving is off: --checkpoints or --save)".to_string()
                } else {
                    format!("checkpoint written to {}", written.join(" and "))
                }
            );
            return Err(Failure::Stopped((128 + signal) as u8));
        }
    }
    if let Some(b) = &bar {
        b.finish_and_clear();
    }
    if saving.dir.is_some() {
        let done = trainer.steps_done();
        if !reports.is_empty() && entry.as_ref().map(|e| e.0) != Some(done) {
            let at = saver.write(&trainer, done, good_of(&entry, cli))?;
            eprintln!("schedrun: checkpoint {}", at.display());
            entry = Some((done, at));
        }
    }
    if let Some(f) = &cli.save {
        let state = checked_state(&trainer, good_of(&entry, cli))?;
        checkpoint::save(f, &model, &state, Contents::Checkpoint).map_err(Failure::fault)?;
    }
    if let Some(f) = &cli.save_hf {
        let state = trainer.state().map_err(Failure::fault)?;
        let (weights, config) = schedrun::hf::save(f, &model, &state).map_err(Failure::fault)?;
        eprintln!("wrote {} and {}", weights.display(), config.display());
    }
    write_plot(cli, &plan, &curve)?;
    if let (Some(f), Some((time, spans))) = (&cli.trace, &last) {
        let trace = schedrun::trace::measured(&plan, *time, spans).map_err(Failure::fault)?;
        let text = serde_json::to_string(&trace).expect("traces serialise") + "\n";
        sched_ir::files::write_atomically(f, text.as_bytes())
            .map_err(|e| Failure::fault(format!("cannot write {}: {e}", f.display())))?;
        eprintln!("wrote {}", f.display());
    }
    summary(cli.json, &plan, &trainer, &reports, curve.val.last());
    Ok(())
}

/// `--plot`: the loss curve so far, when asked for and some step ran.
fn write_plot(cli: &Cli, plan: &Plan, curve: &LossCurve) -> Result<(), Failure> {
    let (Some(f), false) = (&cli.plot, curve.train.is_empty()) else {
        return Ok(());
    };
    let title = format!("{} ({})", plan.job.schedule.name, plan.job.model.name);
    curve.write(f, &title).map_err(Failure::fault)?;
    eprintln!("wrote {}", f.display());
    Ok(())
}

/// The schedule's training settings with the command line's learning-rate schedule and
/// optimizer settings over them.
fn learning_rate_schedule(cli: &Cli, train: &Train) -> Result<Train, Failure> {
    let mut t = train.clone();
    if let Some(w) = cli.warmup {
        t.warmup = w;
    }
    if let Some(d) = &cli.decay {
        t.decay = match d.as_str() {
            "linear" => Decay::Linear,
            "cosine" => Decay::Cosine,
            _ => Decay::Constant,
        };
    }
    if let Some(m) = cli.min_lr {
        t.min_lr = m;
    }
    if let Some(w) = cli.weight_decay {
        if !(w >= 0.0 && w.is_finite()) {
            return Err(Failure::input(format!(
                "--weight-decay {w} must be a number ≥ 0"
            )));
        }
        t.weight_decay = Some(w);
    }
    if let Some(b) = &cli.betas {
        match b.as_slice() {
            &[b1, b2] if (0.0..1.0).contains(&b1) && (0.0..1.0).contains(&b2) => {
                t.betas = Some([b1, b2]);
            }
            _ => {
                return Err(Failure::input(format!(
                    "--betas {b:?} must be two numbers in [0, 1), as 0.9,0.95"
                )))
            }
        }
    }
    if let Some(e) = cli.eps {
        if !(e > 0.0 && e.is_finite()) {
            return Err(Failure::input(format!(
                "--eps {e} must be a positive number"
            )));
        }
        t.eps = Some(e);
    }
    let lr = cli.lr.unwrap_or(t.lr);
    if !(t.min_lr >= 0.0 && t.min_lr <= lr) {
        return Err(Failure::input(format!(
            "--min-lr {} must lie between 0 and the learning rate {lr}",
            t.min_lr
        )));
    }
    Ok(t)
}

/// A line on stderr, above the progress bar when there is one.
fn note(bar: &Option<ProgressBar>, line: String) {
    match bar {
        Some(b) => b.suspend(|| eprintln!("{line}")),
        None => eprintln!("{line}"),
    }
}

/// Why a step's run stops: what was not finite.
#[derive(Clone, Copy)]
enum Divergence {
    Loss,
    /// The loss finite, the gradient norm not (with clipping).
    Norm,
}

impl Divergence {
    fn of(r: &StepReport) -> Option<Divergence> {
        if !r.loss.is_finite() {
            Some(Divergence::Loss)
        } else if r.outcome.grad_sumsq.is_some_and(|s| !s.is_finite()) {
            Some(Divergence::Norm)
        } else {
            None
        }
    }
}

/// A step whose loss or gradient norm is not finite: the run stops (exit 1) before anything of
/// it is saved, naming the layers whose gradients are not finite (in backward order). The
/// step's update has run (the norm is read on the device, by the updates), so the weights held
/// are spoilt; no checkpoint is written from them.
fn diverged<B: Backend>(
    r: &StepReport,
    why: Divergence,
    trainer: &Trainer<B>,
    last_good: Option<&Path>,
) -> Failure {
    let layers = match trainer.non_finite_gradients() {
        Ok(l) if l.is_empty() => String::new(),
        Ok(l) => format!(
            "; non-finite gradients in {} (backward order)",
            l.join(", ")
        ),
        Err(e) => format!("; the gradients could not be read: {e}"),
    };
    let what = match why {
        Divergence::Loss => format!("the loss is {}", r.loss),
        Divergence::Norm => format!(
            "the gradient norm is {} with a finite loss ({:.4})",
            r.outcome.grad_sumsq.unwrap_or(f64::NAN).sqrt(),
            r.loss
        ),
    };
    Failure::input(format!(
        "step {}: {what} (the run diverged){layers}; stopped before saving anything of this \
         step{}",
        r.step,
        last_good_note(last_good)
    ))
}

fn last_good_note(last_good: Option<&Path>) -> String {
    match last_good {
        Some(p) => format!(" (the last good checkpoint is {})", p.display()),
        None => String::new(),
    }
}

/// A state about to be saved that holds non-finite values: a gradient went non-finite with a
/// finite loss, and no gradient norm was computed to catch it at its step (exit 1).
fn non_finite_state(step: u64, layers: &[String], last_good: Option<&Path>) -> Failure {
    let held = match layers {
        [] => "on another process".to_string(),
        l => format!("in {}", l.join(", ")),
    };
    Failure::input(format!(
        "step {step}: the weights or optimizer state after this step hold non-finite values \
         {held} (the run diverged: a gradient was not finite though the loss was; with `clip` \
         its norm stops the run at that step); nothing of this step is saved{}",
        last_good_note(last_good)
    ))
}

/// The newest entry this run wrote, else the checkpoint it resumed from.
fn good_of<'a>(entry: &'a Option<(u64, PathBuf)>, cli: &'a Cli) -> Option<&'a Path> {
    entry
        .as_ref()
        .map(|e| e.1.as_path())
        .or(cli.resume.as_deref())
}

/// The whole state, refused when any value is not finite (no checkpoint keeps such state).
fn checked_state<B: Backend>(
    trainer: &Trainer<B>,
    last_good: Option<&Path>,
) -> Result<schedrun::train::State, Failure> {
    let state = trainer.state().map_err(Failure::fault)?;
    let bad = state.non_finite_layers();
    if !bad.is_empty() {
        let names = layer_names(&trainer.plan, &bad);
        return Err(non_finite_state(state.step, &names, last_good));
    }
    Ok(state)
}

fn layer_names(plan: &Plan, layers: &[usize]) -> Vec<String> {
    layers
        .iter()
        .map(|&l| plan.job.model.layers[l].name.clone())
        .collect()
}

/// Writes the checkpoint entries of a run, every process at the same steps.
struct Saver<'a> {
    model: &'a Model,
    dir: Option<&'a Path>,
    keep: usize,
    /// Each rank writes its shards (`checkpoint::shards`) rather than this process the whole
    /// state: with several processes, or `--shard-checkpoints`.
    sharded: bool,
    /// The process that places a sharded entry (the first), and prints.
    lead: bool,
    world: u32,
}

impl Saver<'_> {
    /// Writes the entry of `step` (the state now held) and returns its path. State holding a
    /// non-finite value is never written: the run stops as diverged.
    fn write<B: Backend>(
        &self,
        trainer: &Trainer<B>,
        step: u64,
        last_good: Option<&Path>,
    ) -> Result<PathBuf, Failure> {
        let Some(dir) = self.dir else {
            return Err(Failure::fault("no checkpoint folder to write into"));
        };
        if !self.sharded {
            let state = checked_state(trainer, last_good)?;
            return checkpoint::folder::write(dir, self.model, &state, self.keep)
                .map_err(Failure::fault);
        }
        // Phase 0: every process's shards finite, or none writes.
        let shards = trainer.rank_shards().map_err(Failure::fault)?;
        let mut bad: Vec<usize> = shards.iter().flat_map(|s| s.non_finite_layers()).collect();
        bad.sort();
        bad.dedup();
        if !trainer
            .backend
            .all_agree(bad.is_empty())
            .map_err(Failure::fault)?
        {
            let names = layer_names(&trainer.plan, &bad);
            return Err(non_finite_state(step, &names, last_good));
        }
        // Phase 1: every rank its shard.
        let wrote = shards
            .iter()
            .try_for_each(|s| checkpoint::shards::write_rank(dir, self.model, step, self.world, s));
        let all = trainer
            .backend
            .all_agree(wrote.is_ok())
            .map_err(Failure::fault)?;
        wrote.map_err(Failure::fault)?;
        if !all {
            return Err(Failure::fault(format!(
                "step {step}: another process could not write its checkpoint shard (its own \
                 error says why); the entry was not completed"
            )));
        }
        // Phase 2: the first process checks every shard, writes the manifest, places the entry.
        let placed = self
            .lead
            .then(|| checkpoint::shards::finish(dir, self.model, step, self.world, self.keep));
        let ok = !matches!(placed, Some(Err(_)));
        let all = trainer.backend.all_agree(ok).map_err(Failure::fault)?;
        if let Some(p) = placed {
            return p.map_err(Failure::fault);
        }
        if !all {
            return Err(Failure::fault(format!(
                "step {step}: the first process could not complete the checkpoint entry (its \
                 error says why)"
            )));
        }
        Ok(dir.join(checkpoint::folder::entry_name(step)))
    }
}

fn progress(steps: u64) -> Option<ProgressBar> {
    if !std::io::stderr().is_terminal() {
        return None;
    }
    let b = ProgressBar::new(steps);
    b.set_style(
        ProgressStyle::with_template("{bar:30} {pos}/{len} steps  {msg}  eta {eta}")
            .expect("a valid template"),
    );
    Some(b)
}

/// Per stream name: seconds waiting and busy, summed over ranks.
fn waits_by_stream(reports: &[StepReport]) -> Vec<(&'static str, f64, f64)> {
    let mut out: Vec<(&'static str, f64, f64)> = vec![];
    for w in reports.iter().flat_map(|r| &r.outcome.waits) {
        let StreamWait {
            stream,
            waiting,
            busy,
            ..
        } = w;
        match out.iter_mut().find(|x| x.0 == *stream) {
            Some(x) => {
                x.1 += waiting.as_secs_f64();
                x.2 += busy.as_secs_f64();
            }
            None => out.push((stream, waiting.as_secs_f64(), busy.as_secs_f64())),
        }
    }
    out
}

fn summary<B: Backend>(
    json_out: bool,
    plan: &Plan,
    trainer: &Trainer<B>,
    reports: &[StepReport],
    val: Option<&(u64, f64)>,
) {
    let memory = trainer.backend.memory();
    let waits = waits_by_stream(reports);
    let total: f64 = reports.iter().map(|r| r.time.as_secs_f64()).sum();
    let tokens = plan.tokens_per_step() as f64 * reports.len() as f64;
    let ranks = f64::from(plan.ranks());
    if json_out {
        let s = json!({"summary": {
            "schedule": plan.job.schedule.name,
            "steps": reports.len(),
            "first_loss": reports.first().map(|r| r.loss),
            "final_loss": reports.last().map(|r| r.loss),
            "val_loss": val.map(|v| v.1),
            "time_s": total,
            "tokens_per_s": tokens / total.max(1e-9),
            "memory_per_rank": memory.iter().map(|m| json!({
                "rank": m.rank, "planned_bytes": plan.program.arena_bytes,
                "allocated_bytes": m.allocated, "peak_touched_bytes": m.touched})).collect::<Vec<_>>(),
            "streams": waits.iter().map(|(s, w, b)| json!({
                "name": s, "waiting_s_per_rank": w / ranks, "busy_s_per_rank": b / ranks,
                "waiting_share": w / (w + b).max(1e-12)})).collect::<Vec<_>>(),
        }});
        println!("{s}");
        return;
    }
    let (Some(first), Some(last)) = (reports.first(), reports.last()) else {
        return;
    };
    eprintln!(
        "\n{} steps in {:.2} s ({:.0} tokens/s); loss {:.4} -> {:.4}",
        reports.len(),
        total,
        tokens / total.max(1e-9),
        first.loss,
        last.loss
    );
    if let Some((step, v)) = val {
        eprintln!("validation loss {v:.4} after step {step}");
    }
    eprintln!("memory per rank (bytes):   planned      allocated    peak touched");
    for m in &memory {
        eprintln!(
            "  rank {:<4}            {:>12} {:>12} {:>12}",
            m.rank, plan.program.arena_bytes, m.allocated, m.touched
        );
    }
    eprintln!("streams (seconds per rank): waiting       busy   waiting share");
    for (s, w, b) in &waits {
        eprintln!(
            "  {:<10}              {:>8.3} {:>10.3}   {:>5.1}%",
            s,
            w / ranks,
            b / ranks,
            100.0 * w / (w + b).max(1e-12)
        );
    }
}
