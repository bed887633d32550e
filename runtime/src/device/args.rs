//! The arguments a generated kernel takes on the host: what the host device's primitives build
//! for [`super::kernels::Kernels::run`] and [`super::jit`] packs into the kernels' slots.

/// A kernel argument, as a generated kernel takes it (built by every primitive, read only where
/// the generated kernels exist).
#[derive(Clone, Copy, Debug)]
#[cfg_attr(not(feature = "llvm"), allow(dead_code))]
pub enum Arg {
    Ptr(*const f32),
    Tokens(*const u32),
    F32(f32),
    I64(i64),
}
