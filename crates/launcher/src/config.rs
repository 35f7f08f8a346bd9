//! `LaunchConfig`: what to run and how many of it, torchrun's flags as a
//! plain struct. It never parses command lines (the `cohort` binary does).

use std::ffi::OsString;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use cohort_store::{Secret, Store};

use crate::LaunchError;

/// torchrun's default `--master-port`.
pub const DEFAULT_MASTER_PORT: u16 = 29500;

/// How long stopped workers get between SIGTERM and SIGKILL, unless set.
pub const DEFAULT_STOP_GRACE: Duration = Duration::from_secs(5);

/// How long a node agent waits for the others to join (torchrun's
/// rendezvous `join_timeout`), unless set.
pub const DEFAULT_JOIN_TIMEOUT: Duration = Duration::from_secs(600);

/// How long an agent may miss heartbeats before the others declare its node
/// lost, unless set (torchrun: 3 missed keep-alives of 5 s).
pub const DEFAULT_HEARTBEAT_TIMEOUT: Duration = Duration::from_secs(15);

/// How long a worker that beats may be silent before it counts as frozen.
pub const DEFAULT_WORKER_TIMEOUT: Duration = Duration::from_secs(60);

/// How long an elastic round stays open for more nodes once `min_nodes` have
/// joined, unless set (torchrun's `last_call_timeout` is 30 s).
pub const DEFAULT_LAST_CALL: Duration = Duration::from_secs(10);

/// Given the job's store, a line explaining why a worker went silent (see
/// [`LaunchConfig::explain_silence`]).
pub type ExplainSilence = fn(Arc<dyn Store>) -> Option<String>;

/// Everything [`launch`](crate::launch) needs to run one node's share of a job.
///
/// Field names follow torchrun's flags (`--nproc-per-node` is
/// `nproc_per_node`).
#[derive(Debug, Clone)]
pub struct LaunchConfig {
    /// The worker program; a bare name is looked up in `PATH`.
    pub program: PathBuf,
    /// Its arguments.
    pub args: Vec<OsString>,
    /// Workers on this node.
    pub nproc_per_node: usize,
    /// Nodes in the job; with `min_nodes`, the most nodes a round admits.
    pub nnodes: usize,
    /// Elastic jobs (`--nnodes MIN:MAX`): the fewest nodes a round may run
    /// with. `None` is a fixed job of exactly `nnodes` nodes.
    pub min_nodes: Option<usize>,
    /// This node's rank, `0..nnodes`; node 0 hosts the rendezvous store. In
    /// an elastic job it only orders the nodes: each round numbers the nodes
    /// that joined it `0..` in the order of their node ranks.
    pub node_rank: usize,
    /// torchrun's c10d rendezvous (`--rdzv-backend c10d` without `--node-rank`): `node_rank`
    /// is not given but found. The agent on the machine of `master_addr` that binds the store
    /// there is node 0; the others take ranks 1.. in the order they reach the store. The rank
    /// holds for the agent's whole life, so a node that leaves an elastic job and comes back
    /// is a new node.
    pub node_rank_from_store: bool,
    /// Address of node 0, as the workers and the other nodes reach it.
    pub master_addr: String,
    /// Port of the rendezvous store on node 0.
    pub master_port: u16,
    /// Single node on a free port: `master_port` is ignored and the port the
    /// store gets is passed to the workers.
    pub standalone: bool,
    /// How many times the whole group may be restarted after a failure.
    pub max_restarts: u32,
    /// Time between SIGTERM and SIGKILL when the launcher stops workers.
    pub stop_grace: Duration,
    /// How long a node agent waits for enough nodes to join a round.
    pub join_timeout: Duration,
    /// How long a round waits for more nodes once `min_nodes` have joined.
    pub last_call: Duration,
    /// How long a node may miss heartbeats before the others declare it lost.
    pub heartbeat_timeout: Duration,
    /// How long a worker that beats (see `worker_beat`) may be silent before
    /// the group is stopped and restarted; zero: workers are not watched.
    pub worker_timeout: Duration,
    /// Serve the agent's health on this port (`GET /health`; 0 picks a free
    /// one), as torchrun does with `TORCHELASTIC_HEALTH_CHECK_PORT`.
    pub health_check_port: Option<u16>,
    /// The job secret (`--secret`, `--secret-file`); `None`: from
    /// `COHORT_SECRET`, or made up for a single-node job (see `secret.rs`).
    pub secret: Option<Secret>,
    /// Explains a hang when a worker is found silent: given the job's store (which the
    /// workers publish their flight recorder rings in), a line to print, e.g. which rank
    /// never issued the collective the others wait in. The binary supplies it (the
    /// launcher knows no collectives); `None`: the silent worker alone is named.
    pub explain_silence: Option<ExplainSilence>,
}

