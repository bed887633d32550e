//! Tensor-parallel layers (`spec/parallel.md` §2): with t > 1 a transformer's or mlp's forward
//! and backward become the phases Megatron-LM runs between its all-reduces over the tensor
//! group, each rank computing its slice ([`sched_ir::tensor`]).
//!
//! Per sublayer j (a transformer's attention, 0, and MLP, 1; an mlp layer's MLP, 0):
//! - forward: `forward_open(j)` reads the parameter slice and the residual stream at the
//!   sublayer's input (the layer's input hidden state for j = 0, the layer's output buffer, which
//!   holds the stream between sublayers, after), writes the sublayer's saved activations and its
//!   fp32 **partial** (tokens × hidden; the lead rank's includes the residual and the
//!   row-parallel bias); an `all_reduce` over the tensor group sums the partials in place;
//!   `forward_close(j)` stores the sum in the layer's output buffer;
//! - backward, from the last sublayer: `backward_open(j)` reads the parameter slice, the saved
//!   activations and the residual stream's gradient at the sublayer's output (the layer's
//!   output gradient for the last sublayer, the input-gradient buffer, which holds it between
//!   sublayers, after), writes the partial gradient of the sublayer's norm output and the
//!   gradient of the sublayer's products' parameters; an `all_reduce` sums the partials;
//!   `backward_close(j)` reads them, the saved activations, the residual path's gradient and,
//!   for j = 0, the layer's input, writes the layer's input gradient and the gradient of the
//!   sublayer's norm.
//!
//! Each phase writes its own tensors' range of the layer's gradient (the one holding the
//! vector's end also the padding), as a whole backward writes all of it: plainly, or added onto
//! the accumulator when backward accumulates directly after the first micro-step. The
//! all-reduces have role `Tensor` (on the compute stream: the next phase waits for them).
//! Partials are fresh buffers per (layer, micro-step, sublayer, direction), so the memory plan
//! alone decides what shares bytes. With `recompute = full` the forward saves nothing and the
//! backward starts with the forward's phases again (Megatron's full recomputation, all-reduce
//! included), saving; the stream between sublayers goes to a fresh buffer and the last
//! sublayer's partial is not summed. Split backwards (`I`/`W`) of tensor-parallel layers are not
//! lowered: the analysis refuses them before lowering.
//!
//! **Sequence parallelism** (`tensor { sequence = true }`, Megatron-LM's): every hidden state
//! between layers and the residual stream between sublayers hold the rank's t-th of the tokens
//! (rows `tp·T/t …`). Before each open an `all_gather` over the tensor group assembles the
//! stream (forward) or its gradient (backward) whole, and the partials are `reduce_scatter`ed
//! instead of all-reduced, so each close works on the rank's rows: the forward close stores its
//! part of the stream, the backward close takes its rows through the norm. The norms' parameter
//! gradients then hold the rank's rows' part only: after the layer's last micro-step's backward
//! (every micro-step's, when backward writes a fresh buffer each), an `all_reduce` over the
//! tensor group sums each norm's range of the gradient. The layers that run whole (embedding,
//! head) gather their input and their output's gradient, write their rows of their output and
//! of their input's gradient; the logits stay whole. The gathers move what the all-reduces
//! moved, in the other direction; the saved activations keep the whole tokens (the gathered
//! stream), so activation memory shrinks by the hidden states and streams only.

use super::comms::CommKind;
use super::Builder;
use sched_ir::abi;
use sched_ir::hash::FxHashMap;
use sched_ir::ir::*;
use sched_ir::job::*;
use sched_ir::tensor::{split_layers, SliceLayout, TensorRank};

