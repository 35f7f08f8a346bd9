use super::*;

fn tiny(bias: bool, tied: bool, dropout: f32) -> GPTConfig {
    GPTConfig {
        vocab_size: 11,
        max_position_embeddings: 8,
        n_layers: 2,
        n_heads: 2,
        d_model: 8,
        d_ff: 12,
        dropout,
        bias,
        tie_word_embeddings: tied,
        ..GPTConfig::default()
    }
}

/// A vocabulary of 300 on a small model (16 wide): large enough that the head's logits come in
/// blocks of the vocabulary.
pub(super) fn wide_vocab(n_layers: usize, tied: bool) -> GPTConfig {
    GPTConfig {
        vocab_size: 300,
        max_position_embeddings: 16,
        n_layers,
        n_heads: 2,
        d_model: 16,
        d_ff: 32,
        dropout: 0.0,
        bias: true,
        tie_word_embeddings: tied,
        ..GPTConfig::default()
    }
}

pub(super) fn model(cfg: GPTConfig, threads: usize, seed: u64) -> GPT {
    GPT::with_backend(cfg, seed, Box::new(Cpu::new(threads).unwrap())).unwrap()
}

/// B = 2, T = 7: row 0 has trailing padding, row 1 is left-padded; some labels are -100.
fn batch() -> (Vec<u32>, Vec<u8>, Vec<i32>) {
    let ids: Vec<u32> = (0..14).map(|i| (i * 7 % 11) as u32).collect();
    let mask = vec![1, 1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1, 1];
    let mut labels: Vec<i32> = ids.iter().map(|&x| x as i32).collect();
    labels[3] = -100;
    labels[12] = -100;
    (ids, mask, labels)
}

fn loss_at(m: &mut GPT, ids: &[u32], mask: &[u8], labels: &[i32]) -> f64 {
    m.forward(
        Forward::new(ids, 2, 7)
            .attention_mask(Some(mask))
            .labels(Labels::Aligned(labels)),
    )
    .unwrap()
    .unwrap() as f64
}

/// Central differences in f32 on parameters scaled up to N(0, 0.3) (so gradients are O(0.1)
/// and the loss differences stand well above f32 rounding): for every tensor, a sample of
/// single coordinates, and the derivative along the tensor's own gradient (which catches any
/// scale error tightly). Dropout masks are fixed per step, so the check holds with dropout.
fn grad_check(cfg: GPTConfig) {
    for keep_max_bytes in [KEEP_MAX_BYTES, 0] {
        grad_check_keeping(cfg.clone(), keep_max_bytes);
    }
}

fn grad_check_keeping(cfg: GPTConfig, keep_max_bytes: usize) {
    let (ids, mask, labels) = batch();
    let mut m = model(cfg.clone(), 2, 5);
    m.keep_max_bytes = keep_max_bytes;
    let mut rng = Normal::new(77);
    let mut big = vec![0.0; m.num_params()];
    rng.fill(&mut big, 0.3);
    m.params_mut().copy_from_slice(&big);
    m.set_dropout_key(3, 1, 9);
    loss_at(&mut m, &ids, &mask, &labels);
    m.zero_grad();
    m.backward(Backward::new()).unwrap();
    let g = m.grads().to_vec();
    assert!(g.iter().all(|x| x.is_finite()));
    let eps = 1e-2f32;
    let views = m.param_views().to_vec();
    for v in &views {
        let r = v.range.clone();
        let picks: Vec<usize> = (0..8).map(|k| r.start + (k * 7919) % r.len()).collect();
        for &i in &picks {
            let orig = m.params()[i];
            m.params_mut()[i] = orig + eps;
            let up = loss_at(&mut m, &ids, &mask, &labels);
            m.params_mut()[i] = orig - eps;
            let dn = loss_at(&mut m, &ids, &mask, &labels);
            m.params_mut()[i] = orig;
            let fd = (up - dn) / (2.0 * eps as f64);
            let err = (fd - g[i] as f64).abs();
            assert!(
                err <= 1e-2 * fd.abs().max(g[i].abs() as f64) + 5e-5,
                "{} [{}]: backward {}, finite difference {fd}",
                v.name,
                i - r.start,
                g[i]
            );
        }
        let norm = g[r.clone()]
            .iter()
            .map(|&x| (x as f64).powi(2))
            .sum::<f64>()
            .sqrt();
        if norm < 1e-6 {
            continue;
        }
        // Along the gradient itself, then along a random direction (which an error
        // orthogonal to the gradient cannot hide from).
        let mut random = vec![0.0f32; r.len()];
        rng.fill(&mut random, 1.0);
        let rnorm = random
            .iter()
            .map(|&x| (x as f64).powi(2))
            .sum::<f64>()
            .sqrt();
        let along_g: Vec<f64> = g[r.clone()].iter().map(|&x| x as f64 / norm).collect();
        let along_r: Vec<f64> = random.iter().map(|&x| x as f64 / rnorm).collect();
        let base = m.params()[r.clone()].to_vec();
        for (what, dir) in [("gradient", along_g), ("random", along_r)] {
            let want: f64 = dir
                .iter()
                .zip(&g[r.clone()])
                .map(|(d, &g)| d * g as f64)
                .sum();
            let mut at = |s: f64| {
                for (k, i) in r.clone().enumerate() {
                    m.params_mut()[i] = base[k] + (s * dir[k]) as f32;
                }
                loss_at(&mut m, &ids, &mask, &labels)
            };
            let fd = (at(eps as f64) - at(-eps as f64)) / (2.0 * eps as f64);
            m.params_mut()[r.clone()].copy_from_slice(&base);
            assert!((fd - want).abs() <= 3e-3 * norm + 2e-5, "{} along the {what} direction: backward {want}, finite difference {fd} (|grad| {norm})", v.name);
        }
    }
}

