//! The summary: a compiled program too large to list op by op, as text a person can review.
//!
//! A production-size program has tens of thousands of ops whose listing nobody reads; this
//! renders what a reviewer needs to see change instead. Header (ranks, arena, counts), two
//! hashes, each stream's ops by kind with its waits and records (and its workspace), the communicators (as the
//! listing shows them), the buffers by kind and dtype, then **per layer**: its buffers by kind and
//! size, and for each stream its ops by kind, its collectives by kind, communicator and payload,
//! and its waits and records. Ops that belong to no layer (the loss, the gradient norm) form one
//! more entry. Layers whose entries are identical share one, headed by their names (a model's
//! repeated blocks collapse into a few entries), so a change in one layer splits its entry.
//!
//! Each entry ends with the hash of its layer's ops written relative to the layer: in issue
//! order, every op's stream, kind, role and micro-step, its regions (buffer by kind, dtype, size,
//! name and layer distance, with the range inside it), the op each wait names and the op issued
//! just before it, all by stream, kind, layer distance and micro-step. Two layers share an entry
//! only when these agree, so a change in order, waits or regions shows where it happens even when
//! the counts do not move.
//!
//! Buffer offsets (the memory plan) appear nowhere but in the `memory plan` hash; the `program`
//! hash covers everything else (every op line, buffer, event and every group of every
//! communicator), so any change to the program changes the summary. Hashes are FNV-1a (64 bit),
//! stable across runs, platforms and Rust versions.

use crate::emit::job::{plural, thousands};
use cranelift_entity::EntityRef;
use sched_ir::ir::*;
use sched_ir::listing::{index_name, op_line};
use std::collections::BTreeMap;
use std::fmt::Write;

/// FNV-1a, 64 bit: a stable hash for snapshots (std's hashers promise no stability).
#[derive(Clone, Copy)]
struct Fnv(u64);

impl Fnv {
    fn new() -> Self {
        Fnv(0xcbf2_9ce4_8422_2325)
    }

    fn bytes(&mut self, b: &[u8]) {
        for &x in b {
            self.0 ^= u64::from(x);
            self.0 = self.0.wrapping_mul(0x0100_0000_01b3);
        }
    }

    /// A string followed by a separator, so that `ab`,`c` and `a`,`bc` differ.
    fn str(&mut self, s: &str) {
        self.bytes(s.as_bytes());
        self.bytes(&[0xff]);
    }

    fn u64(&mut self, n: u64) {
        self.bytes(&n.to_le_bytes());
    }

    fn hex(self) -> String {
        format!("{:016x}", self.0)
    }
}

