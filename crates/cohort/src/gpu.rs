//! `cohort gpu info` and `cohort gpu check`: what this machine offers for CUDA, and every CUDA
//! kernel against the CPU engine. Wiring only: cohort-cuda finds, compiles, launches and
//! compares; this prints and maps failures to the exit code. Both run from the release binary
//! on a GPU machine that has no Rust toolchain (scripts/gpu-check.sh).

use anyhow::{bail, Context};
use cohort_cuda::{check, info::Info, libraries::Search, CudaBackend, Device};

/// The CUDA device: libraries, kernels.
#[derive(clap::Subcommand, Debug)]
pub enum GpuCmd {
    /// Print which CUDA libraries and headers were found where, NVRTC's version and device 0
    /// (name, SMs, memory, compute capability); fails when there is no usable GPU.
    Info,
    /// Run every CUDA kernel against the CPU engine on random inputs, then a short sequence of
    /// them through the engine's CUDA backend against the CPU backend, and print a table
    /// (kernel, max error, tolerance, ok); fails when any output differs.
    Check {
        /// The device ordinal.
        #[arg(long, default_value_t = 0)]
        device: usize,
    },
}

pub fn main(cmd: GpuCmd) -> anyhow::Result<()> {
    let search = Search::from_env();
    match cmd {
        GpuCmd::Info => {
            let info = Info::gather(&search);
            println!("{info}");
            if let Some(e) = info.blocking_error() {
                bail!("cohort gpu info: {e}");
            }
            Ok(())
        }
        GpuCmd::Check { device } => {
            let dev = Device::open(device, &search).context("cohort gpu check")?;
            let i = dev.info();
            println!(
                "device {}: {} (compute capability {}.{}), kernels compiled for {} by NVRTC {}.{}",
                i.ordinal,
                i.name,
                i.compute_capability.0,
                i.compute_capability.1,
                dev.arch().sm(),
                dev.compiler().version().0,
                dev.compiler().version().1
            );
            let mut rows = check::run(&dev);
            // then the engine's backend on the same device, against the CPU backend
            let backend = CudaBackend::on(dev);
            rows.extend(check::engine_backend(&backend));
            // and its bf16 products, against the CPU's fp32 at bf16's tolerance
            rows.extend(check::engine_backend_bf16(backend));
            print!("{}", check::table(&rows));
            let failed = rows.iter().filter(|r| !r.ok).count();
            if failed > 0 {
                bail!(
                    "cohort gpu check: {failed} of {} kernel outputs differ from the CPU engine's",
                    rows.len()
                );
            }
            Ok(())
        }
    }
}
