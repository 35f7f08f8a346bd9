//! `ServeError`: everything that can go wrong serving, each variant carrying what was at fault,
//! and the protocol status it maps to ([`ErrorKind`]). This module never decides how an error is
//! written on the wire; the HTTP and gRPC front ends do that from [`ServeError::kind`].

use std::path::PathBuf;

/// Which class of failure an error is: the HTTP status and gRPC code it becomes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    /// Malformed or invalid request (HTTP 400, gRPC INVALID_ARGUMENT).
    BadRequest,
    /// Unknown model or version (HTTP 404, gRPC NOT_FOUND).
    NotFound,
    /// The request body is over the limit (HTTP 413, gRPC RESOURCE_EXHAUSTED).
    TooLarge,
    /// The model cannot take the request now: queue full, not ready, shutting down
    /// (HTTP 503, gRPC UNAVAILABLE).
    Unavailable,
    /// The server failed (HTTP 500, gRPC INTERNAL).
    Internal,
}

/// What went wrong serving, loading a model, or parsing a request.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ServeError {
    /// No model of this name is loaded.
    #[error("unknown model {model:?}")]
    UnknownModel {
        /// The name asked for.
        model: String,
    },
    /// The model is loaded but not this version.
    #[error("model {model:?} has no ready version {version:?} (ready: {ready:?})")]
    UnknownVersion {
        /// The model.
        model: String,
        /// The version asked for.
        version: String,
        /// The versions that are ready.
        ready: Vec<u64>,
    },
    /// No endpoint answers at this path (HTTP 404).
    #[error("no such endpoint {path}: {hint}")]
    NoEndpoint {
        /// The path asked for.
        path: String,
        /// What the port does serve.
        hint: &'static str,
    },
    /// Models asked for at start are not ready (`exit_on_error`).
    #[error("models failed to load at start (--exit-on-error): {models}")]
    ModelsNotReady {
        /// Each model and why, `"name": reason; ...`.
        models: String,
    },
    /// The model directory exists but the model is not loaded (unloaded, or its load failed).
    #[error("model {model:?} is not ready: {reason}")]
    NotReady {
        /// The model.
        model: String,
        /// Why.
        reason: String,
    },
    /// The request body is not valid JSON / protobuf, or lacks a required field.
    #[error("malformed request: {reason}")]
    Malformed {
        /// What is wrong.
        reason: String,
    },
    /// A tensor named in the request is not one the model has.
    #[error("model {model:?} has no {direction} tensor {name:?} (it has {known})")]
    UnknownTensor {
        /// The model.
        model: String,
        /// `input` or `output`.
        direction: &'static str,
        /// The name given.
        name: String,
        /// The names it has.
        known: String,
    },
    /// The request has the wrong number of inputs.
    #[error("model {model:?} expects {expected} input(s), the request has {found}")]
    InputCount {
        /// The model.
        model: String,
        /// Inputs expected.
        expected: usize,
        /// Inputs given.
        found: usize,
    },
    /// A tensor's datatype is not the model's.
    #[error("tensor {tensor:?} has datatype {found}, the model expects {expected}")]
    Datatype {
        /// The tensor.
        tensor: String,
        /// The datatype given.
        found: String,
        /// The datatype expected.
        expected: &'static str,
    },
    /// A tensor's shape is unusable.
    #[error("tensor {tensor:?} has shape {shape:?}: {reason}")]
    Shape {
        /// The tensor.
        tensor: String,
        /// The shape given.
        shape: Vec<i64>,
        /// Why it is unusable.
        reason: String,
    },
    /// A tensor's data does not have as many elements (or bytes) as its shape says.
    #[error(
        "tensor {tensor:?}: shape {shape:?} needs {expected} {unit}, the request holds {found}"
    )]
    DataSize {
        /// The tensor.
        tensor: String,
        /// Its shape.
        shape: Vec<i64>,
        /// Elements or bytes the shape implies.
        expected: usize,
        /// Elements or bytes given.
        found: usize,
        /// `elements` or `bytes`.
        unit: &'static str,
    },
    /// A token id is not in the model's vocabulary.
    #[error("{tensor}[{index}] = {value} is outside the vocabulary 0..{vocab}")]
    TokenOutOfRange {
        /// The tensor.
        tensor: String,
        /// Flat index of the element.
        index: usize,
        /// Its value.
        value: i64,
        /// The vocabulary size.
        vocab: usize,
    },
    /// A BYTES tensor's elements are unusable: a 4-byte length prefix cut short, a length
    /// running past the data, an element that is not UTF-8 where text is required.
    #[error("tensor {tensor:?}: {reason}")]
    Bytes {
        /// The tensor.
        tensor: String,
        /// What is wrong, naming the element.
        reason: String,
    },
    /// A request parameter has an unusable value.
    #[error("parameter {name:?}: {reason}")]
    Parameter {
        /// The parameter.
        name: String,
        /// What is wrong with it.
        reason: String,
    },
    /// The prompt could not be turned into token ids, or the output back into text.
    #[error("model {model:?}: {reason}")]
    Text {
        /// The model.
        model: String,
        /// The tokenizer's complaint.
        reason: String,
    },
    /// Generation refused the request (empty prompt, bad temperature, ...).
    #[error("model {model:?}: {source}")]
    Generate {
        /// The model.
        model: String,
        /// The sampler's complaint.
        source: cohort_gpt::sample::SampleError,
    },
    /// The request body is larger than the server accepts.
    #[error("request body is over the limit of {limit} bytes")]
    BodyTooLarge {
        /// The limit.
        limit: usize,
    },
    /// The model's request queue is full.
    #[error("model {model:?} version {version}: the request queue is full ({capacity} requests waiting); retry later")]
    QueueFull {
        /// The model.
        model: String,
        /// The version.
        version: u64,
        /// The queue's capacity.
        capacity: usize,
    },
    /// The model version is being unloaded or the server is shutting down.
    #[error("model {model:?} version {version} is shutting down")]
    ShuttingDown {
        /// The model.
        model: String,
        /// The version.
        version: u64,
    },
    /// A step of an ensemble failed. The ensemble answers with the step's class where the
    /// request was at fault or a step's model is busy, and as a server failure otherwise.
    #[error("model {model:?} version {version}: step {step:?}: {source}")]
    Step {
        /// The ensemble.
        model: String,
        /// Its version.
        version: u64,
        /// The step's model.
        step: String,
        /// The step's error.
        source: Box<ServeError>,
    },
    /// A model instance failed while executing the request.
    #[error("model {model:?} version {version}: execution failed: {reason}")]
    Execution {
        /// The model.
        model: String,
        /// The version.
        version: u64,
        /// What failed.
        reason: String,
    },
    /// A model's config.pbtxt / config.toml is unusable.
    #[error("{path}: {reason}")]
    Config {
        /// The file (or model directory).
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// A model version's checkpoint could not be loaded.
    #[error("model {model:?} version {version}: {source}")]
    Load {
        /// The model.
        model: String,
        /// The version.
        version: u64,
        /// The checkpoint loader's error (boxed: it is large, and errors travel by value).
        source: Box<cohort_gpt::checkpoint::CheckpointError>,
    },
    /// A model version that its backend could not load (its file, an operator, a tensor).
    #[error("model {model:?} version {version}: {reason}")]
    Backend {
        /// The model.
        model: String,
        /// The version.
        version: u64,
        /// What was wrong, naming the file, operator or tensor.
        reason: String,
    },
    /// A file-system operation on the repository failed.
    #[error("{op} {path}: {source}")]
    Io {
        /// What was being done.
        op: &'static str,
        /// The path.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// A listening socket could not be bound.
    #[error("cannot listen on {addr} ({what}): {source}")]
    Bind {
        /// `HTTP` or `gRPC`.
        what: &'static str,
        /// The address.
        addr: std::net::SocketAddr,
        /// The OS error.
        source: std::io::Error,
    },
    /// A model instance (thread pool) could not be built.
    #[error("model {model:?}: {reason}")]
    Instance {
        /// The model.
        model: String,
        /// The engine's complaint.
        reason: String,
    },
}

impl ServeError {
    /// The class of the failure, which decides the HTTP status and the gRPC code.
    pub fn kind(&self) -> ErrorKind {
        use ServeError::*;
        match self {
            UnknownModel { .. } | UnknownVersion { .. } | NoEndpoint { .. } => ErrorKind::NotFound,
            Malformed { .. }
            | UnknownTensor { .. }
            | InputCount { .. }
            | Datatype { .. }
            | Shape { .. }
            | DataSize { .. }
            | TokenOutOfRange { .. }
            | Bytes { .. }
            | Parameter { .. }
            | Text { .. }
            | Generate { .. }
            | Config { .. }
            | Load { .. }
            | Backend { .. } => ErrorKind::BadRequest,
            BodyTooLarge { .. } => ErrorKind::TooLarge,
            NotReady { .. } | ModelsNotReady { .. } | QueueFull { .. } | ShuttingDown { .. } => {
                ErrorKind::Unavailable
            }
            Execution { .. } | Io { .. } | Bind { .. } | Instance { .. } => ErrorKind::Internal,
            // a step model that is missing is the ensemble's failure, not an unknown model
            Step { source, .. } => match source.kind() {
                k @ (ErrorKind::BadRequest | ErrorKind::TooLarge | ErrorKind::Unavailable) => k,
                ErrorKind::NotFound | ErrorKind::Internal => ErrorKind::Internal,
            },
        }
    }

    /// A malformed request or reply.
    pub fn malformed(reason: impl ToString) -> ServeError {
        ServeError::Malformed {
            reason: reason.to_string(),
        }
    }

    /// A parameter out of its range, by name.
    pub fn parameter(name: &str, reason: impl ToString) -> ServeError {
        ServeError::Parameter {
            name: name.to_string(),
            reason: reason.to_string(),
        }
    }
}
