"""Holding a fake server's requests until enough arrive together: concurrency counted at the
server, with no clock in the assertion.

A test that says "twenty turns ending at once reach the provider as twenty requests in flight"
sets ``server.holds["chat"] = Hold(20)``: each request to that endpoint waits until twenty wait
at once, then they all go on (and so does every later one). ``peak`` is the most that ever
waited together. A client that serialises its requests never fills the hold; ``give_up_s``
opens it anyway, so such a test fails on ``peak`` instead of hanging.
"""

from __future__ import annotations

import asyncio
import contextlib


class Hold:
    def __init__(self, until: int, *, give_up_s: float = 30.0) -> None:
        if until < 1:
            raise ValueError(f"Hold(until={until}): needs at least one request")
        self.until = until
        self.give_up_s = give_up_s
        self.waiting = 0
        self.peak = 0
        self.arrived = 0
        self._open: asyncio.Event | None = None  # made on the server's loop, on first use

    @property
    def opened(self) -> bool:
        return self._open is not None and self._open.is_set()

    async def wait(self, stopping: asyncio.Event) -> None:
        """Wait (on the server's loop) until the hold opens, gives up, or the server stops."""
        if self._open is None:
            self._open = asyncio.Event()
        self.arrived += 1
        self.waiting += 1
        self.peak = max(self.peak, self.waiting)
        try:
            if self.waiting >= self.until:
                self._open.set()
            if self._open.is_set():
                return
            waits = [asyncio.ensure_future(e.wait()) for e in (self._open, stopping)]
            try:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self.give_up_s):
                        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for waiter in waits:
                    waiter.cancel()
        finally:
            self.waiting -= 1

    def __repr__(self) -> str:
        return f"Hold(until={self.until}, peak={self.peak}, arrived={self.arrived})"
