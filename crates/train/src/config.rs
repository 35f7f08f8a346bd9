//! Training configuration: defaults, an optional TOML file, then command-line
//! flags, each layer overriding the one before (`--config run.toml --lr 3e-4`).
//!
//! [`TrainConfig`] is the resolved configuration (also what a checkpoint
//! records); [`TrainArgs`] is its command-line form, where every field is
//! optional so that only the flags actually given override the file. The two
//! are merged through their serde forms, key by key, so a new setting is one
//! field in each struct and nothing else. This module never starts training.

use crate::device::DeviceChoice;
use crate::error::ConfigError;
use crate::grad_guard::NanInjection;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

mod choices;
pub use choices::*;

/// `bucket_cap_mb` of `cohort train` and `cohort bench ddp`: one bucket per
/// transformer block for the small models (measured on config A, 2 ranks:
/// the exposed communication wait falls from 2-6 ms per step with 25 MB to
/// 0.2-0.8 ms).
pub const TUNED_BUCKET_CAP_MB: f64 = 0.5;

/// The resolved settings of a training run (keys of the TOML file).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TrainConfig {
    /// `markov` (the embedded corpus with a known loss floor), `random`
    /// (uniform random tokens, for throughput), or a path: UTF-8
    /// text, `.jsonl`, a `.bin` token file, nanoGPT's train.bin/val.bin directory.
    pub data: String,
    /// For `data` files: `char`, `bpe` (trained on the data, `vocab_size` ids)
    /// or the path of a tokenizer.json or of a model directory holding one (whose chat template
    /// renders JSONL conversations).
    pub tokenizer: String,
    /// Tokens in the Markov chain's alphabet (the model's vocabulary).
    pub markov_vocab: usize,
    /// How many previous tokens decide the next one in the Markov chain.
    pub markov_order: usize,
    /// Possible successors per context in the Markov chain.
    pub markov_branching: usize,
    /// Vocabulary of `--data random`.
    pub vocab_size: usize,
    /// Training sequences in the data set (one epoch).
    pub train_sequences: usize,
    /// Held-out sequences for the validation loss.
    pub val_sequences: usize,
    /// Tokens per sequence (the model's context length).
    pub seq_len: usize,
    /// Transformer blocks.
    pub n_layers: usize,
    /// Attention heads per block.
    pub n_heads: usize,
    /// Width of the residual stream.
    pub d_model: usize,
    /// Hidden width of the MLP.
    pub d_ff: usize,
    /// Dropout probability (0 disables it).
    pub dropout: f32,
    /// Sequences per micro-batch on each rank.
    pub batch_size: usize,
    /// Micro-batches accumulated per optimizer step on each rank.
    pub grad_accum: usize,
    /// Optimizer steps to run (in total, counting resumed ones).
    pub steps: u64,
    /// Peak learning rate.
    pub lr: f64,
    /// Learning rate at the end of the cosine decay.
    pub min_lr: f64,
    /// Steps of linear warmup.
    pub warmup_steps: u64,
    /// Step at which the cosine reaches `min_lr` (0: at `steps`).
    pub lr_decay_steps: u64,
    /// AdamW decoupled weight decay (biases, LayerNorms and embeddings exempt).
    pub weight_decay: f64,
    /// AdamW beta1.
    pub beta1: f64,
    /// AdamW beta2.
    pub beta2: f64,
    /// Clamp every gradient element into [-clip_value, clip_value] before
    /// the norm clipping (0: no clamp); values are clipped first, then the norm.
    pub clip_value: f32,
    /// Clip the global norm of the averaged gradient to this, after
    /// `clip_value` (0: no clipping). Also accepted as `clip_norm`.
    #[serde(alias = "clip_norm")]
    pub grad_clip: f32,
    /// Stop the run after this many updates in a row skipped for a NaN or
    /// infinite loss or gradient (0: never stop).
    pub max_consecutive_skips: u64,
    /// Seed of the model init, data and dropout.
    pub seed: u64,
    /// Print a log line every this many steps.
    pub log_interval: u64,
    /// Compute the validation loss every this many steps (0: only at the end).
    pub eval_interval: u64,
    /// Validation batches of `batch_size` sequences for each validation loss: the same ones
    /// whatever the world size or strategy, shared out among the ranks.
    pub eval_batches: usize,
    /// Write a checkpoint every this many steps (0: only at the end); needs `out`.
    pub save_interval: u64,
    /// Directory for checkpoints (none: do not save).
    pub out: Option<PathBuf>,
    /// Checkpoint directory to continue from.
    pub resume: Option<PathBuf>,
    /// A pretrained model to start a new run from (step 0, a fresh optimizer): a Hugging Face
    /// GPT-2 directory (config.json, model.safetensors, optional tokenizer.json) or a cohort
    /// checkpoint. Its config.json gives the model's shape; its tokenizer.json, the run's
    /// tokenizer unless one is named.
    pub init_from: Option<PathBuf>,
    /// Where rank 0 writes TensorBoard event files and `metrics.jsonl`
    /// (none: `out/logs` when `out` is set, else no files).
    pub log_dir: Option<PathBuf>,
    /// Newest checkpoints kept in `out`; older `step-*` ones are deleted
    /// after each save (0: keep all).
    pub keep_checkpoints: usize,
    /// Periodic checkpoints that may fail in a row before the run stops
    /// (0: never stop for them). A failed final checkpoint always stops it.
    pub max_failed_saves: u32,
    /// Whether a save writes on the training thread or on a writer thread
    /// from a copy of the state (see [`SaveMode`]).
    pub save_mode: SaveMode,
    /// Test hook, never read from a file or a flag: NaN written into the
    /// averaged gradient at these steps (`COHORT_INJECT_NAN`, see
    /// [`NanInjection`]).
    #[serde(skip)]
    pub inject_nan: Option<NanInjection>,
    /// DDP bucket size in MB. The default, 0.5, is tuned for small models:
    /// after the first step buckets follow backward's ready ranges, so a
    /// cap below one block gives one bucket per block, each all-reduced
    /// while backward computes the blocks below (PyTorch's 25 MB would put
    /// all but the top blocks of config A in one bucket reduced after
    /// backward).
    pub bucket_cap_mb: f64,
    /// Whether DDP all-reduces buckets while backward runs, and ZeRO-2/3
    /// overlap their gathers and reduce-scatters (see [`Overlap`]).
    pub overlap: Overlap,
    /// Send gradients in bf16 (PyTorch's bf16_compress_hook): `true`,
    /// `false`, or unset: bf16 where the ranks span nodes and the measured
    /// link would make a step's fp32 gradients the bottleneck (see
    /// `strategy::data_parallel::link`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bf16_compress: Option<bool>,
    /// What the model's matrix products compute in.
    pub precision: Precision,
    /// Where the model computes: `cpu`, `cuda` (under `cohort run`, the local rank modulo the
    /// visible GPUs) or `cuda:N`.
    pub device: DeviceChoice,
    /// Keep only each block's input in forward and recompute the block inside backward.
    pub activation_checkpointing: bool,
    /// Loader threads reading batches ahead of the training loop (0: read
    /// on the training thread).
    pub loader_workers: usize,
    /// Batches the loader threads prepare ahead.
    pub prefetch: usize,
    /// Documents (JSONL): samples per rank sorted by length together before
    /// being cut into token-budget batches (the sort buffer).
    pub sort_size: usize,
    /// Documents (JSONL, chat): pack each batch's samples into rows of
    /// `seq_len` positions, each attending only to itself (segment ids),
    /// instead of one padded row each.
    pub pack: bool,
    /// How the ranks share the work: data parallel (`ddp`), a parameter
    /// server on rank 0 (`parameter-server`), pipeline stages (`pipeline`)
    /// or data parallel with sharded optimizer state (`zero1`: ZeRO stage
    /// 1, PyTorch's `ZeroRedundancyOptimizer`), sharded gradients too
    /// (`zero2`) or sharded parameters too (`zero3`, FSDP by block).
    pub strategy: Strategy,
    /// Parameter server: `sync` (one update per step from every worker's
    /// gradient, as DDP) or `async` (one update per pushed gradient).
    pub ps_mode: PsMode,
    /// Parameter server, async mode: the most updates a pushed gradient's
    /// parameters may lag the server's; staler gradients are dropped.
    pub max_staleness: u64,
    /// Where the collectives run, by the name of a backend registered with
    /// cohort-comm: cohort's own (`cohort`, the ranks started by `cohort
    /// run`) or one the program registered, such as `mpi` (the ranks
    /// started by mpirun or srun, rank and world from MPI).
    pub backend: String,
    /// Pipeline: stages the blocks are split into, on consecutive ranks (0:
    /// one per rank); the ranks must be a multiple (stages x replicas).
    pub stages: usize,
    /// Pipeline: micro-batches of `batch_size` sequences per step.
    pub micro_batches: usize,
    /// Pipeline: `gpipe` (all forwards, then all backwards) or `1f1b`.
    pub pipeline_schedule: PipelineSchedule,
    /// DiLoCo and local SGD: inner steps between two outer syncs (H).
    pub sync_every: u64,
    /// DiLoCo: the outer optimizer's learning rate (local SGD: 1).
    pub outer_lr: f64,
    /// DiLoCo: the outer optimizer's momentum (local SGD: 0).
    pub outer_momentum: f64,
    /// DiLoCo: Nesterov momentum in the outer optimizer (the paper's), else heavy ball.
    pub outer_nesterov: bool,
    /// DiLoCo and local SGD: what the averaged pseudo-gradients travel in.
    pub pseudo_grad_dtype: Precision,
    /// DiLoCo and local SGD: run the outer all-reduce during the next inner
    /// steps and take the outer step `outer_overlap_steps` steps late.
    pub outer_overlap: bool,
    /// DiLoCo and local SGD, overlapped: the inner steps the outer
    /// all-reduce has before its step is taken (τ; `sync_every` or more:
    /// one round late).
    pub outer_overlap_steps: u64,
}

