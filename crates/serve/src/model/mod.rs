//! One loaded model version: its model read once by its backend, `count` instances (threads,
//! each owning a backend instance: a copy of the parameters and its own thread pool) serving
//! one [`Queue`], the text codec for generation, and its metrics; or, for an ensemble, its
//! steps (which run through their own models' queues). An instance joins a batch's inputs
//! along the batch dimension, executes once and hands each request its rows of the outputs it
//! asked for, whatever the backend. Submitting never blocks; dropping the last handle
//! closes the queue, and the instances finish every queued request before they exit, so a
//! version swapped out while serving loses nothing in flight. A request whose caller stopped
//! waiting (client gone, deadline passed) is not executed, and a generation whose token
//! receiver is gone stops after the current decode step.
//!
//! Generation (by a backend whose instances have a decoder: cohort's GPT) is batched in flight
//! (continuous batching) unless the config's
//! `inflight_batching` parameter is "false": an instance steps every generation it holds (up
//! to `max_batch_size`) together, one token each per step, with one matrix product per layer
//! over all of them; a new request joins between two steps and a finished or cancelled one
//! leaves at once, so a long generation never holds a short one back. Each keeps its own KV
//! cache and sampler, so it produces exactly the tokens it would alone (a prompt that starts
//! as one in flight did copies those keys and values; `max_prefill_tokens` bounds the prompt
//! tokens a step feeds). With the parameter "false", a generation holds its instance until it
//! ends. Either way the KV caches keep keys
//! and values in the `kv_cache_dtype` parameter's format (f32 unless it is "bf16").
//!
//! Its children: `ensemble` (a version that runs other models' versions as steps) and
//! `config_check` (reading a config checked by the backend that will serve it). An ensemble's
//! steps find their models through [`Models`], which the repository implements, so this
//! module never imports the repository that holds its versions. This module never parses a
//! request off the wire.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Instant, SystemTime};

use cohort_gpt::checkpoint::{self, MODEL_FILE};
use cohort_gpt::sample::{
    decode_step, generate_while_in, DecodeWeights, Generation as Decoding, KvDtype, SampleOptions,
    Workspace,
};
use cohort_gpt::GPT;
use tokio::sync::{mpsc, oneshot};

mod config_check;
pub(crate) mod ensemble;

use crate::backend::profile::OpProfile;
use crate::backend::{self, Backend, Instance};
use crate::batcher::{BatchPolicy, Dynamic, GenerateJob, InferJob, Job, Queue, Refused, Work};
use crate::config::{Kind, ModelConfig};
use crate::error::{ErrorKind, ServeError};
use crate::metrics::{ComputeTimes, Failure, VersionMetrics};
use crate::tensor::{InferResult, Request, Tensor, TensorSpec};
use crate::text::TextCodec;
use ensemble::Ensemble;

/// Where the versions being served are found by name: what an ensemble's steps resolve their
/// models in when a request runs. The repository is the one there is; a trait so that a
/// version, which may be an ensemble, does not import the repository that holds it.
pub(crate) trait Models: Send + Sync {
    /// The version that serves a request for `model` (`version` empty or None: the newest).
    fn resolve(&self, model: &str, version: Option<&str>)
        -> Result<Arc<LoadedVersion>, ServeError>;
}

/// What identifies the files a version was loaded from: the resolved directory and the
/// modification times of its model files. A change means "reload".
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Stamp {
    pub dir: PathBuf,
    pub mtimes: Vec<Option<SystemTime>>,
}

