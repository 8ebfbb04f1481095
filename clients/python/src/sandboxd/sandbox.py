"""`Sandbox` (sync): create, exec, files, snapshots. `sandboxd.aio.Sandbox` has the same names."""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import queue
import signal as _signal
import tempfile
import threading
from pathlib import Path
from typing import IO, Any, Iterator, List, Mapping, Optional, Sequence, Union

import grpc

from . import _archive
from ._conn import CHUNK_SIZE, QUEUE_CHUNKS, Pathish
from ._proto.sandbox.v1 import sandbox_pb2 as pb
from ._requests import (
    DownloadCheck,
    IsolationArg,
    Size,
    check_upload,
    create_request,
    exec_request,
    rpc_deadline,
)
from .client import Client, resolve
from .errors import ProtocolError, SandboxdError, SessionClosed, from_rpc_error
from .types import DirTransfer, ExecResult, FileTransfer, NetworkEvent, OutputChunk, SandboxInfo, SnapshotInfo

log = logging.getLogger("sandboxd")

SnapshotArg = Union[str, SnapshotInfo]


def _snapshot_id(snapshot: SnapshotArg) -> str:
    return snapshot.snapshot_id if isinstance(snapshot, SnapshotInfo) else snapshot


class Sandbox:
    """A sandbox of the daemon. Use `Sandbox.create(...)` as a context manager: the sandbox is
    destroyed when the block ends, unless it was created with `keep=True`."""

    def __init__(self, info: SandboxInfo, client: Client, *, keep: bool = False) -> None:
        self.info = info
        self.client = client
        self.keep = keep

    @property
    def id(self) -> str:
        return self.info.id

    def __repr__(self) -> str:
        return f"Sandbox({self.id!r}, isolation={self.info.isolation.name.lower()}, image={self.info.image!r})"

    def __enter__(self) -> "Sandbox":
        return self

    def __exit__(self, *exc: object) -> None:
        if not self.keep:
            self.destroy()

    # Lifecycle.

    @classmethod
    def create(
        cls,
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
        network: Optional[str] = None,
        allow: Optional[Sequence[str]] = None,
        on_expiry: Optional[str] = None,
        keep: bool = False,
        client: Optional[Client] = None,
    ) -> "Sandbox":
        """Creates a sandbox and returns once it is ready to exec.

        `isolation` "process", "container" or "microvm" (None: the daemon's policy); `image`
        (None: "minimal"); `memory`, `disk`, `shm` as bytes or "512M"/"1G"; `cpus` in CPUs
        (0.5 = half of one); `pids` the most processes; `exec_timeout` the default exec
        timeout in seconds; `ttl` seconds until the daemon reaps it (or, with `on_expiry="pause"`,
        pauses it). None leaves each at the daemon's default; a value above the daemon's ceiling
        is `InvalidArgument` naming it.
        """
        request = create_request(
            isolation=isolation, image=image, memory=memory, cpus=cpus, disk=disk, pids=pids,
            shm=shm, exec_timeout=exec_timeout, env=env, workdir=workdir, labels=labels, ttl=ttl,
            user=user, network=network, allow=allow, on_expiry=on_expiry,
        )
        return cls._create(request, resolve(client), keep)

    @classmethod
    def fork(
        cls,
        snapshot: SnapshotArg,
        *,
        memory: Size = None,
        cpus: Optional[float] = None,
        disk: Size = None,
        pids: Optional[int] = None,
        env: Optional[Mapping[str, str]] = None,
        labels: Optional[Mapping[str, str]] = None,
        ttl: Optional[float] = None,
        network: Optional[str] = None,
        allow: Optional[Sequence[str]] = None,
        keep: bool = False,
        client: Optional[Client] = None,
    ) -> "Sandbox":
        """A new sandbox starting from `snapshot`'s filesystem (its parent's tier, image and
        user)."""
        request = create_request(
            memory=memory, cpus=cpus, disk=disk, pids=pids, env=env, labels=labels, ttl=ttl,
            from_snapshot=_snapshot_id(snapshot), network=network, allow=allow,
        )
        return cls._create(request, resolve(client), keep)

    @classmethod
    def _create(cls, request: pb.CreateSandboxRequest, client: Client, keep: bool) -> "Sandbox":
        reply: pb.Sandbox = client.unary("CreateSandbox", request, timeout=None)
        log.debug("created sandbox %s", reply.id)
        return cls(SandboxInfo.from_proto(reply), client, keep=keep)

    @classmethod
    def connect(cls, sandbox_id: str, *, keep: bool = True, client: Optional[Client] = None) -> "Sandbox":
        """The existing sandbox `sandbox_id` (`NotFound` if there is none). As a context manager
        it is kept on exit unless `keep=False`."""
        c = resolve(client)
        reply: pb.Sandbox = c.unary("GetSandbox", pb.GetSandboxRequest(sandbox_id=sandbox_id))
        return cls(SandboxInfo.from_proto(reply), c, keep=keep)

    @classmethod
    def list(cls, labels: Optional[Mapping[str, str]] = None, *, client: Optional[Client] = None) -> List["Sandbox"]:
        """The sandboxes carrying every label in `labels` (all of them without), each kept on a
        context manager's exit."""
        c = resolve(client)
        reply: pb.ListSandboxesResponse = c.unary(
            "ListSandboxes", pb.ListSandboxesRequest(label_selector=dict(labels or {}))
        )
        return [cls(SandboxInfo.from_proto(s), c, keep=True) for s in reply.sandboxes]

    def refresh(self) -> SandboxInfo:
        """Reads the sandbox's state again (also kept in `.info`)."""
        reply: pb.Sandbox = self.client.unary("GetSandbox", pb.GetSandboxRequest(sandbox_id=self.id))
        self.info = SandboxInfo.from_proto(reply)
        return self.info

    def set_ttl(self, seconds: float) -> SandboxInfo:
        """A new lifetime from now (0 = no TTL)."""
        reply: pb.Sandbox = self.client.unary(
            "SetSandboxTtl", pb.SetSandboxTtlRequest(sandbox_id=self.id, ttl_seconds=int(seconds))
        )
        self.info = SandboxInfo.from_proto(reply)
        return self.info

    def pause(self) -> SandboxInfo:
        """Freezes every process of the sandbox in place: memory kept, no CPU used, its TTL
        stopped. Execs and file calls raise `FailedPrecondition` until `resume()`. Pausing a
        paused sandbox changes nothing."""
        reply: pb.Sandbox = self.client.unary("PauseSandbox", pb.PauseSandboxRequest(sandbox_id=self.id))
        self.info = SandboxInfo.from_proto(reply)
        return self.info

    def resume(self, ttl: Optional[float] = None) -> SandboxInfo:
        """Lets a paused sandbox run on where it stopped; `ttl` seconds from now as its new TTL
        (None: what was left of it at the pause). Resuming a running sandbox changes nothing."""
        request = pb.ResumeSandboxRequest(sandbox_id=self.id, ttl_seconds=int(ttl or 0))
        reply: pb.Sandbox = self.client.unary("ResumeSandbox", request)
        self.info = SandboxInfo.from_proto(reply)
        return self.info

    def network_log(self, limit: int = 0) -> List[NetworkEvent]:
        """The sandbox's recent DNS queries and connection attempts, oldest first: allowed or
        denied, by which rule or why, bytes each way (`limit` most recent; 0 = all the daemon
        keeps, the last 256). Empty for a sandbox without a network."""
        reply: pb.GetNetworkLogResponse = self.client.unary(
            "GetNetworkLog", pb.GetNetworkLogRequest(sandbox_id=self.id, limit=max(0, int(limit)))
        )
        return [NetworkEvent.from_proto(e) for e in reply.events]

    def destroy(self) -> None:
        """Kills every process of the sandbox and frees everything it held."""
        self.client.unary("DestroySandbox", pb.DestroySandboxRequest(sandbox_id=self.id), timeout=None)

    # Execs.

    def exec(
        self,
        argv: Sequence[str],
        *,
        timeout: Optional[float] = None,
        env: Optional[Mapping[str, str]] = None,
        workdir: Optional[str] = None,
        user: Optional[str] = None,
        stdin: Union[bytes, str, None] = None,
        max_output: Size = None,
        idempotency_key: Optional[str] = None,
    ) -> ExecResult:
        """Runs `argv` (no shell is implied) and waits for it to end.

        A command that fails is not an exception: see the result's `status` and `exit_code`
        (or `.check()`). `timeout` seconds (None: the sandbox's default); `max_output` bytes
        kept per stream (None: 1 MiB; the whole stream stays in the sandbox at the result's
        spill path). With an `idempotency_key` the daemon runs the command once per key and
        answers a repeat with the first run's record, so a connection failure is retried.
        """
        request = exec_request(
            self.id, argv, timeout=timeout, env=env, workdir=workdir, user=user, stdin=stdin,
            max_output=max_output, idempotency_key=idempotency_key,
        )
        reply: pb.ExecResult = self.client.unary(
            "Exec", request, timeout=rpc_deadline(timeout), retry=bool(idempotency_key)
        )
        return ExecResult.from_proto(reply)

    def exec_stream(
        self,
        argv: Sequence[str],
        *,
        timeout: Optional[float] = None,
        env: Optional[Mapping[str, str]] = None,
        workdir: Optional[str] = None,
        user: Optional[str] = None,
        stdin: Union[bytes, str, None] = None,
        idempotency_key: Optional[str] = None,
    ) -> "ExecStream":
        """Runs `argv`, yielding its output as `OutputChunk`s as it is produced; the result is
        `.result` once the iteration ends (or `.wait()`). Leaving the `with` block early ends
        the command (unless it has an idempotency key)."""
        request = exec_request(
            self.id, argv, timeout=timeout, env=env, workdir=workdir, user=user, stdin=stdin,
            idempotency_key=idempotency_key,
        )
        return ExecStream(self.client.server_stream("ExecStream", request, retry=bool(idempotency_key)))

    def exec_background(
        self,
        argv: Sequence[str],
        *,
        timeout: Optional[float] = None,
        env: Optional[Mapping[str, str]] = None,
        workdir: Optional[str] = None,
        user: Optional[str] = None,
        stdin: Union[bytes, str, None] = None,
        max_output: Size = None,
        idempotency_key: Optional[str] = None,
    ) -> "Exec":
        """Starts `argv` in the background and returns at once: `.wait()` for its result,
        `.kill()` to end it."""
        request = exec_request(
            self.id, argv, timeout=timeout, env=env, workdir=workdir, user=user, stdin=stdin,
            max_output=max_output, idempotency_key=idempotency_key, background=True,
        )
        reply: pb.ExecResult = self.client.unary("Exec", request, retry=bool(idempotency_key))
        return Exec(self.client, reply.exec_id, ExecResult.from_proto(reply))

    def get_exec(self, exec_id: str, *, wait: bool = False, timeout: Optional[float] = None) -> ExecResult:
        """An exec's record with its output; with `wait`, once it has ended."""
        reply: pb.ExecResult = self.client.unary(
            "GetExec", pb.GetExecRequest(exec_id=exec_id, wait=wait), timeout=timeout if wait else self.client.settings.timeout
        )
        return ExecResult.from_proto(reply)

    def execs(self, *, limit: int = 0, page_size: int = 0, include_output: bool = False) -> Iterator[ExecResult]:
        """The sandbox's exec records, oldest first (the newest `limit`; 0 = all), fetched a
        page (`page_size`, at most 100) at a time as the iteration goes. Without
        `include_output` records come without stdout/stderr (`get_exec` has them)."""
        token = ""
        while True:
            request = pb.ListExecsRequest(
                sandbox_id=self.id, limit=limit, page_token=token, include_output=include_output, page_size=page_size
            )
            page: pb.ListExecsResponse = self.client.unary("ListExecs", request)
            for record in page.execs:
                yield ExecResult.from_proto(record)
            if not page.next_page_token:
                return
            token = page.next_page_token

    def session(
        self,
        argv: Sequence[str],
        *,
        tty: bool = True,
        rows: int = 24,
        cols: int = 80,
        env: Optional[Mapping[str, str]] = None,
        workdir: Optional[str] = None,
        user: Optional[str] = None,
        timeout: Optional[float] = None,
        idempotency_key: Optional[str] = None,
    ) -> "Session":
        """An interactive exec (on a terminal unless `tty=False`): `write`, `read`, `expect`,
        `resize`, `signal`, `close_stdin`, then `wait` for the result. Closing the session
        before the command ended ends it (unless it has an idempotency key)."""
        request = exec_request(
            self.id, argv, timeout=timeout, env=env, workdir=workdir, user=user,
            idempotency_key=idempotency_key,
        )
        start = pb.ExecSessionStart(exec=request, tty=tty, size=pb.TerminalSize(rows=rows, cols=cols))
        return Session(self.client, start)

    # Files.

    def write_file(self, path: str, content: Union[bytes, str], *, mode: int = 0) -> int:
        """Writes a small file whole (parents created; `mode` 0 = 0644); returns bytes written.
        For large files use `upload`."""
        data = content.encode() if isinstance(content, str) else content
        reply: pb.WriteFileResponse = self.client.unary(
            "WriteFile", pb.WriteFileRequest(sandbox_id=self.id, path=path, content=data, mode=mode)
        )
        return int(reply.bytes_written)

    def read_file(self, path: str, *, offset: int = 0, limit: Optional[int] = None) -> bytes:
        """Reads a file: all of it from `offset`, or at most `limit` bytes (in as many calls as
        it takes). For large files use `download`."""
        out = bytearray()
        while True:
            want = 0 if limit is None else limit - len(out)
            reply: pb.ReadFileResponse = self.client.unary(
                "ReadFile", pb.ReadFileRequest(sandbox_id=self.id, path=path, offset=offset + len(out), limit=want)
            )
            out += reply.content
            if reply.eof or (limit is not None and len(out) >= limit):
                return bytes(out)
            if not reply.content:
                raise ProtocolError(f"ReadFile of {path} returned no data before end of file at offset {offset + len(out)}")

    def upload(self, local: Union[Pathish, IO[bytes]], remote: str, *, mode: int = 0) -> FileTransfer:
        """Streams a local file (a path, or a binary file object) of any size to `remote`, in
        1 MiB pieces with its SHA-256 last, which the daemon checks; the file is replaced only
        once all of it arrived intact. Returns what both sides agreed was written."""
        hasher = hashlib.sha256()
        sent = 0
        local_error: List[BaseException] = []

        def requests() -> Iterator[pb.UploadRequest]:
            nonlocal sent
            yield pb.UploadRequest(header=pb.UploadHeader(sandbox_id=self.id, path=remote, mode=mode))
            try:
                f: IO[bytes] = open(local, "rb") if isinstance(local, (str, os.PathLike)) else local
                try:
                    while True:
                        chunk = f.read(CHUNK_SIZE)
                        if not chunk:
                            break
                        hasher.update(chunk)
                        sent += len(chunk)
                        yield pb.UploadRequest(data=chunk)
                finally:
                    if f is not local:
                        f.close()
            except Exception as e:
                # No digest is sent: the daemon refuses the upload and keeps the old file.
                local_error.append(e)
                raise
            yield pb.UploadRequest(sha256=hasher.hexdigest())

        try:
            reply: pb.UploadFileResponse = self.client.client_stream("UploadFile", requests())
        except SandboxdError:
            if local_error:
                raise local_error[0] from None
            raise
        return check_upload(remote, sent, hasher.hexdigest(), reply.bytes_written, reply.sha256)

    def download(self, remote: str, local: Union[Pathish, IO[bytes]]) -> FileTransfer:
        """Streams `remote` into a local file (a path, or a binary file object), checking its
        size and SHA-256 against the daemon's. A path is written aside and renamed into place
        only once the checks passed."""
        check = DownloadCheck(remote)
        stream = self.client.server_stream("DownloadFile", pb.DownloadRequest(sandbox_id=self.id, path=remote), retry=True)
        if not isinstance(local, (str, os.PathLike)):
            try:
                for m in stream:
                    local.write(check.chunk(m))
            finally:
                stream.close()  # type: ignore[attr-defined]
            return check.finish()
        dest = Path(local)
        fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.", dir=dest.parent or Path("."))
        try:
            with os.fdopen(fd, "wb") as f:
                for m in stream:
                    f.write(check.chunk(m))
            done = check.finish()
            os.replace(tmp, dest)
            return done
        except BaseException:
            os.unlink(tmp)
            raise
        finally:
            stream.close()  # type: ignore[attr-defined]

    def upload_dir(self, local_dir: Pathish, remote_dir: str) -> DirTransfer:
        """Streams a local directory (its contents, recursively) into `remote_dir` (created) as a
        tar stream with its SHA-256 last. Symlinks are sent as symlinks; sockets, fifos and
        devices are left out. Returns the daemon's count of what it extracted."""
        feed = _archive.PackFeed(Path(local_dir), CHUNK_SIZE, QUEUE_CHUNKS)

        def requests() -> Iterator[pb.UploadRequest]:
            yield pb.UploadRequest(header=pb.UploadHeader(sandbox_id=self.id, path=remote_dir))
            hasher = hashlib.sha256()
            for piece in feed:
                hasher.update(piece)
                yield pb.UploadRequest(data=piece)
            # Last, and only after the whole tree was packed: without it the daemon keeps nothing.
            yield pb.UploadRequest(sha256=hasher.hexdigest())

        try:
            reply: pb.UploadArchiveResponse = self.client.client_stream("UploadArchive", requests())
        except SandboxdError:
            if feed.error is not None:
                raise feed.error from None
            raise
        finally:
            feed.close()
        return DirTransfer(files=reply.files, directories=reply.directories, symlinks=reply.symlinks, bytes=reply.bytes)

    def download_dir(self, remote_dir: str, local_dir: Pathish) -> DirTransfer:
        """Streams `remote_dir` out of the sandbox as a tar stream and extracts it into
        `local_dir` (created), refusing what would land outside it (see `ArchiveRefused`)."""
        dest = Path(local_dir)
        dest.mkdir(parents=True, exist_ok=True)
        stream = self.client.server_stream("DownloadArchive", pb.DownloadRequest(sandbox_id=self.id, path=remote_dir), retry=True)
        try:
            reader = _archive.ChunkReader(m.data for m in stream)
            return _archive.unpack(reader, dest)  # type: ignore[arg-type]
        finally:
            stream.close()  # type: ignore[attr-defined]

    # Snapshots.

    def snapshot(self, name: str = "", include_memory: Optional[bool] = None) -> SnapshotInfo:
        """Snapshots the sandbox's filesystem as it is now; on the microVM tier also its memory
        (`include_memory=False` takes the disk alone; None is the tier's default)."""
        request = pb.SnapshotRequest(sandbox_id=self.id, name=name)
        if include_memory is not None:
            request.include_memory = include_memory
        reply: pb.SnapshotInfo = self.client.unary("Snapshot", request, timeout=None)
        return SnapshotInfo.from_proto(reply)

    def snapshots(self) -> List[SnapshotInfo]:
        reply: pb.ListSnapshotsResponse = self.client.unary("ListSnapshots", pb.ListSnapshotsRequest(sandbox_id=self.id))
        return [SnapshotInfo.from_proto(s) for s in reply.snapshots]

    def rollback(self, snapshot: SnapshotArg) -> SandboxInfo:
        """Puts the filesystem back to `snapshot`; running execs end as LOST."""
        reply: pb.Sandbox = self.client.unary(
            "Rollback", pb.RollbackRequest(sandbox_id=self.id, snapshot_id=_snapshot_id(snapshot)), timeout=None
        )
        self.info = SandboxInfo.from_proto(reply)
        return self.info

    def delete_snapshot(self, snapshot: SnapshotArg) -> None:
        """Deletes a snapshot (`FailedPrecondition` while a fork of it needs it)."""
        self.client.unary("DeleteSnapshot", pb.DeleteSnapshotRequest(snapshot_id=_snapshot_id(snapshot)), timeout=None)


