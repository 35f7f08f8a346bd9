//! The tensors a cohort GPT takes and returns, independent of the wire: turning a request's
//! `input_ids` (INT64 `[batch, seq]`, from JSON numbers, typed protobuf contents or raw
//! little-endian bytes) into checked token ids, and an execution's results into the `logits`
//! (FP32 `[batch, seq, vocab]`) and `next_token` (INT64 `[batch]`, the argmax of the last
//! position) outputs. Every check a request can fail happens here, before anything is queued;
//! this module never touches a model.

use crate::error::ServeError;

/// The one input: token ids, INT64 `[batch, seq]`.
pub const INPUT_IDS: &str = "input_ids";
/// Output: the logits of every position, FP32 `[batch, seq, vocab]`.
pub const LOGITS: &str = "logits";
/// Output: the most likely next token after each row, INT64 `[batch]`.
pub const NEXT_TOKEN: &str = "next_token";

/// The KServe datatype of `input_ids` and `next_token`.
pub const INT64: &str = "INT64";
/// The KServe datatype of `logits`.
pub const FP32: &str = "FP32";

/// What one model version accepts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Limits {
    /// Vocabulary size (V).
    pub vocab: usize,
    /// Longest sequence (max_position_embeddings).
    pub max_seq: usize,
    /// Most rows per request (max_batch_size).
    pub max_batch: usize,
}

/// Checked token ids of one request: `batch` rows of `seq` ids.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct TokenBatch {
    pub batch: usize,
    pub seq: usize,
    pub ids: Vec<u32>,
}

/// Where a request's `input_ids` data is.
pub(crate) enum InputData<'a> {
    /// Row-major little-endian INT64 bytes (HTTP binary extension, gRPC raw contents).
    Raw(&'a [u8]),
    /// Typed values (gRPC `int64_contents`).
    Int64(&'a [i64]),
    /// JSON `data`, flat or nested.
    Json(&'a serde_json::Value),
}

/// Which outputs a request wants.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Wanted {
    pub logits: bool,
    pub next_token: bool,
}

/// One output tensor of the model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Output {
    Logits,
    NextToken,
}

impl Output {
    pub const ALL: [Output; 2] = [Output::Logits, Output::NextToken];

    pub fn name(self) -> &'static str {
        match self {
            Output::Logits => LOGITS,
            Output::NextToken => NEXT_TOKEN,
        }
    }

    pub fn datatype(self) -> &'static str {
        match self {
            Output::Logits => FP32,
            Output::NextToken => INT64,
        }
    }

    /// The output named `name`, or the error a request naming it gets.
    pub fn parse(model: &str, name: &str) -> Result<Output, ServeError> {
        Output::ALL
            .into_iter()
            .find(|o| o.name() == name)
            .ok_or_else(|| ServeError::UnknownTensor {
                model: model.to_string(),
                direction: "output",
                name: name.to_string(),
                known: format!("{LOGITS}, {NEXT_TOKEN}"),
            })
    }
}

/// The one input a cohort model takes, out of a request's `inputs`.
pub(crate) fn single_input<'a, T>(model: &str, inputs: &'a [T]) -> Result<&'a T, ServeError> {
    match inputs {
        [input] => Ok(input),
        _ => Err(ServeError::InputCount {
            model: model.to_string(),
            expected: 1,
            found: inputs.len(),
        }),
    }
}

