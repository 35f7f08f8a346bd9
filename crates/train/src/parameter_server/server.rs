//! The server (rank 0): holds the parameters, AdamW and the schedule, applies the workers'
//! gradients (sync: averaged per step; async: one update per push if fresh enough), evaluates,
//! logs and checkpoints.

use super::*;

/// The server: the model, the optimizer, and the board its handlers fill.
pub(super) struct Server<'c> {
    pub(super) cfg: &'c TrainConfig,
    pub(super) data: Arc<dyn Dataset>,
    pub(super) model: GPT,
    pub(super) opt: AdamW,
    pub(super) schedule: LrSchedule,
    pub(super) guard: StepGuard,
    /// A world of one for the guard's checks (the workers' results are
    /// already gathered here); it opens no socket.
    pub(super) alone: ProcessGroup,
    pub(super) board: Arc<Board>,
    /// The checkpoint this run continues, if any.
    pub(super) resumed: Option<Resumed>,
}

/// Figures of one log window on the server.
#[derive(Default)]
pub(super) struct Window {
    pub(super) steps: u64,
    pub(super) updates: u64,
    pub(super) loss: f32,
    pub(super) tokens: f64,
    pub(super) staleness_sum: u64,
    pub(super) staleness_max: u64,
    pub(super) dropped: u64,
    pub(super) phases: Phases,
}

impl<'c> Server<'c> {
    pub(super) fn new(
        cfg: &'c TrainConfig,
        data: Arc<dyn Dataset>,
        workers: usize,
        wait_limit: Duration,
    ) -> Result<Self, TrainError> {
        let mut model = GPT::new(model_config(cfg, data.vocab_size()), cfg.seed)?;
        let adamw = cfg.adamw();
        let mut opt = AdamW::new(adamw, decay_mask(model.param_views()))?;
        let resumed = match &cfg.resume {
            Some(dir) => Some(checkpoint::resume_alone(
                dir, cfg, workers, &mut model, &mut opt,
            )?),
            None => None,
        };
        let state = resumed.as_ref().map(|r| r.state).unwrap_or_default();
        let schedule =
            LrSchedule::warmup_cosine(cfg.lr, cfg.min_lr, cfg.warmup_steps, cfg.decay_steps())?;
        let alone = GroupOptions::from_env()
            .and_then(|o| ProcessGroup::new(Arc::new(HashStore::new()), 0, 1, o))
            .map_err(TrainError::comm("the server's own group"))?;
        let board = Arc::new(Board {
            mode: cfg.ps_mode,
            workers,
            wait_limit,
            st: Mutex::new(BoardState {
                params: Arc::new(model.params().to_vec()),
                version: state.step,
                done: state.step >= cfg.steps,
                start: (state.epoch, state.offset),
                failed: None,
                inbox: (0..workers).map(|_| None).collect(),
                queue: VecDeque::new(),
                next_ticket: 0,
                answered: 0,
            }),
            cv: Condvar::new(),
        });
        Ok(Server {
            cfg,
            data,
            model,
            opt,
            schedule,
            guard: StepGuard::new(
                cfg.clip_value,
                cfg.grad_clip,
                cfg.max_consecutive_skips,
                None,
            ),
            alone,
            board,
            resumed,
        })
    }

    /// Runs the updates; whatever happens, the waiting pushes are released.
    pub(super) fn serve(
        mut self,
        rpc: &Rpc,
        log: &mut dyn Write,
        timed_from: u64,
    ) -> Result<Outcome, TrainError> {
        let r = self.run(rpc, log, timed_from);
        let mut st = self.board.lock();
        st.done = true;
        if let Err(e) = &r {
            st.failed = Some(e.to_string());
        }
        self.board.cv.notify_all();
        r
    }

