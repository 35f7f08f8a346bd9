//! The state a decode keeps between forwards: each sequence's KV cache ([`KvCache`], in f32 or
//! bf16), the scratch a thread decodes in ([`Workspace`]), and [`Decoder`], one sequence's cache
//! and workspace together.
//!
//! Nothing here computes a forward (that is `forward`) or samples; it never allocates per token:
//! a cache is allocated for a full window when made, a workspace's buffers when built for up to
//! [`WORKSPACE_ROWS`] rows (and grown only for a step of more rows than that).

use std::sync::Arc;

use cohort_engine::cpu::round_to_bf16;

use super::batching::Generation;
use super::forward::{forward_rows, Rows};
use super::weights::DecodeWeights;
use super::{check_vocab, SampleError};
use crate::layout::Layout;
use crate::{GPTConfig, GPT};

/// The number format a [`KvCache`] keeps keys and values in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum KvDtype {
    /// f32, as the forward computes them (the default).
    #[default]
    F32,
    /// bf16, rounded to nearest even when appended: half the bytes.
    Bf16,
}

impl KvDtype {
    /// Bytes per cached element.
    pub fn size(self) -> usize {
        match self {
            KvDtype::F32 => 4,
            KvDtype::Bf16 => 2,
        }
    }
}

impl std::str::FromStr for KvDtype {
    type Err = String;
    /// `fp32` or `bf16` (also `f32`, `float32`, `bfloat16`).
    fn from_str(s: &str) -> Result<KvDtype, String> {
        match s {
            "fp32" | "f32" | "float32" => Ok(KvDtype::F32),
            "bf16" | "bfloat16" => Ok(KvDtype::Bf16),
            _ => Err(format!(
                "unknown KV cache dtype {s:?} (expected fp32 or bf16)"
            )),
        }
    }
}

impl std::fmt::Display for KvDtype {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            KvDtype::F32 => "fp32",
            KvDtype::Bf16 => "bf16",
        })
    }
}

/// A cache's keys and values, (L, max_t, NKV·HS) each (C with as many key/value heads as
/// query heads), in its number format.
pub(super) enum KvStore {
    F32 {
        k: Vec<f32>,
        v: Vec<f32>,
    },
    /// bf16 bits.
    Bf16 {
        k: Vec<u16>,
        v: Vec<u16>,
    },
}

/// The keys and values of the tokens one sequence has fed: (L, max_t, C) each, in f32 or
/// bf16 ([`KvDtype`]). It borrows nothing, so a server can hold one per request and still use
/// the model between steps.
pub struct KvCache {
    pub(super) store: KvStore,
    /// Positions filled.
    pub(super) len: usize,
}

impl KvCache {
    /// An empty f32 cache for a full window of `cfg`.
    pub fn new(cfg: &GPTConfig) -> KvCache {
        KvCache::with_dtype(cfg, KvDtype::F32)
    }

    /// An empty cache for a full window of `cfg`, keeping keys and values in `dtype`.
    pub fn with_dtype(cfg: &GPTConfig, dtype: KvDtype) -> KvCache {
        // One cached head per key/value head: a grouped model caches NH/NKV times less.
        let n = cfg.n_layers * cfg.max_position_embeddings * cfg.kv_heads() * cfg.head_dim();
        let store = match dtype {
            KvDtype::F32 => KvStore::F32 {
                k: vec![0.0; n],
                v: vec![0.0; n],
            },
            KvDtype::Bf16 => KvStore::Bf16 {
                k: vec![0; n],
                v: vec![0; n],
            },
        };
        KvCache { store, len: 0 }
    }

    /// The format it keeps keys and values in.
    pub fn dtype(&self) -> KvDtype {
        match self.store {
            KvStore::F32 { .. } => KvDtype::F32,
            KvStore::Bf16 { .. } => KvDtype::Bf16,
        }
    }

    /// Bytes its keys and values take (allocated for the full window when it was made).
    pub fn bytes(&self) -> usize {
        let (k, v) = match &self.store {
            KvStore::F32 { k, v } => (std::mem::size_of_val(&k[..]), std::mem::size_of_val(&v[..])),
            KvStore::Bf16 { k, v } => {
                (std::mem::size_of_val(&k[..]), std::mem::size_of_val(&v[..]))
            }
        };
        k + v
    }

