"""What the three OpenAI-compatible adapters (STT, TTS, LLM) share: waiting on the server under
first-output, stall and total limits, and turning every way that wait can fail into a
``ProviderError`` with the right ``kind`` (see ``ivr.errors``).

The openai SDK raises its own errors for what happens while it sends a request, but the body of
a streamed answer is read through httpx (``httpx2`` in openai>=3) unwrapped, and it parses
chunks without validating them, so a connection reset mid-stream or a ``"choices": null`` chunk
arrives as an httpx error or a TypeError. Everything is mapped here, once.

All three talk plain HTTP over aiohttp (``OpenAIEndpoint``): a JSON or multipart request, and
raw PCM, one JSON answer or a server-sent event stream (``sse_event_batches``) back. The openai SDK
did this at 4-8x the CPU (per turn, an 11 s two-sentence reply's speech 72 ms and its 40 tokens
34 ms over httpx2; 28 and 8 over the SDK's aiohttp transport; ``bench/provider_cost.py``), which
capped a process at ~5 turns a second. The wire formats are OpenAI's (tests check them against
the official client).
"""

from __future__ import annotations

import asyncio
import contextlib
import email.utils
import json
import socket
import ssl
import time
import weakref
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Mapping
from dataclasses import dataclass
from typing import TypeVar

import aiohttp
import structlog

from ivr.errors import ProviderError, ProviderErrorKind, ProviderStatusError, ProviderTimeout

T = TypeVar("T")
Kind = ProviderErrorKind


_NO_CONNECTION = (
    aiohttp.ClientConnectorError,
    ssl.SSLError,
    socket.gaierror,
    ConnectionRefusedError,
)
_TIMED_OUT = (aiohttp.ServerTimeoutError, aiohttp.SocketTimeoutError)
_TRANSPORT = (aiohttp.ClientError, OSError, EOFError)
_UNPARSABLE = (ValueError, TypeError, AttributeError, KeyError)


ERROR_BODY_LIMIT = 64 * 1024
"""Of an error answer, this much is read for its message."""

log = structlog.get_logger("ivr.providers")

_ENDPOINTS: weakref.WeakSet[OpenAIEndpoint] = weakref.WeakSet()
"""Every endpoint of the process (its providers'): ``preconnect_idle`` warms them."""


def preconnect_idle(idle_s: float) -> None:
    """Open a connection ahead of use to every provider idle for more than ``idle_s`` (see
    ``OpenAIEndpoint.preconnect``). Called when a caller starts to speak: the turn's requests
    follow within seconds."""
    for endpoint in list(_ENDPOINTS):
        endpoint.preconnect(idle_s)


