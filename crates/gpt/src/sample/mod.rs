//! Text generation: an inference-only forward that feeds new tokens against a per-layer KV cache,
//! and nanoGPT's sampler (temperature, top-k, seeded) on top of it.
//!
//! [`Decoder`] keeps, for every layer, the keys and values of the tokens seen so far, so a new
//! token costs one row through each matrix instead of the whole sequence again. Each block runs
//! the training forward's block code (the same kernels in the same order); only its attention
//! is the decode kernel's, the new rows over the cache (a few dot products per cached token).
//!
//! Context longer than the model's window: positions are learned absolute embeddings, so we do
//! what nanoGPT's `generate` does and condition every prediction on the last [`context_window`]
//! tokens (a sliding window). While the sequence fits, the cache grows by one token per step; once
//! it is full, each step rebuilds it from the last window of tokens (one batched forward over the
//! window, the cost nanoGPT pays at every step). The window is the whole
//! `max_position_embeddings`: cohort's training scores every position of a window (next-token
//! targets, as nanoGPT), so the last position predicts as well as any other.
//!
//! Serving many sequences at once (continuous batching): a [`Generation`] owns one sequence's
//! cache and sampler and borrows nothing; [`decode_step`] advances any set of them by one token
//! with one matrix product per layer over all their rows (attention stays per row, over each
//! row's own cache). Sequences may join (their prompts fed by the next step, in the same
//! products) or leave between any two steps, and each gets bit-for-bit the tokens it gets
//! alone: every kernel computes a row the same way whatever other rows share the product.
//! [`generate`] is this same path with one row.
//!
//! The cache keeps keys and values in f32 unless asked for bf16 ([`KvDtype`], as vLLM's
//! `--kv-cache-dtype`): half the bytes, which a batched decode step's attention reads once per
//! row per layer (a memory-bound read that grows with the cached positions). Keys and values
//! are rounded to bf16 (to nearest even) as they are appended, and attention reads them back
//! exactly; everything else stays f32. With a bf16 cache a sequence still gets, in a batch,
//! bit-for-bit what it gets alone; its logits differ from an f32 cache's by the rounding.
//!
//! The matrix products read the model's f32 parameters unless the [`Workspace`] was made
//! [`with_weights`](Workspace::with_weights): a [`DecodeWeights`] copy of the matrices in bf16
//! or in 8-bit blocks ([`WeightFormat`], `cohort sample --weights`), half or about a quarter of
//! the bytes a decode step reads per token. The rest of the forward stays f32, and a sequence
//! still gets in a batch bit-for-bit what it gets alone; its logits differ from the f32
//! weights' by the rounding.
//!
//! This module never changes the model and never allocates per token: a [`Workspace`]'s
//! buffers are sized for a full window (of up to [`WORKSPACE_ROWS`] rows) when it is built, and
//! grown only for a step of more rows than that.
//!
//! The module is laid out as: `cache` (the KV cache, the workspace a thread decodes in, the
//! one-sequence [`Decoder`]), `forward` (the forward of cached rows, whose blocks run the
//! training forward's block code), `weights` (the bf16 / 8-bit copies), `sampler` (turning
//! logits into a token) and `batching` (one [`Generation`] per sequence and [`decode_step`]
//! over many).

use crate::GPT;

mod batching;
mod cache;
mod forward;
mod sampler;
#[cfg(test)]
mod tests;
mod weights;

pub use batching::{decode_step, Generation, STEP_PREFILL_TOKENS};
pub use cache::{Decoder, KvCache, KvDtype, Workspace, WORKSPACE_ROWS};
pub use sampler::{argmax, context_window};
pub use weights::{DecodeWeights, WeightFormat};

/// What to generate.
#[derive(Debug, Clone, PartialEq)]
pub struct SampleOptions {
    /// Tokens to generate after the prompt.
    pub max_new_tokens: usize,
    /// Softmax temperature; 0 means greedy (argmax).
    pub temperature: f32,
    /// Sample only among the `k` most likely tokens (ties with the k-th kept, as nanoGPT).
    pub top_k: Option<usize>,
    /// Nucleus sampling: only among the most likely tokens whose probabilities (after the
    /// temperature and top-k) first reach `top_p` in sum (ties with the last kept); 1 keeps
    /// all, 0 only the most likely.
    pub top_p: f32,
    /// Seed of the sampler's random numbers: the same seed gives the same tokens.
    pub seed: u64,
}

