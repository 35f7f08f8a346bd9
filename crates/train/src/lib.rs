//! cohort's training loop as a library: what nanoGPT's `train.py` is, for
//! the mini-GPT of `cohort-gpt`, spread over ranks by data parallelism
//! (DDP or ZeRO), a pipeline or a parameter server.
//!
//! - [`TrainArgs`] / [`TrainConfig`]: settings from defaults, a TOML file and
//!   flags (flags win).
//! - [`Dataset`]: the seam for training data; built in are [`MarkovCorpus`]
//!   (the default: a learnable corpus whose optimal loss is known and
//!   printed) and [`RandomTokens`] (uniform random tokens, `--data random`);
//!   both live in cohort-data. [`FileData`] reads files (`--data PATH`).
//! - [`run`]: what `cohort train` calls: joins the job the launcher set up
//!   (`RANK` in the environment: `env://`) or trains alone. [`train`]:
//!   training as one rank of a [`ProcessGroup`](cohort_comm::ProcessGroup),
//!   with the strategy `cfg.strategy` names; rank 0 logs in the format of
//!   PyTorch's DDP tutorials (`[step 10 / 50] loss = 9.3437`) plus
//!   throughput and time per phase, evaluates, and writes checkpoints that
//!   `--resume` continues bitwise. [`train_parameter_server`] is the
//!   strategy whose ranks meet over RPC instead.
//! - [`DataParallel`]: one rank of data parallelism, its gradient sync a
//!   value ([`GradSync`]: DDP, ZeRO-1 with [`Zero1`], ZeRO-2/3 with
//!   [`ShardedDp`], DiLoCo and local SGD with [`Outer`]), stepped by the training loop or from outside it
//!   (`cohort bench ddp`). [`PipelineRank`]: one pipeline rank stepped from
//!   outside the loop (`cohort bench pipeline`). [`memory_per_rank`] counts
//!   what a rank holds under each sharding.
//!
//! The layout, by concern (each module depends only on those above it in
//! this list, never back):
//!
//! - `error`, `device` (`--device`: the choice and the backend it builds), `phases`, `memory`, `pages`, `grad_guard` (scaling, clipping
//!   and the NaN/Inf skip of a step), `config`, `run_log`, `stop_request`
//!   (SIGUSR1/SIGTERM: save at the next step and stop);
//! - `input` (the data set and a rank's batches), `checkpoint` (saving,
//!   resuming, consolidating; the trainer's files), `elastic` (resuming
//!   after a launcher's restart);
//! - `step_loop`: the one training loop (`ParallelStrategy` is what a
//!   strategy supplies), with its log window, evaluation, save policy, run
//!   log, console and summary beside it, and the micro-batch helpers;
//! - `replica`: what the strategies that hold a model replica share (the
//!   model, resume and save of a replica or a shard, the memory check);
//! - `strategy`: `data_parallel`, `pipeline`, `parameter_server`, one
//!   folder each; they never use each other;
//! - `launch`: [`run`] and [`train`], the one match on the parallelism.
//!
//! This crate never parses the command line itself (the binary does, with
//! [`TrainArgs`]) and never talks to peers except through the process group
//! (or, for the parameter server, RPC).
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

mod checkpoint;
mod config;
mod device;
mod device_comm;
pub mod elastic;
mod error;
mod grad_guard;
mod input;
mod launch;
mod memory;
mod pages;
mod phases;
mod replica;
mod run_log;
mod step_loop;
mod stop_request;
mod strategy;

pub use checkpoint::trainer_files::{
    load_optimizer_into, load_trainer_state, optimizer_file, trainer_state_json, TrainerState,
    OPTIMIZER_FILE, TRAINER_STATE_FILE,
};
pub use checkpoint::{consolidate, TrainState};
pub use cohort_data::{Dataset, MarkovCorpus, MarkovSpec, RandomTokens, Split};
pub use config::{
    Overlap, PipelineSchedule, Precision, PsMode, SaveMode, Strategy, TrainArgs, TrainConfig,
    TUNED_BUCKET_CAP_MB,
};
pub use device::{
    device_backend, local_cuda_ordinal, register_device_backend, DeviceBackendFn, DeviceChoice,
};
pub use device_comm::{
    register_device_collectives, DeviceCollectives, DeviceCollectivesFn, DeviceSync,
};
pub use error::{ConfigError, TrainError};
pub use grad_guard::{NanInjection, INJECT_NAN_VAR};
pub use input::{build_dataset, FileData};
pub use launch::{process_group_for, process_group_from_env, run, train};
pub use memory::{memory_per_rank, MemoryPerRank, Sharding};
pub use phases::{peak_rss_mb, process_cpu_ms, Phase, Phases, PHASES};
pub use replica::{model_config, param_specs, share_rank0_params};
pub use run_log::METRICS_FILE;
pub use step_loop::Outcome;
pub use stop_request::stop_on_signals;
pub use strategy::data_parallel::{
    DataParallel, GradSync, Outer, OuterConfig, ShardedDp, SyncTimes, Zero1, Zero1Times, ZeroStage,
};
pub use strategy::parameter_server::{
    train_parameter_server, train_parameter_server_timed, RpcJoin,
};
pub use strategy::pipeline::{train_pipeline, PipelineRank, PipelineStepTimes};
