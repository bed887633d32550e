//! Matrix products on a stream, the column-major calls that `enqueue::row_major` derives from
//! the layer math's row-major products: fp32 operands through cuBLAS `sgemm`, bf16 and fp16
//! operands through cuBLASLt on tensor cores (fp32 accumulation; C and D fp32 or the operands'
//! dtype, a bias in the epilogue). Operands lie in the arena in place or in workspace. One of
//! each handle per stream; both use the GEMM part of the stream's planned workspace, in the
//! arena (a stream runs one product at a time), and allocate nothing of their own. Run on one
//! H200 (2026-11-26): bf16 products on cuBLASLt's sm90 kernels.

use super::enqueue::DevAddr;
use super::enqueue::{ColMajor, CudaError, Library};
use cudarc::cublas::result as cb;
use cudarc::cublas::sys::{cublasHandle_t, cublasOperation_t};
use cudarc::cublaslt::{result as lt, sys as lts};
use cudarc::driver::CudaStream;
use sched_ir::job::Dtype;
use std::cell::RefCell;
use std::collections::hash_map::{Entry, HashMap};
use std::sync::Arc;

pub struct Blas {
    handle: cublasHandle_t,
    lt: Lt,
    stream: lts::cudaStream_t,
}

// SAFETY: a handle is used by one host thread at a time (the step's issuing thread).
unsafe impl Send for Blas {}

