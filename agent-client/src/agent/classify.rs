//! What a daemon error means to the loop, decided in one place: by the gRPC code and the
//! operation that got it, never by the words of the message.
//!
//! The daemon words its errors for people ("no such file in sandbox: /x" and "sandbox sb-1 not
//! found" both say "sandbox"), so a loop that reads the text takes a missing file for a vanished
//! sandbox. The code and the call are the contract: a `NOT_FOUND` of a call that names only the
//! sandbox means the sandbox is gone; of a call that also names a file, an exec or a snapshot,
//! it means that thing is missing — unless a lookup of the sandbox says otherwise
//! ([`Class::TargetMissing`]).

use tonic::Code;

/// A daemon call the loop makes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    /// CreateSandbox (a fresh one, or a fork of a snapshot).
    Create,
    /// GetSandbox.
    GetSandbox,
    /// Exec.
    Exec,
    /// GetExec: names an exec.
    GetExec,
    /// ListExecs.
    ListExecs,
    /// ReadFile: names a file.
    ReadFile,
    /// WriteFile: names a file (its parents are created).
    WriteFile,
    /// Snapshot.
    Snapshot,
    /// ListSnapshots.
    ListSnapshots,
    /// Rollback: names a snapshot.
    Rollback,
    /// DeleteSnapshot: names a snapshot.
    DeleteSnapshot,
    /// DestroySandbox.
    Destroy,
}

impl Op {
    /// Whether the call names something besides the sandbox, so that its `NOT_FOUND` may be
    /// about that thing.
    fn names_a_target(self) -> bool {
        matches!(
            self,
            Op::GetExec
                | Op::ReadFile
                | Op::WriteFile
                | Op::Rollback
                | Op::DeleteSnapshot
                | Op::Create
        )
    }

    /// The RPC's name, for messages.
    pub fn name(self) -> &'static str {
        match self {
            Op::Create => "CreateSandbox",
            Op::GetSandbox => "GetSandbox",
            Op::Exec => "Exec",
            Op::GetExec => "GetExec",
            Op::ListExecs => "ListExecs",
            Op::ReadFile => "ReadFile",
            Op::WriteFile => "WriteFile",
            Op::Snapshot => "Snapshot",
            Op::ListSnapshots => "ListSnapshots",
            Op::Rollback => "Rollback",
            Op::DeleteSnapshot => "DeleteSnapshot",
            Op::Destroy => "DestroySandbox",
        }
    }
}

/// What the loop does about a daemon error.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Class {
    /// The daemon (or the way to it) is down or restarting: wait and try again. Only a call
    /// that is safe to repeat is re-sent as it is (see [`super::tools::Repeat`]).
    Transient,
    /// The sandbox is gone: nothing the model does can help. Fatal for the session; a resume
    /// forks the last snapshot.
    SandboxGone,
    /// Something the call named besides the sandbox (a file, an exec, a snapshot) does not
    /// exist — or the sandbox itself does not: the loop asks for the sandbox to tell which.
    TargetMissing,
    /// An answer to the request: a policy or capacity limit (`RESOURCE_EXHAUSTED`), a bad
    /// argument, an operation the sandbox's state does not allow. The model is told and adapts;
    /// the daemon is fine.
    Refused,
    /// The daemon does not accept our credentials: fatal, and no retry will change it.
    Credentials,
}

/// The class of `e`, an error of the call `op`.
pub fn classify(op: Op, e: &crate::Error) -> Class {
    match e.code() {
        // A connection that broke (UNKNOWN, CANCELLED are what a reset mid-call gives) or a
        // daemon going down or busy restarting.
        Code::Unavailable
        | Code::DeadlineExceeded
        | Code::Unknown
        | Code::Cancelled
        | Code::Aborted => Class::Transient,
        Code::NotFound if op.names_a_target() => Class::TargetMissing,
        Code::NotFound => Class::SandboxGone,
        Code::Unauthenticated | Code::PermissionDenied => Class::Credentials,
        // RESOURCE_EXHAUSTED is a cap the daemon holds to on purpose (the 33rd background job,
        // a full disk quota): retrying the same request gets the same answer.
        Code::ResourceExhausted
        | Code::InvalidArgument
        | Code::FailedPrecondition
        | Code::OutOfRange
        | Code::AlreadyExists
        | Code::Unimplemented
        | Code::Internal
        | Code::DataLoss
        | Code::Ok => Class::Refused,
    }
}

/// The daemon's own words of `e` (its status message), without our prefix.
pub fn message(e: &crate::Error) -> String {
    e.status()
        .map_or_else(|| e.to_string(), |s| s.message().to_owned())
}

/// A daemon error with the call that got it.
#[derive(Debug, thiserror::Error)]
#[error("{} failed: {source}", .op.name())]
pub struct OpError {
    /// The call.
    pub op: Op,
    /// The client's error.
    #[source]
    pub source: crate::Error,
}

impl OpError {
    /// Wraps `source` as an error of `op`.
    pub fn new(op: Op, source: crate::Error) -> Self {
        OpError { op, source }
    }

    /// Its class.
    pub fn class(&self) -> Class {
        classify(self.op, &self.source)
    }
}

/// `Result::map_err` helper: tags an error with its call.
pub fn at(op: Op) -> impl FnOnce(crate::Error) -> OpError {
    move |source| OpError::new(op, source)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn status(code: Code, message: &str) -> crate::Error {
        crate::Error::Status(tonic::Status::new(code, message))
    }

    #[test]
    fn a_missing_file_is_not_a_missing_sandbox_whatever_the_words() {
        // The daemon's own text for a missing file mentions the sandbox.
        let e = status(
            Code::NotFound,
            "no such file in sandbox: /workspace/missing.txt",
        );
        assert_eq!(classify(Op::ReadFile, &e), Class::TargetMissing);
        assert_eq!(
            classify(
                Op::Rollback,
                &status(Code::NotFound, "snapshot sn-1 not found")
            ),
            Class::TargetMissing
        );
        // A call that names only the sandbox: its NOT_FOUND is the sandbox, even worded as a file.
        assert_eq!(
            classify(Op::Exec, &status(Code::NotFound, "no such file")),
            Class::SandboxGone
        );
        assert_eq!(classify(Op::Snapshot, &e), Class::SandboxGone);
    }

    #[test]
    fn caps_are_answers_and_outages_are_retried() {
        let cap = status(
            Code::ResourceExhausted,
            "policy.max_background_execs_per_sandbox (32) reached",
        );
        for op in [Op::Exec, Op::WriteFile, Op::Snapshot] {
            assert_eq!(classify(op, &cap), Class::Refused, "{op:?}");
        }
        assert_eq!(
            classify(Op::Exec, &status(Code::Unavailable, "")),
            Class::Transient
        );
        assert_eq!(
            classify(Op::ReadFile, &status(Code::Unknown, "connection reset")),
            Class::Transient
        );
        assert_eq!(
            classify(Op::Exec, &status(Code::Unauthenticated, "")),
            Class::Credentials
        );
        assert_eq!(
            classify(Op::ReadFile, &status(Code::InvalidArgument, "invalid path")),
            Class::Refused
        );
    }
}
