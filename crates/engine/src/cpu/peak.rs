//! The peak rate of the instruction the matrix products use on this machine, measured: what a
//! product kernel's rate, or a training step's model FLOPs utilisation, is a share of.
//!
//! Each loop keeps its accumulators and operands in registers (written in `asm!`, since the
//! compiler spilled some accumulators of an intrinsics loop to the stack) with enough
//! independent chains to cover the instruction's latency at its issue rate, so it measures the
//! execution units and nothing else. Per thread count: every thread of the pool runs the loop at
//! the same moment (a barrier before each run), and the rate is the sum over the threads of the
//! best of a few runs: two threads on one core, or on a host shared with other work, measure
//! what they get together.
//!
//! It only measures; it never touches memory beyond its own stack and never changes what a
//! kernel computes.

use std::sync::Barrier;
use std::time::Instant;

use super::{bf16_kernel_name, simd_level, Cpu, SimdLevel};
use crate::DType;

/// The instruction a backend's matrix products use, and its measured peak.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Peak {
    /// The instruction: "VFMADD231PS zmm", "VFMADD231PS ymm", "VDPBF16PS zmm" or
    /// "TDPBF16PS (AMX)".
    pub instruction: &'static str,
    /// Threads that ran the loop at the same time.
    pub threads: usize,
    /// GFLOP/s of all of them together (multiply and add count as two).
    pub gflops: f64,
}

/// Which loop measures the instruction `dtype`'s products use on this CPU; None where there is
/// none to measure (no FMA).
fn instruction(dtype: DType) -> Option<Instr> {
    match (dtype, bf16_kernel_name()) {
        (DType::Bf16, Some("AMX")) => Some(Instr::Amx),
        (DType::Bf16, Some(_)) => Some(Instr::Dpbf16),
        _ => match simd_level() {
            SimdLevel::Avx512 => Some(Instr::FmaZmm),
            SimdLevel::Avx2 => Some(Instr::FmaYmm),
            SimdLevel::Baseline => None,
        },
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Instr {
    FmaZmm,
    FmaYmm,
    Dpbf16,
    Amx,
}

impl Instr {
    fn name(self) -> &'static str {
        match self {
            Instr::FmaZmm => "VFMADD231PS zmm",
            Instr::FmaYmm => "VFMADD231PS ymm",
            Instr::Dpbf16 => "VDPBF16PS zmm",
            Instr::Amx => "TDPBF16PS (AMX)",
        }
    }
}

/// Runs of the loop per thread; the best counts.
const RUNS: usize = 5;
/// Rounds of one run: a few milliseconds for every instruction.
const ROUNDS: usize = 1 << 18;

/// The peak of the instruction `cpu`'s products use (its dtype, and AMX where the bf16 kernel
/// is AMX), all of `cpu`'s threads running the loop at once. None on a CPU without FMA.
pub fn product_peak(cpu: &Cpu) -> Option<Peak> {
    let instr = instruction(cpu.dtype())?;
    let threads = cpu.num_threads();
    let barrier = Barrier::new(threads);
    // Each thread's (seconds, flops) per run.
    let per_thread: Vec<Vec<(f64, f64)>> = cpu.pool.broadcast(|_| {
        (0..RUNS)
            .map(|_| {
                barrier.wait();
                run(instr, ROUNDS)
            })
            .collect()
    });
    let gflops = per_thread
        .iter()
        .map(|runs| {
            runs.iter()
                .map(|&(s, f)| f / s.max(1e-9) / 1e9)
                .fold(0.0, f64::max)
        })
        .sum();
    Some(Peak {
        instruction: instr.name(),
        threads,
        gflops,
    })
}

/// Seconds and flops of one run of `rounds` rounds of `instr`'s loop.
fn run(instr: Instr, rounds: usize) -> (f64, f64) {
    let t0 = Instant::now();
    #[cfg(target_arch = "x86_64")]
    let flops = {
        // SAFETY: `instruction` picked `instr` from what this CPU (and, for AMX, the OS) grants:
        // AVX-512F for the zmm FMA, AVX2+FMA for the ymm one, AVX512_BF16 for VDPBF16PS, AMX
        // granted to this process for the tiles.
        unsafe {
            match instr {
                Instr::FmaZmm => fma_zmm(rounds),
                Instr::FmaYmm => fma_ymm(rounds),
                Instr::Dpbf16 => dpbf16(rounds),
                Instr::Amx => amx(rounds),
            }
        }
    };
    #[cfg(not(target_arch = "x86_64"))]
    let flops = {
        let _ = (instr, rounds);
        0.0
    };
    (t0.elapsed().as_secs_f64(), flops)
}

/// `rounds` x 24 independent VFMADD231PS zmm (FMA latency 4, two pipes: 8 chains would do);
/// 32 flops each (16 lanes x multiply and add).
///
/// # Safety
/// The CPU must have AVX-512F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn fma_zmm(rounds: usize) -> f64 {
    // SAFETY: registers only; every zmm register written is declared clobbered.
    unsafe {
        std::arch::asm!(
            "vpxord zmm30, zmm30, zmm30",
            "vpxord zmm31, zmm31, zmm31",
            "2:",
            "vfmadd231ps zmm0, zmm30, zmm31", "vfmadd231ps zmm1, zmm30, zmm31",
            "vfmadd231ps zmm2, zmm30, zmm31", "vfmadd231ps zmm3, zmm30, zmm31",
            "vfmadd231ps zmm4, zmm30, zmm31", "vfmadd231ps zmm5, zmm30, zmm31",
            "vfmadd231ps zmm6, zmm30, zmm31", "vfmadd231ps zmm7, zmm30, zmm31",
            "vfmadd231ps zmm8, zmm30, zmm31", "vfmadd231ps zmm9, zmm30, zmm31",
            "vfmadd231ps zmm10, zmm30, zmm31", "vfmadd231ps zmm11, zmm30, zmm31",
            "vfmadd231ps zmm12, zmm30, zmm31", "vfmadd231ps zmm13, zmm30, zmm31",
            "vfmadd231ps zmm14, zmm30, zmm31", "vfmadd231ps zmm15, zmm30, zmm31",
            "vfmadd231ps zmm16, zmm30, zmm31", "vfmadd231ps zmm17, zmm30, zmm31",
            "vfmadd231ps zmm18, zmm30, zmm31", "vfmadd231ps zmm19, zmm30, zmm31",
            "vfmadd231ps zmm20, zmm30, zmm31", "vfmadd231ps zmm21, zmm30, zmm31",
            "vfmadd231ps zmm22, zmm30, zmm31", "vfmadd231ps zmm23, zmm30, zmm31",
            "dec {n}",
            "jnz 2b",
            n = inout(reg) rounds.max(1) => _,
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
    rounds.max(1) as f64 * 24.0 * 32.0
}

/// `rounds` x 12 independent VFMADD231PS ymm (AVX2 has 16 ymm registers: 12 chains and two
/// operands); 16 flops each.
///
/// # Safety
/// The CPU must have AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn fma_ymm(rounds: usize) -> f64 {
    // SAFETY: registers only; every ymm register written is declared clobbered.
    unsafe {
        std::arch::asm!(
            "vxorps ymm14, ymm14, ymm14",
            "vxorps ymm15, ymm15, ymm15",
            "2:",
            "vfmadd231ps ymm0, ymm14, ymm15", "vfmadd231ps ymm1, ymm14, ymm15",
            "vfmadd231ps ymm2, ymm14, ymm15", "vfmadd231ps ymm3, ymm14, ymm15",
            "vfmadd231ps ymm4, ymm14, ymm15", "vfmadd231ps ymm5, ymm14, ymm15",
            "vfmadd231ps ymm6, ymm14, ymm15", "vfmadd231ps ymm7, ymm14, ymm15",
            "vfmadd231ps ymm8, ymm14, ymm15", "vfmadd231ps ymm9, ymm14, ymm15",
            "vfmadd231ps ymm10, ymm14, ymm15", "vfmadd231ps ymm11, ymm14, ymm15",
            "dec {n}",
            "jnz 2b",
            n = inout(reg) rounds.max(1) => _,
            out("ymm0") _, out("ymm1") _, out("ymm2") _, out("ymm3") _,
            out("ymm4") _, out("ymm5") _, out("ymm6") _, out("ymm7") _,
            out("ymm8") _, out("ymm9") _, out("ymm10") _, out("ymm11") _,
            out("ymm14") _, out("ymm15") _,
            options(nostack, nomem),
        );
    }
    rounds.max(1) as f64 * 12.0 * 16.0
}

/// `rounds` x 24 independent VDPBF16PS (enough to cover its latency at two issues a cycle); 64
/// flops each (16 lanes x 2 products, multiply and add).
///
/// # Safety
/// The CPU must have AVX512F and AVX512_BF16.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn dpbf16(rounds: usize) -> f64 {
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
            n = inout(reg) rounds.max(1) => _,
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
    rounds.max(1) as f64 * 24.0 * 64.0
}

