//! The front ends: the protocols clients speak, each turning its requests into calls on the
//! core (the repository's loaded versions, their queues and metrics) and the answers back into
//! its own wire format. KServe v2 over HTTP ([`http`]) and gRPC ([`grpc`]), OpenAI's
//! completions on the HTTP port ([`openai`]). What more than one of them needs sits beside
//! them, below them: [`AppState`] here, the model metadata and effective config both KServe
//! protocols answer ([`metadata`]), the request parameters they share ([`params`]), HTTP bodies
//! and their compression ([`body`]), and a generation streamed as server-sent events ([`sse`]).
//! A front end never imports another front end.
//!
//! A front end never runs a model, never loads one and never counts a metric itself: it
//! parses, asks the repository for a version, queues, and encodes the answer.

pub(crate) mod body;
pub(crate) mod grpc;
pub(crate) mod http;
pub(crate) mod metadata;
pub(crate) mod openai;
pub(crate) mod params;
pub(crate) mod sse;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use crate::metrics::Metrics;
use crate::repository::Repository;

/// What the front ends share.
pub(crate) struct AppState {
    pub repo: Arc<Repository>,
    pub metrics: Arc<Metrics>,
    /// The server answers requests (false before start and from shutdown on).
    pub ready: AtomicBool,
    /// Ready also needs every model asked for to be ready.
    pub strict_readiness: bool,
    pub max_body_bytes: usize,
}

impl AppState {
    /// What the server's readiness (HTTP `/v2/health/ready`, gRPC `ServerReady`) answers.
    pub fn is_ready(&self) -> bool {
        self.ready.load(Ordering::Acquire)
            && (!self.strict_readiness || self.repo.not_ready().is_empty())
    }
}
