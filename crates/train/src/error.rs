//! The crate's errors: [`TrainError`], what can stop a training run, and
//! [`ConfigError`], why settings could not be resolved. Every module returns
//! these; this module depends on no other module of the crate, so that any
//! of them may use it. It never formats a log line or decides a policy: it
//! only names what went wrong and what was at fault.

use std::path::PathBuf;

use cohort_comm::CommError;

/// Why a configuration could not be built.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// The TOML file could not be read.
    #[error("cannot read config file {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The TOML file is malformed or has unknown keys.
    #[error("config file {path}: {message}")]
    Parse {
        /// The file.
        path: PathBuf,
        /// What the parser said.
        message: String,
    },
    /// `--init-from` names a directory whose model the run cannot take.
    #[error("--init-from {path}: {why}")]
    Pretrained {
        /// The directory.
        path: PathBuf,
        /// What is wrong.
        why: String,
    },
    /// A setting is out of range.
    #[error("invalid setting {key} = {value}: {why}")]
    Invalid {
        /// The setting.
        key: &'static str,
        /// Its value.
        value: String,
        /// What it must be.
        why: &'static str,
    },
    /// `--device` names a device this process cannot compute on, or a setting the device
    /// path does not support yet.
    #[error("--device {device}: {why}")]
    Device {
        /// The device asked for (`cuda:0`).
        device: String,
        /// Why it cannot be used.
        why: String,
    },
    /// A Slurm variable of an `srun` task is malformed.
    #[error("Slurm: {0}")]
    Slurm(#[from] cohort_store::slurm::SlurmError),
}

