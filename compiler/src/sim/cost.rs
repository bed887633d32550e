//! The cost model: how long one compute op or one collective takes on its own.
//!
//! **Compute.** Every zoo layer's forward is a list of kernels: its matrix products with their
//! exact shapes (QKV with GQA, the output projection, the MLP's 2 or 3 matrices, the LM head), an
//! attention kernel, and element-wise kernels (norms, activations, rotary embeddings, residual
//! adds, softmax, the loss) that only move memory. A matrix product C(m×n) = A(m×k)·B(k×n) is timed
//! by a roofline: the larger of its FLOPs at `peak_flops × efficiency × shape factor` and the bytes
//! of its three operands at the memory bandwidth. The shape factor ([`gemm_shape_factor`]) is
//! below 1 for small or skinny products: wave quantization (the m·n output is cut into tiles, one
//! per SM at a time, and the last wave runs partly empty: `w / (w + ½)` for `w` waves of
//! [`WAVE_ELEMENTS`] outputs on an A100, scaled by the GPU's peak) times the inner dimension's
//! overhead of each tile (`k / (k + K_HALF)`, its prologue and epilogue against its main loop).
//! `efficiency` is what large products reach (dsl.md), so a 4096-token product with inner size
//! 4096 runs at about 0.93 of it on an A100. Attention is timed as one fused kernel over its
//! FLOPs with inner size the head dimension (flash attention skips the causally masked half;
//! `naive` computes the whole matrix and also moves the s×s probabilities through memory).
//! Backward computes, for every forward product, the input's gradient (m×k from m×n by n×k) and
//! the weight's (k×n, inner size m), plus half an attention forward for flash, which recomputes
//! the probabilities (FlashAttention-2: backward ≈ 2.5× forward), and twice the element-wise
//! traffic. Recompute costs a forward. Every kernel also
//! pays [`KERNEL_LAUNCH_S`]. The memory bandwidth is the cluster's `memory_bandwidth`, or derived:
//! `peak_flops / FLOPS_PER_HBM_BYTE` (200 FLOP per byte puts an A100's 312 TFLOPS at 1.56 TB/s,
//! about what its 2 TB/s HBM sustains). The optimizer update, gradient accumulation, casts and
//! copies run at memory speed: Adam reads and writes fp32 master, m and v (24 bytes), reads the
//! gradient and writes the model-dtype parameter (the cast). `dense` layers cost
//! `flops_per_token` matrix FLOPs (at `efficiency`: their shapes are not known) and touch
//! `activation_bytes_per_token` bytes per token. MFU counts attention at full size
//! ([`model_flops_per_step`]).
//!
//! **Contention.** A compute kernel that runs while collectives move bytes on the same GPU is
//! slowed: communication kernels take SMs and memory bandwidth. The engine runs compute at speed
//! `1 / (1 + contention × n)` while `n` collectives of the rank are moving bytes; the default
//! [`CONTENTION`] is the mean compute slowdown under overlap measured by Lee et al. 2025, and
//! [`CONTENTION_RANGE`] spans no interference to their largest slowdown.
//!
//! **Collectives** use the α–β model of AMSP §IV-A with ring algorithms, over the links' nominal
//! bandwidths × [`LINK_EFFICIENCY`] (what NCCL sustains of them). A group of `a` GPUs per
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
//! calls. Every call (a coalesced group once) also pays [`COLLECTIVE_START_S`], the fixed cost of
//! launching NCCL's kernel, on top of the per-step latencies; a `measured` time already holds it.
//!
//! A pipeline's `send` or `recv` is one message over the link between its two ranks (one latency
//! step); a group of them loads each direction of a full-duplex link with its own sum
//! ([`CostModel::p2p_transfer`]).

use sched_ir::ir::ComputeKind;
use sched_ir::job::{
    Activation, Attention, Collective, Job, Layer, LayerKind, Link, MeasuredTable, Mesh,
};

