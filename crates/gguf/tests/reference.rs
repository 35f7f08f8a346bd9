//! cohort-gguf against the `gguf` Python package, llama.cpp's own reader and writer: a file that
//! package writes (every metadata value type, every supported tensor type in 1 to 3 dimensions, a
//! 64-byte alignment) must read back with the same metadata, dims, alignment and data offset, and
//! dequantise to the same f32 values, bit for bit, as its `dequantize`.

mod support;

use std::path::{Path, PathBuf};

use cohort_gguf::{GgufFile, Value};
use serde_json::Value as Json;
use support::python::{python_with, run_python};

/// Arrays flattened, as GGUFReader's `contents()` reports nested ones.
fn flatten(v: &Value, out: &mut Vec<Json>) {
    match v {
        Value::Array(items) => items.iter().for_each(|i| flatten(i, out)),
        Value::String(s) => out.push(Json::from(s.as_str())),
        Value::Bool(b) => out.push(Json::from(*b)),
        v => out.push(match (v.as_i64(), v.as_u64(), v.as_f64()) {
            (_, Some(u), _) => Json::from(u),
            (Some(i), _, _) => Json::from(i),
            (_, _, Some(f)) => Json::from(f),
            _ => unreachable!("every scalar is an integer or a float"),
        }),
    }
}

#[test]
fn reads_and_dequantises_what_the_gguf_package_writes() {
    let test = "reads_and_dequantises_what_the_gguf_package_writes";
    let Some(pythonpath) = python_with(test, &["gguf", "numpy"]) else {
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/make_reference.py");
    run_python(&pythonpath, &script, &[tmp.path().to_str().unwrap()]);
    let reference: Json =
        serde_json::from_slice(&std::fs::read(tmp.path().join("reference.json")).unwrap()).unwrap();

    let file = GgufFile::open(tmp.path().join("synthetic.gguf")).unwrap();
    assert_eq!(file.version(), 3);
    assert_eq!(file.alignment(), reference["alignment"].as_u64().unwrap());
    assert_eq!(
        file.data_offset(),
        reference["data_offset"].as_u64().unwrap()
    );

    let meta = reference["metadata"].as_object().unwrap();
    assert_eq!(file.metadata().len(), meta.len());
    for (key, value) in file.metadata() {
        let want = &meta[key];
        assert_eq!(
            value.type_name(),
            want[0].as_str().unwrap(),
            "type of {key}"
        );
        let mut got = Vec::new();
        flatten(value, &mut got);
        let want = match &want[1] {
            Json::Array(a) => a.clone(),
            v => vec![v.clone()],
        };
        assert_eq!(got, want, "value of {key}");
    }
    // Nesting is kept, where the Python reader flattens it.
    let nested = file.get("test.nested").unwrap().as_array().unwrap();
    assert_eq!(nested.len(), 2);
    assert_eq!(nested[1], Value::Array(vec![Value::I32(3)]));

    let tensors = reference["tensors"].as_object().unwrap();
    assert_eq!(file.tensors().len(), tensors.len());
    for t in file.tensors() {
        let want = &tensors[&t.name];
        let dims: Vec<u64> = want["dims"]
            .as_array()
            .unwrap()
            .iter()
            .map(|d| d.as_u64().unwrap())
            .collect();
        assert_eq!(t.dims, dims, "dims of {}", t.name);
        assert_eq!(t.ty.to_string(), want["type"].as_str().unwrap());
        let got = file.dequantize(t).unwrap();
        let want = read_f32(&tmp.path().join(format!("{}.f32", t.name)));
        assert_eq!(got.len(), want.len(), "{}", t.name);
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_eq!(
                g.to_bits(),
                w.to_bits(),
                "{}[{i}]: {g} vs gguf's {w}",
                t.name
            );
        }
    }
}

fn read_f32(path: &Path) -> Vec<f32> {
    std::fs::read(path)
        .unwrap()
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}
