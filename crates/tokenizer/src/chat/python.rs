//! The Python behaviour that transformers' Jinja environment has and plain Jinja (minijinja) lacks:
//! `tojson` as `json.dumps` (`", "` and `": "` separators, no HTML escaping, insertion order,
//! `indent`, `separators`, `sort_keys`, `ensure_ascii`), Python's `str()` of None, booleans,
//! lists and dicts where a template prints them, and `strftime_now`. It only formats values;
//! it never renders a template.

use std::fmt::Write as _;

use minijinja::value::{Kwargs, ValueKind};
use minijinja::{Error, ErrorKind, Value};

/// How `json.dumps` lays out containers.
struct JsonStyle {
    indent: Option<String>,
    item_sep: String,
    key_sep: String,
    sort_keys: bool,
    ensure_ascii: bool,
}

/// transformers' `tojson` filter: `json.dumps(x, ensure_ascii=False, indent=None,
/// separators=None, sort_keys=False)` with those keywords open to the template.
pub(super) fn tojson(value: &Value, kwargs: Kwargs) -> Result<Value, Error> {
    let indent: Option<Value> = kwargs.get("indent")?;
    let indent = match indent {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) => Some(match v.as_str() {
            Some(s) => s.to_string(),
            None => " ".repeat(usize::try_from(v)?),
        }),
    };
    let separators: Option<Value> = kwargs.get("separators")?;
    // Python: (', ', ': ') without indent, (',', ': ') with one.
    let (mut item_sep, mut key_sep) = match indent {
        Some(_) => (",".to_string(), ": ".to_string()),
        None => (", ".to_string(), ": ".to_string()),
    };
    if let Some(seps) = separators.filter(|s| !s.is_none()) {
        let parts: Vec<Value> = seps.try_iter()?.collect();
        match parts.as_slice() {
            [a, b] => {
                item_sep = a.to_string();
                key_sep = b.to_string();
            }
            _ => {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    "tojson: separators must be two strings",
                ))
            }
        }
    }
    let style = JsonStyle {
        indent,
        item_sep,
        key_sep,
        sort_keys: kwargs.get::<Option<bool>>("sort_keys")?.unwrap_or(false),
        ensure_ascii: kwargs.get::<Option<bool>>("ensure_ascii")?.unwrap_or(false),
    };
    kwargs.assert_all_used()?;
    let mut out = String::new();
    json(&mut out, value, &style, 0)?;
    Ok(Value::from(out))
}

fn newline(out: &mut String, style: &JsonStyle, depth: usize) {
    if let Some(ind) = &style.indent {
        out.push('\n');
        for _ in 0..depth {
            out.push_str(ind);
        }
    }
}

fn json(out: &mut String, v: &Value, style: &JsonStyle, depth: usize) -> Result<(), Error> {
    match v.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
        ValueKind::Number => number(out, v, true),
        ValueKind::String | ValueKind::Bytes => json_str(out, &v.to_string(), style.ensure_ascii),
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = v.try_iter()?.collect();
            if items.is_empty() {
                out.push_str("[]");
                return Ok(());
            }
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(&style.item_sep);
                }
                newline(out, style, depth + 1);
                json(out, item, style, depth + 1)?;
            }
            newline(out, style, depth);
            out.push(']');
        }
        ValueKind::Map => {
            let mut keys: Vec<Value> = v.try_iter()?.collect();
            if keys.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            if style.sort_keys {
                keys.sort();
            }
            out.push('{');
            for (i, key) in keys.iter().enumerate() {
                if i > 0 {
                    out.push_str(&style.item_sep);
                }
                newline(out, style, depth + 1);
                // json.dumps turns None, booleans and numbers used as keys into strings.
                let name = match key.kind() {
                    ValueKind::None => "null".to_string(),
                    ValueKind::Bool => (if key.is_true() { "true" } else { "false" }).into(),
                    _ => key.to_string(),
                };
                json_str(out, &name, style.ensure_ascii);
                out.push_str(&style.key_sep);
                json(out, &v.get_item(key)?, style, depth + 1)?;
            }
            newline(out, style, depth);
            out.push('}');
        }
        _ => json_str(out, &v.to_string(), style.ensure_ascii),
    }
    Ok(())
}

