"""The typed values the SDK returns, converted once from the protobuf messages."""

from __future__ import annotations

import enum
import re
import shlex
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Mapping, Optional, Sequence, Union

from google.protobuf.timestamp_pb2 import Timestamp

from ._proto.sandbox.v1 import sandbox_pb2 as pb
from .errors import CommandFailed, InvalidArgument


class Isolation(enum.IntEnum):
    """Isolation tier of a sandbox (`UNSPECIFIED` lets the daemon's policy choose)."""

    UNSPECIFIED = pb.ISOLATION_UNSPECIFIED
    PROCESS = pb.ISOLATION_PROCESS
    CONTAINER = pb.ISOLATION_CONTAINER
    MICROVM = pb.ISOLATION_MICROVM

    @classmethod
    def parse(cls, value: Union[str, int, "Isolation", None]) -> "Isolation":
        """`"process"`, `"container"`, `"microvm"` (any case), an `Isolation`, or None."""
        if value is None:
            return cls.UNSPECIFIED
        if isinstance(value, str):
            try:
                return cls[value.strip().upper()]
            except KeyError:
                raise InvalidArgument(
                    f"isolation {value!r}: expected process, container or microvm"
                ) from None
        try:
            return cls(value)
        except ValueError:
            raise InvalidArgument(f"isolation {value!r}: expected process, container or microvm") from None


class SandboxState(enum.IntEnum):
    UNSPECIFIED = pb.SANDBOX_STATE_UNSPECIFIED
    CREATING = pb.SANDBOX_STATE_CREATING
    RUNNING = pb.SANDBOX_STATE_RUNNING
    FAILED = pb.SANDBOX_STATE_FAILED
    DESTROYED = pb.SANDBOX_STATE_DESTROYED
    #: Frozen in place by `Sandbox.pause()` (or its TTL with `on_expiry="pause"`).
    PAUSED = pb.SANDBOX_STATE_PAUSED


class ExecStatus(enum.IntEnum):
    """Why an exec ended: exactly one answer."""

    UNSPECIFIED = pb.EXEC_STATUS_UNSPECIFIED
    EXITED = pb.EXEC_STATUS_EXITED
    SIGNALED = pb.EXEC_STATUS_SIGNALED
    TIMED_OUT = pb.EXEC_STATUS_TIMED_OUT
    OOM_KILLED = pb.EXEC_STATUS_OOM_KILLED
    SPAWN_FAILED = pb.EXEC_STATUS_SPAWN_FAILED
    RUNNING = pb.EXEC_STATUS_RUNNING
    LOST = pb.EXEC_STATUS_LOST


def _time(ts: Timestamp, present: bool = True) -> Optional[datetime]:
    if not present or (ts.seconds == 0 and ts.nanos == 0):
        return None
    return datetime.fromtimestamp(ts.seconds + ts.nanos / 1e9, tz=timezone.utc)


@dataclass(frozen=True)
class Limits:
    """Effective resource limits of a sandbox (0 = the daemon's default, in requests)."""

    cpu_millicores: int = 0
    memory_bytes: int = 0
    max_pids: int = 0
    disk_bytes: int = 0
    exec_timeout_ms: int = 0
    shm_bytes: int = 0

    @classmethod
    def from_proto(cls, m: pb.ResourceLimits) -> "Limits":
        return cls(
            cpu_millicores=m.cpu_millicores,
            memory_bytes=m.memory_bytes,
            max_pids=m.max_pids,
            disk_bytes=m.disk_bytes,
            exec_timeout_ms=m.exec_timeout_ms,
            shm_bytes=m.shm_bytes,
        )


@dataclass(frozen=True)
class SandboxInfo:
    """What the daemon says about a sandbox."""

    id: str
    isolation: Isolation
    image: str
    state: SandboxState
    limits: Limits
    labels: Mapping[str, str]
    created_at: Optional[datetime]
    workdir: str
    parent_snapshot_id: str
    expires_at: Optional[datetime]
    isolation_reason: str
    failure_reason: str
    user: str
    #: "none", "allowlist" or "open": what the sandbox's network may reach.
    network: str = "none"
    #: With "allowlist": the entries ("pypi.org:443", "*.github.com:443", "10.1.0.0/16:5432").
    allow: Sequence[str] = ()
    #: "destroy" or "pause": what the TTL's passing does.
    on_expiry: str = "destroy"
    #: Since when it is paused; None while it is not.
    paused_at: Optional[datetime] = None

    @classmethod
    def from_proto(cls, m: pb.Sandbox) -> "SandboxInfo":
        return cls(
            id=m.id,
            isolation=Isolation(m.isolation),
            image=m.image,
            state=SandboxState(m.state),
            limits=Limits.from_proto(m.limits),
            labels=dict(m.labels),
            created_at=_time(m.created_at, m.HasField("created_at")),
            workdir=m.workdir,
            parent_snapshot_id=m.parent_snapshot_id,
            expires_at=_time(m.expires_at, m.HasField("expires_at")),
            isolation_reason=m.isolation_reason,
            failure_reason=m.failure_reason,
            user=m.user,
            network=_network_mode(m.network.mode) if m.HasField("network") else "none",
            allow=tuple(m.network.allow) if m.HasField("network") else (),
            on_expiry="pause" if m.on_expiry == pb.ON_EXPIRY_PAUSE else "destroy",
            paused_at=_time(m.paused_at, m.HasField("paused_at")),
        )


