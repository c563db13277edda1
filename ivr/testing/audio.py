"""Audio helpers for the local stand-ins of remote services (a fake STT deciding what it
heard) in tests and benchmarks."""

from __future__ import annotations

import numpy as np

from ivr.audio.wav import wav_to_pcm16


def voiced_seconds(wav: bytes, threshold_db: float = -40.0) -> float:
    """Seconds of a WAV (as an STT request carries it) louder than ``threshold_db`` in 20 ms
    frames: how much the caller said, whatever silence surrounds it."""
    audio = wav_to_pcm16(wav)
    x = np.frombuffer(audio.pcm16, dtype="<i2").astype(np.float64)
    frame = audio.sample_rate // 50
    rms = np.sqrt((x[: len(x) // frame * frame].reshape(-1, frame) ** 2).mean(axis=1))
    return float((rms > 32768 * 10 ** (threshold_db / 20)).sum()) / 50
