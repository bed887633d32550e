//! The host side of a run: initial state, batches, steps, and whole-tensor state in and out.
//!
//! The trainer owns no tensors of its own between steps: parameters and optimizer state live in the
//! backend's arenas at the plan's offsets. It scatters whole layers into shards at the start (from
//! the seed, a weights file or a checkpoint), builds each step's batches by the rule of
//! `runtime.md` (so every schedule with the same global batch sees the same data), runs the step,
//! and gathers shards back into whole tensors when asked.

use crate::backend::{Backend, Batch, RunError, StepInput, StepOutcome};
use crate::data::{BatchShape, Corpus};
use crate::math::{init_layer, Precision};
use crate::plan::Plan;
use sched_ir::ir::{BufferKind, ShardIndex};
use sched_ir::job::{Dtype, Optimizer};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// One layer's whole state: its parameters (P_l values) and, for checkpoints, the optimizer's
/// fp32 master copy and moments (empty when not kept: SGD has no moments).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct LayerState {
    pub params: Vec<f32>,
    pub master: Vec<f32>,
    pub m: Vec<f32>,
    pub v: Vec<f32>,
}

/// Whole training state: every layer's, and the optimizer steps taken so far.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct State {
    pub layers: Vec<LayerState>,
    pub step: u64,
}

impl State {
    /// Every layer's parameters, in layer order, as one vector (what parity checks compare).
    pub fn into_params(self) -> Vec<f32> {
        self.layers.into_iter().flat_map(|l| l.params).collect()
    }

    /// The layers (by index) whose parameters, master copy or moments hold a value that is not
    /// finite: state no checkpoint may keep.
    pub fn non_finite_layers(&self) -> Vec<usize> {
        self.layers
            .iter()
            .enumerate()
            .filter(|(_, l)| {
                [&l.params, &l.master, &l.m, &l.v]
                    .iter()
                    .any(|v| v.iter().any(|x| !x.is_finite()))
            })
            .map(|(i, _)| i)
            .collect()
    }
}

/// One layer's slice of the optimizer state as one rank holds it.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct LayerShard {
    /// The layer's index in the model.
    pub layer: usize,
    /// The slice's first element in the layer's padded flat state.
    pub first: usize,
    /// The layer's padded length (its parameters rounded up to the shard count).
    pub padded: usize,
    /// The fp32 master copy, then Adam's moments (empty for SGD), each of the slice's length.
    pub master: Vec<f32>,
    pub m: Vec<f32>,
    pub v: Vec<f32>,
}

/// What one rank writes into a sharded checkpoint entry (`checkpoint::shards`): its slices of
/// the layers' optimizer state.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RankShard {
    pub rank: u32,
    pub layers: Vec<LayerShard>,
}

impl RankShard {
    /// The layers (by index) whose slice holds a value that is not finite.
    pub fn non_finite_layers(&self) -> Vec<usize> {
        self.layers
            .iter()
            .filter(|s| {
                [&s.master, &s.m, &s.v]
                    .iter()
                    .any(|v| v.iter().any(|x| !x.is_finite()))
            })
            .map(|s| s.layer)
            .collect()
    }
}

/// What one step measured.
#[derive(Clone, Debug)]
pub struct StepReport {
    /// 1-based.
    pub step: u64,
    pub loss: f64,
    pub time: Duration,
    pub tokens_per_s: f64,
    pub outcome: StepOutcome,
}

pub struct Trainer<B: Backend> {
    pub plan: Arc<Plan>,
    pub backend: B,
    corpus: Corpus,
    /// Optimizer steps taken (the next step is `step + 1`).
    step: u64,
}

impl<B: Backend> Trainer<B> {
    pub fn new(plan: Arc<Plan>, backend: B, corpus: Corpus) -> Self {
        Trainer {
            plan,
            backend,
            corpus,
            step: 0,
        }
    }

    /// The corpus the batches are cut from.
    pub fn corpus(&self) -> &Corpus {
        &self.corpus
    }

    pub fn steps_done(&self) -> u64 {
        self.step
    }

    /// The seed's initial state (`runtime.md`: initialisation).
    pub fn initial_state(&self, seed: u64) -> State {
        let model = &self.plan.job.model;
        State {
            layers: model
                .layers
                .iter()
                .map(|l| LayerState {
                    params: init_layer(l, model, seed),
                    ..LayerState::default()
                })
                .collect(),
            step: 0,
        }
    }

