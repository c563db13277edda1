"""When the caller makes a sound over the bot, is it an interruption?

Three questions, in the order the audio answers them:

1. **Echo?** (``ivr.audio.echo``): the bot's own voice coming back down the line correlates
   with what the bot played; then nothing happens.
2. **Noise?** (``ivr.audio.voicing``): a cough, a door or static has no pitch. Unvoiced sound
   is held back for ``noise_hold_ms`` from its onset; if no voice appears by then and it is
   still going on, the bot pauses anyway (a long burst might be an unvoiced start, "st..."),
   and if none ever does it resumes when the sound ends, without asking STT (which would
   make words of a cough).
3. **Words?** Anything else pauses the bot at once (``clear``, the heard position kept), within
   the onset-to-``clear`` budget. When the utterance is transcribed, a real turn (at least
   ``min_words`` words, not all backchannel) makes the interruption stand; no words or only
   backchannel ("uh-huh", "okay") and the bot resumes the sentence it was cut in. Speech is
   checked from its onset, but the bot pauses only once it has lasted ``min_speech_ms``; a
   node that raises it lets a short backchannel play through with no pause at all, and a
   word over before it ("Stop.") interrupts when transcribed.
4. **This caller's habit.** Once a caller has backchanneled in a call, their sound over the bot
   pauses it only once it has lasted 200 ms longer than their longest backchannel so far
   (``BackchannelHabit``), or sooner if their words so far, transcribed while the bot holds
   on, are more than backchannel (``ivr.call.barge_in``). The next "uh-huh" plays through, and their
   real interruptions stop the bot later. A listener who says "mm-hmm" is not cut off at
   every one. The call's record keeps the habit: a resumed call goes on with it.

``InterruptionPolicy`` is per flow node (``interruptions:`` in YAML); ``BargeInJudge`` is per
call and holds the caller-side audio the checks need.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from enum import StrEnum

import numpy as np
import numpy.typing as npt
import structlog

from ivr.audio.codec import FRAME_BYTES_PCM16, rms16
from ivr.audio.echo import EchoCheck, EchoPath, check_echo
from ivr.audio.far_end import RATE, FarEndReference
from ivr.audio.levels import active_level_db, level_db
from ivr.audio.voicing import voiced_frames
from ivr.callio.interruption_policy import (
    InterruptionPolicy,
    words_of,
)

log = structlog.get_logger("ivr.call")

FLOOR_FRAMES = 10
"""The line's noise floor is measured over this many frames (200 ms) at a time..."""
FLOOR_KEPT = 25
"""...and is the quietest of the last this many (5 s)."""
ECHO_DELAY_SLACK_S = 0.02
"""Jitter allowed around a known echo delay before searching the whole range again."""
QUIET_DB = -50.0
"""Caller audio below this (dBFS) is nobody talking."""

ECHO_WORDS_SHARE = 0.7
"""Of a transcript's words, this share found in order in what the bot just said: its echo."""
ECHO_WORDS_ALONE = 4
"""So many of the bot's words in a row are its echo even on a line not known to echo ("Say
balance." - "Balance." is an answer, not an echo)."""


def echoes_bot(text: str, bot_said: str, *, line_echoes: bool = True) -> bool:
    """``text`` (a transcript of caller sound) is the bot's own words coming back: most of
    its words appear, in order, in ``bot_said`` (at least ``ECHO_WORDS_ALONE`` of them unless
    the call's line is known to echo). An STT transcribes an echo that got past the audio
    checks as the bot's words; answering them would be the bot answering itself."""
    heard, said = words_of(text), words_of(bot_said)
    if not heard or not said or (not line_echoes and len(heard) < ECHO_WORDS_ALONE):
        return False
    # Longest common subsequence, one row at a time: a few dozen words each way.
    row = [0] * (len(said) + 1)
    for word in heard:
        diagonal = 0
        for j, spoken in enumerate(said, 1):
            above = row[j]
            row[j] = diagonal + 1 if word == spoken else max(row[j], row[j - 1])
            diagonal = above
    return row[-1] >= ECHO_WORDS_SHARE * len(heard)


