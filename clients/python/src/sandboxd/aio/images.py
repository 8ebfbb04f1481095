"""The image catalog for asyncio code: the functions of `sandboxd.images`, as coroutines."""

from __future__ import annotations

import asyncio
import hashlib
from pathlib import Path
from typing import Any, AsyncIterator, Callable, List, Mapping, Optional, Sequence

import grpc.aio

from .. import _archive
from .._requests import network_policy
from .._conn import CHUNK_SIZE, QUEUE_CHUNKS, Pathish
from .._proto.sandbox.v1 import sandbox_pb2 as pb
from ..errors import ProtocolError, from_rpc_error
from ..types import ImageInfo, ImageProgress
from .client import Client, resolve

Progress = Optional[Callable[[ImageProgress], None]]


async def list(*, client: Optional[Client] = None) -> List[ImageInfo]:  # noqa: A001 - the API's name
    """Every image of the catalog the caller sees, sorted by name."""
    reply: pb.ListImagesResponse = await resolve(client).unary("ListImages", pb.ListImagesRequest())
    return [ImageInfo.from_proto(i) for i in reply.images]


async def get(name: str, *, client: Optional[Client] = None) -> ImageInfo:
    reply: pb.ImageInfo = await resolve(client).unary("GetImage", pb.GetImageRequest(name=name))
    return ImageInfo.from_proto(reply)


async def remove(name: str, *, client: Optional[Client] = None) -> int:
    reply: pb.RemoveImageResponse = await resolve(client).unary("RemoveImage", pb.RemoveImageRequest(name=name), timeout=None)
    return int(reply.freed_bytes)


async def _run(
    client: Client, method: str, requests: AsyncIterator[Any], progress: Progress, local_error: Callable[[], Optional[BaseException]]
) -> ImageInfo:
    call = client.bidi(method, requests)
    try:
        async for m in call:
            event = ImageProgress.from_proto(m)
            if progress is not None:
                progress(event)
            if event.done is not None:
                return event.done
    except grpc.aio.AioRpcError as e:
        err = local_error()
        if err is not None:
            raise err from None
        raise from_rpc_error(e, method) from None
    except asyncio.CancelledError:
        # grpc.aio cancels the call when the requests fail: say why, unless the cancellation
        # is the caller's own.
        err = local_error()
        if err is not None:
            raise err from None
        raise
    finally:
        call.cancel()
    err = local_error()
    if err is not None:
        raise err
    raise ProtocolError("the image stream ended without its result")


async def import_docker(
    reference: str, *, name: str = "", shared: bool = False, progress: Progress = None, client: Optional[Client] = None
) -> ImageInfo:
    """Imports an image of the daemon host's Docker Engine (see `sandboxd.images.import_docker`)."""

    async def requests() -> AsyncIterator[pb.ImportImageRequest]:
        yield pb.ImportImageRequest(header=pb.ImportImageHeader(name=name, docker_image=reference, shared=shared))

    return await _run(resolve(client), "ImportImage", requests(), progress, lambda: None)


async def import_archive(
    path: Pathish, *, name: str = "", shared: bool = False, progress: Progress = None, client: Optional[Client] = None
) -> ImageInfo:
    """Streams a `docker save` or OCI tar and imports it (see `sandboxd.images.import_archive`)."""
    p = Path(path)
    size = p.stat().st_size
    errors: List[BaseException] = []

    async def requests() -> AsyncIterator[pb.ImportImageRequest]:
        archive = pb.ImageArchive(size_bytes=size, file_name=p.name)
        yield pb.ImportImageRequest(header=pb.ImportImageHeader(name=name, archive=archive, shared=shared))
        hasher = hashlib.sha256()
        try:
            f = await asyncio.to_thread(p.open, "rb")
            try:
                while chunk := await asyncio.to_thread(f.read, CHUNK_SIZE):
                    hasher.update(chunk)
                    yield pb.ImportImageRequest(chunk=chunk)
            finally:
                f.close()
        except OSError as e:
            errors.append(e)
            raise
        yield pb.ImportImageRequest(sha256=hasher.hexdigest())

    return await _run(resolve(client), "ImportImage", requests(), progress, lambda: errors[0] if errors else None)


async def build(
    context_dir: Pathish,
    tag: str,
    *,
    dockerfile: Optional[str] = None,
    build_args: Optional[Mapping[str, str]] = None,
    network: Optional[str] = None,
    allow: Optional[Sequence[str]] = None,
    progress: Progress = None,
    client: Optional[Client] = None,
) -> ImageInfo:
    """Builds `context_dir` into the catalog image `tag` (see `sandboxd.images.build`)."""
    root = Path(context_dir)
    if not (root / (dockerfile or "Dockerfile")).is_file():
        raise FileNotFoundError(f"no {dockerfile or 'Dockerfile'} in the build context {root}")
    feed = _archive.PackFeed(root, CHUNK_SIZE, QUEUE_CHUNKS)

    async def requests() -> AsyncIterator[pb.BuildImageRequest]:
        header = pb.BuildImageHeader(name=tag, dockerfile=dockerfile or "", build_args=dict(build_args or {}), network=network_policy(network, allow))
        yield pb.BuildImageRequest(header=header)
        hasher = hashlib.sha256()
        while True:
            piece = await asyncio.to_thread(feed.get)
            if piece is None:
                break
            if isinstance(piece, BaseException):
                feed.error = piece
                raise piece
            assert isinstance(piece, bytes)
            hasher.update(piece)
            yield pb.BuildImageRequest(chunk=piece)
        yield pb.BuildImageRequest(sha256=hasher.hexdigest())

    try:
        return await _run(resolve(client), "BuildImage", requests(), progress, lambda: feed.error)
    finally:
        await asyncio.to_thread(feed.close)


__all__ = ["list", "get", "remove", "import_docker", "import_archive", "build"]
