//! One rank's compute ops on the device: the CPU backend's `kernels.rs`, action for action, over
//! device addresses. Regions are read from the arena into f32 workspace, the layer math runs
//! there ([`super::layers`]), and results are rounded back to each buffer's dtype at the same
//! points as on the CPU. Built everywhere (it only enqueues through [`Exec`]), so the host
//! emulation in the tests runs it; on a GPU it runs inside [`super::CudaBackend`].
#![cfg_attr(not(feature = "cuda"), allow(dead_code))]

use super::enqueue::{dtype_code, elems, A};
use super::layers::{self, In, G};
use crate::backend::StepInput;
use crate::exec::{Action, GradPart};
use crate::math::{OptimizerConfig, Stored};
use crate::plan::Plan;
use cranelift_entity::EntityRef;
use schedc::ir::{Region, ShardIndex};
use schedc::job::{Dtype, LayerKind, Optimizer};

/// Device addresses of a rank's constants: the batch tokens, the loss and sum-of-squares
/// accumulators, rotary tables, decay ranges.
pub struct Consts {
    /// i32 tokens: [micro_step][inputs | targets] of T each.
    pub tokens: u64,
    /// One f64: the step's loss sum on this rank.
    pub loss: u64,
    /// One f64: the gradient norm's sum of squares.
    pub sumsq: u64,
    /// cos then sin tables, seq_len × head_dim/2 each.
    pub rope: Option<u64>,
    /// Per layer: (pointer to i64 [start, end) pairs, count).
    pub decay: Vec<(u64, usize)>,
    /// Tokens per micro-batch.
    pub t: usize,
}

/// One rank's view: the plan, its rank, where its arena starts, its constants.
pub struct RankView<'a> {
    pub plan: &'a Plan,
    pub rank: u32,
    pub arena_base: u64,
    pub consts: &'a Consts,
}

