//! cohort's training loop as a library: what nanoGPT's `train.py` is, for
//! the mini-GPT of `cohort-gpt`, data-parallel through `cohort-ddp`.
//!
//! - [`TrainArgs`] / [`TrainConfig`]: settings from defaults, a TOML file and
//!   flags (flags win).
//! - [`Dataset`]: the seam for training data; built in are [`MarkovCorpus`]
//!   (the default: a learnable corpus whose optimal loss is known and
//!   printed) and [`RandomTokens`] (uniform random tokens, `--data random`);
//!   both live in cohort-data.
//! - [`train`]: data-parallel training as one rank of a [`ProcessGroup`];
//!   rank 0 logs in the format of PyTorch's DDP tutorials
//!   (`[step 10 / 50] loss = 9.3437`) plus throughput and time per phase,
//!   evaluates, and writes checkpoints that `--resume` continues bitwise.
//!   With `strategy = zero1` it is ZeRO stage 1 (PyTorch's
//!   `ZeroRedundancyOptimizer`): the optimizer state sharded over the ranks;
//!   [`Zero1`] is its step on flat buffers, for callers with their own loop
//!   (`cohort bench ddp --strategy zero1`). With `strategy = zero2` the
//!   gradients are sharded too, and with `zero3` the parameters as well,
//!   each block gathered only while it runs (FSDP); [`ShardedDp`] is their
//!   forward, backward and step over a model. [`memory_per_rank`] counts what
//!   a rank holds under each, for the header and the memory check.
//!   [`train_pipeline`] and [`train_parameter_server`] are the other
//!   strategies. All of them run the same training loop (`step_loop`): a
//!   strategy supplies its step's gradients (DDP: micro-batches and a
//!   synchronising backward; pipeline: the schedule over stages; parameter
//!   server: the workers' pushes), how the clipping norm combines across
//!   ranks, how an update is applied, evaluation and checkpoints; the loop
//!   does NaN/Inf skips, clipping, the learning-rate schedule, logging and
//!   the intervals, the same way for every strategy.
//! - [`PipelineRank`]: one pipeline rank stepped from outside the loop
//!   (`cohort bench pipeline`).
//! - [`run`]: what `cohort train` calls: joins the job the launcher set up
//!   (`RANK` in the environment: `env://`) or trains alone.
//!
//! This crate never parses the command line itself (the binary does, with
//! [`TrainArgs`]) and never talks to peers except through the process group.
//!
//! ```no_run
//! use cohort_train::{train, TrainConfig};
//!
//! let pg = cohort_train::process_group_from_env().unwrap();
//! let cfg = TrainConfig { steps: 50, ..TrainConfig::default() };
//! let outcome = train(&cfg, &pg, &mut std::io::stdout()).unwrap();
//! println!("final loss {:?}, floor {:?}", outcome.train_losses.last(), outcome.loss_floor);
//! ```
#![deny(missing_docs)]

mod batches;
mod checkpoint;
mod config;
pub mod elastic;
mod fault;
mod file_data;
mod memory;
mod pages;
mod parameter_server;
mod phases;
mod pipeline;
mod run_log;
mod sharded;
mod step_loop;
mod train;
mod trainer_files;
mod zero;

pub use checkpoint::{consolidate, TrainState};
pub use cohort_data::{Dataset, MarkovCorpus, MarkovSpec, RandomTokens, Split};
pub use config::{
    ConfigError, Overlap, PipelineSchedule, Precision, PsMode, Strategy, TrainArgs, TrainConfig,
    TUNED_BUCKET_CAP_MB,
};
pub use fault::{NanInjection, INJECT_NAN_VAR};
pub use file_data::build_dataset;
pub use file_data::FileData;
pub use memory::{memory_per_rank, MemoryPerRank, Sharding};
pub use parameter_server::{train_parameter_server, train_parameter_server_timed, Rendezvous};
pub use phases::{peak_rss_mb, process_cpu_ms, Phase, Phases, PHASES};
pub use pipeline::{train_pipeline, PipelineRank, PipelineStepTimes};
pub use run_log::METRICS_FILE;
pub use sharded::{ShardedDp, ZeroStage};
pub use train::{model_config, param_specs, train, Outcome};
pub use trainer_files::{
    load_optimizer_into, load_trainer_state, optimizer_file, trainer_state_json, TrainerState,
    OPTIMIZER_FILE, TRAINER_STATE_FILE,
};
pub use zero::{Zero1, Zero1Times};

