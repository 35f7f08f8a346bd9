//! The one error type of this crate. Every variant names the file, and where it can the key or
//! tensor and the byte offsets at fault, so that a bad file is one line to read, never a panic.

use std::path::PathBuf;

/// What went wrong reading a GGUF file or writing its conversion.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum GgufError {
    /// A file or directory could not be opened, mapped, created, written or renamed.
    #[error("{op} {path}: {source}")]
    Io {
        /// What was being done ("open", "mmap", "write", ...).
        op: &'static str,
        /// The file or directory.
        path: PathBuf,
        /// The operating system's error.
        source: std::io::Error,
    },
    /// The file does not start with the magic bytes `GGUF`.
    #[error("{path}: not a GGUF file (first bytes {found:02x?}, expected \"GGUF\")")]
    NotGguf {
        /// The file.
        path: PathBuf,
        /// Its first (up to four) bytes.
        found: Vec<u8>,
    },
    /// A GGUF version this reader does not read (it reads 2 and 3).
    #[error("{path}: GGUF version {version} is not supported (2 and 3 are){hint}")]
    Version {
        /// The file.
        path: PathBuf,
        /// The version field as read (little-endian).
        version: u32,
        /// A hint, e.g. that the file looks big-endian.
        hint: &'static str,
    },
    /// The file ends before something the header says is there.
    #[error(
        "{path}: truncated: {what} at offset {offset} needs {need} bytes, the file is {len} bytes"
    )]
    Truncated {
        /// The file.
        path: PathBuf,
        /// What was being read ("the key of metadata entry 3", "tensor blk.0.attn_q.weight", ...).
        what: String,
        /// Where it starts.
        offset: u64,
        /// How many bytes it needs.
        need: u64,
        /// The file's length.
        len: u64,
    },
    /// A field holds a value no valid file has (an unknown value type, a string that is not
    /// UTF-8, a misaligned tensor, a dimension of zero...).
    #[error("{path}: corrupt {what} at offset {offset}: {reason}")]
    Corrupt {
        /// The file.
        path: PathBuf,
        /// The field ("metadata key general.alignment", "tensor info 7", ...).
        what: String,
        /// Where the field starts.
        offset: u64,
        /// What is wrong with it.
        reason: String,
    },
    /// A metadata key the conversion needs is absent.
    #[error("{path}: metadata key {key} is missing")]
    MissingKey {
        /// The file.
        path: PathBuf,
        /// The key.
        key: String,
    },
    /// A metadata key holds another type (or value) than the one the conversion needs.
    #[error("{path}: metadata key {key} is {found}, expected {expected}")]
    WrongKey {
        /// The file.
        path: PathBuf,
        /// The key.
        key: String,
        /// What it should be.
        expected: String,
        /// What it is.
        found: String,
    },
    /// A tensor whose ggml type cannot be dequantised here.
    #[error("{path}: tensor {tensor} has type {ty}, which cannot be dequantised (supported: F32, F16, BF16, Q8_0, Q4_0, Q4_1)")]
    UnsupportedType {
        /// The file.
        path: PathBuf,
        /// The tensor's name.
        tensor: String,
        /// The type's name (or its number when it has none).
        ty: String,
    },
    /// A tensor that is missing, or whose name or shape does not fit the model the metadata
    /// describes.
    #[error("{path}: tensor {tensor}: {reason}")]
    Tensor {
        /// The file.
        path: PathBuf,
        /// The tensor's name.
        tensor: String,
        /// What is wrong with it.
        reason: String,
    },
    /// Something the file describes that the conversion does not handle (an architecture, a
    /// tokenizer model, a pre-tokenizer).
    #[error("{path}: {what} is not supported: {reason}")]
    Unsupported {
        /// The file.
        path: PathBuf,
        /// What ("architecture falcon", "tokenizer.ggml.pre = \"jais\"", ...).
        what: String,
        /// What is supported instead.
        reason: String,
    },
    /// The output directory exists and is not empty.
    #[error("{path}: exists and is not empty; remove it or choose another --out")]
    OutputExists {
        /// The output directory.
        path: PathBuf,
    },
    /// Writing model.safetensors failed.
    #[error("write {path}: {source}")]
    Safetensors {
        /// The file being written.
        path: PathBuf,
        /// The safetensors error.
        source: safetensors::SafeTensorError,
    },
    /// Building or serialising tokenizer.json failed.
    #[error("{path}: building tokenizer.json: {reason}")]
    Tokenizer {
        /// The GGUF file.
        path: PathBuf,
        /// The tokenizers library's message.
        reason: String,
    },
}

impl GgufError {
    /// A closure that wraps an I/O error of `op` on `path` (for `map_err`).
    pub(crate) fn io(
        op: &'static str,
        path: &std::path::Path,
    ) -> impl FnOnce(std::io::Error) -> Self {
        let path = path.to_path_buf();
        move |source| GgufError::Io { op, path, source }
    }
}