impl RankView<'_> {
    fn dtype(&self, r: &Region) -> Dtype {
        self.plan.program.buffers[r.buffer].dtype
    }

    fn elements(&self, r: &Region) -> usize {
        (r.bytes / self.dtype(r).bytes()) as usize
    }

    fn addr(&self, r: &Region) -> u64 {
        self.arena_base + self.plan.at(self.rank, r)
    }

    /// The first `n` values of `r` as f32 in the workspace.
    fn read(&self, g: &G, r: &Region, n: usize) -> Result<u64, String> {
        if n > self.elements(r) {
            return Err(format!(
                "reads {n} values from a region of {}",
                self.elements(r)
            ));
        }
        let dst = g.alloc(n)?;
        g.run(
            "load",
            n,
            &[
                A::P(self.addr(r)),
                A::I(dtype_code(self.dtype(r))),
                A::P(dst),
                A::L(n as i64),
            ],
        )?;
        Ok(dst)
    }

    fn write(&self, g: &G, r: &Region, src: u64, n: usize) -> Result<(), String> {
        if n > self.elements(r) {
            return Err(format!(
                "writes {n} values into a region of {}",
                self.elements(r)
            ));
        }
        g.run(
            "store",
            n,
            &[
                A::P(src),
                A::P(self.addr(r)),
                A::I(dtype_code(self.dtype(r))),
                A::L(n as i64),
            ],
        )
    }

    fn add(&self, g: &G, r: &Region, src: u64, n: usize) -> Result<(), String> {
        g.run(
            "add_store",
            n,
            &[
                A::P(src),
                A::P(self.addr(r)),
                A::I(dtype_code(self.dtype(r))),
                A::L(n as i64),
            ],
        )
    }

    /// kernels.rs `write_grads`: each part gets gradient elements from `first` on, zero past
    /// the gradient's end, written or added.
    fn write_grads(&self, g: &G, parts: &[GradPart], grad: u64, len: usize) -> Result<(), String> {
        for part in parts {
            let n = self.elements(&part.region);
            let v = g.zeros(n)?;
            let lo = part.first.min(len);
            let hi = (part.first + n).min(len);
            g.copy(v, grad + lo as u64 * 4, hi - lo)?;
            if part.accumulate {
                self.add(g, &part.region, v, n)?;
            } else {
                self.write(g, &part.region, v, n)?;
            }
        }
        Ok(())
    }

    fn write_saved(&self, g: &G, layer: usize, r: &Region, v: u64) -> Result<(), String> {
        let mut at = self.addr(r);
        let d = self.dtype(r);
        let mut src = v;
        for seg in self.plan.maths[layer].saved_segments() {
            let n = seg.elements;
            match seg.stored {
                Stored::Model => g.run(
                    "store",
                    n,
                    &[A::P(src), A::P(at), A::I(dtype_code(d)), A::L(n as i64)],
                )?,
                Stored::F32 => g.run("store_halves", n, &[A::P(src), A::P(at), A::L(n as i64)])?,
            }
            at += n as u64 * stored_bytes(seg.stored, d);
            src += n as u64 * 4;
        }
        Ok(())
    }

    fn read_saved(&self, g: &G, layer: usize, r: &Region) -> Result<u64, String> {
        let mut at = self.addr(r);
        let d = self.dtype(r);
        let out = g.alloc(self.plan.maths[layer].saved_elements())?;
        let mut dst = out;
        for seg in self.plan.maths[layer].saved_segments() {
            let n = seg.elements;
            match seg.stored {
                Stored::Model => g.run(
                    "load",
                    n,
                    &[A::P(at), A::I(dtype_code(d)), A::P(dst), A::L(n as i64)],
                )?,
                Stored::F32 => g.run("load_halves", n, &[A::P(at), A::P(dst), A::L(n as i64)])?,
            }
            at += n as u64 * stored_bytes(seg.stored, d);
            dst += n as u64 * 4;
        }
        Ok(out)
    }

    /// A tied head's embedding matrix (zeros for a recompute), as kernels.rs `tied`.
    fn tied(&self, g: &G, layer: usize, r: &Option<Region>) -> Result<Option<u64>, String> {
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
            Some(r) => self.read(g, r, n).map(Some),
            None => g.zeros(n).map(Some),
        }
    }

    fn tokens(&self, m: Option<u32>, targets: bool) -> Result<u64, String> {
        let m = m.ok_or("a layer op without a micro-step")? as u64;
        let t = self.consts.t as u64;
        Ok(self.consts.tokens + (2 * m + u64::from(targets)) * t * 4)
    }

    /// One compute action, the CPU backend's `kernels::run` on the device.
    pub fn compute(
        &self,
        g: &G,
        a: &Action,
        m: Option<u32>,
        input: &StepInput,
    ) -> Result<(), String> {
        let p = self.plan;
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
                let pp = match params {
                    Some(r) => self.read(g, r, math.params())?,
                    None => g.alloc(0)?,
                };
                let t = self.tied(g, *layer, tied)?;
                let x = match hidden {
                    Some(r) => In::Hidden(self.read(g, r, math.input_elements())?),
                    None => In::Tokens(self.tokens(m, false)?),
                };
                let out = g.alloc(math.output_elements())?;
                let keep = g.alloc(math.saved_elements())?;
                layers::forward(g, math, pp, t, x, out, keep)?;
                if let Some(o) = output {
                    self.write(g, o, out, math.output_elements())?;
                }
                if let Some(s) = saved {
                    self.write_saved(g, *layer, s, keep)?;
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
                let pp = match params {
                    Some(r) => self.read(g, r, math.params())?,
                    None => g.alloc(0)?,
                };
                let t = self.tied(g, *layer, tied)?;
                let keep = match saved {
                    Some(s) => self.read_saved(g, *layer, s)?,
                    None => g.alloc(0)?,
                };
                let x = match hidden {
                    Some(r) => In::Hidden(self.read(g, r, math.input_elements())?),
                    None => In::Tokens(self.tokens(m, false)?),
                };
                let dy = self.read(g, grad_output, math.output_elements())?;
                let dx = grad_input
                    .map(|_| g.alloc(math.input_elements()))
                    .transpose()?;
                let dp = g.alloc(math.params())?;
                let dt = t.map(|_| g.alloc(math.tied_elements())).transpose()?;
                layers::backward(g, math, pp, t, keep, x, dy, dx, dp, dt)?;
                if let (Some(r), Some(dx)) = (grad_input, dx) {
                    self.write(g, r, dx, math.input_elements())?;
                }
                self.write_grads(g, grads, dp, math.params())?;
                if let Some(dt) = dt {
                    self.write_grads(g, tied_grads, dt, math.tied_elements())?;
                }
            }
            Action::Loss { logits, grad } => {
                let vocab = match p.job.model.layers.last().map(|l| l.kind) {
                    Some(LayerKind::LmHead { vocab, .. }) => vocab as usize,
                    _ => return Err("the model does not end in an lm_head".into()),
                };
                let n = self.consts.t;
                let z = self.read(g, logits, n * vocab)?;
                let dz = g.alloc(n * vocab)?;
                g.run_rows(
                    "cross_entropy",
                    n,
                    &[
                        A::P(z),
                        A::P(self.tokens(m, true)?),
                        A::L(vocab as i64),
                        A::L(n as i64),
                        A::P(dz),
                        A::P(self.consts.loss),
                    ],
                )?;
                self.write(g, grad, dz, n * vocab)?;
            }
            Action::Update {
                layer,
                grad,
                state,
                param,
                sumsq,
            } => {
                let contributions = f64::from(p.program.ranks) * f64::from(p.program.micro_steps);
                let (sq, sq_dtype, clip) = match (sumsq, input.clip) {
                    (Some(s), Some(clip)) => (self.addr(s), dtype_code(self.dtype(s)), clip),
                    _ => (0, 0, 0.0),
                };
                let n = self.elements(grad);
                let gr = self.read(g, grad, n)?;
                let st = self.read(g, state, self.elements(state))?;
                let first = p.index(self.rank, ShardIndex::Optimizer) as usize * n;
                let cfg = OptimizerConfig::new(p.job.model.optimizer, input.lr);
                if cfg.kind == Optimizer::Sgd {
                    g.run(
                        "sgd",
                        n,
                        &[
                            A::P(st),
                            A::P(gr),
                            A::L(n as i64),
                            A::P(sq),
                            A::I(sq_dtype),
                            A::D(contributions),
                            A::D(clip),
                            A::F(cfg.lr),
                        ],
                    )?;
                } else {
                    let bc1 = 1.0 - f64::from(cfg.beta1).powf(input.step as f64);
                    let bc2 = 1.0 - f64::from(cfg.beta2).powf(input.step as f64);
                    let (decay, ranges) = self.consts.decay[*layer];
                    g.run(
                        "adam",
                        n,
                        &[
                            A::P(st),
                            A::P(gr),
                            A::L(n as i64),
                            A::L(first as i64),
                            A::P(decay),
                            A::I(ranges as i32),
                            A::I(i32::from(
                                cfg.kind == Optimizer::AdamW && cfg.weight_decay != 0.0,
                            )),
                            A::P(sq),
                            A::I(sq_dtype),
                            A::D(contributions),
                            A::D(clip),
                            A::F(cfg.beta1),
                            A::F(cfg.beta2),
                            A::F(cfg.eps),
                            A::F((f64::from(cfg.lr) / bc1) as f32),
                            A::F(bc2.sqrt() as f32),
                            A::F(1.0 - cfg.lr * cfg.weight_decay),
                        ],
                    )?;
                }
                self.write(g, state, st, self.elements(state))?;
                self.write(g, param, st, n)?;
            }
            Action::GradNorm { grads, sumsq } => {
                let acc = self.consts.sumsq;
                // Zeroed on this stream before the sums (a step may hold several grad_norm ops
                // only on one stream, in order).
                g.run("fill", 2, &[A::P(acc), A::F(0.0), A::L(2)])?;
                for r in grads {
                    let n = self.elements(r);
                    let v = self.read(g, r, n)?;
                    g.run("sum_squares", n, &[A::P(v), A::L(n as i64), A::P(acc)])?;
                    g.used.set(0);
                }
                g.x.launch(
                    "store_double",
                    elems(1),
                    &[
                        A::P(acc),
                        A::P(self.addr(sumsq)),
                        A::I(dtype_code(self.dtype(sumsq))),
                    ],
                )?;
            }
            Action::Accumulate { from, acc } => {
                let n = self.elements(from);
                let v = self.read(g, from, n)?;
                self.add(g, acc, v, n)?;
            }
            Action::Copy { from, to } => {
                // The concatenation of `from` into the concatenation of `to`, piece by piece.
                let (mut fi, mut fo, mut ti, mut tof) = (0usize, 0u64, 0usize, 0u64);
                while fi < from.len() && ti < to.len() {
                    let (f, t) = (&from[fi], &to[ti]);
                    let n = (f.bytes - fo).min(t.bytes - tof);
                    g.copy_bytes(self.addr(t) + tof, self.addr(f) + fo, n as usize)?;
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
            Action::Collectives(_) => unreachable!("collectives go through NCCL"),
        }
        Ok(())
    }
}

