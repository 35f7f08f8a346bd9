//! What every strategy that holds a whole model replica shares: the model a
//! config asks for ([`model_config`], [`new_model`], rank 0's parameters
//! shared with [`share_rank0_params`]), its precision and activation
//! checkpointing, the memory check before anything is allocated, the
//! header lines, and resuming and saving a replica (whole, DDP's format) or
//! a rank's shard (the ZeRO stages' sharded format).
//!
//! It is the bottom of the strategies: data parallel, pipeline and
//! parameter server use it, and it uses none of them nor the loop. It never
//! runs a step and never decides when to save.

use std::path::Path;
use std::sync::Arc;

use cohort_comm::{ProcessGroup, ReduceOp};
use cohort_data::Dataset;
use cohort_ddp::ParamSpec;
use cohort_engine::optim::AdamW;
use cohort_gpt::{GPTConfig, GptError, GPT};

use crate::checkpoint::{self, SaveReport, TrainState};
use crate::config::{Precision, TrainConfig};
use crate::error::TrainError;
use crate::input::{self, TrainBatches};
use crate::memory::{memory_per_rank, Sharding};

/// The model a config asks for, over `vocab_size` tokens: the shape flags', or with
/// `init_from` the shape in that directory's config.json (the flags were checked against it
/// when the config was resolved), whose vocabulary must then be the run's.
pub fn model_config(cfg: &TrainConfig, vocab_size: usize) -> Result<GPTConfig, TrainError> {
    let Some(dir) = &cfg.init_from else {
        return Ok(GPTConfig {
            vocab_size,
            max_position_embeddings: cfg.seq_len,
            n_layers: cfg.n_layers,
            n_heads: cfg.n_heads,
            d_model: cfg.d_model,
            d_ff: cfg.d_ff,
            dropout: cfg.dropout,
            ..GPTConfig::default()
        });
    };
    let dir = cohort_gpt::checkpoint::resolve(dir)?;
    let stored = cohort_gpt::checkpoint::load_config(&dir)?;
    if stored.vocab_size != vocab_size {
        return Err(TrainError::InitFrom {
            path: dir,
            reason: format!(
                "its model embeds {} token ids but the run's data has {vocab_size} \
                 (a tokenizer.json beside the model is the run's tokenizer; add tokens with \
                 `cohort tokenizer add-tokens --model`)",
                stored.vocab_size
            ),
        });
    }
    if cfg.seq_len > stored.max_position_embeddings {
        return Err(TrainError::InitFrom {
            path: dir,
            reason: format!(
                "seq_len {} is longer than its max_position_embeddings {}",
                cfg.seq_len, stored.max_position_embeddings
            ),
        });
    }
    // Dropout is how this run trains, not part of the model's shape.
    Ok(GPTConfig {
        dropout: cfg.dropout,
        ..stored
    })
}

/// The model of rank 0 (drawn from `cfg.seed`, or loaded from `cfg.init_from` when the run is
/// not resumed) or of another rank (zeros, to be overwritten by rank 0's broadcast); with the
/// header line saying where rank 0's parameters came from.
pub(crate) fn new_model(
    cfg: &TrainConfig,
    model_cfg: GPTConfig,
    rank0: bool,
) -> Result<(GPT, Option<String>), TrainError> {
    if !rank0 {
        return Ok((GPT::zeroed(model_cfg, cfg.seed)?, None));
    }
    let mut model = GPT::new(model_cfg, cfg.seed)?;
    let (Some(dir), None) = (&cfg.init_from, &cfg.resume) else {
        return Ok((model, None));
    };
    let dir = cohort_gpt::checkpoint::resolve(dir)?;
    cohort_gpt::checkpoint::verify(&dir)?;
    cohort_gpt::checkpoint::load_params_into(&dir, &mut model)?;
    let line = format!(
        "initialized from {} (a new run: step 0, a fresh optimizer)",
        dir.display()
    );
    Ok((model, Some(line)))
}

