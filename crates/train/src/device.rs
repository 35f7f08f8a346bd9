//! Where a run computes (`--device cpu|cuda|cuda:N`, the config key `device`): the choice, its
//! text form, and the backend it builds. The CPU and the emulated device (a test tool: device
//! memory in host memory, the CPU's kernels) are built here; a GPU's backend is built by the
//! program that links it, through [`register_device_backend`], so that this crate never depends
//! on a GPU library. Under `cohort run`, `cuda` without an ordinal is the rank's local rank
//! modulo the GPUs the process sees (`CUDA_VISIBLE_DEVICES` applies), as a torchrun script's
//! `torch.cuda.set_device(local_rank)`.
//!
//! This module never runs a kernel; it must never pick a device the user did not ask for.

use std::fmt;
use std::str::FromStr;
use std::sync::OnceLock;

use cohort_engine::{Backend, DType, Emulated};
use serde::{Deserialize, Serialize};

use crate::error::ConfigError;

/// The device a run computes on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub enum DeviceChoice {
    /// The host's CPU (the default).
    #[default]
    Cpu,
    /// A CUDA GPU: `cuda:N`, or `cuda` (the local rank modulo the visible GPUs).
    Cuda(Option<usize>),
    /// The emulated device: the device code path on the host, for tests (`emulated`).
    Emulated,
}

impl DeviceChoice {
    /// Whether the model lives in a device's memory (CUDA or emulated).
    pub fn is_device(self) -> bool {
        self != DeviceChoice::Cpu
    }
}

impl fmt::Display for DeviceChoice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DeviceChoice::Cpu => f.write_str("cpu"),
            DeviceChoice::Cuda(None) => f.write_str("cuda"),
            DeviceChoice::Cuda(Some(n)) => write!(f, "cuda:{n}"),
            DeviceChoice::Emulated => f.write_str("emulated"),
        }
    }
}

impl FromStr for DeviceChoice {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let bad = || format!("{s:?} is not a device: cpu, cuda or cuda:N");
        match s.trim() {
            "cpu" => Ok(DeviceChoice::Cpu),
            "cuda" => Ok(DeviceChoice::Cuda(None)),
            "emulated" => Ok(DeviceChoice::Emulated),
            other => match other.strip_prefix("cuda:") {
                Some(n) => n
                    .parse()
                    .map(|n| DeviceChoice::Cuda(Some(n)))
                    .map_err(|_| bad()),
                None => Err(bad()),
            },
        }
    }
}

impl TryFrom<String> for DeviceChoice {
    type Error = String;
    fn try_from(s: String) -> Result<Self, String> {
        s.parse()
    }
}

impl From<DeviceChoice> for String {
    fn from(d: DeviceChoice) -> String {
        d.to_string()
    }
}

/// Builds a GPU's backend: the ordinal (`None`: the local rank modulo the visible GPUs) and
/// what the products compute in; an error is one line naming what was missing.
pub type DeviceBackendFn = fn(Option<usize>, DType) -> Result<Box<dyn Backend>, String>;

static CUDA: OnceLock<DeviceBackendFn> = OnceLock::new();

/// Registers how to build a CUDA backend (the `cohort` binary does, with cohort-cuda's). A
/// second registration is ignored.
pub fn register_device_backend(build: DeviceBackendFn) {
    let _ = CUDA.set(build);
}

/// The backend `device` names, computing on `threads` host threads where it uses the CPU's
/// kernels, its products in `dtype`.
pub fn device_backend(
    device: DeviceChoice,
    threads: usize,
    dtype: DType,
) -> Result<Box<dyn Backend>, ConfigError> {
    let err = |why: String| ConfigError::Device {
        device: device.to_string(),
        why,
    };
    match device {
        DeviceChoice::Cpu => cohort_engine::cpu::Cpu::with_dtype(threads, dtype)
            .map(|c| Box::new(c) as Box<dyn Backend>)
            .map_err(|e| err(e.to_string())),
        DeviceChoice::Emulated => Emulated::new(threads, dtype)
            .map(|c| Box::new(c) as Box<dyn Backend>)
            .map_err(|e| err(e.to_string())),
        DeviceChoice::Cuda(ordinal) => match CUDA.get() {
            Some(build) => build(ordinal, dtype).map_err(err),
            None => Err(err(
                "this program was built without a CUDA backend (the cohort binary has one)".into(),
            )),
        },
    }
}

/// The ordinal `cuda` without one means for this process: `LOCAL_RANK` (0 when unset) modulo
/// `visible`, the GPUs it sees.
pub fn local_cuda_ordinal(visible: usize) -> usize {
    let local: usize = std::env::var("LOCAL_RANK")
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0);
    local % visible.max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn devices_parse_and_print_back() {
        for s in ["cpu", "cuda", "cuda:3", "emulated"] {
            assert_eq!(s.parse::<DeviceChoice>().unwrap().to_string(), s);
        }
        for bad in ["gpu", "cuda:x", "cuda:", ""] {
            let e = bad.parse::<DeviceChoice>().unwrap_err();
            assert!(e.contains("cpu, cuda or cuda:N"), "{e}");
        }
    }

    #[test]
    fn cuda_without_a_registered_backend_is_a_one_line_error() {
        let e = device_backend(DeviceChoice::Cuda(Some(0)), 1, DType::F32)
            .err()
            .unwrap()
            .to_string();
        assert!(e.starts_with("--device cuda:0: "), "{e}");
        assert!(!e.contains('\n'), "{e}");
    }
}
