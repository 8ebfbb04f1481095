"""The daemon's image catalog (sync): list, get, remove, import (a Docker image of the daemon's
host, or an archive streamed from here) and build from a Dockerfile, with progress callbacks.
`sandboxd.aio.images` has the same functions, as coroutines."""

from __future__ import annotations

import hashlib
from pathlib import Path

import grpc
from typing import Callable, Iterator, List, Mapping, Optional, Sequence

from . import _archive
from ._requests import network_policy
from ._conn import CHUNK_SIZE, QUEUE_CHUNKS, Pathish
from ._proto.sandbox.v1 import sandbox_pb2 as pb
from .client import Client, resolve
from .errors import ProtocolError, from_rpc_error
from .types import ImageInfo, ImageProgress

Progress = Optional[Callable[[ImageProgress], None]]


def list(*, client: Optional[Client] = None) -> List[ImageInfo]:  # noqa: A001 - the API's name
    """Every image of the catalog the caller sees, sorted by name."""
    reply: pb.ListImagesResponse = resolve(client).unary("ListImages", pb.ListImagesRequest())
    return [ImageInfo.from_proto(i) for i in reply.images]


def get(name: str, *, client: Optional[Client] = None) -> ImageInfo:
    """One image (`NotFound`, naming the images there are, when none has that name)."""
    reply: pb.ImageInfo = resolve(client).unary("GetImage", pb.GetImageRequest(name=name))
    return ImageInfo.from_proto(reply)


def remove(name: str, *, client: Optional[Client] = None) -> int:
    """Removes an imported image; returns the bytes freed (`FailedPrecondition` while a
    sandbox or snapshot uses it, and for the operator's script-built images)."""
    reply: pb.RemoveImageResponse = resolve(client).unary("RemoveImage", pb.RemoveImageRequest(name=name), timeout=None)
    return int(reply.freed_bytes)


def _follow(calls: Iterator[pb.ImageProgress], progress: Progress) -> ImageInfo:
    for m in calls:
        event = ImageProgress.from_proto(m)
        if progress is not None:
            progress(event)
        if event.done is not None:
            return event.done
    raise ProtocolError("the image stream ended without its result")


def _run(client: Client, method: str, requests: Iterator[object], progress: Progress, local_error: Callable[[], Optional[BaseException]]) -> ImageInfo:
    call = client.bidi(method, requests)
    try:
        return _follow(call, progress)
    except grpc.RpcError as e:
        err = local_error()
        if err is not None:
            raise err from None
        raise from_rpc_error(e, method) from None
    finally:
        call.cancel()


def import_docker(
    reference: str, *, name: str = "", shared: bool = False, progress: Progress = None, client: Optional[Client] = None
) -> ImageInfo:
    """Imports an image of the daemon host's Docker Engine (nothing is pulled) as `name`
    (empty: the reference's repository name); `progress` is called for every event."""
    header = pb.ImportImageHeader(name=name, docker_image=reference, shared=shared)
    return _run(resolve(client), "ImportImage", iter([pb.ImportImageRequest(header=header)]), progress, lambda: None)


def import_archive(
    path: Pathish, *, name: str = "", shared: bool = False, progress: Progress = None, client: Optional[Client] = None
) -> ImageInfo:
    """Streams a `docker save` or OCI image-layout tar to the daemon and imports it as `name`
    (empty: from the archive's tags, else the file name), with its SHA-256 checked."""
    p = Path(path)
    size = p.stat().st_size
    errors: List[BaseException] = []

    def requests() -> Iterator[pb.ImportImageRequest]:
        archive = pb.ImageArchive(size_bytes=size, file_name=p.name)
        yield pb.ImportImageRequest(header=pb.ImportImageHeader(name=name, archive=archive, shared=shared))
        hasher = hashlib.sha256()
        try:
            with p.open("rb") as f:
                while chunk := f.read(CHUNK_SIZE):
                    hasher.update(chunk)
                    yield pb.ImportImageRequest(chunk=chunk)
        except OSError as e:
            errors.append(e)
            raise
        yield pb.ImportImageRequest(sha256=hasher.hexdigest())

    return _run(resolve(client), "ImportImage", requests(), progress, lambda: errors[0] if errors else None)


def build(
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
    """Builds `context_dir` (sent as a tar stream) with its Dockerfile (`dockerfile`: a path
    inside the context, default "Dockerfile") into the catalog image `tag`. `FROM
    sandboxd/<name>` names a catalog image; build log lines arrive as phase "build" events.
    Each RUN step runs in a container sandbox; `network`/`allow` ask for its network as for
    `Sandbox.create` (the daemon must allow builds one: `[images] build_network = "policy"`)."""
    root = Path(context_dir)
    if not (root / (dockerfile or "Dockerfile")).is_file():
        raise FileNotFoundError(f"no {dockerfile or 'Dockerfile'} in the build context {root}")
    feed = _archive.PackFeed(root, CHUNK_SIZE, QUEUE_CHUNKS)

    def requests() -> Iterator[pb.BuildImageRequest]:
        header = pb.BuildImageHeader(name=tag, dockerfile=dockerfile or "", build_args=dict(build_args or {}), network=network_policy(network, allow))
        yield pb.BuildImageRequest(header=header)
        hasher = hashlib.sha256()
        for piece in feed:
            hasher.update(piece)
            yield pb.BuildImageRequest(chunk=piece)
        yield pb.BuildImageRequest(sha256=hasher.hexdigest())

    try:
        return _run(resolve(client), "BuildImage", requests(), progress, lambda: feed.error)
    finally:
        feed.close()


__all__ = ["list", "get", "remove", "import_docker", "import_archive", "build"]
