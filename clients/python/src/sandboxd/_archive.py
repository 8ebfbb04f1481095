"""Directories as tar streams, both ways, for `UploadArchive` and `DownloadArchive`.

`pack` writes a local directory as a tar stream: regular files, directories and symlinks (stored
as symlinks, never followed), with modes and mtimes; sockets, fifos and devices are left out.

`unpack` extracts a tar stream that comes from inside a sandbox, so it treats it as hostile,
with the rules of the Rust client's `archive::unpack`: it refuses (stopping at the entry, with
`ArchiveRefused` naming it) an absolute path or one with `..`, an entry whose path goes
through a symlink (every parent must be a real directory), device nodes, fifos, and a hard link
to anything but a regular file the same archive extracted. An entry never writes through what
is already at its path: a file or symlink there is removed and the file created anew with
O_EXCL|O_NOFOLLOW. Symlinks are created as they are (creating one writes nothing through it,
and no later entry may pass through it). Modes lose setuid, setgid and sticky; owners are not
applied; mtimes are.
"""

from __future__ import annotations

import os
import stat
import tarfile
from pathlib import Path, PurePosixPath
from typing import IO, Callable, Iterator, Optional

from .errors import ArchiveRefused, ProtocolError
from .types import DirTransfer


class ChunkWriter:
    """A write-only file object that hands whole `size`-byte chunks to `emit` (the last one may
    be shorter, on `flush_all`)."""

    def __init__(self, emit: Callable[[bytes], None], size: int) -> None:
        self._emit = emit
        self._size = size
        self._buf = bytearray()

    def write(self, data: bytes) -> int:
        self._buf += data
        while len(self._buf) >= self._size:
            self._emit(bytes(self._buf[: self._size]))
            del self._buf[: self._size]
        return len(data)

    def flush(self) -> None:
        pass

    def flush_all(self) -> None:
        if self._buf:
            self._emit(bytes(self._buf))
            self._buf.clear()


def pack(root: Path, out: ChunkWriter) -> DirTransfer:
    """Writes the contents of `root` (names relative to it) as a tar stream into `out`."""
    if not root.is_dir():
        raise NotADirectoryError(f"{root} is not a directory")
    files = directories = symlinks = size = 0
    with tarfile.open(fileobj=out, mode="w|", format=tarfile.PAX_FORMAT) as tar:  # type: ignore[call-overload, unused-ignore]
        for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
            dirnames.sort()
            base = Path(dirpath)
            for name in sorted(dirnames + filenames):
                path = base / name
                rel = path.relative_to(root).as_posix()
                st = path.lstat()
                if not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode) or stat.S_ISLNK(st.st_mode)):
                    continue  # sockets, fifos, devices: left out
                info = tar.gettarinfo(str(path), arcname=rel)
                info.uname = info.gname = ""
                if info.isreg():
                    with path.open("rb") as f:
                        tar.addfile(info, f)
                    files += 1
                    size += info.size
                else:
                    tar.addfile(info)
                    if info.isdir():
                        directories += 1
                    elif info.issym():
                        symlinks += 1
                    else:
                        files += 1  # a hard link to an earlier file
    out.flush_all()
    return DirTransfer(files=files, directories=directories, symlinks=symlinks, bytes=size)


class ChunkReader:
    """A read-only file object over an iterator of byte chunks."""

    def __init__(self, chunks: Iterator[bytes]) -> None:
        self._chunks = chunks
        self._buf = b""
        self._eof = False
        self.total = 0

    def read(self, n: int = -1) -> bytes:
        while not self._eof and (n < 0 or len(self._buf) < n):
            try:
                chunk = next(self._chunks)
            except StopIteration:
                self._eof = True
                break
            self.total += len(chunk)
            self._buf += chunk
        if n < 0:
            out, self._buf = self._buf, b""
        else:
            out, self._buf = self._buf[:n], self._buf[n:]
        return out


def _relative(name: str) -> PurePosixPath:
    p = PurePosixPath(name)
    if p.is_absolute():
        raise ValueError("an absolute path")
    parts = [part for part in p.parts if part not in ("", ".")]
    if ".." in parts:
        raise ValueError("a path with '..'")
    return PurePosixPath(*parts) if parts else PurePosixPath()


def _make_parents(dst: Path, rel: PurePosixPath, name: str) -> None:
    current = dst
    for part in rel.parts[:-1]:
        current = current / part
        try:
            st = current.lstat()
        except FileNotFoundError:
            current.mkdir(mode=0o700)
            continue
        if not stat.S_ISDIR(st.st_mode):
            raise ArchiveRefused(f"refused archive entry {name!r}: its path goes through {part!r}, which is not a directory")


