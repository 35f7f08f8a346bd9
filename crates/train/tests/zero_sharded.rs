//! ZeRO-2 and ZeRO-3 (`--strategy zero2|zero3`) against DDP, ranks as
//! threads over real loopback sockets: the same model from the same seed
//! and data, on a model none of whose blocks divides into 2 or 3 ranks (so
//! shards are padded part by part), with clipping, accumulation and a NaN
//! in one rank's shard; bf16-compressed gradients (ZeRO-1's too); what the
//! strategies release; their header's memory accounting; and their
//! checkpoints (ZeRO-1's too): a shard per rank, which resume on another
//! world size, consolidate into one model, and refuse a damaged shard by
//! name.

mod common;

use cohort_comm::{spawn, ProcessGroup};
use cohort_engine::optim::AdamWConfig;
use cohort_gpt::checkpoint as ckpt;
use cohort_gpt::{Backward, Forward, GPTConfig, Labels, Part, GPT};
use cohort_train::{
    train, NanInjection, Outcome, Overlap, ShardedDp, Strategy, TrainConfig, TrainError, ZeroStage,
};
use common::{
    assert_stopped_run_resumes_like, grad_norms, max_abs_diff, odd, opts, run_world, with,
};

/// Sharding changes only the order of the gradient's sums (each part's
/// shard averaged over ranks, micro-batch by micro-batch), so ZeRO-2/3 and
/// DDP agree to rounding; a wrong shard, average or gather is off by a whole
/// step (lr = 1e-3).
const TOL: f32 = 1e-5;

const STAGES: [Strategy; 2] = [Strategy::Zero2, Strategy::Zero3];

/// `cfg` on `world` ranks logging to a temporary directory: every rank's
/// outcome and rank 0's logged gradient norms.
fn logged(world: usize, cfg: &TrainConfig) -> (Vec<Outcome>, Vec<f64>) {
    let dir = tempfile::tempdir().unwrap();
    let outcomes = run_world(
        world,
        &TrainConfig {
            log_dir: Some(dir.path().into()),
            ..cfg.clone()
        },
    );
    (outcomes, grad_norms(dir.path()))
}

/// Under `strategy`, `cfg`'s ranks agree bitwise, and their parameters,
/// losses and logged gradient norms (relatively) are DDP's within [`TOL`]:
/// the norm is where a wrong average (a sum, say) would show even though
/// AdamW's update barely feels a gradient's scale. Returns the norms.
fn assert_matches_ddp(what: &str, world: usize, strategy: Strategy, cfg: &TrainConfig) -> Vec<f64> {
    let (ddp, ddp_norms) = logged(world, cfg);
    let (zero, norms) = logged(world, &with(strategy, cfg));
    let what = format!("{what}, {strategy:?}, world {world}");
    assert_ne!(zero[0].params.len() % world, 0, "{what}");
    for (r, o) in zero.iter().enumerate().skip(1) {
        assert!(o.params == zero[0].params, "{what}: rank {r} diverged");
    }
    let d = max_abs_diff(&zero[0].params, &ddp[0].params);
    eprintln!("{what}: vs DDP max |diff| {d:e}");
    assert!(d < TOL, "{what}: vs DDP {d}");
    assert_eq!(norms.len(), cfg.steps as usize, "{what}");
    for (step, (z, d)) in norms.iter().zip(&ddp_norms).enumerate() {
        assert!(
            (z - d).abs() <= 1e-5 * d,
            "{what}, step {step}: grad norm {z} vs DDP's {d}"
        );
    }
    assert_eq!(zero[0].train_losses.len(), ddp[0].train_losses.len());
    for ((s1, a), (s2, b)) in zero[0].train_losses.iter().zip(&ddp[0].train_losses) {
        assert_eq!(s1, s2);
        assert!((a - b).abs() < TOL, "{what}: loss {a} vs {b} at step {s1}");
    }
    norms
}