impl Default for TrainConfig {
    /// A small model (benchmark config A's shape) that learns the embedded
    /// Markov corpus (order 1: 64 contexts of 4 successors each) to within
    /// ~0.02 of its floor in 300 steps, well under a minute on two cores.
    fn default() -> Self {
        Self {
            data: "markov".into(),
            tokenizer: "char".into(),
            markov_vocab: 64,
            markov_order: 1,
            markov_branching: 4,
            vocab_size: 65,
            train_sequences: 20_000,
            val_sequences: 512,
            seq_len: 64,
            n_layers: 4,
            n_heads: 4,
            d_model: 128,
            d_ff: 512,
            dropout: 0.0,
            batch_size: 12,
            grad_accum: 1,
            steps: 300,
            lr: 2e-3,
            min_lr: 2e-4,
            warmup_steps: 20,
            lr_decay_steps: 0,
            weight_decay: 0.1,
            beta1: 0.9,
            beta2: 0.99,
            clip_value: 0.0,
            grad_clip: 1.0,
            max_consecutive_skips: 10,
            seed: 1337,
            log_interval: 10,
            eval_interval: 100,
            eval_batches: 4,
            save_interval: 0,
            out: None,
            resume: None,
            init_from: None,
            log_dir: None,
            keep_checkpoints: 3,
            max_failed_saves: 3,
            save_mode: SaveMode::Background,
            inject_nan: None,
            bucket_cap_mb: TUNED_BUCKET_CAP_MB,
            overlap: Overlap::Auto,
            bf16_compress: None,
            precision: Precision::Fp32,
            device: DeviceChoice::Cpu,
            activation_checkpointing: false,
            loader_workers: 1,
            prefetch: 4,
            sort_size: 1024,
            pack: false,
            strategy: Strategy::Ddp,
            ps_mode: PsMode::Sync,
            max_staleness: 4,
            backend: "cohort".into(),
            stages: 0,
            micro_batches: 4,
            pipeline_schedule: PipelineSchedule::OneFOneB,
            sync_every: 50,
            outer_lr: 0.7,
            outer_momentum: 0.9,
            outer_nesterov: true,
            pseudo_grad_dtype: Precision::Fp32,
            outer_overlap: false,
            outer_overlap_steps: 5,
        }
    }
}

