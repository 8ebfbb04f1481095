"""Where the daemon is and how to talk to it: addresses, TLS, the token, retry policy.

Shared by the sync `Client` and the asyncio one; no I/O happens here.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

import grpc

from .errors import InvalidArgument

SOCKET_ENV = "SANDBOXD_SOCKET"
TOKEN_ENV = "SANDBOXD_TOKEN"
CA_ENV = "SANDBOXD_CA_CERT"
DEFAULT_SOCKET = "unix://./.sandboxd/sandboxd.sock"
SYSTEM_SOCKET = "unix:///run/sandboxd/sandboxd.sock"

# As the Rust client: an ExecResult carries both output streams, each up to max_output_bytes.
MAX_RECEIVE_BYTES = 256 * 1024 * 1024
# Pieces of uploads and image imports (whole MiBs, as `sbx` sends them).
CHUNK_SIZE = 1 << 20
# Pieces queued ahead of the network: 4 MiB in flight at most per transfer.
QUEUE_CHUNKS = 4

Pathish = Union[str, "os.PathLike[str]"]


def default_address() -> str:
    """`$SANDBOXD_SOCKET`, else `make run`'s socket under the current directory when there is
    one, else the system daemon's (as `sbx`)."""
    env = os.environ.get(SOCKET_ENV, "")
    if env:
        return env
    if Path("./.sandboxd/sandboxd.sock").exists():
        return DEFAULT_SOCKET
    return SYSTEM_SOCKET


@dataclass(frozen=True)
class Target:
    """A parsed address: what grpc dials, whether with TLS, and how to name it in errors."""

    grpc_target: str
    tls: bool
    display: str
    unix: bool


def parse_address(addr: str, tls: Optional[bool] = None) -> Target:
    """Accepts what `sbx` does — `unix:///abs.sock`, `unix:rel.sock`, a path starting with `/`,
    `./` or `../`, `tcp://host:port`, `http://host:port` — and `https://host:port` (TLS).
    `tls=True` makes a `tcp://` address TLS (it is when a CA is given)."""

    def invalid(reason: str) -> InvalidArgument:
        return InvalidArgument(f"invalid sandboxd address {addr!r}: {reason}")

    path: Optional[str] = None
    if addr.startswith("unix://"):
        path = addr[len("unix://") :]
    elif addr.startswith("unix:"):
        path = addr[len("unix:") :]
    elif addr.startswith(("/", "./", "../")):
        path = addr
    if path is not None:
        if not path:
            raise invalid("empty socket path")
        # Resolved now, not at connect time: the channel may reconnect after a chdir.
        absolute = os.path.normpath(os.path.join(os.getcwd(), path))
        return Target(f"unix://{absolute}", False, f"unix://{absolute}", True)
    for scheme, secure in (("tcp://", bool(tls)), ("http://", False), ("https://", True)):
        if addr.startswith(scheme):
            authority = addr[len(scheme) :].rstrip("/")
            if not authority or "/" in authority:
                raise invalid("expected host:port after the scheme")
            if scheme == "http://" and tls:
                raise invalid("http:// is plaintext; use https:// or tcp:// with a CA")
            return Target(authority, secure, addr, False)
    raise invalid(
        "expected unix:///path.sock, an absolute socket path, tcp://host:port, "
        "http://host:port or https://host:port"
    )


@dataclass(frozen=True)
class Settings:
    """Everything a client needs to open its channel."""

    target: Target
    token: Optional[str]
    root_certificates: Optional[bytes]
    server_name: Optional[str]
    timeout: Optional[float]
    connect_timeout: float
    retries: int

    @classmethod
    def resolve(
        cls,
        address: Optional[str],
        token: Optional[str],
        ca_cert: Union[Pathish, bytes, None],
        server_name: Optional[str],
        timeout: Optional[float],
        connect_timeout: float,
        retries: int,
    ) -> "Settings":
        if token is None:
            token = os.environ.get(TOKEN_ENV) or None
        if token is not None and (not token or any(ord(c) < 0x21 or ord(c) > 0x7E for c in token)):
            raise InvalidArgument(
                "invalid bearer token: it must be visible ASCII without spaces or control characters"
            )
        if ca_cert is None and os.environ.get(CA_ENV):
            ca_cert = os.environ[CA_ENV]
        roots: Optional[bytes] = None
        if isinstance(ca_cert, bytes):
            roots = ca_cert
        elif ca_cert is not None:
            try:
                roots = Path(ca_cert).read_bytes()
            except OSError as e:
                raise InvalidArgument(f"cannot read the CA certificate {ca_cert}: {e}") from e
        target = parse_address(address or default_address(), tls=True if roots else None)
        if roots is not None and target.unix:
            raise InvalidArgument("a CA certificate was given for a UNIX socket, which has no TLS")
        if retries < 0:
            raise InvalidArgument(f"retries: {retries} is negative")
        return cls(target, token, roots, server_name, timeout, connect_timeout, retries)

    def metadata(self, extra: Optional[list[tuple[str, str]]] = None) -> list[tuple[str, str]]:
        md = [("authorization", f"Bearer {self.token}")] if self.token else []
        return md + (extra or [])

    def options(self) -> list[tuple[str, object]]:
        opts: list[tuple[str, object]] = [
            ("grpc.max_receive_message_length", MAX_RECEIVE_BYTES),
            ("grpc.max_send_message_length", 64 * 1024 * 1024),
        ]
        if self.server_name:
            opts.append(("grpc.ssl_target_name_override", self.server_name))
        return opts

    def credentials(self) -> Optional[grpc.ChannelCredentials]:
        if not self.target.tls:
            return None
        return grpc.ssl_channel_credentials(root_certificates=self.root_certificates)


# Calls whose repetition changes nothing: reads, whole-file writes, TTL settings, pause, resume.
IDEMPOTENT = frozenset(
    {
        "GetSandbox",
        "ListSandboxes",
        "GetExec",
        "ListExecs",
        "ReadFile",
        "WriteFile",
        "ListSnapshots",
        "SetSandboxTtl",
        "PauseSandbox",
        "ResumeSandbox",
        "ListImages",
        "GetImage",
    }
)


def backoff(attempt: int) -> float:
    """Seconds before retry `attempt` (1-based): 0.1, 0.2, 0.4, ... up to 2 s, with jitter."""
    base: float = min(2.0, 0.1 * (2 ** (attempt - 1)))
    return base * (0.5 + random.random() / 2)
