"""``ResilientStt``: an STT primary and its fallbacks, with retries, within one budget
(``ivr.providers.resilience``)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence

from ivr.providers.resilience import (
    RetryPolicy,
    WarmChain,
    aclose_stream,
    check_providers,
    first_output,
)
from ivr.stt.base import SpeechToText, Transcript


class ResilientStt(WarmChain[SpeechToText]):
    """``SpeechToText``: the primary, then the fallbacks, with retries, within one budget."""

    def __init__(self, providers: Sequence[SpeechToText], policy: RetryPolicy) -> None:
        check_providers("stt", providers, "sample_rate")
        super().__init__(providers, policy)
        self.sample_rate = providers[0].sample_rate

    async def transcribe(
        self, pcm16: bytes, *, first_output_limit: float | None = None
    ) -> Transcript:
        """``first_output_limit`` replaces the policy's budget for this call."""

        async def attempt(stt: SpeechToText, limit: float) -> AsyncIterator[Transcript]:
            yield await stt.transcribe(pcm16, first_output_limit=limit)

        policy = self.policy.limited(first_output_limit)
        answers = first_output("stt", self.providers, attempt, policy)
        try:
            return await anext(answers)
        finally:
            await aclose_stream(answers)
