//! One error type for the whole crate. Every error carries a message that names the file (and
//! tensor) it is about, and has a [`Kind`] that fixes the process exit code the CLI documents,
//! the same in every command.

use std::path::{Path, PathBuf};

/// Exit code for bad input: malformed checkpoints, configs, arguments or model references.
pub const EXIT_BAD_INPUT: i32 = 2;
/// Exit code for NaN or Inf: found in an input (`inspect --check`, or before a merge or a score
/// uses it) or produced by the arithmetic (an activation or a merged value overflowing f32).
pub const EXIT_NON_FINITE: i32 = 3;
/// Exit code for failures while writing an output, and for internal errors.
pub const EXIT_FAILURE: i32 = 1;
/// Exit codes of a run stopped by a signal are 128 + the signal's number, as shells report them:
/// 130 for SIGINT (Ctrl-C), 143 for SIGTERM, 129 for SIGHUP.
pub const EXIT_SIGNAL_BASE: i32 = 128;

/// What kind of failure an error is; each kind has one exit code.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// The input (a checkpoint, config, argument, model reference) is unusable: exit 2.
    BadInput,
    /// Writing an output failed (disk full, permissions); nothing partial is left behind: exit 1.
    Write,
    /// NaN or Inf, in an input or produced by the arithmetic: exit 3.
    NonFinite,
    /// Not the input's fault: a device error, a decomposition that did not converge on finite
    /// values, a broken invariant: exit 1.
    Internal,
    /// Stopped by a signal (SIGINT, SIGTERM, SIGHUP): exit 128 + the signal's number.
    Interrupted(i32),
}

impl Kind {
    pub fn exit_code(self) -> i32 {
        match self {
            Kind::BadInput => EXIT_BAD_INPUT,
            Kind::Write | Kind::Internal => EXIT_FAILURE,
            Kind::NonFinite => EXIT_NON_FINITE,
            Kind::Interrupted(signal) => EXIT_SIGNAL_BASE + signal,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The input is unusable.
    #[error("{0}")]
    BadInput(String),
    /// An input file could not be read. The message includes the I/O error, which is also the
    /// source, for callers that want its `io::ErrorKind`.
    #[error("{}: cannot read: {source}", path.display())]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    /// Writing the output failed, for a reason that is not one file's I/O error.
    #[error("{0}")]
    Write(String),
    /// An output file could not be written; as [`Error::Read`], the I/O error is the source.
    #[error("{}: cannot write: {source}", path.display())]
    WriteFile {
        path: PathBuf,
        source: std::io::Error,
    },
    /// NaN or Inf values.
    #[error("{0}")]
    NonFinite(String),
    /// An internal failure.
    #[error("{0}")]
    Internal(String),
    /// The user stopped the run with a signal; the output in progress was removed.
    #[error("interrupted by {}", signal_name(*.0))]
    Interrupted(i32),
    /// Another error with what was being done when it happened; it keeps that error's kind.
    #[error("{context}: {source}")]
    Context { context: String, source: Box<Error> },
}

impl Error {
    pub fn kind(&self) -> Kind {
        match self {
            Error::BadInput(_) | Error::Read { .. } => Kind::BadInput,
            Error::Write(_) | Error::WriteFile { .. } => Kind::Write,
            Error::NonFinite(_) => Kind::NonFinite,
            Error::Internal(_) => Kind::Internal,
            Error::Interrupted(signal) => Kind::Interrupted(*signal),
            Error::Context { source, .. } => source.kind(),
        }
    }

    pub fn exit_code(&self) -> i32 {
        self.kind().exit_code()
    }

    /// This error, its message prefixed with `context` and `: `, of the same kind.
    pub fn context(self, context: impl Into<String>) -> Self {
        Error::Context {
            context: context.into(),
            source: Box::new(self),
        }
    }

    /// An I/O failure while reading an input file.
    pub fn read(path: &Path, err: std::io::Error) -> Self {
        Error::Read {
            path: path.to_path_buf(),
            source: err,
        }
    }

    /// An I/O failure while writing an output file.
    pub fn write(path: &Path, err: std::io::Error) -> Self {
        Error::WriteFile {
            path: path.to_path_buf(),
            source: err,
        }
    }
}

/// The message a panic carries (`panic!("...")` gives a `&str` or a `String`), for the one
/// line that reports it.
pub fn panic_message(payload: &(dyn std::any::Any + Send)) -> Option<String> {
    (payload.downcast_ref::<&str>().map(|s| s.to_string()))
        .or_else(|| payload.downcast_ref::<String>().cloned())
}

/// The conventional name of the signals sinkmerge handles, for messages.
pub fn signal_name(signal: i32) -> String {
    match signal {
        1 => "SIGHUP".into(),
        2 => "SIGINT".into(),
        15 => "SIGTERM".into(),
        other => format!("signal {other}"),
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

/// `internal!(...)`: build an `Internal` error formatted like `format!`, for failures that are
/// not the input's fault (a broken invariant, a decomposition that did not converge).
#[macro_export]
macro_rules! internal {
    ($($arg:tt)*) => {
        $crate::error::Error::Internal(format!($($arg)*))
    };
}

/// `non_finite!(...)`: build a `NonFinite` error formatted like `format!`.
#[macro_export]
macro_rules! non_finite {
    ($($arg:tt)*) => {
        $crate::error::Error::NonFinite(format!($($arg)*))
    };
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::error::Error as _;

    #[test]
    fn io_errors_keep_their_message_and_expose_the_io_error_as_source() {
        let err = Error::read(
            Path::new("m/config.json"),
            std::io::Error::from(std::io::ErrorKind::PermissionDenied),
        );
        assert_eq!(
            err.to_string(),
            "m/config.json: cannot read: permission denied"
        );
        assert_eq!(err.exit_code(), EXIT_BAD_INPUT);
        let io = err
            .source()
            .unwrap()
            .downcast_ref::<std::io::Error>()
            .unwrap();
        assert_eq!(io.kind(), std::io::ErrorKind::PermissionDenied);
        let err = Error::write(Path::new("out"), std::io::Error::other("disk full"));
        assert_eq!(err.to_string(), "out: cannot write: disk full");
        assert_eq!(err.kind(), Kind::Write);
        assert!(err.source().is_some());
    }

    #[test]
    fn each_kind_has_one_exit_code() {
        assert_eq!(bad!("x").exit_code(), 2);
        assert_eq!(internal!("x").exit_code(), 1);
        assert_eq!(non_finite!("x").exit_code(), 3);
        assert_eq!(Error::Write("x".into()).exit_code(), 1);
    }

    #[test]
    fn context_prefixes_the_message_and_keeps_the_kind() {
        let err = non_finite!("overflow").context("star: tensor `w`");
        assert_eq!(err.to_string(), "star: tensor `w`: overflow");
        assert_eq!(err.kind(), Kind::NonFinite);
        assert_eq!(internal!("x").context("a").context("b").exit_code(), 1);
    }
}
