//! `cohort checkpoint`: tools for training checkpoints. Wiring only: parse flags, call
//! cohort-train, print.

use std::path::PathBuf;

use anyhow::Context;

/// Work on training checkpoints.
#[derive(clap::Subcommand, Debug)]
pub enum CheckpointCmd {
    /// Write a checkpoint (sharded by ZeRO, or not) as one consolidated checkpoint: the model
    /// in Hugging Face's layout (config.json, model.safetensors) with the whole optimizer state
    /// and the trainer's and tokenizer's files, which `from_pretrained` loads and `--resume`
    /// continues at any world size.
    Consolidate(ConsolidateArgs),
    /// Check every file of a checkpoint against its checksums (CHECKSUMS, or SHA256SUMS of an
    /// older checkpoint), reading it whole: what `sha256sum -c` did for the older ones. A
    /// checkpoint without checksums is an error, so that a script never takes it for intact.
    Verify(VerifyArgs),
}

/// `cohort checkpoint verify`.
#[derive(clap::Args, Debug)]
pub struct VerifyArgs {
    /// A checkpoint directory, or a run's output directory (its latest checkpoint).
    path: PathBuf,
}

/// `cohort checkpoint consolidate`.
#[derive(clap::Args, Debug)]
pub struct ConsolidateArgs {
    /// A checkpoint directory, or a run's output directory (its latest checkpoint).
    #[arg(long)]
    from: PathBuf,
    /// The directory to write (replaced atomically if it exists).
    #[arg(long)]
    out: PathBuf,
}

pub fn main(cmd: CheckpointCmd) -> anyhow::Result<()> {
    match cmd {
        CheckpointCmd::Consolidate(a) => {
            let dir = cohort_train::consolidate(&a.from, &a.out).with_context(|| {
                format!(
                    "cohort checkpoint consolidate {} -> {}",
                    a.from.display(),
                    a.out.display()
                )
            })?;
            println!("consolidated {} into {}", dir.display(), a.out.display());
            Ok(())
        }
        CheckpointCmd::Verify(a) => {
            let context = || format!("cohort checkpoint verify {}", a.path.display());
            let dir = cohort_gpt::checkpoint::resolve(&a.path).with_context(context)?;
            if !cohort_gpt::checkpoint::verify(&dir).with_context(context)? {
                anyhow::bail!(
                    "{}: no {} nor {}: nothing to verify it against",
                    dir.display(),
                    cohort_gpt::checkpoint::CHECKSUMS_FILE,
                    cohort_gpt::checkpoint::SHA256SUMS_FILE
                );
            }
            println!(
                "verified {}: every file matches its checksum",
                dir.display()
            );
            Ok(())
        }
    }
}