    pub(super) fn run(
        &mut self,
        rpc: &Rpc,
        log: &mut dyn Write,
        timed_from: u64,
    ) -> Result<Outcome, TrainError> {
        let cfg = self.cfg;
        let workers = self.board.workers;
        let (b, t) = (cfg.batch_size, self.data.seq_len());
        let mut say = |line: String| writeln!(log, "{line}").map_err(TrainError::Log);
        say(format!("data: {}", self.data.describe()))?;
        say(format!(
            "model: {} layers, {} heads, d_model {}, d_ff {}, vocab {}, seq {}: {} parameters; \
             parameter server on rank 0, {workers} worker(s), {} mode{}",
            cfg.n_layers,
            cfg.n_heads,
            cfg.d_model,
            cfg.d_ff,
            self.data.vocab_size(),
            t,
            self.model.num_params(),
            match cfg.ps_mode {
                PsMode::Sync => "sync",
                PsMode::Async => "async",
            },
            match cfg.ps_mode {
                PsMode::Sync => String::new(),
                PsMode::Async => format!(" (max staleness {})", cfg.max_staleness),
            },
        ))?;
        say(match cfg.ps_mode {
            PsMode::Sync => format!(
                "global batch: {} sequences = {b} per worker x {workers} workers x {} accumulation \
                 ({} tokens/step)",
                b * workers * cfg.grad_accum,
                cfg.grad_accum,
                b * t * workers * cfg.grad_accum
            ),
            PsMode::Async => format!(
                "batch per update: {} sequences = {b} x {} accumulation from one worker",
                b * cfg.grad_accum,
                cfg.grad_accum
            ),
        })?;
        let start = self.resumed.as_ref().map(|r| r.state).unwrap_or_default();
        if let Some(resumed) = &self.resumed {
            for note in &resumed.notes {
                say(note.clone())?;
            }
            say(format!(
                "resumed from {} at step {}",
                resumed.dir.display(),
                start.step
            ))?;
        }
        let mut position = (start.epoch, start.offset);
        let val = val_batches(&self.data, cfg, 1, 0, cfg.eval_batches)?;
        let mut outcome = Outcome::starting_at(start.step, self.data.loss_floor());
        let mut win = Window::default();
        let mut win_start = Instant::now();
        let mut timed: Option<(Instant, f64)> = None;
        let mut skipped_total = 0u64;
        let mut staleness_total = (0u64, 0u64);
        let mut dropped_total = 0u64;

        for step in start.step..cfg.steps {
            if step == start.step + timed_from {
                timed = Some((Instant::now(), 0.0));
            }
            // -- the gradient of this update ------------------------------
            let t_wait = Instant::now();
            let (loss, finite, tokens, ticket) = match cfg.ps_mode {
                PsMode::Sync => {
                    let pushes = self.wait(rpc, step, |st| {
                        st.inbox.iter().all(Option::is_some).then(|| {
                            st.inbox
                                .iter_mut()
                                .map(|p| p.take().expect("all in"))
                                .collect::<Vec<_>>()
                        })
                    })?;
                    win.phases.add(Phase::Comm, t_wait.elapsed());
                    let t_sum = Instant::now();
                    let grads = self.model.grads_mut();
                    grads.copy_from_slice(&pushes[0].grads.0);
                    for p in &pushes[1..] {
                        grads.iter_mut().zip(&p.grads.0).for_each(|(g, x)| *g += *x);
                    }
                    // DDP's average: the sum, then one division by the world.
                    let w = workers as f32;
                    grads.iter_mut().for_each(|g| *g /= w);
                    win.phases.add(Phase::Optimizer, t_sum.elapsed());
                    let loss: f32 = pushes.iter().map(|p| p.loss).sum::<f32>() / w;
                    let finite = pushes.iter().all(|p| p.loss.is_finite());
                    let tokens = pushes.iter().map(|p| p.tokens).sum::<u64>();
                    // Every worker's shard has the same length: one position.
                    position = (pushes[0].epoch, pushes[0].offset as usize);
                    (loss, finite, tokens, None)
                }
                PsMode::Async => {
                    let (ticket, push, staleness) = loop {
                        let (ticket, push) = self.wait(rpc, step, |st| st.queue.pop_front())?;
                        let staleness = step - push.version.min(step);
                        if staleness <= cfg.max_staleness {
                            break (ticket, push, staleness);
                        }
                        win.dropped += 1;
                        self.answer(ticket);
                    };
                    win.phases.add(Phase::Comm, t_wait.elapsed());
                    win.staleness_sum += staleness;
                    win.staleness_max = win.staleness_max.max(staleness);
                    self.model.grads_mut().copy_from_slice(&push.grads.0);
                    (push.loss, push.loss.is_finite(), push.tokens, Some(ticket))
                }
            };
            // -- the update, as `train` makes it ---------------------------
            let t_opt = Instant::now();
            let skip = self.guard.check(
                &self.alone,
                step,
                finite,
                self.model.grads_mut(),
                cfg.grad_accum,
            )?;
            if skip.is_none() {
                let (params, grads) = self.model.params_and_grads_mut();
                self.opt.step(params, grads, self.schedule.lr(step))?;
                win.loss += loss / cfg.grad_accum as f32;
                win.updates += 1;
            } else {
                skipped_total += 1;
            }
            self.model.zero_grad();
            self.publish(step + 1);
            if let Some(ticket) = ticket {
                self.answer(ticket);
            }
            win.phases.add(Phase::Optimizer, t_opt.elapsed());
            if let Some(skip) = skip {
                say(format!("[step {} / {}] {skip}", step + 1, cfg.steps))?;
            }
            win.tokens += tokens as f64;
            win.steps += 1;
            if let Some((_, n)) = &mut timed {
                *n += tokens as f64;
            }
            let done = step + 1;
            outcome.steps_run = done - start.step;
            outcome.final_step = done;

            // -- log, eval ------------------------------------------------
            let t_log = Instant::now();
            if done % cfg.log_interval == 0 || done == cfg.steps {
                let mean = win.loss / win.updates.max(1) as f32;
                outcome.train_losses.push((done, mean));
                let secs = win_start.elapsed().as_secs_f64().max(1e-9);
                let stale = match cfg.ps_mode {
                    PsMode::Sync => String::new(),
                    PsMode::Async => format!(
                        " | staleness mean {:.2} max {} dropped {}",
                        win.staleness_sum as f64 / win.updates.max(1) as f64,
                        win.staleness_max,
                        win.dropped
                    ),
                };
                say(format!(
                    "[step {done} / {}] loss = {mean:.4} | lr {:.2e} | {:.0} tok/s | {}{stale}",
                    cfg.steps,
                    self.schedule.lr(step),
                    win.tokens / secs,
                    win.phases.per_step(win.steps),
                ))?;
                staleness_total.0 += win.staleness_sum;
                staleness_total.1 = staleness_total.1.max(win.staleness_max);
                dropped_total += win.dropped;
                outcome.phases.merge(&win.phases);
                win = Window::default();
                win_start = Instant::now();
            }
            if (cfg.eval_interval > 0 && done % cfg.eval_interval == 0) || done == cfg.steps {
                let loss = mean_loss(&val, &mut self.model)?;
                outcome.val_losses.push((done, loss));
                let floor = self
                    .data
                    .loss_floor()
                    .map(|f| format!(" (floor {f:.4})"))
                    .unwrap_or_default();
                say(format!(
                    "[step {done} / {}] val loss = {loss:.4}{floor}",
                    cfg.steps
                ))?;
            }
            let save_now = cfg.save_interval > 0 && done % cfg.save_interval == 0;
            if let (true, Some(out)) = (save_now || done == cfg.steps, &cfg.out) {
                let state = TrainState {
                    step: done,
                    epoch: position.0,
                    offset: position.1,
                };
                let tokenizer = self.data.tokenizer_json();
                let notes = checkpoint::save_or_report(
                    out,
                    cfg,
                    workers,
                    &self.model,
                    &self.opt,
                    &state,
                    tokenizer.as_deref(),
                );
                for line in notes {
                    say(format!("[step {done} / {}] {line}", cfg.steps))?;
                }
            }
            win.phases.add(Phase::Logging, t_log.elapsed());
        }
        outcome.phases.merge(&win.phases);
        if let Some((t0, tokens)) = timed {
            let secs = t0.elapsed().as_secs_f64();
            if secs > 0.0 {
                outcome.tokens_per_s = tokens / secs;
            }
        }
        outcome.params = self.model.params().to_vec();
        let last = |v: &[(u64, f32)]| {
            v.last()
                .map(|x| format!("{:.4}", x.1))
                .unwrap_or("-".into())
        };
        let floor = self
            .data
            .loss_floor()
            .map(|f| format!("{f:.4}"))
            .unwrap_or("unknown".into());
        say(format!(
            "done: {} steps; train loss {}, val loss {}, floor {floor}; {:.0} tokens/s on {workers} \
             worker(s) and a parameter server",
            outcome.final_step,
            last(&outcome.train_losses),
            last(&outcome.val_losses),
            outcome.tokens_per_s
        ))?;
        let n = outcome.steps_run.max(1);
        say(format!(
            "time per step (server): {} | {}",
            outcome.phases.per_step(n),
            outcome.phases.shares()
        ))?;
        if cfg.ps_mode == PsMode::Async {
            say(format!(
                "staleness: mean {:.2}, max {} (bound {}); {dropped_total} gradient(s) dropped as too stale",
                staleness_total.0 as f64 / n as f64,
                staleness_total.1,
                cfg.max_staleness
            ))?;
        }
        if skipped_total > 0 {
            say(format!(
                "skipped {skipped_total} update(s) for a non-finite loss or gradient"
            ))?;
        }
        Ok(outcome)
    }
}

