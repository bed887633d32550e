//! The GPU device's pointer: a device address and the storage of the elements there, so that
//! the primitives compute on the arena's regions in their own dtype (no f32 staging copies).
//! Workspace is fp32; a region of the arena is fp32, bf16 or fp16; a 16-bit model's saved
//! region mixes model-dtype tensors with fp32 statistics at 2-byte-aligned offsets, which a
//! [`DevPtr`] over it describes as runs of storage that [`Piece::split`] hands out one by one.
#![cfg_attr(not(feature = "cuda"), allow(dead_code))]

use crate::device::Ptr;
use crate::math::saved::Piece;
use crate::math::{Precision, Segment, Stored};
use sched_ir::job::Dtype;

/// An address in GPU memory (in the host emulation, a host address): typed so that device
/// addresses, byte offsets in the arena and element counts cannot be mixed up.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct DevAddr(pub u64);

impl DevAddr {
    pub const NULL: DevAddr = DevAddr(0);

    /// The address `bytes` further on.
    pub fn add_bytes(self, bytes: u64) -> DevAddr {
        DevAddr(self.0 + bytes)
    }
}

/// How the elements behind a pointer are stored.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Storage {
    #[default]
    F32,
    Bf16,
    F16,
    /// An fp32 value as two 16-bit halves, low half first, at a 2-byte-aligned address (the
    /// statistics inside a 16-bit model's saved region): the same bytes as [`Storage::F32`],
    /// read and written by kernels without 4-byte accesses.
    F32Halves,
}

impl Storage {
    /// The storage of a region of `dtype` at a 4-byte-aligned address.
    pub fn of(dtype: Dtype) -> Storage {
        match dtype {
            Dtype::Fp32 => Storage::F32,
            Dtype::Bf16 => Storage::Bf16,
            Dtype::Fp16 => Storage::F16,
        }
    }

    /// The storage of `dtype` at byte `at` of the arena, `None` where it is misaligned for it
    /// (fp32 at a 2-byte boundary is [`Storage::F32Halves`]).
    pub fn at(dtype: Dtype, at: u64) -> Option<Storage> {
        match (dtype, at % 4) {
            (Dtype::Fp32, 0) => Some(Storage::F32),
            (Dtype::Fp32, 2) => Some(Storage::F32Halves),
            (_, r) if r % 2 == 0 => Some(Storage::of(dtype)),
            _ => None,
        }
    }

    pub fn bytes(self) -> u64 {
        match self {
            Storage::F32 | Storage::F32Halves => 4,
            Storage::Bf16 | Storage::F16 => 2,
        }
    }

    /// The dtype a matrix product can take this storage as, in place (cuBLAS needs fp32 at
    /// 4-byte alignment).
    pub fn dtype(self) -> Option<Dtype> {
        match self {
            Storage::F32 => Some(Dtype::Fp32),
            Storage::Bf16 => Some(Dtype::Bf16),
            Storage::F16 => Some(Dtype::Fp16),
            Storage::F32Halves => None,
        }
    }

    /// Whether values written here already carry `prec`'s rounding (so rounding them again
    /// changes nothing): a 16-bit storage of that precision.
    pub fn rounds_to(self, prec: Precision) -> bool {
        matches!(
            (self, prec),
            (_, Precision::F32) | (Storage::Bf16, Precision::Bf16) | (Storage::F16, Precision::F16)
        )
    }
}

/// The most storage runs one pointer describes (a transformer block's saved region has 7:
/// model, stats, model, lse, model, stats, model).
const MAX_RUNS: usize = 8;

/// A run of elements on the device: its first element's address and storage and, for a
/// region that mixes storages, the runs ahead (each `(elements, storage)`, the first one the
/// current). Without runs the storage holds all the way.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DevPtr {
    pub addr: DevAddr,
    pub storage: Storage,
    runs: [(usize, Storage); MAX_RUNS],
    count: usize,
}

impl DevPtr {
    pub const NULL: DevPtr = DevPtr {
        addr: DevAddr::NULL,
        storage: Storage::F32,
        runs: [(0, Storage::F32); MAX_RUNS],
        count: 0,
    };

