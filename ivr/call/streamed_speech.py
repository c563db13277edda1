"""One reply through a streaming voice (Cartesia, ElevenLabs): the producer a ``SpeechHandle``
runs when the call's voice is a ``StreamingTextToSpeech`` (``ivr.tts.voice``).

The LLM's text goes to one ``TextToSpeechSession`` as it comes (in the sentence and clause
pieces of ``SentenceChunker``, which keep the provider's prosody and drop markdown); its end is
``end_input``. The session's mu-law goes to the ``AudioPlayer`` as it is (no resampling, no
encoding), all of it one player segment, so its byte ``n`` is ``n / 8000`` seconds into the
provider's audio: with the provider's word times, the playout position says which words the
caller heard (``heard``). ``cancel()`` (barge-in) cancels the session before anything awaits.

The reply keeps the resilience rules of the batch path: retries and the fallback happen in
``ResilientStreamingTts`` before the first audio, within the turn deadline; a reply that could
not be voiced, or was cut off by a failure, ends with the cached apology.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

import structlog

from ivr.call.player import Segment, heard_prefix
from ivr.call.reply_text import ReplyText, provider_failed
from ivr.call.reply_timing import ReplyTiming
from ivr.call.turns import CallStats, TurnTimings
from ivr.errors import ProviderError
from ivr.providers.resilience import turn_deadline
from ivr.providers.streaming import TimedWord
from ivr.tts.base import StreamingTextToSpeech, TextToSpeechSession

log = structlog.get_logger("ivr.call")

WORD_END_SLACK_S = 0.02
"""A word counts as heard once its audio has played to within this of its end (one frame's
rounding in the playout clock)."""


class StreamedReply:
    """One reply's session, its audio in one player segment, and the words' times in it."""

    def __init__(
        self,
        voice: StreamingTextToSpeech,
        *,
        open_segment: Callable[[str], Segment],
        write: Callable[[Segment, bytes], Awaitable[None]],
        close_segment: Callable[[Segment], None],
        apologise: Callable[[], Awaitable[None]],
        timing: ReplyTiming,
        stats: CallStats,
        clock: Callable[[], float],
    ) -> None:
        self._voice = voice
        self._open_segment = open_segment
        self._write = write
        self._close_segment = close_segment
        self._apologise = apologise
        self._timing = timing
        self._stats = stats
        self._clock = clock
        self._started = 0.0
        self._session: TextToSpeechSession | None = None
        self._cancelled = False
        self.pieces: list[str] = []
        """The text given to the session, in order."""
        self.words: list[TimedWord] = []
        """The provider's words, timed from the first byte of the session's audio."""
        self.segment: Segment | None = None
        """The reply's audio at the player (opened with its first audio)."""
        self.failed = False
        """The voice failed: the caller heard the apology (``spoken`` keeps what was voiced)."""

    @property
    def text(self) -> str:
        return " ".join(self.pieces)

    def cancel(self) -> None:
        """Barge-in: the provider stops now; never blocks."""
        self._cancelled = True
        if self._session is not None:
            self._session.cancel()

    # -- what the caller heard ------------------------------------------------------------

    def heard(self, now: float) -> str:
        """The words whose audio the caller has heard by ``now`` (the playout clock)."""
        segment = self.segment
        if segment is None:
            return ""
        return self._text_upto(segment.heard_seconds(now), segment.heard_fraction(now))

    def spoken(self) -> str:
        """After playout without a barge-in: all of the text, or, when the voice failed, the
        words its audio reached."""
        segment = self.segment
        if segment is None or segment.total_bytes == 0:
            return ""
        if not self.failed:
            return self.text
        return self._text_upto(segment.duration, 1.0)  # without word times: the whole text

    def _text_upto(self, seconds: float, fraction: float) -> str:
        """The words of the text whose audio ends by ``seconds``; without the provider's word
        times, ``fraction`` of the text (speech time by characters, as the batch path)."""
        text = self.text
        if not self.words:
            return heard_prefix(text, fraction)
        heard = sum(1 for w in self.words if w.end <= seconds + WORD_END_SLACK_S)
        # The provider's words are the text's, split at whitespace (both providers do so):
        # keep the text as written (its punctuation), cut after that many words.
        return " ".join(text.split()[:heard])

    # -- producing ------------------------------------------------------------------------

    async def produce(
        self, chunks: AsyncIterator[str], turn: TurnTimings | None, deadline: float | None
    ) -> None:
        """Text in, audio out, until the reply is over (cancelled on a barge-in)."""
        if deadline is not None:  # the session's retries and fallback give up in time
            turn_deadline.set(deadline)
        session = self._session = await self._voice.open()
        if self._cancelled:
            session.cancel()
        feed = asyncio.create_task(self._feed(chunks, session, turn), name="reply-text")
        try:
            await self._play(session)
        finally:
            if not feed.done():
                feed.cancel()
            await asyncio.wait({feed})
            await session.aclose()
        if not feed.cancelled() and (error := feed.exception()) is not None:
            raise error
        if self.failed or feed.result():
            await self._apologise()

    async def _feed(
        self, chunks: AsyncIterator[str], session: TextToSpeechSession, turn: TurnTimings | None
    ) -> bool:
        """The LLM's text into the session; True when the LLM failed before saying anything."""
        text = ReplyText(self._timing, self._stats, self._clock)
        try:
            async with contextlib.aclosing(text.pieces(chunks, turn)) as pieces:
                async for piece in pieces:
                    self._push(session, piece)
        finally:
            if not self._cancelled:
                session.end_input()
        return text.failed and not self.pieces

    def _push(self, session: TextToSpeechSession, piece: str) -> None:
        if self._cancelled:  # a delta that was ready when the barge-in came
            return
        if not self.pieces:
            self._started = self._timing.tts_started()
        self.pieces.append(piece)
        if self.segment is not None:
            self.segment.text = self.text
        session.push_text(piece + " ")  # the providers speak a word once its space has come

    async def _play(self, session: TextToSpeechSession) -> None:
        try:
            async for part in session:
                self.words += part.words
                if not part.audio:
                    continue
                if self.segment is None:
                    self._timing.first_byte(self._started)
                    self.segment = self._open_segment(self.text)
                await self._write(self.segment, part.audio)
        except ProviderError as exc:
            provider_failed("tts", exc, self._stats)
            self.failed = True
        finally:
            if self.segment is not None:
                self._close_segment(self.segment)
