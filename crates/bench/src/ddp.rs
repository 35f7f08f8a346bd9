//! `cohort bench ddp`: the time of a data-parallel training step of the
//! benchmark configs on random tokens, and its scaling efficiency, as
//! PyTorch's reference script `bench_ddp.py` measures PyTorch's.
//!
//! Run under the launcher (`cohort run -n 2 bench ddp --config A`): every
//! rank runs warmup + measured steps (forward, DDP backward, AdamW) on its
//! own share of the data; the step time is the slowest rank's median.
//! Efficiency = (tokens/s of the whole job) / (world x tokens/s of one rank
//! alone with one thread). Rank 0 measures the single-rank figure while the
//! other ranks wait, in segments that alternate with the DDP segments
//! (`--rounds`), or takes it from `--baseline-tokens-per-s`. A third kind of
//! segment has every rank train alone at the same time: DDP's throughput
//! against theirs is the efficiency of DDP itself on this machine. The launch time
//! comes from `COHORT_LAUNCH_TIME_US`, set by `cohort run`.
//! The step is cohort-train's data-parallel step ([`DataParallel`]), the one
//! `cohort train` runs, with the gradient sync `--strategy` names: DDP's
//! bucketed all-reduce, ZeRO-1 (plain backward, then [`Zero1`]:
//! reduce-scatter, AdamW on the shard, all-gather) or ZeRO-2/3
//! ([`ShardedDp`]: each part's gradient reduce-scattered as backward hands
//! it out and released, and for zero3 each part's parameters gathered
//! around its forward and backward, then AdamW on the shard). The peak
//! resident memory of each rank shows what sharding saves.
//! It reports; it never changes what it measures.

use cohort_comm::ProcessGroup;
use cohort_ddp::DdpOptions;
use cohort_engine::cpu::{self, Cpu};
use cohort_engine::optim::{AdamW, AdamWConfig, Optimizer};
use cohort_gpt::optim_groups::decay_mask;
use cohort_gpt::{Backward, Forward, GPTConfig, Labels, GPT};
use cohort_train::{
    peak_rss_mb, process_cpu_ms, share_rank0_params, ConfigError, DataParallel, GradSync, Overlap,
    ShardedDp, TrainError, Zero1, ZeroStage, TUNED_BUCKET_CAP_MB,
};
use std::io::Write;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// The launcher's launch timestamp (microseconds since the Unix epoch).
pub const LAUNCH_TIME_VAR: &str = "COHORT_LAUNCH_TIME_US";

/// Flags of `cohort bench ddp`.
#[derive(Debug, Clone, clap::Args)]
pub struct BenchDdpArgs {
    /// Benchmark config: A (vocab 65, seq 64, 4x128, batch 12), B (seq 256, 6x384, batch 8) or
    /// G (GPT-2 small's shape, vocab 50304, seq 256, batch 4).
    #[arg(long, default_value = "A")]
    pub config: String,
    /// Measured steps.
    #[arg(long)]
    pub steps: Option<usize>,
    /// Unmeasured steps first.
    #[arg(long, default_value_t = 3)]
    pub warmup: usize,
    /// Segments the measured steps are split into, alternating with
    /// segments of the single-rank baseline (each after the first starts
    /// with one unmeasured step).
    #[arg(long, default_value_t = 5)]
    pub rounds: usize,
    /// Single-rank tokens/s to compute the efficiency against, instead of measuring it.
    #[arg(long)]
    pub baseline_tokens_per_s: Option<f64>,
    /// DDP bucket size in MB (PyTorch's default: 25).
    #[arg(long, default_value_t = TUNED_BUCKET_CAP_MB)]
    pub bucket_cap_mb: f64,
    /// DDP first bucket size in MB.
    #[arg(long, default_value_t = cohort_ddp::DEFAULT_FIRST_BUCKET_MB)]
    pub first_bucket_mb: f64,
    /// Overlap the collectives with computation (DDP: reduce gradient
    /// buckets during backward; ZeRO-2/3: prefetch parts' all-gathers and
    /// leave reduce-scatters running) (on), not (off), or only when a core
    /// is free for the communication thread (auto).
    #[arg(long, value_enum, default_value_t = Overlap::Auto)]
    pub overlap: Overlap,
    /// Matrix products in fp32, or bf16 with f32 sums and master weights (both the DDP ranks
    /// and the single-rank baseline).
    #[arg(long, default_value = "fp32")]
    pub precision: cohort_engine::DType,
    /// Send gradients in bf16 (PyTorch's bf16_compress_hook): DDP's
    /// all-reduce, ZeRO's reduce-scatter.
    #[arg(long)]
    pub bf16_compress: bool,
    /// Keep only each block's input in forward and recompute the block inside backward
    /// (PyTorch's `torch.utils.checkpoint` per block), on the ranks and the single-rank
    /// baseline alike.
    #[arg(long)]
    pub activation_checkpointing: bool,
    /// The data-parallel step: DDP, ZeRO-1 (optimizer state sharded), ZeRO-2
    /// (gradients too) or ZeRO-3 (parameters too, gathered per block).
    #[arg(long, value_enum, default_value_t = BenchStrategy::Ddp)]
    pub strategy: BenchStrategy,
    /// Print one JSON object instead of a text line.
    #[arg(long)]
    pub json: bool,
}

