//! The cost model: how long one compute op or one collective takes on its own.
//!
//! **Compute.** Every zoo layer's forward work is split into matrix-multiply FLOPs, timed at
//! `peak_flops × efficiency`, and element-wise memory traffic (norms, activations, rotary
//! embeddings, residual adds, softmax, the loss), timed at the GPU's memory bandwidth; the two are
//! added, since they run as separate kernels. The memory bandwidth is the cluster's
//! `memory_bandwidth`, or derived: `peak_flops / FLOPS_PER_HBM_BYTE`
//! (200 FLOP per byte puts an A100's 312 TFLOPS at
//! 1.56 TB/s, about what its 2 TB/s HBM sustains). Attention's score and value products cost
//! 4·s·h FLOPs per token at full size (what MFU counts, [`model_flops_per_step`]); for time,
//! `attention = flash` skips the masked half (2·s·h), `naive` computes the whole matrix and also
//! moves the s×s probabilities through memory. Backward is twice the forward's matrix FLOPs
//! (gradients of inputs and of weights), plus half an attention forward for flash, which recomputes
//! the probabilities (FlashAttention-2: backward ≈ 2.5× forward), and twice its element-wise
//! traffic. Recompute costs a forward. The optimizer update is memory-bound: Adam reads and writes
//! fp32 master, m and v (24 bytes), reads the gradient and writes the model-dtype parameter.
//! Accumulate, copy and grad-norm ops are pure memory traffic. `dense` layers cost
//! `flops_per_token` matrix FLOPs and touch `activation_bytes_per_token` bytes per token.
//!
//! **Collectives** use the α–β model of AMSP §IV-A with ring algorithms. A group of `a` GPUs per
//! node × `b` nodes (p = a·b) has its ring laid out node by node: every ring step moves one chunk
//! of payload/p along every edge. An edge inside a node uses the sending GPU's intra-node link; an
//! edge leaving a node uses the node's network, which is shared by every ring of the same call
//! that leaves that node (SPMD: with `a` < G, the G/a groups of the node all run at once). A step
//! therefore takes α of the slowest link class plus chunk over the bottleneck share; p−1 steps
//! for all-gather and reduce-scatter, 2(p−1) for all-reduce. All-reduce uses the double-binary
//! tree instead when faster (2·⌈log₂ p⌉ latencies, 2·payload over the bottleneck). Broadcast is a
//! pipelined ring: p−1 latencies plus the payload over the bottleneck. A `measured` table for the
//! collective and mesh replaces the model's time by payload ÷ interpolated bandwidth.
//!
//! A coalesced `group` call is one NCCL group launch: its collectives' chunks travel in the same
//! ring steps, so it pays one latency per step (of its longest member) and carries the sum of the
//! payloads; [`Transfer`] describes it so that the engine can share links between overlapping
//! calls.

use crate::ir::ComputeKind;
use crate::job::{
    Activation, Attention, Collective, Job, Layer, LayerKind, Link, MeasuredTable, Mesh,
};

/// Ratio of dense peak FLOP/s to sustained memory bandwidth (bytes/s) used when the cluster gives
/// no `memory_bandwidth`.
pub const FLOPS_PER_HBM_BYTE: f64 = 200.0;

/// Where a communicator's group sits, as the engine and the planner see it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GroupShape {
    /// Members of the group.
    pub p: u32,
    /// Most members on one node.
    pub a: u32,
    /// Nodes the group spans.
    pub b: u32,
    /// Ring edges of the whole call (all groups of the communicator) that leave one node.
    pub out_edges_per_node: u32,
}

impl GroupShape {
    /// A regular `a x b` group on nodes of `gpus_per_node` GPUs, every GPU in some group.
    pub fn mesh(a: u32, b: u32, gpus_per_node: u32) -> Self {
        let a = a.max(1);
        GroupShape {
            p: a * b.max(1),
            a,
            b: b.max(1),
            out_edges_per_node: if b > 1 { (gpus_per_node / a).max(1) } else { 0 },
        }
    }
}

/// What one collective call asks of the links, alone: a fixed latency, then bytes over the
/// sending GPU's intra-node link and over its node's network, which move at the pace of the
/// slower of the two.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Transfer {
    pub latency_s: f64,
    /// Bytes one GPU sends over its intra-node link.
    pub intra_bytes: f64,
    /// Bytes its node sends over the network (all rings of the call together).
    pub inter_bytes: f64,
    /// Seconds the bytes take alone on the links (the bottleneck of the two).
    pub transfer_s: f64,
}

impl Transfer {
    pub fn seconds(&self) -> f64 {
        self.latency_s + self.transfer_s
    }
}

