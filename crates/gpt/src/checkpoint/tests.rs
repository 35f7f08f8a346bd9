use super::*;

/// Files a caller adds beside the model, as a trainer adds its optimizer and position.
const STATE_FILE: &str = "state.safetensors";
const STEP_FILE: &str = "step.json";

fn tiny(bias: bool, tied: bool) -> GPTConfig {
    GPTConfig {
        vocab_size: 11,
        max_position_embeddings: 8,
        n_layers: 2,
        n_heads: 2,
        d_model: 8,
        d_ff: 16,
        dropout: 0.0,
        bias,
        tie_word_embeddings: tied,
        ..GPTConfig::default()
    }
}

fn model_ckpt(model: &GPT) -> Checkpoint<'_> {
    Checkpoint {
        model: Some(model),
        ..Default::default()
    }
}

#[test]
fn save_and_load_round_trip_every_variant() {
    let root = tempfile::tempdir().unwrap();
    for (i, (bias, tied)) in [(true, true), (false, false), (true, false), (false, true)]
        .into_iter()
        .enumerate()
    {
        let model = GPT::new(tiny(bias, tied), 7 + i as u64).unwrap();
        let dir = save(root.path(), &format!("ckpt-{i}"), &model_ckpt(&model)).unwrap();
        assert_eq!(dir, root.path().join(format!("ckpt-{i}")));
        assert_eq!(
            resolve(root.path()).unwrap(),
            dir,
            "latest names the newest"
        );
        let (loaded, from) = load_model(root.path()).unwrap();
        assert_eq!(from, dir);
        assert_eq!(loaded.config(), model.config());
        assert_eq!(loaded.params(), model.params());
        // config.json is GPT-2's
        let json: serde_json::Value =
            serde_json::from_slice(&fs::read(dir.join(CONFIG_FILE)).unwrap()).unwrap();
        assert_eq!(json["model_type"], "gpt2");
        assert_eq!(json["architectures"][0], "GPT2LMHeadModel");
        assert_eq!(json["n_embd"], 8);
        assert_eq!(json["n_inner"], 16);
        assert_eq!(json["n_positions"], 8);
        assert_eq!(json["activation_function"], "gelu_new");
        assert_eq!(json["layer_norm_epsilon"], 1e-5);
        assert_eq!(json["tie_word_embeddings"], tied);
        // tensor names and shapes are GPT-2's, Conv1D [in, out]
        let bytes = fs::read(dir.join(MODEL_FILE)).unwrap();
        let st = SafeTensors::deserialize(&bytes).unwrap();
        assert_eq!(
            st.tensor("h.1.attn.c_attn.weight").unwrap().shape(),
            [8, 24]
        );
        assert_eq!(st.tensor("h.0.mlp.c_proj.weight").unwrap().shape(), [16, 8]);
        assert_eq!(st.tensor("lm_head.weight").is_ok(), !tied);
        assert_eq!(st.len(), model.param_views().len());
    }
    // the earlier checkpoints are still there and intact
    let (first, _) = load_model(&root.path().join("ckpt-0")).unwrap();
    assert_eq!(
        first.params(),
        GPT::new(tiny(true, true), 7).unwrap().params()
    );
}

/// The same state saved twice is the same bytes, although its metadata comes in a `HashMap`
/// (whose order differs from one map to the next) and the safetensors crate writes it in that
/// order: a resumed run's checkpoint can be compared with an unbroken run's byte for byte.
#[test]
fn the_same_state_saved_twice_is_the_same_bytes() {
    let root = tempfile::tempdir().unwrap();
    let model = GPT::new(tiny(true, false), 5).unwrap();
    let moments: Vec<f32> = (0..model.num_params()).map(|i| i as f32 * 0.25).collect();
    let saved: Vec<Vec<(String, Vec<u8>)>> = (0..8)
        .map(|i| {
            let metadata = (0..6)
                .map(|k| (format!("key{k}"), format!("value \"{k}\"")))
                .collect();
            let file = TensorFile {
                name: STATE_FILE,
                tensors: vec![("moments".to_string(), &moments[..])],
                metadata,
            };
            let ckpt = Checkpoint {
                config_extra: Vec::new(),
                model: Some(&model),
                tensor_files: vec![file],
                extra_files: vec![],
            };
            let dir = save(root.path(), &format!("ckpt-{i}"), &ckpt).unwrap();
            let mut files: Vec<(String, Vec<u8>)> = fs::read_dir(&dir)
                .unwrap()
                .map(|e| {
                    let e = e.unwrap();
                    (
                        e.file_name().into_string().unwrap(),
                        fs::read(e.path()).unwrap(),
                    )
                })
                .collect();
            files.sort();
            files
        })
        .collect();
    for (i, files) in saved.iter().enumerate().skip(1) {
        assert!(files == &saved[0], "save {i} differs from save 0");
    }
    // Still a valid file, metadata and all.
    let dir = root.path().join("ckpt-7");
    let back = read_tensor_file(&dir, STATE_FILE).unwrap().unwrap();
    assert_eq!(back.metadata.len(), 7);
    assert_eq!(back.metadata["key3"], "value \"3\"");
    assert!(verify(&dir).unwrap());
}

