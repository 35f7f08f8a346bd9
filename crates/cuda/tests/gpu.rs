//! Every CUDA kernel against the CPU engine (cohort_cuda::check), where there is a GPU. With
//! no driver or no device this skips with a one-line message; the GPU script runs the same
//! checks through the release binary (`cohort gpu check`), which needs no toolchain.

use cohort_cuda::libraries::Search;
use cohort_cuda::{check, device_count, Device};

#[test]
fn every_kernel_matches_the_cpu_engine() {
    let search = Search::from_env();
    match device_count(&search) {
        Ok(0) => {
            eprintln!("skipped: GPU checks: the driver sees no device");
            return;
        }
        Ok(_) => {}
        Err(e) => {
            eprintln!("skipped: GPU checks: {e}");
            return;
        }
    }
    let dev = Device::open(0, &search).unwrap_or_else(|e| panic!("{e}"));
    let rows = check::run(&dev);
    eprintln!("{}", check::table(&rows));
    assert!(rows.iter().all(|r| r.ok), "{}", check::table(&rows));
}

/// The engine's backend on the GPU against the CPU backend (cohort_cuda::check::engine_backend).
#[test]
fn the_engine_backend_on_the_gpu_matches_the_cpu_backend() {
    let search = Search::from_env();
    let gpu = match cohort_cuda::CudaBackend::open(0, cohort_engine::DType::F32, &search) {
        Ok(b) => b,
        Err(e) => {
            eprintln!("skipped: the engine backend on the GPU: {e}");
            return;
        }
    };
    let rows = check::engine_backend(&gpu);
    eprintln!("{}", check::table(&rows));
    assert!(rows.iter().all(|r| r.ok), "{}", check::table(&rows));
}

/// The host-staging seam of host-staged DDP on the GPU (cohort_cuda::check::host_staging): an
/// event after 20 kernels, a copy after it on another thread into page-locked memory and back
/// beside the kernels, while kernels write another region; every region exactly the CPU's.
#[test]
fn a_copy_after_an_event_lands_what_the_kernels_before_it_wrote() {
    let search = Search::from_env();
    let gpu = match cohort_cuda::CudaBackend::open(0, cohort_engine::DType::F32, &search) {
        Ok(b) => b,
        Err(e) => {
            eprintln!("skipped: host staging on the GPU: {e}");
            return;
        }
    };
    let row = check::host_staging(&gpu);
    eprintln!("{}", check::table(std::slice::from_ref(&row)));
    assert!(row.ok, "{}", check::table(&[row]));
}