/// Ratio of dense peak FLOP/s to sustained memory bandwidth (bytes/s) used when the cluster gives
/// no `memory_bandwidth`.
pub const FLOPS_PER_HBM_BYTE: f64 = 200.0;

/// Compute slowdown per collective moving bytes beside it: 18.9%, the mean slowdown of compute
/// overlapped with communication that Lee et al. measured on A100, H100, MI210 and MI250 training
/// GPT and LLaMA models ("Characterizing Compute-Communication Overlap in GPU-Accelerated
/// Distributed Deep Learning", arXiv 2507.03114, 2025, abstract and §V).
pub const CONTENTION: f64 = 0.189;

/// What the model is unsure of about [`CONTENTION`]: from none (communication on copy engines, or
/// the fully ideal overlap the same paper uses as its baseline) to 40%, their largest slowdown.
pub const CONTENTION_RANGE: (f64, f64) = (0.0, 0.40);

/// Seconds every compute kernel adds to its work: the gap between back-to-back kernels on one
/// stream when the host launches ahead (NVIDIA, "Getting Started with CUDA Graphs", 2019: 2.9 µs
/// kernels took 3.8 µs each in a stream, about 1 µs each of launch overhead).
pub const KERNEL_LAUNCH_S: f64 = 1.0e-6;

/// Seconds a collective call pays once to start its kernel, on top of its per-step latencies:
/// NCCL's own tuning model's base latency for ring algorithms with the Simple protocol, used for
/// large messages (NVIDIA/nccl `src/graph/tuning.cc`, `baseLat`, Ring/Simple = 8.4 µs).
pub const COLLECTIVE_START_S: f64 = 8.4e-6;

/// Fraction of a link's nominal bandwidth that NCCL's ring collectives sustain, calibrated on the two
/// all-gather bandwidths MiCS measured (§3.2: 128 GB/s inside a node of V100s with 150 GB/s of
/// NVLink each, 0.85; 11 GB/s over 8 nodes of 100 Gbps, 0.88). NCCL's own tuning model puts A100
/// rings at 235 of 300 GB/s, 0.78 (NVIDIA/nccl `src/graph/tuning.cc`). Applied to both link
/// classes; `measured` tables are taken as they are.
pub const LINK_EFFICIENCY: f64 = 0.86;

/// Output elements one wave of GEMM tiles covers on a GPU of [`WAVE_PEAK_FLOPS`]: 2^21, about 128
/// SMs with a 128×128 tile each (A100: 108 SMs; NVIDIA's "Matrix Multiplication Background" guide,
/// wave and tile quantization). Other GPUs scale it with their peak (parallel width grows with it:
/// an H100 needs about 3× the outputs to fill, a 100 GFLOPS CPU "cluster" a few hundred).
pub const WAVE_ELEMENTS: f64 = 2_097_152.0;

/// The peak at which one wave is [`WAVE_ELEMENTS`] outputs: an A100's dense 16-bit 312 TFLOPS.
pub const WAVE_PEAK_FLOPS: f64 = 312e12;

/// Inner size at which a GEMM tile spends as long in its prologue and epilogue as in its main
/// loop: 32 puts a head dimension of 128 at 0.8, so flash attention at the default efficiency
/// runs at 60% of peak, inside FlashAttention-2's 50–73% on A100 (Dao 2023, §4.1).
pub const K_HALF: f64 = 32.0;

/// The fraction of `efficiency` a product C(m×n) = A(m×k)·B(k×n) reaches on a GPU whose wave of
/// tiles covers `wave` outputs: wave quantization times the inner dimension's per-tile overhead
/// (see the module doc). Tends to 1 for large products.
pub fn gemm_shape_factor(m: f64, n: f64, k: f64, wave: f64) -> f64 {
    let waves = m * n / wave;
    waves / (waves + 0.5) * k / (k + K_HALF)
}

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
    /// Sustained matrix-multiply FLOP/s of large products: `peak_flops × efficiency`.
    matmul_flops: f64,
    /// Compute slowdown per collective moving bytes beside it ([`CONTENTION`]).
    contention: f64,
    /// Outputs one wave of GEMM tiles covers on this GPU ([`WAVE_ELEMENTS`] scaled by its peak).
    wave: f64,
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
    /// t, the tensor-parallel degree: a sublayer's products are 1/t of the layer's.
    tensor: u32,
}

