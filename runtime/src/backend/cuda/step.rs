//! [`CudaBackend`]: one rank on one GPU. Enqueues a step's ops in the plan's issue order and
//! watches its collectives. Compiled, never run on a GPU yet.

use super::blas::Blas;
use super::device::{drv, Device};
use super::kernels::{dtype_code, Kernels, A};
use super::launch::DistEnv;
use super::layers::{self, In, G};
use super::nccl::{self, Comms, LOSS_KEY};
use super::rendezvous::{self, CommKey, Hello};
use crate::backend::{
    Backend, RankMemory, RunError, RunOptions, StepInput, StepOutcome, StreamWait,
};
use crate::exec::{Action, GradPart};
use crate::math::{OptimizerConfig, Stored};
use crate::plan::Plan;
use cranelift_entity::EntityRef;
use cudarc::driver::CudaEvent;
use schedc::ir::{Region, ShardIndex};
use schedc::job::{Dtype, LayerKind, Optimizer};
use std::cell::Cell;
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
    /// Device constants: the batch tokens, the loss accumulator, rotary tables, decay ranges.
    consts: Consts,
    world: u32,
}

struct Consts {
    base: u64,
    /// i32 tokens: [micro_step][inputs | targets] of T each.
    tokens: u64,
    loss: u64,
    sumsq: u64,
    rope: Option<u64>,
    /// Per layer: (pointer to i64 pairs, count).
    decay: Vec<(u64, usize)>,
    t: usize,
}

fn fault(rank: u32, m: impl Into<String>) -> RunError {
    RunError::at(rank, None, m)
}

/// Floats of f32 workspace one op of `layer` can need (an over-estimate: every input and output
/// converted, plus the math's scratch).
fn layer_workspace(plan: &Plan, layer: usize) -> usize {
    let m = &plan.maths[layer];
    let model = &plan.job.model;
    let t = (model.micro_batch * model.seq_len) as usize;
    let s = model.seq_len as usize;
    let big = match &model.layers[layer].kind {
        LayerKind::Transformer(tr) => {
            let (h, f, n) = (tr.hidden as usize, tr.ffn as usize, tr.heads as usize);
            6 * t * h + 3 * t * f + 2 * t * (h + 2 * h) + n * s * s + 2 * s * s
        }
        LayerKind::Mlp(mm) => 2 * t * mm.hidden as usize + 3 * t * mm.ffn as usize,
        LayerKind::LmHead { hidden, .. } => 2 * t * *hidden as usize,
        _ => 0,
    };
    let padded = plan.program.layers[schedc::ir::LayerId::new(layer)].padded as usize;
    2 * m.params()
        + 2 * m.tied_elements()
        + 2 * m.input_elements()
        + 2 * m.output_elements()
        + 2 * m.saved_elements()
        + 4 * padded
        + big
        + 64 * 64
}

