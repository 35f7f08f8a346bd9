//! Parameter-server training (seed 004's paradigm), over `cohort-rpc`:
//! `cohort run -n K train --strategy parameter-server`.
//!
//! Rank 0 is the server: it holds the parameters, the AdamW state and the
//! learning-rate schedule, applies every update, evaluates and logs. Ranks
//! 1..K-1 are workers: each trains on its own shard of the data (the
//! DistributedSampler of a world of K-1, as DDP's ranks would), computes
//! the gradient of a step and pushes it (`ps.push`); the answer is the
//! parameters to compute the next gradient on.
//!
//! - **sync**: the server waits for every worker's gradient of step `s`,
//!   averages them in worker order (sum, then divide by K-1, as DDP's
//!   all-reduce does), scales, checks and clips them exactly as `train`
//!   does (the same [`StepGuard`]), steps AdamW, and answers every worker
//!   with the new parameters. The parameters after each step are DDP's over
//!   K-1 ranks: bitwise with two workers, where the sum of two gradients
//!   does not depend on the order.
//! - **async**: the server applies each gradient as it arrives, one update
//!   per push, and answers that worker at once. A gradient computed on
//!   parameters `staleness` updates older than the server's is applied if
//!   `staleness <= max_staleness` and dropped otherwise; the log reports the
//!   mean and largest staleness applied and how many were dropped. The run
//!   ends after `steps` updates.
//!
//! Handlers only pass gradients and parameters through a shared board; the
//! server's own thread owns the model. In sync mode the server writes the
//! checkpoints (`--out`, as `train` does, with the workers' data position)
//! and resumes from one (`--resume`): the workers learn the step and the
//! data position from their first pull. Async mode refuses both, since its
//! workers' data positions drift apart. This module never opens a socket
//! itself.

use std::collections::VecDeque;
use std::io::Write;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use cohort_comm::{GroupOptions, ProcessGroup};
use cohort_engine::optim::{AdamW, LrSchedule, Optimizer};
use cohort_gpt::optim_groups::decay_mask;
use cohort_gpt::GPT;
use cohort_rpc::{Floats, Registry, Rpc, RpcError, RpcOptions};
use cohort_store::{HashStore, Store};
use serde::{Deserialize, Serialize};

use crate::batches::{val_batches, TrainBatches};
use crate::checkpoint::{self, Resumed, TrainState};
use crate::config::{ConfigError, PsMode, TrainConfig};
use crate::fault::StepGuard;
use crate::phases::{Phase, Phases};
use crate::train::{build_dataset, mean_loss, model_config, padding_mask, Outcome};
use crate::{FileData, TrainError};
use cohort_data::Dataset;

/// How the processes of a parameter-server job find each other.
pub enum Rendezvous {
    /// The `env://` variables (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), as
    /// `cohort run` sets them.
    Env,
    /// A store every process reaches, this process's rank, the number of
    /// processes, and the RPC settings.
    Store {
        /// The store.
        store: Arc<dyn Store>,
        /// This process's rank (0: the server).
        rank: usize,
        /// Processes: the server and the workers.
        world: usize,
        /// RPC settings (timeout, secret).
        options: RpcOptions,
    },
}

/// A worker's gradient of one step.
#[derive(Serialize, Deserialize)]
struct Push {
    /// 0-based worker index (rank - 1).
    worker: u32,
    /// The parameters' version the gradient was computed on.
    version: u64,
    /// Summed over the step's micro-batches.
    grads: Floats,
    /// Summed over the micro-batches.
    loss: f32,
    /// Tokens trained on (padding excluded).
    tokens: u64,
    /// This worker's data position (epoch, offset) after the step.
    epoch: u64,
    offset: u64,
}

/// The parameters to compute the next gradient on.
#[derive(Serialize, Deserialize)]
struct Params {
    /// Updates applied so far.
    version: u64,
    /// No more steps: the worker stops.
    done: bool,
    params: Floats,
    /// Where the workers' data start: a resumed run's position, else 0, 0.
    epoch: u64,
    offset: u64,
}

