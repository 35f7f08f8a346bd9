//! Continuous batching: a [`Generation`] owns one sequence's cache, sampler state and tokens
//! and borrows nothing; [`decode_step`] advances any set of them by one token in one forward,
//! their rows sharing every matrix product. Sequences may join or leave between any two steps.
//! A prompt that starts as another sequence of the step already fed (chat requests under the
//! same system prompt) copies those positions' keys and values instead of computing them
//! again ([`share_prefixes`]): the same values, so the same tokens.
//!
//! This module decides which rows a step feeds and samples each sequence's next token; it never
//! computes a layer itself (that is `forward`, through the workspace).

use cohort_rng::SplitMix64;

use super::cache::{KvCache, KvDtype, Workspace};
use super::forward::Rows;
use super::sampler::{context_window, sample_token};
use super::{check_vocab, SampleError, SampleOptions};
use crate::GPT;

/// One sequence being generated: its cache, sampler state and tokens so far. It borrows
/// nothing, so many can be in flight on one model and be stepped together by [`decode_step`]
/// (continuous batching); each must only ever be used with the model it was started on.
pub struct Generation {
    opts: SampleOptions,
    /// The (cropped) prompt and every token generated: the source of a rebuilt window.
    seq: Vec<u32>,
    /// Tokens generated.
    pub(super) out: Vec<u32>,
    pub(super) cache: KvCache,
    rng: SplitMix64,
    scratch: Vec<f32>,
    /// Whether a window was rebuilt (the cache then no longer holds `seq`'s start).
    slid: bool,
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
        if !(0.0..=1.0).contains(&opts.top_p) {
            return Err(SampleError::BadTopP(opts.top_p));
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
            slid: false,
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
/// [`Workspace::set_prefill_tokens`] changes it for the steps of one workspace.
pub const STEP_PREFILL_TOKENS: usize = 32;

/// One step of every unfinished generation in `gens`, as one forward: a generation that has
/// not started feeds its prompt, one whose window is full feeds its last window again (at
/// positions 0.., as [`generate`] does), every other one feeds its last token; each then
/// samples its next token. The rows of all of them go through each matrix product together;
/// attention runs per row over the row's own cache. Prompts and windows beyond
/// the workspace's prefill budget ([`STEP_PREFILL_TOKENS`] unless set) wait for a later step. Each generation gets exactly the tokens it
/// would get stepped alone. Finished generations are left as they are.
pub fn decode_step<G: AsMut<Generation> + AsRef<Generation> + Send + Sync>(
    model: &GPT,
    gens: &mut [G],
    ws: &mut Workspace,
) -> Result<(), SampleError> {
    let (max_t, vocab) = (context_window(model.config()), model.config().vocab_size);
    let budget = ws.prefill_tokens;
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
    share_prefixes(model, gens);
    let mut prefill = 0;
    for (i, g) in gens.iter_mut().enumerate() {
        let g = g.as_mut();
        if g.is_finished() {
            continue;
        }
        // a prompt not yet fed may hold a shared start already (share_prefixes)
        let (feed, p0): (&[u32], usize) = if g.out.is_empty() {
            (&g.seq[g.cache.len..], g.cache.len)
        } else if g.cache.len < max_t {
            (&g.seq[g.seq.len() - 1..], g.cache.len)
        } else {
            g.slid = true;
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

/// Gives each prompt of `gens` not yet fed the keys and values of the longest start it shares
/// with a sequence whose cache holds its own start (fed, or given one here), all but its last
/// token (whose logits it samples from): the next step feeds only the rest. A row's key and
/// value depend only on the tokens up to it, and every kernel computes a row alike whatever
/// rows share its product, so the copy holds the very values feeding the prompt would.
pub(super) fn share_prefixes<G: AsMut<Generation> + AsRef<Generation>>(
    model: &GPT,
    gens: &mut [G],
) {
    let cfg = model.config();
    for i in 0..gens.len() {
        let g = gens[i].as_ref();
        if !g.out.is_empty() || g.cache.len > 0 || g.seq.len() < 2 {
            continue;
        }
        let mut best = (0, i);
        for (j, d) in gens.iter().enumerate() {
            let d = d.as_ref();
            if j == i || d.slid || d.cache.dtype() != g.cache.dtype() {
                continue;
            }
            let shared = d.seq[..d.cache.len]
                .iter()
                .zip(&g.seq[..g.seq.len() - 1])
                .take_while(|(a, b)| a == b)
                .count();
            if shared > best.0 {
                best = (shared, j);
            }
        }
        let (p, j) = best;
        if p == 0 {
            continue;
        }
        // the two sequences apart: split the slice at the later of the two
        let (lo, hi) = gens.split_at_mut(i.max(j));
        let (to, from) = if i < j {
            (lo[i].as_mut(), hi[0].as_ref())
        } else {
            (hi[0].as_mut(), lo[j].as_ref())
        };
        to.cache
            .copy_prefix(&from.cache, p, cfg.n_layers, cfg.max_position_embeddings);
    }
}