impl CudaBackend {
    /// Checks the libraries, joins the rendezvous (with every rank's plan hash), opens the GPU
    /// `env.local_rank`, allocates the arena and workspaces, compiles or loads the kernels and
    /// creates the NCCL communicators.
    pub fn new(plan: Arc<Plan>, options: RunOptions, env: &DistEnv) -> Result<Self, RunError> {
        let rank = env.rank;
        let f = |m: String| fault(rank, m);
        super::probe().map_err(f)?;
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
        let streams = p.stream_ops.len();
        let ws: Vec<usize> = (0..streams)
            .map(|s| {
                let ops = &p.stream_ops[s];
                ops.iter()
                    .filter_map(|op| match &p.actions[op.index()] {
                        Action::Collectives(_) => None,
                        a => Some(action_workspace(p, a)),
                    })
                    .max()
                    .unwrap_or(0)
            })
            .collect();
        let dev = Device::open(
            env.local_rank as usize,
            streams,
            p.program.events.len(),
            p.program.arena_bytes,
            &ws,
        )
        .map_err(f)?;
        let ids = if env.world == 1 {
            keys.iter()
                .map(|k| nccl::new_id().map(|id| (*k, id)))
                .collect::<Result<Vec<_>, _>>()
                .map_err(f)?
        } else if rank == 0 {
            let listener = std::net::TcpListener::bind(format!("0.0.0.0:{}", env.master_port))
                .map_err(|e| {
                    f(format!(
                        "rendezvous: cannot listen on {}: {e}",
                        env.master()
                    ))
                })?;
            rendezvous::serve(listener, &hello, &keys, timeout, |_| nccl::new_id())
                .map_err(|e| f(e.0))?
        } else {
            rendezvous::join(&env.master(), &hello, timeout).map_err(|e| f(e.0))?
        };
        let mine: Vec<(CommKey, [u8; 128], u32, u32)> = ids
            .iter()
            .filter_map(|(k, id)| {
                if *k == LOSS_KEY {
                    return Some((*k, *id, env.world, rank));
                }
                let (g, pos) = p.members[k.comm as usize][rank as usize];
                let comm = &p.program.comms[schedc::ir::CommId::new(k.comm as usize)];
                (g == k.group as usize).then(|| (*k, *id, comm.groups[g].len() as u32, pos as u32))
            })
            .collect();
        dev.ctx.bind_to_thread().map_err(|e| f(format!("{e:?}")))?;
        let comms = Comms::init(&mine).map_err(f)?;
        let kernels = Kernels::load(&dev.ctx).map_err(f)?;
        let blas = dev
            .streams
            .iter()
            .map(|s| Blas::new(s))
            .collect::<Result<Vec<_>, _>>()
            .map_err(f)?;
        let markers = p
            .program
            .ops
            .values()
            .map(|o| {
                (!o.collectives().is_empty())
                    .then(|| dev.ctx.new_event(None))
                    .transpose()
            })
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| f(format!("creating marker events: {e:?}")))?;
        let consts = Consts::new(p, &dev).map_err(f)?;
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
            world: env.world,
        })
    }
}

/// Workspace floats of one compute action.
fn action_workspace(p: &Plan, a: &Action) -> usize {
    let elems = |r: &Region| (r.bytes / p.program.buffers[r.buffer].dtype.bytes()) as usize;
    match a {
        Action::Forward { layer, .. } | Action::Backward { layer, .. } => {
            layer_workspace(p, *layer)
        }
        Action::Loss { logits, .. } => 2 * elems(logits) + 64,
        Action::Update { grad, state, .. } => elems(grad) + elems(state) + 128,
        Action::GradNorm { grads, .. } => grads.iter().map(elems).max().unwrap_or(0) + 64,
        Action::Accumulate { from, .. } => elems(from) + 64,
        Action::Copy { .. } | Action::Collectives(_) => 0,
    }
}

