"""Cartesia's TTS WebSocket (``/tts/websocket``): one socket per provider, shared by every
reply of every call, each reply one context (``context_id``) fed with continuations
(``continue: true``) sentence by sentence or token by token, closed with an empty transcript
and ``continue: false``, and cancelled with ``cancel: true`` on barge-in. Audio comes back as
``chunk`` messages in ``pcm_mulaw`` at 8000 Hz (the phone's own format: no resampling), word
times as ``timestamps`` messages (``add_timestamps``; seconds from the context's first audio),
then ``done``; an ``error`` message (``status_code``, ``title``/``message`` or ``error``) ends
the context. Sharing the socket spares each reply a TLS handshake (Cartesia's advice: many
contexts over one socket); if it drops, every reply on it fails with the error and the next
reply opens a new one. A socket that goes silent (a reply stalls and nothing at all came in
on the socket for as long) is dropped the same way: a half-dead connection would otherwise
stall every later reply of every call.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import uuid
from collections.abc import AsyncIterator
from typing import Any

import structlog
from websockets.asyncio.client import ClientConnection

from ivr.errors import ProviderError, ProviderErrorKind, ProviderTimeout
from ivr.providers.openai_http import payload_error
from ivr.providers.streaming import PHONE_AUDIO, TimedWord
from ivr.providers.websocket import open_socket, parse_json, transport_error
from ivr.tts.base import SpeechAudio
from ivr.tts.live import Cancelled, Outbox, SpeechClock

log = structlog.get_logger("ivr.tts")

CARTESIA_URL = "wss://api.cartesia.ai/tts/websocket"
CARTESIA_VERSION = "2025-04-16"
CONTEXT_BACKLOG = 4096
"""Messages one context may hold unread (~5 minutes of audio) before it is failed."""


class CartesiaTts:
    """``StreamingTextToSpeech`` over Cartesia (see the module docstring)."""

    output = PHONE_AUDIO

    def __init__(
        self,
        *,
        api_key: str,
        voice: str,
        model: str = "sonic-2",
        language: str = "en",
        base_url: str = CARTESIA_URL,
        version: str = CARTESIA_VERSION,
        max_buffer_delay_ms: int = 200,
        connect_timeout: float = 1.0,
        first_audio_timeout: float = 1.0,
        stall_timeout: float = 1.0,
        name: str = "cartesia",
    ) -> None:
        self.name = name
        self.voice = voice
        self.url = base_url
        self._headers = {"X-API-Key": api_key, "Cartesia-Version": version}
        self.request: dict[str, Any] = {
            "model_id": model,
            "voice": {"mode": "id", "id": voice},
            "language": language,
            "output_format": {"container": "raw", "encoding": "pcm_mulaw", "sample_rate": 8000},
            "add_timestamps": True,
            "max_buffer_delay_ms": max_buffer_delay_ms,
        }
        self.connect_timeout = connect_timeout
        self.first_audio_timeout = first_audio_timeout
        self.stall_timeout = stall_timeout
        self._link: _Link | None = None
        self._connecting = asyncio.Lock()

    async def _shared_link(self, limit: float) -> _Link:
        async with self._connecting:
            if self._link is None or self._link.failed is not None:
                if self._link is not None:
                    await self._link.aclose()
                socket = await open_socket(self.name, self.url, self._headers, limit=limit)
                self._link = _Link(self.name, socket)
            return self._link

    async def open(self, *, first_output_limit: float | None = None) -> CartesiaSession:
        first = self.first_audio_timeout if first_output_limit is None else first_output_limit
        link = await self._shared_link(min(first, self.connect_timeout))
        clock = SpeechClock(self.name, first=first, stall=self.stall_timeout)
        return CartesiaSession(self, link, clock)

    async def warm(self) -> None:
        """Open the shared socket now, so the first reply does not wait for a handshake."""
        await self._shared_link(self.connect_timeout)

    async def aclose(self) -> None:
        if self._link is not None:
            await self._link.aclose()


class _Link:
    """The shared socket: one reader (a task it owns) hands each message to its context."""

    def __init__(self, provider: str, socket: ClientConnection) -> None:
        self.provider = provider
        self.socket = socket
        self.outbox = Outbox(provider, socket)
        self.contexts: dict[str, asyncio.Queue[dict[str, Any] | ProviderError]] = {}
        self.failed: ProviderError | None = None
        self.last_heard = asyncio.get_running_loop().time()
        """When the socket last brought any message (for any context)."""
        self._reader = asyncio.create_task(self._read(), name=f"{provider}-reader")

    async def _read(self) -> None:
        try:
            async for message in self.socket:
                self.last_heard = asyncio.get_running_loop().time()
                body = parse_json(self.provider, message)
                queue = self.contexts.get(str(body.get("context_id")))
                if queue is None:
                    continue  # a cancelled or finished context's last messages
                try:
                    queue.put_nowait(body)
                except asyncio.QueueFull:
                    self.contexts.pop(str(body.get("context_id")), None)
            error = ProviderError(self.provider, "socket closed", kind=ProviderErrorKind.RESET)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            error = transport_error(self.provider, exc)
        self.failed = error
        log.warning("tts.socket_failed", provider=self.provider, error=str(error))
        for queue in self.contexts.values():
            with contextlib.suppress(asyncio.QueueFull):
                queue.put_nowait(error)

    def stalled(self, error: ProviderTimeout) -> None:
        """A reply on this socket timed out: if the socket brought nothing at all for as
        long, it is dead to us, and the next reply opens a new one."""
        quiet = asyncio.get_running_loop().time() - self.last_heard
        if self.failed is None and quiet >= error.seconds:
            self.failed = error
            log.warning("tts.socket_silent", provider=self.provider, quiet_s=round(quiet, 3))

    async def aclose(self) -> None:
        self._reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._reader
        await self.outbox.aclose()
        await self.socket.close()


class CartesiaSession:
    """One reply: one context on the shared socket (``TextToSpeechSession``)."""

    def __init__(self, tts: CartesiaTts, link: _Link, clock: SpeechClock) -> None:
        self.provider = tts.name
        self.context_id = uuid.uuid4().hex
        self._request = tts.request
        self._link = link
        self._clock = clock
        self._queue: asyncio.Queue[dict[str, Any] | ProviderError] = asyncio.Queue(CONTEXT_BACKLOG)
        link.contexts[self.context_id] = self._queue
        self._sent = False
        self._done = False

    def push_text(self, text: str) -> None:
        if not text or self._clock.ended:
            return
        self._link.outbox.send(
            self._request | {"context_id": self.context_id, "transcript": text, "continue": True}
        )
        self._sent = True
        self._clock.text_pushed()

    def end_input(self) -> None:
        if self._sent and not self._clock.ended:
            self._link.outbox.send(
                self._request | {"context_id": self.context_id, "transcript": "", "continue": False}
            )
        self._clock.input_ended()

    def cancel(self) -> None:
        if self._sent and not self._done:
            self._link.outbox.send({"context_id": self.context_id, "cancel": True})
        self._done = True
        self._clock.cancel()

    async def __aiter__(self) -> AsyncIterator[SpeechAudio]:
        while not self._done:
            if self._clock.ended and not self._sent:
                return
            try:
                item = await self._clock.wait(self._queue.get)
            except Cancelled:
                return
            except ProviderTimeout as exc:
                self._link.stalled(exc)
                raise
            if isinstance(item, ProviderError):
                raise item
            audio = self._message(item)
            if audio is not None:
                yield audio

    def _message(self, body: dict[str, Any]) -> SpeechAudio | None:
        kind = body.get("type")
        if kind == "chunk":
            try:
                audio = base64.b64decode(body["data"], validate=True)
            except (KeyError, TypeError, binascii.Error) as exc:
                raise payload_error(self.provider, f"chunk without base64 audio: {exc}") from exc
            self._clock.audio_arrived()
            return SpeechAudio(audio)
        if kind == "timestamps":
            return SpeechAudio(b"", self._words(body.get("word_timestamps")))
        if kind == "done":
            self._done = True
        elif kind == "error":
            self._done = True
            raise self._error(body)
        return None

    def _words(self, stamps: object) -> tuple[TimedWord, ...]:
        try:
            assert isinstance(stamps, dict)
            return tuple(
                TimedWord(str(w), float(s), float(e))
                for w, s, e in zip(stamps["words"], stamps["start"], stamps["end"], strict=True)
            )
        except (AssertionError, KeyError, TypeError, ValueError) as exc:
            raise payload_error(self.provider, f"word_timestamps unusable: {exc}") from exc

    def _error(self, body: dict[str, Any]) -> ProviderError:
        status = body.get("status_code")
        title, message = body.get("title"), body.get("message") or body.get("error")
        detail = ": ".join(str(part) for part in (status, title, message) if part)
        retryable = isinstance(status, int) and (status >= 500 or status == 429)
        return ProviderError(
            self.provider, f"error message {detail}", kind=ProviderErrorKind.STATUS,
            retryable=retryable,
        )  # fmt: skip

    async def aclose(self) -> None:
        if not self._done and self._sent:
            self.cancel()
        self._link.contexts.pop(self.context_id, None)
