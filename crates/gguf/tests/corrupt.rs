//! Truncated and corrupt files: every one is an error that names the file and what was being read
//! (key, tensor, offset), never a panic; and a type that cannot be dequantised names the tensor
//! and the type.

mod support;

use std::path::Path;

use cohort_gguf::{GgufError, GgufFile};
use support::Writer;

fn small() -> Writer {
    let mut w = Writer::default();
    w.kv_str("general.architecture", "llama")
        .kv_u32("llama.block_count", 1)
        .kv_strs("tokenizer.ggml.tokens", &["a", "b", "Ġc"])
        .tensor_f32("a.weight", &[4, 2], &[1., 2., 3., 4., 5., 6., 7., 8.])
        .tensor("q.weight", &[32], 8, &[0u8; 34]);
    w
}

fn open(dir: &Path, bytes: &[u8]) -> Result<GgufFile, GgufError> {
    let path = dir.join("model.gguf");
    std::fs::write(&path, bytes).unwrap();
    GgufFile::open(&path)
}

/// The message of an error, checked to be one line naming the file.
fn message(dir: &Path, e: GgufError) -> String {
    let msg = e.to_string();
    assert!(!msg.contains('\n'), "{msg}");
    assert!(
        msg.contains(&dir.join("model.gguf").display().to_string()),
        "{msg}"
    );
    msg
}

#[test]
fn a_well_formed_file_reads() {
    let dir = tempfile::tempdir().unwrap();
    let f = open(dir.path(), &small().bytes()).unwrap();
    assert_eq!(f.str("general.architecture").unwrap(), "llama");
    assert_eq!(f.u64("llama.block_count").unwrap(), 1);
    assert_eq!(
        f.opt_strings("tokenizer.ggml.tokens").unwrap().unwrap(),
        ["a", "b", "Ġc"]
    );
    let a = f.tensor("a.weight").unwrap();
    assert_eq!(a.shape(), [2, 4]);
    assert_eq!(f.dequantize(a).unwrap(), [1., 2., 3., 4., 5., 6., 7., 8.]);
    assert_eq!(
        f.dequantize(f.tensor("q.weight").unwrap()).unwrap(),
        [0.0; 32]
    );
    assert_eq!(f.data_offset() % 32, 0);
}

#[test]
fn version_2_reads_as_version_3() {
    // v3 only added big-endian files (marked by the byte order of this very field).
    let dir = tempfile::tempdir().unwrap();
    let mut bytes = small().bytes();
    bytes[4..8].copy_from_slice(&2u32.to_le_bytes());
    let f = open(dir.path(), &bytes).unwrap();
    assert_eq!(f.version(), 2);
    assert_eq!(f.tensors().len(), 2);
}

#[test]
fn a_key_of_another_type_is_an_error_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let f = open(dir.path(), &small().bytes()).unwrap();
    let msg = message(dir.path(), f.u64("general.architecture").unwrap_err());
    assert!(
        msg.ends_with(
            "metadata key general.architecture is a STRING, expected a non-negative integer"
        ),
        "{msg}"
    );
    let msg = message(dir.path(), f.str("tokenizer.ggml.model").unwrap_err());
    assert!(
        msg.ends_with("metadata key tokenizer.ggml.model is missing"),
        "{msg}"
    );
    let msg = message(dir.path(), f.opt_ints("tokenizer.ggml.tokens").unwrap_err());
    assert!(
        msg.contains("is an ARRAY of 3 elements, expected an ARRAY of integers"),
        "{msg}"
    );
}

#[test]
fn every_truncation_is_an_error_naming_the_file_and_what_was_read() {
    let dir = tempfile::tempdir().unwrap();
    let bytes = small().bytes();
    for len in 0..bytes.len() {
        let e =
            open(dir.path(), &bytes[..len]).expect_err(&format!("a file cut at {len} bytes opens"));
        let msg = message(dir.path(), e);
        if len >= 4 {
            assert!(
                msg.contains("truncated") && msg.contains("offset"),
                "cut at {len}: {msg}"
            );
        }
    }
    // Cut inside the last tensor's data: named, with its offsets.
    let msg = message(
        dir.path(),
        open(dir.path(), &bytes[..bytes.len() - 1]).unwrap_err(),
    );
    assert!(
        msg.contains("tensor q.weight") && msg.contains("needs 34 bytes"),
        "{msg}"
    );
}