    /// Scatters `state` into every rank's shards. Missing optimizer state starts fresh: master
    /// copy = parameters, moments zero. A tensor-parallel layer's ranks take their slices of it
    /// ([`sched_ir::tensor::SliceLayout`]).
    pub fn load(&mut self, state: &State) -> Result<(), RunError> {
        let p = self.plan.clone();
        let model = &p.job.model;
        let sh = p.job.schedule.shard;
        let dtype = model.dtype;
        let layout = p.program.layout;
        for (l, (layer, st)) in model.layers.iter().zip(&state.layers).enumerate() {
            let padded =
                p.program.layers[sched_ir::ir::LayerId::from_u32(l as u32)].padded as usize;
            let ps = padded / sh.params.size() as usize;
            let os = padded / sh.optimizer.size() as usize;
            let moments = model.optimizer != Optimizer::Sgd;
            let slices = Slices::of(layer, layout.tensor)?;
            for k in 0..slices.count() {
                let pad = |v: &[f32]| {
                    let mut x = slices.cut(k, v);
                    x.resize(padded, 0.0);
                    x
                };
                let params = pad(&st.params);
                let master = if st.master.is_empty() {
                    params.clone()
                } else {
                    pad(&st.master)
                };
                let zeros = vec![0.0; padded];
                let m = if st.m.is_empty() {
                    zeros.clone()
                } else {
                    pad(&st.m)
                };
                let v = if st.v.is_empty() { zeros } else { pad(&st.v) };
                // Only the ranks of the layer's pipeline stage hold it (and those of a tied
                // head's stage, which keep a replica of the embedding), each its tensor slice.
                let copies = p
                    .state_buffers(l, BufferKind::ParamShard)
                    .into_iter()
                    .zip(p.state_buffers(l, BufferKind::OptimizerShard));
                for (pbuf, obuf) in copies {
                    let holders = p.holders(pbuf);
                    let ranks = self.backend.ranks().into_iter().filter(|&r| {
                        holders.contains(&r) && slices.holds(k, layout.tp_index(r) as usize)
                    });
                    for rank in ranks {
                        let i = p.index(rank, ShardIndex::Param) as usize;
                        let at = p.program.buffers[pbuf].offset;
                        self.backend
                            .upload(rank, at, dtype, &params[i * ps..(i + 1) * ps])?;
                        let j = p.index(rank, ShardIndex::Optimizer) as usize;
                        let mut at = p.program.buffers[obuf].offset;
                        let parts: &[&Vec<f32>] = if moments {
                            &[&master, &m, &v]
                        } else {
                            &[&master]
                        };
                        for part in parts {
                            self.backend.upload(
                                rank,
                                at,
                                Dtype::Fp32,
                                &part[j * os..(j + 1) * os],
                            )?;
                            at += 4 * os as u64;
                        }
                    }
                }
            }
        }
        self.step = state.step;
        Ok(())
    }

    /// Gathers every layer's whole state from the optimizer shards (the parameters are the master
    /// copy rounded to the model dtype), a tensor-parallel layer's from its slices.
    pub fn state(&self) -> Result<State, RunError> {
        let p = &self.plan;
        let model = &p.job.model;
        let sh = p.job.schedule.shard;
        let layout = p.program.layout;
        let mut layers = vec![];
        for (l, layer) in model.layers.iter().enumerate() {
            // A replica's copy equals the layer's own: read from the layer's stage.
            let Some(&obuf) = p.state_buffers(l, BufferKind::OptimizerShard).first() else {
                layers.push(LayerState::default());
                continue;
            };
            let padded =
                p.program.layers[sched_ir::ir::LayerId::from_u32(l as u32)].padded as usize;
            let os = padded / sh.optimizer.size() as usize;
            let parts = if model.optimizer == Optimizer::Sgd {
                1
            } else {
                3
            };
            let slices = Slices::of(layer, layout.tensor)?;
            // Per part (master, m, v), each tensor slice's padded vector.
            let mut opt = vec![vec![vec![0.0; padded]; slices.count()]; parts];
            let holders = p.holders(obuf);
            for rank in self
                .backend
                .ranks()
                .into_iter()
                .filter(|r| holders.contains(r))
            {
                let k = layout.tp_index(rank) as usize;
                if k >= slices.count() {
                    continue; // a replicated layer: every tensor index holds the same
                }
                let j = p.index(rank, ShardIndex::Optimizer) as usize;
                let at = p.program.buffers[obuf].offset;
                let v = self.backend.download(rank, at, parts * os, Dtype::Fp32)?;
                for (i, part) in opt.iter_mut().enumerate() {
                    part[k][j * os..(j + 1) * os].copy_from_slice(&v[i * os..(i + 1) * os]);
                }
            }
            let mut opt = opt
                .into_iter()
                .map(|part| slices.join(part))
                .collect::<Result<Vec<_>, _>>()?
                .into_iter();
            // The optimizer's master copy is the truth after a step: with `refresh = next_forward`
            // the param shards other ranks updated are refreshed only when the next step starts.
            let master = opt.next().unwrap_or_default();
            let mut params = master.clone();
            Precision::of(model.dtype).round(&mut params);
            layers.push(LayerState {
                params,
                master,
                m: opt.next().unwrap_or_default(),
                v: opt.next().unwrap_or_default(),
            });
        }
        Ok(State {
            layers,
            step: self.step,
        })
    }