impl CostModel {
    pub fn new(job: &Job) -> Self {
        let c = &job.cluster;
        let m = &job.model;
        CostModel {
            matmul_flops: c.peak_flops * c.efficiency,
            contention: CONTENTION,
            wave: WAVE_ELEMENTS * c.peak_flops / WAVE_PEAK_FLOPS,
            memory_bandwidth: c
                .memory_bandwidth
                .unwrap_or(c.peak_flops / FLOPS_PER_HBM_BYTE),
            intra: Link {
                bandwidth: c.intra_node.bandwidth * LINK_EFFICIENCY,
                latency: c.intra_node.latency,
            },
            inter: Link {
                bandwidth: c.inter_node.bandwidth * LINK_EFFICIENCY,
                latency: c.inter_node.latency,
            },
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
            tensor: job.schedule.tensor.size.max(1),
        }
    }

    /// The same model with another compute slowdown per overlapping collective (the trust range
    /// of [`CONTENTION`]).
    pub fn with_contention(mut self, contention: f64) -> Self {
        self.contention = contention.max(0.0);
        self
    }

    /// Compute slowdown per collective moving bytes beside a compute op.
    pub fn contention(&self) -> f64 {
        self.contention
    }

    /// Sustained bandwidths (bytes/s) of one GPU's intra-node link and of its node's network:
    /// the cluster's nominal figures × [`LINK_EFFICIENCY`].
    pub fn link_bandwidths(&self) -> (f64, f64) {
        (self.intra.bandwidth, self.inter.bandwidth)
    }

    /// Sustained memory bandwidth in bytes/s (the cluster's, or derived: see the module doc).
    pub fn memory_bandwidth(&self) -> f64 {
        self.memory_bandwidth
    }

    /// Seconds of one memory-bound kernel moving `bytes` through GPU memory, launch included.
    pub fn memory_seconds(&self, bytes: f64) -> f64 {
        bytes / self.memory_bandwidth + KERNEL_LAUNCH_S
    }

    /// Seconds of one matrix product C(m×n) = A(m×k)·B(k×n) in the model's dtype, launch excluded:
    /// the roofline of its FLOPs at the shape's efficiency and its operands' bytes.
    pub fn gemm_seconds(&self, m: f64, n: f64, k: f64) -> f64 {
        if m <= 0.0 || n <= 0.0 || k <= 0.0 {
            return 0.0;
        }
        let flops = 2.0 * m * n * k / (self.matmul_flops * gemm_shape_factor(m, n, k, self.wave));
        let bytes = (m * k + k * n + m * n) * self.dtype_bytes / self.memory_bandwidth;
        flops.max(bytes)
    }

    /// Forward and backward seconds of one product of a layer (m = tokens): the product itself,
    /// then the input's gradient (m×k, inner size n) and the weight's (k×n, inner size m); and
    /// the weight's part alone (what a split backward's `W` runs).
    fn product(&self, m: f64, n: f64, k: f64) -> (f64, f64, f64) {
        let weight = self.gemm_seconds(k, n, m);
        (
            self.gemm_seconds(m, n, k),
            self.gemm_seconds(m, k, n) + weight,
            weight,
        )
    }