fn rpc_err(what: &'static str) -> impl Fn(RpcError) -> TrainError {
    move |error| TrainError::Rpc { what, error }
}

/// Trains with a parameter server: rank 0 serves, the other ranks push
/// gradients. Every process calls it with the same config; the server logs
/// to `log`. Returns the server's outcome on the server (losses, tokens/s
/// of all workers, the final parameters) and the worker's on a worker (its
/// phases, the parameters it last received).
pub fn train_parameter_server(
    cfg: &TrainConfig,
    how: Rendezvous,
    log: &mut dyn Write,
) -> Result<Outcome, TrainError> {
    cfg.validate()?;
    if cfg.ps_mode == PsMode::Async && (cfg.out.is_some() || cfg.resume.is_some()) {
        return Err(ConfigError::Invalid {
            key: "ps_mode",
            value: "async".into(),
            why: "writes and resumes no checkpoints (--out, --resume): its workers' data \
                  positions drift apart; use --ps-mode sync or ddp for those",
        }
        .into());
    }
    let (rank, world) = match &how {
        Rendezvous::Env => (env_usize("RANK")?, env_usize("WORLD_SIZE")?),
        Rendezvous::Store { rank, world, .. } => (*rank, *world),
    };
    if world < 2 {
        return Err(ConfigError::Invalid {
            key: "strategy",
            value: "parameter-server".into(),
            why: "needs a server and at least one worker: run under `cohort run -n K`, K >= 2",
        }
        .into());
    }
    run_role(cfg, how, rank, world, log, 1)
}

/// Serves (rank 0) or works; throughput is timed from step `timed_from`.
fn run_role(
    cfg: &TrainConfig,
    how: Rendezvous,
    rank: usize,
    world: usize,
    log: &mut dyn Write,
    timed_from: u64,
) -> Result<Outcome, TrainError> {
    let options = rpc_options(&how, world)?;
    if rank == 0 {
        // The server prepares file data (tokenizing, caching) before anyone
        // can join, so the workers open the finished cache.
        let data = dataset(cfg, true)?;
        let server = Server::new(cfg, data, world - 1, options.timeout)?;
        let mut registry = Registry::new();
        server.board.register(&mut registry);
        let rpc = join(how, rank, world, registry, options)?;
        let outcome = server.serve(&rpc, log, timed_from);
        finish(&rpc, outcome)
    } else {
        let rpc = join(how, rank, world, Registry::new(), options)?;
        let outcome =
            dataset(cfg, false).and_then(|data| work(cfg, &rpc, data, rank - 1, world - 1));
        finish(&rpc, outcome)
    }
}

/// Shuts the agent down after a run that went well; after a failure, the
/// failure is what the caller sees (the other processes see this one leave).
fn finish(rpc: &Rpc, outcome: Result<Outcome, TrainError>) -> Result<Outcome, TrainError> {
    let outcome = outcome?;
    rpc.shutdown().map_err(rpc_err("shutting down"))?;
    Ok(outcome)
}

fn env_usize(name: &'static str) -> Result<usize, TrainError> {
    let v = std::env::var(name).map_err(|_| ConfigError::Invalid {
        key: "strategy",
        value: "parameter-server".into(),
        why: "needs RANK and WORLD_SIZE: run under `cohort run -n K`, K >= 2",
    })?;
    v.parse().map_err(|_| {
        ConfigError::Invalid {
            key: name,
            value: v.clone(),
            why: "must be a non-negative integer",
        }
        .into()
    })
}

