//! `run_action`: one compute op of a plan on one rank, for every device. Regions of the rank's
//! arena are computed on in place where the device can ([`Device::view`]: the host's fp32
//! regions, every region on a GPU), else loaded into f32 workspace in their dtype and stored
//! back rounded to it at the same points on every backend; parameters, saved activations,
//! gradient parts and optimizer state are found at the plan's offsets. Collectives are the backends' own (rendezvous or NCCL).

use super::layers::{self, In};
use super::{plan_error, ArenaSpan, Device, DeviceError, Logits, Ptr, Update};
use crate::exec::{Action, GradPart};
use crate::math::{LayerMath, OptimizerConfig, Precision, Stored};
use crate::plan::Plan;
use crate::step::StepInput;
use cranelift_entity::EntityRef;
use sched_ir::ir::{Region, ShardIndex};
use sched_ir::job::{Dtype, LayerKind};

/// What an op of one rank runs against: the plan, the rank, and the device of its stream.
pub struct Rank<'a, D> {
    pub plan: &'a Plan,
    pub rank: u32,
    pub device: &'a D,
}

/// Runs one compute action (`m`: its micro-step); the device's workspace is given back after.
pub fn run_action<D: Device>(
    r: &Rank<'_, D>,
    a: &Action,
    m: Option<u32>,
    input: &StepInput,
) -> Result<(), DeviceError> {
    let out = r.action(a, m, input);
    r.device.reset();
    out
}

