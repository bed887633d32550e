//! What `schedc plan` prints: a table of the best schedules, or (`--json`) a list of objects with
//! a `.sched` fragment each.

use super::{fragment, PlanResult, Ranked};
use sched_ir::job::{Job, ReshardAfterForward};
use serde::Serialize;
use std::fmt::Write;

/// One planned schedule as `--json` writes it.
#[derive(Serialize)]
pub struct PlannedJson {
    pub rank: usize,
    pub name: String,
    pub shard: ShardJson,
    pub reshard_after_forward: String,
    pub grad_sync: &'static str,
    pub all_gather: &'static str,
    /// Tensor parallelism, when the schedule splits layers over t > 1 ranks (absent otherwise).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tensor: Option<TensorJson>,
    /// Pipeline stages, when the schedule has more than one (absent otherwise).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pipeline: Option<PipelineJson>,
    pub prefetch: PrefetchJson,
    pub buckets: BucketsJson,
    pub step_time_s: f64,
    /// Beyond cli.md: the step time's range under the cost model's contention range.
    pub step_time_range_s: [f64; 2],
    /// Beyond cli.md: whether this schedule's range overlaps the best one's, so that the model
    /// cannot rank the two apart (always true of the best).
    pub within_range_of_best: bool,
    pub mfu: f64,
    pub tflops_per_gpu: f64,
    pub tokens_per_gpu_per_s: f64,
    pub peak_memory_bytes: u64,
    pub gpu_memory_bytes: u64,
    pub fits: bool,
    /// A schedule block that reproduces this schedule, next to the base schedule's model and
    /// cluster.
    pub fragment: String,
}

#[derive(Serialize)]
pub struct ShardJson {
    pub params: String,
    pub grads: String,
    pub optimizer: String,
}

#[derive(Serialize)]
pub struct TensorJson {
    /// t, the ranks of a tensor group.
    pub size: u32,
    /// Sequence parallelism.
    pub sequence: bool,
    /// Micro-batches per step of each data-parallel rank (d·m keeps the global batch).
    pub micro_steps: u32,
}

#[derive(Serialize)]
pub struct PipelineJson {
    pub stages: u32,
    pub virtual_stages: u32,
    pub schedule: &'static str,
    pub micro_steps: u32,
    /// Layers per chunk, in model order.
    pub layers: Vec<u32>,
}

#[derive(Serialize)]
pub struct PrefetchJson {
    pub forward: u32,
    pub backward: u32,
}

#[derive(Serialize)]
pub struct BucketsJson {
    pub gather: u64,
    pub reduce: u64,
}

/// The name the `rank`-th (from 1) planned schedule of `base` gets.
pub fn planned_name(base: &Job, rank: usize) -> String {
    format!("{}_plan{rank}", base.schedule.name)
}

fn reshard(r: ReshardAfterForward) -> String {
    match r {
        ReshardAfterForward::True => "true".into(),
        ReshardAfterForward::False => "false".into(),
        ReshardAfterForward::Node { secondary } => format!("node({secondary})"),
    }
}

/// A ranked schedule's step-time range (its step time alone if it was simulated without one).
pub fn step_range(r: &Ranked) -> [f64; 2] {
    r.report
        .ranges
        .as_ref()
        .map_or([r.report.step_time_s; 2], |g| g.step_time_s)
}

/// Whether each ranked schedule's step-time range overlaps the best one's: the model cannot tell
/// them apart.
pub fn within_range_of_best(result: &PlanResult) -> Vec<bool> {
    let Some(best) = result.ranked.first() else {
        return vec![];
    };
    let best_high = step_range(best)[1];
    result
        .ranked
        .iter()
        .map(|r| step_range(r)[0] <= best_high)
        .collect()
}

