//! Tensors independent of the wire and of any backend: the KServe datatypes a model may take,
//! a tensor as row-major little-endian bytes with its shape, what a model declares about each
//! of its tensors (name, datatype, shape with -1 for any size, the batch dimension first), and
//! a checked [`Request`] of a model. Its child `wire` holds the checks that turn a request's
//! inputs as a front end received them into such a [`Request`]. This module never touches a
//! model and never reads a request off the wire itself.
//!
//! BYTES tensors (Triton's `TYPE_STRING`) have elements of any length. They are kept in
//! Triton's serialized form, each element a 4-byte little-endian length then its bytes: what
//! the HTTP binary extension and gRPC's raw contents carry, so they pass through unconverted,
//! and rows are cut and joined by walking the prefixes. A BYTES tensor's data is checked to be
//! exactly its shape's elements in that form when it is built from a request, so the walks
//! after that never meet a cut-short prefix.
//!
//! FP16 tensors hold IEEE 754 half-precision elements, two little-endian bytes each (what
//! Triton's clients send for numpy's float16). JSON carries them as numbers: a request's are
//! rounded to the nearest half (one that would round to infinity is refused, as an integer
//! that does not fit its type is), and an answer's are written as the f32 of the same value,
//! which rounds back to the same half. KServe's typed protobuf contents have no field for
//! them; only raw contents carry them over gRPC.

mod wire;

pub(crate) use wire::{request, wanted_outputs, InputData, WireInput};

/// The input of cohort's GPT models: token ids, INT64 `[batch, seq]`.
pub const INPUT_IDS: &str = "input_ids";
/// Output of cohort's GPT models: the logits of every position, FP32 `[batch, seq, vocab]`.
pub const LOGITS: &str = "logits";
/// Output of cohort's GPT models: the most likely next token after each row, INT64 `[batch]`.
pub const NEXT_TOKEN: &str = "next_token";

/// The KServe datatype of `input_ids` and `next_token`.
pub const INT64: &str = "INT64";
/// The KServe datatype of `logits`.
pub const FP32: &str = "FP32";

/// A tensor element type, as KServe names it (`FP32`) and Triton's configs do (`TYPE_FP32`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DataType {
    /// One byte, 0 or 1.
    Bool,
    /// u8.
    Uint8,
    /// i8.
    Int8,
    /// i16.
    Int16,
    /// i32.
    Int32,
    /// i64.
    Int64,
    /// u16.
    Uint16,
    /// u32.
    Uint32,
    /// u64.
    Uint64,
    /// IEEE 754 half precision (`half::f16`); see the module doc.
    Fp16,
    /// f32.
    Fp32,
    /// f64.
    Fp64,
    /// Byte strings of any length (text, usually UTF-8); stored serialized (module doc).
    Bytes,
}

impl DataType {
    /// Every datatype served.
    pub const ALL: [DataType; 13] = [
        DataType::Bool,
        DataType::Uint8,
        DataType::Int8,
        DataType::Int16,
        DataType::Int32,
        DataType::Int64,
        DataType::Uint16,
        DataType::Uint32,
        DataType::Uint64,
        DataType::Fp16,
        DataType::Fp32,
        DataType::Fp64,
        DataType::Bytes,
    ];

