//! The pieces of a step that replicated strategies share: a step's
//! micro-batches run forward and backward with gradients accumulating in
//! the model ([`accumulate`]), the plain forward of a batch, and the
//! validation loss over the job's batches, the same bits however they were
//! shared out among ranks ([`mean_val_loss`]). It never synchronises
//! gradients itself: a strategy's [`MicroBatches::backward`] does.

use cohort_comm::{ProcessGroup, ReduceOp};
use cohort_data::Batch;
use cohort_gpt::{Backward, Forward, Labels, GPT};

use crate::config::TrainConfig;
use crate::error::TrainError;
use crate::input::TrainBatches;
use crate::phases::{Phase, Phases};

/// How a strategy runs one micro-batch on its model: the forward with its
/// labels, and the backward after it (which may synchronise gradients).
/// [`accumulate`] calls them in turn.
pub(crate) trait MicroBatches {
    /// The model the micro-batches run on.
    fn model(&mut self) -> &mut GPT;

    /// The forward of `batch` with next-token targets: its mean loss.
    fn forward(&mut self, batch: &Batch) -> Result<Option<f32>, TrainError>;

    /// The backward of the last forward, accumulating into the model's
    /// gradients; `last` for the step's last micro-batch. Times itself into
    /// `phases`.
    fn backward(&mut self, last: bool, phases: &mut Phases) -> Result<(), TrainError>;
}

/// The plain forward with labels, as every replicated strategy runs it.
pub(crate) fn forward_batch(model: &mut GPT, batch: &Batch) -> Result<Option<f32>, TrainError> {
    Ok(model.forward(
        Forward::new(&batch.input_ids, batch.batch, batch.seq)
            .attention_mask(padding_mask(batch))
            .segments(batch.segments.as_deref())
            .labels(Labels::Next(&batch.targets)),
    )?)
}

/// [`MicroBatches`] on a model alone: plain forwards and backwards, no
/// synchronisation (a parameter server's worker, which pushes the sum).
pub(crate) struct Unsynchronised<'m>(pub &'m mut GPT);

impl MicroBatches for Unsynchronised<'_> {
    fn model(&mut self) -> &mut GPT {
        self.0
    }

    fn forward(&mut self, batch: &Batch) -> Result<Option<f32>, TrainError> {
        forward_batch(self.0, batch)
    }

    fn backward(&mut self, _last: bool, phases: &mut Phases) -> Result<(), TrainError> {
        phases.time(Phase::Backward, || self.0.backward(Backward::new()))?;
        Ok(())
    }
}

/// Forward and backward over one step's `cfg.grad_accum` micro-batches,
/// gradients summing in the model, each run by `passes` (whose last
/// backward is where data parallelism synchronises: PyTorch's `no_sync`
/// for all the others). `replica` is this rank's index among the ranks that
/// read different data, which with the step picks the dropout masks.
/// Returns the summed loss and the real tokens (padding excluded).
pub(crate) fn accumulate(
    passes: &mut dyn MicroBatches,
    batches: &mut TrainBatches,
    cfg: &TrainConfig,
    replica: usize,
    step: u64,
    phases: &mut Phases,
) -> Result<(f32, u64), TrainError> {
    let (mut loss_sum, mut tokens) = (0f32, 0u64);
    for micro in 0..cfg.grad_accum {
        let batch = phases.time(Phase::Data, || {
            if let Some(delay) = super::test_delay(replica) {
                std::thread::sleep(delay);
            }
            batches.next_batch()
        });
        tokens += batch.attention_mask.iter().filter(|&&m| m == 1).count() as u64;
        let model = passes.model();
        model.set_training(true);
        model.set_dropout_key(
            cfg.seed,
            replica as u64,
            step * cfg.grad_accum as u64 + micro as u64,
        );
        let loss = phases.time(Phase::Forward, || passes.forward(&batch))?;
        loss_sum += loss.unwrap_or(0.0);
        passes.backward(micro + 1 == cfg.grad_accum, phases)?;
    }
    Ok((loss_sum, tokens))
}

/// The attention mask of a batch with padding (None when every position is a
/// token, the common case, which spares the model the mask's bookkeeping).
pub(crate) fn padding_mask(batch: &Batch) -> Option<&[u8]> {
    batch
        .attention_mask
        .contains(&0)
        .then_some(&batch.attention_mask[..])
}

/// The loss of `model` on each of `val` ((place in the job's list, batch)), in eval mode.
pub(crate) fn batch_losses(
    val: &[(usize, Batch)],
    model: &mut GPT,
) -> Result<Vec<(usize, f32)>, TrainError> {
    batch_losses_with(val, model, &mut forward_batch)
}

/// A batch's forward with next-token targets: its mean loss.
pub(crate) type ForwardFn<'f> = dyn FnMut(&mut GPT, &Batch) -> Result<Option<f32>, TrainError> + 'f;

/// [`batch_losses`] with each batch's forward run by `forward` (a strategy
/// that gathers parameters around each part).
pub(crate) fn batch_losses_with(
    val: &[(usize, Batch)],
    model: &mut GPT,
    forward: &mut ForwardFn<'_>,
) -> Result<Vec<(usize, f32)>, TrainError> {
    model.set_training(false);
    let losses = val
        .iter()
        .map(|(k, batch)| Ok((*k, forward(model, batch)?.unwrap_or(0.0))))
        .collect::<Result<Vec<_>, TrainError>>();
    model.set_training(true);
    losses
}

/// The validation loss over the job's `total` batches, of which this rank computed `mine`
/// ((place in the list, loss)), known to every rank of `pg` (`None`: this process computed
/// them all); NaN for no batches. Each batch's loss lands in its own slot, summed with zeros
/// only (which is exact), and the slots are averaged in list order: the figure is the same
/// bits however the list was shared out among ranks. Collective over `pg`.
pub(crate) fn mean_val_loss(
    pg: Option<&ProcessGroup>,
    total: usize,
    mine: &[(usize, f32)],
) -> Result<f32, TrainError> {
    if total == 0 {
        return Ok(f32::NAN);
    }
    let mut slots = vec![0f32; total];
    for &(k, loss) in mine {
        slots[k] = loss;
    }
    if let Some(pg) = pg {
        pg.all_reduce(&mut slots, ReduceOp::Sum)
            .map_err(TrainError::comm("val loss all_reduce"))?;
    }
    let sum: f64 = slots.iter().map(|&l| l as f64).sum();
    Ok((sum / total as f64) as f32)
}