#[test]
fn parallel_init_draws_what_one_sequential_pass_draws() {
    // wte (1001 x 130) spans three chunks, the last odd-sized.
    let cfg = GPTConfig {
        vocab_size: 1001,
        max_position_embeddings: 9,
        d_model: 130,
        d_ff: 70,
        ..tiny(true, false, 0.0)
    };
    let m = model(cfg.clone(), 1, 42);
    let mut want = vec![f32::NAN; m.num_params()];
    let mut rng = Normal::new(42);
    let resid_std = 0.02 / (2.0 * cfg.n_layers as f64).sqrt();
    for v in m.param_views() {
        let p = &mut want[v.range.clone()];
        if v.name.ends_with(".bias") {
            p.fill(0.0);
        } else if v.name.contains("ln_") {
            p.fill(1.0);
        } else if v.name.ends_with("c_proj.weight") {
            rng.fill(p, resid_std);
        } else {
            rng.fill(p, 0.02);
        }
    }
    assert!(m.params() == want.as_slice());
}

#[test]
fn gradients_match_finite_differences_tied_with_bias() {
    grad_check(tiny(true, true, 0.0));
}

#[test]
fn gradients_match_finite_differences_untied_without_bias() {
    grad_check(tiny(false, false, 0.0));
}

#[test]
fn gradients_match_finite_differences_with_dropout() {
    grad_check(tiny(true, false, 0.2));
}

#[test]
fn initial_loss_is_ln_vocab() {
    let cfg = GPTConfig::config_a();
    let mut m = model(cfg.clone(), 2, 1234);
    let (b, t) = (4, 64);
    let ids: Vec<u32> = (0..b * t)
        .map(|i| ((i * 2_654_435_761usize) >> 7) as u32 % 65)
        .collect();
    let labels: Vec<i32> = ids.iter().map(|&x| x as i32).collect();
    let loss = m
        .forward(Forward::new(&ids, b, t).labels(Labels::Aligned(&labels)))
        .unwrap()
        .unwrap();
    assert!((loss - 65f32.ln()).abs() < 0.1, "initial loss {loss}");
    // The residual projections are drawn with the smaller std.
    let proj = m
        .param_views()
        .iter()
        .find(|v| v.name == "h.0.mlp.c_proj.weight")
        .unwrap();
    let p = &m.params()[proj.range.clone()];
    let std = (p.iter().map(|x| x * x).sum::<f32>() / p.len() as f32).sqrt();
    assert!((std - 0.02 / 8f32.sqrt()).abs() < 5e-4, "c_proj std {std}");
}

/// Losses and parameters after a few steps of plain SGD, dropout on.
fn run(threads: usize) -> (Vec<f32>, Vec<f32>) {
    let cfg = GPTConfig {
        dropout: 0.1,
        ..GPTConfig::config_a()
    };
    let mut m = model(cfg, threads, 42);
    let (b, t) = (3, 64);
    let mut losses = vec![];
    for step in 0..3u64 {
        let ids: Vec<u32> = (0..b * t)
            .map(|i| ((i as u64 * 31 + step * 17) % 65) as u32)
            .collect();
        let labels: Vec<i32> = ids.iter().map(|&x| x as i32).collect();
        let mut mask = vec![1u8; b * t];
        mask[t..t + 5].fill(0);
        m.set_dropout_key(42, 0, step);
        losses.push(
            m.forward(
                Forward::new(&ids, b, t)
                    .attention_mask(Some(&mask))
                    .labels(Labels::Aligned(&labels)),
            )
            .unwrap()
            .unwrap(),
        );
        m.zero_grad();
        m.backward(Backward::new()).unwrap();
        let (p, g) = m.params_and_grads_mut();
        p.iter_mut().zip(g).for_each(|(p, g)| *p -= 0.1 * g);
    }
    (losses, m.params().to_vec())
}

