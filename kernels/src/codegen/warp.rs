//! A GPU warp on the host ([`super::Target::Warp`]): 32 OS threads, one per lane, each running a
//! kernel's code for every index, meeting at each warp-wide instruction, which the code calls
//! here: a butterfly shuffle ([`SHFL`]) or an `mma.m16n8k16` ([`MMA`], computed by
//! `crate::flash::mma`, the model the fused attention is written after). Lane code
//! whose control flow diverged before such a call would wait forever, as a GPU warp would be
//! wrong; the kernels only meet at calls every lane makes.
//!
//! The JIT maps the three symbols to these functions ([`map`]); [`lanes`] runs a closure on 32
//! threads, each knowing its lane and the warp it meets in.

use crate::flash;
use inkwell::execution_engine::ExecutionEngine;
use inkwell::module::Module;
use std::cell::Cell;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Barrier;

/// The symbols the warp's code calls: its lane, a butterfly shuffle, a matrix product.
pub const LANE: &str = "sched_warp_lane";
pub const SHFL: &str = "sched_warp_shfl";
pub const MMA: &str = "sched_warp_mma";

const LANES: usize = 32;
/// Words a lane passes to a product: A (4), B (2), C (4).
const WORDS: usize = 10;

/// Where a warp's lanes meet: a barrier and each lane's words.
struct Warp {
    barrier: Barrier,
    words: Vec<AtomicU32>,
}

thread_local! {
    /// This thread's lane and its warp, while [`lanes`] runs it.
    static LANE_OF: Cell<Option<(usize, *const Warp)>> = const { Cell::new(None) };
}

fn me() -> (usize, &'static Warp) {
    let (lane, warp) = LANE_OF
        .get()
        .expect("warp code runs on the threads of `lanes`");
    // SAFETY: `lanes` keeps the warp alive while its threads run, and only they call here.
    (lane, unsafe { &*warp })
}

/// Every lane publishes `words`, then reads what `read` takes from all lanes' words, then all
/// wait again so that no lane overwrites its words before every lane has read.
fn meet<R>(words: &[u32], read: impl FnOnce(&[AtomicU32]) -> R) -> R {
    let (lane, warp) = me();
    for (k, &w) in words.iter().enumerate() {
        warp.words[lane * WORDS + k].store(w, Ordering::Relaxed);
    }
    warp.barrier.wait();
    let out = read(&warp.words);
    warp.barrier.wait();
    out
}

extern "C" fn lane() -> i64 {
    me().0 as i64
}

extern "C" fn shfl(x: f32, mask: i32) -> f32 {
    let from = me().0 ^ mask as usize;
    let bits = meet(&[x.to_bits()], |w| w[from * WORDS].load(Ordering::Relaxed));
    f32::from_bits(bits)
}

#[allow(clippy::too_many_arguments)]
extern "C" fn mma(
    a0: u32,
    a1: u32,
    a2: u32,
    a3: u32,
    b0: u32,
    b1: u32,
    c0: f32,
    c1: f32,
    c2: f32,
    c3: f32,
    out: *mut f32,
) {
    let mine = [a0, a1, a2, a3, b0, b1].into_iter();
    let words: Vec<u32> = mine.chain([c0, c1, c2, c3].map(f32::to_bits)).collect();
    let lane = me().0;
    let d = meet(&words, |w| {
        let word = |l: usize, k: usize| w[l * WORDS + k].load(Ordering::Relaxed);
        let a = std::array::from_fn(|l| std::array::from_fn(|k| word(l, k)));
        let b = std::array::from_fn(|l| std::array::from_fn(|k| word(l, 4 + k)));
        let mut c =
            std::array::from_fn(|l| std::array::from_fn(|k| f32::from_bits(word(l, 6 + k))));
        flash::mma(&a, &b, &mut c);
        c[lane]
    });
    // SAFETY: the generated code passes a pointer to four floats of its stack.
    unsafe { std::ptr::copy_nonoverlapping(d.as_ptr(), out, 4) };
}

/// Points the module's declarations of [`LANE`], [`SHFL`] and [`MMA`] at this module's functions.
pub fn map(module: &Module<'_>, engine: &ExecutionEngine<'_>) {
    let functions: [(&str, usize); 3] = [
        (LANE, lane as *const () as usize),
        (SHFL, shfl as *const () as usize),
        (MMA, mma as *const () as usize),
    ];
    for (name, address) in functions {
        if let Some(f) = module.get_function(name) {
            engine.add_global_mapping(&f, address);
        }
    }
}

/// Runs `f` on 32 threads, the lanes of one warp, and returns the first lane's result.
pub fn lanes<R: Send>(f: impl Fn() -> R + Sync) -> R {
    let warp = Warp {
        barrier: Barrier::new(LANES),
        words: (0..LANES * WORDS).map(|_| AtomicU32::new(0)).collect(),
    };
    let warp_at = &warp as *const Warp as usize;
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..LANES)
            .map(|lane| {
                let f = &f;
                s.spawn(move || {
                    LANE_OF.set(Some((lane, warp_at as *const Warp)));
                    let r = f();
                    LANE_OF.set(None);
                    r
                })
            })
            .collect();
        let mut results: Vec<R> = handles
            .into_iter()
            .map(|h| h.join().expect("a lane panicked"))
            .collect();
        results.swap_remove(0)
    })
}

#[cfg(test)]
#[path = "../../tests/unit/codegen_warp.rs"]
mod tests;
