//! A missing or broken CUDA library is a one-line error naming what was looked for and every
//! place looked, never a panic (cudarc panics when it cannot load a library, so the search
//! runs before any cudarc call).

use std::path::PathBuf;

use cohort_cuda::libraries::{Library, Search};
use cohort_cuda::nvrtc::Compiler;
use cohort_cuda::{CudaError, Device};

fn empty_dir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("cohort-cuda-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

#[test]
fn no_driver_is_a_one_line_error_naming_the_library_and_the_places() {
    let dir = empty_dir("nodriver");
    let search = Search::in_dirs([dir.clone()]);
    let e = Device::open(0, &search).unwrap_err();
    let text = e.to_string();
    assert!(matches!(e, CudaError::LibraryNotFound { .. }), "{text}");
    assert!(!text.contains('\n'), "{text}");
    assert!(
        text.starts_with("no GPU/driver: looked for libcuda.so.1"),
        "{text}"
    );
    assert!(text.contains(&dir.display().to_string()), "{text}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn no_nvrtc_or_headers_is_an_error_not_a_panic() {
    let dir = empty_dir("nonvrtc");
    let e = Compiler::new(&Search::in_dirs([dir.clone()])).unwrap_err();
    assert!(matches!(e, CudaError::HeadersNotFound { .. }), "{e}");
    // Headers present, NVRTC missing.
    std::fs::write(dir.join("cuda_bf16.h"), "").unwrap();
    let e = Compiler::new(&Search::in_dirs([dir.clone()])).unwrap_err();
    let text = e.to_string();
    assert!(
        text.starts_with("no NVRTC builtins: looked for")
            || text.starts_with("no NVRTC: looked for"),
        "{text}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_file_that_is_not_a_library_is_an_open_error() {
    let dir = empty_dir("badlib");
    let fake = dir.join("libnccl.so.2");
    std::fs::write(&fake, b"not an ELF file").unwrap();
    let search = Search::in_dirs([dir.clone()]);
    assert_eq!(search.find(Library::Nccl).unwrap(), fake);
    let e = search.open(&[Library::Nccl]).unwrap_err();
    assert!(matches!(e, CudaError::LibraryOpen { .. }), "{e}");
    assert!(e.to_string().contains("libnccl.so.2"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn an_empty_search_says_so() {
    let e = Search::in_dirs([]).find(Library::Cublas).unwrap_err();
    assert_eq!(
        e.to_string(),
        "no cuBLAS: looked for libcublas.so.13 or libcublas.so.12 or libcublas.so in nowhere (no directory to search)"
    );
}
