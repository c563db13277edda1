"""Loudness of PCM16 audio in dBFS: plain RMS, and the level of the speech in it."""

from __future__ import annotations

import math

import numpy as np
import numpy.typing as npt

FULL_SCALE_POWER = 32768.0 * 32768.0
FRAME = 160  # 20 ms at 8 kHz
ACTIVE_RANGE_DB = 20.0
"""Frames this far below the loudest still count as the speech (not the pauses in it)."""


def level_db(pcm: npt.NDArray[np.float64]) -> float:
    """RMS level of ``pcm`` (int16 scale) in dBFS; -120 for digital silence."""
    if pcm.size == 0:
        return -120.0
    ms = float(np.mean(pcm * pcm))
    return 10 * math.log10(ms / FULL_SCALE_POWER) if ms > 0 else -120.0


def active_level_db(pcm: npt.NDArray[np.float64]) -> float:
    """The level of the speech in ``pcm`` (int16 scale, 8 kHz): the RMS of its 20 ms frames
    within ``ACTIVE_RANGE_DB`` of the loudest, so pauses and silence around it do not pull it
    down (a rough ITU-T P.56 active speech level). -120 for digital silence."""
    frames = pcm[: pcm.size - pcm.size % FRAME].reshape(-1, FRAME)
    if frames.size == 0:
        return level_db(pcm)
    power = np.mean(frames * frames, axis=1)
    loudest = float(np.max(power))
    if loudest <= 0:
        return -120.0
    active = power[power >= loudest * 10 ** (-ACTIVE_RANGE_DB / 10)]
    return 10 * math.log10(float(np.mean(active)) / FULL_SCALE_POWER)
