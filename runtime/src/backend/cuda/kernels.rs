//! The kernels of `kernels.cu`: compiled by NVRTC for the GPU's architecture the first time,
//! cached as PTX (in `$SCHEDRUN_PTX_CACHE`, else `$XDG_CACHE_HOME/schedrun`, else
//! `~/.cache/schedrun`, keyed by a hash of the source and the architecture), and launched with
//! raw device pointers into the arena and workspace. Compiled, never run on a GPU yet.

use super::device::drv;
use super::rendezvous::fnv1a;
use cudarc::driver::{CudaContext, CudaFunction, CudaStream, LaunchConfig, PushKernelArg};
use cudarc::nvrtc::{compile_ptx_with_opts, CompileOptions, Ptx};
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;

pub const SOURCE: &str = include_str!("kernels.cu");

const NAMES: &[&str] = &[
    "load",
    "store",
    "add_store",
    "store_halves",
    "load_halves",
    "round_in_place",
    "fill",
    "bias_add",
    "col_sums",
    "embedding_forward",
    "embedding_backward",
    "norm_forward",
    "norm_backward_input",
    "norm_backward_params",
    "gelu_forward",
    "gelu_backward",
    "swiglu_forward",
    "swiglu_backward",
    "rope",
    "causal_softmax",
    "probs_from_lse",
    "softmax_backward",
    "cross_entropy",
    "adam",
    "sgd",
    "sum_squares",
    "store_double",
];

/// One kernel argument (all are scalars or raw device pointers).
#[derive(Clone, Copy, Debug)]
pub enum A {
    /// A device pointer (0 for NULL).
    P(u64),
    L(i64),
    I(i32),
    F(f32),
    D(f64),
}

pub struct Kernels {
    f: HashMap<&'static str, CudaFunction>,
}

fn cache_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("SCHEDRUN_PTX_CACHE") {
        return PathBuf::from(d);
    }
    if let Some(d) = std::env::var_os("XDG_CACHE_HOME") {
        return PathBuf::from(d).join("schedrun");
    }
    let home = std::env::var_os("HOME").unwrap_or_else(|| ".".into());
    PathBuf::from(home).join(".cache/schedrun")
}

impl Kernels {
    pub fn load(ctx: &Arc<CudaContext>) -> Result<Kernels, String> {
        let (major, minor) = ctx
            .compute_capability()
            .map_err(drv("reading the compute capability"))?;
        let arch = format!("compute_{major}{minor}");
        let key = fnv1a(format!("{arch}\n{SOURCE}").as_bytes());
        let file = cache_dir().join(format!("kernels-{key:016x}.ptx"));
        let ptx = match std::fs::read_to_string(&file) {
            Ok(src) => Ptx::from_src(src),
            Err(_) => {
                let opts = CompileOptions {
                    options: vec![format!("--gpu-architecture={arch}")],
                    ..Default::default()
                };
                let ptx = compile_ptx_with_opts(SOURCE, opts)
                    .map_err(|e| format!("NVRTC cannot compile the kernels: {e:?}"))?;
                // A cache that cannot be written only costs a compile next time.
                let _ = std::fs::create_dir_all(cache_dir())
                    .and_then(|()| std::fs::write(&file, ptx.to_src()));
                ptx
            }
        };
        let module = ctx
            .load_module(ptx)
            .map_err(drv("loading the kernels' PTX"))?;
        let mut f = HashMap::new();
        for &n in NAMES {
            f.insert(
                n,
                module
                    .load_function(n)
                    .map_err(|e| format!("kernel {n}: {e:?}"))?,
            );
        }
        Ok(Kernels { f })
    }

    /// Launches `name` on `stream`.
    pub fn launch(
        &self,
        stream: &CudaStream,
        name: &str,
        cfg: LaunchConfig,
        args: &[A],
    ) -> Result<(), String> {
        let f = self
            .f
            .get(name)
            .ok_or_else(|| format!("no kernel {name}"))?;
        let mut b = stream.launch_builder(f);
        for a in args {
            match a {
                A::P(v) => b.arg(v),
                A::L(v) => b.arg(v),
                A::I(v) => b.arg(v),
                A::F(v) => b.arg(v),
                A::D(v) => b.arg(v),
            };
        }
        // SAFETY: every pointer argument lies inside the arena or the stream's workspace, sized
        // by the caller from the plan and the layer math; the kernels index only within `n`.
        unsafe { b.launch(cfg) }
            .map(|_| ())
            .map_err(|e| format!("launching {name}: {e:?}"))
    }
}

const THREADS: u32 = 256;

/// A grid-stride launch over `n` elements.
pub fn elems(n: usize) -> LaunchConfig {
    let blocks = (n as u64).div_ceil(u64::from(THREADS)).clamp(1, 1 << 16) as u32;
    LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// One block of 256 threads per row (the row kernels assume exactly 256).
pub fn rows(n: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (n.max(1) as u32, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// The dtype code of `kernels.cu`.
pub fn dtype_code(d: schedc::job::Dtype) -> i32 {
    match d {
        schedc::job::Dtype::Fp32 => 0,
        schedc::job::Dtype::Bf16 => 1,
        schedc::job::Dtype::Fp16 => 2,
    }
}

/// The rounding code of `kernels.cu` for a [`crate::math::Precision`].
pub fn prec_code(p: crate::math::Precision) -> i32 {
    match p {
        crate::math::Precision::F32 => 0,
        crate::math::Precision::Bf16 => 1,
        crate::math::Precision::F16 => 2,
    }
}