impl Stamp {
    /// The stamp of version directory `version_dir` of a model served by `kind`: a GPT
    /// checkpoint (or checkpoint root), `model.onnx`, or nothing for an ensemble.
    pub fn of(version_dir: &Path, kind: Kind) -> Option<Stamp> {
        let mtime = |dir: &Path, f: &str| {
            std::fs::metadata(dir.join(f))
                .and_then(|m| m.modified())
                .ok()
        };
        match kind {
            Kind::Gpt => {
                let dir = checkpoint::resolve(version_dir).ok()?;
                let mtimes = vec![
                    mtime(&dir, checkpoint::CONFIG_FILE),
                    mtime(&dir, MODEL_FILE),
                ];
                Some(Stamp { dir, mtimes })
            }
            Kind::Onnx => Some(Stamp {
                dir: version_dir.to_path_buf(),
                mtimes: vec![mtime(version_dir, backend::onnx::MODEL_FILE)],
            }),
            Kind::Ensemble => Some(Stamp {
                dir: version_dir.to_path_buf(),
                mtimes: Vec::new(),
            }),
            Kind::Tokenizer => Some(Stamp {
                dir: version_dir.to_path_buf(),
                mtimes: vec![
                    mtime(version_dir, cohort_tokenizer::TOKENIZER_FILE),
                    mtime(version_dir, cohort_tokenizer::char_vocab::VOCAB_FILE),
                ],
            }),
        }
    }
}

/// A queued generation: each token as it is produced, then all of them (or why it failed).
pub(crate) type Generation = (
    mpsc::UnboundedReceiver<u32>,
    oneshot::Receiver<Result<Vec<u32>, ServeError>>,
);

/// Server-wide settings a version is built with.
#[derive(Debug, Clone, Copy)]
pub(crate) struct BuildOptions {
    /// Queue bound when the config has none.
    pub default_queue_size: usize,
    /// Engine threads per instance; None: the cores this process may use / instances.
    pub instance_threads: Option<usize>,
}

/// How a version executes requests.
enum Serving {
    /// Instances of a backend take requests from one queue.
    Instances {
        backend: Box<dyn Backend>,
        queue: Arc<Queue>,
    },
    /// Each request runs the ensemble's steps through the models they name.
    Ensemble(Ensemble),
}

/// A loaded, serving model version.
pub(crate) struct LoadedVersion {
    pub model: String,
    pub version: u64,
    pub kind: Kind,
    pub stamp: Stamp,
    pub text: Result<TextCodec, String>,
    /// The chat template of `/v1/chat/completions`, or why there is none.
    pub chat: Result<Arc<cohort_tokenizer::ChatTemplate>, String>,
    /// The ids a generation stops at unless asked not to: generation_config.json's eos ids and
    /// the chat template's end of turn. The id stopped at is the last one generated; the front
    /// ends leave it out of the text.
    pub eos: Arc<[u32]>,
    pub metrics: Arc<VersionMetrics>,
    pub instances: usize,
    /// The configuration it was loaded with.
    pub config: Arc<ModelConfig>,
    serving: Serving,
}

impl Drop for LoadedVersion {
    fn drop(&mut self) {
        // the instances drain what is queued and exit; nobody waits for them here (this may
        // run on an async worker)
        if let Serving::Instances { queue, .. } = &self.serving {
            queue.close();
        }
    }
}

