//! fp32 matrix products through cuBLAS: one handle per stream, running the column-major calls
//! that `enqueue::row_major` derives from the layer math's row-major products. Compiled, never
//! run on a GPU yet.

use super::enqueue::{ColMajor, CudaError, Library};
use cudarc::cublas::result as cb;
use cudarc::cublas::sys::{cublasHandle_t, cublasOperation_t};
use cudarc::driver::CudaStream;

pub struct Blas {
    handle: cublasHandle_t,
}

// SAFETY: a handle is used by one host thread at a time (the step's issuing thread).
unsafe impl Send for Blas {}

impl Blas {
    pub fn new(stream: &CudaStream) -> Result<Blas, CudaError> {
        let handle =
            cb::create_handle().map_err(|e| CudaError::new(Library::Cublas, "cuBLAS", e))?;
        // SAFETY: a fresh handle and a live stream.
        unsafe { cb::set_stream(handle, stream.cu_stream() as _) }
            .map_err(|e| CudaError::new(Library::Cublas, "cuBLAS set_stream", e))?;
        Ok(Blas { handle })
    }

    fn op(t: bool) -> cublasOperation_t {
        if t {
            cublasOperation_t::CUBLAS_OP_T
        } else {
            cublasOperation_t::CUBLAS_OP_N
        }
    }

    /// Runs one column-major call (see [`super::enqueue::row_major`]).
    pub fn run(&self, c: &ColMajor) -> Result<(), CudaError> {
        let i = |x: usize| x as i32;
        // SAFETY: the caller sizes every operand from the layer math inside the arena or its
        // workspace; alpha and beta are host scalars that outlive the call.
        unsafe {
            if c.batch == 1 {
                cb::sgemm(
                    self.handle,
                    Self::op(c.transa),
                    Self::op(c.transb),
                    i(c.m),
                    i(c.n),
                    i(c.k),
                    &c.alpha,
                    c.a.0 as *const f32,
                    i(c.lda),
                    c.b.0 as *const f32,
                    i(c.ldb),
                    &c.beta,
                    c.c.0 as *mut f32,
                    i(c.ldc),
                )
            } else {
                cb::sgemm_strided_batched(
                    self.handle,
                    Self::op(c.transa),
                    Self::op(c.transb),
                    i(c.m),
                    i(c.n),
                    i(c.k),
                    &c.alpha,
                    c.a.0 as *const f32,
                    i(c.lda),
                    c.stride_a as i64,
                    c.b.0 as *const f32,
                    i(c.ldb),
                    c.stride_b as i64,
                    &c.beta,
                    c.c.0 as *mut f32,
                    i(c.ldc),
                    c.stride_c as i64,
                    i(c.batch),
                )
            }
        }
        .map_err(|e| CudaError::new(Library::Cublas, "cuBLAS sgemm", e))
    }
}

impl Drop for Blas {
    fn drop(&mut self) {
        // SAFETY: the handle was created by `new` and is destroyed once.
        let _ = unsafe { cb::destroy_handle(self.handle) };
    }
}
