//! NCCL communicators and collectives through cudarc's raw bindings. One communicator per
//! [`CommKey`] the rank belongs to (a plan communicator group used on one stream), each made from
//! its own unique id; members ranked in the plan's member order, so chunk `j` of an all-gather or
//! reduce-scatter belongs to member `j` as on the CPU backend. Never run with several ranks:
//! the GPUs lent are single ones, where [`check_one_rank_collectives`] is what can run.

use super::enqueue::{CudaError, Library, NcclCall};
use super::rendezvous::{CommKey, ID_BYTES};
use cudarc::nccl::result as nr;
use cudarc::nccl::sys::{ncclComm_t, ncclDataType_t, ncclRedOp_t, ncclUniqueId};
use sched_ir::job::{Collective, Dtype};
use std::collections::BTreeMap;

/// The key of the world communicator that sums each step's loss across processes.
pub const LOSS_KEY: CommKey = CommKey {
    comm: u32::MAX,
    group: 0,
    stream: u32::MAX,
};

pub struct Comms {
    comms: BTreeMap<CommKey, ncclComm_t>,
}

// SAFETY: communicators are used by the issuing thread and, to abort, by the watchdog.
unsafe impl Send for Comms {}
unsafe impl Sync for Comms {}

/// A fresh unique id (on the master), as bytes.
pub fn new_id() -> Result<[u8; ID_BYTES], CudaError> {
    let id = nr::get_uniqueid().map_err(|e| CudaError::new(Library::Nccl, "ncclGetUniqueId", e))?;
    let mut out = [0u8; ID_BYTES];
    for (o, c) in out.iter_mut().zip(id.internal.iter()) {
        *o = *c as u8;
    }
    Ok(out)
}

fn id_from(bytes: &[u8; ID_BYTES]) -> ncclUniqueId {
    let mut internal = [0 as std::ffi::c_char; ID_BYTES];
    for (i, b) in internal.iter_mut().zip(bytes) {
        *i = *b as std::ffi::c_char;
    }
    ncclUniqueId { internal }
}

impl Comms {
    /// Joins every communicator in `mine`: (key, id, members, my position). NCCL's init blocks
    /// until all members arrive, and every rank walks the keys in the same sorted order inside
    /// one group call, so no two ranks wait on each other in opposite orders.
    pub fn init(mine: &[(CommKey, [u8; ID_BYTES], u32, u32)]) -> Result<Comms, CudaError> {
        let mut comms = BTreeMap::new();
        nr::group_start().map_err(|e| CudaError::new(Library::Nccl, "ncclGroupStart", e))?;
        for (key, id, members, pos) in mine {
            let mut c: ncclComm_t = std::ptr::null_mut();
            // SAFETY: `c` is written by NCCL; the id came from the master's ncclGetUniqueId.
            unsafe { nr::comm_init_rank(&mut c, *members as i32, id_from(id), *pos as i32) }
                .map_err(|e| {
                    CudaError::new(Library::Nccl, format!("ncclCommInitRank {key:?}"), e)
                })?;
            comms.insert(*key, c);
        }
        nr::group_end()
            .map_err(|e| CudaError::new(Library::Nccl, "initialising the NCCL communicators", e))?;
        Ok(Comms { comms })
    }

    pub fn get(&self, key: &CommKey) -> Result<ncclComm_t, CudaError> {
        self.comms
            .get(key)
            .copied()
            .ok_or_else(|| CudaError::backend(format!("no NCCL communicator for {key:?}")))
    }

    /// Aborts every communicator (the watchdog, after a collective timed out): pending NCCL
    /// kernels return and the streams can be torn down.
    pub fn abort(&self) {
        for c in self.comms.values() {
            // SAFETY: each communicator is live; abort may run while a collective is pending.
            let _ = unsafe { nr::comm_abort(*c) };
        }
    }
}

fn nccl_type(d: Dtype) -> ncclDataType_t {
    match d {
        Dtype::Fp32 => ncclDataType_t::ncclFloat32,
        Dtype::Bf16 => ncclDataType_t::ncclBfloat16,
        Dtype::Fp16 => ncclDataType_t::ncclFloat16,
    }
}

/// Enqueues one NCCL call on `stream` ([`nccl_call`] says which and with what).
///
/// # Safety
/// The call's buffers must be valid device ranges of the sizes it implies, and `stream` a live
/// stream of the communicator's device.
pub unsafe fn collective(
    comm: ncclComm_t,
    stream: cudarc::driver::sys::CUstream,
    dtype: Dtype,
    call: &NcclCall,
) -> Result<(), CudaError> {
    let t = nccl_type(dtype);
    let (src, dst) = (
        call.send.0 as *const std::ffi::c_void,
        call.recv.0 as *mut std::ffi::c_void,
    );
    let s = stream as _;
    let n = call.n;
    let r = match call.kind {
        Collective::AllGather => nr::all_gather(src, dst, n, t, comm, s),
        Collective::ReduceScatter => {
            nr::reduce_scatter(src, dst, n, t, ncclRedOp_t::ncclSum, comm, s)
        }
        Collective::AllReduce => nr::all_reduce(src, dst, n, t, ncclRedOp_t::ncclSum, comm, s),
        Collective::Broadcast => nr::broadcast(src, dst, n, t, 0, comm, s),
        // A transfer's communicator is the pair (sender, receiver): the peer is the other one.
        Collective::Send => nr::send(src, n, t, 1, comm, s),
        Collective::Recv => nr::recv(dst, n, t, 0, comm, s),
    };
    r.map(|_| ())
        .map_err(|e| CudaError::new(Library::Nccl, format!("{:?}", call.kind), e))
}

