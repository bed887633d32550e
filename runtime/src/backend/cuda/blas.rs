//! Row-major fp32 matrix products through cuBLAS (which is column-major): a row-major
//! C = op(A)·op(B) is the column-major Cᵀ = op(B)ᵀ·op(A)ᵀ, so every call swaps the operands.
//! One handle per stream. Compiled, never run on a GPU yet.

use cudarc::cublas::result as cb;
use cudarc::cublas::sys::{cublasHandle_t, cublasOperation_t};
use cudarc::driver::CudaStream;

/// A row-major matrix operand: device pointer, leading dimension (elements between rows), and
/// whether it is used transposed.
#[derive(Clone, Copy, Debug)]
pub struct M {
    pub ptr: u64,
    pub ld: usize,
    pub t: bool,
}

pub fn m(ptr: u64, ld: usize) -> M {
    M { ptr, ld, t: false }
}

pub fn mt(ptr: u64, ld: usize) -> M {
    M { ptr, ld, t: true }
}

pub struct Blas {
    handle: cublasHandle_t,
}

// SAFETY: a handle is used by one host thread at a time (the step's issuing thread).
unsafe impl Send for Blas {}

impl Blas {
    pub fn new(stream: &CudaStream) -> Result<Blas, String> {
        let handle = cb::create_handle().map_err(|e| format!("cuBLAS: {e:?}"))?;
        // SAFETY: a fresh handle and a live stream.
        unsafe { cb::set_stream(handle, stream.cu_stream() as _) }
            .map_err(|e| format!("cuBLAS set_stream: {e:?}"))?;
        Ok(Blas { handle })
    }

    fn op(t: bool) -> cublasOperation_t {
        if t {
            cublasOperation_t::CUBLAS_OP_T
        } else {
            cublasOperation_t::CUBLAS_OP_N
        }
    }

    /// C[rows × cols] ← α·op(A)[rows × k]·op(B)[k × cols] + β·C, row-major, C's rows `ldc` apart.
    #[allow(clippy::too_many_arguments)]
    pub fn gemm(
        &self,
        rows: usize,
        cols: usize,
        k: usize,
        alpha: f32,
        a: M,
        b: M,
        beta: f32,
        c: u64,
        ldc: usize,
    ) -> Result<(), String> {
        self.batched(rows, cols, k, alpha, a, 0, b, 0, beta, c, ldc, 0, 1)
    }

    /// `batch` products with element strides between consecutive A, B and C (0 reuses one).
    #[allow(clippy::too_many_arguments)]
    pub fn batched(
        &self,
        rows: usize,
        cols: usize,
        k: usize,
        alpha: f32,
        a: M,
        stride_a: usize,
        b: M,
        stride_b: usize,
        beta: f32,
        c: u64,
        ldc: usize,
        stride_c: usize,
        batch: usize,
    ) -> Result<(), String> {
        if rows == 0 || cols == 0 || batch == 0 {
            return Ok(());
        }
        let i = |x: usize| x as i32;
        // SAFETY: the caller sizes every operand from the layer math inside the arena or its
        // workspace; alpha and beta are host scalars that outlive the call.
        unsafe {
            if batch == 1 {
                cb::sgemm(
                    self.handle,
                    Self::op(b.t),
                    Self::op(a.t),
                    i(cols),
                    i(rows),
                    i(k),
                    &alpha,
                    b.ptr as *const f32,
                    i(b.ld),
                    a.ptr as *const f32,
                    i(a.ld),
                    &beta,
                    c as *mut f32,
                    i(ldc),
                )
            } else {
                cb::sgemm_strided_batched(
                    self.handle,
                    Self::op(b.t),
                    Self::op(a.t),
                    i(cols),
                    i(rows),
                    i(k),
                    &alpha,
                    b.ptr as *const f32,
                    i(b.ld),
                    stride_b as i64,
                    a.ptr as *const f32,
                    i(a.ld),
                    stride_a as i64,
                    &beta,
                    c as *mut f32,
                    i(ldc),
                    stride_c as i64,
                    i(batch),
                )
            }
        }
        .map_err(|e| format!("cuBLAS sgemm: {e:?}"))
    }
}

impl Drop for Blas {
    fn drop(&mut self) {
        // SAFETY: the handle was created by `new` and is destroyed once.
        let _ = unsafe { cb::destroy_handle(self.handle) };
    }
}
