"""Talks to `sbx mcp --http` with the official MCP Python client over streamable HTTP.

Usage: mcp_http_client.py URL TOKEN

Checks that a request without the bearer token is refused, then lists the tools, runs a
command in the default sandbox and prints that sandbox's id as the last line; the caller then
stops the server and checks the sandbox is gone.
"""

import asyncio
import re
import sys

import httpx2
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared._httpx_utils import create_mcp_http_client


async def main():
    url, token = sys.argv[1], sys.argv[2]
    async with httpx2.AsyncClient() as raw:
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            r = await raw.post(url, json={"jsonrpc": "2.0", "id": 1, "method": "tools/list"}, headers=headers)
            assert r.status_code == 401, f"a request with {headers} got {r.status_code}: {r.text}"
    http = create_mcp_http_client(headers={"Authorization": f"Bearer {token}"})
    async with Client(streamable_http_client(url, http_client=http), read_timeout_seconds=120) as client:
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