/// Costs of one job's ops on its cluster.
#[derive(Clone, Debug)]
pub struct CostModel {
    /// Sustained matrix-multiply FLOP/s: `peak_flops × efficiency`.
    matmul_flops: f64,
    /// Sustained memory bandwidth, bytes/s.
    memory_bandwidth: f64,
    intra: Link,
    inter: Link,
    gpus_per_node: u32,
    measured: Vec<MeasuredTable>,
    /// Tokens one rank processes per micro-step.
    tokens: f64,
    seq_len: f64,
    dtype_bytes: f64,
    grad_bytes: f64,
    optimizer_bytes_per_param: f64,
    /// s_g and s_os, for the sizes of accumulators and optimizer shards.
    grad_shards: u64,
    optimizer_shards: u64,
}

impl CostModel {
    pub fn new(job: &Job) -> Self {
        let c = &job.cluster;
        let m = &job.model;
        CostModel {
            matmul_flops: c.peak_flops * c.efficiency,
            memory_bandwidth: c
                .memory_bandwidth
                .unwrap_or(c.peak_flops / FLOPS_PER_HBM_BYTE),
            intra: c.intra_node,
            inter: c.inter_node,
            gpus_per_node: job.schedule.gpus_per_node,
            measured: c.measured.clone(),
            tokens: (m.micro_batch * m.seq_len) as f64,
            seq_len: m.seq_len as f64,
            dtype_bytes: m.dtype.bytes() as f64,
            grad_bytes: m.grad_dtype.bytes() as f64,
            // fp32 state read and written, gradient read, parameter written.
            optimizer_bytes_per_param: 2.0 * m.optimizer.state_bytes_per_param() as f64
                + m.grad_dtype.bytes() as f64
                + m.dtype.bytes() as f64,
            grad_shards: job.schedule.shard.grads.size(),
            optimizer_shards: job.schedule.shard.optimizer.size(),
        }
    }

    /// Sustained memory bandwidth in bytes/s (derived, see the module doc).
    pub fn memory_bandwidth(&self) -> f64 {
        self.memory_bandwidth
    }

    /// Seconds to move `bytes` through GPU memory.
    pub fn memory_seconds(&self, bytes: f64) -> f64 {
        bytes / self.memory_bandwidth
    }

    /// Seconds of one layer's compute op for one micro-step on one rank.
    pub fn compute_seconds(&self, layer: &Layer, kind: ComputeKind) -> f64 {
        let w = self.forward_work(&layer.kind);
        let mem = |bytes: f64| bytes / self.memory_bandwidth;
        let mm = |flops: f64| flops / self.matmul_flops;
        match kind {
            ComputeKind::Forward | ComputeKind::Recompute => mm(w.matmul) + mem(w.bytes),
            ComputeKind::Backward => {
                mm(2.0 * w.matmul + w.backward_extra) + mem(2.0 * w.bytes + w.backward_bytes)
            }
            ComputeKind::Loss => match layer.kind {
                // Read the logits, a max/sum pass, write their gradient.
                LayerKind::LmHead { vocab, .. } => {
                    mem(3.0 * self.tokens * vocab as f64 * self.dtype_bytes)
                }
                _ => mem(3.0 * self.tokens * self.dtype_bytes),
            },
            ComputeKind::Update => {
                let shard = layer.params.div_ceil(self.optimizer_shards) as f64;
                mem(shard * self.optimizer_bytes_per_param)
            }
            ComputeKind::Accumulate => {
                let shard = layer.params.div_ceil(self.grad_shards) as f64;
                mem(3.0 * shard * self.grad_bytes)
            }
            ComputeKind::Copy => mem(2.0 * layer.params as f64 * self.dtype_bytes),
            ComputeKind::GradNorm => {
                let shard = layer.params.div_ceil(self.optimizer_shards) as f64;
                mem(shard * self.grad_bytes)
            }
        }
    }