/// `cohort train`'s flags: every setting of [`TrainConfig`], optional.
#[derive(Debug, Clone, Default, Serialize, clap::Args)]
pub struct TrainArgs {
    /// TOML file with settings (keys as in TrainConfig: seq_len, lr, ...); flags override it.
    #[arg(long, value_name = "FILE")]
    #[serde(skip)]
    pub config: Option<PathBuf>,
    /// Training data: `markov` (default; embedded corpus with a known loss floor), `random`
    /// (uniform random tokens, like the ToyRandomDataset of PyTorch's DDP examples), or a PATH: UTF-8 text, `.jsonl`
    /// (a "text" field per line), a `.bin` token file or nanoGPT's train.bin/val.bin directory.
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub data: Option<String>,
    /// With --data PATH: `char`, `bpe`, a tokenizer.json or a model directory (its chat
    /// template renders `{"messages": [...]}` lines) [default: char].
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tokenizer: Option<String>,
    /// Alphabet size of the Markov corpus [default: 64].
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub markov_vocab: Option<usize>,
    /// Order of the Markov chain [default: 1; 2 needs attention to the previous token and
    /// learns more slowly].
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub markov_order: Option<usize>,
    /// Successors per context of the Markov chain [default: 4].
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub markov_branching: Option<usize>,
    /// Vocabulary of `--data random` [default: 65].
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub vocab_size: Option<usize>,
    /// Training sequences per epoch [default: 20000].
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub train_sequences: Option<usize>,
    /// Held-out sequences [default: 512].
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub val_sequences: Option<usize>,
    /// Tokens per sequence [default: 64].
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub seq_len: Option<usize>,
    /// Transformer blocks [default: 4].
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub n_layers: Option<usize>,
    /// Attention heads [default: 4].
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub n_heads: Option<usize>,
    /// Model width [default: 128].
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub d_model: Option<usize>,
    /// MLP width [default: 512].
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub d_ff: Option<usize>,
    /// Dropout probability [default: 0].
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dropout: Option<f32>,
    /// Sequences per micro-batch ON EACH RANK [default: 12].
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub batch_size: Option<usize>,
    /// Micro-batches accumulated per step on each rank [default: 1].
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub grad_accum: Option<usize>,
    /// Optimizer steps [default: 300].
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub steps: Option<u64>,
    /// Peak learning rate [default: 2e-3].
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub lr: Option<f64>,
    /// Final learning rate of the cosine (unless set: a tenth of --lr, so 2e-4 by default).
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub min_lr: Option<f64>,
    /// Linear warmup steps [default: 20].
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub warmup_steps: Option<u64>,
    /// Step where the cosine ends [default: 0; 0 means at --steps].
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub lr_decay_steps: Option<u64>,
    /// AdamW weight decay [default: 0.1].
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub weight_decay: Option<f64>,
    /// AdamW beta1 [default: 0.9].
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub beta1: Option<f64>,
    /// AdamW beta2 [default: 0.99].
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub beta2: Option<f64>,
    /// Clamp each gradient element to [-V, V] before the norm clipping [default: 0; 0 = off].
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub clip_value: Option<f32>,
    /// Clip the global norm of the averaged gradient, after --clip-value [default: 1.0;
    /// 0 = off].
    #[arg(long, alias = "clip-norm")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub grad_clip: Option<f32>,
    /// Stop after N updates in a row skipped for a NaN/Inf loss or gradient [default: 10;
    /// 0 = never].
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_consecutive_skips: Option<u64>,
    /// Seed of init, data and dropout [default: 1337].
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub seed: Option<u64>,
    /// Log every N steps [default: 10].
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub log_interval: Option<u64>,
    /// Validation loss every N steps [default: 100; 0 = only at the end].
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub eval_interval: Option<u64>,
    /// Validation batches of --batch-size sequences, the same whatever the number of ranks,
    /// shared out among them [default: 4].
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub eval_batches: Option<usize>,
    /// Checkpoint every N steps [default: 0; 0 means only at the end]; needs --out.
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub save_interval: Option<u64>,
    /// Checkpoint directory, written by rank 0 (none by default: no checkpoints; with
    /// --resume, the run directory it resumes from).
    #[arg(long, value_name = "DIR")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub out: Option<PathBuf>,
    /// Continue from the checkpoint in DIR, bitwise as if never stopped; given a --out
    /// directory, from its latest checkpoint, or the newest one before it that is intact.
    /// Checkpoints and logs go on in that directory unless --out names another.
    #[arg(long, value_name = "DIR")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub resume: Option<PathBuf>,
    /// Start a new run (step 0, a fresh optimizer) from the model in DIR: a Hugging Face GPT-2
    /// directory (config.json, model.safetensors [, tokenizer.json]) or a checkpoint. The
    /// model's shape comes from its config.json (a shape flag that differs is an error); its
    /// tokenizer.json is the run's tokenizer unless --tokenizer names one.
    #[arg(long, value_name = "DIR")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub init_from: Option<PathBuf>,
    /// TensorBoard event files and metrics.jsonl go to DIR, written by rank 0 (by default
    /// OUT/logs with --out, else none); `cohort plot DIR` draws the loss curves.
    #[arg(long, value_name = "DIR")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub log_dir: Option<PathBuf>,
    /// Checkpoints kept in --out, the oldest deleted after each save [default: 3; 0 = all].
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub keep_checkpoints: Option<usize>,
    /// Periodic checkpoints that may fail in a row (a full disk) before the run stops with an
    /// error naming the last good one [default: 3; 0 = never]; a failed final one always stops it.
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_failed_saves: Option<u32>,
    /// Write periodic checkpoints from a copy of the state on a writer thread while training
    /// goes on (background), or on the training thread (sync) [default: background]. The
    /// final checkpoint and a signal's are always complete before the run exits.
    #[arg(long, value_enum)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub save_mode: Option<SaveMode>,
    /// DDP gradient bucket size in MB; PyTorch's default is 25 [default: 0.5].
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bucket_cap_mb: Option<f64>,
    /// DDP reduces gradient buckets during backward (on), after it (off), or on only when a
    /// core is free for the communication thread (auto) [default: auto]. ZeRO-2/3 follow the
    /// same rule: prefetch the next block's all-gather and leave reduce-scatters running.
    #[arg(long, value_enum)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub overlap: Option<Overlap>,
    /// Send gradients in bf16 (PyTorch's bf16_compress_hook): DDP's all-reduce, ZeRO's
    /// reduce-scatter. Not given: bf16 only where the ranks span nodes and a timed all-reduce
    /// at the start says a step's fp32 gradients would take over 50 ms on the link.
    #[arg(long, num_args = 0..=1, default_missing_value = "true")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bf16_compress: Option<bool>,
    /// Matrix products in fp32, or in bf16 with f32 sums and fp32 master weights and optimizer
    /// state (PyTorch's CPU autocast) [default: fp32].
    #[arg(long, value_enum)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub precision: Option<Precision>,
    /// Where the model computes: cpu, cuda (under `cohort run`: the local rank modulo the
    /// visible GPUs, CUDA_VISIBLE_DEVICES honoured) or cuda:N [default: cpu].
    #[arg(long, value_name = "cpu|cuda|cuda:N")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub device: Option<DeviceChoice>,
    /// Keep only each block's input in forward and recompute the block inside backward (less
    /// activation memory for one more forward's compute).
    #[arg(long, num_args = 0..=1, default_missing_value = "true")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub activation_checkpointing: Option<bool>,
    /// Loader threads reading batches ahead (0: on the training thread) [default: 1].
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub loader_workers: Option<usize>,
    /// Batches the loader prepares ahead [default: 4].
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prefetch: Option<usize>,
    /// JSONL documents: samples sorted by length per token-budget sort buffer [default: 1024].
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sort_size: Option<usize>,
    /// JSONL documents: pack short samples (conversations) into rows of --seq-len positions,
    /// attention, positions and loss kept inside each (off: one padded row per sample).
    #[arg(long, num_args = 0..=1, default_missing_value = "true")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pack: Option<bool>,
    /// How ranks share the work: ddp, parameter-server (rank 0 serves), pipeline, zero1
    /// (DDP with the optimizer state sharded, ZeRO stage 1), zero2 (gradients sharded too) or
    /// zero3 (parameters sharded too, gathered per block: FSDP), diloco (local AdamW steps,
    /// an outer Nesterov step every --sync-every) or local-sgd (the same, averaging only)
    /// [default: ddp].
    #[arg(long, value_enum)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub strategy: Option<Strategy>,
    /// Parameter server: sync (as DDP) or async [default: sync].
    #[arg(long, value_enum)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ps_mode: Option<PsMode>,
    /// Parameter server, async: drop gradients more than N updates stale [default: 4].
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_staleness: Option<u64>,
    /// Collectives: cohort (ranks from `cohort run`) or mpi (ranks from mpirun or srun; a build
    /// with the `mpi` feature) [default: cohort].
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub backend: Option<String>,
    /// Pipeline: stages, on consecutive ranks [default: 0; 0 = one per rank].
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stages: Option<usize>,
    /// Pipeline: micro-batches of --batch-size sequences per step [default: 4].
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub micro_batches: Option<usize>,
    /// Pipeline schedule: gpipe or 1f1b [default: 1f1b].
    #[arg(long, value_enum)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pipeline_schedule: Option<PipelineSchedule>,
    /// DiLoCo, local SGD: inner steps between outer syncs, H [default: 50].
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sync_every: Option<u64>,
    /// DiLoCo: outer learning rate [default: 0.7].
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub outer_lr: Option<f64>,
    /// DiLoCo: outer momentum [default: 0.9].
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub outer_momentum: Option<f64>,
    /// DiLoCo: Nesterov outer momentum, on unless given false (heavy ball).
    #[arg(long, num_args = 0..=1, default_missing_value = "true")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub outer_nesterov: Option<bool>,
    /// DiLoCo, local SGD: pseudo-gradients averaged in fp32 or bf16 [default: fp32].
    #[arg(long, value_enum)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pseudo_grad_dtype: Option<Precision>,
    /// DiLoCo, local SGD: all-reduce the pseudo-gradients while the next H inner steps run
    /// and take the outer step one round late (docs/guides/slow-links.md).
    #[arg(long, num_args = 0..=1, default_missing_value = "true")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub outer_overlap: Option<bool>,
    /// DiLoCo, local SGD, overlapped: inner steps the outer all-reduce has before its outer
    /// step is taken; --sync-every or more: one round late [default: 5].
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub outer_overlap_steps: Option<u64>,
}

