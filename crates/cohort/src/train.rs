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
    match cohort_train::run(&cfg) {
        Ok(_) => Ok(()),
        Err(e) if e.is_permanent() => not_retryable(anyhow::Error::new(e).context("train")),
        Err(e) => Err(anyhow::Error::new(e).context("train")),
    }
}

/// Reports an error that running again cannot fix and exits with the code
/// that tells `cohort run` not to restart the workers for it.
fn not_retryable(e: anyhow::Error) -> ! {
    eprintln!("Error: {}", crate::one_line(&e));
    std::process::exit(cohort_launcher::EXIT_NOT_RETRYABLE)
}
