//! The launcher's errors: what stopped a launch before or between the
//! workers' runs. How the workers themselves ended is not an error but a
//! [`LaunchOutcome`](crate::LaunchOutcome).

use std::path::PathBuf;
use std::time::Duration;

use cohort_store::StoreError;

/// Why [`launch`](crate::launch) could not run the job.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum LaunchError {
    /// The configuration contradicts itself.
    #[error("invalid launch configuration: {0}")]
    Config(String),
    /// Node 0 could not host the rendezvous store because the port is taken.
    #[error(
        "port {port} on {addr} is already in use: cannot host the rendezvous store \
         (pick another with --master-port, or use --standalone for a free one)"
    )]
    PortInUse {
        /// The address the launcher tried to bind.
        addr: String,
        /// The port that is taken.
        port: u16,
    },
    /// Node 0 could not host the rendezvous store for another reason.
    #[error("cannot host the rendezvous store on {addr}:{port}")]
    Host {
        /// The address the launcher tried to bind.
        addr: String,
        /// The port.
        port: u16,
        /// What the store said.
        #[source]
        source: StoreError,
    },
    /// The rendezvous store failed or could not be reached.
    #[error("rendezvous store at {addr}:{port}: cannot {op}")]
    Store {
        /// The store's address.
        addr: String,
        /// Its port.
        port: u16,
        /// What the launcher was doing.
        op: String,
        /// What the store said.
        #[source]
        source: StoreError,
    },
    /// Too few node agents arrived in time.
    #[error(
        "rendezvous round {round}: only {arrived} of the {needed} nodes needed joined within \
         {timeout:?} (missing node ranks {missing:?})"
    )]
    JoinTimeout {
        /// The restart round being joined.
        round: u32,
        /// Node agents that did arrive.
        arrived: usize,
        /// Node agents needed (`nnodes`, or MIN of an elastic job).
        needed: usize,
        /// Node ranks that never arrived.
        missing: Vec<usize>,
        /// How long the agent waited.
        timeout: Duration,
    },
    /// Two node agents claimed the same node rank.
    #[error("node rank {node_rank} is already taken by another agent ({holder})")]
    DuplicateNodeRank {
        /// The contested node rank.
        node_rank: usize,
        /// What the other agent announced about itself.
        holder: String,
    },
    /// The node agents disagree about the shape of the job.
    #[error("node {node_rank} was started with {setting} = {theirs}, this node with {ours}")]
    NodeMismatch {
        /// The disagreeing node.
        node_rank: usize,
        /// Which setting differs.
        setting: &'static str,
        /// Its value on that node.
        theirs: String,
        /// Its value here.
        ours: String,
    },
    /// A worker process could not be started.
    #[error("cannot start worker rank {rank} ({})", program.display())]
    Spawn {
        /// Global rank of the worker.
        rank: usize,
        /// The program that failed to start.
        program: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// Signal handling could not be installed.
    #[error("cannot install the launcher's signal handlers")]
    Signals(#[source] std::io::Error),
    /// The health-check endpoint or the heartbeat thread could not start.
    #[error("cannot start the agent's {what}")]
    Agent {
        /// Which part: `health-check endpoint on port N`, `heartbeat thread`.
        what: String,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
}
