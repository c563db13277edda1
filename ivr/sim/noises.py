"""Non-speech sounds a caller's line carries over the bot: coughs, a door, bursts of static.

Synthetic and seeded, so a benchmark can draw as many different ones as it needs and a test
gets the same one every run. All return 8 kHz PCM16 (little-endian, mono) with a little
silence on either side; put them through the phone channel with ``ivr.sim.script``.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
import numpy.typing as npt

RATE = 8000
NoiseKind = Literal["cough", "door", "static"]
NOISE_KINDS: tuple[NoiseKind, ...] = ("cough", "door", "static")

_Array = npt.NDArray[np.float64]


def noise_burst(kind: NoiseKind, seed: int = 0) -> bytes:
    """One sound of ``kind``: a cough (one or two broadband bursts, 150-350 ms each), a door
    slamming (a click and a low, decaying thud, ~250 ms) or line static (~0.3-0.7 s of
    crackle)."""
    rng = np.random.default_rng(seed)
    if kind == "cough":
        x = _cough(rng)
    elif kind == "door":
        x = _door(rng)
    elif kind == "static":
        x = _static(rng)
    else:
        raise ValueError(f"unknown noise kind {kind!r}; expected one of {NOISE_KINDS}")
    pad = np.zeros(RATE // 20)
    return _pcm16(np.concatenate([pad, x, pad]))


def _band(x: _Array, lo: float, hi: float) -> _Array:
    spectrum = np.fft.rfft(x)
    f = np.fft.rfftfreq(x.size, 1 / RATE)
    spectrum[(f < lo) | (f > hi)] = 0
    return np.fft.irfft(spectrum, x.size)


def _at_level(x: _Array, dbfs: float) -> _Array:
    rms = float(np.sqrt(np.mean(x**2))) or 1.0
    return x * (32768 * 10 ** (dbfs / 20) / rms)


def _cough(rng: np.random.Generator) -> _Array:
    parts: list[_Array] = []
    for _ in range(int(rng.integers(1, 3))):
        n = int(RATE * rng.uniform(0.15, 0.35))
        t = np.arange(n) / RATE
        # Explosive onset, then a noisy decay: broadband, no pitch.
        env = (1 - np.exp(-t / 0.008)) * np.exp(-t / rng.uniform(0.05, 0.12))
        burst = _band(rng.standard_normal(n), 200, 3400) * env
        parts += [_at_level(burst, rng.uniform(-22, -14)), np.zeros(int(RATE * 0.08))]
    return np.concatenate(parts)


def _door(rng: np.random.Generator) -> _Array:
    n = int(RATE * rng.uniform(0.2, 0.3))
    t = np.arange(n) / RATE
    click = rng.standard_normal(n) * np.exp(-t / 0.004)
    thud = sum(
        np.sin(2 * np.pi * rng.uniform(60, 180) * t + rng.uniform(0, np.pi)) for _ in range(3)
    ) * np.exp(-t / rng.uniform(0.04, 0.08))
    return _at_level(click + 0.5 * thud, rng.uniform(-18, -10))


def _static(rng: np.random.Generator) -> _Array:
    n = int(RATE * rng.uniform(0.3, 0.7))
    crackle = rng.standard_normal(n) * (rng.random(n) < 0.3)  # sparse impulses
    hiss = rng.standard_normal(n) * 0.3
    env = np.minimum(1.0, np.arange(n) / (0.01 * RATE))
    return _at_level((crackle + hiss) * env, rng.uniform(-30, -22))


def _pcm16(x: _Array) -> bytes:
    return bytes(np.clip(np.rint(x), -32768, 32767).astype("<i2").tobytes())
