//! Parameter-server training (rank 0 holds the model, the others push gradients), over `cohort-rpc`:
//! `cohort run -n K train --strategy parameter-server`.
//!
//! Rank 0 is the server: it holds the parameters, the AdamW state and the
//! learning-rate schedule, applies every update, evaluates and logs. Ranks
//! 1..K-1 are workers: each trains on its own shard of the data (the
//! DistributedSampler of a world of K-1, as DDP's ranks would), computes
//! the gradient of a step and pushes it (`ps.push`); the answer is the
//! parameters to compute the next gradient on.
//!
//! - **sync**: the server waits for every worker's gradient of step `s`,
//!   averages them in worker order (sum, then divide by K-1, as DDP's
//!   all-reduce does), scales, checks and clips them exactly as `train`
//!   does (the same training loop), steps AdamW, and answers every worker
//!   with the new parameters. The parameters after each step are DDP's over
//!   K-1 ranks: bitwise with two workers, where the sum of two gradients
//!   does not depend on the order.
//! - **async**: the server applies each gradient as it arrives, one update
//!   per push, and answers that worker at once. A gradient computed on
//!   parameters `staleness` updates older than the server's is applied if
//!   `staleness <= max_staleness` and dropped otherwise; the log reports the
//!   mean and largest staleness applied and how many were dropped. The run
//!   ends after `steps` updates.
//!
//! Handlers only pass gradients and parameters through a shared board; the
//! server's own thread owns the model. In sync mode the server writes the
//! checkpoints (`--out`, as `train` does, with the workers' data position)
//! and resumes from one (`--resume`): the workers learn the step and the
//! data position from their first pull. Async mode refuses both, since its
//! workers' data positions drift apart. This module never opens a socket
//! itself.

use std::io::Write;
use std::sync::Arc;

use cohort_data::Dataset;
use cohort_rpc::{Registry, Rpc, RpcOptions};
use cohort_store::Store;

use crate::config::{PsMode, TrainConfig};
use crate::error::{ConfigError, TrainError};
use crate::input::{build_dataset, FileData};
use crate::step_loop::Outcome;

mod board;
mod messages;
mod server;
mod worker;

use messages::rpc_err;
use server::Server;
use worker::work;

/// How the processes of a parameter-server job join one RPC group (named
/// for that, not `Rendezvous`, which is the launcher's round of joining).
pub enum RpcJoin {
    /// The `env://` variables (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), as
    /// `cohort run` sets them.
    Env,
    /// A store every process reaches, this process's rank, the number of
    /// processes, and the RPC settings.
    Store {
        /// The store.
        store: Arc<dyn Store>,
        /// This process's rank (0: the server).
        rank: usize,
        /// Processes: the server and the workers.
        world: usize,
        /// RPC settings (timeout, secret).
        options: RpcOptions,
    },
}

impl RpcJoin {
    /// This process's rank (0: the server) and the number of processes.
    pub fn rank_and_world(&self) -> Result<(usize, usize), TrainError> {
        Ok(match self {
            RpcJoin::Env => (env_usize("RANK")?, env_usize("WORLD_SIZE")?),
            RpcJoin::Store { rank, world, .. } => (*rank, *world),
        })
    }
}

/// Trains with a parameter server: rank 0 serves, the other ranks push
/// gradients. Every process calls it with the same config; the server logs
/// to `log`. Returns the server's outcome on the server (losses, tokens/s
/// of all workers, the final parameters) and the worker's on a worker (its
/// phases, the parameters it last received).
pub fn train_parameter_server(
    cfg: &TrainConfig,
    how: RpcJoin,
    log: &mut dyn Write,
) -> Result<Outcome, TrainError> {
    cfg.validate()?;
    if cfg.ps_mode == PsMode::Async && (cfg.out.is_some() || cfg.resume.is_some()) {
        return Err(ConfigError::Invalid {
            key: "ps_mode",
            value: "async".into(),
            why: "writes and resumes no checkpoints (--out, --resume): its workers' data \
                  positions drift apart; use --ps-mode sync or ddp for those",
        }
        .into());
    }
    train_parameter_server_timed(cfg, how, log, 1)
}

