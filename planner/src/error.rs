//! The planner's one error type: every operating error (bad input, bad trace, I/O) is a value here.

use std::path::PathBuf;

/// Everything that can go wrong while reading, generating, planning or simulating.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A trace broke one of the rules in docs/trace.md.
    #[error("invalid trace: {0}")]
    InvalidTrace(String),
    /// A plan does not belong to the trace it was given with.
    #[error("invalid plan: {0}")]
    InvalidPlan(String),
    /// A configuration value is out of range.
    #[error("invalid configuration: {0}")]
    Config(String),
    /// Reading or writing a file failed.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The operating-system error.
        source: std::io::Error,
    },
    /// A JSON file did not decode: where (line and column, 1-based), the field the decoder was
    /// reading where it can be told, and why.
    #[error("{}, line {line}, column {column}{}: {reason}", path.display(), field.as_ref().map(|f| format!(", field \"{f}\"")).unwrap_or_default())]
    Decode {
        /// The file.
        path: PathBuf,
        /// Line of the error, 1-based.
        line: usize,
        /// Column of the error, 1-based.
        column: usize,
        /// The object key nearest before the error, where the decoder's message does not name
        /// the field itself.
        field: Option<String>,
        /// The decoder's message without its position.
        reason: String,
    },
    /// A JSON file could not be encoded.
    #[error("{path}: {source}")]
    Json {
        /// The file.
        path: PathBuf,
        /// The decoder's error.
        source: serde_json::Error,
    },
}

/// Result with the planner's error.
pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    /// A decode error of `text` (the contents of `path`) that says where and which field.
    pub fn decode(path: &std::path::Path, text: &str, source: &serde_json::Error) -> Error {
        let message = source.to_string();
        let position = format!(" at line {} column {}", source.line(), source.column());
        let reason = message.strip_suffix(&position).unwrap_or(&message).to_string();
        // serde names a missing or unknown field itself; elsewhere the last key before the error
        // is the field whose value it could not read.
        let names_field = reason.starts_with("missing field") || reason.starts_with("unknown field");
        let field = if names_field { None } else { key_before(text, source.line(), source.column()) };
        Error::Decode { path: path.to_path_buf(), line: source.line(), column: source.column(), field, reason }
    }
}

/// The last object key (`"name":`) in `text` before `line`/`column` (1-based), if any.
fn key_before(text: &str, line: usize, column: usize) -> Option<String> {
    let line_start: usize = text.split_inclusive('\n').take(line.saturating_sub(1)).map(str::len).sum();
    let end = (line_start + column).min(text.len());
    let prefix = text.get(..end)?;
    let colon = prefix.rfind("\":")?;
    let open = prefix[..colon].rfind('"')?;
    Some(prefix[open + 1..colon].to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decode_errors_name_the_file_line_and_field() {
        let text = "{\n  \"ops\": [\n    {\"name\": \"a\", \"duration_us\": \"slow\"}\n  ]\n}";
        let error =
            Error::decode(std::path::Path::new("t.json"), text, &serde_json::from_str::<Probe>(text).unwrap_err());
        let message = error.to_string();
        assert!(message.starts_with("t.json, line 3, column "), "{message}");
        assert!(message.contains("field \"duration_us\""), "{message}");
        assert!(message.contains("expected f64"), "{message}");
        assert!(!message.contains(" at line "), "the position is said once: {message}");
        let missing = serde_json::from_str::<Probe>("{}").unwrap_err();
        let message = Error::decode(std::path::Path::new("t.json"), "{}", &missing).to_string();
        assert_eq!(message, "t.json, line 1, column 2: missing field `ops`");
    }

    #[derive(serde::Deserialize, Debug)]
    #[allow(dead_code)]
    struct Probe {
        ops: Vec<ProbeOp>,
    }

    #[derive(serde::Deserialize, Debug)]
    #[allow(dead_code)]
    struct ProbeOp {
        name: String,
        duration_us: f64,
    }
}