impl LoadedVersion {
    /// Loads `version_dir` with the backend its config names and starts its instances.
    pub fn load(
        model: &str,
        version: u64,
        version_dir: &Path,
        cfg: &Arc<ModelConfig>,
        opts: BuildOptions,
        metrics: Arc<VersionMetrics>,
    ) -> Result<LoadedVersion, ServeError> {
        let what = backend::Version { model, version };
        let kind = cfg.kind().map_err(|e| what.error(e))?;
        let stamp = Stamp::of(version_dir, kind).unwrap_or(Stamp {
            dir: version_dir.to_path_buf(),
            mtimes: Vec::new(),
        });
        if kind == Kind::Ensemble {
            let ensemble = Ensemble::new(cfg).map_err(|e| what.error(e))?;
            return Ok(LoadedVersion {
                model: model.to_string(),
                version,
                kind,
                stamp,
                text: Err("an ensemble does not generate text".into()),
                chat: Err("an ensemble does not generate text".into()),
                eos: Arc::from(Vec::new()),
                metrics,
                instances: 0,
                config: cfg.clone(),
                serving: Serving::Ensemble(ensemble),
            });
        }
        let count = cfg.instance_count();
        let threads = opts.instance_threads.unwrap_or_else(|| {
            let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
            (cores / count).max(1)
        });
        let loaded = backend::load(kind, &what, version_dir, cfg, count, threads)?;
        let policy = BatchPolicy {
            max_batch_size: cfg.max_batch_size,
            dynamic: cfg.dynamic_batching.as_ref().map(|d| Dynamic {
                preferred: d.preferred_batch_size.clone(),
                max_delay: cfg.max_queue_delay(),
            }),
        };
        let capacity = cfg.max_queue_size().unwrap_or(opts.default_queue_size);
        let queue = Arc::new(Queue::new(policy, capacity));
        let (inflight, max_inflight) = (cfg.inflight_batching(), cfg.max_batch_size.max(1));
        let (kv_dtype, prefill_tokens) = (cfg.kv_cache_dtype(), cfg.max_prefill_tokens());
        // One copy for every instance: they serve the same checkpoint.
        let decode_weights = cfg.decode_weights().decode_format().and_then(|format| {
            let gpt = loaded.instances.first()?.decoder()?;
            let copy = DecodeWeights::new(gpt, format);
            tracing::info!(model, version, weights = %cfg.decode_weights(), bytes = copy.bytes(), "decode weights copied");
            Some(Arc::new(copy))
        });
        let outputs: Arc<Vec<String>> = Arc::new(
            loaded
                .backend
                .outputs()
                .iter()
                .map(|s| s.name.clone())
                .collect(),
        );
        for (i, instance) in loaded.instances.into_iter().enumerate() {
            let (q, m, name, outputs, weights) = (
                queue.clone(),
                metrics.clone(),
                model.to_string(),
                outputs.clone(),
                decode_weights.clone(),
            );
            std::thread::Builder::new()
                .name(format!("serve-{model}-{version}-{i}"))
                .spawn(move || {
                    let ctx = InstanceCtx {
                        queue: &q,
                        metrics: &m,
                        model: &name,
                        version,
                        inflight,
                        max_inflight,
                        kv_dtype,
                        prefill_tokens,
                        decode_weights: weights,
                        outputs: &outputs,
                    };
                    run_instance(instance, &ctx)
                })
                .map_err(|e| ServeError::Instance {
                    model: model.to_string(),
                    reason: format!("spawning instance {i}: {e}"),
                })?;
        }
        let (text, chat) = (loaded.backend.text(), loaded.backend.chat_template());
        let mut eos = loaded.backend.eos_ids();
        let end_of_turn = (chat.as_ref().ok())
            .and_then(|t| t.special_token("eos_token"))
            .zip(text.as_ref().ok())
            .and_then(|(t, codec)| codec.encode(t).ok())
            .filter(|ids| ids.len() == 1);
        if let Some(id) = end_of_turn.map(|ids| ids[0]) {
            if !eos.contains(&id) {
                eos.push(id);
            }
        }
        Ok(LoadedVersion {
            model: model.to_string(),
            version,
            kind,
            stamp,
            text,
            chat,
            eos: Arc::from(eos),
            metrics,
            instances: count,
            config: cfg.clone(),
            serving: Serving::Instances {
                backend: loaded.backend,
                queue,
            },
        })
    }

    /// The model's inputs, batch dimension first.
    pub fn inputs(&self) -> &[TensorSpec] {
        match &self.serving {
            Serving::Instances { backend, .. } => backend.inputs(),
            Serving::Ensemble(e) => &e.inputs,
        }
    }

    /// The model's outputs, batch dimension first.
    pub fn outputs(&self) -> &[TensorSpec] {
        match &self.serving {
            Serving::Instances { backend, .. } => backend.outputs(),
            Serving::Ensemble(e) => &e.outputs,
        }
    }

    /// What executes the model (see [`Backend::describe`]); empty for an ensemble.
    pub fn describe(&self) -> String {
        match &self.serving {
            Serving::Instances { backend, .. } => backend.describe(),
            Serving::Ensemble(_) => String::new(),
        }
    }

