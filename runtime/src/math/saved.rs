//! The layout of what each layer keeps for backward in its `saved` buffer, defined once for every
//! backend: forward writes the pieces and backward reads them in this order. A [`Piece`] is the
//! start of a run of f32s on a device (`crate::device`): a host address on the CPU, a device
//! address on the CUDA backend.

use super::attention::Keep;
use super::{BlockP, MlpP};
use sched_ir::job::{Activation, Attention};

/// The start of a run of f32s that pieces can be cut off the front of.
pub(crate) trait Piece: Sized + Default {
    fn split(self, n: usize) -> (Self, Self);
}

/// Cuts consecutive pieces off a buffer.
pub(crate) struct Carve<S>(pub(crate) S);

impl<S: Piece> Carve<S> {
    pub(crate) fn take(&mut self, n: usize) -> S {
        let (head, tail) = std::mem::take(&mut self.0).split(n);
        self.0 = tail;
        head
    }
}

/// The front of what an mlp or lm_head layer keeps: the norm's output and its statistics, then
/// (mlp) the MLP's tensors.
pub(crate) struct NormedSaved<S> {
    pub(crate) a: S,
    pub(crate) st: S,
    pub(crate) rest: Carve<S>,
}

impl<S: Piece> NormedSaved<S> {
    pub(crate) fn carve(t: usize, h: usize, saved: S) -> Self {
        let mut c = Carve(saved);
        let (a, st) = (c.take(t * h), c.take(2 * t));
        NormedSaved { a, st, rest: c }
    }
}

/// The MLP's kept tensors, by activation.
pub(crate) enum MlpSaved<S> {
    Gelu { pre: S, post: S },
    SwiGlu { gate: S, up: S, prod: S },
}

impl<S: Piece> MlpSaved<S> {
    pub(crate) fn carve(t: usize, mp: &MlpP, c: &mut Carve<S>) -> Self {
        let f = mp.ffn;
        match mp.act {
            Activation::Gelu => MlpSaved::Gelu {
                pre: c.take(t * f),
                post: c.take(t * f),
            },
            Activation::SwiGlu => MlpSaved::SwiGlu {
                gate: c.take(t * f),
                up: c.take(t * f),
                prod: c.take(t * f),
            },
        }
    }
}

/// What a transformer block keeps for backward, in the order of its saved buffer.
pub(crate) struct BlockSaved<S> {
    pub(crate) a1: S,
    pub(crate) st1: S,
    pub(crate) qkv: S,
    pub(crate) att: S,
    pub(crate) keep: Keep<S>,
    pub(crate) resid: S,
    pub(crate) a2: S,
    pub(crate) st2: S,
    pub(crate) mlp: Carve<S>,
}

impl<S: Piece> BlockSaved<S> {
    pub(crate) fn carve(bp: &BlockP, t: usize, s: usize, saved: S) -> Self {
        let h = bp.hidden;
        let sh = &bp.shape;
        let mut c = Carve(saved);
        BlockSaved {
            a1: c.take(t * h),
            st1: c.take(2 * t),
            qkv: c.take(t * sh.width()),
            att: c.take(t * h),
            keep: match bp.attention {
                Attention::Flash => Keep::Lse(c.take(sh.heads * t)),
                Attention::Naive => Keep::Probs(c.take(sh.heads * t * s)),
            },
            resid: c.take(t * h),
            a2: c.take(t * h),
            st2: c.take(2 * t),
            mlp: c,
        }
    }
}
