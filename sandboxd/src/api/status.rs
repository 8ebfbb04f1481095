//! The one place core errors become gRPC statuses.

use tonic::{Code, Status};

use crate::error::Error;

impl From<Error> for Status {
    fn from(e: Error) -> Self {
        let code = match &e {
            Error::SandboxNotFound(_)
            | Error::ExecNotFound(_)
            | Error::SnapshotNotFound(_)
            | Error::ImageNotFound { .. }
            | Error::FileNotFound(_)
            | Error::NotFound(_) => Code::NotFound,
            Error::InvalidArgument { .. } => Code::InvalidArgument,
            Error::IncorrectState { .. } | Error::Unavailable { .. } | Error::FailedPrecondition(_) => Code::FailedPrecondition,
            Error::ResourceExhausted(_) => Code::ResourceExhausted,
            Error::PermissionDenied(_) => Code::PermissionDenied,
            Error::Aborted(_) => Code::Aborted,
            Error::DataLoss(_) => Code::DataLoss,
            Error::Internal(_) => {
                tracing::error!(error = %e, "internal error");
                Code::Internal
            }
        };
        Status::new(code, e.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_follow_the_api_contract() {
        assert_eq!(Status::from(Error::SandboxNotFound("sb-x".into())).code(), Code::NotFound);
        let s = Status::from(Error::invalid("limits.memory_bytes", "too big"));
        assert_eq!(s.code(), Code::InvalidArgument);
        assert!(s.message().contains("limits.memory_bytes"));
        let s = Status::from(Error::Unavailable { isolation: crate::model::Isolation::Container, reason: "cannot reach Docker".into() });
        assert_eq!(s.code(), Code::FailedPrecondition);
        assert!(s.message().contains("CONTAINER"));
    }

    #[test]
    fn backend_file_errors_name_the_path_with_the_right_code() {
        use crate::backend::BackendError;
        let status = |e: BackendError| Status::from(Error::from(e));
        let s = status(BackendError::InvalidPath { path: "/workspace/loop-a".into(), reason: "too many levels of symbolic links".into() });
        assert_eq!(s.code(), Code::InvalidArgument);
        assert!(s.message().contains("/workspace/loop-a"), "the message names the path: {}", s.message());
        assert_eq!(status(BackendError::DiskFull { path: "/p".into() }).code(), Code::ResourceExhausted);
        assert_eq!(status(BackendError::FileNotFound { path: "/p".into() }).code(), Code::NotFound);
    }
}
