"""The SandboxService methods as the generated descriptor names them: path and message types.

Calls are made through `channel.unary_unary(...)` & co. with these, rather than through an
untyped generated stub class, so every call site is checked by mypy against the generated
message types. Importing this module fails loudly if `proto/` lost a method this SDK uses.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ._proto.sandbox.v1 import sandbox_pb2 as pb

SERVICE = pb.DESCRIPTOR.services_by_name["SandboxService"]


@dataclass(frozen=True)
class Method:
    name: str
    path: str
    request: Any
    response: Any
    client_streaming: bool
    server_streaming: bool


def _methods() -> dict[str, Method]:
    out = {}
    for m in SERVICE.methods:
        out[m.name] = Method(
            name=m.name,
            path=f"/{SERVICE.full_name}/{m.name}",
            request=getattr(pb, m.input_type.name),
            response=getattr(pb, m.output_type.name),
            client_streaming=m.client_streaming,
            server_streaming=m.server_streaming,
        )
    return out


METHODS = _methods()

USED = {
    "CreateSandbox", "GetSandbox", "SetSandboxTtl", "ListSandboxes", "DestroySandbox", "Exec",
    "ExecStream", "GetExec", "SignalExec", "ListExecs", "WriteFile", "ReadFile", "Snapshot",
    "ListSnapshots", "Rollback", "DeleteSnapshot", "ExecSession", "UploadFile", "DownloadFile",
    "UploadArchive", "DownloadArchive", "ListImages", "GetImage", "RemoveImage", "ImportImage",
    "BuildImage", "GetNetworkLog", "PauseSandbox", "ResumeSandbox",
}
_missing = USED - METHODS.keys()
if _missing:
    raise ImportError(f"sandbox.proto lacks methods this SDK uses: {sorted(_missing)}")