#[test]
fn tensor_files_and_extra_files_round_trip() {
    let root = tempfile::tempdir().unwrap();
    let model = GPT::new(tiny(true, true), 3).unwrap();
    let moments: Vec<f32> = (0..model.num_params()).map(|i| i as f32 * 0.5).collect();
    let vocab = br#"["a","b"]"#;
    let file = || TensorFile {
        name: "state.safetensors",
        tensors: vec![
            ("moments".to_string(), &moments[..]),
            ("one".to_string(), &[1.0][..]),
        ],
        metadata: HashMap::from([("step".to_string(), "2".to_string())]),
    };
    let dir = save(
        root.path(),
        "step-2",
        &Checkpoint {
            config_extra: Vec::new(),
            model: Some(&model),
            tensor_files: vec![file()],
            extra_files: vec![("vocab.json", vocab)],
        },
    )
    .unwrap();
    let mut back = read_tensor_file(&dir, "state.safetensors")
        .unwrap()
        .unwrap();
    // A safetensors file does not keep the writer's order of tensors.
    back.tensors.sort_by(|a, b| a.0.cmp(&b.0));
    assert_eq!(back.metadata.get("step").map(String::as_str), Some("2"));
    assert_eq!(
        back.tensors,
        vec![
            ("moments".to_string(), moments.clone()),
            ("one".to_string(), vec![1.0])
        ]
    );
    assert_eq!(
        read_file_verified(&dir, "vocab.json").unwrap().as_deref(),
        Some(&vocab[..])
    );
    assert!(verify(&dir).unwrap());

    // absent files are None; a name taken twice or reserved is refused
    let bare = save(root.path(), "bare", &model_ckpt(&model)).unwrap();
    assert_eq!(read_tensor_file(&bare, "state.safetensors").unwrap(), None);
    assert_eq!(read_file_verified(&bare, "vocab.json").unwrap(), None);
    for taken in [MODEL_FILE, CHECKSUMS_FILE, "state.safetensors"] {
        let err = save(
            root.path(),
            "clash",
            &Checkpoint {
                config_extra: Vec::new(),
                model: Some(&model),
                tensor_files: vec![file()],
                extra_files: vec![(taken, b"x")],
            },
        )
        .unwrap_err();
        assert!(
            matches!(err, CheckpointError::BadName { .. }),
            "{taken}: {err}"
        );
    }
}

