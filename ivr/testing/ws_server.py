"""What the local WebSocket stand-ins for streaming providers share (``deepgram_server``,
``openai_realtime_server``, ``cartesia_server``, ``elevenlabs_server``): a real
``websockets`` server on its own event loop in a background thread (so sync and async tests,
and benchmarks measuring the client's CPU, can use it), the API-key check at the handshake,
and failures injected at the socket the way production breaks:

    WsFault(refuse=401)                       handshake answered with an HTTP error (+ JSON body)
    WsFault(hang_handshake=True)              TCP accepted, no handshake answer ever
    WsFault(after=3, then="close", code=1011) after 3 messages of the real answer, a close frame
    WsFault(after=3, then="error")            the provider's own error message, then its close
    WsFault(after=3, then="drop")             the TCP connection reset (RST), no close frame
    WsFault(after=3, then="stall")            nothing more is sent; the socket stays open
    WsFault(after=3, then="garbage")          a frame that is not the provider's JSON

Each provider's server says what one "message" of its answer is and what its error message
looks like; ``faults`` is a list, one fault per new connection, taken in order.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import struct
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from http import HTTPStatus
from typing import Any, Literal
from urllib.parse import parse_qs, urlsplit

from websockets.asyncio.server import Server, ServerConnection, serve
from websockets.datastructures import Headers
from websockets.exceptions import ConnectionClosed
from websockets.http11 import Request, Response

JsonDict = dict[str, Any]


@dataclass(frozen=True, slots=True)
class WsFault:
    """One connection's failure (see the module docstring)."""

    refuse: int | None = None
    """Answer the handshake with this HTTP status instead of upgrading."""
    hang_handshake: bool = False
    after: int = 0
    """Messages of the real answer sent before ``then`` happens."""
    then: Literal["close", "error", "drop", "stall", "garbage"] = "close"
    code: int = 1011
    """Close code for ``close`` and ``error``."""
    reason: str = ""


@dataclass(slots=True)
class WsConnection:
    """What the server saw of one connection."""

    path: str
    query: dict[str, str]
    headers: dict[str, str]
    opened: float = field(default_factory=time.monotonic)
    received: list[str | bytes] = field(default_factory=list)
    """Every message from the client, in order (audio frames as bytes)."""
    sent: int = 0
    closed: float | None = None

    async def finished(self, limit: float = 2.0) -> WsConnection:
        """This record once the server's handler is done with it (its ``received`` is whole).

        The client's close handshake completes before the server thread has read every
        message it queued, so a test that checks what arrived last waits here first.
        """
        deadline = time.monotonic() + limit
        while self.closed is None:
            if time.monotonic() > deadline:
                raise AssertionError(f"the server still holds {self.path} after {limit} s")
            await asyncio.sleep(0.01)
        return self

    def json_received(self) -> list[JsonDict]:
        out = []
        for message in self.received:
            if isinstance(message, str):
                with contextlib.suppress(ValueError):
                    out.append(json.loads(message))
        return out


class FaultyLink:
    """One connection's sending side, which carries out the connection's fault on time."""

    def __init__(
        self,
        ws: ServerConnection,
        record: WsConnection,
        fault: WsFault | None,
        error_message: Callable[[WsFault], str],
        stopping: asyncio.Event,
    ) -> None:
        self.ws = ws
        self.record = record
        self.fault = fault if fault is not None and fault.refuse is None else None
        self._error_message = error_message
        self._stopping = stopping
        self.broken = False
        """The fault happened: nothing more goes out."""

    async def send(self, message: str | bytes) -> None:
        if self.broken:
            return
        fault = self.fault
        if fault is not None and self.record.sent >= fault.after:
            self.broken = True
            await self._break(fault)
            return
        self.record.sent += 1
        with contextlib.suppress(ConnectionClosed):
            await self.ws.send(message)

    async def send_json(self, body: JsonDict) -> None:
        await self.send(json.dumps(body))

    async def _break(self, fault: WsFault) -> None:
        with contextlib.suppress(ConnectionClosed):
            if fault.then == "garbage":
                await self.ws.send("\x00\x01 not json {")
            elif fault.then == "error":
                await self.ws.send(self._error_message(fault))
                await self.ws.close(fault.code, fault.reason)
            elif fault.then == "close":
                await self.ws.close(fault.code, fault.reason)
            elif fault.then == "drop":
                reset(self.ws)


def reset(ws: ServerConnection) -> None:
    """Abort the TCP connection with an RST (SO_LINGER 0), as a crashed server does."""
    sock = ws.transport.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    ws.transport.abort()


