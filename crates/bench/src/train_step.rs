//! The single-process training benchmark behind `cohort bench train`: the same model, data and
//! optimizer as PyTorch's reference script (`bench_single.py`): random token
//! ids, AdamW lr 1e-3 with PyTorch's defaults, dropout 0.
//!
//! Beside the times it reports the model FLOPs utilisation: the step's FLOPs by llm.c's count
//! ([`GPTConfig::train_flops_per_token`]) over the median step time, as a share of the peak of
//! the instruction the products use, measured at start in this process on the same threads
//! ([`cpu::product_peak`]); and, per phase, the time outside the matrix products (the kernels
//! the profile names `matmul_*` and `head_*`, with what is fused into them) as a share of the
//! step.
//!
//! It only measures; it never writes files. Peak RSS comes from /proc/self/status (VmHWM).

use std::time::{Duration, Instant};

use cohort_engine::cpu::{self, Cpu};
use cohort_engine::optim::{AdamW, AdamWConfig, DecayMask, Optimizer};
use cohort_engine::{Backend, DType};
use serde::Serialize;

use cohort_gpt::{Backward, Forward, GPTConfig, GptError, Labels, GPT};
use cohort_train::{device_backend, peak_rss_mb, process_cpu_ms, DeviceChoice};

/// The benchmark configurations A, B, G and S (model config and batch size), as PyTorch's
/// reference scripts define them (S: `transformers`' `LlamaForCausalLM` of SmolLM2-135M's shape,
/// docs/bench/bench_llama.py).
pub fn bench_config(name: &str) -> Option<(GPTConfig, usize)> {
    match name {
        "A" | "a" => Some((GPTConfig::config_a(), 12)),
        "B" | "b" => Some((GPTConfig::config_b(), 8)),
        "G" | "g" => Some((GPTConfig::config_g(), 4)),
        "S" | "s" => Some((GPTConfig::config_s(), 4)),
        _ => None,
    }
}

/// What to run.
#[derive(Clone, Debug)]
pub struct TrainBench {
    /// "A", "B", "G" or "S".
    pub config: String,
    /// Intra-op threads.
    pub threads: usize,
    /// Timed steps.
    pub steps: usize,
    /// Untimed steps first (arena allocation, page faults, caches).
    pub warmup: usize,
    /// Seed for the init and the token ids.
    pub seed: u64,
    /// What the matrix products compute in.
    pub precision: DType,
    /// Keep only each block's input and recompute the block inside backward.
    pub activation_checkpointing: bool,
    /// Where the step computes (`--device`): on a device, each phase ends with a sync, so
    /// that its host clock covers the kernels it launched; no product peak or kernel profile.
    pub device: DeviceChoice,
    /// Sequences per step instead of the config's.
    pub batch: Option<usize>,
    /// Sequence length instead of the config's (the model's positions follow it).
    pub seq: Option<usize>,
}

/// Median of one phase (ms) and the time per kernel (ms per step, mean over timed steps).
#[derive(Clone, Debug, Serialize)]
pub struct BenchReport {
    /// Always "train".
    pub bench: &'static str,
    /// "A", "B", "G" or "S".
    pub config: String,
    /// Intra-op threads.
    pub threads: usize,
    /// Parameter count.
    pub params: usize,
    /// Batch size.
    pub batch: usize,
    /// Sequence length.
    pub seq: usize,
    /// Timed steps.
    pub steps: usize,
    /// Median ms per step (zero_grad + forward + backward + AdamW).
    pub ms_per_step: f64,
    /// Fastest step (ms).
    pub min_ms: f64,
    /// Median forward (ms), including zero_grad as the PyTorch script does.
    pub fwd_ms: f64,
    /// Median backward (ms).
    pub bwd_ms: f64,
    /// Median optimizer step (ms).
    pub opt_ms: f64,
    /// Tokens per second at the median step.
    pub tokens_per_s: f64,
    /// Process CPU time (user + system, all threads) per timed step, in ms. On a machine shared
    /// with other work this, for one thread, is close to what the step takes on an idle core.
    pub cpu_ms_per_step: f64,
    /// Peak resident set size (MB, VmHWM).
    pub rss_mb: f64,
    /// Loss of the last step.
    pub final_loss: f32,
    /// Mean ms per step spent in each kernel, in pipeline order.
    pub kernels_ms: Vec<(String, f64)>,
    /// The SIMD level the kernels dispatched to.
    pub simd: String,
    /// What the matrix products computed in ("fp32" where bf16 was asked for on a CPU without
    /// it).
    pub precision: String,
    /// Whether activation checkpointing was on.
    pub activation_checkpointing: bool,
    /// Activation bytes (MB) the model holds, from its memory estimate.
    pub activations_mb: f64,
    /// Model FLOPs of one step (llm.c's count: 6·N + 6·L·C·T per token, N the weights of the
    /// products).
    pub flops_per_step: f64,
    /// flops_per_step over the median step time (GFLOP/s).
    pub gflops: f64,
    /// The instruction the products use, whose peak `mfu` is a share of (None without FMA).
    pub peak_instruction: Option<String>,
    /// Its peak on this run's threads at once, measured at start (GFLOP/s).
    pub peak_gflops: Option<f64>,
    /// Model FLOPs utilisation: gflops / peak_gflops.
    pub mfu: Option<f64>,
    /// The time outside the matrix products, per phase, as shares of the step.
    pub outside_products: OutsideProducts,
    /// Where it ran (`cpu`, `cuda:0`, ...).
    pub device: String,
}

