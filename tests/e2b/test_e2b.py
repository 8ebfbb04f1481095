"""The unmodified `e2b` SDK against sandboxd's E2B-compatible listener: only the SDK's public
API, only the three environment variables a user of E2B's hosted service would change."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Iterator

import pytest
from e2b import (
    AuthenticationException,
    CommandExitException,
    FileType,
    NotFoundException,
    PtySize,
    Sandbox,
    SandboxException,
    SandboxNotFoundException,
    SandboxQuery,
    SandboxState,
    TemplateException,
    TimeoutException,
)

from conftest import BOB_KEY, TIERS, Daemon

IMAGE = "debian"


def wait_for(what: str, check: Callable[[], bool], timeout: float = 60) -> None:
    """Waits for an event (a condition turning true), bounded; never for a fixed time."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.05)


@pytest.fixture
def sbx(daemon: Daemon) -> Iterator[Sandbox]:
    s = Sandbox.create(IMAGE, timeout=600, metadata={"suite": "e2b"})
    yield s
    s.kill()


@pytest.mark.parametrize("tier", TIERS)
def test_core_on_each_tier(daemon: Daemon, tier: str) -> None:
    s = Sandbox.create(IMAGE, timeout=600, metadata={"isolation": tier, "case": "core"}, envs={"GREETING": "hello"})
    try:
        r = s.commands.run('echo "$GREETING from $(cat /etc/debian_version | cut -c1-2)"; echo oops >&2')
        assert r.exit_code == 0
        assert r.stdout.startswith("hello from 12"), r.stdout
        assert r.stderr == "oops\n"
        with pytest.raises(CommandExitException) as exc:
            s.commands.run("echo partial; exit 7")
        assert exc.value.exit_code == 7
        assert exc.value.stdout == "partial\n"
        s.files.write("/tmp/tier.txt", f"on {tier}")
        assert s.files.read("/tmp/tier.txt") == f"on {tier}"
        assert s.commands.run("cat /tmp/tier.txt").stdout == f"on {tier}"
        bg = s.commands.run("sleep 600", background=True)
        assert s.commands.kill(bg.pid) is True
        with pytest.raises(CommandExitException):
            bg.wait()
        assert s.get_info().metadata["isolation"] == tier
    finally:
        s.kill()
    assert not s.is_running()
    with pytest.raises(SandboxNotFoundException):
        Sandbox.connect(s.sandbox_id)


def test_streamed_output_reaches_callbacks_in_order(sbx: Sandbox) -> None:
    seen: list[str] = []
    r = sbx.commands.run(
        "for i in 1 2 3; do echo out$i; echo err$i >&2; done",
        on_stdout=lambda d: seen.append("o:" + d),
        on_stderr=lambda d: seen.append("e:" + d),
    )
    assert r.stdout == "out1\nout2\nout3\n"
    assert r.stderr == "err1\nerr2\nerr3\n"
    assert "".join(x[2:] for x in seen if x.startswith("o:")) == r.stdout
    assert "".join(x[2:] for x in seen if x.startswith("e:")) == r.stderr


def test_command_options_cwd_env_user_and_not_found(sbx: Sandbox) -> None:
    sbx.files.make_dir("/srv/work")
    r = sbx.commands.run("pwd; echo $A; id -un", cwd="/srv/work", envs={"A": "b"}, user="root")
    assert r.stdout == "/srv/work\nb\nroot\n"
    with pytest.raises(CommandExitException) as exc:
        sbx.commands.run("definitely-not-a-command")
    assert exc.value.exit_code == 127


