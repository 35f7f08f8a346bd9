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
//! This module never changes the model and never allocates per token: buffers are sized for a
//! full window when the decoder is built.

use cohort_rng::SplitMix64;

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
#[derive(Debug, thiserror::Error, PartialEq)]
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

/// Scratch rows for up to `max_t` tokens, allocated once.
struct Buffers {
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
    /// Attention weights of one query over the cache (max_t).
    scores: Vec<f32>,
    /// Logits of the last token fed (V).
    logits: Vec<f32>,
}

/// Incremental inference over one sequence with a KV cache.
pub struct Decoder<'m> {
    model: &'m GPT,
    layout: Layout,
    /// Keys then values of every layer: (L, max_t, C) each.
    k_cache: Vec<f32>,
    v_cache: Vec<f32>,
    /// Tokens in the cache.
    len: usize,
    buf: Buffers,
}

impl<'m> Decoder<'m> {
    /// An empty decoder for `model` (buffers for a full window).
    pub fn new(model: &'m GPT) -> Decoder<'m> {
        let cfg = model.config();
        let (t, c, f) = (cfg.max_position_embeddings, cfg.d_model, cfg.d_ff);
        let cache = cfg.n_layers * t * c;
        Decoder {
            model,
            layout: Layout::new(cfg),
            k_cache: vec![0.0; cache],
            v_cache: vec![0.0; cache],
            len: 0,
            buf: Buffers {
                x: vec![0.0; t * c],
                ln: vec![0.0; t * c],
                mean: vec![0.0; t],
                rstd: vec![0.0; t],
                qkv: vec![0.0; t * 3 * c],
                att: vec![0.0; t * c],
                proj: vec![0.0; t * c],
                fc: vec![0.0; t * f],
                gelu: vec![0.0; t * f],
                scores: vec![0.0; t],
                logits: vec![0.0; cfg.vocab_size],
            },
        }
    }

    /// Tokens in the cache.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True before anything was fed (or after [`Decoder::reset`]).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Forgets every cached token.
    pub fn reset(&mut self) {
        self.len = 0;
    }

    /// Runs `tokens` at positions `len..len + n` through the model, appending their keys and
    /// values to the cache, and returns the logits (V) that follow the last of them.
    pub fn feed(&mut self, tokens: &[u32]) -> Result<&[f32], SampleError> {
        let cfg: &GPTConfig = self.model.config();
        if tokens.is_empty() {
            return Err(SampleError::EmptyPrompt);
        }
        if self.len + tokens.len() > cfg.max_position_embeddings {
            return Err(SampleError::ContextFull {
                cached: self.len,
                new: tokens.len(),
                max: cfg.max_position_embeddings,
            });
        }
        if let Some((index, &id)) = tokens
            .iter()
            .enumerate()
            .find(|(_, &id)| id as usize >= cfg.vocab_size)
        {
            return Err(SampleError::TokenOutOfRange {
                index,
                id,
                vocab: cfg.vocab_size,
            });
        }
        let Decoder {
            model,
            layout,
            k_cache,
            v_cache,
            len,
            buf,
        } = self;
        let model: &GPT = model;
        let dev = model.backend();
        let p0 = *len;
        dev.install(&mut || feed_rows(model, layout, k_cache, v_cache, buf, p0, tokens));
        self.len += tokens.len();
        Ok(&self.buf.logits)
    }
}

fn opt<'a>(p: &'a [f32], r: &std::ops::Range<usize>) -> Option<&'a [f32]> {
    (!r.is_empty()).then(|| &p[r.clone()])
}