/// Renders the summary of the whole program.
pub fn emit_summary(p: &Program) -> String {
    let mut out = String::new();
    sched_ir::listing::header(&mut out, p);
    let _ = writeln!(
        out,
        "{}, {}, {}, {}, {}",
        plural(p.ops.len() as u64, "op"),
        plural(p.streams.len() as u64, "stream"),
        plural(p.buffers.len() as u64, "buffer"),
        plural(p.events.len() as u64, "event"),
        plural(p.comms.len() as u64, "communicator"),
    );
    let _ = writeln!(
        out,
        "program hash {} (ops, buffers, events, communicators; offsets excluded)",
        program_hash(p)
    );
    let _ = writeln!(
        out,
        "memory plan hash {} (every buffer's offset)",
        memory_plan_hash(p)
    );

    if p.layout.stages > 1 {
        stages(&mut out, p);
    }
    let _ = writeln!(out, "\nstreams:");
    for (sid, s) in p.streams.iter() {
        let ops: Vec<&Op> = p.ops.values().filter(|o| o.stream == sid).collect();
        let stage = match p.layout.stages {
            1 => String::new(),
            _ => format!("(stage {}) ", s.stage),
        };
        let _ = writeln!(
            out,
            "  {sid} {:<8} {stage}{}: {}",
            s.role.name(),
            plural(ops.len() as u64, "op"),
            kinds_and_events(&ops)
        );
        if let Some(ws) = s.workspace {
            let _ = writeln!(out, "           {}", sched_ir::listing::workspace(p, ws));
        }
    }

    sched_ir::listing::communicators(&mut out, p);

    let _ = writeln!(out, "\nbuffers:");
    let mut by_kind: BTreeMap<(String, &str), (u64, u64)> = BTreeMap::new();
    for b in p.buffers.values() {
        let e = by_kind
            .entry((format!("{:?}", b.kind), b.dtype.name()))
            .or_default();
        e.0 += 1;
        e.1 += b.bytes;
    }
    for ((kind, dtype), (n, bytes)) in &by_kind {
        let _ = writeln!(
            out,
            "  {kind:<15} {dtype} {:>12} {:>19} B",
            plural(*n, "buffer"),
            thousands(*bytes)
        );
    }

    let _ = writeln!(
        out,
        "\nlayers (layers with identical entries share one; `ops` is the hash of the layer's ops \
         relative to it):"
    );
    // The entry of every layer, then of the ops without one; identical entries merge.
    let mut entries: Vec<(String, Vec<String>)> = vec![];
    let mut keys: Vec<Option<LayerId>> = p.layers.keys().map(Some).collect();
    keys.push(None);
    for key in keys {
        let ops: Vec<OpId> = p
            .ops
            .iter()
            .filter(|(_, o)| o.layer == key)
            .map(|(id, _)| id)
            .collect();
        let bufs: Vec<&Buffer> = p.buffers.values().filter(|b| b.layer == key).collect();
        let name = match key {
            Some(l) => p.layers[l].name.clone(),
            None if ops.is_empty() && bufs.is_empty() => continue,
            None => "(no layer)".to_string(),
        };
        let body = layer_entry(p, key, &ops, &bufs);
        match entries.iter_mut().find(|(b, _)| *b == body) {
            Some((_, names)) => names.push(name),
            None => entries.push((body, vec![name])),
        }
    }
    for (body, names) in &entries {
        let _ = writeln!(
            out,
            "  {}:",
            name_list(&names.iter().map(String::as_str).collect::<Vec<_>>())
        );
        out.push_str(body);
    }
    out
}

/// `forward 32, backward 32, group 16 · 40 waits, 20 records`.
/// Each pipeline stage: its ranks, its chunks' layers, and what its own memory plan takes (the
/// arena every rank allocates is the largest stage's); the saved activations' bytes show how
/// many micro-batches are in flight at once.
fn stages(out: &mut String, p: &Program) {
    let _ = writeln!(out, "\nstages:");
    let d = p.layout.stage_size();
    for stage in 0..p.layout.stages {
        let mut chunks: Vec<u32> = vec![];
        let mut layers: Vec<&str> = vec![];
        for (id, l) in p.layers.iter() {
            let on = p
                .ops
                .values()
                .find(|o| o.layer == Some(id))
                .is_some_and(|o| p.streams[o.stream].stage == stage);
            if on {
                layers.push(&l.name);
                if chunks.last() != Some(&l.chunk) {
                    chunks.push(l.chunk);
                }
            }
        }
        let held = |kind: Option<BufferKind>| {
            p.buffers
                .values()
                .filter(|b| b.stage == stage && kind.is_none_or(|k| b.kind == k))
                .map(|b| b.offset + b.bytes)
                .max()
                .unwrap_or(0)
        };
        let activations = held(Some(BufferKind::Activation)).saturating_sub(
            p.buffers
                .values()
                .filter(|b| b.stage == stage && b.kind == BufferKind::Activation)
                .map(|b| b.offset)
                .min()
                .unwrap_or(0),
        );
        let chunks: Vec<String> = chunks.iter().map(u32::to_string).collect();
        let _ = writeln!(
            out,
            "  stage {stage}: ranks {}-{}, chunks {}, layers {}; arena {} B, saved activations within {} B",
            stage * d,
            (stage + 1) * d - 1,
            chunks.join(" "),
            name_list(&layers),
            thousands(held(None)),
            thousands(activations)
        );
    }
}

fn kinds_and_events(ops: &[&Op]) -> String {
    let mut kinds: Vec<(&str, u64)> = vec![];
    for o in ops {
        let k = o.kind_name();
        match kinds.iter_mut().find(|(n, _)| *n == k) {
            Some((_, c)) => *c += 1,
            None => kinds.push((k, 1)),
        }
    }
    let waits: usize = ops.iter().map(|o| o.wait.len()).sum();
    let records = ops.iter().filter(|o| o.record.is_some()).count();
    let kinds: Vec<String> = kinds.iter().map(|(k, c)| format!("{k} {c}")).collect();
    format!(
        "{} · {}, {}",
        kinds.join(", "),
        plural(waits as u64, "wait"),
        plural(records as u64, "record")
    )
}

