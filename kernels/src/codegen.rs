//! LLVM IR for the generated kernels and its two targets (the `llvm` feature).
//!
//! [`ptx`] builds a module of every kernel asked for, for `nvptx64-nvidia-cuda` at one SM
//! version, and returns its PTX text. [`HostKernels::jit`] builds the same bodies for the
//! processor this runs on and JIT-compiles them (MCJIT), handing out each kernel's entry
//! address. Both call [`body`](super::codegen) once per kernel: the body is an internal
//! `alwaysinline` function of the index and the parameters; the wrappers differ only in how
//! they walk `begin..end` (a loop on the host, a grid-stride loop on the GPU, over warps for a
//! cooperative op, four indices an iteration for an [`super::Op::unrolled`] op on the GPU; a
//! column op's rows outside its columns on the host) and in the calling convention
//! (`ptx_kernel` on the GPU).
//!
//! Bodies live in [`bodies`](self::bodies); the arithmetic helpers they use (storage
//! conversions, `exp`, `tanh`, loops, accumulators, lanes) in [`fx`](self::fx). Target
//! differences are confined to [`Target`]: how `ln` and `exp` are computed (libm's `logf` and
//! the Rust math's `exp` on the host, so the host kernels match the Rust math bit for bit;
//! `lg2.approx` and `ex2.approx` on the GPU), the thread-index registers, a cooperative index's
//! lanes (a warp on the GPU, one on the host) and how lanes add into one place (atomically on
//! the GPU).
//!
//! A third target checks the GPU's lane code without a GPU: [`HostKernels::jit_warp`] builds
//! the bodies for this processor with a GPU's lanes ([`Target::Warp`]), which
//! [`HostKernels::run_warp`] runs as 32 threads meeting at the warp's shuffles and matrix
//! products ([`warp`](self::warp)). The fused attention's kernels run so give their models'
//! bits exactly.

mod attention;
mod bodies;
mod flash;
mod fx;
mod rows;
mod warp;

use super::{Kernel, Param, Space, COLUMN_LANES, WARP};
use fx::{Fx, I};
use inkwell::attributes::{Attribute, AttributeLoc};
use inkwell::context::Context;
use inkwell::execution_engine::ExecutionEngine;
use inkwell::module::{Linkage, Module};
use inkwell::passes::PassBuilderOptions;
use inkwell::targets::{
    CodeModel, FileType, InitializationConfig, RelocMode, Target as LlvmTarget, TargetMachine,
    TargetTriple,
};
use inkwell::types::BasicMetadataTypeEnum;
use inkwell::values::FunctionValue;
use inkwell::IntPredicate;
use inkwell::OptimizationLevel;
use std::collections::HashMap;
use std::fmt;

/// The GPU architectures the PTX is written for.
pub const SMS: [u32; 2] = [80, 90];

/// PTX ISA version of the emitted modules: 7.8 is the first with sm_90 and is loaded by every
/// driver since CUDA 11.8.
pub const PTX_FEATURES: &str = "+ptx78";

/// LLVM's number for the `ptx_kernel` calling convention.
const PTX_KERNEL_CC: u32 = 71;

/// Where a module's code runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Target {
    /// `nvptx64-nvidia-cuda` at `sm_XX`.
    Ptx { sm: u32 },
    /// The processor running this process.
    Host,
    /// The processor running this process, as a GPU warp: the GPU's lanes (a warp per row),
    /// each an OS thread running the body in lockstep with the others at the warp's shuffles
    /// and matrix products ([`warp`]), which are calls here. What checks the GPU's lane code,
    /// the fused attention's included, without a GPU ([`HostKernels::jit_warp`]); `exp` and
    /// `ln` are the host's.
    Warp,
}

impl Target {
    /// Whether a kernel entry of `op` walks its rows itself, outside its columns: the host's
    /// column ops, each row then read along its length rather than a column down a row-sized
    /// stride ([`Fx::column_rows`] runs the body at the entry's row).
    pub(crate) fn walks_rows_outside(self, op: super::Op) -> bool {
        self == Target::Host && op.space() == Space::Columns
    }
}

