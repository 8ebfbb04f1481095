"""A stock Python grpcio client against sandboxd's UNIX socket, with no channel options.

Usage: grpcio_client.py <repo root> <unix:///path/to/sandboxd.sock>
Generates the Python stubs from proto/ with grpc_tools, then creates a sandbox, runs commands
unary and streamed, checks an error status, and destroys the sandbox. Prints OK at the end;
any failure raises (non-zero exit).
"""
import os
import sys
import tempfile

import grpc
import grpc_tools
from grpc_tools import protoc

root, address = sys.argv[1], sys.argv[2]
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
print("OK")