def test_background_command_connect_and_kill_from_a_second_process(sbx: Sandbox) -> None:
    handle = sbx.commands.run("echo started; sleep 600", background=True)
    assert any(p.pid == handle.pid for p in sbx.commands.list())
    # A second process attaches by sandbox id and pid, as another worker would, and kills it.
    script = (
        "import sys\n"
        "from e2b import Sandbox\n"
        "s = Sandbox.connect(sys.argv[1])\n"
        "h = s.commands.connect(int(sys.argv[2]))\n"
        "assert s.commands.kill(h.pid) is True\n"
        "print('killed')\n"
    )
    out = subprocess.run([sys.executable, "-c", script, sbx.sandbox_id, str(handle.pid)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "killed"
    with pytest.raises(CommandExitException) as exc:
        handle.wait()
    assert exc.value.exit_code != 0
    assert "started\n" in exc.value.stdout
    assert all(p.pid != handle.pid for p in sbx.commands.list())
    assert sbx.commands.kill(handle.pid) is False, "a second kill finds nothing"


def test_stdin_can_be_sent_and_closed(sbx: Sandbox) -> None:
    h = sbx.commands.run("tr a-z A-Z", background=True, stdin=True)
    sbx.commands.send_stdin(h.pid, "hello ")
    sbx.commands.send_stdin(h.pid, "stdin\n")
    sbx.commands.close_stdin(h.pid)
    assert h.wait().stdout == "HELLO STDIN\n"


def test_pty_with_input_and_resize(sbx: Sandbox) -> None:
    out = bytearray()
    term = sbx.pty.create(PtySize(rows=24, cols=80))
    sbx.pty.resize(term.pid, PtySize(rows=33, cols=111))
    sbx.pty.send_stdin(term.pid, b"stty size; tty; exit 5\n")
    with pytest.raises(CommandExitException) as exc:
        term.wait(on_pty=lambda d: out.extend(d))
    assert exc.value.exit_code == 5
    text = out.decode(errors="replace")
    assert "33 111" in text, text
    assert "/dev/pts/" in text, text


def test_files_write_read_list_exists_remove_make_dir_rename(sbx: Sandbox) -> None:
    info = sbx.files.write("/data/notes/a.txt", "first")
    assert info.path == "/data/notes/a.txt"
    assert sbx.files.read("/data/notes/a.txt") == "first"
    assert sbx.files.exists("/data/notes/a.txt")
    assert not sbx.files.exists("/data/notes/missing.txt")
    assert sbx.files.make_dir("/data/notes/sub") is True
    assert sbx.files.make_dir("/data/notes/sub") is False, "an existing dir is not made again"
    sbx.files.write("/data/notes/sub/b.bin", b"\x00\x01binary")
    top = {e.name: e for e in sbx.files.list("/data/notes")}
    assert set(top) == {"a.txt", "sub"}
    assert top["a.txt"].type == FileType.FILE and top["a.txt"].size == 5
    assert top["sub"].type == FileType.DIR
    deep = {e.path for e in sbx.files.list("/data/notes", depth=2)}
    assert deep == {"/data/notes/a.txt", "/data/notes/sub", "/data/notes/sub/b.bin"}
    moved = sbx.files.rename("/data/notes/a.txt", "/data/notes/sub/c.txt")
    assert moved.path == "/data/notes/sub/c.txt"
    assert not sbx.files.exists("/data/notes/a.txt")
    assert sbx.files.read("/data/notes/sub/c.txt") == "first"
    assert sbx.files.read("/data/notes/sub/b.bin", format="bytes") == b"\x00\x01binary"
    sbx.files.remove("/data/notes/sub")
    assert not sbx.files.exists("/data/notes/sub/c.txt")
    with pytest.raises(NotFoundException):
        sbx.files.read("/data/notes/sub/c.txt")
    with pytest.raises(NotFoundException):
        sbx.files.list("/nowhere")
    # Several files in one multipart upload, each part's name its path.
    infos = sbx.files.write_files([{"path": "/data/m/one.txt", "data": "1"}, {"path": "/data/m/two.bin", "data": b"\x02" * 70000}])
    assert sorted(i.path for i in infos) == ["/data/m/one.txt", "/data/m/two.bin"]
    assert sbx.commands.run("cat /data/m/one.txt; wc -c < /data/m/two.bin").stdout == "170000\n"
    # Relative paths start at the sandbox's workdir.
    sbx.files.write("rel.txt", "relative")
    assert sbx.commands.run("cat /workspace/rel.txt").stdout == "relative"


def test_a_50_mib_file_round_trips(sbx: Sandbox) -> None:
    data = os.urandom(50 << 20)
    digest = hashlib.sha256(data).hexdigest()
    sbx.files.write("/tmp/big.bin", data)
    assert sbx.commands.run("sha256sum /tmp/big.bin").stdout.split()[0] == digest
    got = sbx.files.read("/tmp/big.bin", format="bytes")
    assert len(got) == len(data)
    assert hashlib.sha256(got).hexdigest() == digest


def test_set_timeout_then_expiry(daemon: Daemon) -> None:
    s = Sandbox.create(IMAGE, timeout=600)
    try:
        before = s.get_info().end_at
        s.set_timeout(1200)
        later = s.get_info().end_at
        assert later > before
        s.set_timeout(2)
        assert s.get_info().end_at <= datetime.now(timezone.utc).replace(microsecond=0) + __import__("datetime").timedelta(seconds=3)
        wait_for("the sandbox to expire", lambda: not s.is_running(), timeout=60)
        with pytest.raises(SandboxNotFoundException):
            Sandbox.get_info(s.sandbox_id)
    finally:
        Sandbox.kill(s.sandbox_id)


def test_list_with_metadata_filters_and_pages(daemon: Daemon) -> None:
    run = os.urandom(4).hex()
    a = Sandbox.create(IMAGE, timeout=600, metadata={"run": run, "role": "a"})
    b = Sandbox.create(IMAGE, timeout=600, metadata={"run": run, "role": "b"})
    try:
        only_a = Sandbox.list(query=SandboxQuery(metadata={"run": run, "role": "a"})).next_items()
        assert [s.sandbox_id for s in only_a] == [a.sandbox_id]
        assert only_a[0].metadata == {"run": run, "role": "a"}
        pager = Sandbox.list(query=SandboxQuery(metadata={"run": run}), limit=1)
        ids = []
        while pager.has_next:
            page = pager.next_items()
            assert len(page) == 1
            ids += [s.sandbox_id for s in page]
        assert sorted(ids) == sorted([a.sandbox_id, b.sandbox_id])
    finally:
        a.kill()
        b.kill()


def test_connect_by_id_sees_the_same_sandbox(sbx: Sandbox) -> None:
    sbx.files.write("/tmp/mark", "here")
    other = Sandbox.connect(sbx.sandbox_id)
    assert other.sandbox_id == sbx.sandbox_id
    assert other.commands.run("cat /tmp/mark").stdout == "here"


def test_two_tenants_do_not_see_each_other(sbx: Sandbox) -> None:
    with pytest.raises(SandboxNotFoundException):
        Sandbox.connect(sbx.sandbox_id, api_key=BOB_KEY)
    with pytest.raises(SandboxNotFoundException):
        Sandbox.get_info(sbx.sandbox_id, api_key=BOB_KEY)
    assert Sandbox.kill(sbx.sandbox_id, api_key=BOB_KEY) is False
    assert sbx.sandbox_id not in [s.sandbox_id for s in Sandbox.list(api_key=BOB_KEY).next_items()]
    bobs = Sandbox.create(IMAGE, timeout=600, api_key=BOB_KEY)
    try:
        assert bobs.commands.run("echo bob").stdout == "bob\n"
        assert bobs.sandbox_id not in [s.sandbox_id for s in Sandbox.list().next_items()]
        with pytest.raises(SandboxNotFoundException):
            Sandbox.connect(bobs.sandbox_id)
    finally:
        bobs.kill()
    assert sbx.is_running(), "bob's calls left alice's sandbox alone"
    with pytest.raises(AuthenticationException):
        Sandbox.create(IMAGE, api_key="not-a-key")


def test_unknown_ids_and_templates_are_not_found(daemon: Daemon) -> None:
    with pytest.raises(SandboxNotFoundException):
        Sandbox.connect("sb-doesnotexist")
    assert Sandbox.kill("sb-doesnotexist") is False
    with pytest.raises(SandboxException) as exc:
        Sandbox.create("no-such-image")
    assert "no-such-image" in str(exc.value)


def test_what_does_not_map_is_refused_with_a_reason(sbx: Sandbox) -> None:
    # The control plane's 400 is the SDK's SandboxException, with our sentence in it.
    with pytest.raises(SandboxException) as exc:
        Sandbox.create(IMAGE, lifecycle={"on_timeout": "pause", "auto_resume": True})
    assert "not supported" in str(exc.value) and "autoResume" in str(exc.value)
    with pytest.raises(SandboxException) as exc:
        Sandbox.create(IMAGE, allow_internet_access=True)
    assert "no network" in str(exc.value)
    # A pause keeps the memory: a filesystem-only one (and a reboot on resume) is refused.
    with pytest.raises(SandboxException) as exc:
        sbx.pause(mode="filesystem")
    assert "not supported" in str(exc.value)
    assert sbx.get_info().state == SandboxState.RUNNING
    # What our envd version (0.5.7) lacks, the SDK itself refuses.
    with pytest.raises(TemplateException):
        sbx.files.watch_dir("/tmp", include_entry=True)


def test_watching_a_directory(sbx: Sandbox) -> None:
    from e2b import FilesystemEventType

    sbx.files.make_dir("/w/sub")
    sbx.files.write("/w/old.txt", "x")
    handle = sbx.files.watch_dir("/w", recursive=True)
    assert handle.get_new_events() == []
    sbx.files.write("/w/new.txt", "hello")
    sbx.files.write("/w/sub/deep.txt", "d")
    sbx.files.remove("/w/old.txt")
    seen = {(e.name, e.type) for e in handle.get_new_events()}
    assert seen == {
        ("new.txt", FilesystemEventType.CREATE),
        ("sub/deep.txt", FilesystemEventType.CREATE),
        ("sub", FilesystemEventType.WRITE),
        ("old.txt", FilesystemEventType.REMOVE),
    } or seen - {("sub", FilesystemEventType.WRITE)} == {
        ("new.txt", FilesystemEventType.CREATE),
        ("sub/deep.txt", FilesystemEventType.CREATE),
        ("old.txt", FilesystemEventType.REMOVE),
    }, seen
    handle.stop()
    with pytest.raises(SandboxException):
        handle.get_new_events()


def test_the_default_template_runs_commands(daemon: Daemon) -> None:
    s = Sandbox.create()
    try:
        assert s.commands.run("echo $0").stdout.strip().endswith("bash")
    finally:
        s.kill()


def test_the_readme_example_runs_as_written(daemon: Daemon) -> None:
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = readme.split("## Already using E2B?", 1)[1].split("\n## ", 1)[0]
    example = section.split("```python\n", 1)[1].split("```", 1)[0]
    assert len(example.strip().splitlines()) <= 7, "the README promises a short example"
    out = subprocess.run([sys.executable, "-c", example], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout == "hello from Linux\n\nkept\n"


def test_timeouts_are_the_sdks_timeout_exception(sbx: Sandbox, monkeypatch: pytest.MonkeyPatch) -> None:
    # The SDK's own deadline on a command.
    with pytest.raises(TimeoutException):
        sbx.commands.run("sleep 600", timeout=1)
    # The daemon's exec timeout ([limits.default] exec_timeout_ms) killing a command.
    short = Daemon(extra_config="[limits.default]\nexec_timeout_ms = 1500\n")
    try:
        monkeypatch.setenv("E2B_API_URL", short.url)
        monkeypatch.setenv("E2B_SANDBOX_URL", short.url)
        s = Sandbox.create(IMAGE)
        with pytest.raises(TimeoutException) as exc:
            s.commands.run("sleep 600", timeout=0)
        assert "exec timeout" in str(exc.value)
        assert s.commands.run("echo still here").stdout == "still here\n"
        s.kill()
    finally:
        short.stop()


def test_the_async_sdk_too(daemon: Daemon) -> None:
    import asyncio

    from e2b import AsyncSandbox

    async def main() -> None:
        s = await AsyncSandbox.create(IMAGE, timeout=600)
        try:
            outs = await asyncio.gather(*(s.commands.run(f"echo a{i}") for i in range(5)))
            assert [o.stdout for o in outs] == [f"a{i}\n" for i in range(5)]
            await s.files.write("/tmp/q", "async")
            assert await s.files.read("/tmp/q") == "async"
            h = await s.commands.run("sleep 600", background=True)
            assert await s.commands.kill(h.pid) is True
            events: list[str] = []
            watch = await s.files.watch_dir("/tmp", on_event=lambda e: events.append(e.name))
            await s.files.write("/tmp/watched.txt", "w")
            deadline = time.monotonic() + 30
            while "watched.txt" not in events:
                assert time.monotonic() < deadline, f"no event for watched.txt: {events}"
                await asyncio.sleep(0.05)
            await watch.stop()
        finally:
            await s.kill()

    asyncio.run(main())


def test_fork_copies_the_filesystem(sbx: Sandbox) -> None:
    sbx.files.write("/workspace/state.txt", "before fork")
    forks = sbx.fork(count=2, timeout=600)
    try:
        assert len(forks) == 2
        for f in forks:
            assert isinstance(f, Sandbox), f
            assert f.sandbox_id != sbx.sandbox_id
            assert f.files.read("/workspace/state.txt") == "before fork"
        first, second = forks
        assert isinstance(first, Sandbox) and isinstance(second, Sandbox)
        first.files.write("/workspace/state.txt", "changed in one fork")
        assert second.files.read("/workspace/state.txt") == "before fork"
        assert sbx.files.read("/workspace/state.txt") == "before fork"
    finally:
        for f in forks:
            if isinstance(f, Sandbox):
                f.kill()


@pytest.mark.parametrize("tier", TIERS)
def test_pause_list_and_connect_on_each_tier(daemon: Daemon, tier: str) -> None:
    run = os.urandom(4).hex()
    s = Sandbox.create(IMAGE, timeout=600, metadata={"isolation": tier, "run": run})
    try:
        s.files.write("/tmp/kept", "kept")
        s.commands.run("i=0; while :; do i=$((i+1)); echo $i > /tmp/c.new; mv /tmp/c.new /tmp/c; sleep 0.05; done", background=True)
        count = lambda sb: int(sb.commands.run("cat /tmp/c 2>/dev/null || echo 0").stdout.strip())  # noqa: E731
        wait_for("the counter to count", lambda: count(s) > 2)
        assert s.pause() is True
        assert s.pause() is False, "a second pause answers 'already paused'"
        info = Sandbox.get_info(s.sandbox_id)
        assert info.state == SandboxState.PAUSED
        paused = Sandbox.list(query=SandboxQuery(metadata={"run": run}, state=[SandboxState.PAUSED])).next_items()
        assert [p.sandbox_id for p in paused] == [s.sandbox_id]
        assert paused[0].state == SandboxState.PAUSED
        running = Sandbox.list(query=SandboxQuery(metadata={"run": run}, state=[SandboxState.RUNNING])).next_items()
        assert running == []
        # Nothing runs in it meanwhile, and it says why.
        with pytest.raises(Exception) as exc:
            s.commands.run("true")
        assert "paused" in str(exc.value)

        c = Sandbox.connect(s.sandbox_id, timeout=300)
        assert c.sandbox_id == s.sandbox_id
        assert Sandbox.get_info(s.sandbox_id).state == SandboxState.RUNNING
        assert c.commands.run("cat /tmp/kept").stdout == "kept"
        # The same counter goes on (frozen, not restarted).
        first = count(c)
        wait_for("the counter to go on", lambda: count(c) > first)
        assert Sandbox.get_info(s.sandbox_id).end_at > datetime.now(timezone.utc)
        # Connecting to a running sandbox leaves it running.
        assert Sandbox.connect(s.sandbox_id).commands.run("echo ok").stdout == "ok\n"
    finally:
        Sandbox.kill(s.sandbox_id)


def test_auto_pause_at_timeout_then_connect_resumes(daemon: Daemon) -> None:
    s = Sandbox.create(IMAGE, timeout=3, lifecycle={"on_timeout": "pause"})
    try:
        s.files.write("/tmp/kept", "kept")
        lifecycle = Sandbox.get_info(s.sandbox_id).lifecycle
        assert lifecycle is not None and lifecycle["on_timeout"] == "pause"
        wait_for("the timeout to pause the sandbox", lambda: Sandbox.get_info(s.sandbox_id).state == SandboxState.PAUSED, timeout=60)
        # Paused, not killed: it stays listed and connect brings it back with its files.
        assert s.sandbox_id in [p.sandbox_id for p in Sandbox.list(query=SandboxQuery(state=[SandboxState.PAUSED])).next_items()]
        c = Sandbox.connect(s.sandbox_id, timeout=600)
        assert Sandbox.get_info(s.sandbox_id).state == SandboxState.RUNNING
        assert c.commands.run("cat /tmp/kept").stdout == "kept"
    finally:
        Sandbox.kill(s.sandbox_id)