fn json_str(out: &mut String, s: &str, ensure_ascii: bool) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 || (ensure_ascii && !c.is_ascii()) => {
                let mut units = [0u16; 2];
                for u in c.encode_utf16(&mut units) {
                    let _ = write!(out, "\\u{u:04x}");
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// A number as Python writes it: integers as they are, floats as `repr(float)` (`1.0`, `1e-05`,
/// `1e+16`, `inf` as `Infinity` in JSON).
fn number(out: &mut String, v: &Value, in_json: bool) {
    if v.is_integer() {
        out.push_str(&v.to_string());
        return;
    }
    let Ok(x) = f64::try_from(v.clone()) else {
        out.push_str(&v.to_string());
        return;
    };
    if x.is_nan() {
        out.push_str(if in_json { "NaN" } else { "nan" });
    } else if x.is_infinite() {
        let s = match (in_json, x > 0.0) {
            (true, true) => "Infinity",
            (true, false) => "-Infinity",
            (false, true) => "inf",
            (false, false) => "-inf",
        };
        out.push_str(s);
    } else {
        out.push_str(&float_repr(x));
    }
}

/// Python's `repr(float)`: the shortest digits that round-trip, positional for exponents -4..16,
/// else `d.ddde+XX`.
fn float_repr(x: f64) -> String {
    let sci = format!("{x:e}"); // shortest round-trip digits, e.g. "-1.5e16"
    let (mantissa, exp) = sci.split_once('e').expect("{:e} has an exponent");
    let exp: i32 = exp.parse().expect("{:e}'s exponent is an integer");
    let (sign, mantissa) = match mantissa.strip_prefix('-') {
        Some(m) => ("-", m),
        None => ("", mantissa),
    };
    let digits: String = mantissa.chars().filter(|c| *c != '.').collect();
    if (-4..16).contains(&exp) {
        let point = exp + 1; // digits before the decimal point
        let body = if point <= 0 {
            format!("0.{}{digits}", "0".repeat((-point) as usize))
        } else if point as usize >= digits.len() {
            format!("{digits}{}.0", "0".repeat(point as usize - digits.len()))
        } else {
            let (a, b) = digits.split_at(point as usize);
            format!("{a}.{b}")
        };
        format!("{sign}{body}")
    } else {
        let m = if digits.len() > 1 {
            format!("{}.{}", &digits[..1], &digits[1..])
        } else {
            digits
        };
        let esign = if exp < 0 { '-' } else { '+' };
        format!("{sign}{m}e{esign}{:02}", exp.abs())
    }
}

/// Python's `str(value)` where it differs from minijinja's display: `None`, `True`/`False`, lists
/// and dicts as `repr` writes them. None for every other value (printed as minijinja does).
pub(super) fn py_str(v: &Value) -> Option<String> {
    match v.kind() {
        ValueKind::None | ValueKind::Bool | ValueKind::Seq | ValueKind::Map => {
            let mut out = String::new();
            py_repr(&mut out, v);
            Some(out)
        }
        _ => None,
    }
}

fn py_repr(out: &mut String, v: &Value) {
    match v.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("None"),
        ValueKind::Bool => out.push_str(if v.is_true() { "True" } else { "False" }),
        ValueKind::Number => number(out, v, false),
        ValueKind::String => {
            // repr(str): single quotes unless the text has one and no double quote.
            let s = v.to_string();
            let q = if s.contains('\'') && !s.contains('"') {
                '"'
            } else {
                '\''
            };
            out.push(q);
            for c in s.chars() {
                match c {
                    '\\' => out.push_str("\\\\"),
                    '\n' => out.push_str("\\n"),
                    '\r' => out.push_str("\\r"),
                    '\t' => out.push_str("\\t"),
                    c if c == q => {
                        out.push('\\');
                        out.push(c);
                    }
                    c if (c as u32) < 0x20 || c as u32 == 0x7f => {
                        let _ = write!(out, "\\x{:02x}", c as u32);
                    }
                    c => out.push(c),
                }
            }
            out.push(q);
        }
        ValueKind::Seq | ValueKind::Iterable => {
            out.push('[');
            for (i, item) in v.try_iter().into_iter().flatten().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                py_repr(out, &item);
            }
            out.push(']');
        }
        ValueKind::Map => {
            out.push('{');
            for (i, key) in v.try_iter().into_iter().flatten().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                py_repr(out, &key);
                out.push_str(": ");
                py_repr(out, &v.get_item(&key).unwrap_or_default());
            }
            out.push('}');
        }
        _ => out.push_str(&v.to_string()),
    }
}

