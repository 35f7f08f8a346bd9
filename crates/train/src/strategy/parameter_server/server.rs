//! The server (rank 0): holds the parameters, AdamW and the schedule, applies the workers'
//! gradients (sync: averaged per step; async: one update per push if fresh enough), evaluates,
//! logs and checkpoints, as a strategy of the one training loop ([`ServerStrategy`]). It
//! never computes a gradient: the workers do.

use std::collections::VecDeque;
use std::io::Write;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use cohort_comm::{GroupOptions, ProcessGroup};
use cohort_data::Dataset;
use cohort_engine::optim::{AdamW, Optimizer};
use cohort_gpt::optim_groups::decay_mask;
use cohort_gpt::GPT;
use cohort_rpc::{Rpc, RpcError};
use cohort_store::HashStore;

use super::board::{Board, BoardState};
use super::messages::rpc_err;
use crate::checkpoint::{self, Resumed, SaveReport, TrainState};
use crate::config::{PsMode, TrainConfig};
use crate::error::TrainError;
use crate::input::{val_batches, ValBatches};
use crate::phases::{Phase, Phases};
use crate::replica::model_config;
use crate::step_loop::{
    self, batch_losses, mean_val_loss, Outcome, ParallelStrategy, Start, StepGradients,
};

/// The server: the model, the optimizer, and the board its handlers fill.
pub(super) struct Server<'c> {
    pub(super) cfg: &'c TrainConfig,
    pub(super) data: Arc<dyn Dataset>,
    pub(super) model: GPT,
    pub(super) opt: AdamW,
    /// The job's validation batches, all of them: the same list DDP shares
    /// out among its ranks, so that the same model reports the same
    /// validation loss under either strategy and any number of workers.
    pub(super) val: ValBatches,
    /// A world of one for the loop's checks (the workers' results are
    /// already gathered here); it opens no socket.
    pub(super) alone: ProcessGroup,
    pub(super) board: Arc<Board>,
    /// The checkpoint this run continues, if any.
    pub(super) resumed: Option<Resumed>,
}

/// The server running its updates: [`Server`] as a strategy of the one
/// training loop. Its "gradients" are the workers' pushes.
struct ServerStrategy<'s, 'c> {
    server: Server<'c>,
    rpc: &'s Rpc,
    /// The workers' data position after the last sync step (for checkpoints).
    position: (u64, usize),
    /// Async: the push being applied, answered once the update is done.
    ticket: Option<u64>,
    /// Async staleness in the current log window: sum, max, pushes dropped.
    window: Staleness,
    /// The same over the run.
    total: Staleness,
}

/// How stale the applied async gradients were.
#[derive(Default, Clone, Copy)]
struct Staleness {
    sum: u64,
    max: u64,
    applied: u64,
    dropped: u64,
}

impl Staleness {
    fn add(&mut self, other: Staleness) {
        self.sum += other.sum;
        self.max = self.max.max(other.max);
        self.applied += other.applied;
        self.dropped += other.dropped;
    }
}

