//! GGUF, llama.cpp's model file format, for cohort: read it, dequantise it, convert it.
//!
//! - [`GgufFile`]: a memory-mapped GGUF v2/v3 file with its metadata ([`Value`], every type
//!   including nested arrays) and tensor infos ([`TensorInfo`]) parsed, the alignment taken from
//!   `general.alignment`, and every tensor's extent checked against the file at open, so that a
//!   truncated or corrupt file is a one-line [`GgufError`] naming the file, the key or tensor and
//!   the offsets, never a panic.
//! - [`Dequantizer`]: F32, F16, BF16, Q8_0, Q4_0 and Q4_1 to f32, value for value as the `gguf`
//!   Python package's `dequantize`; any other [`GgmlType`] is an error naming the tensor and the
//!   type.
//! - [`convert_to_hf`]: a Llama GGUF as a Hugging Face `LlamaForCausalLM` directory (config.json,
//!   model.safetensors in f32 with llama.cpp's rotary row permutation of q/k undone,
//!   tokenizer.json and tokenizer_config.json with the chat template, generation_config.json),
//!   which `transformers` loads, and cohort's Hugging Face loader after it.
//!
//! This crate knows file formats, never the model's code: it does not run, build or depend on a
//! model (no cohort model crate, no engine), and it never changes a weight's value beyond
//! decoding it, nor guesses a hyperparameter the file does not state. It never writes a GGUF.
//!
//! ```no_run
//! use cohort_gguf::GgufFile;
//!
//! let file = GgufFile::open("SmolLM2-135M-Instruct.Q4_1.gguf")?;
//! let embd = file.tensor("token_embd.weight").expect("a Llama file has one");
//! let values = file.dequantize(embd)?; // dims[0] fastest: 576 values per token
//! assert_eq!(values.len() as u64, embd.n_elements());
//! # Ok::<(), cohort_gguf::GgufError>(())
//! ```

#![deny(missing_docs)]

mod dequant;
mod error;
pub mod hf;
mod reader;
mod types;
mod value;

pub use dequant::Dequantizer;
pub use error::GgufError;
pub use hf::{convert_to_hf, Conversion, LlamaConfig};
pub use reader::{GgufFile, TensorInfo, DEFAULT_ALIGNMENT};
pub use types::GgmlType;
pub use value::Value;
