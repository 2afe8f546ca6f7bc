//! The CLI's error: a one-line message that says what to do, and the exit code it ends with.

/// Exit code of a failed operation (I/O error, unclean fsck, fio failure).
pub const EXIT_FAILED: i32 = 1;
/// Exit code of bad input (flags, sizes, targets).
pub const EXIT_BAD_INPUT: i32 = 2;

/// A failure the user sees as `error: <message>`.
#[derive(Debug)]
pub struct CliError {
    pub message: String,
    pub exit_code: i32,
}

impl CliError {
    /// Bad input: the user can fix the command line.
    pub fn input(message: impl Into<String>) -> Self {
        CliError { message: message.into(), exit_code: EXIT_BAD_INPUT }
    }
    /// A failed operation.
    pub fn failed(message: impl Into<String>) -> Self {
        CliError { message: message.into(), exit_code: EXIT_FAILED }
    }
}

impl From<teraio_engine::Error> for CliError {
    fn from(e: teraio_engine::Error) -> Self {
        use teraio_engine::Error as E;
        let exit_code = match &e {
            E::InvalidConfig(_)
            | E::NotATeraioDevice { .. }
            | E::WrongStore { .. }
            | E::MissingDevice { .. }
            | E::DuplicateDevice { .. }
            | E::DeviceCountMismatch { .. }
            | E::DeviceTooSmall { .. }
            | E::DirectIoUnsupported { .. }
            | E::DeviceOpen { .. }
            | E::BackendUnavailable { .. } => EXIT_BAD_INPUT,
            _ => EXIT_FAILED,
        };
        // Engine messages are single sentences already; keep them on one line regardless.
        CliError { message: e.to_string().replace('\n', " "), exit_code }
    }
}

impl From<teraio_planner::Error> for CliError {
    fn from(e: teraio_planner::Error) -> Self {
        use teraio_planner::Error as E;
        // A file that is not there or does not decode, a trace or plan that breaks a rule, an
        // unknown model or GPU: the user fixes the command line or the file. Writing failed: 1.
        let exit_code = match &e {
            E::InvalidTrace(_) | E::InvalidPlan(_) | E::Config(_) | E::Decode { .. } => EXIT_BAD_INPUT,
            E::Io { source, .. } if source.kind() == std::io::ErrorKind::NotFound => EXIT_BAD_INPUT,
            E::Io { .. } | E::Json { .. } => EXIT_FAILED,
        };
        CliError { message: e.to_string().replace('\n', " "), exit_code }
    }
}

/// The CLI's result alias.
pub type CliResult<T> = Result<T, CliError>;
