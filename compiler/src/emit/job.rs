//! The resolved-job listing: a schedule with every default, preset and unit made explicit, its
//! cluster, and its model layer by layer with tensor shapes and exact parameter counts.
//!
//! Repeated layers (`block[0]` … `block[31]`) print once as `block[0..31]`. Bytes print as exact
//! integers, rates in base units (bytes/s, FLOP/s, seconds), so the listing shows precisely what
//! later stages receive.

use sched_ir::job::*;
pub use sched_ir::listing::{plural, thousands};
use sched_ir::Layout;
use std::fmt::Write;

/// Renders one job.
pub fn emit_job(job: &Job) -> String {
    let mut out = String::new();
    schedule(&mut out, job);
    out.push('\n');
    cluster(&mut out, &job.cluster);
    out.push('\n');
    model(&mut out, &job.model);
    out
}

fn schedule(out: &mut String, job: &Job) {
    let s = &job.schedule;
    let _ = writeln!(out, "schedule {}", s.name);
    let mut row = |k: &str, v: String| {
        let _ = writeln!(out, "  {k:<22} {v}");
    };
    row("model", job.model.name.clone());
    row("cluster", job.cluster.name.clone());
    row("preset", s.preset.clone().unwrap_or_else(|| "none".into()));
    row(
        "ranks",
        format!(
            "{} = {} x {} per node",
            job.ranks(),
            plural(s.nodes.into(), "node"),
            plural(s.gpus_per_node.into(), "GPU")
        ),
    );
    row("micro_steps", s.micro_steps.to_string());
    let mesh = |m: Mesh| format!("{m} ({})", m.size());
    row(
        "shard",
        format!(
            "params {}  grads {}  optimizer {}",
            mesh(s.shard.params),
            mesh(s.shard.grads),
            mesh(s.shard.optimizer)
        ),
    );
    row(
        "reshard_after_forward",
        match s.reshard_after_forward {
            ReshardAfterForward::True => "true".into(),
            ReshardAfterForward::False => "false".into(),
            ReshardAfterForward::Node { secondary } => {
                format!("node (secondary shard over {secondary} GPUs)")
            }
        },
    );
    row("grad_sync", s.grad_sync.name().to_string());
    row("all_gather", s.all_gather.name().to_string());
    let cap = s
        .prefetch
        .max_live
        .map_or("unlimited".into(), |b| format!("{b} B"));
    row(
        "prefetch",
        format!(
            "forward {}  backward {}  max_live {cap}",
            s.prefetch.forward, s.prefetch.backward
        ),
    );
    row(
        "buckets",
        format!(
            "gather {} B  reduce {} B",
            s.buckets.gather, s.buckets.reduce
        ),
    );
    row("recompute", s.recompute.name().to_string());
    row("streams", s.streams.name().to_string());
    let refresh = match s.overlap.refresh {
        Refresh::Overlap(b) => b.to_string(),
        Refresh::NextForward => "next_forward".into(),
    };
    row(
        "overlap",
        format!(
            "gather {}  reduce {}  sync {}  refresh {refresh}",
            s.overlap.gather, s.overlap.reduce, s.overlap.sync
        ),
    );
    let t = &s.train;
    let data = t
        .data
        .as_ref()
        .map_or("built-in".into(), |p| p.display().to_string());
    let clip = t.clip.map_or("off".into(), |c| c.to_string());
    // Checkpoint settings only when set: the line of a schedule without them is unchanged.
    let mut checkpoints = String::new();
    if let Some(d) = &t.checkpoints {
        checkpoints += &format!("  checkpoints {}", d.display());
    }
    if let Some(n) = t.save_every {
        checkpoints += &format!("  save_every {n}");
    }
    if let Some(k) = t.keep {
        checkpoints += &format!("  keep {k}");
    }
    // The learning-rate schedule only when set, likewise.
    if t.warmup > 0 {
        checkpoints += &format!("  warmup {}", t.warmup);
    }
    if !t.decay.is_constant() {
        checkpoints += &format!("  decay {}  min_lr {}", t.decay.name(), t.min_lr);
    }
    if let Some(w) = t.weight_decay {
        checkpoints += &format!("  weight_decay {w}");
    }
    if let Some([b1, b2]) = t.betas {
        checkpoints += &format!("  betas [{b1}, {b2}]");
    }
    if let Some(e) = t.eps {
        checkpoints += &format!("  eps {e}");
    }
    if let Some(v) = &t.val {
        checkpoints += &format!("  val {}", v.display());
    }
    if let Some(n) = t.eval_every {
        checkpoints += &format!("  eval_every {n}");
    }
    if let Some(k) = t.eval_batches {
        checkpoints += &format!("  eval_batches {k}");
    }
    row(
        "train",
        format!(
            "steps {}  lr {}  seed {}  data {data}  clip {clip}{checkpoints}",
            t.steps, t.lr, t.seed
        ),
    );
    if !s.tensor.is_default() {
        let layout = Layout::of(job);
        let g = layout.dp_gpus_per_node();
        let _ = writeln!(
            out,
            "  {:<22} t = {}{}, data-parallel mesh {g} x {} (d = {})",
            "tensor",
            s.tensor.size,
            if s.tensor.sequence {
                ", sequence parallel"
            } else {
                ""
            },
            layout.dp_size() / g,
            layout.dp_size()
        );
    }
    if s.pipeline.is_pipelined() {
        pipeline(out, job);
    }
}

