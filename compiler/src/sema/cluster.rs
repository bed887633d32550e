//! Resolving `cluster` blocks: sizes, memory, peak compute, links and measured tables.
//!
//! Every key is required but `efficiency` (default 0.75), `memory_bandwidth` (default derived
//! from `peak_flops` by the cost model), `gemm_workspace` (default
//! [`Cluster::DEFAULT_GEMM_WORKSPACE`], at most `gpu_memory`) and `measured` tables; link latencies are required too, because a simulator that silently assumes zero latency misleads.

use super::values::*;
use super::Ctx;
use crate::emit::job::plural;
use sched_grammar::ast::{BlockItem, Measured, Nested, ValueKind};
use sched_grammar::diag::Diagnostic;
use sched_ir::job::{Cluster, Collective, Link, MeasuredTable, Mesh};

const KEYS: &[(&str, Shape)] = &[
    ("nodes", Shape::Value),
    ("gpus_per_node", Shape::Value),
    ("gpu_memory", Shape::Value),
    ("peak_flops", Shape::Value),
    ("efficiency", Shape::Value),
    ("memory_bandwidth", Shape::Value),
    ("gemm_workspace", Shape::Value),
    ("intra_node", Shape::Block),
    ("inter_node", Shape::Block),
];

/// The required keys and what to write for each when it is missing.
const REQUIRED: &[(&str, &str)] = &[
    ("nodes", "nodes = 4"),
    ("gpus_per_node", "gpus_per_node = 8"),
    ("gpu_memory", "gpu_memory = 80 GiB"),
    ("peak_flops", "peak_flops = 312 TFLOPS"),
    (
        "intra_node",
        "intra_node { bandwidth = 200 GB/s  latency = 5 us }",
    ),
    (
        "inter_node",
        "inter_node { bandwidth = 400 Gbps  latency = 10 us }",
    ),
];

const LINK_KEYS: &[(&str, Shape)] = &[("bandwidth", Shape::Value), ("latency", Shape::Value)];

/// Most nodes or GPUs per node a cluster may declare (keeps rank arithmetic far from overflow).
pub(crate) const MAX_COUNT: u64 = 1 << 20;

pub(crate) fn resolve(ctx: &mut Ctx, item: &BlockItem) -> Option<Cluster> {
    let what = format!("cluster `{}`", item.name.name);
    let r = BlockReader::new(
        ctx,
        &what,
        &item.body.entries,
        KEYS,
        Extras {
            measured: true,
            ..Extras::default()
        },
    );
    r.require(ctx, &item.name, &what, REQUIRED);
    let nodes = r
        .value("nodes")
        .and_then(|v| expect_int(ctx, v, 1, MAX_COUNT, "`nodes`"));
    let gpus = r
        .value("gpus_per_node")
        .and_then(|v| expect_int(ctx, v, 1, MAX_COUNT, "`gpus_per_node`"));
    let memory = r.value("gpu_memory").and_then(|v| expect_bytes(ctx, v));
    let peak_value = r.value("peak_flops");
    let peak = peak_value.and_then(|v| expect_quantity(ctx, v, UnitKind::Compute));
    let efficiency = match r.value("efficiency") {
        None => Some(0.75),
        Some(v) => expect_number(ctx, v).and_then(|e| {
            if e > 0.0 && e <= 1.0 {
                Some(e)
            } else {
                ctx.error(
                    Diagnostic::error(format!("`efficiency` must be in (0, 1], found {e}"))
                        .at(v.span, "out of range"),
                );
                None
            }
        }),
    };
    let memory_bandwidth = match r.value("memory_bandwidth") {
        None => Some(None),
        Some(v) => expect_quantity(ctx, v, UnitKind::Bandwidth).and_then(|b| {
            if b > 0.0 && b.is_finite() {
                Some(Some(b))
            } else {
                ctx.error(
                    Diagnostic::error(format!(
                        "`memory_bandwidth` must be positive, found `{}`",
                        written(v)
                    ))
                    .at(v.span, "not positive"),
                );
                None
            }
        }),
    };
    let gemm_workspace = match r.value("gemm_workspace") {
        None => Some(Cluster::DEFAULT_GEMM_WORKSPACE),
        Some(v) => expect_bytes(ctx, v).and_then(|b| match memory {
            Some(m) if b > m => {
                ctx.error(
                    Diagnostic::error(format!(
                        "`gemm_workspace` ({b} B) is larger than `gpu_memory` ({m} B)"
                    ))
                    .at(v.span, "larger than the GPU"),
                );
                None
            }
            _ => Some(b),
        }),
    };
    let intra = r.block("intra_node").and_then(|b| link_block(ctx, b));
    let inter = r.block("inter_node").and_then(|b| link_block(ctx, b));
    let measured: Vec<Option<MeasuredTable>> =
        r.measured.iter().map(|m| measured_table(ctx, m)).collect();
    for (t, m) in measured.iter().zip(&r.measured) {
        let (Some(t), Some(n), Some(g)) = (t, nodes, gpus) else {
            continue;
        };
        if u64::from(t.mesh.intra) > g || u64::from(t.mesh.inter) > n {
            ctx.error(
                Diagnostic::error(format!(
                    "measured mesh {} ({} x {}) does not fit {what} ({} x {})",
                    t.mesh,
                    plural(u64::from(t.mesh.intra), "GPU"),
                    plural(u64::from(t.mesh.inter), "node"),
                    plural(g, "GPU"),
                    plural(n, "node"),
                ))
                .at(m.mesh.span, "mesh larger than the cluster")
                .note("a mesh `a x b` is a GPUs per node times b nodes"),
            );
        }
    }
    if let (Some(p), Some(v)) = (peak, peak_value) {
        if p <= 0.0 {
            ctx.error(
                Diagnostic::error(format!(
                    "`peak_flops` must be positive, found `{}`",
                    written(v)
                ))
                .at(v.span, "not positive"),
            );
            return None;
        }
    }
    Some(Cluster {
        name: item.name.name.clone(),
        nodes: nodes? as u32,
        gpus_per_node: gpus? as u32,
        gpu_memory: memory?,
        peak_flops: peak?,
        efficiency: efficiency?,
        memory_bandwidth: memory_bandwidth?,
        gemm_workspace: gemm_workspace?,
        intra_node: intra?,
        inter_node: inter?,
        measured: measured.into_iter().collect::<Option<Vec<_>>>()?,
    })
}

