//! A rank's device memory, as the CUDA backend and its host emulation lay it out: two
//! allocations and nothing else.
//!
//! - **The arena**, exactly the plan's `arena_bytes`. Every tensor sits at its planned offset,
//!   and so does each stream's workspace ([`StreamMemory`]: the GEMM library's part, given to
//!   cuBLAS and cuBLASLt, then the fp32 scratch the device layer's bump allocator hands out). The
//!   compiler sizes the workspaces (`schedc::lower::workspace`); the bump allocator refuses, with
//!   the op named, anything past the planned size rather than taking memory elsewhere.
//! - **The constants** ([`ConstsLayout`]), outside the plan, as on the CPU backend, where they
//!   live in host memory beside the arenas: the batch's tokens (the step's input, i32, 2·T per
//!   micro-step: `M·2·T·4` bytes), the loss and sum-of-squares accumulators (one f64 each: the
//!   step's output, read by the host, and the gradient norm's f64 sum before it is stored into
//!   the planned `clip.sumsq`, both summed over the processes after the step), a flag the
//!   processes sum to agree between steps (one f64: `Backend::all_agree`), the rotary tables (2·s·d/2 fp32 when the model uses rotary
//!   positions), plus 64 bytes of slack. They are uploaded once (tables) or written by the
//!   host between steps
//!   (tokens, accumulators): no op of the plan produces them, so they are inputs and outputs of
//!   a step, not tensors whose lifetimes a memory plan could overlap.
//!
//! Built everywhere (plain arithmetic on the plan), so the emulation carves exactly what the
//! device does.
#![cfg_attr(not(feature = "cuda"), allow(dead_code))]

use super::enqueue::DevAddr;
use super::gpu::Consts;
use crate::plan::Plan;
use sched_ir::ir::StreamId;

/// Where one stream's workspace lies in the rank's arena (byte offsets from the arena's start).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StreamMemory {
    /// The GEMM library's workspace: offset and bytes (0 bytes on streams without layer math).
    pub gemm: (u64, usize),
    /// The fp32 scratch: offset and floats.
    pub scratch: (u64, usize),
}

impl StreamMemory {
    /// Stream `s`'s workspace as planned, or none when its ops need no scratch.
    pub fn of(p: &Plan, s: StreamId) -> Option<StreamMemory> {
        let ws = p.program.streams[s].workspace?;
        let b = &p.program.buffers[ws.buffer];
        Some(StreamMemory {
            gemm: (b.offset, ws.gemm_bytes as usize),
            scratch: (
                b.offset + ws.gemm_bytes,
                ((b.bytes - ws.gemm_bytes) / 4) as usize,
            ),
        })
    }

    /// The scratch as a [`super::gpu::Gpu`] takes it: its address in an arena at `arena` and its
    /// floats; a stream without a workspace gets none (any allocation then fails, naming the op).
    pub fn scratch_at(m: Option<StreamMemory>, arena: DevAddr) -> (DevAddr, usize) {
        m.map_or((DevAddr::NULL, 0), |m| {
            (arena.add_bytes(m.scratch.0), m.scratch.1)
        })
    }
}

/// Byte offsets of a rank's constants in their one allocation (see the module doc).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConstsLayout {
    /// Tokens per micro-batch (T).
    pub t: usize,
    /// i32 tokens at offset 0: per micro-step, T inputs then T targets.
    pub tokens_bytes: u64,
    /// The loss accumulator (f64), right after the tokens (8-aligned); sum of squares after it.
    pub loss: u64,
    pub sumsq: u64,
    /// A flag (f64) the processes sum to agree between steps (`Backend::all_agree`), after the
    /// sum of squares.
    pub agree: u64,
    /// The rotary tables (cos then sin), when the model uses them.
    pub rope: Option<u64>,
    /// The allocation's size.
    pub bytes: u64,
    /// The initial contents: zero tokens and accumulators, the tables.
    pub contents: Vec<u8>,
}

impl ConstsLayout {
    pub fn of(p: &Plan) -> ConstsLayout {
        let model = &p.job.model;
        let t = (model.micro_batch * model.seq_len) as usize;
        let tokens_bytes = u64::from(p.program.micro_steps) * 2 * t as u64 * 4;
        let loss = tokens_bytes.div_ceil(8) * 8;
        let sumsq = loss + 8;
        let agree = sumsq + 8;
        let mut contents = vec![0u8; (agree + 8) as usize];
        let rope = p.maths.iter().find_map(|m| match m.kind() {
            crate::math::Kind::Transformer(bp) => bp.rope.as_ref(),
            _ => None,
        });
        let rope = rope.map(|r| {
            let at = contents.len() as u64;
            contents.extend(r.cos.iter().chain(&r.sin).flat_map(|x| x.to_le_bytes()));
            at
        });
        let bytes = contents.len() as u64 + 64;
        contents.resize(bytes as usize, 0);
        ConstsLayout {
            t,
            tokens_bytes,
            loss,
            sumsq,
            agree,
            rope,
            bytes,
            contents,
        }
    }

    /// The device's view of constants allocated at `base`.
    pub fn at(&self, base: DevAddr) -> Consts {
        Consts {
            tokens: base,
            loss: base.add_bytes(self.loss),
            sumsq: base.add_bytes(self.sumsq),
            rope: self.rope.map(|o| base.add_bytes(o)),
            t: self.t,
        }
    }

    /// What the host writes before a step: the tokens of every micro-batch (inputs, then targets),
    /// then the two accumulators zeroed (they follow the tokens directly: the token bytes are a
    /// multiple of 8). `None` when a batch, or their number, is not the plan's.
    pub fn step_bytes(&self, batches: &[crate::backend::Batch]) -> Option<Vec<u8>> {
        if batches.len() as u64 * 2 * self.t as u64 * 4 != self.tokens_bytes {
            return None;
        }
        let mut v: Vec<u8> = Vec::with_capacity(self.sumsq as usize + 8);
        for b in batches {
            if b.inputs.len() != self.t || b.targets.len() != self.t {
                return None;
            }
            v.extend(b.inputs.iter().flat_map(|x| (*x as i32).to_le_bytes()));
            v.extend(b.targets.iter().flat_map(|x| (*x as i32).to_le_bytes()));
        }
        v.resize(self.sumsq as usize + 8, 0);
        Some(v)
    }
}
