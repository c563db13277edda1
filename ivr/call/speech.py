"""One bot utterance: the task that produces its audio, and what the caller heard of it.

A ``SpeechHandle`` is made for each ``say`` / ``say_stream``. Its producer task turns text into
paced mu-law: text pieces -> sentences -> TTS -> 8 kHz -> mu-law -> the ``AudioPlayer``, one
player segment (and one mark) per sentence, so LLM deltas overlap with synthesis.

``interrupt()`` ends the utterance for good. Everything it must stop happens before its first
``await``: the producer is cancelled and the handle refuses any further write, so even while
the ``clear`` it sends waits on a backed-up socket, no later sentence can slip out behind it.
``wait_for_playout()`` returns ``Spoken``: all of the text once its marks echo, or the words
the caller heard before the interruption. The reply's latency record is ``ivr.call.reply_timing``.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

import structlog

from ivr import phrases
from ivr.audio.codec import pcm16_to_ulaw
from ivr.audio.resample import StreamResampler
from ivr.call.player import AudioPlayer, Segment, heard_prefix
from ivr.call.prompts import PromptCache
from ivr.call.reply_text import ReplyText, provider_failed
from ivr.call.reply_timing import ReplyTiming, TurnRecorder
from ivr.call.streamed_speech import StreamedReply
from ivr.call.turns import CallStats, TurnTimings
from ivr.callio.io import Spoken
from ivr.errors import ProviderError
from ivr.obs import metrics
from ivr.providers.resilience import aclose_stream, turn_deadline
from ivr.tts.base import StreamingTextToSpeech, TextToSpeech

log = structlog.get_logger("ivr.call")

HEARD_MARGIN = 0.15
"""Of heard_within, what sending the first frame and Twilio playing it take (seconds)."""
SENTENCE_QUEUE_SIZE = 4
"""Sentences waiting for TTS: enough to keep synthesis busy, few enough to drop cheaply."""
TTS_BLOCK_S = 0.2
"""TTS audio is resampled, encoded and queued in blocks of about this much once the caller
has enough ahead of them: a provider streaming 40 ms chunks at 4x real time otherwise costs a
resampler call and a queue write per chunk (bench/capacity.py)."""
TTS_LOW_WATER_S = 0.4
"""Less than this queued ahead of what the caller hears, and audio goes out as it comes."""
TTS_READ_EVERY_S = 0.1
TTS_READ_MAX_WAIT_S = 1.0
"""With more than ``TTS_LOW_WATER_S`` in hand, TTS is next read when the caller would be down to
it (at least ``TTS_READ_EVERY_S``, at most ``TTS_READ_MAX_WAIT_S`` later): each read takes what
the server sent meanwhile in one go, not one socket wakeup per 40 ms piece
(``ivr.tts.openai_http``), and at 4x real time the reads grow apart as the audio in hand grows
(a 5 s sentence read in 19, not 27 at a fixed 100 ms; 9 with ``TTS_FILL_FROM_S``:
``tests/test_tts_pacing.py``)."""
TTS_FILL_FROM_S = 0.08
"""Until the caller has ``TTS_LOW_WATER_S``, TTS is read at once while they have less than this,
then when half of what they have has played: the reply's start reached 0.4 s in ~15 reads of
one 40 ms piece each (at 4x real time), a read, a resampling and a queue write apiece; halving
fills it in ~7, the caller never below ~40 ms in hand once they had this."""


class SpeechHandle:
    """One utterance. Start it with ``play_text`` or ``play_cached``, then await
    ``wait_for_playout``; the session calls ``interrupt`` on a barge-in."""

    def __init__(
        self,
        *,
        player: AudioPlayer,
        tts: TextToSpeech,
        prompts: PromptCache,
        interruptible: bool,
        turn: TurnTimings | None = None,
        on_turn: TurnRecorder | None = None,
        stats: CallStats | None = None,
        llm_name: str = "llm",
        heard_within: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        voice: StreamingTextToSpeech | None = None,
    ) -> None:
        """``voice``: a streaming voice speaks text replies, one session each
        (``ivr.call.streamed_speech``); ``tts`` then serves only the prompt cache's key."""
        self.interruptible = interruptible
        self.turn = turn
        """The caller turn this speech answers, if it started after that turn was heard."""
        self._player = player
        self._tts = tts
        self._prompts = prompts
        self._stats = stats or CallStats()
        self._timing = ReplyTiming(
            turn, on_turn=on_turn, clock=clock, llm_name=llm_name, tts_name=tts.name
        )
        self._heard_within = heard_within
        self._clock = clock
        self._segments: list[Segment] = []
        self._producer: asyncio.Task[None] | None = None
        self._interrupted = False
        self._paused = False
        self._heard = ""
        self._unheard = ""
        self._apologised = False
        self._reply_broken = False
        self._voice = voice
        self._streamed: StreamedReply | None = None

    # -- starting -------------------------------------------------------------------------

    def play_text(self, chunks: AsyncIterator[str], *, from_llm: bool) -> None:
        """Speak text as it arrives; ``from_llm`` times the LLM stages of the turn."""
        if self._voice is None:
            self._start(self._produce_text(chunks, from_llm))
            return
        reply = self._streamed = StreamedReply(
            self._voice, open_segment=self._open_segment, write=self._write,
            close_segment=self._player.close_segment, apologise=self._apologise,
            timing=self._timing, stats=self._stats, clock=self._clock,
        )  # fmt: skip
        deadline = heard_deadline(self.turn, self._heard_within)
        self._start(reply.produce(chunks, self.turn if from_llm else None, deadline))

    def play_cached(self, text: str, ulaw: bytes) -> None:
        """Speak pre-synthesised audio of ``text``."""
        self._start(self._produce_cached(text, ulaw))

    def _start(self, produce: Coroutine[Any, Any, None]) -> None:
        if self._producer is not None:
            produce.close()
            raise RuntimeError("a SpeechHandle plays once")
        self._producer = asyncio.ensure_future(produce)

    # -- state ----------------------------------------------------------------------------

    @property
    def interrupted(self) -> bool:
        return self._interrupted

    @property
    def can_be_interrupted(self) -> bool:
        """Interruptible, not interrupted yet, and still producing or playing audio."""
        if not self.interruptible or self._interrupted or self._producer is None:
            return False
        return not self._producer.done() or self._player.speaking

    @property
    def paused(self) -> bool:
        return self._paused

    @property
    def heard_anything(self) -> bool:
        """Some of this utterance's audio has reached the caller's ear (so far, or before
        the pause)."""
        now = self._clock()
        return any(s.heard_fraction(now) > 0.0 for s in self._segments)

    # -- pausing (the caller may be interrupting) -----------------------------------------

    async def pause(self) -> None:
        """Stop the audio now (``clear``) without ending the utterance: the producer goes on,
        the unheard rest is kept. ``resume()`` plays on from the start of the sentence that
        was cut; ``interrupt()`` makes it final."""
        if self._interrupted or self._paused:
            return
        self._paused = True
        log.info("barge_in.paused", pii_heard=self._heard_so_far())
        await self._player.pause()

    def resume(self) -> None:
        if not self._paused or self._interrupted:
            return
        self._paused = False
        self._player.resume()

    # -- ending ---------------------------------------------------------------------------

    async def interrupt(self, trigger: str) -> None:
        """Stop now and drop what the caller has not heard (local queue and Twilio's buffer;
        after a ``pause()`` what was heard before it)."""
        if self._interrupted:
            return
        self._heard = self._heard_so_far()
        said = self._streamed.text if self._streamed else " ".join(s.text for s in self._segments)
        self._unheard = unheard_rest(said, self._heard)
        self._interrupted = True  # from here on the handle refuses to write (see _guard)
        self._paused = False
        if self._streamed is not None:
            self._streamed.cancel()  # the provider stops synthesising now
        if self._producer is not None:
            self._producer.cancel()
        self._stats.barge_ins += 1
        metrics.BARGE_INS.labels(trigger, "interrupted").inc()
        log.info("barge_in", trigger=trigger, pii_heard=self._heard)
        await self._player.interrupt()

    async def wait_for_playout(self) -> Spoken:
        """Until the audio has played (or was interrupted); what the caller heard."""
        producer = self._producer
        if producer is None:
            raise RuntimeError("wait_for_playout() before play_text() / play_cached()")
        try:
            # wait() rather than await: an interrupt cancels the producer, not the waiter.
            await asyncio.wait({producer})
            if not producer.cancelled() and (error := producer.exception()) is not None:
                raise error
            if not self._interrupted:
                for segment in self._segments:
                    await self._player.wait_played(segment)
        finally:
            if not producer.done():  # the waiter itself was cancelled (the call ended)
                producer.cancel()
                await asyncio.wait({producer})
        if self._interrupted:
            return Spoken(text_heard=self._heard, interrupted=True, text_unheard=self._unheard)
        if self._streamed is not None:
            return Spoken(text_heard=self._streamed.spoken())
        # A sentence TTS failed on was never heard: keep only segments that had audio.
        heard = " ".join(s.text for s in self._segments if s.total_bytes > 0)
        return Spoken(text_heard=heard.strip())

    def _heard_so_far(self) -> str:
        now = self._clock()
        if self._streamed is not None:  # to the word, by the provider's word times
            return self._streamed.heard(now)
        return " ".join(heard_prefix(s.text, s.heard_fraction(now)) for s in self._segments).strip()

    # -- the player, behind the interrupt guard -------------------------------------------

    def _guard(self) -> None:
        """An interrupted utterance never writes again. The producer is cancelled too, but a
        child task may run once more before that cancellation reaches it."""
        if self._interrupted:
            raise asyncio.CancelledError

    def _open_segment(self, text: str) -> Segment:
        self._guard()
        segment = self._player.open_segment(text)
        if self.turn is not None and not self._segments:  # time the reply as the caller hears it
            segment.on_first_heard = self._timing.first_heard
        self._segments.append(segment)
        return segment

    async def _write(self, segment: Segment, ulaw: bytes, *, cached: bool = False) -> None:
        self._guard()
        await self._player.write(segment, ulaw)
        self._timing.first_audio(cached=cached)

    # -- producers ------------------------------------------------------------------------

    async def _produce_cached(self, text: str, ulaw: bytes) -> None:
        segment = self._open_segment(text)
        try:
            await self._write(segment, ulaw, cached=True)
        finally:
            self._player.close_segment(segment)

    async def _produce_text(self, chunks: AsyncIterator[str], from_llm: bool) -> None:
        """Text pieces -> sentences -> TTS -> player; LLM deltas overlap with synthesis."""
        sentences: asyncio.Queue[str | None] = asyncio.Queue(maxsize=SENTENCE_QUEUE_SIZE)
        turn = self.turn if from_llm else None
        if (deadline := heard_deadline(self.turn, self._heard_within)) is not None:
            turn_deadline.set(deadline)  # the tasks below (the LLM stream, TTS) inherit it

        async def synthesise() -> None:
            while (sentence := await sentences.get()) is not None:
                await self._synthesise_sentence(sentence)

        async with asyncio.TaskGroup() as group:
            group.create_task(self._split(chunks, sentences, turn))
            group.create_task(synthesise())
        if self._reply_broken:
            await self._apologise()

    async def _split(
        self,
        chunks: AsyncIterator[str],
        sentences: asyncio.Queue[str | None],
        turn: TurnTimings | None,
    ) -> None:
        text = ReplyText(
            self._timing, self._stats, self._clock, first_words=self._tts.first_piece_words
        )
        said_anything = False
        async with contextlib.aclosing(text.pieces(chunks, turn)) as pieces:
            async for piece in pieces:
                said_anything = True
                await sentences.put(piece)
        if text.failed and not said_anything:
            await sentences.put(phrases.LLM_FAILURE)  # cached: see _synthesise_sentence
        await sentences.put(None)

    async def _synthesise_sentence(self, text: str) -> None:
        cached = self._prompts.get(self._tts.voice, text)
        if cached is not None:  # a phrase said before, or one of the gateway's own
            await self._produce_cached(text, cached)
            return
        segment = self._open_segment(text)
        resampler = StreamResampler(self._tts.sample_rate, 8000)
        started = self._timing.tts_started()
        first = True
        failed = False
        block = bytearray()
        block_bytes = round(TTS_BLOCK_S * self._tts.sample_rate) * 2
        try:
            stream = self._tts.synthesize(text)
            try:
                async for pcm in _paced(stream, self._player):
                    if first:
                        first = False
                        self._timing.first_byte(started)
                    block += pcm
                    if len(block) >= block_bytes or self._player.ahead() < TTS_LOW_WATER_S:
                        await self._write_pcm(segment, resampler.push(bytes(block)))
                        block.clear()
            finally:
                # An interrupt that lands while write() waits must still close the TTS stream.
                await aclose_stream(stream)
            await self._write_pcm(segment, resampler.push(bytes(block)) + resampler.flush())
        except ProviderError as exc:
            provider_failed("tts", exc, self._stats)
            failed = True
        finally:
            self._player.close_segment(segment)
        if segment.total_bytes == 0 and not self._has_audio():
            await self._apologise()
        # A reply that ends on a sentence cut off mid-word leaves the caller waiting as surely
        # as one never voiced: apologise at its end (a later sentence voiced clears this).
        self._reply_broken = failed

    def _has_audio(self) -> bool:
        return any(s.total_bytes > 0 for s in self._segments)

    async def _apologise(self) -> None:
        """The reply could not be voiced (or was cut off): say the pre-synthesised apology,
        once, so a dead TTS still gives the caller an answer (it needs no provider)."""
        if self._apologised:
            return
        self._apologised = True
        cached = self._prompts.get(self._tts.voice, phrases.LLM_FAILURE)
        if cached is None:
            log.error("speech.no_apology", detail="the apology was not synthesised at startup")
            return
        await self._produce_cached(phrases.LLM_FAILURE, cached)

    async def _write_pcm(self, segment: Segment, pcm: bytes) -> None:
        if pcm:
            await self._write(segment, pcm16_to_ulaw(pcm))


