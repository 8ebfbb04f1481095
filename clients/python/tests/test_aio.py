"""The asyncio API (`sandboxd.aio`) against the real daemon: the same names as the sync one."""

from __future__ import annotations

import asyncio
import hashlib
import os
import signal
import uuid
import weakref
from pathlib import Path

import pytest

import sandboxd.aio
import sandboxd.aio.client
from sandboxd.aio import ExecStatus, Sandbox, images

from conftest import Daemon


async def test_create_exec_destroy(aclient: sandboxd.aio.Client) -> None:
    async with Sandbox.create(isolation="process", image="minimal", memory="256M", env={"G": "hi"}, client=aclient) as sb:
        r = await sb.exec(["sh", "-c", "echo $G; exit 2"])
        assert (r.stdout, r.exit_code, r.status) == (b"hi\n", 2, ExecStatus.EXITED)
        assert sb.info.limits.memory_bytes == 256 << 20
        sid = sb.id
    with pytest.raises(sandboxd.aio.NotFound) as e:
        await Sandbox.connect(sid, client=aclient)
    assert sid in e.value.message


async def test_keep_connect_list(aclient: sandboxd.aio.Client) -> None:
    label = uuid.uuid4().hex[:12]
    sb = await Sandbox.create(isolation="process", image="minimal", labels={"run": label}, client=aclient)
    async with sb:
        again = await Sandbox.connect(sb.id, client=aclient)
        assert [s.id for s in await Sandbox.list(labels={"run": label}, client=aclient)] == [sb.id]
        assert (await again.set_ttl(600)).expires_at is not None and (await again.refresh()).id == sb.id
    assert await Sandbox.list(labels={"run": label}, client=aclient) == []


async def test_concurrent_execs_on_one_connection(asb: Sandbox) -> None:
    results = await asyncio.gather(*(asb.exec(["echo", str(i)]) for i in range(8)))
    assert [r.stdout for r in results] == [f"{i}\n".encode() for i in range(8)]


async def test_exec_stream_background_and_records(asb: Sandbox) -> None:
    script = "echo first; while [ ! -e /tmp/go ]; do sleep 0.02; done; echo second >&2; exit 4"
    async with asb.exec_stream(["sh", "-c", script]) as stream:
        first = await stream.__anext__()
        assert (first.stream, first.data) == ("stdout", b"first\n")
        await asb.write_file("/tmp/go", "")
        rest = [c async for c in stream]
        assert [(c.stream, c.data) for c in rest] == [("stderr", b"second\n")]
        assert stream.result is not None and stream.result.exit_code == 4
    assert (await asb.exec_stream(["echo", "w"]).wait()).stdout == b"w\n"

    job = await asb.exec_background(["sleep", "1000"])
    assert (await job.poll()).running
    killed = await job.kill()
    assert killed.status == ExecStatus.SIGNALED and killed.signal == signal.SIGKILL
    slow = await asb.exec_background(["sleep", "1000"])
    with pytest.raises(sandboxd.aio.DeadlineExceeded):
        await slow.wait(timeout=0.5)
    await slow.kill()
    quick = await asb.exec_background(["echo", "bg"])
    assert (await quick.wait(timeout=60)).stdout == b"bg\n"

    key = uuid.uuid4().hex
    once = await asb.exec(["echo", "k"], idempotency_key=key)
    assert (await asb.exec(["echo", "k"], idempotency_key=key)).exec_id == once.exec_id
    records = [r async for r in asb.execs(page_size=2)]
    assert records[-1].exec_id == once.exec_id and len(records) >= 5
    assert (await asb.get_exec(quick.id)).stdout == b"bg\n"


async def test_sessions(asb: Sandbox) -> None:
    async with asb.session(["sh"], tty=True, rows=30, cols=90) as s:
        await s.write("stty size; echo $((6*7))\n")
        await s.expect("30 90")
        await s.expect("42")
        await s.resize(40, 100)
        await s.write("stty size\n")
        await s.expect("40 100")
        await s.write("exit 5\n")
        assert (await s.wait(timeout=60)).exit_code == 5
        with pytest.raises(sandboxd.aio.SessionClosed):
            await s.write("x")
    s = await asb.session(["cat"], tty=False)
    async with s:
        await s.write(b"abc")
        assert await s.expect(b"abc") == b"abc"
        await s.close_stdin()
        assert (await s.wait(timeout=60)).ok
    async with asb.session(["sleep", "1000"], tty=False) as s:
        await s.signal(signal.SIGTERM)
        assert (await s.wait(timeout=60)).signal == signal.SIGTERM


async def test_files_and_directories(asb: Sandbox, tmp_path: Path) -> None:
    assert await asb.write_file("/workspace/a.txt", "hello") == 5
    assert await asb.read_file("/workspace/a.txt", offset=1, limit=3) == b"ell"
    data = os.urandom(3 * (1 << 20) + 7)
    (tmp_path / "big").write_bytes(data)
    sent = await asb.upload(tmp_path / "big", "/workspace/big")
    assert sent.sha256 == hashlib.sha256(data).hexdigest()
    got = await asb.download("/workspace/big", tmp_path / "back")
    assert got == sent and (tmp_path / "back").read_bytes() == data
    with pytest.raises(sandboxd.aio.NotFound) as e:
        await asb.download("/workspace/missing", tmp_path / "missing")
    assert "missing" in e.value.message and not (tmp_path / "missing").exists()
    with pytest.raises(sandboxd.aio.NotFound):
        await asb.read_file("/workspace/missing")

    src = tmp_path / "tree"
    (src / "sub").mkdir(parents=True)
    (src / "sub" / "f.txt").write_text("in sub\n")
    (src / "link").symlink_to("sub/f.txt")
    stats = await asb.upload_dir(src, "/workspace/tree")
    assert (stats.files, stats.symlinks) == (1, 1)
    assert (await asb.exec(["cat", "/workspace/tree/link"])).stdout == b"in sub\n"
    back = await asb.download_dir("/workspace/tree", tmp_path / "tree-back")
    assert back.files == 1 and (tmp_path / "tree-back" / "sub" / "f.txt").read_text() == "in sub\n"
    assert os.readlink(tmp_path / "tree-back" / "link") == "sub/f.txt"
    with pytest.raises(sandboxd.aio.NotFound):
        await asb.download_dir("/workspace/nothing", tmp_path / "none")