use cohort_comm::{init_process_group, CommError, GroupOptions, InitOptions, ProcessGroup};
use std::path::PathBuf;
use std::sync::Arc;

/// What can stop a training run.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TrainError {
    /// Bad settings.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The model refused its config or a batch.
    #[error("model: {0}")]
    Model(#[from] cohort_gpt::GptError),
    /// The optimizer, schedule or clipping refused.
    #[error("optimizer: {0}")]
    Optim(#[from] cohort_engine::optim::OptimError),
    /// Data parallelism failed (model mismatch, unused parameter, a collective).
    #[error("ddp: {0}")]
    Ddp(#[from] cohort_ddp::DdpError),
    /// A collective of the loop itself failed.
    #[error("{what}: {error}")]
    Comm {
        /// What the loop was doing.
        what: &'static str,
        /// The error.
        error: CommError,
    },
    /// Saving or loading a checkpoint failed.
    #[error("checkpoint: {0}")]
    Checkpoint(#[from] cohort_gpt::checkpoint::CheckpointError),
    /// Checkpoints cannot be written (checked before the first step), or
    /// the final checkpoint or too many in a row were not saved: the work
    /// since the last good checkpoint would be lost.
    #[error("{0}")]
    CheckpointLost(String),
    /// The settings need more memory than this host has available (known
    /// before anything is allocated).
    #[error("{0}")]
    TooBig(String),
    /// `--init-from` names a model the run cannot start from.
    #[error("cannot start from {path}: {reason}")]
    InitFrom {
        /// The directory.
        path: PathBuf,
        /// What does not fit.
        reason: String,
    },
    /// A checkpoint cannot be resumed by this run.
    #[error("cannot resume from {path}: {reason}")]
    Resume {
        /// The checkpoint.
        path: PathBuf,
        /// Why.
        reason: String,
    },
    /// The data is unusable: a data file (`--data PATH`), a built-in data
    /// set's parameters, or the ranks' split of it.
    #[error("data: {0}")]
    Data(#[from] cohort_data::DataError),
    /// The tokenizer (`--tokenizer`) could not be built, loaded or saved.
    #[error("tokenizer: {0}")]
    Tokenizer(#[from] cohort_tokenizer::TokenizerError),
    /// Writing the log failed.
    #[error("writing the log: {0}")]
    Log(std::io::Error),
    /// The run log directory (`--log-dir`, or `--out`'s `logs`) cannot be
    /// created or written.
    #[error("run log: {0}")]
    RunLog(String),
    /// Another rank could not resume from the checkpoint this rank tried
    /// (each rank reads only the files it needs, so only it saw why).
    #[error("rank {rank}: {message}")]
    PeerResume {
        /// The rank that failed.
        rank: usize,
        /// Whether it found the checkpoint damaged (an older one may do).
        damaged: bool,
        /// Its error.
        message: String,
    },
    /// The ranks built models of different sizes, so there is no one flat
    /// buffer to shard (ZeRO-1).
    #[error(
        "the ranks built models of different sizes ({min} to {max} parameters): every rank \
         needs the same model settings"
    )]
    ModelMismatch {
        /// The smallest parameter count of a rank.
        min: usize,
        /// The largest.
        max: usize,
    },
    /// A buffer handed to a sharded optimizer step is not as long as the
    /// parameters it was built over.
    #[error("ZeRO: {what} has {len} elements, but the parameters it shards have {expected}")]
    BufferLength {
        /// Which buffer.
        what: &'static str,
        /// Its length.
        len: usize,
        /// The parameter count.
        expected: usize,
    },
    /// The parameter server's calls failed (a worker or the server died,
    /// timed out, or refused a gradient).
    #[error("parameter server: {what}: {error}")]
    Rpc {
        /// What the run was doing.
        what: &'static str,
        /// The error.
        error: cohort_rpc::RpcError,
    },
    /// Too many updates in a row were skipped for a NaN or infinite loss or
    /// gradient (`max_consecutive_skips`).
    #[error(
        "diverged: {skipped} updates in a row skipped for a NaN or infinite loss or gradient, \
         the last at step {step} (max_consecutive_skips = {skipped}; {total} skipped in this run); \
         lower the learning rate or resume from an earlier checkpoint"
    )]
    Diverged {
        /// The step (1-based) of the last skip.
        step: u64,
        /// Skips in a row.
        skipped: u64,
        /// Skips in the run.
        total: u64,
    },
    /// The model handed a sharded strategy a range of its buffers that lies
    /// in no part the strategy sharded (the model and the strategy disagree
    /// on the model's layout).
    #[error("ZeRO: the model handed elements {start}..{end}, which lie in no sharded part")]
    UnknownPart {
        /// The range's first element.
        start: usize,
        /// One past its last.
        end: usize,
    },
    /// A test hook's environment variable is malformed.
    #[error("{var}={value:?}: expected {expected}")]
    Hook {
        /// The variable.
        var: &'static str,
        /// Its value.
        value: String,
        /// The form it must have.
        expected: &'static str,
    },
}

impl TrainError {
    /// Whether running again cannot help: bad settings, unusable data or
    /// tokenizer, settings too big for the host. A launcher need not restart
    /// a worker that failed so.
    pub fn is_permanent(&self) -> bool {
        matches!(
            self,
            TrainError::Config(_)
                | TrainError::Data(_)
                | TrainError::Tokenizer(_)
                | TrainError::Hook { .. }
                | TrainError::TooBig(_)
                | TrainError::ModelMismatch { .. }
                | TrainError::BufferLength { .. }
        )
    }

    /// The error of a collective the loop itself ran, saying what it was doing.
    pub fn comm(what: &'static str) -> impl Fn(CommError) -> TrainError {
        move |error| TrainError::Comm { what, error }
    }
}

/// The process group of this process: the job's, when a launcher (or the
/// user) set `RANK` (`env://`: MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE),
/// or Slurm set SLURM_PROCID and the user MASTER_ADDR (srun; SLURM_PROCID
/// alone is also set in a batch script's own step); otherwise a world of
/// one, which opens no socket.
pub fn process_group_from_env() -> Result<ProcessGroup, TrainError> {
    let var = |name| std::env::var_os(name).is_some();
    let pg = if var("RANK") || (var("SLURM_PROCID") && var("MASTER_ADDR")) {
        init_process_group("tcp", "env://", InitOptions::default())
    } else {
        GroupOptions::from_env().and_then(|opts| {
            ProcessGroup::new(Arc::new(cohort_store::HashStore::new()), 0, 1, opts)
        })
    };
    pg.map_err(TrainError::comm("joining the process group"))
}

/// The process group `cfg.backend` asks for: [`process_group_from_env`]
/// for `cohort`; any other name is a backend of cohort-comm's registry
/// (`mpi`, registered by a program built with it), whose group is built
/// from the environment as `init_process_group(name, "env://")`.
pub fn process_group_for(cfg: &TrainConfig) -> Result<ProcessGroup, TrainError> {
    match cfg.backend.as_str() {
        "cohort" => process_group_from_env(),
        name => init_process_group(name, "env://", InitOptions::default())
            .map_err(TrainError::comm("joining the process group")),
    }
}

/// `cohort train`: joins the job (or trains alone) and trains, rank 0
/// logging to stdout.
pub fn run(cfg: &TrainConfig) -> Result<Outcome, TrainError> {
    if cfg.strategy == Strategy::ParameterServer {
        // No process group: the server and its workers talk over RPC. A
        // resumed run keeps its global batch over another number of workers
        // as DDP's does over another number of ranks, and says so.
        let (rank, world) = Rendezvous::Env.rank_and_world()?;
        let workers = world.saturating_sub(1).max(1);
        let (cfg, notes) =
            elastic::prepare_resume(cfg, workers, elastic::restart_count_from_env()?);
        if rank == 0 {
            notes.iter().for_each(|note| println!("{note}"));
        }
        return train_parameter_server(&cfg, Rendezvous::Env, &mut std::io::stdout());
    }
    let pg = process_group_for(cfg)?;
    // After a restart by the launcher, continue from the job's checkpoints.
    let (cfg, notes) = elastic::prepare_resume(cfg, pg.size(), elastic::restart_count_from_env()?);
    if pg.rank() == 0 {
        notes.iter().for_each(|note| println!("{note}"));
    }
    let cfg = &cfg;
    if cfg.strategy == Strategy::Pipeline {
        return train_pipeline(cfg, &pg, &mut std::io::stdout());
    }
    train(cfg, &pg, &mut std::io::stdout())
}