#[test]
fn training_is_bitwise_reproducible_and_independent_of_thread_count() {
    let one = run(1);
    assert_eq!(one, run(1), "two runs with 1 thread differ");
    assert_eq!(one, run(2), "1 and 2 threads differ");
    assert!(one.0[2] < one.0[0], "loss did not go down: {:?}", one.0);
}

#[test]
fn backward_hands_out_final_ranges_in_order_to_another_thread() {
    for (tied, split) in [(true, false), (false, false), (true, true), (false, true)] {
        let mut m = model(tiny(true, tied, 0.0), 2, 9);
        let (ids, mask, labels) = batch();
        loss_at(&mut m, &ids, &mask, &labels);
        m.zero_grad();
        let expected = match split {
            true => m.split_ready_ranges(),
            false => m.ready_ranges(),
        };
        let (got, sums) = std::thread::scope(|s| {
            let (tx, rx) = std::sync::mpsc::channel::<(Range<usize>, &mut [f32])>();
            let summer = s.spawn(move || {
                let mut got = vec![];
                let mut sums = vec![];
                for (r, g) in rx {
                    assert_eq!(r.len(), g.len());
                    sums.push(g.iter().map(|&x| x as f64).sum::<f64>());
                    // The slice is ours now: scaling it must show up in the final buffer.
                    g.iter_mut().for_each(|x| *x *= 2.0);
                    got.push(r);
                }
                (got, sums)
            });
            let pass =
                Backward::new().on_ready(move |r, g| tx.send((r, ViewMut::host(g))).unwrap());
            let pass = if split { pass.split_blocks() } else { pass };
            m.backward(pass).unwrap();
            summer.join().unwrap()
        });
        assert_eq!(got, expected);
        assert_eq!(got.first().unwrap().end, m.num_params());
        assert_eq!(got.last().unwrap().start, 0);
        for (r, s) in got.iter().zip(&sums) {
            let now: f64 = m.grads()[r.clone()].iter().map(|&x| x as f64).sum();
            assert!((now - 2.0 * s).abs() <= 1e-9 * (1.0 + s.abs()), "{r:?}");
        }
    }
}

#[test]
fn arena_is_reused_for_same_or_smaller_batches_and_grows_once() {
    let mut m = model(tiny(true, true, 0.0), 1, 1);
    let ids = vec![1u32; 16];
    m.forward(Forward::new(&ids, 2, 8)).unwrap();
    let ptr = m.arena.view().addr();
    m.forward(Forward::new(&ids[..8], 1, 8)).unwrap();
    m.forward(Forward::new(&ids, 2, 8)).unwrap();
    assert_eq!(ptr, m.arena.view().addr());
    assert_eq!(m.logits().len(), 16 * 11);
    let ids = vec![1u32; 24];
    m.forward(Forward::new(&ids, 3, 8)).unwrap();
    assert_eq!(m.logits().len(), 24 * 11);
}

#[test]
fn bad_inputs_are_clear_errors() {
    let mut m = model(tiny(true, true, 0.0), 1, 1);
    let err = |r: Result<Option<f32>, GptError>| r.unwrap_err().to_string();
    assert!(err(m.forward(Forward::new(&[1, 2, 3], 2, 2))).contains("input_ids has 3 elements"));
    assert!(
        err(m.forward(Forward::new(&[1; 9], 1, 9))).contains("exceeds max_position_embeddings 8")
    );
    assert!(err(m.forward(Forward::new(&[1, 11], 1, 2))).contains("input_ids[1] = 11"));
    assert!(
        err(m.forward(Forward::new(&[1, 2], 1, 2).labels(Labels::Aligned(&[1, -5]))))
            .contains("labels[1] = -5")
    );
    assert!(
        err(m.forward(Forward::new(&[1, 2], 1, 2).attention_mask(Some(&[1]))))
            .contains("attention_mask")
    );
    m.forward(Forward::new(&[1, 2], 1, 2)).unwrap();
    assert!(matches!(m.backward(Backward::new()), Err(GptError::NoLoss)));
    // All labels ignored: loss 0 and zero gradients, not NaN.
    let loss = m
        .forward(Forward::new(&[1, 2], 1, 2).labels(Labels::Aligned(&[-100, -100])))
        .unwrap()
        .unwrap();
    assert_eq!(loss, 0.0);
    m.zero_grad();
    m.backward(Backward::new()).unwrap();
    assert!(m.grads().iter().all(|&g| g == 0.0));
}

