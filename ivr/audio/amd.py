"""Answering machine detection from the first seconds of an outbound call's audio. Pure numpy.

Two cues, both cheap:

* **Greeting length.** A person who picks up says a word or two ("Hello?") and stops to let the
  caller speak; a voicemail greeting talks on ("Hi, you've reached Sam, I can't take your call
  right now, please leave a message after the tone"). Speech that runs on, pauses shorter than
  ``reply_pause_s`` bridged, for longer than ``greeting_s`` is a machine; speech followed by a
  pause of ``reply_pause_s`` before then is a person.
* **The beep.** A steady tone (one spectral peak holding most of the energy, between 350 and
  2600 Hz, for at least ``min_beep_s``) is a recorder starting: a machine, and the moment a
  voicemail should begin. Voices are never that pure for that long.

Voice activity is frame energy against a running noise floor (a phone line's hiss or a quiet
room sits at its floor). Frames are analysed in batches (``push`` takes any number of bytes): one
vectorised FFT per batch keeps the cost to a few microseconds per 20 ms frame (``bench/amd.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, Literal

import numpy as np
import numpy.typing as npt

SAMPLE_RATE: Final = 8000
FRAME_SAMPLES: Final = 160  # 20 ms
FRAME_S: Final = FRAME_SAMPLES / SAMPLE_RATE

AnsweredBy = Literal["human", "machine", "unknown"]


@dataclass(frozen=True, slots=True)
class AmdConfig:
    greeting_s: float = 2.6
    """Speech running on this long (short pauses bridged) is a machine's greeting."""
    reply_pause_s: float = 0.8
    """A pause this long after a short greeting: the person waits for us, a human."""
    no_speech_s: float = 5.0
    """Nothing said for this long after the answer: unknown (dead air, a silent machine)."""
    min_speech_s: float = 0.12
    """Sound shorter than this (a click, the handset being picked up) is not speech."""
    speech_margin_db: float = 12.0
    """A frame is voiced when this much louder than the noise floor..."""
    min_speech_dbfs: float = -50.0
    """...and at least this loud."""
    min_beep_s: float = 0.16
    max_beep_s: float = 3.0
    beep_band_hz: tuple[float, float] = (350.0, 2600.0)
    beep_purity: float = 0.8
    """Share of a frame's energy in the tone's peak (+-2 bins) for the frame to be tonal."""
    greeting_end_s: float = 1.5
    """After a machine greeting, this much silence with no beep ends the greeting anyway."""
    max_listen_s: float = 45.0
    """Stop listening after this long (a machine that talks on and never beeps)."""


@dataclass(frozen=True, slots=True)
class AmdDecision:
    answered_by: AnsweredBy
    at_s: float
    """Audio time of the decision (seconds since the first frame)."""
    reason: Literal["greeting", "reply_pause", "beep", "no_speech"]


@dataclass(frozen=True, slots=True)
class GreetingEnd:
    """A machine's greeting is over: the recording starts now (after the beep, if any)."""

    at_s: float
    beep_hz: float | None
    """The beep's frequency; None when the greeting ended in silence without one."""


_WINDOW = np.hanning(FRAME_SAMPLES)
_BIN_HZ = SAMPLE_RATE / FRAME_SAMPLES
_VOICE_BAND = (round(300 / _BIN_HZ), round(3400 / _BIN_HZ) + 1)
_POWER_SCALE = FRAME_SAMPLES**2 * float(np.mean(_WINDOW**2))
"""Parseval with the window: 2 * sum(|X|^2) / this = the frame's mean square."""