/// The pipeline: stages, chunks with their layers and stage, and every stage's order.
fn pipeline(out: &mut String, job: &Job) {
    let pl = &job.schedule.pipeline;
    let (p, v) = (pl.stages, pl.virtual_stages);
    let layout = Layout::of(job);
    let g = layout.dp_gpus_per_node();
    let dp = format!("{g} x {}", layout.dp_size() / g);
    let _ = writeln!(
        out,
        "  {:<22} {} x {} per stage, {}, data-parallel mesh {dp} per stage",
        "pipeline",
        plural(p.into(), "stage"),
        plural(v.into(), "chunk"),
        pl.schedule.name()
    );
    let layers = &job.model.layers;
    for c in 0..p * v {
        let range = pl.layers_of_chunk(c);
        let (first, last) = (range.start, range.end - 1);
        let names = match first == last {
            true => layers[first].name.clone(),
            false => format!("{} … {}", layers[first].name, layers[last].name),
        };
        let _ = writeln!(
            out,
            "    chunk {c:<3} stage {:<3} layers {first}-{last} ({}): {names}",
            pl.stage_of_chunk(c),
            range.len()
        );
    }
    for (s, list) in pl.order.iter().enumerate() {
        let _ = writeln!(
            out,
            "    stage {s:<3} {}",
            sched_ir::orders::order_text(list, v)
        );
    }
}

fn cluster(out: &mut String, c: &Cluster) {
    let _ = writeln!(
        out,
        "cluster {}: {} x {} per node, gpu_memory {} B, peak_flops {} FLOP/s, efficiency {}",
        c.name,
        plural(c.nodes.into(), "node"),
        plural(c.gpus_per_node.into(), "GPU"),
        c.gpu_memory,
        c.peak_flops,
        c.efficiency
    );
    if let Some(bw) = c.memory_bandwidth {
        let _ = writeln!(out, "  memory_bandwidth {bw} B/s");
    }
    if c.gemm_workspace != Cluster::DEFAULT_GEMM_WORKSPACE {
        let _ = writeln!(out, "  gemm_workspace {} B", c.gemm_workspace);
    }
    for (name, l) in [("intra_node", c.intra_node), ("inter_node", c.inter_node)] {
        let _ = writeln!(
            out,
            "  {name}  bandwidth {} B/s  latency {} s",
            l.bandwidth, l.latency
        );
    }
    for m in &c.measured {
        let points: Vec<String> = m
            .points
            .iter()
            .map(|(s, b)| format!("{s} B = {b} B/s"))
            .collect();
        let _ = writeln!(
            out,
            "  measured {} {}: {}",
            m.collective.name(),
            m.mesh,
            points.join("; ")
        );
    }
}