/// Checks a request's one input and returns its token ids.
pub(crate) fn token_batch(
    model: &str,
    limits: Limits,
    name: &str,
    datatype: &str,
    shape: &[i64],
    data: InputData<'_>,
) -> Result<TokenBatch, ServeError> {
    if name != INPUT_IDS {
        return Err(ServeError::UnknownTensor {
            model: model.to_string(),
            direction: "input",
            name: name.to_string(),
            known: INPUT_IDS.to_string(),
        });
    }
    if datatype != INT64 {
        return Err(ServeError::Datatype {
            tensor: name.to_string(),
            found: datatype.to_string(),
            expected: INT64,
        });
    }
    let shape_err = |reason: String| ServeError::Shape {
        tensor: name.to_string(),
        shape: shape.to_vec(),
        reason,
    };
    let &[b, t] = shape else {
        return Err(shape_err("expected 2 dimensions, [batch, seq]".into()));
    };
    if b < 1 || b as u64 > limits.max_batch as u64 {
        return Err(shape_err(format!(
            "batch must be in 1..={} (max_batch_size)",
            limits.max_batch
        )));
    }
    if t < 1 || t as u64 > limits.max_seq as u64 {
        return Err(shape_err(format!(
            "seq must be in 1..={} (the model's max_position_embeddings)",
            limits.max_seq
        )));
    }
    let (batch, seq) = (b as usize, t as usize);
    let n = batch * seq;
    let size_err = |found: usize, expected: usize, unit| ServeError::DataSize {
        tensor: name.to_string(),
        shape: shape.to_vec(),
        expected,
        found,
        unit,
    };
    let mut ids = Vec::with_capacity(n);
    let mut push = |index: usize, value: i64| {
        if value < 0 || value as u64 >= limits.vocab as u64 {
            return Err(ServeError::TokenOutOfRange {
                tensor: name.to_string(),
                index,
                value,
                vocab: limits.vocab,
            });
        }
        ids.push(value as u32);
        Ok(())
    };
    match data {
        InputData::Raw(bytes) => {
            if bytes.len() != n * 8 {
                return Err(size_err(bytes.len(), n * 8, "bytes"));
            }
            for (i, c) in bytes.chunks_exact(8).enumerate() {
                push(i, i64::from_le_bytes(c.try_into().expect("8-byte chunk")))?;
            }
        }
        InputData::Int64(values) => {
            if values.len() != n {
                return Err(size_err(values.len(), n, "elements"));
            }
            for (i, &v) in values.iter().enumerate() {
                push(i, v)?;
            }
        }
        InputData::Json(value) => {
            let mut flat = Vec::with_capacity(n);
            flatten(value, &mut flat, 0).map_err(|reason| ServeError::Malformed {
                reason: format!("{name}: data {reason}"),
            })?;
            if flat.len() != n {
                return Err(size_err(flat.len(), n, "elements"));
            }
            for (i, v) in flat.into_iter().enumerate() {
                let value = v.as_i64().ok_or_else(|| ServeError::Datatype {
                    tensor: format!("{name}[{i}] = {v}"),
                    found: "a non-integer".into(),
                    expected: INT64,
                })?;
                push(i, value)?;
            }
        }
    }
    Ok(TokenBatch { batch, seq, ids })
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
        serde_json::Value::Number(_) if depth > 0 => {
            out.push(v);
            Ok(())
        }
        _ if depth == 0 => Err("must be an array".into()),
        other => Err(format!("holds {other}, expected numbers")),
    }
}

/// What one request gets back from an execution.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct InferResult {
    pub batch: usize,
    pub seq: usize,
    pub vocab: usize,
    /// `[batch, seq, vocab]` when wanted.
    pub logits: Option<Vec<f32>>,
    /// `[batch]` when wanted.
    pub next_token: Option<Vec<i64>>,
}

impl InferResult {
    /// The rows `rows` of a batch's logits `(rows_total * seq, vocab)`, as a request wants.
    pub fn from_logits(
        logits: &[f32],
        rows: std::ops::Range<usize>,
        seq: usize,
        vocab: usize,
        want: Wanted,
    ) -> InferResult {
        let mine = &logits[rows.start * seq * vocab..rows.end * seq * vocab];
        let next_token = want.next_token.then(|| {
            mine.chunks_exact(seq * vocab)
                .map(|row| cohort_gpt::sample::argmax(&row[(seq - 1) * vocab..]) as i64)
                .collect()
        });
        InferResult {
            batch: rows.len(),
            seq,
            vocab,
            logits: want.logits.then(|| mine.to_vec()),
            next_token,
        }
    }

    pub fn shape(&self, o: Output) -> Vec<i64> {
        match o {
            Output::Logits => vec![self.batch as i64, self.seq as i64, self.vocab as i64],
            Output::NextToken => vec![self.batch as i64],
        }
    }

    /// Row-major little-endian bytes of `o` (empty when not computed).
    pub fn le_bytes(&self, o: Output) -> Vec<u8> {
        match o {
            Output::Logits => self
                .logits
                .iter()
                .flatten()
                .flat_map(|x| x.to_le_bytes())
                .collect(),
            Output::NextToken => self
                .next_token
                .iter()
                .flatten()
                .flat_map(|x| x.to_le_bytes())
                .collect(),
        }
    }

