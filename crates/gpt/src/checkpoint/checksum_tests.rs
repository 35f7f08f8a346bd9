//! The checksums' formats: what format 2 (`CHECKSUMS`, CRC-32C) catches, that checkpoints of
//! format 1 (`SHA256SUMS`, and shard indexes with SHA-256 digests) still load and are still
//! checked, and that the one-pass writer writes the bytes the safetensors crate would.

use std::collections::BTreeMap;

use sha2::Digest as _;

use super::*;

fn tiny() -> GPTConfig {
    GPTConfig {
        vocab_size: 11,
        max_position_embeddings: 8,
        n_layers: 2,
        n_heads: 2,
        d_model: 8,
        d_ff: 16,
        dropout: 0.0,
        ..GPTConfig::default()
    }
}

fn sha256_hex(path: &Path) -> String {
    hex(&Sha256::digest(fs::read(path).unwrap()))
}

/// Turns the format-2 checkpoint `dir` into what an older version wrote: `SHA256SUMS` in
/// `sha256sum`'s format in place of `CHECKSUMS`.
fn as_format_1(dir: &Path) {
    let sums = fs::read_to_string(dir.join(CHECKSUMS_FILE)).unwrap();
    let mut text = String::new();
    for line in sums.lines().filter(|l| !l.starts_with('#')) {
        let name = line.splitn(3, ' ').nth(2).unwrap();
        text.push_str(&format!("{}  {name}\n", sha256_hex(&dir.join(name))));
    }
    fs::write(dir.join(SHA256SUMS_FILE), text).unwrap();
    fs::remove_file(dir.join(CHECKSUMS_FILE)).unwrap();
}

/// Flips one bit of `path` at `at`.
fn flip(path: &Path, at: usize) {
    let mut bytes = fs::read(path).unwrap();
    bytes[at] ^= 0x08;
    fs::write(path, &bytes).unwrap();
}

#[test]
fn a_checkpoint_with_sha256sums_still_loads_and_is_still_checked() {
    let root = tempfile::tempdir().unwrap();
    let model = GPT::new(tiny(), 3).unwrap();
    let moments: Vec<f32> = (0..model.num_params()).map(|i| i as f32).collect();
    let dir = save(
        root.path(),
        "step-1",
        &Checkpoint {
            model: Some(&model),
            tensor_files: vec![TensorFile {
                name: "optimizer.safetensors",
                tensors: vec![("exp_avg".to_string(), &moments[..])],
                metadata: HashMap::from([("step".to_string(), "1".to_string())]),
            }],
            extra_files: vec![("trainer_state.json", b"{\"step\": 1}")],
            ..Default::default()
        },
    )
    .unwrap();
    as_format_1(&dir);
    match std::process::Command::new("sha256sum")
        .args(["--check", "--quiet", SHA256SUMS_FILE])
        .current_dir(&dir)
        .status()
    {
        Ok(status) => assert!(
            status.success(),
            "sha256sum -c rejects the test's SHA256SUMS"
        ),
        Err(e) => eprintln!("skipping the sha256sum -c cross-check: {e}"),
    }
    assert!(verify(&dir).unwrap());
    let (loaded, _) = load_model(root.path()).unwrap();
    assert_eq!(loaded.params(), model.params());
    let file = read_tensor_file(&dir, "optimizer.safetensors")
        .unwrap()
        .unwrap();
    assert_eq!(file.tensors[0].1, moments);

    // Damage is still found, by SHA-256, naming SHA256SUMS.
    let path = dir.join(MODEL_FILE);
    let len = fs::metadata(&path).unwrap().len() as usize;
    flip(&path, len - 1);
    let err = load_model(root.path()).unwrap_err();
    let msg = err.to_string();
    assert!(
        matches!(
            &err,
            CheckpointError::Corrupt {
                what: "SHA-256",
                list: SHA256SUMS_FILE,
                ..
            }
        ),
        "{msg}"
    );
    assert!(msg.contains(MODEL_FILE), "{msg}");
    assert!(verify(&dir).is_err());
    flip(&path, len - 1);
    flip(&dir.join("trainer_state.json"), 2);
    let err = read_file_verified(&dir, "trainer_state.json").unwrap_err();
    assert!(matches!(err, CheckpointError::Corrupt { .. }), "{err}");
}

