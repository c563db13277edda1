"""``ResilientStreamingTts``: one reply over a streaming TTS primary and its fallbacks, with
retries, until the first audio (``ivr.providers.resilience.first_output``, the same budget and
turn deadline as every stage). The reply's text is kept as it is pushed, so a retry or a
fallback hears all of it; once audio has been yielded nothing is retried (the caller may be
hearing it) and the error goes to the caller as it is.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence

from ivr.providers.resilience import RetryPolicy, WarmChain, first_output
from ivr.tts.base import SpeechAudio, StreamingTextToSpeech, TextToSpeechSession


class ResilientStreamingTts(WarmChain[StreamingTextToSpeech]):
    """``StreamingTextToSpeech``: the primary, then the fallbacks (same output format)."""

    def __init__(self, providers: Sequence[StreamingTextToSpeech], policy: RetryPolicy) -> None:
        if not providers or len({p.output for p in providers}) > 1:
            raise ValueError("streaming TTS providers must give the same audio format")
        super().__init__(providers, policy)
        self.voice = providers[0].voice
        self.output = providers[0].output

    async def open(self, *, first_output_limit: float | None = None) -> ResilientTtsSession:
        return ResilientTtsSession(self.providers, self.policy.limited(first_output_limit))


class ResilientTtsSession:
    def __init__(self, providers: tuple[StreamingTextToSpeech, ...], policy: RetryPolicy) -> None:
        self._providers = providers
        self._policy = policy
        self._texts: list[str] = []
        self._ended = False
        self._cancelled = False
        self._texted = asyncio.Event()
        self._current: TextToSpeechSession | None = None
        self.provider = providers[0].name

    def push_text(self, text: str) -> None:
        if text and not self._ended:
            self._texts.append(text)
            self._texted.set()
            if self._current is not None:
                self._current.push_text(text)

    def end_input(self) -> None:
        self._ended = True
        self._texted.set()
        if self._current is not None:
            self._current.end_input()

    def cancel(self) -> None:
        self._cancelled = True
        self._texted.set()
        if self._current is not None:
            self._current.cancel()

    async def __aiter__(self) -> AsyncIterator[SpeechAudio]:
        await self._texted.wait()  # the budget starts with the first text, not the LLM's wait
        if self._cancelled or not self._texts:
            return
        async for audio in first_output("tts", self._providers, self._attempt, self._policy):
            yield audio

    async def _attempt(
        self, tts: StreamingTextToSpeech, limit: float
    ) -> AsyncIterator[SpeechAudio]:
        session = await tts.open(first_output_limit=limit)
        self._current, self.provider = session, tts.name
        try:
            for text in self._texts:
                session.push_text(text)
            if self._ended:
                session.end_input()
            if self._cancelled:
                session.cancel()
            async for audio in session:
                yield audio
        finally:
            self._current = None
            await session.aclose()

    async def aclose(self) -> None:
        if self._current is not None:
            await self._current.aclose()
