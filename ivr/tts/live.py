"""What the streaming TTS sessions share (``ivr.tts.cartesia``, ``ivr.tts.elevenlabs``): when
a wait for the provider's audio is too long, and words with times built from characters.

The first audio is due ``first`` seconds after the first text (before it, the wait is the
LLM's); after it, the provider owes audio without a gap once the reply's text is complete
(``end_input``): until then a quiet provider may simply be waiting for more text.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

from websockets.asyncio.client import ClientConnection

from ivr.errors import ProviderError, ProviderTimeout
from ivr.providers.streaming import TimedWord
from ivr.providers.websocket import transport_error

JsonDict = dict[str, Any]

T = TypeVar("T")


class Cancelled(Exception):
    """The session was cancelled (barge-in) while waiting: the iteration just ends."""


class SpeechClock:
    """Bounds each wait of one reply's audio (see the module docstring)."""

    def __init__(self, provider: str, *, first: float, stall: float) -> None:
        self.provider = provider
        self.first = first
        self.stall = stall
        self.texted = asyncio.Event()
        self.flowing = False
        self.ended = False
        self.cancelled = False
        self._first_due: float | None = None
        self._timer: asyncio.Timeout | None = None

    def text_pushed(self) -> None:
        if self._first_due is None:
            self._first_due = asyncio.get_running_loop().time() + self.first
            self.texted.set()

    def input_ended(self) -> None:
        self.ended = True
        self.texted.set()  # no text at all: the iteration ends without audio
        if self.flowing:
            self._reschedule(asyncio.get_running_loop().time() + self.stall)

    def cancel(self) -> None:
        self.cancelled = True
        self.texted.set()
        self._reschedule(asyncio.get_running_loop().time())

    def audio_arrived(self) -> None:
        self.flowing = True

    def _deadline(self) -> tuple[float | None, float, str]:
        loop = asyncio.get_running_loop()
        if not self.flowing:
            return self._first_due, self.first, "first audio"
        if self.ended:
            return loop.time() + self.stall, self.stall, "next audio"
        return None, self.stall, "next audio"

    def _reschedule(self, when: float) -> None:
        timer = self._timer
        if timer is not None and (timer.when() is None or when < (timer.when() or 0.0)):
            timer.reschedule(when)

    async def wait(self, step: Callable[[], Awaitable[T]]) -> T:
        """``step()`` under the limit that applies now; ``Cancelled`` after ``cancel()``."""
        if self.cancelled:
            raise Cancelled
        await self.texted.wait()
        if self.cancelled:
            raise Cancelled
        when, limit, phase = self._deadline()
        try:
            async with asyncio.timeout_at(when) as self._timer:
                return await step()
        except TimeoutError:
            if self.cancelled:
                raise Cancelled from None
            raise ProviderTimeout(self.provider, limit, phase=phase) from None
        finally:
            self._timer = None


def words_from_chars(
    chars: Sequence[str], starts: Sequence[float], ends: Sequence[float], offset: float
) -> tuple[list[TimedWord], tuple[str, float, float] | None]:
    """Words (split at whitespace) from per-character times in seconds, shifted by
    ``offset``; the last word is returned apart, unfinished, when the characters do not end
    in whitespace (it may go on in the next message): ``(words, (text, start, end))``."""
    words: list[TimedWord] = []
    text, start, end = "", 0.0, 0.0
    for char, char_start, char_end in zip(chars, starts, ends, strict=False):
        if char.isspace():
            if text:
                words.append(TimedWord(text, start, end))
            text = ""
            continue
        if not text:
            start = char_start + offset
        text += char
        end = char_end + offset
    return words, ((text, start, end) if text else None)


class Outbox:
    """Messages a session sends from sync calls (``push_text``, ``cancel``), written in order
    by one task it owns; ``close_after`` closes the socket once what came before is sent."""

    def __init__(self, provider: str, socket: ClientConnection) -> None:
        self.provider = provider
        self.socket = socket
        self._messages: collections.deque[str | None] = collections.deque()
        self._wake = asyncio.Event()
        self.failed: ProviderError | None = None
        self._task = asyncio.create_task(self._run(), name=f"{provider}-outbox")

    def send(self, message: JsonDict) -> None:
        self._messages.append(json.dumps(message))
        self._wake.set()

    def close_after(self) -> None:
        self._messages.append(None)
        self._wake.set()

    async def _run(self) -> None:
        try:
            while True:
                await self._wake.wait()
                self._wake.clear()
                while self._messages:
                    message = self._messages.popleft()
                    if message is None:
                        await self.socket.close()
                        return
                    await self.socket.send(message)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the reader sees the same socket fail and raises
            self.failed = transport_error(self.provider, exc)

    async def aclose(self, *, drain: float = 0.5) -> None:
        """Send what is queued (a cancel) and close the socket, waiting at most ``drain``."""
        if not self._task.done():
            self.close_after()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(drain):
                    await asyncio.shield(self._task)
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
