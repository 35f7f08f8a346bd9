//! Every kernel family compiles with NVRTC for sm_80 and sm_90 with no register spill, and
//! every kernel the launcher names is in the compiled code. NVRTC needs no GPU: this runs
//! wherever NVRTC and the CUDA runtime headers are found (the `nvidia-*` wheels that `pip
//! install torch` brings), and skips with a message elsewhere; under CI (`CI=true`) a missing
//! NVRTC fails instead, so a kernel that does not compile never lands.

use cohort_cuda::kernels::FAMILIES;
use cohort_cuda::libraries::Search;
use cohort_cuda::nvrtc::{Arch, Compiler};

/// The compiler, or None (skip) where NVRTC is missing outside CI.
fn compiler() -> Option<Compiler> {
    match Compiler::new(&Search::from_env()) {
        Ok(c) => Some(c),
        Err(e) if in_ci() => {
            panic!("CI is set, and the NVRTC compile test cannot run: {e} (pip install torch brings NVRTC and the headers)")
        }
        Err(e) => {
            eprintln!("skipped: NVRTC compile test: {e}");
            None
        }
    }
}

#[test]
fn a_spilling_kernel_is_an_error_naming_it() {
    let Some(compiler) = compiler() else { return };
    let family = FAMILIES.iter().find(|f| f.name == "attention").unwrap();
    let e = compiler
        .compile_with(family, Arch(90), &["--maxrregcount=16"])
        .unwrap_err();
    let text = e.to_string();
    assert!(
        text.contains("spills registers") && text.contains("attention_"),
        "{text}"
    );
}

#[test]
fn every_family_compiles_to_ptx_for_compute_80() {
    let Some(compiler) = compiler() else { return };
    for family in FAMILIES {
        let ptx = compiler
            .compile_ptx(family, Arch(80))
            .unwrap_or_else(|e| panic!("{e}"));
        assert!(
            ptx.contains(".target sm_80"),
            "{}: {}",
            family.name,
            &ptx[..ptx.len().min(300)]
        );
        for k in family.kernels {
            assert!(
                ptx.contains(&format!(".entry {k}(")),
                "{}: no entry {k}",
                family.name
            );
        }
    }
}

#[test]
fn every_kernel_compiles_for_sm80_and_sm90_without_spills() {
    let Some(compiler) = compiler() else { return };
    let (major, minor) = compiler.version();
    eprintln!(
        "NVRTC {major}.{minor} from {}",
        compiler.nvrtc_path().display()
    );
    for arch in Arch::CHECKED {
        for family in FAMILIES {
            let compiled = compiler
                .compile(family, arch)
                .unwrap_or_else(|e| panic!("{e}"));
            assert!(!compiled.cubin.is_empty(), "{}: empty cubin", family.name);
            for k in family.kernels {
                let r = compiled
                    .kernels
                    .iter()
                    .find(|r| r.name == *k)
                    .unwrap_or_else(|| {
                        panic!(
                            "{}.cu for {}: no kernel {k} in ptxas's report",
                            family.name,
                            arch.sm()
                        )
                    });
                eprintln!(
                    "{:>6} {:<14} {:<28} {:>3} registers",
                    arch.sm(),
                    family.name,
                    k,
                    r.registers
                );
            }
        }
    }
}

/// Whether this runs under CI (`CI` set, and not to "", "0" or "false"), where a skipped
/// compile test would let a broken kernel land.
fn in_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| !matches!(v.trim(), "" | "0" | "false"))
}
