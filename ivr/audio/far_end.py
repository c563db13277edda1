"""What the caller has been hearing: the bot's audio on the playout clock, for the echo check.

The player records every piece of bot audio as it sends it (``played``) and a ``clear`` cuts
what never played (``cut``); the echo check reads windows of it (``samples``) and asks whether
anything loud enough to echo played lately (``audible``).
"""

from __future__ import annotations

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


@dataclass(slots=True)
class _Played:
    """One piece of bot audio as sent, decoded only if an echo check looks at it."""

    at: int
    """Sample index it starts playing at."""
    ulaw: bytes
    end: int
    """Sample index after its last (a field, not worked out: read ~6 times a piece sent)."""
    _pcm: npt.NDArray[np.float64] | None = None
    _frame_power: npt.NDArray[np.float64] | None = None

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
        self.end = self.at + len(self.ulaw)
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

    def _index(self, t: float) -> int:
        assert self._origin is not None
        return round((t - self._origin) * RATE)

    def played(self, start: float, ulaw: bytes) -> None:
        """``ulaw`` starts playing at ``start`` (after what was queued before it)."""
        if self._origin is None:
            self._origin = start
        at = self._index(start)
        pieces = self._pieces
        if pieces and pieces[-1].end > at:
            self._forget_from(at)  # clock rounding (a sample of overlap): the newer wins
        end = at + len(ulaw)
        pieces.append(_Played(at, ulaw, end))
        if end - self._size > self._kept_from:
            self._kept_from = kept = end - self._size
            while pieces and pieces[0].end <= kept:
                pieces.popleft()

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