#[test]
fn zero2_and_zero3_match_ddp_on_2_and_3_ranks_with_padded_parts() {
    let start = run_world(1, &TrainConfig { steps: 0, ..odd() })
        .swap_remove(0)
        .params;
    // Evaluation at the end runs through the sharded forward too.
    let cfg = TrainConfig {
        eval_interval: 2,
        ..odd()
    };
    for strategy in STAGES {
        for world in [2, 3] {
            assert_matches_ddp("plain", world, strategy, &cfg);
        }
        // The parameters did move, by far more than the tolerance.
        let zero = run_world(2, &with(strategy, &odd())).swap_remove(0);
        assert!(max_abs_diff(&zero.params, &start) > 1e-3);
        let ddp = run_world(2, &cfg).swap_remove(0);
        let zero = run_world(2, &with(strategy, &cfg)).swap_remove(0);
        assert_eq!(zero.val_losses.len(), ddp.val_losses.len());
        for ((_, a), (_, b)) in zero.val_losses.iter().zip(&ddp.val_losses) {
            assert!((a - b).abs() < TOL, "{strategy:?}: val loss {a} vs {b}");
        }
    }
}

#[test]
fn zero2_and_zero3_clip_by_the_norm_over_all_shards_like_ddp() {
    // Below every step's norm, so every step is clipped, by a factor that
    // changes from step to step.
    let clip = 0.05;
    let cfg = TrainConfig {
        grad_clip: clip,
        ..odd()
    };
    for strategy in STAGES {
        let unclipped = run_world(2, &with(strategy, &odd())).swap_remove(0).params;
        for world in [2, 3] {
            let norms = assert_matches_ddp("grad_clip", world, strategy, &cfg);
            assert!(
                norms.iter().all(|&n| n > 2.0 * clip as f64),
                "clipping should be active: norms {norms:?}"
            );
        }
        let clipped = run_world(2, &with(strategy, &cfg)).swap_remove(0).params;
        let d = max_abs_diff(&clipped, &unclipped);
        assert!(
            d > 10.0 * TOL,
            "{strategy:?}: clipping changed nothing: {d}"
        );
    }
}

#[test]
fn zero2_and_zero3_accumulate_micro_batches_like_ddp() {
    let cfg = TrainConfig {
        grad_accum: 2,
        ..odd()
    };
    for strategy in STAGES {
        for world in [2, 3] {
            assert_matches_ddp("grad_accum 2", world, strategy, &cfg);
        }
        // Accumulating really changed the run (two micro-batches per step).
        let one = run_world(2, &with(strategy, &odd())).swap_remove(0).params;
        let two = run_world(2, &with(strategy, &cfg)).swap_remove(0).params;
        assert!(max_abs_diff(&one, &two) > 10.0 * TOL);
    }
}

/// With activation checkpointing stage 3 gathers each block once around
/// its backward, recomputation included; bf16 products train too.
#[test]
fn zero3_matches_ddp_with_activation_checkpointing_and_runs_in_bf16() {
    let cfg = TrainConfig {
        activation_checkpointing: true,
        ..odd()
    };
    assert_matches_ddp("checkpointing", 2, Strategy::Zero3, &cfg);
    let bf16 = TrainConfig {
        precision: cohort_train::Precision::Bf16,
        ..odd()
    };
    for strategy in STAGES {
        let ddp = run_world(2, &bf16).swap_remove(0);
        let zero = run_world(2, &with(strategy, &bf16));
        assert!(zero[1].params == zero[0].params);
        // bf16 rounds the products of parameters that differ from DDP's in
        // their last bits: near, not within rounding.
        let d = max_abs_diff(&zero[0].params, &ddp.params);
        assert!(d < 1e-3, "{strategy:?} bf16 vs DDP bf16: {d}");
    }
}

/// A NaN in rank 1's gradient only skips the update on every rank, as DDP
/// skips it.
#[test]
fn a_nan_on_one_rank_skips_the_update_on_every_rank() {
    let cfg = TrainConfig {
        inject_nan: Some(NanInjection {
            first_step: 1,
            last_step: 1,
            rank: Some(1),
        }),
        ..odd()
    };
    let ddp = run_world(3, &cfg).swap_remove(0);
    for strategy in STAGES {
        let zero = run_world(3, &with(strategy, &cfg));
        for (r, o) in zero.iter().enumerate() {
            let d = max_abs_diff(&o.params, &ddp.params);
            assert!(d < TOL, "{strategy:?} rank {r}: vs DDP after a skip: {d}");
        }
        let clean = run_world(3, &with(strategy, &odd())).swap_remove(0);
        assert!(
            max_abs_diff(&zero[0].params, &clean.params) > 1e-4,
            "{strategy:?}: the poisoned step was not skipped"
        );
    }
}

