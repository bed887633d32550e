//! What each op of a plan does, decoded once before the first step.
//!
//! A plan's compute ops name only regions; what a region *means* to the op (the layer's
//! parameters, its saved activations, the gradient of its output…) follows the lowering's
//! conventions, which this module decodes into an [`Action`] per op and checks against the model:
//! every size must agree with the layer math, or the plan is refused with the op named. Backends
//! execute actions; none of them looks at a compute op's raw region lists again.
//!
//! The conventions (`compiler/src/lower`), for layer `l`:
//! - `forward`: reads its parameters (when it has any), a tied head's embedding parameters, and
//!   its input hidden state (not for the first layer, which reads tokens); writes its output and,
//!   unless recomputed, its saved activations.
//! - `recompute`: reads parameters and input; writes the saved activations.
//! - `backward`: reads parameters, saved activations, the gradient of its output, its input, then
//!   gradient regions it adds onto and a tied head's embedding parameters; writes the gradient of
//!   its input (not for the first layer), then its parameter-gradient regions — a region that is
//!   also read is added onto, any other is overwritten — and a tied head's embedding gradient.
//! - `backward_input` (a pipeline's `I`): reads parameters, saved activations, the gradient of
//!   its output, its input (not for the first layer) and a tied head's embedding parameters;
//!   writes the gradient of its input (not for the first layer) and its stash (when
//!   `sched_ir::abi::stash_elements` is not zero): the fp32 gradients `backward_weight` needs.
//! - `backward_weight` (a pipeline's `W`, after its `I`): reads parameters, saved activations,
//!   the stash (when there is one), the gradient of its output, its input (not for the first
//!   layer), then gradient regions it adds onto and a tied head's embedding parameters; writes
//!   its parameter-gradient regions (as `backward` does) and a tied head's embedding gradient.
//!   `backward_input` then `backward_weight` compute what `backward` computes.
//! - `loss`: reads the logits, writes their gradient.
//! - `update`: reads the optimizer-shard gradient, the optimizer state and, with clipping, the
//!   all-reduced sum of squares; writes the state and the rank's part of the param shard.
//! - `grad_norm`: reads every optimizer-shard gradient, writes their sum of squares.
//! - `accumulate`: reads `from` and `acc`, writes `acc += from`; `copy`: the concatenation of its
//!   reads is written to the concatenation of its writes.
//!
//! Every other compute op also writes its stream's workspace (its last write): scratch a backend
//! takes from (the CUDA backend's bump allocator and cuBLAS workspace, at the planned offsets),
//! not data, so the decoding sets it aside; backends find it through `Stream::workspace`.

use crate::math::LayerMath;
use cranelift_entity::EntityRef;
use sched_ir::ir::{BufferKind, CollectiveOp, ComputeKind, Offset, OpKind, Program, Region};
use sched_ir::job::{LayerKind, Model};

/// A compute op's parameter-gradient write: `region` holds gradient elements from `first` on.
#[derive(Clone, Debug)]
pub struct GradPart {
    pub region: Region,
    pub first: usize,
    pub accumulate: bool,
}

