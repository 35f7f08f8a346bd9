//! `cohort bench ...`: benchmarks. `collectives` times the collectives of
//! cohort-comm in the style of nccl-tests; run it under the launcher
//! (`cohort run -n 2 bench collectives`), which sets the `env://` variables,
//! or with `--backend mpi` under `mpirun -np 2` (a build with `--features mpi`).

use anyhow::{bail, Context};
use cohort_bench::collectives::{self as bench, BenchOptions};
use cohort_comm::{
    init_process_group, Algorithm, DType, InitOptions, OpKind, ReduceOp, ALL_COLLECTIVES,
};

/// Benchmarks.
#[derive(clap::Args, Debug)]
pub struct BenchArgs {
    #[command(subcommand)]
    what: BenchWhat,
}

#[derive(clap::Subcommand, Debug)]
enum BenchWhat {
    /// Time collectives over sizes (nccl-tests style); run under `cohort run -n N`.
    Collectives(CollectivesArgs),
    /// Time single-process training steps of the mini-GPT (random tokens, AdamW, dropout 0).
    Train(TrainArgs),
    /// Time data-parallel training steps and the scaling efficiency; run under `cohort run -n N`.
    Ddp(cohort_bench::ddp::BenchDdpArgs),
    /// Time RPC round trips and calls/s between two workers; run under `cohort run -n 2`.
    Rpc(RpcArgs),
    /// Time parameter-server training (rank 0 serves, the others push gradients); run under
    /// `cohort run -n K`.
    Ps(cohort_bench::ps::BenchPsArgs),
    /// Load-test `cohort serve`: throughput and latency with and without dynamic batching.
    Serve(crate::serve::BenchServeArgs),
    /// Time pipeline-parallel training steps and the bubble; run under `cohort run -n S`.
    Pipeline(cohort_bench::pipeline::BenchPipelineArgs),
}

#[derive(clap::Args, Debug)]
struct TrainArgs {
    /// Model and batch: A (4 layers, d 128, seq 64, batch 12), B (6 layers, d 384, seq 256,
    /// batch 8), G (GPT-2 small's shape: 12 layers, d 768, vocab 50304, seq 256, batch 4) or S
    /// (SmolLM2-135M's Llama shape: 30 layers, d 576, 9 heads over 3, seq 512, batch 4).
    #[arg(long, default_value = "A")]
    config: String,
    /// Intra-op threads (default: COHORT_NUM_THREADS, else the cores this process may use).
    #[arg(long)]
    threads: Option<usize>,
    /// Timed steps.
    #[arg(long, default_value_t = 50)]
    steps: usize,
    /// Untimed steps first.
    #[arg(long, default_value_t = 5)]
    warmup: usize,
    /// Seed of the init and the token ids.
    #[arg(long, default_value_t = 1234)]
    seed: u64,
    /// Matrix products in fp32, or bf16 (bf16 inputs, f32 sums and master weights: PyTorch's
    /// CPU autocast).
    #[arg(long, default_value = "fp32")]
    precision: cohort_engine::DType,
    /// Keep only each block's input and recompute the block inside backward.
    #[arg(long)]
    activation_checkpointing: bool,
    /// Where the step computes: cpu, cuda or cuda:N.
    #[arg(long, default_value = "cpu", value_name = "cpu|cuda|cuda:N")]
    device: cohort_train::DeviceChoice,
    /// Sequences per step instead of the config's (GPT-2 124M at T=1024: --config G --seq 1024
    /// --batch 8).
    #[arg(long)]
    batch: Option<usize>,
    /// Sequence length instead of the config's.
    #[arg(long)]
    seq: Option<usize>,
    /// One JSON object instead of a table.
    #[arg(long)]
    json: bool,
}

#[derive(clap::Args, Debug)]
struct CollectivesArgs {
    /// Comma-separated ops (all_reduce, broadcast, reduce, all_gather,
    /// reduce_scatter, gather, scatter, all_to_all, barrier) or `all`.
    #[arg(long, default_value = "all_reduce")]
    op: String,
    /// Smallest size (bytes; K, M, G suffixes are powers of 1024).
    #[arg(short = 'b', long, default_value = "4")]
    min_bytes: String,
    /// Largest size.
    #[arg(short = 'e', long, default_value = "256M")]
    max_bytes: String,
    /// Size multiplier between rows.
    #[arg(short = 'f', long, default_value_t = 2)]
    factor: usize,
    /// Timed iterations per size (default: by size, 500 down to 5).
    #[arg(short = 'n', long)]
    iters: Option<usize>,
    /// Untimed iterations per size (default: a tenth of iters, at least 2).
    #[arg(short = 'w', long)]
    warmup: Option<usize>,
    /// Element type: f32, f64, i32, i64, u8, bf16.
    #[arg(short = 'd', long, default_value = "f32")]
    dtype: String,
    /// Reduce op: sum, avg, product, min, max.
    #[arg(short = 'o', long, default_value = "sum")]
    reduce: String,
    /// Algorithm: auto, ring or tree (default: COHORT_ALGO, else auto).
    #[arg(long)]
    algo: Option<String>,
    /// Collectives library: cohort (ranks from `cohort run`) or mpi (ranks from mpirun or
    /// srun; a build with the `mpi` feature).
    #[arg(long, default_value = "cohort")]
    backend: String,
    /// One JSON object per line instead of a table.
    #[arg(long)]
    json: bool,
}