/// Rank 0's header of a one-step run of `cfg` on `world` ranks.
fn header(world: usize, cfg: &TrainConfig) -> String {
    let logs = spawn::threads_with(world, opts(), |pg: &ProcessGroup| {
        let mut log = Vec::new();
        let cfg = TrainConfig {
            steps: 1,
            ..cfg.clone()
        };
        train(&cfg, pg, &mut log).map(|_| String::from_utf8(log).unwrap())
    })
    .unwrap();
    logs[0].clone()
}

/// The figure in MB after `key` in a memory line.
fn mb_after(line: &str, key: &str) -> f64 {
    let rest = line
        .split(key)
        .nth(1)
        .unwrap_or_else(|| panic!("{key:?} in {line}"));
    rest.split(' ').next().unwrap().parse().unwrap()
}

/// The accounting at start: the optimizer state is the flat shard's (each
/// part's ceil(n_p / N), summed), the gradient (both stages) and the
/// parameters (stage 3) fall to a shard plus what one part needs; DDP's
/// figures stay whole.
#[test]
fn the_memory_line_shows_sharded_gradients_and_parameters() {
    // Six blocks: enough parts that a shard plus one part is well below the
    // whole (with two, a part is most of the model).
    let odd = || TrainConfig {
        n_layers: 6,
        ..odd()
    };
    // Units: the embeddings, each block's attention (from ln_1) and MLP
    // (from ln_2) apart, the head.
    let mut parts = vec![1089usize];
    for _ in 0..6 {
        parts.extend([4554, 4387]);
    }
    parts.push(66);
    let line = |h: &str| {
        h.lines()
            .find(|l| l.contains("memory per rank: "))
            .unwrap_or_else(|| panic!("no memory line in:\n{h}"))
            .to_string()
    };
    let ddp = line(&header(2, &odd()));
    for world in [2, 3] {
        let flat: usize = parts.iter().map(|p| p.div_ceil(world)).sum();
        for strategy in STAGES {
            let h = header(world, &with(strategy, &odd()));
            let stage = if strategy == Strategy::Zero2 { 2 } else { 3 };
            assert!(
                h.contains(&format!("ZeRO-{stage}: "))
                    && h.contains(&format!("{flat} elements per rank")),
                "{h}"
            );
            let zero = line(&h);
            assert!(
                zero.contains(&format!("AdamW, 2 x {flat} floats: 1/{world} of DDP's")),
                "{zero}"
            );
            let grads = mb_after(&zero, "gradients ");
            assert!(grads < mb_after(&ddp, "gradients "), "{zero}\nvs {ddp}");
            assert!(
                zero.contains(&format!("(1/{world} shards + the parts in backward)")),
                "{zero}"
            );
            let params = mb_after(&zero, "parameters ");
            if strategy == Strategy::Zero3 {
                assert!(params < mb_after(&ddp, "parameters "), "{zero}");
                assert!(zero.contains("the largest part gathered"), "{zero}");
            } else {
                assert_eq!(params, mb_after(&ddp, "parameters "), "{zero}");
            }
        }
    }
}

/// What the strategies really release: after a backward through
/// [`ShardedDp`] the model's gradient buffer is all zero (each part given
/// back once reduce-scattered) while the shard holds the job's mean
/// gradient; under stage 3 the parameter buffer is all zero between parts,
/// and the step's parameters are DDP's mean-gradient AdamW step.
#[test]
fn sharded_passes_leave_only_the_shards_behind() {
    check_passes(GPTConfig {
        vocab_size: 17,
        max_position_embeddings: 8,
        n_layers: 2,
        n_heads: 3,
        d_model: 33,
        d_ff: 64,
        ..GPTConfig::default()
    });
}

