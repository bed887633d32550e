//! The parity reference: a plain single-process trainer over whole tensors.
//!
//! It shares the layer math with the executor but none of the scheduling: no shards, no
//! collectives, no arena. For one model, seed and global batch every schedule must reproduce its
//! losses and weights (`runtime.md`, "Parity"). Averaging is the one the sharded runs use: each
//! micro-batch's loss gradient is the mean over its tokens, the micro-batches' gradients are summed,
//! and the optimizer scales the sum by clip_factor / (number of micro-batches in the global batch),
//! where clip_factor = min(1, clip / (‖averaged gradient‖₂ + 1e-6)) when `clip` is set.

use crate::data::Batch;
use crate::math::{
    cross_entropy, decay_ranges, grad_scale, init_layer, optimizer_step, tensor_range, Input,
    LayerMath, MathError, OptimizerConfig, Precision, SliceGrads,
};
use sched_ir::job::{Layer, LayerKind, Model, Train};
use std::ops::Range;

pub struct Reference {
    /// The training settings (the learning-rate schedule's, for each step's rate).
    train: sched_ir::job::Train,
    layers: Vec<Layer>,
    math: Vec<LayerMath>,
    seq_len: usize,
    micro_batch: usize,
    vocab: usize,
    /// The embedding's layer index and its `wte` range, when the lm_head is tied.
    tie: Option<(usize, Range<usize>)>,
    opt: OptimizerConfig,
    clip: Option<f64>,
    act: Precision,
    /// Working parameters (the master copy rounded to the model dtype).
    params: Vec<Vec<f32>>,
    /// Optimizer state: [master | m | v] or [master].
    state: Vec<Vec<f32>>,
    grads: Vec<Vec<f32>>,
    decay: Vec<Vec<Range<usize>>>,
    // Per-micro-batch buffers, reused between steps.
    outputs: Vec<Vec<f32>>,
    saved: Vec<Vec<f32>>,
    grad_params: Vec<f32>,
    grad_tied: Vec<f32>,
    grad_logits: Vec<f32>,
}

impl Reference {
    /// A trainer for `model` initialised from `train.seed`, with `train`'s learning rate and clip.
    /// The model must run end to end: an embedding first, an lm_head last, no `dense` layers.
    pub fn new(model: &Model, train: &Train) -> Result<Self, MathError> {
        let bad = |problem: &str| MathError::Shape {
            layer: model.name.clone(),
            problem: problem.to_string(),
        };
        let math = model
            .layers
            .iter()
            .map(|l| LayerMath::new(l, model))
            .collect::<Result<Vec<_>, _>>()?;
        let (first, last) = match (model.layers.first(), model.layers.last()) {
            (Some(f), Some(l)) if model.layers.len() >= 2 => (f, l),
            _ => return Err(bad("a trainable model needs an embedding and an lm_head")),
        };
        if !matches!(first.kind, LayerKind::Embedding { .. }) {
            return Err(bad("the first layer must be the embedding"));
        }
        let LayerKind::LmHead { vocab, tied, .. } = last.kind else {
            return Err(bad("the last layer must be the lm_head"));
        };
        if model.layers[1..model.layers.len() - 1].iter().any(|l| {
            matches!(
                l.kind,
                LayerKind::Embedding { .. } | LayerKind::LmHead { .. }
            )
        }) {
            return Err(bad(
                "only the first layer may be an embedding and only the last an lm_head",
            ));
        }
        let tie = tied.then(|| (0, tensor_range(first, "wte").expect("an embedding has wte")));
        if train.weight_decay.is_some() && model.optimizer != sched_ir::job::Optimizer::AdamW {
            return Err(bad("`train.weight_decay` is AdamW's decoupled decay"));
        }
        let opt = OptimizerConfig::of(model.optimizer, train.lr, train);
        let act = Precision::of(model.dtype);
        let mut params = vec![];
        let mut state = vec![];
        for l in &model.layers {
            let master = init_layer(l, model, train.seed);
            let mut p = master.clone();
            act.round(&mut p);
            let mut st = master;
            st.resize(l.params as usize * opt.state_per_param(), 0.0);
            params.push(p);
            state.push(st);
        }
        let max_params = math.iter().map(LayerMath::params).max().unwrap_or(0);
        let tied_len = math.last().map_or(0, LayerMath::tied_elements);
        Ok(Reference {
            train: train.clone(),
            layers: model.layers.clone(),
            seq_len: model.seq_len as usize,
            micro_batch: model.micro_batch as usize,
            vocab: vocab as usize,
            tie,
            opt,
            clip: train.clip,
            act,
            grads: math.iter().map(|m| vec![0.0; m.params()]).collect(),
            decay: model.layers.iter().map(decay_ranges).collect(),
            outputs: math
                .iter()
                .map(|m| vec![0.0; m.output_elements()])
                .collect(),
            saved: math.iter().map(|m| vec![0.0; m.saved_elements()]).collect(),
            grad_params: vec![0.0; max_params],
            grad_tied: vec![0.0; tied_len],
            grad_logits: vec![0.0; math.last().map_or(0, LayerMath::output_elements)],
            params,
            state,
            math,
        })
    }