impl<D: Device> Rank<'_, D> {
    fn dtype(&self, r: &Region) -> Dtype {
        self.plan.program.buffers[r.buffer].dtype
    }

    fn elements(&self, r: &Region) -> usize {
        (r.bytes / self.dtype(r).bytes()) as usize
    }

    fn at(&self, r: &Region) -> u64 {
        self.plan.at(self.rank, r)
    }

    /// What gradient clipping's norm counts of optimizer-shard gradient `g`: all of it, or with
    /// t > 1 on a tensor index but 0, the parts outside the tensors every rank of the tensor
    /// group holds alike ([`Plan::replicated`]), which tensor index 0 counts. `g` holds the
    /// rank's optimizer shard of its layer's flat vector (the value proof checks it).
    fn counted(&self, g: &Region) -> Vec<ArenaSpan> {
        let whole = self.span(g);
        let p = self.plan;
        let layer = p.program.buffers[g.buffer].layer.map(|l| l.index());
        let same = layer.map_or(&[][..], |l| &p.replicated[l][..]);
        if p.program.layout.tp_index(self.rank) == 0 || same.is_empty() {
            return vec![whole];
        }
        let n = whole.elements;
        let first = p.program.layout.index(ShardIndex::Optimizer, self.rank) as usize * n;
        let bytes = whole.dtype.bytes();
        let mut out = vec![];
        let mut at = first;
        for r in same.iter().chain(std::iter::once(&(first + n..first + n))) {
            let (a, z) = (
                r.start.clamp(first, first + n),
                r.end.clamp(first, first + n),
            );
            if a > at {
                out.push(ArenaSpan {
                    at: whole.at + ((at - first) as u64) * bytes,
                    dtype: whole.dtype,
                    elements: a - at,
                });
            }
            at = at.max(z);
        }
        out
    }

    /// The rows of `n` values (a hidden state, tokens × hidden) this rank holds between layers:
    /// (first value, count): all of them, or with sequence parallelism the t-th of its tensor
    /// index.
    fn rows(&self, n: usize) -> (usize, usize) {
        let layout = &self.plan.program.layout;
        match layout.sequence {
            true => {
                let t = layout.tensor.max(1) as usize;
                let k = layout.tp_index(self.rank) as usize;
                (k * n / t, n / t)
            }
            false => (0, n),
        }
    }

    fn span(&self, r: &Region) -> ArenaSpan {
        ArenaSpan {
            at: self.at(r),
            dtype: self.dtype(r),
            elements: self.elements(r),
        }
    }

    fn check_size(&self, r: &Region, n: usize, write: bool) -> Result<(), DeviceError> {
        if n > self.elements(r) {
            return Err(DeviceError::RegionSize {
                values: n,
                region: self.elements(r),
                write,
            });
        }
        Ok(())
    }

    /// The first `n` values of `r`: on the arena itself where the device can compute there,
    /// else loaded into workspace. The layer math never writes what it reads (the optimizer
    /// updates its state in place, which is where the state goes anyway).
    fn read(&self, r: &Region, n: usize) -> Result<D::Ptr, DeviceError> {
        self.check_size(r, n, false)?;
        if let Some(p) = self.device.view(self.at(r), self.dtype(r), n)? {
            return Ok(p);
        }
        let dst = self.device.alloc(n)?;
        self.device.load(self.at(r), self.dtype(r), dst, n)?;
        Ok(dst)
    }

    fn read_opt(&self, r: &Option<Region>, n: usize) -> Result<D::Ptr, DeviceError> {
        match r {
            Some(r) => self.read(r, n),
            None => self.device.alloc(0),
        }
    }

    /// Test hook ([`StepInput::poison_grad`]): the first value of the gradient region `r` made
    /// NaN, on the lowest rank holding its buffer only. Filled in place where the device can
    /// (every region on a GPU, whose workspace the plan sizes without room for it), else
    /// through one float of workspace.
    fn poison(&self, r: &Region) -> Result<(), DeviceError> {
        if self.rank != self.plan.holders(r.buffer).start {
            return Ok(());
        }
        if let Some(p) = self.device.view(self.at(r), self.dtype(r), 1)? {
            return self.device.fill(p, 1, f32::NAN);
        }
        let nan = self.device.alloc(1)?;
        self.device.fill(nan, 1, f32::NAN)?;
        self.device.store(nan, self.at(r), self.dtype(r), 1, false)
    }

    /// `n` values at `src` written (or added) into `r`.
    fn write(
        &self,
        r: &Region,
        src: D::Ptr,
        n: usize,
        accumulate: bool,
    ) -> Result<(), DeviceError> {
        self.check_size(r, n, true)?;
        if !accumulate && self.device.view(self.at(r), self.dtype(r), n)? == Some(src) {
            return Ok(()); // computed in place
        }
        self.device
            .store(src, self.at(r), self.dtype(r), n, accumulate)
    }

    /// Where an op's output of `n` values for `r` is computed: on the arena itself when the
    /// device can and `r` shares no byte with the op's other regions, else in workspace (and
    /// stored by [`Rank::write`]).
    fn output(&self, r: Option<&Region>, n: usize, op: &[&Region]) -> Result<D::Ptr, DeviceError> {
        if let Some(p) = r.map(|r| self.in_place(r, n, op)).transpose()?.flatten() {
            return Ok(p);
        }
        self.device.alloc(n)
    }

    /// `r`'s `n` values on the arena itself, where the device can compute on them there and
    /// `r` shares no byte with the op's other regions.
    fn in_place(
        &self,
        r: &Region,
        n: usize,
        op: &[&Region],
    ) -> Result<Option<D::Ptr>, DeviceError> {
        if !self.alone(r, op) {
            return Ok(None);
        }
        self.check_size(r, n, true)?;
        self.device.view(self.at(r), self.dtype(r), n)
    }

    /// Where a layer's parameter gradient of `n` values is computed: on the arena when it is
    /// written whole into one fp32 part (not added to it) that [`Rank::output`] can give, else in
    /// fp32 workspace (and written part by part by [`Rank::write_grads`]). A 16-bit part is
    /// never computed on: the gradient is summed in fp32 and rounded once, when written.
    fn grads_output(
        &self,
        parts: &[GradPart],
        n: usize,
        op: &[&Region],
    ) -> Result<D::Ptr, DeviceError> {
        match parts {
            [p] if p.first == 0
                && !p.accumulate
                && self.dtype(&p.region) == Dtype::Fp32
                && self.elements(&p.region) == n =>
            {
                self.output(Some(&p.region), n, op)
            }
            _ => self.device.alloc(n),
        }
    }

    /// Whether `r`'s bytes overlap no other region of `op` (an output computed in place must
    /// not be one of the op's inputs).
    fn alone(&self, r: &Region, op: &[&Region]) -> bool {
        alone(self.plan, self.rank, r, op)
    }

    /// A saved region the device can compute on in place, segment by segment in each one's
    /// storage ([`Device::view_saved`]).
    fn saved_view(&self, layer: usize, r: &Region) -> Result<Option<D::Ptr>, DeviceError> {
        let math = &self.plan.maths[layer];
        let d = self.dtype(r);
        let bytes: u64 = math
            .saved_segments()
            .iter()
            .map(|s| s.elements as u64 * stored_bytes(s.stored, d))
            .sum();
        if bytes > r.bytes {
            return Err(DeviceError::RegionSize {
                values: math.saved_elements(),
                region: self.elements(r),
                write: true,
            });
        }
        self.device
            .view_saved(self.at(r), d, &math.saved_segments())
    }

    /// Whether the plan asks for layer gradients rounded before every store (tests only).
    fn rounds_grads_first(&self) -> bool {
        #[cfg(test)]
        return self.plan.round_grads_first;
        #[cfg(not(test))]
        false
    }

    /// Whether [`Rank::write_grads`] into `parts` rounds a gradient as `Device::round` to
    /// `prec` would: every part written, not added to, in a buffer of `prec`'s dtype (a store
    /// rounds once to nearest even; rounding first would give the same bits).
    fn stores_round(&self, parts: &[GradPart], prec: Precision) -> bool {
        parts
            .iter()
            .all(|p| !p.accumulate && Precision::of(self.dtype(&p.region)) == prec)
    }

    /// A layer's gradient written (or added) into its parts; elements past the gradient (the
    /// padding up to a multiple of the optimizer shards) are zero. A part inside the gradient is
    /// written straight from it; one workspace vector of the largest padded part serves the
    /// padded ones in turn.
    fn write_grads(&self, parts: &[GradPart], grad: D::Ptr, len: usize) -> Result<(), DeviceError> {
        let padded = |p: &GradPart| p.first + self.elements(&p.region) > len;
        let most = parts
            .iter()
            .filter(|p| padded(p))
            .map(|p| self.elements(&p.region))
            .max();
        let scratch = most.map(|n| self.device.alloc(n)).transpose()?;
        for part in parts {
            let n = self.elements(&part.region);
            let Some(v) = scratch.filter(|_| padded(part)) else {
                self.write(&part.region, grad.offset(part.first), n, part.accumulate)?;
                continue;
            };
            self.device.fill(v, n, 0.0)?;
            let lo = part.first.min(len);
            let hi = (part.first + n).min(len);
            self.device.copy(v, grad.offset(lo), hi - lo)?;
            self.write(&part.region, v, n, part.accumulate)?;
        }
        Ok(())
    }

    /// Saved activations, segment by segment: model-dtype segments in the buffer's dtype, fp32
    /// statistics as fp32 (at any 2-byte offset).
    fn write_saved(&self, layer: usize, r: &Region, v: D::Ptr) -> Result<(), DeviceError> {
        if self.saved_view(layer, r)? == Some(v) {
            return Ok(()); // computed in place
        }
        let (mut at, d) = (self.at(r), self.dtype(r));
        let mut src = v;
        for seg in self.plan.maths[layer].saved_segments() {
            let n = seg.elements;
            match seg.stored {
                Stored::Model => self.device.store(src, at, d, n, false)?,
                Stored::F32 => self.device.store_f32(src, at, n)?,
            }
            at += n as u64 * stored_bytes(seg.stored, d);
            src = src.offset(n);
        }
        Ok(())
    }

    fn read_saved_opt(&self, layer: usize, r: &Option<Region>) -> Result<D::Ptr, DeviceError> {
        match r {
            Some(s) => self.read_saved(layer, s),
            None => self.device.alloc(0),
        }
    }

    fn read_saved(&self, layer: usize, r: &Region) -> Result<D::Ptr, DeviceError> {
        if let Some(p) = self.saved_view(layer, r)? {
            return Ok(p);
        }
        let (mut at, d) = (self.at(r), self.dtype(r));
        let out = self.device.alloc(self.plan.maths[layer].saved_elements())?;
        let mut dst = out;
        for seg in self.plan.maths[layer].saved_segments() {
            let n = seg.elements;
            match seg.stored {
                Stored::Model => self.device.load(at, d, dst, n)?,
                Stored::F32 => self.device.load_f32(at, dst, n)?,
            }
            at += n as u64 * stored_bytes(seg.stored, d);
            dst = dst.offset(n);
        }
        Ok(out)
    }

    /// A tied head's embedding matrix: the first vocab × hidden values of the embedding's
    /// parameters (zeros for a recompute, which needs only the saved activations).
    fn tied(&self, layer: usize, r: &Option<Region>) -> Result<Option<D::Ptr>, DeviceError> {
        let LayerKind::LmHead {
            tied: true,
            vocab,
            hidden,
            ..
        } = self.plan.job.model.layers[layer].kind
        else {
            return Ok(None);
        };
        let n = (vocab * hidden) as usize;
        match r {
            Some(r) => self.read(r, n).map(Some),
            None => {
                let z = self.device.alloc(n)?;
                self.device.fill(z, n, 0.0)?;
                Ok(Some(z))
            }
        }
    }

    fn layer_input(
        &self,
        layer: usize,
        hidden: &Option<Region>,
        m: Option<u32>,
    ) -> Result<In<D>, DeviceError> {
        match hidden {
            Some(r) => Ok(In::Hidden(
                self.read(r, self.plan.maths[layer].input_elements())?,
            )),
            None => {
                let m = m.ok_or_else(|| plan_error("a layer op without a micro-step"))?;
                Ok(In::Tokens(self.device.tokens(m, false)?))
            }
        }
    }

    /// What a layer's backward (whole or either half) reads: its weights, saved activations,
    /// input and output gradient.
    fn backward_reads(&self, r: &Reads<'_>, m: Option<u32>) -> Result<Read<D>, DeviceError> {
        let math = &self.plan.maths[r.layer];
        let weights = layers::Weights {
            params: self.read_opt(r.params, math.params())?,
            tied: self.tied(r.layer, r.tied)?,
        };
        let keep = match r.saved {
            Some(s) => self.read_saved(r.layer, s)?,
            None => self.device.alloc(0)?,
        };
        let x = self.layer_input(r.layer, r.hidden, m)?;
        let dy = self.read(r.grad_output, math.output_elements())?;
        Ok(Read {
            weights,
            keep,
            x,
            dy,
        })
    }

    /// Where a layer's backward computes its parameter gradient and a tied head's embedding
    /// gradient, and whether their stores round them (then the layer math leaves them
    /// unrounded until they are stored: the same bits, a pass over them less).
    fn grads_outputs(
        &self,
        layer: usize,
        grads: &[GradPart],
        tied_grads: &[GradPart],
        op: &[&Region],
    ) -> Result<GradOutputs<D::Ptr>, DeviceError> {
        let math = &self.plan.maths[layer];
        let dp = self.grads_output(grads, math.params(), op)?;
        let dt = math
            .is_tied()
            .then(|| self.device.alloc(math.tied_elements()))
            .transpose()?;
        let prec = math.precisions().1;
        let stored = self.stores_round(grads, prec)
            && self.stores_round(tied_grads, prec)
            && !self.rounds_grads_first();
        Ok(GradOutputs { dp, dt, stored })
    }

    /// A layer's parameter gradient and a tied head's embedding gradient written into their
    /// parts.
    fn write_layer_grads(
        &self,
        layer: usize,
        (grads, dp): (&[GradPart], D::Ptr),
        (tied_grads, dt): (&[GradPart], Option<D::Ptr>),
    ) -> Result<(), DeviceError> {
        let math = &self.plan.maths[layer];
        self.write_grads(grads, dp, math.params())?;
        if let Some(dt) = dt {
            self.write_grads(tied_grads, dt, math.tied_elements())?;
        }
        Ok(())
    }

    fn action(&self, a: &Action, m: Option<u32>, input: &StepInput) -> Result<(), DeviceError> {
        let (p, d) = (self.plan, self.device);
        match a {
            Action::Forward {
                layer,
                params,
                tied,
                input: hidden,
                output,
                saved,
            } => {
                let math = &p.maths[*layer];
                let op = op_regions(a);
                let pp = self.read_opt(params, math.params())?;
                let t = self.tied(*layer, tied)?;
                let x = self.layer_input(*layer, hidden, m)?;
                // A hidden state (not the logits) is the rank's rows of the whole output.
                let n = math.output_elements();
                let (first, rows) = match *layer + 1 < p.maths.len() {
                    true => self.rows(n),
                    false => (0, n),
                };
                let out = match rows == n {
                    true => self.output(output.as_ref(), n, &op)?,
                    false => d.alloc(n)?,
                };
                let keep = match saved.as_ref().filter(|s| self.alone(s, &op)) {
                    Some(s) => self.saved_view(*layer, s)?,
                    None => None,
                };
                let keep = keep.map_or_else(|| d.alloc(math.saved_elements()), Ok)?;
                layers::forward(d, math, pp, t, x, out, keep)?;
                if let Some(o) = output {
                    self.write(o, out.at(&(first..first + rows)), rows, false)?;
                }
                if let Some(s) = saved {
                    self.write_saved(*layer, s, keep)?;
                }
            }
            Action::Backward {
                layer,
                params,
                tied,
                saved,
                input: hidden,
                grad_output,
                grad_input,
                grads,
                tied_grads,
            } => {
                let math = &p.maths[*layer];
                let op = op_regions(a);
                let reads = Reads {
                    layer: *layer,
                    params,
                    tied,
                    saved,
                    hidden,
                    grad_output,
                };
                let Read {
                    weights,
                    keep,
                    x,
                    dy,
                } = self.backward_reads(&reads, m)?;
                // The input's gradient is the rank's rows of the whole one.
                let n = math.input_elements();
                let (first, rows) = self.rows(n);
                let dx = grad_input
                    .as_ref()
                    .map(|r| match rows == n {
                        true => self.output(Some(r), n, &op),
                        false => d.alloc(n),
                    })
                    .transpose()?;
                let GradOutputs { dp, dt, stored } =
                    self.grads_outputs(*layer, grads, tied_grads, &op)?;
                let layer_grads = layers::Grads {
                    dy,
                    gi: dx,
                    gp: dp,
                    gt: dt,
                };
                layers::backward(d, math, weights, keep, x, layer_grads, !stored)?;
                if let (Some(r), Some(dx)) = (grad_input, dx) {
                    self.write(r, dx.at(&(first..first + rows)), rows, false)?;
                }
                self.write_layer_grads(*layer, (grads, dp), (tied_grads, dt))?;
            }
            Action::ForwardOpen {
                layer,
                sublayer,
                params,
                stream,
                partial,
                saved,
            } => {
                let math = &p.maths[*layer];
                let op = op_regions(a);
                let pp = self.read_opt(params, math.params())?;
                let x = self.read(stream, math.input_elements())?;
                let n = math.input_elements();
                let out = self.output(Some(partial), n, &op)?;
                let keep = match saved.as_ref().filter(|s| self.alone(s, &op)) {
                    Some(s) => self.saved_view(*layer, s)?,
                    None => None,
                };
                // Sublayer 1 writes its part of what sublayer 0 wrote: start from it.
                let keep = match (keep, saved) {
                    (Some(k), _) => k,
                    (None, Some(s)) if *sublayer > 0 => self.read_saved(*layer, s)?,
                    (None, _) => d.alloc(math.saved_elements())?,
                };
                let lead = p.program.layout.tp_index(self.rank) == 0;
                super::tensor::forward_open(d, math, *sublayer, pp, x, keep, out, lead)?;
                self.write(partial, out, n, false)?;
                if let Some(s) = saved {
                    self.write_saved(*layer, s, keep)?;
                }
            }
            Action::ForwardClose { partial, output } => {
                let n = self.elements(output);
                let sum = self.read(partial, n)?;
                self.write(output, sum, n, false)?;
            }
            Action::BackwardOpen {
                layer,
                sublayer,
                params,
                saved,
                stream_grad,
                partial,
                grads,
            } => {
                let math = &p.maths[*layer];
                let op = op_regions(a);
                let n = math.input_elements();
                let pp = self.read_opt(params, math.params())?;
                let keep = self.read_saved_opt(*layer, saved)?;
                let dy = self.read(stream_grad, n)?;
                let out = self.output(Some(partial), n, &op)?;
                let gp = d.alloc(math.params())?;
                d.fill(gp, math.params(), 0.0)?;
                super::tensor::backward_open(d, math, *sublayer, pp, keep, dy, gp, out)?;
                self.write(partial, out, n, false)?;
                d.round(math.precisions().1, gp, math.params())?;
                self.write_grads(grads, gp, math.params())?;
            }
            Action::BackwardClose {
                layer,
                sublayer,
                params,
                saved,
                partial,
                base,
                input: hidden,
                grad_input,
                grads,
            } => {
                let math = &p.maths[*layer];
                let hidden_width = math.input_elements() / math.dims().t;
                let (first, n) = self.rows(math.input_elements());
                let pp = self.read_opt(params, math.params())?;
                let keep = self.read_saved_opt(*layer, saved)?;
                let sum = self.read(partial, n)?;
                let x = hidden.as_ref().map(|r| self.read(r, n)).transpose()?;
                let b = self.read(base, n)?;
                let gi = d.alloc(n)?;
                let gp = d.alloc(math.params())?;
                d.fill(gp, math.params(), 0.0)?;
                let rows = (first / hidden_width, n / hidden_width);
                let close = super::tensor::backward_close;
                close(d, math, *sublayer, pp, keep, x, sum, (gi, b), gp, rows)?;
                self.write(grad_input, gi, n, false)?;
                d.round(math.precisions().1, gp, math.params())?;
                self.write_grads(grads, gp, math.params())?;
            }
            Action::BackwardInput {
                layer,
                params,
                tied,
                saved,
                input: hidden,
                grad_output,
                grad_input,
                stash,
            } => {
                let math = &p.maths[*layer];
                let op = op_regions(a);
                let reads = Reads {
                    layer: *layer,
                    params,
                    tied,
                    saved,
                    hidden,
                    grad_output,
                };
                let Read {
                    weights,
                    keep,
                    x,
                    dy,
                } = self.backward_reads(&reads, m)?;
                let dx = grad_input
                    .as_ref()
                    .map(|r| self.output(Some(r), math.input_elements(), &op))
                    .transpose()?;
                let n = math.stash_elements();
                let st = self.output(stash.as_ref(), n, &op)?;
                let layer_grads = layers::InputGrads {
                    dy,
                    gi: dx,
                    stash: st,
                };
                layers::backward_input(d, math, weights, keep, x, layer_grads)?;
                if let (Some(r), Some(dx)) = (grad_input, dx) {
                    self.write(r, dx, math.input_elements(), false)?;
                }
                if let Some(s) = stash {
                    self.write(s, st, n, false)?;
                }
            }
            Action::BackwardWeight {
                layer,
                params,
                tied,
                saved,
                stash,
                input: hidden,
                grad_output,
                grads,
                tied_grads,
            } => {
                let math = &p.maths[*layer];
                let op = op_regions(a);
                let reads = Reads {
                    layer: *layer,
                    params,
                    tied,
                    saved,
                    hidden,
                    grad_output,
                };
                let Read {
                    weights,
                    keep,
                    x,
                    dy,
                } = self.backward_reads(&reads, m)?;
                let st = self.read_opt(stash, math.stash_elements())?;
                let GradOutputs { dp, dt, stored } =
                    self.grads_outputs(*layer, grads, tied_grads, &op)?;
                let layer_grads = layers::WeightGrads {
                    dy,
                    stash: st,
                    gp: dp,
                    gt: dt,
                };
                layers::backward_weight(d, math, weights, keep, x, layer_grads, !stored)?;
                self.write_layer_grads(*layer, (grads, dp), (tied_grads, dt))?;
            }
            Action::Loss { logits, grad } => {
                let head = LayerMath::head(&p.maths)
                    .ok_or_else(|| plan_error("the model does not end in an lm_head"))?;
                let (n, vocab, stride) = (head.dims().t, head.output_width(), head.output_stride());
                let m = m.ok_or_else(|| plan_error("a loss op without a micro-step"))?;
                let z = self.read(logits, n * stride)?;
                let dz = self.output(Some(grad), n * stride, &op_regions(a))?;
                d.cross_entropy(
                    &Logits {
                        z,
                        vocab,
                        stride,
                        rows: n,
                    },
                    d.tokens(m, true)?,
                    dz,
                )?;
                self.write(grad, dz, n * stride, false)?;
            }
            Action::Update {
                layer,
                grad,
                state,
                param,
                sumsq,
            } => {
                let contributions = f64::from(p.dp_size()) * f64::from(p.program.micro_steps);
                if sumsq.is_none() && input.poison_grad == Some(*layer) {
                    self.poison(grad)?;
                }
                let n = self.elements(grad);
                let g = self.read(grad, n)?;
                let st = self.read(state, self.elements(state))?;
                let cfg =
                    OptimizerConfig::of(p.job.model.optimizer, input.lr, &p.job.schedule.train);
                if self.elements(state) != cfg.state_per_param() * n {
                    return Err(plan_error(format!(
                        "optimizer state of {} values for a shard of {n}",
                        self.elements(state)
                    )));
                }
                let u = Update {
                    cfg: &cfg,
                    step: input.step,
                    n,
                    first: p.index(self.rank, ShardIndex::Optimizer) as usize * n,
                    decay: &p.decay[*layer],
                    clip: sumsq
                        .as_ref()
                        .zip(input.clip)
                        .map(|(s, clip)| (self.span(s), clip)),
                    contributions,
                };
                // The parameter written by the update's own pass where the device can write it
                // in place, else stored from the new master after.
                let in_place = self.in_place(param, n, &op_regions(a))?;
                d.update(&u, st, g, in_place)?;
                self.write(state, st, self.elements(state), false)?;
                if in_place.is_none() {
                    self.write(param, st, n, false)?;
                }
            }
            Action::GradNorm { grads, sumsq } => {
                for g in grads {
                    let layer = p.program.buffers[g.buffer].layer.map(|l| l.index());
                    if layer.is_some() && layer == input.poison_grad {
                        self.poison(g)?;
                    }
                }
                let spans: Vec<ArenaSpan> = grads.iter().flat_map(|g| self.counted(g)).collect();
                d.grad_norm(&spans, self.span(sumsq))?;
            }
            Action::Accumulate { from, acc } => {
                let n = self.elements(from);
                let v = self.read(from, n)?;
                self.write(acc, v, n, true)?;
            }
            Action::Copy { from, to } => {
                // The concatenation of `from` into the concatenation of `to`, piece by piece.
                let (mut fi, mut fo, mut ti, mut tof) = (0usize, 0u64, 0usize, 0u64);
                while fi < from.len() && ti < to.len() {
                    let (f, t) = (&from[fi], &to[ti]);
                    let n = (f.bytes - fo).min(t.bytes - tof);
                    if n > 0 {
                        d.copy_arena(self.at(t) + tof, self.at(f) + fo, n)?;
                    }
                    fo += n;
                    tof += n;
                    if fo == f.bytes {
                        fi += 1;
                        fo = 0;
                    }
                    if tof == t.bytes {
                        ti += 1;
                        tof = 0;
                    }
                }
            }
            Action::Collectives(_) => {
                return Err(plan_error(
                    "collectives run through the backend's communicators",
                ))
            }
        }
        Ok(())
    }
}

