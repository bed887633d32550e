//! One GPU of the CUDA backend: library checks, the context, the rank's arena (each stream's
//! workspace lies inside it, `memory.rs`), streams and events. Run on one H200 (2026-11-26).

use super::enqueue::{CudaError, DevAddr, Library};
use cudarc::driver::{CudaContext, CudaEvent, CudaSlice, CudaStream, DevicePtr};
use std::sync::Arc;

/// Which of the libraries the backend loads are missing, in one line (cudarc panics when it
/// loads a missing library, so this runs before anything touches them).
pub fn probe_libraries() -> Result<(), CudaError> {
    // SAFETY: each check only tries to open the shared library by its usual names.
    let present = unsafe {
        [
            (
                "the CUDA driver (libcuda.so)",
                cudarc::driver::sys::is_culib_present(),
            ),
            (
                "cuBLAS (libcublas.so)",
                cudarc::cublas::sys::is_culib_present(),
            ),
            (
                "cuBLASLt (libcublasLt.so)",
                cudarc::cublaslt::sys::is_culib_present(),
            ),
            ("NCCL (libnccl.so)", cudarc::nccl::sys::is_culib_present()),
        ]
    };
    let missing: Vec<&str> = present
        .iter()
        .filter(|(_, ok)| !ok)
        .map(|(name, _)| *name)
        .collect();
    if missing.is_empty() {
        return Ok(());
    }
    Err(CudaError::backend(format!(
        "the cuda backend cannot start: {} not found (is the NVIDIA driver installed, and are the \
         CUDA 12 libraries on LD_LIBRARY_PATH? NCCL must be reachable as libnccl.so)",
        missing.join(", ")
    )))
}

/// A driver call's error, saying what the backend was doing.
pub fn drv(what: &str) -> impl Fn(cudarc::driver::DriverError) -> CudaError + '_ {
    move |e| CudaError::new(Library::Driver, what, e)
}

/// A rank's GPU: context, streams (one per plan stream), events (one per plan event) and the
/// arena.
pub struct Device {
    pub ctx: Arc<CudaContext>,
    pub streams: Vec<Arc<CudaStream>>,
    pub events: Vec<CudaEvent>,
    /// Kept alive for `arena_base`; never touched through the safe API.
    _arena: CudaSlice<u8>,
    pub arena_base: DevAddr,
    pub arena_bytes: u64,
}

impl Device {
    /// Opens GPU `ordinal` and allocates the arena: the one allocation of the plan's tensors and
    /// workspaces.
    pub fn open(
        ordinal: usize,
        streams: usize,
        events: usize,
        arena_bytes: u64,
    ) -> Result<Device, CudaError> {
        let count = CudaContext::device_count().map_err(drv("counting CUDA devices"))?;
        if count <= 0 {
            return Err(CudaError::backend("the cuda backend found no CUDA device"));
        }
        if ordinal >= count as usize {
            return Err(CudaError::backend(format!(
                "LOCAL_RANK {ordinal} asks for GPU {ordinal}, but this machine has {count}"
            )));
        }
        let ctx = CudaContext::new(ordinal).map_err(drv("creating the CUDA context"))?;
        // SAFETY: every cross-stream ordering comes from the plan's events, which the plan's
        // verifier proved sufficient; nothing is freed before the final synchronisation.
        unsafe { ctx.disable_event_tracking() };
        let streams = (0..streams)
            .map(|_| ctx.new_stream())
            .collect::<Result<Vec<_>, _>>()
            .map_err(drv("creating streams"))?;
        let events = (0..events)
            .map(|_| ctx.new_event(None))
            .collect::<Result<Vec<_>, _>>()
            .map_err(drv("creating events"))?;
        let s0 = &streams[0];
        // The arena: one allocation, exactly the plan's peak (at least one byte for the API).
        let arena = s0
            .alloc_zeros::<u8>(arena_bytes.max(1) as usize)
            .map_err(drv("allocating the arena"))?;
        let arena_base = DevAddr(arena.device_ptr(s0).0);
        s0.synchronize().map_err(drv("initialising the device"))?;
        Ok(Device {
            ctx,
            streams,
            events,
            _arena: arena,
            arena_base,
            arena_bytes,
        })
    }

    /// Copies host bytes to arena byte `offset` (between steps; synchronous).
    pub fn write_bytes(&self, offset: u64, bytes: &[u8]) -> Result<(), CudaError> {
        self.check(offset, bytes.len() as u64)?;
        self.ctx
            .bind_to_thread()
            .map_err(drv("binding the context"))?;
        // SAFETY: the range lies inside the arena (checked) and no stream is running.
        unsafe {
            cudarc::driver::result::memcpy_htod_sync(self.arena_base.add_bytes(offset).0, bytes)
        }
        .map_err(drv("copying to the GPU"))
    }

    pub fn read_bytes(&self, offset: u64, n: usize) -> Result<Vec<u8>, CudaError> {
        self.check(offset, n as u64)?;
        self.ctx
            .bind_to_thread()
            .map_err(drv("binding the context"))?;
        let mut out = vec![0u8; n];
        // SAFETY: as in write_bytes.
        unsafe {
            cudarc::driver::result::memcpy_dtoh_sync(&mut out, self.arena_base.add_bytes(offset).0)
        }
        .map_err(drv("copying from the GPU"))?;
        Ok(out)
    }

    fn check(&self, offset: u64, n: u64) -> Result<(), CudaError> {
        if offset.checked_add(n).is_none_or(|e| e > self.arena_bytes) {
            return Err(CudaError::backend(format!(
                "bytes {offset}..{} lie outside the {}-byte arena",
                offset.saturating_add(n),
                self.arena_bytes
            )));
        }
        Ok(())
    }

    /// Waits for every stream.
    pub fn synchronize(&self) -> Result<(), CudaError> {
        for s in &self.streams {
            s.synchronize().map_err(drv("waiting for a stream"))?;
        }
        Ok(())
    }
}