def _network_mode(mode: int) -> str:
    if mode == pb.NETWORK_MODE_ALLOWLIST:
        return "allowlist"
    if mode == pb.NETWORK_MODE_OPEN:
        return "open"
    return "none"


@dataclass(frozen=True)
class NetworkEvent:
    """One DNS query or connection attempt of a sandbox (`Sandbox.network_log`)."""

    time: Optional[datetime]
    #: "dns" or "connect".
    kind: str
    name: str
    addr: str
    port: int
    allowed: bool
    #: The allow-list entry that let it through ("open" in mode OPEN); empty when denied.
    rule: str
    #: Why it was denied, or what went wrong.
    detail: str
    bytes_out: int
    bytes_in: int
    duration_ms: int

    @classmethod
    def from_proto(cls, m: pb.NetworkEvent) -> "NetworkEvent":
        return cls(
            time=_time(m.time, m.HasField("time")),
            kind=m.kind,
            name=m.name,
            addr=m.addr,
            port=m.port,
            allowed=m.allowed,
            rule=m.rule,
            detail=m.detail,
            bytes_out=m.bytes_out,
            bytes_in=m.bytes_in,
            duration_ms=m.duration_ms,
        )


@dataclass(frozen=True)
class ExecResult:
    """How a command ended, with its output.

    A command that fails is still a result: look at `status` and `exit_code`, or call
    `check()`. Output beyond the request's `max_output` is cut (`stdout_truncated`); the whole
    stream is then kept inside the sandbox at `stdout_spill_path` (download it).
    """

    exec_id: str
    sandbox_id: str
    argv: list[str]
    status: ExecStatus
    exit_code: int
    signal: int
    stdout: bytes
    stderr: bytes
    stdout_truncated: bool
    stderr_truncated: bool
    stdout_total_bytes: int
    stderr_total_bytes: int
    started_at: Optional[datetime]
    duration_ms: int
    cpu_user_ms: int
    cpu_system_ms: int
    peak_memory_bytes: int
    error: str
    idempotency_key: str
    stdout_spill_path: str
    stderr_spill_path: str
    output_discarded: bool
    argv_truncated: bool

    @classmethod
    def from_proto(
        cls, m: pb.ExecResult, stdout: Optional[bytes] = None, stderr: Optional[bytes] = None
    ) -> "ExecResult":
        return cls(
            exec_id=m.exec_id,
            sandbox_id=m.sandbox_id,
            argv=list(m.argv),
            status=ExecStatus(m.status),
            exit_code=m.exit_code,
            signal=m.signal,
            stdout=m.stdout if stdout is None else stdout,
            stderr=m.stderr if stderr is None else stderr,
            stdout_truncated=m.stdout_truncated,
            stderr_truncated=m.stderr_truncated,
            stdout_total_bytes=m.stdout_total_bytes,
            stderr_total_bytes=m.stderr_total_bytes,
            started_at=_time(m.started_at, m.HasField("started_at")),
            duration_ms=m.duration_ms,
            cpu_user_ms=m.cpu_user_ms,
            cpu_system_ms=m.cpu_system_ms,
            peak_memory_bytes=m.peak_memory_bytes,
            error=m.error,
            idempotency_key=m.idempotency_key,
            stdout_spill_path=m.stdout_spill_path,
            stderr_spill_path=m.stderr_spill_path,
            output_discarded=m.output_discarded,
            argv_truncated=m.argv_truncated,
        )

    @property
    def stdout_text(self) -> str:
        """stdout decoded as UTF-8 (invalid bytes replaced)."""
        return self.stdout.decode("utf-8", errors="replace")

    @property
    def stderr_text(self) -> str:
        """stderr decoded as UTF-8 (invalid bytes replaced)."""
        return self.stderr.decode("utf-8", errors="replace")

    @property
    def duration(self) -> float:
        """Wall time in seconds."""
        return self.duration_ms / 1000.0

    @property
    def cpu_ms(self) -> int:
        """User plus system CPU time of this exec alone."""
        return self.cpu_user_ms + self.cpu_system_ms

    @property
    def ok(self) -> bool:
        """True when the command exited with code 0."""
        return self.status == ExecStatus.EXITED and self.exit_code == 0

    @property
    def running(self) -> bool:
        """True for a background exec that has not ended yet."""
        return self.status == ExecStatus.RUNNING

    def check(self) -> "ExecResult":
        """Returns self when the command exited 0, else raises `CommandFailed` (with this
        result as `.result`), naming the status, the code and the end of stderr."""
        if self.ok:
            return self
        why = self.error or self.stderr_text[-500:].strip()
        raise CommandFailed(
            f"{shlex.join(self.argv)}: {self.status.name} (exit code {self.exit_code})"
            + (f": {why}" if why else ""),
            self,
        )