    /// KServe's name (`FP32`).
    pub fn name(self) -> &'static str {
        match self {
            DataType::Bool => "BOOL",
            DataType::Uint8 => "UINT8",
            DataType::Int8 => "INT8",
            DataType::Int16 => "INT16",
            DataType::Int32 => "INT32",
            DataType::Int64 => INT64,
            DataType::Uint16 => "UINT16",
            DataType::Uint32 => "UINT32",
            DataType::Uint64 => "UINT64",
            DataType::Fp16 => "FP16",
            DataType::Fp32 => FP32,
            DataType::Fp64 => "FP64",
            DataType::Bytes => "BYTES",
        }
    }

    /// Triton's config name (`TYPE_FP32`).
    pub fn triton(self) -> &'static str {
        match self {
            DataType::Bool => "TYPE_BOOL",
            DataType::Uint8 => "TYPE_UINT8",
            DataType::Int8 => "TYPE_INT8",
            DataType::Int16 => "TYPE_INT16",
            DataType::Int32 => "TYPE_INT32",
            DataType::Int64 => "TYPE_INT64",
            DataType::Uint16 => "TYPE_UINT16",
            DataType::Uint32 => "TYPE_UINT32",
            DataType::Uint64 => "TYPE_UINT64",
            DataType::Fp16 => "TYPE_FP16",
            DataType::Fp32 => "TYPE_FP32",
            DataType::Fp64 => "TYPE_FP64",
            DataType::Bytes => "TYPE_STRING",
        }
    }

    /// Bytes per element; None for BYTES, whose elements vary.
    pub fn size(self) -> Option<usize> {
        match self {
            DataType::Bool | DataType::Uint8 | DataType::Int8 => Some(1),
            DataType::Int16 | DataType::Uint16 | DataType::Fp16 => Some(2),
            DataType::Int32 | DataType::Uint32 | DataType::Fp32 => Some(4),
            DataType::Int64 | DataType::Uint64 | DataType::Fp64 => Some(8),
            DataType::Bytes => None,
        }
    }

    /// The datatype KServe calls `name`.
    pub fn from_name(name: &str) -> Option<DataType> {
        DataType::ALL.into_iter().find(|d| d.name() == name)
    }

    /// The datatype a Triton config calls `name`.
    pub fn from_triton(name: &str) -> Option<DataType> {
        DataType::ALL.into_iter().find(|d| d.triton() == name)
    }

    /// Whether elements are floating point.
    pub fn is_float(self) -> bool {
        matches!(self, DataType::Fp16 | DataType::Fp32 | DataType::Fp64)
    }
}

impl std::fmt::Display for DataType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// A tensor: its type, its shape and its elements as row-major little-endian bytes (what the
/// binary protocols carry, so requests and batches are cut and joined without converting).
#[derive(Debug, Clone, PartialEq)]
pub struct Tensor {
    /// The element type.
    pub datatype: DataType,
    /// The shape, batch dimension first for a model that batches.
    pub shape: Vec<usize>,
    /// `shape.product() * datatype.size()` bytes; for BYTES, `shape.product()` elements in
    /// the serialized form (module doc).
    pub data: Vec<u8>,
}

/// Appends `element` in BYTES' serialized form; None when it is 4 GiB or longer, which the
/// 4-byte prefix cannot say.
fn push_element(out: &mut Vec<u8>, element: &[u8]) -> Option<()> {
    out.extend_from_slice(&u32::try_from(element.len()).ok()?.to_le_bytes());
    out.extend_from_slice(element);
    Some(())
}

/// The elements of BYTES data in the serialized form, or why it is not exactly such
/// elements (naming the element at fault).
pub(crate) fn bytes_elements(data: &[u8]) -> Result<Vec<&[u8]>, String> {
    let mut out = Vec::new();
    let mut rest = data;
    while !rest.is_empty() {
        let i = out.len();
        let Some((len, tail)) = rest.split_first_chunk::<4>() else {
            return Err(format!(
                "BYTES element {i}'s 4-byte length prefix is cut short ({} byte(s) left)",
                rest.len()
            ));
        };
        let n = u32::from_le_bytes(*len) as usize;
        let Some((element, tail)) = tail.split_at_checked(n) else {
            return Err(format!(
                "BYTES element {i}'s length prefix says {n} bytes, only {} follow",
                tail.len()
            ));
        };
        out.push(element);
        rest = tail;
    }
    Ok(out)
}

/// Where each of the first `count` elements of serialized BYTES data ends (the walk stops early
/// at data that is cut short, which a checked tensor never has).
fn bytes_ends(data: &[u8], count: usize) -> Vec<usize> {
    let mut ends = Vec::with_capacity(count);
    let mut at = 0;
    while ends.len() < count {
        let Some(len) = data.get(at..at + 4) else {
            break;
        };
        let n = u32::from_le_bytes([len[0], len[1], len[2], len[3]]) as usize;
        at = (at + 4 + n).min(data.len());
        ends.push(at);
    }
    ends
}