    /// The time in each operator type of `runs` executions of one batch of `inputs` (the
    /// model's inputs in its order, batch dimension first) on a private copy of the model; see
    /// [`Backend::profile`].
    pub fn profile(&self, inputs: &[Tensor], runs: usize) -> Result<OpProfile, ServeError> {
        let what = backend::Version {
            model: &self.model,
            version: self.version,
        };
        let Serving::Instances { backend, .. } = &self.serving else {
            return Err(what.error("an ensemble has no operators of its own to time".into()));
        };
        let specs = backend.inputs();
        if inputs.len() != specs.len() {
            return Err(what.error(format!(
                "profile: {} input(s) given, the model takes {}",
                inputs.len(),
                specs.len()
            )));
        }
        for (t, spec) in inputs.iter().zip(specs) {
            let fits = t.datatype == spec.datatype
                && t.shape.len() == spec.shape.len()
                && t.shape
                    .iter()
                    .zip(&spec.shape)
                    .all(|(&g, &m)| m < 0 || g as i64 == m)
                && t.datatype
                    .size()
                    .map(|s| s * t.shape.iter().product::<usize>())
                    == Some(t.data.len());
            if !fits {
                return Err(what.error(format!(
                    "profile: input {:?} is {} {:?} in {} bytes; the model's is {} {:?}",
                    spec.name,
                    t.datatype,
                    t.shape,
                    t.data.len(),
                    spec.datatype,
                    spec.shape
                )));
            }
        }
        backend
            .profile(inputs, runs.max(1))
            .map_err(|e| what.error(format!("profile: {e}")))
    }

    /// Checks a request's values as the backend requires (see [`Backend::check`]).
    pub fn check(&self, request: &Request) -> Result<(), ServeError> {
        match &self.serving {
            Serving::Instances { backend, .. } => backend.check(request),
            Serving::Ensemble(_) => Ok(()),
        }
    }

    fn queue(&self) -> Result<&Queue, ServeError> {
        match &self.serving {
            Serving::Instances { queue, .. } => Ok(queue),
            Serving::Ensemble(_) => Err(ServeError::Text {
                model: self.model.clone(),
                reason: "an ensemble does not generate text".into(),
            }),
        }
    }

    fn refused(&self, why: Refused, capacity: usize) -> ServeError {
        self.metrics.unqueued();
        self.metrics.failure(Failure::Rejected, Default::default());
        match why {
            Refused::Full => ServeError::QueueFull {
                model: self.model.clone(),
                version: self.version,
                capacity,
            },
            Refused::Closed => ServeError::ShuttingDown {
                model: self.model.clone(),
                version: self.version,
            },
        }
    }

    /// Runs a checked request and waits for the outputs `want` (indices into
    /// [`LoadedVersion::outputs`], in the order the answer lists them): queued for an
    /// instance, or through an ensemble's steps (which resolve their models in `repo`).
    pub async fn infer(
        &self,
        repo: &dyn Models,
        input: Request,
        want: Vec<usize>,
    ) -> Result<InferResult, ServeError> {
        self.infer_via(repo, input, want, &[]).await
    }

    /// [`LoadedVersion::infer`] as a step of the ensembles `via` (outermost first), which an
    /// ensemble's steps must not lead back to.
    pub async fn infer_via(
        &self,
        repo: &dyn Models,
        input: Request,
        want: Vec<usize>,
        via: &[&str],
    ) -> Result<InferResult, ServeError> {
        let start = Instant::now();
        let out = match &self.serving {
            Serving::Ensemble(e) => {
                let rows = input.batch;
                let me = (self.model.as_str(), self.version);
                let out = e.run(repo, input, &want, me, via).await;
                if out.is_ok() {
                    let phases = ComputeTimes {
                        infer: start.elapsed(),
                        ..ComputeTimes::default()
                    };
                    self.metrics.executed(rows, 1, phases);
                }
                out
            }
            Serving::Instances { queue, .. } => {
                let (reply, mut rx) = oneshot::channel();
                let job = Job::Infer(InferJob {
                    input,
                    want,
                    reply,
                    enqueued: start,
                });
                self.metrics.enqueued();
                queue
                    .push(job)
                    .map_err(|(_, why)| self.refused(why, queue.capacity()))?;
                match queue.spin_for_reply(&mut rx) {
                    Some(out) => out,
                    None => rx.await.unwrap_or_else(|_| Err(self.lost())),
                }
            }
        };
        self.account(&out, start);
        out
    }

