//! The one error type of the client library.

use tonic::Code;

/// Result alias used throughout the client library.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything a call to `sandboxd` can fail with.
///
/// Status errors keep the daemon's [`tonic::Status`] untouched, so callers can match on
/// [`Error::code`] (`NOT_FOUND`, `INVALID_ARGUMENT`, …) as the API contract describes.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The address is not one of the accepted forms.
    #[error("invalid sandboxd address {addr:?}: {reason}")]
    InvalidAddress {
        /// The address as given.
        addr: String,
        /// What is wrong with it.
        reason: String,
    },

    /// The current directory, needed to resolve a relative socket path, is unavailable.
    #[error("cannot resolve socket path {path:?} against the current directory")]
    CurrentDir {
        /// The relative path that needed resolving.
        path: String,
        /// Why the current directory could not be read.
        #[source]
        source: std::io::Error,
    },

    /// The daemon could not be reached.
    #[error("cannot connect to sandboxd at {addr}")]
    Connect {
        /// The address that was dialled (UNIX paths are absolute here).
        addr: String,
        /// The transport's reason.
        #[source]
        source: tonic::transport::Error,
    },

    /// The bearer token cannot be sent as an HTTP header value.
    #[error("invalid bearer token: it must be visible ASCII without control characters")]
    InvalidToken,

    /// The daemon answered with a gRPC error status.
    ///
    /// Displayed as `CODE: message`, e.g. `NOT_FOUND: sandbox sb-123 not found`.
    #[error("{}: {}", code_name(.0.code()), .0.message())]
    Status(tonic::Status),

    /// The daemon answered with something the API contract rules out.
    #[error("protocol error: {0}")]
    Protocol(String),

    /// Reading or writing the local side of a transfer failed (the reader given to an upload,
    /// the writer given to a download).
    #[error("{what}")]
    Io {
        /// What was being done, e.g. `cannot read the upload of /workspace/a`.
        what: String,
        /// The operating system's reason.
        #[source]
        source: std::io::Error,
    },

    /// What arrived is not what was announced: a download's size or SHA-256 differs from the
    /// daemon's own, or an upload's digest differs from the one the daemon computed. Whatever
    /// was written locally must be thrown away.
    #[error("integrity check of {path} failed: {reason}")]
    Integrity {
        /// The file in the sandbox.
        path: String,
        /// Which check failed, with both values.
        reason: String,
    },

    /// An exec session's input was used after the session had ended (its result arrived, or
    /// the call failed).
    #[error("the exec session has ended")]
    SessionClosed,
}

impl Error {
    /// The gRPC code of this error.
    ///
    /// Status errors carry the daemon's code; errors raised on this side map to the code a
    /// gRPC client would see for them (`UNAVAILABLE` for a failed connection, `INVALID_ARGUMENT`
    /// for a bad address or token, `INTERNAL` for a protocol violation, `DATA_LOSS` for a failed
    /// integrity check, `FAILED_PRECONDITION` for a session that has ended, `UNKNOWN` for a
    /// local I/O error).
    pub fn code(&self) -> Code {
        match self {
            Error::Status(status) => status.code(),
            Error::Connect { .. } => Code::Unavailable,
            Error::InvalidAddress { .. } | Error::InvalidToken | Error::CurrentDir { .. } => {
                Code::InvalidArgument
            }
            Error::Protocol(_) => Code::Internal,
            // A local reader or writer failing has no gRPC counterpart.
            Error::Io { .. } => Code::Unknown,
            // What the daemon itself answers for a digest that differs.
            Error::Integrity { .. } => Code::DataLoss,
            Error::SessionClosed => Code::FailedPrecondition,
        }
    }

    /// The daemon's status, if this error is one.
    pub fn status(&self) -> Option<&tonic::Status> {
        match self {
            Error::Status(status) => Some(status),
            _ => None,
        }
    }
}

// Written by hand rather than with `#[from]`: that would also make the status the error's
// `source`, and a reporter walking the chain would print its verbose `Debug`-like text twice.
impl From<tonic::Status> for Error {
    fn from(status: tonic::Status) -> Self {
        Error::Status(status)
    }
}

/// The canonical upper-case name of a gRPC code, as in the gRPC spec (`NOT_FOUND`, …).
pub fn code_name(code: Code) -> &'static str {
    match code {
        Code::Ok => "OK",
        Code::Cancelled => "CANCELLED",
        Code::Unknown => "UNKNOWN",
        Code::InvalidArgument => "INVALID_ARGUMENT",
        Code::DeadlineExceeded => "DEADLINE_EXCEEDED",
        Code::NotFound => "NOT_FOUND",
        Code::AlreadyExists => "ALREADY_EXISTS",
        Code::PermissionDenied => "PERMISSION_DENIED",
        Code::ResourceExhausted => "RESOURCE_EXHAUSTED",
        Code::FailedPrecondition => "FAILED_PRECONDITION",
        Code::Aborted => "ABORTED",
        Code::OutOfRange => "OUT_OF_RANGE",
        Code::Unimplemented => "UNIMPLEMENTED",
        Code::Internal => "INTERNAL",
        Code::Unavailable => "UNAVAILABLE",
        Code::DataLoss => "DATA_LOSS",
        Code::Unauthenticated => "UNAUTHENTICATED",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_displays_code_and_message() {
        let err = Error::from(tonic::Status::not_found("sandbox sb-123 not found"));
        assert_eq!(err.to_string(), "NOT_FOUND: sandbox sb-123 not found");
        assert_eq!(err.code(), Code::NotFound);
        assert!(std::error::Error::source(&err).is_none());
    }

    #[test]
    fn local_errors_have_codes() {
        let err = Error::InvalidAddress {
            addr: "ftp://x".into(),
            reason: "unsupported".into(),
        };
        assert_eq!(err.code(), Code::InvalidArgument);
        assert_eq!(Error::Protocol("x".into()).code(), Code::Internal);
    }
}