    /// Runs the layers forward on one micro-batch, leaving logits in the last output.
    fn forward(&mut self, tokens: &[u32]) {
        for i in 0..self.math.len() {
            let (done, rest) = self.outputs.split_at_mut(i);
            let input = match done.last() {
                None => Input::Tokens(tokens),
                Some(prev) => Input::Hidden(prev),
            };
            let tied = self.tie.as_ref().filter(|_| self.math[i].is_tied());
            let tied = tied.map(|(l, r)| &self.params[*l][r.clone()]);
            self.math[i].forward(
                &self.params[i],
                tied,
                input,
                &mut rest[0],
                &mut self.saved[i],
            );
        }
    }

    /// Forward and backward of one micro-batch; adds its gradients to `grads` and returns the sum
    /// of its token losses.
    fn micro_batch(&mut self, inputs: &[u32], targets: &[u32]) -> f64 {
        self.forward(inputs);
        let n = self.math.len();
        let loss = cross_entropy(
            &self.outputs[n - 1],
            targets,
            self.vocab,
            self.math[n - 1].output_stride(),
            &mut self.grad_logits,
        );
        let mut grad_out = std::mem::take(&mut self.grad_logits);
        for i in (0..n).rev() {
            let m = &self.math[i];
            let mut grad_in = if i > 0 {
                vec![0.0; m.input_elements()]
            } else {
                vec![]
            };
            let input = if i == 0 {
                Input::Tokens(inputs)
            } else {
                Input::Hidden(&self.outputs[i - 1])
            };
            let tied = self.tie.as_ref().filter(|_| m.is_tied());
            let gp = &mut self.grad_params[..m.params()];
            m.backward(
                &self.params[i],
                tied.map(|(l, r)| &self.params[*l][r.clone()]),
                &self.saved[i],
                input,
                SliceGrads {
                    output: &grad_out,
                    input: (i > 0).then_some(&mut grad_in[..]),
                    params: gp,
                    tied: tied.map(|_| &mut self.grad_tied[..]),
                },
            );
            add(&mut self.grads[i], gp);
            if let Some((l, r)) = tied {
                add(&mut self.grads[*l][r.clone()], &self.grad_tied);
            }
            if i == n - 1 {
                self.grad_logits = grad_out;
            }
            grad_out = grad_in;
        }
        loss
    }