    /// Queues a generation; tokens arrive on the returned receiver as they are produced, and
    /// the oneshot resolves with all of them (or the error) at the end. With `stop_at_eos` it
    /// ends after the first of [`LoadedVersion::eos`] (which is the last token sent).
    pub fn generate(
        &self,
        prompt: Vec<u32>,
        opts: SampleOptions,
        stop_at_eos: bool,
    ) -> Result<Generation, ServeError> {
        let queue = self.queue()?;
        let (tokens, token_rx) = mpsc::unbounded_channel();
        let (done, done_rx) = oneshot::channel();
        let job = Job::Generate(GenerateJob {
            prompt,
            opts,
            stop: if stop_at_eos {
                self.eos.clone()
            } else {
                Arc::from(Vec::new())
            },
            tokens,
            done,
            enqueued: Instant::now(),
        });
        self.metrics.enqueued();
        queue
            .push(job)
            .map_err(|(_, why)| self.refused(why, queue.capacity()))?;
        Ok((token_rx, done_rx))
    }

    /// The error a request gets when its instance died before answering.
    pub fn lost(&self) -> ServeError {
        ServeError::Execution {
            model: self.model.clone(),
            version: self.version,
            reason: "the instance stopped before answering".into(),
        }
    }

    /// Records a request refused as invalid after it reached this version; returns the error.
    pub fn reject(&self, e: ServeError, start: Instant) -> ServeError {
        self.metrics.failure(Failure::Invalid, start.elapsed());
        e
    }

    /// Records a finished request.
    pub fn account<T>(&self, out: &Result<T, ServeError>, start: Instant) {
        match out {
            Ok(_) => self.metrics.success(start.elapsed()),
            Err(ServeError::Execution { .. }) => {
                self.metrics.failure(Failure::Backend, start.elapsed())
            }
            Err(e @ ServeError::Step { .. }) if e.kind() == ErrorKind::Internal => {
                self.metrics.failure(Failure::Backend, start.elapsed())
            }
            Err(_) => self.metrics.failure(Failure::Invalid, start.elapsed()),
        }
    }
}

/// What an instance needs to know besides its model and queue.
struct InstanceCtx<'a> {
    queue: &'a Queue,
    metrics: &'a VersionMetrics,
    model: &'a str,
    version: u64,
    /// Concurrent generations share decode steps; false: each runs alone to its end.
    inflight: bool,
    /// Most generations in flight on this instance.
    max_inflight: usize,
    /// The number format of each generation's KV cache (the `kv_cache_dtype` parameter).
    kv_dtype: KvDtype,
    /// The prompt tokens a decode step feeds (the `max_prefill_tokens` parameter), if set.
    prefill_tokens: Option<usize>,
    /// The copy of the matrices decode steps read (the `decode_weights` parameter), if any.
    decode_weights: Option<Arc<DecodeWeights>>,
    /// The model's output names, in order.
    outputs: &'a [String],
}

impl InstanceCtx<'_> {
    fn exec_err(&self, reason: String) -> ServeError {
        ServeError::Execution {
            model: self.model.to_string(),
            version: self.version,
            reason,
        }
    }
}

/// A generation in flight on an instance: its request and its decoding state.
struct Active {
    job: GenerateJob,
    generation: Decoding,
    /// When it left the queue.
    started: Instant,
    /// Tokens already sent to the client.
    sent: usize,
}