def unpack(source: IO[bytes], dst: Path) -> DirTransfer:
    """Extracts the tar stream `source` into the existing directory `dst` (see the module
    docs for what is refused). Stops at the first refused entry; what came before it stays."""
    if not dst.is_dir() or dst.is_symlink():
        raise NotADirectoryError(f"{dst} is not a directory")
    files = directories = symlinks = size = 0
    extracted: set[PurePosixPath] = set()
    dirs: list[tuple[Path, int, float]] = []
    try:
        tar = tarfile.open(fileobj=source, mode="r|")
    except tarfile.TarError as e:
        raise ProtocolError(f"bad tar stream: {e}") from e
    with tar:
        for member in tar:
            name = member.name

            def refuse(reason: str) -> ArchiveRefused:
                return ArchiveRefused(f"refused archive entry {name!r}: {reason}")

            try:
                rel = _relative(name)
            except ValueError as e:
                raise refuse(str(e)) from None
            if not rel.parts:
                if member.isdir():
                    continue
                raise refuse("an entry with no name")
            target = dst / rel
            _make_parents(dst, rel, name)
            mode = member.mode & 0o777
            try:
                existing: Optional[os.stat_result] = target.lstat()
            except FileNotFoundError:
                existing = None
            in_the_way = existing is not None and stat.S_ISDIR(existing.st_mode)
            if existing is not None and not in_the_way:
                target.unlink()
                extracted.discard(rel)
            if member.isdir():
                if not in_the_way:
                    target.mkdir(mode=0o700)
                dirs.append((target, mode, float(member.mtime)))
                directories += 1
            elif in_the_way:
                raise refuse("a directory is in the way")
            elif member.isreg():
                fileobj = tar.extractfile(member)
                if fileobj is None:
                    raise refuse("a file without content")
                fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
                with os.fdopen(fd, "wb") as f:
                    while True:
                        block = fileobj.read(1 << 20)
                        if not block:
                            break
                        f.write(block)
                        size += len(block)
                    os.fchmod(f.fileno(), mode)
                os.utime(target, (member.mtime, member.mtime), follow_symlinks=False)
                extracted.add(rel)
                files += 1
            elif member.issym():
                if not member.linkname:
                    raise refuse("a symlink without a target")
                os.symlink(member.linkname, target)
                try:
                    os.utime(target, (member.mtime, member.mtime), follow_symlinks=False)
                except (NotImplementedError, OSError):
                    pass  # not every platform sets a symlink's own times
                symlinks += 1
            elif member.islnk():
                try:
                    link_rel = _relative(member.linkname)
                except ValueError as e:
                    raise refuse(f"its target: {e}") from None
                if link_rel not in extracted:
                    raise refuse("a hard link to something this archive did not extract as a file")
                _make_parents(dst, link_rel, name)
                os.link(dst / link_rel, target, follow_symlinks=False)
                extracted.add(rel)
                files += 1
            elif member.ischr() or member.isblk():
                raise refuse("a device node")
            elif member.isfifo():
                raise refuse("a fifo")
            else:
                raise refuse("an entry of a kind this client does not extract")
    for path, mode, mtime in reversed(dirs):
        os.chmod(path, mode)
        os.utime(path, (mtime, mtime))
    return DirTransfer(files=files, directories=directories, symlinks=symlinks, bytes=size)


class PackFeed:
    """`pack(root)` run on a thread of its own, its tar stream handed over in `chunk_size`
    pieces through a queue of `depth` (so memory stays bounded whatever the size). Iterate it
    for the pieces (a failure of the packing is raised there); `close()` stops the thread."""

    def __init__(self, root: Path, chunk_size: int, depth: int) -> None:
        import queue
        import threading

        self._queue: "queue.Queue[object]" = queue.Queue(depth)
        self._stop = threading.Event()
        self._full = queue.Full
        self.report: Optional[DirTransfer] = None
        self.error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._produce, args=(root, chunk_size), name="sandboxd-pack", daemon=True)
        self._thread.start()

    def _put(self, item: object) -> None:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.2)
                return
            except self._full:
                continue

    def _produce(self, root: Path, chunk_size: int) -> None:
        try:
            self.report = pack(root, ChunkWriter(self._put, chunk_size))
            self._put(None)
        except BaseException as e:  # handed to the consumer, which fails with it
            self._put(e)

    def __iter__(self) -> Iterator[bytes]:
        while True:
            item = self._queue.get()
            if item is None:
                return
            if isinstance(item, BaseException):
                self.error = item
                raise item
            assert isinstance(item, bytes)
            yield item

    def get(self) -> object:
        """The next piece, None at the end, or the packing's exception (blocking: for a thread)."""
        return self._queue.get()

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