impl<'c> Server<'c> {
    pub(super) fn new(
        cfg: &'c TrainConfig,
        data: Arc<dyn Dataset>,
        workers: usize,
        wait_limit: Duration,
    ) -> Result<Self, TrainError> {
        let model_cfg = model_config(cfg, data.vocab_size())?;
        model_cfg.validate()?;
        crate::replica::check_memory(
            cfg,
            &model_cfg,
            data.seq_len(),
            1,
            crate::memory::Sharding::Replicated,
        )?;
        // The server's parameters are the workers' (they pull them before each step).
        let (mut model, _) = crate::replica::new_model(cfg, model_cfg, true)?;
        crate::replica::apply_precision(cfg, |d| model.set_precision(d))?;
        let adamw = cfg.adamw();
        let mut opt = AdamW::new(adamw, decay_mask(model.param_views()))?;
        let resumed = match &cfg.resume {
            Some(dir) => Some(checkpoint::resume_alone(
                dir, cfg, workers, &mut model, &mut opt,
            )?),
            None => None,
        };
        let state = resumed.as_ref().map(|r| r.state).unwrap_or_default();
        let val = val_batches(&data, cfg, 1, 0, cfg.eval_batches)?;
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
            val,
            alone,
            board,
            resumed,
        })
    }

    /// Runs the updates; whatever happens, the waiting pushes are released.
    pub(super) fn serve(
        self,
        rpc: &Rpc,
        log: &mut dyn Write,
        untimed_steps: u64,
    ) -> Result<Outcome, TrainError> {
        let board = self.board.clone();
        let cfg = self.cfg;
        let start = self.resumed.as_ref().map(|r| r.state).unwrap_or_default();
        let mut strategy = ServerStrategy {
            server: self,
            rpc,
            position: (start.epoch, start.offset),
            ticket: None,
            window: Staleness::default(),
            total: Staleness::default(),
        };
        let r = step_loop::run(cfg, &mut strategy, log, untimed_steps);
        let mut st = board.lock();
        st.done = true;
        if let Err(e) = &r {
            st.failed = Some(e.to_string());
        }
        board.cv.notify_all();
        r
    }
}

impl ParallelStrategy for ServerStrategy<'_, '_> {
    fn group(&self) -> &ProcessGroup {
        // The workers' results are gathered here: the loop's checks and
        // sums run in a world of one.
        &self.server.alone
    }

    fn start(&self) -> Start {
        let s = &self.server;
        let (cfg, workers) = (s.cfg, s.board.workers);
        let (b, t) = (cfg.batch_size, s.data.seq_len());
        let mut lines: Vec<String> = crate::replica::precision_line(cfg).into_iter().collect();
        if let Some(resumed) = &s.resumed {
            lines.extend(resumed.notes.iter().cloned());
            lines.push(format!(
                "resumed from {} at step {}",
                resumed.dir.display(),
                resumed.state.step
            ));
        }
        lines.extend(crate::input::data_lines(&*s.data));
        lines.push(format!(
            "model: {} layers, {} heads, d_model {}, d_ff {}, vocab {}, seq {}: {} parameters; \
             parameter server on rank 0, {workers} worker(s), {}",
            cfg.n_layers,
            cfg.n_heads,
            cfg.d_model,
            cfg.d_ff,
            s.data.vocab_size(),
            t,
            s.model.num_params(),
            match cfg.ps_mode {
                PsMode::Sync => "sync mode".to_string(),
                PsMode::Async => format!("async mode (max staleness {})", cfg.max_staleness),
            },
        ));
        lines.push(match cfg.ps_mode {
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
        });
        Start {
            step: s.resumed.as_ref().map_or(0, |r| r.state.step),
            header: lines,
            loss_floor: s.data.loss_floor(),
        }
    }

