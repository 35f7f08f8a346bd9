//! The CPU implementation of [`Backend`](crate::Backend): kernels on plain slices, run on a
//! persistent rayon pool.
//!
//! Kernels are free functions named `<layer>_forward` / `<layer>_backward`, arguments in the
//! order outputs, inputs, weights, dims (llm.c's convention). They use the rayon pool they are
//! called from, so call them inside [`Cpu::install`] (the model does, once per forward or
//! backward). Hot loops are plain Rust compiled twice by `simd_fn!`, for AVX-512 and for
//! AVX2+FMA, and picked at run time: CI builds without `-C target-cpu`. No kernel allocates,
//! and no kernel's result depends on the number of threads.

// Kernels take outputs, inputs, weights and dims explicitly, as llm.c does; that is many
// arguments by design.
#![allow(clippy::too_many_arguments)]

mod attention;
mod attention_decode;
#[cfg(target_arch = "x86_64")]
mod attention_fused;
mod bf16;
mod crossentropy;
mod decode_matmul;
mod elementwise;
mod encoder;
mod epilogue;
mod gemm;
#[cfg(target_arch = "x86_64")]
mod gemm_bf16;
mod layernorm;
pub(crate) mod math;
mod matmul;
mod peak;
mod rmsnorm;
mod rope;
mod swiglu;

pub use attention::{
    attention_backward, attention_backward_bf16_qkv, attention_backward_grouped, attention_forward,
    attention_forward_bf16_qkv, attention_forward_grouped, attention_scratch_len, AttnDims,
};
pub use attention_decode::{attention_decode_row, attention_decode_row_bf16, DecodeDims};
pub use bf16::{bf16_to_f32, round_to_bf16};
pub use crossentropy::{
    crossentropy_backward, crossentropy_fold, crossentropy_forward, crossentropy_forward_block,
    loss_sum,
};
pub use decode_matmul::{decode_matmul_forward, DecodeFormat, DecodeMatrix};
pub use elementwise::{
    add_into, dropout_backward, dropout_forward, fill, gelu_backward, gelu_backward_with_grad,
    gelu_forward, gelu_forward_and_grad, residual_forward,
};
pub use encoder::{embedding_backward, embedding_forward, encoder_backward, encoder_forward};
/// Timing hooks for `examples/pack_rates.rs`: the bf16 product's packs alone.
#[cfg(target_arch = "x86_64")]
#[doc(hidden)]
pub use gemm_bf16::rates as pack_rates;
pub use layernorm::{layernorm_backward, layernorm_forward, layernorm_forward_bf16};
pub use matmul::{
    column_sums, head_backward, head_forward, matmul_backward, matmul_backward_input,
    matmul_backward_weight_bf16_input, matmul_forward, matmul_forward_bf16_input,
    matmul_forward_bf16_out, matmul_gelu_forward, matmul_gelu_forward_bf16, packed_matmul_forward,
    PackedMatrix,
};
pub use peak::{product_peak, Peak};
pub use rmsnorm::{rmsnorm_backward, rmsnorm_forward, rmsnorm_forward_bf16};
pub use rope::{rope_backward, rope_forward, rope_tables, RopeDims};
pub use swiglu::{
    matmul_backward_input_swiglu, matmul_backward_input_swiglu_with_grad, matmul_swiglu_forward,
    matmul_swiglu_forward_bf16, swiglu_backward, swiglu_backward_with_grad, swiglu_forward,
    swiglu_interleaved_backward, swiglu_interleaved_forward,
};

use crate::{DType, EngineError};

/// A raw pointer that tasks may share when each writes a disjoint part of the buffer.
#[derive(Clone, Copy)]
pub(crate) struct SendPtr(pub(crate) *mut f32);
// safety: only used for buffers whose parts are written by one task each (see each use).
unsafe impl Send for SendPtr {}
// safety: as above.
unsafe impl Sync for SendPtr {}

