//! A LayerNorm and the bf16 product that reads its output, as a bf16 training step runs them
//! (config B's qkv: 2048 tokens, d 384 -> 1152; config G's: 1024 tokens, d 768 -> 2304), one
//! thread: the LayerNorm writing f32 and the product rounding it as it packs it, against the
//! LayerNorm writing bf16 and the product reading those bits (the same bits out). The
//! LayerNorm alone, forward (LayerNorm then product) and the weight gradient (dW += ln_outᵀ · dY, with the bias's column
//! sums) apart, old and new alternating call by call; each figure is the median of 15 calls.
//! Inputs cycle through copies beyond L2, as a step meets them (written by the previous layer).
//!
//! ```sh
//! cargo run --release -p cohort-engine --example ln_product
//! ```

use std::time::Instant;

use cohort_engine::cpu::{
    bf16_supported, layernorm_forward, layernorm_forward_bf16, matmul_backward,
    matmul_backward_weight_bf16_input, matmul_forward, matmul_forward_bf16_input,
};
use cohort_engine::DType;

const CALLS: usize = 15;
/// Copies of the LayerNorm's input cycled through.
const COPIES: usize = 4;

fn main() {
    if !bf16_supported() {
        eprintln!("ln_product: this CPU has no bf16 product");
        std::process::exit(2);
    }
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build()
        .expect("a one-thread pool");
    println!(
        "{:<10} {:<8} {:>10} {:>10} {:>7}",
        "config", "part", "f32 ms", "bf16 ms", "ratio"
    );
    for (name, n, c, oc) in [("B qkv", 2048, 384, 1152), ("G qkv", 1024, 768, 2304)] {
        pool.install(|| run(name, n, c, oc));
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Deterministic values in [-1, 1).
fn values(len: usize, seed: u32) -> Vec<f32> {
    let mut s = seed.wrapping_mul(2_654_435_761).max(1);
    (0..len)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 17;
            s ^= s << 5;
            (s as f32 / u32::MAX as f32) * 2.0 - 1.0
        })
        .collect()
}

fn run(name: &str, n: usize, c: usize, oc: usize) {
    let d = DType::Bf16;
    let xs: Vec<Vec<f32>> = (0..COPIES as u32).map(|k| values(n * c, k + 1)).collect();
    let (w, b, lw, lb) = (
        values(c * oc, 11),
        values(oc, 12),
        values(c, 13),
        values(c, 14),
    );
    let dy = values(n * oc, 15);
    let (mut ln32, mut ln16) = (vec![0f32; n * c], vec![0u16; n * c]);
    let (mut mean, mut rstd) = (vec![0f32; n], vec![0f32; n]);
    let mut out = vec![0f32; n * oc];
    let (mut dw, mut db) = (vec![0f32; c * oc], vec![0f32; oc]);
    let (mut fwd, mut wgrad) = ([Vec::new(), Vec::new()], [Vec::new(), Vec::new()]);
    let mut ln = [Vec::new(), Vec::new()];
    let mut bits = [Vec::new(), Vec::new()];
    for call in 0..CALLS + 2 {
        let x = &xs[call % COPIES];
        for (k, bf16) in [(0, false), (1, true)] {
            let t = Instant::now();
            if bf16 {
                layernorm_forward_bf16(&mut ln16, &mut mean, &mut rstd, x, &lw, Some(&lb), n, c);
            } else {
                layernorm_forward(&mut ln32, &mut mean, &mut rstd, x, &lw, Some(&lb), n, c);
            }
            let l = t.elapsed().as_secs_f64() * 1e3;
            if bf16 {
                matmul_forward_bf16_input(d, &mut out, &ln16, &w, Some(&b), n, c, oc);
            } else {
                matmul_forward(d, &mut out, &ln32, &w, Some(&b), n, c, oc);
            }
            let f = t.elapsed().as_secs_f64() * 1e3;
            let t = Instant::now();
            if bf16 {
                matmul_backward_weight_bf16_input(
                    d,
                    &mut dw,
                    Some(&mut db),
                    &dy,
                    &ln16,
                    n,
                    c,
                    oc,
                    true,
                );
            } else {
                let (dw, db) = (&mut dw, Some(&mut db[..]));
                matmul_backward(d, None, dw, db, &dy, &ln32, &w, n, c, oc, true);
            }
            let g = t.elapsed().as_secs_f64() * 1e3;
            // the first two calls warm the caches and the pages
            if call >= 2 {
                ln[k].push(l);
                fwd[k].push(f);
                wgrad[k].push(g);
            }
            if call == 0 {
                bits[k] = out.iter().map(|v| v.to_bits()).collect();
            }
        }
    }
    assert!(bits[0] == bits[1], "{name}: the two paths' products differ");
    for (part, times) in [("ln", ln), ("ln+fwd", fwd), ("wgrad", wgrad)] {
        let [a, b] = times.map(median);
        println!("{name:<10} {part:<8} {a:>10.3} {b:>10.3} {:>7.3}", b / a);
    }
}