/// What can stop a training run.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TrainError {
    /// Bad settings.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The model refused its config or a batch.
    #[error("model: {0}")]
    Model(#[from] cohort_gpt::GptError),
    /// The optimizer, schedule or clipping refused.
    #[error("optimizer: {0}")]
    Optim(#[from] cohort_engine::optim::OptimError),
    /// Data parallelism failed (model mismatch, unused parameter, a collective).
    #[error("ddp: {0}")]
    Ddp(#[from] cohort_ddp::DdpError),
    /// A collective of the loop itself failed.
    #[error("{what}: {error}")]
    Comm {
        /// What the loop was doing.
        what: &'static str,
        /// The error.
        error: CommError,
    },
    /// A collective on device memory (NCCL) failed or timed out; the line names the rank and
    /// the operation.
    #[error("{0}")]
    DeviceComm(String),
    /// Saving or loading a checkpoint failed.
    #[error("checkpoint: {0}")]
    Checkpoint(#[from] cohort_gpt::checkpoint::CheckpointError),
    /// Checkpoints cannot be written (checked before the first step), or
    /// the final checkpoint or too many in a row were not saved: the work
    /// since the last good checkpoint would be lost.
    #[error("{0}")]
    CheckpointLost(String),
    /// A signal (SIGUSR1, or SIGTERM when asked) stopped the run at a step
    /// boundary, the same step on every rank, after saving there.
    #[error("stopped by {signal} after step {step}: {saved}")]
    Stopped {
        /// The signal's name, or where it came from.
        signal: String,
        /// The step every rank stopped after.
        step: u64,
        /// Where the checkpoint went (or why there is none).
        saved: String,
    },
    /// The settings need more memory than this host has available (known
    /// before anything is allocated).
    #[error("{0}")]
    TooBig(String),
    /// `--init-from` names a model the run cannot start from.
    #[error("cannot start from {path}: {reason}")]
    InitFrom {
        /// The directory.
        path: PathBuf,
        /// What does not fit.
        reason: String,
    },
    /// A checkpoint cannot be resumed by this run.
    #[error("cannot resume from {path}: {reason}")]
    Resume {
        /// The checkpoint.
        path: PathBuf,
        /// Why.
        reason: String,
    },
    /// The data is unusable: a data file (`--data PATH`), a built-in data
    /// set's parameters, or the ranks' split of it.
    #[error("data: {0}")]
    Data(#[from] cohort_data::DataError),
    /// The tokenizer (`--tokenizer`) could not be built, loaded or saved.
    #[error("tokenizer: {0}")]
    Tokenizer(#[from] cohort_tokenizer::TokenizerError),

    /// The chat template beside `--tokenizer` does not load.
    #[error("--tokenizer {path}: {source}")]
    ChatTemplate {
        /// The tokenizer path given.
        path: String,
        /// Why the template does not load.
        source: cohort_tokenizer::ChatError,
    },
    /// Writing the log failed.
    #[error("writing the log: {0}")]
    Log(std::io::Error),
    /// The run log directory (`--log-dir`, or `--out`'s `logs`) cannot be
    /// created or written.
    #[error("run log: {0}")]
    RunLog(String),
    /// Another rank could not resume from the checkpoint this rank tried
    /// (each rank reads only the files it needs, so only it saw why).
    #[error("rank {rank}: {message}")]
    PeerResume {
        /// The rank that failed.
        rank: usize,
        /// Whether it found the checkpoint damaged (an older one may do).
        damaged: bool,
        /// Its error.
        message: String,
    },
    /// The ranks built models of different sizes, so there is no one flat
    /// buffer to shard (ZeRO-1).
    #[error(
        "the ranks built models of different sizes ({min} to {max} parameters): every rank \
         needs the same model settings"
    )]
    ModelMismatch {
        /// The smallest parameter count of a rank.
        min: usize,
        /// The largest.
        max: usize,
    },
    /// A buffer handed to a sharded optimizer step is not as long as the
    /// parameters it was built over.
    #[error("ZeRO: {what} has {len} elements, but the parameters it shards have {expected}")]
    BufferLength {
        /// Which buffer.
        what: &'static str,
        /// Its length.
        len: usize,
        /// The parameter count.
        expected: usize,
    },
    /// The parameter server's calls failed (a worker or the server died,
    /// timed out, or refused a gradient).
    #[error("parameter server: {what}: {error}")]
    Rpc {
        /// What the run was doing.
        what: &'static str,
        /// The error.
        error: cohort_rpc::RpcError,
    },
    /// Too many updates in a row were skipped for a NaN or infinite loss or
    /// gradient (`max_consecutive_skips`).
    #[error(
        "diverged: {skipped} updates in a row skipped for a NaN or infinite loss or gradient, \
         the last at step {step} (max_consecutive_skips = {skipped}; {total} skipped in this run); \
         lower the learning rate or resume from an earlier checkpoint"
    )]
    Diverged {
        /// The step (1-based) of the last skip.
        step: u64,
        /// Skips in a row.
        skipped: u64,
        /// Skips in the run.
        total: u64,
    },
    /// The model handed a sharded strategy a range of its buffers that lies
    /// in no part the strategy sharded (the model and the strategy disagree
    /// on the model's layout).
    #[error("ZeRO: the model handed elements {start}..{end}, which lie in no sharded part")]
    UnknownPart {
        /// The range's first element.
        start: usize,
        /// One past its last.
        end: usize,
    },
    /// A test hook's environment variable is malformed.
    #[error("{var}={value:?}: expected {expected}")]
    Hook {
        /// The variable.
        var: &'static str,
        /// Its value.
        value: String,
        /// The form it must have.
        expected: &'static str,
    },
}

impl TrainError {
    /// Whether running again cannot help: bad settings, unusable data or
    /// tokenizer, settings too big for the host. A launcher need not restart
    /// a worker that failed so.
    pub fn is_permanent(&self) -> bool {
        matches!(
            self,
            TrainError::Config(_)
                | TrainError::Data(_)
                | TrainError::Tokenizer(_)
                | TrainError::ChatTemplate { .. }
                | TrainError::Hook { .. }
                | TrainError::TooBig(_)
                | TrainError::ModelMismatch { .. }
                | TrainError::BufferLength { .. }
        )
    }

    /// The error of a collective the loop itself ran, saying what it was doing.
    pub fn comm(what: &'static str) -> impl Fn(CommError) -> TrainError {
        move |error| TrainError::Comm { what, error }
    }
}