pub fn main(args: BenchArgs) -> anyhow::Result<()> {
    match args.what {
        BenchWhat::Collectives(a) => collectives(a),
        BenchWhat::Train(a) => train(a),
        BenchWhat::Ddp(a) => ddp(a),
        BenchWhat::Rpc(a) => rpc(a),
        BenchWhat::Ps(a) => {
            cohort_bench::ps::run_ps_bench(&a, &mut std::io::stdout()).context("bench ps")
        }
        BenchWhat::Serve(a) => crate::serve::bench(a),
        BenchWhat::Pipeline(a) => pipeline(a),
    }
}

fn pipeline(a: cohort_bench::pipeline::BenchPipelineArgs) -> anyhow::Result<()> {
    let pg = cohort_train::process_group_from_env().context("bench pipeline")?;
    cohort_bench::pipeline::run_pipeline_bench(&a, &pg, &mut std::io::stdout())
        .context("bench pipeline")?;
    Ok(())
}

#[derive(clap::Args, Debug)]
struct RpcArgs {
    /// Comma-separated payload sizes in bytes, each way (K and M suffixes).
    #[arg(long, default_value = "8,1K")]
    sizes: String,
    /// Timed sequential calls per size.
    #[arg(long, default_value_t = 2000)]
    iters: usize,
    /// Calls of the throughput run.
    #[arg(long, default_value_t = 20000)]
    calls: usize,
    /// Calls in flight at once in the throughput run.
    #[arg(long, default_value_t = 64)]
    window: usize,
    /// One JSON object per line instead of text.
    #[arg(long)]
    json: bool,
}

fn rpc(a: RpcArgs) -> anyhow::Result<()> {
    let env = |name: &str| -> anyhow::Result<usize> {
        std::env::var(name)
            .ok()
            .and_then(|v| v.parse().ok())
            .with_context(|| format!("{name} not set: run under `cohort run -n 2 bench rpc`"))
    };
    let (rank, world) = (env("RANK")?, env("WORLD_SIZE")?);
    if world < 2 {
        bail!("bench rpc needs two workers: `cohort run -n 2 bench rpc`");
    }
    let opts = cohort_bench::rpc::BenchOptions {
        sizes: a
            .sizes
            .split(',')
            .map(parse_size)
            .collect::<anyhow::Result<_>>()?,
        iters: a.iters,
        calls: a.calls,
        window: a.window,
        ..Default::default()
    };
    let mut registry = cohort_rpc::Registry::new();
    cohort_bench::rpc::register(&mut registry);
    let rpc = cohort_rpc::init_rpc(&format!("worker{rank}"), rank, world, registry)
        .context("joining the RPC group")?;
    if rank == 0 {
        for row in cohort_bench::rpc::run(&rpc, 1, &opts).context("bench rpc")? {
            if a.json {
                println!("{}", serde_json::to_string(&row)?);
            } else {
                println!(
                    "{:>8} B: round trip median {:.1} us, p99 {:.1} us, min {:.1} us; \
                     {:.0} calls/s with {} in flight",
                    row.bytes,
                    row.rtt_us_median,
                    row.rtt_us_p99,
                    row.rtt_us_min,
                    row.calls_per_s,
                    row.window
                );
            }
        }
    }
    rpc.shutdown().context("bench rpc shutdown")?;
    Ok(())
}

fn ddp(a: cohort_bench::ddp::BenchDdpArgs) -> anyhow::Result<()> {
    let pg = cohort_train::process_group_from_env().context("bench ddp")?;
    cohort_bench::ddp::run_ddp_bench(&a, &pg, &mut std::io::stdout()).context("bench ddp")?;
    Ok(())
}