impl Default for SampleOptions {
    /// nanoGPT's sample.py defaults, 100 new tokens.
    fn default() -> Self {
        SampleOptions {
            max_new_tokens: 100,
            temperature: 0.8,
            top_k: Some(200),
            top_p: 1.0,
            seed: 1337,
        }
    }
}

/// What went wrong generating.
#[derive(Debug, Clone, thiserror::Error, PartialEq)]
#[non_exhaustive]
pub enum SampleError {
    /// Generation needs at least one token to condition on.
    #[error("the prompt is empty: generation needs at least one token")]
    EmptyPrompt,
    /// A token id is not in the vocabulary.
    #[error("token {index} of the input is {id}, outside the vocabulary 0..{vocab}")]
    TokenOutOfRange {
        /// Position in the tokens fed.
        index: usize,
        /// The id.
        id: u32,
        /// The vocabulary size.
        vocab: usize,
    },
    /// Feeding these tokens would overflow the position embedding.
    #[error("cannot feed {new} tokens after {cached}: max_position_embeddings is {max}")]
    ContextFull {
        /// Tokens already in the cache.
        cached: usize,
        /// Tokens fed.
        new: usize,
        /// The model's maximum sequence length.
        max: usize,
    },
    /// The temperature is negative or not finite.
    #[error("temperature {0} must be finite and >= 0 (0 = greedy)")]
    BadTemperature(f32),
    /// `top_k` is 0.
    #[error("top_k must be at least 1")]
    BadTopK,
    /// `top_p` is outside 0..=1.
    #[error("top_p {0} must be in 0..=1 (1 = all tokens)")]
    BadTopP(f32),
    /// A workspace was given decode weights copied from a model of another config.
    #[error("the decode weights were copied from a model of another config")]
    WeightsOfAnotherModel,
}

/// The first token outside `0..vocab`, as an error.
pub(super) fn check_vocab(tokens: &[u32], vocab: usize) -> Result<(), SampleError> {
    match tokens
        .iter()
        .enumerate()
        .find(|(_, &id)| id as usize >= vocab)
    {
        Some((index, &id)) => Err(SampleError::TokenOutOfRange { index, id, vocab }),
        None => Ok(()),
    }
}

/// Generates up to `opts.max_new_tokens` tokens after `prompt`, calling `on_token` with each as
/// it is produced; returns the generated tokens (without the prompt). A prompt longer than the
/// [`context_window`] is cropped to its last tokens, as nanoGPT does.
pub fn generate(
    model: &GPT,
    prompt: &[u32],
    opts: &SampleOptions,
    mut on_token: impl FnMut(u32),
) -> Result<Vec<u32>, SampleError> {
    generate_while(model, prompt, opts, |id| {
        on_token(id);
        std::ops::ControlFlow::Continue(())
    })
}

/// [`generate`], stopped early when `on_token` breaks: the tokens up to and including the one
/// it broke on are returned, and no further decode step runs (a server stops a generation whose
/// client went away this way, within one step).
pub fn generate_while(
    model: &GPT,
    prompt: &[u32],
    opts: &SampleOptions,
    on_token: impl FnMut(u32) -> std::ops::ControlFlow<()>,
) -> Result<Vec<u32>, SampleError> {
    generate_while_with(model, prompt, opts, KvDtype::F32, on_token)
}

/// [`generate_while`] with the cache keeping keys and values in `kv_dtype`.
pub fn generate_while_with(
    model: &GPT,
    prompt: &[u32],
    opts: &SampleOptions,
    kv_dtype: KvDtype,
    on_token: impl FnMut(u32) -> std::ops::ControlFlow<()>,
) -> Result<Vec<u32>, SampleError> {
    generate_while_in(
        &mut Workspace::new(model),
        model,
        prompt,
        opts,
        kv_dtype,
        on_token,
    )
}

/// [`generate_while_with`] in the workspace `ws` (whose weights the products read: see
/// [`Workspace::with_weights`]).
pub fn generate_while_in(
    ws: &mut Workspace,
    model: &GPT,
    prompt: &[u32],
    opts: &SampleOptions,
    kv_dtype: KvDtype,
    mut on_token: impl FnMut(u32) -> std::ops::ControlFlow<()>,
) -> Result<Vec<u32>, SampleError> {
    let mut g = Generation::with_kv_dtype(model, prompt, opts, kv_dtype)?;
    while !g.is_finished() {
        decode_step(model, std::slice::from_mut(&mut g), ws)?;
        let Some(&next) = g.tokens().last() else {
            break;
        };
        if on_token(next).is_break() {
            break;
        }
    }
    Ok(g.into_tokens())
}
