//! The daemon core's error type. It becomes a gRPC status in exactly one place (`api::status`).

use crate::backend::BackendError;
use crate::model::{Isolation, SandboxState};
use crate::store::StoreError;

/// What can go wrong in a core call, with enough context to tell the user what and where.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("sandbox {0} not found")]
    SandboxNotFound(String),
    #[error("exec {0} not found")]
    ExecNotFound(String),
    #[error("snapshot {0} not found")]
    SnapshotNotFound(String),
    #[error("image {image:?} not found in {dir}")]
    ImageNotFound { image: String, dir: String },
    #[error("no such file in sandbox: {0}")]
    FileNotFound(String),
    #[error("invalid {field}: {message}")]
    InvalidArgument { field: String, message: String },
    #[error("sandbox {id} is {state:?}: cannot {operation}")]
    IncorrectState { id: String, state: SandboxState, operation: &'static str },
    #[error("isolation {} unavailable: {reason}", .isolation.name())]
    Unavailable { isolation: Isolation, reason: String },
    #[error("{0}")]
    FailedPrecondition(String),
    #[error("{0}")]
    ResourceExhausted(String),
    #[error("{0}")]
    PermissionDenied(String),
    /// A transfer that did not complete (the client went away, or broke off).
    #[error("{0}")]
    Aborted(String),
    /// What arrived is not what the client sent (a checksum did not match).
    #[error("{0}")]
    DataLoss(String),
    #[error("internal error: {0}")]
    Internal(String),
}

impl Error {
    /// An INVALID_ARGUMENT naming the request field.
    pub fn invalid(field: impl Into<String>, message: impl Into<String>) -> Self {
        Error::InvalidArgument { field: field.into(), message: message.into() }
    }
}

impl From<BackendError> for Error {
    fn from(e: BackendError) -> Self {
        match e {
            BackendError::ImageNotFound { image, dir } => Error::ImageNotFound { image, dir },
            BackendError::Unavailable { isolation, reason } => Error::Unavailable { isolation, reason },
            BackendError::NoSuchSandbox(id) => Error::SandboxNotFound(id.to_string()),
            BackendError::NoSuchSnapshot(id) => Error::SnapshotNotFound(id.to_string()),
            BackendError::NoSuchExec(id) => Error::FailedPrecondition(format!("exec {id} is not running")),
            BackendError::InvalidPath { path, reason } => Error::invalid("path", format!("{path:?}: {reason}")),
            BackendError::FileNotFound { path } => Error::FileNotFound(path),
            e @ BackendError::DiskFull { .. } => Error::ResourceExhausted(e.to_string()),
            e @ BackendError::UploadIncomplete { .. } => Error::Aborted(e.to_string()),
            BackendError::Archive(e) => archive_error(e),
            e @ (BackendError::Io { .. } | BackendError::Internal(_)) => Error::Internal(e.to_string()),
        }
    }
}

impl From<StoreError> for Error {
    /// The state database failing is never the caller's fault.
    fn from(e: StoreError) -> Self {
        Error::Internal(e.to_string())
    }
}

/// An archive's error: what the archive or its path got wrong is INVALID_ARGUMENT naming the
/// entry, a limit or a full disk RESOURCE_EXHAUSTED, a missing source NOT_FOUND.
fn archive_error(e: sandbox_exec::archive::ArchiveError) -> Error {
    use sandbox_exec::archive::ArchiveError as A;
    match e {
        A::NotFound { path } => Error::FileNotFound(path),
        e @ A::Limit { .. } => Error::ResourceExhausted(format!("archive: {e}")),
        A::Io { path, source } if matches!(source.raw_os_error(), Some(libc::ENOSPC | libc::EDQUOT)) => {
            Error::ResourceExhausted(format!("the sandbox's disk is full (disk_bytes reached) writing {path}"))
        }
        A::Io { path, source } if source.kind() == std::io::ErrorKind::ConnectionAborted => {
            Error::Aborted(format!("archive: the upload broke off at {path}: {source}"))
        }
        e @ A::Io { .. } => Error::Internal(format!("archive: {e}")),
        e @ (A::Unsafe { .. } | A::Unsupported { .. } | A::NotADirectory { .. } | A::Malformed { .. }) => Error::invalid("archive", e.to_string()),
    }
}
