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
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from ivr.audio.codec import ulaw_to_pcm16

RATE = 8000
FRAME = 160  # samples per 20 ms
SILENT_DB = -55.0
"""A far-end frame below this (dBFS) carries nothing that could echo audibly."""


def level_db(pcm: npt.NDArray[np.float64]) -> float:
    """RMS level of ``pcm`` (int16 scale) in dBFS; -120 for digital silence."""
    if pcm.size == 0:
        return -120.0
    ms = float(np.mean(pcm * pcm))
    return 10 * math.log10(ms / (32768.0 * 32768.0)) if ms > 0 else -120.0


class FarEndReference:
    """What the caller has been hearing: the bot's audio on our playout clock (seconds), as
    one contiguous buffer (silence where nothing played) so a window is a slice."""

    def __init__(self, history_s: float = 2.5) -> None:
        self._keep = round(history_s * RATE)
        self._buf: npt.NDArray[np.float64] = np.zeros(0)
        self._start = 0.0
        """Playout time of ``_buf[0]``."""

    def played(self, start: float, ulaw: bytes) -> None:
        """``ulaw`` starts playing at ``start`` (after what was queued before it)."""
        pcm = np.frombuffer(ulaw_to_pcm16(ulaw), dtype="<i2").astype(np.float64)
        gap = round((start - self._start) * RATE) - self._buf.size
        if self._buf.size == 0 or gap > self._keep:
            self._buf, self._start = pcm, start
        elif gap >= 0:
            self._buf = np.concatenate([self._buf, np.zeros(gap), pcm])
        else:  # clock rounding: a sample or two of overlap
            self._buf = np.concatenate([self._buf[: self._buf.size + gap], pcm])
        if self._buf.size > self._keep:
            drop = self._buf.size - self._keep
            self._buf = self._buf[drop:]
            self._start += drop / RATE

    def cut(self, at: float) -> None:
        """A ``clear`` at ``at``: audio scheduled to play after it never did."""
        keep = max(0, round((at - self._start) * RATE))
        self._buf = self._buf[:keep]

    def audible(self, lo: float, hi: float) -> bool:
        """Some bot audio above ``SILENT_DB`` (per 20 ms) played between ``lo`` and ``hi``."""
        x = self.samples(lo, hi)
        frames = x[: x.size - x.size % FRAME].reshape(-1, FRAME)
        if frames.size == 0:
            return False
        loudest = float(np.max(np.mean(frames * frames, axis=1)))
        return loudest > (32768.0 * 10 ** (SILENT_DB / 20)) ** 2

    def samples(self, lo: float, hi: float) -> npt.NDArray[np.float64]:
        """The far-end audio that played from ``lo`` to ``hi`` (zeros where nothing did)."""
        n = max(0, round((hi - lo) * RATE))
        out = np.zeros(n)
        a = round((lo - self._start) * RATE)
        s0, s1 = max(0, a), min(self._buf.size, a + n)
        if s0 < s1:
            out[s0 - a : s1 - a] = self._buf[s0:s1]
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