/// The same with a model whose buffers are large enough (over 64 MiB) for
/// the sharded step to keep released pages and move them to the next part:
/// parameters gathered into pages that held another part's, gradients
/// written into pages that held parameters, and the results unchanged. Its
/// embeddings are large enough to be reduce-scattered piece by piece.
#[test]
fn sharded_passes_reusing_released_pages_give_the_same_step() {
    check_passes(GPTConfig {
        vocab_size: 70_000,
        max_position_embeddings: 8,
        n_layers: 2,
        n_heads: 4,
        d_model: 256,
        d_ff: 1024,
        ..GPTConfig::default()
    });
}

/// A tied wte's gradient (the largest tensor: here 16,000 floats against a
/// block's 12,704) is handed over as the head's backward writes it, and the
/// embeddings' share as rows: it is never held through the blocks'
/// backward, beside a block's gradient, as it was when the head wrote it
/// whole and the embeddings finished it last. And the step is still the
/// mean gradient's (`check_passes`).
#[test]
fn a_tied_wtes_gradient_is_never_held_beside_a_blocks() {
    let cfg = GPTConfig {
        vocab_size: 500,
        max_position_embeddings: 8,
        n_layers: 2,
        n_heads: 2,
        d_model: 32,
        d_ff: 128,
        tie_word_embeddings: true,
        ..GPTConfig::default()
    };
    let (wte, block, head) = (500 * 32, 12 * 32 * 32 + 13 * 32, 2 * 32);
    for stage in [ZeroStage::Two, ZeroStage::Three] {
        let peaks = spawn::threads_with(2, opts(), |pg: &ProcessGroup| {
            let mut model = GPT::new(cfg.clone(), 3).unwrap();
            assert_eq!(model.part_range(Part::Block(0)).len(), block);
            let mut zero = ShardedDp::new(pg, &mut model, stage, AdamWConfig::default())?;
            let x: Vec<u32> = (0..16)
                .map(|i| (i * 31 + pg.rank() * 7) as u32 % 500)
                .collect();
            let labels: Vec<i32> = x.iter().map(|&v| v as i32).collect();
            let labels = Some(Labels::Aligned(&labels));
            zero.forward(pg, &mut model, &x, None, None, labels, 2, 8)?;
            zero.backward(pg, &mut model)?;
            Ok::<_, TrainError>(zero.peak_gradient_floats())
        })
        .unwrap();
        for peak in peaks {
            // The head's block of wte (all of it: its 16 x 500 logits are
            // not split) beside ln_f's, then each block's alone.
            assert_eq!(peak, wte + head, "{stage:?}: not wte + a block");
        }
    }
    check_passes(cfg);
}

/// ZeRO's reduce-scatters follow backward's finer readiness, as DDP's
/// buckets do: each block's MLP (from ln_2 up) as its own unit, launched
/// before the block's attention, so that what is left when backward ends
/// is block 0's attention (about a third of the block) and the
/// embeddings. The header says so. (That the results are still DDP's is
/// every `assert_matches_ddp` above.)
#[test]
fn the_reduce_scatters_end_with_block_0s_attention_and_the_embeddings() {
    let cfg = GPTConfig {
        vocab_size: 17,
        max_position_embeddings: 8,
        n_layers: 3,
        n_heads: 3,
        d_model: 33,
        d_ff: 132,
        ..GPTConfig::default()
    };
    for stage in [ZeroStage::Two, ZeroStage::Three] {
        let got = spawn::threads_with(2, opts(), |pg: &ProcessGroup| {
            let mut model = GPT::new(cfg.clone(), 3).unwrap();
            let ready = model.split_ready_ranges();
            let (block0, embeddings) = (
                model.part_range(Part::Block(0)),
                model.part_range(Part::Embeddings),
            );
            let zero = ShardedDp::new(pg, &mut model, stage, AdamWConfig::default())?;
            Ok::<_, TrainError>((zero.reduce_units(), ready, block0, embeddings))
        })
        .unwrap();
        let (units, ready, block0, embeddings) = got[0].clone();
        assert_eq!(
            units, ready,
            "{stage:?}: the order backward hands them over"
        );
        assert_eq!(units.len(), 2 + 2 * cfg.n_layers);
        let n = units.len();
        assert_eq!(units[n - 1], embeddings);
        let attention = units[n - 2].clone();
        assert_eq!(attention.start, block0.start);
        assert_eq!(
            units[n - 3],
            attention.end..block0.end,
            "block 0's MLP before"
        );
        // ln_1, c_attn and c_proj: 4 C^2 + 6 C of the block's 12 C^2 + 13 C.
        let c = cfg.d_model;
        assert_eq!(attention.len(), 4 * c * c + 6 * c);
        assert_eq!(block0.len(), 12 * c * c + 13 * c);
    }
    let h = header(2, &with(Strategy::Zero2, &odd()));
    assert!(
        h.contains("ZeRO-2: ") && h.contains("6 reduce-scatters in launch order of "),
        "{h}"
    );
}