/// `rounds` x 4 independent TDPBF16PS on 16 x 16 f32 tiles (tmm0-3) from zeroed 16-row,
/// 32-bf16 operand tiles (tmm4-7), the product kernel's tile shapes; 16 x 16 x 32 x 2 flops
/// each. Each TDPBF16PS occupies the unit about 16 cycles where a vector instruction takes one
/// or two: a quarter of the rounds runs about as long as the other loops.
///
/// # Safety
/// The CPU must have AMX-TILE and AMX-BF16 and Linux must have granted this process the tile
/// state (the bf16 kernel is AMX only then).
#[cfg(target_arch = "x86_64")]
unsafe fn amx(rounds: usize) -> f64 {
    let rounds = rounds.max(4) / 4;
    // SAFETY: AMX is granted per the caller; the tiles are this thread's, configured here and
    // released after, as the product kernel does.
    unsafe {
        super::gemm_bf16::amx::configure();
        std::arch::asm!(
            "tilezero tmm4",
            "tilezero tmm5",
            "tilezero tmm6",
            "tilezero tmm7",
            "2:",
            "tdpbf16ps tmm0, tmm4, tmm5",
            "tdpbf16ps tmm1, tmm4, tmm6",
            "tdpbf16ps tmm2, tmm5, tmm7",
            "tdpbf16ps tmm3, tmm6, tmm7",
            "dec {n}",
            "jnz 2b",
            n = inout(reg) rounds => _,
            options(nostack, nomem),
        );
        super::gemm_bf16::amx::release();
    }
    rounds as f64 * 4.0 * (16.0 * 16.0 * 32.0 * 2.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every instruction this CPU has gives a positive, finite rate, at one and two threads.
    #[test]
    fn peak_is_positive_and_finite() {
        for dtype in [DType::F32, DType::Bf16] {
            for threads in [1, 2] {
                let cpu = Cpu::with_dtype(threads, dtype).unwrap();
                let Some(p) = product_peak(&cpu) else {
                    eprintln!("no FMA on this CPU: nothing to measure");
                    return;
                };
                assert!(p.gflops.is_finite() && p.gflops > 0.0, "{p:?}");
                assert_eq!(p.threads, threads);
            }
        }
    }
}