/// What an op does.
#[derive(Clone, Debug)]
pub enum Action {
    Forward {
        layer: usize,
        params: Option<Region>,
        tied: Option<Region>,
        input: Option<Region>,
        output: Option<Region>,
        saved: Option<Region>,
    },
    Backward {
        layer: usize,
        params: Option<Region>,
        tied: Option<Region>,
        saved: Option<Region>,
        input: Option<Region>,
        grad_output: Region,
        grad_input: Option<Region>,
        grads: Vec<GradPart>,
        tied_grads: Vec<GradPart>,
    },
    /// A split backward's input half (`backward_input`): `grad_input` and `stash` written.
    BackwardInput {
        layer: usize,
        params: Option<Region>,
        tied: Option<Region>,
        saved: Option<Region>,
        input: Option<Region>,
        grad_output: Region,
        grad_input: Option<Region>,
        stash: Option<Region>,
    },
    /// A split backward's weight half (`backward_weight`): the gradient parts written from
    /// `stash` as [`Action::Backward`] writes them.
    BackwardWeight {
        layer: usize,
        params: Option<Region>,
        tied: Option<Region>,
        saved: Option<Region>,
        stash: Option<Region>,
        input: Option<Region>,
        grad_output: Region,
        grads: Vec<GradPart>,
        tied_grads: Vec<GradPart>,
    },
    Loss {
        logits: Region,
        grad: Region,
    },
    Update {
        layer: usize,
        grad: Region,
        state: Region,
        param: Region,
        sumsq: Option<Region>,
    },
    GradNorm {
        grads: Vec<Region>,
        sumsq: Region,
    },
    Accumulate {
        from: Region,
        acc: Region,
    },
    Copy {
        from: Vec<Region>,
        to: Vec<Region>,
    },
    Collectives(Vec<CollectiveOp>),
    /// A tensor-parallel layer's `forward_open(j)`: `partial` (fp32) and its part of `saved`
    /// written from the residual `stream` at the sublayer's input.
    ForwardOpen {
        layer: usize,
        sublayer: u8,
        params: Option<Region>,
        stream: Region,
        partial: Region,
        saved: Option<Region>,
    },
    /// `forward_close(j)`: the all-reduced `partial` stored as the residual stream `output`.
    ForwardClose {
        partial: Region,
        output: Region,
    },
    /// `backward_open(j)`: from the residual stream's gradient `stream_grad` at the sublayer's
    /// output, `partial` (fp32) and the sublayer's products' parameter-gradient parts.
    BackwardOpen {
        layer: usize,
        sublayer: u8,
        params: Option<Region>,
        saved: Option<Region>,
        stream_grad: Region,
        partial: Region,
        grads: Vec<GradPart>,
    },
    /// `backward_close(j)`: `grad_input` ← `base` + the norm's input gradient from the
    /// all-reduced `partial`, and the norm's parameter-gradient parts; `input` is the layer's
    /// input (sublayer 0's norm reads it).
    BackwardClose {
        layer: usize,
        sublayer: u8,
        params: Option<Region>,
        saved: Option<Region>,
        partial: Region,
        base: Region,
        input: Option<Region>,
        grad_input: Region,
        grads: Vec<GradPart>,
    },
}

/// Why a plan's ops do not decode against its model.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    #[error("the plan has {plan} layers but its model has {model}")]
    Layers { plan: usize, model: usize },
    /// An op whose regions do not fit what its kind computes (`op17 (backward block[1])`).
    #[error("{op}: {mismatch}")]
    Op { op: String, mismatch: OpMismatch },
}

/// How one op's regions fail to fit what its kind computes.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum OpMismatch {
    #[error("names no layer")]
    NoLayer,
    #[error("its stash {0} is not fp32")]
    StashNotF32(String),
    #[error("reads no {0}")]
    MissingRead(&'static str),
    #[error("writes no {0}")]
    MissingWrite(&'static str),
    #[error("{reads} reads and {writes} writes are left over that the op does not use")]
    LeftOver { reads: usize, writes: usize },
    #[error("writes {0} which is not a gradient")]
    NotAGradient(String),
    #[error("writes a rank-dependent part of {0}")]
    RankDependentGradient(String),
    #[error("writes {0}, another layer's gradient")]
    OtherLayersGradient(String),
    #[error("a tied head's embedding parameters are missing")]
    TiedEmbeddingMissing,
    #[error("the model does not end in an lm_head")]
    NoHead,
    #[error("copies {from} bytes into {to}")]
    CopySizes { from: u64, to: u64 },
    #[error("its {what} region holds {holds} elements, the layer needs {needs}")]
    TooSmall {
        what: &'static str,
        holds: u64,
        needs: usize,
    },
    /// A size this schedrun's layer math does not give: a plan another schedc laid out (or an
    /// edited file).
    #[error(
        "its {what} region holds {holds} elements, the layer has {has} (a plan compiled by \
         another schedc? compile it again)"
    )]
    OtherSize {
        what: &'static str,
        holds: u64,
        has: usize,
    },
}

/// Decodes every op of `p`, compiled for `model`, checking sizes against `maths` (one per layer).
pub fn decode(p: &Program, model: &Model, maths: &[LayerMath]) -> Result<Vec<Action>, DecodeError> {
    if p.layers.len() != model.layers.len() {
        return Err(DecodeError::Layers {
            plan: p.layers.len(),
            model: model.layers.len(),
        });
    }
    p.ops
        .iter()
        .map(|(id, op)| {
            let name = match op.layer {
                Some(l) => format!("{id} ({} {})", op.kind_name(), p.layers[l].name),
                None => format!("{id} ({})", op.kind_name()),
            };
            decode_op(p, model, maths, op)
                .map_err(|mismatch| DecodeError::Op { op: name, mismatch })
        })
        .collect()
}

