//! `cohort train`: the main job. Resolves the settings (defaults, `--config
//! FILE`, flags) and calls `cohort_train::run`, which trains alone or, under
//! `cohort run -n N train`, as one rank of the job (`env://`), or with
//! `--backend mpi` as one rank of the MPI job mpirun or srun started.

/// Train the mini-GPT (alone, or as a rank under `cohort run -n N train`).
///
/// With no data flag it learns an embedded Markov-chain corpus whose best
/// possible loss is known and printed; `--data random` trains on uniform random
/// tokens (the toy data of PyTorch's DDP examples) for throughput. `--batch-size` is per rank.
///
///   cohort train --steps 200
///
///   cohort run -n 2 train --config run.toml --lr 3e-4 --out ckpt
///
///   cohort run -n 2 train --resume ckpt --steps 400
///
///   mpirun -np 4 cohort train --backend mpi      (a build with --features mpi)
///
///   srun -N 2 --ntasks-per-node 2 cohort train --out ckpt
///
/// Under srun, rank, world size, local rank, the master address (the first
/// host of the node list) and port (15000 + job id mod 10000) come from
/// Slurm wherever RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT are
/// unset. SIGUSR1 (and SIGTERM under Slurm) saves a checkpoint at the next
/// step on every rank, then exits with code 75; --resume continues it, and
/// so does a requeued Slurm job by itself (SLURM_RESTART_COUNT > 0 with
/// --out): sbatch --signal=USR1@120, then `[ $? -eq 75 ] && scontrol
/// requeue $SLURM_JOB_ID`.
use anyhow::Context;

#[derive(clap::Args, Debug)]
#[command(verbatim_doc_comment)]
pub struct TrainCmd {
    #[command(flatten)]
    args: Box<cohort_train::TrainArgs>,
}

pub fn main(cmd: TrainCmd) -> anyhow::Result<()> {
    let cfg = match cmd.args.resolve() {
        Ok(cfg) => cfg,
        Err(e) => not_retryable(anyhow::Error::new(e).context("train: bad settings")),
    };
    // SIGUSR1 always, and SIGTERM under Slurm (its time limit and preemption
    // send it): save at the next step on every rank, then exit 75.
    let sigterm = std::env::var_os("SLURM_JOB_ID").is_some();
    cohort_train::stop_on_signals(sigterm).context("train: cannot install the signal handlers")?;
    match cohort_train::run(&cfg) {
        Ok(_) => Ok(()),
        Err(e @ cohort_train::TrainError::Stopped { .. }) => {
            eprintln!("train: {e}");
            std::process::exit(cohort_launcher::EXIT_SAVED_AND_STOPPED)
        }
        Err(e) if e.is_permanent() => not_retryable(anyhow::Error::new(e).context("train")),
        Err(e) => Err(anyhow::Error::new(e).context("train")),
    }
}

/// Reports an error that running again cannot fix and exits with the code
/// that tells `cohort run` not to restart the workers for it.
fn not_retryable(e: anyhow::Error) -> ! {
    crate::print_error(&format!("Error: {}\n", crate::one_line(&e)));
    std::process::exit(cohort_launcher::EXIT_NOT_RETRYABLE)
}
