//! `cohort bench ddp`: the time of a data-parallel training step of the
//! benchmark configs on random tokens, and its scaling efficiency, as
//! `../shared/reference/pytorch/bench_ddp.py` measures PyTorch's.
//!
//! Run under the launcher (`cohort run -n 2 bench ddp --config A`): every
//! rank runs warmup + measured steps (forward, DDP backward, AdamW) on its
//! own share of the data; the step time is the slowest rank's median.
//! Efficiency = (tokens/s of the whole job) / (world x tokens/s of one rank
//! alone with one thread). The single-rank figure is measured by rank 0
//! AFTER the DDP run while the other ranks wait (so the first DDP step is
//! not delayed), or taken from `--baseline-tokens-per-s`. The launch time
//! comes from `COHORT_LAUNCH_TIME_US`, set by `cohort run`.
//! It reports; it never changes what it measures.

use crate::config::Overlap;
use crate::train::{param_specs, GptReplica};
use crate::TrainError;
use cohort_comm::ProcessGroup;
use cohort_ddp::{Ddp, DdpOptions};
use cohort_engine::optim::{AdamW, AdamWConfig, Optimizer};
use cohort_gpt::bench::process_cpu_ms;
use cohort_gpt::optim_groups::decay_mask;
use cohort_gpt::{GPTConfig, GPT};
use std::io::Write;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// The launcher's launch timestamp (microseconds since the Unix epoch).
pub const LAUNCH_TIME_VAR: &str = "COHORT_LAUNCH_TIME_US";

/// Flags of `cohort bench ddp`.
#[derive(Debug, Clone, clap::Args)]
pub struct BenchDdpArgs {
    /// Benchmark config: A (vocab 65, seq 64, 4x128, batch 12) or B (seq 256, 6x384, batch 8).
    #[arg(long, default_value = "A")]
    pub config: String,
    /// Measured steps.
    #[arg(long)]
    pub steps: Option<usize>,
    /// Unmeasured steps first.
    #[arg(long, default_value_t = 3)]
    pub warmup: usize,
    /// Single-rank tokens/s to compute the efficiency against, instead of measuring it.
    #[arg(long)]
    pub baseline_tokens_per_s: Option<f64>,
    /// DDP bucket size in MB (PyTorch's default: 25).
    #[arg(long, default_value_t = crate::config::TUNED_BUCKET_CAP_MB)]
    pub bucket_cap_mb: f64,
    /// DDP first bucket size in MB.
    #[arg(long, default_value_t = cohort_ddp::DEFAULT_FIRST_BUCKET_MB)]
    pub first_bucket_mb: f64,
    /// Reduce gradient buckets during backward (on), after it (off), or on
    /// only when a core is free for the communication thread (auto).
    #[arg(long, value_enum, default_value_t = Overlap::Auto)]
    pub overlap: Overlap,
    /// Print one JSON object instead of a text line.
    #[arg(long)]
    pub json: bool,
}

/// What the benchmark measured (rank 0's view).
#[derive(Debug, Clone, serde::Serialize)]
pub struct BenchDdpResult {
    /// Always `ddp`.
    pub bench: &'static str,
    /// `A` or `B`.
    pub config: String,
    /// Ranks.
    pub world: usize,
    /// Median step time of the slowest rank, ms.
    pub ms_per_step: f64,
    /// Tokens per second of the whole job.
    pub tokens_per_s: f64,
    /// Job tokens/s over world x single-rank tokens/s.
    pub efficiency: f64,
    /// Launch to the start of the first training step, s (when launched by `cohort run`).
    pub launch_to_first_step_s: Option<f64>,
    /// The single-rank tokens/s used for the efficiency.
    pub baseline_tokens_per_s: f64,
    /// Whether the baseline was measured here (else given by flag).
    pub baseline_measured: bool,
    /// Each rank's median step time, ms.
    pub ms_per_step_per_rank: Vec<f64>,
    /// Rank 0's median time waiting for communication after backward, ms.
    pub comm_wait_ms: f64,
    /// Rank 0's median time inside all-reduce calls per step (overlapped or not), ms.
    pub comm_busy_ms: f64,
    /// Rank 0's process CPU time per DDP step (all its threads), ms: less
    /// sensitive than wall time to other load on a shared machine.
    pub cpu_ms_per_step: f64,
    /// The single-rank run's process CPU time per step, ms (when measured here).
    pub baseline_cpu_ms_per_step: Option<f64>,
    /// baseline_cpu_ms_per_step / cpu_ms_per_step: the efficiency in CPU
    /// time, what the wall-clock efficiency would be on a quiet machine
    /// without waiting between ranks.
    pub cpu_efficiency: Option<f64>,
    /// Gradient buckets.
    pub buckets: usize,
    /// Whether buckets were reduced during backward.
    pub overlap: bool,
    /// Parameters of the model.
    pub params: usize,
    /// Sequences per rank per step.
    pub batch_per_rank: usize,
    /// Tokens per sequence.
    pub seq: usize,
    /// Measured steps.
    pub steps: usize,
}

