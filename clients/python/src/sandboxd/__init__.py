"""sandboxd: create sandboxes, run commands in them, move files, snapshot and fork.

    from sandboxd import Sandbox

    with Sandbox.create(isolation="process", image="debian", memory="1G") as sb:
        result = sb.exec(["python3", "-c", "print(6 * 7)"])
        print(result.exit_code, result.stdout_text)

The connection comes from `$SANDBOXD_SOCKET` (and `$SANDBOXD_TOKEN`, `$SANDBOXD_CA_CERT`), or
pass `client=Client(...)`. `sandboxd.aio` has the same API as coroutines.
"""

from . import images
from .client import Client
from .errors import (
    Aborted,
    AlreadyExists,
    ArchiveRefused,
    Cancelled,
    CommandFailed,
    DataLoss,
    DeadlineExceeded,
    FailedPrecondition,
    IntegrityError,
    Internal,
    InvalidArgument,
    NotFound,
    OutOfRange,
    PermissionDenied,
    ProtocolError,
    ResourceExhausted,
    SandboxdError,
    SessionClosed,
    Unauthenticated,
    Unavailable,
    Unimplemented,
    Unknown,
)
from .sandbox import Exec, ExecStream, Sandbox, Session
from .types import (
    DirTransfer,
    ExecResult,
    ExecStatus,
    FileTransfer,
    ImageInfo,
    ImageProgress,
    Isolation,
    Limits,
    NetworkEvent,
    OutputChunk,
    SandboxInfo,
    SandboxState,
    SnapshotInfo,
)

__all__ = [
    "Aborted", "AlreadyExists", "ArchiveRefused", "Cancelled", "Client", "CommandFailed", "DataLoss",
    "DeadlineExceeded", "DirTransfer", "Exec", "ExecResult", "ExecStatus", "ExecStream",
    "FailedPrecondition", "FileTransfer", "ImageInfo", "ImageProgress", "IntegrityError", "Internal",
    "InvalidArgument", "Isolation", "Limits", "NetworkEvent", "NotFound", "OutOfRange", "OutputChunk",
    "PermissionDenied", "ProtocolError", "ResourceExhausted", "Sandbox", "SandboxInfo",
    "SandboxState", "SandboxdError", "Session", "SessionClosed", "SnapshotInfo", "Unauthenticated",
    "Unavailable", "Unimplemented", "Unknown", "images",
]