def unheard_rest(said: str, heard: str) -> str:
    """The words of ``said`` after the ones heard (what was heard is always its first words)."""
    return " ".join(said.split()[len(heard.split()) :])


def heard_deadline(turn: TurnTimings | None, heard_within: float | None) -> float | None:
    """When a failing stage (STT, LLM, TTS) gives up, in time for the cached apology or the
    re-ask to be heard within ``heard_within`` of the caller's end (None: each stage keeps its
    own limit)."""
    if turn is None or heard_within is None:
        return None
    return turn.speech_end + heard_within - HEARD_MARGIN


async def _paced(stream: AsyncIterator[bytes], player: AudioPlayer) -> AsyncIterator[bytes]:
    """``stream``, asked for its next chunk at once while the caller has less than
    ``TTS_FILL_FROM_S``, then once half of what they have has played, and once they have
    ``TTS_LOW_WATER_S``, when they would be down to it (see ``TTS_READ_MAX_WAIT_S``)."""
    async for pcm in stream:
        yield pcm
        ahead = player.ahead()
        if ahead > TTS_LOW_WATER_S:
            spare = ahead - TTS_LOW_WATER_S
            await asyncio.sleep(min(TTS_READ_MAX_WAIT_S, max(TTS_READ_EVERY_S, spare)))
        elif ahead >= TTS_FILL_FROM_S:
            await asyncio.sleep(ahead / 2)
