//! `cohort bench pipeline`: the pipeline's step time and bubble on random tokens, through
//! cohort-train's [`PipelineRank`] (the stage, schedule and pipe `train --strategy pipeline`
//! runs), under `cohort run -n S`. It reports; it never changes what it measures.

use cohort_comm::ProcessGroup;
use cohort_gpt::GPTConfig;
use cohort_train::{process_cpu_ms, ConfigError, PipelineRank, PipelineSchedule, TrainError};
use std::io::Write;
use std::time::Instant;

fn invalid(key: &'static str, value: String, why: &'static str) -> TrainError {
    TrainError::Config(ConfigError::Invalid { key, value, why })
}

/// Flags of `cohort bench pipeline`.
#[derive(Debug, Clone, clap::Args)]
pub struct BenchPipelineArgs {
    /// Benchmark config: A (vocab 65, seq 64, 4x128) or B (seq 256, 6x384).
    #[arg(long, default_value = "B")]
    pub config: String,
    /// Pipeline stages (default: one per rank; ranks = stages x replicas).
    #[arg(long)]
    pub stages: Option<usize>,
    /// Sequences per step of each pipeline (default: the config's per-rank batch, 12 or 8,
    /// times the ranks: what `bench ddp` on as many ranks processes per step).
    #[arg(long)]
    pub batch: Option<usize>,
    /// Micro-batches per step; must divide the batch.
    #[arg(long, default_value_t = 4)]
    pub micro_batches: usize,
    /// gpipe or 1f1b.
    #[arg(long, value_enum, default_value_t = PipelineSchedule::OneFOneB)]
    pub schedule: PipelineSchedule,
    /// Measured steps (default: 30 on A, 5 on B).
    #[arg(long)]
    pub steps: Option<usize>,
    /// Unmeasured steps first.
    #[arg(long, default_value_t = 2)]
    pub warmup: usize,
    /// Print one JSON object instead of a text line.
    #[arg(long)]
    pub json: bool,
}

/// What `cohort bench pipeline` measured (rank 0's view).
#[derive(Debug, Clone, serde::Serialize)]
pub struct BenchPipelineResult {
    /// Always `pipeline`.
    pub bench: &'static str,
    /// `A` or `B`.
    pub config: String,
    /// Ranks.
    pub world: usize,
    /// Stages per pipeline.
    pub stages: usize,
    /// Pipelines (data-parallel replicas).
    pub replicas: usize,
    /// `gpipe` or `1f1b`.
    pub schedule: PipelineSchedule,
    /// Micro-batches per step.
    pub micro_batches: usize,
    /// Sequences per micro-batch.
    pub micro_batch_size: usize,
    /// Tokens per sequence.
    pub seq: usize,
    /// The slowest rank's median step time, ms.
    pub ms_per_step: f64,
    /// Tokens per second of the whole job.
    pub tokens_per_s: f64,
    /// Mean over ranks of the share of the step a stage does not compute (1 - compute / step):
    /// the measured bubble, including the time spent copying and receiving messages.
    pub bubble_fraction: f64,
    /// Per rank: 1 - compute / step.
    pub bubble_per_rank: Vec<f64>,
    /// Per rank: the share of the step blocked in receives or waiting for sends.
    pub wait_fraction_per_rank: Vec<f64>,
    /// Per rank: median forward + backward compute per step, ms.
    pub compute_ms_per_rank: Vec<f64>,
    /// GPipe's idealised bubble for these stages and micro-batches, (S - 1) / (M + S - 1).
    pub ideal_bubble_fraction: f64,
    /// Rank 0's process CPU time per step (all its threads), ms.
    pub cpu_ms_per_step: f64,
    /// Measured steps.
    pub steps: usize,
}