impl AsMut<Decoding> for Active {
    fn as_mut(&mut self) -> &mut Decoding {
        &mut self.generation
    }
}

impl AsRef<Decoding> for Active {
    fn as_ref(&self) -> &Decoding {
        &self.generation
    }
}

/// An instance: executes work from the queue until it is closed and drained. With in-flight
/// batching, generations run as one continuous batch: between two decode steps, queued
/// generations join, ready inference batches run, and generations that finished or whose
/// client left are answered and dropped; each step advances every generation in flight by one
/// token (feeding a newcomer's prompt in the same forward) with one batched product per layer.
fn run_instance(mut instance: Box<dyn Instance>, ctx: &InstanceCtx<'_>) {
    let mut ws = instance.decoder().map(|gpt| workspace(gpt, ctx));
    let mut active: Vec<Active> = Vec::new();
    loop {
        // with generations in flight, never wait for work: the next step is due now
        let work = if active.is_empty() {
            match ctx.queue.next() {
                Some(w) => Some(w),
                None => break,
            }
        } else {
            ctx.queue.try_next()
        };
        match work {
            Some(Work::Infer(jobs)) => run_infer(instance.as_mut(), jobs, ctx),
            Some(Work::Generate(job)) => match instance.decoder() {
                Some(gpt) if ctx.inflight => admit(gpt, job, &mut active, ctx),
                Some(gpt) => match ws.as_mut() {
                    Some(ws) => run_alone(gpt, ws, job, ctx),
                    None => refuse_generate(job, ctx),
                },
                None => refuse_generate(job, ctx),
            },
            None => {}
        }
        let (Some(gpt), Some(ws)) = (instance.decoder(), ws.as_mut()) else {
            continue;
        };
        if !ctx.inflight {
            continue;
        }
        let room = ctx.max_inflight.saturating_sub(active.len());
        for job in ctx.queue.take_generates(room) {
            admit(gpt, job, &mut active, ctx);
        }
        if active.is_empty() {
            continue;
        }
        let ran = catch_unwind(AssertUnwindSafe(|| decode_step(gpt, &mut active, ws)));
        ctx.metrics.decode_step(active.len());
        // a step is shared: if it failed, every generation in it fails alike
        let failed: Option<&dyn Fn() -> ServeError> = match &ran {
            Ok(Ok(())) => None,
            Ok(Err(source)) => Some(&|| ServeError::Generate {
                model: ctx.model.to_string(),
                source: source.clone(),
            }),
            Err(_) => Some(&|| ctx.exec_err("generation panicked".into())),
        };
        if let Some(err) = failed {
            for a in active.drain(..) {
                if a.job.done.send(Err(err())).is_err() {
                    ctx.metrics
                        .failure(Failure::Cancelled, a.job.enqueued.elapsed());
                }
            }
            continue;
        }
        // hand out the new tokens (a prompt that waited for room has none yet), retire the
        // finished
        let mut i = 0;
        while i < active.len() {
            if emit_new(&mut active[i]) {
                i += 1;
            } else {
                finish(active.swap_remove(i), ctx);
            }
        }
    }
    tracing::debug!(model = ctx.model, version = ctx.version, "instance stopped");
}

/// Sends `a`'s tokens not yet sent; false when it is done (finished, or nobody is listening
/// any more, in which case it stops here).
fn emit_new(a: &mut Active) -> bool {
    let tokens = a.generation.tokens();
    let (mut listening, mut ended) = (true, false);
    for &id in &tokens[a.sent.min(tokens.len())..] {
        listening &= a.job.tokens.send(id).is_ok();
        ended |= a.job.stop.contains(&id);
    }
    a.sent = tokens.len();
    listening && !ended && !a.job.done.is_closed() && !a.generation.is_finished()
}

