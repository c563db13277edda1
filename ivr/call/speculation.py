"""The call side of speculative turns: what a call prefetches while the endpoint silence runs
(the seam is ``ivr.callio.speculation``).

The session transcribes the caller's audio as soon as they pause (``pause_ms``), and hands the
tentative transcript to whoever registered for it (the flow runner, which may prefetch the LLM
reply). Speech for the first sentence of that reply is prefetched here, by text: when the turn
is committed and the reply asks TTS for the same sentence, it gets the prefetched stream.

``SpeculativeSpeech`` wraps the call's ``TextToSpeech``: ``synthesize(text)`` adopts a prefetch
of exactly that text, else asks the engine. ``discard()`` drops every prefetch (the caller went
on talking, or the turn is over).
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from ivr.callio.prefetch import Prefetch
from ivr.tts.base import TextToSpeech

MAX_SPEECH_PREFETCHES = 2
"""Sentences held at once: the first sentence of a reply, and a spare for a re-speculation."""
PREFETCH_READ_EVERY_S = 0.1
"""A prefetched sentence is read this often (its first audio at once): it plays only if the
turn ends on these words, and fewer reads are fewer socket wakeups (``ivr.call.speech``)."""


class SpeculativeSpeech:
    """A ``TextToSpeech`` that serves prefetched sentences first (one call's, not shared)."""

    def __init__(self, inner: TextToSpeech) -> None:
        self.inner = inner
        self.name = inner.name
        self.sample_rate = inner.sample_rate
        self.voice = inner.voice
        self.first_piece_words = inner.first_piece_words
        self._prefetched: dict[str, Prefetch[bytes]] = {}

    def prefetch(self, text: str) -> None:
        if text in self._prefetched:
            return
        while len(self._prefetched) >= MAX_SPEECH_PREFETCHES:
            oldest = next(iter(self._prefetched))
            self._prefetched.pop(oldest).discard()
        self._prefetched[text] = Prefetch(
            "tts", lambda: self.inner.synthesize(text), spacing=PREFETCH_READ_EVERY_S
        )

    def synthesize(
        self, text: str, *, first_output_limit: float | None = None
    ) -> AsyncIterator[bytes]:
        """The prefetched sentence (it keeps the limits it started with), else a new one."""

        def live() -> AsyncIterator[bytes]:
            return self.inner.synthesize(text, first_output_limit=first_output_limit)

        prefetched = self._prefetched.pop(text, None)
        if prefetched is not None:
            if not prefetched.failed_early:
                return prefetched.adopt(live)
            prefetched.discard()
        return live()

    def discard(self) -> None:
        for prefetched in self._prefetched.values():
            prefetched.discard()
        self._prefetched.clear()

    async def warm(self) -> None:
        await self.inner.warm()

    async def aclose(self) -> None:
        """Drop this call's prefetches; the engine itself is shared and stays open."""
        pending = list(self._prefetched.values())
        self._prefetched.clear()
        for prefetched in pending:
            await prefetched.aclose()
