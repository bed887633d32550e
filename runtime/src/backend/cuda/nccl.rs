//! NCCL communicators and collectives through cudarc's raw bindings. One communicator per
//! [`CommKey`] the rank belongs to (a plan communicator group used on one stream), each made from
//! its own unique id; members ranked in the plan's member order, so chunk `j` of an all-gather or
//! reduce-scatter belongs to member `j` as on the CPU backend. Never run with several ranks:
//! the only GPU lent so far was a single one.

use super::enqueue::{CudaError, Library, NcclCall};
use super::rendezvous::{CommKey, ID_BYTES};
use cudarc::nccl::result as nr;
use cudarc::nccl::sys::{ncclComm_t, ncclDataType_t, ncclRedOp_t, ncclUniqueId};
use schedc::job::{Collective, Dtype};
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
    };
    r.map(|_| ())
        .map_err(|e| CudaError::new(Library::Nccl, format!("{:?}", call.kind), e))
}

/// Sums one f64 across the world on `stream` (the step's loss).
///
/// # Safety
/// `value` must be a device pointer to one f64.
pub unsafe fn sum_f64(
    comm: ncclComm_t,
    stream: cudarc::driver::sys::CUstream,
    value: u64,
) -> Result<(), CudaError> {
    nr::all_reduce(
        value as *const std::ffi::c_void,
        value as *mut std::ffi::c_void,
        1,
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
