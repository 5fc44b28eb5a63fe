//! One error type for the whole crate. Every error carries a message that names the file (and
//! tensor) it is about, and maps to the process exit code the CLI documents.

use std::path::Path;

/// Exit code for bad input: malformed checkpoints, configs, arguments or model references.
pub const EXIT_BAD_INPUT: i32 = 2;
/// Exit code for `--check` finding NaN or Inf values.
pub const EXIT_NON_FINITE: i32 = 3;
/// Exit code for failures while writing an output, or internal errors.
pub const EXIT_FAILURE: i32 = 1;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The input (a checkpoint, config, argument, model reference) is unusable.
    #[error("{0}")]
    BadInput(String),
    /// Writing the output failed (disk full, permissions); nothing partial is left behind.
    #[error("{0}")]
    Write(String),
    /// A scan found NaN or Inf values.
    #[error("{0}")]
    NonFinite(String),
    /// An internal failure: a device error or a broken invariant, not the input's fault.
    #[error("{0}")]
    Internal(String),
}

impl Error {
    pub fn exit_code(&self) -> i32 {
        match self {
            Error::BadInput(_) => EXIT_BAD_INPUT,
            Error::Write(_) | Error::Internal(_) => EXIT_FAILURE,
            Error::NonFinite(_) => EXIT_NON_FINITE,
        }
    }

    /// An I/O failure while reading an input file.
    pub fn read(path: &Path, err: std::io::Error) -> Self {
        Error::BadInput(format!("{}: cannot read: {err}", path.display()))
    }

    /// An I/O failure while writing an output file.
    pub fn write(path: &Path, err: std::io::Error) -> Self {
        Error::Write(format!("{}: cannot write: {err}", path.display()))
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// `bail!(...)`: return a `BadInput` error formatted like `format!`.
#[macro_export]
macro_rules! bail {
    ($($arg:tt)*) => {
        return Err($crate::error::Error::BadInput(format!($($arg)*)))
    };
}

/// `bad!(...)`: build a `BadInput` error formatted like `format!`.
#[macro_export]
macro_rules! bad {
    ($($arg:tt)*) => {
        $crate::error::Error::BadInput(format!($($arg)*))
    };
}
