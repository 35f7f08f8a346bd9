//! The training loop, nanoGPT's train.py in Rust: build the data and the
//! model, wrap it in DDP, then step (micro-batches, backward with gradient
//! averaging, clip, AdamW), log, evaluate and checkpoint. Top to bottom, no
//! cleverness. The same code runs alone (a world of one) and as one rank of
//! many; only rank 0 writes the log and checkpoints. It never parses flags
//! and never opens sockets itself: it is handed a config and a process group.

use crate::batches::{val_batches, TrainBatches};
use crate::checkpoint::{self, TrainState};
use crate::config::TrainConfig;
use crate::fault::{LogGuard, NanInjection, StepGuard};
use crate::phases::{Phase, Phases};
use crate::TrainError;
use cohort_comm::{ProcessGroup, ReduceOp};
use cohort_data::Dataset;
use cohort_ddp::{Compression, Ddp, DdpOptions, ParamSpec, Replica};
use cohort_engine::optim::{AdamW, LrSchedule, Optimizer};
use cohort_gpt::optim_groups::decay_mask;
use cohort_gpt::{GPTConfig, GPT};
use std::io::{IsTerminal, Write};
use std::ops::Range;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// What a finished run reports (on every rank; losses are averaged over ranks).
#[derive(Debug, Clone)]
pub struct Outcome {
    /// Optimizer steps run in this process (not counting resumed ones).
    pub steps_run: u64,
    /// The step the run ended at.
    pub final_step: u64,
    /// Mean training loss over ranks of each logged step, as `(step, loss)`.
    pub train_losses: Vec<(u64, f32)>,
    /// Validation losses, as `(step, loss)`.
    pub val_losses: Vec<(u64, f32)>,
    /// The data set's loss floor, if known.
    pub loss_floor: Option<f64>,
    /// Tokens per second over the whole job (all ranks), excluding the first step.
    pub tokens_per_s: f64,
    /// Time per phase on this rank, summed over the run.
    pub phases: Phases,
    /// The parameters at the end (identical on every rank).
    pub params: Vec<f32>,
}

impl Outcome {
    /// A run at `step` with nothing run yet, on data whose loss floor is
    /// `loss_floor`.
    pub(crate) fn starting_at(step: u64, loss_floor: Option<f64>) -> Outcome {
        Outcome {
            steps_run: 0,
            final_step: step,
            train_losses: Vec::new(),
            val_losses: Vec::new(),
            loss_floor,
            tokens_per_s: 0.0,
            phases: Phases::default(),
            params: Vec::new(),
        }
    }
}

/// The model a config asks for, over `vocab_size` tokens.
pub fn model_config(cfg: &TrainConfig, vocab_size: usize) -> GPTConfig {
    GPTConfig {
        vocab_size,
        max_position_embeddings: cfg.seq_len,
        n_layers: cfg.n_layers,
        n_heads: cfg.n_heads,
        d_model: cfg.d_model,
        d_ff: cfg.d_ff,
        dropout: cfg.dropout,
        ..GPTConfig::default()
    }
}

/// The GPT as DDP sees it: a backward with a readiness hook, and gradients.
pub struct GptReplica<'m>(pub &'m mut GPT);

impl Replica for GptReplica<'_> {
    fn backward<'g>(
        &'g mut self,
        hook: &mut (dyn FnMut(Range<usize>, &'g mut [f32]) + Send),
    ) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
        self.0.backward(hook)?;
        Ok(())
    }

    fn grads_mut(&mut self) -> &mut [f32] {
        self.0.grads_mut()
    }
}

/// DDP's view of the model's parameters.
pub fn param_specs(model: &GPT) -> Vec<ParamSpec> {
    model
        .param_views()
        .iter()
        .map(|v| ParamSpec {
            name: v.name.clone(),
            shape: v.shape.clone(),
            range: v.range.clone(),
        })
        .collect()
}

