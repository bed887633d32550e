//! Optimizer steps on any slice of a layer's flat vector, so sharded and whole-tensor updates
//! compute the same numbers element for element.

use sched_ir::job::Optimizer;
use std::ops::Range;

/// Adam/AdamW/SGD settings (`runtime.md`): β1 0.9, β2 0.95, eps 1e-8, weight decay 0.1 for AdamW.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct OptimizerConfig {
    pub kind: Optimizer,
    pub lr: f32,
    pub beta1: f32,
    pub beta2: f32,
    pub eps: f32,
    pub weight_decay: f32,
}

impl OptimizerConfig {
    pub fn new(kind: Optimizer, lr: f64) -> Self {
        OptimizerConfig {
            kind,
            lr: lr as f32,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: if kind == Optimizer::AdamW { 0.1 } else { 0.0 },
        }
    }

    /// [`OptimizerConfig::new`] with the schedule's `weight_decay`, `betas` and `eps` where set.
    pub fn of(kind: Optimizer, lr: f64, train: &sched_ir::job::Train) -> Self {
        let mut c = OptimizerConfig::new(kind, lr);
        if let (Some(w), Optimizer::AdamW) = (train.weight_decay, kind) {
            c.weight_decay = w as f32;
        }
        if let Some([b1, b2]) = train.betas {
            (c.beta1, c.beta2) = (b1 as f32, b2 as f32);
        }
        if let Some(e) = train.eps {
            c.eps = e as f32;
        }
        c
    }

    /// Whether AdamW's decoupled weight decay applies (to the decayed ranges).
    pub fn decays(&self) -> bool {
        self.kind == Optimizer::AdamW && self.weight_decay != 0.0
    }

    /// fp32 state values per parameter: master, m, v for Adam; master for SGD.
    pub fn state_per_param(&self) -> usize {
        match self.kind {
            Optimizer::Adam | Optimizer::AdamW => 3,
            Optimizer::Sgd => 1,
        }
    }
}

/// The `grad_scale` of a step: clip_factor / contributions, where `contributions` is the number of
/// micro-batch gradients summed (dp·M) and, when `clip` is set, clip_factor =
/// min(1, clip / (‖averaged gradient‖₂ + 1e-6)) with `sum_sq` = Σ g² over every element of the
/// model's SUMMED gradient (so ‖averaged‖ = √sum_sq / contributions).
pub fn grad_scale(sum_sq: f64, contributions: u64, clip: Option<f64>) -> f32 {
    let mean = 1.0 / contributions as f64;
    let factor = match clip {
        Some(clip) => (clip / (sum_sq.sqrt() * mean + 1e-6)).min(1.0),
        None => 1.0,
    };
    (factor * mean) as f32
}

/// One optimizer step on the `n = grad.len()` elements of a layer's flat vector starting at element
/// `first`. `state` is `[master | m | v]` (3n) for Adam/AdamW and `[master]` (n) for SGD. `grad` is the
/// SUM of the micro-batch contributions and is multiplied by `grad_scale` before use; `step` is
/// 1-based. Elements inside `decay` (flat-vector ranges, [`super::decay_ranges`]) get AdamW's
/// decoupled weight decay. The update follows PyTorch's `torch.optim.AdamW` (single tensor).
pub fn optimizer_step(
    cfg: &OptimizerConfig,
    state: &mut [f32],
    grad: &[f32],
    grad_scale: f32,
    step: u64,
    first: usize,
    decay: &[Range<usize>],
) {
    super::ops::wide(
        #[inline(always)]
        || {
            let n = grad.len();
            assert!(step >= 1, "optimizer steps count from 1");
            assert_eq!(
                state.len(),
                cfg.state_per_param() * n,
                "optimizer state length"
            );
            if cfg.kind == Optimizer::Sgd {
                for (p, &g) in state.iter_mut().zip(grad) {
                    *p -= cfg.lr * (g * grad_scale);
                }
                return;
            }
            let (master, mv) = state.split_at_mut(n);
            let (m, v) = mv.split_at_mut(n);
            let [.., step_size, bc2_sqrt, shrink] = adam_scalars(cfg, step);
            let decays = cfg.decays();

            for (run, inside) in decay_runs(n, first, decay) {
                // Zipped slices, not indices, so the loop vectorises (sqrt and division included).
                let shrink = if decays && inside { shrink } else { 1.0 };
                let lanes = master[run.clone()]
                    .iter_mut()
                    .zip(&mut m[run.clone()])
                    .zip(&mut v[run.clone()])
                    .zip(&grad[run]);
                for (((p, m), v), &g) in lanes {
                    let g = g * grad_scale;
                    *m = cfg.beta1 * *m + (1.0 - cfg.beta1) * g;
                    *v = cfg.beta2 * *v + (1.0 - cfg.beta2) * g * g;
                    *p *= shrink;
                    let denom = v.sqrt() / bc2_sqrt + cfg.eps;
                    *p -= step_size * *m / denom;
                }
            }
        },
    )
}

/// Adam's scalars at 1-based `step`, in the order the generated Adam kernel takes them after its
/// tensors and gradient scale: β1, 1 − β1, β2, 1 − β2, ε, the step size lr/(1 − β1ᵗ), √(1 − β2ᵗ)
/// and AdamW's shrink 1 − lr·wd. [`optimizer_step`] uses the same values.
pub(crate) fn adam_scalars(cfg: &OptimizerConfig, step: u64) -> [f32; 8] {
    let bc1 = 1.0 - f64::from(cfg.beta1).powf(step as f64);
    let bc2 = 1.0 - f64::from(cfg.beta2).powf(step as f64);
    [
        cfg.beta1,
        1.0 - cfg.beta1,
        cfg.beta2,
        1.0 - cfg.beta2,
        cfg.eps,
        (f64::from(cfg.lr) / bc1) as f32,
        bc2.sqrt() as f32,
        1.0 - cfg.lr * cfg.weight_decay,
    ]
}

/// The shard's elements `0..n` (flat-vector elements `first..first + n`) in runs that lie all
/// inside `decay`'s ranges or all outside, in order, with whether the run is inside.
pub(crate) fn decay_runs(
    n: usize,
    first: usize,
    decay: &[Range<usize>],
) -> impl Iterator<Item = (Range<usize>, bool)> + '_ {
    let mut i = 0;
    std::iter::from_fn(move || {
        if i >= n {
            return None;
        }
        let at = first + i;
        let inside = decay.iter().find(|r| r.contains(&at));
        let end = match inside {
            Some(r) => r.end - first,
            None => decay
                .iter()
                .filter(|r| r.start > at)
                .map(|r| r.start - first)
                .min()
                .unwrap_or(n),
        }
        .min(n);
        let run = i..end;
        i = end;
        Some((run, inside.is_some()))
    })
}