impl TrainArgs {
    /// Defaults, overridden by the `--config` file, overridden by the flags given.
    pub fn resolve(&self) -> Result<TrainConfig, ConfigError> {
        let mut table = match &self.config {
            Some(path) => read_table(path)?,
            None => toml::Table::new(),
        };
        let flags = toml::Table::try_from(self).map_err(|e| ConfigError::Parse {
            path: PathBuf::from("<command line>"),
            message: e.to_string(),
        })?;
        table.extend(flags);
        // nanoGPT's rule (the cosine ends at a tenth of the peak), so that `--lr 1e-5` alone
        // is a run and not an error about a floor above the peak; the defaults are this rule.
        if !table.contains_key("min_lr") {
            if let Some(lr) = table.get("lr").and_then(toml::Value::as_float) {
                table.insert("min_lr".into(), (lr / 10.0).into());
            }
        }
        if let Some(dir) = &self.init_from {
            shape_from_pretrained(&mut table, dir)?;
        }
        let path = self
            .config
            .clone()
            .unwrap_or_else(|| PathBuf::from("<command line>"));
        let cfg: TrainConfig =
            table
                .try_into()
                .map_err(|e: toml::de::Error| ConfigError::Parse {
                    path,
                    message: e.to_string(),
                })?;
        let mut cfg = cfg;
        cfg.out_to_resumed_run();
        cfg.validate()?;
        Ok(cfg)
    }
}

