//! A request's inputs as a front end received them (JSON numbers or strings, typed protobuf
//! contents, or raw little-endian bytes), checked against the model's tensor specs and turned
//! into a [`Request`]; and the outputs a request asks for, by name. Every check a request can
//! fail that does not depend on a tensor's values happens here, before anything is queued.
//! This module never parses a protocol's framing (the front ends hand it each input's name,
//! datatype, shape and data) and never touches a model.

use super::{bytes_elements, names, push_element, DataType, Request, Tensor, TensorSpec};
use crate::error::ServeError;

impl DataType {
    /// Little-endian bytes of `v` as this type (a string's serialized form for BYTES, floats
    /// rounded to the nearest value of their type); None when it does not fit (a float that
    /// would round to infinity, or an integer out of range; or is not an integer for an
    /// integer type, or not a string for BYTES, or a string for another type).
    fn encode_json(self, v: &serde_json::Value, out: &mut Vec<u8>) -> Option<()> {
        if v.is_string() != (self == DataType::Bytes) {
            return None;
        }
        match self {
            DataType::Bytes => push_element(out, v.as_str()?.as_bytes())?,
            DataType::Bool => out.push(u8::from(v.as_bool()?)),
            // JSON numbers are finite, so an infinity here is an overflow
            DataType::Fp16 => {
                let h = half::f16::from_f64(v.as_f64()?);
                out.extend_from_slice(&h.is_finite().then_some(h)?.to_le_bytes())
            }
            DataType::Fp32 => {
                let f = v.as_f64()? as f32;
                out.extend_from_slice(&f.is_finite().then_some(f)?.to_le_bytes())
            }
            DataType::Fp64 => out.extend_from_slice(&v.as_f64()?.to_le_bytes()),
            DataType::Uint8 => out.push(u8::try_from(v.as_i64()?).ok()?),
            DataType::Int8 => out.extend_from_slice(&i8::try_from(v.as_i64()?).ok()?.to_le_bytes()),
            DataType::Int16 => {
                out.extend_from_slice(&i16::try_from(v.as_i64()?).ok()?.to_le_bytes())
            }
            DataType::Int32 => {
                out.extend_from_slice(&i32::try_from(v.as_i64()?).ok()?.to_le_bytes())
            }
            DataType::Int64 => out.extend_from_slice(&v.as_i64()?.to_le_bytes()),
            DataType::Uint16 => {
                out.extend_from_slice(&u16::try_from(v.as_u64()?).ok()?.to_le_bytes())
            }
            DataType::Uint32 => {
                out.extend_from_slice(&u32::try_from(v.as_u64()?).ok()?.to_le_bytes())
            }
            DataType::Uint64 => out.extend_from_slice(&v.as_u64()?.to_le_bytes()),
        }
        Some(())
    }
}

/// Where a request's input data is.
pub(crate) enum InputData<'a> {
    /// Row-major little-endian bytes (HTTP binary extension, gRPC raw contents); BYTES
    /// elements serialized (module doc).
    Raw(&'a [u8]),
    /// Typed protobuf contents, already as little-endian bytes of the tensor's type (BYTES
    /// serialized), and how many elements they held.
    Typed(Vec<u8>, usize),
    /// JSON `data`, flat or nested (strings for BYTES).
    Json(&'a serde_json::Value),
}

/// One input as a request names it, before checking.
pub(crate) struct WireInput<'a> {
    pub name: &'a str,
    pub datatype: &'a str,
    pub shape: &'a [i64],
    pub data: InputData<'a>,
}

/// Checks a request's inputs against the model's `specs` (every input exactly once, each of
/// its declared type and shape, `1..=max_batch` rows shared by all) and returns them in the
/// model's order.
pub(crate) fn request(
    model: &str,
    specs: &[TensorSpec],
    max_batch: usize,
    wire: Vec<WireInput<'_>>,
) -> Result<Request, ServeError> {
    if wire.len() != specs.len() {
        return Err(ServeError::InputCount {
            model: model.to_string(),
            expected: specs.len(),
            found: wire.len(),
        });
    }
    let mut slots: Vec<Option<Tensor>> = vec![None; specs.len()];
    for w in wire {
        let Some(i) = specs.iter().position(|s| s.name == w.name) else {
            return Err(ServeError::UnknownTensor {
                model: model.to_string(),
                direction: "input",
                name: w.name.to_string(),
                known: names(specs),
            });
        };
        if slots[i].is_some() {
            return Err(ServeError::malformed(format!(
                "input {:?} is given twice",
                w.name
            )));
        }
        slots[i] = Some(input(&specs[i], max_batch, w)?);
    }
    let inputs: Vec<Tensor> = slots.into_iter().flatten().collect();
    let batch = inputs[0].shape[0];
    if let Some((t, s)) = inputs.iter().zip(specs).find(|(t, _)| t.shape[0] != batch) {
        return Err(ServeError::Shape {
            tensor: s.name.clone(),
            shape: t.wire_shape(),
            reason: format!(
                "its batch dimension differs from {:?}'s ({batch})",
                specs[0].name
            ),
        });
    }
    Ok(Request { batch, inputs })
}