@dataclass(slots=True)
class BackchannelHabit:
    """Per call: how long this caller's backchannels run, once they have said one.

    Someone who says "uh-huh" once will say it again; pausing the bot for every one costs
    them a gap each time (~0.6 s), while their real interruptions, which start like a
    backchannel ("yeah, but"), can afford to stop the bot a little later. The call's record
    keeps what taught it (``backchannel`` events on its timeline), so a call resumed on
    another instance goes on with it (``CallSession.recall_backchannels``).
    """

    longest_ms: int | None = None

    def heard(self, span_ms: int) -> bool:
        """A sound over the bot turned out to be backchannel; its speech spanned ``span_ms``
        (as ``Endpointer.speech_span_ms`` measures it). True if it is the longest yet."""
        if self.longest_ms is not None and span_ms <= self.longest_ms:
            return False
        self.longest_ms = span_ms
        log.info("barge_in.backchannel_habit", longest_ms=span_ms)
        return True

    def hold_ms(self, policy: InterruptionPolicy) -> int:
        """Speech span over the bot before it pauses, for this caller under ``policy``: once
        they have backchanneled, ``backchannel_hold_ms`` (longer than any "uh-huh": the next
        plays through however its length differs from the first; their words so far, asked
        for ``HOLD_PROBE_MS`` in, stop the bot sooner when they are more), where backchannel
        is a thing (a node where "yeah" is an answer, ``backchannels: []``, keeps its
        minimum). Holding only past their longest so far (+200 ms) let a longer second one
        ("uh-huh" after "okay") pause the bot: 25 % of second backchannels did."""
        if self.longest_ms is None or not policy.backchannels or policy.backchannel_hold_ms <= 0:
            return policy.min_speech_ms
        return max(policy.min_speech_ms, policy.backchannel_hold_ms)


@dataclass(slots=True)
class CallerLevel:
    """Per call: how loud this caller speaks, from the turns they took. Sound over the bot
    much quieter than that is someone else (a TV, babble, a voice across the room, the bot's
    own echo): it does not take the floor from the bot."""

    BACKGROUND_DB = 6.0
    """Sound this far under the caller's own level is background. Voices 10 dB under it on
    the whole peak 6-8 dB under it over the 240 ms a check hears (bench/echo.py's babble
    and single-voice cells), so the margin leaves them room; the caller's own speech stays
    within ~4 dB of their level."""
    KEPT = 5

    levels: list[float] = field(default_factory=list)

    def heard_turn(self, active_db: float) -> None:
        """A turn of theirs, at ``active_db`` (``active_level_db`` of its audio)."""
        if active_db > -120.0:
            self.levels = [*self.levels[-(self.KEPT - 1) :], active_db]

    @property
    def level_db(self) -> float | None:
        """The median of their last turns' levels (None before their first turn)."""
        return float(np.median(self.levels)) if self.levels else None

    def background(self, near: npt.NDArray[np.float64]) -> bool:
        """``near`` is well under this caller's own level."""
        level = self.level_db
        return level is not None and active_level_db(near) < level - self.BACKGROUND_DB


class Verdict(StrEnum):
    WAIT = "wait"
    """Not enough audio to tell yet."""
    SPEECH = "speech"
    ECHO = "echo"
    NOISE = "noise"
    BACKGROUND = "background"
    """A voice well under the caller's own level (``CallerLevel``): someone else."""
    QUIET = "quiet"
    """Nothing audible in the last 100 ms (a gap in the echo, the tail of a sound)."""


NOT_SPEECH = frozenset({Verdict.ECHO, Verdict.NOISE, Verdict.BACKGROUND})


class Outcome(StrEnum):
    """What became of caller sound over the bot (the ``outcome`` label of ivr_barge_ins_total)."""

    INTERRUPTED = "interrupted"
    RESUMED = "resumed"
    """Paused, then no words came: the bot went on from the sentence it was cut in."""
    BACKCHANNEL = "backchannel"
    ECHO = "echo"
    NOISE = "noise"
    BACKGROUND = "background"


@dataclass(slots=True)
class JudgedUtterance:
    onset: float  # stream time
    verdicts: list[Verdict] = field(default_factory=list)
    """What the checks said (or SPEECH, taken without a check while the bot was silent)."""
    over_bot: bool = False
    """Judged while the bot was audible (or paused for it)."""
    voiced: bool = False
    """A voice was heard in it (or it was taken for speech unchecked): worth transcribing."""
    checked_at_frame: int = -1
    early: list[Verdict] = field(default_factory=list)
    """What the checks said before ``min_speech_ms`` (the bot does not pause for those yet)."""
    held: bool = False
    """It paused the bot, whose words so far were backchannel: the rest is held (``hold``)."""

    @property
    def taken_for_speech(self) -> bool:
        return Verdict.SPEECH in self.verdicts

    @property
    def voice_heard(self) -> bool:
        """A voice was heard in it, and it was not last taken for echo (an echo check can only
        lock on after some audio, so an early voice may turn out to be the bot's)."""
        decisive = [v for v in self.early + self.verdicts if v in (Verdict.SPEECH, Verdict.ECHO)]
        return bool(decisive) and decisive[-1] is Verdict.SPEECH