/// Puts the shape of the model in `dir` (its config.json) into `table`, where a file or flag
/// that set a different value is an error naming both; and its tokenizer.json as the run's
/// tokenizer unless one is named. `seq_len` may be shorter than the model's positions (and is
/// all of them unless set).
fn shape_from_pretrained(table: &mut toml::Table, dir: &Path) -> Result<(), ConfigError> {
    let bad = |why: String| ConfigError::Pretrained {
        path: dir.to_path_buf(),
        why,
    };
    let resolved = cohort_gpt::checkpoint::resolve(dir).map_err(|e| bad(e.to_string()))?;
    let model = cohort_gpt::checkpoint::load_config(&resolved).map_err(|e| bad(e.to_string()))?;
    let shape = [
        ("n_layers", "n_layer", model.n_layers),
        ("n_heads", "n_head", model.n_heads),
        ("d_model", "n_embd", model.d_model),
        ("d_ff", "n_inner", model.d_ff),
    ];
    for (key, hf_key, theirs) in shape {
        match table.get(key).and_then(toml::Value::as_integer) {
            Some(ours) if ours != theirs as i64 => {
                return Err(bad(format!(
                    "its config.json has {hf_key} = {theirs}, the run sets {key} = {ours}; \
                     drop --{} to take the model's",
                    key.replace('_', "-")
                )))
            }
            _ => {
                table.insert(key.into(), (theirs as i64).into());
            }
        }
    }
    let positions = model.max_position_embeddings as i64;
    match table.get("seq_len").and_then(toml::Value::as_integer) {
        Some(seq) if seq > positions => {
            return Err(bad(format!(
                "its config.json has n_positions = {positions}, shorter than the run's \
                 seq_len = {seq}"
            )))
        }
        Some(_) => {}
        None => {
            table.insert("seq_len".into(), positions.into());
        }
    }
    let tokenizer = resolved.join(cohort_tokenizer::TOKENIZER_FILE);
    if !table.contains_key("tokenizer") && tokenizer.is_file() {
        table.insert(
            "tokenizer".into(),
            tokenizer.to_string_lossy().into_owned().into(),
        );
    }
    Ok(())
}

