"""The asyncio API: the names of `sandboxd`, as coroutines.

    import asyncio
    from sandboxd.aio import Sandbox

    async def main() -> None:
        async with Sandbox.create(isolation="process", image="debian") as sb:
            result = await sb.exec(["python3", "-c", "print(6 * 7)"])
            print(result.stdout_text)

    asyncio.run(main())
"""

from ..errors import *  # noqa: F401,F403 - the same exceptions
from ..errors import SandboxdError
from ..types import (
    DirTransfer,
    ExecResult,
    ExecStatus,
    FileTransfer,
    ImageInfo,
    ImageProgress,
    Isolation,
    OutputChunk,
    SandboxInfo,
    SnapshotInfo,
)
from . import images
from .client import Client
from .sandbox import Exec, ExecStream, Opening, Sandbox, Session

__all__ = [
    "Client", "DirTransfer", "Exec", "ExecResult", "ExecStatus", "ExecStream", "FileTransfer", "ImageInfo",
    "ImageProgress", "Isolation", "Opening", "OutputChunk", "Sandbox", "SandboxInfo", "SandboxdError", "Session",
    "SnapshotInfo", "images",
]
