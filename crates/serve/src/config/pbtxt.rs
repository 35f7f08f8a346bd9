//! A reader for protobuf text format (what Triton's `config.pbtxt` is written in) into a
//! `serde_json::Value`, so that one serde model describes both config.pbtxt and config.toml.
//!
//! Supported: `field: scalar`, `field { ... }` / `field: { ... }` / `field < ... >`, lists
//! `field: [a, b]` and `field [ {..}, {..} ]`, repeated occurrences of a field, `#` comments,
//! optional `,` / `;` separators, strings in single or double quotes with C escapes, numbers,
//! `true` / `false`, and enum identifiers (kept as strings). Fields named in `repeated` always
//! become arrays, even with a single occurrence. This module never knows what a field means.

use serde_json::{Map, Number, Value};

/// A syntax error with its 1-based line.
#[derive(Debug, PartialEq)]
pub(crate) struct SyntaxError {
    pub line: usize,
    pub reason: String,
}

impl std::fmt::Display for SyntaxError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "line {}: {}", self.line, self.reason)
    }
}

/// Parses `text` as a message; fields in `repeated` are always arrays.
pub(crate) fn parse(text: &str, repeated: &[&str]) -> Result<Value, SyntaxError> {
    let mut p = Parser {
        chars: text.chars().collect(),
        pos: 0,
        line: 1,
        repeated,
    };
    let msg = p.message(None)?;
    Ok(Value::Object(msg))
}

struct Parser<'r> {
    chars: Vec<char>,
    pos: usize,
    line: usize,
    repeated: &'r [&'r str],
}