/// Why code could not be generated or a generated kernel could not run.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum CodegenError {
    /// LLVM refused a step (`doing`), in its own words.
    #[error("kernel code generation: {doing}: {llvm}")]
    Llvm { doing: &'static str, llvm: String },
    /// LLVM has no target machine for the triple and processor.
    #[error("kernel code generation: no target machine for {triple} {cpu}")]
    NoMachine { triple: String, cpu: String },
    /// The PTX LLVM wrote is not text.
    #[error("kernel code generation: the PTX is not UTF-8")]
    PtxNotText,
    /// A kernel a host warp cannot run (it needs more lanes than a warp has).
    #[error("kernel code generation: {kernel}: a warp on the host runs row and element ops")]
    NotForAWarp { kernel: String },
    /// A kernel the JIT build does not hold.
    #[error("kernel code generation: {kernel} was not compiled")]
    NotCompiled { kernel: String },
    /// A launch whose arguments do not match the kernel's parameters.
    #[error("kernel code generation: {kernel} takes {takes} arguments, {given} given")]
    Arguments {
        kernel: String,
        takes: usize,
        given: usize,
    },
}

/// [`CodegenError::Llvm`] for LLVM's error `e` while `doing`.
fn llvm(doing: &'static str) -> impl Fn(&dyn fmt::Display) -> CodegenError {
    move |e| CodegenError::Llvm {
        doing,
        llvm: e.to_string(),
    }
}

/// The PTX of `kernels` for `sm_{sm}`, optimised (O3).
pub fn ptx(kernels: &[Kernel], sm: u32) -> Result<String, CodegenError> {
    let ctx = Context::create();
    let target = Target::Ptx { sm };
    let module = build(&ctx, kernels, target, Loops::Gpu)?;
    let tm = machine(target)?;
    optimise(&module, &tm)?;
    let buf = tm
        .write_to_memory_buffer(&module, FileType::Assembly)
        .map_err(|e| llvm("writing PTX")(&e))?;
    String::from_utf8(buf.as_slice().to_vec()).map_err(|_| CodegenError::PtxNotText)
}

/// The optimised LLVM IR text of `kernels` for `target` (for inspection and tests).
pub fn ir(kernels: &[Kernel], target: Target) -> Result<String, CodegenError> {
    let ctx = Context::create();
    let module = build(&ctx, kernels, target, Loops::of(target))?;
    optimise(&module, &machine(target)?)?;
    Ok(module.print_to_string().to_string())
}

fn machine(target: Target) -> Result<TargetMachine, CodegenError> {
    let (triple, cpu, features) = match target {
        Target::Ptx { sm } => {
            LlvmTarget::initialize_nvptx(&InitializationConfig::default());
            (
                TargetTriple::create("nvptx64-nvidia-cuda"),
                format!("sm_{sm}"),
                PTX_FEATURES.to_string(),
            )
        }
        Target::Host | Target::Warp => {
            LlvmTarget::initialize_native(&InitializationConfig::default())
                .map_err(|e| llvm("initialising the host target")(&e))?;
            (
                TargetMachine::get_default_triple(),
                host_cpu().0,
                host_cpu().1,
            )
        }
    };
    let t = LlvmTarget::from_triple(&triple).map_err(|e| llvm("finding the target")(&e))?;
    t.create_target_machine(
        &triple,
        &cpu,
        &features,
        OptimizationLevel::Aggressive,
        RelocMode::Default,
        CodeModel::Default,
    )
    .ok_or_else(|| CodegenError::NoMachine {
        triple: format!("{triple:?}"),
        cpu,
    })
}

fn host_cpu() -> (String, String) {
    (
        TargetMachine::get_host_cpu_name().to_string(),
        TargetMachine::get_host_cpu_features().to_string(),
    )
}

/// Compiles `f` for this processor, with the widest vectors it has: LLVM tunes server CPUs with
/// AVX-512 to prefer 256-bit vectors, with which GELU over 1M fp32 elements from cold caches
/// took 1.23-1.33 ms against 0.99 ms with 512-bit ones (the Rust math's `math::ops::wide`
/// runs AVX-512: 0.94-1.12 ms).
fn for_this_cpu(ctx: &Context, f: FunctionValue<'_>) {
    let (cpu, features) = host_cpu();
    for (key, value) in [
        ("target-cpu", cpu.as_str()),
        ("target-features", features.as_str()),
        ("prefer-vector-width", "512"),
    ] {
        f.add_attribute(
            AttributeLoc::Function,
            ctx.create_string_attribute(key, value),
        );
    }
}

fn optimise(module: &Module<'_>, tm: &TargetMachine) -> Result<(), CodegenError> {
    module
        .verify()
        .map_err(|e| llvm("verifying the module")(&e))?;
    module
        .run_passes("default<O3>", tm, PassBuilderOptions::create())
        .map_err(|e| llvm("optimising")(&e))
}

