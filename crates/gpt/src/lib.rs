//! The mini-GPT that cohort trains: a decoder family on the `cohort-engine` kernels, of which
//! GPT-2's architecture is one point and Llama / Qwen2 / SmolLM2 (RMSNorm, RoPE, SwiGLU,
//! grouped key/value heads, [`Norm`], [`Positions`], [`Mlp`]) are others.
//!
//! [`GPTConfig`] holds the hyper-parameters of a nanoGPT-style `GPTConfig` and the family's axes. [`GPT`] owns one flat parameter buffer, one
//! gradient buffer with the same layout (named by [`ParamView`]s, Hugging Face GPT-2 names and
//! Conv1D `[in, out]` weights, see `docs/GPT_LAYOUT.md`) and an activation arena allocated at the first
//! forward. [`GPT::forward`] of a [`Forward`] (input ids, attention mask, labels) follows Hugging
//! Face's `GPT2LMHeadModel`; [`GPT::backward`] runs top-down and hands each finished range of
//! gradients to the readiness hook of its [`Backward`], which is how data-parallel training
//! overlaps communication with backward.
//! This crate never talks to the network or the file system except through checkpoints.
//!
//! ```
//! use cohort_gpt::{Backward, Forward, GPTConfig, Labels, GPT};
//!
//! let cfg = GPTConfig { vocab_size: 11, max_position_embeddings: 8, n_layers: 1, n_heads: 2,
//!     d_model: 8, d_ff: 16, dropout: 0.0, ..GPTConfig::default() };
//! let mut model = GPT::new(cfg, 42).unwrap();
//! let ids = [1u32, 2, 3, 4];
//! let labels = [1i32, 2, 3, 4];
//! let loss = model.forward(Forward::new(&ids, 1, 4).labels(Labels::Aligned(&labels))).unwrap().unwrap();
//! assert!((loss - (11f32).ln()).abs() < 0.1);
//! model.zero_grad();
//! let mut finished = 0;
//! let ready = |range: std::ops::Range<usize>, grads: cohort_engine::ViewMut<'_, f32>| {
//!     assert_eq!(range.len(), grads.len());
//!     finished += range.len();
//! };
//! model.backward(Backward::new().on_ready(ready)).unwrap();
//! assert_eq!(finished, model.num_params());
//! ```

#![deny(missing_docs)]

pub mod checkpoint;
mod config;
mod labels;
mod layout;
mod model;
pub mod optim_groups;
mod resize;
pub mod sample;
mod stage;

pub use config::{GPTConfig, Mlp, Norm, Positions, RopeScaling};
pub use labels::Labels;
pub use layout::ParamView;
pub use model::{Backward, Forward, MemoryEstimate, NoReadyHook, Part, PartHooks, GPT};
pub use resize::{resize_token_embeddings, ResizeError, RowInit};
pub use stage::{GptStage, StageInput, StageOutput, StagePart};

/// What went wrong building or running the model.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum GptError {
    /// A configuration field has an unusable value.
    #[error("invalid GPTConfig.{field}: {reason}")]
    Config {
        /// The field at fault.
        field: &'static str,
        /// Why it is unusable.
        reason: String,
    },
    /// An input tensor has the wrong length for (batch, seq).
    #[error("{what} has {found} elements, expected batch {batch} x seq {seq} = {}", batch * seq)]
    InputShape {
        /// `input_ids`, `attention_mask` or `labels`.
        what: &'static str,
        /// Elements given.
        found: usize,
        /// Batch size asked for.
        batch: usize,
        /// Sequence length asked for.
        seq: usize,
    },
    /// The sequence is longer than the position embedding.
    #[error("sequence length {seq} exceeds max_position_embeddings {max}")]
    SequenceTooLong {
        /// Sequence length asked for.
        seq: usize,
        /// The config's max_position_embeddings.
        max: usize,
    },
    /// A token id or label is outside the vocabulary.
    #[error(
        "{what}[{index}] = {value} is outside the vocabulary 0..{vocab} (labels may also be -100)"
    )]
    TokenOutOfRange {
        /// `input_ids` or `labels`.
        what: &'static str,
        /// Flat index of the offending element.
        index: usize,
        /// Its value.
        value: i64,
        /// The vocabulary size.
        vocab: usize,
    },
    /// The engine (thread pool, optimizer) failed.
    #[error("{op}: {reason}")]
    Engine {
        /// What was being set up or run.
        op: &'static str,
        /// The engine's error.
        reason: String,
    },
    /// `backward` was called without a forward that computed a loss.
    #[error("backward needs a forward with labels first")]
    NoLoss,
    /// A pipeline stage was built from an unusable part or fed the wrong buffers.
    #[error("pipeline stage with blocks {blocks:?}: {reason}")]
    Stage {
        /// The stage's blocks.
        blocks: std::ops::Range<usize>,
        /// What was wrong.
        reason: String,
    },
}
