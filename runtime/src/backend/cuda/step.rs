//! [`CudaBackend`]: one rank on one GPU. Enqueues a step's ops in the plan's issue order and
//! watches its collectives. Run on one H200 with one rank (2026-11-26); never
//! with several ranks (NCCL), nor its watchdog's abort.

use super::blas::Blas;
use super::device::{drv, Device};
use super::enqueue::{nccl_call, ColMajor, CudaError, DevAddr, Exec, Grid, Library, Pitched, A};
use super::gpu::{Consts, Gpu};
use super::kernels::Kernels;
use super::launch::DistEnv;
use super::memory::{ConstsLayout, StreamMemory};
use super::nccl::{self, Comms, LOSS_KEY};
use super::ptx::PtxFiles;
use super::rendezvous::{self, CommKey, Hello};
use crate::backend::{
    Backend, OpSpan, RankMemory, RunError, RunOptions, StepInput, StepOutcome, StreamWait,
};
use crate::device::action::{run_action, Rank};
use crate::exec::Action;
use crate::plan::Plan;
use cranelift_entity::EntityRef;
use cudarc::driver::CudaEvent;
use sched_ir::job::Dtype;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// One rank of a plan on this process's GPU.
pub struct CudaBackend {
    plan: Arc<Plan>,
    options: RunOptions,
    rank: u32,
    dev: Device,
    kernels: Kernels,
    blas: Vec<Blas>,
    comms: Comms,
    /// One event after each collective op, watched by the timeout (observation only: nothing
    /// waits on them).
    markers: Vec<Option<CudaEvent>>,
    /// Device constants: the batch tokens, the loss accumulator, rotary tables
    /// (outside the plan: see `memory.rs`).
    consts: Consts,
    consts_layout: ConstsLayout,
    /// Each stream's workspace in the arena, as planned.
    workspaces: Vec<Option<StreamMemory>>,
    world: u32,
    /// With [`RunOptions::time_ops`]: timing events around every op.
    timers: Option<Timers>,
}

/// Timing events of a step: one recorded on the first stream when the step is issued, and one
/// on each op's stream before and after the op (after its waits).
struct Timers {
    step: CudaEvent,
    ops: Vec<(CudaEvent, CudaEvent)>,
}

impl Timers {
    fn new(dev: &Device, ops: usize) -> Result<Self, cudarc::driver::DriverError> {
        let timed = || {
            dev.ctx
                .new_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT))
        };
        Ok(Timers {
            step: timed()?,
            ops: (0..ops)
                .map(|_| Ok((timed()?, timed()?)))
                .collect::<Result<_, _>>()?,
        })
    }

    /// Every op's span on `rank`, once the step's work has finished.
    fn spans(&self, rank: u32) -> Result<Vec<OpSpan>, cudarc::driver::DriverError> {
        let at = |e: &CudaEvent| -> Result<Duration, cudarc::driver::DriverError> {
            let ms = self.step.elapsed_ms(e)?;
            Ok(Duration::from_secs_f64(f64::from(ms.max(0.0)) / 1e3))
        };
        self.ops
            .iter()
            .enumerate()
            .map(|(i, (start, end))| {
                Ok(OpSpan {
                    rank,
                    op: sched_ir::ir::OpId::new(i),
                    start: at(start)?,
                    end: at(end)?,
                })
            })
            .collect()
    }
}

fn fault(rank: u32, cause: impl Into<Box<dyn std::error::Error + Send + Sync>>) -> RunError {
    RunError::at(rank, None, cause)
}

