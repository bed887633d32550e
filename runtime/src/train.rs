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
    /// copy = parameters, moments zero.
    pub fn load(&mut self, state: &State) -> Result<(), RunError> {
        let p = self.plan.clone();
        let model = &p.job.model;
        let sh = p.job.schedule.shard;
        let dtype = model.dtype;
        for (l, (layer, st)) in model.layers.iter().zip(&state.layers).enumerate() {
            let padded =
                p.program.layers[sched_ir::ir::LayerId::from_u32(l as u32)].padded as usize;
            let pad = |v: &[f32]| {
                let mut x = v.to_vec();
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
            let ps = padded / sh.params.size() as usize;
            let os = padded / sh.optimizer.size() as usize;
            let moments = model.optimizer != Optimizer::Sgd;
            // Only the ranks of the layer's pipeline stage hold it (and those of a tied head's
            // stage, which keep a replica of the embedding).
            let copies = p
                .state_buffers(l, BufferKind::ParamShard)
                .into_iter()
                .zip(p.state_buffers(l, BufferKind::OptimizerShard));
            for (pbuf, obuf) in copies {
                let holders = p.holders(pbuf);
                for rank in self
                    .backend
                    .ranks()
                    .into_iter()
                    .filter(|r| holders.contains(r))
                {
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
                        self.backend
                            .upload(rank, at, Dtype::Fp32, &part[j * os..(j + 1) * os])?;
                        at += 4 * os as u64;
                    }
                }
            }
            let _ = layer;
        }
        self.step = state.step;
        Ok(())
    }

    /// Gathers every layer's whole state from the optimizer shards (the parameters are the master
    /// copy rounded to the model dtype).
    pub fn state(&self) -> Result<State, RunError> {
        let p = &self.plan;
        let model = &p.job.model;
        let sh = p.job.schedule.shard;
        let mut layers = vec![];
        for (l, layer) in model.layers.iter().enumerate() {
            let n = layer.params as usize;
            // A replica's copy equals the layer's own: read from the layer's stage.
            let Some(&obuf) = p.state_buffers(l, BufferKind::OptimizerShard).first() else {
                layers.push(LayerState::default());
                continue;
            };
            let padded =
                p.program.layers[sched_ir::ir::LayerId::from_u32(l as u32)].padded as usize;
            let os = padded / sh.optimizer.size() as usize;
            let mut params = vec![0.0; padded];
            let parts = if model.optimizer == Optimizer::Sgd {
                1
            } else {
                3
            };
            let mut opt = vec![vec![0.0; padded]; parts];
            let holders = p.holders(obuf);
            for rank in self
                .backend
                .ranks()
                .into_iter()
                .filter(|r| holders.contains(r))
            {
                let j = p.index(rank, ShardIndex::Optimizer) as usize;
                let at = p.program.buffers[obuf].offset;
                let v = self.backend.download(rank, at, parts * os, Dtype::Fp32)?;
                for (k, part) in opt.iter_mut().enumerate() {
                    part[j * os..(j + 1) * os].copy_from_slice(&v[k * os..(k + 1) * os]);
                }
            }
            // The optimizer's master copy is the truth after a step: with `refresh = next_forward`
            // the param shards other ranks updated are refreshed only when the next step starts.
            params.copy_from_slice(&opt[0]);
            Precision::of(model.dtype).round(&mut params);
            params.truncate(n);
            opt.iter_mut().for_each(|x| x.truncate(n));
            let mut opt = opt.into_iter();
            layers.push(LayerState {
                params,
                master: opt.next().unwrap_or_default(),
                m: opt.next().unwrap_or_default(),
                v: opt.next().unwrap_or_default(),
            });
        }
        Ok(State {
            layers,
            step: self.step,
        })
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

    /// Test hook (`schedrun --inject-nan STEP`): makes the first weight of the first layer after
    /// the embedding (the embedding when it is the only one) NaN, in the parameters and the master
    /// copy, so that the next step's loss is NaN as a real divergence's would be. Returns the
    /// layer's index.
    pub fn poison(&mut self) -> Result<usize, RunError> {
        let mut s = self.state()?;
        let n = s.layers.len();
        let l = (1..n)
            .chain(0..1)
            .find(|&l| !s.layers[l].params.is_empty())
            .ok_or_else(|| RunError::of_run("no layer holds parameters"))?;
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