fn check_passes(cfg: GPTConfig) {
    let (b, t) = (2, 8);
    let ids = |rank: usize| -> Vec<u32> {
        (0..b * t)
            .map(|i| ((i * 7 + rank * 3) % 17) as u32)
            .collect()
    };
    // The mean gradient over 2 ranks, and its norm, the plain way.
    let mut whole = GPT::new(cfg.clone(), 3).unwrap();
    let mut mean = vec![0f32; whole.num_params()];
    for rank in 0..2 {
        let x = ids(rank);
        whole.zero_grad();
        whole
            .forward(Forward::new(&x, b, t).labels(Labels::Aligned(
                &x.iter().map(|&v| v as i32).collect::<Vec<_>>(),
            )))
            .unwrap();
        whole.backward(Backward::new()).unwrap();
        for (m, g) in mean.iter_mut().zip(whole.grads()) {
            *m += g / 2.0;
        }
    }
    let want: f64 = mean.iter().map(|&g| (g as f64).powi(2)).sum();
    for stage in [ZeroStage::Two, ZeroStage::Three] {
        let got = spawn::threads_with(2, opts(), |pg: &ProcessGroup| {
            let mut model = GPT::new(cfg.clone(), 3).unwrap();
            let mut zero = ShardedDp::new(pg, &mut model, stage, AdamWConfig::default())?;
            assert_eq!(zero.stage(), stage);
            let x = ids(pg.rank());
            let labels: Vec<i32> = x.iter().map(|&v| v as i32).collect();
            zero.forward(
                pg,
                &mut model,
                &x,
                None,
                None,
                Some(Labels::Aligned(&labels)),
                b,
                t,
            )?;
            zero.backward(pg, &mut model)?;
            assert!(
                model.grads().iter().all(|&g| g == 0.0),
                "gradient buffer released"
            );
            let held_params = model.params().iter().any(|&p| p != 0.0);
            assert_eq!(held_params, stage == ZeroStage::Two, "{stage:?}");
            let shard: f64 = zero
                .shard_grads_mut()
                .iter()
                .map(|&g| (g as f64).powi(2))
                .sum();
            assert_eq!(zero.shard_grads_mut().len(), zero.shard_len());
            zero.update(pg, &mut model, 1e-3)?;
            let params = zero.gather_params(pg)?;
            Ok::<_, TrainError>((shard, params))
        })
        .unwrap();
        let squares: f64 = got.iter().map(|g| g.0).sum();
        assert!(
            (squares - want).abs() <= 1e-4 * want,
            "{stage:?}: shards' squares {squares} vs the mean gradient's {want}"
        );
        assert!(got[0].1 == got[1].1, "{stage:?}: ranks disagree");
        // The first AdamW step moves every decayed or non-zero-gradient
        // parameter by about lr: compare with the whole model's step.
        let mut opt = cohort_engine::optim::AdamW::new(
            AdamWConfig::default(),
            cohort_gpt::optim_groups::decay_mask(whole.param_views()),
        )
        .unwrap();
        let mut step = GPT::new(cfg.clone(), 3).unwrap().params().to_vec();
        use cohort_engine::optim::Optimizer;
        opt.step(&mut step, &mean, 1e-3).unwrap();
        let d = max_abs_diff(&got[0].1, &step);
        assert!(
            d < 1e-6,
            "{stage:?}: step vs AdamW on the mean gradient: {d}"
        );
    }
}

