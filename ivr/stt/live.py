"""One call's connection to a streaming STT, whatever the provider: audio out as it arrives,
events in, the provider's wire protocol left to an ``SttWire`` (``ivr.stt.deepgram``,
``ivr.stt.openai_realtime``).

Two tasks' worth of work, one task: the session's sender (owned by it, cancelled by
``aclose``) writes queued audio and control messages; the consumer's own iteration reads the
socket. Reading only while someone iterates is backpressure: a consumer that stops reading
stops the socket (the ``websockets`` library keeps answering pings meanwhile).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol

import structlog
from websockets.asyncio.client import ClientConnection
from websockets.exceptions import ConnectionClosed, ConnectionClosedOK

from ivr.errors import ProviderTimeout
from ivr.providers.streaming import AudioEncoding, AudioFormat
from ivr.providers.websocket import closed_error, open_socket, transport_error
from ivr.stt.base import FinalWords, SttStreamEvent

log = structlog.get_logger("ivr.stt")


@dataclass(frozen=True, slots=True)
class Finalizing:
    """What a wire does about ``finalize()``."""

    message: str | None
    """Sent to the provider after the audio queued before it (None: nothing to send)."""
    settled: bool
    """Nothing is pending: the answer (an empty flushed ``FinalWords``) is given at once."""


class SttWire(Protocol):
    """One provider's wire protocol for one connection (it may keep state about it)."""

    def opening(self) -> list[str]:
        """Messages sent first (a session configuration), before any audio."""
        ...

    def audio(self, chunk: bytes) -> bytes | str:
        """The message carrying ``chunk`` (binary for Deepgram, JSON + base64 for OpenAI)."""
        ...

    def keepalive(self) -> str | None:
        """A message that keeps a quiet connection open (None: the provider needs none)."""
        ...

    def finalize(self, unsent: bool) -> Finalizing:
        """What ``finalize()`` sends; ``unsent``: audio pushed before it has not gone out yet
        (a replay, a whole utterance at once), so the provider has not heard it."""
        ...

    def close_input(self) -> str | None:
        """The message that ends the input once everything is final (Deepgram CloseStream)."""
        ...

    def parse(self, message: str | bytes) -> list[SttStreamEvent]:
        """The events in one provider message, times from the connection's first audio; an
        error message raises ``ProviderError``, one we cannot use a PAYLOAD error."""
        ...

    def owes_words(self) -> bool:
        """Words were heard that no final has settled yet (or an answer is due for sure)."""
        ...


@dataclass(frozen=True, slots=True)
class LiveLimits:
    finalize: float
    """Seconds from ``finalize()`` to its flushed final words."""
    quiet: float = 0.3
    """Seconds a finalize waits for an answer while nothing is owed (no words pending, all
    audio heard): a provider may then say nothing at all (Deepgram answers ``Finalize``
    "typically when there is a noticeable amount of audio buffered"), and its silence is the
    answer. Owed words wait ``finalize``."""
    keepalive: float = 5.0
    """Seconds without audio after which the wire's keep-alive goes out."""
    max_queued: float = 5.0
    """Seconds of audio queued unsent before the oldest is dropped (a stalled socket)."""


def bytes_per_second(audio: AudioFormat) -> int:
    return audio.sample_rate * (1 if audio.encoding is AudioEncoding.MULAW else 2)