    /// Tokens in the cache.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True before anything was fed (or after [`KvCache::reset`]).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Forgets every cached token.
    pub fn reset(&mut self) {
        self.len = 0;
    }

    /// Makes positions 0..p of every layer (of `layers`, each `max_t` positions long) a copy of
    /// `from`'s: the keys and values of a prompt's start that another sequence of the same
    /// model already fed. Both must be in the same format (the caller checks).
    pub(super) fn copy_prefix(&mut self, from: &KvCache, p: usize, layers: usize, max_t: usize) {
        fn copy<T: Copy>(to: &mut [T], from: &[T], span: usize, layer: usize, layers: usize) {
            for l in 0..layers {
                let at = l * layer..l * layer + span;
                to[at.clone()].copy_from_slice(&from[at]);
            }
        }
        let layer = self.store_len() / layers;
        let span = p * (layer / max_t);
        match (&mut self.store, &from.store) {
            (KvStore::F32 { k, v }, KvStore::F32 { k: fk, v: fv }) => {
                copy(k, fk, span, layer, layers);
                copy(v, fv, span, layer, layers);
            }
            (KvStore::Bf16 { k, v }, KvStore::Bf16 { k: fk, v: fv }) => {
                copy(k, fk, span, layer, layers);
                copy(v, fv, span, layer, layers);
            }
            _ => unreachable!("copy_prefix between caches of different formats"),
        }
        self.len = p;
    }

    /// Elements of its keys (as of its values).
    fn store_len(&self) -> usize {
        match &self.store {
            KvStore::F32 { k, .. } => k.len(),
            KvStore::Bf16 { k, .. } => k.len(),
        }
    }

    /// Stores one row's key and value (NKV·HS each) at flat offset `at`, rounding them to bf16 in a
    /// bf16 cache.
    pub(super) fn put(&mut self, at: usize, key: &[f32], value: &[f32]) {
        let c = key.len();
        match &mut self.store {
            KvStore::F32 { k, v } => {
                k[at..at + c].copy_from_slice(key);
                v[at..at + c].copy_from_slice(value);
            }
            KvStore::Bf16 { k, v } => {
                round_to_bf16(&mut k[at..at + c], key);
                round_to_bf16(&mut v[at..at + c], value);
            }
        }
    }
}

/// The caches a forward's rows write to and read from, by index.
pub(super) trait Caches: Sync {
    fn cache(&mut self, i: usize) -> &mut KvCache;
    fn cache_ref(&self, i: usize) -> &KvCache;
}

impl Caches for KvCache {
    fn cache(&mut self, _: usize) -> &mut KvCache {
        self
    }
    fn cache_ref(&self, _: usize) -> &KvCache {
        self
    }
}

impl<G: AsMut<Generation> + AsRef<Generation> + Sync> Caches for [G] {
    fn cache(&mut self, i: usize) -> &mut KvCache {
        &mut self[i].as_mut().cache
    }
    fn cache_ref(&self, i: usize) -> &KvCache {
        &self[i].as_ref().cache
    }
}

/// Rows a workspace holds when built: a full window of GPT-2's 1024 positions, but not of a
/// Llama's 8192 or a Qwen2's 32768, whose logits and scores rows for a full window would reserve
/// tens of gigabytes for prompts that never come. A longer step grows the buffers once.
pub const WORKSPACE_ROWS: usize = 1024;