impl Consts {
    fn new(p: &Plan, dev: &Device) -> Result<Consts, String> {
        let model = &p.job.model;
        let t = (model.micro_batch * model.seq_len) as usize;
        let micro = p.program.micro_steps as usize;
        let rope = p.maths.iter().find_map(|m| match m.kind() {
            crate::math::Kind::Transformer(bp) => bp.rope.as_ref(),
            _ => None,
        });
        let rope_floats = rope.map_or(0, |r| r.cos.len() + r.sin.len());
        let decay_pairs: usize = p.decay.iter().map(|d| d.len()).sum();
        // Layout (bytes): tokens, loss (f64), sumsq (f64), rope tables, decay ranges.
        let tokens_bytes = micro * 2 * t * 4;
        let bytes = tokens_bytes.div_ceil(8) * 8 + 16 + rope_floats * 4 + decay_pairs * 16 + 64;
        let ctx = &dev.ctx;
        let s0 = &dev.streams[0];
        let buf = s0
            .alloc_zeros::<u8>(bytes)
            .map_err(drv("allocating device constants"))?;
        use cudarc::driver::DevicePtr;
        let base = buf.device_ptr(s0).0;
        std::mem::forget(buf); // lives as long as the process; freed with the context
        let tokens = base;
        let loss = base + (tokens_bytes.div_ceil(8) * 8) as u64;
        let sumsq = loss + 8;
        let mut at = sumsq + 8;
        ctx.bind_to_thread().map_err(drv("binding the context"))?;
        let put = |ptr: u64, bytes: &[u8]| -> Result<(), String> {
            // SAFETY: inside the constants buffer sized above.
            unsafe { cudarc::driver::result::memcpy_htod_sync(ptr, bytes) }
                .map_err(drv("uploading constants"))
        };
        let rope_ptr = match rope {
            Some(r) => {
                let v: Vec<u8> = r
                    .cos
                    .iter()
                    .chain(&r.sin)
                    .flat_map(|x| x.to_le_bytes())
                    .collect();
                put(at, &v)?;
                let ptr = at;
                at += v.len() as u64;
                Some(ptr)
            }
            None => None,
        };
        at = at.div_ceil(8) * 8;
        let mut decay = vec![];
        for d in &p.decay {
            let v: Vec<u8> = d
                .iter()
                .flat_map(|r| [r.start as i64, r.end as i64])
                .flat_map(|x| x.to_le_bytes())
                .collect();
            if !v.is_empty() {
                put(at, &v)?;
            }
            decay.push((at, d.len()));
            at += v.len() as u64;
        }
        Ok(Consts {
            base,
            tokens,
            loss,
            sumsq,
            rope: rope_ptr,
            decay,
            t,
        })
    }
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

