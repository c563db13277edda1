"""``ResilientTts``: a TTS primary and its fallbacks, with retries, until the first audio
(``ivr.providers.resilience``)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Protocol

from ivr.providers.resilience import RetryPolicy, check_providers, first_output


class TimedTextToSpeech(Protocol):
    """A ``TextToSpeech`` that takes a per-call first-byte limit (``OpenAIHttpTts``)."""

    @property
    def name(self) -> str: ...
    @property
    def sample_rate(self) -> int: ...
    @property
    def voice(self) -> str: ...
    def synthesize(
        self, text: str, *, first_output_limit: float | None = None
    ) -> AsyncIterator[bytes]: ...
    async def warm(self) -> None: ...
    async def aclose(self) -> None: ...


class ResilientTts:
    """``TextToSpeech``: the primary, then the fallbacks, with retries, until the first audio
    byte; never a retry after it (the caller may already be hearing the sentence)."""

    def __init__(self, providers: Sequence[TimedTextToSpeech], policy: RetryPolicy) -> None:
        check_providers("tts", providers, "sample_rate")
        self.providers = tuple(providers)
        self.policy = policy
        self.name = providers[0].name
        self.sample_rate = providers[0].sample_rate
        self.voice = providers[0].voice

    def synthesize(self, text: str) -> AsyncIterator[bytes]:
        def attempt(tts: TimedTextToSpeech, limit: float) -> AsyncIterator[bytes]:
            return tts.synthesize(text, first_output_limit=limit)

        return first_output("tts", self.providers, attempt, self.policy)

    async def warm(self) -> None:
        for provider in self.providers:
            await provider.warm()

    async def aclose(self) -> None:
        for provider in self.providers:
            await provider.aclose()