struct Lists<'a> {
    p: &'a Program,
    reads: std::collections::VecDeque<Region>,
    writes: std::collections::VecDeque<Region>,
    all_reads: Vec<Region>,
}

/// What every backward reads first, in the lowering's order ([`Lists::backward_reads`]).
struct BackwardReads {
    params: Option<Region>,
    saved: Option<Region>,
    /// A weight half's stash.
    stash: Option<Region>,
    grad_output: Region,
    input: Option<Region>,
}

impl Lists<'_> {
    /// A backward's (or a half's) first reads of `layer`: its parameters, saved activations, the
    /// stash (a weight half's, with `stash`), the output gradient and its input.
    fn backward_reads(
        &mut self,
        spec: &sched_ir::job::Layer,
        lm: &LayerMath,
        layer: usize,
        stash: bool,
    ) -> Result<BackwardReads, OpMismatch> {
        Ok(BackwardReads {
            params: self.take_read(spec.params > 0, "parameters")?,
            saved: self.take_read(lm.saved_elements() > 0, "saved activations")?,
            stash: self.take_read(stash && lm.stash_elements() > 0, "stash")?,
            grad_output: self
                .take_read(true, "output gradient")?
                .ok_or(OpMismatch::MissingRead("output gradient"))?,
            input: self.take_read(layer > 0, "input hidden state")?,
        })
    }

    fn take_read(&mut self, want: bool, what: &'static str) -> Result<Option<Region>, OpMismatch> {
        if !want {
            return Ok(None);
        }
        self.reads
            .pop_front()
            .map(Some)
            .ok_or(OpMismatch::MissingRead(what))
    }

    fn take_write(&mut self, want: bool, what: &'static str) -> Result<Option<Region>, OpMismatch> {
        if !want {
            return Ok(None);
        }
        self.writes
            .pop_front()
            .map(Some)
            .ok_or(OpMismatch::MissingWrite(what))
    }

    /// The next read when it lies in a buffer of `kind`.
    fn take_kind(&mut self, kind: BufferKind) -> Option<Region> {
        let r = *self.reads.front()?;
        (self.kind(&r) == kind)
            .then(|| self.reads.pop_front())
            .flatten()
    }

    /// The next write when it lies in a buffer of `kind`.
    fn take_write_kind(&mut self, kind: BufferKind) -> Option<Region> {
        let r = *self.writes.front()?;
        (self.kind(&r) == kind)
            .then(|| self.writes.pop_front())
            .flatten()
    }

    fn need_read(&mut self, what: &'static str) -> Result<Region, OpMismatch> {
        self.reads.pop_front().ok_or(OpMismatch::MissingRead(what))
    }

    fn need_write(&mut self, what: &'static str) -> Result<Region, OpMismatch> {
        self.writes
            .pop_front()
            .ok_or(OpMismatch::MissingWrite(what))
    }

    fn kind(&self, r: &Region) -> BufferKind {
        self.p.buffers[r.buffer].kind
    }

    fn is_params(&self, r: &Region) -> bool {
        matches!(self.kind(r), BufferKind::ParamShard | BufferKind::Gathered)
    }

    /// [`Lists::tied_after_grads`], which a backward of a tied head (`tied`) must have and any
    /// other must not.
    fn tied_embedding(&mut self, tied: bool) -> Result<Option<Region>, OpMismatch> {
        let r = self.tied_after_grads();
        if tied != r.is_some() {
            return Err(OpMismatch::TiedEmbeddingMissing);
        }
        Ok(r)
    }

    /// A backward's reads after its input: the gradient regions it adds onto, then a tied
    /// head's embedding parameters (the last parameter region among them).
    fn tied_after_grads(&mut self) -> Option<Region> {
        let mut tied = None;
        while let Some(r) = self.reads.pop_front() {
            if self.is_params(&r) {
                tied = Some(r);
            }
        }
        tied
    }

    /// A backward's writes after its input gradient: parts of `layer`'s parameter gradient,
    /// and of the embedding's (`tied_layer`) for a tied head; a part also read is added onto.
    fn grad_parts(
        &mut self,
        layer: usize,
        tied_layer: Option<usize>,
    ) -> Result<(Vec<GradPart>, Vec<GradPart>), OpMismatch> {
        let (mut grads, mut tied_grads) = (vec![], vec![]);
        while let Some(r) = self.writes.pop_front() {
            let buf = &self.p.buffers[r.buffer];
            if !matches!(buf.kind, BufferKind::GradShard | BufferKind::FullGrad) {
                return Err(OpMismatch::NotAGradient(buf.name.clone()));
            }
            let Offset::Fixed(off) = r.offset else {
                return Err(OpMismatch::RankDependentGradient(buf.name.clone()));
            };
            let part = GradPart {
                region: r,
                first: (off / buf.dtype.bytes()) as usize,
                accumulate: self.all_reads.contains(&r),
            };
            match buf.layer.map(|x| x.index()) {
                Some(x) if x == layer => grads.push(part),
                Some(x) if Some(x) == tied_layer => tied_grads.push(part),
                _ => return Err(OpMismatch::OtherLayersGradient(buf.name.clone())),
            }
        }
        Ok((grads, tied_grads))
    }

    fn finish(&self) -> Result<(), OpMismatch> {
        if !self.reads.is_empty() || !self.writes.is_empty() {
            return Err(OpMismatch::LeftOver {
                reads: self.reads.len(),
                writes: self.writes.len(),
            });
        }
        Ok(())
    }
}

