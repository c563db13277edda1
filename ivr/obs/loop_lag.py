"""Event-loop lag: how late a task that sleeps ``interval`` wakes up.

Every call of this process shares one event loop. When it is saturated (too many calls, or
something blocking it) every timer fires late: the paced audio sender, the endpointer, the
provider streams. The oversleep of a task sleeping 100 ms at a time measures that directly, and
is exported as ``ivr_event_loop_lag_seconds``. The instance counts as *overloaded* while the
median lag of the last ``window`` seconds is above ``threshold``: one long garbage-collection
pause does not flip it, a loop that is late on most wake-ups does.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from ivr.obs import metrics
from ivr.obs.recent import RecentMedian

DEFAULT_INTERVAL = 0.1
DEFAULT_WINDOW = 2.0


class LoopLagMonitor:
    """Run ``run()`` as a task on the loop to watch; read ``overloaded`` from anywhere in it."""

    def __init__(
        self,
        threshold: float,
        *,
        interval: float = DEFAULT_INTERVAL,
        window: float = DEFAULT_WINDOW,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``threshold`` in seconds; 0 means never overloaded (lag is still measured)."""
        if interval <= 0 or window < interval:
            raise ValueError(f"loop lag: need 0 < interval <= window, got {interval}, {window}")
        self.threshold = threshold
        self.interval = interval
        self.window = window
        self._clock = clock
        # Lags by when the monitor woke; after a long block the newest is all there is.
        self._recent = RecentMedian(window, keep_newest=True)
        self._epoch = 0  # bumped by restart(): a sample begun before it is dropped

    async def run(self) -> None:
        """Measure until cancelled."""
        while True:
            before, epoch = self._clock(), self._epoch
            await asyncio.sleep(self.interval)
            now = self._clock()
            if epoch == self._epoch:
                self.record(now, max(0.0, now - before - self.interval))

    def restart(self) -> None:
        """Forget what was measured so far, the sample under way included: startup blocks the
        loop on purpose (flows, prompts, a heap collection) and is not load to shed."""
        self._recent.clear()
        self._epoch += 1

    def record(self, now: float, lag: float) -> None:
        metrics.LOOP_LAG.observe(lag)
        self._recent.add(now, lag)

    @property
    def lag(self) -> float:
        """Median lag over the window, seconds (0 before the first sample)."""
        return self._recent.median(self._clock())

    @property
    def overloaded(self) -> bool:
        return self.threshold > 0 and self.lag > self.threshold
