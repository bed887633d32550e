//! The generated kernels on the GPU: the plan's PTX module for this device's architecture
//! (`ptx.rs` finds, reads and checks it), loaded by the driver from its text (no NVRTC: cudarc's
//! `Ptx` type is only the wrapper `load_module` takes), one function per kernel `for_job`
//! lists, all looked up before the first step, and launched by name with raw arguments.
//! Run on one H200 (the GPU checklist, 2026-11-26).

use super::device::drv;
use super::enqueue::{CudaError, Grid, Library, A};
use super::ptx::{read_module, sm_for, PtxFiles};
use crate::plan::Plan;
use cudarc::driver::{CudaContext, CudaFunction, CudaStream, LaunchConfig, PushKernelArg};
use cudarc::nvrtc::Ptx;
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;

pub struct Kernels {
    /// The module's file, for messages.
    path: PathBuf,
    f: HashMap<String, CudaFunction>,
}

impl Kernels {
    /// Loads the module of `files` for this context's device and every kernel `plan` needs.
    pub fn load(
        ctx: &Arc<CudaContext>,
        files: &PtxFiles,
        plan: &Plan,
    ) -> Result<Kernels, CudaError> {
        let (major, minor) = ctx
            .compute_capability()
            .map_err(drv("reading the compute capability"))?;
        let sm = sm_for(major, minor)?;
        let wanted = sched_kernels::for_job(&plan.job);
        let (path, text) = read_module(files, sm, &plan.job.schedule.name, &wanted)?;
        let module = ctx.load_module(Ptx::from_src(text)).map_err(|e| {
            CudaError::new(Library::Driver, format!("loading {}", path.display()), e)
        })?;
        let mut f = HashMap::new();
        for k in &wanted {
            let name = k.name();
            let function = module.load_function(&name).map_err(|e| {
                CudaError::new(
                    Library::Driver,
                    format!("kernel {name} of {}", path.display()),
                    e,
                )
            })?;
            f.insert(name, function);
        }
        Ok(Kernels { path, f })
    }

    /// Launches `name` on `stream`.
    pub fn launch(
        &self,
        stream: &CudaStream,
        name: &str,
        grid: Grid,
        args: &[A],
    ) -> Result<(), CudaError> {
        let f = self.f.get(name).ok_or_else(|| {
            CudaError::backend(format!(
                "kernel {name} is not among those loaded from {} (sched_kernels::for_job does \
                 not list it: a bug)",
                self.path.display()
            ))
        })?;
        let mut b = stream.launch_builder(f);
        for a in args {
            match a {
                A::P(v) => b.arg(&v.0),
                A::L(v) => b.arg(v),
                A::F(v) => b.arg(v),
                A::D(v) => b.arg(v),
            };
        }
        let cfg = LaunchConfig {
            grid_dim: (grid.blocks, 1, 1),
            block_dim: (grid.threads, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: the arguments are the kernel's parameters in order (`gpu.rs` checks them
        // against `Kernel::params`), every pointer lies inside the arena, the stream's
        // workspace or the constants, sized by the caller from the plan and the layer math, and
        // the kernel touches only what its index range `begin..end` covers.
        unsafe { b.launch(cfg) }
            .map(|_| ())
            .map_err(|e| CudaError::new(Library::Driver, format!("launching {name}"), e))
    }
}
