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
    /// A JSON file did not decode.
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
