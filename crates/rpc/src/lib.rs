//! Remote procedure calls between the processes of a job: what
//! `torch.distributed.rpc` is to PyTorch, for what data parallelism cannot
//! express (a parameter server, a pipeline of model stages).
//!
//! - [`init_rpc`] joins the job's RPC group as a named worker, through the
//!   same `env://` store as `cohort-comm` (or [`init_rpc_with_store`]).
//!   Rust has no pickling: each worker serves the functions of its
//!   [`Registry`], typed handlers registered by name whose arguments and
//!   results are serde values (encoded with postcard).
//! - [`Rpc`] is the agent: [`rpc_sync`](Rpc::rpc_sync),
//!   [`rpc_async`](Rpc::rpc_async) (an [`RpcFuture`], also a `Future`),
//!   [`remote`](Rpc::remote) (an [`RRef`] whose value stays on its owner,
//!   fetched with [`RRef::to_here`], freed when the last reference on any
//!   worker is dropped), and [`shutdown`](Rpc::shutdown), which waits for
//!   outstanding work on every worker.
//! - [`RpcError`] says which worker and function failed: a handler's error
//!   with its message, an unknown function, a timeout, a dead worker (every
//!   call pending on it fails at once).
//! - [`Floats`]: a `Vec<f32>` that travels as raw bytes (parameters,
//!   gradients).
//!
//! # Design
//!
//! One TCP connection per pair of workers carries calls both ways, each
//! tagged with a request id, so any number can be in flight. Each
//! connection has a reader thread, and handlers run on a pool of threads:
//! plain blocking threads rather than an async runtime because handlers
//! here are CPU work (optimizer steps, forward passes) or block on other
//! calls, worlds are small (one thread per peer is a few dozen threads), and
//! the rest of cohort is synchronous; a blocking reader costs one wake-up
//! per frame and needs no executor in the caller. With the job secret set
//! (`COHORT_SECRET`), connections are authenticated with `cohort-store`'s
//! challenge-response handshake.
//!
//! This crate never spawns processes and knows nothing of models; it only
//! moves calls and values between workers.
//!
//! ```
//! use cohort_rpc::{init_rpc_with_store, Registry, RpcOptions};
//! use std::sync::Arc;
//!
//! let mut registry = Registry::new();
//! registry.register("add", |_ctx, (a, b): (i64, i64)| Ok::<_, String>(a + b));
//! // A world of one, through an in-process store: a real job uses
//! // `init_rpc("trainer", rank, world_size, registry)` under `cohort run`.
//! let store = Arc::new(cohort_store::HashStore::new());
//! let rpc = init_rpc_with_store(store, "solo", 0, 1, registry, RpcOptions::default()).unwrap();
//! let sum: i64 = rpc.rpc_sync("solo", "add", (2i64, 3i64)).unwrap();
//! assert_eq!(sum, 5);
//! let rref = rpc.remote::<_, i64>("solo", "add", (20i64, 22i64)).unwrap();
//! assert_eq!(rref.to_here().unwrap(), 42);
//! rpc.shutdown().unwrap();
//! ```
#![deny(missing_docs)]

mod agent;
mod error;
mod floats;
mod future;
mod init;
mod registry;
mod rref;
mod wire;

pub use agent::{Rpc, RpcOptions, ToWorker};
pub use error::RpcError;
pub use floats::Floats;
pub use future::RpcFuture;
pub use init::{init_rpc, init_rpc_with_options, init_rpc_with_store};
pub use registry::{CallContext, Registry, WorkerInfo};
pub use rref::{RRef, RRefId};