impl CudaBackend {
    /// Checks the libraries, joins the rendezvous (with every rank's plan hash), opens the GPU
    /// `env.local_rank`, allocates the arena and workspaces, loads the plan's kernels from the
    /// PTX of `ptx` for this GPU (checking that it holds every one the plan needs) and creates
    /// the NCCL communicators.
    pub fn new(
        plan: Arc<Plan>,
        options: RunOptions,
        env: &DistEnv,
        ptx: &PtxFiles,
    ) -> Result<Self, RunError> {
        let rank = env.rank;
        let f = |m: String| fault(rank, m);
        let g = |e: CudaError| fault(rank, e);
        super::probe().map_err(g)?;
        if env.world != plan.ranks() {
            return Err(f(format!(
                "the plan has {} ranks but WORLD_SIZE is {}",
                plan.ranks(),
                env.world
            )));
        }
        let mut keys = super::comm_keys(&plan);
        if env.world > 1 {
            keys.push(LOSS_KEY);
        }
        let hello = Hello {
            rank,
            world: env.world,
            plan_hash: super::plan_hash(&plan),
        };
        let timeout = options.timeout;
        // The driver must be initialised before ncclGetUniqueId; open the device first.
        let p = &*plan;
        let streams = p.program.streams.len();
        let workspaces: Vec<Option<StreamMemory>> = p
            .program
            .streams
            .keys()
            .map(|s| StreamMemory::of(p, s))
            .collect();
        let dev = Device::open(
            env.local_rank as usize,
            streams,
            p.program.events.len(),
            p.program.arena_bytes,
        )
        .map_err(g)?;
        let ids = if env.world == 1 {
            keys.iter()
                .map(|k| nccl::new_id().map(|id| (*k, id)))
                .collect::<Result<Vec<_>, _>>()
                .map_err(g)?
        } else if rank == 0 {
            let listener = std::net::TcpListener::bind(format!("0.0.0.0:{}", env.master_port))
                .map_err(|e| {
                    f(format!(
                        "rendezvous: cannot listen on {}: {e}",
                        env.master()
                    ))
                })?;
            rendezvous::serve(listener, &hello, &keys, timeout, |_| nccl::new_id())
                .map_err(|e| fault(rank, e))?
        } else {
            rendezvous::join(&env.master(), &hello, timeout).map_err(|e| fault(rank, e))?
        };
        let mine: Vec<(CommKey, [u8; 128], u32, u32)> = ids
            .iter()
            .filter_map(|(k, id)| {
                if *k == LOSS_KEY {
                    return Some((*k, *id, env.world, rank));
                }
                let (g, pos) = p.members[sched_ir::ir::CommId::from_u32(k.comm)][rank as usize];
                let comm = &p.program.comms[sched_ir::ir::CommId::new(k.comm as usize)];
                (g == k.group as usize).then(|| (*k, *id, comm.groups[g].len() as u32, pos as u32))
            })
            .collect();
        dev.ctx.bind_to_thread().map_err(|e| f(format!("{e:?}")))?;
        let comms = Comms::init(&mine).map_err(g)?;
        let kernels = Kernels::load(&dev.ctx, ptx, p).map_err(g)?;
        let blas = dev
            .streams
            .iter()
            .zip(&workspaces)
            .map(|(s, w)| {
                let (at, bytes) = w.map_or((0, 0), |w| w.gemm);
                Blas::new(s, dev.arena_base.add_bytes(at), bytes)
            })
            .collect::<Result<Vec<_>, _>>()
            .map_err(g)?;
        let markers = p
            .program
            .ops
            .values()
            .map(|o| {
                // Only the collectives this rank's pipeline stage issues are watched.
                let mine = p.program.streams[o.stream].stage == p.program.layout.stage(rank);
                (mine && !o.collectives().is_empty())
                    .then(|| dev.ctx.new_event(None))
                    .transpose()
            })
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| f(format!("creating marker events: {e:?}")))?;
        let consts_layout = ConstsLayout::of(p);
        let consts = new_consts(&consts_layout, &dev).map_err(g)?;
        let timers = options
            .time_ops
            .then(|| Timers::new(&dev, p.program.ops.len()))
            .transpose()
            .map_err(|e| f(format!("creating timing events: {e:?}")))?;
        Ok(CudaBackend {
            plan,
            options,
            rank,
            dev,
            kernels,
            blas,
            comms,
            markers,
            consts,
            consts_layout,
            workspaces,
            world: env.world,
            timers,
        })
    }
}

/// Allocates a rank's constants (once; they live as long as the process) and uploads their
/// initial contents: the rotary tables, zero tokens and accumulators.
fn new_consts(layout: &ConstsLayout, dev: &Device) -> Result<Consts, CudaError> {
    let s0 = &dev.streams[0];
    let buf = s0
        .alloc_zeros::<u8>(layout.bytes as usize)
        .map_err(drv("allocating device constants"))?;
    use cudarc::driver::DevicePtr;
    let base = buf.device_ptr(s0).0;
    std::mem::forget(buf); // lives as long as the process; freed with the context
    dev.ctx
        .bind_to_thread()
        .map_err(drv("binding the context"))?;
    // SAFETY: the whole constants buffer, just allocated with `layout.bytes`.
    unsafe { cudarc::driver::result::memcpy_htod_sync(base, &layout.contents) }
        .map_err(drv("uploading constants"))?;
    Ok(layout.at(DevAddr(base)))
}

