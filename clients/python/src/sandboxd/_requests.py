"""Requests built from the SDK's keyword arguments, shared by the sync and asyncio APIs."""

from __future__ import annotations

import hashlib
from typing import Mapping, Optional, Sequence, Union

from ._proto.sandbox.v1 import sandbox_pb2 as pb
from .errors import InvalidArgument, ProtocolError
from .types import FileTransfer, Isolation, parse_size

Size = Union[int, str, None]
IsolationArg = Union[str, int, Isolation, None]


def _ms(seconds: Optional[float], what: str) -> int:
    if seconds is None:
        return 0
    if seconds < 0:
        raise InvalidArgument(f"{what}: {seconds} is negative")
    return max(1, int(round(seconds * 1000))) if seconds > 0 else 0


def create_request(
    *,
    isolation: IsolationArg = None,
    image: Optional[str] = None,
    memory: Size = None,
    cpus: Optional[float] = None,
    disk: Size = None,
    pids: Optional[int] = None,
    shm: Size = None,
    exec_timeout: Optional[float] = None,
    env: Optional[Mapping[str, str]] = None,
    workdir: Optional[str] = None,
    labels: Optional[Mapping[str, str]] = None,
    ttl: Optional[float] = None,
    user: Optional[str] = None,
    from_snapshot: Optional[str] = None,
    network: Optional[str] = None,
    allow: Optional[Sequence[str]] = None,
    on_expiry: Optional[str] = None,
) -> pb.CreateSandboxRequest:
    """A CreateSandboxRequest. Sizes take ints (bytes) or strings ("512M", "1G"), `cpus` a
    number of CPUs (0.5 = 500 millicores), times seconds; None leaves the daemon's default."""
    if cpus is not None and cpus < 0:
        raise InvalidArgument(f"cpus: {cpus} is negative")
    if pids is not None and pids < 0:
        raise InvalidArgument(f"pids: {pids} is negative")
    limits = pb.ResourceLimits(
        cpu_millicores=int(round(cpus * 1000)) if cpus else 0,
        memory_bytes=parse_size(memory, "memory"),
        max_pids=pids or 0,
        disk_bytes=parse_size(disk, "disk"),
        exec_timeout_ms=_ms(exec_timeout, "exec_timeout"),
        shm_bytes=parse_size(shm, "shm"),
    )
    ttl_seconds = 0
    if ttl is not None:
        if ttl < 0:
            raise InvalidArgument(f"ttl: {ttl} is negative")
        ttl_seconds = int(ttl) if ttl == int(ttl) else int(ttl) + 1
    if on_expiry not in (None, "destroy", "pause"):
        raise InvalidArgument(f"on_expiry: {on_expiry!r}: expected 'destroy' or 'pause'")
    return pb.CreateSandboxRequest(
        isolation=int(Isolation.parse(isolation)),  # type: ignore[arg-type]
        image=image or "",
        limits=limits,
        env=dict(env or {}),
        workdir=workdir or "",
        labels=dict(labels or {}),
        ttl_seconds=ttl_seconds,
        user=user or "",
        from_snapshot_id=from_snapshot or "",
        network=network_policy(network, allow),
        on_expiry=pb.ON_EXPIRY_PAUSE if on_expiry == "pause" else pb.ON_EXPIRY_UNSPECIFIED,
    )


NETWORK_MODES = {"none": pb.NETWORK_MODE_NONE, "allowlist": pb.NETWORK_MODE_ALLOWLIST, "open": pb.NETWORK_MODE_OPEN}


def network_policy(network: Optional[str], allow: Optional[Sequence[str]]) -> Optional[pb.NetworkPolicy]:
    """The request's network: None (both None) leaves it to the daemon (NONE, a fork's parent's,
    or a policy rule's); `allow` entries imply "allowlist"."""
    if network is None and allow is None:
        return None
    if isinstance(allow, str):
        raise InvalidArgument("allow: a list of entries (\"name:port\", \"10.0.0.0/8:5432\"), not one string")
    mode = (network or "allowlist").lower()
    if mode not in NETWORK_MODES:
        raise InvalidArgument(f"network: {network!r} is not one of none, allowlist, open")
    return pb.NetworkPolicy(mode=NETWORK_MODES[mode], allow=list(allow or []))