fn decode_op(
    p: &Program,
    model: &Model,
    maths: &[LayerMath],
    op: &sched_ir::ir::Op,
) -> Result<Action, OpMismatch> {
    let kind = match &op.kind {
        OpKind::Collective(c) => return Ok(Action::Collectives(vec![*c])),
        OpKind::Group(cs) => return Ok(Action::Collectives(cs.clone())),
        OpKind::Compute(k) => *k,
    };
    let data = |rs: &[Region]| -> Vec<Region> {
        rs.iter().filter(|r| !p.is_workspace(r)).copied().collect()
    };
    let mut l = Lists {
        p,
        reads: data(&op.reads).into(),
        writes: data(&op.writes).into(),
        all_reads: data(&op.reads),
    };
    let layer = op.layer.map(|id| id.index());
    let need_layer = || layer.ok_or(OpMismatch::NoLayer);
    let tied_of = |layer: usize| -> Option<usize> {
        match model.layers[layer].kind {
            LayerKind::LmHead { tied: true, .. } => model
                .layers
                .iter()
                .position(|x| matches!(x.kind, LayerKind::Embedding { .. })),
            _ => None,
        }
    };
    let action = match kind {
        ComputeKind::BackwardInput => {
            let layer = need_layer()?;
            let r = l.backward_reads(&model.layers[layer], &maths[layer], layer, false)?;
            let BackwardReads {
                params,
                saved,
                grad_output,
                input,
                ..
            } = r;
            let tied = l.tied_embedding(tied_of(layer).is_some())?;
            let grad_input = l.take_write(layer > 0, "input gradient")?;
            let stash = l.take_write(maths[layer].stash_elements() > 0, "stash")?;
            Action::BackwardInput {
                layer,
                params,
                tied,
                saved,
                input,
                grad_output,
                grad_input,
                stash,
            }
        }
        ComputeKind::BackwardWeight => {
            let layer = need_layer()?;
            let r = l.backward_reads(&model.layers[layer], &maths[layer], layer, true)?;
            let BackwardReads {
                params,
                saved,
                stash,
                grad_output,
                input,
            } = r;
            let tied = l.tied_embedding(tied_of(layer).is_some())?;
            let (grads, tied_grads) = l.grad_parts(layer, tied_of(layer))?;
            Action::BackwardWeight {
                layer,
                params,
                tied,
                saved,
                stash,
                input,
                grad_output,
                grads,
                tied_grads,
            }
        }
        ComputeKind::Forward | ComputeKind::Recompute => {
            let layer = need_layer()?;
            let has_params = model.layers[layer].params > 0;
            let params = l.take_read(has_params, "parameters")?;
            let tied = match (kind, tied_of(layer)) {
                (ComputeKind::Forward, Some(_)) => l.take_read(true, "tied embedding")?,
                _ => None,
            };
            let input = l.take_read(layer > 0, "input hidden state")?;
            let saved_len = maths[layer].saved_elements() > 0;
            let (output, saved) = if kind == ComputeKind::Forward {
                let out = l.take_write(true, "output")?;
                let saved = if l.writes.is_empty() {
                    None
                } else {
                    l.take_write(saved_len, "saved activations")?
                };
                (out, saved)
            } else {
                (None, l.take_write(true, "saved activations")?)
            };
            Action::Forward {
                layer,
                params,
                tied,
                input,
                output,
                saved,
            }
        }
        ComputeKind::Backward => {
            let layer = need_layer()?;
            let r = l.backward_reads(&model.layers[layer], &maths[layer], layer, false)?;
            let BackwardReads {
                params,
                saved,
                grad_output,
                input,
                ..
            } = r;
            let tied = l.tied_embedding(tied_of(layer).is_some())?;
            let grad_input = l.take_write(layer > 0, "input gradient")?;
            let (grads, tied_grads) = l.grad_parts(layer, tied_of(layer))?;
            Action::Backward {
                layer,
                params,
                tied,
                saved,
                input,
                grad_output,
                grad_input,
                grads,
                tied_grads,
            }
        }
        ComputeKind::ForwardOpen(j) => {
            let layer = need_layer()?;
            let params = l.take_read(model.layers[layer].params > 0, "parameters")?;
            let stream = l.need_read("residual stream")?;
            // A later sublayer keeps what the earlier ones saved (nothing is saved in a
            // forward whose backward recomputes).
            l.take_kind(BufferKind::Activation);
            let partial = l.need_write("partial sum")?;
            let saved = l.take_write_kind(BufferKind::Activation);
            Action::ForwardOpen {
                layer,
                sublayer: j,
                params,
                stream,
                partial,
                saved,
            }
        }
        ComputeKind::ForwardClose(_) => Action::ForwardClose {
            partial: l.need_read("partial sum")?,
            output: l.need_write("residual stream")?,
        },
        ComputeKind::BackwardOpen(j) => {
            let layer = need_layer()?;
            let params = l.take_read(model.layers[layer].params > 0, "parameters")?;
            let saved = l.take_read(maths[layer].saved_elements() > 0, "saved activations")?;
            let stream_grad = l.need_read("residual stream's gradient")?;
            let partial = l.need_write("partial sum")?;
            l.reads.clear(); // the gradient parts added onto
            let (grads, _) = l.grad_parts(layer, None)?;
            Action::BackwardOpen {
                layer,
                sublayer: j,
                params,
                saved,
                stream_grad,
                partial,
                grads,
            }
        }
        ComputeKind::BackwardClose(j) => {
            let layer = need_layer()?;
            let params = l.take_read(model.layers[layer].params > 0, "parameters")?;
            let saved = l.take_read(maths[layer].saved_elements() > 0, "saved activations")?;
            let partial = l.need_read("partial sum")?;
            let base = l.need_read("residual stream's gradient")?;
            let input = l.take_read(j == 0, "input hidden state")?;
            let grad_input = l.need_write("input gradient")?;
            l.reads.clear();
            let (grads, _) = l.grad_parts(layer, None)?;
            Action::BackwardClose {
                layer,
                sublayer: j,
                params,
                saved,
                partial,
                base,
                input,
                grad_input,
                grads,
            }
        }
        ComputeKind::Loss => Action::Loss {
            logits: l.take_read(true, "logits")?.expect("wanted"),
            grad: l.take_write(true, "logits gradient")?.expect("wanted"),
        },
        ComputeKind::Update => {
            let layer = need_layer()?;
            let grad = l.take_read(true, "gradient")?.expect("wanted");
            let state = l.take_read(true, "optimizer state")?.expect("wanted");
            let sumsq = l.reads.pop_front();
            l.take_write(true, "optimizer state")?;
            let param = l.take_write(true, "param shard")?.expect("wanted");
            Action::Update {
                layer,
                grad,
                state,
                param,
                sumsq,
            }
        }
        ComputeKind::GradNorm => Action::GradNorm {
            grads: l.reads.drain(..).collect(),
            sumsq: l.take_write(true, "sum of squares")?.expect("wanted"),
        },
        ComputeKind::Accumulate => {
            let from = l.take_read(true, "addend")?.expect("wanted");
            l.take_read(true, "accumulator")?;
            Action::Accumulate {
                from,
                acc: l.take_write(true, "accumulator")?.expect("wanted"),
            }
        }
        ComputeKind::Copy => {
            let from: Vec<Region> = l.reads.drain(..).collect();
            let to: Vec<Region> = l.writes.drain(..).collect();
            let (a, b) = (
                from.iter().map(|r| r.bytes).sum::<u64>(),
                to.iter().map(|r| r.bytes).sum::<u64>(),
            );
            if a != b {
                return Err(OpMismatch::CopySizes { from: a, to: b });
            }
            Action::Copy { from, to }
        }
    };
    l.finish()?;
    check_sizes(p, maths, &action)?;
    Ok(action)
}

