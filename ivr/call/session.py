"""One live call's audio session: the ``CallIO`` the flow runner drives, over Twilio audio.

Inbound: mu-law frames -> PCM16 -> endpointer (VAD at 8 kHz, no resampling on the hot path)
-> finished utterances are upsampled whole and transcribed by the STT worker -> input queue
-> ``listen()``. Outbound: each ``say`` / ``say_stream`` is a ``SpeechHandle`` (``speech.py``).
Barge-in: caller speech (once it has lasted ``min_speech_ms``) or a key while interruptible
speech plays interrupts that handle, which clears Twilio's buffer and keeps only what was heard.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass
from enum import StrEnum

import numpy as np
import structlog

from ivr import phrases
from ivr.audio.codec import FRAME_BYTES_PCM16, ulaw_to_pcm16
from ivr.audio.endpointer import (
    Endpointer,
    EndpointEvent,
    SpeechDiscarded,
    SpeechEnded,
    SpeechPaused,
    SpeechResumed,
    SpeechStarted,
)
from ivr.audio.levels import active_level_db
from ivr.audio.resample import resample
from ivr.call.interruptions import (
    DEFAULT_POLICY,
    BargeInJudge,
    InterruptionPolicy,
    Outcome,
    Verdict,
    echoes_bot,
    words_of,
)
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
from ivr.call.speculation import SpeculativeSpeech, TentativeListener
from ivr.call.speech import HEARD_MARGIN, SpeechHandle
from ivr.call.timeline import CallTimeline
from ivr.call.turn_end import (
    DEFAULT_POLICIES,
    Completeness,
    TurnModel,
    TurnPolicy,
    judge_words,
    silence_needed_ms,
)
from ivr.call.turns import CallStats, TurnTimings
from ivr.control.transfers import WarmTransfer
from ivr.errors import ProviderError, ProviderTimeout
from ivr.obs import metrics
from ivr.providers.resilience import turn_deadline
from ivr.stt.base import SpeechToText
from ivr.tts.base import TextToSpeech

log = structlog.get_logger("ivr.call")

INPUT_QUEUE_SIZE = 32
PAUSE_VERDICT_LIMIT_S = 15.0
"""Longest a prompt paused for caller speech waits for that speech's transcript once it ended
(STT has its own, shorter, limits; this is for a transcript that never comes)."""
TURN_MODEL_GRACE_MS = 250
"""How much longer an unsure turn stays open while the audio turn model runs (~60 ms here):
a later answer no longer moves the end."""
WORDS_WAIT_SLACK_MS = 150
"""A pause waiting for its words ends this long before the STT deadline: the turn's end, the
STT worker and the re-ask's first frame all fit in it (a few ms each)."""
CLOCK_CREEP = 0.01
"""How fast the stream-to-clock offset may grow (see ``on_media``): 10 ms a second."""
ECHO_WINDOW_S = 0.6
"""The longest echo delay a line gives (``BargeInJudge.bot_audible`` looks as far back)."""
BACKCHANNEL_MAX_MS = 1200
"""Caller speech over a paused prompt longer than this is not transcribed at its pauses: a
backchannel ("uh-huh", "okay", "I see") is shorter, and each early request costs one."""
HOLD_PROBE_MS = 300
"""While the bot holds on over caller speech (their backchannel habit, ``BackchannelHabit``,
or a node's raised ``min_speech_ms``), their words so far are transcribed once their speech
has spanned this long: "I want..." pauses the bot then, not only when the hold runs out;
"uh-", "yeah" hold on. Sooner, a real STT mishears more of the fragment: whisper tiny.en
took 5 of 8 espeak backchannels for words at 200 ms, 1 at 300 (``bench/hold_probe.py``)."""
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
    speculative: asyncio.Task[str] | None = None
    """The transcript requested when the caller paused, if they did not speak again since."""


