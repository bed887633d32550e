//! Zeroed memory for the CPU backend's large, long-lived buffers (each rank's arena and its
//! workspace vectors), asked to live on transparent huge pages.
//!
//! A training step streams through every saved activation, gradient and optimizer state; with
//! 4 KiB pages each megabyte is 256 translations, far more than the TLB holds, so the element-wise
//! passes and the products' packing pay a page walk every few cache lines. Linux backs a region
//! with 2 MiB pages on first touch when it is marked `MADV_HUGEPAGE` (the usual `madvise` mode of
//! `/sys/kernel/mm/transparent_hugepage/enabled`; in `always` mode it needs no mark, and in `never`
//! the mark does nothing). So the buffers are allocated zeroed without being touched (the global
//! allocator's `alloc_zeroed`: fresh pages for a large size), marked, and only then written. The
//! mark is advice: where it is refused or unsupported the buffer is the same, on small pages.
//! Values never depend on it.

use std::alloc::{alloc_zeroed, handle_alloc_error, Layout};
use std::sync::atomic::AtomicU32;

/// Types whose all-zero bytes are a valid value (0.0 for floats).
///
/// # Safety
/// Implement only for such types.
pub(crate) unsafe trait Zeroable {}

// SAFETY: zero bits are 0.0f32 and an AtomicU32 holding 0.
unsafe impl Zeroable for f32 {}
unsafe impl Zeroable for AtomicU32 {}

/// Regions smaller than this hold no whole aligned huge page worth marking.
const HUGE: usize = 2 << 20;

/// `n` zeroed values, on huge pages where the kernel gives them.
pub(crate) fn zeroed<T: Zeroable>(n: usize) -> Vec<T> {
    let layout = Layout::array::<T>(n).expect("buffer size overflows");
    if layout.size() == 0 {
        return Vec::new();
    }
    // SAFETY: the layout is non-zero-sized; the pointer is checked for null; the allocation has
    // exactly `layout` from the global allocator, as `Vec::from_raw_parts` requires, and zero
    // bytes are `n` valid values of `T` (`Zeroable`).
    unsafe {
        let ptr = alloc_zeroed(layout);
        if ptr.is_null() {
            handle_alloc_error(layout);
        }
        advise_huge(ptr, layout.size());
        Vec::from_raw_parts(ptr.cast::<T>(), n, n)
    }
}

/// Marks the whole huge pages inside `[ptr, ptr + bytes)` for transparent huge pages.
fn advise_huge(ptr: *mut u8, bytes: usize) {
    if bytes < 2 * HUGE {
        return;
    }
    #[cfg(target_os = "linux")]
    {
        let start = (ptr as usize).next_multiple_of(HUGE);
        let end = (ptr as usize + bytes) / HUGE * HUGE;
        if end > start {
            // SAFETY: the range lies inside one live allocation of ours; MADV_HUGEPAGE changes
            // how its pages are backed, never their contents. A refusal (old kernel, THP off)
            // leaves small pages, which is fine.
            unsafe {
                libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_HUGEPAGE);
            }
        }
    }
}

#[cfg(test)]
#[path = "../tests/unit/pages.rs"]
mod tests;