/// A run stopped after 3 of 6 steps on 2 ranks resumes on 3 (the launcher's
/// elastic rescale keeps the global batch: grad_accum 3 -> 2) and ends where
/// the unbroken 2-rank run does, each rank reading its ranges of the 2
/// ranks' shards; a DDP checkpoint resumes under either stage, and a
/// stage's checkpoint under DDP and ZeRO-1 (and ZeRO-1's under the stage).
#[test]
fn zero2_and_zero3_checkpoints_resume_on_another_world_size() {
    let cfg = TrainConfig {
        steps: 6,
        lr_decay_steps: 6,
        grad_accum: 3,
        ..odd()
    };
    for strategy in STAGES {
        let straight = run_world(2, &with(strategy, &cfg)).swap_remove(0);
        for (first, then, world) in [
            (strategy, strategy, 3),
            (Strategy::Ddp, strategy, 3),
            (strategy, Strategy::Ddp, 1),
            // Shards by part read back as ZeRO-1's one contiguous shard, and
            // the other way round.
            (strategy, Strategy::Zero1, 3),
            (Strategy::Zero1, strategy, 3),
        ] {
            assert_stopped_run_resumes_like(&straight, &cfg, (first, then), world, TOL);
        }
    }
}

/// `cfg` on `world` ranks; the first rank's error, if any rank failed.
fn try_world(world: usize, cfg: &TrainConfig) -> Result<Vec<Outcome>, String> {
    spawn::threads_with(world, opts(), |pg: &ProcessGroup| {
        train(cfg, pg, &mut std::io::sink())
    })
    .map_err(|e| e.to_string())
}

/// Every ZeRO stage saves one shard per rank and an index, nothing
/// gathered; the consolidated export of such a checkpoint holds the run's
/// final parameters bitwise, with the whole optimizer state, and resumes
/// exactly as the sharded checkpoint itself does.
#[test]
fn zero_checkpoints_are_a_shard_per_rank_and_consolidate_to_the_final_state() {
    for strategy in [Strategy::Zero1, Strategy::Zero2, Strategy::Zero3] {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("ckpt");
        let cfg = TrainConfig {
            out: Some(out.clone()),
            ..with(strategy, &odd())
        };
        let run = run_world(3, &cfg).swap_remove(0);
        let step = out.join("step-000004");
        let index = ckpt::read_index(&step)
            .unwrap()
            .expect("a sharded checkpoint");
        assert_eq!(index.world_size, 3);
        assert_eq!(index.len, run.params.len());
        for rank in 0..3 {
            assert!(step.join(ckpt::shard_file_name(rank, 3)).is_file());
        }
        for whole in [ckpt::MODEL_FILE, cohort_train::OPTIMIZER_FILE] {
            assert!(!step.join(whole).exists(), "{strategy:?}: {whole} written");
        }
        // The sharded checkpoint loads as a model too.
        let (model, _) = ckpt::load_model(&out).unwrap();
        assert!(model.params() == &run.params[..], "{strategy:?}");

        let export = dir.path().join("export");
        cohort_train::consolidate(&out, &export).unwrap();
        let (model, _) = ckpt::load_model(&export).unwrap();
        assert!(model.params() == &run.params[..], "{strategy:?}: export");
        assert!(ckpt::verify(&export).unwrap());
        assert!(export.join(cohort_train::OPTIMIZER_FILE).is_file());

        // Both continue to the same parameters, on one DDP rank.
        let resumed = |from: &std::path::Path| {
            let (cfg, _) = cohort_train::elastic::prepare_resume(
                &TrainConfig {
                    steps: 6,
                    resume: Some(from.to_path_buf()),
                    ..odd()
                },
                1,
                0,
            );
            run_world(1, &cfg).swap_remove(0)
        };
        let (a, b) = (resumed(&out), resumed(&export));
        assert_eq!(a.steps_run, 2);
        assert!(
            a.params == b.params,
            "{strategy:?}: export resumes differently"
        );
    }
}

