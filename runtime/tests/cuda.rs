//! CUDA twins of the CPU backend's tests: they run only where the CUDA backend is built
//! (`--features cuda`) and a GPU with its libraries is present, and otherwise pass after saying
//! why they skipped (`SKIPPED …`), or fail where `SCHED_REQUIRE` has `gpu`.
//!
//! - Parity at world size 1: the tiny models' losses over 20 fp32 steps on the CUDA backend match
//!   the CPU backend's within 1e-4 relative, and the final weights within 1e-3; the device arena
//!   is exactly the plan's `arena_bytes`.
//! - bf16 parity: bf16 twins of the tiny models (one with a 259-word vocabulary and a 172-wide
//!   SwiGLU, whose products go through padded rows) within 2e-2 of the CPU backend's losses over
//!   20 steps (written after the first GPU session; it has not run on a GPU yet).
//! - The fused attention kernels (forward and backward) against the chunked path on the GPU
//!   (`flash_attention_kernel_matches_the_chunked_path`; written without a GPU, not yet run on
//!   one).
//! - A step timed op by op with CUDA events (`RunOptions::time_ops`, `schedrun --trace`): one span
//!   per op, each stream's in issue order (written without a GPU, not yet run on one).
//! - `gpt2_small_step_mfu` (ignored): a GPT-2-small step on one GPU, reporting step time, MFU and
//!   the losses of the timed steps; with `SCHED_TRACE_DIR`, one more step traced op by op there
//!   (`gpt2_small.trace.json`, Perfetto).
//!
//! The CUDA backend loads each plan's kernels from PTX (`schedc compile --emit ptx`); the device
//! machine has no LLVM, so `write_the_gpu_tests_ptx` (`--features llvm`, ignored; run by
//! `runtime/gpu/build.sh`) writes the modules of every job here into `$SCHED_PTX_DIR`, where the
//! GPU tests read them.

mod common;

