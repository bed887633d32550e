//! One rank's arena: the only memory a rank's tensors live in, sized by the plan's memory plan.
//!
//! The arena is an array of 32-bit words accessed with relaxed atomics. Streams of one rank (and
//! the collectives of other ranks) touch it concurrently; a verified plan orders every conflicting
//! access by happens-before, so relaxed accesses see exactly the values the plan intends. A plan
//! with a missing wait really races here, and produces wrong numbers rather than undefined
//! behaviour — which is what the stress mode (`--jitter`) relies on to expose it.
//!
//! Bulk mode ([`Arena::set_bulk`]) moves fp32 runs with plain vectorised copies instead of word
//! by word. It is for verified plans run without the stress mode: the plan's events order every
//! conflicting access (through the backend's locks), so no access races and plain copies see
//! the same values; a racing plan would be undefined behaviour there, so the stress mode keeps
//! the atomic words.
//!
//! Values cross the arena boundary as `f32`: fp32 tensors are stored as their bits, bf16 tensors
//! as the upper half of the fp32 bits rounded to nearest even (`math::f32_to_bf16_bits`). Every
//! access also raises a high-water mark, the measured peak reported next to the plan's figure.

use crate::math::{bf16_bits_to_f32, f32_to_bf16_bits};
use sched_ir::job::Dtype;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering::Relaxed};

/// A rank's arena.
pub struct Arena {
    words: Box<[AtomicU32]>,
    bytes: u64,
    high_water: AtomicU64,
    bulk: AtomicBool,
}

/// Why an access was refused: it lies outside the arena or is misaligned for its dtype (the
/// access and the arena's size, in words).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct AccessError(pub String);

impl Arena {
    /// An arena of `bytes` bytes, zeroed.
    pub fn new(bytes: u64) -> Self {
        let words = (bytes.div_ceil(4)) as usize;
        Arena {
            words: crate::pages::zeroed::<AtomicU32>(words).into_boxed_slice(),
            bytes,
            high_water: AtomicU64::new(0),
            bulk: AtomicBool::new(false),
        }
    }

    /// Moves fp32 runs with plain copies (see the module documentation for when that is sound).
    pub fn set_bulk(&self, bulk: bool) {
        self.bulk.store(bulk, Relaxed);
    }

    /// The words from `first`, `n` of them, as plain memory (bulk mode only).
    fn raw(&self, first: usize, n: usize) -> *mut u32 {
        assert!(first + n <= self.words.len(), "checked by `check`");
        // AtomicU32 has u32's layout and interior mutability, so a pointer derived from the whole
        // slice may read and write any of its words.
        self.words
            .as_ptr()
            .cast::<u32>()
            .cast_mut()
            .wrapping_add(first)
    }

    /// Size in bytes: the plan's peak.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// The highest byte any access has reached.
    pub fn high_water(&self) -> u64 {
        self.high_water.load(Relaxed)
    }

    fn check(&self, offset: u64, bytes: u64, align: u64) -> Result<(), AccessError> {
        let end = offset.checked_add(bytes);
        if end.is_none_or(|e| e > self.bytes) {
            return Err(AccessError(format!(
                "bytes {offset}..{} lie outside the {}-byte arena",
                offset.saturating_add(bytes),
                self.bytes
            )));
        }
        if !offset.is_multiple_of(align) || !bytes.is_multiple_of(align) {
            return Err(AccessError(format!(
                "bytes {offset}..{} are not aligned to {align}",
                offset + bytes
            )));
        }
        self.high_water.fetch_max(offset + bytes, Relaxed);
        Ok(())
    }

    /// In bulk mode, the `n` fp32 values at byte `offset` as plain memory the caller may read and
    /// write in place (the host device computes on the arena this way); `None` otherwise.
    pub fn view_f32(&self, offset: u64, n: usize) -> Result<Option<*mut f32>, AccessError> {
        if !self.bulk.load(Relaxed) || !offset.is_multiple_of(4) {
            return Ok(None);
        }
        self.check(offset, n as u64 * 4, 4)?;
        Ok(Some(self.raw((offset / 4) as usize, n).cast::<f32>()))
    }