impl SendPtr {
    /// The pointer (a method, so closures capture the whole `Send` wrapper, not the field).
    pub(crate) fn get(self) -> *mut f32 {
        self.0
    }
}

/// Which instruction set the `simd_fn!` clones use on this machine.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SimdLevel {
    /// AVX-512F (with AVX2 and FMA).
    Avx512,
    /// AVX2 and FMA.
    Avx2,
    /// Whatever the build target guarantees (SSE2 on x86-64).
    Baseline,
}

/// The SIMD level detected at run time (cached by std's feature detection).
pub fn simd_level() -> SimdLevel {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f") {
            return SimdLevel::Avx512;
        }
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
        {
            return SimdLevel::Avx2;
        }
    }
    SimdLevel::Baseline
}

/// Defines a function whose body is compiled for AVX-512, AVX2 and the baseline, dispatching at
/// run time. The body must not use FMA-sensitive intrinsics: all clones give the same bits.
macro_rules! simd_fn {
    ($(#[$m:meta])* $vis:vis fn $name:ident($($arg:ident : $ty:ty),* $(,)?) $(-> $ret:ty)? $body:block) => {
        $(#[$m])*
        #[allow(clippy::too_many_arguments)]
        $vis fn $name($($arg: $ty),*) $(-> $ret)? {
            #[inline(always)]
            #[allow(clippy::too_many_arguments)]
            fn inner($($arg: $ty),*) $(-> $ret)? $body
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f,avx512vl,avx512bw,avx512dq,avx2,fma,bmi2")]
                #[allow(clippy::too_many_arguments)]
                unsafe fn avx512($($arg: $ty),*) $(-> $ret)? { inner($($arg),*) }
                #[target_feature(enable = "avx2,fma,bmi2")]
                #[allow(clippy::too_many_arguments)]
                unsafe fn avx2($($arg: $ty),*) $(-> $ret)? { inner($($arg),*) }
                match $crate::cpu::simd_level() {
                    // safety: the features were detected at run time.
                    $crate::cpu::SimdLevel::Avx512 => return unsafe { avx512($($arg),*) },
                    // safety: as above.
                    $crate::cpu::SimdLevel::Avx2 => return unsafe { avx2($($arg),*) },
                    $crate::cpu::SimdLevel::Baseline => {}
                }
            }
            inner($($arg),*)
        }
    };
}
pub(crate) use simd_fn;

/// Whether this CPU has the bf16 matrix product (AVX-512 with AVX512_BF16). Where it does not,
/// a bf16 backend is not built: [`Cpu::with_dtype`] falls back to f32 and says so.
pub fn bf16_supported() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        gemm_bf16::supported()
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Which instructions compute bf16 products on this CPU ("AMX" or "AVX512_BF16"), if any.
pub fn bf16_kernel_name() -> Option<&'static str> {
    #[cfg(target_arch = "x86_64")]
    {
        gemm_bf16::chosen_kernel().map(|k| match k {
            gemm_bf16::Kernel::Amx => "AMX",
            gemm_bf16::Kernel::Avx512 => "AVX512_BF16",
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        None
    }
}

/// The CPU backend: a persistent pool of intra-op threads.
pub struct Cpu {
    pool: rayon::ThreadPool,
    dtype: DType,
}

impl std::fmt::Debug for Cpu {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Cpu")
            .field("threads", &self.num_threads())
            .field("dtype", &self.dtype)
            .finish()
    }
}

impl Cpu {
    /// An f32 backend with `threads` intra-op threads (at least 1).
    pub fn new(threads: usize) -> Result<Cpu, EngineError> {
        Cpu::with_dtype(threads, DType::F32)
    }

    /// A backend computing its matrix products in `dtype`. Asked for bf16 on a CPU without
    /// the bf16 product ([`bf16_supported`]), it is an f32 backend: compare [`Cpu::dtype`]
    /// with what was asked to tell the user.
    pub fn with_dtype(threads: usize, dtype: DType) -> Result<Cpu, EngineError> {
        let dtype = match dtype {
            DType::Bf16 if !bf16_supported() => DType::F32,
            d => d,
        };
        let threads = threads.max(1);
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(|i| format!("cohort-engine-{i}"))
            .build()
            .map_err(|e| EngineError::ThreadPool {
                threads,
                reason: e.to_string(),
            })?;
        Ok(Cpu { pool, dtype })
    }

    /// What the matrix products compute in.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// A backend sized by `COHORT_NUM_THREADS`, else by the cores this process may use.
    pub fn from_env() -> Result<Cpu, EngineError> {
        Cpu::new(threads_from_env()?)
    }

    /// Number of intra-op threads.
    pub fn num_threads(&self) -> usize {
        self.pool.current_num_threads()
    }

    /// Runs `f` with this backend's threads available to the kernels it calls.
    pub fn install<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        self.pool.install(f)
    }
}

