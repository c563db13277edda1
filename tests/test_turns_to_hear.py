"""``TurnsToHear``: the ended turns of a call waiting for their words (both hearings use it)."""

from __future__ import annotations

import asyncio

import pytest

from ivr.call.heard import Heard, TurnsToHear
from ivr.call.inputs import NotUnderstood
from ivr.callio.io import Utterance
from ivr.obs import metrics


def dropped_so_far() -> float:
    return metrics.INBOUND_DROPPED._value.get()


def test_a_turn_past_the_bound_pushes_out_the_oldest_waiting_and_is_counted() -> None:
    turns: TurnsToHear[str] = TurnsToHear(size=2)
    before = dropped_so_far()
    assert turns.put("first") is None
    assert turns.put("second") is None
    assert turns.put("third") == "first"
    assert dropped_so_far() == before + 1
    assert turns.pending()


async def test_turns_are_heard_in_order_and_done_runs_even_when_a_transcription_fails() -> None:
    turns: TurnsToHear[str] = TurnsToHear(size=4)
    delivered: list[Heard] = []
    done: list[str] = []
    transcribing = asyncio.Event()
    go_on = asyncio.Event()

    async def transcribe(turn: str) -> Heard:
        transcribing.set()
        await go_on.wait()
        if turn == "broken":
            raise RuntimeError("the provider answered garbage")
        return Utterance(text=turn.upper())

    async def deliver(heard: Heard) -> None:
        delivered.append(heard)

    turns.put("hello")
    turns.put("there")
    server = asyncio.create_task(turns.serve(transcribe, deliver, done.append))
    await transcribing.wait()
    assert turns.pending()  # one taken and being transcribed, one waiting
    go_on.set()
    while len(delivered) < 2:  # noqa: ASYNC110 - the worker owns no event to wait on
        await asyncio.sleep(0)
    assert [h.text for h in delivered if isinstance(h, Utterance)] == ["HELLO", "THERE"]
    assert done == ["hello", "there"]
    assert not turns.pending()

    turns.put("broken")
    with pytest.raises(RuntimeError, match="garbage"):
        await server  # a transcription that raises is the owner's to handle (the call's task group)
    assert done == ["hello", "there", "broken"]
    assert not turns.pending()
    assert not any(isinstance(h, NotUnderstood) for h in delivered)