#[test]
fn crash_leftovers_never_hide_the_last_good_checkpoint() {
    let root = tempfile::tempdir().unwrap();
    let a = GPT::new(tiny(true, true), 1).unwrap();
    let b = GPT::new(tiny(true, true), 2).unwrap();
    save(root.path(), "step-1", &model_ckpt(&a)).unwrap();
    // a save of step-2 that died half way: a partial temp dir
    let partial = root.path().join(".tmp-step-2");
    fs::create_dir(&partial).unwrap();
    fs::write(partial.join(MODEL_FILE), b"garbage").unwrap();
    assert_eq!(resolve(root.path()).unwrap(), root.path().join("step-1"));
    // the next save of that name cleans it up
    save(root.path(), "step-2", &model_ckpt(&b)).unwrap();
    assert!(!partial.exists());
    assert_eq!(load_model(root.path()).unwrap().0.params(), b.params());
    // a replace of step-2 that died between moving the old one aside and renaming the new
    fs::rename(root.path().join("step-2"), root.path().join(".old-step-2")).unwrap();
    let (m, dir) = load_model(root.path()).unwrap();
    assert_eq!(dir, root.path().join(".old-step-2"));
    assert_eq!(m.params(), b.params());
    // replacing works and leaves no leftovers
    save(root.path(), "step-2", &model_ckpt(&a)).unwrap();
    assert_eq!(load_model(root.path()).unwrap().0.params(), a.params());
    let mut names: Vec<String> = fs::read_dir(root.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    assert_eq!(names, ["latest", "step-1", "step-2"]);
}

#[test]
fn checksums_are_written_with_the_files_and_checked_by_every_reader() {
    let root = tempfile::tempdir().unwrap();
    let model = GPT::new(tiny(true, true), 3).unwrap();
    let moments = vec![0.5f32; model.num_params()];
    let dir = save(
        root.path(),
        "step-1",
        &Checkpoint {
            config_extra: Vec::new(),
            model: Some(&model),
            tensor_files: vec![TensorFile {
                name: STATE_FILE,
                tensors: vec![("exp_avg".to_string(), &moments[..])],
                metadata: HashMap::new(),
            }],
            extra_files: vec![(STEP_FILE, b"{\"step\": 1}"), ("vocab.json", b"[]")],
        },
    )
    .unwrap();
    // Every file has the mode a plain file gets (safetensors' temp files are 0600).
    use std::os::unix::fs::PermissionsExt;
    let mode = |f: &str| fs::metadata(dir.join(f)).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode(MODEL_FILE), mode(CONFIG_FILE));
    assert_eq!(mode(STATE_FILE), mode(CONFIG_FILE));
    // Every file is listed with the CRC-32C and size of its bytes on disk.
    let sums = fs::read_to_string(dir.join(CHECKSUMS_FILE)).unwrap();
    let mut listed: Vec<&str> = Vec::new();
    for line in sums.lines().filter(|l| !l.starts_with('#')) {
        let [digest, size, name] = line.splitn(3, ' ').collect::<Vec<_>>()[..] else {
            panic!("{line:?}");
        };
        let bytes = fs::read(dir.join(name)).unwrap();
        assert_eq!(digest, format!("crc32c:{:08x}", crc32c::crc32c(&bytes)));
        assert_eq!(size, bytes.len().to_string());
        listed.push(name);
    }
    listed.sort();
    assert_eq!(
        listed,
        [CONFIG_FILE, MODEL_FILE, STATE_FILE, STEP_FILE, "vocab.json"]
    );
    assert!(verify(&dir).unwrap());

    // One flipped byte in each file's payload: the reader of that file names it.
    let flip = |name: &str, at: usize| {
        let path = dir.join(name);
        let original = fs::read(&path).unwrap();
        let mut bytes = original.clone();
        let at = at.min(bytes.len() - 1);
        bytes[at] ^= 0x20;
        fs::write(&path, &bytes).unwrap();
        move || fs::write(&path, &original).unwrap()
    };
    let corrupt = |err: CheckpointError, name: &str| match &err {
        CheckpointError::Corrupt { path, .. } if *path == dir.join(name) => {
            let msg = err.to_string();
            assert!(msg.contains(name) && msg.contains("corrupt"), "{msg}");
            assert!(
                msg.contains("CRC-32C") && msg.contains(CHECKSUMS_FILE),
                "{msg}"
            );
        }
        other => panic!("{name}: expected Corrupt, got {other:?}"),
    };
    let len = fs::metadata(dir.join(MODEL_FILE)).unwrap().len() as usize;
    let undo = flip(MODEL_FILE, len - 3);
    let mut fresh = GPT::new(tiny(true, true), 4).unwrap();
    let before = fresh.params().to_vec();
    corrupt(load_params_into(&dir, &mut fresh).unwrap_err(), MODEL_FILE);
    assert_eq!(fresh.params(), before, "a corrupt file loads nothing");
    corrupt(verify(&dir).unwrap_err(), MODEL_FILE);
    undo();
    load_params_into(&dir, &mut fresh).unwrap();
    assert_eq!(fresh.params(), model.params());

    let len = fs::metadata(dir.join(STATE_FILE)).unwrap().len() as usize;
    let undo = flip(STATE_FILE, len - 5);
    corrupt(read_tensor_file(&dir, STATE_FILE).unwrap_err(), STATE_FILE);
    undo();
    let undo = flip(CONFIG_FILE, 10);
    corrupt(load_config(&dir).unwrap_err(), CONFIG_FILE);
    undo();
    let undo = flip(STEP_FILE, 4);
    corrupt(read_file_verified(&dir, STEP_FILE).unwrap_err(), STEP_FILE);
    undo();
    let undo = flip("vocab.json", 0);
    corrupt(verify(&dir).unwrap_err(), "vocab.json");
    undo();
    assert!(verify(&dir).unwrap());

    // a partially written file (truncated) and a missing one
    let model_file = dir.join(MODEL_FILE);
    let whole = fs::read(&model_file).unwrap();
    fs::write(&model_file, &whole[..whole.len() / 2]).unwrap();
    let err = load_params_into(&dir, &mut fresh).unwrap_err();
    assert!(
        matches!(&err, CheckpointError::Corrupt { size, what: "size", .. }
            if *size == (whole.len() / 2) as u64),
        "{err}"
    );
    fs::remove_file(&model_file).unwrap();
    assert!(matches!(
        verify(&dir).unwrap_err(),
        CheckpointError::Io { op: "read", .. }
    ));

    // a garbled CHECKSUMS is a format error naming it; none at all loads unverified
    fs::write(&model_file, &whole).unwrap();
    fs::write(
        dir.join(CHECKSUMS_FILE),
        "not a digest  model.safetensors\n",
    )
    .unwrap();
    let err = load_params_into(&dir, &mut fresh).unwrap_err();
    assert!(
        matches!(&err, CheckpointError::Format { path, .. } if path.ends_with(CHECKSUMS_FILE)),
        "{err}"
    );
    fs::remove_file(dir.join(CHECKSUMS_FILE)).unwrap();
    assert!(!verify(&dir).unwrap());
    load_params_into(&dir, &mut fresh).unwrap();
}

