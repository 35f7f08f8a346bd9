//! The environment contract between `cohort run` and its workers: the names of
//! the variables, the values the launcher gives each worker, and
//! [`WorkerEnv`], with which a worker reads them back. Names follow torchrun
//! where torchrun has one. This module only computes and parses variables; it
//! never changes the launcher's own environment.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Global rank of the worker, `0..WORLD_SIZE`.
pub const RANK: &str = "RANK";
/// Rank of the worker on its node, `0..LOCAL_WORLD_SIZE`.
pub const LOCAL_RANK: &str = "LOCAL_RANK";
/// Workers in the job.
pub const WORLD_SIZE: &str = "WORLD_SIZE";
/// Workers on this node.
pub const LOCAL_WORLD_SIZE: &str = "LOCAL_WORLD_SIZE";
/// Rank of the node (torchrun's name for `--node-rank`).
pub const GROUP_RANK: &str = "GROUP_RANK";
/// Nodes in the job.
pub const GROUP_WORLD_SIZE: &str = "GROUP_WORLD_SIZE";
/// What the collectives count as a node (cohort-comm's hierarchical
/// all_reduce); see [`JobShape::node_id`].
pub const NODE_ID: &str = "COHORT_NODE_ID";
/// Rank among workers of the same role; every cohort worker has one role, so it equals `RANK`.
pub const ROLE_RANK: &str = "ROLE_RANK";
/// Workers of the same role; equals `WORLD_SIZE`.
pub const ROLE_WORLD_SIZE: &str = "ROLE_WORLD_SIZE";
/// Where rank 0 of a torch.distributed program hosts its own store
/// (`init_process_group(init_method="env://")`): a host of the round's first
/// node. Nothing listens there until rank 0 binds it; cohort's own store is
/// at [`STORE_ADDR`]/[`STORE_PORT`], because torch's workers cannot speak
/// its authenticated handshake.
pub const MASTER_ADDR: &str = "MASTER_ADDR";
/// The free port that goes with [`MASTER_ADDR`], chosen per round.
pub const MASTER_PORT: &str = "MASTER_PORT";
/// Address of the launcher's rendezvous store, for cohort's own workers.
pub const STORE_ADDR: &str = cohort_store::endpoint::STORE_ADDR_VAR;
/// Port of the launcher's rendezvous store.
pub const STORE_PORT: &str = cohort_store::endpoint::STORE_PORT_VAR;
/// torch's names for the job's run id, restart count and restart budget, and
/// for the file where a worker's `@record`-decorated entry point writes its
/// uncaught exception (the launcher reports it). `USE_AGENT_STORE=False`
/// tells torch that rank 0 hosts the store at `MASTER_PORT` itself.
pub const TORCHELASTIC_RUN_ID: &str = "TORCHELASTIC_RUN_ID";
/// See [`TORCHELASTIC_RUN_ID`].
pub const TORCHELASTIC_RESTART_COUNT: &str = "TORCHELASTIC_RESTART_COUNT";
/// See [`TORCHELASTIC_RUN_ID`].
pub const TORCHELASTIC_MAX_RESTARTS: &str = "TORCHELASTIC_MAX_RESTARTS";
/// See [`TORCHELASTIC_RUN_ID`].
pub const TORCHELASTIC_ERROR_FILE: &str = "TORCHELASTIC_ERROR_FILE";
/// See [`TORCHELASTIC_RUN_ID`].
pub const TORCHELASTIC_USE_AGENT_STORE: &str = "TORCHELASTIC_USE_AGENT_STORE";
/// How many times the group has been restarted before this run, for a
/// failure or to change its nodes (torchrun's `TORCHELASTIC_RESTART_COUNT`
/// counts only the former; cohort counts every rendezvous round, so that a
/// worker can tell a first start (0) from one that must resume).
pub const RESTART_COUNT: &str = "COHORT_RESTART_COUNT";
/// The `--max-restarts` of the job.
pub const MAX_RESTARTS: &str = "COHORT_MAX_RESTARTS";
/// Identifies the job; the same on every node (torchrun's `TORCHELASTIC_RUN_ID`).
pub const RUN_ID: &str = "COHORT_RUN_ID";
/// `1` when the launcher hosts the store at `COHORT_STORE_ADDR:COHORT_STORE_PORT`
/// (or `MASTER_ADDR:MASTER_PORT` when those are unset), so rank 0 must connect
/// to it as a client instead of binding the port itself.
pub const STORE_HOSTED: &str = "COHORT_STORE_HOSTED";
/// Threads each worker should use for cohort's own thread pools.
pub const NUM_THREADS: &str = "COHORT_NUM_THREADS";
/// The same for OpenMP libraries a worker may load (torchrun sets it too).
pub const OMP_NUM_THREADS: &str = "OMP_NUM_THREADS";
/// When the launcher started, in microseconds since the Unix epoch: lets
/// workers report their start-up latency.
pub const LAUNCH_TIME_US: &str = "COHORT_LAUNCH_TIME_US";

