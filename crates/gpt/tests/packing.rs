//! Packed rows: several sequences in one row with segment ids train exactly as the same
//! sequences in rows of their own (loss and every gradient, within fp32 rounding), for learned
//! and rotary positions, in both label conventions, with padding after the packed sequences.

use cohort_gpt::{Backward, Forward, GPTConfig, Labels, GPT};

fn gpt2() -> GPTConfig {
    GPTConfig {
        vocab_size: 13,
        max_position_embeddings: 24,
        n_layers: 2,
        n_heads: 2,
        d_model: 8,
        d_ff: 12,
        dropout: 0.0,
        ..GPTConfig::default()
    }
}

fn llama() -> GPTConfig {
    GPTConfig {
        n_heads: 4,
        n_kv_heads: Some(2),
        d_model: 16,
        ..GPTConfig::llama_like(gpt2())
    }
}

/// The loss and the gradients of one forward and backward.
fn run(model: &mut GPT, pass: Forward<'_>) -> (f32, Vec<f32>) {
    model.zero_grad();
    let loss = model.forward(pass).unwrap().unwrap();
    model.backward(Backward::new()).unwrap();
    (loss, model.grads().to_vec())
}

#[test]
fn packed_sequences_train_as_separate_rows() {
    // Three sequences of 7, 5 and 3 tokens; the packed row ends with 2 padding positions.
    let seqs: [Vec<u32>; 3] = [
        (0..7).map(|i| (i * 5 + 1) % 13).collect(),
        (0..5).map(|i| (i * 3 + 2) % 13).collect(),
        (0..3).map(|i| (i * 7 + 4) % 13).collect(),
    ];
    let t = 17;
    let (mut ids, mut segs, mut mask) = (Vec::new(), Vec::new(), Vec::new());
    for (s, seq) in seqs.iter().enumerate() {
        ids.extend(seq);
        segs.extend(std::iter::repeat_n(s as u32, seq.len()));
        mask.extend(std::iter::repeat_n(1u8, seq.len()));
    }
    ids.resize(t, 0);
    segs.resize(t, 3);
    mask.resize(t, 0);
    // The same sequences one per row, right-padded to T.
    let (mut rows, mut row_mask) = (vec![0u32; 3 * t], vec![0u8; 3 * t]);
    for (r, seq) in seqs.iter().enumerate() {
        rows[r * t..r * t + seq.len()].copy_from_slice(seq);
        row_mask[r * t..r * t + seq.len()].fill(1);
    }
    // Next-token targets as the chat loader writes them: per sequence, its next token or -100
    // (the last position, and an untrained "user" token at the second position).
    let next = |seq: &[u32]| -> Vec<i32> {
        let mut y: Vec<i32> = seq[1..].iter().map(|&x| x as i32).collect();
        y.push(-100);
        y[1] = -100;
        y
    };
    let mut packed_next: Vec<i32> = seqs.iter().flat_map(|s| next(s)).collect();
    packed_next.resize(t, -100);
    let mut rows_next = vec![-100; 3 * t];
    for (r, seq) in seqs.iter().enumerate() {
        rows_next[r * t..r * t + seq.len()].copy_from_slice(&next(seq));
    }
    // Aligned labels: the ids themselves; the packed row must not predict a sequence's first
    // token from the one before it.
    let packed_aligned: Vec<i32> = ids.iter().map(|&x| x as i32).collect();
    let rows_aligned: Vec<i32> = rows.iter().map(|&x| x as i32).collect();

    for cfg in [gpt2(), llama()] {
        let rope = cfg.positions != cohort_gpt::Positions::Learned;
        let mut model = GPT::new(cfg, 7).unwrap();
        for aligned in [false, true] {
            let (pl, rl) = if aligned {
                (
                    Labels::Aligned(&packed_aligned),
                    Labels::Aligned(&rows_aligned),
                )
            } else {
                (Labels::Next(&packed_next), Labels::Next(&rows_next))
            };
            let packed = Forward::new(&ids, 1, t)
                .attention_mask(Some(&mask))
                .segments(Some(&segs))
                .labels(pl);
            let (loss_p, grads_p) = run(&mut model, packed);
            let apart = Forward::new(&rows, 3, t)
                .attention_mask(Some(&row_mask))
                .labels(rl);
            let (loss_r, grads_r) = run(&mut model, apart);
            let what = format!("rope {rope}, aligned {aligned}");
            assert!(
                (loss_p - loss_r).abs() <= 1e-5 * loss_r.abs(),
                "{what}: loss {loss_p} packed vs {loss_r} apart"
            );
            let scale = grads_r.iter().fold(0f32, |m, g| m.max(g.abs()));
            assert!(scale > 0.0);
            for (i, (p, r)) in grads_p.iter().zip(&grads_r).enumerate() {
                assert!(
                    (p - r).abs() <= 1e-5 * scale,
                    "{what}: grad[{i}] {p} packed vs {r} apart"
                );
            }
            // Without the segment ids the packed row is one long sequence: a different loss.
            let labels = if aligned {
                Labels::Aligned(&packed_aligned)
            } else {
                Labels::Next(&packed_next)
            };
            let joined = Forward::new(&ids, 1, t)
                .attention_mask(Some(&mask))
                .labels(labels);
            let (loss_j, _) = run(&mut model, joined);
            assert!(
                (loss_j - loss_r).abs() > 1e-4,
                "{what}: segments changed nothing"
            );
        }
    }
}

#[test]
fn segment_ids_of_the_wrong_length_are_an_error() {
    let mut model = GPT::new(gpt2(), 1).unwrap();
    let ids = [1u32, 2, 3, 4];
    let err = model
        .forward(Forward::new(&ids, 2, 2).segments(Some(&[0, 0, 1])))
        .unwrap_err();
    assert!(err.to_string().contains("segments"), "{err}");
}