impl Backend for CudaBackend {
    fn name(&self) -> &'static str {
        "cuda"
    }

    fn ranks(&self) -> Vec<u32> {
        vec![self.rank]
    }

    fn upload(&self, rank: u32, offset: u64, dtype: Dtype, values: &[f32]) -> Result<(), RunError> {
        // The CPU arena's encoding, so both backends hold the same bytes.
        let a = crate::arena::Arena::new(values.len() as u64 * dtype.bytes());
        a.write(0, dtype, values).map_err(|e| fault(rank, e.0))?;
        let halves = a
            .read_bytes(0, values.len() as u64 * dtype.bytes())
            .map_err(|e| fault(rank, e.0))?;
        let bytes: Vec<u8> = halves.iter().flat_map(|h| h.to_le_bytes()).collect();
        self.dev
            .write_bytes(offset, &bytes)
            .map_err(|m| fault(rank, m))
    }

    fn download(
        &self,
        rank: u32,
        offset: u64,
        n: usize,
        dtype: Dtype,
    ) -> Result<Vec<f32>, RunError> {
        let bytes = self
            .dev
            .read_bytes(offset, n * dtype.bytes() as usize)
            .map_err(|m| fault(rank, m))?;
        let halves: Vec<u16> = bytes
            .chunks_exact(2)
            .map(|c| u16::from_le_bytes([c[0], c[1]]))
            .collect();
        let a = crate::arena::Arena::new(bytes.len() as u64);
        a.write_bytes(0, &halves).map_err(|e| fault(rank, e.0))?;
        a.read(0, n, dtype).map_err(|e| fault(rank, e.0))
    }

    /// One f64 flag per process summed over the world's communicator (the loss's), in the
    /// constants' `agree` slot: every process must call it at the same point.
    fn all_agree(&self, ok: bool) -> Result<bool, RunError> {
        if self.world == 1 {
            return Ok(ok);
        }
        let f = |m: CudaError| fault(self.rank, m);
        let at = self.consts.loss.0 + (self.consts_layout.agree - self.consts_layout.loss);
        let flag = if ok { 1.0f64 } else { 0.0 };
        // SAFETY: one f64 in the constants buffer; every stream is idle between steps.
        unsafe { cudarc::driver::result::memcpy_htod_sync(at, &flag.to_le_bytes()) }.map_err(
            |e| {
                f(CudaError::new(
                    Library::Driver,
                    "writing the agreement flag",
                    e,
                ))
            },
        )?;
        let comm = self.comms.get(&LOSS_KEY).map_err(f)?;
        let s = &self.dev.streams[0];
        // SAFETY: as above.
        unsafe { nccl::sum_f64(comm, s.cu_stream(), at, 1) }.map_err(f)?;
        s.synchronize().map_err(|e| {
            f(CudaError::new(
                Library::Driver,
                "waiting for the agreement",
                e,
            ))
        })?;
        let mut out = [0u8; 8];
        // SAFETY: as above; the stream is idle.
        unsafe { cudarc::driver::result::memcpy_dtoh_sync(&mut out, at) }.map_err(|e| {
            f(CudaError::new(
                Library::Driver,
                "reading the agreement flag",
                e,
            ))
        })?;
        Ok(f64::from_le_bytes(out) == f64::from(self.world))
    }

    fn run_step(&mut self, input: &StepInput) -> Result<StepOutcome, RunError> {
        let started = Instant::now();
        let rank = self.rank;
        self.upload_batches(input)?;
        let issuing = Instant::now();
        if let Err(e) = self.issue(input) {
            // Work may be in flight that other ranks will never match: abort the communicators
            // so nothing waits on them, and fail (the process exits).
            self.comms.abort();
            return Err(e);
        }
        let enqueue = issuing.elapsed();
        self.watch()?;
        let (loss, sumsq) = self.finish_sums()?;
        let busy = started.elapsed();
        // Every stream is idle (`watch`), so every timing event has been reached.
        let spans = match &self.timers {
            Some(t) => t
                .spans(rank)
                .map_err(|e| fault(rank, format!("reading timing events: {e:?}")))?,
            None => vec![],
        };
        Ok(StepOutcome {
            loss_sum: loss,
            grad_sumsq: self.plan.clips().then_some(sumsq),
            waits: self
                .plan
                .stream_ops
                .keys()
                .map(|s| StreamWait {
                    rank,
                    stream: self.plan.stream_name(s),
                    waiting: Duration::ZERO,
                    busy,
                })
                .collect(),
            spans,
            enqueue: Some(enqueue),
        })
    }

    fn memory(&self) -> Vec<RankMemory> {
        vec![RankMemory {
            rank: self.rank,
            allocated: self.dev.arena_bytes,
            touched: self.dev.arena_bytes,
        }]
    }
}

