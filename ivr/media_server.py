"""Twilio's media streams on picows, on uvicorn's own port (``ivr serve``).

A listening call is 50 small JSON messages a second, and under uvicorn + Starlette each one costs
a Python WebSocket frame parser, an ASGI message dict and two task hand-offs: ~65 us a message on
stop 29's machine, most of what a listening call costs (``bench/ws_floor.py``). picows parses
frames in C and calls back synchronously; here its frames go to the call's receive loop through
one deque: ~34 us a message, the same port and the same HTTP stack for everything else.

How: uvicorn hands a WebSocket upgrade's transport to its ``ws`` protocol class, which is
``MediaServer.protocol`` here. That reads the request line once: a media stream is held unread
while ``authorise_stream`` admits it (signature, draining, token: refused with the same 403 /
503 as under Starlette), then handed to a picows protocol for good (one ``PicowsMediaSocket``
per stream, carried by ``ivr.call.stream.serve_stream``); any other WebSocket goes to uvicorn's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from http import HTTPStatus
from typing import Any, cast
from urllib.parse import unquote

import structlog
from picows import (
    WSCloseCode,
    WSFrame,
    WSListener,
    WSMsgType,
    WSTransport,
)
from picows.picows import WSProtocol  # type: ignore[attr-defined]  # not in its stubs
from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol

from ivr.call.stream import serve_stream
from ivr.control.handshake import authorise_stream
from ivr.gateway import Gateway

log = structlog.get_logger("ivr.media_server")

STREAM_PREFIX = "/twilio/stream/"
MAX_MESSAGE_BYTES = 1024 * 1024
"""Twilio's messages are under 1 KiB. Up to this size a message is taken and the parser says
what is wrong with it (``oversized_frame`` past 64 KiB, as under Starlette); beyond it the
socket is closed (1009) rather than buffered."""
FORBIDDEN = 403
"""What a stream closed before it is accepted is answered with, as under Starlette."""
SERVICE_RESTART = 1012
TRY_AGAIN_LATER = 1013
MAX_QUEUED = 500
"""Messages received and not yet taken by the call (10 s of audio): past it the socket stops
being read (TCP pushes back on the sender) until the call has caught up to half of it."""


class PicowsMediaSocket(WSListener):
    """One media stream's socket: picows' callbacks on one side, ``MediaSocket`` on the other."""

    def __init__(self, path: str, headers: dict[str, str]) -> None:
        self._path = path
        self._headers = headers
        self._transport: WSTransport | None = None
        self._inbox: deque[str | bytes | None] = deque()
        self._waiter: asyncio.Future[None] | None = None
        # Made on the loop it serves; asking asyncio per message costs a getpid() on 3.11.
        self._loop = asyncio.get_running_loop()
        self._reading_paused = False
        self._parts: list[bytes] = []
        self._part_type = WSMsgType.TEXT
        self._ended = False
        self._writable = asyncio.Event()
        self._writable.set()

    # -- picows' side (called from the event loop, synchronously) ------------------------

    def on_ws_connected(self, transport: WSTransport) -> None:
        self._transport = transport

    def on_ws_frame(self, transport: WSTransport, frame: WSFrame) -> None:
        kind = frame.msg_type
        if kind is WSMsgType.TEXT and frame.fin:
            # Twilio's every message, 50 a second a call: one whole text frame, taken without
            # the fragment list and its size sum.
            if self._parts:
                self._parts = []  # a fragmented message cut short by this one is dropped
            payload = frame.get_payload_as_bytes()
            if len(payload) > MAX_MESSAGE_BYTES:
                self._too_big(transport)
                return
            self._take_message(payload, text=True)
            return
        if kind in (WSMsgType.TEXT, WSMsgType.BINARY):
            self._part_type, self._parts = kind, []
        elif kind is WSMsgType.CLOSE:
            with contextlib.suppress(Exception):
                transport.send_close(frame.get_close_code())
            transport.disconnect()
            self._put(None)
            return
        elif kind is not WSMsgType.CONTINUATION:
            return  # PING is answered by picows; PONG needs nothing
        self._parts.append(frame.get_payload_as_bytes())
        if sum(len(p) for p in self._parts) > MAX_MESSAGE_BYTES:
            self._too_big(transport)
            return
        if not frame.fin:
            return
        payload = self._parts[0] if len(self._parts) == 1 else b"".join(self._parts)
        self._parts = []
        self._take_message(payload, text=self._part_type is WSMsgType.TEXT)

    def _take_message(self, payload: bytes, *, text: bool) -> None:
        """A whole message, its size already checked."""
        if text:
            try:
                self._put(payload.decode())
                return
            except UnicodeDecodeError:
                pass  # passed on as bytes: the parser reports it as a bad frame
        self._put(payload)

    def _too_big(self, transport: WSTransport) -> None:
        transport.send_close(WSCloseCode.MESSAGE_TOO_BIG)
        transport.disconnect()
        self._put(None)

    def on_ws_disconnected(self, transport: WSTransport | None) -> None:
        self._put(None)
        self._writable.set()  # a sender waiting for room finds the socket closed

    def pause_writing(self) -> None:
        self._writable.clear()

    def resume_writing(self) -> None:
        self._writable.set()

    def _put(self, message: str | bytes | None) -> None:
        if self._ended:
            return
        self._ended = message is None
        self._inbox.append(message)
        if len(self._inbox) > MAX_QUEUED and not self._reading_paused and self._transport:
            self._reading_paused = True
            self._transport.underlying_transport.pause_reading()
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # -- MediaSocket -----------------------------------------------------------------------

    @property
    def path(self) -> str:
        return self._path

    def header(self, name: str) -> str:
        return self._headers.get(name, "")

    @property
    def connected(self) -> bool:
        transport = self._transport
        return (
            transport is not None
            and not transport.is_disconnected
            and not transport.is_close_frame_sent
        )

    async def accept(self) -> None:
        """picows answered the upgrade before the call began."""

    async def refuse(self, status: int, body: str) -> None:
        # Upgraded already: 1013 (try again later) is what a 503 would have said.
        log.info("stream.refused_after_upgrade", status=status, body=body)
        await self.close(TRY_AGAIN_LATER)

    async def receive(self) -> str | bytes | None:
        inbox = self._inbox
        while not inbox:
            self._waiter = self._loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        message = inbox.popleft()
        if message is None:
            inbox.append(None)  # closed stays closed for whoever asks next
        elif self._reading_paused and len(inbox) <= MAX_QUEUED // 2 and self._transport:
            self._reading_paused = False
            self._transport.underlying_transport.resume_reading()
        return message

    async def send_text(self, text: str) -> None:
        if not self._writable.is_set():
            await self._writable.wait()
        transport = self._transport
        if transport is None or transport.is_disconnected or transport.is_close_frame_sent:
            raise ConnectionResetError("the media stream's socket is closed")
        transport.send(WSMsgType.TEXT, text.encode())

    async def close(self, code: int) -> None:
        transport = self._transport
        if transport is None or transport.is_disconnected:
            return
        if not transport.is_close_frame_sent:
            known = code in {c.value for c in WSCloseCode}  # picows sends only its enum's codes
            transport.send_close(WSCloseCode(code) if known else WSCloseCode.OK)
        transport.disconnect()


class MediaServer:
    """The media streams of one gateway process: each admitted, upgraded and served in a task
    owned here; ``aclose`` closes what is still open when the server stops."""

    def __init__(self, gateway: Gateway) -> None:
        self._gateway = gateway  # its services are read per stream: tests swap them
        self._tasks: set[asyncio.Task[None]] = set()
        self._sockets: set[PicowsMediaSocket] = set()

    @property
    def open_streams(self) -> int:
        """Streams upgraded here and not yet finished."""
        return len(self._sockets)

    def protocol(self, **uvicorn_state: Any) -> asyncio.BaseProtocol:
        """uvicorn's ``ws`` protocol class: called with its config and state per upgrade."""
        return _UpgradeRouter(self, uvicorn_state)

    def admit(self, router: _UpgradeRouter, handshake: _Handshake) -> None:
        task = asyncio.create_task(self._admit_and_serve(router, handshake), name="media-stream")
        self._tasks.add(task)
        task.add_done_callback(self._done)

    async def _admit_and_serve(self, router: _UpgradeRouter, handshake: _Handshake) -> None:
        services = self._gateway.services
        claims = await authorise_stream(
            handshake,
            handshake.path.removeprefix(STREAM_PREFIX),
            auth=services.auth,
            tokens=services.tokens,
            store=services.store,
            draining=services.live.draining,
        )
        if claims is None:
            router.answer(handshake.status, handshake.body)
            return
        socket = PicowsMediaSocket(handshake.path, handshake.headers)
        router.upgrade(socket)
        self._sockets.add(socket)
        try:
            await serve_stream(socket, claims, services)
        finally:
            self._sockets.discard(socket)

    def _done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("stream.handler_failed", exc_info=task.exception())

    async def aclose(self) -> None:
        """Close every open stream (1012, service restart: Twilio may resume the call
        elsewhere through its action URL) and wait for their calls to finish."""
        for socket in list(self._sockets):
            await socket.close(SERVICE_RESTART)
        if self._tasks:
            _, pending = await asyncio.wait(set(self._tasks), timeout=5.0)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)


