"""Is the caller's sound their own, or the bot's voice coming back down the line?

A speakerphone or a 2-wire hybrid feeds what the caller hears back into what they send,
typically 10-30 dB down and 50-300 ms late. A VAD calls that echo speech, so without a check
the bot interrupts itself. The check here correlates the caller's last ~200 ms with what the
bot played over the preceding ``max_delay`` seconds (the ``FarEndReference`` the player fills
as it sends): echo is a delayed, scaled copy of that audio, so the normalised correlation peaks
near 1; the caller's own speech does not correlate with the bot's at all. With both at once
(double talk) the peak is ``1 / sqrt(1 + near/echo energy)``: 0.3 when the caller is 10 dB
above their echo, so a threshold of 0.5 keeps anyone louder than ~2 dB over the echo.

Levels (per 20 ms frame) are kept too: ``audible`` says whether any bot audio played within
the echo window, the only time the check is needed.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from ivr.audio.codec import ulaw_to_pcm16

RATE = 8000
FRAME = 160  # samples per 20 ms
SILENT_DB = -55.0
"""A far-end frame below this (dBFS) carries nothing that could echo audibly."""
_SILENT_POWER = (32768.0 * 10 ** (SILENT_DB / 20)) ** 2


def level_db(pcm: npt.NDArray[np.float64]) -> float:
    """RMS level of ``pcm`` (int16 scale) in dBFS; -120 for digital silence."""
    if pcm.size == 0:
        return -120.0
    ms = float(np.mean(pcm * pcm))
    return 10 * math.log10(ms / (32768.0 * 32768.0)) if ms > 0 else -120.0


@dataclass(slots=True)
class _Played:
    """One piece of bot audio as sent, decoded only if an echo check looks at it."""

    at: int
    """Sample index it starts playing at."""
    ulaw: bytes
    _pcm: npt.NDArray[np.float64] | None = None
    _frame_power: npt.NDArray[np.float64] | None = None

    @property
    def end(self) -> int:
        return self.at + len(self.ulaw)

    def pcm(self) -> npt.NDArray[np.float64]:
        if self._pcm is None:
            self._pcm = np.frombuffer(ulaw_to_pcm16(self.ulaw), dtype="<i2").astype(np.float64)
        return self._pcm

    def loud_between(self, a: int, b: int) -> bool:
        """Some 20 ms frame of it that overlaps [a, b) is above ``SILENT_DB``."""
        if self._frame_power is None:
            x = self.pcm()
            whole = x[: x.size - x.size % FRAME].reshape(-1, FRAME)
            tail = x[whole.size :]
            powers = [np.mean(whole * whole, axis=1)] if whole.size else []
            if tail.size:
                powers.append(np.array([np.mean(tail * tail)]))
            self._frame_power = np.concatenate(powers) if powers else np.zeros(0)
        first = max(0, (a - self.at) // FRAME)
        last = min(self._frame_power.size, (b - self.at + FRAME - 1) // FRAME)
        return bool(np.any(self._frame_power[first:last] > _SILENT_POWER))

    def truncate(self, end: int) -> None:
        self.ulaw = self.ulaw[: max(0, end - self.at)]
        self._pcm = self._frame_power = None


class FarEndReference:
    """What the caller has been hearing: the bot's audio on our playout clock (seconds), the
    last ``history_s`` of it (silence where nothing played).

    Filled as audio is sent (every ~100 ms per call while the bot talks), read only when caller
    sound over the bot needs an echo check: audio is kept as sent and decoded when read.
    """

    def __init__(self, history_s: float = 2.5) -> None:
        self._size = round(history_s * RATE)
        self._origin: float | None = None
        """Playout time of sample index 0."""
        self._pieces: deque[_Played] = deque()
        self._kept_from = 0
        """Oldest sample index kept: ``history_s`` before the newest audio played."""

    @property
    def _end(self) -> int:
        return self._pieces[-1].end if self._pieces else 0

    def _index(self, t: float) -> int:
        assert self._origin is not None
        return round((t - self._origin) * RATE)

    def played(self, start: float, ulaw: bytes) -> None:
        """``ulaw`` starts playing at ``start`` (after what was queued before it)."""
        if self._origin is None:
            self._origin = start
        at = self._index(start)
        self._forget_from(at)  # at < end: clock rounding (a sample of overlap); newer wins
        self._pieces.append(_Played(at, ulaw))
        self._kept_from = max(self._kept_from, self._end - self._size)
        while self._pieces and self._pieces[0].end <= self._kept_from:
            self._pieces.popleft()

    def cut(self, at: float) -> None:
        """A ``clear`` at ``at``: audio scheduled to play after it never did."""
        if self._origin is not None:
            self._forget_from(self._index(at))

    def _forget_from(self, at: int) -> None:
        pieces = self._pieces
        while pieces and pieces[-1].at >= at:
            pieces.pop()
        if pieces and pieces[-1].end > at:
            pieces[-1].truncate(at)

    def _overlapping(self, a: int, b: int) -> list[_Played]:
        """Pieces that overlap [a, b), oldest first (the kept history only)."""
        a = max(a, self._kept_from)
        return [p for p in self._pieces if p.at < b and p.end > a] if a < b else []

    def audible(self, lo: float, hi: float) -> bool:
        """Some bot audio above ``SILENT_DB`` (per 20 ms) played between ``lo`` and ``hi``."""
        if self._origin is None:
            return False
        a, b = self._index(lo), self._index(hi)
        return any(p.loud_between(a, b) for p in self._overlapping(a, b))

    def samples(self, lo: float, hi: float) -> npt.NDArray[np.float64]:
        """The far-end audio that played from ``lo`` to ``hi`` (zeros where nothing did)."""
        n = max(0, round((hi - lo) * RATE))
        out = np.zeros(n)
        if self._origin is None:
            return out
        a = self._index(lo)
        for piece in self._overlapping(a, a + n):
            s0, s1 = max(a, piece.at, self._kept_from), min(a + n, piece.end)
            out[s0 - a : s1 - a] = piece.pcm()[s0 - piece.at : s1 - piece.at]
        return out


@dataclass(frozen=True, slots=True)
class EchoCheck:
    correlation: float
    """Peak normalised cross-correlation with the far end over the delay range (0..1)."""
    delay_s: float
    near_db: float
    far_db: float

    def is_echo(self, threshold: float) -> bool:
        return self.correlation >= threshold


def check_echo(
    near: npt.NDArray[np.float64],
    near_end: float,
    reference: FarEndReference,
    *,
    min_delay: float = 0.0,
    max_delay: float = 0.6,
) -> EchoCheck:
    """Correlate ``near`` (caller audio ending at ``near_end`` on the playout clock) with the
    far end played ``min_delay`` to ``max_delay`` earlier: one FFT over the delay range (the
    whole 0.6 s: ~0.5 ms; +-20 ms around a delay already found: ~0.1 ms)."""
    n = near.size
    lo = near_end - n / RATE - max_delay
    far = reference.samples(lo - 1 / RATE, near_end - min_delay)
    near_db, far_db = level_db(near), level_db(far)
    if n < FRAME or far.size <= n or far_db < SILENT_DB or near_db <= -120.0:
        return EchoCheck(0.0, 0.0, near_db, far_db)
    # Pre-emphasis (first difference) on both: speech is dominated by low frequencies and a
    # voice's pitch, which make two unrelated voices correlate by chance at some delay;
    # whitened, only a real copy lines up (a caller alone: <= 0.25 at the 95th percentile).
    far = np.diff(far)
    x = np.diff(near, prepend=near[0])
    x = x - x.mean()
    size = 1 << (far.size + n).bit_length()
    # corr[k] = sum_i x[i] * far[k + i]: near aligned with the far end starting at sample k.
    corr = np.fft.irfft(np.fft.rfft(far, size) * np.conj(np.fft.rfft(x, size)), size)
    lags = far.size - n + 1
    corr = corr[:lags]
    # Energy of each far-end window of length n, for the normalisation.
    csum = np.concatenate([[0.0], np.cumsum(far * far)])
    window_energy = csum[n : n + lags] - csum[:lags]
    denom = np.sqrt(np.maximum(window_energy, 1e-9) * float(np.dot(x, x)))
    ncc = np.abs(corr) / denom
    # Ignore windows of (near) silence on the far end: their ratio is meaningless.
    ncc[window_energy < n * (32768 * 10 ** ((SILENT_DB - 10) / 20)) ** 2] = 0.0
    k = int(np.argmax(ncc))
    delay = max_delay - k / RATE  # lag 0: the far window that starts max_delay early
    return EchoCheck(float(ncc[k]), delay, near_db, far_db)