def exec_request(
    sandbox_id: str,
    argv: Sequence[str],
    *,
    timeout: Optional[float] = None,
    env: Optional[Mapping[str, str]] = None,
    workdir: Optional[str] = None,
    user: Optional[str] = None,
    stdin: Union[bytes, str, None] = None,
    max_output: Size = None,
    idempotency_key: Optional[str] = None,
    background: bool = False,
) -> pb.ExecRequest:
    """An ExecRequest; `argv` is run as is (no shell is implied: use ["sh", "-c", "..."])."""
    if isinstance(argv, (str, bytes)):
        raise InvalidArgument("argv: a list of strings is expected (no shell is implied), got a string")
    if isinstance(stdin, str):
        stdin = stdin.encode()
    return pb.ExecRequest(
        sandbox_id=sandbox_id,
        argv=list(argv),
        env=dict(env or {}),
        workdir=workdir or "",
        stdin=stdin or b"",
        timeout_ms=_ms(timeout, "timeout"),
        max_output_bytes=parse_size(max_output, "max_output"),
        idempotency_key=idempotency_key or "",
        background=background,
        user=user or "",
    )


def rpc_deadline(exec_timeout: Optional[float]) -> Optional[float]:
    """The call deadline of an exec: its own timeout and a margin for the daemon to end it and
    answer, or none when the sandbox's default applies (the daemon ends it then)."""
    return None if exec_timeout is None else exec_timeout + 30.0


class DownloadCheck:
    """Checks a DownloadFile stream: the first message's `size`, the bytes that follow (never
    more than announced) and the trailing `sha256`."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.size: Optional[int] = None
        self.bytes = 0
        self.hasher = hashlib.sha256()
        self.trailer: Optional[str] = None

    def chunk(self, m: pb.DownloadChunk) -> bytes:
        from .errors import IntegrityError

        if self.trailer is not None:
            raise ProtocolError(f"the download of {self.path} went on after its sha256")
        if self.size is None:
            self.size = m.size
        self.bytes += len(m.data)
        if self.bytes > self.size:
            raise IntegrityError(
                f"integrity check of {self.path} failed: the daemon announced {self.size} bytes and sent more ({self.bytes})"
            )
        self.hasher.update(m.data)
        if m.sha256:
            self.trailer = m.sha256
        return m.data

    def finish(self) -> FileTransfer:
        from .errors import IntegrityError

        digest = self.hasher.hexdigest()
        if self.trailer is None:
            raise ProtocolError(f"the download of {self.path} ended without its sha256")
        if self.size is not None and self.bytes != self.size:
            raise IntegrityError(
                f"integrity check of {self.path} failed: the daemon announced {self.size} bytes and sent {self.bytes}"
            )
        if self.trailer.lower() != digest:
            raise IntegrityError(
                f"integrity check of {self.path} failed: received sha256 {digest}, the daemon sent {self.trailer}"
            )
        return FileTransfer(bytes=self.bytes, sha256=digest)


def check_upload(path: str, sent: int, sent_sha: str, written: int, their_sha: str) -> FileTransfer:
    """The daemon must have written what was sent: the same size and the same digest."""
    from .errors import IntegrityError

    if written != sent:
        raise IntegrityError(f"integrity check of {path} failed: sent {sent} bytes, the daemon wrote {written}")
    if their_sha.lower() != sent_sha:
        raise IntegrityError(f"integrity check of {path} failed: sent sha256 {sent_sha}, the daemon wrote {their_sha!r}")
    return FileTransfer(bytes=sent, sha256=sent_sha)
