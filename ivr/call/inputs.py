"""What the caller gave the call and the flow has not taken yet: keys, transcripts, hang-up.

Filled by the receive loop (keys, hang-up) and the floor (transcripts that take it), read by
``listen()``. Bounded: when the flow is not listening, the newest input is kept.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from ivr.callio.io import HungUp, Utterance

INPUT_QUEUE_SIZE = 32


@dataclass(frozen=True, slots=True)
class Key:
    digit: str


@dataclass(frozen=True, slots=True)
class NotUnderstood:
    """The caller said something, but speech recognition failed on it."""


Input = Key | Utterance | NotUnderstood | HungUp


class CallerInputs:
    def __init__(self, size: int = INPUT_QUEUE_SIZE) -> None:
        self._queue: asyncio.Queue[Input] = asyncio.Queue(size)

    def put(self, item: Input) -> None:
        if self._queue.full():  # the flow is not listening; keep the newest input
            self._queue.get_nowait()
        self._queue.put_nowait(item)

    def empty(self) -> bool:
        return self._queue.empty()

    def clear(self) -> None:
        while not self._queue.empty():
            self._queue.get_nowait()

    async def next(self, wait: float) -> Input | None:
        """The next queued input, waiting up to ``wait`` s; None only if nothing is queued.

        What is queued already is taken first: an answer that lands in the same loop turn as
        the timeout (or a timeout already past) must never become a no-input.
        """
        if not self._queue.empty():
            return self._queue.get_nowait()
        try:
            # Not wait_for: on Python 3.11 it runs the get in a task of its own, one more hop
            # through a busy loop between the caller's words and the flow, every turn.
            async with asyncio.timeout(max(0.0, wait)):
                return await self._queue.get()
        except TimeoutError:
            return self._queue.get_nowait() if not self._queue.empty() else None
