"""The README's examples, run as a newcomer would paste them, against the test daemon."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import Daemon

README = Path(__file__).resolve().parents[1] / "README.md"


def examples() -> list[str]:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    # The connection snippet names a host of its own: only the runnable examples.
    return [b for b in blocks if "sandbox-host" not in b]


def run_example(daemon: Daemon, code: str, tmp_path: Path) -> str:
    """Runs `code` as a newcomer would paste it, against the test daemon; its stdout."""
    env = {"SANDBOXD_SOCKET": daemon.address, "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return out.stdout


def assert_first_example_output(stdout: str) -> None:
    assert stdout.startswith("EXITED 0 hello from Linux\n[stdout] 1\n") and stdout.endswith("3\n"), stdout


@pytest.mark.parametrize("index", range(2))
def test_readme_example_runs(daemon: Daemon, index: int, tmp_path: Path) -> None:
    stdout = run_example(daemon, examples()[index], tmp_path)
    if index == 0:
        assert_first_example_output(stdout)
    else:
        assert "['0', '1', '2']" in stdout and "[stderr] err\n" in stdout, stdout



TOP_README = Path(__file__).resolve().parents[3] / "README.md"


def top_examples() -> list[str]:
    """The repository README's SDK examples (its E2B and grpcio blocks are not the SDK's)."""
    blocks = re.findall(r"```python\n(.*?)```", TOP_README.read_text(), flags=re.S)
    return [b for b in blocks if "from sandboxd" in b]


def test_the_top_readme_shows_both_sdk_examples() -> None:
    assert len(top_examples()) == 2, top_examples()


@pytest.mark.parametrize("index", range(2))
def test_top_readme_example_runs(daemon: Daemon, index: int, tmp_path: Path) -> None:
    stdout = run_example(daemon, top_examples()[index], tmp_path)
    if index == 0:
        assert_first_example_output(stdout)
    else:
        assert stdout.strip() == "['0', '1', '2']", stdout
