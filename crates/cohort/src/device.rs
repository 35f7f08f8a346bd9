//! `--device cuda[:N]`: how the binary builds a GPU's backend for the training crates, which
//! never link a GPU library themselves (`cohort_train::register_device_backend`). Wiring only:
//! cohort-cuda finds the driver, opens the device and compiles its kernels.

use cohort_cuda::{device_count, libraries::Search, CudaBackend};
use cohort_engine::{Backend, DType};

/// Registers [`open_cuda`] with the training crate.
pub fn register() {
    cohort_train::register_device_backend(open_cuda);
}

/// The CUDA backend of GPU `ordinal` (`None`: `LOCAL_RANK` modulo the GPUs this process sees,
/// after `CUDA_VISIBLE_DEVICES`), its products in `dtype`; a missing driver, library or device
/// is one line naming what was looked for.
fn open_cuda(ordinal: Option<usize>, dtype: DType) -> Result<Box<dyn Backend>, String> {
    let search = Search::from_env();
    let visible = device_count(&search).map_err(|e| e.to_string())?;
    let seen = || match std::env::var("CUDA_VISIBLE_DEVICES") {
        Ok(v) => format!("{visible} GPU(s) visible (CUDA_VISIBLE_DEVICES={v})"),
        Err(_) => format!("{visible} GPU(s) visible"),
    };
    if visible == 0 {
        return Err(format!("no GPU: the driver loaded but {}", seen()));
    }
    let ordinal = ordinal.unwrap_or_else(|| cohort_train::local_cuda_ordinal(visible));
    if ordinal >= visible {
        return Err(format!("no GPU {ordinal}: {}", seen()));
    }
    let backend = CudaBackend::open(ordinal, dtype, &search).map_err(|e| e.to_string())?;
    Ok(Box::new(backend))
}