/// Resumes a data-parallel rank's model and whole optimizer state from `cfg.resume`, if set
/// (DDP's checkpoint format, written at any world size), noting it in `header`; returns where
/// the run starts.
pub(crate) fn resume_replica(
    cfg: &TrainConfig,
    pg: &ProcessGroup,
    model: &mut GPT,
    opt: &mut AdamW,
    header: &mut Vec<String>,
) -> Result<TrainState, TrainError> {
    let Some(dir) = &cfg.resume else {
        return Ok(TrainState::default());
    };
    let resumed = checkpoint::resume(dir, cfg, pg, model, opt)?;
    header.extend(resumed.notes);
    header.push(format!(
        "resumed from {} at step {}",
        resumed.dir.display(),
        resumed.state.step
    ));
    Ok(resumed.state)
}

/// Restores a sharded strategy's own shard `target` from `--resume` (any checkpoint: a
/// sharded one is read only where this rank's pieces lie), logging where it resumed. Returns
/// where it continues, or `None` without `--resume`. Collective.
pub(crate) fn resume_shard(
    cfg: &TrainConfig,
    pg: &ProcessGroup,
    target: &mut checkpoint::ShardTarget<'_>,
    header: &mut Vec<String>,
) -> Result<Option<TrainState>, TrainError> {
    let Some(dir) = &cfg.resume else {
        return Ok(None);
    };
    let resumed = checkpoint::resume_into(dir, cfg, pg, pg.size(), target)?;
    header.extend(resumed.notes);
    header.push(format!(
        "resumed from {} at step {}",
        resumed.dir.display(),
        resumed.state.step
    ));
    Ok(Some(resumed.state))
}

/// Rank 0's save of a data-parallel run: the model, the whole optimizer state `opt`, where the
/// batches stand and the tokenizer, in DDP's checkpoint format.
#[allow(clippy::too_many_arguments)]
pub(crate) fn save_replica(
    saver: &mut checkpoint::Saver,
    out: &Path,
    cfg: &TrainConfig,
    pg: &ProcessGroup,
    model: &GPT,
    opt: &AdamW,
    batches: &TrainBatches,
    data: &dyn Dataset,
    step: u64,
) -> SaveReport {
    let (epoch, offset) = batches.position();
    let state = TrainState {
        step,
        epoch,
        offset,
    };
    let tokenizer = data.tokenizer_json();
    saver.save_whole(
        out,
        cfg,
        pg.size(),
        model,
        opt,
        &state,
        tokenizer.as_deref(),
    )
}

/// Every rank's save of a sharded data-parallel run: its own `shard` of the parameters and
/// optimizer state, with where the batches stand and the tokenizer (rank 0's), as a sharded
/// checkpoint. Collective.
#[allow(clippy::too_many_arguments)]
pub(crate) fn save_shard(
    out: &Path,
    cfg: &TrainConfig,
    pg: &ProcessGroup,
    model: &GPT,
    shard: &checkpoint::OwnedShard<'_>,
    batches: &TrainBatches,
    data: &dyn Dataset,
    step: u64,
) -> Result<SaveReport, TrainError> {
    let (epoch, offset) = batches.position();
    let state = TrainState {
        step,
        epoch,
        offset,
    };
    let tokenizer = data.tokenizer_json();
    checkpoint::save_sharded(out, cfg, pg, model, shard, &state, tokenizer.as_deref())
}

/// Puts a model's matrix products in the precision `cfg` asks for (`set` is the model's
/// `set_precision`) and returns [`precision_line`].
pub(crate) fn apply_precision(
    cfg: &TrainConfig,
    set: impl FnOnce(cohort_engine::DType) -> Result<cohort_engine::DType, GptError>,
) -> Result<Option<String>, TrainError> {
    if cfg.precision != Precision::Fp32 {
        set(cfg.precision.dtype())?;
    }
    Ok(precision_line(cfg))
}

/// The line a run's header shows for its precision: what is in effect, and why when the CPU
/// cannot do what was asked. Nothing for fp32, the default.
pub(crate) fn precision_line(cfg: &TrainConfig) -> Option<String> {
    if cfg.precision == Precision::Fp32 {
        return None;
    }
    Some(match cohort_engine::cpu::bf16_kernel_name() {
        Some(kernel) => format!(
            "precision bf16: matrix products on {kernel} with f32 sums; fp32 master weights, \
             optimizer state and other kernels"
        ),
        None => "precision bf16 asked for, but this CPU has neither AMX nor AVX512_BF16: \
                 training in fp32"
            .to_string(),
    })
}