fn model(out: &mut String, m: &Model) {
    let _ = writeln!(
        out,
        "model {}: dtype {}, grad_dtype {}, optimizer {}, seq_len {}, micro_batch {}",
        m.name,
        m.dtype.name(),
        m.grad_dtype.name(),
        m.optimizer.name(),
        m.seq_len,
        m.micro_batch
    );
    if let Some(e) = m.norm_eps {
        let _ = writeln!(out, "  norm_eps {e}");
    }
    if let Some(b) = m.rope_base {
        let _ = writeln!(out, "  rope_base {b}");
    }
    let _ = writeln!(
        out,
        "  parameters {} in {}",
        thousands(m.parameters()),
        plural(m.layers.len() as u64, "layer")
    );
    let mut i = 0;
    while i < m.layers.len() {
        let run = repeated_run(&m.layers[i..]);
        let first = &m.layers[i];
        let name = match run {
            1 => first.name.clone(),
            n => format!(
                "{}..{}]",
                first.name.trim_end_matches(']'),
                index_of(&m.layers[i + n - 1].name).unwrap_or(0)
            ),
        };
        let count = if run > 1 {
            format!("{run} x ")
        } else {
            String::new()
        };
        let each = if run > 1 { " each" } else { "" };
        let _ = writeln!(
            out,
            "  {name}  {count}{}  {} params{each}",
            describe(&first.kind),
            thousands(first.params)
        );
        for t in &first.tensors {
            let _ = writeln!(out, "    {:<18} {:?}", t.name, t.shape);
        }
        i += run;
    }
}

/// How many layers from the start of `layers` are repetitions `base[k]`, `base[k+1]`, … of one kind.
fn repeated_run(layers: &[Layer]) -> usize {
    let Some(start) = index_of(&layers[0].name) else {
        return 1;
    };
    let base = base_of(&layers[0].name);
    layers
        .iter()
        .enumerate()
        .take_while(|(k, l)| {
            l.kind == layers[0].kind
                && base_of(&l.name) == base
                && index_of(&l.name) == Some(start + *k as u64)
        })
        .count()
}

fn base_of(name: &str) -> &str {
    name.split('[').next().unwrap_or(name)
}

fn index_of(name: &str) -> Option<u64> {
    name.strip_suffix(']')?.rsplit_once('[')?.1.parse().ok()
}

fn describe(kind: &LayerKind) -> String {
    let lower = |d: &dyn std::fmt::Debug| format!("{d:?}").to_lowercase();
    match kind {
        LayerKind::Embedding { vocab, hidden, positions } => {
            format!("embedding(vocab {vocab}, hidden {hidden}, positions {})", lower(positions))
        }
        LayerKind::Transformer(t) => format!(
            "transformer(hidden {}, heads {}, kv_heads {}, ffn {}, norm {}, act {}, bias {}, attention {})",
            t.hidden,
            t.heads,
            t.kv_heads,
            t.ffn,
            lower(&t.norm),
            lower(&t.act),
            t.bias,
            lower(&t.attention)
        ),
        LayerKind::Mlp(m) => format!(
            "mlp(hidden {}, ffn {}, act {}, bias {}, norm {})",
            m.hidden,
            m.ffn,
            lower(&m.act),
            m.bias,
            lower(&m.norm)
        ),
        LayerKind::LmHead { hidden, vocab, norm, tied } => {
            format!("lm_head(hidden {hidden}, vocab {vocab}, norm {}, tied {tied})", lower(norm))
        }
        LayerKind::Dense { params, flops_per_token, activation_bytes_per_token } => format!(
            "dense(params {params}, flops_per_token {flops_per_token}, activation_bytes_per_token {activation_bytes_per_token})"
        ),
    }
}

#[cfg(test)]
#[path = "../../tests/unit/emit_job.rs"]
mod tests;