    /// One forward pass of a layer over one micro-step's tokens.
    fn forward_work(&self, kind: &LayerKind) -> Work {
        let t = self.tokens;
        let d = self.dtype_bytes;
        match *kind {
            LayerKind::Embedding { hidden, .. } => Work {
                // Gather rows (plus learned positions) and write the hidden states.
                bytes: 3.0 * t * hidden as f64 * d,
                ..Work::default()
            },
            LayerKind::Transformer(tr) => {
                let h = tr.hidden as f64;
                let kv = tr.kv_dim() as f64;
                let f = tr.ffn as f64;
                let s = self.seq_len;
                let full_attention = 4.0 * s * h * t;
                let (attention, probs_bytes, extra) = match tr.attention {
                    // Causal blocks above the diagonal are skipped; backward recomputes P.
                    Attention::Flash => (full_attention / 2.0, 0.0, full_attention / 4.0),
                    // The whole s×s matrix, masked, written, softmaxed and read back.
                    Attention::Naive => (full_attention, 4.0 * t * s * tr.heads as f64 * d, 0.0),
                };
                let mlp = mlp_work(t, h, f, tr.act, d);
                Work {
                    matmul: 2.0 * t * h * (h + 2.0 * kv) + 2.0 * t * h * h + attention + mlp.matmul,
                    // Attention norm (read, write), rotary on q and k, residual add.
                    bytes: t * d * (2.0 * h + 2.0 * (h + kv) + 3.0 * h) + probs_bytes + mlp.bytes,
                    backward_extra: extra,
                    backward_bytes: probs_bytes / 2.0,
                }
            }
            LayerKind::Mlp(m) => mlp_work(t, m.hidden as f64, m.ffn as f64, m.act, d),
            LayerKind::LmHead { hidden, vocab, .. } => Work {
                matmul: 2.0 * t * hidden as f64 * vocab as f64,
                // Final norm, and the logits written.
                bytes: t * d * (2.0 * hidden as f64 + vocab as f64),
                ..Work::default()
            },
            LayerKind::Dense {
                flops_per_token,
                activation_bytes_per_token,
                ..
            } => Work {
                matmul: flops_per_token * t,
                bytes: activation_bytes_per_token as f64 * t,
                ..Work::default()
            },
        }
    }

    /// Seconds of one collective of `payload_bytes` (cli.md's payload: an all-gather's output, a
    /// reduce-scatter's input, an all-reduce's or broadcast's buffer) on a group of `a` GPUs per
    /// node × `b` nodes, alone on the links (the other groups of the same call, on the same nodes,
    /// run at the same time and share each node's network, as they do in an SPMD program).
    pub fn collective_seconds(&self, kind: Collective, a: u32, b: u32, payload_bytes: u64) -> f64 {
        let shape = GroupShape::mesh(a, b, self.gpus_per_node);
        self.transfer(&[(kind, payload_bytes)], shape).seconds()
    }

    /// What one call of `parts` (one collective, or a coalesced group's members, all on groups of
    /// `shape`) asks of the links.
    pub fn transfer(&self, parts: &[(Collective, u64)], shape: GroupShape) -> Transfer {
        if shape.p <= 1 || parts.is_empty() {
            return Transfer::default();
        }
        let alpha = if shape.b > 1 {
            self.inter
                .latency
                .max(if shape.a > 1 { self.intra.latency } else { 0.0 })
        } else {
            self.intra.latency
        };
        // Chunks one member sends over its outgoing edge, summed over the parts; latency steps.
        let mut sent = 0.0;
        let mut steps = 0.0f64;
        let mut measured = 0.0;
        let mut all_measured = true;
        for &(kind, payload) in parts {
            let m = payload as f64;
            let (chunks, s) = self.algorithm(kind, shape, m, alpha);
            sent += chunks;
            steps = steps.max(s);
            match self.measured_seconds(kind, shape, payload) {
                Some(t) => measured += t,
                None => all_measured = false,
            }
        }
        let intra_bytes = if shape.a > 1 { sent } else { 0.0 };
        let inter_bytes = if shape.b > 1 {
            sent * f64::from(shape.out_edges_per_node)
        } else {
            0.0
        };
        let transfer_s =
            (intra_bytes / self.intra.bandwidth).max(inter_bytes / self.inter.bandwidth);
        if all_measured {
            // The table's time replaces the model's; the link demands keep their proportions so
            // overlapping calls still share links in the engine.
            let scale = if transfer_s > 0.0 {
                measured / transfer_s
            } else {
                0.0
            };
            return Transfer {
                latency_s: 0.0,
                intra_bytes: intra_bytes * scale,
                inter_bytes: inter_bytes * scale,
                transfer_s: measured,
            };
        }
        Transfer {
            latency_s: steps * alpha,
            intra_bytes,
            inter_bytes,
            transfer_s,
        }
    }

    /// Bytes one member sends along its ring edge and latency steps for one collective: the ring,
    /// or for all-reduce the tree when that is faster alone.
    fn algorithm(&self, kind: Collective, shape: GroupShape, m: f64, alpha: f64) -> (f64, f64) {
        let p = f64::from(shape.p);
        match kind {
            Collective::AllGather | Collective::ReduceScatter => (m * (p - 1.0) / p, p - 1.0),
            Collective::Broadcast => (m, p - 1.0),
            Collective::AllReduce => {
                let ring = (2.0 * m * (p - 1.0) / p, 2.0 * (p - 1.0));
                let tree = (2.0 * m, 2.0 * p.log2().ceil());
                let bw = self.bottleneck_bandwidth(shape);
                let time = |(bytes, steps): (f64, f64)| steps * alpha + bytes / bw;
                if time(tree) < time(ring) {
                    tree
                } else {
                    ring
                }
            }
        }
    }