/// Turns on activation checkpointing where `cfg` asks for it and returns the header line that
/// says what it saves: the activation bytes per rank with and without it, for `seq_len`.
pub(crate) fn apply_checkpointing(
    cfg: &TrainConfig,
    model: &mut GPT,
    seq_len: usize,
) -> Option<String> {
    if !cfg.activation_checkpointing {
        return None;
    }
    model.set_activation_checkpointing(true);
    let threads = model.backend().num_threads();
    let tokens = cfg.batch_size * seq_len;
    let dtype = model.backend().dtype();
    let acts = |on| GPT::memory_estimate(model.config(), tokens, threads, on, dtype).activations;
    let (off, on) = (acts(false), acts(true));
    let mb = |b: u64| b as f64 / (1 << 20) as f64;
    Some(format!(
        "activation checkpointing: activations {:.1} MB per rank instead of {:.1} MB (saves \
         {:.1} MB), for one more forward of every block per step",
        mb(on),
        mb(off),
        mb(off.saturating_sub(on))
    ))
}

/// Refuses, before anything is allocated, settings whose training state
/// per rank under `sharding` (see [`memory_per_rank`]) for `cfg.batch_size`
/// sequences of `seq_len` tokens, on each of `ranks_on_host` ranks, exceeds
/// the host's available memory; the error names the settings and the bytes.
/// (Without the check such a run aborts in an allocation.) No check where
/// the host does not say what is available.
pub(crate) fn check_memory(
    cfg: &TrainConfig,
    model: &GPTConfig,
    seq_len: usize,
    ranks_on_host: usize,
    sharding: Sharding,
) -> Result<(), TrainError> {
    let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
    let tokens = cfg.batch_size.checked_mul(seq_len).filter(|&n| n < 1 << 40);
    let Some(tokens) = tokens else {
        return Err(TrainError::TooBig(format!(
            "batch_size {} x seq_len {seq_len} tokens per forward is beyond any memory: lower \
             --batch-size or --seq-len",
            cfg.batch_size
        )));
    };
    let Some(available) = available_memory() else {
        return Ok(());
    };
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let m = memory_per_rank(
        model,
        tokens,
        threads,
        cfg.activation_checkpointing,
        cfg.precision.dtype(),
        sharding,
    );
    let per_rank = m.total();
    let needed = per_rank.saturating_mul(ranks_on_host as u64);
    if needed <= available {
        return Ok(());
    }
    Err(TrainError::TooBig(format!(
        "batch_size {} x seq_len {seq_len} with d_model {}, {} layers, vocab {} needs {:.1} GiB per \
         rank (parameters {:.2}, gradients {:.2}, AdamW state {:.2}, activations {:.2} GiB) x {} \
         rank(s) on this host = {:.1} GiB, but {:.1} GiB is available: lower --batch-size or \
         --seq-len, or the model's size",
        cfg.batch_size,
        model.d_model,
        model.n_layers,
        model.vocab_size,
        gib(per_rank),
        gib(m.parameters),
        gib(m.gradients),
        gib(m.optimizer),
        gib(m.activations),
        ranks_on_host,
        gib(needed),
        gib(available),
    )))
}

/// The header line of [`MemoryPerRank::line`] for `model` as built, training
/// on `cfg.batch_size` sequences of `seq_len` tokens under `sharding`.
pub(crate) fn memory_line(
    cfg: &TrainConfig,
    model: &GPT,
    seq_len: usize,
    sharding: Sharding,
) -> String {
    memory_per_rank(
        model.config(),
        cfg.batch_size * seq_len,
        model.backend().num_threads(),
        cfg.activation_checkpointing,
        model.backend().dtype(),
        sharding,
    )
    .line()
}

