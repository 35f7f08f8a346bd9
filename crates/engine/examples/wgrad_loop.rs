//! One bf16 product of a block in a loop, one thread, for `perf record` / `perf annotate`: the
//! weight gradient (`w`; `wb` with the bias's column sums), the forward (`f`; `fb` with a bias)
//! or the input gradient (`i`) of a Linear layer of `N` tokens, `K` inputs and `OC` outputs
//! (defaults: config G's qkv, 1024 x 768 x 2304), for `SECS` seconds, then the median call.
//! Every matrix is 64-byte aligned, as the model's are.
//!
//! ```sh
//! cargo run --release -p cohort-engine --example wgrad_loop -- w 768 2304 5 1024
//! perf record -e cpu-clock target/release/examples/wgrad_loop w 768 2304 5
//! ```
use std::time::Instant;

use cohort_engine::cpu::{self, Cpu};
use cohort_engine::{AlignedFloats, DType};

/// `len` floats, 64-byte aligned, element i = (i % `m`) / 100.
fn filled(len: usize, m: usize) -> AlignedFloats {
    let mut v = AlignedFloats::zeroed(len);
    for (i, x) in v.as_mut_slice().iter_mut().enumerate() {
        *x = (i % m) as f32 * 0.01;
    }
    v
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let which = args.get(1).cloned().unwrap_or_else(|| "w".into());
    let k: usize = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(768);
    let oc: usize = args.get(3).and_then(|s| s.parse().ok()).unwrap_or(2304);
    let secs: f64 = args.get(4).and_then(|s| s.parse().ok()).unwrap_or(5.0);
    let n: usize = args.get(5).and_then(|s| s.parse().ok()).unwrap_or(1024);
    if !["w", "wb", "f", "fb", "i"].contains(&which.as_str()) {
        eprintln!("wgrad_loop: unknown product {which:?} (expected w, wb, f, fb or i)");
        std::process::exit(2);
    }
    let cpu = Cpu::with_dtype(1, DType::Bf16).expect("a thread pool");
    let inp = filled(n * k, 17);
    let w = filled(k * oc, 13);
    let bias = filled(oc, 7);
    let (mut out, mut dinp, mut dw, mut db) = (
        filled(n * oc, 11),
        AlignedFloats::zeroed(n * k),
        AlignedFloats::zeroed(k * oc),
        AlignedFloats::zeroed(oc),
    );
    let (inp, w, bias) = (&inp[..], &w[..], &bias[..]);
    let d = DType::Bf16;
    let t0 = Instant::now();
    let mut calls = 0;
    let mut times = vec![];
    cpu.install(|| {
        while t0.elapsed().as_secs_f64() < secs {
            let t = Instant::now();
            let (out, dinp, dw, db) = (
                out.as_mut_slice(),
                dinp.as_mut_slice(),
                dw.as_mut_slice(),
                db.as_mut_slice(),
            );
            match which.as_str() {
                "f" => cpu::matmul_forward(d, out, inp, w, None, n, k, oc),
                "fb" => cpu::matmul_forward(d, out, inp, w, Some(bias), n, k, oc),
                "i" => cpu::matmul_backward_input(d, dinp, out, w, n, k, oc),
                "wb" => cpu::matmul_backward(d, None, dw, Some(db), out, inp, w, n, k, oc, true),
                _ => cpu::matmul_backward(d, None, dw, None, out, inp, w, n, k, oc, true),
            }
            times.push(t.elapsed().as_secs_f64());
            calls += 1;
        }
    });
    times.sort_by(f64::total_cmp);
    let med = times[times.len() / 2];
    println!(
        "{which} {n}x{k}x{oc}: {calls} calls, median {:.2} ms, {:.0} GFLOP/s",
        med * 1e3,
        2.0 * (n * k * oc) as f64 / med / 1e9
    );
}
