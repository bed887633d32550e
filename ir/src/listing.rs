//! The listing: a compiled program as text a person can read and a snapshot can pin.
//!
//! Header (ranks, arena), streams (with their workspaces), communicators (first group shown, with the group count),
//! buffers with kind, dtype, size and offset, then every op in issue order: its stream, kind,
//! layer and micro-step, what it reads and writes, the events it waits on and records. Names
//! match the plan file (`op12`, `buf3`, `ev7`, `comm2`). Optional notes can be written beside ops
//! (the verifier uses this to show its errors in place).

use crate::ir::*;
use std::collections::HashMap;
use std::fmt::Write;

/// Renders the whole program.
pub fn emit_listing(p: &Program) -> String {
    emit_listing_with_notes(p, &HashMap::new())
}

/// Renders the program with `notes` written under the ops they concern.
pub fn emit_listing_with_notes(p: &Program, notes: &HashMap<OpId, Vec<String>>) -> String {
    let mut out = String::new();
    header(&mut out, p);
    let _ = writeln!(out, "\nstreams:");
    for (id, s) in p.streams.iter() {
        match s.workspace {
            Some(ws) => {
                let _ = writeln!(out, "  {id} {} {}", s.role.name(), workspace(p, ws));
            }
            None => {
                let _ = writeln!(out, "  {id} {}", s.role.name());
            }
        }
    }
    communicators(&mut out, p);
    let _ = writeln!(out, "\nbuffers:");
    for (id, b) in p.buffers.iter() {
        let _ = writeln!(
            out,
            "  {id:<7} {:<34} {:<15} {} {:>15} B @ {}",
            b.name,
            format!("{:?}", b.kind),
            b.dtype.name(),
            thousands(b.bytes),
            thousands(b.offset)
        );
    }
    let _ = writeln!(out, "\nops:");
    for (id, op) in p.ops.iter() {
        let _ = writeln!(out, "  {}", op_line(p, id, op));
        for n in notes.get(&id).into_iter().flatten() {
            let _ = writeln!(out, "      ^^^ {n}");
        }
    }
    out
}

/// A stream's workspace: `workspace buf9: GEMM 33,554,432 B + scratch 16,640 B`.
pub fn workspace(p: &Program, ws: StreamWorkspace) -> String {
    let bytes = p.buffers.get(ws.buffer).map_or(0, |b| b.bytes);
    format!(
        "workspace {}: GEMM {} B + scratch {} B",
        ws.buffer,
        thousands(ws.gemm_bytes),
        thousands(bytes.saturating_sub(ws.gemm_bytes))
    )
}

/// One op as a line: `op12 gather all_gather block[3] m0 comm0 buf4 -> buf9 wait ev2 record ev5`.
pub fn op_line(p: &Program, id: OpId, op: &Op) -> String {
    let mut s = format!(
        "{id:<7} {:<8} {}",
        p.streams[op.stream].role.name(),
        op.kind_name()
    );
    if let Some(l) = op.layer {
        let _ = write!(s, " {}", p.layers[l].name);
    }
    if let Some(m) = op.micro_step {
        let _ = write!(s, " m{m}");
    }
    match &op.kind {
        OpKind::Compute(_) => {
            let regions = |rs: &[Region]| {
                rs.iter()
                    .map(|r| region(p, r))
                    .collect::<Vec<_>>()
                    .join(" ")
            };
            if !op.reads.is_empty() {
                let _ = write!(s, " reads {}", regions(&op.reads));
            }
            if !op.writes.is_empty() {
                let _ = write!(s, " writes {}", regions(&op.writes));
            }
        }
        _ => {
            let parts: Vec<String> = op
                .collectives()
                .iter()
                .map(|c| {
                    format!(
                        "{}{} {} {} -> {}",
                        if matches!(op.kind, OpKind::Group(_)) {
                            format!("{} ", c.kind.name())
                        } else {
                            String::new()
                        },
                        c.comm,
                        c.count,
                        region(p, &c.input),
                        region(p, &c.output)
                    )
                })
                .collect();
            let _ = write!(s, " {}", parts.join("; "));
        }
    }
    if !op.wait.is_empty() {
        let evs: Vec<String> = op.wait.iter().map(|e| e.to_string()).collect();
        let _ = write!(s, " wait {}", evs.join(" "));
    }
    if let Some(e) = op.record {
        let _ = write!(s, " record {e}");
    }
    s
}

/// `buf3` for a whole buffer, `buf3[+64:128]` for a fixed range, `buf3[param*64+0:64]` for a
/// rank-dependent one.
pub fn region(p: &Program, r: &Region) -> String {
    let whole = r.offset == Offset::Fixed(0) && r.bytes == p.buffers[r.buffer].bytes;
    match r.offset {
        _ if whole => r.buffer.to_string(),
        Offset::Fixed(o) => format!("{}[+{o}:{}]", r.buffer, r.bytes),
        Offset::Shard {
            index,
            base,
            stride,
        } => {
            format!(
                "{}[{}*{stride}+{base}:{}]",
                r.buffer,
                index_name(index),
                r.bytes
            )
        }
    }
}

pub fn index_name(i: ShardIndex) -> &'static str {
    match i {
        ShardIndex::Param => "param",
        ShardIndex::Grad => "grad",
        ShardIndex::Optimizer => "optimizer",
        ShardIndex::ParamLocal => "param_local",
        ShardIndex::OptimizerInParam => "optimizer_in_param",
        ShardIndex::OptimizerInGrad => "optimizer_in_grad",
        ShardIndex::Secondary => "secondary",
    }
}

/// The first line: schedule, ranks, nodes × GPUs, micro-steps, arena (shared by the listing and
/// the summary).
pub fn header(out: &mut String, p: &Program) {
    let _ = writeln!(
        out,
        "schedule {}: {} ranks ({} x {}), {}, arena {} B per rank",
        p.schedule,
        p.ranks(),
        plural(p.layout.nodes.into(), "node"),
        plural(p.layout.gpus_per_node.into(), "GPU"),
        plural(p.micro_steps.into(), "micro-step"),
        thousands(p.arena_bytes)
    );
}

/// The communicators, one line each: name, scope, groups and the first group's ranks (shared by
/// the listing and the summary).
pub fn communicators(out: &mut String, p: &Program) {
    let _ = writeln!(out, "\ncommunicators:");
    for (id, c) in p.comms.iter() {
        let first: Vec<String> = c.groups[0].iter().take(16).map(|r| r.to_string()).collect();
        let more = if c.groups[0].len() > 16 { " …" } else { "" };
        let _ = writeln!(
            out,
            "  {id} {} ({}): {} groups of {}, first [{}{more}]",
            c.name,
            c.scope.name(),
            c.groups.len(),
            c.group_size(),
            first.join(" ")
        );
    }
}

/// `1 node`, `4 nodes`.
pub fn plural(n: u64, word: &str) -> String {
    format!("{n} {word}{}", if n == 1 { "" } else { "s" })
}

/// `1234567` → `1,234,567`.
pub fn thousands(n: u64) -> String {
    let digits = n.to_string();
    let mut out = String::with_capacity(digits.len() + digits.len() / 3);
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).checked_rem(3) == Some(0) {
            out.push(',');
        }
        out.push(c);
    }
    out
}
