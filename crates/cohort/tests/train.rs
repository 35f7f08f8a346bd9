//! `cohort train` and `cohort bench ddp` end to end: the real binary, alone
//! and as two worker processes under `cohort run --standalone -n 2`.

mod support;

use support::{params, run, succeeded, TINY};

/// Steps and logging of the runs: a few seconds for both.
const STEPS: &[&str] = &["--steps", "4", "--warmup-steps", "1", "--log-interval", "2"];

#[test]
fn two_processes_through_the_launcher_match_one_process_with_twice_the_batch() {
    let tmp = tempfile::tempdir().unwrap();
    let (d2, d1) = (tmp.path().join("two"), tmp.path().join("one"));
    let mut args = vec![
        "run",
        "--standalone",
        "-n",
        "2",
        "train",
        "--batch-size",
        "2",
        "--out",
    ];
    args.push(d2.to_str().unwrap());
    args.extend_from_slice(STEPS);
    args.extend_from_slice(TINY);
    let two = succeeded(&run(&args));
    // Rank 0 alone logs, in the format of PyTorch's DDP examples, and states the global batch.
    assert!(
        two.contains("[rank0]: global batch: 4 sequences = 2 per rank x 2 ranks x 1 accumulation"),
        "{two}"
    );
    assert!(two.contains("[rank0]: [step 2 / 4] loss = "), "{two}");
    // ...and what each rank holds.
    assert!(
        two.contains("[rank0]: memory per rank: parameters "),
        "{two}"
    );
    assert!(two.contains("[rank0]: [step 4 / 4] val loss = "), "{two}");
    assert!(!two.contains("[rank1]: [step"), "only rank 0 logs:\n{two}");

    let mut args = vec!["train", "--batch-size", "4", "--out"];
    args.push(d1.to_str().unwrap());
    args.extend_from_slice(STEPS);
    args.extend_from_slice(TINY);
    let one = succeeded(&run(&args));
    assert!(
        one.contains("global batch: 4 sequences = 4 per rank x 1 ranks x 1 accumulation"),
        "{one}"
    );

    // Same samples per step, gradients summed in another order: equal to
    // rounding (see crates/train/tests/train.rs for the tolerance).
    let (a, b) = (params(&d2), params(&d1));
    let d = a
        .iter()
        .zip(&b)
        .map(|(x, y)| (x - y).abs())
        .fold(0f32, f32::max);
    assert!(d < 2e-5, "two ranks vs one process: max |diff| {d}");
    assert!(a != params_at_start(), "training changed the parameters");
}

/// The model before training: the same config and seed as the runs above.
fn params_at_start() -> Vec<f32> {
    let cfg = cohort_train::TrainConfig {
        seq_len: 16,
        n_layers: 2,
        n_heads: 2,
        d_model: 32,
        d_ff: 64,
        ..Default::default()
    };
    let model =
        cohort_gpt::GPT::new(cohort_train::model_config(&cfg, 16).unwrap(), cfg.seed).unwrap();
    model.params().to_vec()
}

#[test]
fn bench_ddp_reports_the_figures_as_json() {
    let v = bench_ddp_on_two_ranks(&[]);
    assert_eq!(v["config"], "A");
    assert_eq!(v["world"], 2);
    for key in [
        "ms_per_step",
        "tokens_per_s",
        "efficiency",
        "launch_to_first_step_s",
    ] {
        let x = v[key]
            .as_f64()
            .unwrap_or_else(|| panic!("{key} missing in {v}"));
        assert!(x > 0.0 && x.is_finite(), "{key} = {x}");
    }
    // Rank 0 measured both its DDP steps and the baseline, phase by phase.
    for (which, phase) in [
        ("phases_ms", "forward"),
        ("phases_ms", "optimizer"),
        ("baseline_phases_ms", "step"),
    ] {
        let ms = v[which][phase].as_f64().unwrap_or(0.0);
        assert!(ms > 0.0, "{which}.{phase} = {ms} in {v}");
    }
    // The launcher's timestamp makes launch-to-first-step meaningful; the
    // target is 0.3 s, a loaded CI machine gets some slack.
    assert!(v["launch_to_first_step_s"].as_f64().unwrap() < 10.0);
    assert_eq!(v["strategy"], "ddp");
    // Model FLOPs utilisation beside the times (where the CPU has FMA).
    assert!(v["flops_per_step_per_rank"]
        .as_f64()
        .is_some_and(|f| f > 0.0));
    if v["peak_gflops_per_rank"].is_array() {
        assert!(v["mfu"].as_f64().is_some_and(|m| m > 0.0), "{v}");
    }
    let params = v["params"].as_u64().unwrap();
    assert_eq!(v["optimizer_floats_per_rank"], 2 * params, "{v}");
    assert_peak_rss_of_each_rank(&v, 2);
}

