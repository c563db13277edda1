"""Turns per-frame VAD decisions into utterances: start, end (with the audio) or discard.

Fed one frame at a time (20 ms, 50x per second per call), so the hot path only appends to a
bytearray and shifts a bit window; audio is copied out once per utterance.

Events, in order, for each utterance: ``SpeechStarted`` then exactly one of ``SpeechEnded``
(kept) or ``SpeechDiscarded`` (too little voiced audio: a click, a cough). A barge-in decision
taken on ``SpeechStarted`` can be undone on ``SpeechDiscarded``.

In between, when ``pause_ms`` is set: ``SpeechPaused`` each time the caller has been quiet
that long (with the audio so far, for speculative work while the endpoint silence still runs),
and ``SpeechResumed`` if they go on talking after it. A pause is heard on the signal's level
(frames ``pause_db`` below the utterance's loudest), not only on the VAD, whose own hangover
(~100 ms for Silero) would make every speculation start that much later; the VAD's silence
counts too, for lines too noisy for the level to drop. ``set_silence_ms`` moves the end of the
turn in progress (an end-of-turn model's verdict) without touching the configured default.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from itertools import islice
from typing import Self

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ivr.audio.codec import rms16
from ivr.audio.vad import VoiceActivityDetector

LOUD_LINE_PAUSE_FRAMES = 2
"""On a line whose level stays up, frames of VAD silence beyond the pause's own before the
pause is reported (a VAD's non-speech inside a word lasts a frame or two)."""


class EndpointConfig(BaseModel):
    """Endpointing knobs; all durations in milliseconds (rounded up to whole frames)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    silence_ms: int = Field(default=300, ge=1)  # non-speech after speech that ends a turn
    min_speech_ms: int = Field(default=100, ge=0)  # less voiced audio than this is discarded
    preroll_ms: int = Field(default=200, ge=0)  # audio kept from before speech started
    max_utterance_ms: int = Field(default=30000, ge=100)  # force an end after this long
    start_frames: int = Field(default=3, ge=1)  # speech frames within start_window to start
    start_window: int = Field(default=5, ge=1, le=60)
    resume_frames: int = Field(default=2, ge=1)  # consecutive speech frames that end a pause
    # Silence that makes a pause worth speculating on (SpeechPaused); 0 = no pause events.
    pause_ms: int = Field(default=0, ge=0)
    pause_db: float = Field(default=30.0, gt=0)  # below the utterance's peak level = quiet

    @model_validator(mode="after")
    def _start_fits_window(self) -> Self:
        if self.start_frames > self.start_window:
            raise ValueError(
                f"start_frames ({self.start_frames}) exceeds start_window ({self.start_window})"
            )
        if self.pause_ms >= self.silence_ms:
            raise ValueError(
                f"pause_ms ({self.pause_ms}) must be shorter than silence_ms ({self.silence_ms})"
            )
        return self


@dataclass(frozen=True, slots=True)
class SpeechStarted:
    t: float  # stream time where the first speech frame of the trigger window begins
    t_detected: float  # end of the frame that triggered the start


@dataclass(frozen=True, slots=True)
class SpeechEnded:
    t_end_of_speech: float  # end of the last speech frame: when the caller really stopped
    audio: bytes  # PCM16 at the VAD's rate: pre-roll + speech + trailing silence
    speech_ms: int  # from the first speech frame's start to the last one's end
    t_start: float
    t_detected: float  # end of the frame that completed the silence (or hit the cap)
    truncated: bool = False  # ended by max_utterance_ms, not by silence


@dataclass(frozen=True, slots=True)
class SpeechDiscarded:
    t_start: float
    t_detected: float
    voiced_ms: int  # below min_speech_ms


@dataclass(frozen=True, slots=True)
class SpeechPaused:
    """The caller has been silent ``pause_ms``: the turn may be over (not decided yet)."""

    t_end_of_speech: float
    audio: bytes  # PCM16 at the VAD's rate, as SpeechEnded would carry it now
    speech_ms: int
    t_start: float
    t_detected: float
    pause: int  # 1, 2, ... within the utterance: tells a later pause's audio from this one's


@dataclass(frozen=True, slots=True)
class SpeechResumed:
    """The caller went on talking after a ``SpeechPaused``: what was paused on is stale."""

    t: float
    pause: int


EndpointEvent = SpeechStarted | SpeechEnded | SpeechDiscarded | SpeechPaused | SpeechResumed


def _frames(ms: int, frame_ms: int) -> int:
    return math.ceil(ms / frame_ms)


class Endpointer:
    """Segments a stream of fixed-size PCM16 frames into utterances with a ``vad``.

    Start: ``start_frames`` speech frames among the last ``start_window``. End: ``silence_ms``
    of non-speech; inside that pause a lone speech frame is ignored, ``resume_frames``
    consecutive ones resume the utterance.
    """

    __slots__ = (
        "_ask_async",
        "_bits",
        "_cfg",
        "_default_silence_frames",
        "_frame_bytes",
        "_frame_s",
        "_hangover_frames",
        "_in_speech",
        "_last_speech_end",
        "_loud_run",
        "_mask",
        "_max_frames",
        "_min_voiced",
        "_pause_frames",
        "_pause_ratio",
        "_paused",
        "_pauses",
        "_peak",
        "_preroll",
        "_preroll_frames",
        "_quiet",
        "_quiet_frames",
        "_run",
        "_silence_frames",
        "_silent",
        "_t_start",
        "_utt",
        "_utt_frames",
        "_vad",
        "_voiced",
    )

    def __init__(self, vad: VoiceActivityDetector, config: EndpointConfig | None = None) -> None:
        cfg = config or EndpointConfig()
        fm = vad.frame_ms
        self._vad = vad
        self._ask_async: Callable[[bytes], Awaitable[bool]] | None = getattr(
            vad, "is_speech_async", None
        )
        self._cfg = cfg
        self._frame_s = fm / 1000
        self._frame_bytes = 2 * vad.sample_rate * fm // 1000
        # The VAD's own hangover already counts as "speech": take it off both the end time
        # and the silence still to wait for, so latency is measured from the real end.
        self._hangover_frames = min(vad.hangover_ms // fm, _frames(cfg.silence_ms, fm) - 1)
        self._default_silence_frames = _frames(cfg.silence_ms, fm) - self._hangover_frames
        self._silence_frames = self._default_silence_frames
        self._pause_frames = (
            max(1, _frames(cfg.pause_ms, fm) - self._hangover_frames) if cfg.pause_ms else 0
        )
        self._quiet_frames = _frames(cfg.pause_ms, fm) if cfg.pause_ms else 0
        self._pause_ratio = 10 ** (-cfg.pause_db / 20)
        self._min_voiced = _frames(cfg.min_speech_ms, fm)
        self._max_frames = _frames(cfg.max_utterance_ms, fm)
        self._preroll_frames = _frames(cfg.preroll_ms, fm)
        self._mask = (1 << cfg.start_window) - 1
        self._preroll: deque[bytes] = deque(maxlen=self._preroll_frames + cfg.start_window)
        self._utt = bytearray()
        self.reset()

    @property
    def config(self) -> EndpointConfig:
        return self._cfg

    @property
    def in_speech(self) -> bool:
        return self._in_speech

    @property
    def voiced_ms(self) -> int:
        """Voiced time of the utterance in progress, not counting the VAD's hangover: what
        ``min_speech_ms`` is compared with (so a click never reaches it)."""
        if not self._in_speech:
            return 0
        return max(0, self._voiced - self._hangover_frames) * self._vad.frame_ms

    @property
    def speech_span_ms(self) -> int:
        """The utterance in progress from its first speech frame to its latest one, the VAD's
        hangover included (0 between utterances): it stops growing once the caller stops,
        where the time since the onset would not."""
        if not self._in_speech:
            return 0
        return round((self._last_speech_end - self._t_start) * 1000)

    @property
    def hangover_ms(self) -> int:
        """The VAD hangover taken off an utterance's end (``SpeechEnded.speech_ms`` plus this
        is the ``speech_span_ms`` it had at its last speech frame)."""
        return self._hangover_frames * self._vad.frame_ms

    @property
    def silence_ms(self) -> int:
        """The silence that ends the turn in progress (the configured one unless moved)."""
        return (self._silence_frames + self._hangover_frames) * self._vad.frame_ms

    def set_silence_ms(self, ms: int) -> None:
        """End the turn in progress after ``ms`` of silence instead of the configured silence
        (a turn that is clearly over ends sooner, an unfinished one waits longer). Applies
        until the caller goes on (``SpeechResumed``) or the utterance ends; at least one frame
        past the pause point, so a shorter silence never ends a turn before its pause was
        reported."""
        self._silence_frames = self._frames_of_silence(ms)

    def _frames_of_silence(self, ms: int) -> int:
        """Non-speech frames past the VAD's hangover that make ``ms`` of silence; always past
        the pause point, so no turn ends before its pause is reported."""
        floor = self._pause_frames + 1 if self._pause_frames else 1
        return max(floor, _frames(ms, self._vad.frame_ms) - self._hangover_frames)

    def utterance_audio(self) -> bytes:
        """The utterance in progress so far, trailing silence included (a copy)."""
        return bytes(self._utt) if self._in_speech else b""

    def use_default_silence_ms(self, ms: int | None) -> None:
        """The silence that ends turns from the next utterance on (what the node listening now
        waits for: longer for an account number); None: the configured one."""
        self._default_silence_frames = self._frames_of_silence(
            self._cfg.silence_ms if ms is None else ms
        )
        if not self._in_speech:
            self._silence_frames = self._default_silence_frames

    def close(self) -> None:
        """The call is over: give back what the VAD holds (a pooled Silero model)."""
        self._vad.close()

    def reset(self) -> None:
        """Forget everything, including an utterance in progress (no event is emitted)."""
        self._preroll.clear()
        self._utt.clear()
        self._bits = 0
        self._in_speech = False
        self._t_start = self._last_speech_end = 0.0
        self._voiced = self._silent = self._run = self._utt_frames = 0
        self._paused = False
        self._pauses = 0
        self._peak = self._quiet = self._loud_run = 0
        self._silence_frames = self._default_silence_frames

    def push(self, frame: bytes, t: float) -> EndpointEvent | None:
        """Feed the frame that starts at stream time ``t`` seconds."""
        self._check(frame)
        return self._judged(frame, t, self._vad.is_speech(frame))

    async def push_async(self, frame: bytes, t: float) -> EndpointEvent | None:
        """``push`` for the event loop: a VAD that batches its model across calls
        (``is_speech_async``, the gated Silero) is awaited; any other is asked directly."""
        self._check(frame)
        ask = self._ask_async
        speech = await ask(frame) if ask is not None else self._vad.is_speech(frame)
        return self._judged(frame, t, speech)

    def _check(self, frame: bytes) -> None:
        if len(frame) != self._frame_bytes:
            raise ValueError(
                f"Endpointer expects {self._frame_bytes}-byte PCM16 frames, got {len(frame)}"
            )

    def _judged(self, frame: bytes, t: float, speech: bool) -> EndpointEvent | None:
        if self._in_speech:
            return self._continue(frame, t, speech)
        return self._watch(frame, t, speech)

    def _watch(self, frame: bytes, t: float, speech: bool) -> SpeechStarted | None:
        self._preroll.append(frame)
        self._bits = ((self._bits << 1) | speech) & self._mask
        if self._bits.bit_count() < self._cfg.start_frames:
            return None
        ago = self._bits.bit_length() - 1  # frames since the oldest speech frame in the window
        take = min(len(self._preroll), ago + 1 + self._preroll_frames)
        for f in islice(self._preroll, len(self._preroll) - take, None):
            self._utt += f
        self._in_speech = True
        self._t_start = t - ago * self._frame_s
        self._last_speech_end = t + self._frame_s
        self._voiced = self._bits.bit_count()
        self._utt_frames = ago + 1
        self._silent = self._run = 0
        self._paused = False
        self._pauses = 0
        self._peak = self._quiet = self._loud_run = 0
        self._silence_frames = self._default_silence_frames
        return SpeechStarted(self._t_start, t + self._frame_s)

    def _continue(self, frame: bytes, t: float, speech: bool) -> EndpointEvent | None:
        self._preroll.append(frame)  # keeps pre-roll contiguous for the next utterance
        self._utt += frame
        self._utt_frames += 1
        self._run = self._run + 1 if speech else 0
        if speech:
            self._voiced += 1
        loud = self._pause_frames > 0 and self._level(frame, speech)
        if speech and (self._silent == 0 or self._run >= self._cfg.resume_frames):
            self._last_speech_end = t + self._frame_s
            self._silent = 0
        else:
            self._silent += 1
        if self._paused and speech and self._loud_run >= self._cfg.resume_frames:
            # Talking again: the VAD hears speech and the level is back (during the VAD's
            # hangover the VAD alone still says "speech" though the caller is quiet).
            self._paused = False
            # A silence moved at the pause judged the words up to it; these are new words, so
            # the configured silence holds until a new pause is judged (on a line too loud for
            # the level to drop, none may come before the end).
            self._silence_frames = self._default_silence_frames
            return SpeechResumed(t, self._pauses)
        if self._silent >= self._silence_frames:
            return self._finish(t + self._frame_s, truncated=False)
        if self._utt_frames >= self._max_frames:
            return self._finish(t + self._frame_s, truncated=True)
        quiet_long = self._quiet >= self._quiet_frames or self._silent >= self._pause_frames
        # A line too loud for the level to drop below the speech's (noise within pause_db of
        # it): the VAD's silence alone makes the pause, held a little past a flicker in a word.
        # Without it such a line never paused, so no turn of it was ever speculated on.
        vad_quiet_long = self._silent >= self._pause_frames + LOUD_LINE_PAUSE_FRAMES
        if (
            self._pause_frames
            and not self._paused
            and ((quiet_long and not loud) or vad_quiet_long)
        ):
            return self._pause(t + self._frame_s)
        return None

    def _level(self, frame: bytes, speech: bool) -> bool:
        """Track the utterance's peak level; whether this frame is loud (not quiet)."""
        level = rms16(frame)
        if speech and level > self._peak:
            self._peak = level
        if level > self._peak * self._pause_ratio:
            self._loud_run += 1
            self._quiet = 0
            return True
        self._loud_run = 0
        self._quiet += 1
        return False

    def _pause(self, now: float) -> SpeechPaused | None:
        fm = self._vad.frame_ms
        if max(0, self._voiced - self._hangover_frames) < self._min_voiced:
            return None  # a click so far: nothing worth transcribing
        self._paused = True
        self._pauses += 1
        # The caller went quiet `_quiet` frames ago (by level), or the VAD's silence began.
        quiet_since = now - self._quiet * self._frame_s
        vad_end = self._last_speech_end - self._hangover_s()
        end = max(self._t_start + fm / 1000, min(quiet_since, vad_end))
        return SpeechPaused(
            end,
            bytes(self._utt),
            round((end - self._t_start) * 1000),
            self._t_start,
            now,
            self._pauses,
        )

    def _hangover_s(self) -> float:
        return self._hangover_frames * self._frame_s

    def _finish(self, now: float, *, truncated: bool) -> SpeechEnded | SpeechDiscarded:
        fm = self._vad.frame_ms
        t_start, voiced = self._t_start, self._voiced
        event: SpeechEnded | SpeechDiscarded
        # The VAD's hangover frames were counted as voiced; they are not the caller's speech.
        voiced = max(0, voiced - self._hangover_frames)
        if voiced < self._min_voiced:
            event = SpeechDiscarded(t_start, now, voiced * fm)
        else:
            # Cut mid-speech (cap reached, no pause yet): no hangover to take off.
            hang = 0.0 if truncated and self._silent == 0 else self._hangover_s()
            end = max(t_start + fm / 1000, self._last_speech_end - hang)
            speech_ms = round((end - t_start) * 1000)
            audio = bytes(self._utt)
            event = SpeechEnded(end, audio, speech_ms, t_start, now, truncated)
        self._utt.clear()
        self._in_speech = False
        self._bits = 0
        self._voiced = self._silent = self._run = self._utt_frames = 0
        self._paused = False
        self._silence_frames = self._default_silence_frames
        return event
