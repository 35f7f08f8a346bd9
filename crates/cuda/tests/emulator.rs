//! The CUDA backend on the CUDA CPU emulator (`emu/README.md`): every kernel against the CPU
//! engine, the engine's backend against the CPU backend (fp32 and bf16 products), and the
//! emulator's own checks (a kernel that writes past its buffer, lanes that skip a shuffle, a
//! block split between barriers, a cuBLAS operand past its buffer) as one-line errors. This
//! test binary opens only the emulator's libraries. It needs g++: without one it skips with a
//! message, and fails under CI (`CI` set), whose machine has it.

use std::path::PathBuf;
use std::sync::OnceLock;

use cohort_cuda::kernels::Family;
use cohort_cuda::libraries::Search;
use cohort_cuda::{check, CudaBackend, Device};
use cudarc::driver::{CudaContext, CudaSlice, LaunchConfig, PushKernelArg};
use cudarc::nvrtc::Ptx;

/// The emulator's libraries (built once per test binary), or None (skip) without g++.
fn emulator() -> Option<Search> {
    static BUILT: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    let built = BUILT.get_or_init(|| {
        let out = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("cuda-emu");
        let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("emu/build.sh");
        let o = std::process::Command::new("bash")
            .arg(&script)
            .arg(&out)
            .output()
            .map_err(|e| format!("bash {}: {e}", script.display()))?;
        if !o.status.success() {
            return Err(String::from_utf8_lossy(&o.stderr).trim().to_string());
        }
        Ok(out.join("lib"))
    });
    match built {
        Ok(lib) => Some(Search::in_dirs([lib.clone()])),
        Err(e) if !in_ci() => {
            eprintln!("skipped: the CUDA CPU emulator did not build: {e}");
            None
        }
        Err(e) => panic!("the CUDA CPU emulator did not build: {e}"),
    }
}

fn in_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| !v.is_empty() && v != "0" && v != "false")
}

#[test]
fn every_kernel_matches_the_cpu_engine_on_the_emulator() {
    let Some(search) = emulator() else { return };
    let dev = Device::open(0, &search).unwrap_or_else(|e| panic!("{e}"));
    assert!(dev.info().name.contains("emulator"), "{}", dev.info().name);
    let rows = check::run(&dev);
    assert!(rows.len() > 40, "{} rows", rows.len());
    assert!(rows.iter().all(|r| r.ok), "{}", check::table(&rows));
}

#[test]
fn the_engine_backend_on_the_emulator_matches_the_cpu_backend() {
    let Some(search) = emulator() else { return };
    let gpu =
        CudaBackend::open(0, cohort_engine::DType::F32, &search).unwrap_or_else(|e| panic!("{e}"));
    let mut rows = check::engine_backend(&gpu);
    rows.extend(check::engine_backend_bf16(gpu));
    assert!(rows.iter().all(|r| r.ok), "{}", check::table(&rows));
}

/// Kernels that break the GPU's rules, each in its own way.
const BROKEN: Family = Family {
    name: "broken",
    source: r#"
extern "C" __global__ void write_past(float* out, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    out[i + n] = 1.0f;  // n = the buffer's length: every write lands past its end, in the guard page
}
extern "C" __global__ void half_warp_shuffle(float* out) {
    if (threadIdx.x % 32 >= 16) return;
    out[threadIdx.x] = warp_sum(1.0f);
}
extern "C" __global__ void split_barrier(float* out) {
    if (threadIdx.x % 2) __syncthreads();
    else out[threadIdx.x] = warp_sum(1.0f);
}
extern "C" __global__ void fine(float* out) {
    out[blockIdx.x * blockDim.x + threadIdx.x] = block_sum(1.0f);
}
"#,
    kernels: &["write_past", "half_warp_shuffle", "split_barrier", "fine"],
};

#[test]
fn the_emulator_fails_a_launch_that_breaks_the_gpus_rules_naming_it() {
    let Some(search) = emulator() else { return };
    let dev = Device::open(0, &search).unwrap_or_else(|e| panic!("{e}"));
    let compiled = dev
        .compiler()
        .compile(&BROKEN, dev.arch())
        .unwrap_or_else(|e| panic!("{e}"));
    let ctx = CudaContext::new(0).unwrap();
    let stream = ctx.default_stream();
    let module = ctx.load_module(Ptx::from_binary(compiled.cubin)).unwrap();
    let mut out = stream.alloc_zeros::<f32>(256).unwrap();
    // What launching `name` on 2 blocks of `threads` says: "" when it ran.
    let err = |name: &str, n: Option<i32>, threads: u32, out: &mut CudaSlice<f32>| {
        let f = module.load_function(name).unwrap();
        let mut b = stream.launch_builder(&f);
        b.arg(out);
        if let Some(n) = &n {
            b.arg(n);
        }
        let cfg = LaunchConfig {
            grid_dim: (2, 1, 1),
            block_dim: (threads, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: the emulator's launch; every argument matches the kernel's parameters.
        match unsafe { b.launch(cfg) } {
            Ok(_) => String::new(),
            Err(e) => e.to_string(),
        }
    };
    // The fine kernel runs, and sums its block of 128 threads.
    assert_eq!(err("fine", None, 128, &mut out), "");
    let host = stream.clone_dtoh(&out).unwrap();
    assert!(host.iter().all(|&x| x == 128.0), "{:?}", &host[..4]);

    let e = err("write_past", Some(256), 128, &mut out);
    assert!(
        e.contains("write_past") && e.contains("outside device memory"),
        "{e}"
    );
    let e = err("half_warp_shuffle", None, 64, &mut out);
    assert!(
        e.contains("half_warp_shuffle") && e.contains("lanes returned"),
        "{e}"
    );
    let e = err("split_barrier", None, 64, &mut out);
    assert!(e.contains("split_barrier") && e.contains("deadlock"), "{e}");
    assert!(!e.contains('\n'), "one line: {e}");
}