/// A model whose parameters are all zero except when a part hook has just filled them in
/// computes what the full model computes: the hooks see every part, in order, with every range
/// it reads, before it runs, in forward and in backward. This is what a sharded strategy
/// (parameters gathered per part, freed after use) relies on.
#[test]
fn part_hooks_fill_each_part_just_before_it_runs() {
    for tied in [true, false] {
        let cfg = tiny(true, tied, 0.0);
        let (ids, mask, labels) = batch();
        let mut full = model(cfg.clone(), 2, 5);
        let want_loss = loss_at(&mut full, &ids, &mask, &labels);
        full.backward(Backward::new()).unwrap();
        let source = full.params().to_vec();

        let mut sharded = model(cfg.clone(), 2, 5);
        let parts = sharded.parts();
        let ranges: Vec<_> = parts.iter().map(|&p| sharded.part_range(p)).collect();
        assert_eq!(ranges.first().map(|r| r.start), Some(0));
        assert_eq!(ranges.last().map(|r| r.end), Some(sharded.num_params()));
        assert!(
            ranges.windows(2).all(|w| w[0].end == w[1].start),
            "{ranges:?}"
        );
        let wte = 0..cfg.vocab_size * cfg.d_model;
        // What each part reads, in the order the hook sees it.
        let reads = |part: Part| {
            let own = sharded.part_range(part);
            match part {
                Part::Head if tied => vec![(part, wte.clone()), (part, own)],
                _ => vec![(part, own)],
            }
        };
        let forward_reads: Vec<_> = parts.iter().flat_map(|&p| reads(p)).collect();
        // The embeddings' backward reads no parameter, so it is not announced.
        let backward_reads: Vec<_> = (parts.iter().rev())
            .filter(|&&p| p != Part::Embeddings)
            .flat_map(|&p| reads(p))
            .collect();

        // Every parameter starts blank and the hook fills in only what it is handed: a part
        // that read a range before it was handed would compute with zeros.
        let mut run = |backward: bool| {
            let mut seen = Vec::new();
            let mut fill = |part: Part, range: Range<usize>, p: &mut [f32]| {
                seen.push((part, range.clone()));
                p.copy_from_slice(&source[range]);
            };
            sharded.params_mut().fill(0.0);
            let loss = if backward {
                sharded.zero_grad();
                sharded.backward(Backward::new().parts(&mut fill)).unwrap();
                None
            } else {
                let pass = Forward::new(&ids, 2, 7)
                    .attention_mask(Some(&mask))
                    .labels(Labels::Aligned(&labels))
                    .parts(&mut fill);
                sharded.forward(pass).unwrap()
            };
            (seen, loss)
        };
        let (seen, loss) = run(false);
        assert_eq!(seen, forward_reads);
        assert_eq!(loss.unwrap().to_bits(), (want_loss as f32).to_bits());
        let (seen, _) = run(true);
        assert_eq!(seen, backward_reads);
        assert_eq!(sharded.grads(), full.grads());
    }
}

/// A [`PartHooks`] that fills each range from `source` before its part runs and blanks it
/// after, as a sharded strategy gathers and frees: the model reads a range only between the
/// two, so the loss and gradients are the whole model's.
struct FillAndBlank<'a> {
    source: &'a [f32],
    calls: Vec<(bool, Part, Range<usize>)>,
}

impl PartHooks for FillAndBlank<'_> {
    fn before(&mut self, part: Part, range: Range<usize>, p: &mut [f32]) {
        self.calls.push((true, part, range.clone()));
        p.copy_from_slice(&self.source[range]);
    }
    fn after(&mut self, part: Part, range: Range<usize>, p: &mut [f32]) {
        self.calls.push((false, part, range));
        p.fill(0.0);
    }
}

#[test]
fn part_hooks_after_each_part_can_free_what_before_gathered() {
    for (tied, checkpoint) in [(true, false), (false, false), (true, true)] {
        let cfg = tiny(true, tied, 0.0);
        let (ids, mask, labels) = batch();
        let mut full = model(cfg.clone(), 2, 5);
        full.set_activation_checkpointing(checkpoint);
        let want_loss = loss_at(&mut full, &ids, &mask, &labels);
        full.backward(Backward::new()).unwrap();
        let source = full.params().to_vec();

        let mut sharded = model(cfg.clone(), 2, 5);
        sharded.set_activation_checkpointing(checkpoint);
        sharded.params_mut().fill(0.0);
        let mut hooks = FillAndBlank {
            source: &source,
            calls: Vec::new(),
        };
        let pass = Forward::new(&ids, 2, 7)
            .attention_mask(Some(&mask))
            .labels(Labels::Aligned(&labels))
            .parts(&mut hooks);
        let loss = sharded.forward(pass).unwrap().unwrap();
        assert_eq!(loss.to_bits(), (want_loss as f32).to_bits());
        sharded.zero_grad();
        sharded.backward(Backward::new().parts(&mut hooks)).unwrap();
        assert_eq!(sharded.grads(), full.grads());
        assert!(sharded.params().iter().all(|&x| x == 0.0), "all blanked");
        // Every before has its after, for the same part and range, before the next part's.
        for pair in hooks.calls.chunks(2) {
            let (b, a) = (&pair[0], &pair[1]);
            if b.1 == Part::Head && tied {
                continue; // wte then the head's own range, then both afters
            }
            assert!(b.0 && !a.0 && b.1 == a.1 && b.2 == a.2, "{pair:?}");
        }
        assert_eq!(
            hooks.calls.iter().filter(|c| c.0).count() * 2,
            hooks.calls.len()
        );
    }
}

