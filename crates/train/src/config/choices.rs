//! The named choices of a training run's settings (strategy, precision, pipeline schedule,
//! parameter-server mode, save mode, overlap): each a flag value and a TOML value at once.
//! This module only names and parses them; [`super::TrainConfig`] holds them.

use serde::{Deserialize, Serialize};

/// The order of a pipeline stage's forwards and backwards in a step.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, clap::ValueEnum)]
pub enum PipelineSchedule {
    /// All micro-batches' forwards, then all their backwards.
    #[serde(rename = "gpipe")]
    #[value(name = "gpipe")]
    Gpipe,
    /// Warm-up forwards, then one forward and one backward in turn: the
    /// same bubble as GPipe with fewer activations in flight.
    #[default]
    #[serde(rename = "1f1b")]
    #[value(name = "1f1b")]
    OneFOneB,
}

impl std::fmt::Display for PipelineSchedule {
    /// The schedule's usual name (GPipe, 1F1B), for logs.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            PipelineSchedule::Gpipe => "GPipe",
            PipelineSchedule::OneFOneB => "1F1B",
        })
    }
}

/// How the ranks of a training job share the work.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum Strategy {
    /// Every rank holds the model; gradients are averaged by all-reduce.
    #[default]
    Ddp,
    /// DiLoCo (Douillard et al. 2023): every rank takes `sync_every` AdamW
    /// steps on its own, then the ranks average their pseudo-gradients
    /// (parameters at the last sync minus now) and take one outer SGD step
    /// with Nesterov momentum on the global parameters.
    Diloco,
    /// Local SGD: DiLoCo's special case with outer lr 1 and no momentum,
    /// the ranks' parameters averaged every `sync_every` steps.
    LocalSgd,
    /// Rank 0 holds the parameters and the optimizer; the other ranks
    /// compute gradients and push them over RPC.
    ParameterServer,
    /// The model's blocks are split into stages on consecutive ranks.
    Pipeline,
    /// ZeRO stage 1 (PyTorch's `ZeroRedundancyOptimizer`, DeepSpeed
    /// ZeRO-1): data parallel, with the optimizer state sharded over the
    /// ranks; gradients are reduce-scattered and the updated parameters
    /// all-gathered.
    #[serde(rename = "zero1")]
    #[value(name = "zero1")]
    Zero1,
    /// ZeRO stage 2 (DeepSpeed ZeRO-2): as ZeRO-1, with the gradients
    /// sharded too: each part's gradient (a block's in two: its MLP, then
    /// its attention) is reduce-scattered as soon as it is final in
    /// backward and only this rank's shard is kept.
    #[serde(rename = "zero2")]
    #[value(name = "zero2")]
    Zero2,
    /// ZeRO stage 3 (DeepSpeed ZeRO-3, PyTorch FSDP's `fully_shard` by
    /// block): as ZeRO-2, with the parameters sharded too; each part's are
    /// all-gathered just before it runs and released after.
    #[serde(rename = "zero3")]
    #[value(name = "zero3")]
    Zero3,
}

impl Strategy {
    /// Whether this is one of the ZeRO strategies (data parallel with
    /// sharded state).
    pub fn is_zero(self) -> bool {
        matches!(self, Strategy::Zero1 | Strategy::Zero2 | Strategy::Zero3)
    }

    /// The flag's name of the strategy.
    pub fn name(self) -> &'static str {
        match self {
            Strategy::Ddp => "ddp",
            Strategy::Diloco => "diloco",
            Strategy::LocalSgd => "local-sgd",
            Strategy::ParameterServer => "parameter-server",
            Strategy::Pipeline => "pipeline",
            Strategy::Zero1 => "zero1",
            Strategy::Zero2 => "zero2",
            Strategy::Zero3 => "zero3",
        }
    }
}

/// How a parameter server applies the workers' gradients.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum PsMode {
    /// Waits for every worker's gradient of a step, averages, updates once.
    #[default]
    Sync,
    /// Applies each gradient as it arrives, if it is not too stale.
    Async,
}

/// What the model's matrix products compute in. Parameters, gradients, optimizer state and
/// every other kernel stay fp32 either way.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum Precision {
    /// fp32 throughout.
    #[default]
    Fp32,
    /// bf16 inputs and f32 sums (AMX or AVX512_BF16, whichever the CPU has; fp32 with a
    /// note where it has neither).
    Bf16,
}

impl Precision {
    /// The engine's name for it.
    pub fn dtype(self) -> cohort_engine::DType {
        match self {
            Precision::Fp32 => cohort_engine::DType::F32,
            Precision::Bf16 => cohort_engine::DType::Bf16,
        }
    }
}

/// Where a periodic checkpoint is written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum SaveMode {
    /// The state is copied at the step boundary and a writer thread hashes, fsyncs and
    /// commits it while training goes on; one save at a time. ZeRO's sharded saves, whose
    /// ranks agree on the commit, stay on the training thread.
    #[default]
    Background,
    /// On the training thread: every rank waits for the save.
    Sync,
}

/// When DDP reduces gradient buckets: on a communication thread during
/// backward, or on the training thread after it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum Overlap {
    /// On when this node has a core that no compute thread uses.
    #[default]
    Auto,
    /// During backward.
    On,
    /// After backward.
    Off,
}

impl Overlap {
    /// Whether to overlap, for `world` ranks of which `local_ranks` run on
    /// this node, each computing on `threads` threads.
    ///
    /// On one node, when every core already runs a compute thread, the
    /// communication thread can only run by preempting one, and the rank it
    /// delays holds up the other ranks at the next bucket: on two cores,
    /// config A with 2 ranks measured efficiency 0.94 reducing after
    /// backward against 0.77 overlapping (medians of 5). Across nodes the
    /// communication thread mostly waits on the network, which takes no
    /// core, while overlap hides the wire time, so a job that spans nodes
    /// overlaps, as PyTorch always does (not measured: our "nodes" here
    /// share the same two cores).
    pub fn enabled(self, world: usize, local_ranks: usize, threads: usize) -> bool {
        match self {
            Overlap::On => true,
            Overlap::Off => false,
            Overlap::Auto => {
                let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
                world > local_ranks || cores > local_ranks * threads
            }
        }
    }
}