/// The data-parallel steps `cohort bench ddp` can time.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum BenchStrategy {
    /// Gradients all-reduced in buckets during backward; AdamW on the whole model.
    Ddp,
    /// Gradients reduce-scattered after backward, AdamW on this rank's
    /// shard, parameters all-gathered.
    #[value(name = "zero1")]
    Zero1,
    /// Each part's gradient reduce-scattered during backward and released,
    /// AdamW on this rank's shard, parameters all-gathered.
    #[value(name = "zero2")]
    Zero2,
    /// As zero2, with the parameters sharded too: each part's gathered just
    /// before its forward and backward, released after.
    #[value(name = "zero3")]
    Zero3,
}

impl BenchStrategy {
    /// The flag's name.
    fn name(self) -> &'static str {
        match self {
            BenchStrategy::Ddp => "ddp",
            BenchStrategy::Zero1 => "zero1",
            BenchStrategy::Zero2 => "zero2",
            BenchStrategy::Zero3 => "zero3",
        }
    }
}

/// What the benchmark measured (rank 0's view).
#[derive(Debug, Clone, serde::Serialize)]
pub struct BenchDdpResult {
    /// Always `ddp`.
    pub bench: &'static str,
    /// `A` or `B`.
    pub config: String,
    /// What the matrix products computed in (`fp32` or `bf16`).
    pub precision: String,
    /// The data-parallel step timed: `ddp`, `zero1`, `zero2` or `zero3`.
    pub strategy: BenchStrategy,
    /// Whether each block was recomputed in backward instead of keeping its activations.
    pub activation_checkpointing: bool,
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
    /// Total tokens/s of the ranks training at the same time without
    /// communicating (when the baseline is measured here).
    pub independent_tokens_per_s: Option<f64>,
    /// tokens_per_s / independent_tokens_per_s: what DDP itself costs
    /// (communication and waiting for each other), apart from how much
    /// the ranks slow each other down by sharing the machine.
    pub efficiency_vs_independent: Option<f64>,
    /// The single-rank tokens/s used for the efficiency.
    pub baseline_tokens_per_s: f64,
    /// Whether the baseline was measured here (else given by flag).
    pub baseline_measured: bool,
    /// Each rank's median step time, ms.
    pub ms_per_step_per_rank: Vec<f64>,
    /// Rank 0's median time of each phase of a DDP step, ms.
    pub phases_ms: PhasesMs,
    /// The same for the single-rank baseline (when measured here).
    pub baseline_phases_ms: Option<PhasesMs>,
    /// The same for rank 0 training independently beside the others.
    pub independent_phases_ms: Option<PhasesMs>,
    /// Rank 0's process CPU time per DDP step (all its threads), ms: less
    /// sensitive than wall time to other load on a shared machine.
    pub cpu_ms_per_step: f64,
    /// The single-rank run's process CPU time per step, ms (when measured here).
    pub baseline_cpu_ms_per_step: Option<f64>,
    /// baseline_cpu_ms_per_step / cpu_ms_per_step: the efficiency in CPU
    /// time, what the wall-clock efficiency would be on a quiet machine
    /// without waiting between ranks.
    pub cpu_efficiency: Option<f64>,
    /// Each rank's peak resident memory (VmHWM) in MB at the end of the
    /// first segment of the strategy's steps, before the single-rank
    /// baseline's model is built in the same process.
    pub peak_rss_mb_per_rank: Vec<f64>,
    /// Floats of AdamW state per rank (two moments): the whole model's
    /// under DDP, one shard's under ZeRO.
    pub optimizer_floats_per_rank: usize,
    /// Gradient buckets (0 under ZeRO: ZeRO-1 reduces the buffer at once,
    /// ZeRO-2 and 3 unit by unit, a block's MLP apart from its attention).
    pub buckets: usize,
    /// Whether the collectives overlapped the computation (DDP: buckets
    /// reduced during backward; ZeRO-2/3: parts' all-gathers prefetched and
    /// reduce-scatters left running during backward).
    pub overlap: bool,
    /// Parameters of the model.
    pub params: usize,
    /// Sequences per rank per step.
    pub batch_per_rank: usize,
    /// Tokens per sequence.
    pub seq: usize,
    /// Measured steps.
    pub steps: usize,
    /// Model FLOPs of one rank's step (llm.c's count, as `cohort bench train`).
    pub flops_per_step_per_rank: f64,
    /// Each rank's peak of the instruction its products use, measured on its threads at start,
    /// all ranks at once (GFLOP/s; None without FMA).
    pub peak_gflops_per_rank: Option<Vec<f64>>,
    /// Model FLOPs utilisation of the job: world x flops_per_step_per_rank at the slowest
    /// rank's median step, over the ranks' peaks summed.
    pub mfu: Option<f64>,
}