impl CudaBackend {
    fn upload_batches(&self, input: &StepInput) -> Result<(), RunError> {
        // Tokens, then the loss and sum-of-squares accumulators zeroed right after them (the
        // previous step has finished: run_step synchronises before returning).
        let v = self
            .consts_layout
            .step_bytes(&input.batches[0])
            .ok_or_else(|| fault(self.rank, "a batch of the wrong size"))?;
        let f = |e| fault(self.rank, format!("uploading the batch: {e:?}"));
        self.dev.ctx.bind_to_thread().map_err(f)?;
        // SAFETY: the start of the constants buffer, `step_bytes` long (tokens, accumulators).
        unsafe { cudarc::driver::result::memcpy_htod_sync(self.consts.tokens.0, &v) }.map_err(f)?;
        Ok(())
    }

    /// Enqueues every op in the plan's issue order.
    fn issue(&self, input: &StepInput) -> Result<(), RunError> {
        let p = &*self.plan;
        self.dev
            .ctx
            .bind_to_thread()
            .map_err(|e| fault(self.rank, format!("{e:?}")))?;
        let timer = |e: &CudaEvent, stream| {
            e.record(stream)
                .map_err(|e| fault(self.rank, format!("recording a timing event: {e:?}")))
        };
        if let Some(t) = &self.timers {
            timer(&t.step, &self.dev.streams[0])?;
        }
        let stage = p.program.layout.stage(self.rank);
        // A rank issues its pipeline stage's ops only.
        for (op, o) in p
            .program
            .ops
            .iter()
            .filter(|(_, o)| p.program.streams[o.stream].stage == stage)
        {
            let s = o.stream.index();
            let stream = &self.dev.streams[s];
            let fail = |cause: Box<dyn std::error::Error + Send + Sync>| {
                RunError::at(self.rank, Some(p.describe(op)), cause)
            };
            for e in &o.wait {
                stream
                    .wait(&self.dev.events[e.index()])
                    .map_err(|e| fail(format!("cuStreamWaitEvent: {e:?}").into()))?;
            }
            if let Some(t) = &self.timers {
                timer(&t.ops[op.index()].0, stream)?;
            }
            let ws = StreamMemory::scratch_at(self.workspaces[s], self.dev.arena_base);
            let x = DevExec {
                k: &self.kernels,
                blas: &self.blas[s],
                s: stream,
            };
            let gpu = Gpu::new(&x, p.job.model.dtype, ws, self.dev.arena_base, &self.consts)
                .with_attention_kernels(self.options.attention_kernels);
            match &p.actions[op.index()] {
                Action::Collectives(cs) => {
                    self.collectives(op, cs, stream)
                        .map_err(|e| fail(e.into()))?;
                    if let Some(m) = &self.markers[op.index()] {
                        m.record(stream)
                            .map_err(|e| fail(format!("marker record: {e:?}").into()))?;
                    }
                }
                a => {
                    let r = Rank {
                        plan: p,
                        rank: self.rank,
                        device: &gpu,
                    };
                    run_action(&r, a, o.micro_step, input).map_err(|e| fail(e.into()))?
                }
            }
            if let Some(t) = &self.timers {
                timer(&t.ops[op.index()].1, stream)?;
            }
            if let Some(e) = o.record {
                self.dev.events[e.index()]
                    .record(stream)
                    .map_err(|e| fail(format!("cuEventRecord: {e:?}").into()))?;
            }
        }
        Ok(())
    }