class Exec:
    """A background exec: `wait()` for its result, `kill()` or `signal()` to end it."""

    def __init__(self, client: Client, exec_id: str, started: ExecResult) -> None:
        self.client = client
        self.id = exec_id
        self.started = started

    def __repr__(self) -> str:
        return f"Exec({self.id!r})"

    def wait(self, timeout: Optional[float] = None) -> ExecResult:
        """Blocks until the exec ends and returns its record with output (`DeadlineExceeded`
        after `timeout` seconds)."""
        reply: pb.ExecResult = self.client.unary("GetExec", pb.GetExecRequest(exec_id=self.id, wait=True), timeout=timeout)
        return ExecResult.from_proto(reply)

    def poll(self) -> ExecResult:
        """The record now (status RUNNING while it runs)."""
        reply: pb.ExecResult = self.client.unary("GetExec", pb.GetExecRequest(exec_id=self.id, wait=False))
        return ExecResult.from_proto(reply)

    def signal(self, sig: int) -> None:
        """Sends `sig` to the exec's whole process tree."""
        self.client.unary("SignalExec", pb.SignalExecRequest(exec_id=self.id, signal=int(sig)))

    def kill(self, sig: int = _signal.SIGKILL) -> ExecResult:
        """Signals the exec (SIGKILL by default) and returns its final record."""
        self.signal(sig)
        return self.wait()