class AnsweringMachineDetector:
    """Feed it the callee's audio (PCM16 mono 8 kHz) from the moment the call is answered.

    ``decision`` is set once (human, machine or unknown); after a machine decision it keeps
    listening until ``greeting_end`` (the beep, or silence). ``done`` means nothing more will
    come: stop feeding it.
    """

    def __init__(self, config: AmdConfig | None = None) -> None:
        self.config = c = config or AmdConfig()
        self.decision: AmdDecision | None = None
        self.greeting_end: GreetingEnd | None = None
        self.frames = 0
        self._tail = b""
        self._floor_db: float | None = None  # set from the first frame (the line, not a voice)
        self._speech_start: float | None = None  # start of the current run of speech
        self._last_voiced: float | None = None
        self._voiced_s = 0.0  # voiced time in the current run
        self._tone_frames = 0
        self._tone_bin = -1
        self._min_tone = round(c.min_beep_s / FRAME_S)
        self._max_tone = round(c.max_beep_s / FRAME_S)
        lo, hi = c.beep_band_hz
        self._band = (int(lo / _BIN_HZ), int(hi / _BIN_HZ) + 1)

    @property
    def done(self) -> bool:
        if self.now_s >= self.config.max_listen_s:
            return True
        if self.decision is None:
            return False
        return self.decision.answered_by != "machine" or self.greeting_end is not None

    @property
    def now_s(self) -> float:
        return self.frames * FRAME_S

    def push(self, pcm16: bytes) -> None:
        """Analyse whole 20 ms frames of ``pcm16`` (a partial frame waits for the next push)."""
        if self.done:
            return
        data = self._tail + pcm16
        n = len(data) // (2 * FRAME_SAMPLES)
        self._tail = data[n * 2 * FRAME_SAMPLES :]
        if n == 0:
            return
        x = np.frombuffer(data, dtype="<i2", count=n * FRAME_SAMPLES).astype(np.float32)
        energy_db, tone_bin = _features(x.reshape(n, FRAME_SAMPLES), self._band, self.config)
        if self._floor_db is None:  # the line before anyone speaks; capped, so that someone
            # already talking at pick-up still counts as voiced
            first = float(np.median(energy_db[:5]))
            self._floor_db = min(first, self.config.min_speech_dbfs + 5)
        for i in range(n):
            self._frame(float(energy_db[i]), int(tone_bin[i]))
            if self.done:
                return

    # -- per frame -------------------------------------------------------------------------

    def _frame(self, energy_db: float, tone_bin: int) -> None:
        c = self.config
        self.frames += 1
        t = self.now_s
        assert self._floor_db is not None
        voiced = energy_db > max(self._floor_db + c.speech_margin_db, c.min_speech_dbfs)
        if not voiced:  # the floor sinks fast, rises slowly (soft speech must not lift it)
            rate = 0.2 if energy_db < self._floor_db else 0.02
            self._floor_db += rate * (energy_db - self._floor_db)
        if self._beep(tone_bin, voiced, t):
            return
        if voiced:
            if self._speech_start is None:
                self._speech_start = t - FRAME_S
                self._voiced_s = 0.0
            self._last_voiced = t
            self._voiced_s += FRAME_S
        if self.decision is None:
            self._decide(t)
        elif self._last_voiced is not None and t - self._last_voiced >= c.greeting_end_s:
            self.greeting_end = GreetingEnd(t, None)  # a machine greeting ended without a beep

    def _beep(self, tone_bin: int, voiced: bool, t: float) -> bool:
        """Track a steady tone; True when one just ended (a machine, the recording starts)."""
        if voiced and tone_bin >= 0 and abs(tone_bin - self._tone_bin) <= 1:
            self._tone_frames += 1
            return False
        ended = self._min_tone <= self._tone_frames <= self._max_tone
        if ended:
            hz = self._tone_bin * _BIN_HZ
            if self.decision is None or self.decision.answered_by != "machine":
                self.decision = AmdDecision("machine", t, "beep")
            self.greeting_end = GreetingEnd(t, hz)
        self._tone_frames = 1 if (voiced and tone_bin >= 0) else 0
        self._tone_bin = tone_bin if self._tone_frames else -1
        return ended

    def _decide(self, t: float) -> None:
        c = self.config
        if self._speech_start is None or self._last_voiced is None:
            if t >= c.no_speech_s:
                self.decision = AmdDecision("unknown", t, "no_speech")
            return
        pause = t - self._last_voiced
        if pause >= c.reply_pause_s:
            if self._voiced_s >= c.min_speech_s:
                self.decision = AmdDecision("human", t, "reply_pause")
                return
            self._speech_start = self._last_voiced = None  # a click: keep listening
            if t >= c.no_speech_s:
                self.decision = AmdDecision("unknown", t, "no_speech")
        elif self._last_voiced - self._speech_start >= c.greeting_s:
            self.decision = AmdDecision("machine", t, "greeting")


def _features(
    frames: npt.NDArray[np.float32], band: tuple[int, int], c: AmdConfig
) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.int64]]:
    """Per frame: energy in dBFS, and the tone's FFT bin (-1 when the frame is not a tone)."""
    spectrum = np.fft.rfft(frames * _WINDOW, axis=1)
    power = spectrum.real * spectrum.real + spectrum.imag * spectrum.imag
    cumulative = np.cumsum(power, axis=1)  # band sums by subtraction, no fancy slicing
    lo, hi = band  # inside 2 bins of either edge, so peak +- 2 stays in the spectrum
    peak = lo + power[:, lo:hi].argmax(axis=1)
    rows = np.arange(frames.shape[0])
    in_peak = cumulative[rows, peak + 2] - cumulative[rows, peak - 3]
    purity = in_peak / (cumulative[:, -1] - cumulative[:, 0] + 1e-9)
    tone = np.where(purity >= c.beep_purity, peak, -1)
    # Energy in the voice band only: line rumble and brown noise live below it.
    v_lo, v_hi = _VOICE_BAND
    mean_square = 2 * (cumulative[:, v_hi - 1] - cumulative[:, v_lo - 1]) / _POWER_SCALE
    energy_db = 10 * np.log10(mean_square / 32768.0**2 + 1e-12)
    return energy_db.astype(np.float64), tone.astype(np.int64)