/// The job as every worker of one node sees it; one per restart round.
#[derive(Debug, Clone)]
pub(crate) struct JobShape {
    pub nproc_per_node: usize,
    /// Nodes in this round.
    pub nnodes: usize,
    /// This node's place among them (`GROUP_RANK`); the node rank it was
    /// started with in a fixed job, its order among the round's nodes in an
    /// elastic one.
    pub group_rank: usize,
    /// The launcher's store, as this node's workers reach it.
    pub store_addr: String,
    pub store_port: u16,
    /// Where a torch.distributed rank 0 hosts its own store this round.
    pub master_addr: String,
    pub master_port: u16,
    /// Restarts after failures so far (torch's restart count).
    pub restarts: u32,
    pub max_restarts: u32,
    pub run_id: String,
    pub launch_time: SystemTime,
}

impl JobShape {
    /// The node its workers are on, for the collectives, in a job of
    /// several launchers (`None` with one): each launcher is a node, as
    /// `LOCAL_WORLD_SIZE` says, so that ranks of one launcher reduce among
    /// themselves first and one of them crosses to the others, also where
    /// two launchers share a host (tests, network namespaces).
    pub fn node_id(&self) -> Option<String> {
        (self.nnodes > 1).then(|| format!("{}/node{}", self.run_id, self.group_rank))
    }

    /// Global rank of local worker `local_rank`.
    pub fn rank(&self, local_rank: usize) -> usize {
        self.group_rank * self.nproc_per_node + local_rank
    }

    /// The variables that identify worker `local_rank` in round `restart`;
    /// `error_file` is where its uncaught exception may be written.
    pub fn worker_vars(
        &self,
        local_rank: usize,
        restart: u32,
        error_file: &str,
    ) -> Vec<(&'static str, String)> {
        let rank = self.rank(local_rank).to_string();
        let world = (self.nnodes * self.nproc_per_node).to_string();
        let launch_us = self
            .launch_time
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default()
            .as_micros();
        vec![
            (RANK, rank.clone()),
            (LOCAL_RANK, local_rank.to_string()),
            (WORLD_SIZE, world.clone()),
            (LOCAL_WORLD_SIZE, self.nproc_per_node.to_string()),
            (GROUP_RANK, self.group_rank.to_string()),
            (GROUP_WORLD_SIZE, self.nnodes.to_string()),
            (ROLE_RANK, rank),
            (ROLE_WORLD_SIZE, world),
            (MASTER_ADDR, self.master_addr.clone()),
            (MASTER_PORT, self.master_port.to_string()),
            (STORE_ADDR, self.store_addr.clone()),
            (STORE_PORT, self.store_port.to_string()),
            (RESTART_COUNT, restart.to_string()),
            (MAX_RESTARTS, self.max_restarts.to_string()),
            (RUN_ID, self.run_id.clone()),
            (STORE_HOSTED, "1".to_string()),
            (TORCHELASTIC_RUN_ID, self.run_id.clone()),
            (TORCHELASTIC_RESTART_COUNT, self.restarts.to_string()),
            (TORCHELASTIC_MAX_RESTARTS, self.max_restarts.to_string()),
            (TORCHELASTIC_ERROR_FILE, error_file.to_string()),
            (TORCHELASTIC_USE_AGENT_STORE, "False".to_string()),
            (LAUNCH_TIME_US, launch_us.to_string()),
        ]
    }
}