class BargeInJudge:
    """Per call: the last ``history_s`` of caller audio and what the bot played, and the checks.

    Feed every inbound frame with ``push``; ``judge`` while an utterance is in progress and
    the bot is audible. Times: ``clock`` times are on the player's playout clock (the session's
    clock), stream times are Twilio's.
    """

    # Slots: every inbound frame reads this object, most often with it out of the CPU's caches
    # (bench/frame_cost.py); slotted, its attributes are in the object, not an array apart.
    __slots__ = (
        "_echo_delay",
        "_floor",
        "_frames",
        "_near",
        "_near_end",
        "_utterance",
        "caller_level",
        "echo_path",
        "habit",
        "reference",
    )

    ECHO_CHECK_EVERY_FRAMES = 2
    NEAR_WINDOW_S = 0.24

    def __init__(self, reference: FarEndReference, history_s: float = 0.5) -> None:
        self.reference = reference
        self.echo_path = EchoPath()
        """This call's echo path, learned from sure echo checks (``EchoPath``)."""
        self.caller_level = CallerLevel()
        self._near: deque[bytes] = deque(maxlen=round(history_s * RATE * 2 / FRAME_BYTES_PCM16))
        self._near_end = 0.0  # playout-clock time the newest pushed frame ended
        self._frames = 0
        self._floor: deque[float] = deque(maxlen=FLOOR_KEPT)
        self._utterance: JudgedUtterance | None = None
        self._echo_delay: float | None = None
        """The echo path's delay, once found: later checks search only around it."""
        self.habit = BackchannelHabit()

    def push(self, pcm16_frame: bytes, ends_at: float) -> None:
        self._near.append(pcm16_frame)
        self._near_end = ends_at
        self._frames += 1
        if self._frames % FLOOR_FRAMES == 0:
            self._floor.append(self._recent_power(FLOOR_FRAMES))

    @property
    def noise_power(self) -> float:
        """The caller's line when nobody talks: the quietest 200 ms of the last few seconds
        (mean square, int16 scale); speech and echo both leave such gaps."""
        return min(self._floor, default=0.0)

    def _recent_power(self, frames: int) -> float:
        near = self._near
        recent = b"".join(near[i] for i in range(max(0, len(near) - frames), len(near)))
        return float(rms16(recent)) ** 2 if recent else 0.0

    def bot_audible(self, max_delay: float = 0.6) -> bool:
        """Bot audio played recently enough that it could be coming back as echo now."""
        return self.reference.audible(self._near_end - max_delay, self._near_end)

    @property
    def heard_not_speech(self) -> bool:
        """The sound in progress was last judged the bot's echo or noise, not the caller."""
        u = self._utterance
        return u is not None and bool(u.verdicts) and u.verdicts[-1] in NOT_SPEECH

    @property
    def onset(self) -> float | None:
        """Stream time the utterance being judged began (None between utterances)."""
        return self._utterance.onset if self._utterance else None

    def start(self, onset: float) -> None:
        self._utterance = JudgedUtterance(onset)

    def confirm(self) -> None:
        """The utterance was taken for speech without a check (the bot was silent)."""
        if self._utterance is not None:
            self._utterance.verdicts.append(Verdict.SPEECH)
            self._utterance.voiced = True

    def hold(self) -> None:
        """The utterance paused the bot, which went on over it (its words so far were only
        backchannel): from now on it pauses the bot only once its speech spans the policy's
        ``backchannel_span_ms``, as a known backchanneler's would."""
        if self._utterance is not None:
            self._utterance.held = True

    @property
    def holding(self) -> bool:
        """The sound in progress is held (``hold``): judged over the bot until it ends."""
        return self._utterance is not None and self._utterance.held

    @property
    def awaiting_voice(self) -> bool:
        """The bot paused for a sound with no voice in it yet: keep listening for one."""
        u = self._utterance
        return u is not None and u.over_bot and u.taken_for_speech and not u.voiced

    def watch_voice(self) -> None:
        """After a pause for unvoiced sound: note when a voice comes in (every other frame)."""
        u = self._utterance
        if u is None or u.voiced or self._frames - u.checked_at_frame < 2:
            return
        u.checked_at_frame = self._frames
        u.voiced = voiced_frames(self._recent()) > 0

    def end(self) -> JudgedUtterance | None:
        """The utterance is over: what it was judged (None if it never was). One over before
        ``min_speech_ms`` ("Stop.", "uh-huh" under a long minimum) never paused the bot; it is
        voiced, so worth transcribing, if a voice was heard in it and it was not last taken
        for echo (an echo check can only lock on after some audio). Its endpoint silence may
        run past the minimum: the quiet checked then is no verdict on the words before it."""
        utterance, self._utterance = self._utterance, None
        if utterance is not None and not utterance.taken_for_speech:
            utterance.voiced = utterance.voice_heard
        return utterance

    @property
    def voice_so_far(self) -> bool:
        """The sound in progress has a voice in it (see ``JudgedUtterance.voice_heard``)."""
        return self._utterance is not None and self._utterance.voice_heard

    def judge(
        self, stream_now: float, voiced_ms: int, span_ms: int, policy: InterruptionPolicy
    ) -> Verdict:
        """Is the sound in progress the caller taking the floor? ``voiced_ms``: the endpointer's
        own (conservative, hangover-free) measure of it, for sound that has no voice;
        ``span_ms``: its ``speech_span_ms``, for the caller's backchannel habit."""
        utterance = self._utterance
        if utterance is None:
            return Verdict.WAIT
        utterance.over_bot = True
        elapsed_ms = (stream_now - utterance.onset) * 1000
        # A caller's habit is held against the speech's span, the measure a backchannel's
        # length was learned in: it stops growing when they stop, so the trailing edge of
        # "mm-hmm", still in the checks' 240 ms window, does not pause the bot.
        hold_ms = self.habit.hold_ms(policy)
        if utterance.held:
            hold_ms = max(hold_ms, policy.backchannel_span_ms)
        early = elapsed_ms < policy.min_speech_ms or (
            hold_ms > policy.min_speech_ms and span_ms < hold_ms
        )
        verdicts = utterance.early if early else utterance.verdicts
        last = verdicts[-1] if verdicts else Verdict.WAIT
        # Echo goes on as long as the bot talks: check it every other frame (~0.2 ms each).
        every = self.ECHO_CHECK_EVERY_FRAMES if last is Verdict.ECHO else 1
        if self._frames - utterance.checked_at_frame < every:
            return Verdict.WAIT if early else last
        utterance.checked_at_frame = self._frames
        # Checked from the onset, so that a sound over before min_speech_ms is still known for
        # speech or not (see ``end``); the bot pauses only once it has lasted that long.
        verdict = self._check(utterance, early, elapsed_ms, voiced_ms, policy, hold_ms)
        verdicts.append(verdict)
        return Verdict.WAIT if early else verdict

    def _recent(self) -> npt.NDArray[np.float64]:
        n = min(len(self._near), round(self.NEAR_WINDOW_S * RATE * 2 / FRAME_BYTES_PCM16))
        frames = list(self._near)[-n:]
        return np.frombuffer(b"".join(frames), dtype="<i2").astype(np.float64)

    def _echo(self, near: npt.NDArray[np.float64], policy: InterruptionPolicy) -> bool:
        """``near`` is the bot's own voice coming back: it correlates with what played, or
        it is no louder than the echo this call's line has been giving (``EchoPath``)."""
        hint = self._echo_delay
        if hint is not None:
            around = check_echo(
                near, self._near_end, self.reference,
                min_delay=max(0.0, hint - ECHO_DELAY_SLACK_S), max_delay=hint + ECHO_DELAY_SLACK_S,
            )  # fmt: skip
            if around.is_echo(policy.echo_threshold):
                self._learn(around, near.size)
                return True
        echo = check_echo(near, self._near_end, self.reference)
        self._learn(echo, near.size)
        if echo.is_echo(policy.echo_threshold):
            self._echo_delay = echo.delay_s
        explained = self.echo_path.explains(near, self._near_end, self.reference, self.noise_power)
        log.debug(
            "barge_in.echo_check",
            correlation=round(echo.correlation, 3),
            delay_ms=round(echo.delay_s * 1000),
            near_db=round(echo.near_db, 1),
            far_db=round(echo.far_db, 1),
            explained=explained,
        )
        return echo.is_echo(policy.echo_threshold) or explained

    def _learn(self, check: EchoCheck, n: int) -> None:
        self.echo_path.learn(check, n, self._near_end, self.reference)

    def _check(
        self,
        utterance: JudgedUtterance,
        early: bool,
        elapsed_ms: float,
        voiced_ms: int,
        policy: InterruptionPolicy,
        hold_ms: int,
    ) -> Verdict:
        near = self._recent()
        if level_db(near[-RATE // 10 :]) < QUIET_DB:
            return Verdict.QUIET
        if self.bot_audible() and self._echo(near, policy):
            return Verdict.ECHO
        if self.caller_level.background(near):
            return Verdict.BACKGROUND
        if voiced_frames(near) > 0:
            # Before min_speech_ms an echo check may not have locked on yet: ``end`` decides.
            utterance.voiced = utterance.voiced or not early
            return Verdict.SPEECH
        # No voice (yet): a cough, a door, static, or the "s" of "stop". Long enough, and
        # loud enough for the endpointer to count it, it pauses the bot all the same.
        if elapsed_ms >= policy.noise_hold_ms and voiced_ms >= hold_ms:
            return Verdict.SPEECH
        return Verdict.NOISE
