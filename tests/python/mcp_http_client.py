"""Talks to `sbx mcp --http` with the official MCP Python client over streamable HTTP.

Usage: mcp_http_client.py URL

Lists the tools, runs a command in the default sandbox and prints that sandbox's id as the
last line; the caller then stops the server and checks the sandbox is gone.
"""

import asyncio
import re
import sys

from mcp import Client


async def main():
    async with Client(sys.argv[1], read_timeout_seconds=120) as client:
        tools = await client.list_tools()
        names = {t.name for t in tools.tools}
        assert "run_command" in names and "upload" not in names, f"tools over HTTP: {names}"
        result = await client.call_tool("run_command", {"command": "echo over-http"})
        text = "".join(getattr(b, "text", "") for b in result.content)
        assert not result.is_error and text.startswith("exit_code=0") and "over-http" in text, text
        found = re.search(r"\(sandbox (sb-[0-9A-Za-z_-]+)\)", text)
        assert found, text
    print(found.group(1))


asyncio.run(main())