/// Checks one input against its spec.
fn input(spec: &TensorSpec, max_batch: usize, w: WireInput<'_>) -> Result<Tensor, ServeError> {
    let name = w.name;
    let shape = w.shape;
    let dt = spec.datatype;
    if w.datatype != dt.name() {
        return Err(ServeError::Datatype {
            tensor: name.to_string(),
            found: w.datatype.to_string(),
            expected: dt.name(),
        });
    }
    let shape_err = |reason: String| ServeError::Shape {
        tensor: name.to_string(),
        shape: shape.to_vec(),
        reason,
    };
    if shape.len() != spec.shape.len() {
        return Err(shape_err(format!(
            "expected {} dimensions, the model's are {:?} (-1: any size, the first is the batch)",
            spec.shape.len(),
            spec.shape
        )));
    }
    let b = shape[0];
    if b < 1 || b as u64 > max_batch as u64 {
        return Err(shape_err(format!(
            "batch must be in 1..={max_batch} (max_batch_size)"
        )));
    }
    for (i, (&got, &want)) in shape.iter().zip(&spec.shape).enumerate().skip(1) {
        if got < 0 || (want >= 0 && got != want) {
            return Err(shape_err(format!(
                "dimension {i} must be {}",
                if want >= 0 {
                    want.to_string()
                } else {
                    "at least 0".into()
                }
            )));
        }
    }
    let dims: Vec<usize> = shape.iter().map(|&d| d as usize).collect();
    let n: usize = dims.iter().product();
    let size_err = |found: usize, expected: usize, unit| ServeError::DataSize {
        tensor: name.to_string(),
        shape: shape.to_vec(),
        expected,
        found,
        unit,
    };
    let data = match w.data {
        InputData::Raw(bytes) => match dt.size() {
            Some(size) if bytes.len() != n * size => {
                return Err(size_err(bytes.len(), n * size, "bytes"))
            }
            Some(_) => bytes.to_vec(),
            // the byte count says nothing about BYTES elements: walk them
            None => {
                let elements = bytes_elements(bytes).map_err(|reason| ServeError::Bytes {
                    tensor: name.to_string(),
                    reason,
                })?;
                if elements.len() != n {
                    return Err(size_err(elements.len(), n, "elements"));
                }
                bytes.to_vec()
            }
        },
        InputData::Typed(bytes, count) => {
            if count != n {
                return Err(size_err(count, n, "elements"));
            }
            bytes
        }
        InputData::Json(value) => {
            let mut flat = Vec::with_capacity(n);
            flatten(value, &mut flat, 0).map_err(|reason| ServeError::Malformed {
                reason: format!("{name}: data {reason}"),
            })?;
            if flat.len() != n {
                return Err(size_err(flat.len(), n, "elements"));
            }
            let mut bytes = Vec::with_capacity(n * dt.size().unwrap_or(8));
            for (i, v) in flat.into_iter().enumerate() {
                dt.encode_json(v, &mut bytes)
                    .ok_or_else(|| ServeError::Datatype {
                        tensor: format!("{name}[{i}] = {v}"),
                        found: if dt == DataType::Bytes && !v.is_string() {
                            "a non-string".into()
                        } else if v.is_string() && dt != DataType::Bytes {
                            "a string".into()
                        } else if v.is_f64() && !dt.is_float() {
                            "a non-integer".into()
                        } else {
                            "a value that does not fit".into()
                        },
                        expected: dt.name(),
                    })?;
            }
            bytes
        }
    };
    Ok(Tensor {
        datatype: dt,
        shape: dims,
        data,
    })
}

/// Row-major leaves of a (possibly nested) JSON array.
fn flatten<'v>(
    v: &'v serde_json::Value,
    out: &mut Vec<&'v serde_json::Value>,
    depth: usize,
) -> Result<(), String> {
    match v {
        serde_json::Value::Array(items) if depth < 8 => {
            for item in items {
                flatten(item, out, depth + 1)?;
            }
            Ok(())
        }
        serde_json::Value::Array(_) => Err("is nested deeper than 8 levels".into()),
        serde_json::Value::Number(_)
        | serde_json::Value::Bool(_)
        | serde_json::Value::String(_)
            if depth > 0 =>
        {
            out.push(v);
            Ok(())
        }
        _ if depth == 0 => Err("must be an array".into()),
        other => Err(format!("holds {other}, expected numbers or strings")),
    }
}