    /// Seconds of one layer's compute op for one micro-step on one rank.
    pub fn compute_seconds(&self, layer: &Layer, kind: ComputeKind) -> f64 {
        let w = self.forward_work(&layer.kind);
        let mem = |bytes: f64| bytes / self.memory_bandwidth;
        let launch = |kernels: f64| kernels * KERNEL_LAUNCH_S;
        match kind {
            ComputeKind::Forward | ComputeKind::Recompute => {
                w.forward_s + mem(w.bytes) + launch(w.kernels)
            }
            ComputeKind::Backward => {
                w.backward_s + mem(2.0 * w.bytes + w.backward_bytes) + launch(2.0 * w.kernels)
            }
            // An embedding has no input gradient: its whole backward is the weight's.
            ComputeKind::BackwardInput if matches!(layer.kind, LayerKind::Embedding { .. }) => 0.0,
            ComputeKind::BackwardWeight if matches!(layer.kind, LayerKind::Embedding { .. }) => {
                self.compute_seconds(layer, ComputeKind::Backward)
            }
            // The input's half: everything but the weight products, and the stash written.
            ComputeKind::BackwardInput => {
                let stash = self.tokens * sched_ir::abi::stash_per_token(&layer.kind) as f64 * 4.0;
                (w.backward_s - w.weight_s)
                    + mem(2.0 * w.bytes + w.backward_bytes + stash)
                    + launch(2.0 * w.kernels)
            }
            // The weight products, from the saved inputs and the stash.
            ComputeKind::BackwardWeight => {
                let stash = self.tokens * sched_ir::abi::stash_per_token(&layer.kind) as f64 * 4.0;
                w.weight_s + mem(w.bytes + stash) + launch(w.kernels)
            }
            ComputeKind::Loss => match layer.kind {
                // Read the logits, a max/sum pass, write their gradient: two kernels.
                LayerKind::LmHead { vocab, .. } => {
                    mem(3.0 * self.tokens * vocab as f64 * self.dtype_bytes) + launch(2.0)
                }
                _ => mem(3.0 * self.tokens * self.dtype_bytes) + launch(2.0),
            },
            // The rank's optimizer shard of its tensor slice (the whole layer's when it is not
            // split).
            ComputeKind::Update => {
                let params =
                    sched_ir::tensor::rank_params(layer, self.tensor).unwrap_or(layer.params);
                let shard = params.div_ceil(self.optimizer_shards) as f64;
                self.memory_seconds(shard * self.optimizer_bytes_per_param)
            }
            ComputeKind::Accumulate => {
                let shard = layer.params.div_ceil(self.grad_shards) as f64;
                self.memory_seconds(3.0 * shard * self.grad_bytes)
            }
            ComputeKind::Copy => self.memory_seconds(2.0 * layer.params as f64 * self.dtype_bytes),
            ComputeKind::GradNorm => {
                let shard = layer.params.div_ceil(self.optimizer_shards) as f64;
                self.memory_seconds(shard * self.grad_bytes)
            }
            ComputeKind::ForwardOpen(j) => {
                let w = self.sublayer_work(&layer.kind, j);
                w.forward_s + mem(w.bytes) + launch(w.kernels)
            }
            ComputeKind::BackwardOpen(j) => {
                let w = self.sublayer_work(&layer.kind, j);
                w.backward_s + mem(2.0 * w.bytes + w.backward_bytes) + launch(2.0 * w.kernels)
            }
            // The fp32 sum read, the residual stream written in the model dtype.
            ComputeKind::ForwardClose(_) => {
                let h = layer.kind.hidden().unwrap_or(0) as f64;
                mem(self.tokens * h * (4.0 + self.dtype_bytes)) + launch(1.0)
            }
            // The norm's backward: the fp32 sum, its input and the stream's gradient read, the
            // gradient written.
            ComputeKind::BackwardClose(_) => {
                let h = layer.kind.hidden().unwrap_or(0) as f64;
                mem(self.tokens * h * (4.0 + 3.0 * self.grad_bytes)) + launch(2.0)
            }
        }
    }