/// The thread-count variables the launcher sets because the user did not:
/// the node's cores divided among its workers, at least one each.
/// `user_env` looks a variable up in the launcher's environment.
pub(crate) fn thread_vars(
    cores: usize,
    nproc_per_node: usize,
    user_env: impl Fn(&str) -> Option<String>,
) -> Vec<(&'static str, String)> {
    let threads = (cores / nproc_per_node.max(1)).max(1).to_string();
    [NUM_THREADS, OMP_NUM_THREADS]
        .into_iter()
        .filter(|name| user_env(name).is_none())
        .map(|name| (name, threads.clone()))
        .collect()
}

/// A variable of the contract was missing or malformed.
#[derive(Debug, thiserror::Error)]
#[error("environment variable {var}: {problem} (is this process started by `cohort run`?)")]
pub struct EnvError {
    /// The variable.
    pub var: &'static str,
    /// What is wrong with it.
    pub problem: String,
}

/// What a worker learns from the launcher: its place in the job, where the
/// store is and which restart round it runs in.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkerEnv {
    /// Global rank.
    pub rank: usize,
    /// Rank on this node.
    pub local_rank: usize,
    /// Workers in the job.
    pub world_size: usize,
    /// Workers on this node.
    pub local_world_size: usize,
    /// Rank of this node (`GROUP_RANK`).
    pub node_rank: usize,
    /// Address of the rendezvous store (`COHORT_STORE_ADDR`, else `MASTER_ADDR`).
    pub store_addr: String,
    /// Port of the rendezvous store (`COHORT_STORE_PORT`, else `MASTER_PORT`).
    pub store_port: u16,
    /// Restarts of the group before this run (0 on the first run).
    pub restart_count: u32,
    /// The job's `--max-restarts`.
    pub max_restarts: u32,
    /// Whether the launcher hosts the store (rank 0 must then not bind it).
    pub store_hosted: bool,
    /// Threads for cohort's thread pools, when set.
    pub num_threads: Option<usize>,
    /// When the launcher started, when set.
    pub launch_time: Option<SystemTime>,
}

impl WorkerEnv {
    /// Reads the contract from this process's environment.
    pub fn from_env() -> Result<Self, EnvError> {
        Self::from_lookup(|name| std::env::var(name).ok())
    }

    /// Reads the contract through `lookup` (the environment, or a map in tests).
    pub fn from_lookup(lookup: impl Fn(&str) -> Option<String>) -> Result<Self, EnvError> {
        let required = |var: &'static str| {
            lookup(var).ok_or_else(|| EnvError {
                var,
                problem: "is not set".to_string(),
            })
        };
        fn parse<T: std::str::FromStr>(var: &'static str, value: &str) -> Result<T, EnvError> {
            value.trim().parse().map_err(|_| EnvError {
                var,
                problem: format!("{value:?} is not a valid {}", std::any::type_name::<T>()),
            })
        }
        let optional = |var: &'static str| lookup(var).filter(|v| !v.trim().is_empty());

