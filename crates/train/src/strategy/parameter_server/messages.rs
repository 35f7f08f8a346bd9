//! What the server and its workers send each other over RPC (a worker's
//! gradient, the parameters to compute the next one on), and the error of
//! a failed call. Plain data: it never calls anyone itself.

use cohort_rpc::{Floats, RpcError};
use serde::{Deserialize, Serialize};

use crate::error::TrainError;

/// A worker's gradient of one step.
#[derive(Serialize, Deserialize)]
pub(super) struct Push {
    /// 0-based worker index (rank - 1).
    pub(super) worker: u32,
    /// The parameters' version the gradient was computed on.
    pub(super) version: u64,
    /// Summed over the step's micro-batches.
    pub(super) grads: Floats,
    /// Summed over the micro-batches.
    pub(super) loss: f32,
    /// Tokens trained on (padding excluded).
    pub(super) tokens: u64,
    /// This worker's data position (epoch, offset) after the step.
    pub(super) epoch: u64,
    pub(super) offset: u64,
}

/// The parameters to compute the next gradient on.
#[derive(Serialize, Deserialize)]
pub(super) struct Params {
    /// Updates applied so far.
    pub(super) version: u64,
    /// No more steps: the worker stops.
    pub(super) done: bool,
    pub(super) params: Floats,
    /// Where the workers' data start: a resumed run's position, else 0, 0.
    pub(super) epoch: u64,
    pub(super) offset: u64,
}

pub(super) fn rpc_err(what: &'static str) -> impl Fn(RpcError) -> TrainError {
    move |error| TrainError::Rpc { what, error }
}