/// `cohort run --standalone -n 2 bench ddp --config A --steps 2 --warmup 1 --json EXTRA`: the
/// JSON line rank 0 prints.
fn bench_ddp_on_two_ranks(extra: &[&str]) -> serde_json::Value {
    let mut args = vec!["run", "--standalone", "-n", "2", "bench", "ddp"];
    args.extend(["--config", "A", "--steps", "2", "--warmup", "1", "--json"]);
    args.extend_from_slice(extra);
    let text = succeeded(&run(&args));
    let line = text
        .lines()
        .find_map(|l| l.strip_prefix("[rank0]: {"))
        .unwrap_or_else(|| panic!("no JSON line from rank 0:\n{text}"));
    serde_json::from_str(&format!("{{{line}")).unwrap()
}

/// Every one of `world` ranks reported a plausible peak resident memory:
/// at least the model's parameters, and not a stray unit (under 100 GB).
fn assert_peak_rss_of_each_rank(v: &serde_json::Value, world: usize) {
    let rss = v["peak_rss_mb_per_rank"]
        .as_array()
        .unwrap_or_else(|| panic!("no peak_rss_mb_per_rank in {v}"));
    assert_eq!(rss.len(), world, "{v}");
    let params_mb = v["params"].as_f64().unwrap() * 4.0 / (1 << 20) as f64;
    for mb in rss {
        let mb = mb.as_f64().unwrap();
        assert!(mb > params_mb && mb < 1e5, "peak RSS {mb} MB in {v}");
    }
}

#[test]
fn bench_ddp_times_zero1_with_one_nth_of_the_optimizer_state() {
    let v = bench_ddp_on_two_ranks(&["--strategy", "zero1", "--rounds", "1"]);
    assert_eq!(v["strategy"], "zero1");
    assert_eq!(v["world"], 2);
    for key in ["tokens_per_s", "efficiency"] {
        let x = v[key].as_f64().unwrap_or(0.0);
        assert!(x > 0.0 && x.is_finite(), "{key} = {x} in {v}");
    }
    // Each rank keeps AdamW's two moments for its half of the (padded) buffer.
    let params = v["params"].as_u64().unwrap();
    assert_eq!(
        v["optimizer_floats_per_rank"],
        2 * params.div_ceil(2),
        "{v}"
    );
    assert_eq!(v["buckets"], 0);
    for phase in ["backward", "comm_wait", "optimizer"] {
        let ms = v["phases_ms"][phase].as_f64().unwrap_or(0.0);
        assert!(ms > 0.0, "phases_ms.{phase} = {ms} in {v}");
    }
    assert_peak_rss_of_each_rank(&v, 2);
    // Gradients sent as bf16 (the ZeRO stages' reduce-scatter compressed as
    // DDP's all-reduce is).
    let v = bench_ddp_on_two_ranks(&["--strategy", "zero1", "--bf16-compress", "--rounds", "1"]);
    let x = v["tokens_per_s"].as_f64().unwrap_or(0.0);
    assert!(x > 0.0 && x.is_finite(), "tokens_per_s = {x} in {v}");
}

/// ZeRO-2 and ZeRO-3 in the benchmark: the flat shard's AdamW state (each
/// part's ceil(n_p / 2), summed: at least half the model's, within a float
/// per part), no buckets, the phases timed, and every rank's peak memory.
#[test]
fn bench_ddp_times_zero2_and_zero3_with_sharded_state() {
    for strategy in ["zero2", "zero3"] {
        let v = bench_ddp_on_two_ranks(&["--strategy", strategy, "--rounds", "1"]);
        assert_eq!(v["strategy"], strategy);
        let x = v["tokens_per_s"].as_f64().unwrap_or(0.0);
        assert!(x > 0.0 && x.is_finite(), "tokens_per_s = {x} in {v}");
        let params = v["params"].as_u64().unwrap();
        let floats = v["optimizer_floats_per_rank"].as_u64().unwrap();
        // Config A: 4 blocks, so 6 parts, each padded by at most one float.
        assert!(
            floats >= 2 * params.div_ceil(2) && floats <= 2 * (params.div_ceil(2) + 6),
            "{v}"
        );
        assert_eq!(v["buckets"], 0);
        for phase in ["backward", "comm_wait", "optimizer"] {
            let ms = v["phases_ms"][phase].as_f64().unwrap_or(0.0);
            assert!(ms > 0.0, "{strategy}: phases_ms.{phase} = {ms} in {v}");
        }
        assert_peak_rss_of_each_rank(&v, 2);
    }
}

