"""Exceptions: one class per gRPC status code, each carrying the daemon's own message.

A command that fails inside a sandbox is never an exception: it is an `ExecResult` with its
status and exit code (see `ExecResult.check` for turning one into `CommandFailed`).
"""

from __future__ import annotations

from typing import Optional

import grpc


class SandboxdError(Exception):
    """Base class of every error this package raises.

    `code` is the gRPC status code (the daemon's, or the one a gRPC client would see for a
    local failure), `message` the daemon's message unchanged. `str()` reads
    `NOT_FOUND: sandbox sb-123 not found`.
    """

    code: grpc.StatusCode = grpc.StatusCode.UNKNOWN

    def __init__(self, message: str, *, code: Optional[grpc.StatusCode] = None) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code

    def __str__(self) -> str:
        return f"{self.code.name}: {self.message}"


class Cancelled(SandboxdError):
    code = grpc.StatusCode.CANCELLED


class Unknown(SandboxdError):
    code = grpc.StatusCode.UNKNOWN


class InvalidArgument(SandboxdError):
    """A malformed request; the daemon's message names the field."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class DeadlineExceeded(SandboxdError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class NotFound(SandboxdError):
    """An unknown sandbox, exec, snapshot, image, or file inside a sandbox."""

    code = grpc.StatusCode.NOT_FOUND


class AlreadyExists(SandboxdError):
    code = grpc.StatusCode.ALREADY_EXISTS


class PermissionDenied(SandboxdError):
    code = grpc.StatusCode.PERMISSION_DENIED


class ResourceExhausted(SandboxdError):
    """Over a configured capacity (sandboxes, execs, snapshots, streams, ...)."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class FailedPrecondition(SandboxdError):
    """The tier or operation cannot be served on this host, or the state is wrong."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class Aborted(SandboxdError):
    code = grpc.StatusCode.ABORTED


class OutOfRange(SandboxdError):
    code = grpc.StatusCode.OUT_OF_RANGE


class Unimplemented(SandboxdError):
    code = grpc.StatusCode.UNIMPLEMENTED


class Internal(SandboxdError):
    code = grpc.StatusCode.INTERNAL


class Unavailable(SandboxdError):
    """The daemon could not be reached (not running, wrong address, connection lost)."""

    code = grpc.StatusCode.UNAVAILABLE


class DataLoss(SandboxdError):
    code = grpc.StatusCode.DATA_LOSS


class Unauthenticated(SandboxdError):
    """A missing or wrong bearer token."""

    code = grpc.StatusCode.UNAUTHENTICATED


class IntegrityError(DataLoss):
    """What arrived is not what was announced (a size or SHA-256 that differs); whatever was
    received must be thrown away (a download never replaces the local file then)."""


class ProtocolError(Internal):
    """The daemon answered something the API contract rules out."""


class SessionClosed(FailedPrecondition):
    """An exec session's input was used after the session had ended."""


class ArchiveRefused(InvalidArgument):
    """A downloaded directory's tar stream holds an entry this client does not extract (an
    absolute path, `..`, a path through a symlink, a device node, ...); the message names it."""


class CommandFailed(SandboxdError):
    """Raised by `ExecResult.check()` for a command that did not exit with code 0."""

    code = grpc.StatusCode.UNKNOWN

    def __init__(self, message: str, result: object) -> None:
        super().__init__(message)
        self.result = result

    def __str__(self) -> str:
        return self.message


__all__ = [
    "Aborted", "AlreadyExists", "ArchiveRefused", "Cancelled", "CommandFailed", "DataLoss", "DeadlineExceeded",
    "FailedPrecondition", "IntegrityError", "Internal", "InvalidArgument", "NotFound", "OutOfRange",
    "PermissionDenied", "ProtocolError", "ResourceExhausted", "SandboxdError", "SessionClosed", "Unauthenticated",
    "Unavailable", "Unimplemented", "Unknown", "error_for", "from_rpc_error",
]

_BY_CODE: dict[grpc.StatusCode, type[SandboxdError]] = {
    cls.code: cls
    for cls in (
        Cancelled,
        Unknown,
        InvalidArgument,
        DeadlineExceeded,
        NotFound,
        AlreadyExists,
        PermissionDenied,
        ResourceExhausted,
        FailedPrecondition,
        Aborted,
        OutOfRange,
        Unimplemented,
        Internal,
        Unavailable,
        DataLoss,
        Unauthenticated,
    )
}


def error_for(code: grpc.StatusCode, message: str) -> SandboxdError:
    """The exception class of `code`, carrying `message`."""
    cls = _BY_CODE.get(code, SandboxdError)
    return cls(message, code=code)


def from_rpc_error(err: grpc.RpcError, what: str = "") -> SandboxdError:
    """The exception for a failed call (sync or asyncio); `what` prefixes local context only
    when the daemon's message is empty (a transport failure)."""
    code_of = getattr(err, "code", None)
    details_of = getattr(err, "details", None)
    code = code_of() if callable(code_of) else grpc.StatusCode.UNKNOWN
    details = details_of() if callable(details_of) else None
    message = str(details) if details else (what or str(err))
    if not isinstance(code, grpc.StatusCode):
        code = grpc.StatusCode.UNKNOWN
    return error_for(code, message)