class LiveSttSession:
    """``SpeechToTextSession`` over one open socket (see the module docstring)."""

    def __init__(
        self,
        provider: str,
        socket: ClientConnection,
        wire: SttWire,
        audio: AudioFormat,
        limits: LiveLimits,
    ) -> None:
        self.provider = provider
        self.limits = limits
        self.dropped_seconds = 0.0
        """Audio dropped unsent because the socket could not take it."""
        self._socket = socket
        self._wire = wire
        self._rate = bytes_per_second(audio)
        self._queued: collections.deque[bytes] = collections.deque()
        self._queued_bytes = 0
        self._control: collections.deque[str] = collections.deque()
        self._wake = asyncio.Event()
        self._closing = False  # end_input(): close once the flushed final is in
        self._settle_now = False  # a finalize() the wire answered without the provider
        self._finalize_deadline: float | None = None
        self._asked_at = 0.0  # when finalize() was called
        self._heard_all = True  # the provider had all the audio when finalize() was called
        self._timer: asyncio.Timeout | None = None
        self._sender = asyncio.create_task(self._send_loop(), name=f"{provider}-sender")

    # ---- input (never blocks) -----------------------------------------------------------

    def push(self, audio: bytes) -> None:
        if self._closing or not audio:
            return
        self._queued.append(audio)
        self._queued_bytes += len(audio)
        limit = self.limits.max_queued * self._rate
        while self._queued_bytes > limit and len(self._queued) > 1:
            old = self._queued.popleft()
            self._queued_bytes -= len(old)
            self.dropped_seconds += len(old) / self._rate
        self._wake.set()

    def finalize(self) -> None:
        if self._finalize_deadline is not None:
            return  # one answer covers both
        self._heard_all = not self._queued
        plan = self._wire.finalize(unsent=not self._heard_all)
        if plan.message is not None:
            self._control.append(plan.message)
            self._wake.set()
        now = asyncio.get_running_loop().time()
        self._asked_at = now
        self._finalize_deadline = now + self.limits.finalize
        self._settle_now = plan.settled
        if (when := self._answer_by()) is not None:
            self._reschedule(when)

    def end_input(self) -> None:
        if not self._closing:
            self._closing = True
            self.finalize()

    def forget_through(self, seconds: float) -> None:
        """Nothing to forget: the audio went out as it came (its words carry times)."""

    def _answer_by(self) -> float | None:
        """When the finalize in progress is settled without the provider's answer (None: no
        finalize in progress)."""
        deadline = self._finalize_deadline
        if deadline is None:
            return None
        if self._settle_now:
            return self._asked_at
        if not self._heard_all or self._wire.owes_words():
            return deadline
        return min(deadline, self._asked_at + self.limits.quiet)

    def _reschedule(self, when: float) -> None:
        timer = self._timer
        if timer is not None and (timer.when() is None or when < (timer.when() or 0.0)):
            timer.reschedule(when)

    # ---- output --------------------------------------------------------------------------

    async def __aiter__(self) -> AsyncIterator[SttStreamEvent]:
        loop = asyncio.get_running_loop()
        while True:
            try:
                async with asyncio.timeout_at(self._answer_by()) as self._timer:
                    message = await self._socket.recv()
            except TimeoutError:
                events = self._timed_out(loop.time())
            except ConnectionClosedOK as exc:
                if self._closing:
                    return
                raise closed_error(self.provider, exc) from exc
            except ConnectionClosed as exc:
                raise closed_error(self.provider, exc) from exc
            else:
                events = self._wire.parse(message)
            finally:  # also when the reader is cancelled: a finished timer cannot be moved
                self._timer = None
            for event in events:
                if isinstance(event, FinalWords) and event.flushed:
                    self._finalize_deadline = None
                    self._settle_now = False
                yield event
                if isinstance(event, FinalWords) and event.flushed and self._closing:
                    await self._finish()
                    return

    def _timed_out(self, now: float) -> list[SttStreamEvent]:
        """The finalize's deadline (or the wire's settled answer) came before the provider's."""
        if self._settle_now or not self._wire.owes_words():
            # Nothing was pending: the provider may say nothing at all (``LiveLimits.quiet``),
            # which is an answer too.
            self._settle_now = False
            return [FinalWords("", flushed=True)]
        raise ProviderTimeout(self.provider, self.limits.finalize, phase="final words")

    async def _finish(self) -> None:
        if (message := self._wire.close_input()) is not None:
            with contextlib.suppress(ConnectionClosed):
                await self._socket.send(message)
        await self.aclose()

    # ---- the sender task -----------------------------------------------------------------

    async def _send_loop(self) -> None:
        try:
            for message in self._wire.opening():
                await self._socket.send(message)
            while True:
                try:
                    async with asyncio.timeout(self.limits.keepalive):
                        await self._wake.wait()
                except TimeoutError:
                    if (keepalive := self._wire.keepalive()) is not None:
                        await self._socket.send(keepalive)
                    continue
                self._wake.clear()
                await self._send_queued()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the reader sees the same socket fail and raises
            error = transport_error(self.provider, exc)
            log.info("stt.stream_send_failed", provider=self.provider, error=str(error))

    async def _send_queued(self) -> None:
        if self._queued:
            # Whatever piled up while the last send was in flight goes in one message.
            chunk = b"".join(self._queued)
            self._queued.clear()
            self._queued_bytes = 0
            await self._socket.send(self._wire.audio(chunk))
        while self._control:
            await self._socket.send(self._control.popleft())

    async def aclose(self) -> None:
        self._closing = True
        self._sender.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._sender
        await self._socket.close()


async def open_live(
    provider: str,
    url: str,
    headers: dict[str, str],
    wire: SttWire,
    audio: AudioFormat,
    limits: LiveLimits,
    *,
    limit: float,
) -> LiveSttSession:
    """A session on a new socket, its handshake within ``limit`` seconds."""
    socket = await open_socket(provider, url, headers, limit=limit)
    return LiveSttSession(provider, socket, wire, audio, limits)
