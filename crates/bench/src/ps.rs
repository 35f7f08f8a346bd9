//! `cohort bench ps`: the parameter server's step time and throughput on random tokens: the
//! training run `train --strategy parameter-server` makes, timed after its warm-up steps,
//! under `cohort run -n K`. It reports; it never changes what it measures.

use cohort_gpt::GPTConfig;
use cohort_train::{
    train_parameter_server_timed, ConfigError, PsMode, RpcJoin, TrainConfig, TrainError,
};
use serde::Serialize;
use std::io::Write;

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
        "A" | "a" => (GPTConfig::config_a(), 12, 30),
        "B" | "b" => (GPTConfig::config_b(), 8, 5),
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
    let (rank, world) = RpcJoin::Env.rank_and_world()?;
    let outcome =
        train_parameter_server_timed(&cfg, RpcJoin::Env, &mut std::io::sink(), args.warmup)?;
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
