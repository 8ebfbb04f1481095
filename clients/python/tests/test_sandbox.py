"""The sync API against the real daemon: sandboxes, execs, streams, sessions, errors."""

from __future__ import annotations

import signal
import time
import uuid

import pytest

import sandboxd
from sandboxd import ExecStatus, Isolation, Sandbox


def test_create_exec_and_destroy_on_exit(client: sandboxd.Client) -> None:
    with Sandbox.create(isolation="process", image="minimal", memory="256M", cpus=0.5, ttl=600,
                        env={"GREETING": "hi"}, labels={"suite": "pysdk"}, client=client) as sb:
        assert sb.id.startswith("sb-")
        assert sb.info.isolation == Isolation.PROCESS and sb.info.image == "minimal"
        assert sb.info.limits.memory_bytes == 256 << 20 and sb.info.limits.cpu_millicores == 500
        assert sb.info.labels == {"suite": "pysdk"} and sb.info.expires_at is not None
        r = sb.exec(["sh", "-c", "echo $GREETING; echo oops >&2; exit 3"])
        assert r.status == ExecStatus.EXITED and r.exit_code == 3 and not r.ok
        assert (r.stdout, r.stdout_text, r.stderr_text) == (b"hi\n", "hi\n", "oops\n")
        assert r.exec_id and r.sandbox_id == sb.id and r.argv[0] == "sh"
        assert r.started_at is not None and r.duration_ms >= 0 and r.duration == r.duration_ms / 1000
        assert r.stdout_total_bytes == 3 and not r.stdout_truncated
        with pytest.raises(sandboxd.CommandFailed, match=r"EXITED \(exit code 3\): oops"):
            r.check()
        busy = sb.exec(["sh", "-c", "i=0; while [ $i -lt 20000 ]; do i=$((i+1)); done; echo done"])
        assert busy.check().stdout == b"done\n"
        assert busy.cpu_ms > 0 and busy.peak_memory_bytes > 0, busy
        sid = sb.id
    with pytest.raises(sandboxd.NotFound) as e:
        Sandbox.connect(sid, client=client)
    assert sid in e.value.message and str(e.value).startswith("NOT_FOUND: ")


def test_keep_connect_list_ttl_and_destroy(client: sandboxd.Client) -> None:
    label = uuid.uuid4().hex[:12]
    with Sandbox.create(image="minimal", isolation="process", labels={"run": label}, keep=True, client=client) as sb:
        sid = sb.id
    again = Sandbox.connect(sid, client=client)
    assert again.info.state == sandboxd.SandboxState.RUNNING and again.info.labels["run"] == label
    assert [s.id for s in Sandbox.list(labels={"run": label}, client=client)] == [sid]
    assert Sandbox.list(labels={"run": "nothing-" + label}, client=client) == []
    assert sid in [s.id for s in Sandbox.list(client=client)]
    assert again.set_ttl(3600).expires_at is not None
    assert again.set_ttl(0).expires_at is None
    assert again.refresh().id == sid
    again.destroy()
    assert Sandbox.list(labels={"run": label}, client=client) == []


def test_pause_and_resume(client: sandboxd.Client) -> None:
    with Sandbox.create(isolation="process", image="minimal", ttl=600, client=client) as sb:
        sb.exec(["sh", "-c", "echo before > /tmp/f"]).check()
        info = sb.pause()
        assert info.state == sandboxd.SandboxState.PAUSED and info.paused_at is not None
        assert sb.pause().state == sandboxd.SandboxState.PAUSED, "pausing again changes nothing"
        with pytest.raises(sandboxd.FailedPrecondition) as e:
            sb.exec(["true"])
        assert "paused" in e.value.message and "resume" in e.value.message
        info = sb.resume(ttl=1200)
        assert info.state == sandboxd.SandboxState.RUNNING and info.paused_at is None
        assert sb.exec(["cat", "/tmp/f"]).check().stdout_text == "before\n"
    with Sandbox.create(isolation="process", image="minimal", ttl=1, on_expiry="pause", client=client) as sb:
        assert sb.info.on_expiry == "pause"
        deadline = time.monotonic() + 60
        while sb.refresh().state != sandboxd.SandboxState.PAUSED:
            assert time.monotonic() < deadline, "the TTL never paused the sandbox"
            time.sleep(0.05)


