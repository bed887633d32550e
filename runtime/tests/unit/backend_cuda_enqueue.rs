//! Unit tests of `backend::cuda::enqueue` (a child module of it: they reach its private items).

use super::*;
use sched_kernels::flash;

/// What the generated kernels' thread mapping (`sched_kernels::codegen`) assumes of a
/// launch: a warp per row and whole warps per block; for columns, whole groups of
/// 32·`COLUMN_LANES` threads (so that every thread of a warp walks the same columns); enough
/// threads for one pass over the indices below the 65,536-block cap (an unrolled op's pass
/// being [`UNROLL`] indices a thread).
#[test]
fn grids_fit_the_kernels_thread_mapping() {
    let rows = Op::CrossEntropy {
        vocab: 50257,
        stride: 50264,
    };
    let columns = Op::BiasGrad {
        width: 768,
        cast: false,
        gelu: false,
    };
    for n in [1, 31, 32, 33, 767, 768, 8192, 1 << 20, 1 << 24] {
        let adam = Op::Adam { param: false };
        let flash = Op::FlashBackwardKeys(flash::Shape {
            heads: 12,
            kv_heads: 12,
            d: 64,
            s: 1024,
        });
        for op in [
            Op::Convert,
            Op::Gelu,
            adam,
            rows,
            columns,
            Op::SumSquares,
            flash,
        ] {
            let g = grid(op, n);
            let threads = u64::from(g.blocks) * u64::from(g.threads);
            assert_eq!(threads % WARP, 0, "{op:?} over {n}: whole warps");
            if op.space() == Space::Columns {
                assert_eq!(
                    threads % (WARP * COLUMN_LANES),
                    0,
                    "{op:?} over {n}: groups"
                );
            }
            // Indices one pass covers, by the mapping: 32 columns per group of threads,
            // `UNROLL` indices per thread of an unrolled op, else one index per
            // `lanes_on_gpu` threads.
            let per_pass = match op.space() {
                Space::Columns => threads / (WARP * COLUMN_LANES) * WARP,
                _ if op.unrolled() => threads * UNROLL,
                _ => threads / op.lanes_on_gpu(),
            };
            assert!(
                per_pass >= n as u64 || g.blocks == 1 << 16,
                "{op:?} over {n}: one pass covers {per_pass}"
            );
        }
    }
    // GPT-2 small: 8,192 rows of a warp each, 768 columns in 24 groups of 8 blocks; the
    // key side's 6,144 warps in blocks of four.
    assert_eq!(grid(rows, 8192).blocks, 1024);
    assert_eq!(grid(columns, 768).blocks, 192);
    let keys = Op::FlashBackwardKeys(flash::Shape {
        heads: 12,
        kv_heads: 12,
        d: 64,
        s: 1024,
    });
    assert_eq!(
        grid(keys, 6144),
        Grid {
            blocks: 1536,
            threads: 128
        }
    );
}