    /// Seconds layer `layer`'s `kind` (forward, backward or recompute) keeps a rank's compute
    /// stream busy in one micro-step: [`CostModel::compute_seconds`], or for a layer split over a
    /// tensor group, its sublayers' phases and the tensor all-reduce of each fp32 partial
    /// between them (on the compute stream, alone on the node's links), as `lower::tensor`
    /// runs them (a recompute sums all but the last sublayer's partial). What `balanced`
    /// pipeline chunks weigh.
    pub fn stream_seconds(&self, layer: &Layer, kind: ComputeKind) -> f64 {
        let n: u8 = match layer.kind {
            k @ LayerKind::Transformer(_) if sched_ir::tensor::split_layers(&k, self.tensor) => 2,
            k @ LayerKind::Mlp(_) if sched_ir::tensor::split_layers(&k, self.tensor) => 1,
            _ => return self.compute_seconds(layer, kind),
        };
        type Phase = fn(u8) -> ComputeKind;
        let (open, close, summed): (Phase, Phase, u8) = match kind {
            ComputeKind::Forward => (ComputeKind::ForwardOpen, ComputeKind::ForwardClose, n),
            ComputeKind::Recompute => (ComputeKind::ForwardOpen, ComputeKind::ForwardClose, n - 1),
            ComputeKind::Backward => (ComputeKind::BackwardOpen, ComputeKind::BackwardClose, n),
            _ => return self.compute_seconds(layer, kind),
        };
        let partial = (self.tokens * layer.kind.hidden().unwrap_or(0) as f64 * 4.0) as u64;
        let reduce = self.collective_seconds(Collective::AllReduce, self.tensor, 1, partial);
        (0..n)
            .map(|j| {
                let closing = if j < summed {
                    reduce + self.compute_seconds(layer, close(j))
                } else {
                    0.0
                };
                self.compute_seconds(layer, open(j)) + closing
            })
            .sum()
    }

    /// Seconds of an attention kernel doing `flops` with inner size `head_dim` over `outputs`
    /// score elements.
    fn attention_seconds(&self, flops: f64, outputs: f64, head_dim: f64) -> f64 {
        if flops <= 0.0 {
            return 0.0;
        }
        flops / (self.matmul_flops * gemm_shape_factor(outputs, 1.0, head_dim, self.wave))
    }

    /// One forward pass of a layer over one micro-step's tokens, and its backward's products.
    fn forward_work(&self, kind: &LayerKind) -> Work {
        let t = self.tokens;
        let d = self.dtype_bytes;
        match *kind {
            LayerKind::Embedding { hidden, .. } => Work {
                // Gather rows (plus learned positions) and write the hidden states.
                bytes: 3.0 * t * hidden as f64 * d,
                kernels: 2.0,
                ..Work::default()
            },
            LayerKind::Transformer(tr) => {
                let (attention, mlp) = (
                    self.attention_work(&tr, 1.0),
                    self.transformer_mlp(&tr, 1.0),
                );
                Work {
                    forward_s: attention.forward_s + mlp.forward_s,
                    backward_s: attention.backward_s + mlp.backward_s,
                    weight_s: attention.weight_s + mlp.weight_s,
                    bytes: attention.bytes + mlp.bytes,
                    backward_bytes: attention.backward_bytes,
                    // Norm, QKV, rotary, attention, output projection, residual; the MLP's.
                    kernels: attention.kernels + mlp.kernels,
                }
            }
            LayerKind::Mlp(m) => self.mlp_work(t, m.hidden as f64, m.ffn as f64, m.act, d),
            LayerKind::LmHead { hidden, vocab, .. } => {
                let (forward_s, backward_s, weight_s) =
                    self.product(t, vocab as f64, hidden as f64);
                Work {
                    forward_s,
                    backward_s,
                    weight_s,
                    // Final norm, and the logits written.
                    bytes: t * d * (2.0 * hidden as f64 + vocab as f64),
                    kernels: 2.0,
                    ..Work::default()
                }
            }
            LayerKind::Dense {
                flops_per_token,
                activation_bytes_per_token,
                ..
            } => Work {
                // No shapes: at `efficiency`, as a large product.
                forward_s: flops_per_token * t / self.matmul_flops,
                backward_s: 2.0 * flops_per_token * t / self.matmul_flops,
                weight_s: flops_per_token * t / self.matmul_flops,
                bytes: activation_bytes_per_token as f64 * t,
                kernels: 2.0,
                ..Work::default()
            },
        }
    }

