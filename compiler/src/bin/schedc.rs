//! `schedc`: the command line of the schedule compiler (`docs/cli.md`).
//!
//! Exit status: 0 success (warnings allowed), 1 errors in the input or a failed check, 2 any other
//! failure (a file that cannot be read or written). Results go to stdout, diagnostics to stderr.

use clap::{Parser, Subcommand};
use codespan_reporting::term::termcolor::{ColorChoice, StandardStream};
use schedc::emit::job::{emit_job, thousands};
use schedc::{analyze, Analysis, FsLoader};
use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;

#[derive(Parser)]
#[command(
    name = "schedc",
    version,
    about = "Compile, check, simulate and format sharded data-parallel training schedules"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Parse, resolve imports and validate; print one line per schedule with its ranks and parameters.
    Check {
        #[arg(required = true)]
        files: Vec<PathBuf>,
        /// Also print each resolved job: every default, preset and unit made explicit, layer by layer.
        #[arg(long)]
        resolved: bool,
    },
    /// Lower a schedule to a stream program, plan its memory, verify it, and write it out.
    Compile {
        file: PathBuf,
        /// Which schedule, when the file defines several.
        #[arg(long)]
        schedule: Option<String>,
        /// Output file (default: NAME.plan.json for plans, stdout for listings, stats and diagrams).
        #[arg(short, long)]
        output: Option<PathBuf>,
        /// What to write.
        #[arg(long, value_enum, default_value = "plan")]
        emit: Emit,
        /// Print how long each pass took, on stderr.
        #[arg(long)]
        time_passes: bool,
    },
    /// Re-run every proof of the lowering spec on a plan file.
    Verify { plan: PathBuf },
    /// Predict one step's time, MFU and memory by simulating the compiled program.
    Simulate {
        /// A `.sched` file (compiled on the fly) or a plan file (JSON, from `schedc compile`).
        file: PathBuf,
        /// Which schedule, when the file defines several.
        #[arg(long)]
        schedule: Option<String>,
        /// Also write the simulated step as a Chrome/Perfetto trace to this file.
        #[arg(long, value_name = "OUT.json")]
        trace: Option<PathBuf>,
        /// Print cli.md's JSON object instead of the table.
        #[arg(long)]
        json: bool,
    },
    /// Search sharding factors and knobs for the fastest schedule that fits in GPU memory.
    ///
    /// The schedule named (or the file's only one) fixes the model, cluster, nodes and GPUs used,
    /// micro-steps, recompute, streams, overlap and training settings; the search chooses the
    /// three shard meshes, reshard_after_forward, grad_sync, all_gather, prefetch depths and
    /// bucket sizes.
    Plan {
        file: PathBuf,
        /// Which schedule to start from, when the file defines several.
        #[arg(long)]
        schedule: Option<String>,
        /// How many schedules to list.
        #[arg(long, default_value_t = 5)]
        top: usize,
        /// Print a JSON list with a `.sched` fragment for each schedule instead of a table.
        #[arg(long)]
        json: bool,
        /// Keep the starting schedule's prefetch depths and bucket sizes instead of tuning them.
        #[arg(long)]
        no_tune: bool,
    },
    /// Write a `model` block from another tool's description of a model.
    Import {
        #[command(subcommand)]
        from: Import,
    },
    /// Rewrite files in canonical layout, keeping comments.
    Fmt {
        #[arg(required = true)]
        files: Vec<PathBuf>,
        /// Only report files that are not formatted (exit 1 if any); change nothing.
        #[arg(long)]
        check: bool,
    },
}

#[derive(Subcommand)]
enum Import {
    /// A Hugging Face `config.json` (GPT-2, LLaMA or Mistral families): every field is mapped or
    /// refused by name, so the parameter count `schedc check` prints is the checkpoint's.
    Hf {
        config: PathBuf,
        /// The model's name in the block.
        #[arg(long, default_value = "imported")]
        name: String,
        /// Write the block to this file (default: stdout); nothing is written on an error.
        #[arg(short, long)]
        output: Option<PathBuf>,
    },
}