fn read_table(path: &Path) -> Result<toml::Table, ConfigError> {
    let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
        path: path.to_path_buf(),
        source,
    })?;
    let mut table: toml::Table = text
        .parse()
        .map_err(|e: toml::de::Error| ConfigError::Parse {
            path: path.to_path_buf(),
            message: e.to_string(),
        })?;
    // The other name, so that a flag (--grad-clip) still overrides it.
    if let Some(v) = table.remove("clip_norm") {
        table.entry("grad_clip").or_insert(v);
    }
    inputs_relative_to(&mut table, path.parent().unwrap_or(Path::new("")));
    Ok(table)
}

/// The keys of a config file that name files the run reads, with the words that are not paths.
const INPUT_PATHS: [(&str, &[&str]); 4] = [
    ("data", &["markov", "random"]),
    ("tokenizer", &["char", "bpe"]),
    ("init_from", &[]),
    ("resume", &[]),
];

/// Makes the relative input paths of a config file relative to the file, so that
/// `cohort train --config configs/x.toml` finds `data = "../text.txt"` from any directory, as
/// Cargo and Compose read their files. Outputs (`out`, `log_dir`) stay relative to where the run
/// starts: a shared config should not fill the directory it lives in with runs.
fn inputs_relative_to(table: &mut toml::Table, dir: &Path) {
    for (key, words) in INPUT_PATHS {
        let Some(toml::Value::String(value)) = table.get_mut(key) else {
            continue;
        };
        if !words.contains(&value.as_str()) && Path::new(value.as_str()).is_relative() {
            *value = dir.join(&*value).to_string_lossy().into_owned();
        }
    }
}