/// Trains as configured, as rank `pg.rank()` of `pg.size()`; rank 0 writes
/// the log to `log`. Collective: every rank must call it with the same config.
pub fn train(
    cfg: &TrainConfig,
    pg: &ProcessGroup,
    log: &mut dyn Write,
) -> Result<Outcome, TrainError> {
    let (rank, world) = (pg.rank(), pg.size());
    let master = rank == 0;
    // A log that cannot be written never stops the run; `say`
    // keeps its Result so that every call site reads the same.
    let log_guard = LogGuard::default();
    let mut say = |log: &mut dyn Write, line: String| -> Result<(), TrainError> {
        if master {
            log_guard.write(log, &line);
        }
        Ok(())
    };
    cfg.validate()?;

    // -- data -------------------------------------------------------------
    let data: Arc<dyn Dataset> = crate::file_data::build(cfg, pg)?.into();
    let (b, t) = (cfg.batch_size, data.seq_len());
    let tokens_per_step = (b * t * cfg.grad_accum * world) as f64;
    say(log, format!("data: {}", data.describe()))?;

    // -- model, optimizer, DDP ----------------------------------------------
    // Only rank 0 draws the initial parameters: DDP checks that the shapes
    // agree and broadcasts rank 0's to the others.
    let mut model = if pg.rank() == 0 {
        GPT::new(model_config(cfg, data.vocab_size()), cfg.seed)?
    } else {
        GPT::zeroed(model_config(cfg, data.vocab_size()), cfg.seed)?
    };
    let adamw = cfg.adamw();
    let mut opt = AdamW::new(adamw, decay_mask(model.param_views()))?;
    let mut state = TrainState::default();
    if let Some(dir) = &cfg.resume {
        let resumed = checkpoint::resume(dir, cfg, pg, &mut model, &mut opt)?;
        for note in resumed.notes {
            say(log, note)?;
        }
        state = resumed.state;
        say(
            log,
            format!(
                "resumed from {} at step {}",
                resumed.dir.display(),
                state.step
            ),
        )?;
    }
    let specs = param_specs(&model);
    let overlap = cfg.overlap.enabled(
        pg.size(),
        pg.local_world_size(),
        model.backend().num_threads(),
    );
    let ddp_options = DdpOptions {
        bucket_cap_mb: cfg.bucket_cap_mb,
        overlap,
        compression: if cfg.bf16_compress {
            Compression::Bf16
        } else {
            Compression::None
        },
        ..DdpOptions::default()
    };
    let mut ddp = Ddp::new(pg, specs, model.params_mut(), ddp_options)?;
    let schedule =
        LrSchedule::warmup_cosine(cfg.lr, cfg.min_lr, cfg.warmup_steps, cfg.decay_steps())?;

    say(
        log,
        format!(
            "model: {} layers, {} heads, d_model {}, d_ff {}, vocab {}, seq {}: {} parameters; \
             DDP buckets: {} (cap {} MB, overlap {})",
            cfg.n_layers,
            cfg.n_heads,
            cfg.d_model,
            cfg.d_ff,
            data.vocab_size(),
            t,
            model.num_params(),
            ddp.buckets().len(),
            cfg.bucket_cap_mb,
            if overlap { "on" } else { "off" },
        ),
    )?;
    say(
        log,
        format!(
            "global batch: {} sequences = {} per rank x {} ranks x {} accumulation ({} tokens/step)",
            b * world * cfg.grad_accum,
            b,
            world,
            cfg.grad_accum,
            tokens_per_step
        ),
    )?;
    if let Some(floor) = data.loss_floor() {
        say(
            log,
            format!(
                "loss floor (best possible): {floor:.4}; start ~ ln(vocab) = {:.4}",
                (data.vocab_size() as f64).ln()
            ),
        )?;
    }

    // -- the loop -------------------------------------------------------------
    let mut batches = TrainBatches::new(data.clone(), cfg, world, rank, state.epoch, state.offset)?;
    let val = val_batches(&data, cfg, world, rank, cfg.eval_batches)?;
    let bar = progress_bar(master, state.step, cfg.steps);

    let mut outcome = Outcome::starting_at(state.step, data.loss_floor());
    let mut window = Phases::default();
    let mut window_steps = 0u64;
    let mut window_loss = 0f32;
    // Updates applied in the window (skipped ones have no loss to average).
    let mut window_updates = 0u64;
    let inject = match cfg.inject_nan {
        Some(hook) => Some(hook),
        None => NanInjection::from_env()?,
    };
    let mut guard = StepGuard::new(
        cfg.clip_value,
        cfg.grad_clip,
        cfg.max_consecutive_skips,
        inject,
    );
    // Real tokens (padding excluded) this rank trained on in the log window,
    // and since the end of the first step.
    let mut window_tokens = 0f64;
    let mut timed_tokens = 0f64;
    let mut timed_from: Option<Instant> = None;
    let first_step = state.step;

    for step in first_step..cfg.steps {
        let lr = schedule.lr(step);
        let mut loss_sum = 0f32;
        for micro in 0..cfg.grad_accum {
            let batch = window.time(Phase::Data, || batches.next_batch());
            let real_tokens = batch.attention_mask.iter().filter(|&&m| m == 1).count();
            window_tokens += real_tokens as f64;
            if timed_from.is_some() {
                timed_tokens += real_tokens as f64;
            }
            let mask = padding_mask(&batch);
            model.set_training(true);
            model.set_dropout_key(
                cfg.seed,
                rank as u64,
                step * cfg.grad_accum as u64 + micro as u64,
            );
            let loss = window.time(Phase::Forward, || {
                model.forward(
                    &batch.input_ids,
                    mask,
                    Some(&batch.labels),
                    batch.batch,
                    batch.seq,
                )
            })?;
            loss_sum += loss.unwrap_or(0.0);
            // Only the last micro-step communicates: the gradients of the
            // others accumulate locally and are averaged with it at once.
            if micro + 1 < cfg.grad_accum {
                window.time(Phase::Backward, || {
                    ddp.backward_no_sync(&mut GptReplica(&mut model))
                })?;
            } else {
                let stats = ddp.backward(&mut GptReplica(&mut model))?;
                window.add(Phase::Backward, stats.backward);
                window.add(Phase::Comm, stats.comm_wait);
            }
        }
        let t_opt = Instant::now();
        // Backward summed the micro-steps' mean-loss gradients: the guard
        // divides by grad_accum, checks with the other ranks, and clips.
        let skip = guard.check(
            pg,
            step,
            loss_sum.is_finite(),
            model.grads_mut(),
            cfg.grad_accum,
        )?;
        if skip.is_none() {
            let (params, grads) = model.params_and_grads_mut();
            opt.step(params, grads, lr)?;
            window_loss += loss_sum / cfg.grad_accum as f32;
            window_updates += 1;
        }
        model.zero_grad();
        window.add(Phase::Optimizer, t_opt.elapsed());
        if let Some(skip) = skip {
            let line = format!("[step {} / {}] {skip}", step + 1, cfg.steps);
            print_line(&bar, &mut say, log, line)?;
        }
        window_steps += 1;
        let done = step + 1;
        state.step = done;
        (state.epoch, state.offset) = batches.position();
        if timed_from.is_none() {
            // The first step pays for allocation and warm-up; throughput is
            // measured from the end of it.
            timed_from = Some(Instant::now());
        }

        // -- log, eval, save (every rank takes part in the collectives) ---
        let t_log = Instant::now();
        if done % cfg.log_interval == 0 || done == cfg.steps {
            let t_comm = Instant::now();
            let mut mean = [window_loss / window_updates as f32];
            pg.all_reduce(&mut mean, ReduceOp::Avg)
                .map_err(TrainError::comm("loss all_reduce"))?;
            let mut tokens = [window_tokens];
            pg.all_reduce(&mut tokens, ReduceOp::Sum)
                .map_err(TrainError::comm("token count all_reduce"))?;
            window.add(Phase::Comm, t_comm.elapsed());
            outcome.train_losses.push((done, mean[0]));
            let secs = window.total().as_secs_f64().max(1e-9);
            let line = format!(
                "[step {done} / {}] loss = {:.4} | lr {lr:.2e} | {:.0} tok/s | {}",
                cfg.steps,
                mean[0],
                tokens[0] / secs,
                window.per_step(window_steps),
            );
            print_line(&bar, &mut say, log, line)?;
            outcome.phases.merge(&window);
            window = Phases::default();
            window_steps = 0;
            window_loss = 0.0;
            window_updates = 0;
            window_tokens = 0.0;
        }
        if (cfg.eval_interval > 0 && done % cfg.eval_interval == 0) || done == cfg.steps {
            let val = evaluate(&val, &mut model, pg)?;
            outcome.val_losses.push((done, val));
            let floor = data
                .loss_floor()
                .map(|f| format!(" (floor {f:.4})"))
                .unwrap_or_default();
            let line = format!("[step {done} / {}] val loss = {val:.4}{floor}", cfg.steps);
            print_line(&bar, &mut say, log, line)?;
        }
        let save_now = cfg.save_interval > 0 && done % cfg.save_interval == 0;
        if let (true, Some(out)) = (save_now || done == cfg.steps, &cfg.out) {
            if master {
                let tokenizer = data.tokenizer_json();
                let notes = checkpoint::save_or_report(
                    out,
                    cfg,
                    world,
                    &model,
                    &opt,
                    &state,
                    tokenizer.as_deref(),
                );
                for line in notes {
                    print_line(
                        &bar,
                        &mut say,
                        log,
                        format!("[step {done} / {}] {line}", cfg.steps),
                    )?;
                }
            }
        }
        window.add(Phase::Logging, t_log.elapsed());
        if let Some(bar) = &bar {
            bar.set_position(done);
        }
        outcome.steps_run += 1;
        outcome.final_step = done;
    }
    outcome.phases.merge(&window);
    if let Some(bar) = bar {
        bar.finish_and_clear();
    }
    let mut tokens = [timed_tokens];
    pg.all_reduce(&mut tokens, ReduceOp::Sum)
        .map_err(TrainError::comm("token count all_reduce"))?;
    if let Some(t0) = timed_from {
        let secs = t0.elapsed().as_secs_f64();
        if outcome.steps_run > 1 && secs > 0.0 {
            outcome.tokens_per_s = tokens[0] / secs;
        }
    }
    outcome.params = model.params().to_vec();

    // -- summary ----------------------------------------------------------
    let last = |v: &[(u64, f32)]| {
        v.last()
            .map(|x| format!("{:.4}", x.1))
            .unwrap_or("-".into())
    };
    let floor = data
        .loss_floor()
        .map(|f| format!("{f:.4}"))
        .unwrap_or("unknown".into());
    say(
        log,
        format!(
            "done: {} steps; train loss {}, val loss {}, floor {floor}; {:.0} tokens/s on {world} rank(s)",
            outcome.final_step,
            last(&outcome.train_losses),
            last(&outcome.val_losses),
            outcome.tokens_per_s
        ),
    )?;
    let n = outcome.steps_run.max(1);
    say(
        log,
        format!(
            "time per step (rank 0): {} | {}",
            outcome.phases.per_step(n),
            outcome.phases.shares()
        ),
    )?;
    if let Some(out) = &cfg.out {
        say(log, format!("checkpoint: {}", out.display()))?;
    }
    if guard.skipped() > 0 {
        say(
            log,
            format!(
                "skipped {} update(s) for a non-finite loss or gradient",
                guard.skipped()
            ),
        )?;
    }
    if log_guard.failures() > 0 {
        // The log is what failed: this line goes where the warnings went.
        let _ = writeln!(
            std::io::stderr(),
            "cohort train: {} log line(s) could not be written",
            log_guard.failures()
        );
    }
    Ok(outcome)
}

