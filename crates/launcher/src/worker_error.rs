//! A worker's own account of why it failed, in torch's error-file format: a
//! Python entry point decorated with torch's `@record` writes its uncaught
//! exception as JSON to the file `TORCHELASTIC_ERROR_FILE` names, and the
//! launcher reports that message instead of only an exit code, as torchrun
//! does. This module only reads such files; it never writes one and never
//! fails a launch because one is missing or malformed (a worker that did not
//! write one simply has no message).

use std::path::Path;

/// Longest message reported; a traceback belongs in the worker's own output.
const MAX_MESSAGE: usize = 500;

/// The message in the error file at `path`, when the worker wrote one.
///
/// torch writes `{"message": {"message": "ValueError: ...", "extraInfo": {...}}}`;
/// older writers and hand-written files put a string directly under `message`.
pub(crate) fn read(path: &Path) -> Option<String> {
    let text = std::fs::read_to_string(path).ok()?;
    let json: serde_json::Value = serde_json::from_str(&text).ok()?;
    let message = match &json["message"] {
        serde_json::Value::String(s) => s.clone(),
        inner => inner["message"].as_str()?.to_string(),
    };
    let message = message.trim();
    if message.is_empty() {
        return None;
    }
    // One line: the report is a summary, and each cause is printed once.
    let first = message.lines().next().unwrap_or(message);
    Some(if first.chars().count() > MAX_MESSAGE {
        let cut: String = first.chars().take(MAX_MESSAGE).collect();
        format!("{cut}...")
    } else {
        first.to_string()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn torchs_format_and_the_plain_one_give_the_message_and_junk_gives_none() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("error.json");
        assert_eq!(read(&file), None, "no file");
        std::fs::write(
            &file,
            r#"{"message": {"message": "ZeroDivisionError: division by zero", "extraInfo": {"py_callstack": "Traceback...", "timestamp": "1"}}}"#,
        )
        .unwrap();
        assert_eq!(
            read(&file).as_deref(),
            Some("ZeroDivisionError: division by zero")
        );
        std::fs::write(&file, r#"{"message": "RuntimeError: x\nsecond line"}"#).unwrap();
        assert_eq!(read(&file).as_deref(), Some("RuntimeError: x"));
        std::fs::write(&file, "{not json").unwrap();
        assert_eq!(read(&file), None);
        std::fs::write(&file, r#"{"message": {"extraInfo": {}}}"#).unwrap();
        assert_eq!(read(&file), None);
    }
}