    /// Reads `n` values of `dtype` at byte `offset`.
    pub fn read(&self, offset: u64, n: usize, dtype: Dtype) -> Result<Vec<f32>, AccessError> {
        let mut out = vec![0.0; n];
        self.read_into(offset, dtype, &mut out)?;
        Ok(out)
    }

    /// Reads `out.len()` values of `dtype` at byte `offset` into `out`.
    pub fn read_into(&self, offset: u64, dtype: Dtype, out: &mut [f32]) -> Result<(), AccessError> {
        let n = out.len() as u64;
        match dtype {
            Dtype::Fp32 => {
                self.check(offset, n * 4, 4)?;
                let first = (offset / 4) as usize;
                if self.bulk.load(Relaxed) {
                    let src = self.raw(first, out.len()).cast::<f32>();
                    // SAFETY: in bounds (checked); no access races in bulk mode.
                    unsafe { std::ptr::copy_nonoverlapping(src, out.as_mut_ptr(), out.len()) };
                    return Ok(());
                }
                let w = &self.words[first..][..out.len()];
                for (o, w) in out.iter_mut().zip(w) {
                    *o = f32::from_bits(w.load(Relaxed));
                }
            }
            Dtype::Bf16 | Dtype::Fp16 => {
                self.check(offset, n * 2, 2)?;
                for (i, o) in out.iter_mut().enumerate() {
                    *o = half_to_f32(dtype, self.load_half(offset + 2 * i as u64));
                }
            }
        }
        Ok(())
    }

    /// Writes `values` as `dtype` at byte `offset`.
    pub fn write(&self, offset: u64, dtype: Dtype, values: &[f32]) -> Result<(), AccessError> {
        let n = values.len() as u64;
        match dtype {
            Dtype::Fp32 => {
                self.check(offset, n * 4, 4)?;
                let first = (offset / 4) as usize;
                if self.bulk.load(Relaxed) {
                    let dst = self.raw(first, values.len()).cast::<f32>();
                    // SAFETY: in bounds (checked); no access races in bulk mode.
                    unsafe { std::ptr::copy_nonoverlapping(values.as_ptr(), dst, values.len()) };
                    return Ok(());
                }
                let w = &self.words[first..][..values.len()];
                for (v, w) in values.iter().zip(w) {
                    w.store(v.to_bits(), Relaxed);
                }
            }
            Dtype::Bf16 | Dtype::Fp16 => {
                self.check(offset, n * 2, 2)?;
                for (i, v) in values.iter().enumerate() {
                    self.store_half(offset + 2 * i as u64, f32_to_half(dtype, *v));
                }
            }
        }
        Ok(())
    }

    /// Adds `values` into the `dtype` values at byte `offset` (gradient accumulation).
    pub fn add(&self, offset: u64, dtype: Dtype, values: &[f32]) -> Result<(), AccessError> {
        if dtype == Dtype::Fp32 {
            let view = self.view_f32(offset, values.len())?;
            // In place, unless `values` is itself in these bytes (then read them first).
            if let Some(p) = view.filter(|&p| {
                let (lo, hi) = (p as usize, p as usize + 4 * values.len());
                let (a, b) = (
                    values.as_ptr() as usize,
                    values.as_ptr() as usize + 4 * values.len(),
                );
                b <= lo || hi <= a
            }) {
                // SAFETY: in bounds (checked by the view), disjoint from `values`, and no
                // access races in bulk mode.
                let cur = unsafe { std::slice::from_raw_parts_mut(p, values.len()) };
                cur.iter_mut().zip(values).for_each(|(c, v)| *c += v);
                return Ok(());
            }
        }
        let mut cur = self.read(offset, values.len(), dtype)?;
        for (c, v) in cur.iter_mut().zip(values) {
            *c += v;
        }
        self.write(offset, dtype, &cur)
    }

