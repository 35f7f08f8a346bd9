//! `cohort gpu info`, `cohort gpu check` and `cohort gpu nccl`: what this machine offers for
//! CUDA, every CUDA kernel against the CPU engine, and every NCCL collective against its
//! expected values. Wiring only: cohort-cuda and cohort-nccl find, compile, launch and
//! compare; this prints and maps failures to the exit code. All run from the release binary
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
    /// NCCL's version and file, then every collective (all_reduce sum and avg,
    /// reduce_scatter, all_gather, broadcast; f32 and bf16) against its expected values, on
    /// one rank or under `cohort run -n N` (each rank on `cuda:LOCAL_RANK` modulo the GPUs;
    /// ranks sharing a GPU need NCCL 2.30+ and NCCL_MULTI_RANK_GPU_ENABLE=1); fails on a
    /// difference or an NCCL error.
    Nccl {
        /// Elements per rank of each collective.
        #[arg(long, default_value_t = (1 << 20) + 3)]
        elements: usize,
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
        GpuCmd::Nccl { elements } => nccl(&search, elements).context("cohort gpu nccl"),
    }
}

/// `cohort gpu nccl` (see [`GpuCmd::Nccl`]).
fn nccl(search: &Search, elements: usize) -> anyhow::Result<()> {
    let pg = cohort_train::process_group_from_env()?;
    let nccl = cohort_nccl::load(search)?;
    let ordinal = cohort_train::local_cuda_ordinal(cohort_cuda::device_count(search)?);
    let backend = CudaBackend::open(ordinal, cohort_engine::DType::F32, search)?;
    let binding = cohort_nccl::Binding::of(&backend).context("a CUDA backend has a stream")?;
    let key = format!(
        "cohort-gpu-nccl/{}",
        cohort_train::elastic::restart_count_from_env()?
    );
    if pg.rank() == 0 {
        println!(
            "NCCL {} from {}; {} rank(s), rank 0 on cuda:{ordinal} ({})",
            nccl.version(),
            nccl.path().display(),
            pg.size(),
            backend.device_handle().info().name
        );
    }
    let policy = cohort_nccl::Policy::Required;
    let comm = match cohort_nccl::join(&pg, search, binding, &key, policy)? {
        cohort_nccl::Joined::Nccl(c) => c,
        cohort_nccl::Joined::Staged(why) => bail!("NCCL was required: {why}"),
    };
    let rows = cohort_nccl::check::run(&comm, &backend, elements)?;
    let failed = rows.iter().filter(|r| !r.ok).count();
    if pg.rank() == 0 || failed > 0 {
        print!("{}", cohort_nccl::check::table(&rows));
    }
    if failed > 0 {
        bail!(
            "rank {}: {failed} of {} NCCL collectives differ from their expected values",
            pg.rank(),
            rows.len()
        );
    }
    Ok(())
}