/// The time outside the matrix products (the Linear layers' and the LM head's kernels, with
/// what is fused into them) per phase, as a share of the whole step (means over the timed
/// steps). Attention (its T x T products interleaved with the softmax) counts outside;
/// `attention` says how much of it that is.
#[derive(Clone, Copy, Debug, Default, Serialize)]
pub struct OutsideProducts {
    /// Forward (with zero_grad).
    pub fwd: f64,
    /// Backward (with the forward recomputed under activation checkpointing).
    pub bwd: f64,
    /// The optimizer step (all of it).
    pub opt: f64,
    /// The three together.
    pub total: f64,
    /// The attention kernels, forward and backward.
    pub attention: f64,
}

/// Whether a profiled kernel is a matrix product.
fn is_product(kernel: &str) -> bool {
    kernel.starts_with("matmul_") || kernel.starts_with("head_")
}

/// Seconds the product kernels have taken so far.
fn product_secs(model: &GPT) -> f64 {
    model
        .kernel_times()
        .iter()
        .filter(|(k, _)| is_product(k))
        .map(|(_, d)| d.as_secs_f64())
        .sum()
}

fn median(x: &mut [f64]) -> f64 {
    x.sort_by(|a, b| a.total_cmp(b));
    x[x.len() / 2]
}

