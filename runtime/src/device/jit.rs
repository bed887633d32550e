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

/// A kernel argument, as [`HostKernels::run`] takes it.
#[derive(Clone, Copy, Debug)]
pub enum Arg {
    Ptr(*const f32),
    Tokens(*const u32),
    F32(f32),
    I64(i64),
}

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
    ran.map_err(|e| DeviceError::Kernel(e.to_string()))
}

#[cfg(test)]
mod tests {
    //! The host device with the generated kernels against the same device on the Rust math:
    //! every layer kind's forward and backward and every optimizer, bit for bit.

    use super::without;
    use crate::arena::Arena;
    use crate::device::host::{Host, HostPtr};
    use crate::device::{ArenaSpan, Device, Update};
    use crate::math::{Input, LayerMath, OptimizerConfig, Rng};
    use sched_ir::job::{Dtype, Optimizer};

    const MODELS: &str = r#"
model gpt {
    dtype = fp32  optimizer = adamw  seq_len = 16  micro_batch = 2
    layer embed    = embedding(vocab = 96, hidden = 32, positions = learned)
    layer block[1] = transformer(hidden = 32, heads = 4, ffn = 64, attention = naive)
    layer mlp      = mlp(hidden = 32, ffn = 48)
    layer head     = lm_head(hidden = 32, vocab = 96, tied = true)
}
model llama {
    dtype = bf16  optimizer = adamw  seq_len = 16  micro_batch = 2
    layer embed    = embedding(vocab = 96, hidden = 32, positions = rope)
    layer block[1] = transformer(hidden = 32, heads = 4, kv_heads = 2, ffn = 40, norm = rmsnorm, act = swiglu, bias = false)
    layer head     = lm_head(hidden = 32, vocab = 96, norm = rmsnorm)
}
"#;

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|x| x.to_bits()).collect()
    }

    /// Forward then backward of `m`: output, saved, input, parameter and tied gradients.
    fn run_layer(
        m: &LayerMath,
        p: &[f32],
        tied: Option<&[f32]>,
        x: &[f32],
        dy: &[f32],
    ) -> Vec<Vec<u32>> {
        let tokens: Vec<u32> = (0..m.input_elements() as u32)
            .map(|i| (i * 37 + 11) % 96)
            .collect();
        let input = if m.takes_tokens() {
            Input::Tokens(&tokens)
        } else {
            Input::Hidden(x)
        };
        let mut out = vec![0.0; m.output_elements()];
        let mut saved = vec![0.0; m.saved_elements()];
        m.forward(p, tied, input, &mut out, &mut saved);
        let mut gi = (!m.takes_tokens()).then(|| vec![0.0; m.input_elements()]);
        let mut gp = vec![0.0; m.params()];
        let mut gt = tied.map(|t| vec![0.0; t.len()]);
        m.backward(
            p,
            tied,
            &saved,
            input,
            dy,
            gi.as_deref_mut(),
            &mut gp,
            gt.as_deref_mut(),
        );
        let mut all = vec![bits(&out), bits(&saved), bits(&gp)];
        all.extend(gi.as_deref().map(bits));
        all.extend(gt.as_deref().map(bits));
        all
    }

    #[test]
    fn layers_on_generated_kernels_are_the_rust_math_bit_for_bit() {
        let loader = schedc::MemLoader::default()
            .in_dir("/mem")
            .with("/mem/m.sched", MODELS);
        let a = schedc::analyze(std::path::Path::new("/mem/m.sched"), &loader).expect("readable");
        assert!(!a.has_errors(), "{}", a.render());
        for model in a.models.iter() {
            let mut rng = Rng::new(3);
            for layer in &model.layers {
                let m = LayerMath::new(layer, model).unwrap();
                let p = rng.normals(m.params(), 0.2);
                let tied = m.is_tied().then(|| rng.normals(m.tied_elements(), 0.2));
                let x = rng.normals(m.input_elements(), 1.0);
                let dy = rng.normals(m.output_elements(), 0.1);
                let generated = run_layer(&m, &p, tied.as_deref(), &x, &dy);
                let rust = without(|| run_layer(&m, &p, tied.as_deref(), &x, &dy));
                for (i, (g, r)) in generated.iter().zip(&rust).enumerate() {
                    assert!(g == r, "{} {}: tensor {i} differs", model.name, layer.name);
                }
            }
        }
    }

    /// One update of a shard that straddles a decayed range, clipped by a stored sum of squares.
    fn update(kind: Optimizer, arena: &Arena, state: &[f32], grad: &[f32]) -> Vec<u32> {
        let mut st = state.to_vec();
        let mut g = grad.to_vec();
        let cfg = OptimizerConfig::new(kind, 3e-3);
        let n = g.len();
        let decay = [0..5, 17..40, 50..90];
        let host = Host::new(arena, &[], vec![]);
        let u = Update {
            cfg: &cfg,
            step: 3,
            n,
            first: 10,
            decay: &decay,
            clip: Some((
                ArenaSpan {
                    at: 0,
                    dtype: Dtype::Fp32,
                    elements: 1,
                },
                0.5,
            )),
            contributions: 4.0,
        };
        host.update(&u, HostPtr::of(&mut st), HostPtr::of(&mut g), None)
            .unwrap();
        bits(&st)
    }

    #[test]
    fn optimizers_on_generated_kernels_are_the_rust_math_bit_for_bit() {
        let arena = Arena::new(8);
        arena.write(0, Dtype::Fp32, &[2.5]).unwrap();
        let mut rng = Rng::new(9);
        let n = 64;
        for kind in [Optimizer::Adam, Optimizer::AdamW, Optimizer::Sgd] {
            let per = OptimizerConfig::new(kind, 1.0).state_per_param();
            let mut state = rng.normals(per * n, 0.5);
            if per == 3 {
                // The second moment is never negative.
                state[2 * n..].iter_mut().for_each(|v| *v = v.abs());
            }
            let grad = rng.normals(n, 1.0);
            let generated = update(kind, &arena, &state, &grad);
            let rust = without(|| update(kind, &arena, &state, &grad));
            assert!(generated == rust, "{kind:?} differs");
            assert_ne!(generated, bits(&state), "{kind:?} changed nothing");
        }
    }
}