/// The outputs one request asked for, by index into the model's outputs, in the order the
/// answer lists them.
pub(crate) fn wanted_outputs<'n>(
    model: &str,
    specs: &[TensorSpec],
    requested: impl Iterator<Item = &'n str>,
) -> Result<Vec<usize>, ServeError> {
    let mut out = Vec::new();
    for name in requested {
        let i =
            specs
                .iter()
                .position(|s| s.name == name)
                .ok_or_else(|| ServeError::UnknownTensor {
                    model: model.to_string(),
                    direction: "output",
                    name: name.to_string(),
                    known: names(specs),
                })?;
        out.push(i);
    }
    if out.is_empty() {
        out = (0..specs.len()).collect();
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tensor::{FP32, INPUT_IDS, INT64};
    use serde_json::json;

    fn specs() -> Vec<TensorSpec> {
        vec![TensorSpec::new(INPUT_IDS, DataType::Int64, vec![-1, -1])]
    }

    fn one(shape: &[i64], data: InputData<'_>) -> Result<Request, ServeError> {
        let w = WireInput {
            name: INPUT_IDS,
            datatype: INT64,
            shape,
            data,
        };
        request("m", &specs(), 2, vec![w])
    }

    #[test]
    fn the_three_encodings_give_the_same_tensor() {
        let want = Tensor::from_i64(vec![2, 3], &[1, 2, 3, 4, 5, 9]);
        let raw = want.data.clone();
        assert_eq!(one(&[2, 3], InputData::Raw(&raw)).unwrap().inputs[0], want);
        assert_eq!(
            one(&[2, 3], InputData::Typed(raw.clone(), 6))
                .unwrap()
                .inputs[0],
            want
        );
        let nested = json!([[1, 2, 3], [4, 5, 9]]);
        assert_eq!(
            one(&[2, 3], InputData::Json(&nested)).unwrap().inputs[0],
            want
        );
        let flat = json!([1, 2, 3, 4, 5, 9]);
        let r = one(&[2, 3], InputData::Json(&flat)).unwrap();
        assert_eq!((r.batch, &r.inputs[0]), (2, &want));
    }

    #[test]
    fn bad_inputs_are_refused_with_what_was_wrong() {
        let three = json!([1, 2, 3]);
        let named = |name: &'static str, datatype: &'static str| {
            let w = WireInput {
                name,
                datatype,
                shape: &[1, 3],
                data: InputData::Json(&three),
            };
            request("m", &specs(), 2, vec![w])
        };
        let cases: Vec<(Result<Request, ServeError>, &str)> = vec![
            (named("ids", INT64), "no input tensor \"ids\""),
            (named(INPUT_IDS, "FP32"), "datatype FP32"),
            (one(&[3], InputData::Json(&three)), "2 dimensions"),
            (
                one(&[3, 1], InputData::Json(&three)),
                "batch must be in 1..=2",
            ),
            (one(&[0, 3], InputData::Json(&three)), "batch"),
            (one(&[1, 4], InputData::Json(&three)), "needs 4 elements"),
            (one(&[1, 3], InputData::Raw(&[0; 20])), "needs 24 bytes"),
            (
                one(&[1, 3], InputData::Json(&json!([1, 2.5, 3]))),
                "non-integer",
            ),
            (
                one(&[1, 3], InputData::Json(&json!([1, null, 3]))),
                "expected numbers",
            ),
            (
                one(&[1, 3], InputData::Json(&json!([1, "a", 3]))),
                "datatype a string",
            ),
            (one(&[1, 3], InputData::Json(&json!(7))), "must be an array"),
            (
                request("m", &specs(), 2, Vec::new()),
                "expects 1 input(s), the request has 0",
            ),
        ];
        for (got, needle) in cases {
            let err = got.unwrap_err().to_string();
            assert!(err.contains(needle), "{needle:?} not in {err:?}");
        }
    }

    #[test]
    fn fixed_dimensions_are_checked_and_rows_cut_and_join() {
        let spec = vec![TensorSpec::new("x", DataType::Fp32, vec![-1, 2])];
        let data = json!([[1.0, 2.0], [3.0, 4.5]]);
        let w = |shape: &'static [i64]| WireInput {
            name: "x",
            datatype: FP32,
            shape,
            data: InputData::Json(&data),
        };
        let err = request("m", &spec, 4, vec![w(&[1, 4])]).unwrap_err();
        assert!(err.to_string().contains("dimension 1 must be 2"), "{err}");
        let r = request("m", &spec, 4, vec![w(&[2, 2])]).unwrap();
        let t = &r.inputs[0];
        assert_eq!(t.rows(1..2).json(), json!([3.0, 4.5]));
        let both = Tensor::concat(&[&t.rows(1..2), &t.rows(0..1)]);
        assert_eq!(both.json(), json!([3.0, 4.5, 1.0, 2.0]));
        assert_eq!(both.shape, [2, 2]);
    }

    #[test]
    fn fp16_rounds_json_to_the_nearest_half_and_refuses_what_overflows_by_name() {
        use half::f16;
        let spec = vec![TensorSpec::new("H", DataType::Fp16, vec![-1, 3])];
        let req = |data: &serde_json::Value, datatype: &'static str| {
            let w = WireInput {
                name: "H",
                datatype,
                shape: &[1, 3],
                data: InputData::Json(data),
            };
            request("m", &spec, 4, vec![w])
        };
        // 0.1 is no half: the nearest is 0.0999755859375; 65519 rounds down to the largest
        // half, 65504; 2051.5 lies between 2050 and 2052 and rounds up (truncation would not)
        let t = req(&json!([0.1, 65519, 2051.5]), "FP16")
            .unwrap()
            .inputs
            .remove(0);
        let halves: Vec<f16> = [0.1, 65504.0, 2052.0].map(f16::from_f64).to_vec();
        let want: Vec<u8> = halves.iter().flat_map(|h| h.to_le_bytes()).collect();
        assert_eq!(t.data, want);
        // little-endian, low byte first: 0x2e66, 0x7bff, 0x6802
        assert_eq!(t.data, [0x66, 0x2e, 0xff, 0x7b, 0x02, 0x68]);
        assert_eq!(t.to_f64s(), [0.0999755859375, 65504.0, 2052.0]);
        // written as the f32 of the same value, which reads back as the same half
        assert_eq!(t.json(), json!([halves[0].to_f32(), 65504.0, 2052.0]));
        let back = req(&t.json(), "FP16").unwrap().inputs.remove(0);
        assert_eq!(back, t);
        let raw = req(&json!([0.1, 65519, 2051.5]), "FP16").unwrap().inputs[0]
            .data
            .clone();
        let w = WireInput {
            name: "H",
            datatype: "FP16",
            shape: &[2, 3],
            data: InputData::Raw(&[raw.clone(), raw].concat()),
        };
        let two = request("m", &spec, 4, vec![w]).unwrap().inputs.remove(0);
        assert_eq!(two.rows(1..2), t);
        assert_eq!(Tensor::concat(&[&t, &t]), two);
        let w = WireInput {
            name: "H",
            datatype: "FP16",
            shape: &[1, 3],
            data: InputData::Raw(&[0; 12]),
        };
        let err = request("m", &spec, 4, vec![w]).unwrap_err().to_string();
        assert!(err.contains("needs 6 bytes"), "{err}");

        for (data, needle) in [
            (
                json!([1, 65520, 2]),
                "\"H[1] = 65520\" has datatype a value that does not fit",
            ),
            (json!([1, 2, -1e6]), "\"H[2] = -1000000.0\""),
            (
                json!([1, "2", 3]),
                "\"H[1] = \\\"2\\\"\" has datatype a string",
            ),
        ] {
            let err = req(&data, "FP16").unwrap_err().to_string();
            assert!(
                err.contains(needle) && err.contains("FP16"),
                "{needle:?} not in {err}"
            );
        }
        let err = req(&json!([1, 2, 3]), FP32).unwrap_err().to_string();
        assert!(
            err.contains("datatype FP32, the model expects FP16"),
            "{err}"
        );
        // FP32 overflows are refused the same way rather than turned into infinities
        let spec32 = vec![TensorSpec::new("F", DataType::Fp32, vec![-1])];
        let big = json!([1e39]);
        let w = WireInput {
            name: "F",
            datatype: FP32,
            shape: &[1],
            data: InputData::Json(&big),
        };
        let err = request("m", &spec32, 4, vec![w]).unwrap_err().to_string();
        assert!(err.contains("\"F[0] = 1e+39\""), "{err}");
    }

    #[test]
    fn unsigned_types_take_their_whole_range_and_refuse_the_rest() {
        let one = |dt: DataType, data: serde_json::Value| {
            let spec = vec![TensorSpec::new("U", dt, vec![-1])];
            let w = WireInput {
                name: "U",
                datatype: dt.name(),
                shape: &[2],
                data: InputData::Json(&data),
            };
            request("m", &spec, 4, vec![w]).map(|mut r| r.inputs.remove(0))
        };
        let t = one(DataType::Uint64, json!([u64::MAX, 7])).unwrap();
        assert_eq!(t.data[..8], u64::MAX.to_le_bytes());
        assert_eq!(t.json(), json!([u64::MAX, 7]));
        let t = one(DataType::Uint32, json!([u32::MAX, 0])).unwrap();
        assert_eq!(t.json(), json!([u32::MAX, 0]));
        let t = one(DataType::Uint16, json!([65535, 1])).unwrap();
        assert_eq!(t.data, [0xff, 0xff, 1, 0]);
        assert_eq!(t.to_f64s(), [65535.0, 1.0]);
        for (dt, bad) in [
            (DataType::Uint16, json!([65536, 0])),
            (DataType::Uint32, json!([0, 4294967296u64])),
            (DataType::Uint64, json!([-1, 0])),
            (DataType::Uint16, json!([1.5, 0])),
        ] {
            let err = one(dt, bad.clone()).unwrap_err().to_string();
            assert!(
                err.contains(dt.name()) && err.contains("\"U["),
                "{bad}: {err}"
            );
        }
        for dt in DataType::ALL {
            assert_eq!(DataType::from_name(dt.name()), Some(dt));
            assert_eq!(DataType::from_triton(dt.triton()), Some(dt));
        }
        assert_eq!(DataType::from_triton("TYPE_FP16"), Some(DataType::Fp16));
        assert_eq!(DataType::Fp16.size(), Some(2));
    }

    #[test]
    fn bytes_tensors_come_in_every_encoding_and_cut_and_join_by_their_prefixes() {
        let spec = vec![TensorSpec::new("TEXT", DataType::Bytes, vec![-1, 2])];
        let words = ["", "héllo", "a", "longer text"];
        let want = Tensor::from_bytes(vec![2, 2], &words);
        let req = |shape: &'static [i64], data| {
            let w = WireInput {
                name: "TEXT",
                datatype: "BYTES",
                shape,
                data,
            };
            request("m", &spec, 4, vec![w])
        };
        let raw = want.data.clone();
        assert_eq!(req(&[2, 2], InputData::Raw(&raw)).unwrap().inputs[0], want);
        let json = json!([["", "héllo"], ["a", "longer text"]]);
        let t = req(&[2, 2], InputData::Json(&json))
            .unwrap()
            .inputs
            .remove(0);
        assert_eq!(t, want);
        assert_eq!(t.json(), json!(words));
        assert_eq!(
            t.byte_elements().unwrap(),
            words.map(str::as_bytes).to_vec()
        );
        // rows are found by walking the prefixes, whatever the elements' lengths
        assert_eq!(t.rows(1..2).json(), json!(["a", "longer text"]));
        assert_eq!(t.rows(0..1).json(), json!(["", "héllo"]));
        let both = Tensor::concat(&[&t.rows(1..2), &t.rows(0..1), &t.rows(1..2)]);
        assert_eq!(both.shape, [3, 2]);
        assert_eq!(
            both.rows(1..3).json(),
            json!(["", "héllo", "a", "longer text"])
        );

        let cut = &raw[..raw.len() - 2];
        let err = req(&[2, 2], InputData::Raw(cut)).unwrap_err().to_string();
        assert!(
            err.contains("\"TEXT\"") && err.contains("element 3's length prefix says 11"),
            "{err}"
        );
        let err = req(&[2, 2], InputData::Raw(&raw[..raw.len() - 13]))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("element 3's 4-byte length prefix is cut short"),
            "{err}"
        );
        let err = req(&[2, 2], InputData::Raw(&raw[..raw.len() - 15]))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("needs 4 elements, the request holds 3"),
            "{err}"
        );
        let mixed = json!(["a", 1, "b", "c"]);
        let err = req(&[2, 2], InputData::Json(&mixed))
            .unwrap_err()
            .to_string();
        assert!(err.contains("a non-string"), "{err}");
        let err = req(&[1, 2], InputData::Typed(raw.clone(), 4))
            .unwrap_err()
            .to_string();
        assert!(err.contains("needs 2 elements"), "{err}");
        // JSON cannot carry bytes that are not UTF-8; the binary forms do, unchanged
        let odd = Tensor::from_bytes(vec![1], &[&b"\xffok"[..]]);
        assert_eq!(odd.json(), json!(["\u{fffd}ok"]));
        assert_eq!(odd.byte_elements().unwrap(), [&b"\xffok"[..]]);
    }
}
