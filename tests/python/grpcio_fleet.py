"""A stock Python grpcio client against a fleet, through one node's address only.

Usage: grpcio_fleet.py <repo root> <host:port of node A> <CA certificate (PEM)> <token> <nodes>
Generates the stubs from proto/ with grpc_tools and connects over TLS (the fleet's CA) with a
bearer token, as an agent framework would. Creates sandboxes through node A until it holds one
on each of the <nodes> (comma-separated node names: A fills first, then its peers), then on each
one: a unary exec, a streamed exec, a snapshot, a change, a rollback that undoes it. Destroys
them all. Prints OK at the end; any failure raises (non-zero exit).
"""
import os
import sys
import tempfile

import grpc
import grpc_tools
from grpc_tools import protoc

root, address, ca_file, token, nodes = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5].split(",")
out = tempfile.mkdtemp(prefix="sandboxd-grpcio-fleet-")
well_known = os.path.join(os.path.dirname(grpc_tools.__file__), "_proto")
rc = protoc.main(["protoc", f"-I{os.path.join(root, 'proto')}", f"-I{well_known}", f"--python_out={out}", f"--grpc_python_out={out}", "sandbox/v1/sandbox.proto"])
if rc != 0:
    sys.exit(f"protoc failed ({rc})")
sys.path.insert(0, out)
from sandbox.v1 import sandbox_pb2 as pb  # noqa: E402
from sandbox.v1 import sandbox_pb2_grpc as pb_grpc  # noqa: E402

with open(ca_file, "rb") as f:
    credentials = grpc.composite_channel_credentials(grpc.ssl_channel_credentials(root_certificates=f.read()), grpc.access_token_call_credentials(token))
stub = pb_grpc.SandboxServiceStub(grpc.secure_channel(address, credentials))

made = []
by_node = {}
try:
    while set(by_node) != set(nodes):
        if len(made) >= 3 * len(nodes) * 4:
            raise AssertionError(f"{len(made)} creates and still not on every node: {sorted(by_node)}")
        sandbox = stub.CreateSandbox(pb.CreateSandboxRequest(image="minimal", isolation=pb.ISOLATION_PROCESS), timeout=120)
        made.append(sandbox.id)
        assert sandbox.node in nodes and sandbox.id.endswith("_" + sandbox.node), sandbox
        by_node.setdefault(sandbox.node, sandbox.id)
    for node, sid in sorted(by_node.items()):
        r = stub.Exec(pb.ExecRequest(sandbox_id=sid, argv=["sh", "-c", f"echo {node} > /workspace/where; hostname"]), timeout=60)
        assert r.status == pb.EXEC_STATUS_EXITED and r.exit_code == 0, (node, r)
        events = list(stub.ExecStream(pb.ExecRequest(sandbox_id=sid, argv=["sh", "-c", "cat /workspace/where; echo err >&2; exit 4"]), timeout=60))
        streamed = b"".join(e.stdout for e in events if e.WhichOneof("event") == "stdout")
        assert streamed == f"{node}\n".encode(), (node, events)
        assert events[-1].WhichOneof("event") == "result" and events[-1].result.exit_code == 4, (node, events[-1])
        snap = stub.Snapshot(pb.SnapshotRequest(sandbox_id=sid, name="s"), timeout=120)
        assert snap.snapshot_id.endswith("_" + node), (node, snap)
        stub.Exec(pb.ExecRequest(sandbox_id=sid, argv=["sh", "-c", "echo changed > /workspace/where"]), timeout=60)
        stub.Rollback(pb.RollbackRequest(sandbox_id=sid, snapshot_id=snap.snapshot_id), timeout=120)
        r = stub.Exec(pb.ExecRequest(sandbox_id=sid, argv=["cat", "/workspace/where"]), timeout=60)
        assert r.stdout == f"{node}\n".encode(), (node, r)
        print(f"{node}: {sid} exec, stream, snapshot, rollback")
finally:
    for sid in made:
        stub.DestroySandbox(pb.DestroySandboxRequest(sandbox_id=sid), timeout=120)
print("OK")
