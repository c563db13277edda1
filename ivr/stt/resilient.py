"""``ResilientStt``: an STT primary and its fallbacks, with retries, within one budget
(``ivr.providers.resilience``)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Protocol

from ivr.providers.resilience import RetryPolicy, aclose_stream, check_providers, first_output
from ivr.stt.base import Transcript


class TimedSpeechToText(Protocol):
    """A ``SpeechToText`` that takes a per-call limit (``OpenAIHttpStt``)."""

    @property
    def name(self) -> str: ...
    @property
    def sample_rate(self) -> int: ...
    async def transcribe(
        self, pcm16: bytes, *, first_output_limit: float | None = None
    ) -> Transcript: ...
    async def warm(self) -> None: ...
    async def aclose(self) -> None: ...


class ResilientStt:
    """``SpeechToText``: the primary, then the fallbacks, with retries, within one budget."""

    def __init__(self, providers: Sequence[TimedSpeechToText], policy: RetryPolicy) -> None:
        check_providers("stt", providers, "sample_rate")
        self.providers = tuple(providers)
        self.policy = policy
        self.name = providers[0].name
        self.sample_rate = providers[0].sample_rate

    async def transcribe(self, pcm16: bytes) -> Transcript:
        async def attempt(stt: TimedSpeechToText, limit: float) -> AsyncIterator[Transcript]:
            yield await stt.transcribe(pcm16, first_output_limit=limit)

        answers = first_output("stt", self.providers, attempt, self.policy)
        try:
            return await anext(answers)
        finally:
            await aclose_stream(answers)

    async def warm(self) -> None:
        for provider in self.providers:
            await provider.warm()

    async def aclose(self) -> None:
        for provider in self.providers:
            await provider.aclose()