#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum Emit {
    Plan,
    Listing,
    /// Per stream and per layer: ops by kind, collectives, waits, hashes of the program and of
    /// the memory plan (what the snapshot tests pin for programs too large to list).
    Summary,
    Stats,
    /// The simulated step as an SVG: a row per pipeline stage, time across, one box per action
    /// coloured by micro-batch (F light, B dark and hatched).
    Diagram,
    /// The plan file and, beside it, the step's generated kernels as PTX for each GPU
    /// architecture (`NAME.sm_80.ptx`, `NAME.sm_90.ptx`); needs a build with `--features llvm`.
    Ptx,
}

/// Outcome of a command: the worst status seen.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Status {
    Ok = 0,
    BadInput = 1,
    Fault = 2,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let status = match cli.command {
        Command::Check { files, resolved } => files.iter().map(|f| check(f, resolved)).max(),
        Command::Fmt { files, check } => files.iter().map(|f| fmt(f, check)).max(),
        Command::Import {
            from:
                Import::Hf {
                    config,
                    name,
                    output,
                },
        } => Some(import_hf(&config, &name, output.as_deref())),
        Command::Compile {
            file,
            schedule,
            output,
            emit,
            time_passes,
        } => Some(compile(
            &file,
            schedule.as_deref(),
            output,
            emit,
            time_passes,
        )),
        Command::Verify { plan } => Some(verify(&plan)),
        Command::Simulate {
            file,
            schedule,
            trace,
            json,
        } => Some(simulate(&file, schedule.as_deref(), trace.as_deref(), json)),
        Command::Plan {
            file,
            schedule,
            top,
            json,
            no_tune,
        } => Some(plan(&file, schedule.as_deref(), top, json, !no_tune)),
    };
    ExitCode::from(status.unwrap_or(Status::Ok) as u8)
}

fn stderr() -> StandardStream {
    let choice = if std::io::stderr().is_terminal() {
        ColorChoice::Auto
    } else {
        ColorChoice::Never
    };
    StandardStream::stderr(choice)
}

/// Analyses `file` and prints its diagnostics; the analysis when it has no errors.
fn analyze_and_report(file: &Path) -> Result<Analysis, Status> {
    let analysis = analyze(file, &FsLoader).map_err(|e| {
        eprintln!("error: {e}");
        Status::Fault
    })?;
    analysis.sources.emit(&mut stderr(), &analysis.diagnostics);
    if analysis.has_errors() {
        return Err(Status::BadInput);
    }
    Ok(analysis)
}

fn check(file: &Path, resolved: bool) -> Status {
    let analysis = match analyze_and_report(file) {
        Ok(a) => a,
        Err(status) => return status,
    };
    let mut out = std::io::stdout().lock();
    for job in &analysis.jobs {
        let s = &job.schedule;
        let _ = writeln!(
            out,
            "{}: {} ranks ({} x {}), model {} with {} parameters, cluster {}",
            s.name,
            job.ranks(),
            plural(s.nodes, "node"),
            plural(s.gpus_per_node, "GPU"),
            job.model.name,
            thousands(job.model.parameters()),
            job.cluster.name
        );
        if resolved {
            let _ = writeln!(out, "\n{}", emit_job(job));
        }
    }
    if analysis.jobs.is_empty() {
        let models: Vec<&str> = analysis.models.iter().map(|m| m.name.as_str()).collect();
        let clusters: Vec<&str> = analysis.clusters.iter().map(|c| c.name.as_str()).collect();
        let _ = writeln!(
            out,
            "{}: no schedule (models: {}; clusters: {})",
            file.display(),
            if models.is_empty() {
                "none".into()
            } else {
                models.join(", ")
            },
            if clusters.is_empty() {
                "none".into()
            } else {
                clusters.join(", ")
            }
        );
    }
    Status::Ok
}

/// Refuses a job that checks but asks for what is not lowered yet (tensor parallelism), with
/// its error at the span that asks for it.
fn lowerable(analysis: &Analysis, job: &schedc::Job) -> Result<(), Status> {
    match analysis.not_lowered(job) {
        Some(d) => {
            analysis
                .sources
                .emit(&mut stderr(), std::slice::from_ref(d));
            Err(Status::BadInput)
        }
        None => Ok(()),
    }
}