async def test_snapshot_rollback_fork(asb: Sandbox, aclient: sandboxd.aio.Client) -> None:
    await asb.write_file("/workspace/s", "v1")
    snap = await asb.snapshot("one")
    await asb.write_file("/workspace/s", "v2")
    await asb.rollback(snap)
    assert await asb.read_file("/workspace/s") == b"v1"
    assert [s.snapshot_id for s in await asb.snapshots()] == [snap.snapshot_id]
    async with Sandbox.fork(snap, client=aclient) as child:
        assert (await child.exec(["cat", "/workspace/s"])).stdout == b"v1"
        with pytest.raises(sandboxd.aio.FailedPrecondition):
            await asb.delete_snapshot(snap)
    await asb.delete_snapshot(snap)
    assert await asb.snapshots() == []


async def test_network_and_its_log(aclient: sandboxd.aio.Client) -> None:
    async with Sandbox.create(allow=["pypi.test:443"], client=aclient) as sb:
        assert (sb.info.network, list(sb.info.allow)) == ("allowlist", ["pypi.test:443"])
        assert (await sb.exec(["nslookup", "evil.test"])).exit_code != 0
        events = await sb.network_log()
        assert any(e.kind == "dns" and e.name == "evil.test" and not e.allowed for e in events), events
        snap = await sb.snapshot()
        async with Sandbox.fork(snap, network="open", client=aclient) as child:
            assert child.info.network == "open"


async def test_errors_and_images(aclient: sandboxd.aio.Client) -> None:
    with pytest.raises(sandboxd.aio.InvalidArgument) as e:
        await Sandbox.create(isolation="process", image="minimal", memory="1K", client=aclient)
    assert "memory_bytes" in e.value.message
    names = [i.name for i in await images.list(client=aclient)]
    assert "minimal" in names
    assert (await images.get("minimal", client=aclient)).name == "minimal"
    with pytest.raises(sandboxd.aio.NotFound, match="no-such-image"):
        await images.get("no-such-image", client=aclient)
    with pytest.raises(sandboxd.aio.FailedPrecondition):
        await images.remove("minimal", client=aclient)


async def test_build_and_import_with_progress(aclient: sandboxd.aio.Client, tmp_path: Path) -> None:
    name = f"pysdk-aio-{uuid.uuid4().hex[:8]}"
    ctx = tmp_path / "ctx"
    ctx.mkdir()
    (ctx / "Dockerfile").write_text("FROM sandboxd/minimal\nARG WHO=nobody\nRUN echo $WHO > /who\n")
    phases: list[str] = []
    info = await images.build(ctx, name, build_args={"WHO": "aio"}, progress=lambda e: phases.append(e.phase), client=aclient)
    try:
        assert "build" in phases and phases[-1] == "done"
        async with Sandbox.create(isolation="process", image=name, client=aclient) as sb:
            assert (await sb.exec(["cat", "/who"])).stdout == b"aio\n"
    finally:
        await images.remove(info.name, client=aclient)
    with pytest.raises(sandboxd.aio.NotFound):
        await images.import_docker("pysdk-no-such-image:never", client=aclient)
    with pytest.raises(FileNotFoundError):
        await images.import_archive(tmp_path / "missing.tar", client=aclient)


async def test_connect_and_default_client(daemon: Daemon, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(sandboxd.aio.Unavailable, match="nothing.sock"):
        await sandboxd.aio.Client.connect(f"unix://{tmp_path}/nothing.sock", connect_timeout=0.5)
    monkeypatch.setenv("SANDBOXD_SOCKET", daemon.address)
    monkeypatch.setattr(sandboxd.aio.client, "_defaults", weakref.WeakKeyDictionary())
    async with Sandbox.create(isolation="process", image="minimal") as sb:
        assert (await sb.exec(["echo", "env"])).stdout == b"env\n"
        assert sb.client.address == daemon.address
    await sb.client.close()


async def test_a_cut_upload_replaces_nothing(asb: Sandbox) -> None:
    import io

    class Broken(io.RawIOBase):
        def __init__(self) -> None:
            self.sent = 0

        def readable(self) -> bool:
            return True

        def read(self, n: int = -1) -> bytes:
            if self.sent >= 2 << 20:
                raise OSError("disk on fire")
            self.sent += n
            return b"y" * n

    await asb.write_file("/workspace/keep.txt", "old")
    with pytest.raises(OSError, match="disk on fire"):
        await asb.upload(Broken(), "/workspace/keep.txt")  # type: ignore[arg-type]
    assert await asb.read_file("/workspace/keep.txt") == b"old"
    # The connection is still good for the next call.
    assert (await asb.upload(io.BytesIO(b"new"), "/workspace/keep.txt")).bytes == 3
    assert await asb.read_file("/workspace/keep.txt") == b"new"
