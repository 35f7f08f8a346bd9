//! How long one batched decode step takes as the number of generations in it grows: the cost
//! behind the server's inter-token latency with in-flight batching, without the server.
//!
//! ```sh
//! cargo run --release -p cohort-gpt --example decode_rate -- [threads] [fp32|bf16]
//! ROWS=32 cargo run ...      # one batch size only (for a profiler)
//! PRODUCTS=1 cargo run ...   # the block's four matrix products alone, at 1, 8 and 32 rows
//! KV=bf16 cargo run ...      # the generations' KV caches in bf16 (default fp32)
//! ```

use std::time::Instant;

use cohort_engine::cpu::Cpu;
use cohort_engine::DType;
use cohort_gpt::sample::{decode_step, Generation, KvDtype, SampleOptions, Workspace};
use cohort_gpt::{GPTConfig, GPT};

fn main() {
    let mut args = std::env::args().skip(1);
    let threads: usize = args.next().map_or(2, |t| t.parse().expect("threads"));
    let dtype = match args.next().as_deref() {
        Some("bf16") => DType::Bf16,
        _ => DType::F32,
    };
    let cfg = GPTConfig::config_b();
    let mut model = GPT::with_backend(cfg, 0, Box::new(Cpu::new(threads).unwrap())).unwrap();
    let got = model.set_precision(dtype).unwrap();
    let kv: KvDtype = std::env::var("KV").map_or(KvDtype::F32, |k| k.parse().expect("KV"));
    println!("config B, {threads} threads, {got:?}, KV cache {kv}");
    if std::env::var_os("PRODUCTS").is_some() {
        for rows in [1, 8, 32] {
            products(rows, got);
        }
        return;
    }
    let only: Option<usize> = std::env::var("ROWS").ok().and_then(|r| r.parse().ok());
    for rows in [1usize, 2, 4, 8, 16, 32] {
        if only.is_some_and(|o| o != rows) {
            continue;
        }
        let mut ws = Workspace::new(&model);
        let mut gens: Vec<Generation> = (0..rows)
            .map(|i| {
                let prompt: Vec<u32> = (0..16).map(|j| ((i * 7 + j * 3) % 65) as u32).collect();
                let opts = SampleOptions {
                    max_new_tokens: 128,
                    temperature: 0.8,
                    top_k: None,
                    top_p: 1.0,
                    seed: i as u64,
                };
                Generation::with_kv_dtype(&model, &prompt, &opts, kv).unwrap()
            })
            .collect();
        // the prompt step, then decode steps only
        decode_step(&model, &mut gens, &mut ws).unwrap();
        let mut times = Vec::new();
        for _ in 0..100 {
            let t = Instant::now();
            decode_step(&model, &mut gens, &mut ws).unwrap();
            times.push(t.elapsed().as_secs_f64() * 1e3);
        }
        times.sort_by(f64::total_cmp);
        println!(
            "{rows:>3} rows: step p50 {:.2} ms, p99 {:.2} ms, {:.2} ms per row",
            times[50],
            times[98],
            times[50] / rows as f64
        );
    }
}

/// Times the block's four products alone at `rows` rows over six layers' weights (as many
/// bytes as a decode step reads).
fn products(rows: usize, dtype: DType) {
    let (c, f) = (384usize, 1536usize);
    for (k, oc) in [(c, 3 * c), (c, c), (c, f), (f, c)] {
        let ws: Vec<Vec<f32>> = (0..6)
            .map(|l| (0..k * oc).map(|i| ((i + l) % 13) as f32 * 0.01).collect())
            .collect();
        let inp: Vec<f32> = (0..rows * k).map(|i| (i % 17) as f32 * 0.01).collect();
        let mut out = vec![0.0; rows * oc];
        let mut times = Vec::new();
        for _ in 0..50 {
            let t = Instant::now();
            for w in &ws {
                cohort_engine::cpu::matmul_forward(dtype, &mut out, &inp, w, None, rows, k, oc);
            }
            times.push(t.elapsed().as_secs_f64() * 1e3 / 6.0);
        }
        times.sort_by(f64::total_cmp);
        let gflops = 2.0 * (rows * k * oc) as f64 / times[25] / 1e6;
        println!(
            "  {rows:>2} x {k} x {oc}: {:.3} ms ({gflops:.0} GFLOP/s)",
            times[25]
        );
    }
}
