"""The caller's line carrying the bot back: a speakerphone's or a 2-wire hybrid's echo path.

What the caller heard (the bot's mu-law as Twilio played it, decoded) comes back into what they
send: clipped by a speakerphone's amplifier (optional), band-limited to the phone band by the
handset's microphone and codec (optional, 300-3400 Hz), attenuated by the echo return loss,
``delay_s`` late, with line noise on top and the caller's own voice under it (double talk),
and mu-law encoded again for the line ("mu-law twice"). Every step is computed from the played
timeline and the sample index alone, so the echo is sample-continuous across frames and the
same for the same seed, and a ``LineRecord`` can keep what the line sent, part by part, for a
stand-in STT that transcribes exactly what the line carried.
"""

from __future__ import annotations

import bisect
import functools
import math
import threading
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from ivr.sim.playout import SAMPLE_RATE, ULAW_SILENCE, TwilioPlayout, ulaw_decode, ulaw_encode

Pcm = npt.NDArray[np.float64]
"""Audio as float64 samples on the int16 scale."""

BAND_HZ = (300.0, 3400.0)
BAND_TAPS = 255
FRACTION_TAPS = 32
_FULL_SCALE = 32768.0


def dbfs(level_db: float) -> float:
    """An RMS or peak level in dBFS, as a linear amplitude on the int16 scale."""
    return _FULL_SCALE * 10 ** (level_db / 20)


