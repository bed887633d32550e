//! Validation loss (`schedrun --val FILE --eval-every N --eval-batches K`).
//!
//! The validation loss after a step is the mean token loss of K batches of the validation corpus
//! under the weights that step produced, computed forward only. Batch i (i = 0..K) is the
//! validation corpus's global batch of "step" i by the batch rule of `runtime.md` (B sequences,
//! B the plan's sequences per step), so every evaluation of a run, and of every schedule with the
//! same B, sees the same K·B sequences.
//!
//! The forward runs on the single-process [`Reference`] model with the weights gathered from the
//! ranks ([`crate::train::Trainer::state`]), not on the schedule's ranks: every schedule computes
//! the same model math (`runtime.md`, "Parity"), and a forward-only pass of a sharded plan would
//! need a plan of its own. It costs one gather of the weights and K·B sequences forward on one
//! thread per evaluation.

use crate::data::{Corpus, DataError};
use crate::math::MathError;
use crate::plan::Plan;
use crate::reference::Reference;

#[derive(Debug, thiserror::Error)]
pub enum EvalError {
    /// The model cannot run on the reference trainer (no embedding or lm_head, a `dense` layer).
    #[error("the validation loss is computed with the reference model, which cannot run this model: {0}")]
    Model(MathError),
    #[error("the gathered weights do not fit the model: {0}")]
    Weights(MathError),
    #[error(transparent)]
    Data(#[from] DataError),
}

/// When the validation loss is computed, and on what.
pub struct Validation {
    corpus: Corpus,
    /// After every step that is a multiple of this (counted from step 0, so a resumed run keeps
    /// the cadence); `None`: only after the last step.
    every: Option<u64>,
    batches: usize,
    sequences: usize,
    seq_len: usize,
    reference: Reference,
}

impl Validation {
    /// Checks `corpus` against the plan's model (length, vocabulary) and builds the reference
    /// model the forward runs on.
    pub fn new(
        plan: &Plan,
        corpus: Corpus,
        every: Option<u64>,
        batches: usize,
    ) -> Result<Self, EvalError> {
        let model = &plan.job.model;
        let seq_len = model.seq_len as usize;
        corpus.check(seq_len)?;
        let reference =
            Reference::new(model, &plan.job.schedule.train).map_err(EvalError::Model)?;
        Ok(Validation {
            corpus,
            every,
            batches,
            sequences: (plan.tokens_per_step() / model.seq_len) as usize,
            seq_len,
            reference,
        })
    }

    pub fn corpus(&self) -> &Corpus {
        &self.corpus
    }

    /// Whether the validation loss is computed after step `step` (1-based), `last` the run's last.
    pub fn due(&self, step: u64, last: bool) -> bool {
        last || self.every.is_some_and(|n| step.is_multiple_of(n))
    }

    /// The mean token loss of the K validation batches under `weights` (each layer's whole
    /// parameters, in layer order).
    pub fn loss(&mut self, weights: &[Vec<f32>]) -> Result<f64, EvalError> {
        self.reference
            .set_params(weights)
            .map_err(EvalError::Weights)?;
        let mut sum = 0.0;
        for i in 0..self.batches {
            let batch = self
                .corpus
                .global_batch(i as u64, self.sequences, self.seq_len)?;
            sum += self.reference.evaluate(&batch);
        }
        Ok(sum / self.batches.max(1) as f64)
    }
}
