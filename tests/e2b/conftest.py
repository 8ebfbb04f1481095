"""Fixtures: the real sandboxd (target/debug/sandboxd) with its E2B-compatible listener on a
free loopback port, a UNIX socket and state dir in a temp dir of its own, two tenants
("alice", "bob") whose tokens are the E2B API keys, and the images of `$SANDBOXD_IMAGES_DIR`.

The SDK is pointed at it the way a user would: E2B_API_URL, E2B_SANDBOX_URL and E2B_API_KEY.
Nothing here skips: a machine that cannot run the daemon (not root, no images, no binary, a
tier it cannot serve) fails the tests that need it, saying why.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Iterator

import pytest

ROOT = Path(__file__).resolve().parents[2]
POOL_BYTES = 256 << 30
ALICE_KEY = "e2b-test-key-alice"
BOB_KEY = "e2b-test-key-bob"
# The tiers the suite runs its core on; CI runs all three.
TIERS = [t for t in os.environ.get("SANDBOXD_E2B_TIERS", "process,container,microvm").split(",") if t]


def sandboxd_bin() -> Path:
    return Path(os.environ.get("SANDBOXD_BIN", ROOT / "target/debug/sandboxd"))


def images_dir() -> Path:
    return Path(os.environ.get("SANDBOXD_IMAGES_DIR", ROOT / "images/build"))


def owner_label(state_dir: Path) -> str:
    """The daemon's `sandboxd.owner` label of its containers (FNV-1a of the state dir)."""
    h = 0xCBF29CE484222325
    for b in os.fsencode(str(state_dir)):
        h ^= b
        h = (h * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return f"{h:016x}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Daemon:
    """A running sandboxd serving the E2B API on `url`."""

    def __init__(self, extra_config: str = "") -> None:
        if os.geteuid() != 0:
            pytest.fail("the E2B tests start sandboxd, which needs root (namespaces, cgroups, mounts)")
        if not sandboxd_bin().is_file():
            pytest.fail(f"sandboxd not found at {sandboxd_bin()}: run `cargo build -p sandboxd` or set SANDBOXD_BIN")
        if not (images_dir() / "debian/image.json").is_file():
            pytest.fail(f"image 'debian' is not built under {images_dir()}: run `make image-debian` or set SANDBOXD_IMAGES_DIR")
        self.dir = Path(tempfile.mkdtemp(prefix="sandboxd-e2b-"))
        self.state_dir = self.dir / "state"
        self.url = f"http://127.0.0.1:{free_port()}"
        config = self.dir / "sandboxd.toml"
        config.write_text(
            "[[auth.tokens]]\n"
            f'tenant = "alice"\nsha256 = "{hashlib.sha256(ALICE_KEY.encode()).hexdigest()}"\n'
            "[[auth.tokens]]\n"
            f'tenant = "bob"\nsha256 = "{hashlib.sha256(BOB_KEY.encode()).hexdigest()}"\n'
            "[e2b]\nisolation_metadata = true\n" + extra_config
        )
        cmd = [
            str(sandboxd_bin()), "--listen", f"unix://{self.dir / 'sandboxd.sock'}",
            "--state-dir", str(self.state_dir), "--images-dir", str(images_dir()),
            "--pool-size-bytes", str(POOL_BYTES), "--config", str(config),
            "--e2b", self.url.removeprefix("http://"),
        ]
        log = open(self.dir / "sandboxd.log", "ab")
        env = dict(os.environ, RUST_LOG=os.environ.get("SANDBOXD_TEST_LOG", "info"))
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log, env=env)
        log.close()
        # Wait for the event "the E2B listener answers", bounded; a daemon that exits fails now.
        deadline = time.monotonic() + 60
        while True:
            if self.proc.poll() is not None:
                pytest.fail(f"sandboxd exited during startup ({self.proc.returncode}); log:\n{self.log()}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as r:
                    if r.status == 204:
                        return
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"sandboxd's E2B listener not answering after 60 s; log:\n{self.log()}")
            time.sleep(0.05)

    def log(self) -> str:
        try:
            return (self.dir / "sandboxd.log").read_text(errors="replace")
        except OSError:
            return ""

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        # A stopped daemon keeps its containers for re-adoption: remove them.
        if shutil.which("docker"):
            ids = subprocess.run(
                ["docker", "ps", "-aq", "--filter", f"label=sandboxd.owner={owner_label(self.state_dir)}"],
                capture_output=True, text=True, check=False,
            ).stdout.split()
            if ids:
                subprocess.run(["docker", "rm", "-f", *ids], capture_output=True, check=False)
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture(scope="session")
def daemon() -> Iterator[Daemon]:
    d = Daemon()
    # Only the three variables a user of E2B's hosted service would change.
    saved = {k: os.environ.get(k) for k in ("E2B_API_URL", "E2B_SANDBOX_URL", "E2B_API_KEY")}
    os.environ.update(E2B_API_URL=d.url, E2B_SANDBOX_URL=d.url, E2B_API_KEY=ALICE_KEY)
    yield d
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    d.stop()


@pytest.fixture(autouse=True)
def _log_on_failure(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    rep = getattr(request.node, "rep_call", None)
    d = request.node.funcargs.get("daemon") if hasattr(request.node, "funcargs") else None
    if rep is not None and rep.failed and d is not None:
        print(f"--- sandboxd log (tail) ---\n{d.log()[-6000:]}")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    rep = yield
    setattr(item, "rep_" + rep.when, rep)
    return rep