/// Records each gradient range announced before it is written, and whether it still read zero.
#[derive(Default)]
struct GradsSeen {
    calls: Vec<(Part, Range<usize>, bool)>,
}

impl PartHooks for GradsSeen {
    fn before(&mut self, _: Part, _: Range<usize>, _: &mut [f32]) {}
    fn before_grads(&mut self, part: Part, range: Range<usize>, grads: &mut [f32]) {
        assert_eq!(grads.len(), range.len());
        self.calls
            .push((part, range, grads.iter().all(|&g| g == 0.0)));
    }
}

#[test]
fn each_gradient_range_is_announced_once_before_the_backward_writes_it() {
    for tied in [true, false] {
        let cfg = tiny(true, tied, 0.0);
        let (ids, mask, labels) = batch();
        let mut m = model(cfg.clone(), 2, 5);
        loss_at(&mut m, &ids, &mask, &labels);
        m.zero_grad();
        let mut seen = GradsSeen::default();
        m.backward(Backward::new().parts(&mut seen)).unwrap();
        let mut want = model(cfg.clone(), 2, 5);
        loss_at(&mut want, &ids, &mask, &labels);
        want.backward(Backward::new()).unwrap();
        assert_eq!(m.grads(), want.grads(), "the hook changes nothing");
        assert!(
            seen.calls.iter().all(|c| c.2),
            "untouched when announced: {:?}",
            seen.calls
        );
        // Head first, the blocks from the last, the embeddings last.
        let parts: Vec<Part> = seen.calls.iter().map(|c| c.0).collect();
        let mut order = vec![Part::Head; if tied { 2 } else { 1 }];
        order.extend((0..cfg.n_layers).rev().map(Part::Block));
        order.extend(vec![Part::Embeddings; if tied { 1 } else { 2 }]);
        assert_eq!(parts, order, "tied {tied}");
        // Every element of the gradient buffer exactly once.
        let mut ranges: Vec<_> = seen.calls.iter().map(|c| c.1.clone()).collect();
        ranges.sort_by_key(|r| r.start);
        let mut at = 0;
        for r in ranges {
            assert_eq!(r.start, at, "tied {tied}: ranges tile the buffer");
            at = r.end;
        }
        assert_eq!(at, m.num_params());
    }
}

/// With bf16 products the loss and every gradient stay within bf16's rounding of fp32's (8
/// significant bits per operand, f32 sums): the loss within 1%, the gradient within 5% in
/// norm and pointing the same way, and not bitwise equal (the bf16 path really ran).
#[test]
fn bf16_products_track_fp32_within_bf16_rounding() {
    if !cohort_engine::cpu::bf16_supported() {
        eprintln!("skipped: this CPU has neither AMX nor AVX512_BF16");
        return;
    }
    let cfg = GPTConfig {
        vocab_size: 50,
        max_position_embeddings: 16,
        n_layers: 2,
        n_heads: 2,
        d_model: 32,
        d_ff: 64,
        dropout: 0.0,
        bias: true,
        tie_word_embeddings: true,
        ..GPTConfig::default()
    };
    let ids: Vec<u32> = (0..32).map(|i| (i * 13 % 50) as u32).collect();
    let labels: Vec<i32> = ids.iter().map(|&x| x as i32).collect();
    let run = |dtype: DType| {
        let mut m = model(cfg.clone(), 2, 9);
        assert_eq!(m.set_precision(dtype).unwrap(), dtype);
        let loss = m
            .forward(Forward::new(&ids, 2, 16).labels(Labels::Aligned(&labels)))
            .unwrap()
            .unwrap();
        m.zero_grad();
        m.backward(Backward::new()).unwrap();
        (loss as f64, m.grads().to_vec())
    };
    let (l32, g32) = run(DType::F32);
    let (l16, g16) = run(DType::Bf16);
    assert!(
        (l32 - l16).abs() < 0.01 * l32,
        "loss fp32 {l32}, bf16 {l16}"
    );
    let dot: f64 = g32
        .iter()
        .zip(&g16)
        .map(|(a, b)| *a as f64 * *b as f64)
        .sum();
    let n32 = g32.iter().map(|a| (*a as f64).powi(2)).sum::<f64>().sqrt();
    let n16 = g16.iter().map(|a| (*a as f64).powi(2)).sum::<f64>().sqrt();
    assert!(
        (n32 - n16).abs() < 0.05 * n32,
        "grad norm fp32 {n32}, bf16 {n16}"
    );
    assert!(dot / (n32 * n16) > 0.999, "cosine {}", dot / (n32 * n16));
    assert_ne!(g32, g16, "bf16 gradients equal fp32's: bf16 not in use?");
}