class _Handshake:
    """A media stream's upgrade request while it is admitted: what ``authorise_stream`` reads
    of it, and the HTTP answer it decides on when it refuses (close before accept = 403)."""

    def __init__(self, path: str, headers: dict[str, str]) -> None:
        self.path = path
        self.headers = headers
        self.status = FORBIDDEN
        self.body = "forbidden"

    @classmethod
    def parse(cls, request: bytes) -> _Handshake:
        # uvicorn rebuilt this request from what it parsed: one line per header, CRLF.
        head = request.partition(b"\r\n\r\n")[0].decode("latin-1").split("\r\n")
        target = head[0].split(" ")[1] if head[0].count(" ") >= 2 else ""
        headers: dict[str, str] = {}
        for line in head[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        return cls(unquote(target.split("?", 1)[0]), headers)

    def header(self, name: str) -> str:
        return self.headers.get(name, "")

    @property
    def connected(self) -> bool:
        return False

    async def accept(self) -> None:
        raise RuntimeError("a stream is accepted by upgrading it, not here")

    async def refuse(self, status: int, body: str) -> None:
        self.status, self.body = status, body

    async def receive(self) -> str | bytes | None:
        return None

    async def send_text(self, text: str) -> None:
        raise ConnectionResetError("the media stream is not upgraded")

    async def close(self, code: int) -> None:
        self.status, self.body = FORBIDDEN, "forbidden"


class _UpgradeRouter(asyncio.Protocol):
    """Takes an upgrade's transport from uvicorn. A media stream's is held (not read) while its
    token is admitted, then answered with an HTTP error or handed to picows for good; any other
    WebSocket goes to uvicorn's own protocol."""

    def __init__(self, server: MediaServer, uvicorn_state: dict[str, Any]) -> None:
        self._server = server
        self._uvicorn_state = uvicorn_state
        self._transport: asyncio.Transport | None = None
        self._next: asyncio.BaseProtocol | None = None
        self._pending = bytearray()
        self._admitting = False
        self._lost = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's TCPTransport has a Transport's methods without being an asyncio.Transport.
        self._transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        if self._next is not None:
            _feed(self._next, data)
            return
        self._pending += data
        if self._admitting or self._transport is None:
            return
        handshake = _Handshake.parse(bytes(self._pending))
        if handshake.path.startswith(STREAM_PREFIX):
            self._admitting = True
            self._transport.pause_reading()
            self._server.admit(self, handshake)
        else:
            self._switch(WebSocketsSansIOProtocol(**self._uvicorn_state))

    def answer(self, status: int, body: str) -> None:
        """Refuse the upgrade with an HTTP error and close."""
        if self._transport is None or self._lost:
            return
        reason = HTTPStatus(status).phrase
        payload = body.encode()
        self._transport.write(
            f"HTTP/1.1 {status} {reason}\r\ncontent-type: text/plain; charset=utf-8\r\n"
            f"content-length: {len(payload)}\r\nconnection: close\r\n\r\n".encode()
            + payload
        )
        self._transport.close()

    def upgrade(self, socket: PicowsMediaSocket) -> None:
        """Hand the connection to picows, which answers 101 and calls ``socket`` back."""
        if self._lost:
            socket.on_ws_disconnected(None)  # the caller left while it was admitted
            return
        self._switch(_picows_protocol(lambda _request: socket))

    def _switch(self, protocol: asyncio.BaseProtocol) -> None:
        transport = self._transport
        assert transport is not None
        self._next = protocol
        protocol.connection_made(transport)
        transport.set_protocol(protocol)
        # From inside uvicorn's first data_received, uvicorn sets this router as the protocol
        # right after it returns: take the transport back for ``protocol`` then.
        asyncio.get_running_loop().call_soon(transport.set_protocol, protocol)
        pending, self._pending = bytes(self._pending), bytearray()
        _feed(protocol, pending)
        if self._admitting:
            transport.resume_reading()

    def eof_received(self) -> bool | None:
        return self._next.eof_received() if isinstance(self._next, asyncio.Protocol) else None

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost = True
        if self._next is not None:
            self._next.connection_lost(exc)


def _feed(protocol: asyncio.BaseProtocol, data: bytes) -> None:
    if isinstance(protocol, asyncio.BufferedProtocol):
        view = memoryview(data)
        while view:
            buffer = memoryview(protocol.get_buffer(len(view)))
            size = min(len(buffer), len(view))
            buffer[:size] = view[:size]
            protocol.buffer_updated(size)
            view = view[size:]
    elif isinstance(protocol, asyncio.Protocol):
        protocol.data_received(data)


def _picows_protocol(factory: Any) -> asyncio.BaseProtocol:
    # picows builds this in ws_create_server; its arguments, in its order (picows is pinned).
    protocol: asyncio.BaseProtocol = WSProtocol(
        None,  # host:port (client side only)
        None,  # path (client side only)
        False,  # is_client_side
        factory,
        logging.getLogger("picows.server"),
        True,  # disconnect_on_exception
        5.0,  # handshake timeout: uvicorn has read the request already
        False,  # auto ping: Twilio's stream carries audio every 20 ms
        20.0,
        20.0,
        1,  # WSAutoPingStrategy.PING_WHEN_IDLE
        True,  # auto pong
        MAX_MESSAGE_BYTES,
        None,  # extra headers
        16 * 1024,  # initial read buffer: it grows for a bigger message
    )
    return protocol
