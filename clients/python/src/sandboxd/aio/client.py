"""`sandboxd.aio.Client`: the asyncio twin of `sandboxd.Client`, on `grpc.aio`."""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from typing import Any, AsyncIterator, Callable, Optional, Union

import grpc
import grpc.aio

from .. import _conn
from .._conn import Pathish, Settings
from .._rpc import METHODS
from ..client import _deadline_error
from ..errors import Unavailable, from_rpc_error

log = logging.getLogger("sandboxd")

_UNSET: Any = object()


class Client:
    """A connection to sandboxd for asyncio code; the arguments are `sandboxd.Client`'s.

    Creating one does no I/O (the channel dials on first use); `await Client.connect(...)`
    also waits until the daemon is reachable, or raises `Unavailable` naming the address.
    A client belongs to the event loop it was first used on.
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
        self.settings = Settings.resolve(address, token, ca_cert, server_name, timeout, connect_timeout, retries)
        options = self.settings.options() + [
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.min_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", 1000),
        ]
        target = self.settings.target
        creds = self.settings.credentials()
        if creds is None:
            self._channel = grpc.aio.insecure_channel(target.grpc_target, options=options)
        else:
            self._channel = grpc.aio.secure_channel(target.grpc_target, creds, options=options)
        self._metadata = tuple(self.settings.metadata())
        self._callables: dict[str, Any] = {}

    @classmethod
    async def connect(
        cls,
        address: Optional[str] = None,
        *,
        token: Optional[str] = None,
        ca_cert: Union[Pathish, bytes, None] = None,
        server_name: Optional[str] = None,
        timeout: Optional[float] = 60.0,
        connect_timeout: float = 10.0,
        retries: int = 5,
    ) -> "Client":
        """A client whose connection is up (`Unavailable` after `connect_timeout`)."""
        client = cls(address, token=token, ca_cert=ca_cert, server_name=server_name, timeout=timeout,
                     connect_timeout=connect_timeout, retries=retries)
        await client.wait_ready()
        return client

    async def wait_ready(self) -> None:
        """Waits until the daemon is reachable (`Unavailable` after `connect_timeout`)."""
        try:
            await asyncio.wait_for(self._channel.channel_ready(), self.settings.connect_timeout)
        except asyncio.TimeoutError:
            raise Unavailable(
                f"cannot connect to sandboxd at {self.address} within {self.settings.connect_timeout} s"
            ) from None

    @property
    def address(self) -> str:
        return self.settings.target.display

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> "Client":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def __repr__(self) -> str:
        return f"aio.Client({self.address!r})"

    def _callable(self, name: str) -> Any:
        fn = self._callables.get(name)
        if fn is None:
            m = METHODS[name]
            kind = {
                (False, False): self._channel.unary_unary,
                (False, True): self._channel.unary_stream,
                (True, False): self._channel.stream_unary,
                (True, True): self._channel.stream_stream,
            }[(m.client_streaming, m.server_streaming)]
            fn = kind(m.path, request_serializer=m.request.SerializeToString, response_deserializer=m.response.FromString)
            self._callables[name] = fn
        return fn

    async def unary(self, name: str, request: Any, *, timeout: Any = _UNSET, retry: Optional[bool] = None) -> Any:
        """Calls a unary method; `retry` None = retry UNAVAILABLE when the method is idempotent."""
        fn = self._callable(name)
        safe = name in _conn.IDEMPOTENT if retry is None else retry
        deadline = self.settings.timeout if timeout is _UNSET else timeout
        tries = 0
        started = time.monotonic()
        while True:
            try:
                return await fn(request, timeout=deadline, metadata=self._metadata)
            except grpc.aio.AioRpcError as e:
                if e.code() == grpc.StatusCode.CANCELLED:
                    raise _deadline_error(from_rpc_error(e, name), deadline, time.monotonic() - started) from None
                if safe and e.code() == grpc.StatusCode.UNAVAILABLE and tries < self.settings.retries:
                    tries += 1
                    delay = _conn.backoff(tries)
                    log.info("%s: daemon unavailable, retry %d in %.2f s", name, tries, delay)
                    await asyncio.sleep(delay)
                    continue
                raise from_rpc_error(e, f"{name} at {self.address}") from None

    async def server_stream(self, name: str, request: Any, *, retry: bool = False) -> AsyncIterator[Any]:
        """Yields a server-streaming method's messages; with `retry`, UNAVAILABLE is retried
        only until the first message has arrived."""
        fn = self._callable(name)
        tries = 0
        while True:
            call = fn(request, metadata=self._metadata)
            received = False
            try:
                async for message in call:
                    received = True
                    yield message
                return
            except grpc.aio.AioRpcError as e:
                if retry and not received and e.code() == grpc.StatusCode.UNAVAILABLE and tries < self.settings.retries:
                    tries += 1
                    await asyncio.sleep(_conn.backoff(tries))
                    continue
                raise from_rpc_error(e, f"{name} at {self.address}") from None
            finally:
                call.cancel()

    async def client_stream(
        self, name: str, requests: AsyncIterator[Any], local_error: Callable[[], Optional[BaseException]]
    ) -> Any:
        """Calls a client-streaming method with `requests`. When they fail, grpc.aio cancels
        the call and raises CancelledError: `local_error()` then says why (else the
        cancellation is the caller's own and goes on)."""
        try:
            return await self._callable(name)(requests, metadata=self._metadata)
        except grpc.aio.AioRpcError as e:
            raise from_rpc_error(e, f"{name} at {self.address}") from None
        except asyncio.CancelledError:
            err = local_error()
            if err is not None:
                raise err from None
            raise

    def bidi(self, name: str, requests: Optional[AsyncIterator[Any]] = None) -> Any:
        """Opens a bidirectional stream: with `requests`, fed from them; without, driven with
        the call's `write`/`done_writing`. Iterate or `read` the call for the responses."""
        if requests is None:
            return self._callable(name)(metadata=self._metadata)
        return self._callable(name)(requests, metadata=self._metadata)


_defaults: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Client]" = weakref.WeakKeyDictionary()


def default_client() -> Client:
    """The client used when none is passed: one per event loop, from the environment."""
    loop = asyncio.get_running_loop()
    client = _defaults.get(loop)
    if client is None:
        client = Client()
        _defaults[loop] = client
    return client


def resolve(client: Optional[Client]) -> Client:
    return client if client is not None else default_client()