/// Sizes every region of a layer action against the layer math.
fn check_sizes(p: &Program, maths: &[LayerMath], a: &Action) -> Result<(), OpMismatch> {
    let elems = |r: &Region| r.bytes / p.buffers[r.buffer].dtype.bytes();
    // With sequence parallelism a rank holds its t-th of the rows of each hidden state but the
    // logits.
    let t = if p.layout.sequence {
        p.layout.tensor.max(1) as usize
    } else {
        1
    };
    let rows = |layer: usize, n: usize| if layer < maths.len() { n / t } else { n };
    let at_least = |r: &Option<Region>, n: usize, what: &'static str| match r {
        Some(r) if (elems(r) as usize) < n => Err(OpMismatch::TooSmall {
            what,
            holds: elems(r),
            needs: n,
        }),
        _ => Ok(()),
    };
    // A size this schedrun's layer math does not give comes from a plan that another schedc
    // laid out (or an edited file): say so (an lm_head's logits, say, are in rows of
    // `logits_stride` since the plan padded them).
    let exactly = |r: &Option<Region>, n: usize, what: &'static str| match r {
        Some(r) if elems(r) as usize != n => Err(OpMismatch::OtherSize {
            what,
            holds: elems(r),
            has: n,
        }),
        _ => Ok(()),
    };
    match a {
        Action::Forward {
            layer,
            params,
            input,
            output,
            ..
        } => {
            let m = &maths[*layer];
            at_least(params, m.params(), "parameter")?;
            exactly(input, m.input_elements(), "input")?;
            exactly(output, rows(layer + 1, m.output_elements()), "output")?;
        }
        Action::Backward {
            layer,
            params,
            input,
            grad_output,
            grad_input,
            ..
        } => {
            let m = &maths[*layer];
            at_least(params, m.params(), "parameter")?;
            exactly(input, m.input_elements(), "input")?;
            exactly(
                grad_input,
                rows(*layer, m.input_elements()),
                "input gradient",
            )?;
            exactly(&Some(*grad_output), m.output_elements(), "output gradient")?;
        }
        Action::BackwardInput {
            layer,
            params,
            input,
            grad_output,
            grad_input,
            stash,
            ..
        } => {
            let m = &maths[*layer];
            at_least(params, m.params(), "parameter")?;
            exactly(input, m.input_elements(), "input")?;
            exactly(grad_input, m.input_elements(), "input gradient")?;
            exactly(&Some(*grad_output), m.output_elements(), "output gradient")?;
            stash_of(p, m, stash)?;
        }
        Action::BackwardWeight {
            layer,
            params,
            input,
            grad_output,
            stash,
            ..
        } => {
            let m = &maths[*layer];
            at_least(params, m.params(), "parameter")?;
            exactly(input, m.input_elements(), "input")?;
            exactly(&Some(*grad_output), m.output_elements(), "output gradient")?;
            stash_of(p, m, stash)?;
        }
        Action::Loss { logits, grad } => {
            let head = LayerMath::head(maths).ok_or(OpMismatch::NoHead)?;
            exactly(&Some(*logits), head.output_elements(), "logits")?;
            exactly(&Some(*grad), head.output_elements(), "logits gradient")?;
        }
        _ => {}
    }
    Ok(())
}

/// A split backward's stash: fp32, of exactly the layer's [`LayerMath::stash_elements`].
fn stash_of(p: &Program, m: &LayerMath, stash: &Option<Region>) -> Result<(), OpMismatch> {
    let Some(r) = stash else { return Ok(()) };
    let buf = &p.buffers[r.buffer];
    if buf.dtype != sched_ir::job::Dtype::Fp32 {
        return Err(OpMismatch::StashNotF32(buf.name.clone()));
    }
    let holds = r.bytes / 4;
    if holds as usize != m.stash_elements() {
        return Err(OpMismatch::OtherSize {
            what: "stash",
            holds,
            has: m.stash_elements(),
        });
    }
    Ok(())
}