/// `COHORT_NUM_THREADS` if set (a positive integer), else `available_parallelism`.
pub fn threads_from_env() -> Result<usize, EngineError> {
    match std::env::var("COHORT_NUM_THREADS") {
        Ok(v) => match v.trim().parse::<usize>() {
            Ok(n) if n > 0 => Ok(n),
            _ => Err(EngineError::BadThreadCount { value: v }),
        },
        Err(_) => Ok(std::thread::available_parallelism().map_or(1, |n| n.get())),
    }
}

#[cfg(test)]
pub(crate) mod testing {
    //! Helpers for the kernel tests: deterministic inputs, f64 finite differences.

    /// Deterministic values in [-1, 1).
    pub fn rand_vec(n: usize, seed: u64) -> Vec<f32> {
        let mut rng = cohort_rng::SplitMix64::new(seed);
        (0..n)
            .map(|_| ((rng.next_u64() >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0)
            .collect()
    }

    pub fn f64s(x: &[f32]) -> Vec<f64> {
        x.iter().map(|&v| v as f64).collect()
    }

    pub fn within_pool<R: Send>(threads: usize, f: impl FnOnce() -> R + Send) -> R {
        super::Cpu::new(threads).unwrap().install(f)
    }

    /// |got - want| <= tol * (1 + |want|) elementwise.
    pub fn assert_close(got: &[f32], want: &[f64], tol: f64, what: &str) {
        assert!(
            got.len() >= want.len(),
            "{what}: {} < {}",
            got.len(),
            want.len()
        );
        for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
            assert!(
                (g as f64 - w).abs() <= tol * (1.0 + w.abs()),
                "{what}[{i}]: got {g}, want {w}"
            );
        }
    }

    /// Checks a kernel's gradient (`got - initial`, since backward accumulates) against central
    /// finite differences in f64 of L(x) = Σ dout · f(x).
    pub fn check_grad(
        what: &str,
        got: &[f32],
        initial: f32,
        x: &[f64],
        dout: &[f32],
        f: impl Fn(&[f64]) -> Vec<f64>,
    ) {
        let h = 1e-6;
        let mut x = x.to_vec();
        let loss = |x: &[f64]| -> f64 { f(x).iter().zip(dout).map(|(y, &d)| y * d as f64).sum() };
        let mut worst = 0f64;
        // Large inputs: a strided sample of about 1500 coordinates keeps the test fast.
        for i in (0..x.len()).step_by((x.len() / 1500).max(1)) {
            let orig = x[i];
            x[i] = orig + h;
            let up = loss(&x);
            x[i] = orig - h;
            let dn = loss(&x);
            x[i] = orig;
            let fd = (up - dn) / (2.0 * h);
            let g = (got[i] - initial) as f64;
            let err = (g - fd).abs() / (1.0 + fd.abs());
            worst = worst.max(err);
            assert!(
                err < 1e-4,
                "{what}[{i}]: backward {g}, finite difference {fd}"
            );
        }
        assert!(worst.is_finite());
    }
}
