//! Text generation: an inference-only forward that feeds new tokens against a per-layer KV cache,
//! and nanoGPT's sampler (temperature, top-k, seeded) on top of it.
//!
//! [`Decoder`] keeps, for every layer, the keys and values of the tokens seen so far, so a new
//! token costs one row through each matrix instead of the whole sequence again. It uses the
//! model's backend for LayerNorm, the matrix products, GELU and the LM head, and computes the
//! attention of the new rows over the cache itself (a few dot products per cached token).
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
//! products) or leave between any two steps, and each gets bit-for-bit the tokens it gets alone: every kernel computes a
//! row the same way whatever other rows share the product. [`generate`] is this same path with
//! one row.
//!
//! The cache keeps keys and values in f32 unless asked for bf16 ([`KvDtype`], as vLLM's
//! `--kv-cache-dtype`): half the bytes, which a batched decode step's attention reads once per
//! row per layer (a memory-bound read that grows with the cached positions). Keys and values
//! are rounded to bf16 (to nearest even) as they are appended, and attention reads them back
//! exactly; everything else stays f32. With a bf16 cache a sequence still gets, in a batch,
//! bit-for-bit what it gets alone; its logits differ from an f32 cache's by the rounding.
//!
//! This module never changes the model and never allocates per token: a [`Workspace`]'s
//! buffers are sized for a full window when it is built (and grown only for a batch wider than
//! that).

use cohort_engine::cpu::round_to_bf16;
use cohort_rng::SplitMix64;
use rayon::prelude::*;

use crate::layout::Layout;
use crate::{GPTConfig, GPT};

/// What to generate.
#[derive(Debug, Clone, PartialEq)]
pub struct SampleOptions {
    /// Tokens to generate after the prompt.
    pub max_new_tokens: usize,
    /// Softmax temperature; 0 means greedy (argmax).
    pub temperature: f32,
    /// Sample only among the `k` most likely tokens (ties with the k-th kept, as nanoGPT).
    pub top_k: Option<usize>,
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
}

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

/// A cache's keys and values, (L, max_t, C) each, in its number format.
enum KvStore {
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
    store: KvStore,
    /// Positions filled.
    len: usize,
}

impl KvCache {
    /// An empty f32 cache for a full window of `cfg`.
    pub fn new(cfg: &GPTConfig) -> KvCache {
        KvCache::with_dtype(cfg, KvDtype::F32)
    }