fn train(a: TrainArgs) -> anyhow::Result<()> {
    let threads = match a.threads {
        Some(n) => n,
        None => cohort_engine::cpu::threads_from_env()?,
    };
    let spec = cohort_bench::train_step::TrainBench {
        config: a.config.clone(),
        threads,
        steps: a.steps,
        warmup: a.warmup,
        seed: a.seed,
        precision: a.precision,
        activation_checkpointing: a.activation_checkpointing,
        device: a.device,
        batch: a.batch,
        seq: a.seq,
    };
    let r = cohort_bench::train_step::run_train_bench(&spec)
        .with_context(|| format!("bench train --config {}", a.config))?;
    if a.json {
        println!("{}", serde_json::to_string(&r)?);
        return Ok(());
    }
    println!(
        "config {} ({} params, batch {} x seq {}), {} thread(s), {} steps, {}, {}, on {}",
        r.config, r.params, r.batch, r.seq, r.threads, r.steps, r.simd, r.precision, r.device
    );
    println!(
        "ms/step {:.2} (min {:.2}): forward {:.2}, backward {:.2}, optimizer {:.2}",
        r.ms_per_step, r.min_ms, r.fwd_ms, r.bwd_ms, r.opt_ms
    );
    println!(
        "tokens/s {:.0}, CPU time {:.2} ms/step, peak RSS {:.1} MB (activations {:.1} MB{}), \
         final loss {:.4}",
        r.tokens_per_s,
        r.cpu_ms_per_step,
        r.rss_mb,
        r.activations_mb,
        if r.activation_checkpointing {
            ", checkpointed"
        } else {
            ""
        },
        r.final_loss
    );
    let o = &r.outside_products;
    println!(
        "MFU {} ({:.1} GFLOP/step at {:.1} GFLOP/s; {}); outside the products: \
         fwd {:.1}% bwd {:.1}% opt {:.1}% = {:.1}% of the step (attention {:.1}%)",
        r.mfu.map_or("-".into(), |m| format!("{:.1}%", 100.0 * m)),
        r.flops_per_step / 1e9,
        r.gflops,
        match (&r.peak_instruction, r.peak_gflops) {
            (Some(i), Some(p)) => format!("peak of {i} on {} thread(s): {p:.1} GFLOP/s", r.threads),
            _ => "no FMA on this CPU: no peak to compare with".into(),
        },
        100.0 * o.fwd,
        100.0 * o.bwd,
        100.0 * o.opt,
        100.0 * o.total,
        100.0 * o.attention
    );
    println!("per kernel (ms/step):");
    for (k, ms) in &r.kernels_ms {
        println!("  {k:<18} {ms:8.3}");
    }
    Ok(())
}

fn parse_size(s: &str) -> anyhow::Result<usize> {
    let t = s.trim().to_ascii_uppercase();
    let t = t.strip_suffix('B').unwrap_or(&t);
    let (num, mult) = match t.chars().last() {
        Some('K') => (&t[..t.len() - 1], 1usize << 10),
        Some('M') => (&t[..t.len() - 1], 1 << 20),
        Some('G') => (&t[..t.len() - 1], 1 << 30),
        _ => (t, 1),
    };
    let n: usize = num
        .parse()
        .with_context(|| format!("bad size {s:?} (e.g. 4, 64K, 256M)"))?;
    Ok(n * mult)
}

fn collectives(a: CollectivesArgs) -> anyhow::Result<()> {
    let ops: Vec<OpKind> = if a.op == "all" {
        ALL_COLLECTIVES.to_vec()
    } else {
        a.op.split(',')
            .map(|s| {
                OpKind::parse(s.trim())
                    .filter(|k| ALL_COLLECTIVES.contains(k))
                    .with_context(|| format!("unknown collective {s:?}"))
            })
            .collect::<anyhow::Result<_>>()?
    };
    let opts = BenchOptions {
        ops,
        min_bytes: parse_size(&a.min_bytes)?,
        max_bytes: parse_size(&a.max_bytes)?,
        factor: a.factor,
        iters: a.iters,
        warmup: a.warmup,
        dtype: DType::parse(&a.dtype).with_context(|| format!("unknown dtype {:?}", a.dtype))?,
        reduce: ReduceOp::parse(&a.reduce)
            .with_context(|| format!("unknown reduce op {:?}", a.reduce))?,
    };
    if opts.factor < 2 {
        bail!("--factor must be at least 2");
    }
    let how = match a.backend.as_str() {
        "mpi" => "joining the MPI job (run under `mpirun -np N`)",
        _ => "joining the process group (run under `cohort run -n N bench collectives`)",
    };
    let pg = init_process_group(&a.backend, "env://", InitOptions::default()).context(how)?;
    if let Some(algo) = &a.algo {
        pg.set_algorithm(
            Algorithm::parse(algo)
                .with_context(|| format!("unknown algorithm {algo:?} (auto, ring, tree)"))?,
        );
    }
    let lead = pg.rank() == 0;
    if lead && !a.json {
        println!(
            "{}",
            bench::text_header(pg.size(), &opts, pg.backend_name())
        );
    }
    bench::run(&pg, &opts, |row| {
        if lead {
            if a.json {
                println!("{}", row.to_json());
            } else {
                println!("{}", bench::text_row(row));
            }
        }
    })
    .context("benchmark failed")?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::parse_size;

    #[test]
    fn sizes() {
        assert_eq!(parse_size("4").unwrap(), 4);
        assert_eq!(parse_size("64K").unwrap(), 65536);
        assert_eq!(parse_size("256MB").unwrap(), 256 << 20);
        assert!(parse_size("lots").is_err());
    }
}