/// The `--json` objects, best first.
pub fn json(base: &Job, result: &PlanResult) -> Vec<PlannedJson> {
    let within = within_range_of_best(result);
    result
        .ranked
        .iter()
        .enumerate()
        .map(|(i, Ranked { job, report, .. })| {
            let s = &job.schedule;
            let name = planned_name(base, i + 1);
            PlannedJson {
                rank: i + 1,
                fragment: fragment::fragment(job, &name),
                name,
                shard: ShardJson {
                    params: s.shard.params.to_string(),
                    grads: s.shard.grads.to_string(),
                    optimizer: s.shard.optimizer.to_string(),
                },
                reshard_after_forward: reshard(s.reshard_after_forward),
                grad_sync: s.grad_sync.name(),
                all_gather: s.all_gather.name(),
                tensor: s.tensor.is_parallel().then_some(TensorJson {
                    size: s.tensor.size,
                    sequence: s.tensor.sequence,
                    micro_steps: s.micro_steps,
                }),
                pipeline: s.pipeline.is_pipelined().then(|| PipelineJson {
                    stages: s.pipeline.stages,
                    virtual_stages: s.pipeline.virtual_stages,
                    schedule: s.pipeline.schedule.name(),
                    micro_steps: s.micro_steps,
                    layers: s.pipeline.chunks.clone(),
                }),
                prefetch: PrefetchJson {
                    forward: s.prefetch.forward,
                    backward: s.prefetch.backward,
                },
                buckets: BucketsJson {
                    gather: s.buckets.gather,
                    reduce: s.buckets.reduce,
                },
                step_time_s: report.step_time_s,
                step_time_range_s: step_range(&result.ranked[i]),
                within_range_of_best: within[i],
                mfu: report.mfu,
                tflops_per_gpu: report.tflops_per_gpu,
                tokens_per_gpu_per_s: report.tokens_per_gpu_per_s,
                peak_memory_bytes: report.peak_memory_bytes,
                gpu_memory_bytes: job.cluster.gpu_memory,
                fits: report.fits,
            }
        })
        .collect()
}

/// Bytes in GiB, or MiB below one GiB.
fn gib(bytes: u64) -> String {
    let b = bytes as f64;
    if b >= f64::from(1u32 << 30) {
        format!("{:.1} GiB", b / f64::from(1u32 << 30))
    } else {
        format!("{:.1} MiB", b / f64::from(1u32 << 20))
    }
}

/// Seconds, or milliseconds below one second.
fn seconds(s: f64) -> String {
    if s >= 1.0 {
        format!("{s:.3} s")
    } else {
        format!("{:.3} ms", s * 1e3)
    }
}

/// Three significant digits.
fn sig3(x: f64) -> String {
    let digits = if x <= 0.0 {
        0
    } else {
        2 - x.abs().log10().floor() as i32
    };
    format!("{x:.*}", digits.clamp(0, 9) as usize)
}

fn mib(bytes: u64) -> String {
    if bytes == 0 {
        "off".into()
    } else {
        format!("{}M", bytes >> 20)
    }
}