fn compile(
    file: &Path,
    schedule: Option<&str>,
    output: Option<PathBuf>,
    emit: Emit,
    time_passes: bool,
) -> Status {
    let analysis = match analyze_and_report(file) {
        Ok(a) => a,
        Err(status) => return status,
    };
    let job = match analysis.select(schedule) {
        Ok(j) => j,
        Err(e) => {
            eprintln!("error: {}: {e}", file.display());
            return Status::BadInput;
        }
    };
    if let Err(status) = lowerable(&analysis, job) {
        return status;
    }
    let mut times = schedc::pipeline::PassTimes::default();
    // The plan file is written out beside the final verification, and kept only if it passes.
    let plan_text = |p: &sched_ir::ir::Program| {
        let plan = sched_ir::plan_file::emit_plan(p, job);
        serde_json::to_string(&plan).expect("plans serialise") + "\n"
    };
    let compiled = match emit {
        Emit::Plan | Emit::Ptx => schedc::compile_emitting(job, &mut times, |p| Some(plan_text(p))),
        _ => schedc::compile_timed(job, &mut times).map(|program| (program, None)),
    };
    if time_passes {
        for (name, t) in &times.0 {
            eprintln!("{name:>16}  {:>10.3} ms", t.as_secs_f64() * 1e3);
        }
    }
    let (program, plan) = match compiled {
        Ok(x) => x,
        Err(schedc::CompileError::Lower(e)) => {
            eprintln!(
                "error: schedule `{}` cannot be lowered: {e}",
                job.schedule.name
            );
            return Status::BadInput;
        }
        Err(e @ schedc::CompileError::TensorNotLowered(..)) => {
            eprintln!("error: schedule `{}`: {e}", job.schedule.name);
            return Status::BadInput;
        }
        Err(schedc::CompileError::Pass {
            pass,
            program,
            errors,
        }) => {
            let what = format!(
                "the program for `{}` is malformed after the {pass} pass",
                job.schedule.name
            );
            return report_broken(&what, &program, &errors, Status::Fault);
        }
        Err(schedc::CompileError::Verify(sched_verify::Rejected { program, errors })) => {
            // A custom pipeline order is lowered as written: its refusal is the input's fault.
            let custom = job.schedule.pipeline.schedule == sched_ir::job::PipelineSchedule::Custom;
            let what = schedc::load::refused(&job.schedule.name, custom);
            let status = if custom {
                Status::BadInput
            } else {
                Status::Fault
            };
            return report_broken(&what, &program, &errors, status);
        }
    };
    let text = match emit {
        Emit::Plan | Emit::Ptx => plan.expect("written beside verification"),
        Emit::Listing => sched_ir::listing::emit_listing(&program),
        Emit::Summary => schedc::emit::summary::emit_summary(&program),
        Emit::Diagram => schedc::emit::diagram::emit_diagram(&program, job),
        Emit::Stats => {
            serde_json::to_string_pretty(&schedc::emit::stats::emit_stats(job, &program))
                .expect("stats serialise")
                + "\n"
        }
    };
    let target = match (output, emit) {
        (Some(o), _) => o,
        (None, Emit::Plan | Emit::Ptx) => PathBuf::from(format!("{}.plan.json", job.schedule.name)),
        (None, _) => {
            print!("{text}");
            return Status::Ok;
        }
    };
    let mut files = vec![];
    if emit == Emit::Ptx {
        match ptx_modules(job, &target) {
            Ok(modules) => files = modules,
            Err(e) => {
                eprintln!("error: {e}");
                return Status::Fault;
            }
        }
    }
    files.push((target, text));
    for (path, text) in &files {
        if let Err(e) = write_atomically(path, text) {
            eprintln!("error: cannot write {}: {e}", path.display());
            return Status::Fault;
        }
        eprintln!("wrote {}", path.display());
    }
    Status::Ok
}

