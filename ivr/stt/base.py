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


class SpeechToText(Protocol):
    name: str
    """Short provider label for metrics and logs (bounded cardinality)."""

    sample_rate: int
    """Rate (Hz) the engine wants; the gateway resamples whole utterances to it."""

    async def transcribe(self, pcm16: bytes) -> Transcript:
        """Transcribe mono little-endian PCM16 at ``sample_rate``.

        Raises ``ProviderError`` (or ``ProviderTimeout``) on failure.
        """
        ...

    async def warm(self) -> None:
        """Load what the first call would otherwise wait for (a model); no-op for HTTP."""
        ...

    async def aclose(self) -> None: ...
