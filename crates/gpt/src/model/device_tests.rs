//! The model on a device backend: [`Emulated`](cohort_engine::Emulated), whose buffers are
//! device buffers in host memory, so that any read of one on the host between kernels panics
//! as it would on a GPU. Its kernels are the CPU's: every result must be the CPU's bits.

use super::*;
use cohort_engine::optim::{AdamW, AdamWConfig, DecayMask};
use cohort_engine::Emulated;

fn config(llama: bool, dropout: f32) -> GPTConfig {
    let cfg = GPTConfig {
        vocab_size: 11,
        max_position_embeddings: 8,
        n_layers: 2,
        n_heads: 2,
        d_model: 8,
        d_ff: 12,
        dropout,
        ..GPTConfig::default()
    };
    if llama {
        // RoPE, RMSNorm, SwiGLU, two query heads over one key/value head
        GPTConfig {
            n_kv_heads: Some(1),
            ..GPTConfig::llama_like(cfg)
        }
    } else {
        cfg
    }
}

/// Two steps (forward with padding and labels, backward, AdamW) on `dev`; the losses, and the
/// parameters and gradients after them, read back through the copies.
fn steps(
    cfg: &GPTConfig,
    dev: Box<dyn Backend>,
    blocked: bool,
    packed: bool,
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let mut m = GPT::with_backend(cfg.clone(), 5, dev).unwrap();
    if blocked {
        m.logits_max_bytes = 64; // the head in vocabulary blocks
    }
    let n = m.num_params();
    let ids: Vec<u32> = (0..14).map(|i| (i * 7 % 11) as u32).collect();
    let mask = [1, 1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1, 1];
    let mut labels: Vec<i32> = ids.iter().map(|&x| x as i32).collect();
    labels[3] = -100;
    // two sequences packed in the first row, one in the second
    let segments = [0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0];
    let mut opt = AdamW::new_on(m.backend(), AdamWConfig::default(), DecayMask::all(n)).unwrap();
    let mut losses = vec![];
    for step in 0..2 {
        m.set_dropout_key(3, 0, step);
        m.zero_grad();
        let pass = Forward::new(&ids, 2, 7)
            .attention_mask(Some(&mask))
            .segments(packed.then_some(&segments[..]))
            .labels(Labels::Aligned(&labels));
        losses.push(m.forward(pass).unwrap().unwrap());
        m.backward(Backward::new()).unwrap();
        let (dev, p, g) = m.params_and_grads_views();
        opt.step_on(dev, p, g, 1e-2).unwrap();
    }
    m.backend().sync().unwrap();
    let (mut p, mut g) = (vec![0f32; n], vec![0f32; n]);
    m.copy_params_to_host(&mut p).unwrap();
    m.copy_grads_to_host(&mut g).unwrap();
    (losses, p, g)
}

#[test]
fn a_model_on_a_device_computes_the_cpus_bits_without_reading_device_memory() {
    let cases = [
        (false, 0.1, false, false),
        (false, 0.0, true, true),
        (true, 0.0, false, false),
        (true, 0.0, false, true),
    ];
    for (llama, dropout, blocked, packed) in cases {
        let cfg = config(llama, dropout);
        let cpu = steps(&cfg, Box::new(Cpu::new(2).unwrap()), blocked, packed);
        let dev = Box::new(Emulated::new(2, DType::F32).unwrap());
        let emulated = steps(&cfg, dev, blocked, packed);
        let case = format!("llama {llama}, dropout {dropout}, blocked {blocked}, packed {packed}");
        assert_eq!(cpu, emulated, "{case}");
    }
}

#[test]
fn the_host_api_of_a_model_on_a_device_names_the_copy_to_use() {
    let dev = Box::new(Emulated::new(1, DType::F32).unwrap());
    let mut m = GPT::with_backend(config(false, 0.0), 5, dev).unwrap();
    let err =
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| m.params().len())).unwrap_err();
    let msg = err.downcast_ref::<String>().unwrap();
    assert!(msg.contains("params of a model on emulated"), "{msg}");
    assert!(msg.contains("copy_params_to_host"), "{msg}");
    let ids = [1u32; 4];
    let mut hooks = |_: Part, _: Range<usize>, _: &mut [f32]| {};
    let err = m
        .forward(Forward::new(&ids, 1, 4).parts(&mut hooks))
        .unwrap_err()
        .to_string();
    assert!(err.contains("not yet for a model on emulated"), "{err}");
    let err = m.set_precision(DType::Bf16).unwrap_err().to_string();
    assert!(err.contains("keeps its backend's precision"), "{err}");
}

#[test]
fn a_backend_without_a_kernel_the_model_needs_is_refused_at_build() {
    let lacking = |kernels| -> Box<dyn Backend> {
        Box::new(Emulated::new(1, DType::F32).unwrap().lacking(kernels))
    };
    const NO_LLAMA: &[&str] = &["rmsnorm_forward", "rope_backward", "swiglu_forward"];
    let err = GPT::with_backend(config(true, 0.0), 5, lacking(NO_LLAMA))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("not yet on emulated: rmsnorm_forward, rope_backward, swiglu_forward"),
        "{err}"
    );
    // GPT-2 runs none of them
    GPT::with_backend(config(false, 0.0), 5, lacking(NO_LLAMA)).unwrap();
    let part = crate::StagePart::split(2, 1).unwrap().remove(0);
    let err = crate::GptStage::with_backend(config(true, 0.0), 5, part, lacking(NO_LLAMA))
        .unwrap_err()
        .to_string();
    assert!(err.contains("not yet on emulated"), "{err}");
}
