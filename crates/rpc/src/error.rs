//! The one error type of every RPC operation. Each variant names the worker
//! and, where there is one, the function, so that a failure in a job of many
//! workers says where it happened. This module must never hold the job
//! secret or a payload in an error.

use std::time::Duration;

/// What went wrong in an RPC operation.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum RpcError {
    /// Joining the RPC group failed: a missing or malformed setting, a
    /// duplicate name, a peer that never showed up.
    #[error("rpc init: {what}: {detail}")]
    Init {
        /// The setting or step at fault (`MASTER_ADDR`, `name`, `connect to worker2`).
        what: String,
        /// What was wrong.
        detail: String,
    },
    /// The rendezvous store failed.
    #[error("rpc: store: {0}")]
    Store(String),
    /// The remote handler returned an error or panicked.
    #[error("rpc {func} on {worker}: handler failed: {message}")]
    Handler {
        /// The worker that ran the handler.
        worker: String,
        /// The function.
        func: String,
        /// The handler's error message.
        message: String,
    },
    /// No handler of that name is registered on the worker.
    #[error("rpc {func} on {worker}: unknown function (registered there: {registered})")]
    UnknownFunction {
        /// The worker asked.
        worker: String,
        /// The name asked for.
        func: String,
        /// The names it has, comma-separated.
        registered: String,
    },
    /// The caller's argument or result type is not the handler's.
    #[error("rpc {func} on {worker}: the handler takes {handler} but the caller sent {caller}")]
    TypeMismatch {
        /// The worker asked.
        worker: String,
        /// The function.
        func: String,
        /// The handler's types (`args -> result`).
        handler: String,
        /// The caller's types.
        caller: String,
    },
    /// No worker of that name (or rank) is in the group.
    #[error("rpc: no worker {worker:?} in this group (workers: {known})")]
    UnknownWorker {
        /// The name or rank asked for.
        worker: String,
        /// The workers there are, comma-separated.
        known: String,
    },
    /// No answer within the call's timeout.
    #[error("rpc {func} on {worker}: no answer within {timeout:?}")]
    Timeout {
        /// The worker called.
        worker: String,
        /// The function (or `rref fetch`, `rref fork`).
        func: String,
        /// The timeout.
        timeout: Duration,
    },
    /// The connection to the worker broke (it died or closed it): every call
    /// to it still pending fails with this at once.
    #[error("rpc {func} on {worker}: worker is gone: {detail}")]
    WorkerGone {
        /// The worker.
        worker: String,
        /// The function of the failed call.
        func: String,
        /// How its connection ended.
        detail: String,
    },
    /// Arguments or results could not be encoded or decoded.
    #[error("rpc {func}: cannot {op} {what}: {detail}")]
    Codec {
        /// The function.
        func: String,
        /// `encode` or `decode`.
        op: &'static str,
        /// `arguments`, `result` or `rref value`.
        what: &'static str,
        /// What the codec said.
        detail: String,
    },
    /// A remote reference's value does not exist on its owner (any more).
    #[error("rpc: rref {rref} on {worker}: {detail}")]
    RRef {
        /// The owner.
        worker: String,
        /// The reference's id.
        rref: String,
        /// What was wrong.
        detail: String,
    },
    /// The agent is shut down (or shutting down) and makes no more calls.
    #[error("rpc: agent {worker} is shut down")]
    ShutDown {
        /// This worker.
        worker: String,
    },
    /// A peer broke the wire protocol (a malformed or oversized frame).
    #[error("rpc: protocol error from {worker}: {detail}")]
    Protocol {
        /// The peer.
        worker: String,
        /// What was wrong.
        detail: String,
    },
}

impl From<cohort_store::StoreError> for RpcError {
    fn from(e: cohort_store::StoreError) -> Self {
        RpcError::Store(e.to_string())
    }
}
