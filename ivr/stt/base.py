"""The speech-to-text seams.

``SpeechToText``: one finished utterance in, its text out (an upload per utterance: OpenAI's
``/v1/audio/transcriptions``, the offline whisper). ``StreamingSpeechToText``: one connection per
call, audio pushed as it arrives, words back as they are heard with the provider's own word on
the turn (Deepgram live, OpenAI Realtime transcription; issue 24).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol

from ivr.providers.streaming import AudioFormat, TimedWord


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


# ---- streaming ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class InterimWords:
    """The words of the speech in progress as heard so far. They may still change: the next
    ``InterimWords`` or ``FinalWords`` for the same audio replaces them (Deepgram's results with
    ``is_final: false``, OpenAI's transcription deltas)."""

    text: str
    words: tuple[TimedWord, ...] = ()
    """With their times, when the provider gives them."""


@dataclass(frozen=True, slots=True)
class FinalWords:
    """Words the provider will not revise: they follow every word final before them
    (Deepgram's ``is_final: true``, Flux's ``EndOfTurn``, OpenAI's ``transcription.completed``).
    ``text`` may be empty: the audio up to ``audio_end`` held no words."""

    text: str
    words: tuple[TimedWord, ...] = ()
    last_word_probability: float | None = None
    """As ``Transcript.last_word_probability``: how sure it is of the last word."""
    audio_end: float | None = None
    """Seconds from the stream's first audio to the end of the audio these words settle: no
    later words will be about audio before it (a reconnection replays only what follows)."""
    flushed: bool = False
    """The answer to ``finalize()``: every word of the audio pushed before it is final now.
    Each ``finalize()`` gets one, within the session's limit, with empty text when nothing
    was pending (or a ``ProviderTimeout`` ends the iteration)."""


class TurnHintKind(StrEnum):
    SPEECH_STARTED = "speech_started"
    """The caller started speaking (Deepgram ``SpeechStarted``, Flux ``StartOfTurn``)."""
    EAGER_END_OF_TURN = "eager_end_of_turn"
    """The turn is probably over: worth speculating on (Flux ``EagerEndOfTurn``)."""
    TURN_RESUMED = "turn_resumed"
    """The caller went on after an eager end (Flux ``TurnResumed``)."""
    END_OF_TURN = "end_of_turn"
    """The provider judges the turn over (Flux ``EndOfTurn``, Deepgram ``speech_final`` or
    ``UtteranceEnd``)."""


@dataclass(frozen=True, slots=True)
class TurnHint:
    """The provider's own word on the turn: one more input to the gateway's end-of-turn policy
    (``ivr.call.turn_end``), measured like the others, never obeyed blindly."""

    kind: TurnHintKind
    at: float
    """Seconds from the stream's first audio to where the provider places it."""
    confidence: float | None = None
    """The provider's end-of-turn probability (0-1), when it gives one (Flux)."""


SttStreamEvent = InterimWords | FinalWords | TurnHint


class SpeechToTextSession(Protocol):
    """One call's live connection to a streaming STT, from the stream's ``start`` to its end.

    Audio goes in as it arrives (``push``, never blocking); events come out by iterating the
    session (one consumer), in the order the provider sent them. A provider's own session ends
    the iteration with a ``ProviderError`` when its connection fails; the resilient wrapper
    (``ivr.stt.resilient.ResilientStreamingStt``) reconnects within the call, or fails over to
    the next provider, replaying the audio no final words have settled yet, and ends the
    iteration with a ``ProviderError`` only when no provider is left.
    """

    def push(self, audio: bytes) -> None:
        """Queue one frame of audio, in the format the session was opened with, to be sent.
        Never blocks; the queue is bounded and, when full, drops the oldest (counted)."""
        ...

    def finalize(self) -> None:
        """Ask for the final words of all the audio pushed so far now, not at the provider's
        own pause (Deepgram ``Finalize``, OpenAI's buffer commit): the gateway's endpointer
        says the caller has stopped. Never blocks."""
        ...

    def end_input(self) -> None:
        """No more audio: the provider finishes what it has, the iteration ends after its
        last ``FinalWords``. Never blocks."""
        ...

    def forget_through(self, seconds: float) -> None:
        """The audio pushed up to ``seconds`` (the session's clock) holds no words the caller
        is waiting for: a sound that was no turn, or what came before the utterance about to
        be finalised. A session that keeps audio to upload it later (a batch fallback) drops
        it; a streaming one has sent it already, and its words carry times. Never blocks."""
        ...

    def __aiter__(self) -> AsyncIterator[SttStreamEvent]:
        """Interim and final words and turn hints, as they come."""
        ...

    async def aclose(self) -> None:
        """Close the connection now (the call is over); what was not final is dropped."""
        ...


class StreamingSpeechToText(Protocol):
    """A provider that transcribes a call's audio as it is spoken."""

    name: str
    """Short provider label for metrics and logs (bounded cardinality)."""

    accepts: tuple[AudioFormat, ...]
    """The formats it takes as they are, preferred first; the gateway sends the phone's
    mu-law as it arrives when it is one of them (``ivr.providers.streaming.PHONE_AUDIO``)."""

    async def open(
        self, audio: AudioFormat, *, first_output_limit: float | None = None
    ) -> SpeechToTextSession:
        """Connect a session for one call, its audio in ``audio`` (one of ``accepts``), ready
        within ``first_output_limit`` seconds when given. Raises ``ProviderError``."""
        ...

    async def warm(self) -> None:
        """Load or connect what the first call would otherwise wait for; may do nothing."""
        ...

    async def aclose(self) -> None: ...