impl LaunchConfig {
    /// One worker of `program args` on a single node, with torchrun's defaults.
    pub fn new(program: impl Into<PathBuf>, args: Vec<OsString>) -> Self {
        LaunchConfig {
            program: program.into(),
            args,
            nproc_per_node: 1,
            nnodes: 1,
            min_nodes: None,
            node_rank: 0,
            node_rank_from_store: false,
            master_addr: "127.0.0.1".to_string(),
            master_port: DEFAULT_MASTER_PORT,
            standalone: false,
            max_restarts: 0,
            stop_grace: DEFAULT_STOP_GRACE,
            join_timeout: DEFAULT_JOIN_TIMEOUT,
            last_call: DEFAULT_LAST_CALL,
            heartbeat_timeout: DEFAULT_HEARTBEAT_TIMEOUT,
            worker_timeout: DEFAULT_WORKER_TIMEOUT,
            health_check_port: None,
            secret: None,
            explain_silence: None,
        }
    }

    /// The fewest nodes a round may run with (`nnodes` for a fixed job).
    pub fn min_nodes(&self) -> usize {
        self.min_nodes.unwrap_or(self.nnodes)
    }

    /// Whether the job may run on fewer nodes than `nnodes`.
    pub fn is_elastic(&self) -> bool {
        self.min_nodes() < self.nnodes
    }

    /// Number of workers in the whole job when every node has joined.
    pub fn world_size(&self) -> usize {
        self.nnodes * self.nproc_per_node
    }

    /// Checks what can be checked before binding or spawning anything.
    pub fn validate(&self) -> Result<(), LaunchError> {
        let bad = |msg: String| Err(LaunchError::Config(msg));
        if self.nproc_per_node == 0 {
            return bad("nproc_per_node must be at least 1".into());
        }
        if self.nnodes == 0 {
            return bad("nnodes must be at least 1".into());
        }
        if let Some(min) = self.min_nodes {
            if min == 0 || min > self.nnodes {
                return bad(format!(
                    "nnodes {min}:{} is not a range MIN:MAX with 1 <= MIN <= MAX",
                    self.nnodes
                ));
            }
        }
        if self.heartbeat_timeout.is_zero() {
            return bad("heartbeat_timeout must be above 0".into());
        }
        if self.node_rank >= self.nnodes {
            return bad(format!(
                "node_rank {} is out of range for nnodes {} (node ranks are 0..{})",
                self.node_rank, self.nnodes, self.nnodes
            ));
        }
        if self.standalone && self.nnodes != 1 {
            return bad(format!(
                "standalone is a single-node mode, but nnodes is {}",
                self.nnodes
            ));
        }
        if self.program.as_os_str().is_empty() {
            return bad("no worker program given".into());
        }
        if self.master_addr.is_empty() {
            return bad("master_addr is empty".into());
        }
        if !self.standalone && self.master_port == 0 {
            return bad("master_port 0 is only allowed with standalone".into());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> LaunchConfig {
        LaunchConfig::new("true", vec![])
    }

    #[test]
    fn defaults_are_torchruns() {
        let c = config();
        assert_eq!((c.nproc_per_node, c.nnodes, c.node_rank), (1, 1, 0));
        assert_eq!(
            (c.master_addr.as_str(), c.master_port),
            ("127.0.0.1", 29500)
        );
        assert_eq!(c.world_size(), 1);
        c.validate().unwrap();
    }

    #[test]
    fn contradictions_are_rejected_with_the_values() {
        let mut c = config();
        c.nnodes = 2;
        c.node_rank = 2;
        let err = c.validate().unwrap_err().to_string();
        assert!(
            err.contains("node_rank 2") && err.contains("nnodes 2"),
            "{err}"
        );

        let mut c = config();
        c.standalone = true;
        c.nnodes = 2;
        assert!(c
            .validate()
            .unwrap_err()
            .to_string()
            .contains("nnodes is 2"));

        let mut c = config();
        c.nproc_per_node = 0;
        assert!(c.validate().is_err());

        let mut c = config();
        c.nnodes = 2;
        c.min_nodes = Some(3);
        let err = c.validate().unwrap_err().to_string();
        assert!(err.contains("nnodes 3:2"), "{err}");
        c.min_nodes = Some(1);
        c.validate().unwrap();
        assert!(c.is_elastic() && c.min_nodes() == 1);

        let mut c = config();
        c.master_port = 0;
        assert!(c.validate().is_err());
        c.standalone = true;
        c.validate().unwrap();
    }
}
