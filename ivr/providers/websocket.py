"""What the WebSocket providers share (Deepgram, OpenAI Realtime, Cartesia, ElevenLabs):
opening a socket within a limit, and every way one fails as a ``ProviderError`` of the right
kind (see ``ivr.errors``).

    handshake refused (401, 429, 5xx)      STATUS, with the provider's message; 429/5xx retryable
    no connection (refused, DNS, TLS)      CONNECT
    no handshake within the limit          TIMEOUT
    socket dropped (no close frame)        RESET
    closed by the provider with a code     1011/1012/1013/1014: STATUS retryable (server side);
                                           1008 and 4xxx: STATUS, not retryable (refused: key,
                                           quota, bad audio); 1000/1001 mid-answer: RESET
    a message that is not what we expect   PAYLOAD

The client is the ``websockets`` library (already the gateway's, for Twilio's side): its C
frame masking, no compression (permessage-deflate costs CPU on every audio frame and mu-law
barely compresses), pings so a half-open socket is noticed.
"""

from __future__ import annotations

import asyncio
import json
import socket
import ssl
from collections.abc import Mapping
from typing import Any

import websockets
from websockets.asyncio.client import ClientConnection
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus

from ivr.errors import ProviderError, ProviderErrorKind, ProviderStatusError, ProviderTimeout
from ivr.providers.openai_http import payload_error, retry_after

Kind = ProviderErrorKind

PING_INTERVAL = 10.0
"""Seconds between pings: a socket whose peer vanished (no FIN, no RST) is noticed within
``PING_INTERVAL + PING_TIMEOUT`` instead of at the next TCP retransmission timeout."""
PING_TIMEOUT = 10.0
MAX_MESSAGE = 4 * 1024 * 1024
"""Largest message read (a provider's audio chunk is a few kB of base64)."""

_SERVER_SIDE = frozenset({1011, 1012, 1013, 1014})
"""Close codes for a server-side failure (internal error, restart, try again later, bad
gateway): the same request may succeed on a new connection."""


async def open_socket(
    provider: str, url: str, headers: Mapping[str, str], *, limit: float
) -> ClientConnection:
    """The provider's socket, its handshake done within ``limit`` seconds; raises
    ``ProviderError`` (``ProviderStatusError`` for a refused handshake)."""
    timer = asyncio.timeout(limit)
    try:
        async with timer:
            return await websockets.connect(
                url,
                additional_headers=dict(headers),
                open_timeout=None,  # ours, above, names the limit
                ping_interval=PING_INTERVAL,
                ping_timeout=PING_TIMEOUT,
                close_timeout=1.0,
                max_size=MAX_MESSAGE,
                compression=None,
                user_agent_header="ivr",
            )
    except TimeoutError as exc:
        if timer.expired():
            raise ProviderTimeout(provider, limit, phase="connection") from exc
        raise ProviderError(provider, f"cannot connect ({exc})", kind=Kind.CONNECT) from exc
    except InvalidStatus as exc:
        response = exc.response
        body = bytes(response.body or b"")
        error = handshake_error(provider, response.status_code, response.headers, body)
        raise error from exc
    except (InvalidHandshake, OSError, ssl.SSLError, socket.gaierror) as exc:
        detail = f"{type(exc).__name__}: {exc}"
        raise ProviderError(provider, f"cannot connect ({detail})", kind=Kind.CONNECT) from exc


def handshake_error(
    provider: str, status: int, headers: Mapping[str, str], body: bytes
) -> ProviderStatusError:
    """A handshake answered with an HTTP error, with the provider's message when its body
    has one (Deepgram's ``err_msg``, OpenAI's ``error.message``, ElevenLabs' ``detail``)."""
    text = body.decode("utf-8", "replace")
    message = text[:300]
    try:
        parsed = json.loads(text)
    except ValueError:
        parsed = None
    if isinstance(parsed, dict):
        message = str(_first_message(parsed) or message)[:300]
    return ProviderStatusError(provider, status, message, retry_after=retry_after(headers))


def _first_message(body: dict[str, Any]) -> object:
    for key in ("err_msg", "message", "description", "detail", "error"):
        value = body.get(key)
        if isinstance(value, dict):
            return _first_message(value)
        if value:
            return value
    return None


def closed_error(provider: str, exc: ConnectionClosed, *, expected: bool = False) -> ProviderError:
    """The socket closed under us (``expected``: we were waiting for the provider to finish
    and it closed normally, which is then not an error: callers check that first)."""
    frame = exc.rcvd
    if frame is None:  # no close frame: the connection dropped (RST, EOF, ping timeout)
        return ProviderError(provider, f"connection broke ({exc})", kind=Kind.RESET)
    code, reason = frame.code, frame.reason[:200]
    detail = f"closed by the provider with {code}" + (f" ({reason})" if reason else "")
    if code in _SERVER_SIDE:
        return ProviderError(provider, detail, kind=Kind.STATUS, retryable=True)
    if code == 1008 or code >= 4000:
        return ProviderError(provider, detail, kind=Kind.STATUS, retryable=False)
    suffix = "" if expected else " mid-answer"
    return ProviderError(provider, detail + suffix, kind=Kind.RESET)


def parse_json(provider: str, message: str | bytes) -> dict[str, Any]:
    """A provider's JSON message as a dict, or a PAYLOAD error saying what came instead."""
    if isinstance(message, bytes):
        try:
            message = message.decode("utf-8")
        except UnicodeDecodeError:
            raise payload_error(provider, f"binary message of {len(message)} bytes") from None
    try:
        parsed = json.loads(message)
    except ValueError:
        raise payload_error(provider, f"message is not JSON: {message[:80]!r}") from None
    if not isinstance(parsed, dict):
        raise payload_error(provider, f"message is {type(parsed).__name__}, not an object")
    return parsed


def transport_error(provider: str, exc: BaseException) -> ProviderError:
    """Any failure while talking over an open socket, as a ProviderError."""
    if isinstance(exc, ProviderError):
        return exc
    if isinstance(exc, ConnectionClosed):
        return closed_error(provider, exc)
    if isinstance(exc, OSError):
        return ProviderError(provider, f"connection broke ({exc})", kind=Kind.RESET)
    return payload_error(provider, f"unexpected {type(exc).__name__}: {exc}")