def test_exec_options(sb: Sandbox) -> None:
    r = sb.exec(["sh", "-c", "pwd; echo $A; id -u; cat"], env={"A": "x"}, workdir="/tmp", user="65534", stdin="fed\n")
    assert r.check().stdout_text == "/tmp\nx\n65534\nfed\n"
    slow = sb.exec(["sleep", "30"], timeout=0.5)
    assert slow.status == ExecStatus.TIMED_OUT and slow.exit_code == 128 + 9, slow
    missing = sb.exec(["no-such-program"])
    assert missing.status == ExecStatus.SPAWN_FAILED and missing.exit_code == 127 and missing.error, missing


def test_truncated_output_is_kept_in_a_spill_file(sb: Sandbox) -> None:
    r = sb.exec(["sh", "-c", "i=0; while [ $i -lt 500 ]; do echo line$i; i=$((i+1)); done"], max_output=100)
    assert r.stdout_truncated and len(r.stdout) == 100 and r.stdout_total_bytes > 2000
    assert r.stdout_spill_path, r
    whole = sb.read_file(r.stdout_spill_path)
    # The kept 100 bytes are the head and the tail of the stream; the spill file has it all.
    assert len(whole) == r.stdout_total_bytes and whole.startswith(r.stdout[:40]) and whole.endswith(b"line499\n")
    assert b"line250\n" in whole and b"line250\n" not in r.stdout


def test_exec_stream_yields_output_as_it_comes(sb: Sandbox) -> None:
    script = "echo first; while [ ! -e /tmp/go ]; do sleep 0.02; done; echo second >&2; exit 4"
    with sb.exec_stream(["sh", "-c", script]) as stream:
        first = next(stream)
        # The command is still waiting for /tmp/go: this chunk came while it ran.
        assert (first.stream, first.data) == ("stdout", b"first\n")
        sb.write_file("/tmp/go", "")
        rest = list(stream)
        assert [(c.stream, c.text) for c in rest] == [("stderr", "second\n")]
        assert stream.result is not None and stream.result.exit_code == 4 and stream.result.stdout == b""
    whole = sb.exec_stream(["sh", "-c", "echo a; echo b >&2"]).wait()
    assert (whole.stdout, whole.stderr, whole.status) == (b"a\n", b"b\n", ExecStatus.EXITED)


def test_background_execs_wait_and_kill(sb: Sandbox) -> None:
    job = sb.exec_background(["sh", "-c", "cat; echo bye"], stdin="in\n")
    done = job.wait(timeout=60)
    assert done.check().stdout == b"in\nbye\n" and done.exec_id == job.id
    sleeper = sb.exec_background(["sleep", "1000"])
    assert sleeper.started.status == ExecStatus.RUNNING and sleeper.poll().running
    killed = sleeper.kill()
    assert killed.status == ExecStatus.SIGNALED and killed.signal == signal.SIGKILL, killed
    term = sb.exec_background(["sleep", "1000"])
    term.signal(signal.SIGTERM)
    assert term.wait().signal == signal.SIGTERM


def test_tty_session(sb: Sandbox) -> None:
    with sb.session(["sh"], tty=True, rows=30, cols=90) as s:
        assert s.exec_id
        s.write("stty size; echo $((6*7))\n")
        s.expect("30 90")
        s.expect("42")
        s.resize(40, 100)
        s.write("stty size\n")
        s.expect("40 100")
        s.write("exit 5\n")
        result = s.wait(timeout=60)
        assert result.status == ExecStatus.EXITED and result.exit_code == 5
        with pytest.raises(sandboxd.SessionClosed):
            s.write("more\n")
    assert sb.get_exec(result.exec_id).exit_code == 5


def test_pipe_session_stdin_close_and_signal(sb: Sandbox) -> None:
    with sb.session(["sh", "-c", "cat; echo err >&2"], tty=False) as s:
        s.write(b"abc\n")
        assert s.expect(b"abc\n") == b"abc\n"
        s.close_stdin()
        result = s.wait(timeout=60)
        assert result.check() and result.stderr == b"err\n"
    with sb.session(["sleep", "1000"], tty=False) as s:
        s.signal(signal.SIGTERM)
        result = s.wait(timeout=60)
        assert result.status == ExecStatus.SIGNALED and result.signal == signal.SIGTERM
    with sb.session(["sh", "-c", "read x; echo got $x"], tty=False) as s:
        s.write("1\n")
        assert s.read(timeout=60) == b"got 1\n"
        assert s.read(timeout=60) == b""
        assert s.result is not None and s.result.ok