/// The table of the best schedules, with a header naming the job and a closing line on what the
/// search did.
pub fn table(base: &Job, result: &PlanResult) -> String {
    let s = &base.schedule;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{}: model {} on {} x {} GPUs of {} ({} GPU memory), {} micro-steps",
        s.name,
        base.model.name,
        s.nodes,
        s.gpus_per_node,
        base.cluster.name,
        gib(base.cluster.gpu_memory),
        s.micro_steps
    );
    // A pipeline column only when some schedule has stages.
    let pipelines = result
        .ranked
        .iter()
        .any(|r| r.job.schedule.pipeline.is_pipelined());
    // A tensor column only when some schedule splits layers.
    let tensors = result
        .ranked
        .iter()
        .any(|r| r.job.schedule.tensor.is_parallel());
    let mut header = vec![
        "#",
        "params",
        "grads",
        "optimizer",
        "reshard",
        "grad_sync",
        "all_gather",
        "prefetch",
        "buckets",
        "step",
        "range",
        "MFU",
        "TFLOPS",
        "peak memory",
    ];
    if pipelines {
        header.insert(1, "pipeline");
    }
    if tensors {
        header.insert(1, "tensor");
    }
    let first_number = header.iter().position(|h| *h == "step").unwrap_or(0);
    let rows: Vec<Vec<String>> = result
        .ranked
        .iter()
        .enumerate()
        .map(|(i, r)| {
            let j = &r.job.schedule;
            let mut row = vec![
                (i + 1).to_string(),
                j.shard.params.to_string(),
                j.shard.grads.to_string(),
                j.shard.optimizer.to_string(),
                reshard(j.reshard_after_forward),
                j.grad_sync.name().to_string(),
                j.all_gather.name().to_string(),
                format!("{}/{}", j.prefetch.forward, j.prefetch.backward),
                format!("{}/{}", mib(j.buckets.gather), mib(j.buckets.reduce)),
                seconds(r.report.step_time_s),
                {
                    let [lo, hi] = step_range(r);
                    format!("{}–{}", seconds(lo), seconds(hi))
                },
                format!("{:.1}%", 100.0 * r.report.mfu),
                sig3(r.report.tflops_per_gpu),
                gib(r.report.peak_memory_bytes),
            ];
            if pipelines {
                let pp = &j.pipeline;
                row.insert(
                    1,
                    match pp.stages {
                        1 => "-".to_string(),
                        p => format!(
                            "{p}x{} {} m={}",
                            pp.virtual_stages,
                            pp.schedule.name(),
                            j.micro_steps
                        ),
                    },
                );
            }
            if tensors {
                let sp = if j.tensor.sequence { " sp" } else { "" };
                let cell = match (j.tensor.size, j.pipeline.is_pipelined()) {
                    (1, _) => "-".to_string(),
                    (t, true) => format!("{t}{sp}"),
                    (t, false) => format!("{t}{sp} m={}", j.micro_steps),
                };
                row.insert(1, cell);
            }
            row
        })
        .collect();
    let widths: Vec<usize> = (0..header.len())
        .map(|c| {
            rows.iter()
                .map(|r| r[c].len())
                .chain([header[c].len()])
                .max()
                .unwrap_or(0)
        })
        .collect();
    let mut line = |cells: Vec<String>| {
        let text: Vec<String> = cells
            .iter()
            .zip(&widths)
            .enumerate()
            .map(|(c, (cell, w))| {
                // Numbers right-aligned, words left-aligned.
                if c == 0 || c >= first_number {
                    format!("{cell:>w$}")
                } else {
                    format!("{cell:<w$}")
                }
            })
            .collect();
        let _ = writeln!(out, "{}", text.join("  ").trim_end());
    };
    line(header.iter().map(|h| h.to_string()).collect());
    for r in rows {
        line(r);
    }
    if result.ranked.is_empty() {
        let _ = writeln!(
            out,
            "(no schedule fits in {})",
            gib(base.cluster.gpu_memory)
        );
    }
    let within = within_range_of_best(result);
    let ties: Vec<String> = (1..within.len())
        .filter(|&i| within[i])
        .map(|i| format!("#{}", i + 1))
        .collect();
    if let Some(best) = result.ranked.first() {
        let (lo, hi) = best.report.ranges.as_ref().map_or((0.0, 0.0), |g| {
            (g.contention_range[0], g.contention_range[1])
        });
        let what =
            format!("(step time over contention {lo:.2}–{hi:.2} per overlapping collective)");
        if ties.is_empty() {
            if result.ranked.len() > 1 {
                let _ = writeln!(out, "#1's range {what} overlaps no other schedule's: the ranking holds at both ends of the range");
            }
        } else {
            let _ = writeln!(
                out,
                "within the model's uncertainty of #1 {what}: {}; measure before choosing between them",
                ties.join(", ")
            );
        }
    }
    let st = &result.stats;
    let _ = writeln!(
        out,
        "searched {} structures: {} over memory before lowering, {} over memory after lowering, {} pruned by the time floor; {} simulations (knob trials included), {} compiled ({} did not fit once placed)",
        st.structures,
        st.over_memory_floor,
        st.over_arena_floor,
        st.pruned_by_time_floor,
        st.simulated,
        st.compiled,
        st.over_gpu_after_placement
    );
    out
}
