//! The `cohort run` launcher (torchrun's role): starts the workers of a job on
//! each node, watches them, stops them all when one fails, and restarts the
//! whole group up to `max_restarts` times. Jobs may be elastic (torchrun's
//! `--nnodes MIN:MAX`): nodes join late or leave, and each restart runs on
//! the nodes still alive.
//!
//! - [`LaunchConfig`]: what to run, how many per node, on how many nodes
//!   (torchrun's flags as a plain struct);
//! - [`launch`]: runs one node agent to the end and returns a
//!   [`LaunchOutcome`] (how the workers ended) or a [`LaunchError`] (why they
//!   could not run: a port in use, a node that never joined, ...);
//! - [`WorkerEnv`]: the worker's side of the contract, the variables each
//!   worker gets (`RANK`, `LOCAL_RANK`, `WORLD_SIZE`, `MASTER_ADDR`, ...; the
//!   names are the constants in [`vars`]).
//!
//! Node 0's agent hosts the job's `TcpStoreServer` on `MASTER_PORT` before it
//! starts any worker and sets `COHORT_STORE_HOSTED=1`, so the workers' rank 0
//! connects as a client instead of binding the port. The node agents meet in
//! that store to agree on each restart round: which nodes run it (all
//! `nnodes`; in an elastic job at least `min_nodes` of those that joined,
//! `last_call` after the `min_nodes`-th arrived), with `RANK`, `WORLD_SIZE`
//! and `GROUP_RANK` numbered afresh and `COHORT_RESTART_COUNT` set to the
//! round. Every agent beats a heartbeat counter in the store; a node whose
//! counter stands still for `heartbeat_timeout` is lost, and the others
//! restart without it. A node that arrives while a round runs waits for the
//! next; a round with room for it stops and regroups at once (not counted
//! against `max_restarts`). Node 0's store is the job's single point of
//! failure, as in torchrun's c10d rendezvous: when node 0 dies, the job
//! ends. Each agent can serve its health over HTTP (`health_check_port`). Each worker leads its own
//! process group and is SIGKILLed by the kernel if the launcher dies, so no
//! worker outlives the launcher; SIGINT and SIGTERM to the launcher are
//! forwarded to the workers, and so is SIGUSR1, without stopping them: a
//! cohort worker saves at its next step and exits with
//! [`EXIT_SAVED_AND_STOPPED`], which ends the job with that code, not a
//! restart. Worker output is forwarded line by line behind a
//! `[rank<N>]: ` prefix. Linux is the target (the parent-death signal is
//! Linux-only). This crate knows nothing of collectives or models.
//!
//! ```no_run
//! use cohort_launcher::{launch, LaunchConfig};
//!
//! let mut config = LaunchConfig::new("python3", vec!["train.py".into()]);
//! config.nproc_per_node = 2;
//! config.standalone = true;
//! let outcome = launch(&config)?;
//! std::process::exit(outcome.exit_code());
//! # Ok::<(), cohort_launcher::LaunchError>(())
//! ```
#![deny(missing_docs)]

mod config;
mod env;
mod error;
mod events;
mod group;
mod health;
mod heartbeat;
mod launch;
mod output;
mod process;
mod rendezvous;
mod secret;
mod worker_beat;
mod worker_error;

pub use config::{
    ExplainSilence, LaunchConfig, DEFAULT_HEARTBEAT_TIMEOUT, DEFAULT_JOIN_TIMEOUT,
    DEFAULT_LAST_CALL, DEFAULT_MASTER_PORT, DEFAULT_STOP_GRACE,
};
pub use env::{EnvError, WorkerEnv};
pub use error::LaunchError;
pub use group::WorkerFailure;
pub use launch::{launch, LaunchOutcome};
pub use process::{signal_name, ExitReason, EXIT_NOT_RETRYABLE, EXIT_SAVED_AND_STOPPED};
pub use worker_beat::{start_beating_from_env, HEARTBEAT_FILE_VAR};

/// Names of the environment variables the launcher sets for each worker.
pub mod vars {
    pub use crate::env::{
        GROUP_RANK, GROUP_WORLD_SIZE, LAUNCH_TIME_US, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR,
        MASTER_PORT, MAX_RESTARTS, NUM_THREADS, OMP_NUM_THREADS, RANK, RESTART_COUNT, ROLE_RANK,
        ROLE_WORLD_SIZE, RUN_ID, STORE_ADDR, STORE_HOSTED, STORE_PORT, TORCHELASTIC_ERROR_FILE,
        TORCHELASTIC_MAX_RESTARTS, TORCHELASTIC_RESTART_COUNT, TORCHELASTIC_RUN_ID,
        TORCHELASTIC_USE_AGENT_STORE, WORLD_SIZE,
    };
}
