//! The kernels of `kernels.cu`: compiled by NVRTC for the GPU's architecture the first time,
//! cached as PTX (in `$SCHEDRUN_PTX_CACHE`, else `$XDG_CACHE_HOME/schedrun`, else
//! `~/.cache/schedrun`, keyed by a hash of the source and the architecture), and launched with
//! raw device pointers into the arena and workspace. Compiled, never run on a GPU yet.

use super::device::drv;
use super::enqueue::{CudaError, Grid, Library, A};
use super::rendezvous::fnv1a;
use cudarc::driver::{CudaContext, CudaFunction, CudaStream, LaunchConfig, PushKernelArg};
use cudarc::nvrtc::{compile_ptx_with_opts, CompileOptions, Ptx};
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;

const NAMES: &[&str] = &[
    "flash_forward",
    "flash_backward_dq",
    "flash_backward_dkv",
    "convert",
    "stage",
    "stage_add",
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

/// `kernels.cu` as PTX for `arch` (`compute_90`, …) through NVRTC; needs no GPU.
pub fn compile(arch: &str) -> Result<Ptx, CudaError> {
    let opts = CompileOptions {
        options: vec![format!("--gpu-architecture={arch}")],
        ..Default::default()
    };
    compile_ptx_with_opts(super::kernels_source(), opts)
        .map_err(|e| CudaError::new(Library::Nvrtc, "compiling the kernels", e))
}

impl Kernels {
    pub fn load(ctx: &Arc<CudaContext>) -> Result<Kernels, CudaError> {
        let (major, minor) = ctx
            .compute_capability()
            .map_err(drv("reading the compute capability"))?;
        let arch = format!("compute_{major}{minor}");
        let key = fnv1a(format!("{arch}\n{}", super::kernels_source()).as_bytes());
        let file = cache_dir().join(format!("kernels-{key:016x}.ptx"));
        let ptx = match std::fs::read_to_string(&file) {
            Ok(src) => Ptx::from_src(src),
            Err(_) => {
                let ptx = compile(&arch)?;
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
                    .map_err(|e| CudaError::new(Library::Driver, format!("kernel {n}"), e))?,
            );
        }
        Ok(Kernels { f })
    }

    /// Launches `name` on `stream`.
    pub fn launch(
        &self,
        stream: &CudaStream,
        name: &str,
        grid: Grid,
        args: &[A],
    ) -> Result<(), CudaError> {
        let f = self
            .f
            .get(name)
            .ok_or_else(|| CudaError::backend(format!("no kernel {name}")))?;
        let mut b = stream.launch_builder(f);
        for a in args {
            match a {
                A::P(v) => b.arg(&v.0),
                A::L(v) => b.arg(v),
                A::I(v) => b.arg(v),
                A::F(v) => b.arg(v),
                A::D(v) => b.arg(v),
            };
        }
        // SAFETY: every pointer argument lies inside the arena or the stream's workspace, sized
        // by the caller from the plan and the layer math; the kernels index only within `n`.
        let cfg = LaunchConfig {
            grid_dim: (grid.blocks, 1, 1),
            block_dim: (grid.threads, 1, 1),
            shared_mem_bytes: 0,
        };
        unsafe { b.launch(cfg) }
            .map(|_| ())
            .map_err(|e| CudaError::new(Library::Driver, format!("launching {name}"), e))
    }
}

#[cfg(test)]
mod tests {
    /// NVRTC needs no GPU: wherever libnvrtc loads, `kernels.cu` must compile for the
    /// architectures the backend meets, and the PTX must hold every kernel the backend loads.
    #[test]
    fn nvrtc_compiles_every_kernel() {
        // SAFETY: only tries to open the library.
        if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
            return schedc::testing::skip(
                "nvrtc",
                "NVRTC (libnvrtc.so) is not on the library path",
            );
        }
        for arch in ["compute_80", "compute_90"] {
            let ptx = super::compile(arch).unwrap_or_else(|e| panic!("{arch}: {e}"));
            let text = ptx.to_src();
            for name in super::NAMES {
                assert!(
                    text.contains(&format!(".entry {name}(")),
                    "{arch}: no entry {name} in the PTX"
                );
            }
        }
    }
}
