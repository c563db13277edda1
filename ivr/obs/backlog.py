"""Inbound backlog: how late this process takes up its callers' audio.

Twilio stamps every media frame; a call's frames reach the gateway with the line's own delay
(the least seen on that call) plus whatever the process adds by falling behind. A process that
carries more calls than its CPU can listen to takes every frame up later and later, and each
turn ends that much later for the caller, while its event loop may lag only tens of ms (at 100
talking calls on one slow core: 4.4 s behind at 43 ms lag; bench/capacity.py). Each call's
``Hearing`` records a sample twice a second (``ivr_inbound_backlog_seconds``); ``behind`` is
the median of the last ``window`` seconds over every call, so one call whose line delivers late
moves it little and a process behind on all of them moves it at once.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from ivr.obs import metrics
from ivr.obs.recent import RecentMedian

DEFAULT_WINDOW = 2.0


class InboundBacklog:
    """The process's record of its calls' backlog samples (one event loop: no locking)."""

    def __init__(
        self, *, window: float = DEFAULT_WINDOW, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if window <= 0:
            raise ValueError(f"inbound backlog: window must be > 0, got {window}")
        self._clock = clock
        self._recent = RecentMedian(window)  # seconds behind, every call's samples

    def record(self, seconds: float) -> None:
        metrics.INBOUND_BACKLOG.observe(seconds)
        self._recent.add(self._clock(), seconds)

    @property
    def behind(self) -> float:
        """Median seconds behind over the window (0 with no call sampled in it)."""
        return self._recent.median(self._clock())