/// One layer's entry (without its heading): buffers, each stream's ops and collectives, the hash.
fn layer_entry(p: &Program, layer: Option<LayerId>, ops: &[OpId], bufs: &[&Buffer]) -> String {
    let mut out = String::new();
    if !bufs.is_empty() {
        let mut sizes: Vec<((String, &str, u64), u64)> = vec![];
        for b in bufs {
            let k = (format!("{:?}", b.kind), b.dtype.name(), b.bytes);
            match sizes.iter_mut().find(|(x, _)| *x == k) {
                Some((_, n)) => *n += 1,
                None => sizes.push((k, 1)),
            }
        }
        let parts: Vec<String> = sizes
            .iter()
            .map(|((kind, dtype, bytes), n)| format!("{kind} {dtype} {} B x{n}", thousands(*bytes)))
            .collect();
        let _ = writeln!(out, "    buffers: {}", parts.join(", "));
    }
    for (sid, s) in p.streams.iter() {
        let on: Vec<&Op> = ops
            .iter()
            .map(|&id| &p.ops[id])
            .filter(|o| o.stream == sid)
            .collect();
        if on.is_empty() {
            continue;
        }
        let _ = writeln!(out, "    {:<8} {}", s.role.name(), kinds_and_events(&on));
        // Collectives by (kind, communicator, payload): calls.
        let mut colls: Vec<((&str, CommId, u64), u64)> = vec![];
        for o in &on {
            for c in o.collectives() {
                let k = (c.kind.name(), c.comm, c.count * c.dtype.bytes());
                match colls.iter_mut().find(|(x, _)| *x == k) {
                    Some((_, n)) => *n += 1,
                    None => colls.push((k, 1)),
                }
            }
        }
        for ((kind, comm, bytes), n) in colls {
            let _ = writeln!(
                out,
                "             {kind} {comm} ({}) {} B x{n}",
                p.comms[comm].name,
                thousands(bytes)
            );
        }
    }
    let mut h = Fnv::new();
    for &id in ops {
        h.str(&relative_op(p, layer, id));
    }
    let _ = writeln!(out, "    ops {}", h.hex());
    out
}

/// Signed distance from layer `from` to `to`, or where either has none, which one.
fn distance(from: Option<LayerId>, to: Option<LayerId>) -> String {
    match (from, to) {
        (Some(a), Some(b)) => format!("{:+}", b.index() as i64 - a.index() as i64),
        (None, Some(b)) => format!("L{}", b.index()),
        (_, None) => "-".to_string(),
    }
}

/// An op as seen from `layer`: stream, kind, layer distance, micro-step.
fn relative_ref(p: &Program, layer: Option<LayerId>, id: OpId) -> String {
    let o = &p.ops[id];
    format!(
        "{} {} {} {:?}",
        p.streams[o.stream].role.name(),
        o.kind_name(),
        distance(layer, o.layer),
        o.micro_step
    )
}

/// A region as seen from `layer`: its buffer by kind, dtype, size, name and layer distance (not by
/// id, not by offset), and the range inside it.
fn relative_region(p: &Program, layer: Option<LayerId>, r: &Region) -> String {
    let b = &p.buffers[r.buffer];
    // `block[3].params.full.m0.fwd` → `.params.full.m0.fwd`: the name without its layer's.
    let name = match b.layer {
        Some(l) => b
            .name
            .strip_prefix(p.layers[l].name.as_str())
            .unwrap_or(&b.name),
        None => &b.name,
    };
    let range = match r.offset {
        Offset::Fixed(o) => format!("+{o}"),
        Offset::Shard {
            index,
            base,
            stride,
        } => format!("{}*{stride}+{base}", index_name(index)),
    };
    format!(
        "{:?} {} {} {name} {} [{range}:{}]",
        b.kind,
        b.dtype.name(),
        b.bytes,
        distance(layer, b.layer),
        r.bytes
    )
}