/// How a kernel's entry walks its indices.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Loops {
    /// One index at a time (the host's loops, which LLVM vectorises).
    Plain,
    /// As on the GPU: an [`super::Op::unrolled`] op [`super::UNROLL`] indices an iteration, loads
    /// first, counted in 32 bits when they fit (the PTX target; on the host, to test it).
    Gpu,
}

impl Loops {
    fn of(target: Target) -> Self {
        match target {
            Target::Ptx { .. } => Loops::Gpu,
            Target::Host | Target::Warp => Loops::Plain,
        }
    }
}

/// How a kernel's entry walks `begin..end`: the one place that decides it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Walk {
    /// An [`super::Op::unrolled`] op with the GPU's loops: [`super::UNROLL`] indices an
    /// iteration, counted in 32 bits when they fit.
    Unrolled,
    /// An [`super::Op::prefetched`] op on the host: blocks of [`super::PREFETCH_BLOCK`], the
    /// next block hinted first.
    Prefetched,
    /// A column op on the host: rows outside, columns inside ([`Target::walks_rows_outside`]).
    RowsOutside,
    /// One index at a time, by the target's stride.
    Strided,
}

impl Walk {
    fn of(op: super::Op, target: Target, loops: Loops) -> Self {
        if op.unrolled() && loops == Loops::Gpu {
            Walk::Unrolled
        } else if target == Target::Host && op.prefetched() {
            Walk::Prefetched
        } else if target.walks_rows_outside(op) {
            Walk::RowsOutside
        } else {
            Walk::Strided
        }
    }
}

/// A module holding every kernel of `kernels` (each once) for `target`.
fn build<'c>(
    ctx: &'c Context,
    kernels: &[Kernel],
    target: Target,
    loops: Loops,
) -> Result<Module<'c>, CodegenError> {
    let module = ctx.create_module("sched_kernels");
    if let Target::Ptx { .. } = target {
        module.set_triple(&TargetTriple::create("nvptx64-nvidia-cuda"));
    }
    let mut seen = std::collections::HashSet::new();
    for k in on(kernels, target) {
        if seen.insert(k.name()) {
            kernel(ctx, &module, k, target, loops)?;
        }
    }
    Ok(module)
}

/// The kernels of `kernels` that exist on `target`: all of them on a GPU, those not
/// [`super::Op::gpu_only`] on the host.
fn on(kernels: &[Kernel], target: Target) -> impl Iterator<Item = &Kernel> {
    kernels
        .iter()
        .filter(move |k| target != Target::Host || !k.op.gpu_only())
}

/// The LLVM types of `k`'s parameters, then `begin` and `end`.
fn param_types<'c>(ctx: &'c Context, k: &Kernel) -> Vec<BasicMetadataTypeEnum<'c>> {
    let ptr = ctx.ptr_type(inkwell::AddressSpace::default());
    let mut v: Vec<BasicMetadataTypeEnum> = k
        .params()
        .iter()
        .map(|p| match p {
            Param::F32(_) => ctx.f32_type().into(),
            Param::F64(_) => ctx.f64_type().into(),
            Param::I64(_) => ctx.i64_type().into(),
            _ => ptr.into(),
        })
        .collect();
    v.push(ctx.i64_type().into());
    v.push(ctx.i64_type().into());
    v
}

