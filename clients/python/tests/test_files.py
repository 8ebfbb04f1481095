"""Files and directories, streamed with the daemon's digest checks, and the client-side
extraction rules for archives that come out of a sandbox."""

from __future__ import annotations

import hashlib
import io
import os
import tarfile
from pathlib import Path

import pytest

import sandboxd
from sandboxd import Sandbox
from sandboxd._archive import unpack


def test_small_files(sb: Sandbox) -> None:
    assert sb.write_file("/workspace/a/b/c.txt", "hello\n") == 6
    assert sb.read_file("/workspace/a/b/c.txt") == b"hello\n"
    assert sb.read_file("/workspace/a/b/c.txt", offset=1, limit=3) == b"ell"
    sb.write_file("/workspace/run.sh", b"#!/bin/sh\necho ran\n", mode=0o755)
    assert sb.exec(["/workspace/run.sh"]).check().stdout == b"ran\n"
    with pytest.raises(sandboxd.NotFound) as e:
        sb.read_file("/workspace/missing.txt")
    assert "missing.txt" in e.value.message


def test_upload_and_download_of_a_large_file(sb: Sandbox, tmp_path: Path) -> None:
    data = os.urandom(5 * (1 << 20) + 12345)
    src = tmp_path / "big.bin"
    src.write_bytes(data)
    digest = hashlib.sha256(data).hexdigest()
    sent = sb.upload(src, "/workspace/big.bin")
    assert (sent.bytes, sent.sha256) == (len(data), digest)
    assert sb.exec(["sh", "-c", "sha256sum /workspace/big.bin"]).stdout_text.split()[0] == digest
    out = tmp_path / "back.bin"
    got = sb.download("/workspace/big.bin", out)
    assert (got.bytes, got.sha256) == (len(data), digest) and out.read_bytes() == data
    buf = io.BytesIO()
    assert sb.download("/workspace/big.bin", buf).sha256 == digest and buf.getvalue() == data
    assert sb.upload(io.BytesIO(b""), "/workspace/empty").bytes == 0
    assert sb.read_file("/workspace/empty") == b""
    assert sb.download("/workspace/empty", tmp_path / "empty").bytes == 0


def test_failed_transfers_change_nothing(sb: Sandbox, tmp_path: Path) -> None:
    with pytest.raises(sandboxd.NotFound) as e:
        sb.download("/workspace/nope.bin", tmp_path / "nope.bin")
    assert "nope.bin" in e.value.message
    assert not (tmp_path / "nope.bin").exists() and list(tmp_path.iterdir()) == []

    sb.write_file("/workspace/keep.txt", "old")

    class Broken(io.RawIOBase):
        """A reader that fails after its first MiB."""

        def __init__(self) -> None:
            self.sent = 0

        def readable(self) -> bool:
            return True

        def read(self, n: int = -1) -> bytes:
            if self.sent >= 1 << 20:
                raise OSError("disk on fire")
            self.sent += n
            return b"x" * n

    with pytest.raises(OSError, match="disk on fire"):
        sb.upload(Broken(), "/workspace/keep.txt")  # type: ignore[arg-type]
    assert sb.read_file("/workspace/keep.txt") == b"old", "a cut upload replaces nothing"
    with pytest.raises(FileNotFoundError):
        sb.upload(tmp_path / "does-not-exist", "/workspace/x")


def test_directories_both_ways(sb: Sandbox, tmp_path: Path) -> None:
    src = tmp_path / "src"
    (src / "pkg" / "deep").mkdir(parents=True)
    (src / "README").write_text("top\n")
    (src / "pkg" / "mod.py").write_text("x = 1\n")
    (src / "pkg" / "deep" / "blob").write_bytes(os.urandom(3 << 20))
    (src / "tool.sh").write_text("#!/bin/sh\necho tool\n")
    (src / "tool.sh").chmod(0o755)
    (src / "link").symlink_to("pkg/mod.py")
    (src / "empty").mkdir()
    stats = sb.upload_dir(src, "/workspace/proj")
    assert (stats.files, stats.symlinks) == (4, 1) and stats.directories >= 3, stats
    assert stats.bytes == sum(p.stat().st_size for p in src.rglob("*") if p.is_file() and not p.is_symlink())
    assert sb.exec(["/workspace/proj/tool.sh"]).check().stdout == b"tool\n"
    assert sb.exec(["cat", "/workspace/proj/link"]).stdout == b"x = 1\n"
    sb.exec(["sh", "-c", "echo made > /workspace/proj/pkg/new.txt"]).check()

    dst = tmp_path / "dst"
    got = sb.download_dir("/workspace/proj", dst)
    assert got.files == 5 and got.symlinks == 1, got
    assert (dst / "pkg" / "deep" / "blob").read_bytes() == (src / "pkg" / "deep" / "blob").read_bytes()
    assert (dst / "pkg" / "new.txt").read_text() == "made\n"
    assert os.readlink(dst / "link") == "pkg/mod.py"
    assert (dst / "tool.sh").stat().st_mode & 0o777 == 0o755 and (dst / "empty").is_dir()
    with pytest.raises(sandboxd.NotFound):
        sb.download_dir("/workspace/nothing-here", tmp_path / "none")
    with pytest.raises(NotADirectoryError):
        sb.upload_dir(src / "README", "/workspace/x")


def _tar(entries: list[tarfile.TarInfo], data: bytes = b"") -> io.BytesIO:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as t:
        for info in entries:
            t.addfile(info, io.BytesIO(data) if info.isreg() else None)
    buf.seek(0)
    return buf


def _entry(name: str, kind: bytes = tarfile.REGTYPE, link: str = "", size: int = 0) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.linkname, info.size, info.mode = kind, link, size, 0o644
    return info


@pytest.mark.parametrize(
    "entries, reason",
    [
        ([_entry("/etc/evil", size=1)], "absolute"),
        ([_entry("../evil", size=1)], "'..'"),
        ([_entry("a/../../evil", size=1)], "'..'"),
        ([_entry("esc", tarfile.SYMTYPE, "/"), _entry("esc/evil", size=1)], "not a directory"),
        ([_entry("dev", tarfile.CHRTYPE)], "device"),
        ([_entry("fifo", tarfile.FIFOTYPE)], "fifo"),
        ([_entry("hl", tarfile.LNKTYPE, "/etc/passwd")], "absolute"),
        ([_entry("hl", tarfile.LNKTYPE, "elsewhere")], "hard link"),
    ],
)
def test_hostile_archives_are_refused(tmp_path: Path, entries: list[tarfile.TarInfo], reason: str) -> None:
    dst = tmp_path / "dst"
    dst.mkdir()
    with pytest.raises(sandboxd.ArchiveRefused, match=reason):
        unpack(_tar(entries, b"x"), dst)
    assert not (tmp_path / "evil").exists() and not Path("/etc/evil").exists()


def test_an_entry_never_writes_through_an_existing_symlink(tmp_path: Path) -> None:
    dst, outside = tmp_path / "dst", tmp_path / "outside"
    dst.mkdir()
    outside.write_text("precious")
    (dst / "f").symlink_to(outside)
    unpack(_tar([_entry("f", size=3)], b"new"), dst)
    assert outside.read_text() == "precious" and not (dst / "f").is_symlink() and (dst / "f").read_text() == "new"
