//! The GPU script's parts through the binary, on the CUDA CPU emulator
//! (`crates/cuda/emu/README.md`) instead of a GPU: `cohort gpu info` and `cohort gpu check`
//! (every CUDA kernel and the CUDA engine backend against the CPU's), `cohort train --device
//! cuda` against `--device cpu`, two ranks sharing the device with their gradients staged
//! through the host or all-reduced by (the emulator's) NCCL (after backward, and in buckets
//! while backward goes on), `cohort gpu nccl` on one rank and two, and `cohort bench train
//! --device cuda`. The CUDA code runs, as host code;
//! no figure from it means anything. Needs g++: without one it skips with a message, and fails
//! under CI (`CI` set), whose machine has it.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::OnceLock;

/// The emulator's `lib/` (built once per test binary), or None (skip) without g++.
fn emulator() -> Option<PathBuf> {
    static BUILT: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    let built = BUILT.get_or_init(|| {
        let out = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("cuda-emu");
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../cuda/emu/build.sh");
        let o = Command::new("bash")
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
        Ok(lib) => Some(lib.clone()),
        Err(e) if std::env::var("CI").is_ok_and(|v| !v.is_empty() && v != "0" && v != "false") => {
            panic!("the CUDA CPU emulator did not build: {e}")
        }
        Err(e) => {
            eprintln!("skipped: the CUDA CPU emulator did not build: {e}");
            None
        }
    }
}

/// `cohort ARGS` with only the emulator's CUDA libraries to find.
fn cohort(lib: &Path, args: &[&str]) -> Output {
    cohort_env(lib, args, &[])
}

/// [`cohort`] with more environment variables.
fn cohort_env(lib: &Path, args: &[&str], env: &[(&str, &str)]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_cohort"))
        .args(args)
        .env("COHORT_CUDA_LIB_DIRS", lib)
        .env_remove("LD_LIBRARY_PATH")
        .env_remove("NCCL_MULTI_RANK_GPU_ENABLE")
        .env("COHORT_PYTHON", "/nonexistent") // no Python environment's nvidia/*/lib
        .envs(env.iter().copied())
        .output()
        .unwrap()
}

fn ok(what: &str, out: &Output) -> String {
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{what}: {}\n{stdout}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

#[test]
fn gpu_info_and_gpu_check_pass_on_the_emulator() {
    let Some(lib) = emulator() else { return };
    let info = ok("cohort gpu info", &cohort(&lib, &["gpu", "info"]));
    assert!(info.contains("emulator"), "{info}");
    let check = ok("cohort gpu check", &cohort(&lib, &["gpu", "check"]));
    assert!(check.contains("emulator"), "{check}");
    // every kernel row and the engine backend's rows, all ok
    assert!(
        check.contains("adamw") && check.contains("backend"),
        "{check}"
    );
}

/// (step, train_loss) of a run log.
fn losses(dir: &Path) -> Vec<(u64, f64)> {
    let text = std::fs::read_to_string(dir.join("metrics.jsonl")).unwrap();
    text.lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter_map(|v| Some((v["step"].as_u64()?, v["train_loss"].as_f64()?)))
        .collect()
}

const TRAIN: &[&str] = &[
    "train",
    "--steps",
    "8",
    "--log-interval",
    "1",
    "--n-layers",
    "2",
    "--n-heads",
    "4",
    "--d-model",
    "64",
    "--d-ff",
    "256",
    "--seq-len",
    "32",
    "--dropout",
    "0",
];

fn close(cpu: &[(u64, f64)], dev: &[(u64, f64)], tol: f64, what: &str) {
    assert_eq!(cpu.len(), 8, "{cpu:?}");
    assert_eq!(
        cpu.iter().map(|c| c.0).collect::<Vec<_>>(),
        dev.iter().map(|d| d.0).collect::<Vec<_>>(),
        "{what}"
    );
    for (c, d) in cpu.iter().zip(dev) {
        assert!(
            (c.1 - d.1).abs() <= tol * c.1.abs(),
            "{what}: step {}: cpu {} device {}\ncpu {cpu:?}\ndevice {dev:?}",
            c.0,
            c.1,
            d.1
        );
    }
}

#[test]
fn training_on_cuda_follows_the_cpus_loss_curve_on_the_emulator() {
    let Some(lib) = emulator() else { return };
    let dir = tempfile::tempdir().unwrap();
    // `cohort [run -n 2] train ... --batch-size B --device D [--backend nccl]`
    let run = |device: &str, batch: &str, ranks: &[&str], log: &str, env: &[(&str, &str)]| {
        let log = dir.path().join(log);
        let nccl = env.iter().any(|(k, _)| k.starts_with("NCCL"));
        let mut args: Vec<&str> = ranks.to_vec();
        args.extend_from_slice(TRAIN);
        if nccl {
            args.extend_from_slice(&["--backend", "nccl"]);
        }
        let log_s = log.to_str().unwrap().to_string();
        args.extend_from_slice(&[
            "--batch-size",
            batch,
            "--device",
            device,
            "--log-dir",
            &log_s,
        ]);
        ok(&format!("{args:?}"), &cohort_env(&lib, &args, env));
        losses(&log)
    };
    let cpu = run("cpu", "8", &[], "cpu", &[]);
    let cuda = run("cuda", "8", &[], "cuda", &[]);
    close(&cpu, &cuda, 1e-4, "one rank on cuda");
    // two ranks sharing the one device, gradients all-reduced on the host: the same global batch
    let staged = run("cuda", "4", &["run", "-n", "2"], "cuda-x2", &[]);
    close(&cpu, &staged, 1e-4, "two host-staged ranks on cuda");
    // the same two ranks, their gradients averaged on the device by NCCL
    let nccl = run(
        "cuda",
        "4",
        &["run", "-n", "2"],
        "cuda-nccl",
        &[("NCCL_MULTI_RANK_GPU_ENABLE", "1")],
    );
    close(&cpu, &nccl, 1e-4, "two ranks on cuda over NCCL");
}

/// (step, train_loss, grad_norm, skipped updates) of a run log, NaN where the log has none
/// (a skipped step's).
fn curve(dir: &Path) -> Vec<(u64, f64, f64, u64)> {
    let text = std::fs::read_to_string(dir.join("metrics.jsonl")).unwrap();
    text.lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v.get("train_loss").is_some())
        .filter_map(|v| {
            let loss = v["train_loss"].as_f64().unwrap_or(f64::NAN);
            let norm = v["grad_norm"].as_f64().unwrap_or(f64::NAN);
            Some((v["step"].as_u64()?, loss, norm, v["skipped"].as_u64()?))
        })
        .collect()
}

/// Two ranks on one device, their gradients averaged by (the emulator's) NCCL in buckets
/// while backward goes on (several: a small cap; overlap on, as a GPU host's free cores make
/// it by default), with two micro-batches a step (the sync on the second only), clipping at
/// a norm below every step's, and a NaN written into rank 1's averaged gradient at step 3
/// (0-based; the log's step 4): the loss curve is the CPU's with the doubled batch (the same
/// micro-batches, the same step skipped), so both ranks skipped it and kept the same
/// parameters.
#[test]
fn ddp_over_nccl_in_buckets_follows_the_cpu_with_accumulation_clipping_and_a_nan_step() {
    let Some(lib) = emulator() else { return };
    let dir = tempfile::tempdir().unwrap();
    let common = ["--grad-accum", "2", "--grad-clip", "0.05"];
    let run = |ranks: &[&str], extra: &[&str], log: &str, env: &[(&str, &str)]| {
        let log = dir.path().join(log);
        let log_s = log.to_str().unwrap().to_string();
        let mut args: Vec<&str> = ranks.to_vec();
        args.extend_from_slice(TRAIN);
        args.extend_from_slice(&common);
        args.extend_from_slice(extra);
        args.extend_from_slice(&["--log-dir", &log_s]);
        let out = ok(&format!("{args:?}"), &cohort_env(&lib, &args, env));
        (out, curve(&log))
    };
    let (cpu_out, cpu) = run(
        &[],
        &["--batch-size", "8", "--device", "cpu"],
        "cpu",
        &[("COHORT_INJECT_NAN", "3")],
    );
    let (out, nccl) = run(
        // A free port: other runs may hold the default one.
        &["run", "-n", "2", "--standalone"],
        &[
            "--batch-size",
            "4",
            "--device",
            "cuda",
            "--backend",
            "nccl",
            "--overlap",
            "on",
            "--bucket-cap-mb",
            "0.05",
        ],
        "nccl",
        &[
            ("NCCL_MULTI_RANK_GPU_ENABLE", "1"),
            ("COHORT_INJECT_NAN", "3@1"),
        ],
    );
    // The header: buckets, averaged by NCCL while backward goes on.
    // Rank 0's lines, as `cohort run` prefixes them.
    let line = |start: &str| {
        let tag = format!("[rank0]: {start}");
        let found = out.lines().find(|l| l.starts_with(&tag));
        found.unwrap_or_else(|| panic!("no {start:?} line: {out}"))
    };
    let model = line("model:");
    let buckets: usize = model
        .split("in buckets while backward goes on: ")
        .nth(1)
        .and_then(|r| r.split(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no buckets in the header: {model}"));
    assert!(buckets >= 3, "{model}");
    assert!(
        model.contains("by NCCL 2.30.7") && model.contains("overlap on"),
        "{model}"
    );
    let grads = line("gradients: averaged");
    assert!(grads.contains("communication stream"), "{grads}");
    // The step skipped on every rank, as on the CPU.
    for o in [&cpu_out, &out] {
        assert!(o.contains("skipped 1 update(s)"), "{o}");
    }
    assert_eq!(cpu.len(), 8, "{cpu:?}");
    assert_eq!(
        cpu.iter().map(|c| c.0).collect::<Vec<_>>(),
        nccl.iter().map(|d| d.0).collect::<Vec<_>>()
    );
    for (c, d) in cpu.iter().zip(&nccl) {
        let what = format!(
            "step {}: cpu {c:?} nccl {d:?}\ncpu {cpu:?}\nnccl {nccl:?}",
            c.0
        );
        if c.0 == 4 {
            assert!(c.3 == 1 && d.3 == 1, "the NaN step was not skipped: {what}");
            continue;
        }
        assert!(c.3 == 0 && d.3 == 0, "{what}");
        assert!((c.1 - d.1).abs() <= 1e-4 * c.1.abs(), "{what}");
        // The clip bites: every step's norm (before clipping) is above it.
        assert!(c.2 > 0.05 && (c.2 - d.2).abs() <= 1e-3 * c.2, "{what}");
    }
}

#[test]
fn bench_train_runs_on_cuda_on_the_emulator() {
    let Some(lib) = emulator() else { return };
    for prec in ["fp32", "bf16"] {
        let out = cohort(
            &lib,
            &[
                "bench",
                "train",
                "--config",
                "A",
                "--threads",
                "1",
                "--steps",
                "2",
                "--warmup",
                "1",
                "--seq",
                "32",
                "--batch",
                "2",
                "--device",
                "cuda",
                "--precision",
                prec,
                "--json",
            ],
        );
        let stdout = ok(
            &format!("bench train --device cuda --precision {prec}"),
            &out,
        );
        let v: serde_json::Value = serde_json::from_str(stdout.lines().last().unwrap()).unwrap();
        assert!(v["final_loss"].as_f64().unwrap().is_finite(), "{v}");
    }
}

#[test]
fn gpu_nccl_runs_every_collective_on_one_rank_and_two_on_the_emulator() {
    let Some(lib) = emulator() else { return };
    let one = ok(
        "cohort gpu nccl",
        &cohort(&lib, &["gpu", "nccl", "--elements", "10003"]),
    );
    assert!(
        one.contains("NCCL 2.30.7") && one.contains("1 rank(s)"),
        "{one}"
    );
    let two = ["run", "-n", "2", "gpu", "nccl", "--elements", "4099"];
    // two ranks on one device: refused, naming the fix, unless NCCL is told it may
    let out = cohort(&lib, &two);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(
        stderr.contains("share one GPU") && stderr.contains("NCCL_MULTI_RANK_GPU_ENABLE=1"),
        "{stderr}"
    );
    let out = cohort_env(&lib, &two, &[("NCCL_MULTI_RANK_GPU_ENABLE", "1")]);
    let text = ok("cohort run -n 2 gpu nccl", &out);
    let rows = text
        .lines()
        .filter(|l| l.trim_end().ends_with("yes"))
        .count();
    // rank 0 prints the table; every rank checks its own outputs (a miss fails the command)
    assert_eq!(rows, 10, "10 collectives: {text}");
}
