"""`sandboxd.aio.Sandbox`: the asyncio twin of `sandboxd.Sandbox`, with the same names.

`Sandbox.create(...)`, `Sandbox.fork(...)` and `sb.session(...)` can be awaited or used
directly with `async with`; `sb.exec_stream(...)` is iterated with `async for`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import logging
import os
import queue
import signal as _signal
import tempfile
import threading
from pathlib import Path
from types import TracebackType
from typing import (
    IO, Any, AsyncIterator, Awaitable, Callable, Generator, Generic, List, Mapping, Optional,
    Sequence, Type, TypeVar, Union,
)

import grpc
import grpc.aio

from .. import _archive
from .._conn import CHUNK_SIZE, QUEUE_CHUNKS, Pathish
from .._proto.sandbox.v1 import sandbox_pb2 as pb
from .._requests import DownloadCheck, IsolationArg, Size, check_upload, create_request, exec_request, rpc_deadline
from ..errors import ProtocolError, SandboxdError, SessionClosed, from_rpc_error
from ..sandbox import SnapshotArg, _snapshot_id
from ..types import DirTransfer, ExecResult, FileTransfer, NetworkEvent, OutputChunk, SandboxInfo, SnapshotInfo
from .client import Client, resolve

log = logging.getLogger("sandboxd")

T = TypeVar("T", bound="_AsyncClosable")


class _AsyncClosable:
    async def __aexit__(
        self, exc_type: Optional[Type[BaseException]], exc: Optional[BaseException], tb: Optional[TracebackType]
    ) -> None:
        raise NotImplementedError


class Opening(Generic[T]):
    """What `create`, `fork` and `session` return: await it for the object, or use it with
    `async with` to have the object closed (a sandbox destroyed unless kept) at the end."""

    def __init__(self, open: Callable[[], Awaitable[T]]) -> None:
        self._open = open
        self._value: Optional[T] = None

    def __await__(self) -> Generator[Any, None, T]:
        return self._open().__await__()

    async def __aenter__(self) -> T:
        self._value = await self._open()
        return self._value

    async def __aexit__(
        self, exc_type: Optional[Type[BaseException]], exc: Optional[BaseException], tb: Optional[TracebackType]
    ) -> None:
        if self._value is not None:
            await self._value.__aexit__(exc_type, exc, tb)


class Sandbox(_AsyncClosable):
    """A sandbox of the daemon (asyncio). As `sandboxd.Sandbox`, every call a coroutine."""

    def __init__(self, info: SandboxInfo, client: Client, *, keep: bool = False) -> None:
        self.info = info
        self.client = client
        self.keep = keep

    @property
    def id(self) -> str:
        return self.info.id

    def __repr__(self) -> str:
        return f"aio.Sandbox({self.id!r}, isolation={self.info.isolation.name.lower()}, image={self.info.image!r})"

    async def __aenter__(self) -> "Sandbox":
        return self

    async def __aexit__(
        self, exc_type: Optional[Type[BaseException]], exc: Optional[BaseException], tb: Optional[TracebackType]
    ) -> None:
        if not self.keep:
            await self.destroy()

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
    ) -> "Opening[Sandbox]":
        """Creates a sandbox (see `sandboxd.Sandbox.create`)."""
        request = create_request(
            isolation=isolation, image=image, memory=memory, cpus=cpus, disk=disk, pids=pids, shm=shm,
            exec_timeout=exec_timeout, env=env, workdir=workdir, labels=labels, ttl=ttl, user=user,
            network=network, allow=allow, on_expiry=on_expiry,
        )
        return Opening(lambda: cls._create(request, client, keep))

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
    ) -> "Opening[Sandbox]":
        """A new sandbox starting from `snapshot`'s filesystem."""
        request = create_request(
            memory=memory, cpus=cpus, disk=disk, pids=pids, env=env, labels=labels, ttl=ttl,
            from_snapshot=_snapshot_id(snapshot), network=network, allow=allow,
        )
        return Opening(lambda: cls._create(request, client, keep))

    @classmethod
    async def _create(cls, request: pb.CreateSandboxRequest, client: Optional[Client], keep: bool) -> "Sandbox":
        c = resolve(client)
        reply: pb.Sandbox = await c.unary("CreateSandbox", request, timeout=None)
        return cls(SandboxInfo.from_proto(reply), c, keep=keep)

    @classmethod
    async def connect(cls, sandbox_id: str, *, keep: bool = True, client: Optional[Client] = None) -> "Sandbox":
        """The existing sandbox `sandbox_id` (`NotFound` if there is none)."""
        c = resolve(client)
        reply: pb.Sandbox = await c.unary("GetSandbox", pb.GetSandboxRequest(sandbox_id=sandbox_id))
        return cls(SandboxInfo.from_proto(reply), c, keep=keep)

    @classmethod
    async def list(cls, labels: Optional[Mapping[str, str]] = None, *, client: Optional[Client] = None) -> List["Sandbox"]:
        """The sandboxes carrying every label in `labels`."""
        c = resolve(client)
        reply: pb.ListSandboxesResponse = await c.unary("ListSandboxes", pb.ListSandboxesRequest(label_selector=dict(labels or {})))
        return [cls(SandboxInfo.from_proto(s), c, keep=True) for s in reply.sandboxes]

    async def refresh(self) -> SandboxInfo:
        reply: pb.Sandbox = await self.client.unary("GetSandbox", pb.GetSandboxRequest(sandbox_id=self.id))
        self.info = SandboxInfo.from_proto(reply)
        return self.info

    async def set_ttl(self, seconds: float) -> SandboxInfo:
        reply: pb.Sandbox = await self.client.unary(
            "SetSandboxTtl", pb.SetSandboxTtlRequest(sandbox_id=self.id, ttl_seconds=int(seconds))
        )
        self.info = SandboxInfo.from_proto(reply)
        return self.info

    async def pause(self) -> SandboxInfo:
        """See `sandboxd.Sandbox.pause`."""
        reply: pb.Sandbox = await self.client.unary("PauseSandbox", pb.PauseSandboxRequest(sandbox_id=self.id))
        self.info = SandboxInfo.from_proto(reply)
        return self.info

    async def resume(self, ttl: Optional[float] = None) -> SandboxInfo:
        """See `sandboxd.Sandbox.resume`."""
        request = pb.ResumeSandboxRequest(sandbox_id=self.id, ttl_seconds=int(ttl or 0))
        reply: pb.Sandbox = await self.client.unary("ResumeSandbox", request)
        self.info = SandboxInfo.from_proto(reply)
        return self.info

    async def network_log(self, limit: int = 0) -> List[NetworkEvent]:
        """See `sandboxd.Sandbox.network_log`."""
        reply: pb.GetNetworkLogResponse = await self.client.unary(
            "GetNetworkLog", pb.GetNetworkLogRequest(sandbox_id=self.id, limit=max(0, int(limit)))
        )
        return [NetworkEvent.from_proto(e) for e in reply.events]

    async def destroy(self) -> None:
        await self.client.unary("DestroySandbox", pb.DestroySandboxRequest(sandbox_id=self.id), timeout=None)

    # Execs.

    async def exec(
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
        """Runs `argv` and waits for it to end (see `sandboxd.Sandbox.exec`)."""
        request = exec_request(
            self.id, argv, timeout=timeout, env=env, workdir=workdir, user=user, stdin=stdin,
            max_output=max_output, idempotency_key=idempotency_key,
        )
        reply: pb.ExecResult = await self.client.unary("Exec", request, timeout=rpc_deadline(timeout), retry=bool(idempotency_key))
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
        """Runs `argv`; `async for chunk in sb.exec_stream(...)` yields its output as it comes."""
        request = exec_request(
            self.id, argv, timeout=timeout, env=env, workdir=workdir, user=user, stdin=stdin,
            idempotency_key=idempotency_key,
        )
        return ExecStream(self.client.server_stream("ExecStream", request, retry=bool(idempotency_key)))

    async def exec_background(
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
        """Starts `argv` in the background: `await .wait()`, `await .kill()`."""
        request = exec_request(
            self.id, argv, timeout=timeout, env=env, workdir=workdir, user=user, stdin=stdin,
            max_output=max_output, idempotency_key=idempotency_key, background=True,
        )
        reply: pb.ExecResult = await self.client.unary("Exec", request, retry=bool(idempotency_key))
        return Exec(self.client, reply.exec_id, ExecResult.from_proto(reply))

    async def get_exec(self, exec_id: str, *, wait: bool = False, timeout: Optional[float] = None) -> ExecResult:
        reply: pb.ExecResult = await self.client.unary(
            "GetExec", pb.GetExecRequest(exec_id=exec_id, wait=wait), timeout=timeout if wait else self.client.settings.timeout
        )
        return ExecResult.from_proto(reply)

    async def execs(self, *, limit: int = 0, page_size: int = 0, include_output: bool = False) -> AsyncIterator[ExecResult]:
        """`async for record in sb.execs(...)`: the exec records, a page at a time."""
        token = ""
        while True:
            request = pb.ListExecsRequest(
                sandbox_id=self.id, limit=limit, page_token=token, include_output=include_output, page_size=page_size
            )
            page: pb.ListExecsResponse = await self.client.unary("ListExecs", request)
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
    ) -> "Opening[Session]":
        """An interactive exec: `async with sb.session(["sh"]) as s:` (see `sandboxd.Session`)."""
        request = exec_request(self.id, argv, timeout=timeout, env=env, workdir=workdir, user=user, idempotency_key=idempotency_key)
        start = pb.ExecSessionStart(exec=request, tty=tty, size=pb.TerminalSize(rows=rows, cols=cols))
        return Opening(lambda: Session._open(self.client, start))

    # Files.

    async def write_file(self, path: str, content: Union[bytes, str], *, mode: int = 0) -> int:
        data = content.encode() if isinstance(content, str) else content
        reply: pb.WriteFileResponse = await self.client.unary(
            "WriteFile", pb.WriteFileRequest(sandbox_id=self.id, path=path, content=data, mode=mode)
        )
        return int(reply.bytes_written)

    async def read_file(self, path: str, *, offset: int = 0, limit: Optional[int] = None) -> bytes:
        out = bytearray()
        while True:
            want = 0 if limit is None else limit - len(out)
            reply: pb.ReadFileResponse = await self.client.unary(
                "ReadFile", pb.ReadFileRequest(sandbox_id=self.id, path=path, offset=offset + len(out), limit=want)
            )
            out += reply.content
            if reply.eof or (limit is not None and len(out) >= limit):
                return bytes(out)
            if not reply.content:
                raise ProtocolError(f"ReadFile of {path} returned no data before end of file at offset {offset + len(out)}")

    async def upload(self, local: Union[Pathish, IO[bytes]], remote: str, *, mode: int = 0) -> FileTransfer:
        """Streams a local file to `remote` with its SHA-256 last (see `sandboxd.Sandbox.upload`);
        local reads run on a worker thread."""
        hasher = hashlib.sha256()
        sent = 0
        local_error: List[BaseException] = []

        async def requests() -> AsyncIterator[pb.UploadRequest]:
            nonlocal sent
            yield pb.UploadRequest(header=pb.UploadHeader(sandbox_id=self.id, path=remote, mode=mode))
            try:
                f: IO[bytes] = await asyncio.to_thread(open, local, "rb") if isinstance(local, (str, os.PathLike)) else local
                try:
                    while True:
                        chunk = await asyncio.to_thread(f.read, CHUNK_SIZE)
                        if not chunk:
                            break
                        hasher.update(chunk)
                        sent += len(chunk)
                        yield pb.UploadRequest(data=chunk)
                finally:
                    if f is not local:
                        f.close()
            except Exception as e:
                local_error.append(e)
                raise
            yield pb.UploadRequest(sha256=hasher.hexdigest())

        try:
            reply: pb.UploadFileResponse = await self.client.client_stream(
                "UploadFile", requests(), lambda: local_error[0] if local_error else None
            )
        except SandboxdError:
            if local_error:
                raise local_error[0] from None
            raise
        if local_error:
            raise local_error[0]
        return check_upload(remote, sent, hasher.hexdigest(), reply.bytes_written, reply.sha256)

    async def download(self, remote: str, local: Union[Pathish, IO[bytes]]) -> FileTransfer:
        """Streams `remote` into a local file, checking size and SHA-256 (a path is replaced only
        once the checks passed)."""
        check = DownloadCheck(remote)
        stream = self.client.server_stream("DownloadFile", pb.DownloadRequest(sandbox_id=self.id, path=remote), retry=True)
        try:
            if not isinstance(local, (str, os.PathLike)):
                async for m in stream:
                    await asyncio.to_thread(local.write, check.chunk(m))
                return check.finish()
            dest = Path(local)
            fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.", dir=dest.parent)
            try:
                with os.fdopen(fd, "wb") as f:
                    async for m in stream:
                        await asyncio.to_thread(f.write, check.chunk(m))
                done = check.finish()
                os.replace(tmp, dest)
                return done
            except BaseException:
                os.unlink(tmp)
                raise
        finally:
            await stream.aclose()  # type: ignore[attr-defined]

    async def upload_dir(self, local_dir: Pathish, remote_dir: str) -> DirTransfer:
        """Streams a local directory into `remote_dir` as a tar stream (packed on a thread)."""
        feed = _archive.PackFeed(Path(local_dir), CHUNK_SIZE, QUEUE_CHUNKS)

        async def requests() -> AsyncIterator[pb.UploadRequest]:
            yield pb.UploadRequest(header=pb.UploadHeader(sandbox_id=self.id, path=remote_dir))
            hasher = hashlib.sha256()
            while True:
                piece = await asyncio.to_thread(feed.get)
                if piece is None:
                    break
                if isinstance(piece, BaseException):
                    feed.error = piece
                    raise piece
                assert isinstance(piece, bytes)
                hasher.update(piece)
                yield pb.UploadRequest(data=piece)
            yield pb.UploadRequest(sha256=hasher.hexdigest())

        try:
            reply: pb.UploadArchiveResponse = await self.client.client_stream("UploadArchive", requests(), lambda: feed.error)
        except SandboxdError:
            if feed.error is not None:
                raise feed.error from None
            raise
        finally:
            await asyncio.to_thread(feed.close)
        if feed.error is not None:
            raise feed.error
        return DirTransfer(files=reply.files, directories=reply.directories, symlinks=reply.symlinks, bytes=reply.bytes)

    async def download_dir(self, remote_dir: str, local_dir: Pathish) -> DirTransfer:
        """Streams `remote_dir` out as a tar stream, extracted on a thread into `local_dir` with
        the rules of `sandboxd.Sandbox.download_dir`."""
        dest = Path(local_dir)
        dest.mkdir(parents=True, exist_ok=True)
        pieces: "queue.Queue[Optional[bytes]]" = queue.Queue(QUEUE_CHUNKS)
        done = threading.Event()

        def chunks() -> Any:
            while True:
                item = pieces.get()
                if item is None:
                    return
                yield item

        def extract() -> DirTransfer:
            try:
                return _archive.unpack(_archive.ChunkReader(chunks()), dest)  # type: ignore[arg-type]
            finally:
                done.set()

        def put(item: Optional[bytes]) -> None:
            while not done.is_set():
                try:
                    pieces.put(item, timeout=0.2)
                    return
                except queue.Full:
                    continue

        extracting = asyncio.ensure_future(asyncio.to_thread(extract))
        stream = self.client.server_stream("DownloadArchive", pb.DownloadRequest(sandbox_id=self.id, path=remote_dir), retry=True)
        try:
            async for m in stream:
                if done.is_set():
                    break
                await asyncio.to_thread(put, m.data)
            await asyncio.to_thread(put, None)
        except BaseException:
            await asyncio.to_thread(put, None)
            await asyncio.gather(extracting, return_exceptions=True)
            raise
        finally:
            await stream.aclose()  # type: ignore[attr-defined]
        return await extracting

    # Snapshots.

    async def snapshot(self, name: str = "", include_memory: Optional[bool] = None) -> SnapshotInfo:
        request = pb.SnapshotRequest(sandbox_id=self.id, name=name)
        if include_memory is not None:
            request.include_memory = include_memory
        reply: pb.SnapshotInfo = await self.client.unary("Snapshot", request, timeout=None)
        return SnapshotInfo.from_proto(reply)

    async def snapshots(self) -> List[SnapshotInfo]:
        reply: pb.ListSnapshotsResponse = await self.client.unary("ListSnapshots", pb.ListSnapshotsRequest(sandbox_id=self.id))
        return [SnapshotInfo.from_proto(s) for s in reply.snapshots]

    async def rollback(self, snapshot: SnapshotArg) -> SandboxInfo:
        reply: pb.Sandbox = await self.client.unary(
            "Rollback", pb.RollbackRequest(sandbox_id=self.id, snapshot_id=_snapshot_id(snapshot)), timeout=None
        )
        self.info = SandboxInfo.from_proto(reply)
        return self.info

    async def delete_snapshot(self, snapshot: SnapshotArg) -> None:
        await self.client.unary("DeleteSnapshot", pb.DeleteSnapshotRequest(snapshot_id=_snapshot_id(snapshot)), timeout=None)


class Exec:
    """A background exec: `await wait()`, `await kill()`, `await signal(sig)`, `await poll()`."""

    def __init__(self, client: Client, exec_id: str, started: ExecResult) -> None:
        self.client = client
        self.id = exec_id
        self.started = started

    def __repr__(self) -> str:
        return f"aio.Exec({self.id!r})"

    async def wait(self, timeout: Optional[float] = None) -> ExecResult:
        reply: pb.ExecResult = await self.client.unary("GetExec", pb.GetExecRequest(exec_id=self.id, wait=True), timeout=timeout)
        return ExecResult.from_proto(reply)

    async def poll(self) -> ExecResult:
        reply: pb.ExecResult = await self.client.unary("GetExec", pb.GetExecRequest(exec_id=self.id, wait=False))
        return ExecResult.from_proto(reply)

    async def signal(self, sig: int) -> None:
        await self.client.unary("SignalExec", pb.SignalExecRequest(exec_id=self.id, signal=int(sig)))

    async def kill(self, sig: int = _signal.SIGKILL) -> ExecResult:
        await self.signal(sig)
        return await self.wait()


class ExecStream:
    """`async for chunk in stream`: `OutputChunk`s, then `.result`."""

    def __init__(self, messages: AsyncIterator[pb.ExecEvent]) -> None:
        self._messages = messages
        self.result: Optional[ExecResult] = None

    def __aiter__(self) -> "ExecStream":
        return self

    async def __anext__(self) -> OutputChunk:
        if self.result is not None:
            raise StopAsyncIteration
        async for m in self._messages:
            kind = m.WhichOneof("event")
            if kind == "stdout":
                return OutputChunk("stdout", m.stdout)
            if kind == "stderr":
                return OutputChunk("stderr", m.stderr)
            if kind == "result":
                self.result = ExecResult.from_proto(m.result)
                raise StopAsyncIteration
        raise ProtocolError("exec stream ended without a result")

    async def wait(self) -> ExecResult:
        out, err = bytearray(), bytearray()
        async for chunk in self:
            (out if chunk.stream == "stdout" else err).extend(chunk.data)
        assert self.result is not None
        return dataclasses.replace(self.result, stdout=bytes(out), stderr=bytes(err))

    async def aclose(self) -> None:
        close = getattr(self._messages, "aclose", None)
        if close is not None:
            await close()

    async def __aenter__(self) -> "ExecStream":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


class Session(_AsyncClosable):
    """An interactive exec (asyncio); output is read by a task of its own into a bounded queue."""

    def __init__(self, call: Any, exec_id: str, pending: Optional[pb.ExecSessionEvent]) -> None:
        self._call = call
        self.exec_id = exec_id
        self.result: Optional[ExecResult] = None
        self._events: "asyncio.Queue[Any]" = asyncio.Queue(64)
        self._buffer = bytearray()
        self._ended = False
        self._closed = False
        self._reader = asyncio.ensure_future(self._read_events(pending))

    @classmethod
    async def _open(cls, client: Client, start: pb.ExecSessionStart) -> "Session":
        call = client.bidi("ExecSession")
        try:
            await call.write(pb.ExecSessionRequest(start=start))
            first = await call.read()
        except grpc.aio.AioRpcError as e:
            raise from_rpc_error(e, "ExecSession") from None
        if first is grpc.aio.EOF:
            call.cancel()
            raise ProtocolError("exec session ended before the command started")
        kind = first.WhichOneof("event")
        if kind == "started":
            return cls(call, first.started.exec_id, None)
        return cls(call, first.result.exec_id if kind == "result" else "", first)

    async def _read_events(self, pending: Optional[pb.ExecSessionEvent]) -> None:
        try:
            if pending is not None:
                await self._events.put(pending)
            while True:
                m = await self._call.read()
                if m is grpc.aio.EOF:
                    break
                await self._events.put(m)
            await self._events.put(None)
        except grpc.aio.AioRpcError as e:
            await self._events.put(from_rpc_error(e, "ExecSession"))
        except asyncio.CancelledError:
            pass

    async def _send(self, **item: Any) -> None:
        if self._closed or self.result is not None:
            raise SessionClosed("the exec session has ended")
        try:
            await self._call.write(pb.ExecSessionRequest(**item))
        except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError) as e:
            raise SessionClosed(f"the exec session has ended: {e}") from None

    async def write(self, data: Union[bytes, str]) -> None:
        await self._send(stdin=data.encode() if isinstance(data, str) else data)

    async def close_stdin(self) -> None:
        await self._send(close_stdin=True)

    async def resize(self, rows: int, cols: int) -> None:
        await self._send(resize=pb.TerminalSize(rows=rows, cols=cols))

    async def signal(self, sig: int) -> None:
        await self._send(signal=int(sig))

    async def _next(self, timeout: Optional[float]) -> Optional[OutputChunk]:
        while True:
            if self._ended:
                return None
            try:
                m = await asyncio.wait_for(self._events.get(), timeout)
            except asyncio.TimeoutError:
                raise TimeoutError(f"no output from exec {self.exec_id} within {timeout} s") from None
            if isinstance(m, SandboxdError):
                self._ended = True
                raise m
            if m is None:
                self._ended = True
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
                try:
                    await self._call.done_writing()
                except (grpc.aio.UsageError, asyncio.InvalidStateError):
                    pass

    async def read(self, timeout: Optional[float] = None) -> bytes:
        if self._buffer:
            out = bytes(self._buffer)
            self._buffer.clear()
            return out
        chunk = await self._next(timeout)
        return b"" if chunk is None else chunk.data

    async def expect(self, pattern: Union[bytes, str], timeout: Optional[float] = 30.0) -> bytes:
        want = pattern.encode() if isinstance(pattern, str) else pattern
        while want not in self._buffer:
            chunk = await self._next(timeout)
            if chunk is None:
                raise EOFError(f"exec {self.exec_id} ended before printing {want!r}; output: {bytes(self._buffer)[-500:]!r}")
            self._buffer += chunk.data
        end = self._buffer.index(want) + len(want)
        out = bytes(self._buffer[:end])
        del self._buffer[:end]
        return out

    async def wait(self, timeout: Optional[float] = None) -> ExecResult:
        out, err = bytearray(self._buffer), bytearray()
        self._buffer.clear()
        while True:
            chunk = await self._next(timeout)
            if chunk is None:
                break
            (out if chunk.stream == "stdout" else err).extend(chunk.data)
        assert self.result is not None
        return dataclasses.replace(self.result, stdout=bytes(out), stderr=bytes(err))

    async def close(self) -> None:
        self._closed = True
        if self.result is None:
            self._call.cancel()
        self._reader.cancel()
        await asyncio.gather(self._reader, return_exceptions=True)

    async def __aenter__(self) -> "Session":
        return self

    async def __aexit__(
        self, exc_type: Optional[Type[BaseException]], exc: Optional[BaseException], tb: Optional[TracebackType]
    ) -> None:
        await self.close()
