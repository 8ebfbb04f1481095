"""Drives `sbx mcp` over stdio with the official MCP Python client (`mcp` from PyPI), against a
real sandboxd, the way an agent host would.

Usage: mcp_client.py SBX DAEMON_ADDRESS HOST_DIR

Checks every tool a model would use, then prints one JSON line (last line of stdout) with the
sandboxes the session created, so the caller can check with the daemon that those without keep
are gone once the client has disconnected. Any failed check exits non-zero with the reason.
"""

import asyncio
import json
import os
import re
import sys

from mcp import Client, StdioServerParameters


def text_of(result):
    return "".join(getattr(block, "text", "") for block in result.content)


def check(cond, what, result=None):
    if not cond:
        detail = f": {text_of(result)!r} (is_error={result.is_error})" if result is not None else ""
        raise AssertionError(f"{what}{detail}")


async def call(client, name, args=None, *, error=False):
    result = await client.call_tool(name, args or {})
    check(bool(result.is_error) == error, f"{name}({args}) is_error should be {error}", result)
    return result, text_of(result)


def sandbox_id(text):
    found = re.search(r"\bsb-[0-9A-Za-z_-]+", text)
    check(found is not None, f"no sandbox id in {text!r}")
    return found.group(0)


async def main():
    sbx, address, host_dir = sys.argv[1], sys.argv[2], sys.argv[3]
    params = StdioServerParameters(
        command=sbx,
        args=["--socket", address, "mcp", "--allow-host-dir", host_dir],
        env={"SBX_LOG": "info", "PATH": os.environ.get("PATH", "/usr/bin:/bin")},
    )
    created = {}
    async with Client(params, read_timeout_seconds=120) as client:
        tools = await client.list_tools()
        names = {t.name for t in tools.tools}
        expected = {"create_sandbox", "run_command", "read_file", "write_file", "list_dir", "snapshot",
                    "rollback", "fork", "list_execs", "list_sandboxes", "destroy_sandbox", "upload", "download"}
        check(expected <= names, f"tools missing: {expected - names}")
        for t in tools.tools:
            check(bool(t.description) and len(t.description) < 700, f"tool {t.name} has no short description")

        # The default sandbox is made on first use.
        _, text = await call(client, "run_command", {"command": "echo hello; echo oops >&2; exit 3"})
        check(text.startswith("exit_code=3 status=exited"), f"a failing command must say its exit code first: {text!r}")
        check("hello" in text and "oops" in text, f"stdout and stderr should be shown: {text!r}")
        default_id = sandbox_id(text)
        created[default_id] = False

        # A malformed call is a tool error naming the problem, and the next call works.
        _, text = await call(client, "read_file", {"offset": 0}, error=True)
        check("missing field `path`" in text, f"the error should name the missing argument: {text!r}")
        _, text = await call(client, "read_file", {"path": "x", "offset": "not a number"}, error=True)
        check("invalid type" in text, f"the error should say what is wrong: {text!r}")
        _, text = await call(client, "run_command", {"command": "true", "bogus": 1}, error=True)
        check("unknown field `bogus`" in text, f"an unknown argument is named: {text!r}")
        _, text = await call(client, "run_command", {}, error=True)
        check("command" in text, f"a call without a command says so: {text!r}")
        _, text = await call(client, "run_command", {"argv": ["true"]})
        check(text.startswith("exit_code=0 status=exited"), text)
        # A daemon error is a tool error with the daemon's message.
        _, text = await call(client, "run_command", {"sandbox_id": "sb-doesnotexist", "command": "true"}, error=True)
        check("NOT_FOUND" in text, f"the daemon's code and message should reach the model: {text!r}")

        # Create (not the default), exec, files.
        _, text = await call(client, "create_sandbox", {"isolation": "process", "make_default": False})
        sb = sandbox_id(text)
        created[sb] = False
        check(sb != default_id, "create_sandbox made a new sandbox")
        _, text = await call(client, "write_file", {"sandbox_id": sb, "path": "/workspace/notes/a.txt", "content": "first version\n"})
        check("14 bytes" in text, text)
        _, text = await call(client, "read_file", {"sandbox_id": sb, "path": "/workspace/notes/a.txt"})
        check(text.endswith("first version\n") and "end of file" in text, text)
        _, text = await call(client, "read_file", {"sandbox_id": sb, "path": "/workspace/notes/a.txt", "offset": 6, "limit": 3})
        check("bytes 6-9 of 14" in text and text.endswith("ver") and "offset=9" in text, f"paged read: {text!r}")
        _, text = await call(client, "list_dir", {"sandbox_id": sb, "path": "/workspace/notes"})
        check("a.txt" in text, text)
        _, text = await call(client, "read_file", {"sandbox_id": sb, "path": "/workspace/nope"}, error=True)
        check("NOT_FOUND" in text, text)

        # Bounded output names the file holding all of it.
        _, text = await call(client, "run_command", {"sandbox_id": sb, "command": "yes abcdefgh | head -c 100000"})
        m = re.search(r"first (\d+) of 100000 bytes; the whole stdout is in the sandbox at (\S+) ", text)
        check(m is not None and int(m.group(1)) < 100000, f"long output should be cut with its path: {text[:400]!r}")
        spill = m.group(2)
        _, text = await call(client, "run_command", {"sandbox_id": sb, "argv": ["wc", "-c", spill]})
        check("100000" in text, f"the named file should hold the whole output: {text!r}")

        # Snapshot, change, rollback: the file is back.
        _, text = await call(client, "snapshot", {"sandbox_id": sb, "name": "before"})
        snap = re.search(r"Snapshot (\S+) of sandbox", text)
        check(snap is not None, text)
        snap = snap.group(1)
        await call(client, "write_file", {"sandbox_id": sb, "path": "/workspace/notes/a.txt", "content": "second\n"})
        await call(client, "run_command", {"sandbox_id": sb, "command": "rm -rf /workspace/notes"})
        _, text = await call(client, "rollback", {"sandbox_id": sb, "snapshot_id": snap})
        _, text = await call(client, "read_file", {"sandbox_id": sb, "path": "/workspace/notes/a.txt"})
        check(text.endswith("first version\n"), f"rollback should bring the file back: {text!r}")

        # Fork: a new sandbox with the snapshot's files; kept after the session.
        _, text = await call(client, "fork", {"snapshot_id": snap, "keep": True})
        fork = sandbox_id(text.split("new sandbox", 1)[1])
        created[fork] = True
        _, text = await call(client, "run_command", {"sandbox_id": fork, "command": "cat /workspace/notes/a.txt"})
        check(text.startswith("exit_code=0") and "first version" in text, text)

        # Host files: upload and download inside the allowed directory only.
        with open(os.path.join(host_dir, "in.txt"), "w") as f:
            f.write("from the host\n")
        _, text = await call(client, "upload", {"sandbox_id": sb, "host_path": "in.txt", "sandbox_path": "/workspace/in.txt"})
        _, text = await call(client, "run_command", {"sandbox_id": sb, "command": "cat in.txt; echo back > out.txt"})
        check("from the host" in text, text)
        _, text = await call(client, "download", {"sandbox_id": sb, "sandbox_path": "/workspace/out.txt", "host_path": "out.txt"})
        with open(os.path.join(host_dir, "out.txt")) as f:
            check(f.read() == "back\n", "downloaded file content")
        _, text = await call(client, "upload", {"sandbox_id": sb, "host_path": "../../etc/passwd", "sandbox_path": "/workspace/x"}, error=True)
        check("outside the allowed directory" in text, text)
        os.symlink("/etc", os.path.join(host_dir, "etc-link"))
        _, text = await call(client, "upload", {"sandbox_id": sb, "host_path": "etc-link/passwd", "sandbox_path": "/workspace/x"}, error=True)
        check("outside the allowed directory" in text, text)
        _, text = await call(client, "download", {"sandbox_id": sb, "sandbox_path": "/workspace/out.txt", "host_path": "etc-link/planted"}, error=True)

        # Execs are listed; destroy works and the sandbox is gone.
        _, text = await call(client, "list_execs", {"sandbox_id": sb})
        check("yes abcdefgh" in text and "exit_code=0" in text, text)
        _, text = await call(client, "list_sandboxes")
        check(sb in text and fork in text and default_id in text and "DEFAULT" in text, text)
        extra_text = (await call(client, "create_sandbox", {"make_default": False}))[1]
        extra = sandbox_id(extra_text)
        _, text = await call(client, "destroy_sandbox", {"sandbox_id": extra})
        _, text = await call(client, "run_command", {"sandbox_id": extra, "command": "true"}, error=True)
        check("NOT_FOUND" in text, text)

        # A network: only the listed destinations; the daemon's DNS refuses any other name.
        _, text = await call(client, "create_sandbox", {"allow": ["pypi.test:443"], "make_default": False})
        check("network ALLOWLIST pypi.test:443" in text, text)
        net = sandbox_id(text)
        _, text = await call(client, "run_command", {"sandbox_id": net, "command": "nslookup evil.test"})
        check(not text.startswith("exit_code=0"), f"an unlisted name resolved: {text!r}")
        _, text = await call(client, "destroy_sandbox", {"sandbox_id": net})

        # Limits beyond the daemon's policy are the daemon's refusal, as a tool error.
        _, text = await call(client, "create_sandbox", {"memory_mb": 100_000_000}, error=True)
        check("INVALID_ARGUMENT" in text or "RESOURCE_EXHAUSTED" in text, text)

    # The client has closed stdin and waited for the server to exit.
    print(json.dumps({"created": created, "snapshot": snap}))


asyncio.run(main())
