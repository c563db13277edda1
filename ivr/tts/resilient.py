"""``ResilientTts``: a TTS primary and its fallbacks, with retries, until the first audio
(``ivr.providers.resilience``)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence

from ivr.providers.resilience import RetryPolicy, WarmChain, check_providers, first_output
from ivr.tts.base import TextToSpeech


class ResilientTts(WarmChain[TextToSpeech]):
    """``TextToSpeech``: the primary, then the fallbacks, with retries, until the first audio
    byte; never a retry after it (the caller may already be hearing the sentence)."""

    def __init__(self, providers: Sequence[TextToSpeech], policy: RetryPolicy) -> None:
        check_providers("tts", providers, "sample_rate")
        super().__init__(providers, policy)
        self.sample_rate = providers[0].sample_rate
        self.voice = providers[0].voice
        self.first_piece_words = providers[0].first_piece_words

    def synthesize(
        self, text: str, *, first_output_limit: float | None = None
    ) -> AsyncIterator[bytes]:
        """``first_output_limit`` replaces the policy's budget for this call."""

        def attempt(tts: TextToSpeech, limit: float) -> AsyncIterator[bytes]:
            return tts.synthesize(text, first_output_limit=limit)

        policy = self.policy.limited(first_output_limit)
        return first_output("tts", self.providers, attempt, policy)