class OpenAIEndpoint:
    """One OpenAI-compatible server (base URL and key) over an aiohttp session of its own,
    opened in the running loop at the first request.

    ``read_bufsize``: what the session buffers of an answer the consumer is not reading yet
    before it stops reading the socket; the kernel then gathers what the server sends, and the
    next read takes it in one go (see ``ivr.tts.openai_http``). ``read_timeout`` and
    ``connect_timeout`` are backstops: every wait is bounded (and named) by a ``WaitClock``.
    """

    def __init__(
        self,
        base_url: str,
        api_key: str,
        *,
        provider: str,
        read_timeout: float,
        connect_timeout: float = 3.0,
        read_bufsize: int = 64 * 1024,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.provider = provider
        self._headers = {"Authorization": f"Bearer {api_key}", "User-Agent": "ivr"}
        self._timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=connect_timeout, sock_read=read_timeout
        )
        self._read_bufsize = read_bufsize
        self._session: aiohttp.ClientSession | None = None
        self._last_sent: float | None = None
        """When the last request was sent (None: none yet, so no connection is open)."""
        self._preconnecting: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        """The loop the session lives in (an endpoint serves one loop)."""
        _ENDPOINTS.add(self)

    def preconnect(self, idle_s: float) -> None:
        """Open a connection now if none is likely open: no request sent for ``idle_s``
        (servers close idle connections, uvicorn and vLLM after 5 s, and our pool after 30).
        A new connection costs a TCP and a TLS handshake, two round trips, which a request on
        a warm one does not wait for. A ``HEAD`` of the models list opens it (free, and any
        answer, even 404, leaves the connection in the pool); it never fails loudly: the
        request it prepares for will say what is wrong.

        Counted from when the last request was *sent*, whether or not its answer is still
        being read: a server's idle clock runs from when it finished answering, and a TTS
        answer read at the listener's pace (``ivr.call.speech``) is let go seconds after the
        server sent its last byte. Counted from the release, the server closed the connection
        first and the next reply's TTS paid the handshakes (+70 ms at 50 ms away, stop 41)."""
        loop = asyncio.get_running_loop()
        if self._preconnecting is not None:
            return
        if self._loop is not None and self._loop is not loop:  # another loop's (a test's)
            return
        if self._last_sent is not None and time.monotonic() - self._last_sent <= idle_s:
            return
        self._preconnecting = loop.create_task(self._preconnect())

    async def _preconnect(self) -> None:
        try:
            async with self._request("HEAD", "/models"):
                pass
        except Exception as exc:  # the real request reports what is wrong
            log.debug("provider.preconnect_failed", provider=self.provider, error=repr(exc))
        finally:
            self._preconnecting = None

    @contextlib.asynccontextmanager
    async def _request(
        self,
        method: str,
        path: str,
        *,
        json_body: object = None,
        form: aiohttp.FormData | None = None,
    ) -> AsyncIterator[aiohttp.ClientResponse]:
        """One request; its answer released when the block is left."""
        session = self._open_session()
        self._last_sent = time.monotonic()
        url = self.base_url + path
        async with session.request(method, url, json=json_body, data=form) as response:
            yield response

    def _open_session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._loop = asyncio.get_running_loop()
            self._session = aiohttp.ClientSession(
                headers=self._headers,
                timeout=self._timeout,
                read_bufsize=self._read_bufsize,
                connector=aiohttp.TCPConnector(limit=1000, keepalive_timeout=30.0),
            )
        return self._session

    @contextlib.asynccontextmanager
    async def post(
        self, path: str, *, json_body: object = None, form: aiohttp.FormData | None = None
    ) -> AsyncIterator[aiohttp.ClientResponse]:
        """POST to ``base_url + path``; an error status raises ``ProviderStatusError`` with
        the server's message. Leaving the block closes the answer (and, mid-stream, the
        connection: the server stops generating)."""
        async with self._request("POST", path, json_body=json_body, form=form) as response:
            if response.status >= 400:
                body = await response.content.read(ERROR_BODY_LIMIT)
                cause = aiohttp.ClientResponseError(
                    response.request_info, response.history, status=response.status,
                    message=response.reason or "", headers=response.headers,
                )  # fmt: skip
                error = status_error(self.provider, response.status, response.headers, body)
                raise error from cause
            yield response

    async def aclose(self) -> None:
        _ENDPOINTS.discard(self)
        if self._preconnecting is not None:
            self._preconnecting.cancel()
            await asyncio.gather(self._preconnecting, return_exceptions=True)
        if self._session is not None:
            await self._session.close()


def status_error(
    provider: str, status: int, headers: Mapping[str, str], body: bytes
) -> ProviderStatusError:
    """An HTTP error answer, with the message of OpenAI's error JSON when there is one."""
    text = body.decode("utf-8", "replace")
    message = text[:500]
    with contextlib.suppress(ValueError):
        message = error_message(json.loads(text))
    return ProviderStatusError(provider, status, message, retry_after=retry_after(headers))


class StreamErrorEvent(Exception):
    """An ``error`` event inside a server-sent event stream: the server gave up mid-answer."""


MAX_SSE_LINE = 1 << 20
"""Longest server-sent event line taken (bytes): an answer that never ends its line is garbage."""


