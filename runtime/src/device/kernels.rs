//! Which kernels the host device runs its element-wise, norm, rotary, loss and optimizer
//! primitives with, chosen once, when a [`super::host::Host`] is made: the Rust math, or, with the
//! `llvm` feature, the generated kernels the GPU runs, JIT-compiled for this processor
//! ([`super::jit`]). A primitive offers its kernel to [`Kernels::run`] and runs the Rust math
//! when it declines, so no primitive tests the cargo feature itself; both give the same bits
//! (`math::generated_parity`).

pub use super::args::Arg;
use super::DeviceError;
use sched_kernels::Op;

/// The host device's kernels.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kernels {
    /// The Rust math (`crate::math`).
    Rust,
    /// The generated kernels (the `llvm` feature).
    #[cfg(feature = "llvm")]
    Generated,
}

impl Kernels {
    /// The generated kernels where this build has them, unless this thread runs the Rust math
    /// only (`jit::without`, the tests' switch); else the Rust math.
    pub(crate) fn chosen() -> Self {
        #[cfg(feature = "llvm")]
        if super::jit::enabled() {
            return Kernels::Generated;
        }
        Kernels::Rust
    }

    /// Whether the generated kernels run.
    pub(crate) fn generated(self) -> bool {
        self != Kernels::Rust
    }

    /// The generated kernel of `op` over `0..n` with `args`, when these are the generated
    /// kernels; `None` (the caller runs the Rust math) otherwise. Every caller passes the
    /// pointers of its primitive, sized for `n` indices of `op`.
    pub(crate) fn run(self, op: Op, args: &[Arg], n: usize) -> Option<Result<(), DeviceError>> {
        match self {
            Kernels::Rust => {
                let _ = (op, args, n);
                None
            }
            // SAFETY: the caller's pointers hold what `op` reads and writes over `0..n`.
            #[cfg(feature = "llvm")]
            Kernels::Generated => {
                Some(unsafe { super::jit::run(&super::jit::kernel(op), args, n) })
            }
        }
    }
}
