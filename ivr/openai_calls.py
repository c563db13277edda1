"""What the three OpenAI-compatible adapters (STT, TTS, LLM) share: waiting on the server under
first-output, stall and total limits, and turning every way that wait can fail into a
``ProviderError`` with the right ``kind`` (see ``ivr.errors``).

The openai SDK raises its own errors for what happens while it sends a request, but the body of
a streamed answer is read through httpx (``httpx2`` in openai>=3) unwrapped, and it parses
chunks without validating them, so a connection reset mid-stream or a ``"choices": null`` chunk
arrives as an httpx error or a TypeError. Everything is mapped here, once.

Everything goes over aiohttp. Speech (``OpenAIEndpoint``) is plain HTTP: a JSON or multipart
request, raw PCM or one JSON answer back. The LLM keeps the openai SDK, over the SDK's own
aiohttp transport (``openai_client``), with each stream chunk left a dict. Per turn, the SDK
over httpx2 cost the gateway ~150 ms of CPU (``bench/provider_cost.py``: an 11 s two-sentence
reply's speech 72 ms, its 40 tokens 34 ms), which capped a process at ~5 turns a second. The
SDK's transport reports aiohttp's errors as httpx2 errors caused by them; ``_transport_error``
reads the aiohttp one first (the SDK's own mapping calls a dropped connection a timeout).
"""

from __future__ import annotations

import asyncio
import contextlib
import email.utils
import importlib
import json
import socket
import ssl
import time
from collections.abc import AsyncIterator, Awaitable, Mapping
from dataclasses import dataclass
from types import ModuleType
from typing import TypeVar

import aiohttp
import httpx
import openai

from ivr.errors import ProviderError, ProviderErrorKind, ProviderStatusError, ProviderTimeout

T = TypeVar("T")
Kind = ProviderErrorKind


def _http_modules() -> tuple[ModuleType, ...]:
    """httpx, plus httpx2 when installed: openai>=3 talks through httpx2, whose exception
    classes are not httpx's."""
    try:
        return (httpx, importlib.import_module("httpx2"))
    except ImportError:
        return (httpx,)


def _classes(name: str) -> tuple[type[BaseException], ...]:
    return tuple(getattr(module, name) for module in _http_modules())


_TIMEOUTS = _classes("TimeoutException")
_NO_CONNECTION = (
    *_classes("ConnectError"),
    *_classes("ProxyError"),
    *_classes("UnsupportedProtocol"),
    ssl.SSLError,
    socket.gaierror,
    ConnectionRefusedError,
)
_TRANSPORT = (*_classes("TransportError"), OSError, EOFError)
_UNPARSABLE = (*_classes("DecodingError"), ValueError, TypeError, AttributeError, KeyError)


ERROR_BODY_LIMIT = 64 * 1024
"""Of an error answer, this much is read for its message."""


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

    def _open_session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
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
        session = self._open_session()
        url = self.base_url + path
        async with session.post(url, json=json_body, data=form) as response:
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
        if self._session is not None:
            await self._session.close()


def status_error(
    provider: str, status: int, headers: Mapping[str, str], body: bytes
) -> ProviderStatusError:
    """An HTTP error answer, with the message of OpenAI's error JSON when there is one."""
    text = body.decode("utf-8", "replace")
    message = text[:500]
    with contextlib.suppress(ValueError):
        parsed = json.loads(text)
        error = parsed.get("error", parsed) if isinstance(parsed, dict) else parsed
        if isinstance(error, dict):
            message = str(error.get("message") or error.get("error") or json.dumps(error))[:500]
        elif isinstance(error, str):
            message = error[:500]
    return ProviderStatusError(provider, status, message, retry_after=retry_after(headers))


def openai_client(
    *, base_url: str, api_key: str, timeout: float | openai.Timeout
) -> openai.AsyncOpenAI:
    """An SDK client over aiohttp (see the module docstring), never retrying: retries are
    ``ivr.providers_resilience``'s decision. ``timeout`` is a backstop only: every wait is
    bounded (and named) by a ``WaitClock``."""
    return openai.AsyncOpenAI(
        base_url=base_url,
        api_key=api_key,
        max_retries=0,
        timeout=timeout,
        http_client=openai.DefaultAioHttpClient(timeout=timeout),
    )


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

    ``transport_timeout`` is the SDK's own (backstop) timeout, reported if that is what fired.
    """
    if isinstance(exc, ProviderError):
        return exc
    if isinstance(exc, openai.APIStatusError):
        after = retry_after(exc.response.headers) if exc.response is not None else None
        return ProviderStatusError(provider, exc.status_code, error_text(exc), retry_after=after)
    if _aiohttp_cause(exc) is not None:  # its transport names it better than the SDK does
        return _transport_error(provider, exc, transport_timeout)
    if isinstance(exc, (openai.APITimeoutError, *_TIMEOUTS)):
        return ProviderTimeout(provider, transport_timeout, phase="answer from the transport")
    if isinstance(exc, openai.APIConnectionError):  # the SDK wraps the httpx error
        cause = exc.__cause__ or exc.__context__ or exc
        return _transport_error(provider, cause, transport_timeout)
    if isinstance(exc, _TRANSPORT):
        return _transport_error(provider, exc, transport_timeout)
    if isinstance(exc, openai.APIResponseValidationError):
        return payload_error(provider, str(exc))
    if isinstance(exc, openai.APIError):  # an error event inside the stream: the server gave up
        detail = f"error event in the stream: {exc.message}"
        return ProviderError(provider, detail, kind=Kind.STATUS, retryable=True)
    if isinstance(exc, _UNPARSABLE):
        return payload_error(provider, f"{type(exc).__name__}: {exc}")
    return payload_error(provider, f"unexpected {type(exc).__name__}: {exc}")


def _transport_error(provider: str, cause: BaseException, timeout: float) -> ProviderError:
    aio = _aiohttp_cause(cause)
    if aio is not None:
        cause = aio
        if isinstance(aio, aiohttp.ClientConnectorError):
            return ProviderError(provider, f"cannot connect ({_describe(aio)})", kind=Kind.CONNECT)
        if isinstance(aio, (aiohttp.ServerTimeoutError, aiohttp.SocketTimeoutError)):
            return ProviderTimeout(provider, timeout, phase="answer from the transport")
        return ProviderError(provider, f"connection broke ({_describe(aio)})", kind=Kind.RESET)
    if isinstance(cause, _TIMEOUTS):
        return ProviderTimeout(provider, timeout, phase="answer from the transport")
    if isinstance(cause, _NO_CONNECTION):
        return ProviderError(provider, f"cannot connect ({_describe(cause)})", kind=Kind.CONNECT)
    return ProviderError(provider, f"connection broke ({_describe(cause)})", kind=Kind.RESET)


def _aiohttp_cause(exc: BaseException) -> aiohttp.ClientError | None:
    """The aiohttp error under an httpx2 error raised by the SDK's aiohttp transport."""
    seen = 0
    current: BaseException | None = exc
    while current is not None and seen < 8:
        if isinstance(current, aiohttp.ClientError):
            return current
        current = current.__cause__ or current.__context__
        seen += 1
    return None


def _describe(exc: BaseException) -> str:
    """``ReadError <- ConnectionResetError: [Errno 104] ...``: httpx errors often have no text
    of their own, the OS error under them does."""
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


def error_text(exc: openai.APIStatusError) -> str:
    body = exc.body
    if isinstance(body, dict):
        message = body.get("message") or body.get("error")
        if message:
            return str(message)
        return json.dumps(body)[:500]
    return exc.response.text[:500] if exc.response is not None else str(exc)


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
