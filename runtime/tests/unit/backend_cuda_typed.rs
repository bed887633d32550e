//! Unit tests of `backend::cuda::typed` (a child module of it: they reach its private items).

use super::*;

fn seg(elements: usize, stored: Stored) -> Segment {
    Segment {
        name: "s",
        elements,
        stored,
    }
}

/// A 16-bit saved region hands out each segment in its storage at its byte offset, and the
/// fp32 statistics at a 2-byte boundary are halves.
#[test]
fn saved_pointers_split_segment_by_segment() {
    let segs = [
        seg(3, Stored::Model),
        seg(2, Stored::F32),
        seg(4, Stored::Model),
        seg(2, Stored::Model),
        seg(1, Stored::F32),
    ];
    let base = DevAddr(1000);
    let p = DevPtr::saved(base, 0, Dtype::Bf16, &segs).unwrap();
    let (a, rest) = p.split(3);
    assert_eq!(a, DevPtr::new(base, Storage::Bf16));
    let (st, rest) = rest.split(2);
    assert_eq!(st, DevPtr::new(DevAddr(1006), Storage::F32Halves));
    let (b, rest) = rest.split(4);
    assert_eq!(b, DevPtr::new(DevAddr(1014), Storage::Bf16));
    let (c, rest) = rest.split(2);
    assert_eq!(c, DevPtr::new(DevAddr(1022), Storage::Bf16));
    assert_eq!(rest, DevPtr::new(DevAddr(1026), Storage::F32Halves));
    assert_eq!(p.offset(12).addr, DevAddr(1030));
    // Inside one run, offsets are the run's elements.
    assert_eq!(p.offset(5 + 3).addr, DevAddr(1020));
    // An fp32 model's saved region is one fp32 run.
    let f = DevPtr::saved(base, 0, Dtype::Fp32, &segs).unwrap();
    assert_eq!(f, DevPtr::f32(base));
    // A model-dtype segment at an odd byte cannot be viewed.
    assert!(DevPtr::saved(base, 1, Dtype::Bf16, &segs).is_none());
}
