//! What the device code asks of a GPU stream, as an interface: launch a generated kernel by
//! name with raw arguments, run a row-major matrix product, copy bytes. The CUDA backend
//! implements it with cudarc (a stream, its cuBLAS handle, the PTX module's functions); the
//! tests implement it on the host (`emulate.rs`: the same kernels JIT-compiled for the host,
//! the BLAS definition for products), so the layer math and the argument marshalling are
//! checked without a GPU.
#![cfg_attr(not(feature = "cuda"), allow(dead_code))]

pub use super::typed::DevAddr;
use super::typed::DevPtr;
use sched_ir::job::{Collective, Dtype};
use sched_kernels::{Op, Space, COLUMN_LANES, UNROLL, WARP};

/// One kernel argument (all are scalars or raw device pointers), as `Kernel::params` types
/// them: pointers, i64, f32, f64.
#[derive(Clone, Copy, Debug)]
pub enum A {
    /// A device pointer ([`DevAddr::NULL`] for NULL).
    P(DevAddr),
    L(i64),
    F(f32),
    D(f64),
}

/// Rows of a 2-D copy ([`Exec::copy_rows`]): the first row's address and the bytes between rows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Pitched {
    pub at: DevAddr,
    pub pitch: usize,
}

impl Pitched {
    /// The address of row `r`.
    pub fn row(self, r: usize) -> DevAddr {
        DevAddr(self.at.0 + (r * self.pitch) as u64)
    }
}

/// A launch shape: `blocks` of `threads`, covering the kernel's index range with its
/// grid-stride loop.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Grid {
    pub blocks: u32,
    pub threads: u32,
}

/// Threads per block of the fused attention's tensor-core kernels (`Op::gpu_only`): four
/// warps. Their registers bound how many warps a multiprocessor holds (65,536 registers: ptxas
/// gives GPT-2's 64-wide heads 96 a thread forward, 127 and 168 for the backward's two sides).
/// In blocks of eight warps the key side fits one block, 8 warps, where blocks of four fit
/// three, 12; the forward 16 against 20. More resident warps hide more of the kernels' global
/// loads (they read K and V without shared memory), and a causal block's uneven warps hold
/// fewer of them idle. Not yet timed on a GPU.
pub const TENSOR_CORE_BLOCK: u32 = 128;

/// The grid of a launch of `op` over `n` indices, in blocks of 256 threads: one thread per
/// element ([`UNROLL`] elements for an unrolled op, which its loop walks in one iteration), a warp
/// per row (the tensor-core kernels' in blocks of [`TENSOR_CORE_BLOCK`]), 32·`COLUMN_LANES`
/// threads per 32 columns (so the launch's threads are whole groups of columns:
/// `Op::lanes_on_gpu`, and the code generator's thread mapping); the others (a chunk per
/// thread) blocks of 64, so that their few indices still spread over the multiprocessors. At
/// most 65,536 blocks: the grid-stride loop covers the rest.
pub fn grid(op: Op, n: usize) -> Grid {
    let n = n as u64;
    let (threads, needed): (u32, u64) = match op.space() {
        Space::Elements if op.unrolled() => (256, n.div_ceil(UNROLL)),
        Space::Elements => (256, n),
        Space::Rows if op.gpu_only() => (TENSOR_CORE_BLOCK, n * WARP),
        Space::Rows => (256, n * WARP),
        Space::Columns => (256, n.div_ceil(WARP) * WARP * COLUMN_LANES),
        Space::Chunks => (64, n),
    };
    Grid {
        blocks: needed.div_ceil(u64::from(threads)).clamp(1, 1 << 16) as u32,
        threads,
    }
}

/// How a region moved between the arena and workspace ([`Exec::staged`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Staged {
    /// `Device::load`: the arena into workspace.
    Load,
    /// `Device::store`: workspace written into the arena.
    Store,
    /// `Device::store` with `accumulate`: workspace added into the arena.
    AddStore,
}

/// A row-major matrix operand: typed device pointer, leading dimension (elements between
/// rows), and whether it is used transposed.
#[derive(Clone, Copy, Debug)]
pub struct M {
    pub ptr: DevPtr,
    pub ld: usize,
    pub t: bool,
}