    /// The optimizer-state slices the ranks this backend drives write into a sharded checkpoint
    /// entry (`checkpoint::shards`), one [`RankShard`] per rank: for each layer, the slice of
    /// the rank's optimizer shard, when the rank holds the layer (its own stage's copy) and no
    /// lower rank holds the same slice (replicas write it once).
    pub fn rank_shards(&self) -> Result<Vec<RankShard>, RunError> {
        let p = &self.plan;
        if p.program.layout.tensor > 1 {
            return Err(RunError::of_run(
                "sharded entries of a tensor-parallel plan are not written yet",
            ));
        }
        let model = &p.job.model;
        let sh = p.job.schedule.shard;
        let parts = if model.optimizer == Optimizer::Sgd {
            1
        } else {
            3
        };
        let mut out = vec![];
        for rank in self.backend.ranks() {
            let mut layers = vec![];
            for l in 0..model.layers.len() {
                let Some(&obuf) = p.state_buffers(l, BufferKind::OptimizerShard).first() else {
                    continue;
                };
                let holders = p.holders(obuf);
                let j = p.index(rank, ShardIndex::Optimizer);
                let writer = holders
                    .clone()
                    .find(|&r| p.index(r, ShardIndex::Optimizer) == j);
                if !holders.contains(&rank) || writer != Some(rank) {
                    continue;
                }
                let padded =
                    p.program.layers[sched_ir::ir::LayerId::from_u32(l as u32)].padded as usize;
                let os = padded / sh.optimizer.size() as usize;
                let at = p.program.buffers[obuf].offset;
                let v = self.backend.download(rank, at, parts * os, Dtype::Fp32)?;
                let part = |k: usize| {
                    if k < parts {
                        v[k * os..(k + 1) * os].to_vec()
                    } else {
                        vec![]
                    }
                };
                layers.push(LayerShard {
                    layer: l,
                    first: j as usize * os,
                    padded,
                    master: part(0),
                    m: part(1),
                    v: part(2),
                });
            }
            out.push(RankShard { rank, layers });
        }
        Ok(out)
    }

    /// The layers whose gradient accumulators hold a value that is not finite after the last
    /// step, in backward order (the last layer first: where a backward's non-finite values show
    /// up first), for the message of a diverged run. Reads every gradient shard of every rank.
    pub fn non_finite_gradients(&self) -> Result<Vec<String>, RunError> {
        let p = &self.plan;
        let mut out = vec![];
        for (l, layer) in p.job.model.layers.iter().enumerate().rev() {
            let mut bad = false;
            for g in p.state_buffers(l, BufferKind::GradShard) {
                let buf = &p.program.buffers[g];
                let n = (buf.bytes / buf.dtype.bytes()) as usize;
                let holders = p.holders(g);
                for rank in self
                    .backend
                    .ranks()
                    .into_iter()
                    .filter(|r| holders.contains(r))
                {
                    let v = self.backend.download(rank, buf.offset, n, buf.dtype)?;
                    bad |= v.iter().any(|x| !x.is_finite());
                }
            }
            if bad {
                out.push(layer.name.clone());
            }
        }
        Ok(out)
    }

    /// The layer the test hooks poison: the first after the embedding that holds parameters
    /// (the embedding when it is the only one).
    pub fn poison_target(&self) -> Result<usize, RunError> {
        let layers = &self.plan.job.model.layers;
        (1..layers.len())
            .chain(0..1)
            .find(|&l| layers[l].params > 0)
            .ok_or_else(|| RunError::of_run("no layer holds parameters"))
    }

    /// Test hook (`schedrun --inject-nan STEP`): makes the first weight of
    /// [`Trainer::poison_target`] NaN, in the parameters and the master copy, so that the next
    /// step's loss is NaN as a real divergence's would be. Returns the layer's index.
    pub fn poison(&mut self) -> Result<usize, RunError> {
        let mut s = self.state()?;
        let l = self.poison_target()?;
        let layer = &mut s.layers[l];
        layer.params[0] = f32::NAN;
        if let Some(x) = layer.master.first_mut() {
            *x = f32::NAN;
        }
        self.load(&s)?;
        Ok(l)
    }

