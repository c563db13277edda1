"""The floor keeper: the caller's sound over the bot, frame by frame, through ``FloorState``.

``Floor`` is fed by the hearing side (each inbound frame, each endpoint event, each transcript)
and acts on the prompt playing (``Speaker.current``): a sound judged the caller's speech pauses
an interruptible prompt; the utterance's words then decide whether it stands (interrupt) or
goes on (resume: echo, noise, backchannel). ``BargeInJudge`` (``ivr.call.interruptions``) does
the audio checks; this module decides what they mean for who has the floor.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable

import numpy as np
import structlog

from ivr.audio.endpointer import Endpointer, SpeechDiscarded, SpeechEnded
from ivr.audio.levels import active_level_db
from ivr.call.early_words import EarlyWords
from ivr.call.floor import Bot, Caller, FloorState
from ivr.call.inputs import CallerInputs, NotUnderstood
from ivr.call.interruptions import BargeInJudge, Outcome, Verdict, echoes_bot
from ivr.call.speaking import Speaker
from ivr.call.speech import SpeechHandle
from ivr.callio.interruption_policy import DEFAULT_POLICY, InterruptionPolicy, words_of
from ivr.callio.io import Utterance
from ivr.callio.timeline import CallTimeline
from ivr.obs import metrics
from ivr.stt.base import SpeechToText

log = structlog.get_logger("ivr.call")

PAUSE_VERDICT_LIMIT_S = 15.0
"""Longest a prompt paused for caller speech waits for that speech's transcript once it ended
(STT has its own, shorter, limits; this is for a transcript that never comes)."""
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
PAUSE_BOUND_S = 0.55
"""Longest the bot stays paused for speech that may be a backchannel (it paused the bot before
spanning ``backchannel_span_ms``) while its words do not say it takes the floor. The team's
bound on a first backchannel's gap is 0.7 s as the caller hears it: the resumed audio reaches
them a few frames after ``resume``. The words so far, asked for ``HOLD_PROBE_MS`` in, usually
resume it sooner (~0.35 s with a 150 ms STT); this is for a slow or failed STT."""


class Floor:
    """One call's floor: its ``FloorState`` and the prompt a caller's sound paused."""

    # Slots: every inbound frame reads this object, most often with it out of the CPU's caches
    # (bench/frame_cost.py); slotted, its attributes are in the object, not an array apart.
    __slots__ = (
        "_clock",
        "_early",
        "_endpointer",
        "_inputs",
        "_last_from",
        "_last_level",
        "_last_ms",
        "_last_over_bot",
        "_last_paused",
        "_min_speech_ms",
        "_pause_bound",
        "_pause_deadline",
        "_paused_speech",
        "_sound_paused",
        "_speaker",
        "_timeline",
        "frame_end",
        "judge",
        "onset",
        "policy",
        "state",
    )

    def __init__(
        self,
        *,
        speaker: Speaker,
        endpointer: Endpointer,
        stt: SpeechToText,
        inputs: CallerInputs,
        timeline: CallTimeline,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.state = FloorState()
        self._speaker = speaker
        self._endpointer = endpointer
        self._inputs = inputs
        self._timeline = timeline
        self._clock = clock
        self.judge = BargeInJudge(speaker.player.far_end)
        self._min_speech_ms = endpointer.config.min_speech_ms
        self.policy = DEFAULT_POLICY
        """The interruption policy of the prompt playing (or last played)."""
        self.onset: float | None = None
        """Stream time the current caller sound began; None when the caller is quiet."""
        self.frame_end = 0.0
        """Stream time the newest inbound frame ended."""
        self._paused_speech: SpeechHandle | None = None
        """Paused for caller speech, waiting for its transcript to stand or resume."""
        self._pause_deadline: asyncio.TimerHandle | None = None
        self._pause_bound: asyncio.TimerHandle | None = None
        """Set while the pause may be a backchannel's: resumes it at ``PAUSE_BOUND_S``."""
        self._sound_paused = False
        """The current sound paused the bot (if only for a while)..."""
        self._last_paused = False
        """...and so did the one handed to STT last (its backchannel goes on the timeline so)."""
        self._last_over_bot = False
        self._last_ms = 0
        """How long the caller spoke in the utterance handed to STT last."""
        self._last_level = -120.0
        """Its active speech level (dBFS): the caller's own, if it turns out to be a turn."""
        self._last_from = 0.0
        """From when (our clock) what the bot said could be echoing in it."""
        self._early = EarlyWords(stt)

    # -- the caller's sound, frame by frame -------------------------------------------------

    def push(self, frame: bytes, stream_end: float, clock_end: float) -> None:
        """One inbound 20 ms frame, ending at ``stream_end`` (Twilio's time), ``clock_end``
        (ours): the judge keeps what the echo and voice checks need."""
        self.judge.push(frame, clock_end)
        self.frame_end = stream_end

    @property
    def judging(self) -> bool:
        """A sound goes on that is not judged speech yet, or has no voice heard in it yet."""
        return self.onset is not None and (
            not self.state.caller_confirmed
            or self.judge.awaiting_voice
            or self._pause_bound is not None  # its words so far may end the pause
        )

    async def sound_started(self, onset: float) -> None:
        self.state = self.state.sound_started()
        self.onset = onset
        self._sound_paused = False
        self._cancel_pause_bound()  # they went on after the sound that paused the bot
        await self.judge_sound()

    async def judge_sound(self) -> None:
        """Is the caller's sound speech? Over the bot (its audio could still be coming back
        as echo) the ``BargeInJudge`` decides: echo and unvoiced bursts do nothing, speech
        pauses an interruptible prompt (the transcript then decides, see ``deliver``).
        Otherwise, as ever, once the endpointer has counted min_speech_ms of it."""
        onset = self.onset
        if onset is None:
            return
        judge = self.judge
        span_ms = self._endpointer.speech_span_ms
        if self.state.caller_confirmed:  # paused for a sound with no voice yet: is there one now?
            judge.watch_voice()
            if self._pause_bound is not None and span_ms >= HOLD_PROBE_MS:
                self._probe_paused_words(onset)
            return
        if judge.onset != onset:
            judge.start(onset)
        speech = self._speaker.current
        if judge.bot_audible() or judge.holding or (speech is not None and speech.paused):
            verdict = judge.judge(self.frame_end, self._endpointer.voiced_ms, span_ms, self.policy)
            if verdict is Verdict.WAIT and span_ms >= HOLD_PROBE_MS:
                self._probe_held_words(onset, span_ms)
            if self.state.caller is Caller.WORDS:  # its words so far take the floor: speech
                judge.confirm()
            elif verdict is not Verdict.SPEECH:
                return
        elif self._endpointer.voiced_ms < self._min_speech_ms:
            return
        else:
            judge.confirm()
        # Paused this soon, by a sound not held before, it may be a backchannel: bounded.
        bounded = (
            self.state.caller is Caller.SOUND
            and not judge.holding
            and span_ms < self.policy.backchannel_span_ms
        )
        self.state = self.state.speech_confirmed()
        await self._pause(speech, bounded=bounded)

    async def _pause(self, speech: SpeechHandle | None, *, bounded: bool = False) -> None:
        if speech is not None and speech.can_be_interrupted:
            self._paused_speech = speech
            self._sound_paused = True
            self.state = self.state.paused()
            if bounded and self._endpointer.config.pause_ms:  # its words so far can be had
                self._cancel_pause_bound()
                self._pause_bound = asyncio.get_running_loop().call_later(
                    PAUSE_BOUND_S, self._pause_ran_out, speech, self.onset
                )
            await speech.pause()

    def _probe_paused_words(self, onset: float) -> None:
        """The bot paused for a sound that may be a backchannel: its words so far, once it has
        spanned ``HOLD_PROBE_MS``, end the pause (backchannel: the bot goes on, the rest of
        the sound held) or make it stand (more: the utterance's words decide)."""
        speech = self._paused_speech
        if self._early.probing_held or speech is None:
            return

        async def verdict(text: str) -> None:
            current = self._paused_speech is speech and self.onset == onset
            if current and self._pause_bound is not None:
                metrics.SPECULATION.labels("stt", "used").inc()
                if self._only_listening(speech, text):
                    self._hold_on(speech, text)
                else:
                    log.info("barge_in.held_words", pii_text=text)
                    self._cancel_pause_bound()  # the pause stands: the whole utterance decides
            else:
                metrics.SPECULATION.labels("stt", "wasted").inc()

        self._early.probe_held(self._endpointer.utterance_audio(), verdict)

    def _pause_ran_out(self, speech: SpeechHandle, onset: float | None) -> None:
        """``PAUSE_BOUND_S`` passed and no words said the sound takes the floor: the bot goes
        on. Its transcript still decides: a real turn interrupts the bot (a sound still going
        on pauses it again once past the hold), a backchannel plays through."""
        self._pause_bound = None
        if self._paused_speech is not speech:
            return
        log.info("barge_in.pause_bounded", limit_s=PAUSE_BOUND_S)
        if self.state.caller is Caller.SPEECH and self.onset == onset:
            self._hold_on(speech, "")
        elif not self.state.caller_sounding:  # over; its transcript is on its way
            self._cancel_pause_deadline()
            self._paused_speech = None
            self.state = self.state.resumed()
            speech.resume()

    def _hold_on(self, speech: SpeechHandle, text: str) -> None:
        """The paused prompt goes on while the sound that paused it does; the rest of the
        sound is held (``BargeInJudge.hold``) and its whole transcript decides, as a later
        backchannel's would: a turn pauses the bot again, or interrupts it."""
        self._cancel_pause_bound()
        self._paused_speech = None
        self.state = self.state.held_on()
        self.judge.hold()
        log.info("barge_in.held_on", pii_text=text)
        speech.resume()

    def caller_paused(self, pcm16_8k: bytes, speech_ms: int) -> bool:
        """A pause in their sound; True if it is the floor's (a prompt is paused for it, no
        turn to speculate on). Their words so far may be a backchannel already ("uh-huh"
        ends in such a pause): asked now rather than after the endpoint silence, the prompt
        goes on ~250 ms sooner."""
        speech = self._paused_speech
        if speech is None:
            return False
        if speech_ms > BACKCHANNEL_MAX_MS:  # no "uh-huh": wait for it all
            return True

        async def verdict(text: str) -> None:
            backchannel = (
                self._paused_speech is speech
                and bool(words_of(text))  # no words yet: the whole utterance decides
                and self._only_listening(speech, text)
            )
            metrics.SPECULATION.labels("stt", "used" if backchannel else "wasted").inc()
            if backchannel:
                self._resume(Outcome.BACKCHANNEL, text, speech_ms)
                self.state = self.state.went_on_early()
            elif self._paused_speech is speech and words_of(text):
                self._cancel_pause_bound()  # more than backchannel: the pause stands

        self._early.judge_at_pause(pcm16_8k, verdict)
        return True

    async def caller_went_on(self) -> None:
        """They spoke again after a pause in their sound."""
        self._early.cancel_at_pause()
        went_on = self.state.bot is Bot.WENT_ON
        self.state = self.state.caller_went_on()
        if went_on:  # more than a backchannel: pause again, the words decide
            await self._pause(self._speaker.current)

    def _probe_held_words(self, onset: float, span_ms: int) -> None:
        """The caller's habit holds the bot over their voice: ask what they are saying (once
        per sound, only with speculation on: it costs an STT request)."""
        speech = self._speaker.current
        if (
            self._early.probing_held
            or speech is None
            or not speech.can_be_interrupted
            or not self._endpointer.config.pause_ms
            or span_ms >= self.judge.habit.hold_ms(self.policy)  # not held: it pauses by itself
            or not self.judge.voice_so_far
        ):
            return

        async def verdict(text: str) -> None:
            current = self.onset == onset and self.state.caller is Caller.SOUND
            takes_floor = (
                current and self._speaker.current is speech and not self._only_listening(None, text)
            )
            metrics.SPECULATION.labels("stt", "used" if takes_floor else "wasted").inc()
            if takes_floor:
                # The receive loop pauses the bot at the next frame, as for any speech: the
                # whole utterance is then transcribed when it ends, and that decides.
                log.info("barge_in.held_words", pii_text=text)
                self.state = self.state.words_take_floor()

        self._early.probe_held(self._endpointer.utterance_audio(), verdict)

    def sound_ended(self, event: SpeechEnded | SpeechDiscarded) -> bool:
        """The caller's sound is over; True if it is an utterance for STT. Not one: too short
        (a paused prompt resumes), or only ever the bot's echo or a noise while the bot was
        audible (dropped: the bot never stopped for it)."""
        went_on = self.state.bot is Bot.WENT_ON
        self._early.cancel_held()
        self.state = self.state.sound_ended()
        self.onset = None
        self._last_paused = self._sound_paused
        judged = self.judge.end()
        self._early.cancel_at_pause()
        if went_on:  # its words were judged at its pause: the bot went on
            return False
        if isinstance(event, SpeechDiscarded):
            if self._paused_speech is not None:
                self._resume(Outcome.RESUMED, "")
            return False
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
            return False
        self._last_over_bot = judged is not None and judged.over_bot
        self._last_ms = event.speech_ms
        self._last_level = active_level_db(
            np.frombuffer(event.audio, dtype="<i2").astype(np.float64)
        )
        # On our clock: when it started, less the longest echo delay (what it could echo).
        self._last_from = self._clock() - (self.frame_end - event.t_start + ECHO_WINDOW_S)
        if self._paused_speech is not None:  # its transcript decides; never wait forever
            self._cancel_pause_deadline()
            self._pause_deadline = asyncio.get_running_loop().call_later(
                PAUSE_VERDICT_LIMIT_S, self._verdict_overdue, self._paused_speech
            )
        return True

    def _verdict_overdue(self, speech: SpeechHandle) -> None:
        """No transcript came for the utterance that paused ``speech`` (lost, say, from a full
        STT queue): the prompt goes on rather than leave the call hanging."""
        if self._paused_speech is speech:
            log.warning("barge_in.no_verdict", limit_s=PAUSE_VERDICT_LIMIT_S)
            self._resume(Outcome.RESUMED, "")

    # -- the caller's words -----------------------------------------------------------------

    async def deliver(self, item: Utterance | NotUnderstood) -> None:
        """A transcript is in. Over the bot, words that do not take the floor (none, or only
        backchannel) are swallowed and a paused prompt resumes; a real turn makes the pause
        an interruption, and the flow gets the words (queued first: the flow, woken by the
        interruption, must find them).

        A reply to the caller's turn paused before they heard any of it answers nothing yet:
        words then are the caller going on with that turn ("yes, that is ... right"), never a
        backchannel to it, so they interrupt it whatever they are. (A prompt that answers no
        turn, such as the greeting, keeps the usual rule: "okay" does not skip it.)"""
        paused = self._paused_speech
        over_bot = self._last_over_bot
        self._last_over_bot = False
        bot_on = paused is not None or (over_bot and self._speaker.current is not None)
        if over_bot and isinstance(item, Utterance) and self._echoes_bot(item.text):
            if bot_on:
                self._resume(Outcome.ECHO, item.text)
            else:  # the echo of the bot's last words, after it stopped: no one to answer
                metrics.BARGE_INS.labels("speech", Outcome.ECHO.value).inc()
                log.info("barge_in.ignored", outcome=Outcome.ECHO.value, by="words")
            return
        if bot_on and isinstance(item, Utterance) and self._only_listening(paused, item.text):
            outcome = Outcome.BACKCHANNEL if words_of(item.text) else Outcome.RESUMED
            self._resume(outcome, item.text, self._last_ms)
            return
        if isinstance(item, Utterance) and words_of(item.text):
            self.judge.caller_level.heard_turn(self._last_level)
        self._inputs.put(item)
        if paused is not None:
            self._paused_speech = None
            self.state = self.state.interrupted()
            self._cancel_pause_deadline()
            self._cancel_pause_bound()
            await paused.interrupt("speech")
        elif over_bot and isinstance(item, Utterance):
            # Over before it could pause the bot (shorter than the node's min_speech_ms, say
            # "Stop."): the words decide now, as they would have after a pause.
            await self._speaker.interrupt("speech")

    def _echoes_bot(self, text: str) -> bool:
        """The words are the bot's own, from what played while the sound could echo it
        (``echoes_bot``): an echo the audio checks let through."""
        said = self._speaker.player.said_since(self._last_from)
        return echoes_bot(text, said, line_echoes=self.judge.echo_path.delay_s is not None)

    def _only_listening(self, paused: SpeechHandle | None, text: str) -> bool:
        """The caller's words over the bot do not take the floor: none, or only backchannel.
        Over a reply to their turn (``paused``) that they heard none of, any word does: it
        goes on with that turn (see ``deliver``)."""
        if not words_of(text):
            return True
        if paused is not None and paused.turn is not None and not paused.heard_anything:
            return False
        return not self.policy.is_real_turn(text)

    def _resume(self, outcome: Outcome, text: str, speech_ms: int = 0) -> None:
        """The caller's sound did not take the floor: a paused prompt goes on. A backchannel
        (``speech_ms`` long) teaches the call this caller's habit (``BackchannelHabit``); one
        that taught it something, or paused the bot, goes on the call's timeline (the record
        carries the habit to a resumed stream, and the console shows it)."""
        self._cancel_pause_deadline()
        self._cancel_pause_bound()
        paused, self._paused_speech = self._paused_speech, None
        self.state = self.state.resumed()
        if outcome is Outcome.BACKCHANNEL and speech_ms > 0:
            span_ms = speech_ms + self._endpointer.hangover_ms
            # Its words came after the bot went on (``_hold_on``): it paused the bot all the same.
            was_paused = paused is not None or self._last_paused
            if self.judge.habit.heard(span_ms) or was_paused:
                self._timeline.add("backchannel", span_ms=span_ms, paused=was_paused)
        metrics.BARGE_INS.labels("speech", outcome.value).inc()
        log.info("barge_in.swallowed", outcome=outcome.value, pii_text=text)
        if paused is not None:
            paused.resume()

    def _cancel_pause_deadline(self) -> None:
        if self._pause_deadline is not None:
            self._pause_deadline.cancel()
            self._pause_deadline = None

    def _cancel_pause_bound(self) -> None:
        if self._pause_bound is not None:
            self._pause_bound.cancel()
            self._pause_bound = None

    # -- settings and waits -----------------------------------------------------------------

    def recall_backchannels(self, spans_ms: Iterable[int]) -> None:
        """A resumed call: the caller's backchannels on its earlier streams (from its record's
        timeline, ``backchannel_spans``) teach this one their habit, as if heard here."""
        for span_ms in spans_ms:
            self.judge.habit.heard(span_ms)

    def set_policy(self, policy: InterruptionPolicy | None) -> None:
        self.policy = policy or DEFAULT_POLICY

    async def until_sound_judged(self, limit: float = 0.5) -> None:
        """The caller just made a sound not yet judged speech (needs min_speech_ms) or noise:
        a reply (ready sooner now that turns are speculated) waits those few frames rather
        than start over a caller who went on talking. Polled: it is rare and short."""
        waited = 0.0
        while self.state.caller_sounding and not self.state.caller_confirmed and waited < limit:
            if self.judge.heard_not_speech:  # the bot's own echo, or noise: nobody to wait for
                return
            await asyncio.sleep(0.02)
            waited += 0.02

    async def aclose(self) -> None:
        self._cancel_pause_deadline()
        self._cancel_pause_bound()
        await self._early.aclose()


def _ignored_as(verdicts: list[Verdict], taken_for_speech: bool) -> Outcome:
    """What a sound over the bot that never proved to be the caller's voice was."""
    if Verdict.ECHO in verdicts and not taken_for_speech:
        return Outcome.ECHO
    if Verdict.BACKGROUND in verdicts:
        return Outcome.BACKGROUND
    return Outcome.NOISE
