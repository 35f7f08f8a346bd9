use super::*;
use clap::Parser;

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    args: TrainArgs,
}

fn parse(argv: &[&str]) -> TrainArgs {
    Cli::try_parse_from(std::iter::once("train").chain(argv.iter().copied()))
        .unwrap()
        .args
}

#[test]
fn a_config_files_inputs_are_relative_to_it_and_its_outputs_to_the_run() {
    let dir = std::env::temp_dir().join(format!("cohort-config-{}", std::process::id()));
    std::fs::create_dir_all(dir.join("configs")).unwrap();
    std::fs::write(dir.join("text.txt"), "abc").unwrap();
    let file = dir.join("configs/run.toml");
    std::fs::write(
        &file,
        "data = \"../text.txt\"\ntokenizer = \"char\"\nout = \"runs/a\"\nsteps = 3\n",
    )
    .unwrap();
    let cfg = parse(&["--config", file.to_str().unwrap()])
        .resolve()
        .unwrap();
    assert_eq!(
        Path::new(&cfg.data),
        dir.join("configs").join("../text.txt"),
        "data"
    );
    assert_eq!(cfg.tokenizer, "char", "a tokenizer kind is not a path");
    assert_eq!(cfg.out.as_deref(), Some(Path::new("runs/a")), "out");
    // A flag is relative to where the run starts, as every flag is.
    let cfg = parse(&["--config", file.to_str().unwrap(), "--data", "markov"])
        .resolve()
        .unwrap();
    assert_eq!(cfg.data, "markov");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn the_cosine_ends_at_a_tenth_of_the_peak_unless_told() {
    assert_eq!(parse(&[]).resolve().unwrap().min_lr, 2e-4);
    assert_eq!(
        parse(&["--lr", "1e-5"]).resolve().unwrap().min_lr,
        1e-5 / 10.0
    );
    let cfg = parse(&["--lr", "1e-5", "--min-lr", "0"]).resolve().unwrap();
    assert_eq!(cfg.min_lr, 0.0);
}

#[test]
fn pipeline_schedules_print_their_usual_names() {
    assert_eq!(PipelineSchedule::OneFOneB.to_string(), "1F1B");
    assert_eq!(PipelineSchedule::Gpipe.to_string(), "GPipe");
}

#[test]
fn overlap_auto_needs_a_free_core_or_another_node() {
    let many = 1 << 20;
    assert!(Overlap::On.enabled(2, 2, many));
    assert!(!Overlap::Off.enabled(4, 2, 0));
    assert!(!Overlap::Auto.enabled(2, 2, many), "every core computes");
    assert!(Overlap::Auto.enabled(4, 2, many), "the job spans nodes");
    assert!(Overlap::Auto.enabled(2, 2, 0), "cores to spare");
}

#[test]
fn zero1_is_a_strategy_by_flag_and_by_file() {
    let cfg = parse(&["--strategy", "zero1"]).resolve().unwrap();
    assert_eq!(cfg.strategy, Strategy::Zero1);
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("run.toml");
    std::fs::write(&file, "strategy = \"zero1\"\n").unwrap();
    let cfg = parse(&["--config", file.to_str().unwrap()])
        .resolve()
        .unwrap();
    assert_eq!(cfg.strategy, Strategy::Zero1);
    for name in ["zero1", "zero2", "zero3"] {
        let cfg = parse(&["--strategy", name, "--bf16-compress"])
            .resolve()
            .unwrap();
        assert_eq!(cfg.compression(), Some(cohort_ddp::Compression::Bf16));
    }
}

#[test]
fn zero2_and_zero3_are_strategies_and_refuse_what_they_do_not_support() {
    for name in ["zero2", "zero3"] {
        let cfg = parse(&["--strategy", name]).resolve().unwrap();
        assert_eq!(cfg.strategy.name(), name);
        assert!(cfg.strategy.is_zero());
        let err = parse(&["--strategy", name, "--stages", "2"])
            .resolve()
            .unwrap_err()
            .to_string();
        assert!(err.contains("stages") && err.contains(name), "{err}");
    }
    assert!(!Strategy::Ddp.is_zero() && !Strategy::Pipeline.is_zero());
}

#[test]
fn defaults_then_file_then_flags() {
    assert_eq!(parse(&[]).resolve().unwrap(), TrainConfig::default());
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("run.toml");
    std::fs::write(
        &file,
        "lr = 3e-4\nsteps = 50\noverlap = \"off\"\nclip_norm = 0.5\n",
    )
    .unwrap();
    let cfg = parse(&["--config", file.to_str().unwrap(), "--steps", "7"])
        .resolve()
        .unwrap();
    assert_eq!(cfg.lr, 3e-4);
    assert_eq!(cfg.steps, 7, "the flag overrides the file");
    assert_eq!(cfg.overlap, Overlap::Off);
    assert_eq!(cfg.batch_size, 12, "untouched settings keep their default");
    assert_eq!(cfg.grad_clip, 0.5, "clip_norm is grad_clip's other name");
    let cfg = parse(&["--config", file.to_str().unwrap(), "--grad-clip", "2"])
        .resolve()
        .unwrap();
    assert_eq!(cfg.grad_clip, 2.0, "the flag overrides the other name too");
    let cfg = parse(&["--bf16-compress", "--out", "/tmp/x"])
        .resolve()
        .unwrap();
    assert_eq!(cfg.bf16_compress, Some(true));
    assert_eq!(cfg.out, Some(PathBuf::from("/tmp/x")));
}

/// The `[default: X]` in each flag's help must be TrainConfig's default.
#[test]
fn documented_defaults_are_the_real_ones() {
    use clap::CommandFactory;
    let defaults = toml::Table::try_from(TrainConfig::default()).unwrap();
    let mut checked = 0;
    for arg in Cli::command().get_arguments() {
        let help = arg.get_help().map(|h| h.to_string()).unwrap_or_default();
        let Some(rest) = help.split("[default: ").nth(1) else {
            continue;
        };
        let doc = rest.split([']', ';']).next().unwrap().trim();
        let key = arg.get_id().as_str();
        let real = &defaults[key];
        let same = match real {
            toml::Value::Integer(i) => doc.parse::<i64>().ok() == Some(*i),
            toml::Value::Float(f) => doc.parse::<f64>().ok() == Some(*f),
            toml::Value::String(s) => doc == s,
            _ => false,
        };
        assert!(same, "--{key}: help says {doc}, default is {real}");
        checked += 1;
    }
    assert!(checked > 20, "only {checked} documented defaults found");
}

#[test]
fn bad_files_and_values_are_clear_errors() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("bad.toml");
    std::fs::write(&file, "learning_rate = 1\n").unwrap();
    let err = parse(&["--config", file.to_str().unwrap()])
        .resolve()
        .unwrap_err();
    assert!(err.to_string().contains("learning_rate"), "{err}");
    let missing = dir.path().join("missing.toml");
    let err = parse(&["--config", missing.to_str().unwrap()])
        .resolve()
        .unwrap_err();
    assert!(matches!(err, ConfigError::Read { .. }), "{err}");
    let err = parse(&["--data", "shakespeare"]).resolve().unwrap_err();
    assert!(err.to_string().contains("data"), "{err}");
    let err = parse(&["--batch-size", "0"]).resolve().unwrap_err();
    assert!(err.to_string().contains("batch_size"), "{err}");
    let err = parse(&["--strategy", "pipeline", "--activation-checkpointing"])
        .resolve()
        .unwrap_err();
    assert!(
        err.to_string().contains("activation_checkpointing"),
        "{err}"
    );
    let ok = parse(&["--precision", "bf16", "--activation-checkpointing"])
        .resolve()
        .unwrap();
    assert_eq!(ok.precision, Precision::Bf16);
    assert!(ok.activation_checkpointing);
}