/// [`train_parameter_server`], with the throughput measured after the first
/// `untimed_steps` steps (a benchmark's warm-up) instead of after the first.
pub fn train_parameter_server_timed(
    cfg: &TrainConfig,
    how: RpcJoin,
    log: &mut dyn Write,
    untimed_steps: u64,
) -> Result<Outcome, TrainError> {
    let (rank, world) = how.rank_and_world()?;
    if world < 2 {
        return Err(ConfigError::Invalid {
            key: "strategy",
            value: "parameter-server".into(),
            why: "needs a server and at least one worker: run under `cohort run -n K`, K >= 2",
        }
        .into());
    }
    run_role(cfg, how, rank, world, log, untimed_steps)
}

/// Serves (rank 0) or works; throughput is timed after `untimed_steps` steps.
fn run_role(
    cfg: &TrainConfig,
    how: RpcJoin,
    rank: usize,
    world: usize,
    log: &mut dyn Write,
    untimed_steps: u64,
) -> Result<Outcome, TrainError> {
    let options = rpc_options(&how, world)?;
    if rank == 0 {
        // The server prepares file data (tokenizing, caching) before anyone
        // can join, so the workers open the finished cache.
        let data = dataset(cfg, true)?;
        let server = Server::new(cfg, data, world - 1, options.timeout)?;
        let mut registry = Registry::new();
        server.board.register(&mut registry);
        let rpc = join(how, rank, world, registry, options)?;
        let outcome = server.serve(&rpc, log, untimed_steps);
        finish(&rpc, outcome)
    } else {
        let rpc = join(how, rank, world, Registry::new(), options)?;
        let outcome =
            dataset(cfg, false).and_then(|data| work(cfg, &rpc, data, rank - 1, world - 1));
        finish(&rpc, outcome)
    }
}

/// Shuts the agent down after a run that went well; after a failure, the
/// failure is what the caller sees (the other processes see this one leave).
fn finish(rpc: &Rpc, outcome: Result<Outcome, TrainError>) -> Result<Outcome, TrainError> {
    let outcome = outcome?;
    rpc.shutdown().map_err(rpc_err("shutting down"))?;
    Ok(outcome)
}

fn env_usize(name: &'static str) -> Result<usize, TrainError> {
    let v = std::env::var(name).map_err(|_| ConfigError::Invalid {
        key: "strategy",
        value: "parameter-server".into(),
        why: "needs RANK and WORLD_SIZE: run under `cohort run -n K`, K >= 2",
    })?;
    v.parse().map_err(|_| {
        ConfigError::Invalid {
            key: name,
            value: v.clone(),
            why: "must be a non-negative integer",
        }
        .into()
    })
}

fn join(
    how: RpcJoin,
    rank: usize,
    world: usize,
    registry: Registry,
    options: RpcOptions,
) -> Result<Rpc, TrainError> {
    let name = if rank == 0 {
        "ps".to_string()
    } else {
        format!("worker{rank}")
    };
    match how {
        RpcJoin::Env => cohort_rpc::init_rpc_with_options(&name, rank, world, registry, options),
        RpcJoin::Store { store, .. } => {
            cohort_rpc::init_rpc_with_store(store, &name, rank, world, registry, options)
        }
    }
    .map_err(rpc_err("joining the RPC group"))
}

/// The RPC settings of `how`, with a handler thread per worker to spare:
/// a sync push holds one on the server until every worker's gradient is in.
fn rpc_options(how: &RpcJoin, world: usize) -> Result<RpcOptions, TrainError> {
    let mut o = match how {
        RpcJoin::Env => RpcOptions::from_env().map_err(rpc_err("reading the RPC settings"))?,
        RpcJoin::Store { options, .. } => options.clone(),
    };
    o.num_worker_threads = o.num_worker_threads.max(world + 2);
    Ok(o)
}

/// The data set, without a process group: the server opens (and if need be
/// builds) file data first, the workers after it.
fn dataset(cfg: &TrainConfig, create: bool) -> Result<Arc<dyn Dataset>, TrainError> {
    if matches!(cfg.data.as_str(), "markov" | "random") {
        return Ok(build_dataset(cfg)?.into());
    }
    Ok(Arc::new(FileData::open(cfg, create)?))
}
