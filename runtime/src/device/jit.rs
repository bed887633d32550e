//! The generated kernels on the host device (`llvm` cargo feature): the same LLVM IR bodies the
//! GPU runs as PTX (`sched_kernels`), JIT-compiled for this processor and called by
//! [`super::host::Host`] for the element-wise, norm, rotary, loss and optimizer primitives, so
//! the CPU parity suites test the GPU kernels' logic. Their results are the bits of the Rust math
//! they replace (`math::generated_parity` checks each kernel against it).
//!
//! Kernels are specialised to the shapes a plan fixes (row widths, the vocabulary, head
//! shapes), so each is compiled on first use and kept for the life of the process. Every tensor
//! the host device passes is f32 workspace (it converts regions of the arena on load and store);
//! [`run_slots`] runs any typed variant, as the host emulation of the CUDA backend launches it.
//! Not generated (still the Rust math): the matrix products, attention, the gradient norm (its
//! generated kernel sums in chunks of `SUMSQ_CHUNK`, a different order from the host's
//! sequential sum) and the conversions to and from the arena.

use super::DeviceError;
use sched_ir::job::Dtype;
use sched_kernels::codegen::{slot_f32, slot_i64, slot_ptr, HostKernels};
use sched_kernels::{Kernel, Op};
use std::cell::Cell;
use std::collections::HashMap;
use std::sync::{Arc, OnceLock, RwLock};

pub use super::args::Arg;

impl Arg {
    fn slot(self) -> u64 {
        match self {
            Arg::Ptr(p) => slot_ptr(p),
            Arg::Tokens(p) => slot_ptr(p),
            Arg::F32(x) => slot_f32(x),
            Arg::I64(x) => slot_i64(x),
        }
    }
}

/// Every kernel compiled so far, by name.
#[derive(Default)]
struct Cache {
    compiled: RwLock<HashMap<String, Arc<HostKernels>>>,
}

fn cache() -> &'static Cache {
    static CACHE: OnceLock<Cache> = OnceLock::new();
    CACHE.get_or_init(Cache::default)
}

thread_local! {
    static RUST_ONLY: Cell<bool> = const { Cell::new(false) };
}

/// Whether this thread's host devices call the generated kernels.
pub(crate) fn enabled() -> bool {
    !RUST_ONLY.with(Cell::get)
}

/// Runs `f` with the generated kernels off on this thread (the Rust math instead): the tests
/// compare the two.
#[cfg(test)]
pub(crate) fn without<R>(f: impl FnOnce() -> R) -> R {
    let before = RUST_ONLY.with(|c| c.replace(true));
    let out = f();
    RUST_ONLY.with(|c| c.set(before));
    out
}

/// The kernel for `op` with every tensor in f32.
pub fn kernel(op: Op) -> Kernel {
    Kernel::new(op, &vec![Dtype::Fp32; op.tensors()])
}

fn poisoned() -> DeviceError {
    DeviceError::Kernel("the kernel cache is poisoned".into())
}

/// Runs `k` over indices `0..n`, compiling it on first use.
///
/// # Safety
/// Every pointer in `args` must be valid for everything the kernel touches over `0..n`.
pub unsafe fn run(k: &Kernel, args: &[Arg], n: usize) -> Result<(), DeviceError> {
    let slots: Vec<u64> = args.iter().map(|a| a.slot()).collect();
    // SAFETY: the caller's promise.
    unsafe { run_slots(k, &slots, 0, n) }
}

/// Runs `k`, any typed variant, over indices `begin..end` with its arguments as 8-byte slots
/// ([`HostKernels::run`]'s), compiling it on first use: the host emulation of the CUDA
/// backend calls the kernel each launch names this way. A GPU-only kernel (the fused
/// attention's, warp-wide matrix products) runs as a warp of host threads
/// ([`HostKernels::jit_warp`]: its PTX kernel's code with the warp's instructions as calls).
///
/// # Safety
/// Every pointer in `slots` must be valid for everything the kernel touches over `begin..end`.
pub unsafe fn run_slots(
    k: &Kernel,
    slots: &[u64],
    begin: usize,
    end: usize,
) -> Result<(), DeviceError> {
    if begin >= end {
        return Ok(());
    }
    let name = k.name();
    let found = cache()
        .compiled
        .read()
        .map_err(|_| poisoned())?
        .get(&name)
        .cloned();
    let host = match found {
        Some(h) => h,
        None => {
            let one = std::slice::from_ref(k);
            let built = if k.op.gpu_only() {
                HostKernels::jit_warp(one)
            } else {
                HostKernels::jit(one)
            };
            let h =
                Arc::new(built.map_err(|e| DeviceError::Kernel(format!("compiling {name}: {e}")))?);
            cache()
                .compiled
                .write()
                .map_err(|_| poisoned())?
                .entry(name)
                .or_insert(h)
                .clone()
        }
    };
    // SAFETY: the caller's promise.
    let ran = unsafe {
        if k.op.gpu_only() {
            host.run_warp(k, slots, begin, end)
        } else {
            host.run(k, slots, begin, end)
        }
    };
    ran.map_err(|e| DeviceError::backend("generated kernel", e))
}

#[cfg(all(test, feature = "compile"))]
#[path = "../../tests/unit/device_jit.rs"]
mod tests;
