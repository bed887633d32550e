//! `.sched` fragments: a schedule block that reproduces a planned job exactly.
//!
//! The block names the base job's model and cluster and writes every key the planner chose, and
//! every key of the base schedule it kept that differs from the language's default, so that the
//! block, added to the file the base schedule came from, resolves to the same job (tested). hpZ
//! with a secondary shard smaller than a node can only be written through its preset; the block
//! then states all three meshes explicitly, overriding the preset's.

use sched_ir::job::{Job, Overlap, Recompute, Refresh, ReshardAfterForward, Streams};
use std::fmt::Write;

/// A byte count in the largest binary unit that divides it exactly.
pub fn bytes(n: u64) -> String {
    for (unit, size) in [
        ("TiB", 1u64 << 40),
        ("GiB", 1 << 30),
        ("MiB", 1 << 20),
        ("KiB", 1 << 10),
    ] {
        if n >= size && n.is_multiple_of(size) {
            return format!("{} {unit}", n / size);
        }
    }
    format!("{n} B")
}

fn string(s: &str) -> String {
    format!("\"{}\"", s.replace('\\', "\\\\").replace('"', "\\\""))
}

/// The schedule block, named `name`.
pub fn fragment(job: &Job, name: &str) -> String {
    let s = &job.schedule;
    let mut out = String::new();
    let mut line = |text: String| {
        let _ = writeln!(out, "    {text}");
    };
    line(format!("model       = {}", job.model.name));
    line(format!("cluster     = {}", job.cluster.name));
    line(format!("nodes       = {}", s.nodes));
    line(format!("gpus_per_node = {}", s.gpus_per_node));
    line(format!("micro_steps = {}", s.micro_steps));
    let reshard = match s.reshard_after_forward {
        ReshardAfterForward::True => "true".to_string(),
        ReshardAfterForward::False => "false".to_string(),
        ReshardAfterForward::Node { secondary } => {
            line(format!("preset      = hpz(secondary = {secondary})"));
            "node".to_string()
        }
    };
    line(format!(
        "shard {{ params = {}  grads = {}  optimizer = {} }}",
        s.shard.params, s.shard.grads, s.shard.optimizer
    ));
    line(format!("reshard_after_forward = {reshard}"));
    line(format!("grad_sync   = {}", s.grad_sync.name()));
    line(format!("all_gather  = {}", s.all_gather.name()));
    line(format!(
        "prefetch {{ forward = {}  backward = {}  max_live = {} }}",
        s.prefetch.forward,
        s.prefetch.backward,
        s.prefetch.max_live.map_or("unlimited".to_string(), bytes)
    ));
    line(format!(
        "buckets {{ gather = {}  reduce = {} }}",
        bytes(s.buckets.gather),
        bytes(s.buckets.reduce)
    ));
    if s.tensor.is_parallel() {
        let sequence = if s.tensor.sequence {
            "  sequence = true"
        } else {
            ""
        };
        line(format!("tensor {{ size = {}{sequence} }}", s.tensor.size));
    }
    let pp = &s.pipeline;
    if pp.is_pipelined() {
        let chunks: Vec<String> = pp.chunks.iter().map(u32::to_string).collect();
        line(format!(
            "pipeline {{ stages = {}  virtual = {}  schedule = {}  layers = [{}] }}",
            pp.stages,
            pp.virtual_stages,
            string(pp.schedule.name()),
            chunks.join(", ")
        ));
    }
    if s.recompute != Recompute::None {
        line(format!("recompute   = {}", s.recompute.name()));
    }
    if s.streams != Streams::PerRole {
        line(format!("streams     = {}", s.streams.name()));
    }
    let o = s.overlap;
    if o != (Overlap {
        gather: true,
        reduce: true,
        sync: true,
        refresh: Refresh::Overlap(true),
    }) {
        let refresh = match o.refresh {
            Refresh::Overlap(b) => b.to_string(),
            Refresh::NextForward => "next_forward".to_string(),
        };
        line(format!(
            "overlap {{ gather = {}  reduce = {}  sync = {}  refresh = {refresh} }}",
            o.gather, o.reduce, o.sync
        ));
    }
    let t = &s.train;
    let mut train = format!("steps = {}  lr = {:?}  seed = {}", t.steps, t.lr, t.seed);
    if let Some(d) = &t.data {
        let _ = write!(train, "  data = {}", string(&d.to_string_lossy()));
    }
    if let Some(c) = t.clip {
        let _ = write!(train, "  clip = {c:?}");
    }
    line(format!("train {{ {train} }}"));
    format!("schedule {name} {{\n{out}}}\n")
}