/// The attention mask of a batch with padding (None when every position is a
/// token, the common case, which spares the model the mask's bookkeeping).
pub(crate) fn padding_mask(batch: &cohort_data::Batch) -> Option<&[u8]> {
    batch
        .attention_mask
        .contains(&0)
        .then_some(&batch.attention_mask[..])
}

/// Mean loss over this rank's validation batches, averaged over ranks.
fn evaluate(
    val: &[cohort_data::Batch],
    model: &mut GPT,
    pg: &ProcessGroup,
) -> Result<f32, TrainError> {
    let mut mean = [mean_loss(val, model)?];
    pg.all_reduce(&mut mean, ReduceOp::Avg)
        .map_err(TrainError::comm("val loss all_reduce"))?;
    Ok(mean[0])
}

/// Mean loss of `model` over `val` (NaN for no batches), in eval mode.
pub(crate) fn mean_loss(val: &[cohort_data::Batch], model: &mut GPT) -> Result<f32, TrainError> {
    if val.is_empty() {
        return Ok(f32::NAN);
    }
    model.set_training(false);
    let mut sum = 0f64;
    for batch in val {
        let mask = padding_mask(batch);
        sum += model
            .forward(
                &batch.input_ids,
                mask,
                Some(&batch.labels),
                batch.batch,
                batch.seq,
            )?
            .unwrap_or(0.0) as f64;
    }
    model.set_training(true);
    Ok((sum / val.len() as f64) as f32)
}

/// Writes a log line, hiding the progress bar (on stderr) meanwhile.
fn print_line(
    bar: &Option<indicatif::ProgressBar>,
    say: &mut dyn FnMut(&mut dyn Write, String) -> Result<(), TrainError>,
    log: &mut dyn Write,
    line: String,
) -> Result<(), TrainError> {
    match bar {
        Some(bar) => bar.suspend(|| say(log, line)),
        None => say(log, line),
    }
}

fn progress_bar(master: bool, at: u64, steps: u64) -> Option<indicatif::ProgressBar> {
    if !master || !std::io::stderr().is_terminal() {
        return None;
    }
    let bar = indicatif::ProgressBar::new(steps);
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "{bar:40} {pos}/{len} steps, {elapsed} elapsed, eta {eta}",
        )
        .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    bar.set_position(at);
    bar.enable_steady_tick(Duration::from_millis(200));
    Some(bar)
}