#[test]
fn a_failed_save_removes_its_temp_dir_and_keeps_the_last_checkpoint() {
    let root = tempfile::tempdir().unwrap();
    let a = GPT::new(tiny(true, true), 1).unwrap();
    let b = GPT::new(tiny(true, true), 2).unwrap();
    save(root.path(), "step-1", &model_ckpt(&a)).unwrap();
    // The bad extra-file name is found after the model files are written.
    let err = save(
        root.path(),
        "step-2",
        &Checkpoint {
            model: Some(&b),
            extra_files: vec![(CHECKSUMS_FILE, b"forged")],
            ..Default::default()
        },
    )
    .unwrap_err();
    assert!(matches!(err, CheckpointError::BadName { .. }), "{err}");
    let names: Vec<String> = fs::read_dir(root.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert!(!names.iter().any(|n| n.starts_with(".tmp")), "{names:?}");
    let (m, dir) = load_model(root.path()).unwrap();
    assert_eq!(dir, root.path().join("step-1"));
    assert_eq!(m.params(), a.params());
}

/// Saves checkpoints in a loop until killed: the child process of
/// `a_killed_saver_leaves_a_loadable_checkpoint`.
#[test]
#[ignore = "child process of a_killed_saver_leaves_a_loadable_checkpoint"]
fn saver_child() {
    let root = PathBuf::from(std::env::var("COHORT_CKPT_CHILD_ROOT").unwrap());
    let first: u64 = std::env::var("COHORT_CKPT_CHILD_FIRST_STEP")
        .unwrap()
        .parse()
        .unwrap();
    let mut model = GPT::new(tiny(true, true), 1).unwrap();
    for step in first.. {
        // every parameter equals the step, so a reader can tell a torn checkpoint
        model.params_mut().fill(step as f32);
        let json = format!("{{\"step\": {step}}}");
        let ckpt = Checkpoint {
            model: Some(&model),
            extra_files: vec![(STEP_FILE, json.as_bytes())],
            ..Default::default()
        };
        // new names and replacements of existing ones, in turn
        save(&root, &format!("step-{}", step % 3), &ckpt).unwrap();
    }
}

/// The step of the checkpoint `root` resolves to, after checking it is whole.
fn whole_checkpoint_step(root: &Path) -> Result<u64, String> {
    let (model, dir) = load_model(root).map_err(|e| e.to_string())?;
    let json = read_file_verified(&dir, STEP_FILE)
        .map_err(|e| e.to_string())?
        .ok_or("no step file")?;
    let step = serde_json::from_slice::<serde_json::Value>(&json).map_err(|e| e.to_string())?
        ["step"]
        .as_u64()
        .ok_or("no step")?;
    let want = step as f32;
    if model.params().iter().any(|&p| p != want) {
        return Err(format!("{dir:?}: params do not all equal step {want}"));
    }
    Ok(step)
}

#[test]
fn a_killed_saver_leaves_a_loadable_checkpoint() {
    use std::time::{Duration, Instant};
    let root = tempfile::tempdir().unwrap();
    let exe = std::env::current_exe().unwrap();
    for round in 0..8u64 {
        let first = 1 + 1000 * round;
        let mut child = std::process::Command::new(&exe)
            .args([
                "--ignored",
                "--exact",
                "checkpoint::tests::saver_child",
                "--test-threads=1",
            ])
            .env("COHORT_CKPT_CHILD_ROOT", root.path())
            .env("COHORT_CKPT_CHILD_FIRST_STEP", first.to_string())
            .env("COHORT_NUM_THREADS", "1")
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        // Wait until this child has completed a few saves (reads may race with its renames
        // and fail; those are retried), then kill it a little later, mid-save or not.
        let deadline = Instant::now() + Duration::from_secs(30);
        while !matches!(whole_checkpoint_step(root.path()), Ok(s) if s >= first + 2) {
            assert!(
                Instant::now() < deadline,
                "round {round}: child made no progress"
            );
            assert!(
                child.try_wait().unwrap().is_none(),
                "round {round}: child exited"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
        std::thread::sleep(Duration::from_micros(700 * round));
        child.kill().unwrap();
        child.wait().unwrap();
        let step = whole_checkpoint_step(root.path())
            .unwrap_or_else(|e| panic!("round {round}: no whole checkpoint: {e}"));
        assert!(step >= first + 2, "round {round}: went back to step {step}");
    }
}

#[test]
fn mismatches_are_clear_errors() {
    let root = tempfile::tempdir().unwrap();
    let model = GPT::new(tiny(true, true), 1).unwrap();
    let dir = save(root.path(), "c", &model_ckpt(&model)).unwrap();
    let model_file = dir.join(MODEL_FILE);

    // a model with a wider d_model: the first tensor differs in shape
    let mut wider = GPT::new(
        GPTConfig {
            d_model: 10,
            ..tiny(true, true)
        },
        1,
    )
    .unwrap();
    let before = wider.params().to_vec();
    let err = load_params_into(&dir, &mut wider).unwrap_err();
    let msg = err.to_string();
    assert!(
        matches!(&err, CheckpointError::ShapeMismatch { expected, found, .. }
            if expected.len() == 2 && expected[1] == 10 && found[1] == 8),
        "{msg}"
    );
    assert!(
        msg.contains(MODEL_FILE) && msg.contains("[11, 10]"),
        "{msg}"
    );
    assert_eq!(wider.params(), before, "a failed load changes nothing");

    // more layers: tensors missing; fewer: tensors unexpected
    let mut deeper = GPT::new(
        GPTConfig {
            n_layers: 3,
            ..tiny(true, true)
        },
        1,
    )
    .unwrap();
    let err = load_params_into(&dir, &mut deeper).unwrap_err();
    assert!(
        matches!(&err, CheckpointError::MissingTensors { names, .. }
            if names.len() == 12 && names.iter().all(|n| n.starts_with("h.2."))),
        "{err}"
    );
    let mut shallower = GPT::new(
        GPTConfig {
            n_layers: 1,
            ..tiny(true, true)
        },
        1,
    )
    .unwrap();
    let err = load_params_into(&dir, &mut shallower).unwrap_err();
    assert!(
        matches!(&err, CheckpointError::UnexpectedTensor { name, .. } if name.starts_with("h.1.")),
        "{err}"
    );
    // no biases in the model: the file's biases are unexpected
    let mut no_bias = GPT::new(tiny(false, true), 1).unwrap();
    assert!(matches!(
        load_params_into(&dir, &mut no_bias).unwrap_err(),
        CheckpointError::UnexpectedTensor { .. }
    ));

    // an f16 tensor
    let half = [0u8; 2 * 8];
    let views = vec![(
        "ln_f.weight".to_string(),
        safetensors::tensor::TensorView::new(Dtype::F16, vec![8], &half).unwrap(),
    )];
    let f16_dir = root.path().join("f16");
    fs::create_dir(&f16_dir).unwrap();
    safetensors::serialize_to_file(views, None, &f16_dir.join(MODEL_FILE)).unwrap();
    let mut m = GPT::new(tiny(true, true), 1).unwrap();
    let err = load_params_into(&f16_dir, &mut m).unwrap_err();
    assert!(err.to_string().contains("F16"), "{err}");

    // truncated file (caught by its checksum, and without one by the parser), missing file,
    // a directory that is no checkpoint
    fs::write(&model_file, &fs::read(&model_file).unwrap()[..100]).unwrap();
    let err = load_params_into(&dir, &mut m).unwrap_err();
    assert!(matches!(err, CheckpointError::Corrupt { .. }), "{err}");
    fs::remove_file(dir.join(CHECKSUMS_FILE)).unwrap();
    let err = load_params_into(&dir, &mut m).unwrap_err();
    assert!(matches!(err, CheckpointError::Format { .. }), "{err}");
    fs::remove_file(&model_file).unwrap();
    let err = load_params_into(&dir, &mut m).unwrap_err();
    assert!(
        matches!(&err, CheckpointError::Io { op: "read", path, .. } if *path == model_file),
        "{err}"
    );
    let empty = tempfile::tempdir().unwrap();
    assert!(matches!(
        load_model(empty.path()).unwrap_err(),
        CheckpointError::NotACheckpoint { .. }
    ));
    assert!(matches!(
        save(root.path(), "../x", &model_ckpt(&model)).unwrap_err(),
        CheckpointError::BadName { .. }
    ));
}

#[test]
fn unsupported_configs_are_rejected_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let base = serde_json::json!({"model_type": "gpt2", "vocab_size": 11, "n_positions": 8,
        "n_embd": 8, "n_layer": 2, "n_head": 2});
    for (key, value, field) in [
        (
            "activation_function",
            serde_json::json!("relu"),
            "activation_function",
        ),
        (
            "layer_norm_epsilon",
            serde_json::json!(1e-6),
            "layer_norm_epsilon",
        ),
        ("model_type", serde_json::json!("mistral"), "model_type"),
        (
            "scale_attn_by_inverse_layer_idx",
            serde_json::json!(true),
            "scale_attn_weights",
        ),
        (
            "attn_pdrop",
            serde_json::json!(0.0),
            "attn_pdrop/embd_pdrop",
        ),
    ] {
        let mut cfg = base.clone();
        cfg[key] = value;
        fs::write(dir.path().join(CONFIG_FILE), cfg.to_string()).unwrap();
        match load_config(dir.path()) {
            Err(CheckpointError::UnsupportedConfig { field: f, .. }) => assert_eq!(f, field),
            other => panic!("{key}: expected UnsupportedConfig, got {other:?}"),
        }
    }
    let mut cfg = base.clone();
    cfg["n_head"] = 3.into();
    fs::write(dir.path().join(CONFIG_FILE), cfg.to_string()).unwrap();
    let err = load_config(dir.path()).unwrap_err();
    assert!(err.to_string().contains("n_heads"), "{err}");
    fs::write(dir.path().join(CONFIG_FILE), "{not json").unwrap();
    assert!(matches!(
        load_config(dir.path()).unwrap_err(),
        CheckpointError::Format { .. }
    ));
}

/// A file laid out the way Hugging Face's GPT2LMHeadModel.save_pretrained (and older
/// torch-converted files) store it: `transformer.` prefix, causal-mask buffers, the tied
/// head stored too, and a config.json with HF's extra keys and n_inner null.
#[test]
fn loads_a_hugging_face_style_gpt2_file() {
    let cfg = GPTConfig {
        d_ff: 32,
        ..tiny(true, true)
    };
    let model = GPT::new(cfg.clone(), 9).unwrap();
    let (c, t) = (8, 8);
    let dir = tempfile::tempdir().unwrap();
    let config = serde_json::json!({
        "_name_or_path": "tiny", "activation_function": "gelu_new",
        "architectures": ["GPT2LMHeadModel"], "attn_pdrop": 0.1, "bos_token_id": 10,
        "embd_pdrop": 0.1, "eos_token_id": 10, "initializer_range": 0.02,
        "layer_norm_epsilon": 1e-05, "model_type": "gpt2", "n_ctx": 8, "n_embd": c,
        "n_head": 2, "n_inner": null, "n_layer": 2, "n_positions": t,
        "reorder_and_upcast_attn": false, "resid_pdrop": 0.1, "scale_attn_by_inverse_layer_idx": false,
        "scale_attn_weights": true, "summary_activation": null, "summary_first_dropout": 0.1,
        "summary_proj_to_labels": true, "summary_type": "cls_index", "summary_use_proj": true,
        "torch_dtype": "float32", "transformers_version": "4.44.0", "use_cache": true,
        "vocab_size": 11
    });
    fs::write(dir.path().join(CONFIG_FILE), config.to_string()).unwrap();
    let params = model.params();
    let bytes = |x: &[f32]| x.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<u8>>();
    let mut stored: Vec<(String, Vec<usize>, Vec<u8>)> = model
        .param_views()
        .iter()
        .map(|v| {
            (
                format!("transformer.{}", v.name),
                v.shape.clone(),
                bytes(&params[v.range.clone()]),
            )
        })
        .collect();
    let mask: Vec<f32> = (0..t * t)
        .map(|i| ((i % t) <= (i / t)) as u8 as f32)
        .collect();
    for l in 0..2 {
        stored.push((
            format!("transformer.h.{l}.attn.bias"),
            vec![1, 1, t, t],
            bytes(&mask),
        ));
        stored.push((
            format!("transformer.h.{l}.attn.masked_bias"),
            vec![],
            bytes(&[-1e4]),
        ));
    }
    let wte = model
        .param_views()
        .iter()
        .find(|v| v.name == "wte.weight")
        .unwrap();
    stored.push((
        "lm_head.weight".into(),
        wte.shape.clone(),
        bytes(&params[wte.range.clone()]),
    ));
    let views: Vec<_> = stored
        .iter()
        .map(|(n, s, b)| {
            (
                n.clone(),
                safetensors::tensor::TensorView::new(Dtype::F32, s.clone(), b).unwrap(),
            )
        })
        .collect();
    let meta = HashMap::from([("format".to_string(), "pt".to_string())]);
    safetensors::serialize_to_file(views, Some(meta), &dir.path().join(MODEL_FILE)).unwrap();

    let (loaded, _) = load_model(dir.path()).unwrap();
    assert_eq!(
        loaded.config(),
        &GPTConfig {
            dropout: 0.1,
            ..cfg
        }
    );
    assert_eq!(loaded.params(), model.params());

    // a stored head that is not the embedding contradicts tie_word_embeddings
    let last = stored.len() - 1;
    stored[last].2[0] ^= 1;
    let views: Vec<_> = stored
        .iter()
        .map(|(n, s, b)| {
            (
                n.clone(),
                safetensors::tensor::TensorView::new(Dtype::F32, s.clone(), b).unwrap(),
            )
        })
        .collect();
    safetensors::serialize_to_file(views, None, &dir.path().join(MODEL_FILE)).unwrap();
    assert!(matches!(
        load_model(dir.path()).unwrap_err(),
        CheckpointError::UntiedHead { .. }
    ));
}

/// A model file with a NaN weight (here one written without checksums, so nothing else
/// catches it) is refused by name when loaded, not trained from until it "diverges".
#[test]
fn a_nan_weight_is_refused_by_tensor_name() {
    let root = tempfile::tempdir().unwrap();
    let mut model = GPT::new(tiny(true, true), 3).unwrap();
    let at = model
        .param_views()
        .iter()
        .find(|v| v.name == "h.1.mlp.c_fc.weight")
        .unwrap()
        .range
        .start
        + 5;
    model.params_mut()[at] = f32::NAN;
    let dir = save(root.path(), "nan", &model_ckpt(&model)).unwrap();
    fs::remove_file(dir.join(CHECKSUMS_FILE)).unwrap();
    let e = load_model(&dir).unwrap_err().to_string();
    assert!(
        e.contains("model.safetensors")
            && e.contains(
                "tensor \"h.1.mlp.c_fc.weight\" holds a non-finite value (NaN at element 5)"
            ),
        "{e}"
    );
}
