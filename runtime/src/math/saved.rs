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
            att: c.take(t * sh.hidden()),
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

/// The MLP's part of a split backward's stash (fp32): the gradient of its first product's
/// output (GELU's input; SwiGLU's gate and up products), which `W` turns into their weight and
/// bias gradients.
pub(crate) enum MlpStash<S> {
    Gelu { dpre: S },
    SwiGlu { dgate: S, dup: S },
}

impl<S: Piece> MlpStash<S> {
    pub(crate) fn carve(t: usize, mp: &MlpP, c: &mut Carve<S>) -> Self {
        let f = mp.ffn;
        match mp.act {
            Activation::Gelu => MlpStash::Gelu {
                dpre: c.take(t * f),
            },
            Activation::SwiGlu => MlpStash::SwiGlu {
                dgate: c.take(t * f),
                dup: c.take(t * f),
            },
        }
    }
}

/// [`MlpStash`]'s floats per token.
pub(crate) fn mlp_stash_per_token(mp: &MlpP) -> usize {
    match mp.act {
        Activation::Gelu => mp.ffn,
        Activation::SwiGlu => 2 * mp.ffn,
    }
}

/// What a transformer block's input-gradient backward (`I`) stashes for its weight-gradient
/// backward (`W`), fp32, in this order (`sched_ir::abi::stash_elements`): the gradients of
/// ln1's output `d1` [t, hidden], of the qkv product's output `dqkv` [t, width] (after the
/// rotary backward), of the projection's output `dr` [t, hidden] (the residual stream's), of
/// ln2's output `d2` [t, hidden], then the MLP's ([`MlpStash`]). A norm's parameter gradient
/// is its output gradient against its saved input and statistics; a product's, its output
/// gradient against its saved input.
pub(crate) struct BlockStash<S> {
    pub(crate) d1: S,
    pub(crate) dqkv: S,
    pub(crate) dr: S,
    pub(crate) d2: S,
    pub(crate) mlp: MlpStash<S>,
}

impl<S: Piece> BlockStash<S> {
    pub(crate) fn carve(bp: &BlockP, t: usize, stash: S) -> Self {
        let h = bp.hidden;
        let mut c = Carve(stash);
        BlockStash {
            d1: c.take(t * h),
            dqkv: c.take(t * bp.shape.width()),
            dr: c.take(t * h),
            d2: c.take(t * h),
            mlp: MlpStash::carve(t, &bp.mlp, &mut c),
        }
    }
}

/// [`BlockStash`]'s floats per token.
pub(crate) fn block_stash_per_token(bp: &BlockP) -> usize {
    3 * bp.hidden + bp.shape.width() + mlp_stash_per_token(&bp.mlp)
}

/// The stash of an mlp or lm_head layer: the gradient of its norm's output `dn` [t, hidden],
/// then (mlp) the MLP's ([`MlpStash`]); the lm_head's product reads the logits' gradient where
/// the loss wrote it.
pub(crate) struct NormedStash<S> {
    pub(crate) dn: S,
    pub(crate) rest: Carve<S>,
}

impl<S: Piece> NormedStash<S> {
    pub(crate) fn carve(t: usize, h: usize, stash: S) -> Self {
        let mut c = Carve(stash);
        NormedStash {
            dn: c.take(t * h),
            rest: c,
        }
    }
}