class ExecStream:
    """The output of a streamed exec as `OutputChunk`s; `.result` after the last one."""

    def __init__(self, messages: Iterator[pb.ExecEvent]) -> None:
        self._messages = messages
        self.result: Optional[ExecResult] = None

    def __iter__(self) -> "ExecStream":
        return self

    def __next__(self) -> OutputChunk:
        if self.result is not None:
            raise StopIteration
        for m in self._messages:
            kind = m.WhichOneof("event")
            if kind == "stdout":
                return OutputChunk("stdout", m.stdout)
            if kind == "stderr":
                return OutputChunk("stderr", m.stderr)
            if kind == "result":
                self.result = ExecResult.from_proto(m.result)
                raise StopIteration
        raise ProtocolError("exec stream ended without a result")

    def wait(self) -> ExecResult:
        """Reads the rest and returns the result with the output not yet iterated filled in."""
        out, err = bytearray(), bytearray()
        for chunk in self:
            (out if chunk.stream == "stdout" else err).extend(chunk.data)
        assert self.result is not None
        return dataclasses.replace(self.result, stdout=bytes(out), stderr=bytes(err))

    def close(self) -> None:
        """Stops reading: the call is cancelled (ending the command unless it has a key)."""
        close = getattr(self._messages, "close", None)
        if close is not None:
            close()

    def __enter__(self) -> "ExecStream":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_END = object()