/// Scratch rows for forwards (activations of every row, the logits asked for), sized for a
/// window (at most [`WORKSPACE_ROWS`]) when built and grown only when a step has more rows.
pub(super) struct Buffers {
    /// Rows the buffers hold.
    pub(super) rows: usize,
    /// Residual stream (n, C): a block's input, its output, and in between the stream after
    /// attention.
    pub(super) x: Vec<f32>,
    pub(super) x_next: Vec<f32>,
    pub(super) x_mid: Vec<f32>,
    /// LayerNorm output (n, C), and the statistics of ln_1 and ln_2 (n each).
    pub(super) ln: Vec<f32>,
    pub(super) mean: Vec<f32>,
    pub(super) rstd: Vec<f32>,
    pub(super) mean_2: Vec<f32>,
    pub(super) rstd_2: Vec<f32>,
    /// (n, (NH+2·NKV)·HS): q, k, v as GPT-2 concatenates them.
    pub(super) qkv: Vec<f32>,
    /// Attention output (n, C).
    pub(super) att: Vec<f32>,
    /// MLP hidden pre- (n, F; n, 2F under SwiGLU) and post-activation (n, F).
    pub(super) fc: Vec<f32>,
    pub(super) gelu: Vec<f32>,
    /// Attention weights of each row's query over its cache (n, max_t).
    pub(super) scores: Vec<f32>,
    /// Logits of the rows asked for (n, V).
    pub(super) logits: Vec<f32>,
    /// Each row's position (n), for rotary embeddings.
    pub(super) pos: Vec<u32>,
}

impl Buffers {
    fn new(cfg: &GPTConfig, rows: usize) -> Buffers {
        let (c, f) = (cfg.d_model, cfg.d_ff);
        Buffers {
            rows,
            x: vec![0.0; rows * c],
            x_next: vec![0.0; rows * c],
            x_mid: vec![0.0; rows * c],
            ln: vec![0.0; rows * c],
            mean: vec![0.0; rows],
            rstd: vec![0.0; rows],
            mean_2: vec![0.0; rows],
            rstd_2: vec![0.0; rows],
            qkv: vec![0.0; rows * cfg.qkv_width()],
            att: vec![0.0; rows * c],
            fc: vec![0.0; rows * cfg.fc_width()],
            gelu: vec![0.0; rows * f],
            scores: vec![0.0; rows * cfg.n_heads * cfg.max_position_embeddings],
            logits: vec![0.0; rows * cfg.vocab_size],
            pos: vec![0; rows],
        }
    }
}

/// Scratch space shared by every sequence a thread decodes: the forward's activations and the
/// parameter layout. One per serving thread, not one per request (a request owns only its
/// [`KvCache`] and sampler state).
pub struct Workspace {
    layout: Layout,
    /// The bf16 or 8-bit copy of the matrices the products read, if any (else the model's).
    weights: Option<Arc<DecodeWeights>>,
    pub(super) buf: Buffers,
    /// A step's rows: (generation, position) and token of each, the last row of each
    /// generation fed, and those generations (indices into the caller's slice).
    pub(super) place: Vec<(usize, usize)>,
    pub(super) tokens: Vec<u32>,
    pub(super) last: Vec<usize>,
    pub(super) sel: Vec<usize>,
    /// Most prompt tokens a step feeds besides the first prompt ([`Workspace::set_prefill_tokens`]).
    pub(super) prefill_tokens: usize,
}

impl Workspace {
    /// Scratch for `model`, sized for a full window of up to [`WORKSPACE_ROWS`] rows.
    pub fn new(model: &GPT) -> Workspace {
        let cfg = model.config();
        Workspace {
            layout: Layout::new(cfg),
            weights: None,
            buf: Buffers::new(cfg, cfg.max_position_embeddings.clamp(1, WORKSPACE_ROWS)),
            place: Vec::new(),
            tokens: Vec::new(),
            last: Vec::new(),
            sel: Vec::new(),
            prefill_tokens: super::batching::STEP_PREFILL_TOKENS,
        }
    }

    /// The most prompt tokens a [`decode_step`](super::decode_step) on this workspace feeds
    /// besides its decoding rows (the step's first prompt is fed whatever its length, so none
    /// waits for ever): fewer holds the decoding sequences up less while prompts join, more
    /// starts a burst of prompts in fewer steps (vLLM's `max_num_batched_tokens`). Default
    /// [`STEP_PREFILL_TOKENS`](super::STEP_PREFILL_TOKENS). It changes when a sequence starts,
    /// never its tokens.
    pub fn set_prefill_tokens(&mut self, tokens: usize) {
        self.prefill_tokens = tokens;
    }