    fn collectives(
        &self,
        op: sched_ir::ir::OpId,
        cs: &[sched_ir::ir::CollectiveOp],
        stream: &cudarc::driver::CudaStream,
    ) -> Result<(), CudaError> {
        let p = &*self.plan;
        let s = super::comm_stream(p, p.program.ops[op].stream);
        nccl::group_start()?;
        for c in cs {
            let (g, _) = p.members[c.comm][self.rank as usize];
            let key = CommKey {
                comm: c.comm.index() as u32,
                group: g as u32,
                stream: s,
            };
            let members = p.program.comms[c.comm].groups[g].len() as u64;
            let comm = self.comms.get(&key)?;
            let input = self.dev.arena_base.add_bytes(p.at(self.rank, &c.input));
            let output = self.dev.arena_base.add_bytes(p.at(self.rank, &c.output));
            let call = nccl_call(c.kind, c.count, members, input, output);
            // SAFETY: both regions lie in the arena and overlap only as NCCL allows (the
            // verifier's proofs 1 and 8, which every loaded plan passed).
            unsafe { nccl::collective(comm, stream.cu_stream(), c.dtype, &call)? };
        }
        nccl::group_end()
    }

    /// Waits for the step, aborting when a collective takes longer than the timeout.
    fn watch(&self) -> Result<(), RunError> {
        let p = &*self.plan;
        // Per stream: its collective ops in order.
        let mut pending: Vec<std::collections::VecDeque<sched_ir::ir::OpId>> =
            vec![Default::default(); p.program.streams.len()];
        for (op, o) in p.program.ops.iter() {
            if self.markers[op.index()].is_some() {
                pending[o.stream.index()].push_back(op);
            }
        }
        let mut since = vec![Instant::now(); pending.len()];
        loop {
            let mut left = 0;
            for (s, q) in pending.iter_mut().enumerate() {
                while let Some(&op) = q.front() {
                    let done = self.markers[op.index()]
                        .as_ref()
                        .map(|m| m.is_complete())
                        .unwrap_or(true);
                    if !done {
                        break;
                    }
                    q.pop_front();
                    since[s] = Instant::now();
                }
                if let Some(&op) = q.front() {
                    left += 1;
                    if since[s].elapsed() > self.options.timeout {
                        self.comms.abort();
                        let e = RunError::at(
                            self.rank,
                            Some(p.describe(op)),
                            format!(
                                "the collective did not complete within {:?}; aborted the NCCL \
                                 communicators (another rank failed or stopped answering)",
                                self.options.timeout
                            ),
                        );
                        // Exit here rather than unwind: after an abort, tearing down streams that
                        // still hold NCCL work could block, and this must never hang.
                        eprintln!("error: {e}");
                        std::process::exit(2);
                    }
                }
            }
            if left == 0 {
                break;
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        self.dev.synchronize().map_err(|m| fault(self.rank, m))
    }

    /// The step's loss and the rank's gradient sum of squares (the two f64 accumulators, side by
    /// side in the constants), each summed over the world with several processes.
    fn finish_sums(&self) -> Result<(f64, f64), RunError> {
        let f = |m: CudaError| fault(self.rank, m);
        debug_assert_eq!(self.consts_layout.sumsq, self.consts_layout.loss + 8);
        if !self.counts_loss() {
            // SAFETY: one f64 in the constants buffer; every stream is idle.
            unsafe {
                cudarc::driver::result::memcpy_htod_sync(self.consts.loss.0, &0f64.to_le_bytes())
            }
            .map_err(|e| f(CudaError::new(Library::Driver, "zeroing the loss", e)))?;
        }
        if self.world > 1 {
            let comm = self.comms.get(&LOSS_KEY).map_err(f)?;
            let s = &self.dev.streams[0];
            // SAFETY: the loss and sum-of-squares accumulators are two adjacent f64 in the
            // constants buffer.
            unsafe { nccl::sum_f64(comm, s.cu_stream(), self.consts.loss.0, 2) }.map_err(f)?;
            s.synchronize()
                .map_err(|e| f(CudaError::new(Library::Driver, "waiting for the loss", e)))?;
        }
        let mut out = [0u8; 16];
        // SAFETY: two f64 in the constants buffer; every stream is idle.
        unsafe { cudarc::driver::result::memcpy_dtoh_sync(&mut out, self.consts.loss.0) }
            .map_err(|e| f(CudaError::new(Library::Driver, "reading the loss", e)))?;
        let at =
            |i: usize| f64::from_le_bytes(out[8 * i..8 * i + 8].try_into().expect("eight bytes"));
        Ok((at(0), at(1)))
    }

    /// Whether this rank's loss counts in the step's: a tensor group's ranks compute the same
    /// loss, and only its lead's is summed.
    fn counts_loss(&self) -> bool {
        self.plan.program.layout.tp_index(self.rank) == 0
    }
}

/// One stream of the GPU as the device code's [`Exec`].
struct DevExec<'a> {
    k: &'a Kernels,
    blas: &'a Blas,
    s: &'a cudarc::driver::CudaStream,
}

impl Exec for DevExec<'_> {
    fn launch(&self, name: &str, grid: Grid, args: &[A]) -> Result<(), CudaError> {
        self.k.launch(self.s, name, grid, args)
    }