fn join(
    how: Rendezvous,
    rank: usize,
    world: usize,
    registry: Registry,
    options: RpcOptions,
) -> Result<Rpc, TrainError> {
    let name = if rank == 0 {
        "ps".to_string()
    } else {
        format!("worker{rank}")
    };
    match how {
        Rendezvous::Env => cohort_rpc::init_rpc_with_options(&name, rank, world, registry, options),
        Rendezvous::Store { store, .. } => {
            cohort_rpc::init_rpc_with_store(store, &name, rank, world, registry, options)
        }
    }
    .map_err(rpc_err("joining the RPC group"))
}

/// The RPC settings of `how`, with a handler thread per worker to spare:
/// a sync push holds one on the server until every worker's gradient is in.
fn rpc_options(how: &Rendezvous, world: usize) -> Result<RpcOptions, TrainError> {
    let mut o = match how {
        Rendezvous::Env => RpcOptions::from_env().map_err(rpc_err("reading the RPC settings"))?,
        Rendezvous::Store { options, .. } => options.clone(),
    };
    o.num_worker_threads = o.num_worker_threads.max(world + 2);
    Ok(o)
}

/// The data set, without a process group: the server opens (and if need be
/// builds) file data first, the workers after it.
fn dataset(cfg: &TrainConfig, create: bool) -> Result<Arc<dyn Dataset>, TrainError> {
    if matches!(cfg.data.as_str(), "markov" | "random") {
        return Ok(build_dataset(cfg)?.into());
    }
    Ok(Arc::new(FileData::open(cfg, create)?))
}

/// What the handlers and the server's thread share.
struct Board {
    mode: PsMode,
    workers: usize,
    /// How long a push may wait for its answer (the RPC timeout).
    wait_limit: Duration,
    st: Mutex<BoardState>,
    cv: Condvar,
}

struct BoardState {
    params: Arc<Vec<f32>>,
    version: u64,
    done: bool,
    /// Where the workers' data start (epoch, offset).
    start: (u64, usize),
    /// Set when the server's loop fails: every waiting push returns it.
    failed: Option<String>,
    /// Sync: this step's push of each worker.
    inbox: Vec<Option<Push>>,
    /// Async: pushes in arrival order, with their tickets.
    queue: VecDeque<(u64, Push)>,
    next_ticket: u64,
    /// Async: every ticket below this one is answered.
    answered: u64,
}

impl Board {
    fn lock(&self) -> MutexGuard<'_, BoardState> {
        self.st.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn register(self: &Arc<Self>, registry: &mut Registry) {
        let board = self.clone();
        registry.register("ps.pull", move |_, ()| {
            let st = board.lock();
            Ok::<_, String>(board.reply(st))
        });
        let board = self.clone();
        registry.register("ps.push", move |_, push: Push| board.push(push));
    }

    /// The current parameters (copied outside the lock).
    fn reply(&self, st: MutexGuard<'_, BoardState>) -> Params {
        let (params, version, done, start) = (st.params.clone(), st.version, st.done, st.start);
        drop(st);
        Params {
            version,
            done,
            params: Floats(params.to_vec()),
            epoch: start.0,
            offset: start.1 as u64,
        }
    }