/// Takes a generation off the queue: counts its queue time and returns when it started, or
/// counts it cancelled (None) when its client has already gone.
fn dequeue(job: &GenerateJob, ctx: &InstanceCtx<'_>) -> Option<Instant> {
    let started = Instant::now();
    ctx.metrics.dequeued(started - job.enqueued);
    if job.tokens.is_closed() || job.done.is_closed() {
        ctx.metrics
            .failure(Failure::Cancelled, job.enqueued.elapsed());
        return None;
    }
    Some(started)
}

/// Counts a finished generation of `n` tokens that started at `started`.
fn count_generated(ctx: &InstanceCtx<'_>, started: Instant, n: usize) {
    ctx.metrics.executed(
        1,
        1,
        ComputeTimes {
            infer: started.elapsed(),
            ..ComputeTimes::default()
        },
    );
    ctx.metrics.generated(n);
}

/// Checks a queued generation and adds it to those in flight (the next step feeds its
/// prompt), or answers it at once: its client left, its request was bad, or it asked for no
/// tokens.
fn admit(gpt: &GPT, job: GenerateJob, active: &mut Vec<Active>, ctx: &InstanceCtx<'_>) {
    let Some(started) = dequeue(&job, ctx) else {
        return;
    };
    match Decoding::with_kv_dtype(gpt, &job.prompt, &job.opts, ctx.kv_dtype) {
        Ok(generation) => {
            let a = Active {
                job,
                generation,
                started,
                sent: 0,
            };
            if a.generation.is_finished() {
                finish(a, ctx);
            } else {
                active.push(a);
            }
        }
        Err(source) => {
            let err = ServeError::Generate {
                model: ctx.model.to_string(),
                source,
            };
            if job.done.send(Err(err)).is_err() {
                ctx.metrics
                    .failure(Failure::Cancelled, job.enqueued.elapsed());
            }
        }
    }
}

/// Answers a generation that left the batch with every token it produced.
fn finish(a: Active, ctx: &InstanceCtx<'_>) {
    let ids = a.generation.into_tokens();
    count_generated(ctx, a.started, ids.len());
    if a.job.done.send(Ok(ids)).is_err() {
        ctx.metrics
            .failure(Failure::Cancelled, a.job.enqueued.elapsed());
    }
}

/// One generation alone on the instance, start to end (in-flight batching off).
fn run_alone(gpt: &GPT, ws: &mut Workspace, job: GenerateJob, ctx: &InstanceCtx<'_>) {
    let Some(started) = dequeue(&job, ctx) else {
        return;
    };
    let (tokens, done) = (&job.tokens, &job.done);
    let ran = catch_unwind(AssertUnwindSafe(|| {
        generate_while_in(ws, gpt, &job.prompt, &job.opts, ctx.kv_dtype, |id| {
            // nobody is listening any more, or the end of text: stop after this step
            if tokens.send(id).is_err() || done.is_closed() || job.stop.contains(&id) {
                std::ops::ControlFlow::Break(())
            } else {
                std::ops::ControlFlow::Continue(())
            }
        })
    }));
    let out = match ran {
        Ok(Ok(ids)) => {
            count_generated(ctx, started, ids.len());
            Ok(ids)
        }
        Ok(Err(source)) => Err(ServeError::Generate {
            model: ctx.model.to_string(),
            source,
        }),
        Err(_) => Err(ctx.exec_err("generation panicked".into())),
    };
    if job.done.send(out).is_err() {
        ctx.metrics
            .failure(Failure::Cancelled, job.enqueued.elapsed());
    }
}

/// An instance's decode workspace, reading the model's copy of its matrices when it has one,
/// with the config's prefill budget when it sets one.
fn workspace(gpt: &GPT, ctx: &InstanceCtx<'_>) -> Workspace {
    let mut ws = match ctx.decode_weights.clone() {
        // The copy was made from this checkpoint, so its config is this instance's.
        Some(copy) => Workspace::with_weights(gpt, copy).unwrap_or_else(|e| {
            tracing::warn!(model = ctx.model, "decode weights not used: {e}");
            Workspace::new(gpt)
        }),
        None => Workspace::new(gpt),
    };
    if let Some(tokens) = ctx.prefill_tokens {
        ws.set_prefill_tokens(tokens);
    }
    ws
}