/// What a layer's backward read ([`Rank::backward_reads`]).
struct Read<D: Device> {
    weights: layers::Weights<D::Ptr>,
    keep: D::Ptr,
    x: In<D>,
    dy: D::Ptr,
}

/// Where a layer's backward computes its gradients ([`Rank::grads_outputs`]).
struct GradOutputs<P> {
    dp: P,
    dt: Option<P>,
    stored: bool,
}

/// The regions a layer's backward reads before its gradients.
struct Reads<'a> {
    layer: usize,
    params: &'a Option<Region>,
    tied: &'a Option<Region>,
    saved: &'a Option<Region>,
    hidden: &'a Option<Region>,
    grad_output: &'a Region,
}

fn stored_bytes(s: Stored, model: Dtype) -> u64 {
    match s {
        Stored::Model => model.bytes(),
        Stored::F32 => 4,
    }
}

/// The regions an op names, for [`Rank::alone`]: a layer op's, the loss's; none for the others.
fn op_regions(a: &Action) -> Vec<&Region> {
    let named: Vec<&Option<Region>> = match a {
        Action::Forward {
            params,
            tied,
            input,
            output,
            saved,
            ..
        } => vec![params, tied, input, output, saved],
        Action::Backward {
            params,
            tied,
            saved,
            input,
            grad_input,
            ..
        } => vec![params, tied, saved, input, grad_input],
        Action::BackwardInput {
            params,
            tied,
            saved,
            input,
            grad_input,
            stash,
            ..
        } => vec![params, tied, saved, input, grad_input, stash],
        Action::BackwardWeight {
            params,
            tied,
            saved,
            stash,
            input,
            ..
        } => vec![params, tied, saved, stash, input],
        Action::ForwardOpen { params, saved, .. }
        | Action::BackwardOpen { params, saved, .. }
        | Action::BackwardClose { params, saved, .. } => vec![params, saved],
        _ => vec![],
    };
    let more: Vec<&Region> = match a {
        Action::Backward {
            grad_output,
            grads,
            tied_grads,
            ..
        }
        | Action::BackwardWeight {
            grad_output,
            grads,
            tied_grads,
            ..
        } => std::iter::once(grad_output)
            .chain(grads.iter().chain(tied_grads).map(|g| &g.region))
            .collect(),
        Action::BackwardInput { grad_output, .. } => vec![grad_output],
        Action::ForwardOpen {
            stream, partial, ..
        } => vec![stream, partial],
        Action::BackwardOpen {
            stream_grad,
            partial,
            grads,
            ..
        } => [stream_grad, partial]
            .into_iter()
            .chain(grads.iter().map(|g| &g.region))
            .collect(),
        Action::Loss { logits, grad } => vec![logits, grad],
        Action::Update {
            grad, state, param, ..
        } => vec![grad, state, param],
        _ => vec![],
    };
    named
        .into_iter()
        .filter_map(|r| r.as_ref())
        .chain(more)
        .collect()
}

/// Whether `r`'s bytes on `rank` overlap no other region of `op`.
fn alone(plan: &Plan, rank: u32, r: &Region, op: &[&Region]) -> bool {
    let span = |x: &Region| (plan.at(rank, x), plan.at(rank, x) + x.bytes);
    let (lo, hi) = span(r);
    op.iter().filter(|x| !std::ptr::eq(**x, r)).all(|x| {
        let (a, b) = span(x);
        b <= lo || hi <= a
    })
}

#[cfg(all(test, feature = "compile"))]
#[path = "../../tests/unit/device_action.rs"]
mod tests;