impl Builder<'_> {
    /// How many tensor-parallel sublayers layer index `l` is lowered as: 0 for a layer that runs
    /// whole (t = 1, the embedding, the head, the tied head's replica).
    pub(super) fn sublayers(&self, l: usize) -> u8 {
        let t = self.job.schedule.tensor.size;
        match self.job.model.layers.get(l).map(|x| x.kind) {
            Some(k @ LayerKind::Transformer(_)) if split_layers(&k, t) => 2,
            Some(k @ LayerKind::Mlp(_)) if split_layers(&k, t) => 1,
            _ => 0,
        }
    }

    /// A fresh fp32 partial-sum buffer of layer `l` (its forward's with `!grad`).
    fn partial_buf(&mut self, l: usize, m: u32, j: u8, grad: bool) -> BufferId {
        let id = self.state(l).id;
        let elems = abi::input_elements(&self.job.model.layers[l].kind, &self.job.model);
        let what = if grad { "partial_grad" } else { "partial" };
        let name = format!("{}.{what}{j}.m{m}", self.p.layers[id].name);
        self.buffer(name, BufferKind::Partial, Dtype::Fp32, elems, Some(id))
    }

    /// The tensor group's all-reduce of partial buffer `b` in place.
    fn tensor_all_reduce(&mut self, l: usize, m: u32, b: BufferId) -> OpId {
        let r = Region::whole(b, self.p.buffers[b].bytes);
        let c = self.collective(Collective::AllReduce, CommKind::Tensor, Dtype::Fp32, r, r);
        let id = self.state(l).id;
        self.issue(vec![c], OpRole::Tensor, Some(id), Some(m))
            .expect("one collective")
    }

    pub(super) fn whole(&self, b: BufferId) -> Region {
        Region::whole(b, self.p.buffers[b].bytes)
    }

    /// Whether the residual stream is split by sequence over the tensor group.
    pub(super) fn sequence(&self) -> bool {
        self.layout.sequence
    }

    /// Sequence parallelism: a fresh buffer `{layer}.{what}.m{m}` assembling the tensor
    /// group's parts of `part` (each rank's rows, in tensor-index order), and the all-gather
    /// filling it.
    pub(super) fn gather_sequence(
        &mut self,
        l: usize,
        m: u32,
        part: BufferId,
        what: &str,
    ) -> (BufferId, OpId) {
        let id = self.state(l).id;
        let t = u64::from(self.layout.tensor.max(1));
        let (dtype, bytes) = (self.p.buffers[part].dtype, self.p.buffers[part].bytes);
        let name = format!("{}.{what}.m{m}", self.p.layers[id].name);
        let whole = self.buffer(
            name,
            BufferKind::Hidden,
            dtype,
            bytes * t / dtype.bytes(),
            Some(id),
        );
        let (from, to) = (self.whole(part), self.whole(whole));
        let c = self.collective(Collective::AllGather, CommKind::Tensor, dtype, from, to);
        let op = self.issue(vec![c], OpRole::Tensor, Some(id), Some(m));
        (whole, op.expect("one collective"))
    }

    /// Sequence parallelism: the tensor group's reduce-scatter of partial buffer `b` into a
    /// fresh buffer of the rank's rows of the sum.
    fn scatter_partial(&mut self, l: usize, m: u32, b: BufferId) -> (BufferId, OpId) {
        let id = self.state(l).id;
        let t = u64::from(self.layout.tensor.max(1));
        let name = format!("{}.rows", self.p.buffers[b].name);
        let elems = self.p.buffers[b].bytes / Dtype::Fp32.bytes() / t;
        let rows = self.buffer(name, BufferKind::Partial, Dtype::Fp32, elems, Some(id));
        let (from, to) = (self.whole(b), self.whole(rows));
        let c = self.collective(
            Collective::ReduceScatter,
            CommKind::Tensor,
            Dtype::Fp32,
            from,
            to,
        );
        let op = self.issue(vec![c], OpRole::Tensor, Some(id), Some(m));
        (rows, op.expect("one collective"))
    }

    /// The sum over the tensor group of partial `b`: all-reduced in place, or with sequence
    /// parallelism reduce-scattered into the rank's rows; the ops and the buffer to read.
    fn sum_partial(&mut self, l: usize, m: u32, b: BufferId) -> (BufferId, OpId) {
        match self.sequence() {
            true => self.scatter_partial(l, m, b),
            false => (b, self.tensor_all_reduce(l, m, b)),
        }
    }

    /// What a phase reads of the stream (or its gradient) in `b`: the buffer itself, or with
    /// sequence parallelism the tensor group's gather of it (its op pushed onto `ops`).
    pub(super) fn stream_seen(
        &mut self,
        l: usize,
        m: u32,
        b: BufferId,
        what: &str,
        ops: &mut Vec<OpId>,
    ) -> BufferId {
        if !self.sequence() {
            return b;
        }
        let (g, op) = self.gather_sequence(l, m, b, what);
        ops.push(op);
        g
    }

    /// Layer `l`'s forward in micro-step `m` as its `n` sublayers' phases.
    pub(super) fn forward_phases(
        &mut self,
        l: usize,
        m: u32,
        n: u8,
        full: &FxHashMap<usize, BufferId>,
    ) -> Vec<OpId> {
        let input = self.hidden_buf(false, m, l);
        let out = self.hidden_buf(false, m, l + 1);
        // With `recompute = full` the forward saves nothing: the backward's recompute does.
        let act = match self.job.schedule.recompute {
            Recompute::Full => None,
            _ => self.act_buf(l, m),
        };
        self.phases_forward(l, m, (input, out), act, full, (n, true))
    }

    /// The forward phases of layer `l`'s `n` sublayers from `input` into `out` (the stream
    /// between sublayers and after the last), saving into `act`; without `sum_last` (a
    /// recompute), the last sublayer's partial is left unsummed: nothing reads it.
    fn phases_forward(
        &mut self,
        l: usize,
        m: u32,
        (input, out): (BufferId, BufferId),
        act: Option<BufferId>,
        full: &FxHashMap<usize, BufferId>,
        (n, sum_last): (u8, bool),
    ) -> Vec<OpId> {
        let id = self.state(l).id;
        let params = self.params_region(l, full);
        let mut ops = vec![];
        for j in 0..n {
            let stream = if j == 0 { input } else { out };
            let what = format!("{}stream{j}", if sum_last { "" } else { "re" });
            let stream = self.stream_seen(l, m, stream, &what, &mut ops);
            let mut reads: Vec<Region> = params.into_iter().collect();
            reads.push(self.whole(stream));
            if j > 0 {
                reads.extend(act.map(|a| self.whole(a)));
            }
            let partial = self.partial_buf(l, m, j, false);
            let mut writes = vec![self.whole(partial)];
            writes.extend(act.map(|a| self.whole(a)));
            let open = ComputeKind::ForwardOpen(j);
            ops.push(self.compute(open, Some(id), Some(m), reads, writes));
            if j + 1 == n && !sum_last {
                break;
            }
            let (sum, op) = self.sum_partial(l, m, partial);
            ops.push(op);
            let (r, w) = (vec![self.whole(sum)], vec![self.whole(out)]);
            ops.push(self.compute(ComputeKind::ForwardClose(j), Some(id), Some(m), r, w));
        }
        ops
    }

    /// With `recompute = full`, layer `l`'s forward again before its backward in micro-step
    /// `m`, for its saved activations: every sublayer's open, and the sum and close of all but
    /// the last (whose output nothing needs), the stream between them in a fresh buffer.
    fn recompute_phases(
        &mut self,
        l: usize,
        m: u32,
        bwd_full: &FxHashMap<usize, BufferId>,
    ) -> Vec<OpId> {
        let Some(act) = self.act_buf(l, m) else {
            return vec![];
        };
        if self.job.schedule.recompute != Recompute::Full {
            return vec![];
        }
        let input = self.hidden_buf(false, m, l);
        let id = self.state(l).id;
        let rows = u64::from(if self.sequence() {
            self.layout.tensor.max(1)
        } else {
            1
        });
        let elems = abi::input_elements(&self.job.model.layers[l].kind, &self.job.model) / rows;
        let name = format!("{}.restream.m{m}", self.p.layers[id].name);
        let stream = self.buffer(name, BufferKind::Hidden, self.dtype, elems, Some(id));
        let n = self.sublayers(l);
        self.phases_forward(l, m, (input, stream), Some(act), bwd_full, (n, false))
    }

    /// Layer `l`'s backward in micro-step `m` as its sublayers' phases, from the last.
    pub(super) fn backward_phases(
        &mut self,
        l: usize,
        m: u32,
        bwd_full: &FxHashMap<usize, BufferId>,
        full_grads: &mut FxHashMap<usize, BufferId>,
    ) -> Vec<OpId> {
        let id = self.state(l).id;
        let params = self.params_region(l, bwd_full);
        let act = self.act_buf(l, m);
        let input = self.hidden_buf(false, m, l);
        let g_out = self.hidden_buf(true, m, l + 1);
        let g_in = self.hidden_buf(true, m, l);
        let target = self.grad_target(l, m, full_grads);
        let ranges = self.phase_gradients(l);
        let mut ops = self.recompute_phases(l, m, bwd_full);
        for j in (0..self.sublayers(l)).rev() {
            let last = j + 1 == self.sublayers(l);
            let stream_grad = if last { g_out } else { g_in };
            let front = |b: &Self| -> Vec<Region> {
                let mut r: Vec<Region> = params.into_iter().collect();
                r.extend(act.map(|a| b.whole(a)));
                r
            };
            // Open: the products' parameter gradients and the norm output's partial gradient.
            let seen = self.stream_seen(l, m, stream_grad, &format!("grad_stream{j}"), &mut ops);
            let mut reads = front(self);
            reads.push(self.whole(seen));
            let partial = self.partial_buf(l, m, j, true);
            let mut writes = vec![self.whole(partial)];
            self.phase_grad_write(m, target, &ranges.open[j as usize], &mut reads, &mut writes);
            let open = ComputeKind::BackwardOpen(j);
            ops.push(self.compute(open, Some(id), Some(m), reads, writes));
            let (sum, op) = self.sum_partial(l, m, partial);
            ops.push(op);
            // Close: through the norm into the input gradient, the norm's parameter gradient.
            let mut reads = front(self);
            reads.push(self.whole(sum));
            reads.push(self.whole(stream_grad));
            if j == 0 {
                reads.push(self.whole(input));
            }
            let mut writes = vec![self.whole(g_in)];
            self.phase_grad_write(
                m,
                target,
                &ranges.close[j as usize],
                &mut reads,
                &mut writes,
            );
            let close = ComputeKind::BackwardClose(j);
            ops.push(self.compute(close, Some(id), Some(m), reads, writes));
        }
        ops.extend(self.sum_norm_gradients(l, m, target, &ranges.close));
        ops
    }

    /// Sequence parallelism: each close left the norms' parameter gradients of its rank's rows
    /// only; once the gradient target holds what is to be summed (after every micro-step's
    /// backward when each writes a fresh buffer, after the last when backward accumulates
    /// directly), an all-reduce over the tensor group of each norm's range (one coalesced group)
    /// completes them.
    fn sum_norm_gradients(
        &mut self,
        l: usize,
        m: u32,
        target: Region,
        norms: &[std::ops::Range<u64>],
    ) -> Vec<OpId> {
        if !self.sequence() {
            return vec![];
        }
        let done = self.backwards_done.entry(l).or_insert(0);
        *done += 1;
        let done = *done;
        if self.direct_accumulation() && done < self.job.schedule.micro_steps {
            return vec![];
        }
        let id = self.state(l).id;
        let d = self.grad_dtype.bytes();
        let gd = self.grad_dtype;
        // One coalesced call for the layer's norms (two disjoint ranges of a transformer's).
        let mut cs = vec![];
        for r in norms.iter().filter(|r| r.end > r.start) {
            let g = Region {
                offset: Offset::Fixed(r.start * d),
                bytes: (r.end - r.start) * d,
                ..target
            };
            cs.push(self.collective(Collective::AllReduce, CommKind::Tensor, gd, g, g));
        }
        self.issue(cs, OpRole::Tensor, Some(id), Some(m))
            .into_iter()
            .collect()
    }

    /// The element ranges of layer `l`'s flat slice gradient each backward phase writes: the
    /// products' tensors by the opens, the norms' by the closes, the padding with the range
    /// holding the vector's end.
    fn phase_gradients(&self, l: usize) -> PhaseGradients {
        let layer = &self.job.model.layers[l];
        let t = self.job.schedule.tensor.size as usize;
        let slice = SliceLayout::shapes(layer, TensorRank { size: t, index: 0 })
            .expect("the analysis checked the tensor-parallel rules");
        let span = |prefix: &str| {
            let mut it = slice
                .tensors()
                .iter()
                .filter(|x| x.name.starts_with(prefix))
                .map(|x| x.range.clone());
            let first = it.next().map_or(0..0, |r| r);
            it.fold(first, |a, r| a.start.min(r.start)..a.end.max(r.end))
        };
        let (open, close) = match self.sublayers(l) {
            2 => (
                vec![span("attn."), span("mlp.")],
                vec![span("ln1."), span("ln2.")],
            ),
            _ => (vec![span("mlp.")], vec![span("ln.")]),
        };
        let (end, padded) = (slice.elements() as u64, self.state(l).padded);
        let pad = |v: Vec<std::ops::Range<usize>>| {
            v.into_iter()
                .map(|r| {
                    let (a, b) = (r.start as u64, r.end as u64);
                    a..if b == end { padded } else { b }
                })
                .collect()
        };
        PhaseGradients {
            open: pad(open),
            close: pad(close),
        }
    }

    /// A phase's write of elements `range` of gradient target `g`: added onto what earlier
    /// micro-steps left when backward accumulates directly, else written.
    fn phase_grad_write(
        &mut self,
        m: u32,
        g: Region,
        range: &std::ops::Range<u64>,
        reads: &mut Vec<Region>,
        writes: &mut Vec<Region>,
    ) {
        let d = self.grad_dtype.bytes();
        let r = Region {
            offset: Offset::Fixed(range.start * d),
            bytes: (range.end - range.start) * d,
            ..g
        };
        if r.bytes == 0 {
            return;
        }
        if self.direct_accumulation() && m > 0 {
            reads.push(r);
        }
        writes.push(r);
    }
}

/// Per sublayer, the gradient elements its backward's open and close write.
struct PhaseGradients {
    open: Vec<std::ops::Range<u64>>,
    close: Vec<std::ops::Range<u64>>,
}