    fn gemm(&self, call: &ColMajor) -> Result<(), CudaError> {
        self.blas.run(call)
    }

    fn copy_bytes(&self, dst: DevAddr, src: DevAddr, bytes: usize) -> Result<(), CudaError> {
        let s = self.s.cu_stream();
        // SAFETY: both ranges lie in the arena or the workspace (the callers size them).
        unsafe { cudarc::driver::result::memcpy_dtod_async(dst.0, src.0, bytes, s) }
            .map_err(|e| CudaError::new(Library::Driver, "device copy", e))
    }

    fn copy_rows(
        &self,
        dst: Pitched,
        src: Pitched,
        width: usize,
        rows: usize,
    ) -> Result<(), CudaError> {
        use cudarc::driver::sys;
        let copy = sys::CUDA_MEMCPY2D {
            srcXInBytes: 0,
            srcY: 0,
            srcMemoryType: sys::CUmemorytype::CU_MEMORYTYPE_DEVICE,
            srcHost: std::ptr::null(),
            srcDevice: src.at.0,
            srcArray: std::ptr::null_mut(),
            srcPitch: src.pitch,
            dstXInBytes: 0,
            dstY: 0,
            dstMemoryType: sys::CUmemorytype::CU_MEMORYTYPE_DEVICE,
            dstHost: std::ptr::null_mut(),
            dstDevice: dst.at.0,
            dstArray: std::ptr::null_mut(),
            dstPitch: dst.pitch,
            WidthInBytes: width,
            Height: rows,
        };
        // SAFETY: both row sets lie in the arena or the workspace (the callers size them); the
        // descriptor is read before the call returns.
        unsafe { sys::cuMemcpy2DAsync_v2(&copy, self.s.cu_stream()) }
            .result()
            .map_err(|e| CudaError::new(Library::Driver, "device 2-D copy", e))
    }
}

/// How far the fused attention kernels are from the chunked path on this GPU, for one shape
/// of a plan's: the worst output, log-sum-exp and dqkv differences, each relative to
/// 1 + |chunked value|.
#[derive(Clone, Debug)]
pub struct FlashCheck {
    pub kernel: String,
    pub out: f32,
    pub lse: f32,
    pub dqkv: f32,
}