pub fn m(ptr: DevPtr, ld: usize) -> M {
    M { ptr, ld, t: false }
}

pub fn mt(ptr: DevPtr, ld: usize) -> M {
    M { ptr, ld, t: true }
}

/// A column-major product call, as cuBLAS takes it: D ← α·op(A)·op(B) + β·C (+ bias) with
/// op(A) m × k, op(B) k × n, C = D m × n (`batch` of them). A and B are stored in `operands`
/// (fp32: `sgemm`; bf16 or fp16: tensor cores through cuBLASLt); C and D in `output`: fp32, or
/// (cuBLASLt only) the operands' 16-bit dtype, α·AB + β·C (+ bias) computed in f32 and rounded
/// once. Every product accumulates in fp32. `bias` (cuBLASLt only: its epilogue) adds a vector
/// of m values of its dtype to every column.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ColMajor {
    pub operands: Dtype,
    pub output: Dtype,
    pub bias: Option<(DevAddr, Dtype)>,
    pub transa: bool,
    pub transb: bool,
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub alpha: f32,
    pub a: DevAddr,
    pub lda: usize,
    pub stride_a: usize,
    pub b: DevAddr,
    pub ldb: usize,
    pub stride_b: usize,
    pub beta: f32,
    pub c: DevAddr,
    pub ldc: usize,
    pub stride_c: usize,
    pub batch: usize,
}

/// A row-major product C[rows × cols] ← α·op(A)[rows × k]·op(B)[k × cols] + β·C, C's rows `ldc`
/// apart; `batch` of them, the batch's A, B and C `strides` elements apart (0 reuses one). What
/// the device layer asks for; [`row_major`] turns it into the [`ColMajor`] call cuBLAS takes.
#[derive(Clone, Copy, Debug)]
pub struct RowMajor {
    pub rows: usize,
    pub cols: usize,
    pub k: usize,
    pub alpha: f32,
    pub a: M,
    pub b: M,
    pub beta: f32,
    pub c: DevPtr,
    pub ldc: usize,
    pub strides: (usize, usize, usize),
    pub batch: usize,
}

impl RowMajor {
    /// C ← op(A)·op(B) for `(rows, cols, k)`, C's rows `ldc` apart: α = 1, β = 0, one product.
    pub fn new(
        (rows, cols, k): (usize, usize, usize),
        a: M,
        b: M,
        (c, ldc): (DevPtr, usize),
    ) -> Self {
        RowMajor {
            rows,
            cols,
            k,
            alpha: 1.0,
            a,
            b,
            beta: 0.0,
            c,
            ldc,
            strides: (0, 0, 0),
            batch: 1,
        }
    }

    /// The same product scaled by `alpha`.
    pub fn alpha(self, alpha: f32) -> Self {
        RowMajor { alpha, ..self }
    }

    /// The same product added to `beta`·C.
    pub fn beta(self, beta: f32) -> Self {
        RowMajor { beta, ..self }
    }

    /// `batch` such products, the next one's A, B and C `strides` elements on.
    pub fn batched(self, strides: (usize, usize, usize), batch: usize) -> Self {
        RowMajor {
            strides,
            batch,
            ..self
        }
    }
}

/// The column-major call that computes `g`: a row-major C is a column-major Cᵀ = op(B)ᵀ·op(A)ᵀ,
/// so the operands swap and keep their transpose flags. The call says fp32 operands and output
/// and no bias; the caller sets what the operands' and C's storage make them (see
/// [`ColMajor::operands`]).
pub fn row_major(g: &RowMajor) -> ColMajor {
    let RowMajor {
        rows,
        cols,
        k,
        alpha,
        a,
        b,
        beta,
        c,
        ldc,
        strides: (stride_a, stride_b, stride_c),
        batch,
    } = *g;
    ColMajor {
        operands: Dtype::Fp32,
        output: Dtype::Fp32,
        bias: None,
        transa: b.t,
        transb: a.t,
        m: cols,
        n: rows,
        k,
        alpha,
        a: b.ptr.addr,
        lda: b.ld,
        stride_a: stride_b,
        b: a.ptr.addr,
        ldb: a.ld,
        stride_b: stride_a,
        beta,
        c: c.addr,
        ldc,
        stride_c,
        batch,
    }
}