def test_exec_records_paged_and_get_exec(sb: Sandbox) -> None:
    ids = [sb.exec(["echo", str(i)]).exec_id for i in range(5)]
    records = list(sb.execs(page_size=2))
    assert [r.exec_id for r in records] == ids
    assert all(r.stdout == b"" for r in records), "records come without output by default"
    with_output = list(sb.execs(page_size=2, include_output=True))
    assert [r.stdout for r in with_output] == [f"{i}\n".encode() for i in range(5)]
    assert [r.exec_id for r in sb.execs(limit=2)] == ids[-2:]
    assert sb.get_exec(ids[3]).stdout == b"3\n"
    with pytest.raises(sandboxd.NotFound, match="ex-nope|exec"):
        sb.get_exec("ex-nope")


def test_idempotency_keys_run_once(sb: Sandbox) -> None:
    key = uuid.uuid4().hex
    first = sb.exec(["sh", "-c", "echo x >> /tmp/count; wc -l < /tmp/count"], idempotency_key=key)
    again = sb.exec(["sh", "-c", "echo x >> /tmp/count; wc -l < /tmp/count"], idempotency_key=key)
    assert first.exec_id == again.exec_id and again.idempotency_key == key
    assert sb.read_file("/tmp/count") == b"x\n", "ran once"
    streamed = sb.exec_stream(["echo", "s"], idempotency_key=key + "-s").wait()
    replay = sb.exec_stream(["echo", "s"], idempotency_key=key + "-s").wait()
    assert streamed.exec_id == replay.exec_id and replay.stdout == b"s\n"


def test_errors_carry_the_daemons_message(client: sandboxd.Client, sb: Sandbox) -> None:
    with pytest.raises(sandboxd.InvalidArgument) as bad:
        Sandbox.create(isolation="process", image="minimal", memory="1K", client=client)
    assert "memory_bytes" in bad.value.message, bad.value
    with pytest.raises(sandboxd.InvalidArgument) as pids:
        Sandbox.create(isolation="process", image="minimal", pids=2, client=client)
    assert "max_pids" in pids.value.message
    with pytest.raises(sandboxd.NotFound) as image:
        Sandbox.create(isolation="process", image="no-such-image", client=client)
    assert "no-such-image" in image.value.message
    with pytest.raises(sandboxd.InvalidArgument, match="isolation 'hypervisor'"):
        Sandbox.create(isolation="hypervisor", client=client)
    with pytest.raises(sandboxd.InvalidArgument, match="not a size"):
        Sandbox.create(memory="lots", client=client)
    with pytest.raises(sandboxd.InvalidArgument, match="argv"):
        sb.exec([])
    with pytest.raises(sandboxd.InvalidArgument, match="no shell is implied"):
        sb.exec("echo hi")
    with pytest.raises(sandboxd.NotFound) as missing:
        sb.read_file("/no/such/file")
    assert "/no/such/file" in missing.value.message
    assert isinstance(missing.value, sandboxd.SandboxdError)
    with pytest.raises(sandboxd.NotFound):
        Sandbox.connect("sb-doesnotexist", client=client)


def test_snapshot_rollback_and_fork(sb: Sandbox, client: sandboxd.Client) -> None:
    sb.write_file("/workspace/state.txt", "v1")
    snap = sb.snapshot("first")
    assert snap.name == "first" and snap.sandbox_id == sb.id and snap.id == snap.snapshot_id
    assert [s.snapshot_id for s in sb.snapshots()] == [snap.snapshot_id]
    sb.write_file("/workspace/state.txt", "v2")
    sb.write_file("/workspace/later.txt", "new")
    sb.rollback(snap)
    assert sb.read_file("/workspace/state.txt") == b"v1"
    with pytest.raises(sandboxd.NotFound):
        sb.read_file("/workspace/later.txt")
    with Sandbox.fork(snap, labels={"fork": "yes"}, client=client) as child:
        assert child.info.parent_snapshot_id == snap.snapshot_id and child.id != sb.id
        assert child.exec(["cat", "/workspace/state.txt"]).stdout == b"v1"
        child.write_file("/workspace/state.txt", "child")
        assert sb.read_file("/workspace/state.txt") == b"v1", "the parent is untouched"
        with pytest.raises(sandboxd.FailedPrecondition):
            sb.delete_snapshot(snap)
    sb.delete_snapshot(snap.snapshot_id)
    assert sb.snapshots() == []
    with pytest.raises(sandboxd.NotFound):
        sb.rollback(snap)