async def sse_event_batches(content: aiohttp.StreamReader) -> AsyncGenerator[list[object], None]:
    """The JSON data of each server-sent event in ``content``, until ``[DONE]`` or the end: a
    list for each read off the socket, of the events that arrived together. (A loaded loop
    finds several of an LLM's token events at each read; taken line by line, each event cost
    two reads, a timer and a resume of its own.) An ``error`` event (by its ``event:`` name or
    an ``"error"`` key) raises ``StreamErrorEvent``, data that is not JSON ``ValueError``: both
    after the events before it have been handed over."""
    parser = SseParser()
    while not parser.done and parser.error is None:
        chunk = await content.readany()
        events = parser.feed(chunk) if chunk else parser.finish()
        if events:
            yield events
        if not chunk:
            break
    if parser.error is not None:
        raise parser.error


class SseParser:
    """Server-sent events from bytes in pieces of any size (see ``sse_event_batches``)."""

    def __init__(self) -> None:
        self._tail = b""  # an unfinished line
        self._event = ""
        self._data: list[bytes] = []
        self.done = False
        """``[DONE]`` was read: nothing after it counts."""
        self.error: Exception | None = None
        """Why the stream cannot go on (an error event, data that is not JSON, a line too
        long): nothing after it counts either."""

    def feed(self, chunk: bytes) -> list[object]:
        """The events that ``chunk`` completes, up to ``[DONE]`` or an error."""
        if self.done or self.error is not None:
            return []
        lines = (self._tail + chunk if self._tail else chunk).split(b"\n")
        self._tail = lines.pop()
        events: list[object] = []
        for line in lines:
            if self._line(line.rstrip(b"\r"), events):
                return events
        if len(self._tail) > MAX_SSE_LINE:
            self.error = ValueError(f"a server-sent event line longer than {MAX_SSE_LINE} bytes")
        return events

    def finish(self) -> list[object]:
        """The stream ended: its last line and event, had the server not ended them."""
        events: list[object] = []
        if self.done or self.error is not None:
            return events
        tail, self._tail = self._tail, b""
        if not (tail and self._line(tail.rstrip(b"\r"), events)):
            self._line(b"", events)  # no blank line after the last event
        return events

    def _line(self, line: bytes, events: list[object]) -> bool:
        """Take one line; True once nothing more is to be read (``[DONE]`` or an error)."""
        if line:
            field, _, value = line.partition(b":")
            value = value[1:] if value.startswith(b" ") else value
            if field == b"data":
                self._data.append(value)
            elif field == b"event":
                self._event = value.decode("utf-8", "replace")
            return False
        # A blank line ends an event; without data it was a comment or a keep-alive.
        event, data, self._event, self._data = self._event, self._data, "", []
        if not data:
            return False
        try:
            parsed = _event_data(event, data)
        except (StreamErrorEvent, ValueError) as exc:
            self.error = exc
            return True
        if parsed is _DONE:
            self.done = True
            return True
        events.append(parsed)
        return False


_DONE = object()


def _event_data(event: str, data: list[bytes]) -> object:
    text = b"\n".join(data)
    if text == b"[DONE]":
        return _DONE
    parsed = json.loads(text)
    if event == "error" or (isinstance(parsed, dict) and "error" in parsed):
        raise StreamErrorEvent(error_message(parsed))
    return parsed


def error_message(body: object) -> str:
    """The message of an OpenAI error body (``{"error": {"message": ...}}`` and kin)."""
    error = body.get("error", body) if isinstance(body, dict) else body
    if isinstance(error, dict):
        return str(error.get("message") or error.get("error") or json.dumps(error))[:500]
    return str(error)[:500]


@dataclass(frozen=True, slots=True)
class StageLimits:
    """Seconds one provider answer may take."""

    first: float
    """To the first output: audio byte, token, or (STT) the whole answer."""
    stall: float
    """Between later chunks of a streamed answer."""
    total: float
    """Waiting on the server in all (time the consumer spends between chunks is not counted)."""


