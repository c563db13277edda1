"""Silero windows of many calls judged in one run of the model, on the event loop.

One run of the shared model costs ~55 us for a single 32 ms window but ~11 us a window for
16 of them (a run's fixed cost dominates a model this small), and a process carrying many
calls has many detectors awake at once. So each window waits briefly for others: a batch
goes as soon as it holds a window from every detector heard from lately (so one call alone
never waits) or after ``max_wait_s``.

A batch runs right there, on the loop (a 64-window batch blocks it ~2 ms). It ran in a thread
of its own once, so that the loop could serve calls meanwhile; but every frame of speech then
waited for a hop to that thread and a wake-up back, and on a loaded core (the thread and the
loop on the same one, as with a worker per core) those hops made each call's frames late:
at 50 calls on one core the callers were heard 48-116 ms late p95 with the thread and 13-17
inline, at 100 calls 434-3063 against 190-209 (``bench/capacity.py``, ``behind``).
"""

from __future__ import annotations

import asyncio
import time
import weakref
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from ivr.audio.silero_net import Floats


class BatchModel(Protocol):
    """What a batch runs: ``ivr.audio.vad.SileroModel``."""

    def predict_batch(self, audio: Floats, states: Floats) -> tuple[Floats, Floats]:
        """(B, n) windows and (2, B, 128) states -> (B, 1) probabilities, next states."""
        ...


RECENT_S = 0.045
"""A detector that sent a window this recently is expected to send the next (one per 32 ms)."""


@dataclass(slots=True)
class _Window:
    audio: Floats  # (1, context + window)
    state: Floats  # (2, 1, 128)
    result: asyncio.Future[tuple[float, Floats]]


class SileroBatcher:
    """Batches one event loop's Silero windows (see the module docstring); ``predict`` is
    the only entry point. Made by ``SileroModel.batcher()``, one per loop."""

    def __init__(
        self,
        model: BatchModel,
        loop: asyncio.AbstractEventLoop,
        *,
        max_wait_s: float = 0.006,
        max_batch: int = 64,
    ) -> None:
        self._model = model
        # Its loop, known up front: asking asyncio for it costs a getpid() syscall on 3.11.
        self._loop = loop
        self._max_wait = max_wait_s
        self._max_batch = max_batch
        self._pending: list[_Window] = []
        # detector id -> when it last sent a window; oldest first
        self._recent: dict[int, float] = {}
        self._timer: asyncio.TimerHandle | None = None
        self._due = False  # the wait ran out, or a whole batch is pending: send now
        self.runs = 0
        self.windows = 0

    async def predict(self, detector: object, audio: Floats, state: Floats) -> tuple[float, Floats]:
        """Speech probability of ``audio`` (a window with its context, shape (1, n); not
        touched again by the caller) and the detector's next recurrent state."""
        loop = self._loop
        now = time.monotonic()
        window = _Window(audio, state, loop.create_future())
        self._pending.append(window)
        if len(self._pending) >= self._heard_from(id(detector), now):
            self._due = True
            self._send()
        elif self._timer is None:
            self._timer = loop.call_later(self._max_wait, self._wait_over)
        return await window.result

    def _heard_from(self, detector: int, now: float) -> int:
        """Note that ``detector`` sends a window now; how many windows a batch waits for: one
        from each detector heard from lately."""
        recent = self._recent  # oldest first: a detector moves to the end when it sends
        recent.pop(detector, None)
        recent[detector] = now
        quiet = []  # the ones that went quiet: all at the front (each is forgotten once)
        for key, sent in recent.items():
            if now - sent <= RECENT_S:
                break
            quiet.append(key)
        for key in quiet:
            del recent[key]
        return min(self._max_batch, len(recent))

    def _wait_over(self) -> None:
        self._timer = None
        self._due = True
        self._send()

    def _send(self) -> None:
        while self._due:
            batch = [w for w in self._pending[: self._max_batch] if not w.result.cancelled()]
            del self._pending[: self._max_batch]
            if self._timer is not None and not self._pending:
                self._timer.cancel()
                self._timer = None
            # Left over past a whole batch: those go next, at once.
            self._due = bool(self._pending) and (
                len(self._pending) >= self._max_batch or self._timer is None
            )
            if batch:
                self._run(batch)

    def _run(self, batch: list[_Window]) -> None:
        self.runs += 1
        self.windows += len(batch)
        try:
            probs, states = self._model.predict_batch(
                np.concatenate([w.audio for w in batch]),
                np.concatenate([w.state for w in batch], axis=1),
            )
        except Exception as exc:  # each window's detector decides what a failure means
            for window in batch:
                if not window.result.done():
                    window.result.set_exception(exc)
            return
        for i, window in enumerate(batch):
            window.result.set_result((float(probs[i, 0]), states[:, i : i + 1, :]))


def batcher_for(model: BatchModel, loop: asyncio.AbstractEventLoop) -> SileroBatcher:
    """``model``'s batcher on ``loop`` (futures belong to one loop; tests run many)."""
    batchers = _BATCHERS.setdefault(loop, {})
    batcher = batchers.get(id(model))
    if batcher is None:
        batcher = batchers[id(model)] = SileroBatcher(model, loop)
    return batcher


_BATCHERS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[int, SileroBatcher]] = (
    weakref.WeakKeyDictionary()
)