/// The host's available memory in bytes (`MemAvailable`), when it says.
fn available_memory() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// The header line that says how big a data-parallel step is, over `world`
/// ranks reading sequences of `seq_len` tokens.
pub(crate) fn global_batch_line(cfg: &TrainConfig, world: usize, seq_len: usize) -> String {
    let b = cfg.batch_size;
    format!(
        "global batch: {} sequences = {} per rank x {} ranks x {} accumulation ({} tokens/step)",
        b * world * cfg.grad_accum,
        b,
        world,
        cfg.grad_accum,
        b * seq_len * cfg.grad_accum * world
    )
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

/// What a replicated strategy starts from on each rank, before it wraps or
/// shards anything: the run's data, the whole model (rank 0's parameters
/// drawn or loaded; the other ranks' zeros until [`share_rank0_params`] or
/// DDP's broadcast), and the header lines so far.
pub(crate) struct ReplicatedStart {
    pub data: Arc<dyn Dataset>,
    pub model: GPT,
    pub header: Vec<String>,
}

/// Builds the data and the model (checked to fit in memory under
/// `sharding`, in the run's precision, with activation checkpointing as
/// asked). Collective only where rank 0 prepares data files first.
pub(crate) fn replicated_start(
    cfg: &TrainConfig,
    pg: &ProcessGroup,
    sharding: Sharding,
) -> Result<ReplicatedStart, TrainError> {
    let data: Arc<dyn Dataset> = input::build(cfg, pg)?.into();
    let t = data.seq_len();
    let mut header = input::data_lines(&*data);
    let model_cfg = model_config(cfg, data.vocab_size())?;
    model_cfg.validate()?;
    if !cfg.device.is_device() {
        // Host memory; a device's is its backend's to refuse.
        check_memory(cfg, &model_cfg, t, pg.local_world_size(), sharding)?;
    }
    // Only rank 0 draws (or loads) the initial parameters; the others
    // receive them.
    let (mut model, init_line) = new_model(cfg, model_cfg, pg.rank() == 0)?;
    header.extend(init_line);
    if cfg.device.is_device() {
        model = to_device(cfg, &model)?;
        header.push(device_line(cfg, &model));
    } else {
        header.extend(apply_precision(cfg, |d| model.set_precision(d))?);
    }
    header.extend(apply_checkpointing(cfg, &mut model, t));
    Ok(ReplicatedStart {
        data,
        model,
        header,
    })
}

/// `model` (drawn or loaded on the host) moved to the device `cfg.device` names, its products
/// in `cfg.precision`: the parameters uploaded once; gradients, activations and AdamW's moments
/// allocated there.
pub(crate) fn to_device(cfg: &TrainConfig, model: &GPT) -> Result<GPT, TrainError> {
    let threads = model.backend().num_threads();
    let dev = crate::device::device_backend(cfg.device, threads, cfg.precision.dtype())?;
    Ok(model.to_backend(dev)?)
}

/// The header line of a run on a device: which, and what its products compute in.
fn device_line(cfg: &TrainConfig, model: &GPT) -> String {
    let dev = model.backend();
    format!(
        "device {} (--device {}): matrix products in {}; parameters, gradients, activations \
         and AdamW state in its memory, copied to the host only for checkpoints and (over \
         several ranks) the gradients' collectives",
        dev.device(),
        cfg.device,
        dev.dtype()
    )
}

/// Makes sure every rank built the same size of model and gives every rank
/// rank 0's parameters (as drawn). Collective.
pub fn share_rank0_params(pg: &ProcessGroup, model: &mut GPT) -> Result<(), TrainError> {
    agree_on_size(pg, model.num_params())?;
    pg.broadcast(model.params_mut(), 0)
        .map_err(TrainError::comm("initial parameters broadcast"))
}

/// Fails unless every rank built a model of `n` parameters: the shards cut
/// one flat buffer that all ranks must agree on. Collective.
pub(crate) fn agree_on_size(pg: &ProcessGroup, n: usize) -> Result<(), TrainError> {
    let mut range = [n as i64, -(n as i64)];
    pg.all_reduce(&mut range, ReduceOp::Max)
        .map_err(TrainError::comm("parameter count all_reduce"))?;
    let (max, min) = (range[0] as usize, (-range[1]) as usize);
    if min != max {
        return Err(TrainError::ModelMismatch { min, max });
    }
    Ok(())
}
