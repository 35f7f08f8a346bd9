//! Times the optimizer step and checkpoint save/load on benchmark config B (10.77M parameters).
//!
//! cargo run --release -p cohort-train --example optim_checkpoint_bench [-- REPEATS]
//!
//! Prints one JSON object: median and minimum milliseconds of an AdamW and an SGD-momentum step
//! and of clip_grad_norm over the whole buffer, at 1 and 2 threads (run inside the engine's
//! pool), then of saving (model + AdamW state + trainer state, atomically) and of loading them
//! into an existing model and optimizer.

use std::time::Instant;

use cohort_engine::cpu::Cpu;
use cohort_engine::optim::{clip_grad_norm, AdamW, AdamWConfig, Optimizer, Sgd, SgdConfig};
use cohort_gpt::checkpoint::{self, Checkpoint};
use cohort_gpt::optim_groups::decay_mask;
use cohort_gpt::{GPTConfig, GPT};
use cohort_train::{load_optimizer_into, optimizer_file, trainer_state_json, TrainerState};

/// (median, min) of `repeats` timings of `f`, in ms.
fn time(repeats: usize, mut f: impl FnMut()) -> (f64, f64) {
    let mut ms: Vec<f64> = (0..repeats)
        .map(|_| {
            let t0 = Instant::now();
            f();
            t0.elapsed().as_secs_f64() * 1e3
        })
        .collect();
    ms.sort_by(f64::total_cmp);
    (ms[ms.len() / 2], ms[0])
}

fn json((median, min): (f64, f64)) -> serde_json::Value {
    serde_json::json!({ "median": median, "min": min })
}

fn main() {
    let repeats: usize = std::env::args()
        .nth(1)
        .map(|s| s.parse().expect("REPEATS is a number"))
        .unwrap_or(21);
    let mut model = GPT::new(GPTConfig::config_b(), 1).unwrap();
    let n = model.num_params();
    let grads: Vec<f32> = (0..n).map(|i| ((i % 777) as f32 - 388.0) * 1e-4).collect();
    let mask = decay_mask(model.param_views());
    let mut adamw = AdamW::new(AdamWConfig::default(), mask.clone()).unwrap();
    let momentum = SgdConfig {
        momentum: 0.9,
        ..Default::default()
    };
    let mut sgd = Sgd::new(momentum, mask).unwrap();
    let mut out = serde_json::Map::new();
    out.insert("params".into(), n.into());
    for threads in [1, 2] {
        let cpu = Cpu::new(threads).unwrap();
        let mut g = grads.clone();
        let (adam, sgd_t, clip) = cpu.install(|| {
            let p = model.params_mut();
            let adam = time(repeats, || adamw.step(p, &grads, 1e-3).unwrap());
            let sgd_t = time(repeats, || sgd.step(p, &grads, 1e-3).unwrap());
            let clip = time(repeats, || {
                clip_grad_norm(&mut g, 1e9).unwrap();
            });
            (adam, sgd_t, clip)
        });
        out.insert(format!("adamw_{threads}t_ms"), json(adam));
        out.insert(format!("sgd_momentum_{threads}t_ms"), json(sgd_t));
        out.insert(format!("clip_grad_norm_{threads}t_ms"), json(clip));
    }

    let root = tempfile::tempdir().unwrap();
    let state = TrainerState {
        step: 1,
        seed: 1,
        ..Default::default()
    };
    let optimizer = adamw.state();
    let trainer = trainer_state_json(&state);
    let ckpt = Checkpoint {
        config_extra: Vec::new(),
        model: Some(&model),
        tensor_files: vec![optimizer_file(&optimizer)],
        extra_files: vec![(cohort_train::TRAINER_STATE_FILE, &trainer)],
    };
    let save = time(repeats.min(11), || {
        checkpoint::save(root.path(), "bench", &ckpt).unwrap();
    });
    // Loading into a model and optimizer that exist already, as a resuming trainer does
    // (building the model, whose random init costs more than the load, is not timed).
    let dir = checkpoint::resolve(root.path()).unwrap();
    let mut into = GPT::new(GPTConfig::config_b(), 2).unwrap();
    let mut opt = AdamW::new(AdamWConfig::default(), decay_mask(into.param_views())).unwrap();
    let load = time(repeats.min(11), || {
        checkpoint::load_params_into(&dir, &mut into).unwrap();
        assert!(load_optimizer_into(&dir, &mut opt).unwrap());
    });
    assert_eq!(into.params(), model.params());
    out.insert("save_model_adamw_ms".into(), json(save));
    out.insert("load_model_adamw_ms".into(), json(load));
    println!("{}", serde_json::Value::Object(out));
}
