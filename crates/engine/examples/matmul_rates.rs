//! GFLOP/s of the matrix kernels on config B's shapes (2048 tokens; d 384; d_ff 1536) or config
//! G's (1024 tokens; d 768; d_ff 3072), one thread: the forward product, the input gradient and
//! the weight gradient of each of a block's four Linear layers, in the precision given (`fp32`
//! or `bf16`). `THREADS=2` runs them on a pool of two (the thread split of a training step).
//! Each figure is the median of 20 calls. It first measures the peak of the instruction the
//! products use (FMA, VDPBF16PS or AMX tiles; [`cpu::product_peak`]) on all the threads at once,
//! and it reports the twelve products of a block together as a fraction of it. The matrices are
//! 64-byte aligned, as the model's buffers are (a plain `Vec` of megabytes starts 16 bytes off a
//! line, and a weight gradient, which reads its C back, measured 3-12% slower on that alone).
//!
//! ```sh
//! cargo run --release -p cohort-engine --example matmul_rates -- bf16 [B|G]
//! COHORT_AMX=0 cargo run --release -p cohort-engine --example matmul_rates -- bf16  # zmm kernel
//! COLD=1 cargo run --release -p cohort-engine --example matmul_rates -- bf16 G  # operands cold
//! ```
//!
//! `COLD=1` writes 256 MB between calls (untimed), so each call finds its operands beyond the
//! caches, as a training step's products do (each weight is read once per pass).

use std::time::Instant;

use cohort_engine::cpu::{self, Cpu};
use cohort_engine::{AlignedFloats, DType};

fn main() {
    let dtype: DType = match std::env::args()
        .nth(1)
        .unwrap_or_else(|| "bf16".into())
        .parse()
    {
        Ok(d) => d,
        Err(e) => {
            eprintln!("matmul_rates: {e}");
            std::process::exit(2);
        }
    };
    let threads = std::env::var("THREADS")
        .ok()
        .and_then(|t| t.parse().ok())
        .unwrap_or(1);
    let cpu = Cpu::with_dtype(threads, dtype).expect("a thread pool");
    println!("{threads} thread(s)");
    match (cpu.dtype(), cpu::bf16_kernel_name()) {
        (DType::Bf16, Some(kernel)) => println!("bf16 on {kernel}"),
        (d, _) => println!("{d}"),
    }
    // The peak of the instruction the products use, all threads at once, registers only.
    let peak = cpu::product_peak(&cpu);
    if let Some(p) = peak {
        println!(
            "{} peak, {} thread(s): {:.0} GFLOP/s (registers only)",
            p.instruction, p.threads, p.gflops
        );
    }
    // The block's twelve products together: their flops over the sum of their times.
    let (mut block_gflop, mut block_s) = (0.0, 0.0);
    let (n, c) = match std::env::args().nth(2).as_deref() {
        None | Some("B") => (2048usize, 384usize),
        Some("G") => (1024, 768),
        Some(other) => {
            eprintln!("matmul_rates: unknown config {other:?} (expected B or G)");
            std::process::exit(2);
        }
    };
    for (k, oc) in [(c, 3 * c), (c, c), (c, 4 * c), (4 * c, c)] {
        let (inp, w) = (filled(n * k, 17), filled(k * oc, 13));
        let (mut out, mut dinp, mut dw) = (
            AlignedFloats::zeroed(n * oc),
            AlignedFloats::zeroed(n * k),
            AlignedFloats::zeroed(k * oc),
        );
        let time = |f: &mut dyn FnMut()| seconds_per_call(20, f);
        let d = cpu.dtype();
        let fwd = cpu
            .install(|| time(&mut || cpu::matmul_forward(d, &mut out, &inp, &w, None, n, k, oc)));
        let bin = cpu
            .install(|| time(&mut || cpu::matmul_backward_input(d, &mut dinp, &out, &w, n, k, oc)));
        let bw = cpu.install(|| {
            time(&mut || {
                cpu::matmul_backward(d, None, &mut dw, None, &out, &inp, &w, n, k, oc, true)
            })
        });
        let gflop = 2.0 * (n * k * oc) as f64 / 1e9;
        block_gflop += 3.0 * gflop;
        block_s += fwd + bin + bw;
        println!(
            "{n}x{k}x{oc}: forward {:.2} ms ({:.0} GFLOP/s), input grad {:.2} ms ({:.0}), weight grad {:.2} ms ({:.0})",
            fwd * 1e3,
            gflop / fwd,
            bin * 1e3,
            gflop / bin,
            bw * 1e3,
            gflop / bw
        );
    }
    let block = block_gflop / block_s;
    match peak {
        Some(p) => println!(
            "block (12 products): {block:.0} GFLOP/s, {:.0}% of the peak",
            100.0 * block / p.gflops
        ),
        None => println!("block (12 products): {block:.0} GFLOP/s"),
    }
    // The LM head over one block of the vocabulary (the weight is nn.Linear's [out, in]), or
    // over HEAD_V columns (config G's whole vocabulary: HEAD_V=50304).
    let v = std::env::var("HEAD_V")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(4096);
    let (inp, w) = (filled(n * c, 17), filled(v * c, 13));
    let (mut out, mut dinp, mut dw) = (
        AlignedFloats::zeroed(n * v),
        AlignedFloats::zeroed(n * c),
        AlignedFloats::zeroed(v * c),
    );
    let time = |f: &mut dyn FnMut()| seconds_per_call(10, f);
    let d = cpu.dtype();
    let fwd = cpu.install(|| time(&mut || cpu::head_forward(d, &mut out, &inp, &w, n, c, v)));
    let bwd = cpu.install(|| {
        time(&mut || cpu::head_backward(d, &mut dinp, &mut dw, &out, &inp, &w, n, c, v, true))
    });
    let gflop = 2.0 * (n * c * v) as f64 / 1e9;
    println!(
        "head {n}x{c}x{v}: forward {:.2} ms ({:.0} GFLOP/s), backward (two products) {:.2} ms ({:.0})",
        fwd * 1e3,
        gflop / fwd,
        bwd * 1e3,
        2.0 * gflop / bwd
    );
}

/// `len` floats, 64-byte aligned, element i = (i % `period`) / 100.
fn filled(len: usize, period: usize) -> AlignedFloats {
    let mut v = AlignedFloats::zeroed(len);
    for (i, x) in v.iter_mut().enumerate() {
        *x = (i % period) as f32 * 0.01;
    }
    v
}

/// Median seconds of one call of `f` over `reps` calls, after one untimed call (the median
/// shrugs off the calls that a busy host interrupts).
fn seconds_per_call(reps: usize, f: &mut dyn FnMut()) -> f64 {
    let cold = std::env::var("COLD").is_ok_and(|v| v == "1");
    let mut evict = if cold {
        vec![1.0f32; 64 << 20]
    } else {
        Vec::new()
    };
    f();
    let mut times: Vec<f64> = (0..reps)
        .map(|_| {
            for x in evict.iter_mut() {
                *x += 1.0;
            }
            std::hint::black_box(&evict);
            let t0 = Instant::now();
            f();
            t0.elapsed().as_secs_f64()
        })
        .collect();
    times.sort_by(f64::total_cmp);
    times[reps / 2]
}
