//! GFLOP/s of the matrix kernels on config B's shapes (2048 tokens; d 384; d_ff 1536) or config
//! G's (1024 tokens; d 768; d_ff 3072), one thread: the forward product, the input gradient and
//! the weight gradient of each of a block's four Linear layers, in the precision given (`fp32`
//! or `bf16`). `THREADS=2` runs them on a pool of two (the thread split of a training step).
//! Each figure is the median of 20 calls. On AVX512_BF16 without AMX it first measures the
//! instruction's peak on one core, and it reports the twelve products of a block together as a
//! fraction of it.
//!
//! ```sh
//! cargo run --release -p cohort-engine --example matmul_rates -- bf16 [B|G]
//! COHORT_AMX=0 cargo run --release -p cohort-engine --example matmul_rates -- bf16  # zmm kernel
//! ```

use std::time::Instant;

use cohort_engine::cpu::{self, Cpu};
use cohort_engine::DType;

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
    let mut peak = None;
    match (cpu.dtype(), cpu::bf16_kernel_name()) {
        (DType::Bf16, Some(kernel)) => {
            println!("bf16 on {kernel}");
            if kernel == "AVX512_BF16" {
                peak = dpbf16_peak_gflops();
            }
            if let Some(peak) = peak {
                println!("VDPBF16PS peak, one core: {peak:.0} GFLOP/s (24 independent zmm chains, registers only)");
            }
        }
        (d, _) => println!("{d}"),
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
        let inp: Vec<f32> = (0..n * k).map(|i| (i % 17) as f32 * 0.01).collect();
        let w: Vec<f32> = (0..k * oc).map(|i| (i % 13) as f32 * 0.01).collect();
        let (mut out, mut dinp, mut dw) = (vec![0.0; n * oc], vec![0.0; n * k], vec![0.0; k * oc]);
        let time = |f: &mut dyn FnMut()| seconds_per_call(20, f);
        let d = cpu.dtype();
        let fwd = cpu
            .install(|| time(&mut || cpu::matmul_forward(d, &mut out, &inp, &w, None, n, k, oc)));
        let bin = cpu
            .install(|| time(&mut || cpu::matmul_backward_input(d, &mut dinp, &out, &w, n, k, oc)));
        let bw = cpu.install(|| {
            time(&mut || cpu::matmul_backward(d, None, &mut dw, None, &out, &inp, &w, n, k, oc))
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
            "block (12 products): {block:.0} GFLOP/s, {:.0}% of {threads} x the one-core peak",
            100.0 * block / (p * threads as f64)
        ),
        None => println!("block (12 products): {block:.0} GFLOP/s"),
    }
    // The LM head over one block of the vocabulary (the weight is nn.Linear's [out, in]).
    let v = 4096;
    let inp: Vec<f32> = (0..n * c).map(|i| (i % 17) as f32 * 0.01).collect();
    let w: Vec<f32> = (0..v * c).map(|i| (i % 13) as f32 * 0.01).collect();
    let (mut out, mut dinp, mut dw) = (vec![0.0; n * v], vec![0.0; n * c], vec![0.0; v * c]);
    let time = |f: &mut dyn FnMut()| seconds_per_call(10, f);
    let d = cpu.dtype();
    let fwd = cpu.install(|| time(&mut || cpu::head_forward(d, &mut out, &inp, &w, n, c, v)));
    let bwd = cpu.install(|| {
        time(&mut || cpu::head_backward(d, &mut dinp, &mut dw, &out, &inp, &w, n, c, v))
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

/// Median seconds of one call of `f` over `reps` calls, after one untimed call (the median
/// shrugs off the calls that a busy host interrupts).
fn seconds_per_call(reps: usize, f: &mut dyn FnMut()) -> f64 {
    f();
    let mut times: Vec<f64> = (0..reps)
        .map(|_| {
            let t0 = Instant::now();
            f();
            t0.elapsed().as_secs_f64()
        })
        .collect();
    times.sort_by(f64::total_cmp);
    times[reps / 2]
}

/// The AVX512_BF16 instruction's peak on one core: 24 independent accumulators (enough to
/// cover its latency at two issues a cycle) each take VDPBF16PS on operands already in
/// registers, 2^20 rounds; 64 flops per instruction (16 lanes x 2 multiply-adds). What the
/// product kernel's rates are a fraction of. None without AVX512_BF16.
fn dpbf16_peak_gflops() -> Option<f64> {
    #[cfg(target_arch = "x86_64")]
    {
        if !std::arch::is_x86_feature_detected!("avx512bf16") {
            return None;
        }
        // SAFETY: the CPU has AVX512_BF16 (checked above); the loop touches registers only.
        let (secs, flops) = unsafe { dpbf16_loop(1 << 20) };
        Some(flops / secs / 1e9)
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        None
    }
}

/// Seconds and flops of `rounds` rounds of 24 independent VDPBF16PS (the best of three runs),
/// written in assembly so that the 24 accumulators stay in registers (the compiler spilled some
/// of an intrinsics loop to the stack).
///
/// # Safety
/// The CPU must have AVX512F and AVX512_BF16.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn dpbf16_loop(rounds: usize) -> (f64, f64) {
    let mut best = f64::INFINITY;
    for _ in 0..3 {
        let t0 = Instant::now();
        // SAFETY: registers only; every zmm register written is declared clobbered.
        unsafe {
            std::arch::asm!(
                "vpxord zmm30, zmm30, zmm30",
                "vpxord zmm31, zmm31, zmm31",
                "2:",
                "vdpbf16ps zmm0, zmm30, zmm31", "vdpbf16ps zmm1, zmm30, zmm31",
                "vdpbf16ps zmm2, zmm30, zmm31", "vdpbf16ps zmm3, zmm30, zmm31",
                "vdpbf16ps zmm4, zmm30, zmm31", "vdpbf16ps zmm5, zmm30, zmm31",
                "vdpbf16ps zmm6, zmm30, zmm31", "vdpbf16ps zmm7, zmm30, zmm31",
                "vdpbf16ps zmm8, zmm30, zmm31", "vdpbf16ps zmm9, zmm30, zmm31",
                "vdpbf16ps zmm10, zmm30, zmm31", "vdpbf16ps zmm11, zmm30, zmm31",
                "vdpbf16ps zmm12, zmm30, zmm31", "vdpbf16ps zmm13, zmm30, zmm31",
                "vdpbf16ps zmm14, zmm30, zmm31", "vdpbf16ps zmm15, zmm30, zmm31",
                "vdpbf16ps zmm16, zmm30, zmm31", "vdpbf16ps zmm17, zmm30, zmm31",
                "vdpbf16ps zmm18, zmm30, zmm31", "vdpbf16ps zmm19, zmm30, zmm31",
                "vdpbf16ps zmm20, zmm30, zmm31", "vdpbf16ps zmm21, zmm30, zmm31",
                "vdpbf16ps zmm22, zmm30, zmm31", "vdpbf16ps zmm23, zmm30, zmm31",
                "dec {n}",
                "jnz 2b",
                n = inout(reg) rounds => _,
                out("zmm0") _, out("zmm1") _, out("zmm2") _, out("zmm3") _,
                out("zmm4") _, out("zmm5") _, out("zmm6") _, out("zmm7") _,
                out("zmm8") _, out("zmm9") _, out("zmm10") _, out("zmm11") _,
                out("zmm12") _, out("zmm13") _, out("zmm14") _, out("zmm15") _,
                out("zmm16") _, out("zmm17") _, out("zmm18") _, out("zmm19") _,
                out("zmm20") _, out("zmm21") _, out("zmm22") _, out("zmm23") _,
                out("zmm30") _, out("zmm31") _,
                options(nostack, nomem),
            );
        }
        best = best.min(t0.elapsed().as_secs_f64());
    }
    (best, rounds as f64 * 24.0 * 64.0)
}