@dataclass(frozen=True)
class OutputChunk:
    """A piece of a streamed exec's output: `stream` is "stdout" or "stderr"."""

    stream: str
    data: bytes

    @property
    def text(self) -> str:
        return self.data.decode("utf-8", errors="replace")


@dataclass(frozen=True)
class SnapshotInfo:
    snapshot_id: str
    sandbox_id: str
    name: str
    created_at: Optional[datetime]
    size_bytes: int
    parent_snapshot_id: str
    # The snapshot holds the microVM's memory too: a rollback or fork resumes its processes.
    includes_memory: bool = False

    @property
    def id(self) -> str:
        return self.snapshot_id

    @classmethod
    def from_proto(cls, m: pb.SnapshotInfo) -> "SnapshotInfo":
        return cls(
            snapshot_id=m.snapshot_id,
            sandbox_id=m.sandbox_id,
            name=m.name,
            created_at=_time(m.created_at, m.HasField("created_at")),
            size_bytes=m.size_bytes,
            parent_snapshot_id=m.parent_snapshot_id,
            includes_memory=m.includes_memory,
        )


@dataclass(frozen=True)
class FileTransfer:
    """What a file upload or download moved, as both sides agreed on it."""

    bytes: int
    sha256: str


@dataclass(frozen=True)
class DirTransfer:
    """What a directory upload or download moved."""

    files: int
    directories: int
    symlinks: int
    bytes: int


@dataclass(frozen=True)
class ImageInfo:
    name: str
    digest: str
    size_bytes: int
    created_at: Optional[datetime]
    source: str
    ready_tiers: list[Isolation]
    env: Mapping[str, str]
    workdir: str
    user: str
    entrypoint: list[str]
    cmd: list[str]
    imported: bool
    shared: bool
    # In a fleet's list: the nodes holding this image with this digest (empty otherwise).
    nodes: list[str] = field(default_factory=list)

    @classmethod
    def from_proto(cls, m: pb.ImageInfo) -> "ImageInfo":
        return cls(
            name=m.name,
            digest=m.digest,
            size_bytes=m.size_bytes,
            created_at=_time(m.created_at, m.HasField("created_at")),
            source=m.source,
            ready_tiers=[Isolation(t) for t in m.ready_tiers],
            env=dict(m.env),
            workdir=m.workdir,
            user=m.user,
            entrypoint=list(m.entrypoint),
            cmd=list(m.cmd),
            imported=m.imported,
            shared=m.shared,
            nodes=list(m.nodes),
        )


@dataclass(frozen=True)
class ImageProgress:
    """One progress event of an image import or build (a build's log line is `message` in
    phase "build"); `done` is set on the last one."""

    phase: str
    message: str
    bytes: int
    total_bytes: int
    count: int
    total_count: int
    done: Optional[ImageInfo] = field(default=None)

    @classmethod
    def from_proto(cls, m: pb.ImageProgress) -> "ImageProgress":
        return cls(
            phase=m.phase,
            message=m.message,
            bytes=m.bytes,
            total_bytes=m.total_bytes,
            count=m.count,
            total_count=m.total_count,
            done=ImageInfo.from_proto(m.done) if m.HasField("done") else None,
        )


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgtKMGT]?)(i?[bB]?)\s*$")
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(value: Union[int, str, None], what: str) -> int:
    """Bytes from an int or a string such as "512M", "1G", "1.5GiB" (powers of 1024); 0 for
    None. A bad string is `InvalidArgument` naming `what`."""
    if value is None:
        return 0
    if isinstance(value, bool):
        raise InvalidArgument(f"{what}: expected a size, got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise InvalidArgument(f"{what}: {value} is negative")
        return value
    match = _SIZE.match(value)
    if not match:
        raise InvalidArgument(f"{what}: {value!r} is not a size such as 512M or 1G")
    number, unit = float(match.group(1)), match.group(2).lower()
    return int(number * _UNITS[unit])