    /// Raw bytes at `offset` (any dtype; 2-byte granularity).
    pub fn read_bytes(&self, offset: u64, bytes: u64) -> Result<Vec<u16>, AccessError> {
        let mut out = vec![];
        self.append_bytes(offset, bytes, &mut out)?;
        Ok(out)
    }

    /// Appends the raw bytes at `offset` to `out` (as [`Arena::read_bytes`] returns them), so a
    /// caller that keeps `out` reads without allocating.
    pub fn append_bytes(
        &self,
        offset: u64,
        bytes: u64,
        out: &mut Vec<u16>,
    ) -> Result<(), AccessError> {
        self.check(offset, bytes, 2)?;
        let at = out.len();
        let n = (bytes / 2) as usize;
        if self.bulk.load(Relaxed) && offset.is_multiple_of(4) && bytes.is_multiple_of(4) {
            out.resize(at + n, 0);
            let src = self
                .raw((offset / 4) as usize, (bytes / 4) as usize)
                .cast::<u16>();
            // SAFETY: in bounds (checked); no access races in bulk mode; little-endian words
            // hold their lower half first, as `load_half` reads them.
            unsafe { std::ptr::copy_nonoverlapping(src, out[at..].as_mut_ptr(), n) };
            return Ok(());
        }
        out.extend((0..bytes / 2).map(|i| self.load_half(offset + 2 * i)));
        Ok(())
    }

    /// Writes raw bytes read by [`Arena::read_bytes`].
    pub fn write_bytes(&self, offset: u64, halves: &[u16]) -> Result<(), AccessError> {
        self.check(offset, 2 * halves.len() as u64, 2)?;
        if offset.is_multiple_of(4) && halves.len().is_multiple_of(2) {
            if self.bulk.load(Relaxed) {
                let dst = self
                    .raw((offset / 4) as usize, halves.len() / 2)
                    .cast::<u16>();
                // SAFETY: as in `read_bytes`.
                unsafe { std::ptr::copy_nonoverlapping(halves.as_ptr(), dst, halves.len()) };
                return Ok(());
            }
            let w = &self.words[(offset / 4) as usize..][..halves.len() / 2];
            for (pair, w) in halves.chunks_exact(2).zip(w) {
                w.store(u32::from(pair[0]) | (u32::from(pair[1]) << 16), Relaxed);
            }
            return Ok(());
        }
        for (i, h) in halves.iter().enumerate() {
            self.store_half(offset + 2 * i as u64, *h);
        }
        Ok(())
    }

    fn load_half(&self, byte: u64) -> u16 {
        let w = self.words[(byte / 4) as usize].load(Relaxed);
        if byte.is_multiple_of(4) {
            w as u16
        } else {
            (w >> 16) as u16
        }
    }

    /// Stores 16 bits without disturbing the other half of the word (another tensor's bytes).
    fn store_half(&self, byte: u64, h: u16) {
        let w = &self.words[(byte / 4) as usize];
        let (keep, set) = if byte.is_multiple_of(4) {
            (0xFFFF_0000, u32::from(h))
        } else {
            (0x0000_FFFF, u32::from(h) << 16)
        };
        let _ = w.fetch_update(Relaxed, Relaxed, |old| Some((old & keep) | set));
    }
}

/// A bf16 or fp16 word as f32.
pub(crate) fn half_to_f32(dtype: Dtype, h: u16) -> f32 {
    match dtype {
        Dtype::Fp16 => fp16_to_f32(h),
        _ => bf16_bits_to_f32(h),
    }
}

/// `x` rounded to a bf16 or fp16 word (to nearest even).
pub(crate) fn f32_to_half(dtype: Dtype, x: f32) -> u16 {
    match dtype {
        Dtype::Fp16 => f32_to_fp16(x),
        _ => f32_to_bf16_bits(x),
    }
}

/// IEEE half precision, through the `half` crate's exact conversions.
fn fp16_to_f32(h: u16) -> f32 {
    half::f16::from_bits(h).to_f32()
}

fn f32_to_fp16(x: f32) -> u16 {
    half::f16::from_f32(x).to_bits()
}

#[cfg(test)]
#[path = "../tests/unit/arena.rs"]
mod tests;