fn stored_bytes(s: Stored, model: Dtype) -> u64 {
    match s {
        Stored::Model => model.bytes(),
        Stored::F32 => 4,
    }
}

/// Floats of f32 workspace one op of `layer` can need (an over-estimate: every input and output
/// converted, plus the math's scratch).
pub fn layer_workspace(plan: &Plan, layer: usize) -> usize {
    let m = &plan.maths[layer];
    let model = &plan.job.model;
    let t = (model.micro_batch * model.seq_len) as usize;
    let s = model.seq_len as usize;
    let big = match &model.layers[layer].kind {
        LayerKind::Transformer(tr) => {
            let (h, f, n) = (tr.hidden as usize, tr.ffn as usize, tr.heads as usize);
            6 * t * h + 3 * t * f + 2 * t * (h + 2 * h) + n * s * s + 2 * s * s
        }
        LayerKind::Mlp(mm) => 2 * t * mm.hidden as usize + 3 * t * mm.ffn as usize,
        LayerKind::LmHead { hidden, .. } => 2 * t * *hidden as usize,
        _ => 0,
    };
    let padded = plan.program.layers[schedc::ir::LayerId::new(layer)].padded as usize;
    2 * m.params()
        + 2 * m.tied_elements()
        + 2 * m.input_elements()
        + 2 * m.output_elements()
        + 2 * m.saved_elements()
        + 4 * padded
        + big
        + 64 * 64
}

/// Workspace floats of one compute action.
pub fn action_workspace(p: &Plan, a: &Action) -> usize {
    let elems = |r: &Region| (r.bytes / p.program.buffers[r.buffer].dtype.bytes()) as usize;
    match a {
        Action::Forward { layer, .. } | Action::Backward { layer, .. } => {
            layer_workspace(p, *layer)
        }
        Action::Loss { logits, .. } => 2 * elems(logits) + 64,
        Action::Update { grad, state, .. } => elems(grad) + elems(state) + 128,
        Action::GradNorm { grads, .. } => grads.iter().map(elems).max().unwrap_or(0) + 64,
        Action::Accumulate { from, .. } => elems(from) + 64,
        Action::Copy { .. } | Action::Collectives(_) => 0,
    }
}