fn kernel<'c>(
    ctx: &'c Context,
    module: &Module<'c>,
    k: &Kernel,
    target: Target,
    loops: Loops,
) -> Result<(), CodegenError> {
    let name = k.name();
    let types = param_types(ctx, k);
    let fn_type = ctx.void_type().fn_type(&types, false);

    // The body: (params..., index, lane) -> void, inlined into the wrapper.
    let body = module.add_function(&format!("{name}.body"), fn_type, Some(Linkage::Internal));
    let inline = Attribute::get_named_enum_kind_id("alwaysinline");
    body.add_attribute(AttributeLoc::Function, ctx.create_enum_attribute(inline, 0));
    {
        let mut fx = Fx::new(ctx, module, body, k, target);
        let index = fx.param_int(types.len() - 2);
        let lane = fx.param_int(types.len() - 1);
        fx.set_lane(lane);
        bodies::emit(&mut fx, k, index);
        fx.ret();
    }

    // The entry: walks begin..end and calls the body.
    let entry = module.add_function(&name, fn_type, None);
    if let Target::Ptx { .. } = target {
        entry.set_call_conventions(PTX_KERNEL_CC);
    } else {
        for f in [body, entry] {
            for_this_cpu(ctx, f);
        }
    }
    let mut fx = Fx::new(ctx, module, entry, k, target);
    let n = types.len();
    let (begin, end) = (fx.param_int(n - 2), fx.param_int(n - 1));
    let args = fx.params_as_args();
    let (start, stride, lane) = match target {
        Target::Host => (begin, fx.i64c(1), fx.i64c(0)),
        // Every lane walks every index, in lockstep at the warp's collective calls.
        Target::Warp => (begin, fx.i64c(1), fx.warp_lane()),
        Target::Ptx { .. } => {
            let (tid, ntid, ctaid, nctaid) = fx.thread_registers();
            let thread = fx.iadd(fx.imul(ctaid, ntid), tid);
            let threads = fx.imul(ntid, nctaid);
            let (first, stride, lane) = gpu_lanes(&fx, k.op, thread, threads);
            (fx.iadd(begin, first), stride, lane)
        }
    };
    // The body called at index `i` with lane `lane`.
    let call = |fx: &mut Fx<'c, '_>, i: I<'c>, lane: I<'c>| {
        let mut call_args = args.clone();
        call_args[n - 2] = i.into();
        call_args[n - 1] = lane.into();
        fx.call_void(body, &call_args);
    };
    match Walk::of(k.op, target, loops) {
        Walk::Unrolled => {
            // The body inline, so that the unrolled iteration's stores can follow all its loads.
            let walk = |fx: &mut Fx<'c, '_>, start: I<'c>, end: I<'c>, stride: I<'c>| {
                fx.set_lane(lane);
                fx.unrolled_loop(start, end, stride, |fx, i| bodies::emit(fx, k, i));
            };
            // Counted in 32 bits when every index the loop forms fits (a GPU's 64-bit integer
            // arithmetic takes two instructions, a 32-bit index's address one), else in 64.
            // Only the unrolled ops: ptxas gave the others (Adam, the embedding) more registers
            // for the two loops than the narrower indices saved.
            let reach = fx.iadd(end, fx.imul(stride, fx.i64c(crate::UNROLL)));
            let fits = fx.icmp(IntPredicate::ULE, reach, fx.i64c(u64::from(u32::MAX)));
            fx.if_else(
                fits,
                |fx| {
                    let (s, e, st) = (fx.narrowed(start), fx.narrowed(end), fx.narrowed(stride));
                    walk(fx, s, e, st);
                },
                |fx| walk(fx, start, end, stride),
            );
        }
        Walk::Prefetched => {
            // Blocks of PREFETCH_BLOCK indices, each after hinting the next block of every tensor.
            let block = fx.i64c(crate::PREFETCH_BLOCK);
            let tensors: Vec<&str> = k
                .params()
                .iter()
                .filter(|p| matches!(p, Param::Tensor(..)))
                .map(|p| p.name())
                .collect();
            fx.strided_loop(start, end, block, |fx, lo| {
                let upto = |fx: &Fx<'c, '_>, a: I<'c>| {
                    let b = fx.iadd(a, block);
                    fx.iselect(fx.icmp(IntPredicate::ULT, b, end), b, end)
                };
                let hi = upto(fx, lo);
                let next = upto(fx, hi);
                for t in &tensors {
                    fx.prefetch_lines(t, hi, next);
                }
                fx.strided_loop(lo, hi, fx.i64c(1), |fx, i| call(fx, i, lane));
            });
        }
        Walk::RowsOutside => {
            // Each row is read along its length and a column's sum waits in its output between
            // rows (`Fx::column_rows`), the body getting the row as its lane.
            let rows = fx.int_param("rows");
            fx.strided_loop(fx.i64c(0), rows, fx.i64c(1), |fx, r| {
                fx.strided_loop(start, end, stride, |fx, j| call(fx, j, r));
            });
        }
        Walk::Strided => fx.strided_loop(start, end, stride, |fx, i| call(fx, i, lane)),
    }
    fx.ret();
    if !matches!(target, Target::Ptx { .. }) {
        packed(ctx, module, k, entry);
    }
    Ok(())
}