impl TrainConfig {
    /// Where the run log goes: `log_dir`, else `out/logs`, else nowhere.
    pub fn log_dir(&self) -> Option<PathBuf> {
        self.log_dir
            .clone()
            .or_else(|| self.out.as_ref().map(|o| o.join("logs")))
    }

    /// Checks the settings that the model, optimizer and data do not check
    /// themselves.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let bad = |key, value: String, why| Err(ConfigError::Invalid { key, value, why });
        if !matches!(self.data.as_str(), "markov" | "random")
            && !std::path::Path::new(&self.data).exists()
        {
            return bad(
                "data",
                self.data.clone(),
                "must be `markov`, `random` or an existing file or directory",
            );
        }
        if self.batch_size == 0 {
            return bad("batch_size", "0".into(), "must be at least 1");
        }
        if self.init_from.is_some() && self.strategy == Strategy::Pipeline {
            return bad(
                "init_from",
                self.init_from
                    .as_ref()
                    .map_or(String::new(), |p| p.display().to_string()),
                "is not supported with --strategy pipeline yet (use ddp, zero1, zero2, zero3 \
                 or parameter-server)",
            );
        }
        if self.pack && self.strategy == Strategy::Pipeline {
            return bad(
                "pack",
                "true".into(),
                "is not supported with --strategy pipeline yet (use ddp, zero1, zero2, zero3 \
                 or parameter-server)",
            );
        }
        if self.activation_checkpointing && self.strategy == Strategy::Pipeline {
            return bad(
                "activation_checkpointing",
                "true".into(),
                "is not supported with --strategy pipeline yet (use ddp or parameter-server)",
            );
        }
        if self.stages > 0 && matches!(self.strategy, Strategy::Zero2 | Strategy::Zero3) {
            return bad(
                "stages",
                self.stages.to_string(),
                "is a pipeline setting: --strategy zero2 and zero3 shard one data-parallel \
                 model and do not combine with pipeline stages",
            );
        }
        if self.sync_every == 0 {
            return bad("sync_every", "0".into(), "must be at least 1");
        }
        if self.outer_overlap_steps == 0 {
            return bad("outer_overlap_steps", "0".into(), "must be at least 1");
        }
        if !(self.outer_lr > 0.0 && self.outer_lr.is_finite()) {
            return bad(
                "outer_lr",
                self.outer_lr.to_string(),
                "must be finite and > 0",
            );
        }
        if !(0.0..1.0).contains(&self.outer_momentum) {
            let why = "must be in [0, 1)";
            return bad("outer_momentum", self.outer_momentum.to_string(), why);
        }
        if self.grad_accum == 0 {
            return bad("grad_accum", "0".into(), "must be at least 1");
        }
        if self.sort_size == 0 {
            return bad("sort_size", "0".into(), "must be at least 1");
        }
        if self.micro_batches == 0 {
            return bad("micro_batches", "0".into(), "must be at least 1");
        }
        if self.log_interval == 0 {
            return bad("log_interval", "0".into(), "must be at least 1");
        }
        for (key, value) in [("lr", self.lr), ("min_lr", self.min_lr)] {
            if !(value.is_finite() && value >= 0.0) {
                return bad(key, value.to_string(), "must be finite and >= 0");
            }
        }
        if self.save_interval > 0 && self.out.is_none() {
            return bad(
                "save_interval",
                self.save_interval.to_string(),
                "needs --out (the directory the checkpoints go to)",
            );
        }
        if !(self.bucket_cap_mb >= 0.0 && self.bucket_cap_mb.is_finite()) {
            return bad(
                "bucket_cap_mb",
                self.bucket_cap_mb.to_string(),
                "must be finite and >= 0",
            );
        }
        for (key, value) in [
            ("clip_value", self.clip_value),
            ("grad_clip", self.grad_clip),
        ] {
            if !(value >= 0.0 && value.is_finite()) {
                return bad(key, value.to_string(), "must be finite and >= 0");
            }
        }
        if !(0.0..1.0).contains(&self.dropout) {
            return bad("dropout", self.dropout.to_string(), "must be in [0, 1)");
        }
        self.validate_device()
    }

    /// What a model in a device's memory cannot do yet: only DDP and ZeRO-1 (host-staged)
    /// step it, and its gradient guard has no clamp kernel.
    fn validate_device(&self) -> Result<(), ConfigError> {
        if self.backend == "nccl" && !matches!(self.device, DeviceChoice::Cuda(_)) {
            return Err(ConfigError::Invalid {
                key: "backend",
                value: self.backend.clone(),
                why: "NCCL moves GPU memory: use --backend nccl with --device cuda (the host's \
                      collectives are --backend cohort)",
            });
        }
        if !self.device.is_device() {
            return Ok(());
        }
        let refuse = |why: &str| {
            Err(ConfigError::Device {
                device: self.device.to_string(),
                why: why.to_string(),
            })
        };
        if !matches!(self.strategy, Strategy::Ddp | Strategy::Zero1) {
            return refuse(&format!(
                "--strategy {} is not on a device yet: ddp and zero1 train a model in a \
                 device's memory (its gradients staged through the host)",
                self.strategy.name()
            ));
        }
        if self.clip_value > 0.0 {
            return refuse("clip_value is not on a device yet (grad_clip, by norm, is)");
        }
        Ok(())
    }

    /// Without `out`, a resume goes on writing checkpoints and logs where its run wrote (the
    /// output directory `resume` lies in), as a Hugging Face Trainer resumed in its
    /// output_dir does; `elastic::prepare_resume` says so.
    pub fn out_to_resumed_run(&mut self) {
        if self.out.is_none() {
            self.out = (self.resume.as_deref()).and_then(crate::checkpoint::output_root);
        }
    }

    /// The step at which the cosine decay reaches `min_lr`.
    pub fn decay_steps(&self) -> u64 {
        if self.lr_decay_steps == 0 {
            self.steps.max(self.warmup_steps)
        } else {
            self.lr_decay_steps
        }
    }

    /// How gradients travel between ranks as `--bf16-compress` asks, for
    /// DDP's all-reduce and ZeRO's reduce-scatter alike; `None` when it was
    /// not given (the run decides by the link).
    pub fn compression(&self) -> Option<cohort_ddp::Compression> {
        self.bf16_compress.map(|bf16| match bf16 {
            true => cohort_ddp::Compression::Bf16,
            false => cohort_ddp::Compression::None,
        })
    }

    /// The optimizer settings of the run (AdamW's other defaults are PyTorch's).
    pub fn adamw(&self) -> cohort_engine::optim::AdamWConfig {
        cohort_engine::optim::AdamWConfig {
            beta1: self.beta1,
            beta2: self.beta2,
            weight_decay: self.weight_decay,
            ..Default::default()
        }
    }
}

#[cfg(test)]
mod tests;