#[test]
fn crc32c_finds_one_flipped_bit_anywhere_in_a_large_file() {
    // Larger than the writer's windows, so that the writeback-and-drop path runs too.
    let n = (40 << 20) / 4;
    let values: Vec<f32> = (0..n).map(|i| (i % 977) as f32 * 0.5).collect();
    let root = tempfile::tempdir().unwrap();
    let dir = save(
        root.path(),
        "step-1",
        &Checkpoint {
            tensor_files: vec![TensorFile {
                name: "big.safetensors",
                tensors: vec![("v".to_string(), &values[..])],
                metadata: HashMap::new(),
            }],
            ..Default::default()
        },
    )
    .unwrap();
    let back = read_tensor_file(&dir, "big.safetensors").unwrap().unwrap();
    assert!(back.tensors[0].1 == values);
    let path = dir.join("big.safetensors");
    let len = fs::metadata(&path).unwrap().len() as usize;
    for at in [0, 9, len / 3, len / 2 + 12_345, len - 1] {
        flip(&path, at);
        let err = read_tensor_file(&dir, "big.safetensors").unwrap_err();
        assert!(
            matches!(&err, CheckpointError::Corrupt { what: "CRC-32C", list: CHECKSUMS_FILE, size, .. }
                if *size == len as u64),
            "bit at {at}: {err}"
        );
        assert!(verify(&dir).is_err(), "bit at {at}");
        flip(&path, at);
    }
    assert!(verify(&dir).unwrap());
}

#[test]
fn the_writer_writes_the_bytes_the_safetensors_crate_writes() {
    let a: Vec<f32> = (0..24).map(|i| i as f32 - 3.5).collect();
    let b = [f32::MIN_POSITIVE, -0.0, 1e30];
    let c: Vec<f32> = Vec::new();
    let views = || {
        vec![
            ("zeta \"quoted\"".to_string(), (vec![2, 3, 4], &a[..])),
            ("alpha".to_string(), (vec![3], &b[..])),
            ("empty".to_string(), (vec![0, 5], &c[..])),
        ]
    };
    for metadata in [
        HashMap::new(),
        HashMap::from([("format".into(), "pt".into())]),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.safetensors");
        let tensors = (views().into_iter())
            .map(|(name, (shape, data))| (name, F32View { shape, data }))
            .collect();
        let sum = write_safetensors(&path, tensors, metadata.clone()).unwrap();
        let ours = fs::read(&path).unwrap();
        struct Crate<'a>(Vec<usize>, &'a [f32]);
        impl safetensors::tensor::View for Crate<'_> {
            fn dtype(&self) -> Dtype {
                Dtype::F32
            }
            fn shape(&self) -> &[usize] {
                &self.0
            }
            fn data(&self) -> std::borrow::Cow<'_, [u8]> {
                self.1.iter().flat_map(|x| x.to_le_bytes()).collect()
            }
            fn data_len(&self) -> usize {
                self.1.len() * 4
            }
        }
        let theirs = safetensors::serialize(
            views()
                .into_iter()
                .map(|(name, (shape, data))| (name, Crate(shape, data))),
            (!metadata.is_empty()).then_some(metadata),
        )
        .unwrap();
        assert!(ours == theirs, "{:?}\n{:?}", ours, theirs);
        assert_eq!(sum.digest, Digest::Crc32c(crc32c::crc32c(&ours)));
        assert_eq!(sum.size, Some(ours.len() as u64));
    }
}

#[test]
fn a_sharded_checkpoint_of_format_1_still_loads_and_is_still_checked() {
    let model = GPT::new(tiny(), 1).unwrap();
    let n = model.num_params();
    let root = tempfile::tempdir().unwrap();
    let staging = begin_sharded(root.path(), "step-1").unwrap();
    let pieces = [Piece {
        start: 0,
        end: n,
        at: 0,
    }];
    let record = write_shard(&staging, 0, 1, &pieces, &[(PARAMS_BUFFER, model.params())]).unwrap();
    assert!(record.digest.starts_with("crc32c:"), "{record:?}");
    let index =
        ShardIndex::new(n, vec![PARAMS_BUFFER.into()], BTreeMap::new(), vec![record]).unwrap();
    let config = model.config();
    let dir = commit_sharded(
        root.path(),
        "step-1",
        config,
        &Checkpoint::default(),
        &index,
    )
    .unwrap();

    // What an older version wrote: the index of format 1 with SHA-256 digests, SHA256SUMS.
    let shard = dir.join(&index.shards[0].file);
    let mut json: serde_json::Value =
        serde_json::from_slice(&fs::read(dir.join(SHARD_INDEX_FILE)).unwrap()).unwrap();
    json["format"] = "cohort-flat-shards/1".into();
    let record = json["shards"][0].as_object_mut().unwrap();
    record.remove("digest");
    record.insert("sha256".into(), sha256_hex(&shard).into());
    fs::write(
        dir.join(SHARD_INDEX_FILE),
        serde_json::to_vec_pretty(&json).unwrap(),
    )
    .unwrap();
    as_format_1(&dir);
    assert!(verify(&dir).unwrap());
    let (loaded, _) = load_model(root.path()).unwrap();
    assert_eq!(loaded.params(), model.params());

    let len = fs::metadata(&shard).unwrap().len() as usize;
    flip(&shard, len - 2);
    let err = load_model(root.path()).unwrap_err();
    let CheckpointError::Shard { source, .. } = &err else {
        panic!("{err}");
    };
    assert!(
        matches!(
            **source,
            CheckpointError::Corrupt {
                what: "SHA-256",
                list: SHARD_INDEX_FILE,
                ..
            }
        ),
        "{err}"
    );
}