/// How GPU thread `thread` of `threads` walks `op`'s indices: its first index, the stride, and
/// its lane ([`crate::Op::lanes_on_gpu`]). One thread per index for element and chunk
/// ops; a warp per row, lane = the thread's place in its warp; for columns, groups of
/// 32·[`COLUMN_LANES`] threads take 32 neighbouring columns, a warp being the 32 columns at one
/// lane (its loads of a row coalesce). The launch's thread count is a multiple of a group
/// (`grid` in the CUDA backend), so every thread of a warp walks indices together.
fn gpu_lanes<'c>(
    fx: &Fx<'c, '_>,
    op: super::Op,
    thread: I<'c>,
    threads: I<'c>,
) -> (I<'c>, I<'c>, I<'c>) {
    let warp = fx.i64c(WARP);
    match op.space() {
        Space::Rows => (
            fx.udiv(thread, warp),
            fx.udiv(threads, warp),
            fx.urem(thread, warp),
        ),
        Space::Columns => {
            let group = fx.i64c(WARP * COLUMN_LANES);
            let (g, within) = (fx.udiv(thread, group), fx.urem(thread, group));
            let first = fx.iadd(fx.imul(g, warp), fx.urem(within, warp));
            let stride = fx.imul(fx.udiv(threads, group), warp);
            (first, stride, fx.udiv(within, warp))
        }
        Space::Elements | Space::Chunks => (thread, threads, fx.i64c(0)),
    }
}

/// The host's uniform entry `{name}.packed(args: *const u64, begin: i64, end: i64)`: each
/// parameter in one 8-byte slot (a pointer's address, an i64, an f64's bits, an f32's bits in
/// the low half),
/// so Rust calls every kernel through one function type ([`HostKernels::run`]).
fn packed<'c>(ctx: &'c Context, module: &Module<'c>, k: &Kernel, entry: FunctionValue<'c>) {
    let i64t = ctx.i64_type();
    let ptr = ctx.ptr_type(inkwell::AddressSpace::default());
    let t = ctx
        .void_type()
        .fn_type(&[ptr.into(), i64t.into(), i64t.into()], false);
    let f = module.add_function(&format!("{}.packed", k.name()), t, None);
    for_this_cpu(ctx, f);
    let fx = Fx::new(ctx, module, f, k, Target::Host);
    let slots = f
        .get_nth_param(0)
        .expect("packed has 3 parameters")
        .into_pointer_value();
    let mut args: Vec<inkwell::values::BasicMetadataValueEnum> = vec![];
    for (i, p) in k.params().iter().enumerate() {
        let word = fx.slot(slots, i as u64);
        args.push(match p {
            Param::I64(_) => word.into(),
            Param::F32(_) => fx.low_f32(word).into(),
            Param::F64(_) => fx.f64_of_bits(word).into(),
            _ => fx.int_to_ptr(word).into(),
        });
    }
    args.push(fx.param_int(1).into());
    args.push(fx.param_int(2).into());
    fx.call_void(entry, &args);
    fx.ret();
}

/// Kernels JIT-compiled for this processor: the CPU backend's copy of the GPU's code.
pub struct HostKernels {
    addresses: HashMap<String, usize>,
    // Field order matters: the engine (which owns the module and the machine code) drops before
    // the context it was created in.
    _engine: ExecutionEngine<'static>,
    _ctx: Box<Context>,
}

// SAFETY: after construction the engine and context are never touched again except by `Drop`
// (which runs once, on whichever thread drops the last owner); the compiled functions are plain
// machine code that reads only its arguments, so calling them from many threads is safe.
unsafe impl Send for HostKernels {}
unsafe impl Sync for HostKernels {}

impl HostKernels {
    /// Compiles `kernels` for this processor.
    pub fn jit(kernels: &[Kernel]) -> Result<Self, CodegenError> {
        Self::jit_for(kernels, Target::Host, Loops::Plain)
    }

    /// Compiles `kernels` for this processor with the GPU's index loops (an
    /// [`super::Op::unrolled`] op four indices an iteration, loads first, counted in 32 bits
    /// when they fit), stride 1: what tests the loops the PTX runs. The host's own loops
    /// ([`HostKernels::jit`]) take one index at a time, which LLVM vectorises; the unrolled form
    /// ran the CPU backend's element kernels about 20% slower (bench_ddp, llvm build).
    pub fn jit_gpu_loops(kernels: &[Kernel]) -> Result<Self, CodegenError> {
        Self::jit_for(kernels, Target::Host, Loops::Gpu)
    }

    /// Compiles `kernels` for this processor as a GPU warp ([`Target::Warp`]; row and element
    /// ops, the GPU-only ones included), to run with [`HostKernels::run_warp`].
    pub fn jit_warp(kernels: &[Kernel]) -> Result<Self, CodegenError> {
        Self::jit_for(kernels, Target::Warp, Loops::Plain)
    }