    /// Replaces the weights with `layers`' parameters (whole, one vector per layer, as
    /// [`crate::train::Trainer::state`] gathers them), rounded to the model dtype; the optimizer
    /// state is left as it is. A forward-only [`Reference::evaluate`] then computes the loss of
    /// those weights.
    pub fn set_params(&mut self, layers: &[Vec<f32>]) -> Result<(), MathError> {
        if layers.len() != self.params.len() {
            return Err(MathError::Shape {
                layer: "the model".to_string(),
                problem: format!(
                    "{} layers of weights for {} layers",
                    layers.len(),
                    self.params.len()
                ),
            });
        }
        for ((p, w), l) in self.params.iter_mut().zip(layers).zip(&self.layers) {
            if p.len() != w.len() {
                return Err(MathError::Shape {
                    layer: l.name.clone(),
                    problem: format!("{} weights for {} parameters", w.len(), p.len()),
                });
            }
            p.copy_from_slice(w);
            self.act.round(p);
        }
        Ok(())
    }

    /// The mean loss of `batch` under the current weights, without training.
    pub fn evaluate(&mut self, batch: &Batch) -> f64 {
        let chunk = self.micro_batch * self.seq_len;
        let mut total = 0.0;
        for (x, y) in batch.inputs.chunks(chunk).zip(batch.targets.chunks(chunk)) {
            self.forward(x);
            let n = self.math.len();
            let stride = self.math[n - 1].output_stride();
            let (z, dz) = (&self.outputs[n - 1], &mut self.grad_logits);
            total += cross_entropy(z, y, self.vocab, stride, dz);
        }
        total / batch.targets.len() as f64
    }

    /// One training step (`step_index` counts from 0) on `batch`, the step's whole global batch
    /// (a multiple of micro_batch sequences). Returns the mean loss over all its tokens, computed
    /// with the weights the step started from.
    pub fn step(&mut self, step_index: u64, batch: &Batch) -> f64 {
        let chunk = self.micro_batch * self.seq_len;
        assert_eq!(
            batch.inputs.len(),
            batch.targets.len(),
            "batch inputs and targets differ"
        );
        assert!(
            !batch.inputs.is_empty() && batch.inputs.len().is_multiple_of(chunk),
            "a global batch is a whole number of micro-batches"
        );
        let micro_batches = batch.inputs.len() / chunk;
        self.opt.lr = self.train.lr_at(self.train.lr, step_index) as f32;
        self.grads.iter_mut().for_each(|g| g.fill(0.0));
        let mut total = 0.0;
        for (x, y) in batch.inputs.chunks(chunk).zip(batch.targets.chunks(chunk)) {
            total += self.micro_batch(x, y);
        }
        let sum_sq: f64 = match self.clip {
            Some(_) => self
                .grads
                .iter()
                .flatten()
                .map(|&g| f64::from(g) * f64::from(g))
                .sum(),
            None => 0.0,
        };
        let scale = grad_scale(sum_sq, micro_batches as u64, self.clip);
        for i in 0..self.math.len() {
            optimizer_step(
                &self.opt,
                &mut self.state[i],
                &self.grads[i],
                scale,
                step_index + 1,
                0,
                &self.decay[i],
            );
            let n = self.params[i].len();
            self.params[i].copy_from_slice(&self.state[i][..n]);
            self.act.round(&mut self.params[i]);
        }
        total / batch.targets.len() as f64
    }

    /// The master weights, each tensor named `LAYER.TENSOR`, in layer and flattening order.
    pub fn weights(&self) -> Vec<(String, Vec<f32>)> {
        let mut out = vec![];
        for (l, st) in self.layers.iter().zip(&self.state) {
            let mut at = 0;
            for t in &l.tensors {
                let n = t.elements() as usize;
                out.push((format!("{}.{}", l.name, t.name), st[at..at + n].to_vec()));
                at += n;
            }
        }
        out
    }

    /// The layers' flat working parameter vectors.
    pub fn params(&self) -> &[Vec<f32>] {
        &self.params
    }

    /// The summed gradients of the last step, per layer (before the 1/micro-batches scaling).
    pub fn grads(&self) -> &[Vec<f32>] {
        &self.grads
    }
}

fn add(acc: &mut [f32], g: &[f32]) {
    acc.iter_mut().zip(g).for_each(|(a, &v)| *a += v);
}
