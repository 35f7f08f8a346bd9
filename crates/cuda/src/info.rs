//! What this machine offers for CUDA, as `cohort gpu info` prints it: each library and where
//! it was found (or where it was looked for), the runtime headers, NVRTC's version, and the
//! devices the driver sees. Gathering it must never fail or panic: each part that is missing
//! is reported as such, and the driver is only called once it is found.

use std::fmt::Write as _;

use crate::libraries::{Library, Search};
use crate::nvrtc::Compiler;
use crate::{device, CudaError, Device, DeviceInfo};

/// What was found where.
#[derive(Debug)]
pub struct Info {
    /// Each library: its path or the error of its search.
    pub libraries: Vec<(Library, Result<std::path::PathBuf, CudaError>)>,
    /// The runtime headers directory, or why not.
    pub headers: Result<std::path::PathBuf, CudaError>,
    /// NVRTC's version, or why not.
    pub nvrtc: Result<(i32, i32), CudaError>,
    /// The first device, or why not (no driver, no device, ...).
    pub device: Result<DeviceInfo, CudaError>,
}

impl Info {
    /// Looks for everything `search` describes; opens device 0 when there is one.
    pub fn gather(search: &Search) -> Info {
        let libraries = Library::ALL.iter().map(|&l| (l, search.find(l))).collect();
        let headers = search.headers();
        let nvrtc = Compiler::new(search).map(|c| c.version());
        let device = device::device_count(search)
            .and_then(|_| Device::open(0, search))
            .map(|d| d.info().clone());
        Info {
            libraries,
            headers,
            nvrtc,
            device,
        }
    }

    /// The first error that stops GPU work (a missing driver, no device), if any.
    pub fn blocking_error(&self) -> Option<&CudaError> {
        self.device.as_ref().err()
    }
}

impl std::fmt::Display for Info {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut s = String::new();
        for (lib, r) in &self.libraries {
            match r {
                Ok(p) => {
                    let note = if lib.reachable_by_cudarc(p) {
                        ""
                    } else {
                        " (a name cudarc's loader never tries: not usable through cudarc)"
                    };
                    let _ = writeln!(s, "{:<15} {}{note}", lib.what(), p.display());
                }
                Err(e) => {
                    let _ = writeln!(s, "{:<15} missing: {e}", lib.what());
                }
            }
        }
        let _ = match &self.headers {
            Ok(p) => writeln!(s, "{:<15} {}", "headers", p.display()),
            Err(e) => writeln!(s, "{:<15} missing: {e}", "headers"),
        };
        let _ = match &self.nvrtc {
            Ok((a, b)) => writeln!(s, "{:<15} {a}.{b}", "NVRTC version"),
            Err(e) => writeln!(s, "{:<15} unavailable: {e}", "NVRTC version"),
        };
        let _ = match &self.device {
            Ok(d) => writeln!(
                s,
                "{:<15} {} of {}: {}, compute capability {}.{}, {} SMs, {:.1} GiB, driver CUDA {}.{}",
                "device",
                d.ordinal,
                d.device_count,
                d.name,
                d.compute_capability.0,
                d.compute_capability.1,
                d.sm_count,
                d.total_memory as f64 / (1u64 << 30) as f64,
                d.driver_version / 1000,
                d.driver_version % 1000 / 10
            ),
            Err(e) => writeln!(s, "{:<15} none: {e}", "device"),
        };
        f.write_str(s.trim_end())
    }
}
