//! The spellings Triton's config fields come in, read into one form: `parameters` as a map or
//! as pbtxt's key/value entries, with or without `string_value`; a protobuf `map<string,
//! string>` likewise; and protobuf JSON's 64-bit integers written as strings. Serde hooks of
//! the `config` module's types; this module never decides whether a value is acceptable.

use std::collections::BTreeMap;

use serde::Deserialize;

/// Reads Triton's parameters in any of their three spellings into key -> string value.
pub(super) fn de_parameters<'de, D: serde::Deserializer<'de>>(
    d: D,
) -> Result<BTreeMap<String, String>, D::Error> {
    use serde::de::Error;
    use serde_json::Value;
    let string_value = |key: &str, v: &Value| -> Result<String, D::Error> {
        match v {
            Value::String(s) => Ok(s.clone()),
            Value::Object(o) if o.len() == 1 && o.contains_key("string_value") => o["string_value"]
                .as_str()
                .map(str::to_string)
                .ok_or_else(|| {
                    D::Error::custom(format!("parameter {key}: string_value is not a string"))
                }),
            other => Err(D::Error::custom(format!(
                "parameter {key}: {other} is not {{ string_value: \"...\" }}"
            ))),
        }
    };
    let mut out = BTreeMap::new();
    match Value::deserialize(d)? {
        Value::Object(map) => {
            for (k, v) in &map {
                out.insert(k.clone(), string_value(k, v)?);
            }
        }
        Value::Array(entries) => {
            for e in &entries {
                let (Some(k), Some(v)) = (e.get("key").and_then(Value::as_str), e.get("value"))
                else {
                    return Err(D::Error::custom(format!(
                        "parameters entry {e} is not {{ key: \"...\" value: {{ string_value: \"...\" }} }}"
                    )));
                };
                out.insert(k.to_string(), string_value(k, v)?);
            }
        }
        other => {
            return Err(D::Error::custom(format!(
                "parameters: {other} is neither a map nor key/value entries"
            )))
        }
    }
    Ok(out)
}

/// Writes parameters as Triton's JSON does: key -> `{"string_value": v}`.
pub(super) fn ser_parameters<S: serde::Serializer>(
    p: &BTreeMap<String, String>,
    s: S,
) -> Result<S::Ok, S::Error> {
    use serde::ser::SerializeMap;
    let mut m = s.serialize_map(Some(p.len()))?;
    for (k, v) in p {
        m.serialize_entry(k, &serde_json::json!({ "string_value": v }))?;
    }
    m.end()
}

/// Reads a protobuf map<string, string> in its spellings: pbtxt's repeated
/// `{ key: "k" value: "v" }` entries, JSON's or TOML's `{"k": "v"}`.
pub(super) fn de_string_map<'de, D: serde::Deserializer<'de>>(
    d: D,
) -> Result<BTreeMap<String, String>, D::Error> {
    use serde::de::Error;
    use serde_json::Value;
    let mut out = BTreeMap::new();
    match Value::deserialize(d)? {
        Value::Object(map) => {
            for (k, v) in map {
                let v = v.as_str().ok_or_else(|| {
                    D::Error::custom(format!("map entry {k}: {v} is not a string"))
                })?;
                out.insert(k, v.to_string());
            }
        }
        Value::Array(entries) => {
            for e in &entries {
                let (Some(k), Some(v)) = (
                    e.get("key").and_then(Value::as_str),
                    e.get("value").and_then(Value::as_str),
                ) else {
                    return Err(D::Error::custom(format!(
                        "map entry {e} is not {{ key: \"...\" value: \"...\" }}"
                    )));
                };
                out.insert(k.to_string(), v.to_string());
            }
        }
        other => {
            return Err(D::Error::custom(format!(
                "{other} is neither a map nor key/value entries"
            )))
        }
    }
    Ok(out)
}

/// Protobuf's JSON writes 64-bit integers as strings (`"max_queue_delay_microseconds": "100"`);
/// turns those of the integer fields cohort reads back into numbers.
pub(super) fn integers_from_strings(v: &mut serde_json::Value) {
    const INTEGER_FIELDS: &[&str] = &[
        "max_batch_size",
        "preferred_batch_size",
        "max_queue_delay_microseconds",
        "max_queue_size",
        "count",
        "num_versions",
        "versions",
        "dims",
    ];
    fn number(v: &mut serde_json::Value) {
        match v {
            serde_json::Value::String(s) => {
                if let Ok(n) = s.parse::<i64>() {
                    *v = n.into();
                }
            }
            serde_json::Value::Array(a) => a.iter_mut().for_each(number),
            _ => {}
        }
    }
    match v {
        serde_json::Value::Object(m) => {
            for (k, x) in m.iter_mut() {
                if INTEGER_FIELDS.contains(&k.as_str()) {
                    number(x);
                } else {
                    integers_from_strings(x);
                }
            }
        }
        serde_json::Value::Array(a) => a.iter_mut().for_each(integers_from_strings),
        _ => {}
    }
}