class Session:
    """An interactive exec. Output is read by a thread of its own into a bounded queue, so
    writing never deadlocks against a command blocked on its output; read it with `read`,
    `expect` or `wait`."""

    def __init__(self, client: Client, start: pb.ExecSessionStart) -> None:
        self._input: "queue.Queue[pb.ExecSessionRequest]" = queue.Queue(16)
        self._closed = threading.Event()
        self._stopped = threading.Event()
        self._input.put(pb.ExecSessionRequest(start=start))
        self._call = client.bidi("ExecSession", self._requests())
        self._events: "queue.Queue[Any]" = queue.Queue(64)
        self._buffer = bytearray()
        self.result: Optional[ExecResult] = None
        self._ended = False
        try:
            first: pb.ExecSessionEvent = next(self._call)
        except grpc.RpcError as e:
            self._closed.set()
            raise from_rpc_error(e, "ExecSession") from None
        except StopIteration:
            self._closed.set()
            raise ProtocolError("exec session ended before the command started") from None
        kind = first.WhichOneof("event")
        pending: Optional[pb.ExecSessionEvent] = None
        if kind == "started":
            self.exec_id: str = first.started.exec_id
        else:
            self.exec_id = first.result.exec_id if kind == "result" else ""
            pending = first
        self._reader = threading.Thread(target=self._read_events, args=(pending,), name="sandboxd-session", daemon=True)
        self._reader.start()

    def _requests(self) -> Iterator[pb.ExecSessionRequest]:
        while True:
            try:
                item = self._input.get(timeout=0.2)
            except queue.Empty:
                if self._closed.is_set():
                    return
                continue
            yield item

    def _deliver(self, item: Any) -> None:
        # Bounded: a reader that falls behind holds the command back (flow control), and a
        # closed session stops waiting.
        while not self._stopped.is_set():
            try:
                self._events.put(item, timeout=0.2)
                return
            except queue.Full:
                continue

    def _read_events(self, pending: Optional[pb.ExecSessionEvent]) -> None:
        try:
            if pending is not None:
                self._deliver(pending)
            for m in self._call:
                self._deliver(m)
            self._deliver(_END)
        except grpc.RpcError as e:
            self._deliver(from_rpc_error(e, "ExecSession"))

    def _send(self, **item: Any) -> None:
        if self._closed.is_set() or self.result is not None:
            raise SessionClosed("the exec session has ended")
        self._input.put(pb.ExecSessionRequest(**item))

    def write(self, data: Union[bytes, str]) -> None:
        """Bytes for the command's stdin (on a terminal: keys, so "\\x03" is Ctrl-C)."""
        self._send(stdin=data.encode() if isinstance(data, str) else data)

    def close_stdin(self) -> None:
        """Ends the command's stdin (on a terminal: Ctrl-D)."""
        self._send(close_stdin=True)

    def resize(self, rows: int, cols: int) -> None:
        """Tells the command's terminal its new size."""
        self._send(resize=pb.TerminalSize(rows=rows, cols=cols))

    def signal(self, sig: int) -> None:
        """Sends `sig` to the command's whole process tree."""
        self._send(signal=int(sig))

    def _next(self, timeout: Optional[float]) -> Optional[OutputChunk]:
        """The next output chunk; None once the result has come. `TimeoutError` past
        `timeout`."""
        while True:
            if self._ended:
                return None
            try:
                m = self._events.get(timeout=timeout)
            except queue.Empty:
                raise TimeoutError(f"no output from exec {self.exec_id} within {timeout} s") from None
            if isinstance(m, SandboxdError):
                self._ended = True
                self._closed.set()
                raise m
            if m is _END:
                self._ended = True
                self._closed.set()
                if self.result is None:
                    raise ProtocolError(f"exec session {self.exec_id} ended without a result")
                return None
            kind = m.WhichOneof("event")
            if kind == "stdout":
                return OutputChunk("stdout", m.stdout)
            if kind == "stderr":
                return OutputChunk("stderr", m.stderr)
            if kind == "result":
                self.result = ExecResult.from_proto(m.result)
                self._closed.set()

    def read(self, timeout: Optional[float] = None) -> bytes:
        """The next piece of output (stdout and stderr alike), b"" once the command has ended."""
        if self._buffer:
            out = bytes(self._buffer)
            self._buffer.clear()
            return out
        chunk = self._next(timeout)
        return b"" if chunk is None else chunk.data

    def expect(self, pattern: Union[bytes, str], timeout: Optional[float] = 30.0) -> bytes:
        """Reads until the output contains `pattern`; returns everything up to and including
        it (the rest stays for the next read). `TimeoutError` past `timeout`, `EOFError` if the
        command ended first."""
        want = pattern.encode() if isinstance(pattern, str) else pattern
        while want not in self._buffer:
            chunk = self._next(timeout)
            if chunk is None:
                raise EOFError(f"exec {self.exec_id} ended before printing {want!r}; output: {bytes(self._buffer)[-500:]!r}")
            self._buffer += chunk.data
        end = self._buffer.index(want) + len(want)
        out = bytes(self._buffer[:end])
        del self._buffer[:end]
        return out

    def wait(self, timeout: Optional[float] = None) -> ExecResult:
        """Reads to the end; the result with the output not yet read as its stdout/stderr."""
        out, err = bytearray(self._buffer), bytearray()
        self._buffer.clear()
        while True:
            chunk = self._next(timeout)
            if chunk is None:
                break
            (out if chunk.stream == "stdout" else err).extend(chunk.data)
        assert self.result is not None
        return dataclasses.replace(self.result, stdout=bytes(out), stderr=bytes(err))

    def close(self) -> None:
        """Ends the session; a command still running is ended (unless it has a key)."""
        self._closed.set()
        self._stopped.set()
        if self.result is None:
            self._call.cancel()
        self._reader.join(timeout=10)

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