@dataclass(slots=True)
class _PauseTranscript:
    """Speculative STT of the utterance so far, started when the caller paused."""

    pause: int
    task: asyncio.Task[str]


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
    warm: WarmTransfer | None = None
    """A warm transfer: the caller is held in a conference while the agent is briefed."""


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
        turn_model: TurnModel | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``heard_within``: when a provider fails, the caller hears the cached apology (or
        the not-understood prompt) within this many seconds of the end of their speech;
        None leaves each stage to its own limit."""
        self._player = player
        self._endpointer = endpointer
        self._stt = stt
        self._speech_prefetch = SpeculativeSpeech(tts)
        self._tts = self._speech_prefetch
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
        self.timeline = CallTimeline()  # key presses, barge-ins, nodes: saved with turns
        self._listening = False
        """The flow is inside ``listen()``: waiting for the caller."""
        self._listen_spec: ListenSpec | None = None
        self._pause_transcript: _PauseTranscript | None = None
        self._tentative_listener: TentativeListener | None = None
        self._turn_model = turn_model
        self._turn_judge: asyncio.Task[None] | None = None
        self._audio_taps: list[Callable[[bytes], None]] = []
        self._judge = BargeInJudge(player.far_end)
        self._frame_end = 0.0
        """Stream time the newest inbound frame ended."""
        self._stream_to_clock = math.inf
        """Our clock less Twilio's stream time, at the least-delayed frame so far."""
        self._policy = DEFAULT_POLICY
        """The interruption policy of the prompt playing (or last played)."""
        self._paused_speech: SpeechHandle | None = None
        """Paused for caller speech, waiting for its transcript to stand or resume."""
        self._last_utterance_over_bot = False
        self._last_utterance_ms = 0
        """How long the caller spoke in the utterance handed to STT last."""
        self._last_utterance_level = -120.0
        """Its active speech level (dBFS): the caller's own, if it turns out to be a turn."""
        self._last_utterance_from = 0.0
        """From when (our clock) what the bot said could be echoing in it."""
        self._pause_deadline: asyncio.TimerHandle | None = None
        self._early_verdict: asyncio.Task[None] | None = None
        """Transcribing the caller's words over a paused prompt at their first pause."""
        self._resumed_early = False
        """The paused prompt went on at that pause: the words were a backchannel."""
        self._hold_probe: asyncio.Task[None] | None = None
        """Transcribing the words so far of a sound the caller's habit holds the bot over."""
        self._held_words_onset: float | None = None
        """Onset of the sound whose words so far, transcribed while held, take the floor."""

    # -- inbound (called by the stream's receive loop) ------------------------------------

    def add_audio_tap(self, tap: Callable[[bytes], None]) -> None:
        """``tap`` gets every inbound payload as PCM16 8 kHz (e.g. answering machine
        detection); it runs on the receive loop, so it must only hand the audio on."""
        self._audio_taps.append(tap)

    async def on_media(self, ulaw: bytes, stream_time: float) -> None:
        """One inbound payload (normally 20 ms); ``stream_time`` is Twilio's timestamp (s)."""
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
        while len(pcm) - offset >= FRAME_BYTES_PCM16:
            frame = pcm[offset : offset + FRAME_BYTES_PCM16]
            t = stream_time + (offset / FRAME_BYTES_PCM16) * frame_s - tail_s
            offset += FRAME_BYTES_PCM16
            self._judge.push(frame, t + frame_s + self._stream_to_clock)
            self._frame_end = t + frame_s
            event = await self._endpointer.push_async(frame, t)
            if event is not None:
                await self._on_endpoint(event, t + frame_s)
            elif self._speech_started_at is not None and (
                not self._caller_confirmed or self._judge.awaiting_voice
            ):
                await self._confirm_speech()
        self._pcm_tail = pcm[offset:]

    async def _confirm_speech(self) -> None:
        """Is the caller's sound speech? Over the bot (its audio could still be coming back
        as echo) the ``BargeInJudge`` decides: echo and unvoiced bursts do nothing, speech
        pauses an interruptible prompt (the transcript then decides, see ``_deliver``).
        Otherwise, as ever, once the endpointer has counted min_speech_ms of it."""
        onset = self._speech_started_at
        if onset is None:
            return
        judge = self._judge
        if self._caller_confirmed:  # paused for a sound with no voice yet: is there one now?
            judge.watch_voice()
            return
        if judge.onset != onset:
            judge.start(onset)
        speech = self._speech
        if judge.bot_audible() or (speech is not None and speech.paused):
            policy = self._policy
            endpointer = self._endpointer
            span_ms = endpointer.speech_span_ms
            verdict = judge.judge(self._frame_end, endpointer.voiced_ms, span_ms, policy)
            if verdict is Verdict.WAIT and span_ms >= HOLD_PROBE_MS:
                self._probe_held_words(onset, span_ms, policy)
            if self._held_words_onset == onset:  # its words so far take the floor: speech
                judge.confirm()
            elif verdict is not Verdict.SPEECH:
                return
        elif self._endpointer.voiced_ms < self._min_speech_ms:
            return
        else:
            judge.confirm()
        self._caller_confirmed = True
        if speech is not None and speech.can_be_interrupted:
            self._paused_speech = speech
            await speech.pause()

    async def _on_endpoint(self, event: EndpointEvent, stream_now: float) -> None:
        if isinstance(event, SpeechPaused):
            self._on_pause(event)
            return
        if isinstance(event, SpeechResumed):
            self._drop_speculation()
            self._cancel_early_verdict()
            if self._resumed_early:  # more than a backchannel: pause again, the words decide
                self._resumed_early = False
                speech = self._speech
                if speech is not None and speech.can_be_interrupted:
                    self._paused_speech = speech
                    await speech.pause()
            return
        if isinstance(event, SpeechStarted):
            self._caller_speaking = True
            self._speech_started_at = event.t
            self._caller_confirmed = False
            await self._confirm_speech()
            return
        self._end_caller_speech()
        if self._not_for_stt(event) or isinstance(event, SpeechDiscarded):  # see _not_for_stt
            return
        now = self._clock()
        # Map stream time back to our clock: the caller stopped (stream_now - end) ago.
        speech_end = now - max(0.0, stream_now - event.t_end_of_speech)
        pending = _PendingUtterance(event.audio, TurnTimings(speech_end=speech_end, endpoint=now))
        if self._pause_transcript is not None:  # no speech since that pause: same words
            pending.speculative = self._pause_transcript.task
            self._pause_transcript = None
        if self._stt_queue.full():
            metrics.INBOUND_DROPPED.inc()
            self._stt_queue.get_nowait()
        self._stt_queue.put_nowait(pending)

    # -- speculative turns ----------------------------------------------------------------

    def on_tentative_input(self, listener: TentativeListener | None) -> None:
        self._tentative_listener = listener

    def prefetch_speech(self, text: str) -> None:
        if self._prompts.get(self._tts.voice, text) is None:  # cached prompts need no TTS
            self._speech_prefetch.prefetch(text)

    def _speculating(self) -> bool:
        """Worth transcribing at a pause: the flow waits for speech and the bot is silent
        (speech over the bot is a barge-in, judged on its own)."""
        spec = self._listen_spec
        return self._listening and self._speech is None and spec is not None and spec.speech

    def _on_pause(self, event: SpeechPaused) -> None:
        self._drop_speculation()
        if self._paused_speech is not None:
            if event.speech_ms <= BACKCHANNEL_MAX_MS:  # longer is no "uh-huh": wait for it all
                self._judge_words_early(event.audio, event.speech_ms, self._paused_speech)
            return
        if not self._speculating():
            return
        log.debug("speculation.pause", pause=event.pause, speech_ms=event.speech_ms)
        task = asyncio.create_task(
            self._transcribe_pause(event.audio, event.pause), name="speculative-stt"
        )
        self._pause_transcript = _PauseTranscript(event.pause, task)
        spec = self._listen_spec
        if spec is not None:
            # Until the words are in, they cannot keep an unfinished sentence open: with an STT
            # slower than the endpoint silence (offline whisper: ~0.4 s) the short silence
            # would end it first. Hold the turn as long as an unfinished one may wait; a
            # finished one loses nothing, its reply needs these very words.
            self._endpointer.set_silence_ms(self._words_wait_ms(spec.turn))

    def _words_wait_ms(self, policy: TurnPolicy) -> int:
        """How long a pause may run while its words are still coming: the node's longest
        pause, but with a turn deadline (cloud providers) never so long that an STT which
        never answers would push the re-ask past it: the turn must end before the deadline."""
        if self._heard_within is None:
            return policy.max_silence_ms
        budget_ms = round((self._heard_within - HEARD_MARGIN) * 1000) - WORDS_WAIT_SLACK_MS
        return max(policy.fallback_silence_ms, min(policy.max_silence_ms, budget_ms))

    async def _transcribe_pause(self, pcm16_8k: bytes, pause: int) -> str:
        audio = resample(pcm16_8k, 8000, self._stt.sample_rate)
        try:
            transcript = await self._stt.transcribe(audio)
        except ProviderError as exc:  # the turn asks again; counted like any provider failure
            metrics.count_provider_error("stt", exc.provider, exc)
            current, spec = self._pause_transcript, self._listen_spec
            if current is not None and current.pause == pause and spec is not None:
                # No words to judge by: silence decides, as without speculation.
                self._endpointer.set_silence_ms(spec.turn.fallback_silence_ms)
            raise
        text = transcript.text.strip()
        current = self._pause_transcript
        listener = self._tentative_listener
        # Still the caller's latest words and the turn not committed yet: let the flow start
        # on the reply (once committed, the STT worker delivers the text the normal way).
        if current is None or current.pause != pause:
            return text
        verdict = self._judge_turn(text, pcm16_8k, pause, transcript.last_word_probability)
        # Words that leave a clause open will be followed by more: a reply to them is waste.
        if listener is not None and text and verdict != "incomplete":
            log.debug("speculation.transcript", pause=pause)
            listener(text)
        return text

    # -- end of turn ------------------------------------------------------------------------

    def _judge_turn(
        self, text: str, pcm16_8k: bytes, pause: int, last_word_probability: float | None
    ) -> Completeness | None:
        """Move the end of this turn by what the words so far say, and when they say nothing
        either way, by the audio turn model: an open clause ("my number is", "and") or digits
        still missing wait the node's longest pause, a finished answer its shortest, words
        that may go on (or whose last word the STT doubts) halfway."""
        spec = self._listen_spec
        if spec is None:
            return None
        policy = spec.turn
        verdict = judge_words(policy, text, last_word_probability)
        if verdict != "unknown" or self._turn_model is None:
            silence = silence_needed_ms(policy, None, verdict)
            self._endpointer.set_silence_ms(silence)
            log.debug("turn.judged", text=verdict, silence_ms=silence)
            return verdict
        # Hold the turn open while the model thinks (off the loop), a bounded moment.
        self._endpointer.set_silence_ms(policy.fallback_silence_ms + TURN_MODEL_GRACE_MS)
        if self._turn_judge is not None:
            self._turn_judge.cancel()
        # The audio up to now: the silence since the pause is part of what the model judges
        # (it was trained on turns that end ~200 ms into the pause).
        audio = self._endpointer.utterance_audio() or pcm16_8k
        self._turn_judge = asyncio.create_task(
            self._judge_by_model(self._turn_model, policy, audio, pause), name="turn-model"
        )
        return verdict

    async def _judge_by_model(
        self, model: TurnModel, policy: TurnPolicy, pcm16_8k: bytes, pause: int
    ) -> None:
        p_audio = await model.audio_probability(pcm16_8k)  # never raises: None = no answer
        current = self._pause_transcript
        if current is None or current.pause != pause:
            return  # the turn ended meanwhile (or went on): nothing to move
        silence = silence_needed_ms(policy, p_audio, "unknown")
        self._endpointer.set_silence_ms(silence)
        log.debug("turn.judged", text="unknown", p_audio=p_audio, silence_ms=silence)

    def _drop_speculation(self) -> None:
        """The caller went on talking: what was started on their pause is stale."""
        pause = self._pause_transcript
        self._pause_transcript = None
        if pause is not None:
            if not pause.task.done():
                pause.task.cancel()
            metrics.SPECULATION.labels("stt", "wasted").inc()
            pause.task.add_done_callback(_consume_result)
            if self._tentative_listener is not None:
                self._tentative_listener(None)
        # Prefetched speech stays: the next pause may bring the same words (then the reply,
        # and its first sentence, are the same). A new listen() drops what is left.

    async def aclose(self) -> None:
        """The stream is over: cancel what speculation still runs."""
        judge, self._turn_judge = self._turn_judge, None
        if judge is not None and not judge.done():
            judge.cancel()
            await asyncio.gather(judge, return_exceptions=True)
        pause = self._pause_transcript
        self._pause_transcript = None
        if pause is not None and not pause.task.done():
            pause.task.cancel()
            await asyncio.gather(pause.task, return_exceptions=True)
        for task in (self._early_verdict, self._hold_probe):
            if task is not None and not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        self._early_verdict = self._hold_probe = None
        await self._speech_prefetch.aclose()

    def _probe_held_words(self, onset: float, span_ms: int, policy: InterruptionPolicy) -> None:
        """The caller's habit holds the bot over their voice: ask what they are saying (once
        per sound, only with speculation on: it costs an STT request)."""
        speech = self._speech
        if (
            self._hold_probe is not None
            or speech is None
            or not speech.can_be_interrupted
            or not self._endpointer.config.pause_ms
            or span_ms >= self._judge.habit.hold_ms(policy)  # not held: it pauses by itself
            or not self._judge.voice_so_far
        ):
            return
        self._hold_probe = asyncio.create_task(
            self._judge_held_words(self._endpointer.utterance_audio(), onset, speech),
            name="held-words",
        )

    async def _judge_held_words(self, pcm16_8k: bytes, onset: float, speech: SpeechHandle) -> None:
        """Mark the sound for a pause if its words so far are more than backchannel."""
        text = await self._words_so_far(pcm16_8k, "barge_in.held_words_failed")
        if text is None:  # the hold runs out as without this
            return
        current = self._speech_started_at == onset and not self._caller_confirmed
        takes_floor = current and self._speech is speech and not self._only_listening(None, text)
        metrics.SPECULATION.labels("stt", "used" if takes_floor else "wasted").inc()
        if takes_floor:
            # The receive loop pauses the bot at the next frame, as for any speech: the
            # whole utterance is then transcribed when it ends, and that decides.
            log.info("barge_in.held_words", pii_text=text)
            self._held_words_onset = onset

    def _cancel_hold_probe(self) -> None:
        task, self._hold_probe = self._hold_probe, None
        if task is not None and not task.done():
            task.cancel()  # the sound ended first: its whole transcript decides
            metrics.SPECULATION.labels("stt", "wasted").inc()

    def _end_caller_speech(self) -> None:
        self._cancel_hold_probe()
        self._held_words_onset = None
        self._caller_speaking = False
        self._caller_confirmed = False
        self._speech_started_at = None

    def _caller_answering(self) -> bool:
        """Speech in progress or being transcribed: an answer is on its way."""
        return self._caller_speaking or self._stt_pending()

    def _stt_pending(self) -> bool:
        """Speech that ended is being, or waits to be, transcribed."""
        return self._stt_busy > 0 or not self._stt_queue.empty()

    def _caller_has_the_floor(self) -> bool:
        """The caller is talking, or has said or pressed something not yet acted on."""
        return self._caller_confirmed or self._stt_pending() or not self._inputs.empty()

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
            await self._deliver(utterance)

    async def _speculated_text(self, pending: _PendingUtterance) -> str | None:
        """The transcript asked for at the caller's pause, once it is in; None if it failed
        (then the turn asks again: a failed speculation is never heard)."""
        task = pending.speculative
        if task is None:
            return None
        # The request was sent without the turn's deadline (nobody knew the turn yet): hold
        # it to that deadline now, as a request sent at the endpoint would be.
        deadline = self._deadline_of(pending.timings)
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

    async def _transcribe(self, pending: _PendingUtterance) -> Utterance | _NotUnderstood:
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
            metrics.count_provider_error("stt", exc.provider, exc)
            self.stats.provider_errors += 1
            log.warning("stt.failed", error=str(exc), kind=exc.kind.value)
            return _NotUnderstood()
        timings.stt_end = self._clock()
        metrics.STT_LATENCY.labels(self._stt.name).observe(timings.stt_end - timings.endpoint)
        self._turn = timings
        log.info("caller.said", pii_text=text, stt_s=round(timings.stt_end - timings.stt_start, 3))
        return Utterance(text=text, latency={"stt": timings.stt_end - timings.stt_start})

    async def _transcribe_now(self, pending: _PendingUtterance) -> str:
        timings = pending.timings
        timings.stt_start = self._clock()
        audio = resample(pending.pcm16_8k, 8000, self._stt.sample_rate)
        deadline = self._deadline_of(timings)
        if deadline is not None:  # see SpeechHandle: the same deadline, for STT
            turn_deadline.set(deadline)
        result = await self._stt.transcribe(audio)
        return result.text.strip()

    def _deadline_of(self, timings: TurnTimings) -> float | None:
        """When STT must have answered for a failure's re-ask to be heard in time (None: off)."""
        if self._heard_within is None:
            return None
        return timings.speech_end + self._heard_within - HEARD_MARGIN

    # -- CallIO: listening ----------------------------------------------------------------

    async def listen(self, spec: ListenSpec) -> CallerInput:
        self._listening = True
        self._listen_spec = spec
        self._speech_prefetch.discard()  # a new turn: what the last one did not use is stale
        # The node's pause before a turn counts as over (an account number waits longer);
        # a node that sets nothing keeps the gateway's configured endpoint silence.
        custom = spec.turn != DEFAULT_POLICIES["any"]
        self._endpointer.use_default_silence_ms(spec.turn.fallback_silence_ms if custom else None)
        try:
            return await self._listen(spec)
        finally:
            self._listening = False
            self._endpointer.use_default_silence_ms(None)

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
        if handle.interruptible and self._caller_speaking and not self._caller_confirmed:
            await self._until_sound_judged()
        if handle.interruptible and self._caller_has_the_floor():
            # The caller is talking (they went on after a pause, or barged into the previous
            # prompt) or has answered already: speaking now would talk over them or answer
            # half a sentence. Their input comes through listen().
            metrics.BARGE_INS.labels("before_start", "interrupted").inc()
            return Spoken(text_heard="", interrupted=True)
        start()
        self._speech = handle
        try:
            return await handle.wait_for_playout()
        finally:
            self._speech = None

    async def forget_caller_input(self, limit: float = 3.0, until_quiet: bool = False) -> None:
        """Drop what the caller said so far, once transcribed (waits ``limit`` s at most): an
        outbound callee's "Hello?" greets us, it answers no prompt. ``until_quiet``: first let
        them finish it (a verdict can come mid-word), so the bot does not start over a person
        and take their "Hello?" for a barge-in. Polled, once a call."""
        waited = 0.0
        busy = self._caller_answering if until_quiet else self._stt_pending
        while busy() and waited < limit:
            await asyncio.sleep(0.02)
            waited += 0.02
        while not self._inputs.empty():
            self._inputs.get_nowait()

    async def _until_sound_judged(self, limit: float = 0.5) -> None:
        """The caller just made a sound not yet judged speech (needs min_speech_ms) or noise:
        a reply (ready sooner now that turns are speculated) waits those few frames rather
        than start over a caller who went on talking. Polled: it is rare and short."""
        waited = 0.0
        while self._caller_speaking and not self._caller_confirmed and waited < limit:
            if self._judge.heard_not_speech:  # the bot's own echo, or noise: nobody to wait for
                return
            await asyncio.sleep(0.02)
            waited += 0.02

    def unsaved_turns(self) -> list[dict[str, float]]:
        """Turn latencies not yet handed to the call store (each is handed out once)."""
        fresh = self.turns[self._turns_saved :]
        self._turns_saved = len(self.turns)
        return fresh

    # -- barge-in -------------------------------------------------------------------------

    def recall_backchannels(self, spans_ms: Iterable[int]) -> None:
        """A resumed call: the caller's backchannels on its earlier streams (from its record's
        timeline, ``backchannel_spans``) teach this one their habit, as if heard here."""
        for span_ms in spans_ms:
            self._judge.habit.heard(span_ms)

    def set_interruption_policy(self, policy: InterruptionPolicy | None) -> None:
        """What interrupts the prompts that follow (``SupportsInterruptionPolicy``)."""
        self._policy = policy or DEFAULT_POLICY

    def _not_for_stt(self, event: SpeechEnded | SpeechDiscarded) -> bool:
        """An utterance is over: too short (a paused prompt resumes), or only ever the bot's
        echo or a noise while the bot was audible (dropped: the bot never stopped for it)."""
        judged = self._judge.end()
        self._cancel_early_verdict()
        if self._resumed_early:  # its words were judged at its pause: the bot went on
            self._resumed_early = False
            return True
        if isinstance(event, SpeechDiscarded):
            if self._paused_speech is not None:
                self._resume(Outcome.RESUMED, "")
            return True
        if judged is not None and judged.over_bot and not judged.voiced:
            # Only ever echo, someone in the background, or a sound with no voice in it (a
            # cough, a door, static): no words of the caller's to transcribe (and STT would
            # make some up); a paused prompt resumes.
            outcome = _ignored_as(judged.verdicts, judged.taken_for_speech)
            if self._paused_speech is not None:
                self._resume(outcome, "")
            else:
                metrics.BARGE_INS.labels("speech", outcome.value).inc()
                log.info("barge_in.ignored", outcome=outcome.value)
            return True
        self._last_utterance_over_bot = judged is not None and judged.over_bot
        self._last_utterance_ms = event.speech_ms
        self._last_utterance_level = active_level_db(
            np.frombuffer(event.audio, dtype="<i2").astype(np.float64)
        )
        # On our clock: when it started, less the longest echo delay (what it could echo).
        self._last_utterance_from = self._clock() - (
            self._frame_end - event.t_start + ECHO_WINDOW_S
        )
        if self._paused_speech is not None:  # its transcript decides; never wait forever
            self._cancel_pause_deadline()
            self._pause_deadline = asyncio.get_running_loop().call_later(
                PAUSE_VERDICT_LIMIT_S, self._verdict_overdue, self._paused_speech
            )
        return False

    def _verdict_overdue(self, speech: SpeechHandle) -> None:
        """No transcript came for the utterance that paused ``speech`` (lost, say, from a full
        STT queue): the prompt goes on rather than leave the call hanging."""
        if self._paused_speech is speech:
            log.warning("barge_in.no_verdict", limit_s=PAUSE_VERDICT_LIMIT_S)
            self._resume(Outcome.RESUMED, "")

    async def _deliver(self, item: Utterance | _NotUnderstood) -> None:
        """A transcript is in. Over the bot, words that do not take the floor (none, or only
        backchannel) are swallowed and a paused prompt resumes; a real turn makes the pause
        an interruption, and the flow gets the words (queued first: the flow, woken by the
        interruption, must find them).

        A reply to the caller's turn paused before they heard any of it answers nothing yet:
        words then are the caller going on with that turn ("yes, that is ... right"), never a
        backchannel to it, so they interrupt it whatever they are. (A prompt that answers no
        turn, such as the greeting, keeps the usual rule: "okay" does not skip it.)"""
        paused = self._paused_speech
        over_bot = self._last_utterance_over_bot
        self._last_utterance_over_bot = False
        bot_on = paused is not None or (over_bot and self._speech is not None)
        if over_bot and isinstance(item, Utterance) and self._echoes_bot(item.text):
            if bot_on:
                self._resume(Outcome.ECHO, item.text)
            else:  # the echo of the bot's last words, after it stopped: no one to answer
                metrics.BARGE_INS.labels("speech", Outcome.ECHO.value).inc()
                log.info("barge_in.ignored", outcome=Outcome.ECHO.value, by="words")
            return
        if bot_on and isinstance(item, Utterance) and self._only_listening(paused, item.text):
            outcome = Outcome.BACKCHANNEL if words_of(item.text) else Outcome.RESUMED
            self._resume(outcome, item.text, self._last_utterance_ms)
            return
        if isinstance(item, Utterance) and words_of(item.text):
            self._judge.caller_level.heard_turn(self._last_utterance_level)
        self._put_input(item)
        if paused is not None:
            self._paused_speech = None
            self._cancel_pause_deadline()
            await paused.interrupt("speech")
        elif over_bot and isinstance(item, Utterance):
            # Over before it could pause the bot (shorter than the node's min_speech_ms, say
            # "Stop."): the words decide now, as they would have after a pause.
            await self._barge_in("speech")

    def _echoes_bot(self, text: str) -> bool:
        """The words are the bot's own, from what played while the sound could echo it
        (``echoes_bot``): an echo the audio checks let through."""
        said = self._player.said_since(self._last_utterance_from)
        return echoes_bot(text, said, line_echoes=self._judge.echo_path.delay_s is not None)

    def _only_listening(self, paused: SpeechHandle | None, text: str) -> bool:
        """The caller's words over the bot do not take the floor: none, or only backchannel.
        Over a reply to their turn (``paused``) that they heard none of, any word does: it
        goes on with that turn (see ``_deliver``)."""
        if not words_of(text):
            return True
        if paused is not None and paused.turn is not None and not paused.heard_anything:
            return False
        return not self._policy.is_real_turn(text)

    def _judge_words_early(self, pcm16_8k: bytes, speech_ms: int, speech: SpeechHandle) -> None:
        """The caller paused in their sound over a paused prompt: their words so far may be
        a backchannel already ("uh-huh" ends in such a pause). Ask now rather than after the
        endpoint silence, so the prompt goes on ~250 ms sooner."""
        self._cancel_early_verdict()
        self._early_verdict = asyncio.create_task(
            self._resume_on_backchannel(pcm16_8k, speech_ms, speech), name="early-barge-in-verdict"
        )

    async def _words_so_far(self, pcm16_8k: bytes, failed_event: str) -> str | None:
        """The caller's words in a sound not over yet, for a verdict on it; None if the STT
        fails (counted) or a bug does (logged): a call never ends for want of this answer,
        the sound's own transcript (or the hold) decides without it."""
        audio = resample(pcm16_8k, 8000, self._stt.sample_rate)
        try:
            return (await self._stt.transcribe(audio)).text.strip()
        except ProviderError:
            metrics.SPECULATION.labels("stt", "failed").inc()
        except Exception:
            log.exception(failed_event)
        return None

    async def _resume_on_backchannel(
        self, pcm16_8k: bytes, speech_ms: int, speech: SpeechHandle
    ) -> None:
        text = await self._words_so_far(pcm16_8k, "barge_in.early_verdict_failed")
        if text is None:  # the utterance's own transcript decides, as without this
            return
        backchannel = (
            self._paused_speech is speech
            and bool(words_of(text))  # no words yet: the whole utterance decides
            and self._only_listening(speech, text)
        )
        metrics.SPECULATION.labels("stt", "used" if backchannel else "wasted").inc()
        if backchannel:
            self._resumed_early = True
            self._resume(Outcome.BACKCHANNEL, text, speech_ms)

    def _cancel_early_verdict(self) -> None:
        task, self._early_verdict = self._early_verdict, None
        if task is not None and not task.done():
            task.cancel()  # the caller went on, or stopped: the utterance's words decide
            metrics.SPECULATION.labels("stt", "wasted").inc()

    def _cancel_pause_deadline(self) -> None:
        if self._pause_deadline is not None:
            self._pause_deadline.cancel()
            self._pause_deadline = None

    def _resume(self, outcome: Outcome, text: str, speech_ms: int = 0) -> None:
        """The caller's sound did not take the floor: a paused prompt goes on. A backchannel
        (``speech_ms`` long) teaches the call this caller's habit (``BackchannelHabit``); one
        that taught it something, or paused the bot, goes on the call's timeline (the record
        carries the habit to a resumed stream, and the console shows it)."""
        self._cancel_pause_deadline()
        paused, self._paused_speech = self._paused_speech, None
        if outcome is Outcome.BACKCHANNEL and speech_ms > 0:
            span_ms = speech_ms + self._endpointer.hangover_ms
            if self._judge.habit.heard(span_ms) or paused is not None:
                self.timeline.add("backchannel", span_ms=span_ms, paused=paused is not None)
        metrics.BARGE_INS.labels("speech", outcome.value).inc()
        log.info("barge_in.swallowed", outcome=outcome.value, pii_text=text)
        if paused is not None:
            paused.resume()

    async def _barge_in(self, trigger: str) -> None:
        speech = self._speech
        if speech is not None and speech.can_be_interrupted:
            await speech.interrupt(trigger)

    # -- CallIO: leaving ------------------------------------------------------------------

    async def transfer(self, number: str, warm: WarmTransfer | None = None) -> None:
        self._on_end(CallEnd(EndAction.TRANSFER, number, warm))

    async def hangup(self) -> None:
        self._on_end(CallEnd(EndAction.HANGUP))


def _ignored_as(verdicts: list[Verdict], taken_for_speech: bool) -> Outcome:
    """What a sound over the bot that never proved to be the caller's voice was."""
    if Verdict.ECHO in verdicts and not taken_for_speech:
        return Outcome.ECHO
    if Verdict.BACKGROUND in verdicts:
        return Outcome.BACKGROUND
    return Outcome.NOISE


def _consume_result(task: asyncio.Task[str]) -> None:
    """Retrieve a dropped speculation's outcome, so a failure is not logged as unhandled."""
    if not task.cancelled():
        task.exception()
