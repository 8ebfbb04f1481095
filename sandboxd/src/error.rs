//! The daemon core's error type. It becomes a gRPC status in exactly one place (`api::status`).

use crate::backend::BackendError;
use crate::images::ImageError;
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
    #[error("image {image:?} not found; available: {}", if .available.is_empty() { "none".to_string() } else { .available.join(", ") })]
    ImageNotFound { image: String, available: Vec<String> },
    /// Something else a request names does not exist (a Docker image to import).
    #[error("{0}")]
    NotFound(String),
    #[error("no such file in sandbox: {0}")]
    FileNotFound(String),
    #[error("invalid {field}: {message}")]
    InvalidArgument { field: String, message: String },
    #[error("sandbox {id} is {state:?}: cannot {operation}{}", resume_hint(*.state, .id))]
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
    /// A stream the client left idle past `streams.idle_timeout_ms`.
    #[error("{0}")]
    DeadlineExceeded(String),
    #[error("internal error: {0}")]
    Internal(String),
}

/// What to do about a paused sandbox, said where an operation meets one.
fn resume_hint(state: SandboxState, id: &str) -> String {
    match state {
        SandboxState::Paused => format!(" while it is paused; resume it first (ResumeSandbox, `sbx resume {id}`)"),
        _ => String::new(),
    }
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
            BackendError::ImageNotFound { image, available } => Error::ImageNotFound { image, available },
            BackendError::Unavailable { isolation, reason } => Error::Unavailable { isolation, reason },
            BackendError::NoSuchSandbox(id) => Error::SandboxNotFound(id.to_string()),
            BackendError::NoSuchSnapshot(id) => Error::SnapshotNotFound(id.to_string()),
            BackendError::NoSuchExec(id) => Error::FailedPrecondition(format!("exec {id} is not running")),
            BackendError::InvalidPath { path, reason } => Error::invalid("path", format!("{path:?}: {reason}")),
            BackendError::FileNotFound { path } => Error::FileNotFound(path),
            e @ BackendError::DiskFull { .. } => Error::ResourceExhausted(e.to_string()),
            e @ BackendError::UploadIncomplete { .. } => Error::Aborted(e.to_string()),
            e @ BackendError::Idle { .. } => Error::DeadlineExceeded(e.to_string()),
            e @ BackendError::SnapshotUnusable { .. } => Error::DataLoss(e.to_string()),
            BackendError::Archive(e) => archive_error(e),
            e @ (BackendError::Io { .. } | BackendError::Internal(_)) => Error::Internal(e.to_string()),
        }
    }
}

impl From<ImageError> for Error {
    /// Each image error with its code: an unknown image or Docker image NOT_FOUND, a bad
    /// request or archive INVALID_ARGUMENT, a bound or a full disk RESOURCE_EXHAUSTED, what the
    /// state forbids (in use, a script-built image, Docker down, a failed build)
    /// FAILED_PRECONDITION, a client that broke off ABORTED.
    fn from(e: ImageError) -> Self {
        match e {
            ImageError::NotFound { image, available } => Error::ImageNotFound { image, available },
            e @ ImageError::DockerImageNotFound(_) => Error::NotFound(e.to_string()),
            ImageError::Invalid { field, message } => Error::invalid(field, message),
            e @ ImageError::Archive(_) => Error::invalid("archive", e.to_string()),
            e @ (ImageError::Limit { .. } | ImageError::StoreFull(_)) => Error::ResourceExhausted(e.to_string()),
            e if e.is_disk_full() => Error::ResourceExhausted(e.to_string()),
            e @ (ImageError::Refused(_) | ImageError::NotReady { .. } | ImageError::DockerUnavailable(_) | ImageError::BuildFailed(_)) => {
                Error::FailedPrecondition(e.to_string())
            }
            ImageError::Aborted(m) => Error::Aborted(m),
            e @ (ImageError::Io { .. } | ImageError::Internal(_)) => Error::Internal(e.to_string()),
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
