"""Fixtures: the real sandboxd (target/debug/sandboxd, built by `cargo build -p sandboxd`) on a
UNIX socket in a temp dir of its own, with the images of `$SANDBOXD_IMAGES_DIR`.

Nothing here skips: a machine that cannot run the daemon (not root, no images, no binary)
fails every test that needs it, saying why.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, AsyncIterator, Iterator, Optional

import pytest

import sandboxd

if TYPE_CHECKING:
    import sandboxd.aio

ROOT = Path(__file__).resolve().parents[3]
POOL_BYTES = 256 << 30


def sandboxd_bin() -> Path:
    return Path(os.environ.get("SANDBOXD_BIN", ROOT / "target/debug/sandboxd"))


def images_dir() -> Path:
    return Path(os.environ.get("SANDBOXD_IMAGES_DIR", ROOT / "images/build"))


def require_environment() -> None:
    if os.geteuid() != 0:
        pytest.fail("the SDK tests start sandboxd, which needs root (namespaces, cgroups, mounts)")
    if not sandboxd_bin().is_file():
        pytest.fail(f"sandboxd not found at {sandboxd_bin()}: run `cargo build -p sandboxd` or set SANDBOXD_BIN")
    if not (images_dir() / "minimal/image.json").is_file():
        pytest.fail(f"image 'minimal' is not built under {images_dir()}: run `make images` or set SANDBOXD_IMAGES_DIR")


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
    """A running sandboxd with its own state dir, socket and log."""

    def __init__(self, config: str = "", extra_args: Optional[list[str]] = None) -> None:
        require_environment()
        self.dir = Path(tempfile.mkdtemp(prefix="sandboxd-pysdk-"))
        self.socket = self.dir / "sandboxd.sock"
        self.address = f"unix://{self.socket}"
        self.state_dir = self.dir / "state"
        self.config = None
        if config:
            self.config = self.dir / "sandboxd.toml"
            self.config.write_text(config)
        self.extra_args = extra_args or []
        self.proc: Optional[subprocess.Popen[bytes]] = None
        self.start()

    def log(self) -> str:
        try:
            return (self.dir / "sandboxd.log").read_text(errors="replace")
        except OSError:
            return ""

    def start(self) -> None:
        cmd = [
            str(sandboxd_bin()), "--listen", self.address, "--state-dir", str(self.state_dir),
            "--images-dir", str(images_dir()), "--pool-size-bytes", str(POOL_BYTES),
        ]
        if self.config:
            cmd += ["--config", str(self.config)]
        cmd += self.extra_args
        if self.socket.exists():
            self.socket.unlink()
        log = open(self.dir / "sandboxd.log", "ab")
        env = dict(os.environ, RUST_LOG=os.environ.get("SANDBOXD_TEST_LOG", "info"))
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log, env=env)
        log.close()
        # Wait for the event "the daemon answers a call", bounded; a daemon that exits fails now.
        deadline = time.monotonic() + 60
        while True:
            if self.proc.poll() is not None:
                pytest.fail(f"sandboxd exited during startup ({self.proc.returncode}); log:\n{self.log()}")
            if self.socket.exists():
                try:
                    with sandboxd.Client(self.address, connect_timeout=2, retries=0) as c:
                        sandboxd.Sandbox.list(client=c)
                        return
                except sandboxd.SandboxdError:
                    pass
            if time.monotonic() > deadline:
                pytest.fail(f"sandboxd not answering after 60 s; log:\n{self.log()}")
            time.sleep(0.05)

    def kill9(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def stop(self) -> None:
        if self.proc is None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    def cleanup(self) -> None:
        self.stop()
        # A stopped daemon keeps its containers for re-adoption: remove them.
        if shutil.which("docker"):
            ids = subprocess.run(
                ["docker", "ps", "-aq", "--filter", f"label=sandboxd.owner={owner_label(self.state_dir)}"],
                capture_output=True, text=True, check=False,
            ).stdout.split()
            if ids:
                subprocess.run(["docker", "rm", "-f", *ids], capture_output=True, check=False)
        # Never let rmtree recurse into a mount a killed daemon left: deepest first.
        mounts = []
        with open("/proc/self/mountinfo") as f:
            for line in f:
                point = line.split(" ")[4]
                if point.startswith(str(self.state_dir)):
                    mounts.append(point)
        for point in sorted(mounts, key=lambda p: p.count("/"), reverse=True):
            subprocess.run(["umount", "-l", point], capture_output=True, check=False)
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture(scope="session")
def daemon() -> Iterator[Daemon]:
    d = Daemon()
    yield d
    d.cleanup()


@pytest.fixture(scope="session")
def client(daemon: Daemon) -> Iterator[sandboxd.Client]:
    with sandboxd.Client(daemon.address) as c:
        yield c


@pytest.fixture
def sb(client: sandboxd.Client) -> Iterator[sandboxd.Sandbox]:
    """A process-tier sandbox of the `minimal` image, destroyed after the test."""
    with sandboxd.Sandbox.create(isolation="process", image="minimal", client=client) as s:
        yield s


@pytest.fixture
async def aclient(daemon: Daemon) -> AsyncIterator["sandboxd.aio.Client"]:
    import sandboxd.aio

    c = await sandboxd.aio.Client.connect(daemon.address)
    try:
        yield c
    finally:
        await c.close()


@pytest.fixture
async def asb(aclient: "sandboxd.aio.Client") -> AsyncIterator["sandboxd.aio.Sandbox"]:
    import sandboxd.aio

    async with sandboxd.aio.Sandbox.create(isolation="process", image="minimal", client=aclient) as s:
        yield s