#[test]
fn corrupt_fields_are_errors_naming_the_field() {
    let dir = tempfile::tempdir().unwrap();
    let good = small().bytes();
    let mut cases: Vec<(Vec<u8>, &str)> = Vec::new();

    let mut b = good.clone();
    b[..4].copy_from_slice(b"GGML");
    cases.push((b, "not a GGUF file"));
    let mut b = good.clone();
    b[4..8].copy_from_slice(&1u32.to_le_bytes());
    cases.push((b, "GGUF version 1 is not supported"));
    let mut b = good.clone();
    b[4..8].copy_from_slice(&3u32.to_be_bytes());
    cases.push((b, "big-endian"));
    // A tensor count far beyond the file: fails at the first missing entry, allocating nothing.
    let mut b = good.clone();
    b[8..16].copy_from_slice(&u64::MAX.to_le_bytes());
    cases.push((b, "tensor"));
    // A key length far beyond the file.
    let mut b = good.clone();
    b[24..32].copy_from_slice(&(1u64 << 62).to_le_bytes());
    cases.push((b, "the key of metadata entry 0"));

    let mut w = Writer::default();
    w.kv_raw("bad.type", 13, &[0; 8]);
    cases.push((
        w.bytes(),
        "metadata key bad.type at offset 40: value type 13",
    ));
    let mut w = Writer::default();
    w.kv_raw("bad.bool", 7, &[2]);
    cases.push((w.bytes(), "metadata key bad.bool"));
    let mut w = Writer::default();
    w.kv_raw("bad.utf8", 8, &[2, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xfe]);
    cases.push((w.bytes(), "not UTF-8"));
    let mut w = Writer::default();
    let mut arr = 9u32.to_le_bytes().to_vec();
    arr.extend(u64::MAX.to_le_bytes());
    w.kv_raw("bad.array", 9, &arr);
    cases.push((w.bytes(), "element 0 of metadata key bad.array"));
    let mut w = Writer::default();
    w.kv_u32("general.alignment", 0);
    cases.push((w.bytes(), "general.alignment"));
    let mut w = Writer::default();
    w.kv_u32("k", 1).kv_u32("k", 2);
    cases.push((w.bytes(), "the key appears twice"));
    let mut w = Writer::default();
    w.tensor_f32("t", &[1], &[1.0])
        .tensor_f32("t", &[1], &[2.0]);
    cases.push((w.bytes(), "tensor t at offset"));
    let mut w = Writer::default();
    w.tensor("five", &[1, 1, 1, 1, 1], 0, &[0; 4]);
    cases.push((w.bytes(), "5 dimensions"));
    let mut w = Writer::default();
    w.tensor("q", &[16], 8, &[0; 34]);
    cases.push((w.bytes(), "not a multiple of Q8_0's block of 32"));
    let mut w = Writer::default();
    w.tensor("huge", &[u64::MAX, 2], 0, &[]);
    cases.push((w.bytes(), "overflow"));
    // A tensor whose offset points past the end.
    let mut w = Writer::default();
    w.tensor_f32("far", &[4], &[0.0; 4]);
    let mut b = w.bytes();
    let info_offset_field = 24 + 8 + 3 + 4 + 8 + 4;
    b[info_offset_field..info_offset_field + 8].copy_from_slice(&(1u64 << 20).to_le_bytes());
    cases.push((b, "the data of tensor far"));

    for (bytes, want) in cases {
        let msg = message(dir.path(), open(dir.path(), &bytes).unwrap_err());
        assert!(msg.contains(want), "expected {want:?} in: {msg}");
    }
}

#[test]
fn an_unsupported_type_names_the_tensor_and_the_type() {
    let dir = tempfile::tempdir().unwrap();
    let mut w = Writer::default();
    // Q5_0 (22-byte blocks), Q4_K (144-byte blocks of 256) and a type ggml does not define.
    w.tensor("blk.0.attn_v.weight", &[32], 6, &[0; 22])
        .tensor("k.weight", &[256], 12, &[0; 144])
        .tensor("odd.weight", &[4], 99, &[]);
    let f = open(dir.path(), &w.bytes()).unwrap();
    for (name, ty) in [
        ("blk.0.attn_v.weight", "Q5_0"),
        ("k.weight", "Q4_K"),
        ("odd.weight", "unknown ggml type 99"),
    ] {
        let msg = message(
            dir.path(),
            f.dequantize(f.tensor(name).unwrap()).unwrap_err(),
        );
        assert!(
            msg.contains(&format!("tensor {name} has type {ty}")),
            "{msg}"
        );
    }
}

#[test]
fn a_missing_file_names_it() {
    let dir = tempfile::tempdir().unwrap();
    let msg = message(
        dir.path(),
        GgufFile::open(dir.path().join("model.gguf")).unwrap_err(),
    );
    assert!(msg.starts_with("open "), "{msg}");
}