/// A shard that is damaged or missing stops the resume with one line
/// naming the file and the rank that wrote it; in an output directory with
/// an older intact checkpoint, the run resumes from that one instead.
#[test]
fn a_damaged_or_missing_shard_is_an_error_naming_its_file_and_rank() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("ckpt");
    let cfg = TrainConfig {
        steps: 2,
        save_interval: 1,
        out: Some(out.clone()),
        ..with(Strategy::Zero2, &odd())
    };
    run_world(2, &cfg);
    let step = out.join("step-000002");
    let shard = step.join(ckpt::shard_file_name(1, 2));
    let mut bytes = std::fs::read(&shard).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 0x40;
    std::fs::write(&shard, &bytes).unwrap();
    let resume = |from: &std::path::Path| TrainConfig {
        steps: 3,
        resume: Some(from.to_path_buf()),
        out: None,
        save_interval: 0,
        ..cfg.clone()
    };
    let err = try_world(2, &resume(&step)).unwrap_err();
    eprintln!("damaged: {err}");
    for want in [
        "shard of rank 1 of 2",
        "shard-00001-of-00002.safetensors",
        "corrupt",
    ] {
        assert!(err.contains(want), "{want:?} in {err}");
    }
    assert_eq!(err.lines().count(), 1, "{err}");
    let err = cohort_train::consolidate(&step, &dir.path().join("x")).unwrap_err();
    assert!(err.to_string().contains("shard of rank 1 of 2"), "{err}");
    // The output directory falls back to step 1's checkpoint.
    let resumed = try_world(2, &resume(&out)).unwrap();
    assert_eq!(resumed[0].steps_run, 2);

    std::fs::remove_file(&shard).unwrap();
    let err = try_world(2, &resume(&step)).unwrap_err();
    eprintln!("missing: {err}");
    for want in ["shard of rank 1 of 2", "shard-00001-of-00002.safetensors"] {
        assert!(err.contains(want), "{want:?} in {err}");
    }
}

/// With overlap on (each part's all-gather prefetched, each part's
/// reduce-scatter left running through the backward of the part before
/// it), ZeRO-2 and ZeRO-3 end bitwise where they do without it: the same
/// collectives in the same order, only the waiting moved; with
/// accumulation, clipping and evaluation in the run; with the gradients
/// sent in bf16 too (each unit's compressed reduce-scatter in flight on
/// its own bf16 copy).
#[test]
fn zero2_and_zero3_overlap_changes_nothing_but_the_waiting() {
    let cfg = TrainConfig {
        grad_accum: 2,
        grad_clip: 0.05,
        eval_interval: 2,
        activation_checkpointing: true,
        ..odd()
    };
    for strategy in STAGES {
        for (world, bf16) in [(2, false), (3, false), (2, true), (3, true)] {
            let at = |overlap| {
                run_world(
                    world,
                    &TrainConfig {
                        overlap,
                        bf16_compress: Some(bf16),
                        ..with(strategy, &cfg)
                    },
                )
            };
            let (on, off) = (at(Overlap::On), at(Overlap::Off));
            let what = format!("{strategy:?} x{world}, bf16 {bf16}");
            for (a, b) in on.iter().zip(&off) {
                assert!(a.params == b.params, "{what}: params");
                assert_eq!(a.train_losses, b.train_losses, "{what}");
                assert_eq!(a.val_losses, b.val_losses, "{what}");
            }
        }
        assert_matches_ddp(
            "overlap",
            3,
            strategy,
            &TrainConfig {
                overlap: Overlap::On,
                ..odd()
            },
        );
    }
}

/// ZeRO-2 with overlap leaves the update's all-gathers to the next
/// forward: a checkpoint saved then (the flat shards) resumes bitwise where
/// the unbroken run goes, with an evaluation at the save, and both end
/// bitwise where overlap off does.
#[test]
fn zero2_deferred_gathers_save_and_resume_bitwise() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("ckpt");
    let cfg = TrainConfig {
        steps: 6,
        lr_decay_steps: 6,
        grad_accum: 2,
        eval_interval: 3,
        overlap: Overlap::On,
        ..with(Strategy::Zero2, &odd())
    };
    let straight = run_world(2, &cfg);
    let off = run_world(
        2,
        &TrainConfig {
            overlap: Overlap::Off,
            ..cfg.clone()
        },
    );
    assert!(straight[0].params == off[0].params, "overlap on vs off");
    assert_eq!(straight[0].val_losses, off[0].val_losses);
    run_world(
        2,
        &TrainConfig {
            steps: 3,
            save_interval: 3,
            out: Some(out.clone()),
            ..cfg.clone()
        },
    );
    let resumed = run_world(
        2,
        &TrainConfig {
            resume: Some(out.clone()),
            ..cfg.clone()
        },
    );
    assert_eq!(resumed[0].steps_run, 3, "resumed at step 3");
    for (r, (a, b)) in resumed.iter().zip(&straight).enumerate() {
        assert!(a.params == b.params, "rank {r}: resumed vs unbroken");
    }
}