@functools.cache
def phone_band_taps() -> Pcm:
    """A minimum-phase FIR band-pass for 300-3400 Hz at 8 kHz: the magnitude of a windowed-sinc
    design, with the phase of a causal analogue filter (a handset's microphone and codec
    filters are not linear-phase), so the echo is shaped and phase-shifted, not just delayed."""
    lo, hi = (f / SAMPLE_RATE for f in BAND_HZ)
    n = np.arange(BAND_TAPS) - (BAND_TAPS - 1) / 2
    linear = (2 * hi * np.sinc(2 * hi * n) - 2 * lo * np.sinc(2 * lo * n)) * np.hamming(BAND_TAPS)
    size = 1 << 14
    # Homomorphic method: fold the real cepstrum of log|H| onto positive quefrencies.
    log_mag = np.log(np.maximum(np.abs(np.fft.fft(linear, size)), 1e-9))
    cepstrum = np.fft.ifft(log_mag).real
    fold = np.zeros(size)
    fold[0], fold[size // 2] = cepstrum[0], cepstrum[size // 2]
    fold[1 : size // 2] = 2 * cepstrum[1 : size // 2]
    minimum: Pcm = np.fft.ifft(np.exp(np.fft.fft(fold))).real[:BAND_TAPS]
    return minimum


@functools.cache
def path_taps(fraction: float, band_limit: bool) -> tuple[Pcm, int]:
    """The echo path's filter after its whole-sample delay, and how many samples early it must
    be read to delay by exactly ``fraction`` of a sample more: a windowed-sinc fractional delay
    (a speakerphone's acoustic path is no whole number of samples long), then the band."""
    taps: Pcm = np.ones(1)
    lead = 0
    if fraction > 0:
        lead = FRACTION_TAPS // 2
        m = np.arange(FRACTION_TAPS) - lead
        taps = np.sinc(m - fraction) * np.hamming(FRACTION_TAPS + 1)[:-1]
        taps = taps / taps.sum()
    if band_limit:
        taps = np.convolve(taps, phone_band_taps())
    return taps, lead


@dataclass(frozen=True, slots=True)
class LineFrame:
    """One 20 ms frame as the caller's line sent it, and its parts (float, int16 scale)."""

    ulaw: bytes
    near: Pcm
    """The caller's own microphone (their voice, or silence / comfort noise)."""
    echo: Pcm
    """The bot's voice coming back, after the whole echo path."""
    noise: Pcm
    source: Pcm
    """What the caller heard ``delay_s`` earlier: the bot audio this echo is a copy of."""

    @classmethod
    def plain(cls, ulaw: bytes) -> LineFrame:
        near = np.frombuffer(ulaw_decode(ulaw), dtype="<i2").astype(np.float64)
        zeros = np.zeros(near.size)
        return cls(ulaw, near, zeros, zeros, zeros)


class Background:
    """Other voices in the caller's room (babble, a TV, someone across the room): ``audio``
    (8 kHz, int16 scale) looped, scaled so its active speech is at ``level_dbfs``, on the line
    only within ``spans_s`` (seconds from the call's first sample)."""

    def __init__(self, audio: Pcm, level_dbfs: float, spans_s: tuple[tuple[float, float], ...]):
        self.audio = audio
        self.level_dbfs = level_dbfs
        self.spans_s = spans_s
        self._gain = dbfs(level_dbfs) / _active_rms(audio)

    def part(self, start: int, n: int) -> Pcm:
        """Its samples ``[start, start + n)`` of the line (zeros outside its spans)."""
        out = np.zeros(n)
        for lo_s, hi_s in self.spans_s:
            lo = max(start, round(lo_s * SAMPLE_RATE))
            hi = min(start + n, round(hi_s * SAMPLE_RATE))
            if lo < hi:
                out[lo - start : hi - start] = self.audio[np.arange(lo, hi) % self.audio.size]
        return out * self._gain


def _active_rms(x: Pcm) -> float:
    """RMS of ``x``'s 20 ms frames within 20 dB of its loudest (its speech, not its gaps)."""
    frames = x[: x.size - x.size % 160].reshape(-1, 160)
    power = np.mean(frames * frames, axis=1)
    return float(np.sqrt(np.mean(power[power >= power.max() / 100])))


@dataclass(frozen=True, slots=True)
class LineEcho:
    """The echo path of the caller's line. ``gain_db`` is minus the echo return loss (ERL):
    -20 puts a bot at -23 dBFS on the line at -43 dBFS. ``delay_s`` need not be a whole
    number of samples (0.1000625 is 800.5): the fraction is a windowed-sinc delay.

    ``band_limit``: through a 300-3400 Hz minimum-phase filter. ``clip_dbfs``: the caller's
    loudspeaker amplifier clips what it plays at this peak level (None: no clipping).
    ``noise_dbfs``: white line noise at this RMS level (None: none). ``seed`` picks the noise.
    """

    delay_s: float = 0.1
    gain_db: float = -20.0
    band_limit: bool = False
    clip_dbfs: float | None = None
    noise_dbfs: float | None = None
    seed: int = 0
    background: Background | None = None
    """Other voices on the line, mixed in like the noise (``Background``)."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.delay_s <= 2.0:
            raise ValueError(f"LineEcho.delay_s must be within 0..2 s, got {self.delay_s}")
        if not -80.0 <= self.gain_db <= 0.0:
            raise ValueError(f"LineEcho.gain_db must be within -80..0 dB, got {self.gain_db}")
        if self.clip_dbfs is not None and not -40.0 <= self.clip_dbfs <= 0.0:
            raise ValueError(f"LineEcho.clip_dbfs must be within -40..0 dBFS, got {self.clip_dbfs}")
        if self.noise_dbfs is not None and not -90.0 <= self.noise_dbfs <= -20.0:
            raise ValueError(
                f"LineEcho.noise_dbfs must be within -90..-20 dBFS, got {self.noise_dbfs}"
            )

    @property
    def erl_db(self) -> float:
        return -self.gain_db

    def mix_frame(self, frame: bytes, playout: TwilioPlayout, frame_end: int) -> LineFrame:
        """``frame`` (the caller's mu-law, ending at sample ``frame_end``) as the line sends
        it, with the echo and the noise on it, and its parts."""
        n = len(frame)
        start = frame_end - n
        source, echo = self.echo(playout, start, n)
        noise = self.noise(start, n)
        if not echo.any() and not noise.any():
            return LineFrame.plain(frame)
        near = np.frombuffer(ulaw_decode(frame), dtype="<i2").astype(np.float64)
        mixed = np.clip(np.round(near + echo + noise), -32768, 32767)
        return LineFrame(ulaw_encode(mixed.astype("<i2").tobytes()), near, echo, noise, source)

    def echo(self, playout: TwilioPlayout, start: int, n: int) -> tuple[Pcm, Pcm]:
        """(what played ``delay_s`` before samples ``[start, start + n)``, its echo there)."""
        exact = self.delay_s * SAMPLE_RATE
        whole = math.floor(exact + 1e-6)
        taps, lead = path_taps(round(exact - whole, 4), self.band_limit)
        history = taps.size - 1  # the filters' memory comes from the timeline: no state
        played = playout.played_audio(start - whole + lead - history, n + history)
        if played.count(ULAW_SILENCE) == len(played):
            zeros = np.zeros(n)
            return zeros, zeros
        heard = np.frombuffer(ulaw_decode(played), dtype="<i2").astype(np.float64)
        x = heard
        if self.clip_dbfs is not None:
            peak = dbfs(self.clip_dbfs)
            x = np.clip(x, -peak, peak)
        if taps.size > 1:
            x = np.convolve(x, taps, mode="valid")
        source = heard[history - lead : history - lead + n]
        return source, x * 10 ** (self.gain_db / 20)

    def noise(self, start: int, n: int) -> Pcm:
        """Line noise for samples ``[start, start + n)``: the same for the same seed and start."""
        noise: Pcm = np.zeros(n)
        if self.noise_dbfs is not None:
            rng = np.random.default_rng([self.seed, max(0, start)])
            noise = rng.normal(0.0, dbfs(self.noise_dbfs), n)
        if self.background is not None:
            noise = noise + self.background.part(start, n)
        return noise


@dataclass(frozen=True, slots=True)
class LineSpan:
    """Samples ``[start, start + sent.size)`` of a ``LineRecord`` (zeros where none were sent)."""

    start: int
    sent: Pcm
    near: Pcm
    speech: npt.NDArray[np.bool_]
    """Per sample: the caller's microphone carried their scripted speech there."""
    echo: Pcm
    noise: Pcm
    source: Pcm


class LineRecord:
    """What the caller's line sent, frame by frame on the call's sample clock, with its parts.
    Written by the caller's pump (the call's event loop), read by a stand-in STT (a server
    thread): a lock keeps the frame list whole."""

    PARTS = ("sent", "near", "echo", "noise", "source")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._starts: list[int] = []
        self._frames: list[tuple[LineFrame, Pcm, bool]] = []

    def add(self, start: int, frame: LineFrame, speech: bool) -> None:
        """Frame ``frame`` went out from sample ``start``; ``speech``: the caller's own."""
        sent = np.frombuffer(ulaw_decode(frame.ulaw), dtype="<i2").astype(np.float64)
        with self._lock:
            if self._starts and start < self._starts[-1]:
                raise ValueError(f"frame at sample {start} is older than the last one recorded")
            self._starts.append(start)
            self._frames.append((frame, sent, speech))

    @property
    def end(self) -> int:
        """Sample after the last one recorded (0 before any)."""
        with self._lock:
            if not self._starts:
                return 0
            return self._starts[-1] + self._frames[-1][1].size

    def span(self, lo: int, hi: int) -> LineSpan:
        n = max(0, hi - lo)
        parts = {name: np.zeros(n) for name in self.PARTS}
        speech = np.zeros(n, dtype=bool)
        with self._lock:
            first = max(0, bisect.bisect_right(self._starts, lo) - 1)
            frames = list(zip(self._starts[first:], self._frames[first:], strict=True))
        for start, (frame, sent, said) in frames:
            if start >= hi:
                break
            a, b = max(lo, start), min(hi, start + sent.size)
            if a >= b:
                continue
            values = (sent, frame.near, frame.echo, frame.noise, frame.source)
            for name, value in zip(self.PARTS, values, strict=True):
                parts[name][a - lo : b - lo] = value[a - start : b - start]
            speech[a - lo : b - lo] = said
        return LineSpan(lo, speech=speech, **parts)


def level_dbfs(x: Pcm) -> float:
    """RMS level of ``x`` in dBFS (-120 for silence)."""
    if x.size == 0:
        return -120.0
    ms = float(np.mean(x * x))
    return 10 * math.log10(ms / _FULL_SCALE**2) if ms > 0 else -120.0