/// Why the benchmark could not run.
fn bad_config(name: &str) -> TrainError {
    TrainError::Config(crate::ConfigError::Invalid {
        key: "config",
        value: name.to_string(),
        why: "must be A or B",
    })
}

/// The model and per-rank batch of config A or B, and the default steps.
fn bench_config(name: &str) -> Result<(GPTConfig, usize, usize), TrainError> {
    match name {
        "A" | "a" => Ok((GPTConfig::config_a(), 12, 30)),
        "B" | "b" => Ok((GPTConfig::config_b(), 8, 5)),
        _ => Err(bad_config(name)),
    }
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    if v.is_empty() {
        return 0.0;
    }
    v[v.len() / 2]
}

/// Random token batches, different per rank and step (seed 000's data).
fn batch(vocab: usize, n: usize, rank: usize, step: usize) -> (Vec<u32>, Vec<i32>) {
    let mut s = (rank as u64) << 32 ^ step as u64 ^ 0x5eed;
    let ids: Vec<u32> = (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 33) % vocab as u64) as u32
        })
        .collect();
    let labels = ids.iter().map(|&x| x as i32).collect();
    (ids, labels)
}

/// Runs the benchmark as a rank of `pg`; rank 0 writes the result to `out`.
pub fn run_ddp_bench(
    args: &BenchDdpArgs,
    pg: &ProcessGroup,
    out: &mut dyn Write,
) -> Result<BenchDdpResult, TrainError> {
    let launch = std::env::var(LAUNCH_TIME_VAR)
        .ok()
        .and_then(|v| v.parse::<u64>().ok());
    let (cfg, b, default_steps) = bench_config(&args.config)?;
    let steps = args.steps.unwrap_or(default_steps).max(1);
    let t = cfg.max_position_embeddings;
    let (rank, world) = (pg.rank(), pg.size());

    // Only rank 0's draws survive DDP's broadcast.
    let mut model = if rank == 0 {
        GPT::new(cfg.clone(), 1234)?
    } else {
        GPT::zeroed(cfg.clone(), 1234)?
    };
    let mut opt = AdamW::new(AdamWConfig::default(), decay_mask(model.param_views()))?;
    let overlap = args
        .overlap
        .enabled(world, pg.local_world_size(), model.backend().num_threads());
    let options = DdpOptions {
        bucket_cap_mb: args.bucket_cap_mb,
        first_bucket_mb: args.first_bucket_mb,
        overlap,
        ..DdpOptions::default()
    };
    let mut ddp = Ddp::new(pg, param_specs(&model), model.params_mut(), options)?;

    let mut first_step_start = None;
    let mut times = Vec::with_capacity(steps);
    let mut waits = Vec::with_capacity(steps);
    let mut busy = Vec::with_capacity(steps);
    let mut cpu0 = 0.0;
    for i in 0..args.warmup + steps {
        let (ids, labels) = batch(cfg.vocab_size, b * t, rank, i);
        if i == args.warmup {
            cpu0 = process_cpu_ms();
        }
        let t0 = Instant::now();
        if i == 0 {
            first_step_start = Some(SystemTime::now());
        }
        model.zero_grad();
        model.forward(&ids, None, Some(&labels), b, t)?;
        let stats = ddp.backward(&mut GptReplica(&mut model))?;
        let (params, grads) = model.params_and_grads_mut();
        opt.step(params, grads, 1e-3)?;
        if i >= args.warmup {
            times.push(t0.elapsed().as_secs_f64());
            waits.push(stats.comm_wait.as_secs_f64());
            busy.push(stats.comm_busy.as_secs_f64());
        }
    }
    let cpu_ms = (process_cpu_ms() - cpu0) / steps as f64;
    let med = median(&mut times);
    let comm_wait = median(&mut waits);
    let comm_busy = median(&mut busy);
    let mut meds = vec![0f64; world];
    pg.all_gather(&[med], &mut meds)
        .map_err(TrainError::comm("gathering step times"))?;
    let slowest = meds.iter().copied().fold(0.0, f64::max);
    let tokens_per_s = (world * b * t) as f64 / slowest;

    // The single-rank, single-thread figure: rank 0 alone, plain backward,
    // while the others wait at the barrier.
    let (baseline, baseline_cpu, measured) = match args.baseline_tokens_per_s {
        Some(x) => (x, None, false),
        None if world == 1 => (tokens_per_s, Some(cpu_ms), true),
        None => {
            let (mut base, mut base_cpu) = (f64::NAN, None);
            if rank == 0 {
                let (tps, cpu) = single_rank(&cfg, b, args.warmup, steps)?;
                (base, base_cpu) = (tps, Some(cpu));
            }
            pg.barrier()
                .map_err(TrainError::comm("waiting for the baseline"))?;
            (base, base_cpu, true)
        }
    };
    let launch_to_first = match (launch, first_step_start) {
        (Some(us), Some(t)) => t
            .duration_since(UNIX_EPOCH + Duration::from_micros(us))
            .ok()
            .map(|d| d.as_secs_f64()),
        _ => None,
    };
    let result = BenchDdpResult {
        bench: "ddp",
        config: args.config.to_uppercase(),
        world,
        ms_per_step: slowest * 1e3,
        tokens_per_s,
        efficiency: tokens_per_s / (world as f64 * baseline),
        launch_to_first_step_s: launch_to_first,
        baseline_tokens_per_s: baseline,
        baseline_measured: measured,
        ms_per_step_per_rank: meds.iter().map(|m| m * 1e3).collect(),
        comm_wait_ms: comm_wait * 1e3,
        comm_busy_ms: comm_busy * 1e3,
        cpu_ms_per_step: cpu_ms,
        baseline_cpu_ms_per_step: baseline_cpu,
        cpu_efficiency: baseline_cpu.map(|c| c / cpu_ms),
        buckets: ddp.buckets().len(),
        overlap,
        params: model.num_params(),
        batch_per_rank: b,
        seq: t,
        steps,
    };
    if rank == 0 {
        let line = if args.json {
            serde_json::to_string(&result).unwrap_or_default()
        } else {
            format!(
                "config {}, world {}, ms_per_step {:.2}, tokens_per_s {:.0}, efficiency {:.3} \
                 (baseline {:.0} tokens/s on 1 rank), launch_to_first_step_s {}, \
                 comm wait {:.2} ms, comm busy {:.2} ms, {} bucket(s); CPU ms/step {:.2} vs {} \
                 alone (cpu efficiency {})",
                result.config,
                world,
                result.ms_per_step,
                result.tokens_per_s,
                result.efficiency,
                baseline,
                launch_to_first
                    .map(|s| format!("{s:.3}"))
                    .unwrap_or("- (not launched by cohort run)".into()),
                result.comm_wait_ms,
                result.comm_busy_ms,
                result.buckets,
                cpu_ms,
                baseline_cpu
                    .map(|c| format!("{c:.2}"))
                    .unwrap_or("-".into()),
                result
                    .cpu_efficiency
                    .map(|e| format!("{e:.3}"))
                    .unwrap_or("-".into()),
            )
        };
        writeln!(out, "{line}").map_err(TrainError::Log)?;
    }
    Ok(result)
}

/// Tokens/s and process CPU ms per step of one process training alone (no
/// DDP), with this process's threads.
fn single_rank(
    cfg: &GPTConfig,
    b: usize,
    warmup: usize,
    steps: usize,
) -> Result<(f64, f64), TrainError> {
    let t = cfg.max_position_embeddings;
    let mut model = GPT::new(cfg.clone(), 1234)?;
    let mut opt = AdamW::new(AdamWConfig::default(), decay_mask(model.param_views()))?;
    let mut times = Vec::with_capacity(steps);
    let mut cpu0 = 0.0;
    for i in 0..warmup + steps {
        let (ids, labels) = batch(cfg.vocab_size, b * t, 0, i);
        if i == warmup {
            cpu0 = process_cpu_ms();
        }
        let t0 = Instant::now();
        model.zero_grad();
        model.forward(&ids, None, Some(&labels), b, t)?;
        model.backward(|_, _| {})?;
        let (params, grads) = model.params_and_grads_mut();
        opt.step(params, grads, 1e-3)?;
        if i >= warmup {
            times.push(t0.elapsed().as_secs_f64());
        }
    }
    let cpu = (process_cpu_ms() - cpu0) / steps as f64;
    Ok(((b * t) as f64 / median(&mut times), cpu))
}