/// Sums `count` adjacent f64 across the world on `stream` (the step's loss and gradient sum of
/// squares).
///
/// # Safety
/// `value` must be a device pointer to `count` f64.
pub unsafe fn sum_f64(
    comm: ncclComm_t,
    stream: cudarc::driver::sys::CUstream,
    value: u64,
    count: usize,
) -> Result<(), CudaError> {
    nr::all_reduce(
        value as *const std::ffi::c_void,
        value as *mut std::ffi::c_void,
        count,
        ncclDataType_t::ncclFloat64,
        ncclRedOp_t::ncclSum,
        comm,
        stream as _,
    )
    .map(|_| ())
    .map_err(|e| CudaError::new(Library::Nccl, "NCCL loss all-reduce", e))
}

pub fn group_start() -> Result<(), CudaError> {
    nr::group_start()
        .map(|_| ())
        .map_err(|e| CudaError::new(Library::Nccl, "ncclGroupStart", e))
}

pub fn group_end() -> Result<(), CudaError> {
    nr::group_end()
        .map(|_| ())
        .map_err(|e| CudaError::new(Library::Nccl, "ncclGroupEnd", e))
}

/// NCCL on one GPU, as far as one GPU takes it (NCCL refuses two ranks on one device, so the
/// lent single-GPU machines cannot run a two-rank plan): a one-member communicator per
/// collective kind, each from its own unique id and initialised in one group as [`Comms::init`]
/// does; then every kind in every dtype through [`collective`] inside a group, out of place
/// and in place, and the loss's [`sum_f64`]. With one member each call delivers its input, so a
/// wrong dtype, element count, buffer or stream shows as a wrong or unwritten value. What it
/// cannot show: the split of a count over members ([`nccl_call`]'s division, which the emulated
/// backend checks) and anything between processes. Returns one line per wrong result.
pub fn check_one_rank_collectives() -> Result<Vec<String>, CudaError> {
    use super::device::{drv, probe_libraries, Device};
    probe_libraries()?;
    const N: usize = 1001;
    let kinds = [
        Collective::AllGather,
        Collective::ReduceScatter,
        Collective::AllReduce,
        Collective::Broadcast,
    ];
    // Send at byte 0, an out-of-place receive at 8·N: room for N values of any dtype each.
    let away = 8 * N as u64;
    let dev = Device::open(0, 1, 0, 2 * away)?;
    dev.ctx
        .bind_to_thread()
        .map_err(drv("binding the context"))?;
    let keys: Vec<CommKey> = (0..kinds.len() as u32)
        .map(|comm| CommKey {
            comm,
            group: 0,
            stream: 0,
        })
        .collect();
    let mine = keys
        .iter()
        .map(|k| Ok((*k, new_id()?, 1, 0)))
        .collect::<Result<Vec<_>, CudaError>>()?;
    let comms = Comms::init(&mine)?;
    let stream = &dev.streams[0];
    let wait = || stream.synchronize().map_err(drv("waiting for NCCL"));
    let mut wrong = vec![];
    for dtype in [Dtype::Fp32, Dtype::Bf16, Dtype::Fp16] {
        // Integers from -125 to 125, exact in every dtype, as the arena stores them.
        let value = |i: usize| (i % 251) as f32 - 125.0;
        let words: Vec<u8> = (0..N)
            .flat_map(|i| match dtype {
                Dtype::Fp32 => value(i).to_le_bytes().to_vec(),
                _ => crate::arena::f32_to_half(dtype, value(i))
                    .to_le_bytes()
                    .to_vec(),
            })
            .collect();
        for (key, kind) in keys.iter().zip(kinds) {
            for in_place in [false, true] {
                let at = if in_place { 0 } else { away };
                dev.write_bytes(0, &words)?;
                if !in_place {
                    dev.write_bytes(at, &vec![0xFF; words.len()])?;
                }
                let call = NcclCall {
                    kind,
                    send: dev.arena_base,
                    recv: dev.arena_base.add_bytes(at),
                    n: N,
                };
                group_start()?;
                // SAFETY: both ranges hold N values of `dtype` inside the arena; in place they
                // coincide, as NCCL allows for the only member.
                unsafe { collective(comms.get(key)?, stream.cu_stream(), dtype, &call) }?;
                group_end()?;
                wait()?;
                let got = dev.read_bytes(at, words.len())?;
                if got != words {
                    let first = got.iter().zip(&words).position(|(g, w)| g != w);
                    wrong.push(format!(
                        "{kind:?} of {N} {dtype:?} values{}: byte {} differs",
                        if in_place { " in place" } else { "" },
                        first.unwrap_or(0)
                    ));
                }
            }
        }
    }
    let loss = 2.5f64;
    dev.write_bytes(0, &loss.to_le_bytes())?;
    // SAFETY: byte 0 of the arena holds one f64.
    unsafe {
        sum_f64(
            comms.get(&keys[0])?,
            stream.cu_stream(),
            dev.arena_base.0,
            1,
        )
    }?;
    wait()?;
    let back = dev.read_bytes(0, 8)?;
    let sum = f64::from_le_bytes(back.try_into().expect("8 bytes"));
    if sum != loss {
        wrong.push(format!("the loss's f64 sum gave {sum}, not {loss}"));
    }
    Ok(wrong)
}
