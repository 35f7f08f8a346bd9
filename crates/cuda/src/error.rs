//! The crate's one error type. Every variant names what failed (a library and the places
//! looked, a kernel, an argument and its sizes) so that the message alone says where to look;
//! it must never carry a value that needs the driver to print (the driver may be what is
//! missing).

use std::path::PathBuf;

/// What went wrong finding, compiling or running CUDA code.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CudaError {
    /// A library was not found in any of the places searched.
    #[error("no {what}: looked for {names} in {}", places_text(looked_in))]
    LibraryNotFound {
        /// What the library is for ("GPU/driver", "NVRTC", ...).
        what: &'static str,
        /// The file names tried, joined with " or ".
        names: String,
        /// Every directory searched, in order (plus "ldconfig" when its cache was read).
        looked_in: Vec<String>,
    },
    /// A library was found but `dlopen` refused it.
    #[error("cannot open {}: {reason}", path.display())]
    LibraryOpen {
        /// The file.
        path: PathBuf,
        /// `dlerror()`'s text.
        reason: String,
    },
    /// No directory holds `cuda_bf16.h`, which the kernels include.
    #[error(
        "no CUDA runtime headers: looked for cuda_bf16.h in {}",
        places_text(looked_in)
    )]
    HeadersNotFound {
        /// Every directory searched, in order.
        looked_in: Vec<String>,
    },
    /// NVRTC failed to compile a kernel family.
    #[error("NVRTC: {family}.cu for {arch} does not compile: {log}")]
    Compile {
        /// The kernel source file.
        family: &'static str,
        /// The target ("sm_90").
        arch: String,
        /// NVRTC's log (the first lines of it).
        log: String,
    },
    /// A kernel spills registers to local memory (ptxas's "bytes spill stores/loads").
    #[error("NVRTC: kernel {kernel} in {family}.cu for {arch} spills registers: {line}")]
    Spill {
        /// The kernel source file.
        family: &'static str,
        /// The kernel's (mangled or extern "C") name.
        kernel: String,
        /// The target.
        arch: String,
        /// ptxas's line.
        line: String,
    },
    /// An NVRTC call other than the compile itself failed.
    #[error("NVRTC: {call} failed: {reason}")]
    Nvrtc {
        /// The call.
        call: &'static str,
        /// The NVRTC error.
        reason: String,
    },
    /// A driver call failed.
    #[error("CUDA driver: {call} failed: {reason}")]
    Driver {
        /// The call (or "launch <kernel>", "sync after <kernel>").
        call: String,
        /// The driver's error text.
        reason: String,
    },
    /// No device with this ordinal.
    #[error("no CUDA device {ordinal}: the driver sees {count}")]
    NoDevice {
        /// Asked for.
        ordinal: usize,
        /// Devices the driver reports.
        count: usize,
    },
    /// A buffer is too small for the dimensions a kernel was given.
    #[error("{kernel}: {arg} holds {got} elements, the dims need {need}")]
    Shape {
        /// The kernel.
        kernel: &'static str,
        /// The argument.
        arg: &'static str,
        /// Elements needed.
        need: usize,
        /// Elements given.
        got: usize,
    },
    /// A dimension the kernel does not support.
    #[error("{kernel}: {what}")]
    Unsupported {
        /// The kernel.
        kernel: &'static str,
        /// What is out of range.
        what: String,
    },
    /// cuBLAS failed.
    #[error("cuBLAS: {call} failed: {reason}")]
    Blas {
        /// The call.
        call: &'static str,
        /// cuBLAS's status.
        reason: String,
    },
}

/// "a, b, c" (or "nowhere" when the search list was empty).
fn places_text(places: &[String]) -> String {
    if places.is_empty() {
        "nowhere (no directory to search)".to_string()
    } else {
        places.join(", ")
    }
}

impl CudaError {
    /// A driver error, named by the call that returned it.
    pub(crate) fn driver(call: impl Into<String>, e: cudarc::driver::DriverError) -> CudaError {
        // The driver's own text when it can give one (it can, once loaded), else the code.
        let reason = match e.error_string() {
            Ok(s) => format!("{:?} ({})", e.0, s.to_string_lossy()),
            Err(_) => format!("{:?}", e.0),
        };
        CudaError::Driver {
            call: call.into(),
            reason,
        }
    }
}