/// The forward of `tokens` at positions `p0..`, attending over the cache; writes the last
/// token's logits into `buf.logits`. Dims: n new tokens, C, F, V, NH heads of HS.
fn feed_rows(
    model: &GPT,
    layout: &Layout,
    k_cache: &mut [f32],
    v_cache: &mut [f32],
    buf: &mut Buffers,
    p0: usize,
    tokens: &[u32],
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
        let (te, pe) = (id as usize * c, (p0 + i) * c);
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
        // attention: ln_1, qkv, append k and v, attend over positions 0..=p0+i
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
        let kc = &mut k_cache[l * max_t * c..(l + 1) * max_t * c];
        let vc = &mut v_cache[l * max_t * c..(l + 1) * max_t * c];
        for (i, row) in qkv.chunks_exact(3 * c).enumerate() {
            let at = (p0 + i) * c;
            kc[at..at + c].copy_from_slice(&row[c..2 * c]);
            vc[at..at + c].copy_from_slice(&row[2 * c..]);
        }
        for (i, (row, out)) in qkv
            .chunks_exact(3 * c)
            .zip(att.chunks_exact_mut(c))
            .enumerate()
        {
            let ctx = p0 + i + 1;
            for h in 0..nh {
                let q = &row[h * hs..(h + 1) * hs];
                let scores = &mut buf.scores[..ctx];
                let mut max = f32::NEG_INFINITY;
                for (j, s) in scores.iter_mut().enumerate() {
                    let k = &kc[j * c + h * hs..j * c + (h + 1) * hs];
                    *s = q.iter().zip(k).map(|(a, b)| a * b).sum::<f32>() * scale;
                    max = max.max(*s);
                }
                let mut sum = 0.0;
                for s in scores.iter_mut() {
                    *s = (*s - max).exp();
                    sum += *s;
                }
                let o = &mut out[h * hs..(h + 1) * hs];
                o.fill(0.0);
                for (j, s) in scores.iter().enumerate() {
                    let w = s / sum;
                    let vj = &vc[j * c + h * hs..j * c + (h + 1) * hs];
                    for (o, vv) in o.iter_mut().zip(vj) {
                        *o += w * vv;
                    }
                }
            }
        }
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
        dev.matmul_forward(fc, ln, &p[bl.fc_w.clone()], opt(p, &bl.fc_b), n, c, f);
        dev.gelu_forward(gelu, fc);
        let (wp, bp) = (&p[bl.fcproj_w.clone()], opt(p, &bl.fcproj_b));
        dev.matmul_forward(proj, gelu, wp, bp, n, f, c);
        add(x, proj);
    }
    // only the last position's logits are needed
    let last = &x[(n - 1) * c..];
    let (ln1, mean1, rstd1) = (&mut ln[..c], &mut mean[..1], &mut rstd[..1]);
    let (lnf_w, lnf_b) = (&p[layout.ln_f_w.clone()], opt(p, &layout.ln_f_b));
    dev.layernorm_forward(ln1, mean1, rstd1, last, lnf_w, lnf_b, 1, c);
    let head = &p[layout.lm_head.clone()];
    dev.head_forward(&mut buf.logits, ln1, head, 1, c, v);
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
    mut on_token: impl FnMut(u32) -> std::ops::ControlFlow<()>,
) -> Result<Vec<u32>, SampleError> {
    if !(opts.temperature >= 0.0 && opts.temperature.is_finite()) {
        return Err(SampleError::BadTemperature(opts.temperature));
    }
    if opts.top_k == Some(0) {
        return Err(SampleError::BadTopK);
    }
    if prompt.is_empty() {
        return Err(SampleError::EmptyPrompt);
    }
    let max_t = context_window(model.config());
    let mut seq: Vec<u32> = prompt[prompt.len().saturating_sub(max_t)..].to_vec();
    let mut decoder = Decoder::new(model);
    let mut rng = SplitMix64::new(opts.seed);
    let mut scratch = Vec::with_capacity(model.config().vocab_size);
    let mut out = Vec::with_capacity(opts.max_new_tokens);
    let mut logits = decoder.feed(&seq)?.to_vec();
    for i in 0..opts.max_new_tokens {
        let next = sample_token(&logits, opts, &mut rng, &mut scratch);
        out.push(next);
        seq.push(next);
        if on_token(next).is_break() || i + 1 == opts.max_new_tokens {
            break;
        }
        let fed = if decoder.len() < max_t {
            decoder.feed(&[next])?
        } else {
            // window full: condition on the last max_t tokens, at positions 0..max_t
            decoder.reset();
            decoder.feed(&seq[seq.len() - max_t..])?
        };
        logits.copy_from_slice(fed);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

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

    /// Greedy decoding by re-running the full forward on the (cropped) sequence every step.
    fn greedy_full(model: &mut GPT, prompt: &[u32], steps: usize) -> (Vec<u32>, Vec<Vec<f32>>) {
        let (max_t, v) = (context_window(model.config()), model.config().vocab_size);
        let mut seq = prompt.to_vec();
        let (mut out, mut all_logits) = (Vec::new(), Vec::new());
        for _ in 0..steps {
            let ctx = &seq[seq.len().saturating_sub(max_t)..];
            model.forward(ctx, None, None, 1, ctx.len()).unwrap();
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
