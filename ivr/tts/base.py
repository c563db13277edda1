"""The text-to-speech seam: text in, a stream of PCM16 chunks out."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol


class TextToSpeech(Protocol):
    name: str
    """Short provider label for metrics and logs (bounded cardinality)."""

    sample_rate: int
    """Rate (Hz) of the PCM16 this engine yields; the gateway resamples to 8 kHz."""

    voice: str
    """Voice id, part of the prompt-cache key."""

    def synthesize(
        self, text: str, *, first_output_limit: float | None = None
    ) -> AsyncIterator[bytes]:
        """Yield mono little-endian PCM16 at ``sample_rate`` as soon as each piece is ready.

        Chunks hold whole samples (even byte counts). Cancelling the iteration stops the
        engine's work. ``first_output_limit``: seconds the first audio may take this time, in
        place of the provider's own first-byte limit; None keeps the provider's. Raises
        ``ProviderError`` (``ProviderTimeout`` past a limit) on failure.
        """
        ...

    async def warm(self) -> None:
        """Load what the first call would otherwise wait for (a voice); no-op for HTTP."""
        ...

    async def aclose(self) -> None: ...
