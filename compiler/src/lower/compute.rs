//! Compute ops: each layer's forward, recompute and backward, with the hidden states between
//! layers and the activations forward saves for backward (sized by [`super::activations`]).
//!
//! A compute op's regions follow one order the runtime decodes (`runtime/src/exec.rs`): layer
//! parameters, tied embedding, input, then outputs.

use super::Builder;
use sched_ir::abi as activations;
use sched_ir::hash::FxHashMap;
use sched_ir::ir::*;
use sched_ir::job::*;

impl Builder<'_> {
    /// The hidden state entering layer `l` in micro-step `m` (its gradient with `grad`), as the
    /// current stage holds it: a boundary between stages has one buffer on each side, which the
    /// pipeline's sends and receives connect.
    pub(super) fn hidden_buf(&mut self, grad: bool, m: u32, l: usize) -> BufferId {
        let map = if grad {
            &self.grad_hidden
        } else {
            &self.hidden
        };
        let stage = self.stage;
        if let Some(&b) = map.get(&(m, l, stage)) {
            return b;
        }
        let layers = &self.job.model.layers;
        // h[l] is produced by layer l-1; size it by its producer, else by its consumer.
        let bytes = (l > 0)
            .then(|| activations::output_bytes(&layers[l - 1].kind, &self.job.model))
            .filter(|&b| b > 0)
            .or_else(|| {
                layers
                    .get(l)
                    .map(|x| activations::output_bytes(&x.kind, &self.job.model))
            })
            .unwrap_or(0);
        // With sequence parallelism each rank holds its rows of all but the logits.
        let rows = match self.sequence() && l < layers.len() {
            true => u64::from(self.layout.tensor.max(1)),
            false => 1,
        };
        let bytes = bytes / rows;
        let mut name = format!("{}.{}.m{m}", if grad { "grad_hidden" } else { "hidden" }, l);
        if self.job.schedule.pipeline.is_pipelined() {
            name.push_str(&format!(".s{stage}"));
        }
        let id = self.buffer(
            name,
            BufferKind::Hidden,
            self.dtype,
            bytes / self.dtype.bytes(),
            None,
        );
        let map = if grad {
            &mut self.grad_hidden
        } else {
            &mut self.hidden
        };
        map.insert((m, l, stage), id);
        id
    }

    /// Layer `l`'s saved activations in micro-step `m` (created on first use).
    pub(super) fn act_buf(&mut self, l: usize, m: u32) -> Option<BufferId> {
        if let Some(&b) = self.acts.get(&(l, m)) {
            return Some(b);
        }
        // A tensor-parallel layer keeps its slice's.
        let t = self.job.schedule.tensor.size;
        let bytes =
            activations::slice_saved_bytes(&self.job.model.layers[l].kind, &self.job.model, t);
        (bytes > 0).then(|| {
            let id = self.state(l).id;
            let name = format!("{}.act.m{m}", self.p.layers[id].name);
            let b = self.buffer(
                name,
                BufferKind::Activation,
                self.dtype,
                bytes / self.dtype.bytes(),
                Some(id),
            );
            self.acts.insert((l, m), b);
            b
        })
    }

    pub(super) fn forward(
        &mut self,
        l: usize,
        m: u32,
        full: &FxHashMap<usize, BufferId>,
    ) -> Vec<OpId> {
        let mut ops = match self.sublayers(l) {
            0 => self.whole_forward(l, m, full),
            n => self.forward_phases(l, m, n, full),
        };
        ops.extend(self.secondary_copy(l, m, full));
        ops
    }

    /// Layer `l`'s forward as one op.
    fn whole_forward(&mut self, l: usize, m: u32, full: &FxHashMap<usize, BufferId>) -> Vec<OpId> {
        let id = self.state(l).id;
        let recompute = self.job.schedule.recompute == Recompute::Full;
        let mut reads: Vec<Region> = self.params_region(l, full).into_iter().collect();
        if let Some(e) = self.tied_embedding(l) {
            reads.extend(self.params_region(e, full));
        }
        let mut ops = vec![];
        if l > 0 {
            let h = self.hidden_buf(false, m, l);
            let h = self.stream_seen(l, m, h, "input", &mut ops);
            reads.push(self.whole(h));
        }
        let out = self.hidden_buf(false, m, l + 1);
        let mut writes = vec![Region::whole(out, self.p.buffers[out].bytes)];
        if !recompute {
            if let Some(a) = self.act_buf(l, m) {
                writes.push(Region::whole(a, self.p.buffers[a].bytes));
            }
        }
        ops.push(self.compute(ComputeKind::Forward, Some(id), Some(m), reads, writes));
        ops
    }

    /// hpZ keeps this rank's slice of the gathered parameters of layer `l` for backward.
    fn secondary_copy(&mut self, l: usize, m: u32, full: &FxHashMap<usize, BufferId>) -> Vec<OpId> {
        let id = self.state(l).id;
        let mut ops = vec![];
        if let (ReshardAfterForward::Node { secondary }, Some(&g)) =
            (self.job.schedule.reshard_after_forward, full.get(&l))
        {
            let padded = self.state(l).padded;
            let chunk = padded / u64::from(secondary) * self.dtype.bytes();
            let sec = self.secondary_buf(l, m);
            let from = Region {
                buffer: g,
                offset: Offset::Shard {
                    index: ShardIndex::Secondary,
                    base: 0,
                    stride: chunk,
                },
                bytes: chunk,
            };
            ops.push(self.compute(
                ComputeKind::Copy,
                Some(id),
                Some(m),
                vec![from],
                vec![Region::whole(sec, chunk)],
            ));
        }
        ops
    }

    pub(super) fn backward(
        &mut self,
        l: usize,
        m: u32,
        bwd_full: &FxHashMap<usize, BufferId>,
        fwd_full: &FxHashMap<usize, BufferId>,
        full_grads: &mut FxHashMap<usize, BufferId>,
    ) -> Vec<OpId> {
        if self.sublayers(l) > 0 {
            return self.backward_phases(l, m, bwd_full, full_grads);
        }
        let id = self.state(l).id;
        let mut ops = self.recompute(l, m, bwd_full);
        let (mut reads, mut writes) = self.backward_operands(l, m, bwd_full, None, true, &mut ops);
        self.parameter_gradients(l, m, fwd_full, full_grads, (&mut reads, &mut writes));
        ops.push(self.compute(ComputeKind::Backward, Some(id), Some(m), reads, writes));
        ops
    }

    /// What every backward of layer `l` in micro-step `m` reads, in exec's order: its
    /// parameters, saved activations, `stash` (a weight half's), the gradient of its output and,
    /// past the first layer, its input; and, with `input_gradient`, writes the gradient of its
    /// input.
    /// With sequence parallelism the gradient of the output (but the logits') and the input are
    /// the tensor group's gathers, their ops pushed onto `ops`.
    fn backward_operands(
        &mut self,
        l: usize,
        m: u32,
        bwd_full: &FxHashMap<usize, BufferId>,
        stash: Option<BufferId>,
        input_gradient: bool,
        ops: &mut Vec<OpId>,
    ) -> (Vec<Region>, Vec<Region>) {
        let whole = |p: &Program, b: BufferId| Region::whole(b, p.buffers[b].bytes);
        let mut reads: Vec<Region> = self.params_region(l, bwd_full).into_iter().collect();
        if let Some(a) = self.act_buf(l, m) {
            reads.push(whole(&self.p, a));
        }
        reads.extend(stash.map(|s| whole(&self.p, s)));
        let mut g_out = self.hidden_buf(true, m, l + 1);
        if l + 1 < self.job.model.layers.len() {
            g_out = self.stream_seen(l, m, g_out, "grad_output", ops);
        }
        reads.push(whole(&self.p, g_out));
        let mut writes = vec![];
        if l > 0 {
            let h = self.hidden_buf(false, m, l);
            let h = self.stream_seen(l, m, h, "backward_input", ops);
            reads.push(whole(&self.p, h));
            if input_gradient {
                let g_in = self.hidden_buf(true, m, l);
                writes.push(whole(&self.p, g_in));
            }
        }
        (reads, writes)
    }

    /// The parameter-gradient regions of layer `l`'s backward (or weight half) in micro-step
    /// `m`: into the accumulator directly when it is the full size, else a full buffer; a tied
    /// head also reads the embedding's parameters and writes the embedding's `wte` gradient.
    fn parameter_gradients(
        &mut self,
        l: usize,
        m: u32,
        fwd_full: &FxHashMap<usize, BufferId>,
        full_grads: &mut FxHashMap<usize, BufferId>,
        (reads, writes): (&mut Vec<Region>, &mut Vec<Region>),
    ) {
        if self.state(l).has_params {
            let g = self.grad_target(l, m, full_grads);
            self.grad_write(m, g, reads, writes);
        }
        if let Some(e) = self.tied_embedding(l) {
            if let Some(p) = self.params_region(e, fwd_full) {
                reads.push(p);
            }
            let g = self.grad_target(e, m, full_grads);
            // Into the embedding's `wte` part; into a replica's whole gradient, which nothing
            // else writes (the device writes zeros past `wte`).
            let wte = match self.is_replica(e) {
                true => g,
                false => {
                    let LayerKind::Embedding { vocab, hidden, .. } = self.job.model.layers[e].kind
                    else {
                        unreachable!()
                    };
                    Region {
                        bytes: vocab * hidden * self.grad_dtype.bytes(),
                        ..g
                    }
                }
            };
            self.grad_write(m, wte, reads, writes);
        }
    }

    /// With `recompute = full`, the forward of layer `l` in micro-step `m` again, from its saved
    /// input, rewriting its saved activations before its backward.
    fn recompute(&mut self, l: usize, m: u32, bwd_full: &FxHashMap<usize, BufferId>) -> Vec<OpId> {
        let act = self.act_buf(l, m);
        if self.job.schedule.recompute != Recompute::Full {
            return vec![];
        }
        let Some(a) = act else { return vec![] };
        let mut reads: Vec<Region> = self.params_region(l, bwd_full).into_iter().collect();
        let mut ops = vec![];
        if l > 0 {
            let h = self.hidden_buf(false, m, l);
            let h = self.stream_seen(l, m, h, "recompute_input", &mut ops);
            reads.push(Region::whole(h, self.p.buffers[h].bytes));
        }
        let w = vec![Region::whole(a, self.p.buffers[a].bytes)];
        let id = self.state(l).id;
        ops.push(self.compute(ComputeKind::Recompute, Some(id), Some(m), reads, w));
        ops
    }

    /// Layer `l`'s stash in micro-step `m`: what its `I` leaves for its `W` (created on first
    /// use; `None` when the layer stashes nothing).
    fn stash_buf(&mut self, l: usize, m: u32) -> Option<BufferId> {
        if let Some(&b) = self.stashes.get(&(l, m)) {
            return Some(b);
        }
        let elems = activations::stash_elements(&self.job.model.layers[l].kind, &self.job.model);
        (elems > 0).then(|| {
            let id = self.state(l).id;
            let name = format!("{}.stash.m{m}", self.p.layers[id].name);
            let b = self.buffer(name, BufferKind::Stash, Dtype::Fp32, elems, Some(id));
            self.stashes.insert((l, m), b);
            b
        })
    }

    /// Whether layer `l` has an input-gradient half: an input gradient or a stash to make.
    pub(super) fn has_input_half(&self, l: usize) -> bool {
        l > 0 || activations::stash_elements(&self.job.model.layers[l].kind, &self.job.model) > 0
    }

    /// The input-gradient half of layer `l`'s backward in micro-step `m` (a pipeline's `I`),
    /// with the recompute before it (`recompute = full`): reads what `backward` reads but the
    /// gradients it adds onto; writes the input gradient and the stash (exec's conventions).
    pub(super) fn backward_input(
        &mut self,
        l: usize,
        m: u32,
        bwd_full: &FxHashMap<usize, BufferId>,
        fwd_full: &FxHashMap<usize, BufferId>,
    ) -> Vec<OpId> {
        if !self.has_input_half(l) {
            return vec![];
        }
        let id = self.state(l).id;
        let mut ops = self.recompute(l, m, bwd_full);
        let (mut reads, mut writes) = self.backward_operands(l, m, bwd_full, None, true, &mut ops);
        if let Some(e) = self.tied_embedding(l) {
            reads.extend(self.params_region(e, fwd_full));
        }
        if let Some(s) = self.stash_buf(l, m) {
            writes.push(Region::whole(s, self.p.buffers[s].bytes));
        }
        ops.push(self.compute(ComputeKind::BackwardInput, Some(id), Some(m), reads, writes));
        ops
    }

    /// The weight half of layer `l`'s backward in micro-step `m` (a pipeline's `W`, after its
    /// `I`): reads the parameters, saved activations, the stash, the output gradient and the
    /// input; writes the parameter gradients (as `backward` does) and a tied head's embedding
    /// gradient.
    pub(super) fn backward_weight(
        &mut self,
        l: usize,
        m: u32,
        bwd_full: &FxHashMap<usize, BufferId>,
        fwd_full: &FxHashMap<usize, BufferId>,
        full_grads: &mut FxHashMap<usize, BufferId>,
    ) -> Vec<OpId> {
        let id = self.state(l).id;
        let stash = self.stash_buf(l, m);
        let mut ops = vec![];
        let (mut reads, mut writes) =
            self.backward_operands(l, m, bwd_full, stash, false, &mut ops);
        self.parameter_gradients(l, m, fwd_full, full_grads, (&mut reads, &mut writes));
        let w = ComputeKind::BackwardWeight;
        ops.push(self.compute(w, Some(id), Some(m), reads, writes));
        ops
    }
}