def test_network_modes_forks_and_the_network_log(client: sandboxd.Client) -> None:
    # The daemon's DNS answers only what the policy allows: a query for an unlisted name is
    # refused and logged (no upstream is needed for that).
    with Sandbox.create(allow=["pypi.test:443"], client=client) as sb:
        assert (sb.info.network, list(sb.info.allow)) == ("allowlist", ["pypi.test:443"])
        r = sb.exec(["nslookup", "evil.test"])
        assert r.exit_code != 0, r.stdout
        events = sb.network_log()
        denied = [e for e in events if e.kind == "dns" and e.name == "evil.test"]
        assert denied and not denied[0].allowed and denied[0].detail, events
        assert isinstance(denied[0], sandboxd.NetworkEvent) and denied[0].time is not None
        assert len(sb.network_log(limit=1)) == 1
        snap = sb.snapshot()
        with Sandbox.fork(snap, client=client) as child:
            assert (child.info.network, list(child.info.allow)) == ("allowlist", ["pypi.test:443"]), "a fork inherits"
        with Sandbox.fork(snap, network="none", client=client) as closed:
            assert closed.info.network == "none" and closed.network_log() == []
    with Sandbox.create(network="open", client=client) as sb:
        assert sb.info.network == "open" and list(sb.info.allow) == []
    with Sandbox.create(client=client) as sb:
        assert sb.info.network == "none"
    with pytest.raises(sandboxd.InvalidArgument, match="network"):
        Sandbox.create(network="everything", client=client)
    with pytest.raises(sandboxd.InvalidArgument, match="network.allow"):
        Sandbox.create(allow=["no-port.test"], client=client)


def test_deadlines_and_capacity_errors() -> None:
    from conftest import Daemon

    daemon = Daemon("[policy]\nmax_sandboxes = 1\n[admission]\nmax_snapshots_per_sandbox = 1\n")
    try:
        with sandboxd.Client(daemon.address, timeout=30) as c:
            with Sandbox.create(isolation="process", image="minimal", client=c) as sb:
                with pytest.raises(sandboxd.ResourceExhausted) as full:
                    Sandbox.create(isolation="process", image="minimal", client=c)
                assert "policy.max_sandboxes (1)" in full.value.message
                sb.snapshot("one")
                with pytest.raises(sandboxd.ResourceExhausted) as snaps:
                    sb.snapshot("two")
                assert "max_snapshots_per_sandbox" in snaps.value.message
                job = sb.exec_background(["sleep", "1000"])
                with pytest.raises(sandboxd.DeadlineExceeded):
                    job.wait(timeout=0.5)
                assert job.kill().status == ExecStatus.SIGNALED
    finally:
        daemon.cleanup()


@pytest.mark.parametrize("tier", ["container", "microvm"])
def test_every_tier_through_the_same_calls(client: sandboxd.Client, tier: str) -> None:
    with Sandbox.create(isolation=tier, image="minimal", memory="256M", client=client) as sb:
        assert sb.info.isolation == Isolation[tier.upper()]
        assert sb.exec(["sh", "-c", "echo $((2+3))"]).check().stdout == b"5\n"
        sb.write_file("/workspace/f", "data")
        snap = sb.snapshot()
        sb.write_file("/workspace/f", "changed")
        sb.rollback(snap)
        assert sb.read_file("/workspace/f") == b"data"
        with sb.session(["sh"], tty=True) as s:
            s.write("echo tier-$((1+1))\n")
            s.expect("tier-2")
            s.write("exit\n")
            assert s.wait(timeout=120).ok
