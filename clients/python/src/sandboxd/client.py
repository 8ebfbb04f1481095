"""`Client`: one connection to sandboxd (sync). `sandboxd.aio.Client` is the asyncio twin."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Iterable, Iterator, Optional, TypeVar, Union

import grpc

from . import _conn
from ._conn import Pathish, Settings
from ._rpc import METHODS
from .errors import Cancelled, DeadlineExceeded, SandboxdError, Unavailable, from_rpc_error

log = logging.getLogger("sandboxd")

T = TypeVar("T")
_UNSET: Any = object()


class Client:
    """A connection to sandboxd, shared by every `Sandbox` made through it; thread-safe.

    - `address`: `unix:///path.sock`, a socket path, `tcp://host:port` (plaintext, or TLS when
      `ca_cert` is given), `http://host:port`, `https://host:port`. Default `$SANDBOXD_SOCKET`,
      else `./.sandboxd/sandboxd.sock` if it exists, else `/run/sandboxd/sandboxd.sock`.
    - `token`: bearer token sent with every call (default `$SANDBOXD_TOKEN`).
    - `ca_cert`: PEM file (or bytes) of the CA that signed the daemon's TLS certificate
      (default `$SANDBOXD_CA_CERT`); `server_name` overrides the name checked against it.
    - `timeout`: deadline in seconds of each short call (gets, lists, file reads and writes,
      snapshots); None = none. Execs have their own (their `timeout=` plus a margin).
    - `connect_timeout`: how long the first connection may take.
    - `retries`: how often a call that failed with UNAVAILABLE is repeated, only where that is
      safe: reads, whole-file writes, TTL updates, and execs with an `idempotency_key` (the
      daemon runs a key once and answers a repeat with the first run's record).
    """

    def __init__(
        self,
        address: Optional[str] = None,
        *,
        token: Optional[str] = None,
        ca_cert: Union[Pathish, bytes, None] = None,
        server_name: Optional[str] = None,
        timeout: Optional[float] = 60.0,
        connect_timeout: float = 10.0,
        retries: int = 5,
    ) -> None:
        self.settings = Settings.resolve(
            address, token, ca_cert, server_name, timeout, connect_timeout, retries
        )
        options = self.settings.options() + [
            # Come back quickly after a daemon restart, so retries find it.
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.min_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", 1000),
        ]
        target = self.settings.target
        creds = self.settings.credentials()
        if creds is None:
            self._channel = grpc.insecure_channel(target.grpc_target, options=options)
        else:
            self._channel = grpc.secure_channel(target.grpc_target, creds, options=options)
        self._metadata = self.settings.metadata()
        self._callables: dict[str, Any] = {}
        self._lock = threading.Lock()
        try:
            grpc.channel_ready_future(self._channel).result(timeout=connect_timeout)
        except grpc.FutureTimeoutError:
            self._channel.close()
            raise Unavailable(
                f"cannot connect to sandboxd at {target.display} within {connect_timeout} s"
            ) from None

    @property
    def address(self) -> str:
        return self.settings.target.display

    def close(self) -> None:
        """Closes the connection (calls in flight are cancelled)."""
        self._channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Client({self.address!r})"

    # The four shapes of call, with errors turned into SandboxdError.

    def _callable(self, name: str) -> Any:
        with self._lock:
            fn = self._callables.get(name)
            if fn is None:
                m = METHODS[name]
                kind = {
                    (False, False): self._channel.unary_unary,
                    (False, True): self._channel.unary_stream,
                    (True, False): self._channel.stream_unary,
                    (True, True): self._channel.stream_stream,
                }[(m.client_streaming, m.server_streaming)]
                fn = kind(
                    m.path,
                    request_serializer=m.request.SerializeToString,
                    response_deserializer=m.response.FromString,
                )
                self._callables[name] = fn
            return fn

    def _deadline(self, timeout: Any) -> Optional[float]:
        return self.settings.timeout if timeout is _UNSET else timeout

    def _retrying(self, name: str, safe: bool, attempt: Callable[[], T]) -> T:
        tries = 0
        while True:
            try:
                return attempt()
            except grpc.RpcError as e:
                code = e.code() if callable(getattr(e, "code", None)) else None
                if safe and code == grpc.StatusCode.UNAVAILABLE and tries < self.settings.retries:
                    tries += 1
                    delay = _conn.backoff(tries)
                    log.info("%s: daemon unavailable, retry %d in %.2f s", name, tries, delay)
                    time.sleep(delay)
                    continue
                raise from_rpc_error(e, f"{name} at {self.address}") from None

    def unary(self, name: str, request: Any, *, timeout: Any = _UNSET, retry: Optional[bool] = None) -> Any:
        """Calls a unary method; `retry` None = retry UNAVAILABLE when the method is idempotent."""
        fn = self._callable(name)
        safe = name in _conn.IDEMPOTENT if retry is None else retry
        deadline = self._deadline(timeout)
        started = time.monotonic()
        try:
            return self._retrying(name, safe, lambda: fn(request, timeout=deadline, metadata=self._metadata))
        except Cancelled as e:
            raise _deadline_error(e, deadline, time.monotonic() - started) from None

    def server_stream(self, name: str, request: Any, *, retry: bool = False) -> Iterator[Any]:
        """Calls a server-streaming method, yielding its messages. With `retry`, UNAVAILABLE is
        retried only until the first message has arrived."""
        fn = self._callable(name)
        tries = 0
        while True:
            call = fn(request, metadata=self._metadata)
            received = False
            try:
                for message in call:
                    received = True
                    yield message
                return
            except grpc.RpcError as e:
                if retry and not received and e.code() == grpc.StatusCode.UNAVAILABLE and tries < self.settings.retries:
                    tries += 1
                    time.sleep(_conn.backoff(tries))
                    continue
                raise from_rpc_error(e, f"{name} at {self.address}") from None
            finally:
                call.cancel()

    def client_stream(self, name: str, requests: Iterable[Any]) -> Any:
        """Calls a client-streaming method with `requests` (consumed on a gRPC thread)."""
        fn = self._callable(name)
        try:
            return fn(iter(requests), metadata=self._metadata)
        except grpc.RpcError as e:
            raise from_rpc_error(e, f"{name} at {self.address}") from None

    def bidi(self, name: str, requests: Iterator[Any]) -> Any:
        """Opens a bidirectional stream; returns the call (an iterator of responses)."""
        return self._callable(name)(requests, metadata=self._metadata)


def _deadline_error(err: SandboxdError, deadline: Optional[float], elapsed: float) -> SandboxdError:
    """The daemon (tonic) answers a call whose deadline passed on its side with CANCELLED
    ("Timeout expired"); this client never cancels a unary call, so that is the deadline."""
    if deadline is not None and elapsed >= deadline * 0.95:
        return DeadlineExceeded(f"deadline of {deadline} s exceeded: {err.message}")
    return err


_default: Optional[Client] = None
_default_lock = threading.Lock()


def default_client() -> Client:
    """The client used when none is passed: one per process, from the environment."""
    global _default
    with _default_lock:
        if _default is None:
            _default = Client()
        return _default


def resolve(client: Optional[Client]) -> Client:
    return client if client is not None else default_client()


__all__ = ["Client", "default_client"]