/// The commit protocol under a crash: a save killed after some shards
/// were written leaves only its staging directory, which no resume reads
/// (the latest complete checkpoint is used) and the next save of that step
/// replaces.
#[test]
fn a_save_killed_midway_leaves_the_previous_checkpoint_in_charge() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("ckpt");
    let cfg = TrainConfig {
        steps: 4,
        save_interval: 2,
        out: Some(out.clone()),
        ..with(Strategy::Zero3, &odd())
    };
    let straight = run_world(2, &cfg).swap_remove(0);
    // As if step 4's save had been killed after rank 0's shard.
    std::fs::remove_dir_all(out.join("step-000004")).unwrap();
    std::fs::write(out.join("latest"), "step-000002\n").unwrap();
    let staging = ckpt::staging_dir(&out, "step-000004");
    std::fs::create_dir(&staging).unwrap();
    std::fs::write(staging.join(ckpt::shard_file_name(0, 2)), b"half").unwrap();
    let resumed = run_world(
        2,
        &TrainConfig {
            resume: Some(out.clone()),
            ..cfg.clone()
        },
    );
    assert_eq!(resumed[0].steps_run, 2, "resumed at step 2");
    assert!(resumed[0].params == straight.params);
    assert!(!staging.exists(), "the staging directory was replaced");
    let index = ckpt::read_index(&out.join("step-000004")).unwrap().unwrap();
    assert_eq!(index.world_size, 2);
}

#[test]
fn bf16_compressed_gradients_under_every_zero_stage_match_compressed_ddp() {
    let cfg = TrainConfig {
        bf16_compress: Some(true),
        ..odd()
    };
    let exact = run_world(2, &odd()).swap_remove(0).params;
    let ddp = run_world(2, &cfg).swap_remove(0).params;
    // Compression is on: the gradients lost bits, so the run moved
    // differently (AdamW's normalized steps carry a small gradient's
    // rounding into a whole step of lr = 1e-3 at most).
    let lost = max_abs_diff(&ddp, &exact);
    assert!(lost > 1e-5 && lost < 1e-2, "compressed vs f32 DDP: {lost}");
    // The reduce-scatters stay overlapped under compression.
    for strategy in STAGES {
        let overlapped = TrainConfig {
            overlap: Overlap::On,
            ..with(strategy, &cfg)
        };
        let log = header(2, &overlapped);
        let line = log
            .lines()
            .find(|l| l.contains("reduce-scatters in launch order"));
        assert!(
            line.is_some_and(|l| l.contains("overlap on")),
            "{strategy:?}: {log}"
        );
        assert!(log.contains("gradients: bf16"), "{strategy:?}: {log}");
    }
    for strategy in [Strategy::Zero1, Strategy::Zero2, Strategy::Zero3] {
        let zero = run_world(2, &with(strategy, &cfg));
        assert!(
            zero[1].params == zero[0].params,
            "{strategy:?}: ranks diverged"
        );
        // Each element's two shares are rounded and summed in bf16 as DDP's
        // all-reduce does; only the micro-batch's f32 gradients before it
        // may differ in their last bits (and flip a rounding).
        let d = max_abs_diff(&zero[0].params, &ddp);
        eprintln!("{strategy:?} + bf16 compression vs compressed DDP: max |diff| {d:e}");
        assert!(
            d < lost / 10.0,
            "{strategy:?}: {d} vs compressed DDP ({lost} from f32)"
        );
    }
}