impl Parser<'_> {
    fn err<T>(&self, reason: impl Into<String>) -> Result<T, SyntaxError> {
        Err(SyntaxError {
            line: self.line,
            reason: reason.into(),
        })
    }

    fn peek(&self) -> Option<char> {
        self.chars.get(self.pos).copied()
    }

    fn bump(&mut self) -> Option<char> {
        let c = self.peek()?;
        self.pos += 1;
        if c == '\n' {
            self.line += 1;
        }
        Some(c)
    }

    /// Skips whitespace and comments.
    fn skip(&mut self) {
        while let Some(c) = self.peek() {
            if c.is_whitespace() {
                self.bump();
            } else if c == '#' {
                while let Some(c) = self.bump() {
                    if c == '\n' {
                        break;
                    }
                }
            } else {
                break;
            }
        }
    }

    fn eat(&mut self, c: char) -> bool {
        self.skip();
        if self.peek() == Some(c) {
            self.bump();
            true
        } else {
            false
        }
    }

    fn ident(&mut self) -> Result<String, SyntaxError> {
        self.skip();
        let start = self.pos;
        while let Some(c) = self.peek() {
            if c.is_ascii_alphanumeric() || c == '_' || c == '.' {
                self.bump();
            } else {
                break;
            }
        }
        if start == self.pos {
            return match self.peek() {
                Some(c) => self.err(format!("expected a field name, found {c:?}")),
                None => self.err("expected a field name, found the end of the file"),
            };
        }
        Ok(self.chars[start..self.pos].iter().collect())
    }

    /// Fields until `close` (or the end of input at the top level).
    fn message(&mut self, close: Option<char>) -> Result<Map<String, Value>, SyntaxError> {
        let mut out = Map::new();
        loop {
            self.skip();
            match (self.peek(), close) {
                (None, None) => return Ok(out),
                (None, Some(c)) => return self.err(format!("missing {c:?} before the end")),
                (Some(c), Some(want)) if c == want => {
                    self.bump();
                    return Ok(out);
                }
                _ => {}
            }
            let name = self.ident()?;
            let colon = self.eat(':');
            self.skip();
            let value = match self.peek() {
                Some('{') | Some('<') => self.submessage()?,
                Some('[') => {
                    self.bump();
                    self.list()?
                }
                Some(_) if colon => self.scalar()?,
                Some(c) => return self.err(format!("expected ':' after {name:?}, found {c:?}")),
                None => return self.err(format!("{name:?} has no value")),
            };
            self.insert(&mut out, name, value);
            // optional separator
            if !self.eat(',') {
                self.eat(';');
            }
        }
    }

    fn submessage(&mut self) -> Result<Value, SyntaxError> {
        let close = match self.bump() {
            Some('{') => '}',
            _ => '>',
        };
        Ok(Value::Object(self.message(Some(close))?))
    }

    /// Elements after `[` up to `]`.
    fn list(&mut self) -> Result<Value, SyntaxError> {
        let mut items = Vec::new();
        loop {
            self.skip();
            match self.peek() {
                Some(']') => {
                    self.bump();
                    return Ok(Value::Array(items));
                }
                Some('{') | Some('<') => items.push(self.submessage()?),
                Some(_) => items.push(self.scalar()?),
                None => return self.err("missing ']' before the end"),
            }
            self.skip();
            match self.peek() {
                Some(',') => {
                    self.bump();
                }
                Some(']') => {}
                Some(c) => return self.err(format!("expected ',' or ']' in a list, found {c:?}")),
                None => return self.err("missing ']' before the end"),
            }
        }
    }

    fn scalar(&mut self) -> Result<Value, SyntaxError> {
        self.skip();
        match self.peek() {
            Some(q @ ('"' | '\'')) => {
                self.bump();
                self.string(q).map(Value::String)
            }
            Some(c) if c == '-' || c == '+' || c == '.' || c.is_ascii_digit() => self.number(),
            Some(_) => {
                let word = self.ident()?;
                Ok(match word.as_str() {
                    "true" | "True" | "t" => Value::Bool(true),
                    "false" | "False" | "f" => Value::Bool(false),
                    _ => Value::String(word),
                })
            }
            None => self.err("expected a value, found the end of the file"),
        }
    }

    fn string(&mut self, quote: char) -> Result<String, SyntaxError> {
        let mut s = String::new();
        loop {
            let c = match self.peek() {
                None | Some('\n') => return self.err("unterminated string"),
                Some(c) => c,
            };
            self.bump();
            match c {
                c if c == quote => break,
                '\\' => match self.bump() {
                    Some('n') => s.push('\n'),
                    Some('t') => s.push('\t'),
                    Some('r') => s.push('\r'),
                    Some(c @ ('\\' | '\'' | '"')) => s.push(c),
                    Some(c) => return self.err(format!("unsupported escape \\{c}")),
                    None => return self.err("unterminated string"),
                },
                c => s.push(c),
            }
        }
        // adjacent string literals concatenate, as in C
        self.skip();
        if let Some(q @ ('"' | '\'')) = self.peek() {
            self.bump();
            s.push_str(&self.string(q)?);
        }
        Ok(s)
    }

    fn number(&mut self) -> Result<Value, SyntaxError> {
        let start = self.pos;
        while let Some(c) = self.peek() {
            if c.is_ascii_alphanumeric() || matches!(c, '-' | '+' | '.') {
                self.bump();
            } else {
                break;
            }
        }
        let text: String = self.chars[start..self.pos].iter().collect();
        let trimmed = text.trim_start_matches('+');
        if let Ok(i) = trimmed.parse::<i64>() {
            return Ok(Value::Number(i.into()));
        }
        if let Ok(u) = trimmed.parse::<u64>() {
            return Ok(Value::Number(u.into()));
        }
        let float = trimmed.trim_end_matches(['f', 'F']);
        match float.parse::<f64>().ok().and_then(Number::from_f64) {
            Some(n) => Ok(Value::Number(n)),
            None => self.err(format!("{text:?} is not a number")),
        }
    }

    fn insert(&self, out: &mut Map<String, Value>, name: String, value: Value) {
        let repeated = self.repeated.contains(&name.as_str());
        match out.get_mut(&name) {
            Some(Value::Array(items)) if repeated => match value {
                Value::Array(more) => items.extend(more),
                v => items.push(v),
            },
            Some(existing) => {
                // a second occurrence of a field not declared repeated: keep both, the
                // consumer reports a list where it wanted one value
                let first = existing.take();
                *existing = Value::Array(vec![first, value]);
            }
            None => {
                let value = match value {
                    v @ Value::Array(_) => v,
                    v if repeated => Value::Array(vec![v]),
                    v => v,
                };
                out.insert(name, value);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn reads_a_triton_model_config() {
        let text = r#"
            name: "gpt"   # the model
            platform: "cohort_gpt"
            max_batch_size: 32
            input [
              { name: "input_ids" data_type: TYPE_INT64 dims: [ -1 ] }
            ]
            dynamic_batching {
              preferred_batch_size: [ 8, 16 ]
              preferred_batch_size: 32
              max_queue_delay_microseconds: 2000
              default_queue_policy { max_queue_size: 64 }
            }
            instance_group [ { count: 2, kind: KIND_CPU } ]
            version_policy: { specific: { versions: 3 } }
            parameters { key: "x" value: { string_value: 'a' "b" } }
            ratio: 1.5e-1
        "#;
        let v = parse(
            text,
            &[
                "preferred_batch_size",
                "versions",
                "instance_group",
                "input",
            ],
        )
        .unwrap();
        assert_eq!(
            v,
            json!({
                "name": "gpt",
                "platform": "cohort_gpt",
                "max_batch_size": 32,
                "input": [{"name": "input_ids", "data_type": "TYPE_INT64", "dims": [-1]}],
                "dynamic_batching": {
                    "preferred_batch_size": [8, 16, 32],
                    "max_queue_delay_microseconds": 2000,
                    "default_queue_policy": {"max_queue_size": 64}
                },
                "instance_group": [{"count": 2, "kind": "KIND_CPU"}],
                "version_policy": {"specific": {"versions": [3]}},
                "parameters": {"key": "x", "value": {"string_value": "ab"}},
                "ratio": 0.15
            })
        );
    }

    #[test]
    fn syntax_errors_name_the_line() {
        for (text, line, needle) in [
            ("a: 1\nb {\n c: 2\n", 4, "missing '}'"),
            ("a: 1\nb 2", 2, "expected ':'"),
            ("a: \"x\n", 1, "unterminated string"),
            ("a: [1 2]", 1, "expected ',' or ']'"),
            ("a: 12abc", 1, "not a number"),
            ("}", 1, "expected a field name"),
        ] {
            let err = parse(text, &[]).unwrap_err();
            assert_eq!(err.line, line, "{text:?}: {err}");
            assert!(err.reason.contains(needle), "{text:?}: {err}");
        }
    }
}
