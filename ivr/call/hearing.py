"""The caller's side of the call: inbound audio to transcripts.

Inbound: mu-law frames -> PCM16 -> endpointer (VAD at 8 kHz, no resampling on the hot path)
-> each frame and endpoint event to the floor (``ivr.call.barge_in``: is it a barge-in?) ->
finished utterances are upsampled whole and transcribed by the STT worker -> the floor, which
hands the words that take it to ``listen()``. At a pause in the caller's speech while the flow
listens, their words so far are transcribed at once (``TurnSpeculation``): the flow may start
on its reply, and the words move the end of the turn (``ivr.call.turn_end``). With a
streaming STT, every payload also goes to the call's session as it arrives and a turn's end
asks it for the final words instead of an upload (``ivr.call.live_hearing``).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import structlog

from ivr.audio.codec import FRAME_BYTES_PCM16, ulaw_to_pcm16
from ivr.audio.endpointer import (
    Endpointer,
    EndpointEvent,
    SpeechDiscarded,
    SpeechPaused,
    SpeechResumed,
    SpeechStarted,
)
from ivr.audio.resample import resample
from ivr.call.barge_in import Floor
from ivr.call.heard import TurnsToHear, not_understood, words_heard
from ivr.call.inputs import NotUnderstood
from ivr.call.live_hearing import LiveHearing
from ivr.call.pause_turns import TurnSpeculation
from ivr.call.speaking import Speaker
from ivr.call.speech import heard_deadline
from ivr.call.turns import TurnTimings
from ivr.callio.io import Utterance
from ivr.errors import ProviderError, ProviderTimeout
from ivr.obs import metrics
from ivr.obs.backlog import InboundBacklog
from ivr.providers.resilience import turn_deadline
from ivr.stt.base import SpeechToText

log = structlog.get_logger("ivr.call")

CLOCK_CREEP = 0.01
"""How fast the stream-to-clock offset may grow (see ``on_media``): 10 ms a second."""
STT_QUEUE_SIZE = 4
BACKLOG_EVERY = 25
"""Payloads between two samples of the inbound backlog (twice a second at 20 ms each)."""


@dataclass(slots=True)
class _PendingUtterance:
    pcm16_8k: bytes
    timings: TurnTimings
    speculative: asyncio.Task[str] | None = None
    """The transcript requested when the caller paused, if they did not speak again since."""


class Hearing:
    # Slots: every inbound frame reads this object, most often with it out of the CPU's caches
    # (bench/frame_cost.py); slotted, its attributes are in the object, not an array apart.
    __slots__ = (
        "_audio_taps",
        "_backlog",
        "_clock",
        "_endpointer",
        "_floor",
        "_frame_end",
        "_heard_within",
        "_live",
        "_on_speech_start",
        "_payloads",
        "_pcm_tail",
        "_speaker",
        "_stream_to_clock",
        "_stt",
        "_turns",
        "speculation",
    )

    def __init__(
        self,
        *,
        endpointer: Endpointer,
        stt: SpeechToText,
        floor: Floor,
        speaker: Speaker,
        speculation: TurnSpeculation,
        heard_within: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        live: LiveHearing | None = None,
        backlog: InboundBacklog | None = None,
        on_speech_start: Callable[[], None] | None = None,
    ) -> None:
        """``live``: a streaming STT hears the call (``ivr.call.live_hearing``); ``stt`` is
        then only asked for the words so far. ``backlog``: the process's record of how late
        it takes up its calls' audio (None: this call's samples go to the metric alone).
        ``on_speech_start``: called as the caller begins to speak (the providers' connections
        are opened then, ahead of the turn's requests)."""
        self._live = live
        self._on_speech_start = on_speech_start
        self._backlog = backlog or InboundBacklog()
        self._endpointer = endpointer
        self._stt = stt
        self._floor = floor
        self._speaker = speaker
        self.speculation = speculation
        self._heard_within = heard_within
        self._clock = clock
        self._turns: TurnsToHear[_PendingUtterance] = TurnsToHear(STT_QUEUE_SIZE)
        self._pcm_tail = b""
        self._audio_taps: list[Callable[[bytes], None]] = []
        self._frame_end = 0.0
        """Stream time the newest inbound frame ended."""
        self._stream_to_clock = math.inf
        """Our clock less Twilio's stream time, at the least-delayed frame so far."""
        self._payloads = 0

    def add_audio_tap(self, tap: Callable[[bytes], None]) -> None:
        self._audio_taps.append(tap)

    async def on_media(self, ulaw: bytes, stream_time: float) -> None:
        """One inbound payload (normally 20 ms); ``stream_time`` is Twilio's timestamp (s)."""
        if self._live is not None:
            self._live.push(ulaw, stream_time)  # as it arrives: the provider hears it live
        decoded = ulaw_to_pcm16(ulaw)
        for tap in self._audio_taps:
            tap(decoded)
        pcm = self._pcm_tail + decoded
        offset = 0
        frame_s = FRAME_BYTES_PCM16 / 16000
        # Twilio's timestamps on our clock, for the echo check: the least lag seen lately is
        # the line's own, so a frame we get to late (a busy loop) keeps its place in time. It
        # may creep up by CLOCK_CREEP of the time passed: a sender whose clock runs slow.
        tail_s = len(self._pcm_tail) / 16000
        lag = self._clock() - stream_time + tail_s
        creep = CLOCK_CREEP * (stream_time - self._frame_end) if self._frame_end else 0.0
        self._stream_to_clock = min(self._stream_to_clock + max(0.0, creep), lag)
        self._payloads += 1
        if self._payloads % BACKLOG_EVERY == 0:
            self._backlog.record(lag - self._stream_to_clock)
        floor = self._floor
        while len(pcm) - offset >= FRAME_BYTES_PCM16:
            frame = pcm[offset : offset + FRAME_BYTES_PCM16]
            t = stream_time + (offset / FRAME_BYTES_PCM16) * frame_s - tail_s
            offset += FRAME_BYTES_PCM16
            self._frame_end = t + frame_s
            floor.push(frame, t + frame_s, t + frame_s + self._stream_to_clock)
            event = await self._endpointer.push_async(frame, t)
            if event is not None:
                await self._on_endpoint(event, t + frame_s)
            elif floor.judging:
                await floor.judge_sound()
        self._pcm_tail = pcm[offset:]

    async def _on_endpoint(self, event: EndpointEvent, stream_now: float) -> None:
        floor = self._floor
        if self._live is not None:
            self._live.hints.saw(event)
        if isinstance(event, SpeechPaused):
            self.speculation.drop()
            if not floor.caller_paused(event.audio, event.speech_ms):
                self.speculation.at_pause(event)
            return
        if isinstance(event, SpeechResumed):
            self.speculation.drop()
            await floor.caller_went_on()
            return
        if isinstance(event, SpeechStarted):
            if self._on_speech_start is not None:
                self._on_speech_start()
            await floor.sound_started(event.t)
            return
        if not floor.sound_ended(event) or isinstance(event, SpeechDiscarded):
            if self._live is not None:  # its words, if the provider heard any, are no turn
                self._live.no_turn(event.t_detected)
            return
        now = self._clock()
        # Map stream time back to our clock: the caller stopped (stream_now - end) ago.
        speech_end = now - max(0.0, stream_now - event.t_end_of_speech)
        timings = TurnTimings(speech_end=speech_end, endpoint=now)
        if self._live is not None:
            start = event.t_detected - len(event.audio) / 16000  # PCM16 at 8 kHz
            self._live.turn_ended(timings, start, event.t_end_of_speech, self.speculation.take())
            return
        pending = _PendingUtterance(event.audio, timings)
        pending.speculative = self.speculation.take()  # no speech since that pause: same words
        self._turns.put(pending)

    def stt_pending(self) -> bool:
        """Speech that ended is being, or waits to be, transcribed."""
        live = self._live is not None and self._live.pending()
        return live or self._turns.pending()

    # -- STT worker (run in the call's task group) ----------------------------------------

    async def run_stt(self) -> None:
        if self._live is not None:
            await self._live.run()
            return
        await self._turns.serve(self._transcribe, self._floor.deliver)

    async def _speculated_text(self, pending: _PendingUtterance) -> str | None:
        """The transcript asked for at the caller's pause, once it is in; None if it failed
        (then the turn asks again: a failed speculation is never heard)."""
        task = pending.speculative
        if task is None:
            return None
        # The request was sent without the turn's deadline (nobody knew the turn yet): hold
        # it to that deadline now, as a request sent at the endpoint would be.
        deadline = heard_deadline(pending.timings, self._heard_within)
        limit = None if deadline is None else max(0.0, deadline - self._clock())
        try:
            text = await asyncio.wait_for(asyncio.shield(task), limit)
        except TimeoutError:
            task.cancel()
            metrics.SPECULATION.labels("stt", "failed").inc()
            raise ProviderTimeout(self._stt.name, self._heard_within or 0.0) from None
        except asyncio.CancelledError:
            if not task.cancelled():
                raise  # this worker is being cancelled, not the speculation
            return None
        except Exception as exc:
            metrics.SPECULATION.labels("stt", "failed").inc()
            log.info("stt.speculation_failed", error=str(exc))
            return None
        metrics.SPECULATION.labels("stt", "used").inc()
        return text

    async def _transcribe(self, pending: _PendingUtterance) -> Utterance | NotUnderstood:
        timings = pending.timings
        # A speculated transcript costs the turn only what is left of it past the endpoint.
        timings.stt_start = self._clock()
        try:
            speculated = await self._speculated_text(pending)
            if speculated is not None:
                text = speculated
            else:
                text = await self._transcribe_now(pending)
        except ProviderError as exc:
            return not_understood(self._speaker, exc)
        return words_heard(self._stt.name, self._speaker, timings, text, self._clock())

    async def _transcribe_now(self, pending: _PendingUtterance) -> str:
        timings = pending.timings
        timings.stt_start = self._clock()
        audio = resample(pending.pcm16_8k, 8000, self._stt.sample_rate)
        deadline = heard_deadline(timings, self._heard_within)
        if deadline is not None:  # see SpeechHandle: the same deadline, for STT
            turn_deadline.set(deadline)
        result = await self._stt.transcribe(audio)
        return result.text.strip()

    async def aclose(self) -> None:
        if self._live is not None:
            await self._live.aclose()