    fn run_step(&mut self, input: &StepInput) -> Result<StepOutcome, RunError> {
        let started = Instant::now();
        let rank = self.rank;
        self.upload_batches(input)?;
        if let Err(e) = self.issue(input) {
            // Work may be in flight that other ranks will never match: abort the communicators
            // so nothing waits on them, and fail (the process exits).
            self.comms.abort();
            return Err(e);
        }
        self.watch()?;
        let loss = self.finish_loss()?;
        let busy = started.elapsed();
        Ok(StepOutcome {
            loss_sum: loss,
            waits: self
                .plan
                .stream_ops
                .iter()
                .enumerate()
                .map(|(s, _)| StreamWait {
                    rank,
                    stream: self.plan.stream_name(schedc::ir::StreamId::new(s)),
                    waiting: Duration::ZERO,
                    busy,
                })
                .collect(),
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
        let t = self.consts.t;
        let mut v: Vec<u8> = vec![];
        for b in &input.batches[0] {
            if b.inputs.len() != t || b.targets.len() != t {
                return Err(fault(self.rank, "a batch of the wrong size"));
            }
            v.extend(b.inputs.iter().flat_map(|x| (*x as i32).to_le_bytes()));
            v.extend(b.targets.iter().flat_map(|x| (*x as i32).to_le_bytes()));
        }
        v.extend([0u8; 16]);
        // Tokens, then zero the loss and sum-of-squares accumulators right after them (the
        // previous step has finished: run_step synchronises before returning).
        let f = |e| fault(self.rank, format!("uploading the batch: {e:?}"));
        self.dev.ctx.bind_to_thread().map_err(f)?;
        // SAFETY: inside the constants buffer; tokens end where the accumulators begin only
        // when the token bytes are a multiple of 8, which they are (2·T·4 per micro-step).
        unsafe { cudarc::driver::result::memcpy_htod_sync(self.consts.tokens, &v) }.map_err(f)?;
        let _ = self.consts.base;
        Ok(())
    }

    /// Enqueues every op in the plan's issue order.
    fn issue(&self, input: &StepInput) -> Result<(), RunError> {
        let p = &*self.plan;
        self.dev
            .ctx
            .bind_to_thread()
            .map_err(|e| fault(self.rank, format!("{e:?}")))?;
        for (op, o) in p.program.ops.iter() {
            let s = o.stream.index();
            let stream = &self.dev.streams[s];
            let fail = |m: String| RunError::at(self.rank, Some(p.describe(op)), m);
            for e in &o.wait {
                stream
                    .wait(&self.dev.events[e.index()])
                    .map_err(|e| fail(format!("cuStreamWaitEvent: {e:?}")))?;
            }
            let (ws_base, ws_len) = self.dev.workspace[s];
            let g = G {
                k: &self.kernels,
                blas: &self.blas[s],
                s: stream,
                ws_base,
                ws_len,
                used: Cell::new(0),
                rope: self.consts.rope,
            };
            match &p.actions[op.index()] {
                Action::Collectives(cs) => {
                    self.collectives(op, cs, stream).map_err(fail)?;
                    if let Some(m) = &self.markers[op.index()] {
                        m.record(stream)
                            .map_err(|e| fail(format!("marker record: {e:?}")))?;
                    }
                }
                a => self.compute(&g, a, o.micro_step, input).map_err(fail)?,
            }
            if let Some(e) = o.record {
                self.dev.events[e.index()]
                    .record(stream)
                    .map_err(|e| fail(format!("cuEventRecord: {e:?}")))?;
            }
        }
        Ok(())
    }

    fn collectives(
        &self,
        op: schedc::ir::OpId,
        cs: &[schedc::ir::CollectiveOp],
        stream: &cudarc::driver::CudaStream,
    ) -> Result<(), String> {
        let p = &*self.plan;
        let s = p.program.ops[op].stream.index() as u32;
        nccl::group_start()?;
        for c in cs {
            let (g, _) = p.members[c.comm.index()][self.rank as usize];
            let key = CommKey {
                comm: c.comm.index() as u32,
                group: g as u32,
                stream: s,
            };
            let members = p.program.comms[c.comm].groups[g].len() as u64;
            let comm = self.comms.get(&key)?;
            let input = self.dev.arena_base + p.at(self.rank, &c.input);
            let output = self.dev.arena_base + p.at(self.rank, &c.output);
            // SAFETY: both regions lie in the arena (the plan's verifier checked them).
            unsafe {
                nccl::collective(
                    comm,
                    stream.cu_stream(),
                    c.kind,
                    c.dtype,
                    c.count,
                    members,
                    input,
                    output,
                )?;
            }
        }
        nccl::group_end()
    }

    /// Waits for the step, aborting when a collective takes longer than the timeout.
    fn watch(&self) -> Result<(), RunError> {
        let p = &*self.plan;
        // Per stream: its collective ops in order.
        let mut pending: Vec<std::collections::VecDeque<schedc::ir::OpId>> =
            vec![Default::default(); p.stream_ops.len()];
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
                        return Err(RunError::at(
                            self.rank,
                            Some(p.describe(op)),
                            format!(
                                "the collective did not complete within {:?}; aborted the NCCL \
                                 communicators (another rank failed or stopped answering)",
                                self.options.timeout
                            ),
                        ));
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

    fn finish_loss(&self) -> Result<f64, RunError> {
        let f = |m: String| fault(self.rank, m);
        if self.world > 1 {
            let comm = self.comms.get(&LOSS_KEY).map_err(f)?;
            let s = &self.dev.streams[0];
            // SAFETY: the loss accumulator is one f64 in the constants buffer.
            unsafe { nccl::sum_f64(comm, s.cu_stream(), self.consts.loss) }.map_err(f)?;
            s.synchronize().map_err(|e| f(format!("{e:?}")))?;
        }
        let mut out = [0u8; 8];
        // SAFETY: one f64 in the constants buffer; every stream is idle.
        unsafe { cudarc::driver::result::memcpy_dtoh_sync(&mut out, self.consts.loss) }
            .map_err(|e| f(format!("reading the loss: {e:?}")))?;
        Ok(f64::from_le_bytes(out))
    }

    fn dtype(&self, r: &Region) -> Dtype {
        self.plan.program.buffers[r.buffer].dtype
    }

    fn elements(&self, r: &Region) -> usize {
        (r.bytes / self.dtype(r).bytes()) as usize
    }

    fn addr(&self, r: &Region) -> u64 {
        self.dev.arena_base + self.plan.at(self.rank, r)
    }

    /// The first `n` values of `r` as f32 in the workspace.
    fn read(&self, g: &G, r: &Region, n: usize) -> Result<u64, String> {
        if n > self.elements(r) {
            return Err(format!(
                "reads {n} values from a region of {}",
                self.elements(r)
            ));
        }
        let dst = g.alloc(n)?;
        g.run(
            "load",
            n,
            &[
                A::P(self.addr(r)),
                A::I(dtype_code(self.dtype(r))),
                A::P(dst),
                A::L(n as i64),
            ],
        )?;
        Ok(dst)
    }

    fn write(&self, g: &G, r: &Region, src: u64, n: usize) -> Result<(), String> {
        if n > self.elements(r) {
            return Err(format!(
                "writes {n} values into a region of {}",
                self.elements(r)
            ));
        }
        g.run(
            "store",
            n,
            &[
                A::P(src),
                A::P(self.addr(r)),
                A::I(dtype_code(self.dtype(r))),
                A::L(n as i64),
            ],
        )
    }

    fn add(&self, g: &G, r: &Region, src: u64, n: usize) -> Result<(), String> {
        g.run(
            "add_store",
            n,
            &[
                A::P(src),
                A::P(self.addr(r)),
                A::I(dtype_code(self.dtype(r))),
                A::L(n as i64),
            ],
        )
    }

    /// kernels.rs `write_grads`: each part gets gradient elements from `first` on, zero past
    /// the gradient's end, written or added.
    fn write_grads(&self, g: &G, parts: &[GradPart], grad: u64, len: usize) -> Result<(), String> {
        for part in parts {
            let n = self.elements(&part.region);
            let v = g.zeros(n)?;
            let lo = part.first.min(len);
            let hi = (part.first + n).min(len);
            g.copy(v, grad + lo as u64 * 4, hi - lo)?;
            if part.accumulate {
                self.add(g, &part.region, v, n)?;
            } else {
                self.write(g, &part.region, v, n)?;
            }
        }
        Ok(())
    }

    fn write_saved(&self, g: &G, layer: usize, r: &Region, v: u64) -> Result<(), String> {
        let mut at = self.addr(r);
        let d = self.dtype(r);
        let mut src = v;
        for seg in self.plan.maths[layer].saved_segments() {
            let n = seg.elements;
            match seg.stored {
                Stored::Model => g.run(
                    "store",
                    n,
                    &[A::P(src), A::P(at), A::I(dtype_code(d)), A::L(n as i64)],
                )?,
                Stored::F32 => g.run("store_halves", n, &[A::P(src), A::P(at), A::L(n as i64)])?,
            }
            at += n as u64 * stored_bytes(seg.stored, d);
            src += n as u64 * 4;
        }
        Ok(())
    }

    fn read_saved(&self, g: &G, layer: usize, r: &Region) -> Result<u64, String> {
        let mut at = self.addr(r);
        let d = self.dtype(r);
        let out = g.alloc(self.plan.maths[layer].saved_elements())?;
        let mut dst = out;
        for seg in self.plan.maths[layer].saved_segments() {
            let n = seg.elements;
            match seg.stored {
                Stored::Model => g.run(
                    "load",
                    n,
                    &[A::P(at), A::I(dtype_code(d)), A::P(dst), A::L(n as i64)],
                )?,
                Stored::F32 => g.run("load_halves", n, &[A::P(at), A::P(dst), A::L(n as i64)])?,
            }
            at += n as u64 * stored_bytes(seg.stored, d);
            dst += n as u64 * 4;
        }
        Ok(out)
    }

    /// A tied head's embedding matrix (zeros for a recompute), as kernels.rs `tied`.
    fn tied(&self, g: &G, layer: usize, r: &Option<Region>) -> Result<Option<u64>, String> {
        let LayerKind::LmHead {
            tied: true,
            vocab,
            hidden,
            ..
        } = self.plan.job.model.layers[layer].kind
        else {
            return Ok(None);
        };
        let n = (vocab * hidden) as usize;
        match r {
            Some(r) => self.read(g, r, n).map(Some),
            None => g.zeros(n).map(Some),
        }
    }

    fn tokens(&self, m: Option<u32>, targets: bool) -> Result<u64, String> {
        let m = m.ok_or("a layer op without a micro-step")? as u64;
        let t = self.consts.t as u64;
        Ok(self.consts.tokens + (2 * m + u64::from(targets)) * t * 4)
    }

    /// One compute action, the CPU backend's `kernels::run` on the device.
    fn compute(&self, g: &G, a: &Action, m: Option<u32>, input: &StepInput) -> Result<(), String> {
        let p = &*self.plan;
        match a {
            Action::Forward {
                layer,
                params,
                tied,
                input: hidden,
                output,
                saved,
            } => {
                let math = &p.maths[*layer];
                let pp = match params {
                    Some(r) => self.read(g, r, math.params())?,
                    None => g.alloc(0)?,
                };
                let t = self.tied(g, *layer, tied)?;
                let x = match hidden {
                    Some(r) => In::Hidden(self.read(g, r, math.input_elements())?),
                    None => In::Tokens(self.tokens(m, false)?),
                };
                let out = g.alloc(math.output_elements())?;
                let keep = g.alloc(math.saved_elements())?;
                layers::forward(g, math, pp, t, x, out, keep)?;
                if let Some(o) = output {
                    self.write(g, o, out, math.output_elements())?;
                }
                if let Some(s) = saved {
                    self.write_saved(g, *layer, s, keep)?;
                }
            }
            Action::Backward {
                layer,
                params,
                tied,
                saved,
                input: hidden,
                grad_output,
                grad_input,
                grads,
                tied_grads,
            } => {
                let math = &p.maths[*layer];
                let pp = match params {
                    Some(r) => self.read(g, r, math.params())?,
                    None => g.alloc(0)?,
                };
                let t = self.tied(g, *layer, tied)?;
                let keep = match saved {
                    Some(s) => self.read_saved(g, *layer, s)?,
                    None => g.alloc(0)?,
                };
                let x = match hidden {
                    Some(r) => In::Hidden(self.read(g, r, math.input_elements())?),
                    None => In::Tokens(self.tokens(m, false)?),
                };
                let dy = self.read(g, grad_output, math.output_elements())?;
                let dx = grad_input
                    .map(|_| g.alloc(math.input_elements()))
                    .transpose()?;
                let dp = g.alloc(math.params())?;
                let dt = t.map(|_| g.alloc(math.tied_elements())).transpose()?;
                layers::backward(g, math, pp, t, keep, x, dy, dx, dp, dt)?;
                if let (Some(r), Some(dx)) = (grad_input, dx) {
                    self.write(g, r, dx, math.input_elements())?;
                }
                self.write_grads(g, grads, dp, math.params())?;
                if let Some(dt) = dt {
                    self.write_grads(g, tied_grads, dt, math.tied_elements())?;
                }
            }
            Action::Loss { logits, grad } => {
                let vocab = match p.job.model.layers.last().map(|l| l.kind) {
                    Some(LayerKind::LmHead { vocab, .. }) => vocab as usize,
                    _ => return Err("the model does not end in an lm_head".into()),
                };
                let n = self.consts.t;
                let z = self.read(g, logits, n * vocab)?;
                let dz = g.alloc(n * vocab)?;
                g.run_rows(
                    "cross_entropy",
                    n,
                    &[
                        A::P(z),
                        A::P(self.tokens(m, true)?),
                        A::L(vocab as i64),
                        A::L(n as i64),
                        A::P(dz),
                        A::P(self.consts.loss),
                    ],
                )?;
                self.write(g, grad, dz, n * vocab)?;
            }
            Action::Update {
                layer,
                grad,
                state,
                param,
                sumsq,
            } => {
                let contributions = f64::from(p.program.ranks) * f64::from(p.program.micro_steps);
                let (sq, sq_dtype, clip) = match (sumsq, input.clip) {
                    (Some(s), Some(clip)) => (self.addr(s), dtype_code(self.dtype(s)), clip),
                    _ => (0, 0, 0.0),
                };
                let n = self.elements(grad);
                let gr = self.read(g, grad, n)?;
                let st = self.read(g, state, self.elements(state))?;
                let first = p.index(self.rank, ShardIndex::Optimizer) as usize * n;
                let cfg = OptimizerConfig::new(p.job.model.optimizer, input.lr);
                if cfg.kind == Optimizer::Sgd {
                    g.run(
                        "sgd",
                        n,
                        &[
                            A::P(st),
                            A::P(gr),
                            A::L(n as i64),
                            A::P(sq),
                            A::I(sq_dtype),
                            A::D(contributions),
                            A::D(clip),
                            A::F(cfg.lr),
                        ],
                    )?;
                } else {
                    let bc1 = 1.0 - f64::from(cfg.beta1).powf(input.step as f64);
                    let bc2 = 1.0 - f64::from(cfg.beta2).powf(input.step as f64);
                    let (decay, ranges) = self.consts.decay[*layer];
                    g.run(
                        "adam",
                        n,
                        &[
                            A::P(st),
                            A::P(gr),
                            A::L(n as i64),
                            A::L(first as i64),
                            A::P(decay),
                            A::I(ranges as i32),
                            A::I(i32::from(
                                cfg.kind == Optimizer::AdamW && cfg.weight_decay != 0.0,
                            )),
                            A::P(sq),
                            A::I(sq_dtype),
                            A::D(contributions),
                            A::D(clip),
                            A::F(cfg.beta1),
                            A::F(cfg.beta2),
                            A::F(cfg.eps),
                            A::F((f64::from(cfg.lr) / bc1) as f32),
                            A::F(bc2.sqrt() as f32),
                            A::F(1.0 - cfg.lr * cfg.weight_decay),
                        ],
                    )?;
                }
                self.write(g, state, st, self.elements(state))?;
                self.write(g, param, st, n)?;
            }
            Action::GradNorm { grads, sumsq } => {
                let acc = self.consts.sumsq;
                // Zeroed on this stream before the sums (a step may hold several grad_norm ops
                // only on one stream, in order).
                g.run("fill", 2, &[A::P(acc), A::F(0.0), A::L(2)])?;
                for r in grads {
                    let n = self.elements(r);
                    let v = self.read(g, r, n)?;
                    g.run("sum_squares", n, &[A::P(v), A::L(n as i64), A::P(acc)])?;
                    g.used.set(0);
                }
                g.k.launch(
                    g.s,
                    "store_double",
                    super::kernels::elems(1),
                    &[
                        A::P(acc),
                        A::P(self.addr(sumsq)),
                        A::I(dtype_code(self.dtype(sumsq))),
                    ],
                )?;
            }
            Action::Accumulate { from, acc } => {
                let n = self.elements(from);
                let v = self.read(g, from, n)?;
                self.add(g, acc, v, n)?;
            }
            Action::Copy { from, to } => {
                // The concatenation of `from` into the concatenation of `to`, piece by piece.
                let (mut fi, mut fo, mut ti, mut tof) = (0usize, 0u64, 0usize, 0u64);
                while fi < from.len() && ti < to.len() {
                    let (f, t) = (&from[fi], &to[ti]);
                    let n = (f.bytes - fo).min(t.bytes - tof);
                    g.copy_bytes(self.addr(t) + tof, self.addr(f) + fo, n as usize)?;
                    fo += n;
                    tof += n;
                    if fo == f.bytes {
                        fi += 1;
                        fo = 0;
                    }
                    if tof == t.bytes {
                        ti += 1;
                        tof = 0;
                    }
                }
            }
            Action::Collectives(_) => unreachable!("collectives go through NCCL"),
        }
        Ok(())
    }
}

fn stored_bytes(s: Stored, model: Dtype) -> u64 {
    match s {
        Stored::Model => model.bytes(),
        Stored::F32 => 4,
    }
}