/// Says that a program is broken: `what`, its error count and the first 20 errors in their
/// context; returns `status` (a fault when the compiler made it, bad input when a file did).
fn report_broken(
    what: &str,
    program: &sched_ir::ir::Program,
    errors: &[sched_verify::VerifyError],
    status: Status,
) -> Status {
    eprintln!("error: {what} ({} errors):\n", errors.len());
    eprint!(
        "{}",
        sched_verify::render_context(program, &errors[..errors.len().min(20)], 3)
    );
    status
}

/// The job's kernels as PTX, one module per architecture, named after the plan file
/// (`sched_kernels::ptx_path`: `x.plan.json` gives `x.sm_80.ptx`); all generated before
/// anything is written.
#[cfg(feature = "llvm")]
fn ptx_modules(
    job: &schedc::Job,
    plan: &Path,
) -> Result<Vec<(PathBuf, String)>, sched_kernels::codegen::CodegenError> {
    use sched_kernels::codegen::{ptx, SMS};
    let kernels = sched_kernels::for_job(job);
    SMS.iter()
        .map(|&sm| Ok((sched_kernels::ptx_path(plan, sm), ptx(&kernels, sm)?)))
        .collect()
}

/// `--emit ptx` from a schedc without code generation.
#[cfg(not(feature = "llvm"))]
#[derive(Debug)]
struct NoCodegen;

#[cfg(not(feature = "llvm"))]
impl std::fmt::Display for NoCodegen {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("--emit ptx needs schedc built with `--features llvm` (LLVM 19)")
    }
}

#[cfg(not(feature = "llvm"))]
fn ptx_modules(_: &schedc::Job, _: &Path) -> Result<Vec<(PathBuf, String)>, NoCodegen> {
    Err(NoCodegen)
}

fn verify(path: &Path) -> Status {
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("error: cannot read {}: {e}", path.display());
            return Status::Fault;
        }
    };
    let plan = match sched_ir::plan_file::read_plan(&text) {
        Ok(p) => p,
        Err(e) => {
            eprintln!("error: {}: {e}", path.display());
            return Status::BadInput;
        }
    };
    match sched_verify::verify(plan.program) {
        Ok(p) => {
            println!(
                "{}: verified: {} ops on {} streams, {} buffers, {} events, arena {} B per rank",
                path.display(),
                p.ops.len(),
                p.streams.len(),
                p.buffers.len(),
                p.events.len(),
                thousands(p.arena_bytes)
            );
            Status::Ok
        }
        Err(sched_verify::Rejected { program, errors }) => {
            let what = format!("{} fails verification", path.display());
            report_broken(&what, &program, &errors, Status::BadInput)
        }
    }
}

/// A verified program with its job: from a plan file, or compiled from a `.sched` file (whose
/// diagnostics are printed), through the shared loader.
fn load_program(
    file: &Path,
    schedule: Option<&str>,
) -> Result<(sched_verify::Verified, schedc::Job), Status> {
    match schedc::load::load(file, schedule) {
        Ok(loaded) => {
            if let Some(a) = &loaded.analysis {
                a.sources.emit(&mut stderr(), &a.diagnostics);
            }
            Ok((loaded.program, loaded.job))
        }
        Err(schedc::load::LoadError::Diagnostics(a)) => {
            a.sources.emit(&mut stderr(), &a.diagnostics);
            Err(Status::BadInput)
        }
        Err(e) => {
            eprint!("error: {}", e.render(20, 3));
            if !matches!(
                e,
                schedc::load::LoadError::Unverified { .. }
                    | schedc::load::LoadError::Compile {
                        error: schedc::CompileError::Verify(..),
                        ..
                    }
            ) {
                eprintln!();
            }
            Err(if e.is_input() {
                Status::BadInput
            } else {
                Status::Fault
            })
        }
    }
}

fn simulate(file: &Path, schedule: Option<&str>, trace: Option<&Path>, json: bool) -> Status {
    let (program, job) = match load_program(file, schedule) {
        Ok(x) => x,
        Err(status) => return status,
    };
    let report = match trace {
        Some(path) => {
            let (report, trace) = schedc::sim::simulate_traced(&program, &job);
            let text = serde_json::to_string(&trace).expect("traces serialise") + "\n";
            if let Err(e) = write_atomically(path, &text) {
                eprintln!("error: cannot write {}: {e}", path.display());
                return Status::Fault;
            }
            eprintln!("wrote {}", path.display());
            report
        }
        None => schedc::sim::simulate(&program, &job),
    };
    if json {
        println!(
            "{}",
            serde_json::to_string_pretty(&report).expect("reports serialise")
        );
    } else {
        print!("{}", simulation_table(&report));
    }
    Status::Ok
}

