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
            Error::DeadlineExceeded(_) => Code::DeadlineExceeded,
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

    #[test]
    fn image_errors_have_their_codes_and_never_a_host_path() {
        use crate::images::ImageError;
        let status = |e: ImageError| Status::from(Error::from(e));
        let s = status(ImageError::NotFound { image: "x".into(), available: vec!["debian".into(), "minimal".into()] });
        assert_eq!((s.code(), s.message()), (Code::NotFound, "image \"x\" not found; available: debian, minimal"));
        let s = Status::from(Error::from(crate::backend::BackendError::ImageNotFound { image: "x".into(), available: Vec::new() }));
        assert_eq!((s.code(), s.message()), (Code::NotFound, "image \"x\" not found; available: none"));
        assert_eq!(status(ImageError::DockerImageNotFound("a:b".into())).code(), Code::NotFound);
        assert_eq!(status(ImageError::Archive("layer l: x: refused".into())).code(), Code::InvalidArgument);
        assert_eq!(status(ImageError::Limit { what: "w".into(), limit: "1".into(), key: "max_entries" }).code(), Code::ResourceExhausted);
        let full = ImageError::io("layer", std::io::Error::from_raw_os_error(libc::ENOSPC));
        assert_eq!(status(full).code(), Code::ResourceExhausted);
        for e in [ImageError::Refused("in use".into()), ImageError::DockerUnavailable("down".into()), ImageError::BuildFailed("RUN false".into())] {
            assert_eq!(status(e).code(), Code::FailedPrecondition);
        }
        assert_eq!(status(ImageError::Aborted("gone".into())).code(), Code::Aborted);
        let s = status(ImageError::Invalid { field: "name", message: "bad".into() });
        assert!(s.code() == Code::InvalidArgument && s.message().contains("name"), "{s:?}");
    }
}
