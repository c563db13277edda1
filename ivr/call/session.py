"""One live call's audio session: the ``CallIO`` the flow runner drives, over Twilio audio.

Inbound: mu-law frames -> PCM16 -> endpointer (VAD at 8 kHz, no resampling on the hot path)
-> finished utterances are upsampled whole and transcribed by the STT worker -> input queue.
Outbound: text -> sentences -> TTS -> resample to 8 kHz -> mu-law -> ``AudioPlayer`` (paced,
marked). Barge-in: caller speech or a key while interruptible speech plays clears Twilio's
buffer, cancels LLM/TTS work and keeps only what the caller heard.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, Literal

import structlog

from ivr.audio.codec import FRAME_BYTES_PCM16, pcm16_to_ulaw, ulaw_to_pcm16
from ivr.audio.endpointer import Endpointer, SpeechEnded, SpeechStarted
from ivr.audio.resample import StreamResampler, resample
from ivr.call.io import (
    CallerInput,
    Digits,
    HungUp,
    ListenSpec,
    NoInput,
    Spoken,
    Utterance,
)
from ivr.call.player import AudioPlayer, Segment, heard_prefix
from ivr.call.prompts import PromptCache
from ivr.call.turns import TurnTimings
from ivr.errors import ProviderError
from ivr.llm.sentences import SentenceChunker
from ivr.obs import metrics
from ivr.stt.base import SpeechToText
from ivr.telephony.twilio import E164, TRANSFER_FAILED_PROMPT
from ivr.tts.base import TextToSpeech

log = structlog.get_logger("ivr.call")

LLM_FAILURE_PROMPT = "Sorry, I'm having trouble answering right now."
INPUT_QUEUE_SIZE = 32
STT_QUEUE_SIZE = 4


@dataclass(frozen=True, slots=True)
class _Key:
    digit: str


@dataclass(slots=True)
class _PendingUtterance:
    pcm16_8k: bytes
    timings: TurnTimings


@dataclass(slots=True, eq=False)
class _Speech:
    """The bot utterance currently playing (one ``say``/``say_stream`` call)."""

    interruptible: bool
    segments: list[Segment] = field(default_factory=list)
    turn: TurnTimings | None = None
    """The caller turn this speech answers, if it started after that turn was heard."""
    interrupted: bool = False
    heard: str | None = None
    producer: asyncio.Task[None] | None = None


@dataclass(slots=True)
class CallEnd:
    """How the call should leave the stream: consumed by the ``<Connect action>`` handler."""

    action: Literal["hangup", "transfer"]
    number: str = ""


class CallSession:
    """Implements ``ivr.call.io.CallIO`` for one Media Stream."""

    def __init__(
        self,
        *,
        player: AudioPlayer,
        endpointer: Endpointer,
        stt: SpeechToText,
        tts: TextToSpeech,
        prompts: PromptCache,
        on_end: Callable[[CallEnd], None],
        llm_name: str = "llm",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._player = player
        self._endpointer = endpointer
        self._stt = stt
        self._tts = tts
        self._prompts = prompts
        self._on_end = on_end
        self._llm_name = llm_name
        self._clock = clock
        self._inputs: asyncio.Queue[_Key | Utterance | HungUp] = asyncio.Queue(INPUT_QUEUE_SIZE)
        self._stt_queue: asyncio.Queue[_PendingUtterance] = asyncio.Queue(STT_QUEUE_SIZE)
        self._pcm_tail = b""
        self._caller_speaking = False
        self._speech_started_at: float | None = None
        """Stream time the current caller utterance began; None when the caller is quiet."""
        self._caller_confirmed = False
        """The current utterance has lasted min_speech_ms: real speech, not a click."""
        self._min_speech_ms = endpointer.config.min_speech_ms
        self._stt_busy = 0
        self._speech: _Speech | None = None
        self._turn: TurnTimings | None = None
        self.turns: list[dict[str, float]] = []
        self._turns_saved = 0
        self.hung_up = False

    # -- inbound (called by the stream's receive loop) ------------------------------------

    async def on_media(self, ulaw: bytes, stream_time: float) -> None:
        """One inbound payload (normally 20 ms); ``stream_time`` is Twilio's timestamp (s)."""
        pcm = self._pcm_tail + ulaw_to_pcm16(ulaw)
        offset = 0
        frame_s = FRAME_BYTES_PCM16 / 16000
        while len(pcm) - offset >= FRAME_BYTES_PCM16:
            frame = pcm[offset : offset + FRAME_BYTES_PCM16]
            t = stream_time + (offset / FRAME_BYTES_PCM16) * frame_s
            offset += FRAME_BYTES_PCM16
            event = self._endpointer.push(frame, t)
            if event is not None:
                await self._on_endpoint(event, t + frame_s)
            elif self._speech_started_at is not None and not self._caller_confirmed:
                await self._confirm_speech()
        self._pcm_tail = pcm[offset:]

    async def _confirm_speech(self) -> None:
        """Barge in only once the sound has lasted min_speech_ms: a click or a cough that the
        endpointer will discard must not cut the bot off."""
        if self._endpointer.voiced_ms >= self._min_speech_ms:
            self._caller_confirmed = True
            await self._barge_in("speech")

    async def _on_endpoint(self, event: object, stream_now: float) -> None:
        if isinstance(event, SpeechStarted):
            self._caller_speaking = True
            self._speech_started_at = event.t
            self._caller_confirmed = False
            await self._confirm_speech()
        elif isinstance(event, SpeechEnded):
            self._end_caller_speech()
            now = self._clock()
            # Map stream time back to our clock: the caller stopped (stream_now - end) ago.
            speech_end = now - max(0.0, stream_now - event.t_end_of_speech)
            pending = _PendingUtterance(
                event.audio, TurnTimings(speech_end=speech_end, endpoint=now)
            )
            if self._stt_queue.full():
                metrics.INBOUND_DROPPED.inc()
                self._stt_queue.get_nowait()
            self._stt_queue.put_nowait(pending)
        else:  # discarded: too short to be speech
            self._end_caller_speech()

    def _end_caller_speech(self) -> None:
        self._caller_speaking = False
        self._caller_confirmed = False
        self._speech_started_at = None

    def _caller_answering(self) -> bool:
        """Speech in progress or being transcribed: an answer is on its way."""
        return self._caller_speaking or self._stt_busy > 0 or not self._stt_queue.empty()

    def _caller_has_the_floor(self) -> bool:
        """The caller is talking, or has said or pressed something not yet acted on."""
        answer_on_its_way = self._stt_busy > 0 or not self._stt_queue.empty()
        return self._caller_confirmed or answer_on_its_way or not self._inputs.empty()

    async def on_dtmf(self, digit: str) -> None:
        await self._barge_in("dtmf")
        self._put_input(_Key(digit))

    def on_mark(self, name: str) -> None:
        self._player.on_mark(name)

    def on_hangup(self) -> None:
        self.hung_up = True
        self._put_input(HungUp())

    def _put_input(self, item: _Key | Utterance | HungUp) -> None:
        if self._inputs.full():  # the flow is not listening; keep the newest input
            self._inputs.get_nowait()
        self._inputs.put_nowait(item)

    # -- STT worker (run in the call's task group) ----------------------------------------

    async def run_stt(self) -> None:
        while True:
            pending = await self._stt_queue.get()
            self._stt_busy += 1
            try:
                utterance = await self._transcribe(pending)
            finally:
                self._stt_busy -= 1
            self._put_input(utterance)

    async def _transcribe(self, pending: _PendingUtterance) -> Utterance:
        timings = pending.timings
        timings.stt_start = self._clock()
        audio = resample(pending.pcm16_8k, 8000, self._stt.sample_rate)
        try:
            result = await self._stt.transcribe(audio)
            text = result.text.strip()
        except ProviderError as exc:
            metrics.PROVIDER_ERRORS.labels("stt", self._stt.name, type(exc).__name__).inc()
            log.warning("stt.failed", error=str(exc), retryable=exc.retryable)
            text = ""
        timings.stt_end = self._clock()
        metrics.STT_LATENCY.labels(self._stt.name).observe(timings.stt_end - timings.endpoint)
        self._turn = timings
        log.info("caller.said", pii_text=text, stt_s=round(timings.stt_end - timings.stt_start, 3))
        return Utterance(text=text, latency={"stt": timings.stt_end - timings.stt_start})

    # -- CallIO: listening ----------------------------------------------------------------

    async def listen(self, spec: ListenSpec) -> CallerInput:
        deadline = self._clock() + spec.no_input_timeout
        digits = ""
        digit_deadline = deadline
        while True:
            now = self._clock()
            if digits:
                wait = digit_deadline - now
            elif self._caller_answering():
                wait = 0.25  # the caller is mid-answer: never time out on them
                deadline = max(deadline, now + 0.25)
            else:
                wait = deadline - now
            try:
                item = await asyncio.wait_for(self._inputs.get(), max(0.0, wait))
            except TimeoutError:
                if digits:
                    return Digits(digits)
                if self._clock() >= deadline and not self._caller_answering():
                    return NoInput()
                continue
            if isinstance(item, HungUp):
                return item
            if isinstance(item, _Key):
                if not spec.dtmf:
                    continue
                if spec.finish_on_key and item.digit == spec.finish_on_key:
                    return Digits(digits)
                digits += item.digit
                if spec.num_digits is not None and len(digits) >= spec.num_digits:
                    return Digits(digits)
                digit_deadline = self._clock() + spec.inter_digit_timeout
                continue
            if spec.speech and not digits:
                return item

    # -- CallIO: speaking -----------------------------------------------------------------

    async def say(self, text: str, *, interruptible: bool = True) -> Spoken:
        cached = self._prompts.get(self._tts.voice, text)
        if cached is not None:
            return await self._speak_cached(text, cached, interruptible)

        async def one() -> AsyncIterator[str]:
            yield text

        return await self._speak(one(), interruptible, from_llm=False)

    async def say_stream(self, chunks: AsyncIterator[str], *, interruptible: bool = True) -> Spoken:
        return await self._speak(chunks, interruptible, from_llm=True)

    async def _speak_cached(self, text: str, ulaw: bytes, interruptible: bool) -> Spoken:
        speech = _Speech(interruptible)

        async def produce() -> None:
            segment = self._player.open_segment(text)
            speech.segments.append(segment)
            await self._player.write(segment, ulaw)
            self._player.close_segment(segment)
            self._mark_first_audio(speech, cached=True)

        return await self._run_speech(speech, produce())

    async def _speak(
        self, chunks: AsyncIterator[str], interruptible: bool, from_llm: bool
    ) -> Spoken:
        speech = _Speech(interruptible)
        return await self._run_speech(speech, self._produce(chunks, speech, from_llm))

    async def _run_speech(self, speech: _Speech, produce: Coroutine[Any, Any, None]) -> Spoken:
        speech.turn, self._turn = self._turn, None
        if speech.interruptible and self._caller_has_the_floor():
            # The caller is talking (they went on after a pause, or barged into the previous
            # prompt) or has answered already: speaking now would talk over them or answer
            # half a sentence. Their input comes through listen().
            produce.close()
            metrics.BARGE_INS.labels("before_start").inc()
            return Spoken(text_heard="", interrupted=True)
        self._speech = speech
        speech.producer = asyncio.ensure_future(produce)
        try:
            # wait() rather than await: a barge-in cancels the producer, not us.
            await asyncio.wait({speech.producer})
            if not speech.producer.cancelled() and speech.producer.exception() is not None:
                raise speech.producer.exception()  # type: ignore[misc]
            if not speech.interrupted:
                for segment in speech.segments:
                    await self._player.wait_played(segment)
        finally:
            if not speech.producer.done():
                speech.producer.cancel()
                await asyncio.wait({speech.producer})
            self._speech = None
        if speech.interrupted:
            return Spoken(text_heard=speech.heard or "", interrupted=True)
        # A sentence TTS failed on was never heard: keep only segments that had audio.
        heard = " ".join(s.text for s in speech.segments if s.total_bytes > 0)
        return Spoken(text_heard=heard.strip())

    async def _produce(self, chunks: AsyncIterator[str], speech: _Speech, from_llm: bool) -> None:
        """Text pieces -> sentences -> TTS -> player; LLM deltas overlap with synthesis."""
        sentences: asyncio.Queue[str | None] = asyncio.Queue(maxsize=4)

        async def split() -> None:
            chunker = SentenceChunker()
            turn = speech.turn if from_llm else None
            said_anything = False
            try:
                if turn is not None:
                    turn.llm_start = self._clock()
                async for delta in chunks:
                    if turn is not None and turn.llm_first_token is None:
                        turn.llm_first_token = self._clock()
                        metrics.LLM_TTFT.labels(self._llm_name).observe(
                            turn.llm_first_token - turn.llm_start  # type: ignore[operator]
                        )
                    for piece in chunker.push(delta):
                        said_anything = True
                        await self._queue_piece(sentences, piece, turn)
                for piece in chunker.flush():
                    said_anything = True
                    await self._queue_piece(sentences, piece, turn)
            except ProviderError as exc:
                metrics.PROVIDER_ERRORS.labels("llm", self._llm_name, type(exc).__name__).inc()
                log.warning("llm.failed", error=str(exc), retryable=exc.retryable)
                if not said_anything:
                    await sentences.put(LLM_FAILURE_PROMPT)
            finally:
                await _aclose(chunks)  # closes the provider's HTTP stream on barge-in too
            await sentences.put(None)

        async def synthesise() -> None:
            while (sentence := await sentences.get()) is not None:
                await self._synthesise_segment(sentence, speech)

        async with asyncio.TaskGroup() as group:
            group.create_task(split())
            group.create_task(synthesise())

    async def _queue_piece(
        self, sentences: asyncio.Queue[str | None], piece: str, turn: TurnTimings | None
    ) -> None:
        if turn is not None and turn.first_clause is None:
            turn.first_clause = self._clock()
        await sentences.put(piece)

    async def _synthesise_segment(self, text: str, speech: _Speech) -> None:
        segment = self._player.open_segment(text)
        speech.segments.append(segment)
        resampler = StreamResampler(self._tts.sample_rate, 8000)
        turn = speech.turn
        started = self._clock()
        first = True
        if turn is not None and turn.tts_start is None:
            turn.tts_start = started
        try:
            stream = self._tts.synthesize(text)
            try:
                async for pcm in stream:
                    if first:
                        first = False
                        now = self._clock()
                        metrics.TTS_TTFB.labels(self._tts.name).observe(now - started)
                        if turn is not None and turn.tts_first_byte is None:
                            turn.tts_first_byte = now
                    await self._write_pcm(segment, resampler.push(pcm), speech)
            finally:
                # A barge-in that lands while write() waits must still close the TTS stream.
                await _aclose(stream)
            await self._write_pcm(segment, resampler.flush(), speech)
        except ProviderError as exc:
            metrics.PROVIDER_ERRORS.labels("tts", self._tts.name, type(exc).__name__).inc()
            log.warning("tts.failed", error=str(exc), retryable=exc.retryable)
        finally:
            self._player.close_segment(segment)

    async def _write_pcm(self, segment: Segment, pcm: bytes, speech: _Speech) -> None:
        if pcm:
            await self._player.write(segment, pcm16_to_ulaw(pcm))
            self._mark_first_audio(speech, cached=False)

    def _mark_first_audio(self, speech: _Speech, *, cached: bool) -> None:
        """Close the turn's latency record once its first audio is queued for sending."""
        turn = speech.turn
        if turn is None or turn.first_audio is not None:
            return
        turn.first_audio = self._clock()
        turn.cached_prompt = cached
        parts = turn.observe()
        self.turns.append(parts)
        log.info("turn.latency", **{k: round(v, 4) for k, v in parts.items()})

    def unsaved_turns(self) -> list[dict[str, float]]:
        """Turn latencies not yet handed to the call store (each is handed out once)."""
        fresh = self.turns[self._turns_saved :]
        self._turns_saved = len(self.turns)
        return fresh

    # -- barge-in -------------------------------------------------------------------------

    async def _barge_in(self, trigger: str) -> None:
        speech = self._speech
        if speech is None or not speech.interruptible or speech.interrupted:
            return
        if not self._player.speaking and speech.producer is not None and speech.producer.done():
            return
        now = self._clock()
        speech.heard = " ".join(
            heard_prefix(s.text, s.heard_fraction(now)) for s in speech.segments
        ).strip()
        speech.interrupted = True
        metrics.BARGE_INS.labels(trigger).inc()
        log.info("barge_in", trigger=trigger, pii_heard=speech.heard)
        await self._player.interrupt()
        if speech.producer is not None:
            speech.producer.cancel()

    # -- CallIO: leaving ------------------------------------------------------------------

    async def transfer(self, number: str) -> None:
        if not E164.fullmatch(number):
            # A template that rendered empty, or a number a caller or a model made up: never
            # dial it. Say so and end the call rather than loop or dial garbage.
            log.error("transfer.invalid_number", pii_number=number)
            metrics.PROVIDER_ERRORS.labels("transfer", "twilio", "invalid_number").inc()
            await self.say(TRANSFER_FAILED_PROMPT, interruptible=False)
            self._on_end(CallEnd("hangup"))
            return
        self._on_end(CallEnd("transfer", number))

    async def hangup(self) -> None:
        self._on_end(CallEnd("hangup"))


async def _aclose(stream: object) -> None:
    """Close an async generator (the seams promise only an AsyncIterator)."""
    aclose = getattr(stream, "aclose", None)
    if aclose is not None:
        await aclose()
