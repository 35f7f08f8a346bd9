//! Time of config B's attention (batch 8, 256 positions, 6 heads of 64) forward and backward,
//! for one layer and for the model's six, without the rest of a training step.
//!
//! ```sh
//! cargo run --release -p cohort-engine --example attention_rates -- [fp32|bf16|bf16-qkv] [threads]
//! COHORT_FUSED_ATTENTION=0 cargo run ...   # bf16 through the general product, not fused heads
//! ```
//!
//! `bf16-qkv`: bf16 with the qkv buffer kept in bf16, as a model under bf16 products keeps it
//! (`attention_forward_bf16_qkv`).

use std::time::Instant;

use cohort_engine::cpu::{
    attention_backward, attention_backward_bf16_qkv, attention_forward, attention_forward_bf16_qkv,
    attention_scratch_len, round_to_bf16, AttnDims,
};
use cohort_engine::DType;

fn main() {
    let mut args = std::env::args().skip(1);
    let (dtype, qkv16) = match args.next().as_deref() {
        Some("fp32") => (DType::F32, false),
        Some("bf16-qkv") => (DType::Bf16, true),
        _ => (DType::Bf16, false),
    };
    let threads: usize = args.next().map_or(1, |t| t.parse().expect("threads"));
    let dims = AttnDims {
        b: 8,
        t: 256,
        c: 384,
        nh: 6,
    };
    let AttnDims { b, t, c, nh } = dims;
    let wave = |n: usize, m: usize| -> Vec<f32> {
        (0..n)
            .map(|i| ((i * m % 1000) as f32 - 500.0) * 0.002)
            .collect()
    };
    let (qkv, dout) = (wave(b * t * 3 * c, 7919), wave(b * t * c, 104_729));
    let mut q16 = vec![0u16; qkv.len()];
    round_to_bf16(&mut q16, &qkv);
    let (mut out, mut lse) = (vec![0f32; b * t * c], vec![0f32; b * nh * t]);
    let mut dqkv = vec![0f32; b * t * 3 * c];
    let mut scratch = vec![0f32; attention_scratch_len(t, threads)];
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .expect("thread pool");
    let n = 30;
    pool.install(|| {
        let start = Instant::now();
        for _ in 0..n {
            let (o, l, s) = (&mut out[..], &mut lse[..], &mut scratch[..]);
            if qkv16 {
                attention_forward_bf16_qkv(dtype, o, l, &q16, None, None, dims, nh, None, s);
            } else {
                attention_forward(dtype, o, l, &qkv, None, None, dims, None, s);
            }
        }
        let fwd = start.elapsed().as_secs_f64() * 1e3 / n as f64;
        let start = Instant::now();
        for _ in 0..n {
            let (dq, s) = (&mut dqkv[..], &mut scratch[..]);
            if qkv16 {
                let q = &q16;
                attention_backward_bf16_qkv(
                    dtype, dq, None, &dout, q, &lse, None, None, dims, nh, None, s,
                );
            } else {
                attention_backward(
                    dtype, dq, None, &dout, &qkv, &lse, None, None, dims, None, s,
                );
            }
        }
        let bwd = start.elapsed().as_secs_f64() * 1e3 / n as f64;
        println!(
            "config B attention, {dtype:?}{}, {threads} thread(s): forward {fwd:.2} ms, backward \
             {bwd:.2} ms per layer (six layers: {:.1} / {:.1} ms)",
            if qkv16 { " (qkv in bf16)" } else { "" },
            6.0 * fwd,
            6.0 * bwd
        );
    });
}