impl Tensor {
    /// An FP32 tensor.
    pub fn from_f32(shape: Vec<usize>, values: &[f32]) -> Tensor {
        Tensor {
            datatype: DataType::Fp32,
            shape,
            data: values.iter().flat_map(|x| x.to_le_bytes()).collect(),
        }
    }

    /// An INT64 tensor.
    pub fn from_i64(shape: Vec<usize>, values: &[i64]) -> Tensor {
        Tensor {
            datatype: DataType::Int64,
            shape,
            data: values.iter().flat_map(|x| x.to_le_bytes()).collect(),
        }
    }

    /// A BYTES tensor of `elements` (row-major).
    pub fn from_bytes<E: AsRef<[u8]>>(shape: Vec<usize>, elements: &[E]) -> Tensor {
        let mut data = Vec::new();
        for e in elements {
            // an element of 4 GiB or more is beyond any request cohort accepts
            let e = e.as_ref();
            data.extend_from_slice(&(e.len() as u32).to_le_bytes());
            data.extend_from_slice(e);
        }
        Tensor {
            datatype: DataType::Bytes,
            shape,
            data,
        }
    }

    /// The elements of a BYTES tensor; None for another type.
    pub fn byte_elements(&self) -> Option<Vec<&[u8]>> {
        (self.datatype == DataType::Bytes).then(|| {
            let mut start = 0;
            bytes_ends(&self.data, self.len())
                .into_iter()
                .map(|end| {
                    let e = &self.data[start + 4..end];
                    start = end;
                    e
                })
                .collect()
        })
    }

    /// Elements.
    pub fn len(&self) -> usize {
        self.shape.iter().product()
    }

    /// Whether it has no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The INT64 elements; None for another type.
    pub fn i64s(&self) -> Option<Vec<i64>> {
        (self.datatype == DataType::Int64).then(|| {
            self.data
                .chunks_exact(8)
                .map(|c| i64::from_le_bytes(c.try_into().expect("8-byte chunk")))
                .collect()
        })
    }

    /// The elements as f64 (exact for every type but INT64 and UINT64 beyond 2^53), for JSON
    /// answers and comparisons; none for BYTES.
    pub fn to_f64s(&self) -> Vec<f64> {
        let Some(n) = self.datatype.size() else {
            return Vec::new();
        };
        self.data
            .chunks_exact(n)
            .map(|c| match self.datatype {
                DataType::Bool | DataType::Uint8 => f64::from(c[0]),
                DataType::Int8 => f64::from(c[0] as i8),
                DataType::Int16 => f64::from(i16::from_le_bytes([c[0], c[1]])),
                DataType::Int32 => f64::from(i32::from_le_bytes(c.try_into().expect("4 bytes"))),
                DataType::Int64 => i64::from_le_bytes(c.try_into().expect("8 bytes")) as f64,
                DataType::Uint16 => f64::from(u16::from_le_bytes([c[0], c[1]])),
                DataType::Uint32 => f64::from(u32::from_le_bytes(c.try_into().expect("4 bytes"))),
                DataType::Uint64 => u64::from_le_bytes(c.try_into().expect("8 bytes")) as f64,
                DataType::Fp16 => half::f16::from_le_bytes([c[0], c[1]]).to_f64(),
                DataType::Fp32 => f64::from(f32::from_le_bytes(c.try_into().expect("4 bytes"))),
                DataType::Fp64 => f64::from_le_bytes(c.try_into().expect("8 bytes")),
                DataType::Bytes => f64::NAN,
            })
            .collect()
    }

