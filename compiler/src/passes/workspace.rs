//! Workspaces: each stream that runs compute gets one planned buffer for its ops' scratch
//! (lowering spec §6: every byte a step uses is a planned buffer), sized by
//! [`crate::lower::workspace`].
//!
//! Reads each op's kind, layer, stream and regions; creates one [`BufferKind::Workspace`] buffer
//! per stream whose compute ops need scratch, records it as the stream's [`StreamWorkspace`], and
//! appends one write of it to every op that uses it, so the verifier's race and memory-plan
//! proofs see every access. Preserves everything else (issue order, streams, waits: all the
//! accesses of a workspace are on its stream, ordered by stream order, so no event is needed).
//!
//! Layout of a stream's workspace: the GEMM library's workspace first
//! ([`StreamWorkspace::gemm_bytes`], only on streams that run layer math: cuBLAS and cuBLASLt
//! share it), then the fp32 scratch the device layer's bump allocator hands out, as many floats
//! as the stream's neediest op takes. A layer op writes both parts (from byte 0 to the end of its
//! own scratch); the loss, the update and the gradient norm write only their scratch; accumulate
//! and copy ops use none.
//!
//! **Lifetime: the stream's, not the op's.** One buffer per stream lives from the stream's first
//! op that uses it to its last, rather than one buffer per op. The runtime's workspace is a
//! per-stream bump allocator given back after every op, which this matches. Per-op buffers would
//! buy little: the sizes depend on the layer kind, not on forward or backward (only gradient parts
//! padded past the gradient and aliased outputs add to an op), so in a model of repeated blocks
//! nearly every layer op of the compute stream needs the stream's maximum, and consecutive ops
//! follow each other with nothing in between: the memory plan would chain their buffers at one
//! offset, sized by the largest, and could lend bytes only to buffers alive entirely inside the
//! turn of a smaller op (the embedding's, the loss's). And they would add one buffer per compute op
//! (thousands on the 1,024-rank benchmark programs) to every pass and proof, where this adds one
//! per stream (0.7 ms for the workspace pass on the 1,024-rank LLaMA-70B example).

use crate::lower::workspace::{gemm_bytes, needs, runs_layer_math};
use sched_ir::ir::*;
use sched_ir::job::{Dtype, Job};

/// Creates the workspaces of `p`'s streams (after stream assignment, before events).
pub fn run(p: &mut Program, job: &Job) {
    let (streams, per_op) = needs(job, p);
    let gemm = gemm_bytes(job);
    let stream_ids: Vec<StreamId> = p.streams.keys().collect();
    for s in stream_ids {
        let need = streams[s];
        let gemm_bytes = if need.layer_math { gemm } else { 0 };
        let bytes = gemm_bytes + need.floats * Dtype::Fp32.bytes();
        if bytes == 0 {
            continue;
        }
        let buffer = p.buffers.push(Buffer {
            name: match p.layout.stages {
                1 => format!("workspace.{}", p.streams[s].role.name()),
                _ => format!(
                    "workspace.{}.s{}",
                    p.streams[s].role.name(),
                    p.streams[s].stage
                ),
            },
            kind: BufferKind::Workspace,
            dtype: Dtype::Fp32,
            bytes,
            layer: None,
            offset: 0,
            stage: p.streams[s].stage,
        });
        p.streams[s].workspace = Some(StreamWorkspace { buffer, gemm_bytes });
    }
    for ((_, op), floats) in p.ops.iter_mut().zip(per_op) {
        let Some(ws) = p.streams[op.stream].workspace else {
            continue;
        };
        let scratch = floats * Dtype::Fp32.bytes();
        let region = if runs_layer_math(op) {
            Region::whole(ws.buffer, ws.gemm_bytes + scratch)
        } else if scratch > 0 {
            Region {
                buffer: ws.buffer,
                offset: Offset::Fixed(ws.gemm_bytes),
                bytes: scratch,
            }
        } else {
            continue;
        };
        op.writes.push(region);
    }
}