/// The human-readable summary of a simulated step.
fn simulation_table(r: &schedc::sim::SimReport) -> String {
    let gib = |b: u64| b as f64 / f64::from(1u32 << 30);
    let mut out = format!(
        "schedule {}: {} ranks ({} simulated)\n",
        r.schedule, r.ranks, r.simulated_ranks
    );
    let rows = [
        ("step time", format!("{:.3} ms", r.step_time_s * 1e3)),
        ("compute", format!("{:.3} ms", r.compute_s * 1e3)),
        (
            "exposed comm",
            format!(
                "{:.3} ms ({:.1}% of the step)",
                r.exposed_comm_s * 1e3,
                100.0 * r.exposed_comm_s / r.step_time_s.max(f64::MIN_POSITIVE)
            ),
        ),
        ("MFU", format!("{:.1}%", r.mfu * 100.0)),
        ("TFLOPS per GPU", format!("{:.1}", r.tflops_per_gpu)),
        ("tokens/GPU/s", format!("{:.1}", r.tokens_per_gpu_per_s)),
        (
            "memory",
            format!(
                "{:.2} GiB of {:.2} GiB per GPU ({})",
                gib(r.peak_memory_bytes),
                gib(r.gpu_memory_bytes),
                if r.fits { "fits" } else { "does NOT fit" }
            ),
        ),
    ];
    for (k, v) in rows {
        out += &format!("  {k:<16}{v}\n");
    }
    if let Some(g) = &r.ranges {
        out += &format!(
            "  under contention {:.2}–{:.2} (default {:.3}) per overlapping collective:\n",
            g.contention_range[0], g.contention_range[1], g.contention
        );
        let ranges = [
            (
                "step time",
                format!(
                    "{:.3}–{:.3} ms",
                    g.step_time_s[0] * 1e3,
                    g.step_time_s[1] * 1e3
                ),
            ),
            (
                "MFU",
                format!("{:.1}–{:.1}%", g.mfu[0] * 100.0, g.mfu[1] * 100.0),
            ),
        ];
        for (k, v) in ranges {
            out += &format!("    {k:<14}{v}\n");
        }
    }
    let share = |t: f64| 100.0 * t / r.step_time_s.max(f64::MIN_POSITIVE);
    if let Some(bubble) = r.bubble {
        out += &format!(
            "  pipeline bubble {:.1}% (mean over {} stages of 1 - compute busy / step)\n",
            bubble * 100.0,
            r.stages.len()
        );
        out += "  stages busy:\n";
        for s in &r.stages {
            out += &format!(
                "    stage {:<6}{:>12.3} ms  {:>5.1}%   bubble {:>5.1}%\n",
                s.stage,
                s.busy_s * 1e3,
                share(s.busy_s),
                s.bubble * 100.0
            );
        }
    }
    out += "  streams busy:\n";
    // A pipeline's streams stage by stage, each named with its stage.
    let mut streams: Vec<(String, &schedc::sim::StreamBusy)> = r
        .streams
        .iter()
        .map(|s| match s.stage {
            Some(stage) => (format!("stage {stage} {}", s.name), s),
            None => (s.name.clone(), s),
        })
        .collect();
    streams.sort_by_key(|(_, s)| s.stage);
    let width = streams
        .iter()
        .map(|(n, _)| n.len() + 2)
        .fold(12, usize::max);
    for (name, s) in streams {
        out += &format!(
            "    {name:<width$}{:>12.3} ms  {:>5.1}%\n",
            s.busy_s * 1e3,
            share(s.busy_s)
        );
    }
    out
}

