"""A stock Python grpcio client against sandboxd's UNIX socket, with no channel options.

Usage: grpcio_client.py <repo root> <unix:///path/to/sandboxd.sock> <rootfs of the minimal image>
Generates the Python stubs from proto/ with grpc_tools, then creates a sandbox, runs commands
unary and streamed, checks an error status, and destroys the sandbox. Then prepares an image as
a remote client would: writes a `docker save` archive of the given rootfs itself (no Docker),
streams it through ImportImage, lists it, runs a sandbox of it and removes it. Prints OK at the
end; any failure raises (non-zero exit).
"""
import hashlib
import io
import json
import os
import sys
import tarfile
import tempfile
import uuid

import grpc
import grpc_tools
from grpc_tools import protoc

root, address, rootfs = sys.argv[1], sys.argv[2], sys.argv[3]
out = tempfile.mkdtemp(prefix="sandboxd-grpcio-")
well_known = os.path.join(os.path.dirname(grpc_tools.__file__), "_proto")
rc = protoc.main([
    "protoc",
    f"-I{os.path.join(root, 'proto')}",
    f"-I{well_known}",
    f"--python_out={out}",
    f"--grpc_python_out={out}",
    "sandbox/v1/sandbox.proto",
])
if rc != 0:
    sys.exit(f"protoc failed ({rc})")
sys.path.insert(0, out)
from sandbox.v1 import sandbox_pb2 as pb  # noqa: E402
from sandbox.v1 import sandbox_pb2_grpc as pb_grpc  # noqa: E402

# No options: no grpc.default_authority. grpcio sends the socket path as :authority.
channel = grpc.insecure_channel(address)
stub = pb_grpc.SandboxServiceStub(channel)

sandbox = stub.CreateSandbox(pb.CreateSandboxRequest(), timeout=60)
assert sandbox.id.startswith("sb-"), sandbox
result = stub.Exec(pb.ExecRequest(sandbox_id=sandbox.id, argv=["echo", "hello from grpcio"]), timeout=60)
assert result.status == pb.EXEC_STATUS_EXITED and result.stdout == b"hello from grpcio\n", result

events = list(stub.ExecStream(pb.ExecRequest(sandbox_id=sandbox.id, argv=["sh", "-c", "echo out; echo err >&2; exit 3"]), timeout=60))
streamed = b"".join(e.stdout for e in events if e.WhichOneof("event") == "stdout")
assert streamed == b"out\n", events
assert events[-1].WhichOneof("event") == "result" and events[-1].result.exit_code == 3, events[-1]

try:
    stub.GetSandbox(pb.GetSandboxRequest(sandbox_id="sb-doesnotexist"), timeout=10)
    raise AssertionError("GetSandbox of an unknown id succeeded")
except grpc.RpcError as e:
    assert e.code() == grpc.StatusCode.NOT_FOUND, (e.code(), e.details())

# Several calls in flight on one connection (HPACK state across requests).
futures = [stub.Exec.future(pb.ExecRequest(sandbox_id=sandbox.id, argv=["echo", str(i)]), timeout=60) for i in range(8)]
assert sorted(f.result().stdout for f in futures) == sorted(f"{i}\n".encode() for i in range(8))

stub.DestroySandbox(pb.DestroySandboxRequest(sandbox_id=sandbox.id), timeout=60)


def docker_save_archive(rootfs, tag, env, workdir):
    """A `docker save` tar of one layer (the rootfs) and a config of our own, in memory."""
    layer = io.BytesIO()
    with tarfile.open(fileobj=layer, mode="w", format=tarfile.PAX_FORMAT) as t:
        for entry in sorted(os.listdir(rootfs)):
            t.add(os.path.join(rootfs, entry), arcname=entry)
    layer = layer.getvalue()
    diff_id = "sha256:" + hashlib.sha256(layer).hexdigest()
    config = json.dumps({
        "architecture": "amd64",
        "os": "linux",
        "created": "2026-01-02T03:04:05Z",
        "config": {"Env": env, "WorkingDir": workdir, "Cmd": ["sh"]},
        "rootfs": {"type": "layers", "diff_ids": [diff_id]},
    }).encode()
    config_name = hashlib.sha256(config).hexdigest() + ".json"
    manifest = json.dumps([{"Config": config_name, "RepoTags": [tag], "Layers": ["l1/layer.tar"]}]).encode()
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as t:
        for name, data in [(config_name, config), ("l1/layer.tar", layer), ("manifest.json", manifest)]:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))
    return out.getvalue(), "sha256:" + hashlib.sha256(config).hexdigest()


def import_requests(name, archive, digest_of_chunks=None):
    yield pb.ImportImageRequest(header=pb.ImportImageHeader(
        name=name, archive=pb.ImageArchive(size_bytes=len(archive), file_name="grpcio.tar")))
    for i in range(0, len(archive), 1 << 20):
        yield pb.ImportImageRequest(chunk=archive[i:i + (1 << 20)])
    yield pb.ImportImageRequest(sha256=digest_of_chunks or hashlib.sha256(archive).hexdigest())


# Images, prepared remotely: an archive streamed in, its progress streamed back.
name = "grpcio-" + uuid.uuid4().hex[:8]
archive, config_digest = docker_save_archive(rootfs, name + ":v1", ["FROM_GRPCIO=yes"], "/srv/app")

try:
    list(stub.ImportImage(import_requests(name, archive, "0" * 64), timeout=120))
    raise AssertionError("an archive whose sha256 does not match was imported")
except grpc.RpcError as e:
    assert e.code() == grpc.StatusCode.DATA_LOSS, (e.code(), e.details())

progress = list(stub.ImportImage(import_requests(name, archive), timeout=600))
phases = [p.phase for p in progress]
for phase in ["receive", "layers", "metadata", "process", "done"]:
    assert phase in phases, (phase, phases)
done = progress[-1].done
assert progress[-1].phase == "done" and done.name == name, progress[-1]
assert done.digest == config_digest and done.imported, done
assert done.env.get("FROM_GRPCIO") == "yes" and done.workdir == "/srv/app", done
assert pb.ISOLATION_PROCESS in done.ready_tiers, done

listed = {i.name: i for i in stub.ListImages(pb.ListImagesRequest(), timeout=30).images}
assert name in listed and "minimal" in listed, sorted(listed)
assert listed[name].digest == config_digest, listed[name]

sandbox = stub.CreateSandbox(pb.CreateSandboxRequest(image=name), timeout=60)
result = stub.Exec(pb.ExecRequest(sandbox_id=sandbox.id, argv=["sh", "-c", "echo $FROM_GRPCIO; pwd"]), timeout=60)
assert result.status == pb.EXEC_STATUS_EXITED and result.stdout == b"yes\n/srv/app\n", result
try:
    stub.RemoveImage(pb.RemoveImageRequest(name=name), timeout=30)
    raise AssertionError("an image in use was removed")
except grpc.RpcError as e:
    assert e.code() == grpc.StatusCode.FAILED_PRECONDITION, (e.code(), e.details())
stub.DestroySandbox(pb.DestroySandboxRequest(sandbox_id=sandbox.id), timeout=60)

freed = stub.RemoveImage(pb.RemoveImageRequest(name=name), timeout=120).freed_bytes
assert freed > 0, freed
try:
    stub.GetImage(pb.GetImageRequest(name=name), timeout=10)
    raise AssertionError("GetImage of a removed image succeeded")
except grpc.RpcError as e:
    assert e.code() == grpc.StatusCode.NOT_FOUND and "available: " in e.details(), (e.code(), e.details())
    assert "/" not in e.details(), e.details()
print("OK")