/// Under bf16 products the MLP's GELU (SwiGLU) outputs are kept in bf16 instead of recomputed,
/// and the LayerNorms (RMSNorms) write bf16: the loss and every gradient are the same bits as
/// with all of them kept in f32 (the products round them to bf16 either way), with and without
/// activation checkpointing, with dropout, d_model with a tail past 16 lanes, as a Llama.
#[test]
fn bf16_kept_activations_give_the_bits_of_f32_kept_ones() {
    if !cohort_engine::cpu::bf16_supported() {
        eprintln!("skipped: this CPU has neither AMX nor AVX512_BF16");
        return;
    }
    let gpt2 = |d_model: usize, bias: bool| GPTConfig {
        vocab_size: 50,
        max_position_embeddings: 16,
        n_layers: 2,
        n_heads: 2,
        d_model,
        d_ff: 72, // rows of an odd number of pairs' halves: 16 x 72 / 2 per layer
        dropout: 0.1,
        bias,
        tie_word_embeddings: true,
        ..GPTConfig::default()
    };
    let llama = GPTConfig {
        n_heads: 4,
        n_kv_heads: Some(2),
        d_ff: 32,
        ..GPTConfig::llama_like(gpt2(40, false))
    };
    let ids: Vec<u32> = (0..30).map(|i| (i * 13 % 50) as u32).collect();
    let labels: Vec<i32> = ids.iter().map(|&x| x as i32).collect();
    for cfg in [gpt2(32, true), gpt2(40, false), llama] {
        let run = |keep_max_bytes: usize, checkpointing: bool| {
            let mut m = model(cfg.clone(), 2, 9);
            assert_eq!(m.set_precision(DType::Bf16).unwrap(), DType::Bf16);
            m.keep_max_bytes = keep_max_bytes;
            m.set_activation_checkpointing(checkpointing);
            m.set_dropout_key(3, 1, 9);
            let loss = m
                .forward(Forward::new(&ids, 2, 15).labels(Labels::Aligned(&labels)))
                .unwrap()
                .unwrap();
            m.zero_grad();
            m.backward(Backward::new()).unwrap();
            let al = m.act_layout.as_ref().unwrap();
            // bf16 GELU outputs and LayerNorm outputs (one slot of bf16 pairs) in use
            let kept16 = !al.keep && al.bf16 && al.ln16;
            let ln_floats = al.ranges[ACT_S_LN].len();
            assert!(!kept16 || ln_floats == (30 * cfg.d_model).div_ceil(2));
            let grads = m.grads().iter().map(|g| g.to_bits()).collect::<Vec<_>>();
            (loss.to_bits(), grads, kept16)
        };
        let (loss, grads, kept16) = run(usize::MAX, false);
        assert!(!kept16, "a large budget keeps the outputs in f32");
        for checkpointing in [false, true] {
            let (l, g, kept16) = run(0, checkpointing);
            let what = format!(
                "C {}, {:?}, checkpointing {checkpointing}",
                cfg.d_model, cfg.norm
            );
            assert!(kept16, "bf16 outputs in use, {what}");
            assert_eq!(l, loss, "loss, {what}");
            assert_eq!(g, grads, "gradients, {what}");
        }
    }
}

/// The head in blocks of the vocabulary (logits too large to keep whole) gives the same loss
/// and gradients up to summation order (the log-sum-exp folded block by block, d(ln_f out)
/// summed over blocks); it holds only one block of logits, and no logits are readable
/// afterwards.
#[test]
fn a_head_in_vocabulary_blocks_matches_the_whole_one() {
    for tied in [true, false] {
        let cfg = wide_vocab(1, tied);
        let ids: Vec<u32> = (0..48).map(|i| (i * 37 % 300) as u32).collect();
        let mut labels: Vec<i32> = ids.iter().map(|&x| x as i32).collect();
        labels[7] = -100;
        let run = |max_bytes: usize| {
            let mut m = model(cfg.clone(), 2, 4);
            m.logits_max_bytes = max_bytes;
            let loss = m
                .forward(Forward::new(&ids, 3, 16).labels(Labels::Aligned(&labels)))
                .unwrap()
                .unwrap();
            let cols = m.act_layout.as_ref().unwrap().logit_cols;
            let logits = m.logits().len();
            m.zero_grad();
            m.backward(Backward::new()).unwrap();
            (loss, m.grads().to_vec(), cols, logits)
        };
        let (l_whole, g_whole, cols_whole, logits_whole) = run(LOGITS_MAX_BYTES);
        // 48 x 300 logits are 57600 bytes: a limit below that splits them, here into blocks
        // of 104 columns (the last one narrower).
        let (l_block, g_block, cols_block, logits_block) = run(40_000);
        assert_eq!((cols_whole, logits_whole), (300, 48 * 300));
        assert_eq!(cols_block, 104);
        assert_eq!(logits_block, 0);
        assert!(
            (l_whole - l_block).abs() < 1e-5,
            "tied {tied}: {l_whole} vs {l_block}"
        );
        let worst = g_whole
            .iter()
            .zip(&g_block)
            .map(|(a, b)| (a - b).abs() / (1e-3 + a.abs()))
            .fold(0f32, f32::max);
        assert!(worst < 1e-4, "tied {tied}: gradients differ by {worst}");
    }
}

