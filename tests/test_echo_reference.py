"""FarEndReference, the bot's audio on the playout clock, against a plain model of it: every
window it returns is what played there (silence where nothing did, or what a clear cut)."""

from __future__ import annotations

import random

import numpy as np
import pytest

from ivr.audio.codec import pcm16_to_ulaw, ulaw_to_pcm16
from ivr.audio.far_end import RATE, FarEndReference


class PlainReference:
    """Every sample by its index in a dict: slow, obviously right."""

    def __init__(self, history_s: float) -> None:
        self.size = round(history_s * RATE)
        self.samples: dict[int, float] = {}
        self.end = 0
        self.kept = 0

    def played(self, at: int, values: np.ndarray) -> None:
        if at - self.end > self.size:
            self.kept = at
        for k in [k for k in self.samples if k >= at]:
            del self.samples[k]
        self.samples.update((at + j, float(v)) for j, v in enumerate(values))
        self.end = at + len(values)
        self.kept = max(self.kept, self.end - self.size)

    def cut(self, at: int) -> None:
        for k in [k for k in self.samples if k >= at]:
            del self.samples[k]
        self.end = max(self.kept, min(self.end, at))

    def window(self, lo: int, hi: int) -> np.ndarray:
        return np.array(
            [self.samples.get(k, 0.0) if self.kept <= k < self.end else 0.0 for k in range(lo, hi)]
        )


@pytest.mark.parametrize("seed", range(40))
def test_every_window_is_what_played_there(seed: int) -> None:
    rng = random.Random(seed)
    history_s = rng.choice([0.05, 0.5, 2.5])
    ref, plain = FarEndReference(history_s=history_s), PlainReference(history_s)
    t0 = 100.0 + rng.random()
    for step in range(rng.randint(1, 25)):
        if plain.end and rng.random() < 0.15:
            at = rng.randint(max(0, plain.end - 2000), plain.end + 200)
            ref.cut(t0 + at / RATE)
            plain.cut(at)
            continue
        gap = rng.choice([0, 0, 0, rng.randint(1, 50), rng.randint(100, 30000)])
        n = rng.choice([160, 320, 800, 1600, 30000])
        level = 3000 if rng.random() < 0.7 else 5
        pcm = np.random.default_rng(seed * 100 + step).normal(0, level, n)
        ulaw = pcm16_to_ulaw(pcm.clip(-32768, 32767).astype("<i2").tobytes())
        at = plain.end + gap
        ref.played(t0 + at / RATE, ulaw)
        plain.played(at, np.frombuffer(ulaw_to_pcm16(ulaw), dtype="<i2"))
        for _ in range(4):
            lo = rng.randint(max(0, plain.end - plain.size - 500), plain.end + 100)
            hi = lo + rng.randint(0, 3000)
            got = ref.samples(t0 + lo / RATE, t0 + hi / RATE)
            np.testing.assert_array_equal(got, plain.window(lo, hi))
            loud = np.abs(plain.window(lo, hi)) > 1000
            if loud.sum() > 200:  # a 20 ms frame of it is loud: it could echo
                assert ref.audible(t0 + lo / RATE, t0 + hi / RATE)
            if not np.any(plain.window(lo, hi)):
                assert not ref.audible(t0 + lo / RATE, t0 + hi / RATE)