/// Why the benchmark could not run.
fn bad_config(name: &str) -> TrainError {
    TrainError::Config(ConfigError::Invalid {
        key: "config",
        value: name.to_string(),
        why: "must be A, B, G or S",
    })
}

/// The model and per-rank batch of config A, B, G or S, and the default steps.
fn bench_config(name: &str) -> Result<(GPTConfig, usize, usize), TrainError> {
    match name {
        "A" | "a" => Ok((GPTConfig::config_a(), 12, 100)),
        "B" | "b" => Ok((GPTConfig::config_b(), 8, 10)),
        "G" | "g" => Ok((GPTConfig::config_g(), 4, 3)),
        "S" | "s" => Ok((GPTConfig::config_s(), 4, 3)),
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

/// Random token batches, different per rank and step (the toy data of PyTorch's DDP examples).
fn batch(vocab: usize, n: usize, rank: usize, step: usize) -> (Vec<u32>, Vec<i32>) {
    let mut ids = vec![0u32; n];
    crate::random_tokens(vocab, &mut ids, (rank as u64) << 32 ^ step as u64);
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

    // Only rank 0's draws survive: DDP broadcasts them, ZeRO shares them first.
    let mut model = if rank == 0 {
        GPT::new(cfg.clone(), 1234)?
    } else {
        GPT::zeroed(cfg.clone(), 1234)?
    };
    model.set_precision(args.precision)?;
    model.set_activation_checkpointing(args.activation_checkpointing);
    // ZeRO-1 has nothing to overlap: its collectives run after backward.
    let overlap = args.strategy != BenchStrategy::Zero1
        && args
            .overlap
            .enabled(world, pg.local_world_size(), model.backend().num_threads());
    let mask = decay_mask(model.param_views());
    let compression = if args.bf16_compress {
        cohort_ddp::Compression::Bf16
    } else {
        cohort_ddp::Compression::None
    };
    let sync = match args.strategy {
        BenchStrategy::Ddp => {
            let options = DdpOptions {
                bucket_cap_mb: args.bucket_cap_mb,
                first_bucket_mb: args.first_bucket_mb,
                overlap,
                compression,
                ..DdpOptions::default()
            };
            let opt = AdamW::new(AdamWConfig::default(), mask)?;
            GradSync::ddp(pg, &mut model, opt, options)?
        }
        BenchStrategy::Zero1 => {
            share_rank0_params(pg, &mut model)?;
            let mut zero = Zero1::new(pg, model.params(), &mask, AdamWConfig::default())?;
            zero.set_compression(compression);
            GradSync::Zero1(zero)
        }
        BenchStrategy::Zero2 | BenchStrategy::Zero3 => {
            share_rank0_params(pg, &mut model)?;
            let stage = if args.strategy == BenchStrategy::Zero2 {
                ZeroStage::Two
            } else {
                ZeroStage::Three
            };
            let mut zero = ShardedDp::new(pg, &mut model, stage, AdamWConfig::default())?;
            zero.set_compression(compression);
            zero.set_overlap(overlap);
            GradSync::Sharded(Box::new(zero))
        }
    };
    let mut dp = DataParallel::new(pg, model, sync);
    // The instruction's peak on this rank's threads, every rank at once (what they get of the
    // machine together), before the first step.
    pg.barrier()
        .map_err(TrainError::comm("waiting to measure the peak"))?;
    let backend = dp.model().backend();
    let peak = Cpu::with_dtype(backend.num_threads(), backend.dtype())
        .ok()
        .and_then(|cpu| cpu::product_peak(&cpu));
    let mut peaks = vec![0f64; world];
    pg.all_gather(&[peak.map_or(f64::NAN, |p| p.gflops)], &mut peaks)
        .map_err(TrainError::comm("gathering the peaks"))?;
    let peaks = peaks.iter().all(|p| p.is_finite()).then_some(peaks);
    let flops_per_step = cfg.train_flops_per_token(t) * (b * t) as f64;

    // DDP and the single-rank baseline run in alternating segments, so that
    // drift in the host's speed (seconds long on a shared VM) weighs on both
    // alike instead of on whichever ran second.
    let measure_baseline = args.baseline_tokens_per_s.is_none() && world > 1;
    // The same single-rank training on every rank at once, without
    // communication: what the machine gives two processes, so that
    // `efficiency_vs_independent` isolates the cost of DDP itself.
    let mut single: Option<SingleRank> = None;
    let mut alone_times = StepTimes::default();
    let mut independent_times = StepTimes::default();
    let rounds = args.rounds.clamp(1, steps);
    let mut ddp_times = StepTimes::default();
    let mut first_step_start = None;
    let mut peak_rss = 0.0;
    let mut i = 0;
    for round in 0..rounds {
        let measured = steps / rounds + usize::from(round < steps % rounds);
        // A segment's first step refills the caches the other model evicted.
        let warmup = if round == 0 { args.warmup } else { 1 };
        for j in 0..warmup + measured {
            let (ids, labels) = batch(cfg.vocab_size, b * t, rank, i);
            i += 1;
            if j == warmup {
                ddp_times.start_segment();
            }
            first_step_start.get_or_insert_with(SystemTime::now);
            let phases = timed_step(&mut dp, &ids, &labels, b, t)?;
            if j >= warmup {
                ddp_times.push(phases);
            }
        }
        ddp_times.end_segment();
        if round == 0 {
            peak_rss = peak_rss_mb();
        }
        if measure_baseline {
            // Built after the first DDP segment, not to delay the first step.
            let single = match &mut single {
                Some(s) => s,
                None => single.insert(SingleRank::new(
                    &cfg,
                    b,
                    rank,
                    args.precision,
                    args.activation_checkpointing,
                )?),
            };
            // Rank 0 alone, plain backward, while the others wait here.
            if rank == 0 {
                single.run(warmup, measured, &mut alone_times)?;
            }
            pg.barrier()
                .map_err(TrainError::comm("waiting for the baseline"))?;
            single.run(warmup, measured, &mut independent_times)?;
            pg.barrier()
                .map_err(TrainError::comm("waiting for the independent ranks"))?;
        }
    }
    let cpu_ms = ddp_times.cpu_ms_per_step();
    let phases = ddp_times.medians_ms();
    let med = phases.step / 1e3;
    let mut meds = vec![0f64; world];
    pg.all_gather(&[med], &mut meds)
        .map_err(TrainError::comm("gathering step times"))?;
    let slowest = meds.iter().copied().fold(0.0, f64::max);
    let tokens_per_s = (world * b * t) as f64 / slowest;
    let baseline_phases_ms = (measure_baseline && rank == 0).then(|| alone_times.medians_ms());
    let (baseline, baseline_cpu, measured) = match (args.baseline_tokens_per_s, baseline_phases_ms)
    {
        (Some(x), _) => (x, None, false),
        (None, _) if world == 1 => (tokens_per_s, Some(cpu_ms), true),
        (None, Some(alone)) => (
            (b * t) as f64 * 1e3 / alone.step,
            Some(alone_times.cpu_ms_per_step()),
            true,
        ),
        (None, None) => (f64::NAN, None, true),
    };
    let mut peak_rss_per_rank = vec![0f64; world];
    pg.all_gather(&[peak_rss], &mut peak_rss_per_rank)
        .map_err(TrainError::comm("gathering peak memory"))?;
    let independent_phases_ms = measure_baseline.then(|| independent_times.medians_ms());
    let independent_tokens_per_s = if let Some(own) = independent_phases_ms {
        let own = (b * t) as f64 * 1e3 / own.step;
        let mut each = vec![0f64; world];
        pg.all_gather(&[own], &mut each)
            .map_err(TrainError::comm("gathering the independent ranks' speed"))?;
        Some(each.iter().sum::<f64>())
    } else {
        None
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
        precision: dp.model().backend().dtype().to_string(),
        strategy: args.strategy,
        activation_checkpointing: args.activation_checkpointing,
        world,
        ms_per_step: slowest * 1e3,
        tokens_per_s,
        efficiency: tokens_per_s / (world as f64 * baseline),
        independent_tokens_per_s,
        efficiency_vs_independent: independent_tokens_per_s.map(|x| tokens_per_s / x),
        launch_to_first_step_s: launch_to_first,
        baseline_tokens_per_s: baseline,
        baseline_measured: measured,
        ms_per_step_per_rank: meds.iter().map(|m| m * 1e3).collect(),
        phases_ms: phases,
        baseline_phases_ms,
        independent_phases_ms,
        cpu_ms_per_step: cpu_ms,
        baseline_cpu_ms_per_step: baseline_cpu,
        cpu_efficiency: baseline_cpu.map(|c| c / cpu_ms),
        peak_rss_mb_per_rank: peak_rss_per_rank,
        optimizer_floats_per_rank: dp.optimizer_floats(),
        buckets: dp.buckets(),
        overlap,
        params: dp.model().num_params(),
        batch_per_rank: b,
        seq: t,
        steps,
        flops_per_step_per_rank: flops_per_step,
        mfu: peaks
            .as_ref()
            .map(|p| world as f64 * flops_per_step / slowest / 1e9 / p.iter().sum::<f64>()),
        peak_gflops_per_rank: peaks,
    };
    if rank == 0 {
        let line = if args.json {
            serde_json::to_string(&result).unwrap_or_default()
        } else {
            format!(
                "config {}, strategy {}, world {}, ms_per_step {:.2}, tokens_per_s {:.0}, efficiency {:.3} \
                 (baseline {:.0} tokens/s on 1 rank; {} against the ranks training \
                 independently), launch_to_first_step_s {}, \
                 {} bucket(s); rank 0 ms: {}{}; CPU ms/step {:.2} vs {} alone (cpu efficiency {}); \
                 peak RSS MB per rank {}, AdamW state {} floats per rank; MFU {}",
                result.config,
                args.strategy.name(),
                world,
                result.ms_per_step,
                result.tokens_per_s,
                result.efficiency,
                baseline,
                result
                    .efficiency_vs_independent
                    .map(|e| format!("{e:.3}"))
                    .unwrap_or("-".into()),
                launch_to_first
                    .map(|s| format!("{s:.3}"))
                    .unwrap_or("- (not launched by cohort run)".into()),
                result.buckets,
                phases,
                baseline_phases_ms
                    .map(|p| format!(", alone: {p}"))
                    .unwrap_or_default(),
                cpu_ms,
                baseline_cpu
                    .map(|c| format!("{c:.2}"))
                    .unwrap_or("-".into()),
                result
                    .cpu_efficiency
                    .map(|e| format!("{e:.3}"))
                    .unwrap_or("-".into()),
                result
                    .peak_rss_mb_per_rank
                    .iter()
                    .map(|m| format!("{m:.1}"))
                    .collect::<Vec<_>>()
                    .join("/"),
                result.optimizer_floats_per_rank,
                result
                    .mfu
                    .map(|m| format!("{:.1}%", 100.0 * m))
                    .unwrap_or("-".into()),
            )
        };
        writeln!(out, "{line}").map_err(TrainError::Log)?;
    }
    Ok(result)
}

/// One timed data-parallel step of `ids` with `labels` (B = `b`, T = `t`)
/// through cohort-train's step: the gradients cleared, forward, backward
/// with the strategy's synchronisation, and the update. Collective.
fn timed_step(
    dp: &mut DataParallel<'_>,
    ids: &[u32],
    labels: &[i32],
    b: usize,
    t: usize,
) -> Result<StepPhases, TrainError> {
    let t0 = Instant::now();
    dp.clear_grads();
    dp.forward(ids, None, None, Some(Labels::Aligned(labels)), b, t)?;
    let forward = t0.elapsed();
    let sync = dp.backward(true)?;
    let t_opt = Instant::now();
    // ZeRO-1 and 2 all-gather the updated shards here; nothing overlaps
    // those collectives, so all of their time is waited for. (ZeRO-2 with
    // overlap leaves them to the next forward, prefetched part by part:
    // what they are not hidden by is in that forward's time.)
    let gather = dp.update(1e-3)?;
    let optimizer = t_opt.elapsed().saturating_sub(gather);
    Ok(StepPhases {
        step: t0.elapsed(),
        forward,
        backward: sync.backward,
        comm_wait: sync.comm_wait + gather,
        comm_busy: sync.comm_busy + gather,
        optimizer,
    })
}

/// Where the time of one training step went.
#[derive(Debug, Clone, Copy, Default)]
struct StepPhases {
    step: Duration,
    forward: Duration,
    /// The model's backward (with overlap, the reduction it hid included).
    backward: Duration,
    /// From the end of backward until the gradients were averaged.
    comm_wait: Duration,
    /// Inside all-reduce calls, overlapped or not.
    comm_busy: Duration,
    optimizer: Duration,
}

/// Median milliseconds of each phase, each over the measured steps (so
/// they need not add up to `step`).
#[derive(Debug, Clone, Copy, serde::Serialize)]
pub struct PhasesMs {
    /// The whole step.
    pub step: f64,
    /// Forward and loss.
    pub forward: f64,
    /// The model's backward.
    pub backward: f64,
    /// Waiting for gradient averaging after backward.
    pub comm_wait: f64,
    /// Inside all-reduce calls.
    pub comm_busy: f64,
    /// The AdamW step.
    pub optimizer: f64,
}

impl std::fmt::Display for PhasesMs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "step {:.2} (forward {:.2}, backward {:.2}, comm wait {:.2}, optimizer {:.2}; \
             in all-reduce {:.2})",
            self.step, self.forward, self.backward, self.comm_wait, self.optimizer, self.comm_busy
        )
    }
}