    fn jit_for(kernels: &[Kernel], target: Target, loops: Loops) -> Result<Self, CodegenError> {
        let too_wide = |k: &&Kernel| k.op.lanes_on_gpu() > super::WARP;
        if let Some(k) = kernels
            .iter()
            .find(too_wide)
            .filter(|_| target == Target::Warp)
        {
            return Err(CodegenError::NotForAWarp {
                kernel: k.to_string(),
            });
        }
        let ctx = Box::new(Context::create());
        // SAFETY: the context is boxed (its address is stable) and outlives the engine: both are
        // fields of the returned value, the engine declared (and so dropped) first.
        let ctx_ref: &'static Context = unsafe { &*(ctx.as_ref() as *const Context) };
        let module = build(ctx_ref, kernels, target, loops)?;
        optimise(&module, &machine(target)?)?;
        // MCJIT resolves libm's `logf` from this process (the engine makes the program's own
        // symbols visible when it is created).
        let engine = module
            .create_jit_execution_engine(OptimizationLevel::Aggressive)
            .map_err(|e| llvm("creating the JIT")(&e))?;
        if target == Target::Warp {
            warp::map(&module, &engine);
        }
        let mut addresses = HashMap::new();
        for k in on(kernels, target) {
            let name = k.name();
            let a = engine
                .get_function_address(&format!("{name}.packed"))
                .map_err(|e| CodegenError::Llvm {
                    doing: "finding a compiled kernel",
                    llvm: format!("{name}: {e}"),
                })?;
            addresses.insert(name, a);
        }
        Ok(HostKernels {
            addresses,
            _engine: engine,
            _ctx: ctx,
        })
    }

    /// Whether `k` was compiled.
    pub fn has(&self, k: &Kernel) -> bool {
        self.addresses.contains_key(&k.name())
    }

    /// Runs `k` over indices `begin..end` with `args`, one per [`Kernel::params`] entry (see
    /// [`slot_ptr`], [`slot_f32`], [`slot_f64`], [`slot_i64`]).
    ///
    /// # Errors
    /// When `k` was not compiled or `args` has the wrong length.
    ///
    /// # Safety
    /// Every pointer argument must be valid for every element the kernel touches over
    /// `begin..end` (its [`super::Op`] documents which), with no other thread writing them.
    pub unsafe fn run(
        &self,
        k: &Kernel,
        args: &[u64],
        begin: usize,
        end: usize,
    ) -> Result<(), CodegenError> {
        let name = k.name();
        let a = self
            .addresses
            .get(&name)
            .ok_or_else(|| CodegenError::NotCompiled {
                kernel: name.clone(),
            })?;
        if args.len() != k.params().len() {
            return Err(CodegenError::Arguments {
                kernel: name,
                takes: k.params().len(),
                given: args.len(),
            });
        }
        // SAFETY: the address is the `.packed` entry built for exactly this signature.
        let f: extern "C" fn(*const u64, i64, i64) = unsafe { std::mem::transmute(*a) };
        f(args.as_ptr(), begin as i64, end as i64);
        Ok(())
    }

    /// [`HostKernels::run`] of a [`HostKernels::jit_warp`] build: 32 threads, one per lane,
    /// each walking `begin..end`.
    ///
    /// # Errors
    /// As [`HostKernels::run`].
    ///
    /// # Safety
    /// As [`HostKernels::run`]; the lanes of a warp write what the GPU's would.
    pub unsafe fn run_warp(
        &self,
        k: &Kernel,
        args: &[u64],
        begin: usize,
        end: usize,
    ) -> Result<(), CodegenError> {
        // SAFETY: the caller's contract, for every lane.
        warp::lanes(|| unsafe { self.run(k, args, begin, end) })
    }
}

/// A pointer argument of [`HostKernels::run`].
pub fn slot_ptr<T>(p: *const T) -> u64 {
    p as usize as u64
}

/// An f32 argument of [`HostKernels::run`].
pub fn slot_f32(x: f32) -> u64 {
    u64::from(x.to_bits())
}

/// An f64 argument of [`HostKernels::run`].
pub fn slot_f64(x: f64) -> u64 {
    x.to_bits()
}

/// An i64 argument of [`HostKernels::run`].
pub fn slot_i64(x: i64) -> u64 {
    x as u64
}