    /// `o` as a flat JSON array.
    pub fn json(&self, o: Output) -> serde_json::Value {
        match o {
            Output::Logits => serde_json::json!(self.logits.as_deref().unwrap_or_default()),
            Output::NextToken => serde_json::json!(self.next_token.as_deref().unwrap_or_default()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const LIM: Limits = Limits {
        vocab: 10,
        max_seq: 4,
        max_batch: 2,
    };

    fn ok(shape: &[i64], data: InputData<'_>) -> Result<TokenBatch, ServeError> {
        token_batch("m", LIM, INPUT_IDS, INT64, shape, data)
    }

    #[test]
    fn the_three_encodings_give_the_same_ids() {
        let want = TokenBatch {
            batch: 2,
            seq: 3,
            ids: vec![1, 2, 3, 4, 5, 9],
        };
        let raw: Vec<u8> = [1i64, 2, 3, 4, 5, 9]
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect();
        assert_eq!(ok(&[2, 3], InputData::Raw(&raw)).unwrap(), want);
        assert_eq!(
            ok(&[2, 3], InputData::Int64(&[1, 2, 3, 4, 5, 9])).unwrap(),
            want
        );
        let nested = json!([[1, 2, 3], [4, 5, 9]]);
        assert_eq!(ok(&[2, 3], InputData::Json(&nested)).unwrap(), want);
        let flat = json!([1, 2, 3, 4, 5, 9]);
        assert_eq!(ok(&[2, 3], InputData::Json(&flat)).unwrap(), want);
    }

    #[test]
    fn bad_inputs_are_refused_with_what_was_wrong() {
        let three = json!([1, 2, 3]);
        let cases: Vec<(Result<TokenBatch, ServeError>, &str)> = vec![
            (
                token_batch("m", LIM, "ids", INT64, &[1, 3], InputData::Json(&three)),
                "no input tensor \"ids\"",
            ),
            (
                token_batch(
                    "m",
                    LIM,
                    INPUT_IDS,
                    "FP32",
                    &[1, 3],
                    InputData::Json(&three),
                ),
                "datatype FP32",
            ),
            (ok(&[3], InputData::Json(&three)), "2 dimensions"),
            (
                ok(&[3, 1], InputData::Json(&three)),
                "batch must be in 1..=2",
            ),
            (
                ok(&[1, 5], InputData::Int64(&[0; 5])),
                "seq must be in 1..=4",
            ),
            (ok(&[0, 3], InputData::Json(&three)), "batch"),
            (ok(&[1, 4], InputData::Json(&three)), "needs 4 elements"),
            (ok(&[1, 3], InputData::Raw(&[0; 20])), "needs 24 bytes"),
            (
                ok(&[1, 3], InputData::Int64(&[1, 10, 2])),
                "[1] = 10 is outside the vocabulary 0..10",
            ),
            (
                ok(&[1, 3], InputData::Int64(&[1, 2, -1])),
                "[2] = -1 is outside",
            ),
            (
                ok(&[1, 3], InputData::Json(&json!([1, 2.5, 3]))),
                "non-integer",
            ),
            (
                ok(&[1, 3], InputData::Json(&json!([1, "a", 3]))),
                "expected numbers",
            ),
            (ok(&[1, 3], InputData::Json(&json!(7))), "must be an array"),
        ];
        for (got, needle) in cases {
            let err = got.unwrap_err().to_string();
            assert!(err.contains(needle), "{needle:?} not in {err:?}");
        }
    }

    #[test]
    fn results_slice_rows_and_take_the_last_positions_argmax() {
        // 3 rows, seq 2, vocab 3
        let logits: Vec<f32> = vec![
            0., 1., 0., /* */ 5., 0., 0., // row 0: next token 0
            0., 0., 1., /* */ 0., 9., 1., // row 1: next token 1
            1., 0., 0., /* */ 0., 0., 2., // row 2: next token 2
        ];
        let all = Wanted {
            logits: true,
            next_token: true,
        };
        let r = InferResult::from_logits(&logits, 1..3, 2, 3, all);
        assert_eq!(r.next_token, Some(vec![1, 2]));
        assert_eq!(r.logits.as_deref(), Some(&logits[6..]));
        assert_eq!(r.shape(Output::Logits), [2, 2, 3]);
        assert_eq!(r.le_bytes(Output::NextToken).len(), 16);
        let only = InferResult::from_logits(
            &logits,
            0..1,
            2,
            3,
            Wanted {
                logits: false,
                next_token: true,
            },
        );
        assert_eq!(only.logits, None);
        assert_eq!(only.json(Output::NextToken), json!([0]));
    }
}