/// Answers a generation request on a model that does not generate (the front ends refuse
/// those before queueing; this keeps the instance sound if one gets through).
fn refuse_generate(job: GenerateJob, ctx: &InstanceCtx<'_>) {
    ctx.metrics.dequeued(job.enqueued.elapsed());
    let err = ServeError::Text {
        model: ctx.model.to_string(),
        reason: "this model does not generate text".into(),
    };
    if job.done.send(Err(err)).is_err() {
        ctx.metrics
            .failure(Failure::Cancelled, job.enqueued.elapsed());
    }
}

/// One batch of inference requests: their inputs joined along the batch dimension, one
/// execution, each request's rows of the outputs it asked for.
fn run_infer(instance: &mut dyn Instance, mut jobs: Vec<InferJob>, ctx: &InstanceCtx<'_>) {
    let (metrics, model, version) = (ctx.metrics, ctx.model, ctx.version);
    let exec_err = |reason: String| ctx.exec_err(reason);
    let started = Instant::now();
    for j in &jobs {
        metrics.dequeued(started - j.enqueued);
    }
    // a caller that stopped waiting (client gone, deadline passed) gets nothing:
    // running its rows would only delay the others
    jobs.retain(|j| {
        let gone = j.reply.is_closed();
        if gone {
            metrics.failure(Failure::Cancelled, j.enqueued.elapsed());
        }
        !gone
    });
    if jobs.is_empty() {
        return;
    }
    let rows: usize = jobs.iter().map(|j| j.input.batch).sum();
    let inputs: Vec<Tensor> = if jobs.len() == 1 {
        std::mem::take(&mut jobs[0].input.inputs)
    } else {
        (0..jobs[0].input.inputs.len())
            .map(|i| {
                let parts: Vec<&Tensor> = jobs.iter().map(|j| &j.input.inputs[i]).collect();
                Tensor::concat(&parts)
            })
            .collect()
    };
    let mut want = vec![false; ctx.outputs.len()];
    for j in &jobs {
        for &o in &j.want {
            want[o] = true;
        }
    }
    let gathered = Instant::now();
    // a panicking kernel must not take the instance (and every later request) down
    let ran = catch_unwind(AssertUnwindSafe(|| instance.execute(&inputs, &want)));
    let inferred = Instant::now();
    let outputs = match ran {
        Ok(Ok(o)) => Ok(o),
        Ok(Err(e)) => Err(e),
        Err(_) => Err("the execution panicked".to_string()),
    };
    let mut row = 0;
    let mut replies = Vec::with_capacity(jobs.len());
    let single = jobs.len() == 1;
    for j in jobs {
        let mine = row..row + j.input.batch;
        row += j.input.batch;
        let out = match &outputs {
            Ok(tensors) => j
                .want
                .iter()
                .map(|&o| match &tensors[o] {
                    Some(t) if single => Ok((ctx.outputs[o].clone(), t.clone())),
                    Some(t) => Ok((ctx.outputs[o].clone(), t.rows(mine.clone()))),
                    None => Err(exec_err(format!(
                        "the backend did not compute output {:?}",
                        ctx.outputs[o]
                    ))),
                })
                .collect::<Result<InferResult, ServeError>>(),
            Err(e) => Err(exec_err(e.clone())),
        };
        replies.push((j.reply, j.enqueued, out));
    }
    let phases = ComputeTimes {
        input: gathered - started,
        infer: inferred - gathered,
        output: inferred.elapsed(),
    };
    metrics.executed(rows, replies.len(), phases);
    tracing::debug!(
        model,
        version,
        rows,
        requests = replies.len(),
        compute_us = phases.infer.as_micros() as u64,
        "executed batch"
    );
    for (reply, enqueued, out) in replies {
        if reply.send(out).is_err() {
            metrics.failure(Failure::Cancelled, enqueued.elapsed());
        }
    }
    ctx.queue.answered_after(started.elapsed());
}