impl Blas {
    /// Handles on `stream` whose workspace is the `bytes` at `workspace` (256-byte aligned: the
    /// arena's start is, and so is every planned offset; none when `bytes` is 0).
    pub fn new(
        stream: &Arc<CudaStream>,
        workspace: DevAddr,
        bytes: usize,
    ) -> Result<Blas, CudaError> {
        let handle =
            cb::create_handle().map_err(|e| CudaError::new(Library::Cublas, "cuBLAS", e))?;
        let workspace = if bytes == 0 { DevAddr::NULL } else { workspace };
        // SAFETY: a fresh handle and a live stream; the workspace lies in the arena, which
        // outlives the handle, and only this stream's products use it.
        unsafe {
            cb::set_stream(handle, stream.cu_stream() as _)
                .map_err(|e| CudaError::new(Library::Cublas, "cuBLAS set_stream", e))?;
            cudarc::cublas::sys::cublasSetWorkspace_v2(handle, workspace.0 as *mut _, bytes)
                .result()
                .map_err(|e| CudaError::new(Library::Cublas, "cuBLAS set_workspace", e))?;
        }
        Ok(Blas {
            handle,
            lt: Lt::new(workspace, bytes)?,
            stream: stream.cu_stream() as _,
        })
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
        if c.operands != Dtype::Fp32 {
            return self.lt.run(c, self.stream);
        }
        if c.output != Dtype::Fp32 || c.bias.is_some() {
            return Err(CudaError::backend(
                "sgemm writes fp32 without a bias epilogue",
            ));
        }
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

/// 16-bit products through cuBLASLt: bf16 or fp16 A and B on tensor cores, C and D fp32 or the
/// operands' dtype (α·AB + β·C (+ bias) in f32, rounded once), fp32 accumulation and scalars. A call's descriptors and algorithm (cuBLASLt's heuristic, which
/// costs host time) are made once per shape and kept.
struct Lt {
    handle: lts::cublasLtHandle_t,
    /// The stream's GEMM workspace (the cluster's `gemm_workspace`, 32 MiB by default, NVIDIA's
    /// recommendation for Hopper) in the arena, and its bytes.
    workspace_at: u64,
    workspace_bytes: usize,
    plans: RefCell<HashMap<LtKey, LtPlan>>,
}

/// What fixes a product's descriptors and algorithm: the call without its pointers and
/// scalars, the bias's dtype (the epilogue), and every matrix's alignment (operands in the
/// arena are used in place, at whatever alignment their offset gives).
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
struct LtKey {
    operands: Dtype,
    output: Dtype,
    bias: Option<Dtype>,
    a_align: u32,
    b_align: u32,
    transa: bool,
    transb: bool,
    mnk: [usize; 3],
    ld: [usize; 3],
    stride: [usize; 3],
    batch: usize,
    c_align: u32,
}

/// The largest power of two up to 256 dividing a device address (cuBLASLt's alignment
/// preferences, in bytes).
fn alignment(addr: u64) -> u32 {
    1 << addr.trailing_zeros().min(8)
}

/// cuBLASLt's data type for a dtype.
fn lt_type(d: Dtype) -> lts::cudaDataType {
    match d {
        Dtype::Fp32 => lts::cudaDataType::CUDA_R_32F,
        Dtype::Bf16 => lts::cudaDataType::CUDA_R_16BF,
        Dtype::Fp16 => lts::cudaDataType::CUDA_R_16F,
    }
}

struct LtPlan {
    desc: lts::cublasLtMatmulDesc_t,
    layouts: [lts::cublasLtMatrixLayout_t; 3],
    algo: lts::cublasLtMatmulAlgo_t,
}

fn lt_err(what: &'static str) -> impl Fn(cudarc::cublaslt::result::CublasError) -> CudaError {
    move |e| CudaError::new(Library::Cublas, what, e)
}

impl Lt {
    fn new(workspace: DevAddr, bytes: usize) -> Result<Lt, CudaError> {
        let handle = lt::create_handle().map_err(lt_err("cuBLASLt"))?;
        Ok(Lt {
            handle,
            workspace_at: workspace.0,
            workspace_bytes: bytes,
            plans: RefCell::new(HashMap::new()),
        })
    }

    fn key(c: &ColMajor) -> LtKey {
        LtKey {
            operands: c.operands,
            output: c.output,
            bias: c.bias.map(|(_, d)| d),
            a_align: alignment(c.a.0),
            b_align: alignment(c.b.0),
            transa: c.transa,
            transb: c.transb,
            mnk: [c.m, c.n, c.k],
            ld: [c.lda, c.ldb, c.ldc],
            stride: [c.stride_a, c.stride_b, c.stride_c],
            batch: c.batch,
            c_align: alignment(c.c.0),
        }
    }

    /// A column-major matrix layout of `rows` × `cols`, `ld` apart, `batch` of them `stride` apart.
    fn layout(
        dtype: lts::cudaDataType,
        rows: usize,
        cols: usize,
        ld: usize,
        stride: usize,
        batch: usize,
    ) -> Result<lts::cublasLtMatrixLayout_t, CudaError> {
        let l = lt::create_matrix_layout(dtype, rows as u64, cols as u64, ld as i64)
            .map_err(lt_err("cuBLASLt layout"))?;
        if batch > 1 {
            let (count, offset) = (batch as i32, stride as i64);
            // SAFETY: a live layout; the attribute values are the documented types.
            unsafe {
                lt::set_matrix_layout_attribute(
                    l,
                    lts::cublasLtMatrixLayoutAttribute_t::CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT,
                    (&count as *const i32).cast(),
                    std::mem::size_of::<i32>(),
                )
                .and_then(|()| {
                    lt::set_matrix_layout_attribute(
                        l,
                        lts::cublasLtMatrixLayoutAttribute_t::CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET,
                        (&offset as *const i64).cast(),
                        std::mem::size_of::<i64>(),
                    )
                })
            }
            .map_err(lt_err("cuBLASLt batch layout"))?;
        }
        Ok(l)
    }

    fn plan(&self, c: &ColMajor, key: &LtKey) -> Result<LtPlan, CudaError> {
        use lts::cublasLtMatmulDescAttributes_t as D;
        use lts::cublasLtMatmulPreferenceAttributes_t as P;
        if c.operands == Dtype::Fp32 {
            return Err(CudaError::backend("cuBLASLt runs the 16-bit products only"));
        }
        let ab = lt_type(c.operands);
        let f32t = lts::cudaDataType::CUDA_R_32F;
        let desc = lt::create_matmul_desc(lts::cublasComputeType_t::CUBLAS_COMPUTE_32F, f32t)
            .map_err(lt_err("cuBLASLt matmul descriptor"))?;
        // cublasOperation_t: 0 = N, 1 = T.
        let (ta, tb) = (i32::from(c.transa), i32::from(c.transb));
        let (ma, ka) = if c.transa { (c.k, c.m) } else { (c.m, c.k) };
        let (kb, nb) = if c.transb { (c.n, c.k) } else { (c.k, c.n) };
        let layouts = [
            Self::layout(ab, ma, ka, c.lda, c.stride_a, c.batch)?,
            Self::layout(ab, kb, nb, c.ldb, c.stride_b, c.batch)?,
            Self::layout(lt_type(c.output), c.m, c.n, c.ldc, c.stride_c, c.batch)?,
        ];
        if let Some(bias) = key.bias {
            let epilogue = lts::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_BIAS;
            let dtype = lt_type(bias);
            // SAFETY: a live descriptor; each attribute value is the documented type.
            unsafe {
                lt::set_matmul_desc_attribute(
                    desc,
                    D::CUBLASLT_MATMUL_DESC_EPILOGUE,
                    (&epilogue as *const lts::cublasLtEpilogue_t).cast(),
                    std::mem::size_of::<lts::cublasLtEpilogue_t>(),
                )
                .and_then(|()| {
                    lt::set_matmul_desc_attribute(
                        desc,
                        D::CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE,
                        (&dtype as *const lts::cudaDataType).cast(),
                        std::mem::size_of::<lts::cudaDataType>(),
                    )
                })
            }
            .map_err(lt_err("cuBLASLt bias epilogue"))?;
        }
        let pref = lt::create_matmul_pref().map_err(lt_err("cuBLASLt preference"))?;
        let size = self.workspace_bytes;
        // SAFETY: live descriptors; each attribute value is the documented type.
        let algo = unsafe {
            let set =
                |a: D, v: &i32| lt::set_matmul_desc_attribute(desc, a, (v as *const i32).cast(), 4);
            set(D::CUBLASLT_MATMUL_DESC_TRANSA, &ta)
                .and_then(|()| set(D::CUBLASLT_MATMUL_DESC_TRANSB, &tb))
                .and_then(|()| {
                    lt::set_matmul_pref_attribute(
                        pref,
                        P::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                        (&size as *const usize).cast(),
                        std::mem::size_of::<usize>(),
                    )
                })
                .and_then(|()| {
                    [
                        (P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, key.a_align),
                        (P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, key.b_align),
                        (P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, key.c_align),
                        (P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, key.c_align),
                    ]
                    .into_iter()
                    .try_for_each(|(a, align)| {
                        lt::set_matmul_pref_attribute(pref, a, (&align as *const u32).cast(), 4)
                    })
                })
                .and_then(|()| {
                    lt::get_matmul_algo_heuristic(
                        self.handle,
                        desc,
                        layouts[0],
                        layouts[1],
                        layouts[2],
                        layouts[2],
                        pref,
                    )
                })
                .map(|h| h.algo)
        };
        // SAFETY: created above and used by nothing else.
        let _ = unsafe { lt::destroy_matmul_pref(pref) };
        let algo = algo.map_err(lt_err("cuBLASLt algorithm for a product"))?;
        Ok(LtPlan {
            desc,
            layouts,
            algo,
        })
    }

    fn run(&self, c: &ColMajor, stream: lts::cudaStream_t) -> Result<(), CudaError> {
        let key = Self::key(c);
        let mut plans = self.plans.borrow_mut();
        let p = match plans.entry(key) {
            Entry::Occupied(o) => o.into_mut(),
            Entry::Vacant(v) => v.insert(self.plan(c, &key)?),
        };
        if let Some((bias, _)) = c.bias {
            let at: u64 = bias.0;
            // SAFETY: a live descriptor, used by this stream's host thread only; the bias lies
            // in the arena.
            unsafe {
                lt::set_matmul_desc_attribute(
                    p.desc,
                    lts::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                    (&at as *const u64).cast(),
                    std::mem::size_of::<u64>(),
                )
            }
            .map_err(lt_err("cuBLASLt bias pointer"))?;
        }
        // SAFETY: the operands and C lie in the arena or the stream's workspace (the caller
        // sizes them), the descriptors are live, alpha and beta outlive the call, and the
        // workspace is this stream's.
        unsafe {
            lt::matmul(
                self.handle,
                p.desc,
                (&c.alpha as *const f32).cast(),
                (&c.beta as *const f32).cast(),
                c.a.0 as *const _,
                p.layouts[0],
                c.b.0 as *const _,
                p.layouts[1],
                c.c.0 as *const _,
                p.layouts[2],
                c.c.0 as *mut _,
                p.layouts[2],
                &p.algo,
                self.workspace_at as *mut _,
                self.workspace_bytes,
                stream,
            )
        }
        .map_err(lt_err("cuBLASLt matmul"))
    }
}

impl Drop for Lt {
    fn drop(&mut self) {
        // SAFETY: every descriptor and the handle were created by this value, destroyed once.
        unsafe {
            for p in self.plans.get_mut().values() {
                let _ = lt::destroy_matmul_desc(p.desc);
                for l in p.layouts {
                    let _ = lt::destroy_matrix_layout(l);
                }
            }
            let _ = lt::destroy_handle(self.handle);
        }
    }
}