/// One NCCL call: `ncclAllGather(send, recv, n)` (n = elements each member sends),
/// `ncclReduceScatter(send, recv, n)` (n = elements each member receives), `ncclAllReduce` and
/// `ncclBroadcast` (root: the group's first member) over n elements; sums for reductions.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NcclCall {
    pub kind: Collective,
    pub send: DevAddr,
    pub recv: DevAddr,
    pub n: usize,
}

/// The NCCL call of one plan collective on one rank: `count` elements of payload (the gathered
/// output of an all-gather, the input of a reduce-scatter, the buffer of an all-reduce or
/// broadcast) over `members` ranks, between the device addresses `input` and `output`.
pub fn nccl_call(
    kind: Collective,
    count: u64,
    members: u64,
    input: DevAddr,
    output: DevAddr,
) -> NcclCall {
    let n = match kind {
        Collective::AllGather | Collective::ReduceScatter => count / members,
        Collective::AllReduce | Collective::Broadcast | Collective::Send | Collective::Recv => {
            count
        }
    } as usize;
    NcclCall {
        kind,
        send: input,
        recv: output,
        n,
    }
}

/// The CUDA library a failed call belongs to; `Backend` for the backend's own checks around the
/// calls (a range outside the arena, a kernel or communicator that is not there).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Library {
    Driver,
    Cublas,
    Nccl,
    Backend,
}

/// Why a call into the CUDA libraries failed: the library, what the backend was doing, and the
/// library's own words (cudarc reports them as text).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CudaError {
    pub library: Library,
    pub what: String,
    pub detail: String,
}

impl CudaError {
    pub fn new(library: Library, what: impl Into<String>, detail: impl std::fmt::Debug) -> Self {
        CudaError {
            library,
            what: what.into(),
            detail: format!("{detail:?}"),
        }
    }

    /// A failure of the backend's own checks, with no library detail.
    pub fn backend(what: impl Into<String>) -> Self {
        CudaError {
            library: Library::Backend,
            what: what.into(),
            detail: String::new(),
        }
    }
}

impl std::fmt::Display for CudaError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.library {
            Library::Backend => f.write_str(&self.what),
            l => write!(f, "{l:?}: {}: {}", self.what, self.detail),
        }
    }
}

impl std::error::Error for CudaError {}

/// A stream's view of the device.
pub trait Exec {
    /// Launches the generated kernel `name` (`Kernel::name`) on `grid` with its arguments in
    /// `Kernel::params` order, then `begin` and `end`.
    fn launch(&self, name: &str, grid: Grid, args: &[A]) -> Result<(), CudaError>;
    fn gemm(&self, call: &ColMajor) -> Result<(), CudaError>;
    /// Copies `bytes` from `src` to `dst` (device addresses), in stream order.
    fn copy_bytes(&self, dst: DevAddr, src: DevAddr, bytes: usize) -> Result<(), CudaError>;
    /// Copies `rows` rows of `width` bytes, `src.pitch` bytes apart at `src`, to rows
    /// `dst.pitch` bytes apart at `dst` (device addresses), in stream order. By default row by
    /// row through [`Exec::copy_bytes`]; a GPU does it in one 2-D copy.
    fn copy_rows(
        &self,
        dst: Pitched,
        src: Pitched,
        width: usize,
        rows: usize,
    ) -> Result<(), CudaError> {
        (0..rows).try_for_each(|r| self.copy_bytes(dst.row(r), src.row(r), width))
    }
    /// Told, before the launch or copy that does it, that the device layer staged `n` values
    /// (`arena_bytes` of the arena) between the arena and workspace: the tests' tally of what
    /// is not computed in place. Nothing by default.
    fn staged(&self, what: Staged, n: usize, arena_bytes: u64) {
        let _ = (what, n, arena_bytes);
    }
}

#[cfg(test)]
#[path = "../../../tests/unit/backend_cuda_enqueue.rs"]
mod tests;
