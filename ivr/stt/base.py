"""The speech-to-text seam: one finished utterance in, its text out."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True, slots=True)
class Transcript:
    text: str
    """What the caller said, as the engine heard it ("" when nothing was recognised)."""
    seconds: float
    """Wall time the engine took, for the stage histogram."""
    last_word_probability: float | None = None
    """How sure the engine is of the last word (0-1), when it says. A small model tends to
    turn a dangling word into one that closes the sentence ("for" -> "for it.", "the" ->
    "them."), and then says so with a low probability: the end of turn waits longer."""


class SpeechToText(Protocol):
    name: str
    """Short provider label for metrics and logs (bounded cardinality)."""

    sample_rate: int
    """Rate (Hz) the engine wants; the gateway resamples whole utterances to it."""

    async def transcribe(
        self, pcm16: bytes, *, first_output_limit: float | None = None
    ) -> Transcript:
        """Transcribe mono little-endian PCM16 at ``sample_rate``.

        ``first_output_limit``: seconds the answer may take this time, in place of the
        provider's own limit (a retry or a fallback gets what is left of the stage's budget);
        None keeps the provider's. Raises ``ProviderError`` (``ProviderTimeout`` past the
        limit) on failure.
        """
        ...

    async def warm(self) -> None:
        """Load what the first call would otherwise wait for (a model); no-op for HTTP."""
        ...

    async def aclose(self) -> None: ...
