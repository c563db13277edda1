"""A provider stream started before anyone asked for it, kept until adopted or thrown away.

Speculative turns start STT, the LLM and TTS of the first sentence while the caller's endpoint
silence still runs. Each such stream is a ``Prefetch``: a task drains the real stream into a
buffer; whoever later asks for the very same request adopts it and reads the buffer, then the
rest as it arrives, as if it had sent the request itself. Throwing it away cancels the task,
which closes the provider's HTTP stream: nothing was played, nothing reaches the history.

Once adopted, the stream is handed over: the task stops at the next item and the adopter reads
the stream itself, at its own pace. A TTS answer read only when its consumer wants more is read
in a few large gulps (``ivr.tts.openai_http``); a task draining it for the adopter read every
40 ms piece as it came, each a wakeup of its own (~110 more a turn, bench/capacity.py).

A prefetch that failed before yielding anything is never adopted: the live request is sent
instead, so a failed speculation is invisible to the caller.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Sequence
from enum import StrEnum
from typing import Generic, TypeVar

import structlog

from ivr.errors import ProviderError, ProviderErrorKind
from ivr.obs import metrics
from ivr.providers.resilience import aclose_stream

log = structlog.get_logger("ivr.call")

T = TypeVar("T")

MAX_BUFFERED = 4096
"""Items held before the producer waits for its adopter (an LLM reply is a few hundred
deltas; TTS of one sentence a few dozen chunks)."""


class PrefetchOutcome(StrEnum):
    USED = "used"
    """Adopted by the live turn: its provider time is saved."""
    WASTED = "wasted"
    """Thrown away (the caller went on talking, or the turn asked for something else)."""
    FAILED = "failed"
    """The provider failed before answering: the live turn sends its own request."""


class Prefetch(Generic[T]):
    """One speculative stream of ``T`` (LLM events, PCM chunks) for one ``stage``."""

    def __init__(
        self,
        stage: str,
        open_stream: Callable[[], AsyncIterator[T]],
        *,
        spacing: float = 0.0,
        join: Callable[[Sequence[T]], Sequence[T]] | None = None,
    ) -> None:
        """``spacing``: until adopted, wait this long between items after the first (a
        speculative sentence's speech is not playing yet: its reads need not be prompt).
        ``join``: makes what arrived before the adopter asked into fewer items (an LLM's
        text deltas into one), each a trip through every layer above the adopter."""
        self.stage = stage
        self._spacing = spacing
        self._join = join
        self._items: list[T] = []
        self._error: BaseException | None = None
        self._done = False
        self._handed: AsyncIterator[T] | None = None
        """The stream, once the task has stopped reading it for the adopter to read on."""
        self._changed = asyncio.Event()
        self._adopted = asyncio.Event()
        self._settled = False
        self._task = asyncio.create_task(self._drain(open_stream), name=f"prefetch-{stage}")

    @property
    def failed_early(self) -> bool:
        """It failed before yielding anything: not worth adopting."""
        return self._done and self._error is not None and not self._items

    @property
    def done(self) -> bool:
        """No more items will arrive here: the stream ended, failed, or went to its adopter."""
        return self._done

    @property
    def adopted(self) -> bool:
        return self._adopted.is_set()

    def items_so_far(self) -> list[T]:
        """What has arrived yet (a snapshot, for peeking at the first sentence)."""
        return list(self._items)

    async def wait_changed(self) -> None:
        """Until another item arrives or the stream ends."""
        if self._done:
            return
        self._changed.clear()
        await self._changed.wait()

    async def _drain(self, open_stream: Callable[[], AsyncIterator[T]]) -> None:
        stream = open_stream()
        try:
            while True:
                if self._adopted.is_set():  # the adopter reads on from here
                    self._handed = stream
                    return
                try:
                    item = await anext(stream)
                except StopAsyncIteration:
                    return
                self._items.append(item)
                self._changed.set()
                if self._adopted.is_set():
                    continue
                if len(self._items) >= MAX_BUFFERED:
                    await self._adopted.wait()
                elif self._spacing:
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(self._spacing):
                            await self._adopted.wait()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # surfaced to the adopter at the same point as live
            self._error = exc
            if isinstance(exc, ProviderError):  # invisible to the caller, not to the SRE
                metrics.count_provider_error(self.stage, exc.provider, exc)
        finally:
            self._done = True
            self._changed.set()
            if self._handed is None:
                await aclose_stream(stream, quiet=True)

    def adopt(self, live: Callable[[], AsyncIterator[T]] | None = None) -> AsyncIterator[T]:
        """The stream, from its first item; only once. Closing the iterator early cancels
        the provider request, as closing a live stream would.

        ``live`` opens the request anew: if the prefetch fails after adoption but before its
        first item (its attempts were still running when the turn ended), the adopter gets
        what a turn without speculation would have got, not the speculation's failure. Not
        after a timeout: the prefetch has already used the wait the caller can afford."""
        if self._adopted.is_set():
            raise RuntimeError("a prefetch is adopted once")
        self._adopted.set()
        self._settle(PrefetchOutcome.USED)
        return self._replay(live)

    async def _replay(self, live: Callable[[], AsyncIterator[T]] | None) -> AsyncIterator[T]:
        sent = 0
        try:
            while True:
                while sent < len(self._items):
                    backlog = self._items[sent:]
                    sent = len(self._items)
                    for item in backlog if self._join is None else self._join(backlog):
                        yield item
                if self._done:
                    break
                self._changed.clear()
                if sent < len(self._items) or self._done:
                    continue
                await self._changed.wait()
            if (stream := self._handed) is not None:
                self._handed = None
                try:
                    async for item in stream:
                        yield item
                finally:
                    await aclose_stream(stream, quiet=True)
                return
            error = self._error
            if error is None:
                return
            if sent or live is None or _timed_out(error):
                raise error
            log.info("prefetch.reopened", stage=self.stage, error=repr(error))
            async for item in live():
                yield item
        finally:
            if not self._done:
                self._task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await self._task
            await self._close_handed()  # handed over, never read on

    def discard(self) -> None:
        """Throw it away: cancel the request if it is still running."""
        if self._adopted.is_set():
            return
        self._settle(PrefetchOutcome.FAILED if self.failed_early else PrefetchOutcome.WASTED)
        self._task.cancel()

    def _settle(self, outcome: PrefetchOutcome) -> None:
        if not self._settled:
            self._settled = True
            metrics.SPECULATION.labels(self.stage, outcome.value).inc()

    async def aclose(self) -> None:
        """Discard and wait for the request to be gone (teardown); a stream handed to an
        adopter that never read on is closed here, not left to the garbage collector."""
        self.discard()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        await self._close_handed()

    async def _close_handed(self) -> None:
        """Close the stream handed over for the adopter, if nobody reads it on."""
        if (stream := self._handed) is not None:
            self._handed = None
            await aclose_stream(stream, quiet=True)


def _timed_out(error: BaseException) -> bool:
    return isinstance(error, ProviderError) and error.kind == ProviderErrorKind.TIMEOUT