    fn push(&self, push: Push) -> Result<Params, String> {
        let mut st = self.lock();
        let w = push.worker as usize;
        if w >= self.workers {
            return Err(format!("worker index {w} out of {} workers", self.workers));
        }
        if let Some(f) = &st.failed {
            return Err(format!("the server failed: {f}"));
        }
        if st.done {
            return Ok(self.reply(st));
        }
        let ready: Box<dyn Fn(&BoardState) -> bool> = match self.mode {
            PsMode::Sync => {
                if push.version != st.version || st.inbox[w].is_some() {
                    return Err(format!(
                        "worker {} pushed a gradient of step {} while the server is at step {}",
                        w + 1,
                        push.version + 1,
                        st.version + 1
                    ));
                }
                let step = push.version;
                st.inbox[w] = Some(push);
                Box::new(move |st: &BoardState| st.version > step)
            }
            PsMode::Async => {
                let ticket = st.next_ticket;
                st.next_ticket += 1;
                st.queue.push_back((ticket, push));
                Box::new(move |st: &BoardState| st.answered > ticket)
            }
        };
        self.cv.notify_all();
        let deadline = Instant::now() + self.wait_limit;
        while !(ready(&st) || st.done || st.failed.is_some()) {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(format!(
                    "no update from the server within {:?}",
                    self.wait_limit
                ));
            }
            st = self
                .cv
                .wait_timeout(st, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        if let Some(f) = &st.failed {
            return Err(format!("the server failed: {f}"));
        }
        Ok(self.reply(st))
    }
}

/// The server: the model, the optimizer, and the board its handlers fill.
struct Server<'c> {
    cfg: &'c TrainConfig,
    data: Arc<dyn Dataset>,
    model: GPT,
    opt: AdamW,
    schedule: LrSchedule,
    guard: StepGuard,
    /// A world of one for the guard's checks (the workers' results are
    /// already gathered here); it opens no socket.
    alone: ProcessGroup,
    board: Arc<Board>,
    /// The checkpoint this run continues, if any.
    resumed: Option<Resumed>,
}

/// Figures of one log window on the server.
#[derive(Default)]
struct Window {
    steps: u64,
    updates: u64,
    loss: f32,
    tokens: f64,
    staleness_sum: u64,
    staleness_max: u64,
    dropped: u64,
    phases: Phases,
}