/// Runs the pipeline benchmark as a rank of `pg`; rank 0 writes the result to `out`.
pub fn run_pipeline_bench(
    args: &BenchPipelineArgs,
    pg: &ProcessGroup,
    out: &mut dyn Write,
) -> Result<BenchPipelineResult, TrainError> {
    let (cfg, per_rank, default_steps) = match args.config.as_str() {
        "A" | "a" => (GPTConfig::config_a(), 12, 30),
        "B" | "b" => (GPTConfig::config_b(), 8, 5),
        other => return Err(invalid("config", other.to_string(), "must be A or B")),
    };
    let world = pg.size();
    let batch = args.batch.unwrap_or(per_rank * world);
    let m = args.micro_batches;
    if m == 0 || batch % m != 0 {
        return Err(invalid(
            "micro_batches",
            m.to_string(),
            "must be at least 1 and divide the batch",
        ));
    }
    let (b, t) = (batch / m, cfg.max_position_embeddings);
    let steps = args.steps.unwrap_or(default_steps).max(1);
    let vocab = cfg.vocab_size;
    let mut rank = PipelineRank::new(pg, cfg, args.stages.unwrap_or(0), args.schedule, m, b, 1234)?;
    let (stages, replicas, replica) = (rank.stages(), rank.replicas(), rank.replica());
    let mut tokens = vec![vec![0u32; b * t]; m];
    let mut labels = vec![vec![0i32; b * t]; m];
    let (mut step_s, mut compute_s, mut wait_s) = (vec![], vec![], vec![]);
    let mut cpu0 = 0.0;
    for i in 0..args.warmup + steps {
        if i == args.warmup {
            pg.barrier()
                .map_err(TrainError::comm("barrier before the timed steps"))?;
            cpu0 = process_cpu_ms();
        }
        let t0 = Instant::now();
        for (k, (tok, lab)) in tokens.iter_mut().zip(labels.iter_mut()).enumerate() {
            let stream = ((replica as u64) << 40) ^ ((i as u64) << 20) ^ k as u64;
            crate::random_tokens(vocab, tok, stream);
            lab.iter_mut()
                .zip(tok.iter())
                .for_each(|(l, &x)| *l = x as i32);
        }
        let times = rank.step(&tokens, &labels, 1e-3)?;
        if i >= args.warmup {
            step_s.push(t0.elapsed().as_secs_f64());
            compute_s.push((times.forward + times.backward).as_secs_f64());
            wait_s.push((times.wait + times.reduce).as_secs_f64());
        }
    }
    let cpu_ms = (process_cpu_ms() - cpu0) / steps as f64;
    let sum = |v: &[f64]| v.iter().sum::<f64>();
    let mut med = step_s.clone();
    med.sort_by(f64::total_cmp);
    let mut cmed = compute_s.clone();
    cmed.sort_by(f64::total_cmp);
    let mine = [
        med[med.len() / 2],
        1.0 - sum(&compute_s) / sum(&step_s),
        sum(&wait_s) / sum(&step_s),
        cmed[cmed.len() / 2],
    ];
    let mut all = vec![0f64; 4 * world];
    pg.all_gather(&mine, &mut all)
        .map_err(TrainError::comm("gathering the timings"))?;
    let col = |j: usize| -> Vec<f64> { all.chunks(4).map(|r| r[j]).collect() };
    let slowest = col(0).into_iter().fold(0.0, f64::max);
    let bubbles = col(1);
    let result = BenchPipelineResult {
        bench: "pipeline",
        config: args.config.to_uppercase(),
        world,
        stages,
        replicas,
        schedule: args.schedule,
        micro_batches: m,
        micro_batch_size: b,
        seq: t,
        ms_per_step: slowest * 1e3,
        tokens_per_s: (replicas * batch * t) as f64 / slowest,
        bubble_fraction: sum(&bubbles) / world as f64,
        bubble_per_rank: bubbles,
        wait_fraction_per_rank: col(2),
        compute_ms_per_rank: col(3).iter().map(|x| x * 1e3).collect(),
        ideal_bubble_fraction: (stages - 1) as f64 / (m + stages - 1) as f64,
        cpu_ms_per_step: cpu_ms,
        steps,
    };
    if pg.rank() == 0 {
        let line = if args.json {
            serde_json::to_string(&result).unwrap_or_default()
        } else {
            format!(
                "config {}, {} stage(s) x {} replica(s), {}, {} micro-batches of {}: \
                 ms_per_step {:.1}, tokens_per_s {:.0}, bubble {:.3} (per rank {:?}, ideal {:.3}), \
                 wait share per rank {:?}, compute ms per rank {:?}",
                result.config,
                stages,
                replicas,
                args.schedule,
                m,
                b,
                result.ms_per_step,
                result.tokens_per_s,
                result.bubble_fraction,
                result
                    .bubble_per_rank
                    .iter()
                    .map(|x| (x * 1e3).round() / 1e3)
                    .collect::<Vec<_>>(),
                result.ideal_bubble_fraction,
                result
                    .wait_fraction_per_rank
                    .iter()
                    .map(|x| (x * 1e3).round() / 1e3)
                    .collect::<Vec<_>>(),
                result
                    .compute_ms_per_rank
                    .iter()
                    .map(|x| x.round())
                    .collect::<Vec<_>>(),
            )
        };
        writeln!(out, "{line}").map_err(TrainError::Log)?;
    }
    Ok(result)
}
