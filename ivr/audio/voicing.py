"""Does a sound have a voice in it? Periodicity (a pitch) is what a VAD's "speech" from a cough,
a door or line static lacks: those are broadband bursts with no fundamental, while every
vowel, "mm" and "uh" is voiced. Cheap enough to run on each candidate barge-in.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

RATE = 8000
WINDOW = 320  # 40 ms: two periods of an 80 Hz voice
HOP = 160
MIN_LAG, MAX_LAG = 20, 120  # pitch 400 Hz .. 67 Hz
VOICED_CORRELATION = 0.6
MIN_LEVEL_DB = -50.0


def voiced_frames(pcm: npt.NDArray[np.float64]) -> int:
    """How many 40 ms windows (20 ms apart) of ``pcm`` (8 kHz, int16 scale) are periodic: a
    normalised autocorrelation above ``VOICED_CORRELATION`` at a pitch lag of 2.5-15 ms."""
    if pcm.size < WINDOW:
        return 0
    starts = np.arange(0, pcm.size - WINDOW + 1, HOP)
    x = pcm[starts[:, None] + np.arange(WINDOW)]  # one window per row
    x = x - x.mean(axis=1, keepdims=True)
    energy = np.einsum("ij,ij->i", x, x)
    x = x[energy >= WINDOW * (32768 * 10 ** (MIN_LEVEL_DB / 20)) ** 2]
    if x.shape[0] == 0:
        return 0
    spectrum = np.fft.rfft(x, 2 * WINDOW, axis=1)
    ac = np.fft.irfft(spectrum * np.conj(spectrum), axis=1)[:, MIN_LAG : MAX_LAG + 1]
    # Energy of the overlapping parts, so long lags are not penalised for being short.
    csum = np.cumsum(x * x, axis=1)
    lags = np.arange(MIN_LAG, MAX_LAG + 1)
    head = csum[:, WINDOW - 1 - lags]  # x[0 : W-k]
    tail = csum[:, -1:] - csum[:, lags - 1]  # x[k : W]
    r = ac / np.sqrt(np.maximum(head * tail, 1e-9))
    return int(np.count_nonzero(r.max(axis=1) >= VOICED_CORRELATION))
