"""An upload that breaks off: a stock grpcio client sends UploadFile's header and 1 MiB of data,
then its process dies (os._exit) with the stream still open, as a crashed client would.

Usage: grpcio_cut_upload.py <repo root> <unix:///path/to/sandboxd.sock> <sandbox id> <path>
The caller checks that the old file is unchanged.
"""
import os
import sys
import tempfile
import time

import grpc
import grpc_tools
from grpc_tools import protoc

root, address, sandbox_id, path = sys.argv[1:5]
out = tempfile.mkdtemp(prefix="sandboxd-grpcio-")
well_known = os.path.join(os.path.dirname(grpc_tools.__file__), "_proto")
if protoc.main(["protoc", f"-I{os.path.join(root, 'proto')}", f"-I{well_known}", f"--python_out={out}", f"--grpc_python_out={out}", "sandbox/v1/sandbox.proto"]) != 0:
    sys.exit("protoc failed")
sys.path.insert(0, out)
from sandbox.v1 import sandbox_pb2 as pb  # noqa: E402
from sandbox.v1 import sandbox_pb2_grpc as pb_grpc  # noqa: E402

stub = pb_grpc.SandboxServiceStub(grpc.insecure_channel(address))


def pieces():
    yield pb.UploadRequest(header=pb.UploadHeader(sandbox_id=sandbox_id, path=path))
    yield pb.UploadRequest(data=b"n" * (1 << 20))
    time.sleep(1)
    # Dies with the stream open: no half-close ever reaches the daemon.
    os._exit(3)


stub.UploadFile(pieces(), timeout=60)