/// An op as seen from `layer`, with what it waits on and what was issued just before it.
fn relative_op(p: &Program, layer: Option<LayerId>, id: OpId) -> String {
    let o = &p.ops[id];
    let mut s = format!(
        "{} {:?} {:?}",
        relative_ref(p, layer, id),
        o.role,
        o.record.is_some()
    );
    for r in &o.reads {
        let _ = write!(s, " r {}", relative_region(p, layer, r));
    }
    for r in &o.writes {
        let _ = write!(s, " w {}", relative_region(p, layer, r));
    }
    for c in o.collectives() {
        let _ = write!(
            s,
            " c {} {} {} {} {} -> {}",
            c.kind.name(),
            c.comm,
            c.dtype.name(),
            c.count,
            relative_region(p, layer, &c.input),
            relative_region(p, layer, &c.output)
        );
    }
    for e in &o.wait {
        let _ = write!(s, " wait {}", relative_ref(p, layer, p.events[*e].recorder));
    }
    if id.index() > 0 {
        let _ = write!(
            s,
            " after {}",
            relative_ref(p, layer, OpId::new(id.index() - 1))
        );
    }
    s
}

/// Everything but the offsets: every op line of the listing, every buffer, event and group.
fn program_hash(p: &Program) -> String {
    let mut h = Fnv::new();
    h.str(&p.schedule);
    for n in [
        p.ranks(),
        p.layout.nodes,
        p.layout.gpus_per_node,
        p.micro_steps,
    ] {
        h.u64(n.into());
    }
    for l in p.layers.values() {
        h.str(&l.name);
        h.u64(l.params);
        h.u64(l.padded);
    }
    for s in p.streams.values() {
        h.str(s.role.name());
        if p.layout.stages > 1 {
            h.u64(s.stage.into());
        }
        if let Some(ws) = s.workspace {
            h.u64(ws.buffer.index() as u64);
            h.u64(ws.gemm_bytes);
        }
    }
    for c in p.comms.values() {
        h.str(&c.name);
        h.str(c.scope.name());
        h.u64(c.groups.len() as u64);
        for g in &c.groups {
            h.u64(g.len() as u64);
            for &r in g {
                h.u64(r.into());
            }
        }
    }
    for b in p.buffers.values() {
        h.str(&b.name);
        h.str(&format!("{:?}", b.kind));
        h.str(b.dtype.name());
        h.u64(b.bytes);
        h.u64(b.layer.map_or(u64::MAX, |l| l.index() as u64));
    }
    for e in p.events.values() {
        h.u64(e.recorder.index() as u64);
    }
    for (id, o) in p.ops.iter() {
        h.str(&format!("{:?}", o.role));
        h.str(&op_line(p, id, o));
    }
    h.hex()
}

/// The memory plan: the arena's size and every buffer's offset.
fn memory_plan_hash(p: &Program) -> String {
    let mut h = Fnv::new();
    h.u64(p.arena_bytes);
    for b in p.buffers.values() {
        h.u64(b.offset);
    }
    h.hex()
}

/// `embed`, `block[0] … block[29] (30 layers)`, `block[1], block[3] … block[29] (every 2nd, 15
/// layers)`: names in order, arithmetic runs of three or more collapsed. Names are compared by
/// position in `names`' source, so callers pass them in layer order.
fn name_list(names: &[&str]) -> String {
    // Positions of `block[3]`-style names: the index in brackets, when the prefix agrees.
    let index = |n: &str| -> Option<(String, i64)> {
        let (stem, rest) = n.split_once('[')?;
        let i = rest.strip_suffix(']')?.parse().ok()?;
        Some((stem.to_string(), i))
    };
    let mut parts = vec![];
    let mut i = 0;
    while i < names.len() {
        let mut j = i + 1;
        if let (Some((s0, a)), Some((s1, b))) =
            (index(names[i]), names.get(i + 1).and_then(|n| index(n)))
        {
            let step = b - a;
            if s0 == s1 && step > 0 {
                while j < names.len()
                    && index(names[j])
                        .is_some_and(|(s, x)| s == s0 && x == a + step * (j - i) as i64)
                {
                    j += 1;
                }
            }
            if j - i >= 3 {
                let every = if step == 1 {
                    String::new()
                } else {
                    format!("every {step}, ")
                };
                parts.push(format!(
                    "{} … {} ({every}{} layers)",
                    names[i],
                    names[j - 1],
                    j - i
                ));
                i = j;
                continue;
            }
            j = i + 1;
        }
        parts.push(names[i].to_string());
        i = j;
    }
    parts.join(", ")
}

#[cfg(test)]
#[path = "../../tests/unit/emit_summary.rs"]
mod tests;
