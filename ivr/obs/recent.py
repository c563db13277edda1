"""The median of the samples of the last few seconds: what the instance's overload signals
(event-loop lag, inbound backlog) are judged on, so one outlier does not flip them."""

from __future__ import annotations

import statistics
from collections import deque


class RecentMedian:
    """Samples taken in the last ``window`` seconds (one event loop: no locking)."""

    def __init__(self, window: float, *, keep_newest: bool = False) -> None:
        """``keep_newest``: the newest sample stands even once it is older than the window
        (after a long block of the loop, it is all there is to know)."""
        self.window = window
        self._keep = 1 if keep_newest else 0
        self._samples: deque[tuple[float, float]] = deque()  # (taken at, value)

    def add(self, now: float, value: float) -> None:
        self._samples.append((now, value))
        self._forget_before(now - self.window)

    def clear(self) -> None:
        self._samples.clear()

    def median(self, now: float) -> float:
        """Of the samples in the window (0 with none)."""
        self._forget_before(now - self.window)
        if not self._samples:
            return 0.0
        return statistics.median(value for _, value in self._samples)

    def _forget_before(self, cutoff: float) -> None:
        while len(self._samples) > self._keep and self._samples[0][0] < cutoff:
            self._samples.popleft()