const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];
const DAYS: [&str; 7] = [
    "Monday",
    "Tuesday",
    "Wednesday",
    "Thursday",
    "Friday",
    "Saturday",
    "Sunday",
];

/// transformers' `strftime_now(format)`: the current time (UTC) formatted as C's strftime does,
/// for the directives templates use (`%d %b %Y` in Llama 3.1's); others are kept as written.
pub(super) fn strftime_now(format: &str) -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64);
    strftime(format, secs)
}

/// `format` at `secs` seconds after the Unix epoch (UTC).
pub(super) fn strftime(format: &str, secs: i64) -> String {
    let days = secs.div_euclid(86_400);
    let rem = secs.rem_euclid(86_400);
    let (hour, minute, second) = (rem / 3600, rem % 3600 / 60, rem % 60);
    let (year, month, day) = civil_from_days(days);
    let weekday = (days + 3).rem_euclid(7) as usize; // 1970-01-01 was a Thursday (Monday = 0)
    let yday = days - days_from_civil(year, 1, 1) + 1;
    let mut out = String::new();
    let mut chars = format.chars().peekable();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        // glibc's "%-d": no padding.
        let pad = chars.peek() != Some(&'-');
        if !pad {
            chars.next();
        }
        let num = |out: &mut String, n: i64, width: usize| {
            if pad {
                let _ = write!(out, "{n:0width$}");
            } else {
                let _ = write!(out, "{n}");
            }
        };
        match chars.next() {
            Some('Y') => num(&mut out, year, 4),
            Some('y') => num(&mut out, year.rem_euclid(100), 2),
            Some('m') => num(&mut out, month as i64, 2),
            Some('d') => num(&mut out, day as i64, 2),
            Some('e') => {
                let _ = write!(out, "{day:2}");
            }
            Some('H') => num(&mut out, hour, 2),
            Some('I') => num(&mut out, (hour + 11) % 12 + 1, 2),
            Some('M') => num(&mut out, minute, 2),
            Some('S') => num(&mut out, second, 2),
            Some('j') => num(&mut out, yday, 3),
            Some('p') => out.push_str(if hour < 12 { "AM" } else { "PM" }),
            Some('B') => out.push_str(MONTHS[month as usize - 1]),
            Some('b') | Some('h') => out.push_str(&MONTHS[month as usize - 1][..3]),
            Some('A') => out.push_str(DAYS[weekday]),
            Some('a') => out.push_str(&DAYS[weekday][..3]),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                if !pad {
                    out.push('-');
                }
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

/// (year, month 1..=12, day 1..=31) of a day count since 1970-01-01 (Howard Hinnant's
/// algorithm).
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let y = yoe + era * 400 + (m <= 2) as i64;
    (y, m, d)
}

fn days_from_civil(y: i64, m: u32, d: u32) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let mp = (m as i64 + 9) % 12;
    let doy = (153 * mp + 2) / 5 + d as i64 - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn floats_print_as_python_repr() {
        for (x, want) in [
            (1.0, "1.0"),
            (0.1, "0.1"),
            (1e-5, "1e-05"),
            (0.0001, "0.0001"),
            (1e16, "1e+16"),
            (1.5e16, "1.5e+16"),
            (123456.75, "123456.75"),
            (-2.5e-7, "-2.5e-07"),
            (1e15, "1000000000000000.0"),
        ] {
            assert_eq!(float_repr(x), want, "{x}");
        }
    }

    #[test]
    fn strftime_matches_c() {
        // 2024-07-23 14:05:09 UTC, a Tuesday, day 205.
        let t = 1_721_743_509;
        assert_eq!(
            strftime("%d %b %Y %H:%M:%S %A %a %B %j %y %-d %%", t),
            "23 Jul 2024 14:05:09 Tuesday Tue July 205 24 23 %"
        );
        assert_eq!(strftime("%d %b %Y", 0), "01 Jan 1970");
    }

    #[test]
    fn python_str_of_containers() {
        let v: Value =
            serde_json::from_str(r#"{"a": [1, 2.5, null, true], "b's": "x'y"}"#).unwrap();
        assert_eq!(
            py_str(&v).unwrap(),
            r#"{'a': [1, 2.5, None, True], "b's": "x'y"}"#
        );
    }
}