    /// A transformer's attention sublayer on one rank of a tensor group of `tp` (1: the whole
    /// sublayer): its norm, the qkv product over the rank's heads, the attention, the output
    /// projection over those heads' columns, the residual add.
    fn attention_work(&self, tr: &sched_ir::job::TransformerSpec, tp: f64) -> Work {
        let (t, d) = (self.tokens, self.dtype_bytes);
        let h = tr.hidden as f64;
        let kv = tr.kv_dim() as f64;
        let s = self.seq_len;
        let heads = tr.heads as f64 / tp;
        let head_dim = tr.head_dim() as f64;
        let full_attention = 4.0 * s * h * t / tp;
        // Score elements: tokens × keys × heads (half of them under flash's causal skip).
        let scores = t * s * heads;
        let (attention, outputs, probs_bytes, extra) = match tr.attention {
            // Causal blocks above the diagonal are skipped; backward recomputes P.
            Attention::Flash => (
                full_attention / 2.0,
                scores / 2.0,
                0.0,
                full_attention / 4.0,
            ),
            // The whole s×s matrix, masked, written, softmaxed and read back.
            Attention::Naive => (full_attention, scores, 4.0 * t * s * heads * d, 0.0),
        };
        let qkv = self.product(t, (h + 2.0 * kv) / tp, h);
        let out = self.product(t, h, h / tp);
        let attn_fwd = self.attention_seconds(attention, outputs, head_dim);
        let attn_bwd = self.attention_seconds(2.0 * attention + extra, outputs, head_dim);
        Work {
            forward_s: qkv.0 + out.0 + attn_fwd,
            backward_s: qkv.1 + out.1 + attn_bwd,
            weight_s: qkv.2 + out.2,
            // Attention norm (read, write), rotary on q and k, residual add.
            bytes: t * d * (2.0 * h + 2.0 * (h + kv) / tp + 3.0 * h) + probs_bytes,
            backward_bytes: probs_bytes / 2.0,
            // Norm, QKV, rotary, attention, output projection, residual.
            kernels: 6.0,
        }
    }

    /// A transformer's MLP sublayer on one rank of a tensor group of `tp`.
    fn transformer_mlp(&self, tr: &sched_ir::job::TransformerSpec, tp: f64) -> Work {
        let f = tr.ffn as f64 / tp;
        self.mlp_work(self.tokens, tr.hidden as f64, f, tr.act, self.dtype_bytes)
    }

    /// Sublayer `j` of a tensor-parallel layer on one rank (`ForwardOpen(j)`, `BackwardOpen(j)`):
    /// the narrower products at their own shape's efficiency.
    fn sublayer_work(&self, kind: &LayerKind, j: u8) -> Work {
        let tp = f64::from(self.tensor);
        match *kind {
            LayerKind::Transformer(tr) if j == 0 => self.attention_work(&tr, tp),
            LayerKind::Transformer(tr) => self.transformer_mlp(&tr, tp),
            LayerKind::Mlp(m) => {
                let f = m.ffn as f64 / tp;
                self.mlp_work(self.tokens, m.hidden as f64, f, m.act, self.dtype_bytes)
            }
            _ => self.forward_work(kind),
        }
    }