    /// `addr` holding elements of `storage`.
    pub fn new(addr: DevAddr, storage: Storage) -> DevPtr {
        DevPtr {
            addr,
            storage,
            ..DevPtr::NULL
        }
    }

    /// fp32 values at `addr` (workspace).
    pub fn f32(addr: DevAddr) -> DevPtr {
        DevPtr::new(addr, Storage::F32)
    }

    /// A saved region at `addr` (byte `at` of the arena) laid out as `segments`: model-dtype
    /// segments in `model`'s storage, fp32 ones as fp32 (as halves where 2-byte aligned).
    /// `None` when a segment is misaligned for its storage or there are too many runs.
    pub fn saved(addr: DevAddr, at: u64, model: Dtype, segments: &[Segment]) -> Option<DevPtr> {
        let mut p = DevPtr::new(addr, Storage::of(model));
        let mut byte = at;
        for seg in segments.iter().filter(|s| s.elements > 0) {
            let dtype = match seg.stored {
                Stored::Model => model,
                Stored::F32 => Dtype::Fp32,
            };
            let storage = Storage::at(dtype, byte)?;
            match p.count {
                0 => p.storage = storage,
                c if p.runs[c - 1].1 == storage => {
                    p.runs[c - 1].0 += seg.elements;
                    byte += seg.elements as u64 * storage.bytes();
                    continue;
                }
                c if c == MAX_RUNS => return None,
                _ => {}
            }
            p.runs[p.count] = (seg.elements, storage);
            p.count += 1;
            byte += seg.elements as u64 * storage.bytes();
        }
        Some(p.plain_if_single())
    }

    /// The runs ahead, the current one first.
    fn runs(&self) -> &[(usize, Storage)] {
        &self.runs[..self.count]
    }

    /// Without runs when one storage holds all the way.
    fn plain_if_single(mut self) -> DevPtr {
        if self.count <= 1 {
            self.count = 0;
            self.runs = DevPtr::NULL.runs;
        }
        self
    }

    /// The first `n` elements only (the runs they span).
    fn truncated(self, n: usize) -> DevPtr {
        let mut p = DevPtr::new(self.addr, self.storage);
        let mut left = n;
        for &(len, storage) in self.runs() {
            if left == 0 {
                break;
            }
            p.runs[p.count] = (len.min(left), storage);
            p.count += 1;
            left -= len.min(left);
        }
        p.plain_if_single()
    }

    /// The address of element `n` (of this pointer's storage): no runs may lie in between.
    pub fn addr_of(self, n: usize) -> DevAddr {
        debug_assert!(self.count == 0 || n <= self.runs[0].0);
        self.addr.add_bytes(n as u64 * self.storage.bytes())
    }

    /// Whether the elements from here are of more than one storage (a saved region not yet cut
    /// into its segments): no kernel takes such a pointer.
    pub fn mixed(self) -> bool {
        self.count > 0
    }
}

impl Piece for DevPtr {
    fn split(self, n: usize) -> (Self, Self) {
        (self.truncated(n), self.offset(n))
    }
}

impl Ptr for DevPtr {
    /// `n` elements further on, crossing runs (each element the size of its own storage).
    fn offset(self, n: usize) -> Self {
        if self.count == 0 {
            return DevPtr::new(self.addr_of(n), self.storage);
        }
        let mut p = self;
        let mut left = n;
        while left > 0 && p.count > 0 {
            let (len, storage) = p.runs[0];
            let step = len.min(left);
            p.addr = p.addr.add_bytes(step as u64 * storage.bytes());
            left -= step;
            if step == len && p.count > 1 {
                p.runs.copy_within(1..p.count, 0);
                p.count -= 1;
                p.storage = p.runs[0].1;
            } else {
                p.runs[0].0 -= step;
            }
        }
        // Past the last run: its storage continues.
        p.addr = p.addr.add_bytes(left as u64 * p.storage.bytes());
        p.plain_if_single()
    }
}

#[cfg(test)]
#[path = "../../../tests/unit/backend_cuda_typed.rs"]
mod tests;