class FakeWsServer:
    """Base of the provider stand-ins: subclasses give ``serve_connection`` and
    ``error_message``; ``auth_ok`` says whether a handshake's credentials are good."""

    name = "fake"

    def __init__(self, *, api_key: str | None = None, host: str = "127.0.0.1", port: int = 0):
        self.api_key = api_key
        self.host, self.port = host, port
        self.faults: list[WsFault] = []
        """One per new connection, in order; a refused handshake takes one too."""
        self.connections: list[WsConnection] = []
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: Server | None = None
        self._stopping: asyncio.Event | None = None
        self._lock = threading.Lock()
        self._pending_fault: dict[int, WsFault | None] = {}
        self._links: set[FaultyLink] = set()

    # ---- what a provider's server says ---------------------------------------------------

    def auth_ok(self, headers: Headers, query: dict[str, str]) -> bool:
        raise NotImplementedError

    def refusal_body(self, status: int) -> JsonDict:
        return {"error": {"message": f"Injected fault: HTTP {status}"}}

    def error_message(self, fault: WsFault) -> str:
        raise NotImplementedError

    async def serve_connection(self, link: FaultyLink) -> None:
        raise NotImplementedError

    # ---- lifecycle -----------------------------------------------------------------------

    @property
    def url(self) -> str:
        return f"ws://{self.host}:{self.port}"

    def start(self) -> FakeWsServer:
        ready = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(ready,), name=f"fake-{self.name}", daemon=True
        )
        self._thread.start()
        if not ready.wait(10) or self._server is None:
            raise RuntimeError(f"fake {self.name} server did not start")
        return self

    def _run(self, ready: threading.Event) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        try:
            loop.run_until_complete(self._serve(ready))
        finally:
            ready.set()
            loop.close()

    async def _serve(self, ready: threading.Event) -> None:
        self._stopping = asyncio.Event()
        async with serve(
            self._handle, self.host, self.port, process_request=self._check,
            compression=None, ping_interval=None, max_size=4 * 1024 * 1024,
        ) as server:  # fmt: skip
            self._server = server
            self.port = next(iter(server.sockets)).getsockname()[1]
            ready.set()
            await self._stopping.wait()

    def stop(self) -> None:
        if self._thread is None or self._loop is None or self._stopping is None:
            return
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self._stopping.set)
        self._thread.join(timeout=10)
        self._thread = None

    def __enter__(self) -> FakeWsServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    async def __aenter__(self) -> FakeWsServer:
        return await asyncio.to_thread(self.start)

    async def __aexit__(self, *exc: object) -> None:
        await asyncio.to_thread(self.stop)

    def arm(self, fault: WsFault) -> None:
        """``fault`` on every connection open now, ``after`` counted from now (a socket shared
        by many requests, as Cartesia's, fails mid-call); ``faults`` serve new connections."""
        loop = self._loop
        assert loop is not None, "start the server first"

        def apply() -> None:
            for link in self._links:
                link.fault = replace(fault, after=link.record.sent + fault.after)

        loop.call_soon_threadsafe(apply)

    # ---- per connection ------------------------------------------------------------------

    async def _check(self, ws: ServerConnection, request: Request) -> Response | None:
        with self._lock:
            fault = self.faults.pop(0) if self.faults else None
        self._pending_fault[id(ws)] = fault
        query = _query(request.path)
        if not self.auth_ok(request.headers, query):
            return _json_response(HTTPStatus.UNAUTHORIZED, self.refusal_body(401))
        if fault is not None and fault.hang_handshake:
            assert self._stopping is not None
            await self._stopping.wait()
        if fault is not None and fault.refuse is not None:
            return _json_response(HTTPStatus(fault.refuse), self.refusal_body(fault.refuse))
        return None

    async def _handle(self, ws: ServerConnection) -> None:
        request = ws.request
        assert request is not None
        record = WsConnection(
            path=urlsplit(request.path).path,
            query=_query(request.path),
            headers={k.lower(): v for k, v in request.headers.raw_items()},
        )
        self.connections.append(record)
        fault = self._pending_fault.pop(id(ws), None)
        link = FaultyLink(ws, record, fault, self.error_message, self._stopping_event())
        self._links.add(link)
        try:
            await self.serve_connection(link)
        except ConnectionClosed:
            pass
        finally:
            self._links.discard(link)
            record.closed = time.monotonic()

    def _stopping_event(self) -> asyncio.Event:
        assert self._stopping is not None
        return self._stopping

    async def wait_stopping(self) -> None:
        await self._stopping_event().wait()

    def last(self) -> WsConnection:
        if not self.connections:
            raise AssertionError(f"fake {self.name}: no connection was made")
        return self.connections[-1]


def later(
    tasks: set[asyncio.Task[None]], delay: float, send: Callable[[], Awaitable[None]]
) -> None:
    """Run ``send()`` after ``delay`` seconds in a task kept in ``tasks`` (the connection's,
    cancelled when it ends)."""

    async def run() -> None:
        await asyncio.sleep(max(0.0, delay))
        await send()

    task = asyncio.create_task(run())
    tasks.add(task)
    task.add_done_callback(tasks.discard)


def _query(path: str) -> dict[str, str]:
    return {k: v[-1] for k, v in parse_qs(urlsplit(path).query).items()}


def _json_response(status: HTTPStatus, body: JsonDict) -> Response:
    data = json.dumps(body).encode()
    headers = Headers([("Content-Type", "application/json"), ("Content-Length", str(len(data)))])
    if status == HTTPStatus.TOO_MANY_REQUESTS:
        headers["Retry-After"] = "0"
    return Response(status.value, status.phrase, headers, data)
