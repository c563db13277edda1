"""One live call's audio session: the ``CallIO`` the flow runner drives, over Twilio audio.

Inbound: mu-law frames -> PCM16 -> endpointer (VAD at 8 kHz, no resampling on the hot path)
-> finished utterances are upsampled whole and transcribed by the STT worker -> input queue
-> ``listen()``. Outbound: each ``say`` / ``say_stream`` is a ``SpeechHandle`` (``speech.py``).
Barge-in: caller speech (once it has lasted ``min_speech_ms``) or a key while interruptible
speech plays interrupts that handle, which clears Twilio's buffer and keeps only what was heard.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from enum import StrEnum

import structlog

from ivr import phrases
from ivr.audio.codec import FRAME_BYTES_PCM16, ulaw_to_pcm16
from ivr.audio.endpointer import Endpointer, EndpointEvent, SpeechDiscarded, SpeechStarted
from ivr.audio.resample import resample
from ivr.call.io import (
    CallerInput,
    Digits,
    HungUp,
    ListenSpec,
    NoInput,
    Spoken,
    Utterance,
)
from ivr.call.player import AudioPlayer
from ivr.call.prompts import PromptCache
from ivr.call.speech import HEARD_MARGIN, SpeechHandle
from ivr.call.turns import CallStats, TurnTimings
from ivr.errors import ProviderError
from ivr.obs import metrics
from ivr.providers_resilience import turn_deadline
from ivr.stt.base import SpeechToText
from ivr.tts.base import TextToSpeech

log = structlog.get_logger("ivr.call")

INPUT_QUEUE_SIZE = 32
STT_QUEUE_SIZE = 4


@dataclass(frozen=True, slots=True)
class _Key:
    digit: str


@dataclass(frozen=True, slots=True)
class _NotUnderstood:
    """The caller said something, but speech recognition failed on it."""


@dataclass(slots=True)
class _PendingUtterance:
    pcm16_8k: bytes
    timings: TurnTimings


_Input = _Key | Utterance | _NotUnderstood | HungUp


class EndAction(StrEnum):
    HANGUP = "hangup"
    TRANSFER = "transfer"


@dataclass(frozen=True, slots=True)
class CallEnd:
    """How the call should leave the stream: consumed by the ``<Connect action>`` handler."""

    action: EndAction
    number: str = ""
    """The number to dial, for a transfer (checked by the flow engine)."""


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
        heard_within: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``heard_within``: when a provider fails, the caller hears the cached apology (or
        the not-understood prompt) within this many seconds of the end of their speech;
        None leaves each stage to its own limit."""
        self._player = player
        self._endpointer = endpointer
        self._stt = stt
        self._tts = tts
        self._prompts = prompts
        self._on_end = on_end
        self._llm_name = llm_name
        self._heard_within = heard_within
        self._clock = clock
        self._inputs: asyncio.Queue[_Input] = asyncio.Queue(INPUT_QUEUE_SIZE)
        self._stt_queue: asyncio.Queue[_PendingUtterance] = asyncio.Queue(STT_QUEUE_SIZE)
        self._pcm_tail = b""
        self._caller_speaking = False
        self._speech_started_at: float | None = None
        """Stream time the current caller utterance began; None when the caller is quiet."""
        self._caller_confirmed = False
        """The current utterance has lasted min_speech_ms: real speech, not a click."""
        self._min_speech_ms = endpointer.config.min_speech_ms
        self._stt_busy = 0
        self._speech: SpeechHandle | None = None
        self._turn: TurnTimings | None = None
        self.turns: list[dict[str, float]] = []
        self.stats = CallStats()
        self._turns_saved = 0
        self._listening = False
        """The flow is inside ``listen()``: waiting for the caller."""

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

    async def _on_endpoint(self, event: EndpointEvent, stream_now: float) -> None:
        if isinstance(event, SpeechStarted):
            self._caller_speaking = True
            self._speech_started_at = event.t
            self._caller_confirmed = False
            await self._confirm_speech()
            return
        self._end_caller_speech()
        if isinstance(event, SpeechDiscarded):  # too short to be speech
            return
        now = self._clock()
        # Map stream time back to our clock: the caller stopped (stream_now - end) ago.
        speech_end = now - max(0.0, stream_now - event.t_end_of_speech)
        pending = _PendingUtterance(event.audio, TurnTimings(speech_end=speech_end, endpoint=now))
        if self._stt_queue.full():
            metrics.INBOUND_DROPPED.inc()
            self._stt_queue.get_nowait()
        self._stt_queue.put_nowait(pending)

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
        # Queue the key before the barge-in awaits `clear`, so the flow, woken by the
        # interruption, finds it instead of starting its next prompt.
        self._put_input(_Key(digit))
        await self._barge_in("dtmf")

    def on_mark(self, name: str) -> None:
        self._player.on_mark(name)

    def on_hangup(self) -> None:
        self._put_input(HungUp())

    def _put_input(self, item: _Input) -> None:
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

    async def _transcribe(self, pending: _PendingUtterance) -> Utterance | _NotUnderstood:
        timings = pending.timings
        timings.stt_start = self._clock()
        audio = resample(pending.pcm16_8k, 8000, self._stt.sample_rate)
        if self._heard_within is not None:  # see SpeechHandle: the same deadline, for STT
            turn_deadline.set(timings.speech_end + self._heard_within - HEARD_MARGIN)
        try:
            result = await self._stt.transcribe(audio)
            text = result.text.strip()
        except ProviderError as exc:
            metrics.count_provider_error("stt", exc.provider, exc)
            self.stats.provider_errors += 1
            log.warning("stt.failed", error=str(exc), kind=exc.kind.value)
            return _NotUnderstood()
        timings.stt_end = self._clock()
        metrics.STT_LATENCY.labels(self._stt.name).observe(timings.stt_end - timings.endpoint)
        self._turn = timings
        log.info("caller.said", pii_text=text, stt_s=round(timings.stt_end - timings.stt_start, 3))
        return Utterance(text=text, latency={"stt": timings.stt_end - timings.stt_start})

    # -- CallIO: listening ----------------------------------------------------------------

    async def listen(self, spec: ListenSpec) -> CallerInput:
        self._listening = True
        try:
            return await self._listen(spec)
        finally:
            self._listening = False

    def at_turn_boundary(self) -> bool:
        """The flow waits for the caller, the bot is silent and the caller has neither started
        talking nor said or pressed anything not yet acted on: nobody would notice a pause."""
        return (
            self._listening
            and self._speech is None
            and not self._caller_answering()
            and not self._caller_has_the_floor()
        )

    async def wait_for_turn_boundary(self, poll: float = 0.02) -> None:
        """Until ``at_turn_boundary()`` (polled: this is for rare events such as a drain)."""
        while True:  # the conditions change in many places; a 20 ms poll costs nothing here
            if self.at_turn_boundary():
                return
            await asyncio.sleep(poll)

    async def _listen(self, spec: ListenSpec) -> CallerInput:
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
            item = await self._next_input(wait)
            if item is None:  # timed out, and nothing is queued
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
            if isinstance(item, _NotUnderstood):
                if spec.speech and not digits:
                    # Ask again at once, from the prompt cache (it does not need the STT that
                    # just failed, nor the TTS), and give the caller the full time to answer.
                    await self.say(phrases.NOT_UNDERSTOOD)
                    deadline = self._clock() + spec.no_input_timeout
                continue
            if spec.speech and not digits:
                return item

    async def _next_input(self, wait: float) -> _Input | None:
        """The next queued input, waiting up to ``wait`` s; None only if nothing is queued.

        What is queued already is taken first: an answer that lands in the same loop turn as
        the timeout (or a timeout already past) must never become a no-input.
        """
        if not self._inputs.empty():
            return self._inputs.get_nowait()
        try:
            return await asyncio.wait_for(self._inputs.get(), max(0.0, wait))
        except TimeoutError:
            return self._inputs.get_nowait() if not self._inputs.empty() else None

    # -- CallIO: speaking -----------------------------------------------------------------

    async def say(self, text: str, *, interruptible: bool = True) -> Spoken:
        handle = self._new_speech(interruptible)
        cached = self._prompts.get(self._tts.voice, text)
        if cached is not None:
            return await self._play(handle, lambda: handle.play_cached(text, cached))

        async def one() -> AsyncIterator[str]:
            yield text

        chunks = one()
        return await self._play(handle, lambda: handle.play_text(chunks, from_llm=False))

    async def say_stream(self, chunks: AsyncIterator[str], *, interruptible: bool = True) -> Spoken:
        handle = self._new_speech(interruptible)
        return await self._play(handle, lambda: handle.play_text(chunks, from_llm=True))

    def _new_speech(self, interruptible: bool) -> SpeechHandle:
        turn, self._turn = self._turn, None
        return SpeechHandle(
            player=self._player,
            tts=self._tts,
            prompts=self._prompts,
            stats=self.stats,
            interruptible=interruptible,
            turn=turn,
            on_turn=self.turns.append,
            llm_name=self._llm_name,
            heard_within=self._heard_within,
            clock=self._clock,
        )

    async def _play(self, handle: SpeechHandle, start: Callable[[], None]) -> Spoken:
        if handle.interruptible and self._caller_has_the_floor():
            # The caller is talking (they went on after a pause, or barged into the previous
            # prompt) or has answered already: speaking now would talk over them or answer
            # half a sentence. Their input comes through listen().
            metrics.BARGE_INS.labels("before_start").inc()
            return Spoken(text_heard="", interrupted=True)
        start()
        self._speech = handle
        try:
            return await handle.wait_for_playout()
        finally:
            self._speech = None

    def unsaved_turns(self) -> list[dict[str, float]]:
        """Turn latencies not yet handed to the call store (each is handed out once)."""
        fresh = self.turns[self._turns_saved :]
        self._turns_saved = len(self.turns)
        return fresh

    # -- barge-in -------------------------------------------------------------------------

    async def _barge_in(self, trigger: str) -> None:
        speech = self._speech
        if speech is not None and speech.can_be_interrupted:
            await speech.interrupt(trigger)

    # -- CallIO: leaving ------------------------------------------------------------------

    async def transfer(self, number: str) -> None:
        self._on_end(CallEnd(EndAction.TRANSFER, number))

    async def hangup(self) -> None:
        self._on_end(CallEnd(EndAction.HANGUP))