        let (addr_var, port_var) = cohort_store::endpoint::store_vars(&lookup);
        let rank: usize = parse(RANK, &required(RANK)?)?;
        let world_size: usize = parse(WORLD_SIZE, &required(WORLD_SIZE)?)?;
        if rank >= world_size {
            return Err(EnvError {
                var: RANK,
                problem: format!("rank {rank} is not below WORLD_SIZE {world_size}"),
            });
        }
        let local_rank = match optional(LOCAL_RANK) {
            Some(v) => parse(LOCAL_RANK, &v)?,
            None => rank,
        };
        let local_world_size = match optional(LOCAL_WORLD_SIZE) {
            Some(v) => parse(LOCAL_WORLD_SIZE, &v)?,
            None => world_size,
        };
        let launch_time = match optional(LAUNCH_TIME_US) {
            Some(v) => Some(UNIX_EPOCH + Duration::from_micros(parse(LAUNCH_TIME_US, &v)?)),
            None => None,
        };
        Ok(WorkerEnv {
            rank,
            local_rank,
            world_size,
            local_world_size,
            node_rank: optional(GROUP_RANK)
                .map(|v| parse(GROUP_RANK, &v))
                .transpose()?
                .unwrap_or(0),
            store_addr: required(addr_var)?,
            store_port: parse(port_var, &required(port_var)?)?,
            restart_count: optional(RESTART_COUNT)
                .map(|v| parse(RESTART_COUNT, &v))
                .transpose()?
                .unwrap_or(0),
            max_restarts: optional(MAX_RESTARTS)
                .map(|v| parse(MAX_RESTARTS, &v))
                .transpose()?
                .unwrap_or(0),
            store_hosted: optional(STORE_HOSTED).is_some_and(|v| v.trim() == "1"),
            num_threads: optional(NUM_THREADS)
                .map(|v| parse(NUM_THREADS, &v))
                .transpose()?,
            launch_time,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn shape() -> JobShape {
        JobShape {
            nproc_per_node: 3,
            nnodes: 2,
            group_rank: 1,
            store_addr: "10.0.0.1".into(),
            store_port: 29500,
            master_addr: "10.0.0.1".into(),
            master_port: 29501,
            restarts: 1,
            max_restarts: 2,
            run_id: "r1".into(),
            launch_time: UNIX_EPOCH + Duration::from_micros(1_700_000_000_123_456),
        }
    }

    #[test]
    fn worker_vars_round_trip_through_worker_env() {
        let vars: HashMap<_, _> = shape()
            .worker_vars(2, 1, "/tmp/e.json")
            .into_iter()
            .collect();
        assert_eq!(vars[RANK], "5");
        // torch's rank 0 binds MASTER_PORT; cohort's workers use the store's.
        assert_eq!(
            (vars[MASTER_PORT].as_str(), vars[STORE_PORT].as_str()),
            ("29501", "29500")
        );
        assert_eq!(vars[TORCHELASTIC_RUN_ID], "r1");
        assert_eq!(vars[TORCHELASTIC_ERROR_FILE], "/tmp/e.json");
        assert_eq!(vars[ROLE_RANK], "5");
        assert_eq!(vars[WORLD_SIZE], "6");
        assert_eq!(vars[GROUP_RANK], "1");
        let env = WorkerEnv::from_lookup(|k| vars.get(k).cloned()).unwrap();
        assert_eq!(
            env,
            WorkerEnv {
                rank: 5,
                local_rank: 2,
                world_size: 6,
                local_world_size: 3,
                node_rank: 1,
                store_addr: "10.0.0.1".into(),
                store_port: 29500,
                restart_count: 1,
                max_restarts: 2,
                store_hosted: true,
                num_threads: None,
                launch_time: Some(UNIX_EPOCH + Duration::from_micros(1_700_000_000_123_456)),
            }
        );
    }

    #[test]
    fn threads_divide_the_cores_unless_the_user_set_them() {
        let unset = |_: &str| None;
        assert_eq!(
            thread_vars(8, 3, unset),
            vec![
                (NUM_THREADS, "2".to_string()),
                (OMP_NUM_THREADS, "2".to_string())
            ]
        );
        assert_eq!(thread_vars(2, 4, unset)[0].1, "1");
        let user_set_omp = |k: &str| (k == OMP_NUM_THREADS).then(|| "7".to_string());
        assert_eq!(
            thread_vars(8, 2, user_set_omp),
            vec![(NUM_THREADS, "4".to_string())]
        );
    }

    #[test]
    fn bad_variables_name_the_variable_and_value() {
        let vars = |pairs: &[(&str, &str)]| {
            let map: HashMap<String, String> = pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect();
            WorkerEnv::from_lookup(move |k| map.get(k).cloned())
        };
        let err = vars(&[]).unwrap_err();
        assert_eq!(err.var, RANK);
        let err = vars(&[(RANK, "x"), (WORLD_SIZE, "2")]).unwrap_err();
        assert!(err.to_string().contains("\"x\""), "{err}");
        let err = vars(&[(RANK, "2"), (WORLD_SIZE, "2")]).unwrap_err();
        assert!(err.to_string().contains("WORLD_SIZE 2"), "{err}");
        let env = vars(&[
            (RANK, "1"),
            (WORLD_SIZE, "2"),
            (MASTER_ADDR, "h"),
            (MASTER_PORT, "1"),
        ])
        .unwrap();
        assert_eq!(
            (env.local_rank, env.local_world_size, env.store_hosted),
            (1, 2, false)
        );
    }
}
