//! Generation's tests: the KV cache against full forwards, batched steps against solo ones,
//! the bf16 cache, the sampler's distribution and seeds, and bad requests.

use super::sampler::sample_token;
use super::*;
use crate::layout::Layout;
use crate::{Forward, GPTConfig, GPT};
use cohort_engine::cpu::DecodeFormat;
use cohort_rng::SplitMix64;

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
        ..GPTConfig::default()
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
        top_p: 1.0,
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
    // and a Llama: rotary positions and 4 query heads over 2 cached key/value heads
    let llama = GPTConfig {
        n_kv_heads: Some(2),
        ..GPTConfig::llama_like(tiny(13, false, false))
    };
    let mut differs = false;
    for cfg in [tiny(13, true, false), wide, llama] {
        let model = peaked(cfg, 5);
        let o = |n, temperature, top_k, seed| SampleOptions {
            max_new_tokens: n,
            temperature,
            top_k,
            top_p: 1.0,
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
        // prompts sharing a start with a sequence in flight (a copied prefix): job 0's
        // prompt, job 3's 20 tokens, and job 2's whole prompt again
        jobs.push((vec![1, 2, 3, 5, 8], o(9, 0.0, None, 0), 2));
        let longer: Vec<u32> = (0..20).map(|i| i % 37).chain([30, 31]).collect();
        jobs.push((longer, o(6, 0.9, Some(8), 15), 5));
        jobs.push((vec![5, 6, 7, 8, 9, 10, 11], o(8, 1.3, None, 16), 4));
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

/// A prompt that starts as a sequence in flight did gets that start's keys and values copied
/// and feeds only the rest; one that shares nothing, or only its last token, feeds all.
#[test]
fn a_prompt_sharing_a_start_with_a_sequence_in_flight_feeds_only_the_rest() {
    let model = peaked(tiny(48, true, true), 5);
    let opts = SampleOptions {
        max_new_tokens: 4,
        temperature: 0.0,
        top_k: None,
        top_p: 1.0,
        seed: 0,
    };
    let mut ws = Workspace::new(&model);
    let system: Vec<u32> = (0..12).map(|i| (i * 5 + 1) % 37).collect();
    let ask = |tail: &[u32]| [&system[..], tail].concat();
    let mut gens = vec![Generation::new(&model, &ask(&[3, 4]), &opts).unwrap()];
    decode_step(&model, &mut gens, &mut ws).unwrap();
    gens.push(Generation::new(&model, &ask(&[9, 9, 9]), &opts).unwrap());
    gens.push(Generation::new(&model, &[20, 21], &opts).unwrap());
    gens.push(Generation::new(&model, &system[..1], &opts).unwrap());
    super::batching::share_prefixes(&model, &mut gens);
    let cached: Vec<usize> = gens.iter().map(|g| g.cache.len()).collect();
    assert_eq!(cached, [14, 12, 0, 0]);
}

/// The prefill budget decides how many prompts a step starts, never their tokens.
#[test]
fn the_prefill_budget_starts_more_prompts_per_step_with_the_same_tokens() {
    let model = peaked(tiny(48, true, true), 5);
    let opts = SampleOptions {
        max_new_tokens: 6,
        temperature: 0.9,
        top_k: Some(8),
        top_p: 1.0,
        seed: 3,
    };
    let run = |budget: usize| {
        let mut ws = Workspace::new(&model);
        ws.set_prefill_tokens(budget);
        let mut gens: Vec<Generation> = (0..5u32)
            .map(|j| {
                let prompt: Vec<u32> = (0..10).map(|i| (i * 3 + j * 7) % 37).collect();
                Generation::new(&model, &prompt, &opts).unwrap()
            })
            .collect();
        decode_step(&model, &mut gens, &mut ws).unwrap();
        let started = gens.iter().filter(|g| !g.tokens().is_empty()).count();
        while gens.iter().any(|g| !g.is_finished()) {
            decode_step(&model, &mut gens, &mut ws).unwrap();
        }
        let out: Vec<Vec<u32>> = gens.into_iter().map(Generation::into_tokens).collect();
        (started, out)
    };
    let (few, a) = run(1);
    let (many, b) = run(1000);
    assert_eq!((few, many), (1, 5));
    assert_eq!(a, b);
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
            top_p: 1.0,
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
        top_p: 1.0,
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
            let bf16_tokens = generate_while_with(&model, prompt, &greedy, KvDtype::Bf16, |_| {
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
        top_p: 1.0,
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
        top_p: 1.0,
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
        top_p: 1.0,
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
        top_p: 1.0,
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
        top_p: 1.0,
        seed: 0,
    };
    assert_eq!(
        generate(&model, &long, &greedy, |_| {}).unwrap(),
        generate(&model, &long[12..], &greedy, |_| {}).unwrap()
    );
}

#[test]
fn a_llama_with_grouped_heads_decodes_with_its_cache_as_its_full_forward_does() {
    // RoPE, RMSNorm, SwiGLU, 4 query heads over 2 cached key/value heads
    for kv in [KvDtype::F32, KvDtype::Bf16] {
        let cfg = GPTConfig {
            n_heads: 4,
            n_kv_heads: Some(2),
            qkv_bias: Some(true),
            ..GPTConfig::llama_like(tiny(13, false, false))
        };
        let prompt = [3u32, 14, 15, 9, 2];
        let opts = SampleOptions {
            max_new_tokens: 30,
            temperature: 0.0,
            top_k: None,
            top_p: 1.0,
            seed: 0,
        };
        let cached_model = peaked(cfg.clone(), 11);
        let cached = generate_while_with(&cached_model, &prompt, &opts, kv, |_| {
            std::ops::ControlFlow::Continue(())
        })
        .unwrap();
        let (full, _) = greedy_full(&mut peaked(cfg.clone(), 11), &prompt, 30);
        if kv == KvDtype::F32 {
            assert_eq!(cached, full);
            assert!(full.iter().collect::<std::collections::HashSet<_>>().len() > 3);
        } else {
            // a rounded cache may tip a near tie; it still decodes every step
            assert_eq!(cached.len(), full.len());
        }
        // the cache holds 2 of the 4 heads
        let full_heads = KvCache::with_dtype(
            &GPTConfig {
                n_kv_heads: None,
                ..cfg.clone()
            },
            kv,
        );
        assert_eq!(
            2 * KvCache::with_dtype(&cfg, kv).bytes(),
            full_heads.bytes()
        );
    }
}

/// Logits of `model`'s f32 weights and of its copy in `format`, step by step along the f32
/// weights' greedy tokens: (the worst |logit diff| over a step's largest |logit|, steps
/// whose argmax agrees, steps).
fn copy_against_f32(model: &GPT, format: DecodeFormat, prompt: &[u32]) -> (f32, usize, usize) {
    let weights = std::sync::Arc::new(DecodeWeights::new(model, format));
    let (mut a, mut b) = (
        Decoder::new(model),
        Decoder::with_weights(model, weights, KvDtype::F32).unwrap(),
    );
    let (mut la, mut lb) = (
        a.feed(prompt).unwrap().to_vec(),
        b.feed(prompt).unwrap().to_vec(),
    );
    let (mut worst, mut agree, steps) = (0f32, 0, 20);
    for _ in 0..steps {
        let diff = la
            .iter()
            .zip(&lb)
            .map(|(x, y)| (x - y).abs())
            .fold(0.0, f32::max);
        let scale = la.iter().fold(0.0f32, |m, x| m.max(x.abs()));
        worst = worst.max(diff / scale);
        let next = argmax(&la) as u32;
        agree += usize::from(argmax(&lb) as u32 == next);
        la = a.feed(&[next]).unwrap().to_vec();
        lb = b.feed(&[next]).unwrap().to_vec();
    }
    (worst, agree, steps)
}

/// A GPT-2 (LayerNorm, GELU, biases, tied head) and a Llama (RMSNorm, SwiGLU, RoPE, 4 query
/// heads over 2 key/value heads, untied head), with room for 20 steps after the prompt.
fn gpt2_and_llama() -> [(&'static str, GPT); 2] {
    let llama = GPTConfig {
        n_kv_heads: Some(2),
        ..GPTConfig::llama_like(tiny(32, false, false))
    };
    [
        ("gpt2", calm_attention(tiny(32, true, true), 11)),
        ("llama", calm_attention(llama, 12)),
    ]
}

#[test]
fn bf16_and_q8_weights_give_logits_near_f32_weights() {
    // bf16 keeps 8 significant bits of each weight and input: a product moves by about 2^-8
    // of itself, sums of many cancel some of that, and the layers compound it: about 2^-7 of
    // the logits' scale is seen (0.007-0.009). Q8 keeps about 7 bits of each block's largest
    // element (the rest of a block lose more): 0.03-0.05 is seen on these models, whose
    // weights were scaled up with an offset that quantises poorly. Either way a broken
    // product is off by the logits' whole scale.
    for (name, model) in gpt2_and_llama() {
        for prompt in [&[3u32, 14, 15, 9, 2][..], &[7, 1, 30]] {
            for (format, tol) in [
                (DecodeFormat::Bf16, 1.0 / 64.0),
                (DecodeFormat::Q8, 1.0 / 10.0),
            ] {
                let (worst, agree, steps) = copy_against_f32(&model, format, prompt);
                assert!(
                    worst > 0.0 && worst < tol,
                    "{name} {format:?} {prompt:?}: {worst}"
                );
                // the top token may change at a near tie, rarely
                assert!(
                    agree + 2 >= steps,
                    "{name} {format:?} {prompt:?}: top-1 {agree}/{steps}"
                );
            }
        }
    }
}

#[test]
fn bf16_weights_give_the_greedy_tokens_of_f32_weights() {
    let greedy = SampleOptions {
        max_new_tokens: 20,
        temperature: 0.0,
        top_k: None,
        top_p: 1.0,
        seed: 0,
    };
    for (name, model) in gpt2_and_llama() {
        let weights = std::sync::Arc::new(DecodeWeights::new(&model, DecodeFormat::Bf16));
        let mut ws = Workspace::with_weights(&model, weights).unwrap();
        let go = |_| std::ops::ControlFlow::Continue(());
        let prompt = [3u32, 14, 15, 9, 2];
        let want = generate(&model, &prompt, &greedy, |_| {}).unwrap();
        let got = generate_while_in(&mut ws, &model, &prompt, &greedy, KvDtype::F32, go).unwrap();
        assert_eq!(got, want, "{name}");
    }
}

#[test]
fn with_compact_weights_batched_steps_give_each_sequence_its_solo_tokens() {
    let opts = |seed| SampleOptions {
        max_new_tokens: 12,
        temperature: 0.9,
        top_k: Some(10),
        top_p: 1.0,
        seed,
    };
    let prompts: [&[u32]; 3] = [&[3, 14, 15], &[7], &[22, 22, 5, 11, 36, 0, 4]];
    for (name, model) in gpt2_and_llama() {
        for format in [DecodeFormat::Bf16, DecodeFormat::Q8] {
            let weights = std::sync::Arc::new(DecodeWeights::new(&model, format));
            let mut ws = Workspace::with_weights(&model, weights.clone()).unwrap();
            let mut gens: Vec<Generation> = prompts
                .iter()
                .enumerate()
                .map(|(i, p)| Generation::new(&model, p, &opts(i as u64)).unwrap())
                .collect();
            while gens.iter().any(|g| !g.is_finished()) {
                decode_step(&model, &mut gens, &mut ws).unwrap();
            }
            for (i, (g, p)) in gens.iter().zip(prompts).enumerate() {
                let mut solo = Workspace::with_weights(&model, weights.clone()).unwrap();
                let go = |_| std::ops::ControlFlow::Continue(());
                let alone =
                    generate_while_in(&mut solo, &model, p, &opts(i as u64), KvDtype::F32, go);
                assert_eq!(
                    g.tokens(),
                    &alone.unwrap()[..],
                    "{name} {format:?} sequence {i}"
                );
            }
        }
    }
}

#[test]
fn decode_weights_formats_sizes_and_mismatch() {
    let model = GPT::new(tiny(13, true, true), 1).unwrap();
    let f32_bytes: usize = {
        let cfg = model.config();
        let (c, f, l) = (cfg.d_model, cfg.d_ff, cfg.n_layers);
        4 * (l * (c * 3 * c + c * c + 2 * c * f) + cfg.vocab_size * c)
    };
    let bf16 = DecodeWeights::new(&model, DecodeFormat::Bf16);
    let q8 = DecodeWeights::new(&model, DecodeFormat::Q8);
    // d_model 32: rows are whole blocks, so exactly half and 36/128 of f32's bytes
    assert_eq!(bf16.bytes() * 2, f32_bytes);
    assert_eq!(q8.bytes() * 128, f32_bytes * 36);
    assert_eq!(
        (bf16.format(), q8.format()),
        (DecodeFormat::Bf16, DecodeFormat::Q8)
    );
    let other = GPT::new(tiny(13, false, true), 1).unwrap();
    assert_eq!(
        Workspace::with_weights(&other, std::sync::Arc::new(q8)).err(),
        Some(SampleError::WeightsOfAnotherModel)
    );
    for (s, w) in [
        ("fp32", WeightFormat::F32),
        ("bf16", WeightFormat::Bf16),
        ("q8", WeightFormat::Q8),
    ] {
        assert_eq!(s.parse::<WeightFormat>(), Ok(w));
        assert_eq!(w.to_string(), s);
    }
    assert_eq!(WeightFormat::Q8.decode_format(), Some(DecodeFormat::Q8));
    assert!("q4"
        .parse::<WeightFormat>()
        .unwrap_err()
        .contains("fp32, bf16 or q8"));
}
