"""The socket a Twilio media stream arrives on, as the call sees it.

Two servers carry media streams: any ASGI server through Starlette's ``WebSocket`` (the
embedded servers of tests and ``running_server``), and ``ivr.media_server`` under ``ivr serve``
(picows frames on uvicorn's own port: a third of the CPU per message, which is most of what a
listening call costs). The call (``ivr.call.stream``) and its handshake (``ivr.control``) are
written once, against ``MediaSocket``.
"""

from __future__ import annotations

from typing import Protocol

from starlette.responses import Response
from starlette.websockets import WebSocket, WebSocketState


class MediaSocket(Protocol):
    @property
    def path(self) -> str:
        """The request's path, percent-decoded, without its query."""
        ...

    def header(self, name: str) -> str:
        """A request header ('' when absent); ``name`` in lower case."""
        ...

    @property
    def connected(self) -> bool:
        """Accepted and not closed by either side."""
        ...

    async def accept(self) -> None: ...

    async def refuse(self, status: int, body: str) -> None:
        """Answer the upgrade with an HTTP error (before ``accept``); a server that has already
        upgraded closes the socket instead."""
        ...

    async def receive(self) -> str | bytes | None:
        """The next message (text as str, binary as bytes); None once the socket closed."""
        ...

    async def send_text(self, text: str) -> None:
        """Send one text message; raises when the socket is closed."""
        ...

    async def close(self, code: int) -> None:
        """Close with ``code`` (before ``accept``: refuse the upgrade, which Twilio sees as 403)."""
        ...


class StarletteMediaSocket:
    """A ``MediaSocket`` over Starlette's WebSocket (any ASGI server)."""

    def __init__(self, ws: WebSocket) -> None:
        self._ws = ws

    @property
    def path(self) -> str:
        return self._ws.url.path

    def header(self, name: str) -> str:
        return self._ws.headers.get(name, "")

    @property
    def connected(self) -> bool:
        return self._ws.application_state == WebSocketState.CONNECTED

    async def accept(self) -> None:
        await self._ws.accept()

    async def refuse(self, status: int, body: str) -> None:
        await self._ws.send_denial_response(Response(body, status_code=status))

    async def receive(self) -> str | bytes | None:
        raw = await self._ws.receive()
        if raw["type"] == "websocket.disconnect":
            return None
        text = raw.get("text")
        return text if text is not None else raw.get("bytes") or b""

    async def send_text(self, text: str) -> None:
        await self._ws.send_text(text)

    async def close(self, code: int) -> None:
        await self._ws.close(code)
