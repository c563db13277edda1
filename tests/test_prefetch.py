"""``Prefetch``: a speculative provider stream, drained until adopted, then read by its adopter.

The streams here are async generators standing in for a provider's answer (the seam is an
``AsyncIterator``); what a real provider does with a closed stream is in
``tests/test_speculative_turns.py``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest

from ivr.callio.prefetch import Prefetch
from ivr.errors import ProviderError, ProviderErrorKind


@dataclass
class Answer:
    """A provider answer with ``items`` pieces, always ready: it counts what was pulled."""

    items: int = 1000
    fail_at: int | None = None
    pulled: int = 0
    closed: bool = False

    async def stream(self) -> AsyncIterator[int]:
        try:
            for i in range(self.items):
                await asyncio.sleep(0)  # a read off the socket
                if i == self.fail_at:
                    raise ProviderError("tts", "connection broke", kind=ProviderErrorKind.RESET)
                self.pulled += 1
                yield i
        finally:
            self.closed = True


async def settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0)


async def test_after_adoption_the_answer_is_read_only_as_fast_as_the_adopter_reads() -> None:
    answer = Answer()
    prefetch: Prefetch[int] = Prefetch("tts", answer.stream, spacing=0.1)
    await settle()
    assert answer.pulled == 1  # the first piece at once, the next after the spacing
    replay = prefetch.adopt()
    assert [await anext(replay), await anext(replay), await anext(replay)] == [0, 1, 2]
    await settle()
    # Not drained ahead: a reader that waits gets what came meanwhile in one gulp.
    assert answer.pulled == 3
    await replay.aclose()
    assert answer.closed


async def test_before_adoption_the_answer_is_drained_and_replayed_whole() -> None:
    answer = Answer(items=5)
    prefetch: Prefetch[int] = Prefetch("llm", answer.stream)
    await settle()
    assert answer.pulled == 5 and prefetch.done and answer.closed
    assert [item async for item in prefetch.adopt()] == [0, 1, 2, 3, 4]


async def test_an_adopter_that_stops_before_reading_on_closes_the_answer() -> None:
    answer = Answer()
    prefetch: Prefetch[int] = Prefetch("tts", answer.stream, spacing=0.1)
    await settle()
    replay = prefetch.adopt()
    assert await anext(replay) == 0
    await settle()  # handed over, not read on
    assert prefetch.done and not answer.closed
    await replay.aclose()
    assert answer.closed and answer.pulled == 1


async def test_a_failure_after_handover_reaches_the_adopter_where_it_happened() -> None:
    answer = Answer(items=10, fail_at=3)
    prefetch: Prefetch[int] = Prefetch("tts", answer.stream, spacing=0.1)
    await settle()
    got: list[int] = []
    with pytest.raises(ProviderError, match="connection broke"):
        async for item in prefetch.adopt():
            got.append(item)
    assert got == [0, 1, 2] and answer.closed


async def test_discarded_unadopted_the_answer_is_closed() -> None:
    answer = Answer()
    prefetch: Prefetch[int] = Prefetch("tts", answer.stream, spacing=0.1)
    await settle()
    prefetch.discard()
    await settle()
    assert answer.closed and answer.pulled == 1


async def test_adopted_but_never_read_the_answer_is_closed_by_aclose() -> None:
    answer = Answer()
    prefetch: Prefetch[int] = Prefetch("tts", answer.stream, spacing=0.1)
    await settle()
    replay = prefetch.adopt()  # the turn took it, then ended before reading a piece
    await prefetch.aclose()  # teardown
    assert answer.closed, "left to the garbage collector's finaliser"
    del replay