impl<'c> Server<'c> {
    fn new(
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
    fn serve(
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

    fn run(
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
    fn wait<T>(
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
    fn publish(&self, version: u64) {
        let params = Arc::new(self.model.params().to_vec());
        let mut st = self.board.lock();
        st.params = params;
        st.version = version;
        st.done = version >= self.cfg.steps;
        self.board.cv.notify_all();
    }

    /// Async: the push `ticket` is dealt with (applied or dropped).
    fn answer(&self, ticket: u64) {
        self.board.lock().answered = ticket + 1;
        self.board.cv.notify_all();
    }
}

/// A worker: pull the parameters, compute a step's gradient on this
/// worker's shard, push it, repeat with the parameters of the answer.
fn work(
    cfg: &TrainConfig,
    rpc: &Rpc,
    data: Arc<dyn Dataset>,
    worker: usize,
    workers: usize,
) -> Result<Outcome, TrainError> {
    // The server's parameters replace these at every step.
    let mut model = GPT::zeroed(model_config(cfg, data.vocab_size()), cfg.seed)?;
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
        let mut loss_sum = 0f32;
        let mut tokens = 0u64;
        for micro in 0..cfg.grad_accum {
            let batch = phases.time(Phase::Data, || batches.next_batch());
            tokens += batch.attention_mask.iter().filter(|&&m| m == 1).count() as u64;
            model.set_training(true);
            // DDP's rank r is worker r here: the same dropout masks.
            model.set_dropout_key(
                cfg.seed,
                worker as u64,
                step * cfg.grad_accum as u64 + micro as u64,
            );
            let loss = phases.time(Phase::Forward, || {
                model.forward(
                    &batch.input_ids,
                    padding_mask(&batch),
                    Some(&batch.labels),
                    batch.batch,
                    batch.seq,
                )
            })?;
            loss_sum += loss.unwrap_or(0.0);
            phases.time(Phase::Backward, || model.backward(|_, _| {}))?;
        }
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

/// Flags of `cohort bench ps`.
#[derive(Debug, Clone, clap::Args)]
pub struct BenchPsArgs {
    /// Benchmark config: A (vocab 65, seq 64, 4x128, batch 12 per worker) or B (seq 256,
    /// 6x384, batch 8 per worker).
    #[arg(long, default_value = "A")]
    pub config: String,
    /// Measured steps (default: 30 on A, 5 on B).
    #[arg(long)]
    pub steps: Option<u64>,
    /// Unmeasured steps first.
    #[arg(long, default_value_t = 3)]
    pub warmup: u64,
    /// sync (one update per step from every worker) or async (one per push).
    #[arg(long, value_enum, default_value = "sync")]
    pub mode: PsMode,
    /// Print one JSON object instead of a text line.
    #[arg(long)]
    pub json: bool,
}

/// What `cohort bench ps` measured (the server's view).
#[derive(Debug, Clone, Serialize)]
pub struct BenchPsResult {
    /// Always `ps`.
    pub bench: &'static str,
    /// `A` or `B`.
    pub config: String,
    /// Processes: the server and the workers.
    pub world: usize,
    /// Workers computing gradients.
    pub workers: usize,
    /// `sync` or `async`.
    pub mode: &'static str,
    /// Wall time per update, ms (sync: one step of every worker).
    pub ms_per_update: f64,
    /// Tokens per second the workers trained on.
    pub tokens_per_s: f64,
    /// Parameters of the model.
    pub params: usize,
    /// Sequences per worker per step.
    pub batch_per_worker: usize,
    /// Tokens per sequence.
    pub seq: usize,
    /// Measured updates.
    pub steps: u64,
}

/// `cohort bench ps`: parameter-server training of benchmark config A or B
/// on random tokens (the training loop itself, AdamW and clipping
/// included), under `cohort run -n K`; rank 0 writes the result to `out`.
pub fn run_ps_bench(args: &BenchPsArgs, out: &mut dyn Write) -> Result<(), TrainError> {
    let (g, b, default_steps) = match args.config.as_str() {
        "A" | "a" => (cohort_gpt::GPTConfig::config_a(), 12, 30),
        "B" | "b" => (cohort_gpt::GPTConfig::config_b(), 8, 5),
        other => {
            return Err(ConfigError::Invalid {
                key: "config",
                value: other.to_string(),
                why: "must be A or B",
            }
            .into())
        }
    };
    let steps = args.steps.unwrap_or(default_steps).max(1);
    let cfg = TrainConfig {
        data: "random".into(),
        vocab_size: g.vocab_size,
        seq_len: g.max_position_embeddings,
        n_layers: g.n_layers,
        n_heads: g.n_heads,
        d_model: g.d_model,
        d_ff: g.d_ff,
        batch_size: b,
        steps: args.warmup + steps,
        log_interval: args.warmup + steps,
        eval_interval: 0,
        eval_batches: 0,
        ps_mode: args.mode,
        ..TrainConfig::default()
    };
    let (rank, world) = (env_usize("RANK")?, env_usize("WORLD_SIZE")?);
    let outcome = run_role(
        &cfg,
        Rendezvous::Env,
        rank,
        world,
        &mut std::io::sink(),
        args.warmup,
    )?;
    if rank != 0 {
        return Ok(());
    }
    let workers = world - 1;
    let tokens_per_update = match args.mode {
        PsMode::Sync => (workers * b * cfg.seq_len) as f64,
        PsMode::Async => (b * cfg.seq_len) as f64,
    };
    let result = BenchPsResult {
        bench: "ps",
        config: args.config.to_uppercase(),
        world,
        workers,
        mode: match args.mode {
            PsMode::Sync => "sync",
            PsMode::Async => "async",
        },
        ms_per_update: tokens_per_update / outcome.tokens_per_s.max(1e-9) * 1e3,
        tokens_per_s: outcome.tokens_per_s,
        params: outcome.params.len(),
        batch_per_worker: b,
        seq: cfg.seq_len,
        steps,
    };
    let line = if args.json {
        serde_json::to_string(&result).unwrap_or_default()
    } else {
        format!(
            "config {}, {} worker(s) + server, {} mode: ms_per_update {:.2}, tokens_per_s {:.0}",
            result.config, workers, result.mode, result.ms_per_update, result.tokens_per_s
        )
    };
    writeln!(out, "{line}").map_err(TrainError::Log)
}
