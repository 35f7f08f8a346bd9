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
    }
}