def provider_error(provider: str, exc: BaseException, *, transport_timeout: float) -> ProviderError:
    """``exc`` (raised while talking to ``provider``) as a ProviderError; raise it ``from exc``.

    ``transport_timeout`` is the HTTP session's own (backstop) read timeout, reported if that is
    what fired.
    """
    if isinstance(exc, ProviderError):
        return exc
    if isinstance(exc, _TIMED_OUT):
        return ProviderTimeout(provider, transport_timeout, phase="answer from the transport")
    if isinstance(exc, _NO_CONNECTION):
        return ProviderError(provider, f"cannot connect ({_describe(exc)})", kind=Kind.CONNECT)
    if isinstance(exc, _TRANSPORT):
        return ProviderError(provider, f"connection broke ({_describe(exc)})", kind=Kind.RESET)
    if isinstance(exc, StreamErrorEvent):  # the server gave up mid-answer
        detail = f"error event in the stream: {exc}"
        return ProviderError(provider, detail, kind=Kind.STATUS, retryable=True)
    if isinstance(exc, _UNPARSABLE):
        return payload_error(provider, f"{type(exc).__name__}: {exc}")
    return payload_error(provider, f"unexpected {type(exc).__name__}: {exc}")


def _describe(exc: BaseException) -> str:
    """``ClientOSError <- ConnectionResetError: [Errno 104] ...``: an HTTP error with no text
    of its own says what the OS error under it says."""
    names = [type(exc).__name__]
    while not str(exc) and (inner := exc.__cause__ or exc.__context__) is not None:
        exc = inner
        names.append(type(exc).__name__)
    return " <- ".join(names) + (f": {exc}" if str(exc) else "")


def payload_error(provider: str, detail: str) -> ProviderError:
    return ProviderError(provider, f"unusable answer: {detail}", kind=Kind.PAYLOAD)


def retry_after(headers: Mapping[str, str]) -> float | None:
    """Seconds from ``retry-after-ms`` (OpenAI) or ``Retry-After`` (seconds or an HTTP date)."""
    try:
        if (ms := headers.get("retry-after-ms")) is not None:
            return max(0.0, float(ms) / 1000)
        if (value := headers.get("retry-after")) is None:
            return None
        if value.strip().replace(".", "", 1).isdigit():
            return max(0.0, float(value))
        when = email.utils.parsedate_to_datetime(value)
        return max(0.0, when.timestamp() - time.time())
    except (TypeError, ValueError):
        return None


class WaitClock:
    """Limits for the waits of one provider answer. Before the first output each wait gets
    what is left of ``limits.first``; after it, ``limits.stall``; all waits together at most
    ``limits.total``. No timer runs while the consumer holds a chunk."""

    def __init__(
        self,
        provider: str,
        limits: StageLimits,
        *,
        first_phase: str,
        transport_timeout: float,
    ) -> None:
        self.provider = provider
        self.limits = limits
        self.first_phase = first_phase
        self.transport_timeout = transport_timeout
        self.spent = 0.0
        self.flowing = False
        """True once the first output arrived: later waits are stall-limited."""

    def output_started(self) -> None:
        self.flowing = True

    def _next(self) -> tuple[float, float, str]:
        """(seconds allowed for the next wait, the configured limit, its name)."""
        limits = self.limits
        if self.flowing:
            allowed, configured, phase = limits.stall, limits.stall, "next chunk"
        else:
            allowed, configured, phase = limits.first - self.spent, limits.first, self.first_phase
        if limits.total - self.spent < allowed:
            allowed, configured, phase = limits.total - self.spent, limits.total, "end of stream"
        return max(0.0, allowed), configured, phase

    async def wait(self, step: Awaitable[T]) -> T:
        """Await one step of the answer; every failure comes out as a ProviderError."""
        seconds, configured, phase = self._next()
        loop = asyncio.get_running_loop()
        started = loop.time()
        timer = asyncio.timeout(seconds)
        try:
            async with timer:
                return await step
        except ProviderError:
            raise
        except TimeoutError as exc:
            if timer.expired():
                raise ProviderTimeout(self.provider, configured, phase=phase) from exc
            raise self._error(exc) from exc
        except Exception as exc:
            raise self._error(exc) from exc
        finally:
            self.spent += loop.time() - started

    def _error(self, exc: BaseException) -> ProviderError:
        return provider_error(self.provider, exc, transport_timeout=self.transport_timeout)