/// The phases and process CPU time of the measured steps, gathered over
/// one or more segments.
#[derive(Default)]
struct StepTimes {
    steps: Vec<StepPhases>,
    cpu_ms: f64,
    segment_cpu0: Option<f64>,
}

impl StepTimes {
    fn start_segment(&mut self) {
        self.segment_cpu0 = Some(process_cpu_ms());
    }

    fn end_segment(&mut self) {
        if let Some(cpu0) = self.segment_cpu0.take() {
            self.cpu_ms += process_cpu_ms() - cpu0;
        }
    }

    fn push(&mut self, step: StepPhases) {
        self.steps.push(step);
    }

    fn medians_ms(&self) -> PhasesMs {
        let of = |f: fn(&StepPhases) -> Duration| {
            let mut v: Vec<f64> = self
                .steps
                .iter()
                .map(|p| f(p).as_secs_f64() * 1e3)
                .collect();
            median(&mut v)
        };
        PhasesMs {
            step: of(|p| p.step),
            forward: of(|p| p.forward),
            backward: of(|p| p.backward),
            comm_wait: of(|p| p.comm_wait),
            comm_busy: of(|p| p.comm_busy),
            optimizer: of(|p| p.optimizer),
        }
    }

    fn cpu_ms_per_step(&self) -> f64 {
        self.cpu_ms / self.steps.len().max(1) as f64
    }
}

