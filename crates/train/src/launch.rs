//! The crate's entry points: [`run`], what `cohort train` calls (join the
//! job the launcher set up, or train alone), and [`train`], the one place
//! that picks the strategy for the configured parallelism. It also builds
//! the process group from the environment. It never runs a step itself.

use std::io::Write;
use std::sync::Arc;

use cohort_comm::{init_process_group, GroupOptions, InitOptions, ProcessGroup};
use cohort_store::slurm::{SlurmTask, Taken};

use crate::config::{Strategy, TrainConfig};
use crate::elastic;
use crate::error::{ConfigError, TrainError};
use crate::step_loop::Outcome;
use crate::strategy::data_parallel::{self, SyncKind, ZeroStage};
use crate::strategy::parameter_server::{train_parameter_server, RpcJoin};
use crate::strategy::pipeline::train_pipeline;

/// The process group of this process: the job's, when a launcher (or the
/// user) set `RANK` (`env://`: MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE),
/// or this is a task of an `srun` step (`cohort_store::slurm`: rank, world
/// size and master from Slurm wherever those variables are unset; a batch
/// script's own shell is no task), or Slurm set SLURM_PROCID and the user
/// MASTER_ADDR; otherwise a world of one, which opens no socket. Rank 0
/// says in one line what it took from Slurm.
pub fn process_group_from_env() -> Result<ProcessGroup, TrainError> {
    let var = |name| std::env::var_os(name).is_some();
    let slurm = if var("RANK") {
        None
    } else {
        SlurmTask::from_process_env().map_err(ConfigError::from)?
    };
    let pg = if var("RANK") || slurm.is_some() || (var("SLURM_PROCID") && var("MASTER_ADDR")) {
        init_process_group("tcp", "env://", InitOptions::default())
    } else {
        GroupOptions::from_env().and_then(|opts| {
            ProcessGroup::new(Arc::new(cohort_store::HashStore::new()), 0, 1, opts)
        })
    };
    let pg = pg.map_err(TrainError::comm("joining the process group"))?;
    let taken = Taken {
        rank: true,
        world_size: !var("WORLD_SIZE"),
        local_rank: !var("LOCAL_RANK"),
        master_addr: !var("MASTER_ADDR"),
        master_port: !var("MASTER_PORT"),
        ..Taken::default()
    };
    if let Some(line) = slurm.and_then(|task| task.note(taken)) {
        if pg.rank() == 0 {
            println!("{line}");
        }
    }
    Ok(pg)
}

/// The process group `cfg.backend` asks for: [`process_group_from_env`]
/// for `cohort`, and for `nccl` (NCCL moves the GPU's gradients; the
/// group carries everything else and NCCL's set-up, see `device_comm`);
/// any other name is a backend of cohort-comm's registry (`mpi`, registered
/// by a program built with it), whose group is built from the environment
/// as `init_process_group(name, "env://")`.
pub fn process_group_for(cfg: &TrainConfig) -> Result<ProcessGroup, TrainError> {
    match cfg.backend.as_str() {
        "cohort" | "nccl" => process_group_from_env(),
        name => init_process_group(name, "env://", InitOptions::default())
            .map_err(TrainError::comm("joining the process group")),
    }
}

/// `cohort train`: joins the job (or trains alone) and trains, rank 0
/// logging to stdout.
pub fn run(cfg: &TrainConfig) -> Result<Outcome, TrainError> {
    // The parameter server's ranks meet over RPC, not in a process group.
    if cfg.strategy == Strategy::ParameterServer {
        return run_parameter_server(cfg);
    }
    let pg = process_group_for(cfg)?;
    // After a restart by the launcher, continue from the job's checkpoints.
    let (cfg, notes) = elastic::prepare_resume(cfg, pg.size(), elastic::restart_count_from_env()?);
    if pg.rank() == 0 {
        notes.iter().for_each(|note| println!("{note}"));
    }
    train(&cfg, &pg, &mut std::io::stdout())
}

/// [`run`] for the parameter server: rank 0 serves, the others work. A
/// resumed run keeps its global batch over another number of workers as
/// DDP's does over another number of ranks, and says so.
fn run_parameter_server(cfg: &TrainConfig) -> Result<Outcome, TrainError> {
    let (rank, world) = RpcJoin::Env.rank_and_world()?;
    let workers = world.saturating_sub(1).max(1);
    let (cfg, notes) = elastic::prepare_resume(cfg, workers, elastic::restart_count_from_env()?);
    if rank == 0 {
        notes.iter().for_each(|note| println!("{note}"));
    }
    train_parameter_server(&cfg, RpcJoin::Env, &mut std::io::stdout())
}

/// Trains as configured, as rank `pg.rank()` of `pg.size()`, with the
/// strategy `cfg.strategy` names: data parallel (DDP, ZeRO stage 1, 2 or
/// 3, DiLoCo or local SGD) or pipeline; rank 0 writes the log to `log`. The parameter server
/// needs no process group: see [`train_parameter_server`]. Collective:
/// every rank must call it with the same config.
pub fn train(
    cfg: &TrainConfig,
    pg: &ProcessGroup,
    log: &mut dyn Write,
) -> Result<Outcome, TrainError> {
    let sync = match cfg.strategy {
        Strategy::Ddp => SyncKind::Ddp,
        Strategy::Diloco | Strategy::LocalSgd => SyncKind::Diloco,
        Strategy::Zero1 => SyncKind::Zero1,
        Strategy::Zero2 => SyncKind::Sharded(ZeroStage::Two),
        Strategy::Zero3 => SyncKind::Sharded(ZeroStage::Three),
        Strategy::Pipeline => return train_pipeline(cfg, pg, log),
        Strategy::ParameterServer => {
            return Err(TrainError::Config(ConfigError::Invalid {
                key: "strategy",
                value: cfg.strategy.name().to_string(),
                why: "the parameter server trains over RPC, not a process group: call \
                      train_parameter_server (cohort train does)",
            }))
        }
    };
    data_parallel::train(cfg, pg, log, sync)
}