#[test]
fn bad_settings_are_clear_errors() {
    let out = run(&["train", "--data", "shakespeare"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("data") && err.contains("markov"), "{err}");
}

/// Text data in a read-only directory (a read-only tmpfs, which refuses even root) trains:
/// its token cache goes to the user's cache directory, and nothing is written beside it.
#[test]
fn text_data_in_a_read_only_directory_caches_its_tokens_elsewhere() {
    use std::process::Command;
    let tmp = tempfile::tempdir().unwrap();
    let ro = tmp.path().join("ro");
    std::fs::create_dir_all(&ro).unwrap();
    let mounted = Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=4m", "tmpfs"])
        .arg(&ro)
        .output();
    if !mounted.as_ref().is_ok_and(|o| o.status.success()) {
        eprintln!("skipping: cannot mount a tmpfs here ({mounted:?})");
        return;
    }
    let text: String = (0..400)
        .map(|i| format!("line {i}: the quick brown fox jumps over the lazy dog\n"))
        .collect();
    std::fs::write(ro.join("corpus.txt"), text).unwrap();
    let remounted = Command::new("mount")
        .args(["-o", "remount,ro"])
        .arg(&ro)
        .status()
        .unwrap();
    let cache = tmp.path().join("cache");
    let out = support::cohort()
        .args(["train", "--data"])
        .arg(ro.join("corpus.txt"))
        .args(["--steps", "2", "--log-interval", "1"])
        .args(TINY)
        .env("XDG_CACHE_HOME", &cache)
        .output()
        .unwrap();
    let listed: Vec<String> = std::fs::read_dir(&ro)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    let _ = Command::new("umount").arg(&ro).status();
    assert!(remounted.success());
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(listed, ["corpus.txt"], "written beside read-only data");
    // A directory of this source's own in $XDG_CACHE_HOME/cohort/tokens holds the token
    // file and the tokenizer built from the text.
    let dirs: Vec<_> = std::fs::read_dir(cache.join("cohort/tokens"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    assert_eq!(dirs.len(), 1, "{dirs:?}");
    let name = dirs[0].file_name().unwrap().to_string_lossy().into_owned();
    assert!(name.starts_with("corpus.txt-"), "{name}");
    let cached: Vec<String> = std::fs::read_dir(&dirs[0])
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert!(cached.iter().any(|n| n.ends_with(".tok")), "{cached:?}");
    assert!(
        cached.iter().any(|n| n.ends_with(".tokenizer.json")),
        "{cached:?}"
    );
}

/// `--init-from`: a new run (step 0, a fresh optimizer) from a trained model's directory takes
/// its shape and its parameters; a shape flag or a vocabulary that differs is an error naming
/// both values, and so is resuming a checkpoint with another model's flags.
#[test]
fn a_new_run_starts_from_a_pretrained_model_and_takes_its_shape() {
    let tmp = tempfile::tempdir().unwrap();
    let base = tmp.path().join("base");
    let mut args = vec!["train", "--steps", "30", "--out", base.to_str().unwrap()];
    args.extend_from_slice(TINY);
    succeeded(&run(&args));

    // The data flags of TINY without its shape flags: the shape comes from config.json.
    let data: &[&str] = &[
        "--eval-batches",
        "2",
        "--markov-vocab",
        "16",
        "--train-sequences",
        "96",
        "--val-sequences",
        "16",
    ];
    let one_step = |init: Option<&str>| {
        let mut args = vec!["train", "--steps", "1", "--lr", "1e-9", "--min-lr", "0"];
        args.extend_from_slice(data);
        match init {
            Some(dir) => args.extend(["--init-from", dir]),
            None => args.extend_from_slice(&TINY[4..14]),
        }
        succeeded(&run(&args))
    };
    let val = |out: &str| -> f32 {
        let tail = out.split("val loss ").last().unwrap();
        tail.split(',').next().unwrap().trim().parse().unwrap()
    };
    let started = one_step(Some(base.to_str().unwrap()));
    assert!(
        started.contains("initialized from ")
            && started.contains("model: 2 layers, 2 heads, d_model 32, d_ff 64, vocab 16, seq 16"),
        "{started}"
    );
    let fresh = one_step(None);
    assert!(
        val(&started) < val(&fresh) - 0.3,
        "the pretrained model's loss: {} vs a fresh one's {}",
        val(&started),
        val(&fresh)
    );

    let fails = |extra: &[&str]| {
        let mut args = vec![
            "train",
            "--steps",
            "1",
            "--init-from",
            base.to_str().unwrap(),
        ];
        args.extend_from_slice(extra);
        let out = run(&args);
        assert!(!out.status.success());
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let e = fails(&["--d-model", "64", "--markov-vocab", "16"]);
    assert!(
        e.contains("n_embd = 32") && e.contains("d_model = 64"),
        "{e}"
    );
    let e = fails(&["--markov-vocab", "20"]);
    assert!(
        e.contains("embeds 16 token ids but the run's data has 20"),
        "{e}"
    );

    let mut other: Vec<&str> = TINY.to_vec();
    let at = other.iter().position(|a| *a == "--n-layers").unwrap();
    other[at + 1] = "3";
    let mut args = vec!["train", "--steps", "40", "--resume", base.to_str().unwrap()];
    args.extend_from_slice(&other);
    let out = run(&args);
    let e = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && e.contains("n_layers 2 in its config.json, 3 in this run"),
        "{e}"
    );
}

/// `cohort checkpoint consolidate` turns a ZeRO-3 run's sharded checkpoint
/// (a shard per rank) into one model with the same parameters; a damaged
/// shard is one line naming its file and rank. `cohort checkpoint verify`
/// passes the intact checkpoint and names the damaged shard.
#[test]
fn checkpoint_consolidate_exports_a_sharded_run_as_one_model() {
    let tmp = tempfile::tempdir().unwrap();
    let (out, export) = (tmp.path().join("out"), tmp.path().join("export"));
    let mut args = vec![
        "run",
        "--standalone",
        "-n",
        "2",
        "train",
        "--strategy",
        "zero3",
    ];
    args.extend_from_slice(&["--out", out.to_str().unwrap()]);
    args.extend_from_slice(STEPS);
    args.extend_from_slice(TINY);
    succeeded(&run(&args));
    let step = out.join("step-000004");
    assert!(step.join("shard-00001-of-00002.safetensors").is_file());
    let consolidate = |from: &std::path::Path| {
        run(&[
            "checkpoint",
            "consolidate",
            "--from",
            from.to_str().unwrap(),
            "--out",
            export.to_str().unwrap(),
        ])
    };
    succeeded(&consolidate(&out));
    assert!(export.join("model.safetensors").is_file());
    assert_eq!(params(&export), params(&step));
    let verify = |path: &std::path::Path| run(&["checkpoint", "verify", path.to_str().unwrap()]);
    let verified = verify(&out);
    assert!(verified.status.success(), "{verified:?}");
    let said = String::from_utf8_lossy(&verified.stdout);
    assert!(
        said.contains("verified") && said.contains("step-000004"),
        "{said}"
    );

    let shard = step.join("shard-00001-of-00002.safetensors");
    let bytes = std::fs::read(&shard).unwrap();
    std::fs::write(&shard, &bytes[..bytes.len() / 2]).unwrap();
    let failed = consolidate(&step);
    assert!(!failed.status.success());
    let err = String::from_utf8_lossy(&failed.stderr);
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    for want in ["shard of rank 1 of 2", "shard-00001-of-00002.safetensors"] {
        assert!(err.contains(want), "{want:?} in {err}");
    }
    let failed = verify(&step);
    let err = String::from_utf8_lossy(&failed.stderr);
    assert!(!failed.status.success());
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    assert!(
        err.contains("shard-00001-of-00002.safetensors") && err.contains("corrupt"),
        "{err}"
    );
}

/// r43: the README's resume line keeps its work. `cohort run -n 2 train --resume ckpt --steps
/// N` without `--out` goes on writing checkpoints and logs in ckpt and says so, notes that
/// the longer run re-lays the cosine schedule, and a resume already at `--steps` says there
/// is nothing to do and exits 0.
#[test]
fn a_resume_without_out_keeps_writing_where_it_read() {
    let tmp = tempfile::tempdir().unwrap();
    let ckpt = tmp.path().join("ckpt");
    let ckpt_s = ckpt.to_str().unwrap();
    let train = |extra: &[&str]| {
        let mut args = vec!["run", "--standalone", "-n", "2", "train"];
        args.extend_from_slice(TINY);
        args.extend_from_slice(&["--warmup-steps", "1", "--log-interval", "2"]);
        args.extend_from_slice(extra);
        run(&args)
    };
    succeeded(&train(&["--steps", "4", "--out", ckpt_s]));
    let more = succeeded(&train(&["--resume", ckpt_s, "--steps", "6"]));
    assert!(
        more.contains(&format!("checkpoints and logs go on in {ckpt_s}")),
        "{more}"
    );
    assert!(
        more.contains("the cosine schedule is re-laid over 6 steps"),
        "{more}"
    );
    assert_eq!(
        std::fs::read_to_string(ckpt.join("latest")).unwrap().trim(),
        "step-000006"
    );
    let done = train(&["--resume", ckpt_s, "--steps", "5"]);
    let text = succeeded(&done);
    assert!(
        text.contains("nothing to do: checkpoint is at step 6, --steps 5"),
        "{text}"
    );
    assert!(!text.contains("train loss"), "{text}");
}