/// Runs the benchmark.
pub fn run_train_bench(spec: &TrainBench) -> Result<BenchReport, GptError> {
    let (mut cfg, batch) = bench_config(&spec.config).ok_or_else(|| GptError::Config {
        field: "bench config",
        reason: format!("{:?} is not A, B, G or S", spec.config),
    })?;
    let batch = spec.batch.unwrap_or(batch);
    if let Some(seq) = spec.seq {
        cfg.max_position_embeddings = seq;
    }
    let t = cfg.max_position_embeddings;
    let v = cfg.vocab_size as u64;
    let cfg_flops_per_token = cfg.train_flops_per_token(t);
    if spec.steps == 0 {
        return Err(GptError::Config {
            field: "bench steps",
            reason: "must be at least 1".into(),
        });
    }
    let on_device = spec.device.is_device();
    // A CPU's product peak is measured before the model's arena exists, on the threads the
    // step will use; a device has none here.
    let (dev, peak): (Box<dyn Backend>, _) = if on_device {
        let dev = device_backend(spec.device, spec.threads, spec.precision).map_err(|e| {
            GptError::Engine {
                op: "device",
                reason: e.to_string(),
            }
        })?;
        (dev, None)
    } else {
        let cpu = Cpu::with_dtype(spec.threads, spec.precision).map_err(|e| GptError::Engine {
            op: "thread pool",
            reason: e.to_string(),
        })?;
        if cpu.dtype() != spec.precision {
            eprintln!(
                "bench train: {} needs AVX-512 with AVX512_BF16, which this CPU lacks; timing {}",
                spec.precision,
                cpu.dtype()
            );
        }
        let peak = cpu::product_peak(&cpu);
        (Box::new(cpu), peak)
    };
    let precision = dev.dtype().to_string();
    let device = dev.device().to_string();
    let activations_mb = GPT::memory_estimate(
        &cfg,
        batch * t,
        spec.threads,
        spec.activation_checkpointing,
        dev.dtype(),
    )
    .activations as f64
        / (1 << 20) as f64;
    let mut model = if on_device {
        // Drawn on the host, as every run's initial parameters are, then uploaded.
        GPT::new(cfg, spec.seed)?.to_backend(dev)?
    } else {
        GPT::with_backend(cfg, spec.seed, dev)?
    };
    model.set_activation_checkpointing(spec.activation_checkpointing);
    let n = model.num_params();
    let opt_err = |e: cohort_engine::optim::OptimError| GptError::Engine {
        op: "AdamW",
        reason: e.to_string(),
    };
    let mut opt = match on_device {
        true => AdamW::new_on(model.backend(), AdamWConfig::default(), DecayMask::all(n)),
        false => AdamW::new(AdamWConfig::default(), DecayMask::all(n)),
    }
    .map_err(opt_err)?;
    // On a device, a phase's time runs to the end of its kernels.
    let sync = |model: &GPT| -> Result<(), GptError> {
        if on_device {
            model.backend().sync().map_err(|e| GptError::Engine {
                op: "sync",
                reason: e.to_string(),
            })?;
        }
        Ok(())
    };
    // Random ids with targets = the next id, as the reference (data[:, :-1], data[:, 1:]):
    // labels aligned with the inputs and shifted inside the model.
    let mut state = spec.seed ^ 0x5eed;
    let mut next_id = move || {
        state = state
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        ((state >> 33) % v) as u32
    };
    let mut ids = vec![0u32; batch * t];
    let mut labels = vec![0i32; batch * t];
    let (mut fwd, mut bwd, mut optm, mut total) = (vec![], vec![], vec![], vec![]);
    // Seconds summed over the timed steps: forward and backward, and their products.
    let (mut fwd_s, mut bwd_s, mut fwd_prod_s, mut bwd_prod_s) = (0.0, 0.0, 0.0, 0.0);
    let mut loss = 0.0;
    let mut cpu0 = 0.0;
    for step in 0..spec.warmup + spec.steps {
        ids.iter_mut().for_each(|x| *x = next_id());
        labels
            .iter_mut()
            .zip(&ids)
            .for_each(|(l, &x)| *l = x as i32);
        if step == spec.warmup {
            model.reset_kernel_times();
            cpu0 = process_cpu_ms();
        }
        let p0 = product_secs(&model);
        let t0 = Instant::now();
        model.zero_grad();
        loss = model
            .forward(Forward::new(&ids, batch, t).labels(Labels::Aligned(&labels)))?
            .unwrap_or(0.0);
        let t1 = Instant::now();
        let p1 = product_secs(&model);
        model.backward(Backward::new())?;
        sync(&model)?;
        let t2 = Instant::now();
        let p2 = product_secs(&model);
        if on_device {
            let (dev, params, grads) = model.params_and_grads_views();
            opt.step_on(dev, params, grads, 1e-3).map_err(opt_err)?;
        } else {
            model
                .update_params(|params, grads| opt.step(params, grads, 1e-3))
                .map_err(opt_err)?;
        }
        sync(&model)?;
        let t3 = Instant::now();
        if step >= spec.warmup {
            let ms = |d: Duration| d.as_secs_f64() * 1e3;
            fwd.push(ms(t1 - t0));
            bwd.push(ms(t2 - t1));
            optm.push(ms(t3 - t2));
            total.push(ms(t3 - t0));
            fwd_s += (t1 - t0).as_secs_f64();
            bwd_s += (t2 - t1).as_secs_f64();
            fwd_prod_s += p1 - p0;
            bwd_prod_s += p2 - p1;
        }
    }
    let steps = spec.steps.max(1) as f64;
    let cpu_ms_per_step = (process_cpu_ms() - cpu0) / steps;
    let ms_per_step = median(&mut total);
    let opt_s = optm.iter().sum::<f64>() / 1e3;
    let step_s = (fwd_s + bwd_s + opt_s).max(1e-12);
    let attention_s: f64 = model
        .kernel_times()
        .iter()
        .filter(|(k, _)| k.starts_with("attention_"))
        .map(|(_, d)| d.as_secs_f64())
        .sum();
    let outside_products = OutsideProducts {
        fwd: (fwd_s - fwd_prod_s).max(0.0) / step_s,
        bwd: (bwd_s - bwd_prod_s).max(0.0) / step_s,
        opt: opt_s / step_s,
        total: (step_s - fwd_prod_s - bwd_prod_s).max(0.0) / step_s,
        attention: attention_s / step_s,
    };
    let flops_per_step = cfg_flops_per_token * (batch * t) as f64;
    let gflops = flops_per_step / (ms_per_step / 1e3) / 1e9;
    Ok(BenchReport {
        bench: "train",
        config: spec.config.to_uppercase(),
        threads: spec.threads,
        params: n,
        batch,
        seq: t,
        steps: spec.steps,
        ms_per_step,
        min_ms: total[0],
        fwd_ms: median(&mut fwd),
        bwd_ms: median(&mut bwd),
        opt_ms: median(&mut optm),
        tokens_per_s: (batch * t) as f64 / (ms_per_step / 1e3),
        cpu_ms_per_step,
        rss_mb: peak_rss_mb(),
        final_loss: loss,
        kernels_ms: model
            .kernel_times()
            .into_iter()
            .map(|(k, d)| (k.to_string(), d.as_secs_f64() * 1e3 / steps))
            .collect(),
        simd: format!("{:?}", cohort_engine::cpu::simd_level()),
        precision,
        activation_checkpointing: spec.activation_checkpointing,
        activations_mb,
        flops_per_step,
        gflops,
        peak_instruction: peak.map(|p| p.instruction.to_string()),
        peak_gflops: peak.map(|p| p.gflops),
        mfu: peak.map(|p| gflops / p.gflops),
        outside_products,
        device,
    })
}