    /// An empty cache for a full window of `cfg`, keeping keys and values in `dtype`.
    pub fn with_dtype(cfg: &GPTConfig, dtype: KvDtype) -> KvCache {
        let n = cfg.n_layers * cfg.max_position_embeddings * cfg.d_model;
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

    /// Stores one row's key and value (C each) at flat offset `at`, rounding them to bf16 in a
    /// bf16 cache.
    fn put(&mut self, at: usize, key: &[f32], value: &[f32]) {
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
trait Caches: Sync {
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

/// Scratch rows for forwards (activations of every row, the logits asked for), sized for a full
/// window when built and grown only when a batched step has more rows than that.
struct Buffers {
    /// Rows the buffers hold.
    rows: usize,
    /// Residual stream (n, C).
    x: Vec<f32>,
    /// LayerNorm output (n, C).
    ln: Vec<f32>,
    mean: Vec<f32>,
    rstd: Vec<f32>,
    /// (n, 3C): q, k, v as GPT-2 concatenates them.
    qkv: Vec<f32>,
    /// Attention output (n, C).
    att: Vec<f32>,
    /// Projection output (n, C), added to the residual.
    proj: Vec<f32>,
    /// MLP hidden pre- and post-GELU (n, F).
    fc: Vec<f32>,
    gelu: Vec<f32>,
    /// Attention weights of each row's query over its cache (n, max_t).
    scores: Vec<f32>,
    /// Logits of the rows asked for (n, V).
    logits: Vec<f32>,
}

impl Buffers {
    fn new(cfg: &GPTConfig, rows: usize) -> Buffers {
        let (c, f) = (cfg.d_model, cfg.d_ff);
        Buffers {
            rows,
            x: vec![0.0; rows * c],
            ln: vec![0.0; rows * c],
            mean: vec![0.0; rows],
            rstd: vec![0.0; rows],
            qkv: vec![0.0; rows * 3 * c],
            att: vec![0.0; rows * c],
            proj: vec![0.0; rows * c],
            fc: vec![0.0; rows * f],
            gelu: vec![0.0; rows * f],
            scores: vec![0.0; rows * cfg.n_heads * cfg.max_position_embeddings],
            logits: vec![0.0; rows * cfg.vocab_size],
        }
    }
}

/// Scratch space shared by every sequence a thread decodes: the forward's activations and the
/// parameter layout. One per serving thread, not one per request (a request owns only its
/// [`KvCache`] and sampler state).
pub struct Workspace {
    layout: Layout,
    buf: Buffers,
    /// A step's rows: (generation, position) and token of each, the last row of each
    /// generation fed, and those generations (indices into the caller's slice).
    place: Vec<(usize, usize)>,
    tokens: Vec<u32>,
    last: Vec<usize>,
    sel: Vec<usize>,
}

impl Workspace {
    /// Scratch for `model`, sized for a full window.
    pub fn new(model: &GPT) -> Workspace {
        let cfg = model.config();
        Workspace {
            layout: Layout::new(cfg),
            buf: Buffers::new(cfg, cfg.max_position_embeddings.max(1)),
            place: Vec::new(),
            tokens: Vec::new(),
            last: Vec::new(),
            sel: Vec::new(),
        }
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
    fn run<C: Caches + Send + ?Sized>(
        &mut self,
        model: &GPT,
        caches: &mut C,
        tokens: &[u32],
        rows: Rows<'_>,
    ) {
        if tokens.len() > self.buf.rows {
            self.buf = Buffers::new(model.config(), tokens.len());
        }
        let (layout, buf) = (&self.layout, &mut self.buf);
        model
            .backend()
            .install(&mut || forward_rows(model, layout, caches, buf, tokens, rows));
    }
}

fn check_vocab(tokens: &[u32], vocab: usize) -> Result<(), SampleError> {
    match tokens
        .iter()
        .enumerate()
        .find(|(_, &id)| id as usize >= vocab)
    {
        Some((index, &id)) => Err(SampleError::TokenOutOfRange { index, id, vocab }),
        None => Ok(()),
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

/// Which sequence and position each row of a forward is, and which rows get logits.
#[derive(Clone, Copy)]
enum Rows<'a> {
    /// Consecutive tokens of the one cache given, from position `p0`; only the last row's
    /// logits are computed (a prompt fed through a [`Decoder`]).
    Sequence { p0: usize },
    /// Row i is (cache index, position) `place[i]`; logits are computed for the rows in `last`
    /// (a step of many sequences: one row each for those decoding, all of a prompt or of a
    /// rebuilt window for the others).
    Mixed {
        place: &'a [(usize, usize)],
        last: &'a [usize],
    },
}

impl Rows<'_> {
    /// (cache index, position) of row `i`.
    fn at(self, i: usize) -> (usize, usize) {
        match self {
            Rows::Sequence { p0 } => (0, p0 + i),
            Rows::Mixed { place, .. } => place[i],
        }
    }
}

fn opt<'a>(p: &'a [f32], r: &std::ops::Range<usize>) -> Option<&'a [f32]> {
    (!r.is_empty()).then(|| &p[r.clone()])
}

/// The forward of `tokens` (one per row, placed by `rows`), attending over each row's cache;
/// writes the logits `rows` asks for into `buf.logits`. The matrix products run once over all
/// rows; attention runs per row over its own cache. Every kernel computes a row the same way
/// whatever other rows are present (the products sum each output over K in one fixed order), so
/// a sequence decoded in a batch gets bit-for-bit the logits it gets alone. Caches' lengths
/// are not advanced here. Dims: n rows, C, F, V, NH heads of HS.
fn forward_rows<C: Caches + ?Sized>(
    model: &GPT,
    layout: &Layout,
    caches: &mut C,
    buf: &mut Buffers,
    tokens: &[u32],
    rows: Rows<'_>,
) {
    let cfg = model.config();
    let (n, c, f, v) = (tokens.len(), cfg.d_model, cfg.d_ff, cfg.vocab_size);
    let (max_t, nh) = (cfg.max_position_embeddings, cfg.n_heads);
    let hs = c / nh;
    let scale = 1.0 / (hs as f32).sqrt();
    let p = model.params();
    let dev = model.backend();
    let (wte, wpe) = (&p[layout.wte.clone()], &p[layout.wpe.clone()]);

    let x = &mut buf.x[..n * c];
    for (i, (row, &id)) in x.chunks_exact_mut(c).zip(tokens).enumerate() {
        let (_, pos) = rows.at(i);
        let (te, pe) = (id as usize * c, pos * c);
        for ((o, a), b) in row.iter_mut().zip(&wte[te..te + c]).zip(&wpe[pe..pe + c]) {
            *o = a + b;
        }
    }
    let (ln, mean, rstd) = (&mut buf.ln[..n * c], &mut buf.mean[..n], &mut buf.rstd[..n]);
    let (qkv, att, proj) = (
        &mut buf.qkv[..n * 3 * c],
        &mut buf.att[..n * c],
        &mut buf.proj[..n * c],
    );
    let (fc, gelu) = (&mut buf.fc[..n * f], &mut buf.gelu[..n * f]);
    for (l, bl) in layout.blocks.iter().enumerate() {
        // attention: ln_1, qkv, append k and v, attend over positions 0..=pos
        dev.layernorm_forward(
            ln,
            mean,
            rstd,
            x,
            &p[bl.ln_1_w.clone()],
            opt(p, &bl.ln_1_b),
            n,
            c,
        );
        dev.matmul_forward(
            qkv,
            ln,
            &p[bl.attn_w.clone()],
            opt(p, &bl.attn_b),
            n,
            c,
            3 * c,
        );
        let layer = l * max_t * c..(l + 1) * max_t * c;
        // every row's key and value first: a prompt's row i attends to rows before it
        for (i, row) in qkv.chunks_exact(3 * c).enumerate() {
            let (ci, pos) = rows.at(i);
            caches
                .cache(ci)
                .put(layer.start + pos * c, &row[c..2 * c], &row[2 * c..]);
        }
        // attention, each row over its own cache, rows in parallel (they only read the caches)
        let shared: &C = caches;
        let scores = &mut buf.scores[..n * nh * max_t];
        qkv.par_chunks_exact(3 * c)
            .zip(att.par_chunks_exact_mut(c))
            .zip(scores.par_chunks_exact_mut(nh * max_t))
            .enumerate()
            .for_each(|(i, ((row, out), scores))| {
                let (ci, pos) = rows.at(i);
                let (q, ctx) = (&row[..c], pos + 1);
                match &shared.cache_ref(ci).store {
                    KvStore::F32 { k, v } => {
                        let (k, v) = (&k[layer.clone()], &v[layer.clone()]);
                        dev.attention_decode_row(out, scores, q, k, v, ctx, nh, hs, c, scale);
                    }
                    KvStore::Bf16 { k, v } => {
                        let (k, v) = (&k[layer.clone()], &v[layer.clone()]);
                        dev.attention_decode_row_bf16(out, scores, q, k, v, ctx, nh, hs, c, scale);
                    }
                }
            });
        dev.matmul_forward(
            proj,
            att,
            &p[bl.proj_w.clone()],
            opt(p, &bl.proj_b),
            n,
            c,
            c,
        );
        add(x, proj);
        // MLP: ln_2, c_fc, GELU, c_proj
        dev.layernorm_forward(
            ln,
            mean,
            rstd,
            x,
            &p[bl.ln_2_w.clone()],
            opt(p, &bl.ln_2_b),
            n,
            c,
        );
        dev.matmul_gelu_forward(fc, gelu, ln, &p[bl.fc_w.clone()], opt(p, &bl.fc_b), n, c, f);
        let (wp, bp) = (&p[bl.fcproj_w.clone()], opt(p, &bl.fcproj_b));
        dev.matmul_forward(proj, gelu, wp, bp, n, f, c);
        add(x, proj);
    }
    // logits only where a token will be sampled: the last row of each sequence
    let (lnf_w, lnf_b) = (&p[layout.ln_f_w.clone()], opt(p, &layout.ln_f_b));
    let head = &p[layout.lm_head.clone()];
    let (m, from): (usize, &[f32]) = match rows {
        Rows::Sequence { .. } => (1, &x[(n - 1) * c..]),
        Rows::Mixed { last, .. } => {
            // gathered into the (now free) projection buffer, contiguous for the kernels
            for (j, &r) in last.iter().enumerate() {
                proj[j * c..(j + 1) * c].copy_from_slice(&x[r * c..(r + 1) * c]);
            }
            (last.len(), &proj[..last.len() * c])
        }
    };
    let (ln, mean, rstd) = (&mut ln[..m * c], &mut mean[..m], &mut rstd[..m]);
    dev.layernorm_forward(ln, mean, rstd, from, lnf_w, lnf_b, m, c);
    dev.head_forward(&mut buf.logits[..m * v], ln, head, m, c, v);
}

fn add(x: &mut [f32], y: &[f32]) {
    for (a, b) in x.iter_mut().zip(y) {
        *a += b;
    }
}

/// Index of the largest logit (the first one on ties).
pub fn argmax(logits: &[f32]) -> usize {
    let mut best = 0;
    for (i, &x) in logits.iter().enumerate() {
        if x > logits[best] {
            best = i;
        }
    }
    best
}

/// One token from `logits` as nanoGPT samples it: divide by the temperature, keep the top k
/// (and anything tied with the k-th), softmax, draw. Temperature 0 is argmax.
fn sample_token(
    logits: &[f32],
    opts: &SampleOptions,
    rng: &mut SplitMix64,
    scratch: &mut Vec<f32>,
) -> u32 {
    if opts.temperature == 0.0 {
        return argmax(logits) as u32;
    }
    let threshold = match opts.top_k {
        Some(k) if k < logits.len() => {
            scratch.clear();
            scratch.extend_from_slice(logits);
            let (_, kth, _) = scratch.select_nth_unstable_by(k - 1, |a, b| b.total_cmp(a));
            *kth
        }
        _ => f32::NEG_INFINITY,
    };
    let t = f64::from(opts.temperature);
    let max = f64::from(logits[argmax(logits)]);
    let weight = |x: f32| {
        if x >= threshold {
            ((f64::from(x) - max) / t).exp()
        } else {
            0.0
        }
    };
    let total: f64 = logits.iter().map(|&x| weight(x)).sum();
    let mut u = rng.next_f64() * total;
    let mut last = 0;
    for (i, &x) in logits.iter().enumerate() {
        let w = weight(x);
        if w > 0.0 {
            last = i;
            if u < w {
                return i as u32;
            }
            u -= w;
        }
    }
    // rounding left u just past the end: the last token with weight
    last as u32
}

/// How many tokens `generate` conditions on: all of `max_position_embeddings` (see the module
/// doc).
pub fn context_window(cfg: &GPTConfig) -> usize {
    cfg.max_position_embeddings.max(1)
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
    mut on_token: impl FnMut(u32) -> std::ops::ControlFlow<()>,
) -> Result<Vec<u32>, SampleError> {
    let mut ws = Workspace::new(model);
    let mut g = Generation::with_kv_dtype(model, prompt, opts, kv_dtype)?;
    while !g.is_finished() {
        decode_step(model, std::slice::from_mut(&mut g), &mut ws)?;
        let Some(&next) = g.tokens().last() else {
            break;
        };
        if on_token(next).is_break() {
            break;
        }
    }
    Ok(g.into_tokens())
}

/// One sequence being generated: its cache, sampler state and tokens so far. It borrows
/// nothing, so many can be in flight on one model and be stepped together by [`decode_step`]
/// (continuous batching); each must only ever be used with the model it was started on.
pub struct Generation {
    opts: SampleOptions,
    /// The (cropped) prompt and every token generated: the source of a rebuilt window.
    seq: Vec<u32>,
    /// Tokens generated.
    out: Vec<u32>,
    cache: KvCache,
    rng: SplitMix64,
    scratch: Vec<f32>,
}

impl AsMut<Generation> for Generation {
    fn as_mut(&mut self) -> &mut Generation {
        self
    }
}

impl AsRef<Generation> for Generation {
    fn as_ref(&self) -> &Generation {
        self
    }
}

impl Generation {
    /// Checks `opts` and `prompt` (cropped to the [`context_window`]); nothing runs yet: the
    /// first [`decode_step`] that includes it feeds the prompt and samples the first token.
    /// Its cache is f32.
    pub fn new(
        model: &GPT,
        prompt: &[u32],
        opts: &SampleOptions,
    ) -> Result<Generation, SampleError> {
        Generation::with_kv_dtype(model, prompt, opts, KvDtype::F32)
    }

    /// [`Generation::new`] with the cache keeping keys and values in `kv_dtype`.
    pub fn with_kv_dtype(
        model: &GPT,
        prompt: &[u32],
        opts: &SampleOptions,
        kv_dtype: KvDtype,
    ) -> Result<Generation, SampleError> {
        if !(opts.temperature >= 0.0 && opts.temperature.is_finite()) {
            return Err(SampleError::BadTemperature(opts.temperature));
        }
        if opts.top_k == Some(0) {
            return Err(SampleError::BadTopK);
        }
        if prompt.is_empty() {
            return Err(SampleError::EmptyPrompt);
        }
        let cfg = model.config();
        let max_t = context_window(cfg);
        let seq: Vec<u32> = prompt[prompt.len().saturating_sub(max_t)..].to_vec();
        check_vocab(&seq, cfg.vocab_size)?;
        Ok(Generation {
            opts: opts.clone(),
            out: Vec::with_capacity(opts.max_new_tokens),
            cache: KvCache::with_dtype(cfg, kv_dtype),
            rng: SplitMix64::new(opts.seed),
            scratch: Vec::with_capacity(cfg.vocab_size),
            seq,
        })
    }

    fn push(&mut self, token: u32) {
        self.out.push(token);
        self.seq.push(token);
    }

    /// The tokens generated so far (the last one is not yet fed).
    pub fn tokens(&self) -> &[u32] {
        &self.out
    }

    /// True once `max_new_tokens` tokens are out: stepping it further does nothing.
    pub fn is_finished(&self) -> bool {
        self.out.len() >= self.opts.max_new_tokens
    }

    /// What it samples with.
    pub fn options(&self) -> &SampleOptions {
        &self.opts
    }

    /// The format its cache keeps keys and values in.
    pub fn kv_dtype(&self) -> KvDtype {
        self.cache.dtype()
    }

    /// The tokens generated (without the prompt).
    pub fn into_tokens(self) -> Vec<u32> {
        self.out
    }
}

/// Most prompt (or rebuilt-window) tokens one step feeds besides the decoding rows; the first
/// newcomer of a step is fed whatever its length, so none waits for ever. It bounds how long
/// the sequences already decoding are held up when others join: a step that also feeds 256
/// prompt tokens costs about twice a plain 32-row step on config B, and with many streams
/// joining at once those steps are the slowest inter-token gaps. A smaller budget spreads the
/// joins over more steps (vLLM's `max_num_batched_tokens` trades time to first token for
/// inter-token latency the same way). With 32 streams of 16-token prompts on config B, 32
/// against 64 lowered the p99 inter-token gap by about 8% and raised time to first token by
/// 10-20%.
const STEP_PREFILL_TOKENS: usize = 32;

/// One step of every unfinished generation in `gens`, as one forward: a generation that has
/// not started feeds its prompt, one whose window is full feeds its last window again (at
/// positions 0.., as [`generate`] does), every other one feeds its last token; each then
/// samples its next token. The rows of all of them go through each matrix product together;
/// attention runs per row over the row's own cache. Prompts and windows beyond
/// [`STEP_PREFILL_TOKENS`] wait for a later step. Each generation gets exactly the tokens it
/// would get stepped alone. Finished generations are left as they are.
pub fn decode_step<G: AsMut<Generation> + AsRef<Generation> + Send + Sync>(
    model: &GPT,
    gens: &mut [G],
    ws: &mut Workspace,
) -> Result<(), SampleError> {
    let (max_t, vocab) = (context_window(model.config()), model.config().vocab_size);
    let budget = STEP_PREFILL_TOKENS;
    let (mut place, mut tokens, mut last, mut sel) = (
        std::mem::take(&mut ws.place),
        std::mem::take(&mut ws.tokens),
        std::mem::take(&mut ws.last),
        std::mem::take(&mut ws.sel),
    );
    place.clear();
    tokens.clear();
    last.clear();
    sel.clear();
    let mut prefill = 0;
    for (i, g) in gens.iter_mut().enumerate() {
        let g = g.as_mut();
        if g.is_finished() {
            continue;
        }
        let (feed, p0): (&[u32], usize) = if g.out.is_empty() {
            (&g.seq, 0)
        } else if g.cache.len < max_t {
            (&g.seq[g.seq.len() - 1..], g.cache.len)
        } else {
            (&g.seq[g.seq.len() - max_t..], 0)
        };
        if feed.len() > 1 || g.out.is_empty() {
            if prefill > 0 && prefill + feed.len() > budget {
                continue;
            }
            prefill += feed.len();
        }
        for (j, &t) in feed.iter().enumerate() {
            place.push((i, p0 + j));
            tokens.push(t);
        }
        last.push(place.len() - 1);
        sel.push(i);
    }
    let ran = if sel.is_empty() {
        Ok(())
    } else {
        check_vocab(&tokens, vocab).map(|()| {
            let rows = Rows::Mixed {
                place: &place,
                last: &last,
            };
            ws.run(model, gens, &tokens, rows);
            for (r, &i) in sel.iter().enumerate() {
                let g = gens[i].as_mut();
                g.cache.len = place[last[r]].1 + 1;
                let logits = &ws.buf.logits[r * vocab..(r + 1) * vocab];
                let next = sample_token(logits, &g.opts, &mut g.rng, &mut g.scratch);
                g.push(next);
            }
        })
    };
    (ws.place, ws.tokens, ws.last, ws.sel) = (place, tokens, last, sel);
    ran
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Forward;

    fn tiny(max_t: usize, bias: bool, tied: bool) -> GPTConfig {
        GPTConfig {
            vocab_size: 37,
            max_position_embeddings: max_t,
            n_layers: 2,
            n_heads: 4,
            d_model: 32,
            d_ff: 64,
            dropout: 0.0,
            bias,
            tie_word_embeddings: tied,
        }
    }

    /// A model whose logits are far from uniform, so greedy choices have clear margins.
    fn peaked(cfg: GPTConfig, seed: u64) -> GPT {
        let mut m = GPT::new(cfg, seed).unwrap();
        for (i, p) in m.params_mut().iter_mut().enumerate() {
            *p *= 20.0;
            *p += ((i * 7919) % 1000) as f32 * 1e-4;
        }
        m
    }

    /// [`peaked`], but with the inputs of q, k and v (ln_1 and the qkv weights) as initialised:
    /// confident logits over attention scores of order 1, as a trained model has (the peaked
    /// model's scores run to hundreds, so its attention is one-hot on whichever key wins by
    /// a hair).
    fn calm_attention(cfg: GPTConfig, seed: u64) -> GPT {
        let init = GPT::new(cfg.clone(), seed).unwrap();
        let mut m = peaked(cfg.clone(), seed);
        for bl in &Layout::new(&cfg).blocks {
            for r in [&bl.ln_1_w, &bl.ln_1_b, &bl.attn_w, &bl.attn_b] {
                m.params_mut()[r.clone()].copy_from_slice(&init.params()[r.clone()]);
            }
        }
        m
    }

    /// Greedy decoding by re-running the full forward on the (cropped) sequence every step.
    fn greedy_full(model: &mut GPT, prompt: &[u32], steps: usize) -> (Vec<u32>, Vec<Vec<f32>>) {
        let (max_t, v) = (context_window(model.config()), model.config().vocab_size);
        let mut seq = prompt.to_vec();
        let (mut out, mut all_logits) = (Vec::new(), Vec::new());
        for _ in 0..steps {
            let ctx = &seq[seq.len().saturating_sub(max_t)..];
            model.forward(Forward::new(ctx, 1, ctx.len())).unwrap();
            let last = model.logits()[(ctx.len() - 1) * v..ctx.len() * v].to_vec();
            let next = argmax(&last) as u32;
            all_logits.push(last);
            out.push(next);
            seq.push(next);
        }
        (out, all_logits)
    }

    #[test]
    fn generate_while_stops_on_the_token_it_breaks_on() {
        let model = peaked(tiny(13, true, false), 4);
        let opts = SampleOptions {
            max_new_tokens: 20,
            temperature: 0.8,
            top_k: None,
            seed: 9,
        };
        let all = generate(&model, &[1, 2], &opts, |_| {}).unwrap();
        let mut calls = 0;
        let cut = generate_while(&model, &[1, 2], &opts, |_| {
            calls += 1;
            if calls == 5 {
                std::ops::ControlFlow::Break(())
            } else {
                std::ops::ControlFlow::Continue(())
            }
        })
        .unwrap();
        assert_eq!((calls, &cut[..]), (5, &all[..5]));
    }

    /// Runs `jobs` (prompt, options, the step each joins at) as a server's continuous batch
    /// would, over caches in `kv`: joiners are prefilled between steps, every step is one
    /// `decode_step` over all active generations, finished ones leave at once.
    fn continuous_with(
        model: &GPT,
        jobs: &[(Vec<u32>, SampleOptions, usize)],
        kv: KvDtype,
    ) -> Vec<Vec<u32>> {
        let mut ws = Workspace::new(model);
        let mut done: Vec<Option<Vec<u32>>> = vec![None; jobs.len()];
        let mut active: Vec<(usize, Generation)> = Vec::new();
        let mut step = 0;
        while done.iter().any(Option::is_none) {
            for (i, (prompt, opts, at)) in jobs.iter().enumerate() {
                if *at == step {
                    let g = Generation::with_kv_dtype(model, prompt, opts, kv).unwrap();
                    active.push((i, g));
                }
            }
            active.retain_mut(|(i, g)| {
                let finished = g.is_finished();
                if finished {
                    done[*i] = Some(std::mem::take(&mut g.out));
                }
                !finished
            });
            let mut gens: Vec<&mut Generation> = active.iter_mut().map(|(_, g)| g).collect();
            decode_step(model, &mut gens, &mut ws).unwrap();
            step += 1;
        }
        done.into_iter().map(Option::unwrap).collect()
    }

    /// Runs generations together in decode steps over caches of `kv` and checks each gets
    /// bit for bit its tokens alone (over the same cache type); returns whether any differs
    /// from what an f32 cache gives it.
    fn batched_equals_solo(kv: KvDtype) -> bool {
        // two shapes: the tiny one (windows slide mid-batch) and one whose products are big
        // enough to be split over threads
        let wide = GPTConfig {
            d_model: 128,
            d_ff: 512,
            max_position_embeddings: 48,
            ..tiny(48, true, true)
        };
        let mut differs = false;
        for cfg in [tiny(13, true, false), wide] {
            let model = peaked(cfg, 5);
            let o = |n, temperature, top_k, seed| SampleOptions {
                max_new_tokens: n,
                temperature,
                top_k,
                seed,
            };
            let mut jobs = vec![
                (vec![1, 2, 3], o(30, 0.0, None, 0), 0),
                (vec![4], o(7, 0.9, Some(5), 11), 0),
                (vec![5, 6, 7, 8, 9, 10, 11], o(20, 1.3, None, 12), 2),
                ((0..20).map(|i| i % 37).collect(), o(12, 0.0, None, 0), 3),
                (vec![9, 9], o(1, 0.7, Some(3), 13), 3),
                (vec![2, 7], o(25, 0.8, Some(20), 14), 9),
                (vec![3], o(0, 0.8, None, 1), 4),
            ];
            // seven 40-token prompts joining at once: more than one step's prompt budget, so
            // some wait a step (and a 40-token window rebuild may come first)
            for j in 0..7u64 {
                let prompt = (0..40)
                    .map(|i| ((i * 7 + j as usize) % 37) as u32)
                    .collect();
                jobs.push((prompt, o(5 + j as usize, 0.9, Some(8), 20 + j), 1));
            }
            let together = continuous_with(&model, &jobs, kv);
            for ((prompt, opts, _), got) in jobs.iter().zip(&together) {
                let alone = generate_while_with(&model, prompt, opts, kv, |_| {
                    std::ops::ControlFlow::Continue(())
                })
                .unwrap();
                assert_eq!(got, &alone, "{kv:?} {opts:?}");
                differs |= alone != generate(&model, prompt, opts, |_| {}).unwrap();
            }
            assert_eq!(together[0].len(), 30);
        }
        differs
    }

    #[test]
    fn batched_decode_steps_give_each_sequence_its_solo_tokens_bit_for_bit() {
        assert!(!batched_equals_solo(KvDtype::F32));
    }

    #[test]
    fn under_a_bf16_cache_batched_decode_steps_give_each_sequence_its_solo_tokens_bit_for_bit() {
        // the cache really is bf16: somewhere a sampled token moves (the temperature-1.3
        // sequence samples from a wide distribution, 20 tokens long)
        assert!(
            batched_equals_solo(KvDtype::Bf16),
            "no sequence changed with a bf16 cache"
        );
    }

    #[test]
    fn kv_cache_greedy_equals_full_forward_greedy() {
        // 13 positions and 30 new tokens: the window slides for most of the run
        for (bias, tied) in [(true, true), (false, false)] {
            let cfg = tiny(13, bias, tied);
            let prompt = [3u32, 14, 15, 9, 2];
            let opts = SampleOptions {
                max_new_tokens: 30,
                temperature: 0.0,
                top_k: None,
                seed: 0,
            };
            let cached_model = peaked(cfg.clone(), 11);
            let cached = generate(&cached_model, &prompt, &opts, |_| {}).unwrap();
            let (full, full_logits) = greedy_full(&mut peaked(cfg, 11), &prompt, 30);
            assert_eq!(cached, full, "bias {bias} tied {tied}");
            assert!(full.iter().collect::<std::collections::HashSet<_>>().len() > 3);

            // and the logits agree at every step, through the slide (to f32 rounding of two
            // attention implementations over the large activations of the scaled weights)
            let window = context_window(cached_model.config());
            let mut dec = Decoder::new(&cached_model);
            let mut seq = prompt.to_vec();
            let mut logits = dec.feed(&seq).unwrap().to_vec();
            for (step, want) in full_logits.iter().enumerate() {
                let worst = logits
                    .iter()
                    .zip(want)
                    .map(|(a, b)| (a - b).abs())
                    .fold(0.0, f32::max);
                let scale = want.iter().fold(1.0f32, |m, x| m.max(x.abs()));
                assert!(
                    worst < 1e-4 * scale,
                    "step {step}: max |logit diff| {worst} of {scale}"
                );
                seq.push(full[step]);
                logits = if dec.len() < window {
                    dec.feed(&[full[step]]).unwrap().to_vec()
                } else {
                    dec.reset();
                    dec.feed(&seq[seq.len() - window..]).unwrap().to_vec()
                };
            }
        }
    }

    #[test]
    fn a_bf16_cache_gives_logits_close_to_an_f32_caches_and_the_same_greedy_tokens() {
        // 13 positions and 30 new tokens: the window slides for most of the run. The peaked
        // model's attention is one-hot on keys that win by less than bf16 moves a score, so
        // the model here has its confident logits over ordinary attention (`calm_attention`).
        let greedy = SampleOptions {
            max_new_tokens: 30,
            temperature: 0.0,
            top_k: None,
            seed: 0,
        };
        let mut seen = std::collections::HashSet::new();
        for (bias, tied) in [(true, true), (false, false)] {
            let model = calm_attention(tiny(13, bias, tied), 11);
            let window = context_window(model.config());
            for prompt in [
                &[3u32, 14, 15, 9, 2][..],
                &[7, 1, 30],
                &[22, 22, 5, 11, 36, 0],
            ] {
                let f32_tokens = generate(&model, prompt, &greedy, |_| {}).unwrap();
                let bf16_tokens =
                    generate_while_with(&model, prompt, &greedy, KvDtype::Bf16, |_| {
                        std::ops::ControlFlow::Continue(())
                    })
                    .unwrap();
                assert_eq!(
                    bf16_tokens, f32_tokens,
                    "bias {bias} tied {tied} {prompt:?}"
                );
                seen.extend(f32_tokens.iter().copied());

                // the logits at every step. bf16 keeps 8 significant bits, so a key or value
                // moves by at most 2^-9 of itself; attention mixes values (a convex
                // combination) and the scores (of order 1 here) move by about 2^-9 of
                // themselves, so no logit should move by 2^-9 of the logits' scale (about
                // 2^-12 is seen); an f32 cache gives 0, a wrong cache far more.
                let (mut a, mut b) = (
                    Decoder::new(&model),
                    Decoder::with_kv_dtype(&model, KvDtype::Bf16),
                );
                assert_eq!(
                    (a.cache().dtype(), b.cache().dtype()),
                    (KvDtype::F32, KvDtype::Bf16)
                );
                let mut seq = prompt.to_vec();
                let mut la = a.feed(&seq).unwrap().to_vec();
                let mut lb = b.feed(&seq).unwrap().to_vec();
                let mut moved = false;
                for (step, &next) in f32_tokens.iter().enumerate() {
                    let worst = la
                        .iter()
                        .zip(&lb)
                        .map(|(x, y)| (x - y).abs())
                        .fold(0.0, f32::max);
                    let scale = la.iter().fold(0.0f32, |m, x| m.max(x.abs()));
                    assert!(
                        worst < scale / 512.0,
                        "{prompt:?} step {step}: max |logit diff| {worst} of {scale}"
                    );
                    moved |= worst > 0.0;
                    seq.push(next);
                    if a.len() < window {
                        la = a.feed(&[next]).unwrap().to_vec();
                        lb = b.feed(&[next]).unwrap().to_vec();
                    } else {
                        let w = &seq[seq.len() - window..];
                        a.reset();
                        b.reset();
                        la = a.feed(w).unwrap().to_vec();
                        lb = b.feed(w).unwrap().to_vec();
                    }
                }
                assert!(moved, "the bf16 rounding never reached the logits");
            }
        }
        assert!(
            seen.len() > 8,
            "greedy tokens too uniform to tell: {seen:?}"
        );
    }

    #[test]
    fn a_bf16_cache_takes_half_the_bytes() {
        let cfg = tiny(13, true, true);
        let n = cfg.n_layers * cfg.max_position_embeddings * cfg.d_model;
        let f = KvCache::new(&cfg);
        let b = KvCache::with_dtype(&cfg, KvDtype::Bf16);
        assert_eq!((f.dtype(), b.dtype()), (KvDtype::F32, KvDtype::Bf16));
        assert_eq!(f.bytes(), 2 * n * 4);
        assert_eq!(b.bytes(), 2 * n * 2);
        assert_eq!(KvDtype::Bf16.size() * 2, KvDtype::F32.size());
        assert_eq!("bf16".parse::<KvDtype>(), Ok(KvDtype::Bf16));
        assert_eq!("fp32".parse::<KvDtype>(), Ok(KvDtype::F32));
        assert!("fp16"
            .parse::<KvDtype>()
            .unwrap_err()
            .contains("fp32 or bf16"));
        assert_eq!(KvDtype::default(), KvDtype::F32);
    }

    #[test]
    fn same_seed_same_sample_other_seed_other_sample() {
        let model = peaked(tiny(64, true, true), 3);
        let opts = SampleOptions {
            max_new_tokens: 40,
            temperature: 1.0,
            top_k: Some(10),
            seed: 42,
        };
        let prompt = [1u32, 2, 3];
        let mut streamed = Vec::new();
        let a = generate(&model, &prompt, &opts, |t| streamed.push(t)).unwrap();
        let b = generate(&model, &prompt, &opts, |_| {}).unwrap();
        assert_eq!(a, b);
        assert_eq!(a, streamed);
        assert_eq!(a.len(), 40);
        let c = generate(
            &model,
            &prompt,
            &SampleOptions {
                seed: 43,
                ..opts.clone()
            },
            |_| {},
        )
        .unwrap();
        assert_ne!(a, c);
    }

    #[test]
    fn top_k_and_temperature_shape_the_distribution() {
        let logits = [0.0f32, 5.0, 1.0, 4.0, 4.0, -2.0];
        let mut rng = SplitMix64::new(7);
        let mut scratch = Vec::new();
        let mut counts = [0usize; 6];
        let opts = SampleOptions {
            max_new_tokens: 1,
            temperature: 1.0,
            top_k: Some(2),
            seed: 0,
        };
        for _ in 0..3000 {
            counts[sample_token(&logits, &opts, &mut rng, &mut scratch) as usize] += 1;
        }
        // top 2 = {5.0, 4.0}; the tie at 4.0 keeps both 4.0s, as nanoGPT's `logits < v[-1]`
        assert_eq!((counts[0], counts[2], counts[5]), (0, 0, 0), "{counts:?}");
        // p(1) = e^5 / (e^5 + 2 e^4) = 0.576
        let p1 = counts[1] as f64 / 3000.0;
        assert!((p1 - 0.576).abs() < 0.04, "{counts:?}");
        // a low temperature concentrates on the maximum
        let cold = SampleOptions {
            temperature: 0.05,
            top_k: None,
            ..opts
        };
        for _ in 0..100 {
            assert_eq!(sample_token(&logits, &cold, &mut rng, &mut scratch), 1);
        }
    }

    #[test]
    fn bad_requests_are_errors() {
        let model = peaked(tiny(8, true, true), 1);
        let opts = SampleOptions::default();
        assert_eq!(
            generate(&model, &[], &opts, |_| {}),
            Err(SampleError::EmptyPrompt)
        );
        assert_eq!(
            generate(&model, &[1, 99], &opts, |_| {}),
            Err(SampleError::TokenOutOfRange {
                index: 1,
                id: 99,
                vocab: 37
            })
        );
        let hot = SampleOptions {
            temperature: -1.0,
            ..opts.clone()
        };
        assert!(matches!(
            generate(&model, &[1], &hot, |_| {}),
            Err(SampleError::BadTemperature(_))
        ));
        let k0 = SampleOptions {
            top_k: Some(0),
            ..opts
        };
        assert_eq!(
            generate(&model, &[1], &k0, |_| {}),
            Err(SampleError::BadTopK)
        );
        let mut dec = Decoder::new(&model);
        dec.feed(&[1; 6]).unwrap();
        assert_eq!(
            dec.feed(&[1; 3]).unwrap_err(),
            SampleError::ContextFull {
                cached: 6,
                new: 3,
                max: 8
            }
        );
        // a prompt longer than the window is cropped, not refused
        let long: Vec<u32> = (0..20).map(|i| i % 37).collect();
        let greedy = SampleOptions {
            max_new_tokens: 3,
            temperature: 0.0,
            top_k: None,
            seed: 0,
        };
        assert_eq!(
            generate(&model, &long, &greedy, |_| {}).unwrap(),
            generate(&model, &long[12..], &greedy, |_| {}).unwrap()
        );
    }
}