fn link_block(ctx: &mut Ctx, block: &Nested) -> Option<Link> {
    let what = format!("`{}`", block.key.name);
    let r = BlockReader::for_nested(ctx, &what, block, LINK_KEYS);
    r.require(
        ctx,
        &block.key,
        &what,
        &[
            ("bandwidth", "bandwidth = 200 GB/s"),
            ("latency", "latency = 5 us"),
        ],
    );
    let bw_value = r.value("bandwidth");
    let lat_value = r.value("latency");
    let bw = bw_value.and_then(|v| expect_quantity(ctx, v, UnitKind::Bandwidth));
    let lat = lat_value.and_then(|v| expect_quantity(ctx, v, UnitKind::Time));
    let mut ok = true;
    if let (Some(b), Some(v)) = (bw, bw_value) {
        if b <= 0.0 {
            ctx.error(
                Diagnostic::error(format!(
                    "{what} bandwidth must be positive, found `{}`",
                    written(v)
                ))
                .at(v.span, "not positive"),
            );
            ok = false;
        }
    }
    if let (Some(l), Some(v)) = (lat, lat_value) {
        if l < 0.0 {
            ctx.error(
                Diagnostic::error(format!(
                    "{what} latency cannot be negative, found `{}`",
                    written(v)
                ))
                .at(v.span, "negative"),
            );
            ok = false;
        }
    }
    ok.then_some(Link {
        bandwidth: bw?,
        latency: lat?,
    })
}

fn measured_table(ctx: &mut Ctx, m: &Measured) -> Option<MeasuredTable> {
    let collective = choice(ctx, &m.collective, &Collective::MEASURED, "collective");
    let mesh = match &m.mesh.kind {
        ValueKind::Mesh(lit) => match (lit.a.value(), lit.b.value()) {
            (Some(a), Some(b)) if (1..=MAX_COUNT).contains(&a) && (1..=MAX_COUNT).contains(&b) => {
                Some(Mesh {
                    intra: a as u32,
                    inter: b as u32,
                })
            }
            _ => {
                ctx.error(
                    Diagnostic::error(format!(
                        "measured mesh factors must be between 1 and {MAX_COUNT} (2^20), found {} x {}",
                        lit.a.text, lit.b.text
                    ))
                    .at(m.mesh.span, "out of range"),
                );
                None
            }
        },
        _ => {
            ctx.error(
                Diagnostic::error(format!(
                    "expected a mesh such as `8 x 2`, found {}",
                    m.mesh.kind.describe()
                ))
                .at(m.mesh.span, "a measured table names its mesh as `a x b`"),
            );
            None
        }
    };
    let mut points = Vec::with_capacity(m.points.len());
    for p in &m.points {
        let size = bytes(ctx, &p.size);
        let bw = quantity(ctx, &p.bandwidth, UnitKind::Bandwidth);
        if let (Some(s), Some(b)) = (size, bw) {
            if b <= 0.0 || s == 0 {
                ctx.error(
                    Diagnostic::error("a measured point needs a positive size and bandwidth")
                        .at(p.span, "here"),
                );
            } else if let Some(&(prev, _)) = points.last().filter(|(prev, _)| *prev >= s) {
                ctx.error(
                    Diagnostic::error(format!(
                        "measured sizes must increase: {} follows {}",
                        human_bytes(s),
                        human_bytes(prev)
                    ))
                    .at(p.size.span, "not larger than the point before"),
                );
            } else {
                points.push((s, b));
            }
        }
    }
    if m.points.is_empty() {
        ctx.error(
            Diagnostic::error("a measured table needs at least one point")
                .at(m.span, "empty table"),
        );
        return None;
    }
    let table = MeasuredTable {
        collective: collective_of(collective?),
        mesh: mesh?,
        points,
    };
    (table.points.len() == m.points.len()).then_some(table)
}

fn collective_of(i: usize) -> Collective {
    [
        Collective::AllGather,
        Collective::ReduceScatter,
        Collective::AllReduce,
        Collective::Broadcast,
    ][i]
}
