"""Connections as `sbx` makes them: addresses, the environment, TLS with a CA, bearer tokens,
and retries of UNAVAILABLE only where the daemon's idempotency makes them safe."""

from __future__ import annotations

import hashlib
import logging
import subprocess
import threading
from pathlib import Path
from typing import Iterator

import pytest

import sandboxd
import sandboxd.client
from sandboxd import Sandbox
from sandboxd._conn import parse_address

from conftest import Daemon, free_port


def test_address_forms(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert parse_address("unix:///run/x.sock").grpc_target == "unix:///run/x.sock"
    assert parse_address("/run/x.sock").grpc_target == "unix:///run/x.sock"
    assert parse_address("unix:rel.sock").grpc_target == f"unix://{tmp_path}/rel.sock"
    assert parse_address("./.sandboxd/sandboxd.sock").display == f"unix://{tmp_path}/.sandboxd/sandboxd.sock"
    tcp = parse_address("tcp://127.0.0.1:7070")
    assert (tcp.grpc_target, tcp.tls) == ("127.0.0.1:7070", False)
    assert parse_address("tcp://h:1", tls=True).tls and parse_address("https://h:1").tls
    for bad in ["", "unix://", "localhost:50051", "tcp://", "http://h:1/x", "sock"]:
        with pytest.raises(sandboxd.InvalidArgument, match="invalid sandboxd address"):
            parse_address(bad)
    with pytest.raises(sandboxd.InvalidArgument, match="bearer token"):
        sandboxd.Client("unix:///nowhere.sock", token="bad token")


def test_no_daemon_is_unavailable_naming_the_address(tmp_path: Path) -> None:
    sock = tmp_path / "missing.sock"
    with pytest.raises(sandboxd.Unavailable, match="missing.sock"):
        sandboxd.Client(f"unix://{sock}", connect_timeout=0.5)


def test_the_environment_picks_the_daemon(daemon: Daemon, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SANDBOXD_SOCKET", daemon.address)
    monkeypatch.delenv("SANDBOXD_TOKEN", raising=False)
    monkeypatch.setattr(sandboxd.client, "_default", None)
    try:
        with Sandbox.create(isolation="process", image="minimal") as sb:
            assert sb.client.address == daemon.address
            assert sb.exec(["echo", "env"]).stdout == b"env\n"
    finally:
        default = sandboxd.client._default
        if default is not None:
            default.close()


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


@pytest.fixture(scope="module")
def tls_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str, Path]]:
    """A daemon serving TCP over TLS with a certificate of a CA made here, and one token."""
    d = tmp_path_factory.mktemp("pki")
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=pysdk-ca",
             "-keyout", "ca.key", "-out", "ca.crt", cwd=d)
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=sandbox-host", "-keyout", "tls.key", "-out", "tls.csr", cwd=d)
    (d / "san.ext").write_text("subjectAltName=DNS:sandbox-host,IP:127.0.0.1\n")
    _openssl("x509", "-req", "-in", "tls.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial", "-days", "2",
             "-extfile", "san.ext", "-out", "tls.crt", cwd=d)
    token = "pysdk-" + hashlib.sha256(str(d).encode()).hexdigest()[:24]
    config = (
        f'[tls]\ncert = "{d / "tls.crt"}"\nkey = "{d / "tls.key"}"\n'
        f'[[auth.tokens]]\ntenant = "pysdk"\nsha256 = "{hashlib.sha256(token.encode()).hexdigest()}"\n'
    )
    port = free_port()
    daemon = Daemon(config, ["--listen", f"tcp://127.0.0.1:{port}"])
    yield f"tcp://127.0.0.1:{port}", token, d
    daemon.cleanup()


def test_tls_with_a_ca_and_a_token(tls_daemon: tuple[str, str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    address, good, pki = tls_daemon
    with sandboxd.Client(address, ca_cert=pki / "ca.crt", token=good) as c:
        with Sandbox.create(isolation="process", image="minimal", client=c) as sb:
            assert sb.exec(["echo", "over tls"]).stdout == b"over tls\n"
            assert [s.id for s in Sandbox.list(client=c)] == [sb.id]
    # The same from the environment, the CA as bytes, the server name checked against the SAN.
    monkeypatch.setenv("SANDBOXD_TOKEN", good)
    with sandboxd.Client(address.replace("tcp://", "https://"), ca_cert=(pki / "ca.crt").read_bytes(), server_name="sandbox-host") as c:
        assert Sandbox.list(client=c) == []
    monkeypatch.delenv("SANDBOXD_TOKEN")
    with sandboxd.Client(address, ca_cert=pki / "ca.crt", token="wrong-token") as c:
        with pytest.raises(sandboxd.Unauthenticated):
            Sandbox.list(client=c)
    with sandboxd.Client(address, ca_cert=pki / "ca.crt") as c:
        with pytest.raises(sandboxd.Unauthenticated):
            Sandbox.create(client=c)
    # Without the CA the daemon's certificate is not trusted: no connection.
    with pytest.raises(sandboxd.Unavailable):
        sandboxd.Client(address.replace("tcp://", "https://"), token=good, connect_timeout=2)
    with pytest.raises(sandboxd.InvalidArgument, match="CA certificate"):
        sandboxd.Client(address, ca_cert=pki / "missing.crt")


class _RetryLog(logging.Handler):
    """Sets `retried` when the client logs its first retry: the event the test waits for."""

    def __init__(self) -> None:
        super().__init__()
        self.retried = threading.Event()
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        if "retry" in record.getMessage():
            self.count += 1
            self.retried.set()


def test_unavailable_is_retried_only_where_safe() -> None:
    daemon = Daemon()
    handler = _RetryLog()
    logger = logging.getLogger("sandboxd")
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.INFO)
    try:
        with sandboxd.Client(daemon.address, retries=60) as c:
            assert Sandbox.list(client=c) == []
            daemon.kill9()
            # Not idempotent: a create is never repeated, whatever `retries` says.
            with pytest.raises(sandboxd.Unavailable):
                Sandbox.create(isolation="process", image="minimal", client=c)
            assert handler.count == 0
            # A listing is: it waits through the outage and answers once the daemon is back.
            result: list[object] = []
            worker = threading.Thread(target=lambda: result.append(Sandbox.list(client=c)))
            worker.start()
            assert handler.retried.wait(60), "the listing was not retried"
            daemon.start()
            worker.join(120)
            assert result == [[]], result
        with sandboxd.Client(daemon.address, retries=0) as c:
            daemon.kill9()
            before = handler.count
            with pytest.raises(sandboxd.Unavailable):
                Sandbox.list(client=c)
            assert handler.count == before, "retries=0 never retries"
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        daemon.cleanup()