/// Activation checkpointing recomputes each block from its input with the same dropout masks,
/// so loss and gradients are the same bits as the path that keeps every block's activations
/// but recomputes the LayerNorm, attention and GELU outputs (what a model too large to keep
/// those does), in a smaller arena.
#[test]
fn activation_checkpointing_gives_the_same_bits_in_less_memory() {
    let (ids, mask, labels) = batch();
    for dropout in [0.0, 0.1] {
        let run = |on: bool| {
            let mut m = model(tiny(true, true, dropout), 2, 6);
            m.keep_max_bytes = 0;
            m.set_activation_checkpointing(on);
            m.set_dropout_key(3, 1, 9);
            let loss = loss_at(&mut m, &ids, &mask, &labels);
            m.zero_grad();
            m.backward(Backward::new()).unwrap();
            (loss, m.grads().to_vec(), m.arena.len())
        };
        let (l_all, g_all, arena_all) = run(false);
        let (l_ckpt, g_ckpt, arena_ckpt) = run(true);
        assert_eq!(l_all, l_ckpt, "dropout {dropout}");
        let differ = g_all.iter().zip(&g_ckpt).filter(|(a, b)| a != b).count();
        assert_eq!(differ, 0, "dropout {dropout}: {differ} gradients differ");
        assert!(arena_ckpt < arena_all, "{arena_ckpt} vs {arena_all}");
    }
    let cfg = GPTConfig::config_b();
    let est = |on| GPT::memory_estimate(&cfg, 8 * 256, 1, on, DType::F32).activations;
    assert!(
        est(true) * 2 < est(false),
        "{} vs {}",
        est(true),
        est(false)
    );
}

#[test]
fn next_token_targets_score_every_position_as_aligned_labels_one_longer_do() {
    // Windows of T + 1 = 8 tokens: inputs are the first 7, targets the last 7.
    let windows: Vec<u32> = (0..16).map(|i| (i * 5 % 11) as u32).collect();
    let (mut inputs, mut targets) = (Vec::new(), Vec::new());
    for row in windows.chunks(8) {
        inputs.extend_from_slice(&row[..7]);
        targets.extend(row[1..].iter().map(|&x| x as i32));
    }
    let mut m = model(tiny(true, true, 0.0), 1, 4);
    let next = m
        .forward(Forward::new(&inputs, 2, 7).labels(Labels::Next(&targets)))
        .unwrap()
        .unwrap();
    let next_grads = {
        m.zero_grad();
        m.backward(Backward::new()).unwrap();
        m.grads().to_vec()
    };
    // Aligned labels on the whole 8-token windows score the same 7 positions per row
    // (position 7 has no label); causal attention makes positions 0..7 see the same inputs.
    let labels: Vec<i32> = windows.iter().map(|&x| x as i32).collect();
    let aligned = m
        .forward(Forward::new(&windows, 2, 8).labels(Labels::Aligned(&labels)))
        .unwrap()
        .unwrap();
    m.zero_grad();
    m.backward(Backward::new()).unwrap();
    assert!((next - aligned).abs() < 1e-6, "{next} vs {aligned}");
    let max_diff = next_grads
        .iter()
        .zip(m.grads())
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    assert!(max_diff < 1e-6, "gradients differ by {max_diff}");
    // -100 drops a position, and padding drops it too.
    targets[6] = -100;
    let mut mask = vec![1u8; 14];
    mask[13] = 0;
    let fewer = m
        .forward(
            Forward::new(&inputs, 2, 7)
                .attention_mask(Some(&mask))
                .labels(Labels::Next(&targets)),
        )
        .unwrap()
        .unwrap();
    assert_ne!(fewer, next);
}

/// `tiny`'s shape as a Llama (RMSNorm, RoPE, SwiGLU) with `heads` query heads over `kv` key/value
/// heads.
fn tiny_llama(heads: usize, kv: usize, qkv_bias: bool, tied: bool) -> GPTConfig {
    GPTConfig {
        n_heads: heads,
        n_kv_heads: Some(kv),
        qkv_bias: Some(qkv_bias),
        tie_word_embeddings: tied,
        ..GPTConfig::llama_like(tiny(false, tied, 0.0))
    }
}

#[test]
fn llama_gradients_match_finite_differences_with_grouped_and_shared_heads() {
    // grouped (4 heads over 2), multi-query (2 over 1) and multi-head (2 over 2)
    grad_check(tiny_llama(4, 2, false, true));
    grad_check(tiny_llama(2, 1, true, false));
    grad_check(tiny_llama(2, 2, true, true));
    // F a multiple of 16: SwiGLU runs as its product's epilogue (on AVX-512)
    grad_check(GPTConfig {
        d_ff: 32,
        ..tiny_llama(4, 2, false, true)
    });
}