    fn gradients(&mut self, step: u64, phases: &mut Phases) -> Result<StepGradients, TrainError> {
        let (cfg, workers) = (self.server.cfg, self.server.board.workers);
        let t_wait = Instant::now();
        let (loss, finite, tokens) = match cfg.ps_mode {
            PsMode::Sync => {
                let pushes = self.server.wait(self.rpc, step, |st| {
                    st.inbox.iter().all(Option::is_some).then(|| {
                        st.inbox
                            .iter_mut()
                            .map(|p| p.take().expect("all in"))
                            .collect::<Vec<_>>()
                    })
                })?;
                phases.add(Phase::Comm, t_wait.elapsed());
                let t_sum = Instant::now();
                let grads = self.server.model.grads_mut();
                grads.copy_from_slice(&pushes[0].grads.0);
                for p in &pushes[1..] {
                    grads.iter_mut().zip(&p.grads.0).for_each(|(g, x)| *g += *x);
                }
                // DDP's average: the sum, then one division by the world.
                let w = workers as f32;
                grads.iter_mut().for_each(|g| *g /= w);
                phases.add(Phase::Optimizer, t_sum.elapsed());
                let loss: f32 = pushes.iter().map(|p| p.loss).sum::<f32>() / w;
                let finite = pushes.iter().all(|p| p.loss.is_finite());
                let tokens = pushes.iter().map(|p| p.tokens).sum::<u64>();
                // Every worker's shard has the same length: one position.
                self.position = (pushes[0].epoch, pushes[0].offset as usize);
                (loss, finite, tokens)
            }
            PsMode::Async => {
                let (ticket, push, staleness) = loop {
                    let (ticket, push) = self
                        .server
                        .wait(self.rpc, step, |st| st.queue.pop_front())?;
                    let staleness = step - push.version.min(step);
                    if staleness <= cfg.max_staleness {
                        break (ticket, push, staleness);
                    }
                    self.window.dropped += 1;
                    self.server.answer(ticket);
                };
                phases.add(Phase::Comm, t_wait.elapsed());
                self.window.sum += staleness;
                self.window.max = self.window.max.max(staleness);
                self.window.applied += 1;
                self.server.model.grads_mut().copy_from_slice(&push.grads.0);
                self.ticket = Some(ticket);
                (push.loss, push.loss.is_finite(), push.tokens)
            }
        };
        Ok(StepGradients {
            loss_share: loss as f64 / cfg.grad_accum as f64,
            loss_finite: finite,
            tokens: tokens as f64,
            micro_batches: cfg.grad_accum,
        })
    }

    fn grads_mut(&mut self) -> &mut [f32] {
        self.server.model.grads_mut()
    }

    fn apply(&mut self, step: u64, lr: Option<f64>) -> Result<(), TrainError> {
        let s = &mut self.server;
        if let Some(lr) = lr {
            let (params, grads) = s.model.params_and_grads_mut();
            s.opt.step(params, grads, lr)?;
        }
        s.model.zero_grad();
        s.publish(step + 1);
        if let Some(ticket) = self.ticket.take() {
            s.answer(ticket);
        }
        Ok(())
    }

    fn log_note(&mut self) -> Result<String, TrainError> {
        let w = std::mem::take(&mut self.window);
        self.total.add(w);
        Ok(match self.server.cfg.ps_mode {
            PsMode::Sync => String::new(),
            PsMode::Async => format!(
                " | staleness mean {:.2} max {} dropped {}",
                w.sum as f64 / w.applied.max(1) as f64,
                w.max,
                w.dropped
            ),
        })
    }

    fn evaluate(&mut self) -> Result<f32, TrainError> {
        let s = &mut self.server;
        let losses = batch_losses(&s.val.mine, &mut s.model)?;
        mean_val_loss(None, s.val.total, &losses)
    }

    fn save(
        &mut self,
        out: &std::path::Path,
        step: u64,
        saver: &mut checkpoint::Saver,
    ) -> Result<SaveReport, TrainError> {
        let s = &self.server;
        let state = TrainState {
            step,
            epoch: self.position.0,
            offset: self.position.1,
        };
        let tokenizer = s.data.tokenizer_json();
        Ok(saver.save_whole(
            out,
            s.cfg,
            s.board.workers,
            &s.model,
            &s.opt,
            &state,
            tokenizer.as_deref(),
        ))
    }

    fn final_params(&mut self) -> Result<Vec<f32>, TrainError> {
        Ok(self.server.model.params().to_vec())
    }

    fn who(&self) -> String {
        format!(
            "{} worker(s) and a parameter server",
            self.server.board.workers
        )
    }

    fn summary(&self) -> Vec<String> {
        let cfg = self.server.cfg;
        if cfg.ps_mode == PsMode::Sync {
            return Vec::new();
        }
        let mut t = self.total;
        t.add(self.window);
        vec![format!(
            "staleness: mean {:.2}, max {} (bound {}); {} gradient(s) dropped as too stale",
            t.sum as f64 / t.applied.max(1) as f64,
            t.max,
            cfg.max_staleness,
            t.dropped
        )]
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