fn plan(file: &Path, schedule: Option<&str>, top: usize, json: bool, tune_knobs: bool) -> Status {
    let analysis = match analyze_and_report(file) {
        Ok(a) => a,
        Err(status) => return status,
    };
    let base = match analysis.select(schedule) {
        Ok(j) => j,
        Err(e) => {
            eprintln!("error: {}: {e}", file.display());
            return Status::BadInput;
        }
    };
    if let Err(status) = lowerable(&analysis, base) {
        return status;
    }
    if top == 0 {
        eprintln!("error: --top must be at least 1");
        return Status::BadInput;
    }
    let options = schedc::planner::Options {
        top,
        tune_knobs,
        ..Default::default()
    };
    let bar = std::io::stderr().is_terminal().then(|| {
        let bar = indicatif::ProgressBar::new(0);
        bar.set_style(
            indicatif::ProgressStyle::with_template(
                "{spinner} searching [{bar:30}] {pos}/{len} structures  {msg}",
            )
            .expect("a valid template")
            .progress_chars("=> "),
        );
        bar
    });
    let progress = |p: schedc::planner::Progress| {
        if let Some(bar) = &bar {
            bar.set_length(p.total as u64);
            bar.set_position(p.settled as u64);
            if let Some(best) = p.best_s {
                bar.set_message(format!("best {best:.3} s"));
            }
        }
    };
    let result = schedc::planner::plan(base, &options, &progress);
    if let Some(bar) = &bar {
        bar.finish_and_clear();
    }
    let result = match result {
        Ok(r) => r,
        Err(e) => {
            eprintln!("error: {e}");
            return Status::Fault;
        }
    };
    if json {
        let list = schedc::planner::output::json(base, &result);
        println!(
            "{}",
            serde_json::to_string_pretty(&list).expect("plans serialise")
        );
    } else {
        print!("{}", schedc::planner::output::table(base, &result));
    }
    Status::Ok
}

fn plural(n: u32, word: &str) -> String {
    format!("{n} {word}{}", if n == 1 { "" } else { "s" })
}

/// `schedc import hf`: the model block of `config`, on stdout or into `output`.
fn import_hf(config: &Path, name: &str, output: Option<&Path>) -> Status {
    let is_name = name
        .chars()
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
    if !is_name {
        eprintln!("error: --name `{name}` is not an identifier (letters, digits and _, not starting with a digit)");
        return Status::BadInput;
    }
    let text = match std::fs::read_to_string(config) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("error: cannot read {}: {e}", config.display());
            return Status::Fault;
        }
    };
    let block = match schedc::hf::model_from_config(&text, name) {
        Ok(b) => b,
        Err(e) => {
            eprintln!("error: {}: {e}", config.display());
            return Status::BadInput;
        }
    };
    match output {
        None => {
            print!("{block}");
            Status::Ok
        }
        Some(path) => match write_atomically(path, &block) {
            Ok(()) => Status::Ok,
            Err(e) => {
                eprintln!("error: cannot write {}: {e}", path.display());
                Status::Fault
            }
        },
    }
}

fn fmt(file: &Path, check_only: bool) -> Status {
    let text = match std::fs::read_to_string(file) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("error: cannot read {}: {e}", file.display());
            return Status::Fault;
        }
    };
    let mut sources = sched_grammar::SourceMap::new();
    let id = sources.add(file.display().to_string(), file, text);
    let parsed = sched_grammar::parse(id, &sources.get(id).text);
    if !parsed.errors.is_empty() {
        sources.emit(&mut stderr(), &parsed.errors);
        return Status::BadInput;
    }
    let text = &sources.get(id).text;
    let formatted = sched_grammar::fmt::format(text, &parsed.file);
    if formatted == *text {
        return Status::Ok;
    }
    if check_only {
        println!("{}: not formatted", file.display());
        return Status::BadInput;
    }
    match write_atomically(file, &formatted) {
        Ok(()) => Status::Ok,
        Err(e) => {
            eprintln!("error: cannot write {}: {e}", file.display());
            Status::Fault
        }
    }
}

/// Writes without leaving a half-written file (see [`sched_ir::files`]).
fn write_atomically(path: &Path, text: &str) -> std::io::Result<()> {
    sched_ir::files::write_atomically(path, text.as_bytes())
}