#[test]
fn llama_activation_checkpointing_and_thread_count_keep_the_bits() {
    let (ids, mask, labels) = batch();
    // SwiGLU after its product (F 12) and fused into it (F 32), fp32 and bf16 (the SwiGLU
    // output kept in bf16)
    for (d_ff, dtype) in [(12, DType::F32), (32, DType::F32), (32, DType::Bf16)] {
        let run = |threads: usize, ckpt: bool| {
            let cfg = GPTConfig {
                d_ff,
                ..tiny_llama(4, 2, true, false)
            };
            let mut m = model(cfg, threads, 6);
            m.set_precision(dtype).ok()?;
            m.keep_max_bytes = 0;
            m.set_activation_checkpointing(ckpt);
            let loss = loss_at(&mut m, &ids, &mask, &labels);
            m.zero_grad();
            m.backward(Backward::new()).unwrap();
            Some((loss, m.grads().to_vec()))
        };
        let Some(base) = run(1, false) else {
            eprintln!("skipped {dtype}: not on this CPU");
            continue;
        };
        let what = format!("F {d_ff}, {dtype}");
        assert!(
            run(2, false) == Some(base.clone()),
            "thread count changed the bits, {what}"
        );
        assert!(
            run(2, true) == Some(base),
            "activation checkpointing changed the bits, {what}"
        );
    }
}

#[test]
fn llama_bf16_products_track_fp32() {
    let (ids, mask, labels) = batch();
    for d_ff in [12, 32] {
        let cfg = GPTConfig {
            d_ff,
            ..tiny_llama(4, 2, true, true)
        };
        let (mut losses, mut grads) = (Vec::new(), Vec::new());
        for dtype in [DType::F32, DType::Bf16] {
            let mut m = model(cfg.clone(), 2, 8);
            m.set_precision(dtype).unwrap();
            losses.push(loss_at(&mut m, &ids, &mask, &labels));
            m.zero_grad();
            m.backward(Backward::new()).unwrap();
            assert!(m.grads().iter().all(|g| g.is_finite()));
            grads.push(m.grads().to_vec());
        }
        assert!((losses[0] - losses[1]).abs() < 1e-2, "F {d_ff}: {losses:?}");
        // the gradients within bf16's rounding of fp32's, relative to their scale
        let scale = grads[0].iter().fold(0f32, |m, g| m.max(g.abs()));
        for (a, b) in grads[0].iter().zip(&grads[1]) {
            assert!(
                (a - b).abs() <= 0.05 * scale,
                "F {d_ff}: {a} vs {b} (scale {scale})"
            );
        }
    }
}

#[test]
fn parameters_and_gradients_copy_to_and_from_the_host() {
    let mut m = model(tiny(true, true, 0.0), 1, 1);
    let n = m.num_params();
    let mut out = vec![0f32; n];
    m.copy_params_to_host(&mut out).unwrap();
    assert_eq!(out, m.params());
    let new: Vec<f32> = (0..n).map(|i| i as f32).collect();
    m.copy_params_from_host(&new).unwrap();
    assert_eq!(m.params(), &new[..]);
    m.copy_grads_from_host(&new).unwrap();
    m.copy_grads_to_host(&mut out).unwrap();
    assert_eq!(out, new);
    m.zero_grad();
    assert!(m.grads().iter().all(|&g| g == 0.0));
    let err = m
        .copy_params_to_host(&mut out[1..])
        .unwrap_err()
        .to_string();
    assert!(
        err.contains(&format!("has {} floats, the model's {n}", n - 1)),
        "{err}"
    );
}

/// An optimizer step and the clearing of the gradients run on the model's threads (their
/// passes over memory split over them), and give the same bits on one thread or two.
#[test]
fn the_update_and_zero_grad_run_on_the_models_threads() {
    use cohort_engine::optim::{AdamW, AdamWConfig, DecayMask, Optimizer};
    let mut after = Vec::new();
    for threads in [1, 2] {
        let mut m = model(tiny(true, true, 0.0), threads, 3);
        let (ids, mask, labels) = batch();
        m.zero_grad();
        loss_at(&mut m, &ids, &mask, &labels);
        m.backward(Backward::new()).unwrap();
        let n = m.num_params();
        let mut opt = AdamW::new(AdamWConfig::default(), DecayMask::all(n)).unwrap();
        let seen = m.update_params(|p, g| {
            opt.step(p, g, 1e-2).unwrap();
            rayon::current_num_threads()
        });
        assert_eq!(seen, threads, "the step ran outside the model's pool");
        after.push(m.params_mut().to_vec());
        m.zero_grad();
        let (_, grads) = m.params_and_grads_mut();
        assert!(grads.iter().all(|&g| g.to_bits() == 0), "{threads} threads");
    }
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&after[0]), bits(&after[1]));
}