/// Runs the fused attention kernels of `plan` (forward and backward,
/// [`sched_kernels::Op::FlashForward`] and the rest, from the plan's PTX in `ptx`) on GPU 0
/// against the chunked path (cuBLAS products and the softmax kernels, which the parity tests
/// check against the CPU backend) on the same random bf16 inputs and output gradient,
/// `sequences` sequences of the model's length, once per shape.
pub fn check_flash_attention(
    plan: &Plan,
    ptx: &PtxFiles,
    sequences: usize,
) -> Result<Vec<FlashCheck>, CudaError> {
    use super::typed::{DevPtr, Storage};
    use crate::math::attention::Shape;
    use sched_kernels::{flash, for_job, Op};
    const GEMM_BYTES: usize = 32 << 20;
    let mut checks = vec![];
    let mut shapes: Vec<flash::Shape> = for_job(&plan.job)
        .iter()
        .filter_map(|k| match k.op {
            Op::FlashForward(f) => Some(f),
            _ => None,
        })
        .collect();
    shapes.sort_by_key(|f| (f.heads, f.kv_heads, f.d, f.s));
    shapes.dedup();
    for f in shapes {
        let sh = Shape {
            b: sequences,
            s: f.s,
            heads: f.heads,
            kv_heads: f.kv_heads,
            d: f.d,
        };
        let (tokens, rows) = (sh.b * sh.s, sh.b * sh.heads * sh.s);
        // Arena, in floats: qkv (bf16), dout, two outputs, two lse, two dqkv (fp32), the
        // scratch; then cuBLAS's workspace.
        let scratch = 4 * sh.heads * sh.s * sh.s + 4 * tokens * sh.width() + (1 << 20);
        let (qkv_n, out_n, dqkv_n) = (
            tokens * sh.width(),
            tokens * sh.hidden(),
            tokens * sh.width(),
        );
        let sizes = [
            qkv_n / 2 + 1,
            out_n,
            out_n,
            out_n,
            rows,
            rows,
            dqkv_n,
            dqkv_n,
            scratch,
        ];
        let at: Vec<usize> = sizes
            .iter()
            .scan(0, |end, n| {
                let start = *end;
                *end += n.div_ceil(64) * 64;
                Some(start)
            })
            .collect();
        let total = at[8] + scratch.div_ceil(64) * 64;
        let dev = Device::open(0, 1, 0, (total * 4 + GEMM_BYTES) as u64)?;
        dev.ctx
            .bind_to_thread()
            .map_err(drv("binding the context"))?;
        let kernels = Kernels::load(&dev.ctx, ptx, plan)?;
        let s = &dev.streams[0];
        let blas = Blas::new(s, dev.arena_base.add_bytes((total * 4) as u64), GEMM_BYTES)?;
        let x = DevExec {
            k: &kernels,
            blas: &blas,
            s,
        };
        let consts = Consts {
            tokens: DevAddr::NULL,
            loss: DevAddr::NULL,
            sumsq: DevAddr::NULL,
            rope: None,
            t: 0,
        };
        let addr = |i: usize| dev.arena_base.add_bytes((at[i] * 4) as u64);
        let gpu = Gpu::new(&x, Dtype::Bf16, (addr(8), scratch), dev.arena_base, &consts);
        // Inputs in [−2, 2) from a fixed seed: qkv as bf16, dout as bf16 values in fp32.
        let mut rng = crate::math::Rng::new(7);
        let mut next = || flash::bf16((rng.next_f64() * 4.0 - 2.0) as f32);
        let qkv: Vec<u8> = (0..qkv_n).flat_map(|_| next().to_le_bytes()).collect();
        let dout: Vec<u8> = (0..out_n)
            .flat_map(|_| flash::widen(next()).to_le_bytes())
            .collect();
        dev.write_bytes(0, &qkv)?;
        dev.write_bytes((at[1] * 4) as u64, &dout)?;
        let f32s = |i: usize| DevPtr::new(addr(i), Storage::F32);
        gpu.flash_and_chunks(
            &sh,
            (DevPtr::new(addr(0), Storage::Bf16), f32s(1)),
            [f32s(2), f32s(3)],
            [f32s(4), f32s(5)],
            [f32s(6), f32s(7)],
        )
        .map_err(|e| CudaError::backend(format!("flash{}: {e}", f.suffix())))?;
        dev.synchronize()?;
        let read = |i: usize, n: usize| -> Result<Vec<f32>, CudaError> {
            let bytes = dev.read_bytes((at[i] * 4) as u64, n * 4)?;
            Ok(bytes
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect())
        };
        let worst = |a: Vec<f32>, b: Vec<f32>| {
            a.iter()
                .zip(&b)
                .map(|(x, y)| (x - y).abs() / (1.0 + y.abs()))
                .fold(
                    0f32,
                    |m, e| if e.is_nan() { f32::INFINITY } else { m.max(e) },
                )
        };
        checks.push(FlashCheck {
            kernel: f.suffix(),
            out: worst(read(2, out_n)?, read(3, out_n)?),
            lse: worst(read(4, rows)?, read(5, rows)?),
            dqkv: worst(read(6, dqkv_n)?, read(7, dqkv_n)?),
        });
    }
    Ok(checks)
}