impl Server<'_> {
    /// Waits until `take` finds what the next update needs on the board,
    /// checking meanwhile that no worker died.
    pub(super) fn wait<T>(
        &self,
        rpc: &Rpc,
        step: u64,
        mut take: impl FnMut(&mut BoardState) -> Option<T>,
    ) -> Result<T, TrainError> {
        let limit = self.board.wait_limit;
        let deadline = Instant::now() + limit;
        let mut st = self.board.lock();
        loop {
            if let Some(x) = take(&mut st) {
                return Ok(x);
            }
            drop(st);
            rpc.check_workers()
                .map_err(rpc_err("waiting for gradients"))?;
            if Instant::now() >= deadline {
                return Err(TrainError::Rpc {
                    what: "waiting for gradients",
                    error: RpcError::Timeout {
                        worker: "the workers".into(),
                        func: format!("ps.push of step {}", step + 1),
                        timeout: limit,
                    },
                });
            }
            st = self.board.lock();
            st = self
                .board
                .cv
                .wait_timeout(st, Duration::from_millis(100))
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }

    /// Makes the model's parameters the ones pushes are answered with.
    pub(super) fn publish(&self, version: u64) {
        let params = Arc::new(self.model.params().to_vec());
        let mut st = self.board.lock();
        st.params = params;
        st.version = version;
        st.done = version >= self.cfg.steps;
        self.board.cv.notify_all();
    }

    /// Async: the push `ticket` is dealt with (applied or dropped).
    pub(super) fn answer(&self, ticket: u64) {
        self.board.lock().answered = ticket + 1;
        self.board.cv.notify_all();
    }
}
