"""`make bench`'s E2B section: `Sandbox.create()` + `commands.run("true")` + kill through the
unmodified E2B SDK against sandboxd's E2B listener, next to the same through sandboxd's own
Python SDK over gRPC (clients/python), on one daemon, per tier. Writes the section into
BENCHMARKS.md (`--out`), replacing the previous one.

Both clients are Python, so the difference is the protocol and the front door, not the language.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import sandboxd
from e2b import Sandbox

sys.path.insert(0, str(Path(__file__).resolve().parent))
from conftest import ALICE_KEY, Daemon  # noqa: E402

IMAGE = "debian"
SECTION = "## E2B SDK against gRPC"


def measure(fn: Callable[[], None], n: int) -> list[float]:
    fn()  # warm-up: first use of the image on this tier, connection set-up
    out = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t) * 1000)
    return out


def e2b_round(tier: str) -> Callable[[], None]:
    def run() -> None:
        s = Sandbox.create(IMAGE, metadata={"isolation": tier})
        s.commands.run("true")
        s.kill()
    return run


def grpc_round(client: sandboxd.Client, tier: str) -> Callable[[], None]:
    def run() -> None:
        sb = sandboxd.Sandbox.create(isolation=tier, image=IMAGE, client=client)
        r = sb.exec(["/bin/bash", "-l", "-c", "true"])
        assert r.exit_code == 0
        sb.destroy()
    return run


def replace_section(path: Path, text: str) -> None:
    doc = path.read_text() if path.exists() else "# Benchmarks\n"
    if SECTION in doc:
        head, rest = doc.split(SECTION, 1)
        tail = rest.split("\n## ", 1)
        doc = head + text + ("\n## " + tail[1] if len(tail) > 1 else "")
    else:
        doc = doc.rstrip("\n") + "\n\n" + text
    path.write_text(doc)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path)
    ap.add_argument("-n", type=int, default=20)
    ap.add_argument("--tiers", default=os.environ.get("SANDBOXD_E2B_TIERS", "process,container,microvm"))
    args = ap.parse_args()
    d = Daemon()
    os.environ.update(E2B_API_URL=d.url, E2B_SANDBOX_URL=d.url, E2B_API_KEY=ALICE_KEY)
    rows = []
    try:
        client = sandboxd.Client(f"unix://{d.dir / 'sandboxd.sock'}")
        for tier in [t for t in args.tiers.split(",") if t]:
            for name, fn in (("E2B SDK (HTTP, envd)", e2b_round(tier)), ("sandboxd SDK (gRPC)", grpc_round(client, tier))):
                ms = sorted(measure(fn, args.n))
                p50, p95 = statistics.median(ms), ms[min(len(ms) - 1, int(len(ms) * 0.95))]
                rows.append(f"| {tier} | {name} | {p50:.1f} | {p95:.1f} |")
                print(rows[-1], flush=True)
    finally:
        d.stop()
    text = (
        f"{SECTION}\n\n"
        f"`Sandbox.create(\"{IMAGE}\")` + `commands.run(\"true\")` + `kill()` through the unmodified `e2b` SDK\n"
        "against the daemon's E2B listener, next to `Sandbox.create` + `exec([\"/bin/bash\", \"-l\", \"-c\", \"true\"])`\n"
        "+ `destroy()` through sandboxd's Python SDK on the UNIX socket; the same daemon, "
        f"{args.n} rounds after one warm-up, milliseconds per round (tests/e2b/bench_e2b.py).\n\n"
        "| tier | client | p50 ms | p95 ms |\n|---|---|---|---|\n" + "\n".join(rows) + "\n"
    )
    print(text)
    if args.out:
        replace_section(args.out, text)


if __name__ == "__main__":
    main()