    /// The batches of step `t` (0-based) for the backend's ranks: `[rank][micro_step]`.
    pub fn batches(&self, t: u64) -> Result<Vec<Vec<Batch>>, RunError> {
        let p = &self.plan;
        let model = &p.job.model;
        let micro_steps = p.program.micro_steps as usize;
        // A pipeline's stages share the batches of their data-parallel index.
        let shape = BatchShape {
            ranks: p.dp_size() as usize,
            micro_steps,
            micro_batch: model.micro_batch as usize,
            seq_len: model.seq_len as usize,
        };
        let mut out = vec![];
        for rank in self.backend.ranks() {
            let mut per_rank = vec![];
            for m in 0..micro_steps {
                let dp = p.program.layout.dp_index(rank) as usize;
                let (inputs, targets) = self
                    .corpus
                    .batch(&shape, (t, m, dp))
                    .map_err(RunError::of_run)?;
                per_rank.push(Batch { inputs, targets });
            }
            out.push(per_rank);
        }
        Ok(out)
    }

    /// Runs the next optimizer step.
    pub fn step(&mut self, lr: f64, clip: Option<f64>) -> Result<StepReport, RunError> {
        self.step_poisoned(lr, clip, None)
    }

    /// Runs the next optimizer step with a test hook: `poison_grad` makes that layer's gradient
    /// non-finite after the backward ([`StepInput::poison_grad`]).
    pub fn step_poisoned(
        &mut self,
        lr: f64,
        clip: Option<f64>,
        poison_grad: Option<usize>,
    ) -> Result<StepReport, RunError> {
        if clip.is_some() && !self.plan.clips() {
            return Err(RunError::of_run(
                "gradient clipping was asked for, but the plan was compiled without it (set \
                 `clip` in the schedule's `train` block and compile again)",
            ));
        }
        let input = StepInput {
            step: self.step + 1,
            lr,
            clip,
            batches: self.batches(self.step)?,
            poison_grad,
        };
        let start = Instant::now();
        let outcome = self.backend.run_step(&input)?;
        let time = start.elapsed();
        self.step += 1;
        let tokens = self.plan.tokens_per_step() as f64;
        Ok(StepReport {
            step: self.step,
            loss: outcome.loss_sum / tokens,
            time,
            tokens_per_s: tokens / time.as_secs_f64().max(1e-9),
            outcome,
        })
    }
}

/// How a layer's whole vectors map to what ranks hold: its tensor slices when the lowering
/// splits it, else the whole vector on every tensor index.
struct Slices<'a> {
    layer: &'a sched_ir::job::Layer,
    cuts: Vec<sched_ir::tensor::SliceLayout>,
}

impl<'a> Slices<'a> {
    fn of(layer: &'a sched_ir::job::Layer, t: u32) -> Result<Self, RunError> {
        let cuts = match sched_ir::tensor::split_layers(&layer.kind, t) {
            false => vec![],
            true => (0..t as usize)
                .map(|index| {
                    let rank = sched_ir::tensor::TensorRank {
                        size: t as usize,
                        index,
                    };
                    sched_ir::tensor::SliceLayout::new(layer, rank)
                })
                .collect::<Result<_, _>>()
                .map_err(RunError::of_run)?,
        };
        Ok(Slices { layer, cuts })
    }

    /// The distinct vectors ranks hold: one per tensor index, or one.
    fn count(&self) -> usize {
        self.cuts.len().max(1)
    }

    /// Whether a rank of tensor index `tp` holds vector `k`.
    fn holds(&self, k: usize, tp: usize) -> bool {
        self.cuts.is_empty() || k == tp
    }

    /// Vector `k` of the whole vector `v`.
    fn cut(&self, k: usize, v: &[f32]) -> Vec<f32> {
        match self.cuts.get(k) {
            Some(c) => c.slice(v),
            None => v.to_vec(),
        }
    }

    /// The whole vector from the padded vectors ranks hold.
    fn join(&self, mut held: Vec<Vec<f32>>) -> Result<Vec<f32>, RunError> {
        let n = self.layer.params as usize;
        if self.cuts.is_empty() {
            let mut v = held.swap_remove(0);
            v.truncate(n);
            return Ok(v);
        }
        for (v, c) in held.iter_mut().zip(&self.cuts) {
            v.truncate(c.elements());
        }
        let refs: Vec<&[f32]> = held.iter().map(|v| v.as_slice()).collect();
        sched_ir::tensor::gather(self.layer, self.cuts.len(), &refs).map_err(RunError::of_run)
    }
}