    /// An MLP's products (2 matrices, or 3 with a gated activation) and element-wise traffic.
    fn mlp_work(&self, t: f64, h: f64, f: f64, act: Activation, d: f64) -> Work {
        let (ins, act_bytes) = match act {
            Activation::Gelu => (1.0, 2.0 * f),
            Activation::SwiGlu => (2.0, 3.0 * f),
        };
        let up = self.product(t, f, h);
        let down = self.product(t, h, f);
        Work {
            forward_s: ins * up.0 + down.0,
            backward_s: ins * up.1 + down.1,
            weight_s: ins * up.2 + down.2,
            // Norm (read, write), activation, residual add.
            bytes: t * d * (2.0 * h + act_bytes + 3.0 * h),
            backward_bytes: 0.0,
            // Norm, the products, activation, residual add.
            kernels: 3.0 + ins + 1.0,
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
            latency_s: COLLECTIVE_START_S + steps * alpha,
            intra_bytes,
            inter_bytes,
            transfer_s,
        }
    }

    /// What one point-to-point call asks of the links: `parts` are its sends and receives (a
    /// coalesced group may hold several, to different peers), each with the shape of its
    /// two-member group. Each is one message of its bytes over the link between the two ranks
    /// (the intra-node link when they share a node, else the node's network, shared by the
    /// stage's ranks sending at once). Links are full duplex: the sends and the receives each
    /// load a link class with their sum, and the call moves at the pace of the busier direction.
    /// It pays one call start and the latency of the slowest link it crosses.
    pub fn p2p_transfer(&self, parts: &[(Collective, u64, GroupShape)]) -> Transfer {
        // [send, recv] × [intra, inter] bytes.
        let mut load = [[0.0f64; 2]; 2];
        let mut latency = 0.0f64;
        for &(kind, bytes, shape) in parts {
            let t = self.transfer(&[(kind, bytes)], shape);
            let dir = usize::from(kind == Collective::Recv);
            load[dir][0] += t.intra_bytes;
            load[dir][1] += t.inter_bytes;
            latency = latency.max(t.latency_s);
        }
        let intra_bytes = load[0][0].max(load[1][0]);
        let inter_bytes = load[0][1].max(load[1][1]);
        Transfer {
            latency_s: latency,
            intra_bytes,
            inter_bytes,
            transfer_s: (intra_bytes / self.intra.bandwidth)
                .max(inter_bytes / self.inter.bandwidth),
        }
    }

    /// Bytes one member sends along its ring edge and latency steps for one collective: the ring,
    /// or for all-reduce the tree when that is faster alone.
    fn algorithm(&self, kind: Collective, shape: GroupShape, m: f64, alpha: f64) -> (f64, f64) {
        let p = f64::from(shape.p);
        match kind {
            Collective::AllGather | Collective::ReduceScatter => (m * (p - 1.0) / p, p - 1.0),
            Collective::Broadcast => (m, p - 1.0),
            // One message to one peer.
            Collective::Send | Collective::Recv => (m, 1.0),
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

/// One layer's forward and backward on one micro-step: product and attention seconds, element-wise
/// bytes (backward moves twice the forward's plus `backward_bytes`) and kernels (backward launches
/// twice as many).
#[derive(Clone, Copy, Debug, Default)]
struct Work {
    forward_s: f64,
    backward_s: f64,
    /// The weight products' part of `backward_s`.
    weight_s: f64,
    bytes: f64,
    backward_bytes: f64,
    kernels: f64,
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

/// cli.md's MFU numerator: 3 × the forward model FLOPs of one step, over all micro-steps and
/// the d data-parallel ranks (every rank without a pipeline or tensor groups; a micro-batch passes
/// through all p stages and is shared by the t ranks of a tensor group) (recomputation adds
/// nothing).
pub fn model_flops_per_step(job: &Job) -> f64 {
    let m = &job.model;
    let per_token: f64 = m
        .layers
        .iter()
        .map(|l| model_flops_per_token(l, m.seq_len))
        .sum();
    let data_parallel = sched_ir::Layout::of(job).dp_size();
    let tokens = (m.micro_batch * m.seq_len) as f64
        * f64::from(job.schedule.micro_steps)
        * data_parallel as f64;
    3.0 * per_token * tokens
}