/// One process training alone (no DDP) with this process's threads: the
/// baseline of the efficiency.
struct SingleRank {
    model: GPT,
    opt: AdamW,
    batch: usize,
    rank: usize,
    step: usize,
}

impl SingleRank {
    fn new(
        cfg: &GPTConfig,
        batch: usize,
        rank: usize,
        precision: cohort_engine::DType,
        activation_checkpointing: bool,
    ) -> Result<Self, TrainError> {
        let mut model = GPT::new(cfg.clone(), 1234)?;
        model.set_precision(precision)?;
        model.set_activation_checkpointing(activation_checkpointing);
        let opt = AdamW::new(AdamWConfig::default(), decay_mask(model.param_views()))?;
        Ok(Self {
            model,
            opt,
            batch,
            rank,
            step: 0,
        })
    }

    /// `warmup` unmeasured steps, then `measured` measured ones into `times`.
    fn run(
        &mut self,
        warmup: usize,
        measured: usize,
        times: &mut StepTimes,
    ) -> Result<(), TrainError> {
        let cfg = self.model.config().clone();
        let (b, t) = (self.batch, cfg.max_position_embeddings);
        for j in 0..warmup + measured {
            let (ids, labels) = batch(cfg.vocab_size, b * t, self.rank, self.step);
            self.step += 1;
            if j == warmup {
                times.start_segment();
            }
            let t0 = Instant::now();
            self.model.zero_grad();
            self.model
                .forward(Forward::new(&ids, b, t).labels(Labels::Aligned(&labels)))?;
            let forward = t0.elapsed();
            self.model.backward(Backward::new())?;
            let backward = t0.elapsed() - forward;
            let t_opt = Instant::now();
            let opt = &mut self.opt;
            self.model
                .update_params(|params, grads| opt.step(params, grads, 1e-3))?;
            if j >= warmup {
                times.push(StepPhases {
                    step: t0.elapsed(),
                    forward,
                    backward,
                    optimizer: t_opt.elapsed(),
                    ..StepPhases::default()
                });
            }
        }
        times.end_segment();
        Ok(())
    }
}
