//! What one optimizer step takes besides the plan: the step number, the learning rate, the
//! clipping limit and each rank's micro-batches. The device layer's embedding and loss ops read
//! the batches; every backend takes a [`StepInput`] per step (`backend::Backend::step`).

/// One rank's micro-batch: input bytes and the targets (the inputs shifted by one).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Batch {
    pub inputs: Vec<u32>,
    pub targets: Vec<u32>,
}

/// What one optimizer step needs besides the plan.
pub struct StepInput {
    /// 1-based optimizer step (Adam's bias correction).
    pub step: u64,
    pub lr: f64,
    /// Global gradient-norm limit, if clipping.
    pub clip: Option<f64>,
    /// `batches[rank][micro_step]`, for the ranks this backend drives.
    pub batches: Vec<Vec<Batch>>,
    /// Test hook (`schedrun --inject-nan STEP:grad`): this layer's optimizer-shard gradient gets
    /// a NaN as its first element on the lowest rank holding it, just before the first op that
    /// reads it after the backward (the `grad_norm` with clipping, else the layer's update), so
    /// the step's loss stays finite while its gradient is not.
    pub poison_grad: Option<usize>,
}