    /// Bandwidth one member's edge gets alone: the slower of its intra-node link and its share of
    /// the node's network.
    fn bottleneck_bandwidth(&self, shape: GroupShape) -> f64 {
        let intra = if shape.a > 1 {
            self.intra.bandwidth
        } else {
            f64::INFINITY
        };
        let inter = if shape.b > 1 {
            self.inter.bandwidth / f64::from(shape.out_edges_per_node.max(1))
        } else {
            f64::INFINITY
        };
        intra.min(inter)
    }

    /// Seconds from a `measured` table for this collective and mesh, if there is one.
    fn measured_seconds(&self, kind: Collective, shape: GroupShape, payload: u64) -> Option<f64> {
        let mesh = Mesh {
            intra: shape.a,
            inter: shape.b,
        };
        let t = self
            .measured
            .iter()
            .find(|t| t.collective == kind && t.mesh == mesh && !t.points.is_empty())?;
        Some(payload as f64 / interpolate(&t.points, payload))
    }
}

/// Algorithm bandwidth at `size`: linear in log size between points, clamped outside them.
fn interpolate(points: &[(u64, f64)], size: u64) -> f64 {
    let (first, last) = (points[0], points[points.len() - 1]);
    if size <= first.0 {
        return first.1;
    }
    if size >= last.0 {
        return last.1;
    }
    let x = (size as f64).ln();
    for w in points.windows(2) {
        let ((s0, b0), (s1, b1)) = (w[0], w[1]);
        if size <= s1 {
            let (x0, x1) = ((s0 as f64).ln(), (s1 as f64).ln());
            return b0 + (b1 - b0) * (x - x0) / (x1 - x0);
        }
    }
    last.1
}

/// A forward pass's work; backward adds `backward_extra` matrix FLOPs and `backward_bytes`.
#[derive(Clone, Copy, Debug, Default)]
struct Work {
    matmul: f64,
    bytes: f64,
    backward_extra: f64,
    backward_bytes: f64,
}

fn mlp_work(t: f64, h: f64, f: f64, act: Activation, d: f64) -> Work {
    let (mats, act_bytes) = match act {
        Activation::Gelu => (2.0, 2.0 * f),
        Activation::SwiGlu => (3.0, 3.0 * f),
    };
    Work {
        matmul: 2.0 * t * h * f * mats,
        // Norm (read, write), activation, residual add.
        bytes: t * d * (2.0 * h + act_bytes + 3.0 * h),
        ..Work::default()
    }
}

/// Model FLOPs of one layer's forward for one token, as MFU counts them (cli.md): 2 per
/// multiply-add with a weight, plus 4·seq_len·hidden for attention, not halved for the mask.
pub fn model_flops_per_token(layer: &Layer, seq_len: u64) -> f64 {
    match layer.kind {
        LayerKind::Embedding { .. } => 0.0,
        LayerKind::Transformer(t) => {
            let h = t.hidden as f64;
            let mats = match t.act {
                Activation::Gelu => 2.0,
                Activation::SwiGlu => 3.0,
            };
            2.0 * (h * (h + 2.0 * t.kv_dim() as f64) + h * h + mats * h * t.ffn as f64)
                + 4.0 * seq_len as f64 * h
        }
        LayerKind::Mlp(m) => {
            let mats = match m.act {
                Activation::Gelu => 2.0,
                Activation::SwiGlu => 3.0,
            };
            2.0 * mats * m.hidden as f64 * m.ffn as f64
        }
        LayerKind::LmHead { hidden, vocab, .. } => 2.0 * hidden as f64 * vocab as f64,
        LayerKind::Dense {
            flops_per_token, ..
        } => flops_per_token,
    }
}

/// cli.md's MFU numerator: 3 × the forward model FLOPs of one step, over all ranks and
/// micro-steps (recomputation adds nothing).
pub fn model_flops_per_step(job: &Job) -> f64 {
    let m = &job.model;
    let per_token: f64 = m
        .layers
        .iter()
        .map(|l| model_flops_per_token(l, m.seq_len))
        .sum();
    let tokens = (m.micro_batch * m.seq_len) as f64
        * f64::from(job.schedule.micro_steps)
        * job.ranks() as f64;
    3.0 * per_token * tokens
}
