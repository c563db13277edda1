"""The text-to-speech seams.

``TextToSpeech``: one sentence in, a stream of PCM16 chunks out (OpenAI's ``/v1/audio/speech``,
piper, espeak). ``StreamingTextToSpeech``: one reply's text in as it comes, audio out as it is
synthesised, with the times of its words (Cartesia, ElevenLabs over their WebSockets; issue 24).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol

from ivr.providers.streaming import AudioFormat, TimedWord


class TextToSpeech(Protocol):
    name: str
    """Short provider label for metrics and logs (bounded cardinality)."""

    sample_rate: int
    """Rate (Hz) of the PCM16 this engine yields; the gateway resamples to 8 kHz."""

    voice: str
    """Voice id, part of the prompt-cache key."""

    first_piece_words: int | None
    """For an engine whose first audio waits for a whole piece to render (piper): a reply's
    first piece may end after this many words, so it starts sooner; None cuts it at a clause
    or sentence end only (an engine whose first byte hardly grows with the text)."""

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


# ---- streaming ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SpeechAudio:
    """A piece of a reply's audio, and the words whose times the provider sent with it."""

    audio: bytes
    """In the session's output format, whole samples; empty when a message carried only word
    times (Cartesia sends them apart from the audio)."""
    words: tuple[TimedWord, ...] = ()
    """Times from the first byte of the session's audio (Cartesia's word timestamps,
    ElevenLabs' alignment): with the playout position they tell which words the caller heard
    before a barge-in."""


class TextToSpeechSession(Protocol):
    """One reply, spoken as its text comes: a Cartesia context fed with continuations, an
    ElevenLabs stream-input socket.

    Text goes in as the LLM writes it (``push_text``, a sentence or a few tokens at a time,
    never blocking); audio comes out by iterating the session (one consumer). A
    ``ProviderError`` ends the iteration; none is retried once audio has been yielded (the
    caller may be hearing it). Limits: the first audio within the first-output limit of the
    first text (time before any text is the LLM's, not the voice's); after ``end_input`` the
    provider owes all of it, and a gap longer than the stall limit is a ``ProviderTimeout``.
    """

    def push_text(self, text: str) -> None:
        """Queue more of the reply's text, to be spoken after what came before. Never blocks."""
        ...

    def end_input(self) -> None:
        """The reply's text is complete: the iteration ends after its last audio."""
        ...

    def cancel(self) -> None:
        """Barge-in: stop synthesising (the provider's cancel), drop what was not yielded; the
        iteration ends. Never blocks."""
        ...

    def __aiter__(self) -> AsyncIterator[SpeechAudio]:
        """The reply's audio, as it is synthesised."""
        ...

    async def aclose(self) -> None:
        """Release the session (after the reply, or after ``cancel``)."""
        ...


class StreamingTextToSpeech(Protocol):
    """A provider that speaks a reply while its text is still being written."""

    name: str
    """Short provider label for metrics and logs (bounded cardinality)."""

    voice: str
    """Voice id, part of the prompt-cache key."""

    output: AudioFormat
    """What its audio is; the phone's mu-law (``ivr.providers.streaming.PHONE_AUDIO``) goes
    to the caller without a resampling step."""

    async def open(self, *, first_output_limit: float | None = None) -> TextToSpeechSession:
        """A session for one reply; its first audio must come within ``first_output_limit``
        seconds of the first text when given. Raises ``ProviderError``."""
        ...

    async def warm(self) -> None:
        """Connect what the first reply would otherwise wait for; may do nothing."""
        ...

    async def aclose(self) -> None: ...