use common::{plan_of, train};
use cranelift_entity::EntityRef;
use schedc::sema::Loader;
use schedc::{analyze, Job};
use schedrun::backend::cpu::CpuBackend;
use schedrun::backend::cuda::launch::DistEnv;
use schedrun::backend::cuda::{self, CudaBackend, PtxFiles};
use schedrun::backend::{Backend, RunOptions};
use schedrun::data::Corpus;
use schedrun::plan::Plan;
use schedrun::train::Trainer;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Whether the CUDA backend can run here; says why not (`schedc::testing::skip`, which fails
/// where `SCHED_REQUIRE` has `gpu`, as the GPU checklist's parity step sets).
#[track_caller]
fn gpu() -> bool {
    match cuda::probe() {
        Ok(()) => true,
        Err(e) => {
            schedc::testing::skip("gpu", &format!("no GPU run possible here: {e}"));
            false
        }
    }
}

/// Where the GPU tests find a job's PTX: `$SCHED_PTX_DIR/NAME.sm_XX.ptx` (else a folder under
/// the temporary directory), as if beside a plan file `NAME.plan.json` there.
fn ptx(job: &Job) -> PtxFiles {
    let dir = std::env::var_os("SCHED_PTX_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| std::env::temp_dir().join("sched-gpu-tests-ptx"));
    PtxFiles::BesidePlan(dir.join(format!("{}.plan.json", job.schedule.name)))
}

struct Overlay {
    root: PathBuf,
    text: String,
}

impl Loader for Overlay {
    fn read(&self, path: &Path) -> std::io::Result<String> {
        if self.identity(path) == self.root {
            Ok(self.text.clone())
        } else {
            std::fs::read_to_string(path)
        }
    }
}

fn jobs(text: &str) -> Vec<Job> {
    let schedules = Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .join("schedules");
    let root = schedules.join("generated_cuda_tests.sched");
    let a = analyze(
        &root,
        &Overlay {
            root: root.clone(),
            text: text.to_string(),
        },
    )
    .unwrap();
    assert!(!a.has_errors(), "{}", a.render());
    a.jobs.clone()
}

/// One-rank schedules of both tiny models (fp32), with flash and naive attention.
const TINY: &str = r#"
import "models/tiny.sched"
import "clusters/cpu.sched"
schedule gpt_ddp1 { model = tiny_gpt  cluster = cpu4  gpus_per_node = 1  preset = ddp  train { lr = 1e-3  seed = 3 } }
schedule gpt_ddp1_m2 { model = tiny_gpt  cluster = cpu4  gpus_per_node = 1  preset = ddp  micro_steps = 2  recompute = full  train { lr = 1e-3  seed = 3 } }
schedule llama_ddp1 { model = tiny_llama  cluster = cpu4  gpus_per_node = 1  preset = ddp  train { lr = 1e-3  seed = 3 } }
"#;

/// bf16 twins of the tiny models, one-rank: the GPT with flash attention; the LLaMA-style one with
/// a 259-word vocabulary and a 172-wide SwiGLU (widths that are not a multiple of 8: its head and
/// MLP products go through padded rows) and naive attention; and a LLaMA-style block with two
/// query heads of 128 sharing one kv head (the fused attention's widest heads).
const BF16: &str = r#"
import "clusters/cpu.sched"
model gpt_bf16 {
    dtype = bf16  optimizer = adamw  seq_len = 64  micro_batch = 2
    layer embed    = embedding(vocab = 256, hidden = 64, positions = learned)
    layer block[2] = transformer(hidden = 64, heads = 4, ffn = 256)
    layer head     = lm_head(hidden = 64, vocab = 256, tied = true)
}
model llama_bf16 {
    dtype = bf16  optimizer = adamw  seq_len = 64  micro_batch = 2
    layer embed    = embedding(vocab = 259, hidden = 64, positions = rope)
    layer block[2] = transformer(hidden = 64, heads = 4, kv_heads = 2, ffn = 172, norm = rmsnorm,
                                 act = swiglu, bias = false, attention = naive)
    layer head     = lm_head(hidden = 64, vocab = 259, norm = rmsnorm)
}
model wide_bf16 {
    dtype = bf16  optimizer = adamw  seq_len = 64  micro_batch = 2
    layer embed    = embedding(vocab = 256, hidden = 256, positions = rope)
    layer block[1] = transformer(hidden = 256, heads = 2, kv_heads = 1, ffn = 512, norm = rmsnorm,
                                 act = swiglu, bias = false)
    layer head     = lm_head(hidden = 256, vocab = 256, norm = rmsnorm)
}
schedule gpt_bf16_ddp1 { model = gpt_bf16  cluster = cpu4  gpus_per_node = 1  preset = ddp  train { lr = 1e-3  seed = 3 } }
schedule llama_bf16_ddp1 { model = llama_bf16  cluster = cpu4  gpus_per_node = 1  preset = ddp  train { lr = 1e-3  seed = 3 } }
schedule wide_bf16_ddp1 { model = wide_bf16  cluster = cpu4  gpus_per_node = 1  preset = ddp  train { lr = 1e-3  seed = 3 } }
"#;

/// Every job the GPU tests run.
fn all_jobs() -> Vec<Job> {
    [TINY, BF16, GPT2].into_iter().flat_map(jobs).collect()
}

fn env1() -> DistEnv {
    DistEnv {
        rank: 0,
        world: 1,
        local_rank: 0,
        master_addr: "127.0.0.1".into(),
        master_port: 0,
    }
}

const GPT2: &str = r#"
import "models/gpt2.sched"
import "clusters/h100.sched"
schedule gpt2_1gpu { model = gpt2  cluster = h100_400g  nodes = 1  gpus_per_node = 1  preset = ddp  train { lr = 1e-4  seed = 0 } }
"#;

/// Runs everywhere: the schedules the GPU tests use compile to one-rank plans (so a GPU session
/// does not find a typo first), and the plan's communicator keys and hash are well defined.
#[test]
fn the_gpu_tests_schedules_compile_to_one_rank() {
    for job in all_jobs() {
        let plan = plan_of(&job);
        assert_eq!(plan.ranks(), 1, "{}", job.schedule.name);
        assert_eq!(cuda::plan_hash(&plan), cuda::plan_hash(&plan_of(&job)));
    }
}

/// Not a check: writes the PTX of every job the GPU tests run, for both architectures, into
/// `$SCHED_PTX_DIR`, so that a device machine without LLVM can run them.
#[cfg(feature = "llvm")]
#[test]
#[ignore = "writes files: runtime/gpu/build.sh runs it"]
fn write_the_gpu_tests_ptx() {
    use sched_kernels::codegen::{ptx as emit_ptx, SMS};
    for job in all_jobs() {
        let kernels = sched_kernels::for_job(&job);
        let files = ptx(&job);
        for sm in SMS {
            let path = files.path(sm);
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            std::fs::write(&path, emit_ptx(&kernels, sm).unwrap()).unwrap();
            println!("wrote {}", path.display());
        }
    }
}

/// Runs everywhere: a sharded plan needs one communicator per group and stream, and every rank
/// belongs to exactly one group of each communicator it uses.
#[test]
fn comm_keys_cover_every_group_and_stream() {
    let job = jobs(
        r#"
import "models/tiny.sched"
import "clusters/cpu.sched"
schedule m { model = tiny_gpt  cluster = cpu2x2  preset = mics(partition = 2) }
"#,
    )
    .remove(0);
    let plan = plan_of(&job);
    let keys = cuda::comm_keys(&plan);
    assert!(!keys.is_empty());
    let mut sorted = keys.clone();
    sorted.sort();
    sorted.dedup();
    assert_eq!(sorted, keys, "sorted and unique");
    for k in &keys {
        let groups = plan
            .program
            .comms
            .values()
            .nth(k.comm as usize)
            .unwrap()
            .groups
            .len();
        assert!((k.group as usize) < groups);
    }
    for r in 0..plan.ranks() {
        let mine = cuda::rank_keys(&plan, r);
        let mut pairs: Vec<(u32, u32)> = mine.iter().map(|k| (k.comm, k.stream)).collect();
        let n = pairs.len();
        pairs.dedup();
        assert_eq!(
            pairs.len(),
            n,
            "rank {r}: one group per communicator and stream"
        );
    }
}

/// Runs everywhere: a pipeline's send and its receive are issued on different stages' streams,
/// and must meet on one NCCL communicator: the key both ends compute for each transfer is the
/// same, and each rank joins only the groups it is a member of.
#[test]
fn the_two_ends_of_a_transfer_share_their_communicator() {
    let job = jobs(
        r#"
import "models/tiny.sched"
import "clusters/cpu.sched"
schedule m {
    model = tiny_llama  cluster = cpu4  micro_steps = 4  preset = zero1
    pipeline { stages = 2  layers = [2, 2] }
}
"#,
    )
    .remove(0);
    let plan = plan_of(&job);
    let p = &plan.program;
    let mut ends: std::collections::BTreeMap<u32, [std::collections::BTreeSet<u32>; 2]> =
        Default::default();
    for op in p.ops.values() {
        for c in op.collectives() {
            let side = match c.kind {
                sched_ir::job::Collective::Send => 0,
                sched_ir::job::Collective::Recv => 1,
                _ => continue,
            };
            ends.entry(c.comm.as_u32()).or_default()[side]
                .insert(cuda::comm_stream(&plan, op.stream));
        }
    }
    assert_eq!(ends.len(), 2, "one communicator each way");
    for (comm, [sends, recvs]) in &ends {
        assert_eq!(
            sends, recvs,
            "comm{comm}: both ends' streams name one communicator"
        );
    }
    for r in 0..plan.ranks() {
        for k in cuda::rank_keys(&plan, r) {
            let groups = &p.comms.values().nth(k.comm as usize).unwrap().groups;
            assert!(
                groups[k.group as usize].contains(&r),
                "rank {r} joins {k:?}"
            );
        }
    }
}

/// Each one-rank job of `schedules` trained 20 steps on the GPU and on the CPU backend: losses
/// within `loss_tol` relative, final weights within `weight_tol` (when given), and the device
/// arena exactly the plan's.
fn one_gpu_matches_the_cpu_backend(schedules: &str, loss_tol: f64, weight_tol: Option<f32>) {
    for job in jobs(schedules) {
        let name = job.schedule.name.clone();
        let plan = plan_of(&job);
        let want = train(
            plan.clone(),
            CpuBackend::new(plan.clone(), RunOptions::default()),
            20,
        );
        let backend = CudaBackend::new(plan.clone(), RunOptions::default(), &env1(), &ptx(&job))
            .unwrap_or_else(|e| {
                panic!("{name}: {e} (runtime/gpu/build.sh writes these tests' PTX)")
            });
        let got = train(plan.clone(), backend, 20);
        for (i, (g, w)) in got.0.iter().zip(&want.0).enumerate() {
            assert!(
                (g - w).abs() <= loss_tol * w.abs(),
                "{name}: step {}: cuda loss {g}, cpu loss {w}",
                i + 1
            );
        }
        if let Some(tol) = weight_tol {
            let worst = got
                .1
                .iter()
                .zip(&want.1)
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            assert!(worst <= tol, "{name}: final weights differ by {worst}");
        }
        let allocated: Vec<u64> = got.2.backend.memory().iter().map(|m| m.allocated).collect();
        assert_eq!(
            allocated,
            vec![plan.program.arena_bytes],
            "{name}: the device arena is the plan's"
        );
    }
}

/// The fp32 tiny models: losses within 1e-4, final weights within 1e-3.
#[test]
fn tiny_models_on_one_gpu_match_the_cpu_backend() {
    if gpu() {
        one_gpu_matches_the_cpu_backend(TINY, 1e-4, Some(1e-3));
    }
}

/// The bf16 twins of the tiny models: losses within 2e-2 (the issue's bf16 tolerance; the host
/// emulation of such plans agrees within it). Not yet run on a GPU.
#[test]
fn tiny_bf16_models_on_one_gpu_match_the_cpu_backend() {
    if gpu() {
        one_gpu_matches_the_cpu_backend(BF16, 2e-2, None);
    }
}

/// A trainer on the CUDA backend (GPU 0, one rank) for `job`'s plan, with `options`, loaded with
/// the initial state of `seed`.
fn gpu_trainer(
    job: &Job,
    plan: &Arc<Plan>,
    options: RunOptions,
    seed: u64,
) -> Trainer<CudaBackend> {
    let backend = CudaBackend::new(plan.clone(), options, &env1(), &ptx(job))
        .unwrap_or_else(|e| panic!("{e} (runtime/gpu/build.sh writes these tests' PTX)"));
    let mut t = Trainer::new(plan.clone(), backend, Corpus::builtin());
    let init = t.initial_state(seed);
    t.load(&init).unwrap();
    t
}

/// `RunOptions::time_ops`: a step on the GPU times every op with CUDA events: each span ends after
/// it starts and within the step, and a stream's ops follow one another in the plan's issue order.
/// Written without a GPU, not yet run on one.
#[test]
fn a_timed_gpu_step_spans_every_op_in_issue_order() {
    if !gpu() {
        return;
    }
    let job = jobs(TINY).remove(0);
    let plan = plan_of(&job);
    let options = RunOptions {
        time_ops: true,
        ..RunOptions::default()
    };
    let mut t = gpu_trainer(&job, &plan, options, job.schedule.train.seed);
    for _ in 0..2 {
        let r = t.step(job.schedule.train.lr, None).unwrap();
        let spans = &r.outcome.spans;
        assert_eq!(spans.len(), plan.program.ops.len(), "one span per op");
        for s in spans {
            assert!(
                s.start <= s.end && s.end <= r.time,
                "{s:?} within {:?}",
                r.time
            );
        }
        for ops in plan.stream_ops.values() {
            for w in ops.windows(2) {
                let (a, b) = (&spans[w[0].index()], &spans[w[1].index()]);
                assert!(a.end <= b.start, "{a:?} then {b:?} on one stream");
            }
        }
        schedrun::trace::measured(&plan, r.time, spans).unwrap();
    }
}

/// The fused attention kernels (tensor cores, `sched_kernels::flash`: forward and backward)
/// on the GPU against the chunked path (cuBLAS products and the softmax kernels, which the
/// parity tests hold to the CPU backend) on random bf16 inputs of two sequences: the bf16 GPT's
/// heads of 16 (seq 64), the wide LLaMA-style model's grouped heads of 128 (seq 64; the key side
/// in two parts) and GPT-2's heads of 64 (seq 1024). Outputs within 1e-2, log-sum-exps
/// within 1e-4, dqkv within 2e-2 of 1 + |value|; on the host the kernels' code (run as warps) is
/// within 2.1e-3, 1.2e-7 and 9.4e-3 of `attention.rs` (`backend::cuda::emulate`).
#[cfg(feature = "cuda")]
#[test]
fn flash_attention_kernel_matches_the_chunked_path() {
    if !gpu() {
        return;
    }
    let wanted = ["gpt_bf16_ddp1", "wide_bf16_ddp1", "gpt2_1gpu"];
    let jobs: Vec<Job> = [BF16, GPT2]
        .into_iter()
        .flat_map(jobs)
        .filter(|j| wanted.contains(&j.schedule.name.as_str()))
        .collect();
    assert_eq!(jobs.len(), wanted.len());
    for job in jobs {
        let checks = cuda::check_flash_attention(&plan_of(&job), &ptx(&job), 2)
            .unwrap_or_else(|e| panic!("{}: {e}", job.schedule.name));
        assert!(
            !checks.is_empty(),
            "{}: no fused attention kernel",
            job.schedule.name
        );
        for c in checks {
            eprintln!(
                "flash{}: output within {:.2e}, lse {:.2e}, dqkv {:.2e}",
                c.kernel, c.out, c.lse, c.dqkv
            );
            assert!(c.out <= 1e-2 && c.lse <= 1e-4 && c.dqkv <= 2e-2, "{c:?}");
        }
    }
}

/// NCCL as far as one GPU takes it (`cuda::check_one_rank_collectives`): the library loads,
/// one-member communicators initialise in a group, and every collective kind in every dtype,
/// out of place and in place, and the loss's f64 sum deliver their input. No plan with one rank
/// has a collective, so without this no NCCL call would run on a one-GPU machine.
#[cfg(feature = "cuda")]
#[test]
fn nccl_collectives_run_on_one_gpu() {
    if !gpu() {
        return;
    }
    let wrong = cuda::check_one_rank_collectives().unwrap_or_else(|e| panic!("{e}"));
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

/// GPT-2 small (124M, seq 1024, micro-batch 8, bf16) on one GPU, twice in one run: attention as
/// the tensor-core kernels (the default), then chunked on cuBLAS (`RunOptions::attention_kernels`
/// off). Each: a warm-up step, then five timed ones; prints the step time, MFU against the
/// cluster's bf16 peak and the timed steps' losses (a random-init GPT-2 starts near
/// ln 50,257 ≈ 10.8), then the ratio of the two step times.
#[test]
#[ignore = "a benchmark: needs a GPU with about 20 GB free; run with --ignored"]
fn gpt2_small_step_mfu() {
    if !gpu() {
        return;
    }
    let job = jobs(GPT2).remove(0);
    let plan = plan_of(&job);
    let m = &job.model;
    let (b, s) = (
        (m.micro_batch * u64::from(job.schedule.micro_steps)) as f64,
        m.seq_len as f64,
    );
    let (l, h, v) = (12.0, 768.0, 50257.0);
    let flops = 72.0 * b * s * l * h * h * (1.0 + s / (6.0 * h) + v / (12.0 * l * h));
    let peak = job.cluster.peak_flops;
    // Attention chunked on cuBLAS (run on a GPU before), then as the tensor-core kernels (the
    // default), in the same run: should the kernels fault, poisoning the process's CUDA
    // context, the first figure is already out. SCHED_GPT2_ATTENTION=kernels (or chunked)
    // times only that one (profile.sh profiles the kernels' launches).
    let only = std::env::var("SCHED_GPT2_ATTENTION").ok();
    let mut times = vec![];
    for (kernels, what) in [(false, "chunked"), (true, "kernels")] {
        if only.as_deref().is_some_and(|o| o != what) {
            continue;
        }
        let what = format!("{what} attention");
        let options = RunOptions {
            attention_kernels: kernels,
            ..RunOptions::default()
        };
        let mut t = gpu_trainer(&job, &plan, options, 0);
        t.step(1e-4, None).unwrap(); // warm-up: the driver's PTX compilation, cuBLAS heuristics
        let steps = 5;
        let (mut total, mut enqueue) = (0.0, 0.0);
        let mut losses = vec![];
        for _ in 0..steps {
            let r = t.step(1e-4, None).unwrap();
            total += r.time.as_secs_f64();
            enqueue += r.outcome.enqueue.map_or(0.0, |d| d.as_secs_f64());
            losses.push(r.loss);
        }
        let step = total / steps as f64;
        times.push(step);
        println!(
            "gpt2 small, 1 GPU, {what}: {step:.4} s/step, {:.1} TFLOP/s, MFU {:.2}% of {:.0} TFLOP/s",
            flops / step / 1e12,
            100.0 * flops / step / peak,
            peak / 1e12
        );
        // Near the step time, the host's launches bound the step (CUDA graphs would help);
        // far below it, the GPU's kernels do.
        println!(
            "gpt2 small, 1 GPU, {what}: the host enqueued a step's ops in {:.4} s",
            enqueue / steps as f64
        );
        println!("gpt2 small, 1 GPU, {what}: losses of the timed steps {losses:.4?}");
        assert!(
            losses.iter().all(|l| l.is_finite()),
            "{what}: a loss is not finite: {losses:?}"
        );
    }
    if let [chunked, kernels] = times[..] {
        println!(
            "gpt2 small, 1 GPU: the attention kernels take {:.2}x the chunked path's step time",
            kernels / chunked
        );
    }
    // What `schedc simulate` predicts for this plan, to calibrate its GPU cost model.
    let predicted = schedc::sim::simulate(&plan.program, &plan.job).step_time_s;
    let last = times.last().copied().unwrap_or(f64::NAN);
    println!(
        "gpt2 small, 1 GPU: schedc simulate predicts {predicted:.4} s/step; measured {last:.4} s \
         ({:.2}x the prediction)",
        last / predicted
    );
    // With SCHED_TRACE_DIR: one more step, every op timed with CUDA events (after the timed
    // steps, so the events cost them nothing), as a Perfetto trace there.
    if let Some(dir) = std::env::var_os("SCHED_TRACE_DIR") {
        let options = RunOptions {
            time_ops: true,
            ..RunOptions::default()
        };
        let mut t = gpu_trainer(&job, &plan, options, 0);
        t.step(1e-4, None).unwrap();
        let r = t.step(1e-4, None).unwrap();
        let trace = schedrun::trace::measured(&plan, r.time, &r.outcome.spans).unwrap();
        let path = PathBuf::from(dir).join("gpt2_small.trace.json");
        std::fs::write(&path, serde_json::to_string(&trace).unwrap()).unwrap();
        println!(
            "gpt2 small, 1 GPU: a timed step of {:.4} s traced in {}",
            r.time.as_secs_f64(),
            path.display()
        );
    }
}
