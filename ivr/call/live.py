"""The calls whose media streams this process carries right now: what admission counts and
what a drain waits for (or moves elsewhere)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field

from ivr.call.session import CallSession
from ivr.control.connect import CallParams
from ivr.obs.backlog import InboundBacklog


@dataclass(eq=False, slots=True)
class LiveCall:
    """One connected stream."""

    params: CallParams
    stream_sid: str
    session: CallSession
    close_stream: Callable[[], Awaitable[None]]
    """Close our end of the socket (a moved call whose ``stop`` never came)."""
    moving: bool = False
    """A REST redirect to a new stream was sent: the ``stop`` that follows is the move."""
    ended: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def call_sid(self) -> str:
        return self.params.call_sid


class LiveCalls:
    """Registry of this process's live streams (one event loop: no locking needed)."""

    def __init__(self) -> None:
        self._calls: dict[str, LiveCall] = {}
        self._changed = asyncio.Event()
        self._open_sockets = 0
        self.draining_since: float | None = None
        """Monotonic time the drain began; None while taking streams."""
        self.backlog = InboundBacklog()
        """How late the process takes up these calls' audio (admission reads it)."""

    @property
    def draining(self) -> bool:
        return self.draining_since is not None

    def start_draining(self) -> None:
        if self.draining_since is None:
            self.draining_since = time.monotonic()

    def add(self, call: LiveCall) -> None:
        self._calls[call.stream_sid] = call
        self._changed.set()

    def remove(self, call: LiveCall) -> None:
        if self._calls.get(call.stream_sid) is call:
            del self._calls[call.stream_sid]
        call.ended.set()
        self._changed.set()

    @contextlib.contextmanager
    def socket_open(self) -> Iterator[None]:
        """Around a media stream socket's whole life, teardown included: a call leaves the
        registry when its session ends, but its socket closes only after the record is saved,
        and Twilio asks the <Connect action> URL only after that close."""
        self._open_sockets += 1
        try:
            yield
        finally:
            self._open_sockets -= 1
            self._changed.set()

    @property
    def open_sockets(self) -> int:
        return self._open_sockets

    def __len__(self) -> int:
        return len(self._calls)

    def calls(self) -> list[LiveCall]:
        return list(self._calls.values())

    async def changed(self, at_most: float) -> None:
        """Until a call comes or goes, or ``at_most`` seconds."""
        self._changed.clear()
        try:
            async with asyncio.timeout(max(0.0, at_most)):
                await self._changed.wait()
        except TimeoutError:
            pass
