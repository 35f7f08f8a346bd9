//! What a run trains on: the data set its config names ([`build`]: the
//! built-in Markov corpus or random tokens, or files through `cohort-data`
//! and `cohort-tokenizer`), and the batches one rank reads of it
//! ([`TrainBatches`], [`val_batches`]), with the position that checkpoints
//! record. This module never touches the model, and talks to other ranks
//! only to let rank 0 prepare data files first.

mod batches;
mod file_data;

pub(crate) use batches::{val_batches, val_rows, val_share, TrainBatches, ValBatches};
pub use file_data::{build, build_dataset, chat_template_source, model_dir_files, FileData};

use cohort_data::Dataset;

/// The lines every strategy's header has about its data: what it is, and
/// its loss floor when known.
pub(crate) fn data_lines(data: &dyn Dataset) -> Vec<String> {
    let mut lines = vec![format!("data: {}", data.describe())];
    if let Some(floor) = data.loss_floor() {
        lines.push(format!(
            "loss floor (best possible): {floor:.4}; start ~ ln(vocab) = {:.4}",
            (data.vocab_size() as f64).ln()
        ));
    }
    lines
}
