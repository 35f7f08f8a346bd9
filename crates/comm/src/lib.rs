//! Collective communication for CPU processes: what c10d and Gloo are to
//! PyTorch, over shared memory and TCP.
//!
//! A [`ProcessGroup`] is a set of ranks that run collectives together:
//! point-to-point [`send`](ProcessGroup::send)/[`recv`](ProcessGroup::recv),
//! [`broadcast`](ProcessGroup::broadcast), [`reduce`](ProcessGroup::reduce),
//! [`all_reduce`](ProcessGroup::all_reduce),
//! [`reduce_scatter`](ProcessGroup::reduce_scatter),
//! [`all_gather`](ProcessGroup::all_gather), [`gather`](ProcessGroup::gather),
//! [`scatter`](ProcessGroup::scatter), [`all_to_all`](ProcessGroup::all_to_all)
//! and [`barrier`](ProcessGroup::barrier), each blocking on slices or async
//! on owned buffers (returning a [`Work`]), on any [`Element`] type (f32, f64,
//! i32, i64, u8, bf16) with any [`ReduceOp`].
//!
//! Layers, top to bottom:
//! - [`init_process_group`] (`env://`, `tcp://`, `file://`), [`spawn()`]
//!   (threads) and [`spawn::processes`] build groups; ranks meet through a
//!   [`cohort_store::Store`]. [`ProcessGroup::new_group`] makes sub-groups.
//! - [`ProcessGroup`] orders collectives (sequence numbers), validates
//!   arguments, runs async work, and aborts on the first failure.
//! - A [`Backend`] executes calls on bytes. The one backend today,
//!   [`MeshBackend`], runs Gloo-style algorithms (one file per algorithm in
//!   `collectives/`) as schedules of frames driven by a non-blocking
//!   progress engine.
//! - A [`transport::Transport`] only moves bytes between pairs: ring
//!   buffers in shared memory when every rank is on one host
//!   ([`transport::shm`]), else a full mesh of sockets (Unix domain sockets
//!   between ranks on the same host, TCP between hosts). On shared memory,
//!   large all_reduces skip the rings and reduce straight from the peers'
//!   memory; groups that span several nodes all_reduce hierarchically
//!   (inside each node, then among one leader per node).
//!
//! Failures never hang: every operation has a deadline (the group timeout,
//! 10 minutes by default, as NCCL's, `COHORT_TIMEOUT`), a dead peer fails pending calls
//! at once, mismatched calls are reported by a header check on every frame
//! (and a full cross-check under `COHORT_DEBUG=detail`), and an aborted
//! group refuses further calls. The [`flight`] recorder keeps each group's
//! last collectives; when one fails, the ranks pool their rings through the
//! store and the first to fail names, in one line, the rank that diverged.
//! This crate knows nothing of models or training (the phase and step it
//! records are set by its caller, [`flight::set_context`]).
//!
//! Environment: MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE, LOCAL_RANK,
//! LOCAL_WORLD_SIZE (`env://`); `COHORT_STORE_HOSTED=1` (a launcher hosts
//! the store, so rank 0 does not); `COHORT_RESTART_COUNT` (set by the
//! launcher; keeps restarts apart in its store); `COHORT_TIMEOUT`,
//! `COHORT_ALGO=auto|ring|tree|shm|hierarchical`, `COHORT_DEBUG=detail`,
//! `COHORT_SOCKET_ADDR` and `COHORT_TRANSPORT=auto|shm|unix|tcp` (see
//! [`GroupOptions::from_env`] and [`transport`]); `COHORT_NODE_ID` names
//! this process's node for the hierarchical all_reduce, reduce_scatter and
//! all_gather (default: the host).
//! Under `srun`, Slurm's variables stand in for the unset ones
//! (`cohort_store::slurm`); `COHORT_FLIGHT_RECORDER` sizes the flight
//! recorder's ring (0: off), `COHORT_FLIGHT_DIR` is where rings are
//! written as JSON.
//!
//! ```
//! use cohort_comm::{spawn, CommError, ReduceOp};
//!
//! let sums = spawn::threads(3, |pg| {
//!     let mut x = vec![pg.rank() as f32; 4];
//!     pg.all_reduce(&mut x, ReduceOp::Sum)?;
//!     Ok::<_, CommError>(x[0])
//! })
//! .unwrap();
//! assert_eq!(sums, vec![3.0, 3.0, 3.0]);
//! ```
#![deny(missing_docs)]

pub mod backend;
mod collectives;
mod config;
mod element;
mod engine;
mod error;
pub mod flight;
mod group;
mod init;
mod kinds;
mod p2p;
mod reduce_op;
mod registry;
pub mod spawn;
pub mod transport;
mod work;

pub use backend::{
    Algorithm, Backend, DebugLevel, MeshBackend, OpContext, OpKind, ALL_COLLECTIVES,
};
pub use config::InitOptions;
pub use config::{parse_duration, GroupOptions, DEFAULT_TIMEOUT};
pub use element::{DType, Element};
pub use error::CommError;
pub use group::ProcessGroup;
pub use half::bf16;
pub use init::{init_process_group, STORE_HOSTED_VAR};
pub use reduce_op::{reduce_into, ReduceOp};
pub use registry::{register_backend, registered_backends, BackendInit};
/// `spawn(n, f)`: [`spawn::threads`], mp.spawn's role for tests and single-machine runs.
pub use spawn::threads as spawn;
pub use work::Work;
