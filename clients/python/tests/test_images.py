"""The image catalog: list, get, remove, import from an archive and from the host's Docker,
build from a Dockerfile, each with progress callbacks."""

from __future__ import annotations

import hashlib
import io
import json
import os
import subprocess
import tarfile
import uuid
from pathlib import Path
from typing import Iterator

import pytest

import sandboxd
from sandboxd import ImageProgress, Isolation, Sandbox, images

from conftest import images_dir


def docker_save_archive(path: Path, rootfs: Path, tag: str) -> None:
    """A `docker save` tar of one layer (the rootfs) and a config of our own, written here."""
    layer = io.BytesIO()
    with tarfile.open(fileobj=layer, mode="w", format=tarfile.PAX_FORMAT) as t:
        for entry in sorted(os.listdir(rootfs)):
            t.add(rootfs / entry, arcname=entry)
    layer_bytes = layer.getvalue()
    config = json.dumps({
        "architecture": "amd64", "os": "linux", "created": "2026-01-02T03:04:05Z",
        "config": {"Env": ["FROM_ARCHIVE=yes"], "WorkingDir": "/srv", "Cmd": ["sh"]},
        "rootfs": {"type": "layers", "diff_ids": ["sha256:" + hashlib.sha256(layer_bytes).hexdigest()]},
    }).encode()
    config_name = hashlib.sha256(config).hexdigest() + ".json"
    manifest = json.dumps([{"Config": config_name, "RepoTags": [tag], "Layers": ["layer/layer.tar"]}]).encode()
    with tarfile.open(path, mode="w") as t:
        for name, data in [(config_name, config), ("layer/layer.tar", layer_bytes), ("manifest.json", manifest)]:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))


@pytest.fixture
def names() -> Iterator[list[str]]:
    """Image names a test made: removed from the catalog's Docker side afterwards."""
    made: list[str] = []
    yield made
    for name in made:
        out = subprocess.run(["docker", "images", "-q", "--filter", f"reference=*{name}*"], capture_output=True, text=True, check=False)
        for image in set(out.stdout.split()):
            subprocess.run(["docker", "rmi", "-f", image], capture_output=True, check=False)


def test_list_and_get(client: sandboxd.Client) -> None:
    listed = images.list(client=client)
    by_name = {i.name: i for i in listed}
    assert "minimal" in by_name and [i.name for i in listed] == sorted(by_name)
    minimal = images.get("minimal", client=client)
    assert minimal == by_name["minimal"] and minimal.digest.startswith("sha256:")
    assert Isolation.PROCESS in minimal.ready_tiers and not minimal.imported
    with pytest.raises(sandboxd.NotFound) as e:
        images.get("no-such-image", client=client)
    assert "no-such-image" in e.value.message and "minimal" in e.value.message
    with pytest.raises(sandboxd.FailedPrecondition):
        images.remove("minimal", client=client)


def test_import_an_archive_run_it_and_remove_it(client: sandboxd.Client, tmp_path: Path, names: list[str]) -> None:
    name = f"pysdk-archive-{uuid.uuid4().hex[:8]}"
    names.append(name)
    archive = tmp_path / "image.tar"
    docker_save_archive(archive, images_dir() / "minimal/rootfs", f"{name}:v1")
    events: list[ImageProgress] = []
    info = images.import_archive(archive, progress=events.append, client=client)
    assert info.name == name, "named after the archive's RepoTags"
    phases = [e.phase for e in events]
    assert phases[0] == "receive" and phases[-1] == "done" and "layers" in phases, phases
    assert events[-1].done == info and info.imported and info.source.startswith("archive:")
    assert info.env.get("FROM_ARCHIVE") == "yes" and info.workdir == "/srv"
    assert any(e.phase == "receive" and e.total_bytes == archive.stat().st_size for e in events)
    with Sandbox.create(isolation="process", image=name, client=client) as sb:
        assert sb.exec(["sh", "-c", "echo $FROM_ARCHIVE; pwd"]).stdout == b"yes\n/srv\n"
        with pytest.raises(sandboxd.FailedPrecondition):
            images.remove(name, client=client)
    assert images.remove(name, client=client) > 0
    with pytest.raises(sandboxd.NotFound):
        images.get(name, client=client)


def test_import_from_docker(client: sandboxd.Client, tmp_path: Path, names: list[str]) -> None:
    tag = f"pysdk-docker-{uuid.uuid4().hex[:8]}:v1"
    names.append(tag.split(":")[0])
    rootfs_tar = tmp_path / "rootfs.tar"
    subprocess.run(["tar", "-C", str(images_dir() / "minimal/rootfs"), "-cf", str(rootfs_tar), "."], check=True)
    subprocess.run(["docker", "import", "--change", "ENV FROM_DOCKER=yes", str(rootfs_tar), tag], check=True, capture_output=True)
    events: list[ImageProgress] = []
    info = images.import_docker(tag, name=tag.split(":")[0] + "-d", progress=events.append, client=client)
    names.append(info.name)
    assert info.source == f"docker:{tag}" and events[-1].done == info and "export" in [e.phase for e in events]
    with Sandbox.create(isolation="process", image=info.name, client=client) as sb:
        assert sb.exec(["sh", "-c", "echo $FROM_DOCKER"]).stdout == b"yes\n"
    images.remove(info.name, client=client)
    with pytest.raises(sandboxd.NotFound):
        images.import_docker("pysdk-no-such-image:never", client=client)


def test_build_from_a_dockerfile(client: sandboxd.Client, tmp_path: Path, names: list[str]) -> None:
    name = f"pysdk-built-{uuid.uuid4().hex[:8]}"
    names.append(name)
    ctx = tmp_path / "ctx"
    (ctx / "docker").mkdir(parents=True)
    (ctx / "hello.txt").write_text("from the context\n")
    (ctx / "docker" / "Build.df").write_text(
        "FROM sandboxd/minimal\nARG GREETING=unset\nCOPY hello.txt /opt/hello.txt\n"
        "RUN echo $GREETING > /opt/greeting\nENV BUILT=yes\n"
    )
    events: list[ImageProgress] = []
    info = images.build(ctx, name, dockerfile="docker/Build.df", build_args={"GREETING": "hi"}, progress=events.append, client=client)
    assert info.name == name and info.source.startswith("build:") and info.env.get("BUILT") == "yes"
    assert any(e.phase == "build" and e.message for e in events), [e.phase for e in events]
    with Sandbox.create(isolation="process", image=name, client=client) as sb:
        assert sb.exec(["cat", "/opt/hello.txt", "/opt/greeting"]).stdout == b"from the context\nhi\n"
    images.remove(name, client=client)
    with pytest.raises(FileNotFoundError):
        images.build(ctx, name, client=client)
    (ctx / "Dockerfile").write_text("FROM sandboxd/no-such-base\n")
    with pytest.raises(sandboxd.SandboxdError) as e:
        images.build(ctx, name, client=client)
    assert "no-such-base" in e.value.message
    # A network for the RUN steps needs the daemon's consent ([images] build_network).
    (ctx / "Dockerfile").write_text("FROM sandboxd/minimal\nRUN true\n")
    with pytest.raises(sandboxd.SandboxdError) as e:
        images.build(ctx, name, network="open", client=client)
    assert "build_network" in e.value.message