    /// The elements as a flat JSON array of the type's natural JSON values (strings for BYTES:
    /// JSON cannot carry other bytes, so an element that is not UTF-8 has its bad sequences
    /// replaced by U+FFFD; the binary forms carry it exactly).
    pub fn json(&self) -> serde_json::Value {
        match self.datatype {
            DataType::Bytes => serde_json::json!(self
                .byte_elements()
                .unwrap_or_default()
                .into_iter()
                .map(String::from_utf8_lossy)
                .collect::<Vec<_>>()),
            DataType::Bool => {
                serde_json::json!(self.data.iter().map(|&b| b != 0).collect::<Vec<_>>())
            }
            DataType::Int64 => serde_json::json!(self.i64s().unwrap_or_default()),
            DataType::Uint64 => serde_json::json!(self
                .data
                .chunks_exact(8)
                .map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes")))
                .collect::<Vec<_>>()),
            // the f32 of the same value: its shortest decimal rounds back to the same half
            DataType::Fp16 => serde_json::json!(self
                .data
                .chunks_exact(2)
                .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect::<Vec<_>>()),
            DataType::Fp32 => serde_json::json!(self
                .data
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes(c.try_into().expect("4 bytes")))
                .collect::<Vec<_>>()),
            DataType::Fp64 => serde_json::json!(self.to_f64s()),
            _ => serde_json::json!(self
                .to_f64s()
                .into_iter()
                .map(|x| x as i64)
                .collect::<Vec<_>>()),
        }
    }

    /// The shape as the protocols write it.
    pub fn wire_shape(&self) -> Vec<i64> {
        self.shape.iter().map(|&d| d as i64).collect()
    }

    /// Where the data of rows `rows` of the first dimension lies.
    fn row_span(&self, rows: &std::ops::Range<usize>) -> std::ops::Range<usize> {
        let per_row = self.shape[1..].iter().product::<usize>();
        match self.datatype.size() {
            Some(size) => rows.start * per_row * size..rows.end * per_row * size,
            None => {
                let ends = bytes_ends(&self.data, rows.end * per_row);
                let at = |elements: usize| match elements {
                    0 => 0,
                    e => ends.get(e - 1).copied().unwrap_or(self.data.len()),
                };
                at(rows.start * per_row)..at(rows.end * per_row)
            }
        }
    }

    /// Rows `rows` of the first dimension.
    pub fn rows(&self, rows: std::ops::Range<usize>) -> Tensor {
        let span = self.row_span(&rows);
        let mut shape = self.shape.clone();
        shape[0] = rows.len();
        Tensor {
            datatype: self.datatype,
            shape,
            data: self.data[span].to_vec(),
        }
    }

    /// `parts` joined along the first dimension (they agree on type and the other dimensions).
    pub fn concat(parts: &[&Tensor]) -> Tensor {
        let first = parts[0];
        let mut shape = first.shape.clone();
        shape[0] = parts.iter().map(|t| t.shape[0]).sum();
        let mut data = Vec::with_capacity(parts.iter().map(|t| t.data.len()).sum());
        for t in parts {
            data.extend_from_slice(&t.data);
        }
        Tensor {
            datatype: first.datatype,
            shape,
            data,
        }
    }
}

/// What a model declares about one of its tensors.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorSpec {
    /// The tensor's name.
    pub name: String,
    /// Its element type.
    pub datatype: DataType,
    /// Its shape with the batch dimension first; -1: any size.
    pub shape: Vec<i64>,
}

impl TensorSpec {
    /// A spec.
    pub fn new(name: &str, datatype: DataType, shape: Vec<i64>) -> TensorSpec {
        TensorSpec {
            name: name.to_string(),
            datatype,
            shape,
        }
    }

    /// The dims a Triton config writes for it: without the batch dimension, `[1]` for a
    /// tensor that has no other dimension (Triton allows no empty dims).
    pub fn config_dims(&self) -> Vec<i64> {
        match &self.shape[1..] {
            [] => vec![1],
            dims => dims.to_vec(),
        }
    }
}

/// The names of `specs`, for error messages.
pub(crate) fn names(specs: &[TensorSpec]) -> String {
    specs
        .iter()
        .map(|s| s.name.as_str())
        .collect::<Vec<_>>()
        .join(", ")
}

/// A checked request: one tensor per model input, in the model's input order, all with the
/// same number of rows.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Request {
    /// Rows (the batch dimension every input shares).
    pub batch: usize,
    pub inputs: Vec<Tensor>,
}

impl Request {
    /// Whether `self` and `other` can run in one batch: every input agrees beyond the batch
    /// dimension (Triton's rule for dynamic batching).
    pub fn batches_with(&self, other: &Request) -> bool {
        self.inputs
            .iter()
            .zip(&other.inputs)
            .all(|(a, b)| a.shape[1..] == b.shape[1..])
    }
}

/// What one request gets back: the outputs it asked for, in its order, with their names.
pub(crate) type InferResult = Vec<(String, Tensor)>;
