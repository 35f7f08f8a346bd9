//! A worker (ranks 1..K-1): pulls parameters, computes the gradient of its own shard's batch
//! and pushes it; the answer is the parameters for its next step.

use super::*;

/// A worker: pull the parameters, compute a step's gradient on this
/// worker's shard, push it, repeat with the parameters of the answer.
pub(super) fn work(
    cfg: &TrainConfig,
    rpc: &Rpc,
    data: Arc<dyn Dataset>,
    worker: usize,
    workers: usize,
) -> Result<Outcome, TrainError> {
    // The server's parameters replace these at every step.
    let mut model = GPT::zeroed(model_config(cfg, data.vocab_size())?, cfg.seed)?;
    // The server's header says what precision is in effect (the same CPU check as here).
    crate::train::apply_precision(cfg, |d| model.set_precision(d))?;
    model.set_activation_checkpointing(cfg.activation_checkpointing);
    let mut phases = Phases::default();
    let mut reply: Params = rpc.rpc_sync(0, "ps.pull", ()).map_err(rpc_err("ps.pull"))?;
    let mut batches = TrainBatches::new(
        data.clone(),
        cfg,
        workers,
        worker,
        reply.epoch,
        reply.offset as usize,
    )?;
    // A resumed run starts at the server's step: the same dropout keys as
    // a run that never stopped.
    let first_step = reply.version;
    let mut step = first_step;
    while !reply.done {
        if reply.params.0.len() != model.num_params() {
            return Err(TrainError::Rpc {
                what: "ps.pull",
                error: RpcError::Protocol {
                    worker: "ps".into(),
                    detail: format!(
                        "{} parameters served, the model has {}",
                        reply.params.0.len(),
                        model.num_params()
                    ),
                },
            });
        }
        model.params_mut().copy_from_slice(&reply.params.0);
        // DDP's rank r is worker r here: the same batches and dropout masks.
        let (loss_sum, tokens) = step_loop::accumulate(
            &mut model,
            &mut batches,
            cfg,
            worker,
            step,
            &mut phases,
            &mut |model, phases| {
                Ok(phases.time(Phase::Backward, || {
                    model.backward(cohort_gpt::Backward::new())
                })?)
            },
        )?;
        let (epoch, offset) = batches.position();
        let push = Push {
            worker: worker as u32,
            version: reply.version,
            grads: Floats(model.grads().to_vec()),
            loss: loss_sum,
            tokens,
            epoch,
            offset: offset as u64,
        };
        model.zero_grad();
        let t_push = Instant::now();
        reply = rpc
            .rpc_sync(0, "ps.push", push)
            .map_err(rpc_err("ps.push"))?;
        phases.add(Phase::Comm, t_push.elapsed());
        step += 1;
    }
    Ok(Outcome {
        steps_run: step - first_step,
        final_step: reply.version,
        train_losses: Vec::new(),
        val_losses: Vec::new(),
        loss_floor: data.loss_floor(),
        tokens_per_s: 0.0,
        phases,
        params: reply.params.0,
    })
}