    /// Scratch for `model` whose forwards' matrix products read `weights` (a bf16 or 8-bit
    /// copy of `model`'s matrices) instead of its f32 parameters.
    pub fn with_weights(
        model: &GPT,
        weights: Arc<DecodeWeights>,
    ) -> Result<Workspace, SampleError> {
        if &weights.config != model.config() {
            return Err(SampleError::WeightsOfAnotherModel);
        }
        Ok(Workspace {
            weights: Some(weights),
            ..Workspace::new(model)
        })
    }

    /// The copy of the matrices its forwards read, if not the model's f32 parameters.
    pub fn weights(&self) -> Option<&Arc<DecodeWeights>> {
        self.weights.as_ref()
    }

    /// Runs `tokens` at positions `cache.len()..` of one sequence through `model`, appending
    /// their keys and values to `cache`; returns the logits (V) that follow the last of them.
    pub fn feed(
        &mut self,
        model: &GPT,
        cache: &mut KvCache,
        tokens: &[u32],
    ) -> Result<&[f32], SampleError> {
        let cfg: &GPTConfig = model.config();
        if tokens.is_empty() {
            return Err(SampleError::EmptyPrompt);
        }
        if cache.len + tokens.len() > cfg.max_position_embeddings {
            return Err(SampleError::ContextFull {
                cached: cache.len,
                new: tokens.len(),
                max: cfg.max_position_embeddings,
            });
        }
        check_vocab(tokens, cfg.vocab_size)?;
        let p0 = cache.len;
        self.run(model, cache, tokens, Rows::Sequence { p0 });
        cache.len += tokens.len();
        Ok(&self.buf.logits[..cfg.vocab_size])
    }

    /// One forward of `rows` through `model` (the caller validated tokens and room).
    pub(super) fn run<C: Caches + Send + ?Sized>(
        &mut self,
        model: &GPT,
        caches: &mut C,
        tokens: &[u32],
        rows: Rows<'_>,
    ) {
        if tokens.len() > self.buf.rows {
            self.buf = Buffers::new(model.config(), tokens.len());
        }
        let (layout, buf, decode) = (&self.layout, &mut self.buf, self.weights.as_deref());
        model
            .backend()
            .install(&mut || forward_rows(model, layout, decode, caches, buf, tokens, rows));
    }
}

/// Incremental inference over one sequence with a KV cache.
pub struct Decoder<'m> {
    model: &'m GPT,
    cache: KvCache,
    ws: Workspace,
}

impl<'m> Decoder<'m> {
    /// An empty decoder for `model` (buffers for a full window), with an f32 cache.
    pub fn new(model: &'m GPT) -> Decoder<'m> {
        Decoder::with_kv_dtype(model, KvDtype::F32)
    }

    /// An empty decoder for `model` whose cache keeps keys and values in `kv_dtype`.
    pub fn with_kv_dtype(model: &'m GPT, kv_dtype: KvDtype) -> Decoder<'m> {
        Decoder {
            model,
            cache: KvCache::with_dtype(model.config(), kv_dtype),
            ws: Workspace::new(model),
        }
    }

    /// An empty decoder for `model` whose products read `weights` (see
    /// [`Workspace::with_weights`]) and whose cache keeps keys and values in `kv_dtype`.
    pub fn with_weights(
        model: &'m GPT,
        weights: Arc<DecodeWeights>,
        kv_dtype: KvDtype,
    ) -> Result<Decoder<'m>, SampleError> {
        Ok(Decoder {
            model,
            cache: KvCache::with_dtype(model.config(), kv_dtype),
            ws: Workspace::with_weights(model, weights)?,
        })
    }

    /// The decoder's cache (its format and size).
    pub fn cache(&self) -> &KvCache {
        &self.cache
    }

    /// Tokens in the cache.
    pub fn len(&self) -> usize {
        self.cache.len()
    }

    /// True before anything was fed (or after [`Decoder::reset`]).
    pub fn is_empty(&self) -> bool {
        self.cache.is_empty()
    }

    /// Forgets every cached token.
    pub fn reset(&mut self) {
        self.cache.reset();
    }

    /// Runs `tokens` at positions `len..len + n` through the model, appending their keys and
    /// values to the cache, and returns the logits (V) that follow the last of them.
    pub fn feed(&mut self, tokens: &[u32]) -> Result<&[f32], SampleError> {
        self.ws.feed(self.model, &mut self.cache, tokens)
    }
}
