//! The qkv rows kept in bf16 under bf16 products ([`ActLayout::qkv16`]): loss and every
//! gradient are the bits of the f32 rows, on every path that reads them, and the arena holds
//! half the floats for them; models whose rows something else reads (RoPE) or whose backend
//! lacks the kernels keep them in f32.

use super::tests::model;
use super::*;
use cohort_engine::Emulated;

/// GPT-2-style, 16 positions: heads of 12 (an even head size whose Q rows the fused heads
/// read in place) or, with `nkv`, grouped key/value heads.
fn gpt2(nkv: Option<usize>, dropout: f32) -> GPTConfig {
    GPTConfig {
        vocab_size: 50,
        max_position_embeddings: 16,
        n_layers: 2,
        n_heads: 4,
        n_kv_heads: nkv,
        d_model: 48,
        d_ff: 72,
        dropout,
        bias: true,
        tie_word_embeddings: true,
        ..GPTConfig::default()
    }
}

/// Loss and gradient bits of one step on `m` (bf16, outputs not kept), with padding, packed
/// sequences and labels; whether the arena kept qkv in bf16, and its qkv floats.
fn step(mut m: GPT, checkpointing: bool) -> (u32, Vec<u32>, bool, usize) {
    if m.backend().dtype() != DType::Bf16 {
        assert_eq!(m.set_precision(DType::Bf16).unwrap(), DType::Bf16);
    }
    m.keep_max_bytes = 0;
    m.set_activation_checkpointing(checkpointing);
    m.set_dropout_key(3, 1, 9);
    let ids: Vec<u32> = (0..30).map(|i| (i * 13 % 50) as u32).collect();
    let labels: Vec<i32> = ids.iter().map(|&x| x as i32).collect();
    let mut mask = vec![1u8; 30];
    mask[15..18].fill(0); // row 1 left-padded
    let segments: Vec<u32> = (0..30).map(|i| u32::from(i % 15 >= 6)).collect();
    let pass = Forward::new(&ids, 2, 15)
        .attention_mask(Some(&mask))
        .segments(Some(&segments))
        .labels(Labels::Aligned(&labels));
    let loss = m.forward(pass).unwrap().unwrap();
    m.zero_grad();
    m.backward(Backward::new()).unwrap();
    m.backend().sync().unwrap();
    let mut g = vec![0f32; m.num_params()];
    m.copy_grads_to_host(&mut g).unwrap();
    let al = m.act_layout.as_ref().unwrap();
    let qkv_floats = al.ranges[ACT_QKV].len();
    let grads = g.iter().map(|x| x.to_bits()).collect();
    (loss.to_bits(), grads, al.qkv16, qkv_floats)
}

#[test]
fn bf16_qkv_rows_give_the_bits_of_f32_ones() {
    if !cohort_engine::cpu::bf16_supported() {
        eprintln!("skipped: this CPU has neither AMX nor AVX512_BF16");
        return;
    }
    for cfg in [gpt2(None, 0.1), gpt2(Some(2), 0.0)] {
        let per_layer = 30 * cfg.qkv_width();
        let layers = |checkpointing| if checkpointing { 1 } else { cfg.n_layers };
        for checkpointing in [false, true] {
            let mut want = None;
            for threads in [1, 2] {
                let what = format!("nkv {:?}, checkpointing {checkpointing}", cfg.n_kv_heads);
                let mut f32_rows = model(cfg.clone(), threads, 9);
                f32_rows.qkv16 = false;
                let (l, g, on, floats) = step(f32_rows, checkpointing);
                assert!(!on, "{what}: qkv in f32 when asked");
                assert_eq!(floats, layers(checkpointing) * per_layer, "{what}");
                let (l16, g16, on, floats) = step(model(cfg.clone(), threads, 9), checkpointing);
                assert!(on, "{what}: qkv in bf16");
                assert_eq!(floats, layers(checkpointing) * per_layer / 2, "{what}");
                assert_eq!(l16, l, "{what}, {threads} threads: loss");
                assert_eq!(g16, g, "{what}, {threads} threads: gradients");
                // and the same bits on every thread count
                let got = (l, g);
                assert_eq!(
                    *want.get_or_insert_with(|| got.clone()),
                    got,
                    "{what}: threads"
                );
            }
        }
    }
}

#[test]
fn qkv_rows_stay_f32_under_rope_and_on_a_backend_without_the_kernels() {
    if !cohort_engine::cpu::bf16_supported() {
        eprintln!("skipped: this CPU has neither AMX nor AVX512_BF16");
        return;
    }
    // RoPE turns q and k in f32 in place
    let llama = GPTConfig::llama_like(gpt2(Some(2), 0.0));
    let (_, _, on, _) = step(model(llama, 2, 9), false);
    assert!(!on, "a rotary model keeps qkv in f32");
    // a backend without the optional kernels: the model builds, keeps f32 rows, same bits
    let cfg = gpt2(None, 0.1);
    let lacking = Emulated::new(2, DType::Bf16)
        .unwrap()
        .lacking(&QKV16_KERNELS);
    let m = GPT::with_backend(cfg.clone(), 9, Box::new(lacking)).unwrap();
    let (l, g, on, _) = step(m, false);
    assert!(!on, "no kernels, no bf16 rows");
    let (l16, g16, on, _) = step(model(cfg, 2, 9), false);
    assert!(on);
    assert_eq!(
        (l16, g16),
        (l, g),
        "the CPU's bits on a device without the kernels"
    );
}
